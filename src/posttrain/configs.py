"""Shared configuration dataclasses.

Every trainer config extends `TrainingConfig` (optimisation, logging, saving, model and data
locations) and the online trainers extend `OnPolicyConfig` (rollout sizes and generation). Field
names, meanings and defaults follow TRL's `TrainingArguments` / `OnPolicyConfig` (see
TRL's `OnPolicyConfig`) so code and command lines written for TRL port unchanged.
Each field's `help` metadata is its `--help` text on the command line.

This module imports only the standard library (and posttrain.compat, which reads package metadata):
`posttrain --help` and config validation run before
torch loads.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

from posttrain import compat


def flag(text: str, **kw: Any) -> Any:
    """A config field whose `help` text is its `--help` line on the command line."""
    return field(metadata={"help": text}, **kw)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field(s) and the fix."""


CPU_LINEAR_ENV = "POSTTRAIN_CPU_LINEAR"
CPU_LINEAR_MODES = ("auto", "onednn", "off")


def _env_mode(name: str, modes: tuple[str, ...]) -> str:
    """The environment variable `name`, lower-cased, one of `modes` (unset or empty: the first)."""
    value = os.environ.get(name, modes[0]).strip().lower() or modes[0]
    if value not in modes:
        choices = ", ".join(modes)
        raise ConfigError(f"{name}={value!r}: expected one of {choices} (unset it for the default, {modes[0]}).")
    return value


def cpu_linear_mode() -> str:
    """POSTTRAIN_CPU_LINEAR, which `posttrain.cpu_linear` reads: `auto` (unset or empty), `onednn` or `off`."""
    return _env_mode(CPU_LINEAR_ENV, CPU_LINEAR_MODES)


TRACE_DECODE_ENV = "POSTTRAIN_TRACE_DECODE"
TRACE_DECODE_MODES = ("auto", "off")


def trace_decode_mode() -> str:
    """POSTTRAIN_TRACE_DECODE, which `posttrain.decode_trace` reads: `auto` (unset or empty) or `off`."""
    return _env_mode(TRACE_DECODE_ENV, TRACE_DECODE_MODES)


MALLOC_ENV = "POSTTRAIN_MALLOC"
MALLOC_MODES = ("auto", "off")


def malloc_mode() -> str:
    """POSTTRAIN_MALLOC, which `posttrain.runtime.reuse_freed_memory` reads: `auto` (unset or empty) or `off`."""
    return _env_mode(MALLOC_ENV, MALLOC_MODES)


CONCURRENT_DECODE_ENV = "POSTTRAIN_CONCURRENT_DECODE"
CONCURRENT_DECODE_MODES = ("auto", "off")


def concurrent_decode_mode() -> str:
    """POSTTRAIN_CONCURRENT_DECODE, which XPO's rollouts read (`trainers.online.sample_with_reference`): `auto`
    (unset or empty) or `off`."""
    return _env_mode(CONCURRENT_DECODE_ENV, CONCURRENT_DECODE_MODES)


SHARED_PROMPTS_ENV = "POSTTRAIN_SHARED_PROMPTS"
SHARED_PROMPTS_MODES = ("auto", "off")


def shared_prompts_mode() -> str:
    """POSTTRAIN_SHARED_PROMPTS, which `posttrain.scoring`'s forwards over a rollout read: `auto` (unset or
    empty: completions of the same prompt share one pass over it where that costs fewer operations, and the
    chunked forwards and the update's micro-batches keep them together) or `off`."""
    return _env_mode(SHARED_PROMPTS_ENV, SHARED_PROMPTS_MODES)


