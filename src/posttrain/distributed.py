"""The thin layer over accelerate: the only module that knows about ranks.

Trainers, tracking and checkpointing call these helpers with an `accelerate.Accelerator` (or
`None`, meaning "one plain process"), so models and math never import accelerate (DESIGN.md,
principle 6) and the same trainer runs on 1 CPU, 1 GPU or N GPUs. accelerate, deepspeed and
friends are imported inside the functions so that `import posttrain` stays light (principle 7).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from accelerate import Accelerator

MIXED_PRECISION_CHOICES = ("no", "bf16", "fp16")


def build_accelerator(
    gradient_accumulation_steps: int = 1,
    mixed_precision: str = "no",
    seed: int | None = None,
    log_with: str | list[str] | None = None,
    cpu: bool = False,
    **accelerator_kwargs: Any,
) -> Accelerator:
    """Create the run's `Accelerator`; the launch environment (accelerate launch, torchrun,
    DeepSpeed / FSDP configs) decides the distributed type, these arguments only the loop knobs.

    `seed` is applied with `set_seed` after the process group exists, so every rank starts from
    the same model initialisation and sampling stream unless a caller asks for per-device seeds.
    `accelerator_kwargs` go to `Accelerator` as given (the classic PPOConfig.accelerator_kwargs).
    """
    if mixed_precision not in MIXED_PRECISION_CHOICES:
        raise ValueError(
            f"mixed_precision={mixed_precision!r} is not supported; use one of {', '.join(MIXED_PRECISION_CHOICES)}."
        )
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps} must be >= 1.")
    from accelerate import Accelerator

    accelerator = Accelerator(
        gradient_accumulation_steps=gradient_accumulation_steps,
        mixed_precision=mixed_precision,
        log_with=log_with,
        cpu=cpu,
        **accelerator_kwargs,
    )
    if mixed_precision == "bf16" and accelerator.device.type == "cpu":
        warn_if_bf16_is_emulated()
    if seed is not None:
        set_seed(seed)
    return accelerator


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls in hardware (AMX tiles or AVX512-BF16), by torch's own checks.

    Without either, oneDNN emulates bf16 through fp32 conversions and a bf16 linear layer runs tens of
    times slower than in fp32 (measured about 100x on an AMD EPYC without avx512_bf16).
    """
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def warn_if_bf16_is_emulated() -> None:
    """One warning, with the reason and the advice, when bf16 is asked for on a CPU that emulates it."""
    if cpu_has_native_bf16():
        return
    warnings.warn(
        "bf16 was requested on a CPU without native bf16 (no AMX, no AVX512-BF16): torch emulates it, and "
        "training runs tens of times slower than in float32. Drop --bf16 / --torch_dtype bfloat16 on this "
        "machine (float32 is faster here); bf16 pays off on GPUs and on CPUs with AMX.",
        stacklevel=3,
    )


def world_size(accelerator: Accelerator | None) -> int:
    """Number of processes taking part in the run (1 without an accelerator)."""
    return 1 if accelerator is None else accelerator.num_processes


def process_index(accelerator: Accelerator | None) -> int:
    """Global rank of this process (0 without an accelerator)."""
    return 0 if accelerator is None else accelerator.process_index


def is_main(accelerator: Accelerator | None) -> bool:
    """True on the one process that writes files and prints (global rank 0)."""
    return True if accelerator is None else accelerator.is_main_process


def device(accelerator: Accelerator | None) -> torch.device:
    """The device this process computes on (CPU without an accelerator)."""
    return torch.device("cpu") if accelerator is None else accelerator.device


def reduce_sum(tensor: torch.Tensor, accelerator: Accelerator | None) -> torch.Tensor:
    """Element-wise sum of `tensor` over all ranks (a copy; the input is left untouched)."""
    if world_size(accelerator) == 1:
        return tensor.clone()
    return accelerator.reduce(tensor, reduction="sum")


def gather(tensor: torch.Tensor, accelerator: Accelerator | None) -> torch.Tensor:
    """Concatenate `tensor` from all ranks along dim 0 (rank order)."""
    if world_size(accelerator) == 1:
        return tensor
    return accelerator.gather(tensor)


