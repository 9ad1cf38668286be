"""torch.profiler's self-time table of three rollouts at Online DPO's shape (the 14m policy, 8 prompts x 2, 53
new tokens), after 3 warm-up rollouts and the mean of 5 timed ones.

    PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/results/session-2026-12-07-3/opprof.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session-2026-12-07-4"))
from ab_rollout import rollout_at_online_dpo_shape  # noqa: E402

timed_rollout = rollout_at_online_dpo_shape("14m")
for _ in range(3):
    timed_rollout()
print("ms/rollout", sum(timed_rollout()[1] for _ in range(5)) / 5)
with torch.profiler.profile() as p:
    for _ in range(3):
        timed_rollout()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
