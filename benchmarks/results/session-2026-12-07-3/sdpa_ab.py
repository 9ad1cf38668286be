import contextlib
import os
import time

import torch
from datasets import load_from_disk
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.rollout import SamplingConfig, generate, generation_mode

A = os.path.expanduser("~/.cache/posttrain-bench/artifacts")
size = os.environ.get("SIZE", "14m")
tok = AutoTokenizer.from_pretrained(f"{A}/policy-{size}")
m = AutoModelForCausalLM.from_pretrained(f"{A}/policy-{size}")
ds = load_from_disk(f"{A}/prompts")["train"]
enc = tok([r["prompt"] for r in ds.select(range(8))], return_tensors="pt", padding=True)
s = SamplingConfig(max_new_tokens=53, temperature=0.9, stop_token_ids=())


def run(ctx):
    g = torch.Generator().manual_seed(0)
    with ctx(), generation_mode(m), torch.no_grad():
        t = time.perf_counter()
        r = generate(
            m,
            enc.input_ids,
            enc.attention_mask.bool(),
            s,
            pad_token_id=tok.pad_token_id,
            num_samples=2,
            generator=g,
            return_logprobs=True,
        )
        return time.perf_counter() - t, r


ctxs = {"default": contextlib.nullcontext, "math": lambda: sdpa_kernel(SDPBackend.MATH)}
for _name, c in ctxs.items():
    run(c)
    run(c)
res = {k: [] for k in ctxs}
for i in range(8):
    for name, c in ctxs.items():
        t, r = run(c)
        res[name].append(t * 1000)
        if i == 0:
            print(name, r.completion_ids[:2, :8].tolist(), float(r.logprobs.sum()))
for k, v in res.items():
    v.sort()
    print(k, [round(x) for x in v], "median", round(v[len(v) // 2]))
