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

TRL >= 0.21 rewrote RLOOConfig in GRPO's vocabulary for the same algorithm (sequence-level k1 KL
penalty in the reward, leave-one-out baseline, sequence-level PPO-clip). Its six renamed fields are
fields here too, default None; each one given sets the TRL 0.19 field it renames (`TRL_1X_NAMES`),
which the trainer reads, and keeps the value given:

    TRL >= 0.21 name        TRL 0.19 field (read by the trainer)
    num_generations         rloo_k
    beta                    kl_coef
    max_completion_length   response_length
    epsilon                 cliprange
    num_iterations          num_ppo_epochs
    normalize_advantages    normalize_advantage

Both names given with different values is a ConfigError naming both (a 0.19 field left at its
default yields to the new name). A field neither name sets keeps its 0.19 default, which may differ
from TRL 1.x's: num_ppo_epochs 4 (num_iterations 1), response_length 53 (max_completion_length 512),
learning_rate 5e-05 (1e-06), temperature 0.7 (1.0); README.md, "RLOO", lists them. TRL 1.x's
`reward_clip_range` is a (min, max) pair clipping the raw rewards (before the KL penalty); a float is
0.19's clip to ±c of the scores normalised by normalize_reward. Both meanings work, told apart by
type. TRL 1.x's `reward_weights` (one weight per reward) and `epsilon_high` (the upper clip bound,
default cliprange) are fields with TRL's meaning; its
`num_generations_eval` accepts only 1, the one greedy completion per eval
prompt that evaluation draws. TRL 1.x's rollout settings shared with GRPO (steps_per_generation /
generation_batch_size, mask_truncated_completions, sync_ref_model, min_p, repetition_penalty,
generation_kwargs, log_completions, chat_template_kwargs, pad_to_multiple_of) come from
`configs.GroupRolloutOptions`; docs/internals.md ("TRL 1.x rollout options of GRPO and RLOO").

Standard library only: `posttrain rloo --help` and validation run before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.configs import (
    ConfigError,
    GroupRolloutOptions,
    OnPolicyConfig,
    VLLMOptions,
    _field_default,
    check_group_rollout_options,
    check_reward_weights,
    flag,
)

# TRL >= 0.21's RLOOConfig name -> the TRL 0.19 field it sets (same meaning and units).
TRL_1X_NAMES = {
    "num_generations": "rloo_k",
    "beta": "kl_coef",
    "max_completion_length": "response_length",
    "epsilon": "cliprange",
    "num_iterations": "num_ppo_epochs",
    "normalize_advantages": "normalize_advantage",
}


