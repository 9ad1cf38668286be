"""Run one of ../shared/bench's run_<trainer>.py scripts on one GPU, on TRL or (unchanged, through the
bench's trl stand-in) on posttrain, and print one RESULT line with episodes/s and peak GPU memory.

    python benchmarks/gpu_trl_runner.py trl       BENCH_DIR run_grpo.py
    python benchmarks/gpu_trl_runner.py posttrain BENCH_DIR run_grpo.py
    CACHE_IMPL=static python benchmarks/gpu_trl_runner.py ...       # both libraries: a static KV cache

The bench scripts are written for a CPU baseline (`use_cpu=True` in common.COMMON); this runner turns that
one setting off, the same way for both libraries, and changes nothing else (the knobs are the bench's own
environment variables: SIZE, EPISODES, BATCH, K, RESP_LEN, BF16, ART, RUNS). CACHE_IMPL sets the config's
`cache_implementation` (a field of TRL's GRPOConfig/RLOOConfig and of posttrain's online configs): with
"static", transformers' generate() compiles its decode step on CUDA (TRL), and posttrain compiles its
one-token decode forward with CUDA graphs. Timing is common.timed_train's: trainer.train() wall time,
episodes = EPISODES. Peak GPU memory is torch.cuda.max_memory_allocated over the whole process.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import runpy
import sys
import time


def main() -> None:
    library, bench, script = sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3]
    if library not in ("trl", "posttrain"):
        raise SystemExit(f"library must be trl or posttrain, got {library!r}")
    if library == "posttrain":
        sys.path.insert(0, os.path.join(bench, "posttrain_shim"))
    sys.path.insert(0, bench)
    import common  # the bench's settings; imports `trl` (the real one, or the stand-in)
    import torch
    import trl

    common.COMMON["use_cpu"] = False
    cache_impl = os.environ.get("CACHE_IMPL")
    if cache_impl:
        for name in ("GRPOConfig", "RLOOConfig", "OnlineDPOConfig", "XPOConfig"):
            if hasattr(trl, name):
                setattr(trl, name, functools.partial(getattr(trl, name), cache_implementation=cache_impl))

    cuda = torch.cuda.is_available()  # False only in a dry run of this script on a CPU machine

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed_train(trainer, name, per_prompt):
        sync()
        t0 = time.perf_counter()
        trainer.train()
        sync()
        wall = time.perf_counter() - t0
        res = dict(
            trainer=name,
            library=library,
            version=trl.__version__,
            cache_implementation=cache_impl or None,
            device=torch.cuda.get_device_name() if cuda else "cpu",
            torch=torch.__version__,
            size=common.SIZE,
            batch=common.BATCH,
            k=per_prompt,
            resp_len=common.RESP_LEN,
            bf16=common.COMMON["bf16"],
            episodes=common.EPISODES,
            steps=trainer.state.global_step,
            train_wall_s=round(wall, 2),
            eps_wall=round(common.EPISODES / wall, 2),
            cuda_peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            ru_maxrss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        )
        print("RESULT", json.dumps(res), flush=True)
        return res

    common.timed_train = timed_train
    runpy.run_path(os.path.join(bench, script), run_name="__main__")


if __name__ == "__main__":
    main()
