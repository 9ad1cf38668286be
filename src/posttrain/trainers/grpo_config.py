"""Configuration of GRPO (`posttrain grpo`, `GRPOTrainer`).

Field names and defaults follow TRL 1.16's `GRPOConfig` (num_generations, beta, epsilon,
epsilon_high, delta, num_iterations, loss_type, importance_sampling_level, scale_rewards,
multi_objective_aggregation, reward_weights, top_entropy_quantile, use_bias_correction_kl,
sapo_temperature_pos / sapo_temperature_neg, vespo_k_pos / vespo_lambda_pos / vespo_k_neg / vespo_lambda_neg,
off_policy_mask_threshold, max_completion_length; TRL 1.9's entropy bonus
entropy_coef / use_adaptive_entropy / entropy_coef_min / entropy_coef_max / entropy_coef_delta /
entropy_target), with the TRL 1.x rollout
settings GRPO shares with RLOO (`configs.GroupRolloutOptions`: steps_per_generation /
generation_batch_size, sync_ref_model, min_p, repetition_penalty, generation_kwargs,
log_completions, chat_template_kwargs, pad_to_multiple_of, mask_truncated_completions), on top of
`OnPolicyConfig`, which sizes the rollout batch like RLOO / PPO (per_device_train_batch_size ×
gradient_accumulation_steps × num_mini_batches completions per device, num_mini_batches optimizer
steps per pass). docs/internals.md ("GRPO loss family") gives the equation of every variant.

- As in TRL, only the GLOBAL rollout batch (all processes) must divide by num_generations: the G
  completions of one prompt may live on different processes (rewards are gathered before the
  group statistics are taken).
- beta defaults to 0.0 (TRL GRPO's default since v0.19; posttrain used 0.05 before): no KL term and
  no reference model unless beta is set.
- scale_rewards takes "group", "batch" or "none"; True / False (also "true" / "false" from the
  command line) are aliases of "group" / "none", as in TRL.
- max_completion_length is an alias of response_length: give either (both only if equal).

Standard library only: `posttrain grpo --help` and validation run before torch loads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from posttrain.configs import (
    ConfigError,
    GroupRolloutOptions,
    OnPolicyConfig,
    VLLMOptions,
    check_group_rollout_options,
    check_reward_weights,
    flag,
    refuse_unsupported,
)

logger = logging.getLogger(__name__)

_DEFAULT_RESPONSE_LENGTH = 53  # OnPolicyConfig.response_length's default

# The accepted values (posttrain.grpo_losses implements each one).
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
# Loss types that sum per-token terms (a sequence-level ratio is then counted once per token).
TOKEN_SUMMED_LOSS_TYPES = ("bnpo", "dr_grpo", "dapo", "cispo")


# TRL 1.16 GRPOConfig fields accepted at their default only (refuse_unsupported names the field and this reason).
GRPO_UNSUPPORTED_FIELDS = {
    "max_tool_calling_iterations": "posttrain's GRPO calls no tools",
    "log_completions_hub_repo": "completions are written to samples.jsonl in output_dir, which push_to_hub uploads",
}


def _one_of(name: str, value: object, accepted: tuple[str, ...], extra: str = "") -> None:
    if value not in accepted:
        raise ConfigError(f"{name}={value!r} is not supported; use one of {', '.join(accepted)}{extra}.")


@dataclass
class GRPOConfig(GroupRolloutOptions, VLLMOptions, OnPolicyConfig):
    """Group relative policy optimisation: num_generations completions per prompt, group-relative
    advantages, and the loss selected by loss_type (TRL 1.16's GRPO family)."""

    exp_name: str = flag("Experiment name.", default="grpo_config")
    learning_rate: float = flag("Initial AdamW learning rate (TRL GRPO's default).", default=1e-6)
    temperature: float = flag("Sampling temperature; also divides logits when scoring logprobs.", default=1.0)
    num_generations: int = flag(
        "Completions sampled per prompt (the group size G, >= 2). The global rollout batch (all processes) "
        "must divide by it; a group may span processes.",
        default=8,
    )
    max_completion_length: int | None = flag("Alias of response_length (TRL GRPO's name).", default=None)
    beta: float = flag(
        "Coefficient of the KL(π‖π_ref) loss term (k3 estimator); 0 (TRL's default) loads no reference model.",
        default=0.0,
    )
    epsilon: float = flag(
        "Lower clip range of the importance ratio: clip(ρ, 1 − epsilon, 1 + epsilon_high).", default=0.2
    )
    epsilon_high: float | None = flag(
        "Upper clip range (DAPO's clip-higher); None means epsilon. With loss_type=cispo: the absolute cap on ρ "
        "(ScaleRL suggests 5.0).",
        default=None,
    )
    delta: float | None = flag(
        "Two-sided clipping (INTELLECT-2): cap the unclipped ratio at delta (recommended > 1 + epsilon); None: off.",
        default=None,
    )
    num_iterations: int = flag("Passes over each rollout batch (GRPO's μ, PPO epochs).", default=1)
    loss_type: str = flag(
        "The objective: grpo (sequence mean of token means), bnpo (micro-batch token mean), dr_grpo (sum / "
        "(B · max_completion_length)), dapo (token mean over the global batch), cispo (clipped IS-weight "
        "REINFORCE), sapo (soft gate), luspo (GSPO's sequence loss scaled by length; with "
        "importance_sampling_level=sequence), vespo (REINFORCE weighted by a gamma function of the sequence "
        "ratio). See docs/internals.md, 'GRPO loss family'.",
        default="dapo",
    )
    importance_sampling_level: str = flag(
        'Importance ratio per "token" or per "sequence" (GSPO: the length-normalized sequence ratio).',
        default="token",
    )
    scale_rewards: str = flag(
        'Divide the group-centred rewards by the std of the "group", of the whole "batch", or "none" '
        "(Dr. GRPO); true / false are aliases of group / none.",
        default="group",
    )
    multi_objective_aggregation: str = flag(
        "sum_then_normalize: weight and sum the rewards, then normalize (scale_rewards); normalize_then_sum "
        "(GDPO): normalize each reward within its group, weight and sum, then normalize over the batch.",
        default="sum_then_normalize",
    )
    reward_weights: list[float] | None = flag(
        "One weight per reward: the reward model first (when reward_model_path is set), then reward_funcs in order.",
        default=None,
    )
    top_entropy_quantile: float = flag(
        "Keep in the policy loss only the tokens whose entropy is in this top quantile (Beyond the 80/20 Rule "
        "recommends 0.2); 1.0 keeps every token.",
        default=1.0,
    )
    use_bias_correction_kl: bool = flag(
        "Multiply the per-token KL term by the importance ratio (DeepSeek-V3.2's unbiased KL estimate).", default=True
    )
    sapo_temperature_pos: float = flag("SAPO's gate temperature for positive advantages.", default=1.0)
    sapo_temperature_neg: float = flag("SAPO's gate temperature for negative advantages.", default=1.05)
    vespo_k_pos: float = flag(
        "VESPO's power k for A >= 0: φ(w) = e^λ·w^k·e^(−λw) down-weights sequence ratios w < 1 more as k grows.",
        default=2.0,
    )
    vespo_lambda_pos: float = flag(
        "VESPO's decay λ for A >= 0: down-weights sequence ratios w > 1 more as λ grows.", default=3.0
    )
    vespo_k_neg: float = flag("VESPO's power k for A < 0.", default=3.0)
    vespo_lambda_neg: float = flag("VESPO's decay λ for A < 0.", default=2.0)
    cast_lm_head_to_fp32: bool = flag(
        "Keep the LM head of the policy and the reference in float32 and compute the logits in float32 under bf16 "
        "/ fp16 (autocast included), as the ScaleRL recipe recommends (arXiv:2510.13786); tied embeddings share "
        "the float32 matrix. Not with LoRA on lm_head.",
        default=False,
    )
    max_tool_calling_iterations: int | None = flag(
        "TRL: tool-calling turns per completion (not supported: posttrain's GRPO calls no tools).", default=None
    )
    log_completions_hub_repo: str | None = flag(
        "TRL: push the completions tables to a Hub dataset (not supported: they are written to samples.jsonl in "
        "output_dir, which push_to_hub uploads).",
        default=None,
    )
    off_policy_mask_threshold: float | None = flag(
        "Off-policy sequence masking (DeepSeek-V3.2): drop from the policy loss the completions with a negative "
        "advantage whose mean per-token log π_old − log π_θ exceeds this (e.g. 0.5); None: off.",
        default=None,
    )
    entropy_coef: float = flag(
        "Entropy bonus: loss = policy loss − entropy_coef · H, H the mean per-token entropy of the loss tokens "
        "(the same meaning for every loss_type); 0: off. With use_adaptive_entropy, the initial coefficient.",
        default=0.0,
    )
    use_adaptive_entropy: bool = flag(
        "Adaptive entropy control (Skywork-OR1): after each optimizer step the coefficient moves by "
        "entropy_coef_delta, up when the entropy is <= entropy_target, down otherwise, within "
        "[entropy_coef_min, entropy_coef_max]; the bonus applies only while the entropy is <= entropy_target.",
        default=False,
    )
    entropy_coef_min: float = flag("Lower bound of the adaptive entropy coefficient.", default=0.0)
    entropy_coef_max: float = flag("Upper bound of the adaptive entropy coefficient.", default=1.0)
    entropy_coef_delta: float = flag("Change of the adaptive entropy coefficient per optimizer step.", default=0.005)
    entropy_target: float = flag(
        "Target mean per-token entropy (nats) of adaptive entropy control, over the loss tokens (the "
        "top-entropy ones with top_entropy_quantile < 1). Language models typically have 2-10 nats per token: "
        "set it near the entropy observed early in training.",
        default=0.2,
    )

    def __post_init__(self) -> None:
        if self.max_completion_length is not None:
            if self.response_length not in (_DEFAULT_RESPONSE_LENGTH, self.max_completion_length):
                raise ConfigError(
                    f"max_completion_length={self.max_completion_length} and response_length={self.response_length} "
                    "disagree; they are the same setting, give one of them."
                )
            self.response_length = self.max_completion_length
        check_group_rollout_options(self, kl_field="beta", kl_coef=self.beta)
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
        if self.delta is not None and self.delta <= 1:
            raise ConfigError(f"delta={self.delta} must be > 1 (it caps the ratio from above; None turns it off).")
        _one_of("loss_type", self.loss_type, LOSS_TYPES)
        _one_of("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        if self.importance_sampling_level == "sequence" and self.loss_type in TOKEN_SUMMED_LOSS_TYPES:
            logger.warning(
                "importance_sampling_level='sequence' with loss_type=%r: this loss sums per-token contributions, "
                "which weights each sequence by its completion length instead of optimizing GSPO's per-sequence "
                "objective. Set loss_type='grpo' for the GSPO paper's setup (arXiv:2507.18071).",
                self.loss_type,
            )
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            logger.warning(
                "loss_type='luspo' with importance_sampling_level=%r: LUSPO (arXiv:2602.05261) scales GSPO's "
                "sequence-level loss; set importance_sampling_level='sequence' for the paper's setup.",
                self.importance_sampling_level,
            )
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            logger.warning(
                "loss_type='vespo' computes its sequence-level weight from the token ratios itself; "
                "importance_sampling_level=%r only changes the ratio of the KL bias correction. Leave it at "
                "'token' (the default) for the paper's setup (arXiv:2602.10693).",
                self.importance_sampling_level,
            )
        _one_of("multi_objective_aggregation", self.multi_objective_aggregation, MULTI_OBJECTIVE_AGGREGATIONS)
        scale = self.scale_rewards
        if isinstance(scale, str):
            scale = {"true": "group", "false": "none"}.get(scale.strip().lower(), scale)
        self.scale_rewards = {True: "group", False: "none"}.get(scale, scale) if isinstance(scale, bool) else scale
        _one_of("scale_rewards", self.scale_rewards, SCALE_REWARDS, " (True / False: group / none)")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ConfigError(f"top_entropy_quantile={self.top_entropy_quantile} must be in [0, 1] (1.0 keeps all).")
        if self.off_policy_mask_threshold is not None and self.off_policy_mask_threshold < 0:
            raise ConfigError(
                f"off_policy_mask_threshold={self.off_policy_mask_threshold} must be >= 0 (a mean KL; None: off)."
            )
        for name in ("entropy_coef", "entropy_coef_min", "entropy_coef_delta"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0 (entropy_coef 0: no entropy bonus).")
        if self.entropy_coef_max < self.entropy_coef_min:
            raise ConfigError(
                f"entropy_coef_max={self.entropy_coef_max} must be >= entropy_coef_min={self.entropy_coef_min}."
            )
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0.")
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0 (VESPO's weight e^λ·w^k·e^(−λw)).")
        check_reward_weights(self)
        refuse_unsupported(self, GRPO_UNSUPPORTED_FIELDS)

    @property
    def samples_per_prompt(self) -> int:
        return self.num_generations

    def check_samples_per_prompt(self) -> None:
        """Only the global rollout batch must hold whole groups (TRL 1.16: generation_batch_size %
        num_generations == 0); a group's completions may live on different processes."""
        assert self.batch_size is not None and self.world_size is not None
        if self.batch_size % self.num_generations != 0:
            raise ConfigError(
                "per_device_train_batch_size × gradient_accumulation_steps × num_mini_batches × processes = "
                f"{self.batch_size} completions per rollout batch must be divisible by num_generations "
                f"({self.num_generations}); change the batch size or num_generations."
            )

    @property
    def prompts_per_rollout(self) -> int:
        """Prompts per device the shared prompt stream is sized for (rounded up); GRPOTrainer draws
        the whole global batch of batch_size / num_generations prompts on every process."""
        assert self.batch_size is not None and self.world_size is not None, "call derive_sizes() first"
        return -(-self.global_prompts_per_rollout // self.world_size)

    @property
    def global_prompts_per_rollout(self) -> int:
        """Prompts per rollout batch over all processes."""
        assert self.batch_size is not None, "call derive_sizes() first"
        return self.batch_size // self.num_generations
