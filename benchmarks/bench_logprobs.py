"""Peak extra memory and time of chunked vs naive completion log-probs for (8, 64, 50000) logits.

naive   = log_softmax over the whole float32 (B, T, V) tensor, then gather (TRL ≤ 0.11
          `logprobs_from_logits`, Online DPO);
chunked = posttrain.ops.selective_log_softmax (only a (chunk_tokens, V) float32 block alive).

Each variant runs in its own subprocess and reports the growth of peak RSS
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`) over the peak right after the logits were allocated,
so allocator caches of one variant cannot hide another's peak (tracemalloc does not see torch).

    PYTHONPATH=src python benchmarks/bench_logprobs.py [--dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

VARIANTS = ("naive", "chunked-default", "chunked-1024", "chunked-128")


def run_variant(variant: str, shape: tuple[int, int, int], dtype_name: str) -> dict[str, float]:
    import torch

    from posttrain.ops import selective_log_softmax

    torch.set_num_threads(2)
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    B, T, V = shape
    logits = torch.randn(B, T, V).to(dtype)
    index = torch.randint(0, V, (B, T))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if variant == "naive":
        out = torch.log_softmax(logits.float(), dim=-1).gather(-1, index[..., None]).squeeze(-1)
    else:
        rows = variant.split("-")[1]
        out = selective_log_softmax(logits, index, chunk_tokens=None if rows == "default" else int(rows))
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert out.shape == (B, T)
    # ru_maxrss is in KiB on Linux.
    return {"peak_extra_mib": (after - before) / 1024, "ms": elapsed * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--shape", type=int, nargs=3, default=(8, 64, 50000))
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = tuple(args.shape)
    if args.variant:
        print(json.dumps(run_variant(args.variant, shape, args.dtype)))
        return
    B, T, V = shape
    logits_mib = B * T * V * (4 if args.dtype == "fp32" else 2) / 2**20
    print(f"logits {shape} {args.dtype} = {logits_mib:.0f} MiB")
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--variant", variant, "--dtype", args.dtype, "--shape", *map(str, shape)]
        result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ).stdout)
        print(f"{variant:13s}: peak +{result['peak_extra_mib']:7.1f} MiB  {result['ms']:7.1f} ms")


if __name__ == "__main__":
    main()
