"""One linear layer's call at the shapes of the bench models, float32 and bf16, on plain and on packed weights.

The kernels posttrain's decode loop chooses between on CPU (posttrain.cpu_linear): float32 `F.linear`
(torch's BLAS path), float32 oneDNN on a weight reordered once (`packed_weights`), bf16 `F.linear` on a
bf16 weight (what autocast runs, its weight cast once from the cache), bf16 oneDNN on a bf16 weight
reordered once (`autocast_packed_weights`), and autocast's `F.linear` on a float32 weight that is not a
leaf requiring grad (cast at every call). Prints µs per call (the best of 7 rounds of 50 calls) at decode
(16 and 64) and training (848 = 16 × 53) row counts, and the largest difference between the two bf16
kernels' outputs.

    PYTHONPATH=src python benchmarks/bench_bf16_linear.py [--threads 2] [--rows 16,64,848]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

# (name, out_features, in_features): pythia-14m / 70m's projections and LM head (vocab 6,815), and two of
# Qwen2.5-0.5B's.
SHAPES = [
    ("14m qkv", 384, 128),
    ("14m mlp", 512, 128),
    ("14m head", 6815, 128),
    ("70m qkv", 1536, 512),
    ("70m mlp", 2048, 512),
    ("70m head", 6815, 512),
    ("0.5B mlp", 4864, 896),
    ("0.5B q", 896, 896),
]


def best_us(fn, *args: torch.Tensor, calls: int = 50, rounds: int = 7) -> float:
    for _ in range(5):
        fn(*args)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="16,64,848")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native = [name for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported") if getattr(torch.cpu, name)()]
    print(f"torch {torch.__version__}, {args.threads} threads, native bf16 checks true: {native or 'none'}")
    print(f"{'rows':>4s} {'shape':9s} {'fp32':>8s} {'fp32 pk':>8s} {'bf16':>8s} {'bf16 pk':>8s} {'autocast':>8s}  diff")
    with torch.no_grad():
        for rows in map(int, args.rows.split(",")):
            for name, out_features, in_features in SHAPES:
                x, w, b = (
                    torch.randn(rows, in_features),
                    torch.randn(out_features, in_features) * 0.02,
                    torch.randn(out_features),
                )
                xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
                packed, packed_bf16 = (torch.ops.mkldnn._reorder_linear_weight(t, 16) for t in (w, wb))
                times = [
                    best_us(F.linear, x, w, b),
                    best_us(onednn, x, packed, b),
                    best_us(F.linear, xb, wb, bb),
                    best_us(onednn, xb, packed_bf16, bb),
                ]
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    times.append(best_us(F.linear, x, w, b))
                diff = (onednn(xb, packed_bf16, bb).float() - F.linear(xb, wb, bb).float()).abs().max().item()
                print(f"{rows:4d} {name:9s} " + " ".join(f"{t:8.1f}" for t in times) + f"  {diff:.1e}")


if __name__ == "__main__":
    main()
