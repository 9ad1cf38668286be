import os

import torch
from datasets import load_from_disk
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain import runtime
from posttrain.rollout import SamplingConfig, generate, generation_mode

if os.environ.get("REUSE"):
    runtime.reuse_freed_memory()
A = os.path.expanduser("~/.cache/posttrain-bench/artifacts")
tok = AutoTokenizer.from_pretrained(f"{A}/policy-14m")
m = AutoModelForCausalLM.from_pretrained(f"{A}/policy-14m")
ds = load_from_disk(f"{A}/prompts")["train"]
s = SamplingConfig(max_new_tokens=53, temperature=0.9, stop_token_ids=(tok.eos_token_id,))


def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024


g = torch.Generator().manual_seed(0)
out = []
with generation_mode(m), torch.no_grad():
    for i in range(40):
        enc = tok(
            [r["prompt"] for r in ds.select(range(8 * (i % 20), 8 * (i % 20) + 8))], return_tensors="pt", padding=True
        )
        generate(
            m, enc.input_ids, enc.attention_mask.bool(), s, pad_token_id=tok.pad_token_id, num_samples=2, generator=g
        )
        out.append(rss())
print(out)
