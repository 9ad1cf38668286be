"""Process-wide settings every training run applies when it starts (SFT, reward and the online trainers).

- `seed_run`: `seed` for python, numpy and torch, or `transformers.enable_full_determinism(seed)`
  with `full_determinism` (deterministic algorithms, cuDNN / cuBLAS settings), as transformers.Trainer does.
- `data_seed`: the seed of the data order alone (`data_seed`, default `seed`).
- `apply_log_levels`: transformers' and posttrain's logging verbosity from `log_level` on the main
  process and `log_level_replica` on the others (`log_on_each_node`: each node's main process
  counts as main), as transformers.Trainer sets it.
- `reuse_freed_memory`: on Linux with glibc, when training starts, malloc keeps memory freed at the top of
  its heap for the next allocations instead of returning it to the kernel (POSTTRAIN_MALLOC).
- `side_by_side`: two independent pieces of CPU work at once, on this thread and on one worker thread, with
  torch's intra-op threads split between them (XPO's policy and reference rollouts).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from posttrain import distributed as dist
from posttrain.configs import malloc_mode

logger = logging.getLogger(__name__)

# log_level names -> logging levels ("passive": leave the level as it is).
_LEVELS = {
    "debug": logging.DEBUG,
    "detail": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def seed_run(config: Any) -> None:
    """Seed python, numpy and torch with config.seed; with config.full_determinism also switch on
    deterministic algorithms (transformers.enable_full_determinism)."""
    if getattr(config, "full_determinism", False):
        from transformers.trainer_utils import enable_full_determinism

        enable_full_determinism(config.seed)
    else:
        dist.set_seed(config.seed)


def data_seed(config: Any) -> int:
    """The seed of the data order: data_seed when set, else seed."""
    value = getattr(config, "data_seed", None)
    return config.seed if value is None else value


def process_log_level(config: Any, *, is_main: bool, is_local_main: bool) -> int | None:
    """The logging level of this process (None: "passive", leave it)."""
    should_log = is_local_main if config.log_on_each_node else is_main
    name = config.log_level if should_log else config.log_level_replica
    return _LEVELS.get(name)


def apply_log_levels(config: Any, accelerator: Any) -> int | None:
    """Set transformers' and the `posttrain` logger's verbosity for this process; returns the level set."""
    is_main = dist.is_main(accelerator)
    is_local_main = bool(getattr(accelerator, "is_local_main_process", is_main))
    level = process_log_level(config, is_main=is_main, is_local_main=is_local_main)
    if level is not None:
        import transformers

        transformers.logging.set_verbosity(level)
        logging.getLogger("posttrain").setLevel(level)
    return level


# glibc's mallopt parameters (malloc.h) and the values training sets with them.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Blocks of at least this size get a mapping of their own, unmapped when freed: 32 MiB, the ceiling glibc's own
# adaptive threshold rises to on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX; glibc's manual, "Malloc Tunable
# Parameters"), so blocks that large are handled as by default.
MMAP_THRESHOLD = 32 << 20
# Free memory at the top of the heap beyond this much is returned to the kernel.
TRIM_THRESHOLD = 256 << 20
# Environment variables through which a user sets malloc's thresholds: then they are left as they are.
USER_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_reusing = False  # set once this process's malloc has been configured


def glibc() -> Any:
    """This process's C library through ctypes where it is glibc (it has `gnu_get_libc_version`), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def reuse_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for the next allocations during training; whether it now does.

    By default glibc returns memory freed at the top of its heap to the kernel once more than about twice
    the largest recently freed block is free there. A training step allocates and frees the same large
    tensors every step (a 14M-parameter model's (848, 6,815) float32 logits, log-softmax and gradient
    blocks are 23 MB each), so the kernel hands the same memory back every step, each 4 KiB page through a
    page fault that zeroes it: about 530,000 faults and 1.2 s of system time over the 32 steps of an Online
    DPO run at 14m, against 67,000 and 0.3 s with the thresholds set here (benchmarks/README.md, "Page
    faults and glibc's trim threshold"). With them, only free memory beyond TRIM_THRESHOLD at the top of
    the heap goes back, and blocks of MMAP_THRESHOLD and more keep their own mappings, as glibc's
    adaptive threshold gives them at its ceiling; the peak resident memory stays that of the blocks alive
    at once.

    Acts once per process, on Linux with glibc, unless POSTTRAIN_MALLOC=off or the environment already
    sets malloc's thresholds (MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_, MALLOC_TOP_PAD_,
    MALLOC_MMAP_MAX_, or glibc.malloc tunables in GLIBC_TUNABLES). The setting is process-wide and stays
    after training (mallopt has no getter to restore from); the trainers call this when train() starts.
    """
    global _reusing
    if _reusing:
        return True
    if malloc_mode() == "off" or not sys.platform.startswith("linux"):
        return False
    if any(name in os.environ for name in USER_MALLOC_ENV) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    libc = glibc()
    if libc is None:
        return False
    # Setting either threshold switches glibc's adaptive one off, so both are set.
    _reusing = (
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    )
    if _reusing:
        logger.info(
            "glibc malloc keeps up to %d MiB of freed memory for reuse (POSTTRAIN_MALLOC=off leaves it as it is)",
            TRIM_THRESHOLD >> 20,
        )
    return _reusing


A = TypeVar("A")
B = TypeVar("B")
_SIDE: concurrent.futures.ThreadPoolExecutor | None = None  # the worker of side_by_side, made on first use


def _forget_side_worker() -> None:
    global _SIDE
    _SIDE = None  # a forked child has no copy of the worker thread: it makes its own if it needs one


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_side_worker)


def side_by_side(main: Callable[[], A], side: Callable[[], B]) -> tuple[A, B]:
    """(main(), side()), run at the same time: `side` on a worker thread with half of torch's intra-op
    threads (rounded down, at least one), `main` on this thread with the rest; torch's thread count is
    restored afterwards. For two jobs bound by per-operator overhead rather than arithmetic (a small model's
    decode steps: one thread each does almost the work of two, so two such jobs take little longer than
    one). The worker has finished when this returns or raises; an exception of either job is raised here,
    main's first. Thread-local state (grad mode, autocast) is the worker's own: `side` sets what it needs.
    Needs torch.get_num_threads() >= 2 to help; with one thread both jobs share it."""
    import torch

    global _SIDE
    threads = torch.get_num_threads()
    side_threads = max(threads // 2, 1)
    if _SIDE is None:
        _SIDE = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="posttrain-side")

    def run_side() -> B:
        torch.set_num_threads(side_threads)  # the worker thread's own OpenMP team (torch.set_num_threads)
        return side()

    future = _SIDE.submit(run_side)
    torch.set_num_threads(max(threads - side_threads, 1))
    try:
        first = main()
    finally:
        concurrent.futures.wait([future])
        torch.set_num_threads(threads)
    return first, future.result()
