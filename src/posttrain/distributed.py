"""The thin layer over accelerate: the only module that knows about ranks.

Trainers, tracking and checkpointing call these helpers with an `accelerate.Accelerator` (or
`None`, meaning "one plain process"), so models and math never import accelerate (DESIGN.md,
principle 6) and the same trainer runs on 1 CPU, 1 GPU or N GPUs. accelerate, deepspeed and
friends are imported inside the functions so that `import posttrain` stays light (principle 7).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import warnings
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from posttrain.configs import ConfigError, launch_world_size

if TYPE_CHECKING:
    from accelerate import Accelerator

MIXED_PRECISION_CHOICES = ("no", "bf16", "fp16")


def accelerator_device_available() -> bool:
    """Whether torch sees a device other than the CPU (CUDA, XPU, MPS, ...)."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    xpu = getattr(torch, "xpu", None)
    return torch.cuda.is_available() or (xpu is not None and xpu.is_available())


def build_accelerator(
    gradient_accumulation_steps: int = 1,
    mixed_precision: str = "no",
    seed: int | None = None,
    log_with: str | list[str] | None = None,
    cpu: bool = False,
    *,
    tf32: bool | None = None,
    empty_cache_steps: int | None = None,
    process_group_kwargs: dict[str, Any] | None = None,
    ddp_kwargs: dict[str, Any] | None = None,
    fsdp_plugin: Any = None,
    deepspeed_plugin: Any = None,
    dataloader_kwargs: dict[str, Any] | None = None,
    gradient_accumulation_kwargs: dict[str, Any] | None = None,
    **accelerator_kwargs: Any,
) -> Accelerator:
    """Create the run's `Accelerator`; the launch environment (accelerate launch, torchrun,
    DeepSpeed / FSDP configs) decides the distributed type unless a plugin is given here.

    `seed` is applied with `set_seed` after the process group exists, so every rank starts from
    the same model initialisation and sampling stream unless a caller asks for per-device seeds.
    `process_group_kwargs` (backend, timeout) and `ddp_kwargs` (find_unused_parameters,
    bucket_cap_mb, broadcast_buffers) become accelerate's kwargs handlers; `tf32` sets the CUDA
    TF32 switches; `empty_cache_steps` empties the device cache every that many optimizer steps.
    `accelerator_kwargs` go to `Accelerator` as given (the classic PPOConfig.accelerator_kwargs).
    """
    if mixed_precision not in MIXED_PRECISION_CHOICES:
        raise ValueError(
            f"mixed_precision={mixed_precision!r} is not supported; use one of {', '.join(MIXED_PRECISION_CHOICES)}."
        )
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps} must be >= 1.")
    if tf32:
        check_tf32_available(cpu)
    if not cpu and launch_world_size() > 1 and not accelerator_device_available():
        # A launcher's processes on a machine without GPUs: accelerate joins them into one gloo group only
        # with cpu=True. Without it every process would train alone on the whole run and write the same
        # output_dir (`torchrun --nproc_per_node 2` of a GPU recipe on a CPU machine).
        cpu = True
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    handlers: list[Any] = []
    if process_group_kwargs:
        handlers.append(InitProcessGroupKwargs(**process_group_kwargs))
    if ddp_kwargs:
        handlers.append(DistributedDataParallelKwargs(**ddp_kwargs))
    extra: dict[str, Any] = {}
    if dataloader_kwargs:
        from accelerate.utils import DataLoaderConfiguration

        extra["dataloader_config"] = DataLoaderConfiguration(**dataloader_kwargs)
    if gradient_accumulation_kwargs:
        from accelerate.utils import GradientAccumulationPlugin

        plugin_kwargs = {"num_steps": gradient_accumulation_steps, **gradient_accumulation_kwargs}
        extra["gradient_accumulation_plugin"] = GradientAccumulationPlugin(**plugin_kwargs)
    else:
        extra["gradient_accumulation_steps"] = gradient_accumulation_steps
    if fsdp_plugin is not None:
        extra["fsdp_plugin"] = fsdp_plugin
    if deepspeed_plugin is not None:
        extra["deepspeed_plugin"] = deepspeed_plugin
    before = {name: os.environ.get(name) for name in _PLUGIN_ENV.values()}
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        log_with=log_with,
        cpu=cpu,
        kwargs_handlers=handlers or None,
        **extra,
        **accelerator_kwargs,
    )
    # accelerate records a given plugin in the environment; remember that it was us, not a launcher.
    _ENV_SET_HERE.update(name for name, value in before.items() if os.environ.get(name) != value)
    if fsdp_plugin is None and _launched_with("ACCELERATE_USE_FSDP"):
        # accelerate launch --config_file with FSDP: accelerate keeps its plugin only where it shards itself.
        from accelerate.utils import FullyShardedDataParallelPlugin

        fsdp_plugin = getattr(accelerator.state, "fsdp_plugin", None) or FullyShardedDataParallelPlugin()
    if fsdp_plugin is not None:
        try:
            _register_sharding(accelerator, fsdp_plugin)
        except ConfigError:
            for name, value in before.items():
                _ENV_SET_HERE.discard(name)
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            raise
    if tf32 is not None and accelerator.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    if empty_cache_steps:
        EmptyCacheEvery(empty_cache_steps, accelerator).install()
    if mixed_precision == "bf16" and accelerator.device.type == "cpu":
        warn_if_bf16_is_emulated()
    if seed is not None:
        set_seed(seed)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        release_process_group_at_exit()
    return accelerator


def accelerator_for(config: Any, **accelerator_kwargs: Any) -> Accelerator:
    """The run's `Accelerator` from a `TrainingConfig`: use_cpu, mixed precision, tf32,
    torch_empty_cache_steps, the ddp_* fields, accelerator_config, fsdp / fsdp_config and deepspeed;
    `accelerator_kwargs` go to `Accelerator` as given (the classic PPOConfig's accelerator_kwargs).
    Every trainer builds its accelerator here (unless one is passed in)."""
    check_launch_conflicts(config)
    check_zero3_export(config.deepspeed or None)
    options = accelerator_config_kwargs(config.accelerator_config)
    return build_accelerator(
        mixed_precision=config.mixed_precision,
        cpu=config.use_cpu,
        tf32=config.tf32,
        empty_cache_steps=config.torch_empty_cache_steps,
        process_group_kwargs=process_group_kwargs(config),
        ddp_kwargs=ddp_kwargs(config),
        fsdp_plugin=fsdp_plugin_from(config),
        deepspeed_plugin=deepspeed_plugin_from(config),
        dataloader_kwargs=options["dataloader"],
        gradient_accumulation_kwargs=options["gradient_accumulation"],
        **accelerator_kwargs,
    )


# -- TrainingArguments' device and launch fields → accelerate --------------------------------------