@dataclass
class TrainingConfig:
    """Fields every trainer shares: where to read and write, how to optimise, log and save."""

    output_dir: str = flag("Where models, checkpoints, metrics.jsonl and plots are written.", default="outputs/run")
    model_name_or_path: str | None = flag(
        "Policy (or model to train): a local folder saved with save_pretrained or a hub name.", default=None
    )
    dataset_name: str | None = flag(
        "Training data: a hub dataset name, a folder saved with datasets.save_to_disk, or a "
        ".jsonl/.json/.parquet/.csv file.",
        default=None,
    )
    dataset_config: str | None = flag("Configuration name of a hub dataset.", default=None)
    dataset_streaming: bool = flag(
        "Online trainers: read the training split as a stream (datasets' streaming=True) instead of loading it "
        "whole; needs max_steps. Rows are read in the stream's order.",
        default=False,
    )
    dataset_train_split: str = flag("Split used for training.", default="train")
    dataset_test_split: str = flag("Split used for evaluation and sample generations.", default="test")
    learning_rate: float = flag("Initial learning rate of the optimizer (optim).", default=5e-5)
    per_device_train_batch_size: int = flag("Batch size per device per micro-step.", default=8)
    per_device_eval_batch_size: int = flag("Batch size per device for evaluation.", default=8)
    gradient_accumulation_steps: int = flag("Micro-steps accumulated before each optimizer step.", default=1)
    num_train_epochs: float = flag(
        "Passes over the training data (when max_steps / total_episodes are not set).", default=3.0
    )
    max_steps: int = flag(
        "If > 0: total optimizer steps, overriding num_train_epochs (online trainers: and total_episodes; "
        "they run ceil(max_steps / optimizer steps per rollout batch) rollout batches).",
        default=-1,
    )
    lr_scheduler_type: str = flag(
        "Learning-rate schedule: linear, cosine, cosine_with_restarts, polynomial, constant, constant_with_warmup.",
        default="linear",
    )
    warmup_ratio: float = flag("Fraction of total steps used for linear warmup.", default=0.0)
    warmup_steps: int = flag("Warmup steps (overrides warmup_ratio when > 0).", default=0)
    weight_decay: float = flag("Weight decay of the optimizer (optim), on every parameter.", default=0.0)
    adam_beta1: float = flag("AdamW beta1.", default=0.9)
    adam_beta2: float = flag("AdamW beta2.", default=0.999)
    adam_epsilon: float = flag("AdamW epsilon.", default=1e-8)
    max_grad_norm: float | None = flag(
        "Clip the global gradient norm to this value (None or 0: no clipping).", default=1.0
    )
    seed: int = flag("Random seed for python, numpy and torch (sampling included).", default=42)
    bf16: bool | None = flag(
        "bf16 mixed precision (autocast). Fast on GPUs, and on CPUs with native bf16 (AMX or AVX512-BF16) for "
        "models of ~70M parameters and more. None: off (posttrain never turns it on by itself: CPUs without "
        "native bf16 emulate it ~100x slower).",
        default=None,
    )
    fp16: bool = flag("fp16 mixed precision (GPU only).", default=False)
    torch_dtype: str | None = flag("dtype to load weights in: float32, bfloat16, float16 or auto.", default=None)
    trust_remote_code: bool = flag("Allow model code from the hub.", default=False)
    gradient_checkpointing: bool = flag("Recompute activations in backward to save memory.", default=False)
    disable_dropout: bool = flag("Turn off dropout in every model (needed for exact PPO ratios).", default=True)
    logging_steps: float = flag(
        'With logging_strategy="steps": log metrics every N optimizer steps (online trainers: every N rollout '
        "batches); a value in (0, 1) is a ratio of the total steps, rounded up (as transformers).",
        default=10,
    )
    eval_steps: float | None = flag(
        'With eval_strategy="steps": evaluate every N steps (None: logging_steps); a value in (0, 1) is a ratio '
        'of the total steps. Setting it while eval_strategy is "no" selects "steps".',
        default=None,
    )
    save_steps: float = flag(
        'With save_strategy="steps": save a resumable checkpoint every N steps (0: never during training); a '
        "value in (0, 1) is a ratio of the total steps.",
        default=500,
    )
    save_total_limit: int | None = flag("Keep at most this many checkpoints (oldest deleted).", default=None)
    report_to: list[str] | None = flag(
        "Metric sinks besides console and metrics.jsonl: none, tensorboard, wandb, all (None: none, as in "
        "transformers 5).",
        default=None,
    )
    run_name: str | None = flag("Run name for trackers.", default=None)
    resume_from_checkpoint: str | None = flag(
        'Resume from a checkpoint folder, or "latest" for the newest one in output_dir.', default=None
    )
    overwrite_output_dir: bool = flag(
        "Allow writing into a non-empty output_dir that holds a finished run.", default=False
    )
    dataset_num_proc: int | None = flag("Processes for dataset preprocessing.", default=None)
    # LoRA flags of TRL's ModelConfig (same names and defaults), turned into a peft.LoraConfig by
    # posttrain.models.peft_config_from.
    use_peft: bool = flag(
        "Train LoRA adapters instead of the full model (needs `pip install posttrain[peft]`).", default=False
    )
    lora_r: int = flag("LoRA rank.", default=16)
    lora_alpha: int = flag("LoRA alpha (the update is scaled by lora_alpha / lora_r).", default=32)
    lora_dropout: float = flag("Dropout on the LoRA input.", default=0.05)
    lora_target_modules: list[str] | None = flag(
        'Module names to adapt, e.g. q_proj v_proj, or "all-linear" (None: peft\'s default for the architecture).',
        default=None,
    )
    lora_modules_to_save: list[str] | None = flag(
        "Modules trained fully and saved with the adapter (e.g. a new head).", default=None
    )
    lora_task_type: str = flag(
        'PEFT task type: "CAUSAL_LM" (the reward command uses "SEQ_CLS" for its score head).', default="CAUSAL_LM"
    )

    # -- the rest of transformers.TrainingArguments (TRL's configs subclass it; see docs/internals.md) ---
    do_train: bool = flag(
        "Not used by the trainers (as in transformers): a switch for your own scripts.", default=False
    )
    do_eval: bool = flag("Not used by the trainers (as in transformers): a switch for your own scripts.", default=False)
    do_predict: bool = flag(
        "Not used by the trainers (as in transformers): a switch for your own scripts.", default=False
    )
    eval_strategy: str = flag(
        'When to evaluate the eval dataset during training: "no", "steps" (every eval_steps) or "epoch" (at the '
        "end of each pass over the training data). SFT and reward training also evaluate once after the last step.",
        default="no",
    )
    eval_delay: float | None = flag(
        "Steps (eval_strategy steps) or epochs (eval_strategy epoch) to wait before the first evaluation.", default=0
    )
    eval_on_start: bool = flag("Evaluate once before the first training step (a sanity check).", default=False)
    logging_strategy: str = flag(
        'When to log training metrics: "no", "steps" (every logging_steps) or "epoch" (at the end of each pass); '
        'besides, the last step logs unless "no".',
        default="steps",
    )
    logging_first_step: bool = flag("Also log after the first step.", default=False)
    logging_dir: str | None = flag(
        "TensorBoard log folder (with report_to tensorboard; default: <output_dir>/runs/<run_name or start time>).",
        default=None,
    )
    logging_nan_inf_filter: bool = flag(
        "Keep non-finite losses out of the logged averages (posttrain always does: a non-finite step is skipped "
        "on every rank); False is refused.",
        default=True,
    )
    save_strategy: str = flag(
        'When to save checkpoints: "no", "steps" (every save_steps), "epoch" (end of each pass) or "best" (after '
        "each evaluation that improves metric_for_best_model). The last step writes none: the final model follows.",
        default="steps",
    )
    save_only_model: bool = flag(
        "Checkpoints hold only the model weights (no optimizer, scheduler or RNG state): resuming from one is refused.",
        default=False,
    )
    save_safetensors: bool | None = flag("Write weights as safetensors (posttrain always does).", default=True)
    save_on_each_node: bool = flag("Multi-node without a shared disk: every node's main process saves.", default=False)
    restore_callback_states_from_checkpoint: bool = flag(
        "On resume, restore the state of stateful callbacks (transformers.ExportableState) saved in the checkpoint.",
        default=False,
    )
    load_best_model_at_end: bool | None = flag(
        "Track the best evaluation by metric_for_best_model (state.best_metric, state.best_model_checkpoint), never "
        "rotate its checkpoint away, and load it at the end, so the final model is the best one (SFT and reward "
        'training). Needs save_strategy equal to eval_strategy (or "best").',
        default=False,
    )
    metric_for_best_model: str | None = flag(
        'Evaluation metric that picks the best model, with or without its "eval_" prefix (default "loss" with '
        "load_best_model_at_end).",
        default=None,
    )
    greater_is_better: bool | None = flag(
        "Whether a larger metric_for_best_model is better (default: False for names ending in loss, True otherwise).",
        default=None,
    )
    lr_scheduler_kwargs: dict[str, Any] | str | None = flag(
        "Extra keyword arguments of the learning-rate schedule (transformers.get_scheduler's "
        "scheduler_specific_kwargs), as JSON on the command line, e.g. '{\"num_cycles\": 2}' for "
        "cosine_with_restarts or '{\"min_lr\": 1e-6}' for cosine_with_min_lr. Refused for constant schedules.",
        default_factory=dict,
    )
    optim: str = flag(
        "Optimizer: adamw_torch, adamw_torch_fused, adafactor (transformers' Adafactor with an external lr), "
        "sgd, adagrad, rmsprop, or with bitsandbytes installed adamw_bnb_8bit, adamw_8bit, paged_adamw_8bit, "
        "paged_adamw_32bit, lion_8bit, lion_32bit, paged_lion_8bit, paged_lion_32bit, rmsprop_bnb, "
        "rmsprop_bnb_8bit, rmsprop_bnb_32bit. All take learning_rate and weight_decay; the Adam ones "
        "adam_beta1/2 and adam_epsilon; Lion the betas. Default: transformers' TrainingArguments default on this "
        "install (adamw_torch_fused from transformers 4.54 with torch >= 2.8, else adamw_torch).",
        default=compat.default_optim(),
    )
    optim_args: str | None = flag(
        'Extra optimizer keyword arguments as "key=value,key=value" (e.g. "momentum=0.9,nesterov=true" for sgd); '
        "numbers and true/false are converted, and they override the values above. An argument the optimizer "
        "does not take is an error.",
        default=None,
    )
    adafactor: bool = flag("Deprecated alias of optim=adafactor.", default=False)
    optim_target_modules: list[str] | str | None = flag(
        "Modules for GaLore-style optimizers (not supported by posttrain).", default=None
    )
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = flag(
        "Keyword arguments of gradient_checkpointing_enable, as JSON (e.g. '{\"use_reentrant\": true}'); "
        'given keys replace posttrain\'s default {"use_reentrant": false} (works with frozen inputs and LoRA).',
        default=None,
    )
    activation_checkpointing: bool | None = flag(
        "transformers >= 5 name of gradient_checkpointing (given, it sets gradient_checkpointing, which mirrors it).",
        default=None,
    )
    activation_checkpointing_kwargs: dict[str, Any] | str | None = flag(
        "transformers >= 5 name of gradient_checkpointing_kwargs. Besides torch.utils.checkpoint's keys, "
        '"every_n_layers" (checkpoint only every n-th decoder layer) and "offload" (keep the saved activations in '
        "host memory) need a transformers with activation_checkpointing_enable.",
        default=None,
    )
    use_cache: bool = flag(
        "Let training forwards return a KV cache (not supported: generation uses posttrain.rollout's own cache).",
        default=False,
    )
    torch_compile: bool = flag(
        "Compile the trained model's forward with torch.compile (in place: saved weights keep their names). "
        "Online trainers generate with the uncompiled forward (decoding changes shapes every token); "
        'cache_implementation="static" compiles their decode step instead.',
        default=False,
    )
    torch_compile_backend: str | None = flag(
        "torch.compile backend (default inductor); setting it turns torch_compile on.", default=None
    )
    torch_compile_mode: str | None = flag(
        "torch.compile mode: default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs; setting it turns "
        "torch_compile on.",
        default=None,
    )
    torchdynamo: str | None = flag("Deprecated alias of torch_compile_backend.", default=None)
    dataloader_num_workers: int = flag(
        "SFT / reward: worker processes that collate the training batches (0: the main process). Online "
        "trainers draw prompt batches in-process and ignore it (with a warning).",
        default=0,
    )
    dataloader_prefetch_factor: int | None = flag(
        "SFT / reward: optimizer steps' batches each worker prepares ahead (needs dataloader_num_workers > 0).",
        default=None,
    )
    dataloader_pin_memory: bool = flag(
        "SFT / reward: pin the training batches' memory for faster host-to-GPU copies (CUDA only). Online "
        "trainers' prompt batches are never pinned.",
        default=True,
    )
    dataloader_persistent_workers: bool = flag(
        "SFT / reward: keep the data-loader workers alive from one epoch to the next (needs "
        "dataloader_num_workers > 0).",
        default=False,
    )
    dataloader_drop_last: bool = flag(
        "SFT / reward: each epoch ends at its last complete batch (fewer steps per epoch). Online trainers always "
        "drop an epoch's incomplete prompt batch.",
        default=False,
    )
    dataloader_multiprocessing_context: str | None = flag(
        'SFT / reward: start method of the data-loader workers ("fork", "spawn" or "forkserver"; needs '
        "dataloader_num_workers > 0). None: torch's default.",
        default=None,
    )
    dataloader_in_order: bool = flag(
        "Yield batches in the order they were dispatched (False is not supported: the loader yields one item per "
        "optimizer step, which an exact resume replays in order).",
        default=True,
    )
    train_sampling_strategy: str = flag(
        '"random": a new seeded order of the training examples (online: prompts) every epoch; "sequential": dataset '
        "order. group_by_length and batch_rebalance are not supported.",
        default="random",
    )
    data_seed: int | None = flag(
        "Seed of the data order only (SFT / reward example order, online prompt order); default: seed. Model "
        "initialisation, dropout and sampling follow seed.",
        default=None,
    )
    full_determinism: bool = flag(
        "transformers.enable_full_determinism(seed): deterministic algorithms, cuDNN / cuBLAS settings; slower.",
        default=False,
    )
    disable_tqdm: bool | None = flag("Hide progress bars (None: shown on the main process).", default=None)
    use_cpu: bool = flag(
        "Train on the CPU even when a GPU is available (accelerate's Accelerator(cpu=True)).", default=False
    )
    no_cuda: bool = flag("Deprecated alias of use_cpu.", default=False)
    use_mps_device: bool = flag("Deprecated: Apple MPS is used automatically when available.", default=False)
    tf32: bool | None = flag(
        "True / False: switch TF32 matmuls and cuDNN convolutions on / off (needs an Ampere or newer GPU: "
        "True is an error elsewhere). None: torch's setting.",
        default=None,
    )
    torch_empty_cache_steps: int | None = flag(
        "Empty the accelerator's memory cache (torch.cuda.empty_cache) every N optimizer steps: less peak "
        "memory, a little slower. None: never.",
        default=None,
    )
    neftune_noise_alpha: float | None = flag(
        "NEFTune (Jain et al. 2023, arXiv:2310.05914): while training, add uniform noise in ±alpha/sqrt(L·d) to the "
        "input embeddings (L tokens, d dimensions); evaluation and generation are unchanged (SFT and reward).",
        default=None,
    )
    per_gpu_train_batch_size: int | None = flag("Deprecated alias of per_device_train_batch_size.", default=None)
    per_gpu_eval_batch_size: int | None = flag("Deprecated alias of per_device_eval_batch_size.", default=None)
    eval_accumulation_steps: int | None = flag(
        "Move accumulated eval predictions to the CPU every N steps (posttrain keeps no predictions).", default=None
    )
    prediction_loss_only: bool = flag("Evaluation returns only the loss (posttrain's does).", default=False)
    log_level: str = flag(
        "transformers' and posttrain's log level on the main process: debug, detail, info, warning, error, critical "
        "or passive (leave as set).",
        default="passive",
    )
    log_level_replica: str = flag("Log level of the other processes (same choices).", default="warning")
    log_on_each_node: bool = flag(
        "Multi-node: each node's main process logs at log_level (False: only the first node's).", default=True
    )
    local_rank: int = flag("Set by the launcher (torchrun / accelerate); read from the environment.", default=-1)
    ddp_backend: str | None = flag(
        "torch.distributed backend: nccl, gloo, mpi, ccl, hccl, cncl, mccl, xccl (None: accelerate picks).",
        default=None,
    )
    ddp_timeout: int = flag("Seconds a collective waits before the process group times out.", default=1800)
    ddp_find_unused_parameters: bool | None = flag(
        "DDP find_unused_parameters (None: DDP's default, False).", default=None
    )
    ddp_bucket_cap_mb: int | None = flag("DDP gradient bucket size in MiB (None: DDP's default, 25).", default=None)
    ddp_broadcast_buffers: bool | None = flag("DDP broadcast_buffers (None: DDP's default, True).", default=None)
    ddp_static_graph: bool | None = flag(
        "DDP static_graph: the set of parameters used, and the graph, are the same every step (None: DDP's default, "
        "False).",
        default=None,
    )
    parallelism_config: dict[str, Any] | str | None = flag(
        "accelerate ParallelismConfig for tensor / context / sequence parallelism (not supported).", default=None
    )
    enable_jit_checkpoint: bool = flag(
        "On SIGTERM (a preemption), finish the current optimizer step (online: rollout batch), save a resumable "
        "checkpoint in output_dir and stop; resume with --resume_from_checkpoint latest.",
        default=False,
    )
    project: str = flag("Trackio project name (Trackio is not among posttrain's trackers).", default="huggingface")
    trackio_space_id: str | None = flag("Trackio Space (Trackio is not among posttrain's trackers).", default=None)
    trackio_bucket_id: str | None = flag("Trackio Bucket (Trackio is not among posttrain's trackers).", default=None)
    trackio_static_space_id: str | None = flag(
        "Trackio static Space (Trackio is not among posttrain's trackers).", default=None
    )
    fsdp: list[str] | str | None = flag(
        'FSDP (FSDP2 unless fsdp_config says version 1) through accelerate, on GPUs: "full_shard" or '
        '"shard_grad_op", "offload", "auto_wrap" (space separated; FSDP1 also "hybrid_shard", "no_shard").',
        default="",
    )
    fsdp_config: dict[str, Any] | str | None = flag(
        "FSDP options, a JSON file path or object with transformers' keys: version, min_num_params, "
        "transformer_layer_cls_to_wrap, auto_wrap_policy, reshard_after_forward, offload_params, state_dict_type, "
        "activation_checkpointing, cpu_ram_efficient_loading (FSDP1: backward_prefetch, forward_prefetch, "
        "limit_all_gathers, use_orig_params, sync_module_states).",
        default=None,
    )
    fsdp_min_num_params: int = flag("Deprecated (fsdp_config min_num_params): auto-wrap size threshold.", default=0)
    fsdp_transformer_layer_cls_to_wrap: str | None = flag(
        "Deprecated (fsdp_config transformer_layer_cls_to_wrap): layer class names to wrap.", default=None
    )
    deepspeed: dict[str, Any] | str | None = flag(
        'DeepSpeed: a JSON config file path or object; "auto" values are filled from the batch, optimizer and '
        "precision flags (needs `pip install deepspeed`).",
        default=None,
    )
    accelerator_config: dict[str, Any] | str | None = flag(
        "accelerate options, a JSON file or object with transformers' keys (split_batches, dispatch_batches, "
        "even_batches, use_seedable_sampler, non_blocking, use_configured_state, gradient_accumulation_kwargs); "
        'values posttrain cannot honour are refused. {"gradient_accumulation_kwargs": {"sync_each_batch": true}} '
        "all-reduces every micro-batch (less memory under DDP).",
        default=None,
    )
    half_precision_backend: str = flag('Mixed-precision backend: "auto" (torch amp).', default="auto")
    fp16_opt_level: str = flag("apex AMP level (apex is not supported: torch amp is used).", default="O1")
    fp16_backend: str = flag("Deprecated alias of half_precision_backend.", default="auto")
    bf16_full_eval: bool = flag("Evaluate in pure bf16 (not supported).", default=False)
    fp16_full_eval: bool = flag("Evaluate in pure fp16 (not supported).", default=False)
    jit_mode_eval: bool = flag("TorchScript for inference (not supported).", default=False)
    use_ipex: bool = flag("Intel extension for PyTorch (not supported).", default=False)
    tpu_num_cores: int | None = flag("TPU cores (TPUs are not supported).", default=None)
    tpu_metrics_debug: bool = flag("Deprecated TPU debug metrics (not supported).", default=False)
    debug: list[str] | str = flag("transformers debug options (not supported).", default="")
    past_index: int = flag("Index of past states in model outputs (not supported).", default=-1)
    remove_unused_columns: bool | None = flag(
        "Drop dataset columns the model does not take. posttrain's data preparation keeps only what it "
        "tokenizes and passes every column to reward functions, whatever this says.",
        default=True,
    )
    label_names: list[str] | None = flag("Label keys of the inputs (not supported).", default=None)
    ignore_data_skip: bool = flag(
        "On resume, do not skip the batches already seen (not supported: resume is exact).", default=False
    )
    label_smoothing_factor: float = flag("Label smoothing (not supported).", default=0.0)
    group_by_length: bool = flag("Batch examples of similar length together (not supported).", default=False)
    length_column_name: str | None = flag("Column with precomputed lengths for group_by_length.", default="length")
    skip_memory_metrics: bool = flag("Skip transformers' memory profiler metrics.", default=True)
    use_legacy_prediction_loop: bool = flag("transformers' old prediction loop (not supported).", default=False)
    include_inputs_for_metrics: bool = flag(
        "Deprecated: pass inputs to compute_metrics (not supported).", default=False
    )
    include_for_metrics: list[str] = flag("Extra data passed to compute_metrics (not supported).", default_factory=list)
    eval_do_concat_batches: bool = flag("Concatenate eval batches (not supported).", default=True)
    batch_eval_metrics: bool = flag("compute_metrics per batch (not supported).", default=False)
    eval_use_gather_object: bool | None = flag("Gather nested eval objects (not supported).", default=False)
    mp_parameters: str = flag("SageMaker model-parallel parameters (not supported).", default="")
    auto_find_batch_size: bool = flag("Halve the batch size on out-of-memory (not supported).", default=False)
    ray_scope: str | None = flag("Ray Tune scope of hyperparameter search (not supported).", default="last")
    include_tokens_per_second: bool | None = flag(
        "Add train_tokens_per_second (input tokens, padding included, over all processes) to the end-of-training "
        "summary (SFT and reward).",
        default=False,
    )
    include_num_input_tokens_seen: bool | None = flag(
        "Add num_input_tokens_seen (input tokens so far, padding included, all processes) and "
        'train_tokens_per_second (this train() call) to every log entry (SFT and reward). transformers 5\'s "all" '
        'is True, "no" False, and "non_padding" counts the attended tokens only.',
        default=False,
    )
    use_liger_kernel: bool | None = flag("Liger kernels (not supported).", default=False)
    liger_kernel_config: dict[str, bool] | str | None = flag("Liger kernel options (not supported).", default=None)
    average_tokens_across_devices: bool | None = flag(
        "Normalise the loss by the token count of every process, not each one's (posttrain always does).",
        default=True,
    )
    model_init_kwargs: dict[str, Any] | str | None = flag(
        "Extra keyword arguments for from_pretrained of every model loaded from a path (online trainers: policy, "
        "reference, reward and value models), as JSON on the command line "
        '(e.g. \'{"attn_implementation": "sdpa"}\').',
        default=None,
    )
    push_to_hub: bool = flag(
        "Upload the model, its tokenizer and a model card to the Hugging Face Hub at the end of train() "
        "and, by hub_strategy, at each checkpoint save (main process only; training waits for each upload).",
        default=False,
    )
    hub_model_id: str | None = flag(
        'Hub repository to push to, "name" (in your namespace) or "org/name" (default: the output_dir name).',
        default=None,
    )
    hub_strategy: str = flag(
        'What is pushed and when: "end" (at the end of training only), "every_save" (also the model and card '
        'at each checkpoint save), "checkpoint" (also the newest checkpoint as last-checkpoint/, to resume '
        'from), "all_checkpoints" (every checkpoint folder).',
        default="every_save",
    )
    hub_token: str | None = flag(
        "Hub token (default: the logged-in one). Never written to output_dir or the model card.", default=None
    )
    hub_private_repo: bool | None = flag(
        "Create the Hub repository private (default: the account's default; no effect if it exists).", default=None
    )
    hub_always_push: bool = flag(
        "Push at every save even while the previous push runs. posttrain's pushes are synchronous, so every "
        "save is always pushed; accepted for compatibility.",
        default=False,
    )
    hub_revision: str | None = flag("Hub branch to push to (created if missing; default: main).", default=None)
    push_to_hub_model_id: str | None = flag("Deprecated alias of hub_model_id.", default=None)
    push_to_hub_organization: str | None = flag("Deprecated: write hub_model_id as organization/name.", default=None)
    push_to_hub_token: str | None = flag("Deprecated alias of hub_token.", default=None)

    def __post_init__(self) -> None:
        self._resolve_aliases()
        refuse_unsupported(self)
        cpu_linear_mode()  # read by train(); a bad value fails here, before any model loads
        trace_decode_mode()  # read by the decode loop; the same
        malloc_mode()  # read when training starts; the same
        concurrent_decode_mode()  # read by XPO's rollouts; the same
        shared_prompts_mode()  # read by the forwards over a rollout; the same
        if self.bf16 is None:
            self.bf16 = False
        if self.report_to is None:
            self.report_to = ["none"]
        if isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        self.report_to = [r for part in self.report_to for r in str(part).split(",") if r]
        checks = [
            ("learning_rate", self.learning_rate >= 0, "must be >= 0"),
            ("per_device_train_batch_size", self.per_device_train_batch_size >= 1, "must be >= 1"),
            ("per_device_eval_batch_size", self.per_device_eval_batch_size >= 1, "must be >= 1"),
            ("gradient_accumulation_steps", self.gradient_accumulation_steps >= 1, "must be >= 1"),
            ("warmup_ratio", 0.0 <= self.warmup_ratio <= 1.0, "must be within [0, 1]"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ConfigError(f"{name}={getattr(self, name)!r} {why}.")
        if self.bf16 and self.fp16:
            raise ConfigError("bf16 and fp16 are both set; choose one mixed-precision mode.")
        valid_sinks = {"none", "all", "tensorboard", "wandb"}
        bad = [r for r in self.report_to if r not in valid_sinks]
        if bad:
            raise ConfigError(f"report_to has unknown sink(s) {bad}; valid: {sorted(valid_sinks)}.")
        if self.use_peft and self.lora_r < 1:
            raise ConfigError(f"lora_r={self.lora_r} must be >= 1.")
        if self.use_peft and not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"lora_dropout={self.lora_dropout} must be within [0, 1).")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ConfigError(f"save_total_limit={self.save_total_limit} must be >= 1 or None.")
        self._check_optimization_fields()
        self._check_schedule()
        self._check_launch_fields()
        if self.remove_unused_columns is False:
            warnings.warn(
                "remove_unused_columns=False has no effect in posttrain: reward functions always receive every "
                "dataset column, and data preparation keeps only the columns it tokenizes.",
                stacklevel=3,
            )
        from posttrain.hub import HUB_STRATEGIES  # stdlib-only module

        if self.hub_strategy not in HUB_STRATEGIES:
            raise ConfigError(f"hub_strategy={self.hub_strategy!r} is not one of {', '.join(HUB_STRATEGIES)}.")

    def _check_optimization_fields(self) -> None:
        """optim / optim_args, compile, data-loader and log-level fields: refused here, before any model loads."""
        if self.optim not in OPTIMIZERS:
            raise ConfigError(f"optim={self.optim!r} is not a known optimizer; choose one of {list(OPTIMIZERS)}.")
        if self.optim in BNB_OPTIMIZERS and importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(f"optim={self.optim!r} needs bitsandbytes: pip install bitsandbytes")
        for part in (self.optim_args or "").replace(" ", "").split(","):
            if part and ("=" not in part or part.startswith("=")):
                raise ConfigError(f'optim_args={self.optim_args!r}: {part!r} is not key=value; write "a=1,b=2".')
        for name in ("log_level", "log_level_replica"):
            if getattr(self, name) not in LOG_LEVELS:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be one of {list(LOG_LEVELS)}.")
        if self.torch_compile_mode not in COMPILE_MODES:
            raise ConfigError(f"torch_compile_mode={self.torch_compile_mode!r} must be one of {list(COMPILE_MODES)}.")
        if self.torch_compile_backend is not None or self.torch_compile_mode is not None:
            self.torch_compile = True  # as transformers: naming a backend or mode turns compiling on
        if self.torch_compile and self.torch_compile_backend is None:
            self.torch_compile_backend = "inductor"
        if self.dataloader_num_workers < 0:
            raise ConfigError(f"dataloader_num_workers={self.dataloader_num_workers} must be >= 0.")
        if self.dataloader_num_workers == 0 and self.dataloader_prefetch_factor is not None:
            raise ConfigError(
                "dataloader_prefetch_factor needs worker processes: set dataloader_num_workers > 0 or drop it."
            )
        if self.dataloader_prefetch_factor is not None and self.dataloader_prefetch_factor < 1:
            raise ConfigError(f"dataloader_prefetch_factor={self.dataloader_prefetch_factor} must be >= 1.")
        if self.dataloader_num_workers == 0 and self.dataloader_persistent_workers:
            raise ConfigError(
                "dataloader_persistent_workers needs worker processes: set dataloader_num_workers > 0 or drop it."
            )
        context = self.dataloader_multiprocessing_context
        if context is not None and context not in MULTIPROCESSING_CONTEXTS:
            raise ConfigError(
                f"dataloader_multiprocessing_context={context!r} must be one of {', '.join(MULTIPROCESSING_CONTEXTS)}."
            )
        if context is not None and self.dataloader_num_workers == 0:
            raise ConfigError(
                "dataloader_multiprocessing_context needs worker processes: set dataloader_num_workers > 0 or drop it."
            )
        if self.train_sampling_strategy in ("group_by_length", "batch_rebalance"):
            raise ConfigError(
                f"train_sampling_strategy={self.train_sampling_strategy!r} is not supported by posttrain "
                '(length-grouped batching is not supported; use packing for SFT); use "random" or "sequential".'
            )
        if self.train_sampling_strategy not in TRAIN_SAMPLING_STRATEGIES:
            raise ConfigError(
                f"train_sampling_strategy={self.train_sampling_strategy!r} must be one of "
                f"{', '.join(TRAIN_SAMPLING_STRATEGIES)}."
            )
        cls = type(self)
        ignored = [f"{n}={getattr(self, n)!r}" for n in TRACKIO_FIELDS if getattr(self, n) != _field_default(cls, n)]
        if ignored:
            warnings.warn(
                f"{', '.join(ignored)}: ignored (Trackio settings; posttrain reports to tensorboard and wandb, not "
                "Trackio).",
                UserWarning,
                stacklevel=4,
            )
        self._check_checkpointing_kwargs()

    def _check_checkpointing_kwargs(self) -> None:
        """gradient_checkpointing_kwargs' layer keys (every_n_layers, offload), before any model loads."""
        kwargs = self.gradient_checkpointing_kwargs or {}
        every = kwargs.get("every_n_layers", 1)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"gradient_checkpointing_kwargs every_n_layers={every!r} must be an integer >= 1.")
        offload = kwargs.get("offload", False)
        if not isinstance(offload, bool):
            raise ConfigError(f"gradient_checkpointing_kwargs offload={offload!r} must be true or false.")
        if every != 1 or offload:
            from transformers import PreTrainedModel  # only when these keys are given

            if not hasattr(PreTrainedModel, "activation_checkpointing_enable"):
                import transformers

                raise ConfigError(
                    "gradient_checkpointing_kwargs every_n_layers / offload need transformers' "
                    f"activation_checkpointing_enable, which transformers {transformers.__version__} lacks; upgrade "
                    "transformers or drop the keys."
                )

    def _check_schedule(self) -> None:
        """The logging / evaluation / saving strategies, as transformers.TrainingArguments.__post_init__
        checks them (plus: eval_steps given with eval_strategy "no" selects "steps"; see docs/internals.md)."""
        for name, allowed in (
            ("eval_strategy", ("no", "steps", "epoch")),
            ("logging_strategy", ("no", "steps", "epoch")),
            ("save_strategy", ("no", "steps", "epoch", "best")),
        ):
            value = str(getattr(self, name)).lower()
            if value not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be one of {', '.join(allowed)}.")
            setattr(self, name, value)
        if self.eval_steps and self.eval_strategy == "no":
            # transformers would ignore eval_steps here; posttrain has always evaluated every eval_steps.
            self.eval_strategy = "steps"
        if self.eval_strategy == "steps" and not self.eval_steps:
            self.eval_steps = self.logging_steps  # transformers' fallback
        for name, minimum in (("logging_steps", 1), ("save_steps", 0), ("eval_steps", 1)):
            value = getattr(self, name)
            if value is None or (name == "eval_steps" and self.eval_strategy != "steps"):
                continue  # transformers checks eval_steps only where it is used
            if value != int(value) and value > 1:
                raise ConfigError(f"{name}={value!r} must be an integer when above 1 (a value in (0, 1) is a ratio).")
            value = int(value) if value == int(value) else float(value)
            setattr(self, name, value)
            if value < 0 or (value == 0 and minimum == 1):
                raise ConfigError(
                    f"{name}={value!r} must be >= {minimum}. (A value in (0, 1) is a ratio of the total steps.)"
                )
        if self.eval_delay is not None and self.eval_delay < 0:
            raise ConfigError(f"eval_delay={self.eval_delay!r} must be >= 0.")
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if self.save_strategy == "best" and self.metric_for_best_model is None:
            raise ConfigError(
                'save_strategy="best" saves after each evaluation that improves metric_for_best_model; '
                "set --metric_for_best_model (e.g. loss)."
            )
        if self.save_strategy == "best" and self.eval_strategy == "no":
            raise ConfigError('save_strategy="best" needs evaluations: set eval_strategy to "steps" or "epoch".')
        if self.load_best_model_at_end:
            if self.eval_strategy == "no":
                raise ConfigError(
                    'load_best_model_at_end needs evaluations during training: set eval_strategy ("steps" or '
                    '"epoch") and the same save_strategy.'
                )
            if self.save_strategy != "best" and self.save_strategy != self.eval_strategy:
                raise ConfigError(
                    f"load_best_model_at_end requires save_strategy ({self.save_strategy!r}) to match eval_strategy "
                    f'({self.eval_strategy!r}) (or save_strategy="best"); set both to the same value.'
                )
            if self.save_strategy == "steps" and self.eval_strategy == "steps":
                save, every = self.save_steps, self.eval_steps
                mixed = (save < 1) != (every < 1)
                if mixed or not save or round(save * 1_000_000) % round(every * 1_000_000) != 0:
                    raise ConfigError(
                        f"load_best_model_at_end requires save_steps ({save}) to be a multiple of eval_steps ({every}) "
                        "(both whole numbers of steps, or both ratios), so every saved step was evaluated."
                    )

    def _check_launch_fields(self) -> None:
        """The device / DDP / FSDP / DeepSpeed fields (posttrain.distributed turns them into accelerate's)."""
        if self.torch_empty_cache_steps is not None and self.torch_empty_cache_steps < 1:
            raise ConfigError(f"torch_empty_cache_steps={self.torch_empty_cache_steps} must be >= 1 or None.")
        if self.ddp_timeout <= 0:
            raise ConfigError(f"ddp_timeout={self.ddp_timeout} must be > 0 (seconds).")
        backends = ("nccl", "gloo", "mpi", "ccl", "hccl", "cncl", "mccl", "xccl")
        if self.ddp_backend is not None and self.ddp_backend not in backends:
            raise ConfigError(f"ddp_backend={self.ddp_backend!r} is not one of {', '.join(backends)}.")
        for name in ("fsdp_config", "deepspeed", "accelerator_config"):
            setattr(self, name, json_or_file(name, getattr(self, name)))
        if self.accelerator_config is not None:
            self.accelerator_config = AcceleratorConfig(self.accelerator_config)
        launch = ("fsdp", "fsdp_config", "fsdp_min_num_params", "fsdp_transformer_layer_cls_to_wrap", "deepspeed")
        if any(getattr(self, name) for name in launch + ("accelerator_config",)):
            from posttrain.distributed import check_launch_options  # loads torch: only when these are set

            check_launch_options(self)

    def _resolve_aliases(self) -> None:
        """transformers' deprecated names: each sets its new name (both given and different: ConfigError)."""
        pairs = [
            ("per_gpu_train_batch_size", "per_device_train_batch_size"),
            ("per_gpu_eval_batch_size", "per_device_eval_batch_size"),
            ("push_to_hub_model_id", "hub_model_id"),
            ("push_to_hub_token", "hub_token"),
            ("torchdynamo", "torch_compile_backend"),
        ]
        for old, new in pairs:
            value = getattr(self, old)
            if value is None:
                continue
            current = getattr(self, new)
            default = _field_default(type(self), new)
            if current != default and current != value:
                raise ConfigError(f"{old}={value!r} and {new}={current!r} are the same setting; give only {new}.")
            warnings.warn(f"{old} is deprecated; use {new} (set to {value!r}).", FutureWarning, stacklevel=4)
            setattr(self, new, value)
        if self.push_to_hub_organization is not None:
            name = self.hub_model_id or os.path.basename(os.path.normpath(self.output_dir))
            self.hub_model_id = f"{self.push_to_hub_organization}/{name.split('/')[-1]}"
        if self.torchdynamo is not None:
            self.torch_compile = True
        if self.no_cuda:
            self.use_cpu = True
        if self.adafactor:
            if self.optim not in (_field_default(type(self), "optim"), "adafactor"):
                raise ConfigError(f"adafactor=True and optim={self.optim!r} conflict; give only optim.")
            self.optim = "adafactor"
        if self.fp16_backend != "auto" and self.half_precision_backend == "auto":
            self.half_precision_backend = self.fp16_backend
        if self.output_dir is None:  # transformers 5's default; posttrain's own default folder instead
            self.output_dir = _field_default(type(self), "output_dir")
        seen = self.include_num_input_tokens_seen
        if isinstance(seen, str):  # transformers 5: "no", "all" (padding included) or "non_padding"
            modes = {"no": False, "false": False, "all": True, "true": True, "non_padding": "non_padding"}
            if seen.strip().lower() not in modes:
                raise ConfigError(
                    f"include_num_input_tokens_seen={seen!r} must be true / false or one of no, all, non_padding."
                )
            self.include_num_input_tokens_seen = modes[seen.strip().lower()]
        self.model_init_kwargs = parse_json_field("model_init_kwargs", self.model_init_kwargs)
        self.lr_scheduler_kwargs = parse_json_field("lr_scheduler_kwargs", self.lr_scheduler_kwargs) or {}
        self.gradient_checkpointing_kwargs = parse_json_field(
            "gradient_checkpointing_kwargs", self.gradient_checkpointing_kwargs
        )
        self.activation_checkpointing_kwargs = parse_json_field(
            "activation_checkpointing_kwargs", self.activation_checkpointing_kwargs
        )
        # transformers >= 5's names of gradient_checkpointing(_kwargs): given, each sets the field posttrain reads.
        for name, target in (
            ("activation_checkpointing", "gradient_checkpointing"),
            ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"),
        ):
            value, current = getattr(self, name), getattr(self, target)
            if value is None:
                continue
            if current != _field_default(type(self), target) and current != value:
                raise ConfigError(f"{target}={current!r} and {name}={value!r} are the same setting; give only one.")
            setattr(self, target, value)
        if isinstance(self.fsdp, list):
            self.fsdp = " ".join(self.fsdp)
        if self.fsdp is True or str(self.fsdp).lower() == "true":
            self.fsdp = "full_shard auto_wrap"  # transformers 5's fsdp=True: FSDP2, full shard, auto wrap
        elif self.fsdp is False or str(self.fsdp).lower() == "false":
            self.fsdp = ""
        self.fsdp = self.fsdp or ""

    # -- helpers -------------------------------------------------------------------------------
    @property
    def mixed_precision(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "no"

    def to_dict(self) -> dict[str, Any]:
        """Every field (derived sizes included), JSON-serialisable: saved beside models and checkpoints
        (which may be pushed to the Hub), so the Hub tokens are written as None."""
        out = {}
        for f in dataclasses.fields(self):
            value = None if f.name in ("hub_token", "push_to_hub_token") else getattr(self, f.name)
            out[f.name] = value if isinstance(value, (str, int, float, bool, type(None), list, dict)) else repr(value)
        return out

    def warmup_for(self, total_steps: int) -> int:
        return self.warmup_steps if self.warmup_steps > 0 else math.ceil(self.warmup_ratio * total_steps)


def check_reward_weights(config: Any) -> None:
    """`reward_weights` (GRPOConfig, RLOOConfig): None, or one weight per reward, the reward model
    (reward_model_path) first, then each of reward_funcs. Rewards passed to the trainer as objects
    are counted there (scoring.RewardSource)."""
    weights = config.reward_weights
    if weights is None:
        return
    if not weights:
        raise ConfigError("reward_weights is empty; give one weight per reward or leave it unset.")
    expected = int(bool(config.reward_model_path)) + len(config.reward_funcs or [])
    if expected and len(weights) != expected:
        raise ConfigError(
            f"reward_weights has {len(weights)} entries for {expected} rewards "
            "(reward_model_path first, then each of reward_funcs); give one weight per reward."
        )


@dataclass
class OnPolicyConfig(TrainingConfig):
    """Rollout sizes and generation settings of the online trainers (TRL's OnPolicyConfig).

    Sizes derived by `derive_sizes` (as TRL's on-policy trainers do), all counted in completions (episodes):
      local_batch_size   = per_device_train_batch_size · gradient_accumulation_steps · num_mini_batches
      batch_size         = local_batch_size · world_size        (episodes per rollout batch)
      mini_batch_size    = batch_size / num_mini_batches         (episodes per optimizer step)
      local_mini_batch_size = local_batch_size / num_mini_batches
      num_total_batches  = ceil(total_episodes / batch_size)     (rollout batches in the run)
    One rollout batch therefore yields exactly num_mini_batches optimizer steps per epoch, each over
    per_device_train_batch_size × gradient_accumulation_steps completions per device.
    """

    learning_rate: float = flag("Initial learning rate of the optimizer (optim).", default=3e-6)
    logging_steps: float = flag(
        "Log metrics every N rollout batches (a value in (0, 1): a ratio of the rollout batches).", default=1
    )
    num_mini_batches: int = flag("Minibatches (optimizer steps) per rollout batch and epoch.", default=1)
    total_episodes: int | None = flag(
        "Total completions to generate (default: num_train_epochs × dataset size × samples per prompt).", default=None
    )
    local_rollout_forward_batch_size: int = flag(
        "Rows per no-grad chunk for generation and the reference / reward / value forwards.", default=64
    )
    num_sample_generations: int = flag(
        "How many times during training to print a table of (query, model response, score); 0 disables.", default=10
    )
    response_length: int = flag("Maximum new tokens per completion.", default=53)
    stop_token: str | None = flag('"eos": stop completions at the tokenizer\'s EOS token.', default=None)
    stop_token_id: int | None = flag("Stop completions at this token id (kept in the completion).", default=None)
    temperature: float = flag("Sampling temperature; also divides logits when scoring logprobs.", default=0.7)
    top_k: int = flag("Sample from the top-k tokens only (0: off).", default=0)
    top_p: float = flag("Nucleus sampling threshold (1.0: off).", default=1.0)
    missing_eos_penalty: float | None = flag(
        "Subtract this from the score of a completion that did not end with the stop token (the EOS trick).",
        default=None,
    )
    sft_model_path: str | None = flag(
        "Policy / reference initialisation; defaults to model_name_or_path (TRL's script argument).", default=None
    )
    reward_model_path: str | None = flag(
        "Reward model: a sequence-classification model folder or hub name.", default=None
    )
    reward_funcs: list[str] | None = flag(
        "Text reward functions as dotted import paths, module:function or module.function "
        "(used instead of a reward model).",
        default=None,
    )
    max_prompt_length: int | None = flag(
        "Prompts longer than this many tokens are handled by prompt_overflow.", default=None
    )
    prompt_overflow: str = flag('What to do with overlong prompts: "truncate_left" or "drop".', default="truncate_left")
    ds3_gather_for_generation: bool = flag(
        "Under DeepSpeed ZeRO-3 gather the full policy once for generation (fast; needs the memory).", default=True
    )
    cache_implementation: str | None = flag(
        'KV cache of the decode loop: None (a cache that grows each token) or "static" (preallocated for the '
        "whole completion, with the one-token decode forward compiled by torch.compile, CUDA graphs on CUDA). "
        "static decodes faster once compiled but each new shape compiles first (tens of seconds on CPU); see "
        'benchmarks/README.md, "Decode engine".',
        default=None,
    )
    exp_name: str = flag("Experiment name.", default="posttrain")

    # Derived by derive_sizes() (TRL names). Accepted as arguments, as in TRL, but a value given must equal
    # the derived one (TRL overwrites it silently).
    world_size: int | None = field(default=None, metadata={"help": "Derived: number of processes (if given, checked)."})
    local_batch_size: int | None = field(
        default=None, metadata={"help": "Derived: episodes per device per rollout batch."}
    )
    batch_size: int | None = field(
        default=None, metadata={"help": "Derived: episodes per rollout batch (if given, checked)."}
    )
    mini_batch_size: int | None = field(
        default=None, metadata={"help": "Derived: episodes per optimizer step (if given, checked)."}
    )
    local_mini_batch_size: int | None = field(
        default=None, metadata={"help": "Derived: episodes per device per optimizer step."}
    )
    micro_batch_size: int | None = field(
        default=None, metadata={"help": "Derived: episodes per micro-step over all devices."}
    )
    num_total_batches: int | None = field(
        default=None, metadata={"help": "Derived: rollout batches in the run (if given, checked)."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_unsupported(self, ONLINE_UNSUPPORTED_FIELDS)
        ignored = [f"{n}={getattr(self, n)!r}" for n in ONLINE_IGNORED_FIELDS if getattr(self, n)]
        if ignored:
            warnings.warn(f"{', '.join(ignored)}: ignored ({ONLINE_PROMPTS}).", UserWarning, stacklevel=3)
        self._requested_sizes = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(OnPolicyConfig)
            if f.name in DERIVED_SIZES and getattr(self, f.name) is not None
        }
        if self.stop_token is not None and self.stop_token != "eos":
            raise ConfigError(
                f'stop_token={self.stop_token!r}: the only supported value is "eos" (or use stop_token_id).'
            )
        if self.stop_token is not None and self.stop_token_id is not None:
            raise ConfigError("stop_token and stop_token_id are both set; give one of them.")
        if self.num_mini_batches < 1:
            raise ConfigError(f"num_mini_batches={self.num_mini_batches} must be >= 1.")
        if self.response_length < 1:
            raise ConfigError(f"response_length={self.response_length} must be >= 1.")
        if self.local_rollout_forward_batch_size < 1:
            raise ConfigError(f"local_rollout_forward_batch_size={self.local_rollout_forward_batch_size} must be >= 1.")
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 (0 = greedy).")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1].")
        if self.top_k > 0 or self.top_p < 1.0:
            warnings.warn(
                f"top_k={self.top_k} / top_p={self.top_p}: completions are sampled from a truncated distribution "
                "while logprobs, ratios and KL use the full softmax (as training must), so updates are slightly "
                "off-policy. TRL's online trainers force top_k=0, top_p=1.0.",
                stacklevel=3,
            )
        if self.cache_implementation not in (None, "dynamic", "static"):
            raise ConfigError(
                f"cache_implementation={self.cache_implementation!r} is not supported by posttrain's decode loop; "
                'use None (dynamic cache) or "static".'
            )
        if self.prompt_overflow not in ("truncate_left", "drop"):
            raise ConfigError(f'prompt_overflow={self.prompt_overflow!r} must be "truncate_left" or "drop".')
        if self.total_episodes is not None and self.total_episodes < 1:
            raise ConfigError(f"total_episodes={self.total_episodes} must be >= 1.")
        if self.sft_model_path is None:
            self.sft_model_path = self.model_name_or_path
        if self.model_name_or_path is None:
            self.model_name_or_path = self.sft_model_path

    @property
    def samples_per_prompt(self) -> int:
        """Completions generated per prompt (1 for PPO; rloo_k / num_generations in subclasses)."""
        return 1

    @property
    def optimizer_steps_per_rollout(self) -> int:
        """Optimizer steps each rollout batch makes: minibatches × passes over the batch."""
        passes = getattr(self, "num_ppo_epochs", None) or getattr(self, "num_iterations", None) or 1
        return self.num_mini_batches * passes

    def derive_sizes(self, world_size: int = 1, dataset_size: int | None = None) -> OnPolicyConfig:
        """Compute the derived batch sizes and check that every division is exact.

        Raises ConfigError naming both numbers when a size does not divide: this runs before any
        model loads, so a bad batch arithmetic costs nothing.
        """
        k = self.samples_per_prompt
        self.world_size = world_size
        self.micro_batch_size = self.per_device_train_batch_size * world_size
        self.local_mini_batch_size = self.per_device_train_batch_size * self.gradient_accumulation_steps
        self.local_batch_size = self.local_mini_batch_size * self.num_mini_batches
        self.batch_size = self.local_batch_size * world_size
        self.mini_batch_size = self.local_mini_batch_size * world_size
        self.check_samples_per_prompt()
        if self.max_steps > 0:
            # TRL semantics: max_steps (optimizer steps) overrides the episode / epoch budget.
            rollouts = math.ceil(self.max_steps / self.optimizer_steps_per_rollout)
            self.total_episodes = rollouts * self.batch_size
        if self.total_episodes is None:
            if dataset_size is None:
                raise ConfigError("total_episodes is not set and the dataset size is unknown; pass --total_episodes.")
            self.total_episodes = int(self.num_train_epochs * dataset_size * k)
        if self.total_episodes < self.batch_size:
            raise ConfigError(
                f"total_episodes ({self.total_episodes}) is smaller than one rollout batch "
                f"(batch_size = {self.batch_size} = per_device_train_batch_size {self.per_device_train_batch_size} "
                f"× gradient_accumulation_steps {self.gradient_accumulation_steps} "
                f"× num_mini_batches {self.num_mini_batches} × world_size {world_size}); "
                "raise total_episodes or lower the batch size."
            )
        self.num_total_batches = math.ceil(self.total_episodes / self.batch_size)
        generation_batch_size = getattr(self, "generation_batch_size", None)
        if generation_batch_size is not None and generation_batch_size != self.batch_size:
            raise ConfigError(
                f"generation_batch_size={generation_batch_size} was sized for {launch_world_size()} process(es), "
                f"but this run has {world_size}: its rollout batch is {self.batch_size} completions. Set "
                "generation_batch_size for this run, or give steps_per_generation instead (per process)."
            )
        for name, requested in getattr(self, "_requested_sizes", {}).items():
            if getattr(self, name) != requested:
                raise ConfigError(
                    f"{name}={requested} was given, but the batch arithmetic gives {name}={getattr(self, name)} "
                    f"(per_device_train_batch_size {self.per_device_train_batch_size} × gradient_accumulation_steps "
                    f"{self.gradient_accumulation_steps} × num_mini_batches {self.num_mini_batches} × world_size "
                    f"{world_size}); it is derived: drop it, or change the sizes it comes from."
                )
        return self

    def check_samples_per_prompt(self) -> None:
        """Each device's rollout batch holds whole groups of samples_per_prompt completions (RLOO);
        GRPO overrides this with TRL's global check (a group may span processes)."""
        k = self.samples_per_prompt
        if self.local_batch_size % k != 0:
            raise ConfigError(
                "per_device_train_batch_size × gradient_accumulation_steps × num_mini_batches = "
                f"{self.local_batch_size} completions per device must be divisible by the samples per prompt ({k}); "
                "change the batch size or k."
            )

    @property
    def prompts_per_rollout(self) -> int:
        """Prompts drawn per device per rollout batch."""
        assert self.local_batch_size is not None, "call derive_sizes() first"
        return self.local_batch_size // self.samples_per_prompt

    @property
    def sample_generations_freq(self) -> int:
        assert self.num_total_batches is not None, "call derive_sizes() first"
        if self.num_sample_generations <= 0:
            return 0
        return max(1, self.num_total_batches // self.num_sample_generations)


# generation_kwargs keys the rollout engine honours: each sets the config field of the same name.
GENERATION_KWARGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "do_sample")
# beam-search settings, which transformers' generate ignores without beams (num_beams 1): accepted with a warning
BEAM_ONLY_KWARGS = ("length_penalty", "early_stopping")
# generation_kwargs keys that would override what the run itself decides: the completion length, the row
# layout, the stop and pad ids, the outputs and the cache
RUN_OWNED_KWARGS = {
    "max_new_tokens": "use max_completion_length (response_length)",
    "max_length": "use max_completion_length (response_length)",
    "num_return_sequences": "use num_generations: each completion is its own row",
    "eos_token_id": "use stop_token / stop_token_id (the tokenizer's EOS is a stop token already)",
    "pad_token_id": "the tokenizer's pad token pads the completions",
    "return_dict_in_generate": "the rollout records what training needs",
    "output_scores": "the rollout records the log-probs training needs",
    "output_logits": "the rollout records the log-probs training needs",
    "output_attentions": "not recorded",
    "output_hidden_states": "not recorded",
    "cache_implementation": "use the config's cache_implementation field",
    "stop_strings": "completions stop at token ids: use stop_token / stop_token_id",
}


def launch_world_size() -> int:
    """Processes of this launch as torchrun / accelerate announce them (WORLD_SIZE; 1 without a
    launcher): what TRL's configs size generation_batch_size with, before any model loads."""
    return max(int(os.environ.get("WORLD_SIZE", "1") or 1), 1)


@dataclass
class SamplingOptions:
    """TRL 1.x's sampling settings beyond temperature / top_k / top_p (GRPOConfig, RLOOConfig and the
    experimental OnlineDPOConfig have them, with these defaults), checked by `check_sampling_options`."""

    min_p: float | None = flag(
        "Sample only tokens whose probability is at least min_p times the most likely token's (0.01-0.2 are "
        "typical); None or 0: off. Recorded logprobs stay those of the full distribution.",
        default=None,
    )
    repetition_penalty: float = flag(
        "Penalise tokens already in the prompt or the completion so far (transformers' repetition penalty: "
        "positive logits divided, negative multiplied); > 1 discourages repeats, 1.0: off.",
        default=1.0,
    )
    generation_kwargs: dict[str, Any] | str | None = flag(
        "Sampling settings as a dict (JSON on the command line) that override the fields of the same name: "
        f"{', '.join(GENERATION_KWARGS)} (do_sample must be true). Any other transformers generation setting "
        "(num_beams, no_repeat_ngram_size, bad_words_ids, ...) is passed to the model's generate(), which then "
        "samples the completions instead of posttrain's faster engine.",
        default=None,
    )


VLLM_NOT_USED = "posttrain generates with its own engine (posttrain.rollout); vLLM is not used"


@dataclass
class VLLMOptions:
    """TRL 1.x's generation-engine settings (names and defaults of TRL 1.16's GRPOConfig / RLOOConfig):
    accepted so that a config written for TRL constructs, and refused with the reason when set away
    from the default (`GENERATION_ENGINE_FIELDS`): posttrain samples with its own engine."""

    use_vllm: bool = flag(f"Generate with vLLM (not supported: {VLLM_NOT_USED}).", default=False)
    vllm_mode: str = flag("vLLM's mode, server or colocate (not supported).", default="colocate")
    vllm_model_impl: str = flag("vLLM model implementation (not supported).", default="vllm")
    vllm_enable_sleep_mode: bool = flag("vLLM sleep mode (not supported).", default=False)
    vllm_structured_outputs_regex: str | None = flag("vLLM structured outputs (not supported).", default=None)
    vllm_server_base_url: str | None = flag("vLLM server URL (not supported).", default=None)
    vllm_server_host: str = flag("vLLM server host (not supported).", default="0.0.0.0")
    vllm_server_port: int = flag("vLLM server port (not supported).", default=8000)
    vllm_server_timeout: float = flag("vLLM server timeout in seconds (not supported).", default=240.0)
    vllm_group_port: int = flag("vLLM weight-sync port (not supported).", default=51216)
    vllm_gpu_memory_utilization: float = flag("vLLM GPU memory fraction (not supported).", default=0.3)
    vllm_max_model_length: int | None = flag("vLLM context length (not supported).", default=None)
    vllm_tensor_parallel_size: int = flag("vLLM tensor parallel size (not supported).", default=1)
    # GRPO's correction of vLLM's sampling in TRL (harmless in the other configs: it is never set)
    vllm_importance_sampling_correction: bool = flag(
        "vLLM importance-sampling correction (not supported).", default=True
    )
    vllm_importance_sampling_mode: str = flag("vLLM importance-sampling mode (unused).", default="sequence_mask")
    vllm_importance_sampling_clip_max: float = flag("vLLM importance-sampling clip (unused).", default=3.0)
    vllm_importance_sampling_clip_min: float | None = flag(
        "vLLM importance-sampling clip (not supported).", default=None
    )
    vllm_importance_sampling_cap: float | None = flag("vLLM importance-sampling cap (unused).", default=None)
    use_transformers_paged: bool = flag(
        "Generate with transformers' paged attention (not supported: posttrain.rollout is the engine).",
        default=False,
    )
    use_transformers_continuous_batching: bool = flag(
        "TRL >= 1.x: generate with transformers' continuous batching (not supported: posttrain.rollout is the engine).",
        default=False,
    )
    transformers_continuous_batching_config: dict[str, Any] | str | None = flag(
        "TRL >= 1.x: transformers' ContinuousBatchingConfig (not supported: posttrain.rollout is the engine).",
        default=None,
    )


@dataclass
class GroupRolloutOptions(SamplingOptions):
    """TRL 1.x settings GRPOConfig and RLOOConfig share (same names, meanings and defaults as TRL
    1.16's GRPOConfig / RLOOConfig), checked by `check_group_rollout_options` before any model loads.
    Mixed into both configs after OnPolicyConfig."""

    steps_per_generation: int | None = flag(
        "TRL 1.x: micro-batches (of per_device_train_batch_size completions per device) in one generation "
        "batch; each gradient_accumulation_steps of them make one optimizer step, so it sets num_mini_batches = "
        "steps_per_generation / gradient_accumulation_steps (which must divide). None: gradient_accumulation_steps "
        "× num_mini_batches. Exclusive with generation_batch_size.",
        default=None,
    )
    generation_batch_size: int | None = flag(
        "TRL 1.x: completions per generation batch over all processes = per_device_train_batch_size × processes "
        "× steps_per_generation (must divide). None: from steps_per_generation. Exclusive with it.",
        default=None,
    )
    chat_template_kwargs: dict[str, Any] | str | None = flag(
        "Extra keyword arguments of apply_chat_template for conversational prompts, e.g. "
        "'{\"enable_thinking\": false}' (JSON on the command line).",
        default=None,
    )
    pad_to_multiple_of: int | str | None = flag(
        "Pad the prompt (left) and completion (right) tensors of each rollout batch to a multiple of this "
        'many tokens (fewer distinct shapes for compiled models); None or "auto": no padding.',
        default=None,
    )
    mask_truncated_completions: bool = flag(
        "Leave completions that hit max_completion_length without a stop token out of the loss (DAPO).",
        default=False,
    )
    shuffle_dataset: bool = flag(
        "Draw the prompts in a new seeded random order on each pass over the dataset; False: in dataset order.",
        default=True,
    )
    sync_ref_model: bool = flag(
        "TR-DPO: every ref_model_sync_steps optimizer steps, ref ← ref_model_mixup_alpha · policy + "
        "(1 − ref_model_mixup_alpha) · ref. Needs a reference model (a KL coefficient > 0); not with PEFT.",
        default=False,
    )
    ref_model_mixup_alpha: float = flag(
        "TR-DPO's α, in [0, 1]: the policy's share of the new reference (with sync_ref_model).", default=0.6
    )
    ref_model_sync_steps: int = flag(
        "TR-DPO's τ: optimizer steps between reference updates (with sync_ref_model).", default=512
    )
    log_completions: bool = flag(
        "At each logging step, print (main process, with rich if installed) a table of the rollout batch's "
        "prompts, completions, rewards and advantages, and write it to samples.jsonl.",
        default=False,
    )
    num_completions_to_print: int | None = flag(
        "Rows of the log_completions table (None: every completion of the rollout batch).", default=None
    )
    log_unique_prompts: bool = flag(
        "The log_completions table keeps only the first completion of each distinct prompt.", default=False
    )
    log_multimodal: bool = flag(
        "Log images and videos with the completions (posttrain trains text models: there are none to log).",
        default=True,
    )
    router_aux_loss_coef: float | None = flag(
        "Weight of a mixture-of-experts model's router load-balancing loss in the policy loss (no effect on "
        "other models); 0: off; None (TRL 1.16's default): the model config's own router_aux_loss_coef (0 if it "
        "declares none).",
        default=0.001,
    )
    num_generations_eval: int | None = flag(
        "TRL 1.x: completions per prompt at evaluation. posttrain evaluates one greedy completion per eval "
        "prompt, so only 1 (or None) is accepted.",
        default=None,
    )


def _pad_multiple(value: int | str | None) -> int | None:
    """pad_to_multiple_of as a whole number or None: "auto" (TRL 1.x's default, which pads only on AWS
    Neuron devices, where posttrain does not run) and "none" mean no padding; a number given as text is read."""
    pad = value
    if isinstance(pad, str):
        text = pad.strip().lower()
        if text in ("auto", "none", "null", ""):
            pad = None
        elif text.isdigit():
            pad = int(text)
        else:
            raise ConfigError(f'pad_to_multiple_of={value!r} must be a whole number, "auto" or None.')
    if pad is not None and pad < 1:
        raise ConfigError(f"pad_to_multiple_of={pad} must be >= 1 (None: no padding).")
    return pad


def generation_config_fields() -> set[str]:
    """The settings a default transformers `GenerationConfig` holds (imports transformers)."""
    from transformers import GenerationConfig

    return set(GenerationConfig().to_dict())


def transformers_generation_kwargs(config: Any) -> dict[str, Any]:
    """The generation_kwargs the rollout engine does not implement itself (those left after
    check_sampling_options applied the engine's own and dropped beam settings without beams):
    passed to the model's transformers generate(), which then samples the completions."""
    kwargs = parse_json_field("generation_kwargs", getattr(config, "generation_kwargs", None)) or {}
    beams = kwargs.get("num_beams", 1) != 1
    return {
        key: value
        for key, value in kwargs.items()
        if key not in GENERATION_KWARGS and (beams or (key not in BEAM_ONLY_KWARGS and key != "num_beams"))
    }


def check_sampling_options(config: Any, stacklevel: int = 4) -> None:
    """Validate and apply `SamplingOptions`: generation_kwargs (a dict, or JSON text from the command
    line) override the sampling fields of the same name; min_p and repetition_penalty are checked.
    `stacklevel`: of the warnings, to point at the line that built the config."""
    config.generation_kwargs = parse_json_field("generation_kwargs", config.generation_kwargs)
    beams = (config.generation_kwargs or {}).get("num_beams", 1) != 1
    for key, value in (config.generation_kwargs or {}).items():
        if not beams and (key in BEAM_ONLY_KWARGS or key == "num_beams"):
            if key != "num_beams":
                warnings.warn(
                    f"generation_kwargs {key}={value!r} has no effect: it applies to beam search, and completions "
                    "are sampled without beams (transformers' generate ignores it too with num_beams=1).",
                    stacklevel=stacklevel,
                )
            continue
        if key in RUN_OWNED_KWARGS:
            raise ConfigError(f"generation_kwargs has {key!r}, which the run sets itself: {RUN_OWNED_KWARGS[key]}.")
        if key not in GENERATION_KWARGS:
            known = generation_config_fields()
            if key not in known:
                raise ConfigError(
                    f"generation_kwargs has {key!r}, which is not a setting of transformers' GenerationConfig; "
                    f"remove it or correct its name (the engine's own: {', '.join(GENERATION_KWARGS)})."
                )
            continue
        if key == "do_sample":
            if value is not True:
                raise ConfigError(
                    f"generation_kwargs do_sample={value!r}: online training samples its completions (greedy "
                    "decoding would give every completion of a prompt the same tokens); drop do_sample."
                )
            continue
        setattr(config, key, value)  # as TRL: generation_kwargs override the fields of the same name
    extra = transformers_generation_kwargs(config)
    if extra:
        warnings.warn(
            f"generation_kwargs {', '.join(sorted(extra))}: posttrain's rollout engine does not implement "
            f"{'this setting' if len(extra) == 1 else 'these settings'}, so the completions are sampled by the "
            "model's transformers generate() with them (no shared prompt prefill, row compaction or traced decode "
            "step: slower); log-probs come from one forward after it.",
            stacklevel=stacklevel,
        )
    if config.min_p is not None and not 0.0 <= config.min_p <= 1.0:
        raise ConfigError(f"min_p={config.min_p} must be in [0, 1] (None or 0: off).")
    if not config.repetition_penalty > 0:
        raise ConfigError(f"repetition_penalty={config.repetition_penalty} must be > 0 (1.0: off).")
    if config.min_p or config.repetition_penalty != 1.0:
        warnings.warn(
            f"min_p={config.min_p} / repetition_penalty={config.repetition_penalty}: completions are sampled from a "
            "reshaped distribution while logprobs, ratios and KL use the full softmax of the raw logits (as in TRL), "
            "so updates are slightly off-policy.",
            stacklevel=stacklevel,
        )


def check_group_rollout_options(config: Any, *, kl_field: str, kl_coef: float) -> None:
    """Validate and apply the `GroupRolloutOptions` of `config` (call before OnPolicyConfig's own
    checks): generation_kwargs set the sampling fields, steps_per_generation / generation_batch_size
    set num_mini_batches. `kl_field` / `kl_coef`: the name the caller gave the KL coefficient and its
    value (sync_ref_model needs a reference model, which only a coefficient > 0 loads)."""
    check_sampling_options(config, stacklevel=5)
    config.chat_template_kwargs = parse_json_field("chat_template_kwargs", config.chat_template_kwargs)
    config.pad_to_multiple_of = _pad_multiple(config.pad_to_multiple_of)
    if not 0.0 <= config.ref_model_mixup_alpha <= 1.0:
        raise ConfigError(f"ref_model_mixup_alpha={config.ref_model_mixup_alpha} must be in [0, 1].")
    if config.ref_model_sync_steps < 1:
        raise ConfigError(f"ref_model_sync_steps={config.ref_model_sync_steps} must be >= 1.")
    if config.sync_ref_model and kl_coef == 0:
        raise ConfigError(
            f"sync_ref_model=True with {kl_field}=0: no reference model is loaded, so there is nothing to "
            f"synchronize (as TRL). Set {kl_field} > 0, or drop sync_ref_model."
        )
    if config.sync_ref_model and config.use_peft:
        raise ConfigError(
            "sync_ref_model=True with use_peft: the reference is the policy with its adapter disabled, there is no "
            "separate reference model to mix into (TRL refuses this too). Drop sync_ref_model or use_peft."
        )
    if config.num_completions_to_print is not None and config.num_completions_to_print < 1:
        raise ConfigError(f"num_completions_to_print={config.num_completions_to_print} must be >= 1 (None: all).")
    if config.router_aux_loss_coef is not None and config.router_aux_loss_coef < 0:
        raise ConfigError(
            f"router_aux_loss_coef={config.router_aux_loss_coef} must be >= 0 (0: off; None: the model's)."
        )
    if config.num_generations_eval not in (None, 1):
        raise ConfigError(
            f"num_generations_eval={config.num_generations_eval}: posttrain's evaluation draws one greedy completion "
            "per eval prompt (eval_objective/scores is their mean score), so more completions per prompt would "
            "all be the same. Set num_generations_eval=1 or leave it unset."
        )
    _resolve_generation_batch(config)


def _resolve_generation_batch(config: Any) -> None:
    """TRL 1.x's generation batch of steps_per_generation micro-batches (or generation_batch_size
    completions over all processes) onto posttrain's rollout batch: num_mini_batches =
    steps_per_generation / gradient_accumulation_steps optimizer steps per pass."""
    steps, size = config.steps_per_generation, config.generation_batch_size
    if steps is None and size is None:
        return
    if steps is not None and size is not None:
        raise ConfigError(
            f"steps_per_generation={steps} and generation_batch_size={size} both size the generation batch; give "
            "only one (as TRL)."
        )
    per_step, accumulation = config.per_device_train_batch_size, config.gradient_accumulation_steps
    if size is not None:
        world = launch_world_size()
        if size < 1 or size % (per_step * world):
            raise ConfigError(
                f"generation_batch_size={size} must be a positive multiple of per_device_train_batch_size × "
                f"processes = {per_step} × {world} = {per_step * world}."
            )
        steps, named = size // (per_step * world), f"generation_batch_size={size}"
    else:
        if steps < 1:
            raise ConfigError(f"steps_per_generation={steps} must be >= 1.")
        named = f"steps_per_generation={steps}"
    if steps % accumulation:
        raise ConfigError(
            f"{named} gives {steps} micro-batches per generation batch, not a multiple of "
            f"gradient_accumulation_steps={accumulation}: posttrain makes whole optimizer steps from each "
            "generation batch. Make it a multiple (it then sets num_mini_batches = micro-batches / "
            "gradient_accumulation_steps)."
        )
    mini = steps // accumulation
    if config.num_mini_batches not in (1, mini):
        raise ConfigError(
            f"{named} means num_mini_batches={mini} ({steps} micro-batches / gradient_accumulation_steps "
            f"{accumulation}), but num_mini_batches={config.num_mini_batches} was given; they are the same "
            "setting: give one."
        )
    config.num_mini_batches = mini


# optim names (transformers' OptimizerNames that posttrain builds; see posttrain.optim).
BNB_OPTIMIZERS = (
    "adamw_bnb_8bit",
    "adamw_8bit",
    "paged_adamw_8bit",
    "paged_adamw_32bit",
    "lion_8bit",
    "lion_32bit",
    "paged_lion_8bit",
    "paged_lion_32bit",
    "rmsprop_bnb",
    "rmsprop_bnb_8bit",
    "rmsprop_bnb_32bit",
)
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop", *BNB_OPTIMIZERS)
# log_level / log_level_replica values (transformers' names; "passive" leaves the level as it is).
LOG_LEVELS = ("passive", "debug", "detail", "info", "warning", "error", "critical")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# transformers.TrainingArguments fields posttrain accepts at their default but cannot honour otherwise:
# a different value is a ConfigError naming the field and this reason (nothing is silently ignored).
UNSUPPORTED_FIELDS: dict[str, str] = {
    "use_mps_device": "Apple MPS is picked automatically when available (the flag is deprecated in transformers)",
    "half_precision_backend": "posttrain's mixed precision is torch autocast through accelerate (bf16 / fp16)",
    "fp16_opt_level": "apex AMP is not supported; fp16 uses torch autocast",
    "bf16_full_eval": "evaluation runs in the training precision; load the model in bf16 (torch_dtype) instead",
    "fp16_full_eval": "evaluation runs in the training precision; load the model in fp16 (torch_dtype) instead",
    "jit_mode_eval": "TorchScript inference is not supported",
    "use_ipex": "intel-extension-for-pytorch is not supported; bf16 autocast uses AMX natively",
    "tpu_num_cores": "TPUs are not supported",
    "tpu_metrics_debug": "TPUs are not supported",
    "debug": "transformers' debug options are not supported",
    "past_index": "posttrain's models do not return past states to the loss",
    "label_names": "each trainer knows its own label columns",
    "ignore_data_skip": "resume replays the exact data order; skipping nothing would repeat data",
    "label_smoothing_factor": "label smoothing is not supported",
    "group_by_length": "length-grouped batching is not supported (use packing for SFT)",
    "length_column_name": "length-grouped batching is not supported",
    "skip_memory_metrics": "transformers' memory profiler is not used; peak memory is logged as memory/*",
    "use_legacy_prediction_loop": "there is no prediction loop",
    "include_inputs_for_metrics": "there is no compute_metrics",
    "include_for_metrics": "there is no compute_metrics",
    "eval_do_concat_batches": "there is no compute_metrics",
    "batch_eval_metrics": "there is no compute_metrics",
    "eval_use_gather_object": "there is no compute_metrics",
    "eval_accumulation_steps": "evaluation keeps no predictions to move to the CPU",
    "prediction_loss_only": "evaluate() reports each trainer's own metrics",
    "mp_parameters": "SageMaker model parallelism is not supported",
    "auto_find_batch_size": "automatic batch-size search is not supported",
    "ray_scope": "hyperparameter search is not supported",
    "use_liger_kernel": "Liger kernels are not supported",
    "liger_kernel_config": "Liger kernels are not supported",
    "optim_target_modules": "GaLore / APOLLO optimizers are not supported",
    "logging_nan_inf_filter": "a non-finite loss is never logged: the step is skipped on every rank",
    "save_safetensors": "weights are always written as safetensors",
    "average_tokens_across_devices": "losses are always normalised by the token count of every process",
    "use_cache": "training forwards build no KV cache; generation uses posttrain.rollout's own cache",
    "dataloader_in_order": "the loader yields one item per optimizer step, which an exact resume replays in order",
    "parallelism_config": "tensor / context / sequence parallelism is not supported; use DDP, fsdp or deepspeed",
}
# Trackio's settings: transformers reads them only for report_to="trackio", which is not among posttrain's trackers.
# Set, they are ignored with one warning (the run trains and logs exactly as without them).
TRACKIO_FIELDS = ("project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id")
TRAIN_SAMPLING_STRATEGIES = ("random", "sequential")
MULTIPROCESSING_CONTEXTS = ("fork", "spawn", "forkserver")
# activation_checkpointing_kwargs keys that transformers' activation_checkpointing_enable takes itself
# (the rest go to torch.utils.checkpoint).
CHECKPOINTING_LAYER_KEYS = ("every_n_layers", "offload")


# The batch sizes OnPolicyConfig.derive_sizes computes (TRL's names).
DERIVED_SIZES = frozenset(
    {
        "world_size",
        "local_batch_size",
        "batch_size",
        "mini_batch_size",
        "local_mini_batch_size",
        "micro_batch_size",
        "num_total_batches",
    }
)

# VLLMOptions' fields, and Online DPO's TRL 0.19 name of vllm_gpu_memory_utilization
GENERATION_ENGINE_FIELDS: dict[str, str] = {
    **{f.name: VLLM_NOT_USED for f in dataclasses.fields(VLLMOptions)},
    "use_transformers_paged": "posttrain.rollout is the generation engine; transformers' paged generation is not used",
    "use_transformers_continuous_batching": (
        "posttrain.rollout is the generation engine; transformers' continuous batching is not used"
    ),
    "transformers_continuous_batching_config": (
        "posttrain.rollout is the generation engine; transformers' continuous batching is not used"
    ),
    "gpu_memory_utilization": VLLM_NOT_USED,
}
# Fields that apply to SFT and reward training but not to the online trainers.
ONLINE_UNSUPPORTED_FIELDS: dict[str, str] = {
    **GENERATION_ENGINE_FIELDS,
    "load_best_model_at_end": "online trainers have no held-out loss to pick a checkpoint by",
    "neftune_noise_alpha": "NEFTune applies to supervised fine-tuning only",
    "include_tokens_per_second": "online trainers report throughput as eps (episodes per second)",
    "include_num_input_tokens_seen": "online trainers count completions (episode), not input tokens",
}
# Data-loader settings of TRL configs that have nothing to act on in the online trainers: their prompts are
# tokenized once and drawn in the training process. Set, they are ignored with one warning (a TRL config
# that asks for workers still runs, and trains exactly as without them).
ONLINE_PROMPTS = "the online trainers draw their pre-tokenized prompt batches in the training process, without workers"
ONLINE_IGNORED_FIELDS = (
    "dataloader_num_workers",
    "dataloader_prefetch_factor",
    "dataloader_persistent_workers",
    "dataloader_multiprocessing_context",
)


def _field_default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def refuse_unsupported(config: Any, unsupported: dict[str, str] | None = None) -> None:
    """ConfigError for the first field of `unsupported` (default UNSUPPORTED_FIELDS) set away from its default."""
    table = UNSUPPORTED_FIELDS if unsupported is None else unsupported
    for name, why in table.items():
        if not hasattr(config, name):
            continue
        value, default = getattr(config, name), _field_default(type(config), name)
        if value != default and not (value in (None, "", [], {}) and default in (None, "", [], {})):
            raise ConfigError(f"{name}={value!r} is not supported by posttrain ({why}); leave it at {default!r}.")


def parse_json_field(name: str, value: Any) -> dict[str, Any] | None:
    """A dict-valued field given as JSON text on the command line (HfArgumentParser passes a str)."""
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{name}={value!r} is not valid JSON ({err}); write it like '{{\"key\": 1}}'.") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{name}={value!r} must be a JSON object, e.g. '{{\"key\": 1}}'.")
    return parsed


