"""Shared configuration dataclasses.

Every trainer config extends `TrainingConfig` (optimisation, logging, saving, model and data
locations) and the online trainers extend `OnPolicyConfig` (rollout sizes and generation). Field
names, meanings and defaults follow TRL's `TrainingArguments` / `OnPolicyConfig` (see
TRL's `OnPolicyConfig`) so code and command lines written for TRL port unchanged.
Each field's `help` metadata is its `--help` text on the command line.

This module imports only the standard library: `posttrain --help` and config validation run before
torch loads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any


def flag(text: str, **kw: Any) -> Any:
    """A config field whose `help` text is its `--help` line on the command line."""
    return field(metadata={"help": text}, **kw)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field(s) and the fix."""


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
    dataset_train_split: str = flag("Split used for training.", default="train")
    dataset_test_split: str = flag("Split used for evaluation and sample generations.", default="test")
    learning_rate: float = flag("Initial AdamW learning rate.", default=5e-5)
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
    weight_decay: float = flag("AdamW weight decay.", default=0.0)
    adam_beta1: float = flag("AdamW beta1.", default=0.9)
    adam_beta2: float = flag("AdamW beta2.", default=0.999)
    adam_epsilon: float = flag("AdamW epsilon.", default=1e-8)
    max_grad_norm: float | None = flag(
        "Clip the global gradient norm to this value (None or 0: no clipping).", default=1.0
    )
    seed: int = flag("Random seed for python, numpy and torch (sampling included).", default=42)
    bf16: bool | None = flag(
        "bf16 mixed precision (autocast). Fast on GPUs and on CPUs with AMX. None: off (posttrain never turns it "
        "on by itself: CPUs without native bf16 emulate it ~100x slower).",
        default=None,
    )
    fp16: bool = flag("fp16 mixed precision (GPU only).", default=False)
    torch_dtype: str | None = flag("dtype to load weights in: float32, bfloat16, float16 or auto.", default=None)
    trust_remote_code: bool = flag("Allow model code from the hub.", default=False)
    gradient_checkpointing: bool = flag("Recompute activations in backward to save memory.", default=False)
    disable_dropout: bool = flag("Turn off dropout in every model (needed for exact PPO ratios).", default=True)
    logging_steps: int = flag(
        "Log metrics every N optimizer steps (online trainers: every N rollout batches).", default=10
    )
    eval_steps: int | None = flag("Evaluate every N steps (None: only at the end).", default=None)
    save_steps: int = flag("Save a resumable checkpoint every N steps (0: never during training).", default=500)
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
    eval_strategy: str = flag('When to evaluate: "no", "steps" (every eval_steps) or "epoch".', default="no")
    eval_delay: float | None = flag("Steps (or epochs) to wait before the first evaluation.", default=0)
    eval_on_start: bool = flag("Evaluate once before the first training step (a sanity check).", default=False)
    logging_strategy: str = flag('When to log: "no", "steps" (every logging_steps) or "epoch".', default="steps")
    logging_first_step: bool = flag("Also log the first step.", default=False)
    logging_dir: str | None = flag(
        "TensorBoard log folder (default: <output_dir>/runs/<date>_<host>, as transformers).", default=None
    )
    logging_nan_inf_filter: bool = flag(
        "Keep non-finite losses out of the logged averages (posttrain always does: a non-finite step is skipped "
        "on every rank); False is refused.",
        default=True,
    )
    save_strategy: str = flag('When to save checkpoints: "no", "steps", "epoch" or "best".', default="steps")
    save_only_model: bool = flag(
        "Checkpoints hold only the model weights (no optimizer, scheduler or RNG state: cannot resume).", default=False
    )
    save_safetensors: bool | None = flag("Write weights as safetensors (posttrain always does).", default=True)
    save_on_each_node: bool = flag("Multi-node without a shared disk: every node's main process saves.", default=False)
    restore_callback_states_from_checkpoint: bool = flag(
        "On resume, restore the state of stateful callbacks saved in the checkpoint.", default=False
    )
    load_best_model_at_end: bool | None = flag(
        "Keep the best checkpoint by metric_for_best_model and load it at the end (SFT and reward training).",
        default=False,
    )
    metric_for_best_model: str | None = flag('Metric that picks the best model (default "loss").', default=None)
    greater_is_better: bool | None = flag(
        "Whether a larger metric_for_best_model is better (default: False for losses, True otherwise).", default=None
    )
    lr_scheduler_kwargs: dict[str, Any] | str | None = flag(
        "Extra keyword arguments of the learning-rate schedule, as JSON on the command line "
        "(e.g. '{\"num_cycles\": 2}').",
        default_factory=dict,
    )
    optim: str = flag(
        "Optimizer: adamw_torch, adamw_torch_fused, adafactor, sgd, or a bitsandbytes optimizer "
        "(adamw_bnb_8bit, paged_adamw_8bit, ...) when bitsandbytes is installed.",
        default="adamw_torch",
    )
    optim_args: str | None = flag('Extra optimizer arguments as "key=value,key=value".', default=None)
    adafactor: bool = flag("Deprecated alias of optim=adafactor.", default=False)
    optim_target_modules: list[str] | str | None = flag(
        "Modules for GaLore-style optimizers (not supported by posttrain).", default=None
    )
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = flag(
        "Keyword arguments of gradient_checkpointing_enable, as JSON (e.g. '{\"use_reentrant\": false}').",
        default=None,
    )
    torch_compile: bool = flag("Compile the trained model with torch.compile.", default=False)
    torch_compile_backend: str | None = flag("torch.compile backend (default inductor).", default=None)
    torch_compile_mode: str | None = flag("torch.compile mode (default, reduce-overhead, max-autotune).", default=None)
    torchdynamo: str | None = flag("Deprecated alias of torch_compile_backend.", default=None)
    dataloader_num_workers: int = flag("Worker processes of the training data loader (0: main process).", default=0)
    dataloader_prefetch_factor: int | None = flag("Batches each worker loads ahead.", default=None)
    dataloader_pin_memory: bool = flag("Pin data-loader memory (faster host-to-GPU copies).", default=True)
    dataloader_persistent_workers: bool = flag("Keep data-loader workers alive between epochs.", default=False)
    dataloader_drop_last: bool = flag("Drop the last incomplete training batch.", default=False)
    data_seed: int | None = flag("Seed of the data order only (default: seed).", default=None)
    full_determinism: bool = flag(
        "Deterministic algorithms everywhere (torch.use_deterministic_algorithms); slower.", default=False
    )
    disable_tqdm: bool | None = flag("Hide progress bars.", default=None)
    use_cpu: bool = flag("Train on the CPU even when a GPU is available.", default=False)
    no_cuda: bool = flag("Deprecated alias of use_cpu.", default=False)
    use_mps_device: bool = flag("Deprecated: Apple MPS is used automatically when available.", default=False)
    tf32: bool | None = flag("Allow TF32 matmuls on Ampere or newer GPUs.", default=None)
    torch_empty_cache_steps: int | None = flag("Empty the accelerator's cache every N steps.", default=None)
    neftune_noise_alpha: float | None = flag(
        "NEFTune: add uniform noise of this scale to the input embeddings while training (SFT).", default=None
    )
    per_gpu_train_batch_size: int | None = flag("Deprecated alias of per_device_train_batch_size.", default=None)
    per_gpu_eval_batch_size: int | None = flag("Deprecated alias of per_device_eval_batch_size.", default=None)
    eval_accumulation_steps: int | None = flag(
        "Move accumulated eval predictions to the CPU every N steps (posttrain keeps no predictions).", default=None
    )
    prediction_loss_only: bool = flag("Evaluation returns only the loss (posttrain's does).", default=False)
    log_level: str = flag(
        "Log level of the main process: debug, info, warning, error, critical or passive (leave as set).",
        default="passive",
    )
    log_level_replica: str = flag("Log level of the other processes.", default="warning")
    log_on_each_node: bool = flag("Multi-node: log from each node's main process, not only the first.", default=True)
    local_rank: int = flag("Set by the launcher (torchrun / accelerate); read from the environment.", default=-1)
    ddp_backend: str | None = flag("torch.distributed backend: nccl, gloo, mpi, ccl, hccl, ...", default=None)
    ddp_timeout: int = flag("Seconds a collective waits before the process group times out.", default=1800)
    ddp_find_unused_parameters: bool | None = flag("DDP find_unused_parameters.", default=None)
    ddp_bucket_cap_mb: int | None = flag("DDP gradient bucket size in MiB.", default=None)
    ddp_broadcast_buffers: bool | None = flag("DDP broadcast_buffers.", default=None)
    fsdp: list[str] | str | None = flag(
        'FSDP through accelerate: "full_shard", "shard_grad_op", "hybrid_shard", "offload", "auto_wrap" (space '
        "separated).",
        default="",
    )
    fsdp_config: dict[str, Any] | str | None = flag("FSDP options: a JSON file path or a JSON object.", default=None)
    fsdp_min_num_params: int = flag("Deprecated (fsdp_config min_num_params): auto-wrap size threshold.", default=0)
    fsdp_transformer_layer_cls_to_wrap: str | None = flag(
        "Deprecated (fsdp_config transformer_layer_cls_to_wrap): layer class names to wrap.", default=None
    )
    deepspeed: dict[str, Any] | str | None = flag("DeepSpeed: a JSON config file path or a JSON object.", default=None)
    accelerator_config: dict[str, Any] | str | None = flag(
        "accelerate.Accelerator options (split_batches, dispatch_batches, even_batches, ...): a JSON file or object.",
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
    include_tokens_per_second: bool | None = flag("Log train_tokens_per_second in the summary.", default=False)
    include_num_input_tokens_seen: bool | None = flag("Log num_input_tokens_seen.", default=False)
    use_liger_kernel: bool | None = flag("Liger kernels (not supported).", default=False)
    liger_kernel_config: dict[str, bool] | str | None = flag("Liger kernel options (not supported).", default=None)
    average_tokens_across_devices: bool | None = flag(
        "Normalise the loss by the token count of every process, not each one's (posttrain always does).",
        default=True,
    )
    model_init_kwargs: dict[str, Any] | str | None = flag(
        "Extra keyword arguments for from_pretrained, as JSON on the command line "
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
            ("logging_steps", self.logging_steps >= 1, "must be >= 1"),
            ("save_steps", self.save_steps >= 0, "must be >= 0"),
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
        from posttrain.hub import HUB_STRATEGIES  # stdlib-only module

        if self.hub_strategy not in HUB_STRATEGIES:
            raise ConfigError(f"hub_strategy={self.hub_strategy!r} is not one of {', '.join(HUB_STRATEGIES)}.")

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
            if self.optim not in ("adamw_torch", "adafactor"):
                raise ConfigError(f"adafactor=True and optim={self.optim!r} conflict; give only optim.")
            self.optim = "adafactor"
        if self.fp16_backend != "auto" and self.half_precision_backend == "auto":
            self.half_precision_backend = self.fp16_backend
        self.model_init_kwargs = parse_json_field("model_init_kwargs", self.model_init_kwargs)
        self.lr_scheduler_kwargs = parse_json_field("lr_scheduler_kwargs", self.lr_scheduler_kwargs) or {}
        self.gradient_checkpointing_kwargs = parse_json_field(
            "gradient_checkpointing_kwargs", self.gradient_checkpointing_kwargs
        )
        if isinstance(self.fsdp, list):
            self.fsdp = " ".join(self.fsdp)
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

    learning_rate: float = flag("Initial AdamW learning rate.", default=3e-6)
    logging_steps: int = flag("Log metrics every N rollout batches.", default=1)
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
    # Not yet wired: each entry leaves this table when its behaviour lands.
    "eval_strategy": "not implemented yet",
    "eval_delay": "not implemented yet",
    "eval_on_start": "not implemented yet",
    "logging_strategy": "not implemented yet",
    "logging_first_step": "not implemented yet",
    "logging_dir": "not implemented yet",
    "save_strategy": "not implemented yet",
    "save_only_model": "not implemented yet",
    "save_on_each_node": "not implemented yet",
    "restore_callback_states_from_checkpoint": "not implemented yet",
    "load_best_model_at_end": "not implemented yet",
    "metric_for_best_model": "not implemented yet",
    "greater_is_better": "not implemented yet",
    "lr_scheduler_kwargs": "not implemented yet",
    "optim": "not implemented yet",
    "optim_args": "not implemented yet",
    "gradient_checkpointing_kwargs": "not implemented yet",
    "torch_compile": "not implemented yet",
    "torch_compile_backend": "not implemented yet",
    "torch_compile_mode": "not implemented yet",
    "dataloader_num_workers": "not implemented yet",
    "dataloader_prefetch_factor": "not implemented yet",
    "dataloader_pin_memory": "not implemented yet",
    "dataloader_persistent_workers": "not implemented yet",
    "dataloader_drop_last": "not implemented yet",
    "data_seed": "not implemented yet",
    "full_determinism": "not implemented yet",
    "disable_tqdm": "not implemented yet",
    "use_cpu": "not implemented yet",
    "tf32": "not implemented yet",
    "torch_empty_cache_steps": "not implemented yet",
    "neftune_noise_alpha": "not implemented yet",
    "log_level": "not implemented yet",
    "log_level_replica": "not implemented yet",
    "log_on_each_node": "not implemented yet",
    "ddp_backend": "not implemented yet",
    "ddp_timeout": "not implemented yet",
    "ddp_find_unused_parameters": "not implemented yet",
    "ddp_bucket_cap_mb": "not implemented yet",
    "ddp_broadcast_buffers": "not implemented yet",
    "fsdp": "not implemented yet",
    "fsdp_config": "not implemented yet",
    "fsdp_min_num_params": "not implemented yet",
    "fsdp_transformer_layer_cls_to_wrap": "not implemented yet",
    "deepspeed": "not implemented yet",
    "accelerator_config": "not implemented yet",
    "include_tokens_per_second": "not implemented yet",
    "include_num_input_tokens_seen": "not implemented yet",
}


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

# Fields that apply to SFT and reward training but not to the online trainers.
ONLINE_UNSUPPORTED_FIELDS: dict[str, str] = {
    "load_best_model_at_end": "online trainers have no held-out loss to pick a checkpoint by",
    "neftune_noise_alpha": "NEFTune applies to supervised fine-tuning only",
    "model_init_kwargs": "not implemented yet",
}


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
    pad_to_multiple_of: int | None = flag("Pad every batch's length up to a multiple of this.", default=None)
    activation_offloading: bool = flag(
        "Keep activations saved for backward in CPU memory instead of the GPU.", default=False
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ConfigError(f"pad_to_multiple_of={self.pad_to_multiple_of} must be >= 1 or None.")


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