# The environment variables by which `accelerate launch --config_file` turns FSDP / DeepSpeed on
# (accelerate also sets them itself when it is given a plugin: those are remembered in _ENV_SET_HERE).
_PLUGIN_ENV = {"FSDP": "ACCELERATE_USE_FSDP", "DeepSpeed": "ACCELERATE_USE_DEEPSPEED"}
_ENV_SET_HERE: set[str] = set()


def _launched_with(env: str) -> bool:
    """Whether the launcher (not an earlier accelerator of this process) turned `env` on."""
    return env not in _ENV_SET_HERE and os.environ.get(env, "false").strip().lower() in ("true", "1", "yes")


def check_tf32_available(cpu: bool = False) -> None:
    """ConfigError unless TF32 can be switched on: a CUDA GPU of compute capability 8.0 (Ampere) or newer."""
    if cpu or not torch.cuda.is_available():
        where = "--use_cpu is set" if cpu else "no CUDA GPU is available"
        raise ConfigError(f"--tf32 requires Ampere or a newer GPU, and {where}; drop --tf32 (or pass --tf32 false).")
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        raise ConfigError(
            f"--tf32 requires Ampere or a newer GPU (compute capability >= 8.0); this GPU is {major}.{minor}. "
            "Drop --tf32."
        )


def process_group_kwargs(config: Any) -> dict[str, Any]:
    """accelerate `InitProcessGroupKwargs` of ddp_backend and ddp_timeout (seconds → timedelta)."""
    from datetime import timedelta

    out: dict[str, Any] = {"timeout": timedelta(seconds=config.ddp_timeout)}
    # As transformers: a backend only for a launched multi-process run (one process has no group).
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1 or int(os.environ.get("LOCAL_RANK", "-1")) != -1
    if config.ddp_backend and launched:
        out["backend"] = config.ddp_backend
    return out


def ddp_kwargs(config: Any) -> dict[str, Any]:
    """accelerate `DistributedDataParallelKwargs` of the ddp_* fields that are set (None: DDP's default)."""
    names = {
        "ddp_find_unused_parameters": "find_unused_parameters",
        "ddp_bucket_cap_mb": "bucket_cap_mb",
        "ddp_broadcast_buffers": "broadcast_buffers",
        "ddp_static_graph": "static_graph",
    }
    return {key: getattr(config, name) for name, key in names.items() if getattr(config, name) is not None}


# transformers' AcceleratorConfig keys, each with the only value(s) posttrain's loops can honour and why.
ACCELERATOR_CONFIG_KEYS: dict[str, tuple[tuple[Any, ...], str]] = {
    "split_batches": ((False,), "per_device_train_batch_size is always per device"),
    "dispatch_batches": ((None, False), "every process reads its own share of the data"),
    "even_batches": ((True,), "every process runs the same number of micro-batches (the data is wrapped around)"),
    "use_seedable_sampler": ((True,), "the data order is always drawn from the seed"),
    "non_blocking": ((False,), "the trainers copy batches to the device themselves"),
    "use_configured_state": ((False,), "each trainer creates its own accelerator state"),
    "gradient_accumulation_kwargs": ((), ""),
}
GRADIENT_ACCUMULATION_KEYS: dict[str, tuple[tuple[Any, ...], str]] = {
    "num_steps": ((), "set --gradient_accumulation_steps instead"),
    "adjust_scheduler": ((True,), "the schedule always steps once per optimizer step"),
    "sync_with_dataloader": ((True,), "an epoch's last optimizer step always ends with its last micro-batch"),
    "sync_each_batch": ((True, False), ""),
}


def accelerator_config_kwargs(value: dict[str, Any] | None) -> dict[str, dict[str, Any] | None]:
    """Check an `accelerator_config` mapping (transformers' AcceleratorConfig keys) and split it into
    accelerate's `DataLoaderConfiguration` keywords ("dataloader") and `GradientAccumulationPlugin`
    keywords ("gradient_accumulation"); None where nothing was given.

    posttrain's trainers batch and accumulate themselves, so a key is accepted with the value that
    describes what they do; `gradient_accumulation_kwargs.sync_each_batch: true` (all-reduce every
    micro-batch's gradients instead of only the last one's: less memory, more communication) is
    honoured by `no_sync_unless_last`.
    """
    if not value:
        return {"dataloader": None, "gradient_accumulation": None}
    unknown = sorted(set(value) - set(ACCELERATOR_CONFIG_KEYS))
    if unknown:
        raise ConfigError(
            f"accelerator_config has unknown key(s) {unknown}; valid keys: {', '.join(ACCELERATOR_CONFIG_KEYS)}."
        )
    dataloader = {}
    for key, given in value.items():
        if key == "gradient_accumulation_kwargs":
            continue
        allowed, why = ACCELERATOR_CONFIG_KEYS[key]
        if given not in allowed:
            raise ConfigError(
                f"accelerator_config {key}={given!r} is not supported by posttrain ({why}); use {allowed[0]!r}."
            )
        if key != "use_configured_state":
            dataloader[key] = given
    accumulation = value.get("gradient_accumulation_kwargs") or {}
    if not isinstance(accumulation, dict):
        raise ConfigError(
            f"accelerator_config gradient_accumulation_kwargs={accumulation!r} must be a mapping, "
            'e.g. {"sync_each_batch": true}.'
        )
    unknown = sorted(set(accumulation) - set(GRADIENT_ACCUMULATION_KEYS))
    if unknown:
        raise ConfigError(
            f"accelerator_config gradient_accumulation_kwargs has unknown key(s) {unknown}; "
            f"valid keys: {', '.join(GRADIENT_ACCUMULATION_KEYS)}."
        )
    for key, given in accumulation.items():
        allowed, why = GRADIENT_ACCUMULATION_KEYS[key]
        if allowed and given not in allowed or not allowed:
            raise ConfigError(
                f"accelerator_config gradient_accumulation_kwargs {key}={given!r} is not supported by posttrain "
                f"({why})" + (f"; use {allowed[0]!r}." if allowed else ".")
            )
    return {"dataloader": dataloader or None, "gradient_accumulation": dict(accumulation) or None}


FSDP_OPTIONS = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard", "offload", "auto_wrap")
FSDP_SHARDING = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard")
# fsdp_config keys (transformers' names; a leading "fsdp_" is dropped as transformers does).
FSDP_CONFIG_KEYS = (
    "version",
    "min_num_params",
    "transformer_layer_cls_to_wrap",
    "auto_wrap_policy",
    "backward_prefetch",
    "forward_prefetch",
    "limit_all_gathers",
    "use_orig_params",
    "sync_module_states",
    "cpu_ram_efficient_loading",
    "activation_checkpointing",
    "offload_params",
    "cpu_offload",
    "reshard_after_forward",
    "state_dict_type",
)
FSDP1_ONLY_KEYS = (
    "backward_prefetch",
    "forward_prefetch",
    "limit_all_gathers",
    "use_orig_params",
    "sync_module_states",
)
FSDP_AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
FSDP_STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ConfigError(f"fsdp_config {name}={value!r} must be true or false.")