def gather_values(values: torch.Tensor, accelerator: Accelerator | None) -> torch.Tensor:
    """Concatenate 1-D tensors of DIFFERENT lengths from all ranks (rank order), e.g. the masked
    token values of each rank's micro-batch. NaN marks the padding between ranks, so the values
    themselves must not be NaN."""
    values = values.reshape(-1)
    if world_size(accelerator) == 1:
        return values
    padded = accelerator.pad_across_processes(values.float(), dim=0, pad_index=float("nan"))
    gathered = accelerator.gather(padded)
    return gathered[~torch.isnan(gathered)].to(values.dtype)


def broadcast_object(obj: Any, accelerator: Accelerator | None, from_process: int = 0) -> Any:
    """Send a picklable object from `from_process` to every rank; returns the received copy."""
    if world_size(accelerator) == 1:
        return obj
    from accelerate.utils import broadcast_object_list

    box = [obj]
    broadcast_object_list(box, from_process=from_process)
    return box[0]


def wait_for_everyone(accelerator: Accelerator | None) -> None:
    """Barrier across ranks; a no-op for one process."""
    if world_size(accelerator) > 1:
        accelerator.wait_for_everyone()


def unwrap(model: nn.Module, accelerator: Accelerator | None) -> nn.Module:
    """The bare model under DDP / DeepSpeed / FSDP / torch.compile wrappers."""
    if accelerator is not None:
        return accelerator.unwrap_model(model)
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def _is_deepspeed_zero3(accelerator: Accelerator | None) -> bool:
    if accelerator is None:
        return False
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


@contextlib.contextmanager
def unwrap_for_generation(
    model: nn.Module, accelerator: Accelerator | None, gather_deepspeed3_params: bool = True
) -> Iterator[nn.Module]:
    """Yield a model that can run `generate`-style token-by-token forwards.

    Under DDP the wrapper only adds gradient synchronisation, so the bare module is enough.
    Under DeepSpeed ZeRO-3 every forward would all-gather each layer's shards again, which for
    hundreds of decoding steps dominates the rollout; gathering the full parameters once for the
    whole generation (as TRL's `unwrap_model_for_generation` does) trades memory for that time.
    `gather_deepspeed3_params=False` keeps the sharded path for models too big to gather.
    """
    unwrapped = unwrap(model, accelerator)
    if not (_is_deepspeed_zero3(accelerator) and gather_deepspeed3_params):
        yield unwrapped
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        yield unwrapped


def set_seed(seed: int, device_specific: bool = False) -> None:
    """Seed python `random`, numpy, torch and CUDA; `device_specific` adds the rank so ranks
    draw different samples (used for sampling, never for model initialisation)."""
    from accelerate.utils import set_seed as accelerate_set_seed

    accelerate_set_seed(seed, device_specific=device_specific)


@contextlib.contextmanager
def main_process_first(accelerator: Accelerator | None) -> Iterator[None]:
    """Run the body on the main process first, then on the others (dataset preprocessing
    and downloads fill caches once instead of racing on them)."""
    if accelerator is None:
        yield
        return
    with accelerator.main_process_first():
        yield


def shutdown() -> None:
    """Wait for every rank, then tear the process group down, if one was started.

    Exiting with a live gloo/NCCL group lets one rank's background threads be killed mid-flight
    ("terminate called without an active exception", SIGABRT), which the launcher reports as a
    failed run. The CLI calls this after every command; scripts that build trainers themselves
    under torchrun / accelerate launch should call it before exiting.
    """
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def no_sync_unless_last(accelerator: Accelerator | None, model: nn.Module, is_last: bool):
    """Skip the DDP gradient all-reduce on all but the last micro-batch of an accumulation."""
    if is_last or world_size(accelerator) == 1:
        return contextlib.nullcontext()
    return accelerator.no_sync(model)


def global_moments(
    values: torch.Tensor, mask: torch.Tensor | None, accelerator: Accelerator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, unbiased variance) of `values` over the True positions of `mask` (all positions when
    None) on every rank together: two all-reduces of (Σx, n) and Σ(x − mean)², so each rank gets
    the statistics of the global batch without gathering it."""
    x = values.float()
    m = torch.ones_like(x) if mask is None else mask.to(torch.float32)
    sums = reduce_sum(torch.stack([(x * m).sum(), m.sum()]), accelerator)
    mean = sums[0] / sums[1]
    var = reduce_sum(((x - mean).square() * m).sum(), accelerator) / (sums[1] - 1)
    return mean, var
