"""float32 CPU linear layers: torch's default path (its BLAS) against oneDNN (posttrain.cpu_linear), per
shape, forward and forward + backward, plus what `cpu_linear.onednn_faster` decides for each shape.

    PYTHONPATH=src python benchmarks/bench_cpu_linear.py [--threads 2] [--repeats 20]

Shapes (rows × in → out): the decode steps (16 rows) and the training forwards (1088 rows = 16 × 68
tokens; 848 = 16 × 53 completion positions for the LM head) of the bench's pythia-14m-shaped (hidden
128) and pythia-70m-shaped (hidden 512) GPTNeoX models, vocabulary 6,815. Median of `--repeats` calls.
Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from posttrain import cpu_linear

SHAPES = [  # (rows, in, out, bias, what)
    (16, 128, 384, True, "14m qkv, decode"),
    (16, 128, 512, True, "14m MLP up, decode"),
    (16, 128, 6815, False, "14m LM head, decode"),
    (1088, 128, 512, True, "14m MLP up, training"),
    (848, 128, 6815, False, "14m LM head, training"),
    (16, 512, 1536, True, "70m qkv, decode"),
    (16, 512, 512, True, "70m attention out, decode"),
    (16, 512, 2048, True, "70m MLP up, decode"),
    (16, 2048, 512, True, "70m MLP down, decode"),
    (16, 512, 6815, False, "70m LM head, decode"),
    (1088, 512, 1536, True, "70m qkv, training"),
    (1088, 512, 512, True, "70m attention out, training"),
    (1088, 512, 2048, True, "70m MLP up, training"),
    (1088, 2048, 512, True, "70m MLP down, training"),
    (848, 512, 6815, False, "70m LM head, training"),
]


def median_ms(fn, args: tuple, repeats: int) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def forward(f, x, w, b, g) -> None:
    with torch.no_grad():
        f(x, w, b)


def forward_backward(f, x, w, b, g) -> None:
    f(x, w, b).backward(g)
    for t in (x, w, b):
        if t is not None:
            t.grad = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_linear.available():
        raise SystemExit("this torch build has no oneDNN linear kernel")
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats}")
    print("| shape (rows × in → out) | layer | default fwd ms | oneDNN fwd ms | fwd ratio | default fwd+bwd ms "
          "| oneDNN fwd+bwd ms | fwd+bwd ratio | auto picks oneDNN at this size |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for rows, inp, out, bias, what in SHAPES:
        torch.manual_seed(0)
        w = torch.randn(out, inp, requires_grad=True)
        b = torch.randn(out, requires_grad=True) if bias else None
        x = torch.randn(rows, inp, requires_grad=True)
        g = torch.randn(rows, out)
        fwd = [median_ms(forward, (f, x, w, b, g), args.repeats) for f in (F.linear, cpu_linear.linear)]
        both = [median_ms(forward_backward, (f, x, w, b, g), args.repeats) for f in (F.linear, cpu_linear.linear)]
        decision = cpu_linear.onednn_faster(out, inp, bias)
        picks = decision.small if rows <= cpu_linear.SMALL_ROWS else decision.large
        print(
            f"| {rows} × {inp} → {out} | {what} | {fwd[0]:.3f} | {fwd[1]:.3f} | {fwd[0] / fwd[1]:.2f}× "
            f"| {both[0]:.3f} | {both[1]:.3f} | {both[0] / both[1]:.2f}× | {'yes' if picks else 'no'} |"
        )


if __name__ == "__main__":
    main()
