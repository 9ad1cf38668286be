"""Configuration of GRPO (`posttrain grpo`, `GRPOTrainer`).

Field names follow TRL's `GRPOConfig` (num_generations, beta, epsilon, epsilon_high,
num_iterations, scale_rewards, reward_weights, mask_truncated_completions, max_completion_length)
on top of `OnPolicyConfig`, which sizes the rollout batch exactly like RLOO / PPO
(per_device_train_batch_size × gradient_accumulation_steps × num_mini_batches completions per
device, num_mini_batches optimizer steps per pass). Defaults, and where they differ from TRL:

- num_generations 8, learning_rate 1e-6, temperature 1.0, epsilon 0.2: TRL GRPO's defaults.
- beta 0.05 (TRL GRPO: 0.0 since v0.19, 0.04 before; TRL's GRPO-style RLOO: 0.05): a KL term to
  the reference is on by default, as in the classic trainers; beta = 0 loads no reference model.
- scale_rewards is a bool (TRL's older form): True divides by the group std ("group" in newer TRL),
  False only subtracts the group mean (Dr. GRPO, "none").
- The loss is always the token mean over the GLOBAL number of completion tokens of the minibatch
  (TRL's loss_type="dapo"), so micro-batching and data parallelism leave the update unchanged.
- max_completion_length is an alias of response_length: give either (both only if equal).

Standard library only: `posttrain grpo --help` and validation run before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.configs import ConfigError, OnPolicyConfig, _help

_DEFAULT_RESPONSE_LENGTH = 53  # OnPolicyConfig.response_length's default


@dataclass
class GRPOConfig(OnPolicyConfig):
    """Group relative policy optimisation: num_generations completions per prompt, advantages
    (r − mean_group) / std_group, token-level PPO-clip loss plus beta · KL(π‖π_ref) (k3)."""

    exp_name: str = _help("Experiment name.", default="grpo_config")
    learning_rate: float = _help("Initial AdamW learning rate (TRL GRPO's default).", default=1e-6)
    temperature: float = _help("Sampling temperature; also divides logits when scoring logprobs.", default=1.0)
    num_generations: int = _help("Completions sampled per prompt (the group size G, ≥ 2).", default=8)
    max_completion_length: int | None = _help("Alias of response_length (TRL GRPO's name).", default=None)
    beta: float = _help(
        "Coefficient of the KL(π‖π_ref) loss term (k3 estimator); 0 loads no reference model.", default=0.05
    )
    epsilon: float = _help(
        "Lower clip range of the token-level ratio: clip(ρ, 1 − epsilon, 1 + epsilon_high).", default=0.2
    )
    epsilon_high: float | None = _help("Upper clip range (DAPO's clip-higher); None means epsilon.", default=None)
    num_iterations: int = _help("Passes over each rollout batch (GRPO's μ, PPO epochs).", default=1)
    scale_rewards: bool = _help(
        "Divide the group-centred rewards by the group std (False: Dr. GRPO, centring only).", default=True
    )
    reward_weights: list[float] | None = _help(
        "One weight per reward: the reward model first (when reward_model_path is set), then reward_funcs in order.",
        default=None,
    )
    mask_truncated_completions: bool = _help(
        "Leave completions that hit response_length without a stop token out of the loss.", default=False
    )

    def __post_init__(self) -> None:
        if self.max_completion_length is not None:
            if self.response_length not in (_DEFAULT_RESPONSE_LENGTH, self.max_completion_length):
                raise ConfigError(
                    f"max_completion_length={self.max_completion_length} and response_length={self.response_length} "
                    "disagree; they are the same setting, give one of them."
                )
            self.response_length = self.max_completion_length
        super().__post_init__()
        self.max_completion_length = self.response_length
        if self.num_generations < 2:
            raise ConfigError(
                f"num_generations={self.num_generations}: GRPO needs at least 2 completions per prompt to form a group."
            )
        if self.num_iterations < 1:
            raise ConfigError(f"num_iterations={self.num_iterations} must be >= 1.")
        if self.beta < 0:
            raise ConfigError(f"beta={self.beta} must be >= 0.")
        if self.epsilon <= 0:
            raise ConfigError(f"epsilon={self.epsilon} must be > 0.")
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ConfigError(f"epsilon_high={self.epsilon_high} must be >= epsilon={self.epsilon} (or None).")
        if self.reward_weights is not None and not self.reward_weights:
            raise ConfigError("reward_weights is empty; give one weight per reward or leave it unset.")
        expected = int(bool(self.reward_model_path)) + len(self.reward_funcs or [])
        if self.reward_weights is not None and expected and len(self.reward_weights) != expected:
            raise ConfigError(
                f"reward_weights has {len(self.reward_weights)} entries for {expected} rewards "
                "(reward_model_path first, then each of reward_funcs); give one weight per reward."
            )

    @property
    def samples_per_prompt(self) -> int:
        return self.num_generations
