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
    bf16: bool = flag("bf16 mixed precision (autocast). Fast on GPUs and on CPUs with AMX.", default=False)
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
    report_to: list[str] = flag(
        "Metric sinks besides console and metrics.jsonl: none, tensorboard, wandb, all.",
        default_factory=lambda: ["none"],
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

    def __post_init__(self) -> None:
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

    # -- helpers -------------------------------------------------------------------------------
    @property
    def mixed_precision(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "no"

    def to_dict(self) -> dict[str, Any]:
        """Every field (derived sizes included), JSON-serialisable: saved beside models and checkpoints."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
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

    # Derived by derive_sizes(); None until then (TRL names).
    world_size: int | None = field(
        default=None, init=False, metadata={"help": "Derived: number of processes.", "derived": True}
    )
    local_batch_size: int | None = field(default=None, init=False, metadata={"help": "Derived.", "derived": True})
    batch_size: int | None = field(
        default=None, init=False, metadata={"help": "Derived: episodes per rollout batch.", "derived": True}
    )
    mini_batch_size: int | None = field(default=None, init=False, metadata={"help": "Derived.", "derived": True})
    local_mini_batch_size: int | None = field(default=None, init=False, metadata={"help": "Derived.", "derived": True})
    micro_batch_size: int | None = field(default=None, init=False, metadata={"help": "Derived.", "derived": True})
    num_total_batches: int | None = field(default=None, init=False, metadata={"help": "Derived.", "derived": True})

    def __post_init__(self) -> None:
        super().__post_init__()
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

    model_init_kwargs: dict[str, Any] | str | None = flag(
        "Extra keyword arguments for from_pretrained, as JSON on the command line "
        '(e.g. \'{"attn_implementation": "sdpa"}\').',
        default=None,
    )
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
        self.model_init_kwargs = parse_json_field("model_init_kwargs", self.model_init_kwargs)
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
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("derived")]


def resolve_path(path: str | None) -> str | None:
    """Expand ~ in local paths; leave hub names untouched."""
    return os.path.expanduser(path) if path else path