def fsdp_plugin_kwargs(config: Any) -> dict[str, Any] | None:
    """Keywords of accelerate's `FullyShardedDataParallelPlugin` from --fsdp, --fsdp_config and the
    deprecated --fsdp_min_num_params / --fsdp_transformer_layer_cls_to_wrap, mapped as transformers'
    TrainingArguments does (FSDP2 unless fsdp_config says version 1); None when --fsdp is off.

    --fsdp words: full_shard / shard_grad_op (FSDP2: reshard_after_forward true / false;
    FSDP1 also hybrid_shard, hybrid_shard_zero2, no_shard), offload (parameters and gradients in
    CPU memory), auto_wrap (the default: wrap each transformer block, or by size with min_num_params).
    """
    words = str(config.fsdp or "").split()
    fsdp_config = {
        (key[5:] if key.startswith("fsdp_") else key): val for key, val in (config.fsdp_config or {}).items()
    }
    deprecated = {
        "fsdp_min_num_params": ("min_num_params", config.fsdp_min_num_params or None),
        "fsdp_transformer_layer_cls_to_wrap": (
            "transformer_layer_cls_to_wrap",
            config.fsdp_transformer_layer_cls_to_wrap,
        ),
    }
    if not words:
        given = [name for name, (_, val) in deprecated.items() if val] + (["fsdp_config"] if fsdp_config else [])
        if given:
            raise ConfigError(f'{", ".join(given)} set but --fsdp is not; add --fsdp "full_shard auto_wrap".')
        return None
    bad = [w for w in words if w not in FSDP_OPTIONS]
    if bad:
        raise ConfigError(f"fsdp has unknown option(s) {bad}; valid (space separated): {', '.join(FSDP_OPTIONS)}.")
    unknown = sorted(set(fsdp_config) - set(FSDP_CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"fsdp_config has unknown key(s) {unknown}; valid keys: {', '.join(FSDP_CONFIG_KEYS)}.")
    for name, (key, val) in deprecated.items():
        if val:
            if fsdp_config.get(key) not in (None, val):
                raise ConfigError(f"{name}={val!r} and fsdp_config {key}={fsdp_config[key]!r} conflict; give only one.")
            fsdp_config[key] = val
    version = fsdp_config.get("version", 2)
    if version not in (1, 2, "1", "2"):
        raise ConfigError(f"fsdp_config version={version!r} must be 1 or 2 (FSDP2, the default).")
    version = int(version)
    sharding = [w for w in words if w in FSDP_SHARDING]
    if len(sharding) > 1:
        raise ConfigError(f"fsdp has several sharding strategies {sharding}; choose one.")
    kwargs: dict[str, Any] = {"fsdp_version": version}
    if "reshard_after_forward" in fsdp_config:
        reshard = fsdp_config["reshard_after_forward"]
        kwargs["reshard_after_forward"] = _as_bool("reshard_after_forward", reshard) if version == 2 else str(reshard)
    elif sharding and version == 2:
        if sharding[0] not in ("full_shard", "shard_grad_op"):
            raise ConfigError(
                f"fsdp {sharding[0]} is an FSDP1 strategy; use full_shard or shard_grad_op with FSDP2, or set "
                'fsdp_config {"version": 1}.'
            )
        kwargs["reshard_after_forward"] = sharding[0] == "full_shard"
    elif sharding:
        kwargs["reshard_after_forward"] = sharding[0].upper()
    offload = "offload" in words
    for key in ("offload_params", "cpu_offload"):
        if key in fsdp_config:
            offload = offload or _as_bool(key, fsdp_config[key])
    if offload:
        kwargs["cpu_offload"] = True
    min_num_params = int(fsdp_config.get("min_num_params") or 0)
    policy = str(fsdp_config.get("auto_wrap_policy", "SIZE_BASED_WRAP" if min_num_params > 0 else "")).upper()
    policy = policy or "TRANSFORMER_BASED_WRAP"
    if policy not in FSDP_AUTO_WRAP_POLICIES:
        raise ConfigError(
            f"fsdp_config auto_wrap_policy={policy!r} must be one of {', '.join(FSDP_AUTO_WRAP_POLICIES)}."
        )
    kwargs["auto_wrap_policy"] = policy
    if policy == "SIZE_BASED_WRAP":
        kwargs["min_num_params"] = min_num_params
    layers = fsdp_config.get("transformer_layer_cls_to_wrap")
    if policy == "TRANSFORMER_BASED_WRAP" and layers:
        kwargs["transformer_cls_names_to_wrap"] = [layers] if isinstance(layers, str) else list(layers)
    state_dict_type = str(fsdp_config.get("state_dict_type", "FULL_STATE_DICT")).upper()
    allowed_types = FSDP_STATE_DICT_TYPES if version == 1 else FSDP_STATE_DICT_TYPES[:2]
    if state_dict_type not in allowed_types:
        raise ConfigError(
            f"fsdp_config state_dict_type={state_dict_type!r} must be one of {', '.join(allowed_types)} "
            f"with FSDP{version}."
        )
    kwargs["state_dict_type"] = state_dict_type
    for key in ("cpu_ram_efficient_loading", "activation_checkpointing"):
        if key in fsdp_config:
            kwargs[key] = _as_bool(key, fsdp_config[key])
    fsdp1_given = [key for key in FSDP1_ONLY_KEYS if key in fsdp_config]
    if version == 2 and fsdp1_given:
        warnings.warn(
            f"fsdp_config {', '.join(fsdp1_given)} apply to FSDP1 only; FSDP2 (the default version) does without "
            'them, so they are not used. Drop them, or set fsdp_config {"version": 1}.',
            stacklevel=3,
        )
    elif version == 1:
        prefetch = str(fsdp_config.get("backward_prefetch", "NO_PREFETCH")).upper()
        if prefetch not in ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"):
            raise ConfigError(
                f"fsdp_config backward_prefetch={prefetch!r} must be BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH."
            )
        kwargs["backward_prefetch"] = prefetch
        defaults = {"forward_prefetch": False, "use_orig_params": True, "sync_module_states": True}
        for key, default in defaults.items():
            kwargs[key] = _as_bool(key, fsdp_config.get(key, default))
        if "limit_all_gathers" in fsdp_config:
            kwargs["limit_all_gathers"] = _as_bool("limit_all_gathers", fsdp_config["limit_all_gathers"])
    return kwargs


def fsdp_plugin_from(config: Any) -> Any:
    """accelerate's `FullyShardedDataParallelPlugin` for --fsdp (None when it is off)."""
    kwargs = fsdp_plugin_kwargs(config)
    if kwargs is None:
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(**kwargs)


def deepspeed_fill_auto(ds_config: dict[str, Any], config: Any, world_size: int) -> dict[str, Any]:
    """A copy of a DeepSpeed config with its "auto" values filled from the training config, as
    transformers' HfTrainerDeepSpeedConfig does: micro-batch size, gradient accumulation, train batch
    size (= world_size × micro-batch × accumulation), gradient clipping, the optimizer's lr / betas /
    eps / weight_decay, the scheduler's warmup_max_lr, and fp16 / bf16 enabled. A value given
    explicitly that differs from the training config's is a ConfigError listing every mismatch.
    """
    import copy

    filled = copy.deepcopy(ds_config)
    mismatches = []

    def fill(path: str, value: Any, source: str) -> None:
        node = filled
        *parents, key = path.split(".")
        for parent in parents:
            node = node.get(parent)
            if not isinstance(node, dict):
                return
        if node.get(key) == "auto":
            node[key] = value
        elif key in node and node[key] != value:
            mismatches.append(f"{path}={node[key]!r} vs {source}={value!r}")

    micro, accumulation = config.per_device_train_batch_size, config.gradient_accumulation_steps
    fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    fill("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    fill("train_batch_size", world_size * micro * accumulation, "world_size × per_device × accumulation")
    fill("gradient_clipping", config.max_grad_norm or 0.0, "max_grad_norm")
    fill("optimizer.params.lr", config.learning_rate, "learning_rate")
    fill("optimizer.params.betas", [config.adam_beta1, config.adam_beta2], "[adam_beta1, adam_beta2]")
    fill("optimizer.params.eps", config.adam_epsilon, "adam_epsilon")
    fill("optimizer.params.weight_decay", config.weight_decay, "weight_decay")
    fill("scheduler.params.warmup_max_lr", config.learning_rate, "learning_rate")
    fill("fp16.enabled", bool(config.fp16), "fp16")
    fill("bf16.enabled", bool(config.bf16), "bf16")
    if mismatches:
        raise ConfigError(
            "the DeepSpeed config disagrees with the training config: "
            + "; ".join(mismatches)
            + '. Set those DeepSpeed values to "auto" or change the flags to match.'
        )
    return filled


def require_deepspeed() -> None:
    """ConfigError naming the install command when the optional deepspeed package is missing."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("--deepspeed needs the deepspeed package, which is not installed: pip install deepspeed.")


def deepspeed_plugin_from(config: Any) -> Any:
    """accelerate's `DeepSpeedPlugin` for --deepspeed (None when it is off), "auto" values filled."""
    if not config.deepspeed:
        return None
    require_deepspeed()
    from accelerate.utils import DeepSpeedPlugin

    world = int(os.environ.get("WORLD_SIZE", "1"))
    return DeepSpeedPlugin(hf_ds_config=deepspeed_fill_auto(config.deepspeed, config, world))


def check_launch_conflicts(config: Any) -> None:
    """--fsdp and --deepspeed exclude each other and an `accelerate launch --config_file` that already
    turned FSDP or DeepSpeed on (the two plugins would fight over the model)."""

    flags = [name for name in ("fsdp", "deepspeed") if getattr(config, name)]
    if len(flags) == 2:
        raise ConfigError("--fsdp and --deepspeed are both set; choose one.")
    launched = [what for what, env in _PLUGIN_ENV.items() if _launched_with(env)]
    if flags and launched:
        raise ConfigError(
            f"--{flags[0]} is set, and accelerate launch's config already turns {launched[0]} on; configure it in "
            f"one place: drop --{flags[0]}, or launch without the {launched[0]} config."
        )


def check_launch_options(config: Any) -> None:
    """Config-time checks of the launch fields (before any model loads): fsdp words and fsdp_config
    keys, accelerator_config keys, deepspeed installed, and no two plugins at once."""
    check_launch_conflicts(config)
    fsdp_plugin_kwargs(config)
    accelerator_config_kwargs(config.accelerator_config)
    if config.deepspeed:
        require_deepspeed()
    check_zero3_export(config.deepspeed or None)


class EmptyCacheEvery:
    """Empty the accelerator's memory cache (accelerate's `clear_device_cache`: torch.cuda.empty_cache
    on CUDA, a no-op on CPU) after every `steps`-th optimizer step of the optimizers prepared by
    `accelerator` (transformers' torch_empty_cache_steps)."""

    def __init__(self, steps: int, accelerator: Accelerator) -> None:
        import weakref

        self.steps, self.count, self.calls = steps, 0, 0
        self.accelerator = weakref.ref(accelerator)

    def install(self) -> None:
        import weakref

        from torch.optim.optimizer import register_optimizer_step_post_hook

        handle = register_optimizer_step_post_hook(self)
        weakref.finalize(self.accelerator(), handle.remove)

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        accelerator = self.accelerator()
        prepared = [] if accelerator is None else accelerator._optimizers
        if not any(getattr(o, "optimizer", o) is optimizer for o in prepared):
            return
        self.count += 1
        if self.count % self.steps == 0:
            from accelerate.utils import memory

            memory.clear_device_cache()
            self.calls += 1


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


def early_device(config: Any, accelerator: Accelerator | None = None) -> torch.device | None:
    """The GPU this process will hold a whole (unsharded) model on, known before the run's Accelerator
    exists: in a one-process or DDP run on CUDA, the device accelerate will assign (the current CUDA
    device for one process; cuda:(LOCAL_RANK mod the visible GPUs) for each launched process).
    Trainers make their reference copy of the policy there instead of in host memory (a 0.5B float32
    copy is 2 GB of RAM). None where models stay on the CPU, are sharded or placed by FSDP or
    DeepSpeed, or an accelerator was passed in (the run then uses that one's device and plan)."""
    if accelerator is not None or config.use_cpu or not torch.cuda.is_available():
        return None
    if config.fsdp or config.deepspeed or any(_launched_with(env) for env in _PLUGIN_ENV.values()):
        return None
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        return torch.device("cuda")
    return torch.device("cuda", int(local_rank) % torch.cuda.device_count())


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


def gather_objects(obj: Any, accelerator: Accelerator | None) -> list[Any]:
    """Every rank's picklable `obj`, in rank order, on every rank."""
    if world_size(accelerator) == 1:
        return [obj]
    out: list[Any] = [None] * world_size(accelerator)
    torch.distributed.all_gather_object(out, obj)
    return out


def gather_object(items: list[Any], accelerator: Accelerator | None) -> list[Any]:
    """Concatenate each rank's list of picklable objects (e.g. texts), in rank order."""
    return [item for part in gather_objects(list(items), accelerator) for item in part]


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
    Under FSDP2 the same: the parameters are gathered once (unshard) before the decoding loop and
    sharded again after it. `gather_deepspeed3_params=False` keeps the sharded path for models too big
    to gather.
    """
    unwrapped = unwrap(model, accelerator)
    if _sharded_root(unwrapped) is not None:
        # FSDP2: every unit of the generating model gathered once for the whole rollout; or, with
        # gather off, only the root's own unit (each layer then all-gathers at every decoding step).
        with gathered(unwrapped, everything=gather_deepspeed3_params):
            yield unwrapped
        return
    if not (_is_deepspeed_zero3(accelerator) and gather_deepspeed3_params):
        yield unwrapped
        return
    import deepspeed

    # One gather for the whole generation; the engine's per-layer fetch/release hooks are taken off
    # meanwhile, or each decoding step's forward would release (re-partition) what was just gathered.
    engine = _engine_holding(model, accelerator)
    with deepspeed.zero.GatheredParameters(list(model.parameters())), _zero3_hooks_suspended(engine):
        yield unwrapped


# -- DeepSpeed ZeRO: frozen models, the generation gather, the 16-bit export -------------------------


def model_hidden_size(model: nn.Module) -> int | None:
    """The hidden size DeepSpeed's bucket sizes are derived from: `config.hidden_size`, or the largest
    of `config.hidden_sizes` (models with several stages); None when the model has no such config."""
    config = getattr(model, "config", None)
    sizes = getattr(config, "hidden_sizes", None)
    if sizes:
        return int(max(sizes))
    size = getattr(config, "hidden_size", None)
    return int(size) if size else None


def deepspeed_inference_config(train_config: dict[str, Any], hidden_size: int | None) -> dict[str, Any]:
    """The DeepSpeed config of a frozen model (reference, reward model) from the run's training config.

    A copy with the ZeRO stage kept and the "optimizer" and "scheduler" sections removed (a frozen
    model has neither). Under stage 3 the bucket sizes are derived from `hidden_size` h as
    transformers' HfTrainerDeepSpeedConfig does for the trained model: reduce_bucket_size = h²,
    stage3_param_persistence_threshold = 10·h (parameters at most that large stay whole on every
    rank), stage3_prefetch_bucket_size = int(0.9·h²). They are written inside "zero_optimization",
    where DeepSpeed reads them (TRL's `prepare_deepspeed` writes dotted top-level keys, which
    DeepSpeed does not read). Without a hidden size the training config's values are kept.
    """
    import copy

    config = copy.deepcopy(train_config)
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    zero = config.get("zero_optimization") or {}
    if int(zero.get("stage", 0)) == 3 and hidden_size:
        zero["reduce_bucket_size"] = hidden_size * hidden_size
        zero["stage3_param_persistence_threshold"] = 10 * hidden_size
        zero["stage3_prefetch_bucket_size"] = int(0.9 * hidden_size * hidden_size)
    return config


def prepare_frozen(model: Any, accelerator: Accelerator | None) -> Any:
    """A frozen model (reference policy, reward model, PPO's frozen roles) ready for no-grad forwards:
    eval mode, requires_grad off, and then

    - under DeepSpeed ZeRO-3: sharded like the policy in an inference-only DeepSpeed engine
      (`deepspeed_inference_config`: the run's config without optimizer, buckets from the model's
      hidden size), as TRL's `prepare_deepspeed` does; every rank must call this, in the same order;
    - under FSDP2 (--fsdp): sharded like the policy, without optimizer state; its units gather their
      parameters as they run;
    - otherwise (one process, DDP, ZeRO-1/2): moved to the run's device whole, no wrapper (ZeRO-1/2
      shard only optimizer state and gradients, which a frozen model does not have).

    Anything that is not a module (a reward function, None) is returned as it is. Every trainer
    places its frozen models through here.
    """
    if not isinstance(model, nn.Module) or hasattr(model, "zero_optimization_stage") or _is_fsdp2(model):
        return model  # not a model, or prepared already (a DeepSpeed engine, an FSDP2-sharded model)
    model.eval().requires_grad_(False)
    if not _is_deepspeed_zero3(accelerator):
        plan = sharding_plan(accelerator)
        if plan is None:
            return model.to(device(accelerator))
        return _shard(model, accelerator, plan)
    import deepspeed

    plugin = accelerator.state.deepspeed_plugin
    config = deepspeed_inference_config(plugin.deepspeed_config, model_hidden_size(model))
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def _engine_holding(model: nn.Module, accelerator: Accelerator) -> Any:
    """The DeepSpeed engine that is `model` or holds it as a submodule (PPO samples from the policy
    inside its policy-and-critic engine); None when no engine prepared by `accelerator` holds it."""
    if hasattr(model, "zero_optimization_stage"):
        return model
    for engine in getattr(accelerator, "_models", []):
        if any(module is model for module in unwrap(engine, accelerator).modules()):
            return engine
    return None


@contextlib.contextmanager
def _zero3_hooks_suspended(engine: Any) -> Iterator[None]:
    """Take a ZeRO-3 engine's parameter fetch/release hooks off for the body and put them back after
    (DeepSpeed's own `unwrap_model_for_generation` does the same); a no-op for a module that is not
    an engine (e.g. the PEFT policy with its adapter disabled)."""
    optimizer = getattr(engine, "optimizer", None) if hasattr(engine, "zero_optimization_stage") else None
    owner = getattr(optimizer, "parameter_offload", optimizer)
    if owner is None or not hasattr(owner, "forward_hooks"):
        yield
        return
    for module in owner.module.modules():
        external = getattr(module, "ds_external_parameters", lambda: [])()
        for param in [*module.parameters(recurse=False), *(p for _, p in external)]:
            active = getattr(param, "ds_active_sub_modules", None)
            if active is not None:
                active.clear()
    for hook in [*owner.forward_hooks, *owner.backward_hooks]:
        hook.remove()
    owner.forward_hooks, owner.backward_hooks = [], []
    try:
        yield
    finally:
        # Renamed in DeepSpeed 0.16.4 (deepspeedai/DeepSpeed#6847).
        register = getattr(owner, "_register_deepspeed_module", None) or owner._register_hooks_recursively
        register(owner.module)


def zero3_state_dict(model: nn.Module, accelerator: Accelerator) -> dict[str, torch.Tensor]:
    """The full 16-bit state dict of `model` (a trained model, or a part of one such as PPO's policy
    inside its policy-and-critic wrapper) under DeepSpeed ZeRO-3, keyed as `model.state_dict()`.

    The engine that is or holds `model` gathers its shards (accelerate's `get_state_dict`, DeepSpeed's
    `_zero3_consolidated_16bit_state_dict`); every rank must call this, and only the main process
    receives the tensors (the other ranks get an empty dict). Needs
    zero_optimization.stage3_gather_16bit_weights_on_model_save (accelerate config:
    zero3_save_16bit_model: true).
    """
    bare = unwrap(model, accelerator)  # SFT and reward training save the engine itself
    for engine in getattr(accelerator, "_models", []):
        root = unwrap(engine, accelerator)
        prefix = next((name for name, module in root.named_modules() if module is bare), None)
        if prefix is None:
            continue
        if not engine.zero_gather_16bit_weights_on_model_save():
            raise ConfigError(
                "saving a ZeRO-3 model needs its full weights gathered: set "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save: true in the DeepSpeed config "
                "(accelerate config: zero3_save_16bit_model: true)."
            )
        full = accelerator.get_state_dict(engine) or {}  # None on every rank but the main one
        if not prefix:
            return full
        return {key[len(prefix) + 1 :]: value for key, value in full.items() if key.startswith(prefix + ".")}
    raise ValueError(
        f"{type(model).__name__} is not part of a model prepared by this accelerator; only trained models "
        "are saved under ZeRO-3."
    )


def deepspeed_stage(accelerator: Accelerator | None) -> int | None:
    """The ZeRO stage (0-3) of a run under DeepSpeed; None when the run does not use DeepSpeed."""
    plugin = None if accelerator is None else getattr(accelerator.state, "deepspeed_plugin", None)
    return None if plugin is None else int(plugin.zero_stage)


def _engine_stepping(optimizer: Any, accelerator: Accelerator) -> Any:
    """The DeepSpeed engine prepared by `accelerator` whose ZeRO optimizer `optimizer` is, or wraps
    (accelerate returns the engine's optimizer inside its `DeepSpeedOptimizerWrapper`)."""
    chain, inner = [], optimizer
    while inner is not None and len(chain) < 8:
        chain.append(inner)
        inner = getattr(inner, "optimizer", None)
    for engine in getattr(accelerator, "_models", []):
        held = getattr(engine, "optimizer", None) if hasattr(engine, "zero_optimization_stage") else None
        if held is not None and any(held is link for link in chain):
            return engine
    raise ValueError(
        "the optimizer is not the one of a DeepSpeed engine prepared by this accelerator; pass the optimizer "
        "that accelerator.prepare returned."
    )


def engine_modules(optimizer: Any, accelerator: Accelerator) -> list[nn.Module]:
    """Every module inside the DeepSpeed engine that steps `optimizer`: the models whose weights the
    engine's own checkpoint restores."""
    return list(unwrap(_engine_stepping(optimizer, accelerator), accelerator).modules())


def save_engine_state(directory: Path, tag: str, optimizer: Any, accelerator: Accelerator) -> dict[str, Any]:
    """Every rank, collectively: the DeepSpeed engine that steps `optimizer` writes its own checkpoint
    into `directory/tag` with `engine.save_checkpoint` (DeepSpeed's layout: each rank's ZeRO partition
    of the optimizer state and fp32 master weights, the module states, plus `latest` and DeepSpeed's
    `zero_to_fp32.py` in `directory`). Frozen parameters (a LoRA base) are left out, as transformers
    does for PEFT models: the run's model loading rebuilds them. Returns what `load_engine_state` needs."""
    engine = _engine_stepping(optimizer, accelerator)
    frozen = any(not p.requires_grad for p in unwrap(engine, accelerator).parameters())
    # Every rank, not only DeepSpeed's rank 0: with save_on_each_node the nodes share no disk.
    (directory / tag).mkdir(parents=True, exist_ok=True)
    engine.save_checkpoint(str(directory), tag=tag, exclude_frozen_parameters=frozen)
    return {"tag": tag, "exclude_frozen_parameters": frozen}


def load_engine_state(directory: Path, record: Mapping[str, Any], optimizer: Any, accelerator: Accelerator) -> bool:
    """Every rank: the DeepSpeed engine that steps `optimizer` loads its own partition of the state
    `save_engine_state` wrote (`record` is what it returned): weights, fp32 master weights, optimizer
    state and the engine's own scheduler, if it has one. False when DeepSpeed found nothing to load."""
    engine = _engine_stepping(optimizer, accelerator)
    loaded, _ = engine.load_checkpoint(
        str(directory),
        tag=record["tag"],
        load_module_strict=not record.get("exclude_frozen_parameters", False),
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )
    return loaded is not None


def check_zero3_export(ds_config: dict[str, Any] | None) -> None:
    """ConfigError, before any model loads, when ZeRO-3 would not let the final model be saved in a
    form transformers loads: its 16-bit weights are gathered for saving only when
    zero_optimization.stage3_gather_16bit_weights_on_model_save is true. `ds_config` is the --deepspeed
    config; None checks an `accelerate launch` DeepSpeed config (its zero3_save_16bit_model key,
    which accelerate passes on in the environment) unless that config names a DeepSpeed JSON file."""
    if ds_config is None:
        env = os.environ
        launched = env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("true", "1", "yes")
        if not launched or env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none") != "none":
            return
        if env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3":
            if env.get("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "false").lower() != "true":
                raise ConfigError(
                    "the accelerate launch config is DeepSpeed ZeRO-3 without zero3_save_16bit_model: true; the "
                    "trained model could not be saved in a form transformers loads. Add zero3_save_16bit_model: "
                    "true under deepspeed_config (as examples/accelerate_configs/deepspeed_zero3.yaml does)."
                )
        return
    zero = ds_config.get("zero_optimization") or {}
    if int(zero.get("stage", 0)) == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") is not True:
        raise ConfigError(
            "the DeepSpeed config is ZeRO stage 3 without zero_optimization.stage3_gather_16bit_weights_on_model_save"
            ": true; the trained model could not be saved in a form transformers loads. Add "
            '"stage3_gather_16bit_weights_on_model_save": true to "zero_optimization".'
        )


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
    _destroy_and_free()


def _destroy_and_free() -> None:
    """Destroy this process's group if it still exists, then free it (`_release_process_groups`)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _release_process_groups()


_RELEASE_AT_EXIT = False


def release_process_group_at_exit() -> None:
    """Have the process group destroyed and freed when the interpreter begins to exit.

    A script that builds a trainer under torchrun and ends after `train()`, as TRL's examples do, still holds
    its trainer in module globals at exit, and the trainer's DDP-wrapped model holds the group, so the
    group's gloo threads ran on into interpreter teardown, where a rank of a finished run could abort with
    SIGABRT ("terminate called without an active exception"; docs/internals.md, "Process exit"). An
    `atexit` handler runs while the interpreter and its threads are alive: it destroys the group, has every
    DistributedDataParallel wrapper drop its reducer, logger and group (nothing trains after exit has
    begun), and frees the group (`_release_process_groups`), which joins its threads. It waits for no other
    rank (after an error a barrier could wait forever). Registered once per process, by `build_accelerator`
    when a process group exists."""
    global _RELEASE_AT_EXIT
    if not _RELEASE_AT_EXIT:
        _RELEASE_AT_EXIT = True
        atexit.register(_release_at_exit)


def _release_at_exit() -> None:
    import gc

    from torch.nn.parallel import DistributedDataParallel

    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads obj.__class__, which on some objects torch keeps for
        # deprecated names (torch.distributed.reduce_op) prints a FutureWarning at every exit
        if issubclass(type(obj), DistributedDataParallel):
            for name in ("reducer", "logger", "process_group"):
                obj.__dict__.pop(name, None)
    _destroy_and_free()


def _release_process_groups() -> None:
    """Free the process groups `destroy_process_group` unregistered, so that their worker threads are
    joined now rather than during interpreter teardown.

    After FSDP2 (`fully_shard`), DTensor's module-level caches (sharding propagation, mesh topology,
    redistribution planners) keep the device mesh, and with it the gloo/NCCL process group, alive after
    `destroy_process_group()`: its worker and transport threads then outlive the interpreter's teardown,
    a window in which a rank of a finished run can abort with SIGABRT ("terminate called without an
    active exception"). Emptying those caches drops the last references; `gc.collect()` frees what
    cycles still hold. See docs/internals.md ("Process exit").
    """
    import gc
    import sys

    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed.tensor"):
            continue
        for value in list(vars(module).values()):
            _clear_caches(value)
            if isinstance(value, type) and value.__module__ == name:
                for member in vars(value).values():
                    _clear_caches(getattr(member, "__func__", member))
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import DTensor

        propagator = DTensor._op_dispatcher.sharding_propagator
        _clear_caches(propagator.propagate_op_sharding)  # per instance, not a module attribute
        if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):  # the C++ fast path's cache
            torch._C._clear_DTensor_sharding_propagator_cache()
        planners = getattr(sys.modules.get("torch.distributed.tensor._redistribute"), "_planner_cache", None)
        if isinstance(planners, dict):
            planners.clear()
    gc.collect()


def _clear_caches(value: Any) -> None:
    """Empty `value` if it is a functools cache (`lru_cache` / `cache`, DTensor's per-thread LRU cache)."""
    import functools

    if isinstance(value, functools._lru_cache_wrapper) or type(value).__name__ == "LocalLRUCache":
        value.cache_clear()


def no_sync_unless_last(accelerator: Accelerator | None, model: nn.Module, is_last: bool):
    """Skip the DDP gradient all-reduce on all but the last micro-batch of an accumulation (unless
    accelerator_config asks for sync_each_batch)."""
    if is_last or world_size(accelerator) == 1 or _sync_each_batch(accelerator):
        return contextlib.nullcontext()
    if _is_fsdp2(model):
        return _fsdp_no_sync(model)
    return accelerator.no_sync(model)


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's no_sync: gradients accumulate unsharded until the last micro-batch reduce-scatters them."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _sync_each_batch(accelerator: Accelerator) -> bool:
    """accelerator_config gradient_accumulation_kwargs sync_each_batch: all-reduce every micro-batch."""
    return bool(accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False))


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


# -- FSDP2: sharded models -------------------------------------------------------------------------
#
# accelerate shards with FSDP only on several GPUs (NPUs, ...); on CPU processes (gloo) it would quietly
# train unsharded. There posttrain shards itself with PyTorch's `fully_shard` over the process group
# accelerate created. Either way the trainers call the same functions: prepare_trained (the trained
# model and its optimizer), prepare_frozen (reference and reward models), unwrap_for_generation (the
# parameters gathered once per rollout), no_sync_unless_last, clip_grad_norm and full_state_dict.


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """How models are cut into FSDP2 units: each module of `layer_classes` (by class name; empty: the
    model's own `_no_split_modules`) or, with `min_num_params` > 0, each smallest module holding that
    many parameters; then every other module that holds parameters, then the root.
    `reshard_after_forward` (full_shard: True, shard_grad_op: False) applies to all units but the root.
    `native`: posttrain shards the trained model itself (accelerate cannot on this device)."""

    reshard_after_forward: bool = True
    layer_classes: tuple[str, ...] = ()
    min_num_params: int = 0
    auto_wrap: bool = True
    native: bool = True


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # accelerator -> ShardingPlan
_MESHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # accelerator -> DeviceMesh
_ROOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sharded root module -> ShardingPlan


def _plan_from_plugin(plugin: Any, native: bool) -> ShardingPlan:
    """The ShardingPlan of accelerate's FSDP plugin (built from --fsdp or from accelerate launch's config).
    Options posttrain cannot honour where it shards itself are ConfigErrors."""
    if native:
        if int(plugin.fsdp_version) != 2:
            raise ConfigError(
                "FSDP1 needs GPUs; on CPU processes posttrain shards with FSDP2. Drop fsdp_config version 1 "
                "(or fsdp_version: 1 in the accelerate config)."
            )
        offload = plugin.cpu_offload  # a bool, FSDP1's CPUOffload or FSDP2's (CPU)OffloadPolicy
        if offload is True or type(offload).__name__ == "CPUOffloadPolicy" or getattr(offload, "offload_params", 0):
            raise ConfigError(
                "--fsdp offload (cpu_offload) moves parameters to CPU memory, where they already are on a CPU run; "
                "drop offload."
            )
        if plugin.activation_checkpointing:
            raise ConfigError(
                "fsdp_config activation_checkpointing is applied by accelerate on GPUs only; use "
                "--gradient_checkpointing instead."
            )
    policy = getattr(plugin.auto_wrap_policy, "__name__", plugin.auto_wrap_policy)
    min_num_params = int(getattr(plugin, "min_num_params", 0) or 0) if policy == "size_based_auto_wrap_policy" else 0
    reshard = plugin.reshard_after_forward
    return ShardingPlan(
        reshard_after_forward=reshard if isinstance(reshard, bool) else str(reshard).upper() != "SHARD_GRAD_OP",
        layer_classes=tuple(getattr(plugin, "transformer_cls_names_to_wrap", None) or ()),
        min_num_params=min_num_params,
        auto_wrap=policy is not None,
        native=native,
    )


def sharding_plan(accelerator: Accelerator | None) -> ShardingPlan | None:
    """The run's FSDP2 plan (None: models are not sharded)."""
    if accelerator is None:
        return None
    try:
        return _PLANS.get(accelerator)
    except TypeError:  # a stand-in object that takes no weak reference was never registered
        return None


def _register_sharding(accelerator: Accelerator, plugin: Any) -> None:
    """Remember how this run shards: accelerate's FSDP (GPUs), or posttrain's own FSDP2 over the gloo
    group of several CPU processes. ConfigError where neither can (one process)."""
    if accelerator.distributed_type.value == "FSDP":
        _PLANS[accelerator] = _plan_from_plugin(plugin, native=False)
        return
    if accelerator.distributed_type.value == "MULTI_CPU" and accelerator.num_processes > 1:
        _PLANS[accelerator] = _plan_from_plugin(plugin, native=True)
        return
    raise ConfigError(
        f"--fsdp needs several processes (torchrun / accelerate launch with 2 or more); this run is "
        f"{accelerator.distributed_type.value} on {accelerator.device.type} with {accelerator.num_processes} "
        "process(es), where nothing can be sharded. Drop --fsdp here."
    )


def _mesh(accelerator: Accelerator) -> Any:
    if accelerator not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[accelerator] = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    return _MESHES[accelerator]


def _tied_param_owners(model: nn.Module) -> dict[int, int]:
    """id(parameter) -> how many modules hold it directly (2 or more: tied weights)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return owners


def _layer_classes(model: nn.Module, plan: ShardingPlan) -> set[str]:
    if plan.layer_classes:
        return set(plan.layer_classes)
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def shard_units(model: nn.Module, plan: ShardingPlan) -> list[nn.Module]:
    """The submodules that become FSDP units, children before parents (the root is not listed).

    First the layers (plan.layer_classes, else the classes the model's `_no_split_modules` name; or by
    size with min_num_params), then every other module that holds parameters itself, so that whichever
    module a trainer calls (a backbone, a score head, a value head) gathers its own parameters. Modules
    holding a tied weight (e.g. embeddings tied to the LM head) stay in the root's unit, so a tied weight
    lives in one unit. ConfigError when auto_wrap finds no layer to wrap."""
    owners = _tied_param_owners(model)

    def has_tied(module: nn.Module) -> bool:
        return any(owners[id(p)] > 1 for p in module.parameters())

    layers: list[nn.Module] = []
    if plan.auto_wrap and plan.min_num_params > 0:

        def visit(module: nn.Module) -> int:
            count = sum(p.numel() for p in module.parameters(recurse=False))
            for child in module.children():
                count += visit(child)
            if module is not model and count >= plan.min_num_params and not has_tied(module):
                layers.append(module)
                return 0
            return count

        visit(model)
    elif plan.auto_wrap:
        classes = _layer_classes(model, plan)
        layers = [m for m in model.modules() if type(m).__name__ in classes and m is not model]
        if not layers:
            where = f"the class(es) {sorted(classes)}" if classes else "no _no_split_modules (no known layer class)"
            raise ConfigError(
                f"--fsdp auto_wrap cannot shard {type(model).__name__}: it has {where} to wrap as units. Set "
                '--fsdp_config \'{"transformer_layer_cls_to_wrap": "<its decoder layer class>"}\' or '
                "'{\"min_num_params\": 1000000}'."
            )
    inside = {id(m) for layer in layers for m in layer.modules()}
    rest = [
        m
        for m in model.modules()
        if m is not model and id(m) not in inside and any(True for _ in m.parameters(recurse=False))
    ]
    return layers + [m for m in rest if not has_tied(m)]


def _shard(model: nn.Module, accelerator: Accelerator, plan: ShardingPlan) -> nn.Module:
    """fully_shard every unit of `model`, then the root (in place); the root is initialised at once, so it
    stays the root whichever submodule runs first (e.g. PPO generates with the LM inside the wrapper)."""
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(accelerator)
    model.to(accelerator.device)
    for unit in shard_units(model, plan):
        fully_shard(unit, mesh=mesh, reshard_after_forward=plan.reshard_after_forward)
    fully_shard(model, mesh=mesh)
    _init_root(model)
    _ROOTS[model] = plan
    return model


def _init_root(model: nn.Module) -> None:
    # FSDP2 makes the first module to run forward the root; run its lazy init now (torch has no public call).
    model._get_fsdp_state()._lazy_init()


def prepare_trained(model: nn.Module, optimizer: Any, accelerator: Accelerator) -> tuple[nn.Module, Any]:
    """(model, optimizer) ready to train: `accelerator.prepare` (DDP, DeepSpeed, accelerate's FSDP), or,
    where posttrain shards itself, the model sharded in place and the optimizer moved onto the sharded
    (DTensor) parameters, so each rank keeps the optimizer state of its own shards only."""
    plan = sharding_plan(accelerator)
    if plan is None or not plan.native:
        wrapped, optimizer = accelerator.prepare(model, optimizer)
        if plan is not None and _is_fsdp2(wrapped):
            _init_root(wrapped)
            _ROOTS[wrapped] = plan
        return wrapped, optimizer
    names = {id(p): name for name, p in model.named_parameters()}
    owned = [p for group in optimizer.param_groups for p in group["params"]]
    if any(id(p) not in names for p in owned):
        raise ConfigError(
            "the optimizer holds parameters that are not the model's; under --fsdp build it over model.parameters()."
        )
    _shard(model, accelerator, plan)
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        full_params, group["params"] = group["params"], [sharded[names[id(p)]] for p in group["params"]]
        for old, new in zip(full_params, group["params"]):
            if old in optimizer.state:  # restored from a checkpoint before sharding: keep this rank's shard
                optimizer.state[new] = {k: _shard_like(v, new) for k, v in optimizer.state.pop(old).items()}
    return model, accelerator.prepare(optimizer)


def _shard_like(value: Any, param: Any) -> Any:
    """An optimizer state tensor of a full parameter, cut like its sharded (DTensor) parameter."""
    if not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return value  # e.g. Adam's step count
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)


def _is_fsdp2(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def _sharded_root(module: nn.Module) -> nn.Module | None:
    """The sharded root model that `module` is (part of), or None."""
    for root in list(_ROOTS.keys()):
        if root is module or any(m is module for m in root.modules()):
            return root
    return None


@contextlib.contextmanager
def gathered(module: nn.Module, everything: bool = True) -> Iterator[None]:
    """Within the body, the parameters of the sharded root that holds `module` stay gathered: its own
    unit's (what a call of a submodule needs) and, with `everything`, those of every unit inside
    `module`, all-gathered once instead of at every forward (FSDP2's unshard / reshard). A no-op for
    a model that is not sharded."""
    root = _sharded_root(module)
    if root is None:
        yield
        return
    plan = _ROOTS[root]
    units = [root]
    if everything:
        units += [m for m in module.modules() if m is not root and _is_fsdp2(m)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(plan.reshard_after_forward and unit is not root, recurse=False)


def clip_grad_norm(accelerator: Accelerator, parameters: Any, max_norm: float) -> float:
    """Clip the global gradient norm over all ranks (sharded gradients included); returns the norm before clipping."""
    norm = accelerator.clip_grad_norm_(parameters, max_norm)
    full = getattr(norm, "full_tensor", None)  # a DTensor norm of sharded gradients
    return float(full() if full is not None else norm)


def full_state_dict(model: nn.Module, accelerator: Accelerator | None) -> dict[str, torch.Tensor] | None:
    """The full weights of a sharded `model` (or of a module inside one), gathered by every rank (a
    collective): on the main process a CPU state dict, {} elsewhere. None when `model` is not sharded."""
    root = _sharded_root(model)
    if root is None:
        return None
    for unit in root.modules():
        if _is_fsdp2(unit):
            unit.reshard()
    main, out, seen = is_main(accelerator), {}, {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) not in seen:
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            seen[id(value)] = full.detach().cpu() if main else None
        if main:
            out[key] = seen[id(value)]
    return out