@dataclass
class RLOOConfig(GroupRolloutOptions, VLLMOptions, OnPolicyConfig):
    """REINFORCE leave-one-out: rloo_k completions per prompt, each baselined by the mean reward of
    the other k − 1; sequence-level PPO-clip updates (REINFORCE/A2C when num_ppo_epochs = 1 and
    num_mini_batches = 1)."""

    exp_name: str = flag("Experiment name.", default="rloo_config")
    learning_rate: float = flag("Initial AdamW learning rate (TRL's documented RLOOConfig default).", default=5e-5)
    num_ppo_epochs: int = flag("Passes over each rollout batch (PPO epochs; TRL >= 0.21: num_iterations).", default=4)
    whiten_rewards: bool = flag(
        "Divide the per-sequence RLHF rewards of the rollout batch by their std (mean kept). TRL declares "
        "this flag but never uses it.",
        default=False,
    )
    kl_coef: float = flag("KL coefficient: rlhf_reward = score − kl_coef · Σ_t KL_t (TRL >= 0.21: beta).", default=0.05)
    cliprange: float = flag(
        "PPO clip range of the sequence-level probability ratio (TRL >= 0.21: epsilon).", default=0.2
    )
    rloo_k: int = flag(
        "Completions sampled per prompt (the leave-one-out group size, ≥ 2; TRL >= 0.21: num_generations).", default=2
    )
    normalize_reward: bool = flag(
        "Normalise scores to mean 0 / std 1 over the rollout batch, then clip to ±reward_clip_range.", default=False
    )
    reward_clip_range: float | str | tuple[float, float] | None = flag(
        "A float c: clip to ±c the scores normalised by normalize_reward (TRL 0.19). A (min, max) pair (on "
        "the command line: --reward_clip_range=-1,1): clip the raw rewards to it before the KL penalty (TRL >= 0.21).",
        default=10.0,
    )
    normalize_advantage: bool = flag(
        "Normalise advantages to mean 0 / std 1 over the rollout batch (TRL >= 0.21: normalize_advantages).",
        default=False,
    )
    reward_weights: list[float] | None = flag(
        "One weight per reward (TRL >= 0.21): the reward model first (when reward_model_path is set), then "
        "reward_funcs in order; the score is their weighted sum. None: all 1.",
        default=None,
    )
    token_level_kl: bool = flag(
        "Put the KL penalty per token (score on the last token) instead of per sequence; with a "
        "masked KL both give the same per-sequence reward.",
        default=False,
    )

    # TRL >= 0.21 names (GRPO-style RLOOConfig); each sets the TRL 0.19 field named in its help.
    num_generations: int | None = flag(
        "TRL >= 0.21 name of rloo_k (completions per prompt); None: rloo_k applies.", default=None
    )
    beta: float | None = flag(
        "TRL >= 0.21 name of kl_coef (KL coefficient in the reward); None: kl_coef applies.", default=None
    )
    max_completion_length: int | None = flag(
        "TRL >= 0.21 name of response_length (maximum new tokens per completion); None: response_length applies.",
        default=None,
    )
    epsilon: float | None = flag(
        "TRL >= 0.21 name of cliprange (PPO clip range); None: cliprange applies.", default=None
    )
    epsilon_high: float | None = flag(
        "TRL 1.x: upper clip bound, ρ clipped to [1 − cliprange, 1 + epsilon_high] (DAPO's clip-higher, which "
        "recommends 0.28); None: cliprange.",
        default=None,
    )
    num_iterations: int | None = flag(
        "TRL >= 0.21 name of num_ppo_epochs (passes per rollout batch); None: num_ppo_epochs applies.", default=None
    )
    normalize_advantages: bool | None = flag(
        "TRL >= 0.21 name of normalize_advantage (advantages to mean 0 / std 1); None: normalize_advantage applies.",
        default=None,
    )

    def __post_init__(self) -> None:
        self._resolve_trl_1x_names()
        if isinstance(self.reward_clip_range, str):  # the command line: "10" or "-1,1" / "(-1, 1)" / "[-1, 1]"
            parts = self.reward_clip_range.strip().strip("()[]").split(",")
            try:
                values = [float(p) for p in parts]
            except ValueError:
                values = []
            if len(values) not in (1, 2):
                raise ConfigError(
                    f"reward_clip_range={self.reward_clip_range!r}: give a float c (with normalize_reward) or a "
                    "'min,max' pair clipping the raw rewards."
                )
            self.reward_clip_range = values[0] if len(values) == 1 else tuple(values)
        if isinstance(self.reward_clip_range, (tuple, list)):
            low, high = (float(v) for v in self.reward_clip_range) if len(self.reward_clip_range) == 2 else (1, 0)
            if not low < high:
                raise ConfigError(
                    f"reward_clip_range={self.reward_clip_range!r}: a clip of the raw rewards is a (min, max) pair "
                    "with min < max (a float c is TRL 0.19's clip to ±c of the scores normalised by normalize_reward)."
                )
            if self.normalize_reward:
                raise ConfigError(
                    f"reward_clip_range={self.reward_clip_range!r} with normalize_reward=True: a (min, max) pair clips "
                    "the raw rewards (TRL >= 0.21), a float c the normalised ones (TRL 0.19); give a float."
                )
            self.reward_clip_range = (low, high)
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ConfigError(f"max_completion_length={self.max_completion_length} must be >= 1.")
        check_group_rollout_options(self, kl_field=self._named("kl_coef"), kl_coef=self.kl_coef)
        super().__post_init__()
        if self.rloo_k < 2:
            raise ConfigError(
                f"{self._named('rloo_k')}={self.rloo_k}: RLOO needs at least 2 completions per prompt for a "
                "leave-one-out baseline."
            )
        if self.num_ppo_epochs < 1:
            raise ConfigError(f"{self._named('num_ppo_epochs')}={self.num_ppo_epochs} must be >= 1.")
        if self.cliprange <= 0:
            raise ConfigError(f"{self._named('cliprange')}={self.cliprange} must be > 0.")
        if self.epsilon_high is not None and self.epsilon_high < self.cliprange:
            raise ConfigError(
                f"epsilon_high={self.epsilon_high} must be >= {self._named('cliprange')}={self.cliprange} (or None)."
            )
        if self.kl_coef < 0:
            raise ConfigError(f"{self._named('kl_coef')}={self.kl_coef} must be >= 0.")
        check_reward_weights(self)
        if self.normalize_reward and (self.reward_clip_range is None or self.reward_clip_range <= 0):
            raise ConfigError(f"reward_clip_range={self.reward_clip_range} must be > 0 when normalize_reward is set.")

    def _resolve_trl_1x_names(self) -> None:
        """Each TRL >= 0.21 name given sets its TRL 0.19 field; both given and different: ConfigError."""
        for new, old in TRL_1X_NAMES.items():
            value = getattr(self, new)
            if value is None:
                continue
            current = getattr(self, old)
            if current != _field_default(type(self), old) and current != value:
                raise ConfigError(
                    f"{new}={value!r} and {old}={current!r} are two names of the same setting ({new}: TRL >= 0.21, "
                    f"{old}: TRL 0.19) with different values; give only one."
                )
            setattr(self, old, value)

    def _named(self, old: str) -> str:
        """The name the caller used for a TRL 0.19 field (its TRL >= 0.21 name when that was given)."""
        new = next(n for n, o in TRL_1X_NAMES.items() if o == old)
        return new if getattr(self, new) is not None else old

    @property
    def samples_per_prompt(self) -> int:
        return self.rloo_k
