"""Configuration of Online DPO (`posttrain online-dpo`, `OnlineDPOTrainer`).

Fields, meanings and defaults follow TRL's `OnlineDPOConfig` on top of the shared
`OnPolicyConfig`.

Batch sizes are TRL's: `per_device_train_batch_size` counts PROMPTS, each sampled twice (the
pair that is ranked), so a micro-batch holds 2 × per_device_train_batch_size completions. TRL's
`OnlineDPOTrainer` / `XPOTrainer` run on transformers' Trainer, so the same command makes the same
number of optimizer steps here (`derive_sizes`), with P prompts, W processes, GA =
gradient_accumulation_steps:

    steps per epoch = max(1, ceil(ceil(P / (per_device_train_batch_size · W)) / GA))
    max_steps       = ceil(num_train_epochs · steps per epoch)   (or --max_steps when > 0)

e.g. 32 prompts, per_device_train_batch_size 4, one process: 8 steps per epoch, each on 4 prompts ×
2 completions. The learning-rate schedule (and warmup_ratio) spans max_steps optimizer steps, as
TRL's. One rollout batch = per_device_train_batch_size · GA · num_mini_batches prompts per process
and makes num_mini_batches optimizer steps (num_mini_batches is posttrain's, 1 = TRL); the run
makes ceil(max_steps / num_mini_batches) rollout batches, so `trainer.state.max_steps` and
`global_step` equal TRL's with num_mini_batches = 1. Every step draws full batches (a prompt
stream reshuffled each pass), where transformers' last step of an epoch may be shorter.
`total_episodes`, when given, counts completions (2 per prompt) and sets the run length instead.
`episode` (logged) counts completions generated so far, as TRL's RLOO / PPO count theirs; TRL's
Online DPO logs no `episode`, only `epoch`.

Deliberate differences, each for a reason:

- `max_new_tokens` and `response_length` (the OnPolicyConfig name) are aliases; giving both with
  different values is an error rather than a silent choice.
- `gradient_checkpointing` and `bf16` default to off (CPU-first); TRL's base config turns both on.
- vLLM and transformers' paged generation (TRL's `use_vllm`, `vllm_*`, `use_transformers_paged`) are
  accepted at their defaults and refused otherwise: posttrain samples with its own engine. TRL 1.x's
  `min_p`, `repetition_penalty` and `generation_kwargs` are honoured (configs.SamplingOptions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from posttrain.configs import (
    ConfigError,
    OnPolicyConfig,
    SamplingOptions,
    VLLMOptions,
    check_sampling_options,
    flag,
)

DEFAULT_MAX_NEW_TOKENS = 64


def resolve_schedule(name: str, value: object) -> list[float]:
    """A float or a non-empty list of floats -> list (TRL: a list is a per-epoch schedule)."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} must be a number or a list of numbers (one per epoch).") from None
    if not values:
        raise ConfigError(f"{name} is empty; give a number or one number per epoch.")
    return values


