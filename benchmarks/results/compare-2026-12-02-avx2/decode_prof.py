"""One 16-row x 53-token rollout of the bench's policy-14m (8 prompts x 2 samples; its completions ran all 53
tokens), as the trainers run it (posttrain's oneDNN layers on; KERN=0: off); median of 10 after 3 warm-ups.
PROF=1 adds a torch.profiler table of one rollout; OPTS='{"cache_implementation": "static"}' passes engine
options to rollout.generate.

    PYTHONPATH=src python benchmarks/results/compare-2026-12-02-avx2/decode_prof.py
"""

import contextlib
import json
import os
import time

import torch
from datasets import load_from_disk
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain import cpu_linear
from posttrain.rollout import SamplingConfig, generate, generation_mode

torch.set_num_threads(2)
OPTS = json.loads(os.environ.get("OPTS", "{}"))
ART = os.path.expanduser("~/.cache/posttrain-bench/artifacts")
tok = AutoTokenizer.from_pretrained(f"{ART}/policy-14m")
model = AutoModelForCausalLM.from_pretrained(f"{ART}/policy-14m")
enc = tok(load_from_disk(f"{ART}/prompts")["train"]["prompt"][:8], return_tensors="pt", padding=True)
cfg = SamplingConfig(max_new_tokens=53, temperature=1.0, stop_token_ids=(tok.eos_token_id,))


def run():
    g = torch.Generator().manual_seed(0)
    with generation_mode(model):
        return generate(
            model, enc.input_ids, enc.attention_mask, cfg, pad_token_id=tok.pad_token_id, num_samples=2, generator=g,
            **OPTS,
        )  # fmt: skip


kernels = cpu_linear.linear_kernels([model]) if os.environ.get("KERN", "1") == "1" else contextlib.nullcontext([])
with kernels as switched:
    print("layers on oneDNN:", len(switched))
    for _ in range(3):
        run()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        rollout = run()
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"rollout ms median {1000 * times[5]:.1f} min {1000 * times[0]:.1f}")
    print("lengths", rollout.completion_lengths.tolist())
    if os.environ.get("PROF"):
        from torch.profiler import profile

        with profile() as prof:
            run()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