class AcceleratorConfig(dict):
    """`accelerator_config` once parsed: the mapping as given, whose keys also read as attributes with
    transformers' defaults for those not given (`args.accelerator_config.dispatch_batches`, as on
    transformers' AcceleratorConfig); posttrain.distributed says which values the trainers honour."""

    DEFAULTS: ClassVar[dict[str, Any]] = {
        "split_batches": False,
        "dispatch_batches": None,
        "even_batches": True,
        "use_seedable_sampler": True,
        "non_blocking": False,
        "use_configured_state": False,
        "gradient_accumulation_kwargs": None,
    }

    def __getattr__(self, name: str) -> Any:
        if name in self:
            return self[name]
        if name in self.DEFAULTS:
            return self.DEFAULTS[name]
        raise AttributeError(f"accelerator_config has no key {name!r}; keys: {', '.join(self.DEFAULTS)}")


def json_or_file(name: str, value: Any) -> dict[str, Any] | None:
    """A dict-valued field given as a dict, as JSON text, or as the path of a JSON file (fsdp_config,
    deepspeed, accelerator_config; transformers takes all three)."""
    if value is None or isinstance(value, dict) or value == "":
        return value or None
    text = str(value).strip()
    if text.startswith("{"):
        return parse_json_field(name, text)
    path = os.path.expanduser(text)
    if not os.path.isfile(path):
        raise ConfigError(f"{name}={value!r} is neither a JSON object nor an existing JSON file; pass one of them.")
    try:
        with open(path, encoding="utf-8") as f:
            parsed = json.load(f)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{name}={value!r}: the file cannot be read as JSON ({err}).") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{name}={value!r}: the file must hold a JSON object.")
    return parsed


