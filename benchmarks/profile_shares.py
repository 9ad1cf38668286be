"""Shares of `train()` by phase, from a py-spy profile of an online trainer in raw (collapsed) form.

    py-spy record -r 100 -f raw -o rloo.txt -- python ../shared/bench/run_posttrain.py ../shared/bench run_rloo.py
    python benchmarks/profile_shares.py rloo.txt

Each sample whose stack passes through a posttrain trainer's `train` counts toward the first phase
below whose frame names appear in it (checked in this order), else toward "other".
"""

from __future__ import annotations

import argparse
import collections

PHASES = [
    ("generation", ["generate (posttrain/rollout.py"]),
    ("reference forward", ["reference_logprobs", "reference_logps"]),
    ("reward", ["score_rewards", "RewardSource.per_reward", "RewardSource.__call__"]),
    ("kernel timing (cpu_linear)", ["linear_kernels"]),
    ("optimizer", ["clip_and_step", "step_if_finite"]),
    ("backward", ["backward (torch/_tensor.py"]),
    ("forward with grad", ["PolicyAndValue.forward", "micro_loss", "minibatch_step", "completion_forward"]),
]


def shares(path: str) -> tuple[int, dict[str, float]]:
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if "train (posttrain/trainers/" not in stack:
                continue
            total += int(n)
            phase = next((name for name, keys in PHASES if any(k in stack for k in keys)), "other")
            counts[phase] += int(n)
    return total, {name: 100 * counts[name] / max(total, 1) for name, _ in [*PHASES, ("other", None)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="+", help="py-spy raw profiles (-f raw)")
    args = parser.parse_args()
    for path in args.profiles:
        total, table = shares(path)
        print(f"{path}: {total} samples in train()")
        for name, pct in table.items():
            print(f"  {name:28s} {pct:5.1f}%")


if __name__ == "__main__":
    main()