@dataclass
class OnlineDPOConfig(SamplingOptions, VLLMOptions, OnPolicyConfig):
    """Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback")."""

    learning_rate: float = flag("Initial AdamW learning rate.", default=5e-7)
    logging_steps: float = flag("Log metrics (averaged since the last log) every N rollout batches.", default=10)
    max_new_tokens: int | None = flag(
        f"Maximum new tokens per completion (default {DEFAULT_MAX_NEW_TOKENS}); alias of response_length.", default=None
    )
    response_length: int | None = flag("Alias of max_new_tokens (the OnPolicyConfig name).", default=None)
    max_length: int = flag(
        "Cap on prompt + completion tokens in the log-prob forward passes; longer prompts lose their left part "
        "there (generation sees the whole prompt), as in TRL.",
        default=512,
    )
    temperature: float = flag(
        "Sampling temperature (log-probs of the DPO loss are taken at temperature 1).", default=0.9
    )
    beta: list[float] = flag(
        "DPO beta / IPO tau: one value, or one value per epoch (the last one is kept after the list ends).",
        default_factory=lambda: [0.1],
    )
    loss_type: str = flag('"sigmoid" (DPO) or "ipo".', default="sigmoid")
    judge: str | None = flag(
        "Pairwise judge instead of a reward model: pair_rm, openai[:model], http:<url>#<model>, "
        "reward_model:<path>, python:<module>:<function>, random[:seed].",
        default=None,
    )
    reward_weights: list[float] | None = flag(
        "Weights of the rewards (reward model first, then each reward function); default 1 each.", default=None
    )
    gpu_memory_utilization: float | None = flag("vLLM GPU memory fraction (not supported).", default=0.55)
    vllm_gpu_memory_utilization: float = flag("vLLM GPU memory fraction (not supported).", default=0.55)

    def __post_init__(self) -> None:
        check_sampling_options(self)
        # The alias must be settled before OnPolicyConfig validates response_length.
        if (
            self.max_new_tokens is not None
            and self.response_length is not None
            and self.max_new_tokens != self.response_length
        ):
            raise ConfigError(
                f"max_new_tokens={self.max_new_tokens} and response_length={self.response_length} disagree; "
                "they are the same setting, give one of them."
            )
        length = self.max_new_tokens if self.max_new_tokens is not None else self.response_length
        self.max_new_tokens = self.response_length = DEFAULT_MAX_NEW_TOKENS if length is None else length
        super().__post_init__()
        self.beta = resolve_schedule("beta", self.beta)
        if any(b <= 0 for b in self.beta):
            raise ConfigError(f"beta={self.beta} must be > 0 (IPO divides by it).")
        if self.loss_type not in ("sigmoid", "ipo"):
            raise ConfigError(f'loss_type={self.loss_type!r} must be "sigmoid" or "ipo".')
        if self.max_length <= self.max_new_tokens:
            raise ConfigError(
                f"max_length={self.max_length} must exceed max_new_tokens={self.max_new_tokens} "
                "(it caps prompt + completion)."
            )

    @property
    def samples_per_prompt(self) -> int:
        """Two completions per prompt: the pair that is ranked."""
        return 2

    def derive_sizes(self, world_size: int = 1, dataset_size: int | None = None) -> OnlineDPOConfig:
        """TRL's step count (module docstring). The derived sizes keep OnPolicyConfig's meaning
        (completions), with per_device_train_batch_size counted in prompts:
          local_mini_batch_size = 2 · per_device_train_batch_size · GA   (completions per optimizer step and process)
          local_batch_size      = local_mini_batch_size · num_mini_batches
          batch_size            = local_batch_size · world_size          (completions per rollout batch)
          num_total_batches     = ceil(total_episodes / batch_size)      (rollout batches)
        """
        k = self.samples_per_prompt
        prompts_per_step = self.per_device_train_batch_size * world_size
        self.world_size = world_size
        self.micro_batch_size = k * prompts_per_step
        self.local_mini_batch_size = k * self.per_device_train_batch_size * self.gradient_accumulation_steps
        self.local_batch_size = self.local_mini_batch_size * self.num_mini_batches
        self.batch_size = self.local_batch_size * world_size
        self.mini_batch_size = self.local_mini_batch_size * world_size
        if self.max_steps > 0:
            self.total_episodes = math.ceil(self.max_steps / self.num_mini_batches) * self.batch_size
        elif self.total_episodes is None:
            if dataset_size is None:
                raise ConfigError("total_episodes is not set and the dataset size is unknown; pass --total_episodes.")
            # transformers.Trainer: len(dataloader) = ceil(P / (per_device_train_batch_size · W)) per
            # process; an epoch makes ceil(len / GA) optimizer steps (the last one may accumulate less).
            dataloader_len = math.ceil(dataset_size / prompts_per_step)
            steps_per_epoch = max(math.ceil(dataloader_len / self.gradient_accumulation_steps), 1)
            max_steps = math.ceil(self.num_train_epochs * steps_per_epoch)
            self.total_episodes = math.ceil(max_steps / self.num_mini_batches) * self.batch_size
        if self.total_episodes < self.batch_size:
            raise ConfigError(
                f"total_episodes ({self.total_episodes}) is smaller than one rollout batch "
                f"(batch_size = {self.batch_size} completions = {k} per prompt × per_device_train_batch_size "
                f"{self.per_device_train_batch_size} × gradient_accumulation_steps {self.gradient_accumulation_steps} "
                f"× num_mini_batches {self.num_mini_batches} × world_size {world_size}); "
                "raise total_episodes or lower the batch size."
            )
        self.num_total_batches = math.ceil(self.total_episodes / self.batch_size)
        return self
