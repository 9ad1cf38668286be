"""The 14m LM head (6815 x 128) at 16 rows on a packed oneDNN weight, 2 threads: warm (evict 0), and after 12 MB of
other memory went through the caches before each call (evict 1), as in a decode step; median and min of 300."""

import time

import torch

torch.set_num_threads(2)
W = torch.randn(6815, 128) * 0.02
x = torch.randn(16, 128)
packed = torch.ops.mkldnn._reorder_linear_weight(W, 16)
junk = torch.randn(3 * 1024 * 1024)


def call(evict):
    if evict:
        junk.add_(1.0)
    start = time.perf_counter()
    torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return time.perf_counter() - start


for evict in (0, 1):
    times = sorted(call(evict) for _ in range(300))
    print(evict, f"median {times[150] * 1e6:.0f}us min {times[0] * 1e6:.0f}us")
