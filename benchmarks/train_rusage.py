"""What one of ../shared/bench's run_<trainer>.py scripts costs inside trainer.train() on posttrain: wall time,
the median step, and the process's minor page faults and user / system CPU seconds between the start and the
end of train() (getrusage), which separate the allocator's share from the noise of a shared machine.

    export ART=~/.cache/posttrain-bench/artifacts SIZE=14m OMP_NUM_THREADS=2 PYTHONPATH=src
    POSTTRAIN_MALLOC=off python benchmarks/train_rusage.py ../shared/bench run_online_dpo.py
    python benchmarks/train_rusage.py ../shared/bench run_online_dpo.py

Prints one line: train s, first / median step s, page faults, user s, system s.
"""

from __future__ import annotations

import os
import resource
import runpy
import statistics
import sys
import time


def main() -> None:
    bench, script = sys.argv[1], sys.argv[2]
    sys.path[:0] = [os.path.join(bench, "posttrain_shim"), bench]
    import common  # the bench's common.py, importing the shim as trl
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    def timed_train(trainer, name, per_prompt):
        steps = StepTimes()
        trainer.add_callback(steps)
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
        durations = [b - a for a, b in zip([start, *steps.ends], steps.ends)]
        print(
            f"{name} train {wall:.2f} s, first step {durations[0]:.3f} s, median step "
            f"{statistics.median(durations):.3f} s, page faults {after.ru_minflt - before.ru_minflt}, "
            f"user {after.ru_utime - before.ru_utime:.2f} s, system {after.ru_stime - before.ru_stime:.2f} s"
        )

    common.timed_train = timed_train
    runpy.run_path(os.path.join(bench, script), run_name="__main__")


if __name__ == "__main__":
    main()
