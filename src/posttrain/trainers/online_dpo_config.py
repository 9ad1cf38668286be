"""Configuration of Online DPO (`posttrain online-dpo`, `OnlineDPOTrainer`).

Fields, meanings and defaults follow TRL's `OnlineDPOConfig` on top of the shared
`OnPolicyConfig`. Deliberate differences, each for a reason:

- `per_device_train_batch_size` counts completions, as in every posttrain online trainer (and
  TRL's GRPO / RLOO): each prompt yields 2 completions, so 8 means 4 prompts per micro-batch.
  TRL's Online DPO counted prompts; double the number to port a TRL command line exactly.
- `max_new_tokens` and `response_length` (the OnPolicyConfig name) are aliases; giving both with
  different values is an error rather than a silent choice.
- `gradient_checkpointing` and `bf16` default to off (CPU-first); TRL's base config turns both on.
- generation options TRL has that posttrain's rollout engine does not (vLLM, min_p,
  repetition_penalty) are absent.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.configs import ConfigError, OnPolicyConfig, flag, refuse_unsupported

DEFAULT_MAX_NEW_TOKENS = 64


VLLM_FIELDS = {
    "use_vllm": "posttrain generates with its own engine (posttrain.rollout); vLLM is not used",
    "vllm_model_impl": "vLLM is not used",
    "gpu_memory_utilization": "vLLM is not used",
}


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
class OnlineDPOConfig(OnPolicyConfig):
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
    use_vllm: bool = flag(
        "Generate with vLLM (not supported: posttrain.rollout is the generation engine).", default=False
    )
    vllm_model_impl: str = flag("vLLM model implementation (not supported).", default="vllm")
    gpu_memory_utilization: float | None = flag("vLLM GPU memory fraction (not supported).", default=0.55)

    def __post_init__(self) -> None:
        refuse_unsupported(self, VLLM_FIELDS)
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
