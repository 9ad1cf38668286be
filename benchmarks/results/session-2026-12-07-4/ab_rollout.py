"""One process's rollouts of the bench's policy at Online DPO's shape (8 prompts x 2 samples, 53 new tokens):
the first rollout's wall time (it makes the decode trace) and the median and best of 15 more. Run it alternately
on two source trees (PYTHONPATH=<tree>/src) to compare them.

    PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/results/session-2026-12-07-4/ab_rollout.py [14m|70m]
"""

import os
import sys
import time

import torch
from datasets import load_from_disk
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain import runtime
from posttrain.rollout import SamplingConfig, generate, generation_mode


def rollout_at_online_dpo_shape(size: str = "14m"):
    """A function that runs one rollout of the bench's `size` policy (8 prompts x 2, 53 new tokens, seeded
    once) and returns it with its wall time in ms; with glibc keeping freed memory, as training does."""
    runtime.reuse_freed_memory()
    art = os.path.expanduser("~/.cache/posttrain-bench/artifacts")
    tok = AutoTokenizer.from_pretrained(f"{art}/policy-{size}")
    model = AutoModelForCausalLM.from_pretrained(f"{art}/policy-{size}")
    prompts = load_from_disk(f"{art}/prompts")["train"]
    enc = tok([row["prompt"] for row in prompts.select(range(8))], return_tensors="pt", padding=True)
    sampling = SamplingConfig(max_new_tokens=53, temperature=0.9, stop_token_ids=())
    generator = torch.Generator().manual_seed(0)

    @torch.no_grad()
    def timed_rollout():
        start = time.perf_counter()
        with generation_mode(model):
            rollout = generate(
                model,
                enc.input_ids,
                enc.attention_mask.bool(),
                sampling,
                pad_token_id=tok.pad_token_id,
                num_samples=2,
                generator=generator,
                return_logprobs=False,
            )
        return rollout, (time.perf_counter() - start) * 1000

    return timed_rollout


if __name__ == "__main__":
    timed_rollout = rollout_at_online_dpo_shape(sys.argv[1] if len(sys.argv) > 1 else "14m")
    rollout, first = timed_rollout()
    times = sorted(timed_rollout()[1] for _ in range(15))
    print(
        f"first {first:.1f} ms  median {times[7]:.1f} ms  best {times[0]:.1f} ms  "
        f"tokens0 {rollout.completion_ids[0, :6].tolist()}"
    )
