"""Count the host synchronisations posttrain makes during one of ../shared/bench's run_<trainer>.py
scripts, by source line: every call of Tensor.item / tolist / __bool__ / __int__ / __float__ /
__index__ / cpu / numpy while `trainer.train()` runs (on a GPU each one waits for the queued kernels).

    PYTHONPATH=src ART=~/.cache/posttrain-bench/artifacts EPISODES=64 \\
        python benchmarks/count_syncs.py ../shared/bench run_grpo.py

Runs on the CPU (the calls are the same on any device) through the bench's trl stand-in, as
run_posttrain.py does. A call made outside posttrain's code (transformers' mask creation, say) is
counted at the innermost frame outside torch, marked "other". Prints the total per optimizer step
and the 40 most frequent call sites.
"""

from __future__ import annotations

import collections
import os
import runpy
import sys
import traceback


def main() -> None:
    bench, script = os.path.abspath(sys.argv[1]), sys.argv[2]
    sys.path[:0] = [os.path.join(bench, "posttrain_shim"), bench]
    import common  # the bench's settings, importing the stand-in as trl
    import torch

    counts: collections.Counter = collections.Counter()
    active = False

    def counted(name: str):
        original = getattr(torch.Tensor, name)

        def call(self, *args, **kwargs):
            if active:
                frames = traceback.extract_stack(limit=16)[:-1]
                ours = [f for f in frames if "/posttrain/" in f.filename]
                theirs = [f for f in frames if "/torch/" not in f.filename]
                if ours:
                    frame = ours[-1]
                    site = (frame.filename.split("/posttrain/")[-1], frame.lineno, frame.line)
                elif theirs:
                    frame = theirs[-1]
                    site = ("other: " + frame.filename.split("site-packages/")[-1], frame.lineno, frame.line)
                else:
                    site = ("other", 0, "")
                counts[(name, *site)] += 1
            return original(self, *args, **kwargs)

        setattr(torch.Tensor, name, call)

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"):
        counted(name)

    def timed_train(trainer, name, per_prompt):
        nonlocal active
        active = True
        trainer.train()
        active = False
        steps = max(trainer.state.global_step, 1)
        total = sum(counts.values())
        print(f"{name}: {steps} steps, {total} host-sync calls, {total / steps:.1f} per step")
        for (call, path, line, text), n in counts.most_common(40):
            print(f"{n / steps:8.1f}/step  {call:10s} {path}:{line}  {text}")

    common.timed_train = timed_train
    runpy.run_path(os.path.join(bench, script), run_name="__main__")


if __name__ == "__main__":
    main()