@dataclass
class SupervisedConfig(TrainingConfig):
    """Fields SFT and reward-model training share (TRL's SFTConfig / RewardConfig)."""

    chat_template_path: str | None = flag(
        "A Jinja chat-template file, or a tokenizer folder whose template is used, for conversational data.",
        default=None,
    )
    eos_token: str | None = flag(
        "End-of-sequence token appended to plain-text examples (default: the tokenizer's). "
        "Must already exist in the vocabulary.",
        default=None,
    )
    pad_token: str | None = flag(
        "Padding token (default: the tokenizer's pad, else unk, else eos). Must already exist in the vocabulary.",
        default=None,
    )
    pad_to_multiple_of: int | str | None = flag(
        "Pad every batch's length up to a multiple of this; None or \"auto\" (TRL 1.x's default: pad only on AWS "
        "Neuron, which posttrain does not run on): no padding.",
        default=None,
    )
    activation_offloading: bool = flag(
        "Keep activations saved for backward in CPU memory instead of the GPU.", default=False
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pad_to_multiple_of = _pad_multiple(self.pad_to_multiple_of)
        if self.dataset_streaming:
            raise ConfigError(
                "dataset_streaming=True is for the online trainers (PPO, RLOO, GRPO, Online DPO, XPO); SFT and "
                "reward training load their dataset whole (packing and length checks read every row): drop it."
            )


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The `field: value` mapping of a `--config` YAML (or JSON) file, or a ConfigError naming the
    file and, for a syntax error, its line and column (1-based, as editors count).

    A missing, unreadable or non-UTF-8 file, a syntax error and a document that is not a mapping
    are each reported in one line; an empty file is an empty mapping.
    """
    import yaml  # PyYAML comes with transformers / datasets; imported here to keep this module light

    where = f"--config {os.fspath(path)}"
    if not os.path.exists(path):
        raise ConfigError(f"{where}: no such file.")
    if os.path.isdir(path):
        raise ConfigError(f"{where} is a directory; pass a YAML file of field: value lines.")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as err:
        raise ConfigError(f"{where}: not UTF-8 text (byte {err.start}); save the file as UTF-8.") from None
    except OSError as err:
        raise ConfigError(f"{where}: cannot be read ({err.strerror}).") from None
    try:
        values = yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:

        def at(mark: Any) -> str:
            return f"line {mark.line + 1}, column {mark.column + 1}"

        mark = err.problem_mark or err.context_mark
        problem = err.problem or err.context or "invalid YAML"
        if err.context and err.context_mark is not None and err.problem_mark is not None:
            problem += f" ({err.context} started at {at(err.context_mark)})"
        raise ConfigError(
            f"{where}{', ' + at(mark) if mark is not None else ''}: YAML syntax error: {problem}. "
            "Fix the file there: one `field: value` per line; quote values holding ': ', '#' or brackets."
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: YAML error: {err}.") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(
            f"{where} must hold a mapping of field: value, not a {type(values).__name__} "
            "(e.g. `learning_rate: 3.0e-6` on its own line)."
        )
    return values


def config_fields(cls: type) -> list[dataclasses.Field]:
    """User-settable fields of a config class (derived sizes excluded)."""
    return [f for f in dataclasses.fields(cls) if f.name not in DERIVED_SIZES]


def resolve_path(path: str | None) -> str | None:
    """Expand ~ in local paths; leave hub names untouched."""
    return os.path.expanduser(path) if path else path
