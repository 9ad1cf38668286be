import os
import time

import torch
from datasets import load_from_disk
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.rollout import SamplingConfig, generate, generation_mode

A = os.path.expanduser("~/.cache/posttrain-bench/artifacts")
tok = AutoTokenizer.from_pretrained(f"{A}/policy-14m")
m = AutoModelForCausalLM.from_pretrained(f"{A}/policy-14m")
ds = load_from_disk(f"{A}/prompts")["train"]
enc = tok([r["prompt"] for r in ds.select(range(8))], return_tensors="pt", padding=True)
s = SamplingConfig(max_new_tokens=53, temperature=0.9, stop_token_ids=())
g = torch.Generator().manual_seed(0)
with generation_mode(m), torch.no_grad():
    for _ in range(3):
        generate(
            m,
            enc.input_ids,
            enc.attention_mask.bool(),
            s,
            pad_token_id=tok.pad_token_id,
            num_samples=2,
            generator=g,
            return_logprobs=False,
        )
    t = time.perf_counter()
    for _ in range(5):
        generate(
            m,
            enc.input_ids,
            enc.attention_mask.bool(),
            s,
            pad_token_id=tok.pad_token_id,
            num_samples=2,
            generator=g,
            return_logprobs=False,
        )
    print("ms/rollout", (time.perf_counter() - t) / 5 * 1000)
    with torch.profiler.profile() as p:
        for _ in range(3):
            generate(
                m,
                enc.input_ids,
                enc.attention_mask.bool(),
                s,
                pad_token_id=tok.pad_token_id,
                num_samples=2,
                generator=g,
                return_logprobs=False,
            )
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
