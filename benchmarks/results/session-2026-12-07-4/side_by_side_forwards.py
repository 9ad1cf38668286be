"""Online DPO's two no-grad forwards of one step, the reference model's (log-probs of 53 completion positions)
and the reward model's, over 16 rows of 68 tokens: one after the other on all threads against side by side
(`runtime.side_by_side`, half the threads each). Means of 20, three rounds.

    PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/results/session-2026-12-07-4/side_by_side_forwards.py [14m|70m]
"""

import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from posttrain import runtime

size = sys.argv[1] if len(sys.argv) > 1 else "14m"
art = os.path.expanduser("~/.cache/posttrain-bench/artifacts")
ref = AutoModelForCausalLM.from_pretrained(f"{art}/policy-{size}").eval()
reward = AutoModelForSequenceClassification.from_pretrained(f"{art}/reward-{size}", num_labels=1).eval()
ids = torch.randint(10, 1000, (16, 68))
mask = torch.ones_like(ids)


@torch.no_grad()
def reference_forward():
    return ref(input_ids=ids, attention_mask=mask, logits_to_keep=54).logits.sum()


@torch.no_grad()
def reward_forward():
    return reward(input_ids=ids, attention_mask=mask).logits.sum()


def both_in_turn():
    return reference_forward(), reward_forward()


def both_at_once():
    return runtime.side_by_side(reference_forward, reward_forward)


def mean_ms(fn, repeats=20):
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1000


for fn in (both_in_turn, both_at_once):
    mean_ms(fn, 3)
for _ in range(3):
    print(
        f"in turn {mean_ms(both_in_turn):.1f} ms  side by side {mean_ms(both_at_once):.1f} ms  "
        f"reference alone {mean_ms(reference_forward):.1f} ms"
    )
