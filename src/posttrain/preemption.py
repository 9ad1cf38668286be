"""`enable_jit_checkpoint`: a SIGTERM (a preemption notice) ends training with a resumable checkpoint.

Preemptible schedulers (Slurm with `--signal`, Kubernetes, spot instances) send SIGTERM and kill the job
a grace period later. With `enable_jit_checkpoint=True` the handler installed for the run only records
the signal. At the end of each optimizer step (online trainers: each rollout batch), the one point where
a checkpoint resumes exactly, every process learns whether any process has received it (one all-reduce
of a flag), so all of them save `checkpoint-N` of the same step and stop together; the final model is
not written (training did not finish) and `--resume_from_checkpoint latest` continues the run.

transformers' own `JITCheckpointCallback` (enable_jit_checkpoint in `transformers.Trainer`) lets each
process act on its own flag, set by a timer 3 s after the signal, at whichever callback sees it first;
under DDP, FSDP or ZeRO the processes can then stop at different steps, and a save that is a collective
waits for a process that has moved on. The all-reduce here is what keeps them on the same step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from posttrain import distributed as dist

logger = logging.getLogger(__name__)


class Preemption:
    """The SIGTERM flag of one run: `installed()` around the training loop, `requested()` once per step
    on every process (a collective when distributed, so every process must call it at the same step)."""

    def __init__(self, enabled: bool, accelerator: Any = None) -> None:
        self.enabled, self.accelerator = bool(enabled), accelerator
        self.received = False

    def _handler(self, signum: int, frame: Any) -> None:
        self.received = True  # nothing else: the training loop acts on it at the end of the step

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The SIGTERM handler while the block runs; the previous handler is restored after it."""
        if not self.enabled:
            yield
            return
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "enable_jit_checkpoint: training runs outside the main thread, where Python cannot install a "
                "SIGTERM handler; a SIGTERM ends this run without a checkpoint.",
                stacklevel=3,
            )
            self.enabled = False
            yield
            return
        previous = signal.signal(signal.SIGTERM, self._handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def requested(self) -> bool:
        """Whether any process has received SIGTERM (False without enable_jit_checkpoint, no collective)."""
        if not self.enabled:
            return False
        flag = torch.tensor([1.0 if self.received else 0.0], device=dist.device(self.accelerator))
        return bool(dist.reduce_sum(flag, self.accelerator).item() > 0)


def log_preempted(output_dir: str, step: int, *, is_main: bool) -> None:
    """The main process's one line after the checkpoint of a preempted run is written."""
    if is_main:
        logger.warning(
            "enable_jit_checkpoint: SIGTERM received; saved %s after step %d and stopped (no final model: training "
            "did not finish). Continue with --resume_from_checkpoint latest.",
            os.path.join(output_dir, f"checkpoint-{step}"),
            step,
        )
