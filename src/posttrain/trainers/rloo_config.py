"""Configuration of REINFORCE leave-one-out (`posttrain rloo`, `RLOOTrainer`).

Every field of TRL's on-policy `RLOOConfig` (TRL 0.19 documentation) exists here with
the same name, meaning and default, on top of `OnPolicyConfig` (rollout sizes, sampling, EOS
handling). Deliberate differences, each for a reason:

- `learning_rate` defaults to 5e-05, the value TRL documents for `RLOOConfig` (inherited from
  `TrainingArguments`, as TRL 0.19 documents it); TRL's example commands pass `--learning_rate 3e-6`.
- `whiten_rewards` is declared by TRL and never read. Here it does what its name says: the
  per-sequence RLHF rewards of the whole rollout batch (all ranks) are divided by their standard
  deviation, mean kept (`advantages.whiten_rewards`, shift_mean=False, as TRL's PPO whitening).
  Since the leave-one-out baseline removes any constant, this rescales the advantages by 1/std.
- `token_level_kl` defaults to False, as TRL's code (its docstring says True).
- `reward_model_path` and `sft_model_path` have no hub default (TRL: EleutherAI/pythia-160m): a
  missing reward is an error naming --reward_model_path / --reward_funcs, not a silent download.
- `normalize_reward` / `normalize_advantage` use the statistics of the whole rollout batch across
  ranks (TRL: each rank's own), so N processes give the update of one process with the same
  global batch.

Standard library only: `posttrain rloo --help` and validation run before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.configs import ConfigError, OnPolicyConfig, flag


@dataclass
class RLOOConfig(OnPolicyConfig):
    """REINFORCE leave-one-out: rloo_k completions per prompt, each baselined by the mean reward of
    the other k − 1; sequence-level PPO-clip updates (REINFORCE/A2C when num_ppo_epochs = 1 and
    num_mini_batches = 1)."""

    exp_name: str = flag("Experiment name.", default="rloo_config")
    learning_rate: float = flag("Initial AdamW learning rate (TRL's documented RLOOConfig default).", default=5e-5)
    num_ppo_epochs: int = flag("Passes over each rollout batch (PPO epochs).", default=4)
    whiten_rewards: bool = flag(
        "Divide the per-sequence RLHF rewards of the rollout batch by their std (mean kept). TRL declares "
        "this flag but never uses it.",
        default=False,
    )
    kl_coef: float = flag("KL coefficient: rlhf_reward = score − kl_coef · Σ_t KL_t.", default=0.05)
    cliprange: float = flag("PPO clip range of the sequence-level probability ratio.", default=0.2)
    rloo_k: int = flag("Completions sampled per prompt (the leave-one-out group size, ≥ 2).", default=2)
    normalize_reward: bool = flag(
        "Normalise scores to mean 0 / std 1 over the rollout batch, then clip to ±reward_clip_range.", default=False
    )
    reward_clip_range: float = flag("Clip range of the normalized scores (with normalize_reward).", default=10.0)
    normalize_advantage: bool = flag("Normalise advantages to mean 0 / std 1 over the rollout batch.", default=False)
    token_level_kl: bool = flag(
        "Put the KL penalty per token (score on the last token) instead of per sequence; with a "
        "masked KL both give the same per-sequence reward.",
        default=False,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rloo_k < 2:
            raise ConfigError(
                f"rloo_k={self.rloo_k}: RLOO needs at least 2 completions per prompt for a leave-one-out baseline."
            )
        if self.num_ppo_epochs < 1:
            raise ConfigError(f"num_ppo_epochs={self.num_ppo_epochs} must be >= 1.")
        if self.cliprange <= 0:
            raise ConfigError(f"cliprange={self.cliprange} must be > 0.")
        if self.kl_coef < 0:
            raise ConfigError(f"kl_coef={self.kl_coef} must be >= 0.")
        if self.normalize_reward and self.reward_clip_range <= 0:
            raise ConfigError(f"reward_clip_range={self.reward_clip_range} must be > 0 when normalize_reward is set.")

    @property
    def samples_per_prompt(self) -> int:
        return self.rloo_k
