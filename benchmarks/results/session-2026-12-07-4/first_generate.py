"""The bench's run_online_dpo.py on posttrain (through the bench's trl stand-in), timing every rollout
(`rollout.generate` as the online trainers call it) and every decode trace made: prints the first rollout,
the sum and median of the others, and each trace's seconds.

    cd /tmp && ART=~/.cache/posttrain-bench/artifacts SIZE=14m OMP_NUM_THREADS=2 PYTHONPATH=<tree>/src \
        python <tree>/benchmarks/results/session-2026-12-07-4/first_generate.py [run_online_dpo.py]
"""

import atexit
import os
import runpy
import sys
import time

from posttrain import decode_trace
from posttrain.trainers import online

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "shared", "bench")
script = sys.argv[1] if len(sys.argv) > 1 else "run_online_dpo.py"
sys.argv = ["run_posttrain.py", BENCH, script]
rollouts: list[float] = []
generate, trace = online.generate, decode_trace._trace


def timed_generate(*args, **kwargs):
    start = time.perf_counter()
    out = generate(*args, **kwargs)
    rollouts.append(time.perf_counter() - start)
    return out


def timed_trace(model, key, args):
    start = time.perf_counter()
    out = trace(model, key, args)
    outcome = "made" if out is not None else "refused"
    print(f"TRACE {type(model).__name__} {outcome} {time.perf_counter() - start:.3f} s")
    return out


def report():
    rest = sorted(rollouts[1:])
    print(
        f"GENERATE n {len(rollouts)} first {rollouts[0] * 1000:.0f} ms, the others {sum(rest) * 1000:.0f} ms "
        f"(median {rest[len(rest) // 2] * 1000:.1f})"
    )


online.generate, decode_trace._trace = timed_generate, timed_trace
atexit.register(report)
runpy.run_path(os.path.join(BENCH, "run_posttrain.py"), run_name="__main__")
