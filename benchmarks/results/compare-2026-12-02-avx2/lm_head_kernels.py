"""The 14m LM head (6815 x 128, no bias) at 1-32 rows, 2 threads, warm cache: F.linear, a contiguous transposed
weight, oneDNN on a packed and on the plain weight (mean of 200 calls after 10)."""

import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
W = torch.randn(6815, 128) * 0.02


def mean_us(fn, *args, n=200):
    for _ in range(10):
        fn(*args)
    start = time.perf_counter()
    for _ in range(n):
        fn(*args)
    return (time.perf_counter() - start) / n * 1e6


def onednn(x, w):
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


for rows in (1, 8, 16, 32):
    x = torch.randn(rows, 128)
    wt = W.t().contiguous()
    packed = torch.ops.mkldnn._reorder_linear_weight(W, rows)
    times = {
        "linear": mean_us(F.linear, x, W),
        "mm_Wt_contig": mean_us(torch.mm, x, wt),
        "onednn_packed": mean_us(onednn, x, packed),
        "onednn_plain": mean_us(onednn, x, W),
    }
    flops = 2 * rows * 128 * 6815
    print(rows, {k: f"{v:.0f}us {flops / v / 1e3:.1f}GF/s" for k, v in times.items()})
