"""Configuration of `posttrain ppo` / `PPOTrainer`: PPO with a critic, both ways in.

One dataclass serves both APIs of trainers/ppo.py:
- `train()` (TRL 0.19 "on-policy" PPOTrainer): the OnPolicyConfig sizes plus
  num_ppo_epochs, kl_coef, kl_estimator, whiten_rewards, cliprange, vf_coef, cliprange_value,
  gamma, lam;
- `generate()` / `step()` (TRL ≤ 0.11 PPOTrainer and its gpt2-sentiment notebook): steps, batch_size,
  mini_batch_size, ppo_epochs, adap_kl_ctrl, init_kl_coef, target, horizon, kl_penalty,
  use_score_scaling, use_score_norm, score_clip, early_stopping, target_kl, ratio_threshold,
  log_with.

Where the two TRL generations name the same setting twice, both names are accepted and resolved in
`__post_init__` (each pair defaults to None so "explicitly set" is visible); giving both with
different values is a ConfigError. After resolution both names hold the same value:

    on-policy name     classic name     default   meaning
    num_ppo_epochs     ppo_epochs       4         optimisation epochs over each batch
    kl_coef            init_kl_coef     0.05      KL coefficient (initial value when adaptive)
    kl_estimator       kl_penalty       "k1"      k1 = "kl", k2 = "mse", k3, abs, full
    total_episodes     steps            None      completions in the whole train() run
    report_to          log_with         ["none"]  metric sinks besides console and metrics.jsonl

Defaults are the on-policy ones (TRL 0.19) for every shared setting. The classic trainer's
defaults differ (init_kl_coef 0.2, adap_kl_ctrl True, learning_rate 1.41e-5): scripts that relied
on them should pass them explicitly.

`batch_size` and `mini_batch_size` are derived, read-only sizes in OnPolicyConfig; here they are
settable because `step()` needs them (classic meaning: `batch_size` rows per `step()` call,
forward/backward micro-batches of `mini_batch_size` rows, one optimizer step per
`mini_batch_size × gradient_accumulation_steps` rows). `train()` still derives both
(batch_size = episodes per rollout batch, mini_batch_size = episodes per optimizer step); a value
set explicitly must then equal the derived one, else ConfigError names both.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.configs import ConfigError, OnPolicyConfig, flag

# Equivalent names of the same estimator (advantages.KL_ESTIMATORS plus the exact "full" KL).
_KL_CANONICAL = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "abs": "abs", "full": "full"}
VALUE_MODEL_INITS = ("reward", "policy", "head")


@dataclass
class PPOConfig(OnPolicyConfig):
    """PPO with a critic (TRL PPOConfig, both generations); see the module docstring for aliases."""

    # -- PPO (TRL on-policy names) ------------------------------------------------------------
    num_ppo_epochs: int | None = flag(
        "Epochs of PPO updates over each rollout batch (default 4; alias ppo_epochs).", default=None
    )
    kl_coef: float | None = flag(
        "KL penalty coefficient in the per-token reward; the initial value when adap_kl_ctrl "
        "(default 0.05; alias init_kl_coef).",
        default=None,
    )
    kl_estimator: str | None = flag(
        "Per-token KL estimator: k1 (= kl), k2 (= mse), k3, abs, or full (exact KL over the vocabulary) "
        "(default k1; alias kl_penalty).",
        default=None,
    )
    whiten_rewards: bool = flag("Whiten the per-token rewards (scale only, mean kept) before GAE.", default=False)
    whiten_advantages: bool = flag(
        "Whiten the advantages over the batch (mean 0, std 1), as TRL always does.", default=True
    )
    cliprange: float = flag("PPO policy clip range ε: the ratio is clipped to [1 − ε, 1 + ε].", default=0.2)
    vf_coef: float = flag("Weight of the value loss in the total loss.", default=0.1)
    cliprange_value: float = flag(
        "Value clip range: V is clipped to V_old ± cliprange_value in the value loss.", default=0.2
    )
    gamma: float = flag("Discount factor of GAE.", default=1.0)
    lam: float = flag("λ of GAE.", default=0.95)
    entropy_coef: float = flag(
        "Entropy bonus weight: loss −= entropy_coef · mean token entropy (DeepSpeed-Chat practice uses 0.01; 0 = off).",
        default=0.0,
    )
    value_model_path: str | None = flag(
        "Critic initialisation from this folder / hub name (a reward or causal LM checkpoint); "
        "overrides value_model_init.",
        default=None,
    )
    value_model_init: str | None = flag(
        'Critic when none is given: "reward" (a copy of the reward model, as DeepSpeed-Chat and TRL\'s examples do), '
        '"policy" (a separate value model with the policy\'s trunk and a new head) or "head" (a value head on the '
        'policy\'s own trunk). Default: "reward" with a reward model, else "policy".',
        default=None,
    )
    is_encoder_decoder: bool | None = flag(
        "step() / generate(): the policy is an encoder–decoder LM (T5, BART; queries feed the encoder, responses "
        "are decoder sequences). None: detected from the model.",
        default=None,
    )
    # -- reward scaling (classic PPOConfig; DeepSpeed-Chat's cure for a diverging critic) ------
    use_score_scaling: bool = flag("Divide scores by the running std of all scores seen so far.", default=False)
    use_score_norm: bool = flag("With use_score_scaling: also subtract the running mean.", default=False)
    score_clip: float | None = flag("Clip (scaled) scores to [−score_clip, score_clip].", default=None)
    # -- KL control and safety switches (classic PPOConfig) ------------------------------------
    adap_kl_ctrl: bool = flag(
        "Adapt the KL coefficient towards `target` (Ziegler et al. 2019); off = fixed kl_coef.", default=False
    )
    target: float = flag("Target KL (sum over a completion) of the adaptive controller.", default=6.0)
    horizon: float = flag("Horizon of the adaptive KL controller, in episodes.", default=10000.0)
    early_stopping: bool = flag(
        "Stop a batch's PPO epochs once the minibatch policy KL exceeds 1.5 × target_kl.", default=False
    )
    target_kl: float = flag("KL threshold of early_stopping.", default=1.0)
    ratio_threshold: float = flag(
        "Skip (zero the loss of) a micro-batch whose mean ratio exceeds this (classic PPO's guard).", default=10.0
    )
    # -- classic aliases -------------------------------------------------------------------------
    steps: int | None = flag("Classic name of total_episodes (completions in the run).", default=None)
    ppo_epochs: int | None = flag("Classic name of num_ppo_epochs.", default=None)
    init_kl_coef: float | None = flag("Classic name of kl_coef.", default=None)
    kl_penalty: str | None = flag("Classic name of kl_estimator (kl, abs, mse, full).", default=None)
    log_with: str | None = flag("Classic name of report_to: wandb or tensorboard.", default=None)
    # Settable here (derived in OnPolicyConfig): step() reads them, train() checks them.
    batch_size: int | None = flag(
        "step(): rows per step() call (None: any). train(): derived; if set it must equal the derived value.",
        default=None,
    )
    mini_batch_size: int | None = flag(
        "step(): rows per forward/backward micro-batch (None: the whole batch). train(): derived episodes per "
        "optimizer step; if set it must equal the derived value.",
        default=None,
    )

    def __post_init__(self) -> None:
        self.total_episodes = self._alias("total_episodes", self.total_episodes, "steps", self.steps, None)
        self.steps = self.total_episodes
        super().__post_init__()
        self.num_ppo_epochs = self.ppo_epochs = self._alias(
            "num_ppo_epochs", self.num_ppo_epochs, "ppo_epochs", self.ppo_epochs, 4
        )
        self.kl_coef = self.init_kl_coef = self._alias("kl_coef", self.kl_coef, "init_kl_coef", self.init_kl_coef, 0.05)
        for name in ("kl_estimator", "kl_penalty"):
            value = getattr(self, name)
            if value is not None and value not in _KL_CANONICAL:
                raise ConfigError(f"{name}={value!r} is not a KL estimator; use one of {', '.join(_KL_CANONICAL)}.")
        new = _KL_CANONICAL.get(self.kl_estimator) if self.kl_estimator else None
        old = _KL_CANONICAL.get(self.kl_penalty) if self.kl_penalty else None
        self.kl_estimator = self._alias("kl_estimator", new, "kl_penalty", old, "k1")
        self.kl_penalty = self.kl_estimator
        if self.log_with is not None:
            if self.log_with not in ("wandb", "tensorboard"):
                raise ConfigError(f'log_with={self.log_with!r} must be "wandb" or "tensorboard" (or use report_to).')
            if self.report_to not in (["none"], [], [self.log_with]):
                raise ConfigError(
                    f"log_with={self.log_with!r} and report_to={self.report_to!r} are the same setting; "
                    "give one of them."
                )
            self.report_to = [self.log_with]
        # What the user set for step(); train() compares the derived sizes against it.
        self._step_batch_size, self._step_mini_batch_size = self.batch_size, self.mini_batch_size
        checks = [
            ("num_ppo_epochs", self.num_ppo_epochs >= 1, "must be >= 1"),
            ("cliprange", self.cliprange > 0, "must be > 0"),
            ("cliprange_value", self.cliprange_value > 0, "must be > 0"),
            ("vf_coef", self.vf_coef >= 0, "must be >= 0"),
            ("gamma", 0.0 <= self.gamma <= 1.0, "must be within [0, 1]"),
            ("lam", 0.0 <= self.lam <= 1.0, "must be within [0, 1]"),
            ("entropy_coef", self.entropy_coef >= 0, "must be >= 0"),
            ("kl_coef", self.kl_coef >= 0, "must be >= 0"),
            ("target", self.target > 0, "must be > 0"),
            ("horizon", self.horizon > 0, "must be > 0"),
            ("target_kl", self.target_kl > 0, "must be > 0"),
            ("ratio_threshold", self.ratio_threshold > 0, "must be > 0"),
            ("score_clip", self.score_clip is None or self.score_clip > 0, "must be > 0 (or unset)"),
            ("batch_size", self.batch_size is None or self.batch_size >= 1, "must be >= 1"),
            ("mini_batch_size", self.mini_batch_size is None or self.mini_batch_size >= 1, "must be >= 1"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ConfigError(f"{name}={getattr(self, name)!r} {why}.")
        if self.use_score_norm and not self.use_score_scaling:
            raise ConfigError(
                "use_score_norm=True needs use_score_scaling=True (TRL silently ignored it); set both or neither."
            )
        if self.value_model_init is not None and self.value_model_init not in VALUE_MODEL_INITS:
            raise ConfigError(
                f"value_model_init={self.value_model_init!r} must be one of {', '.join(VALUE_MODEL_INITS)}."
            )
        if self.value_model_path is not None and self.value_model_init == "head":
            raise ConfigError(
                'value_model_path and value_model_init="head" contradict each other: '
                "a value head has no separate weights."
            )

    @staticmethod
    def _alias(new: str, new_value, old: str, old_value, default):
        if new_value is not None and old_value is not None and new_value != old_value:
            raise ConfigError(
                f"{new}={new_value!r} and {old}={old_value!r} are two names of the same setting with different values; "
                f"give only one ({new} is the current name)."
            )
        if new_value is not None:
            return new_value
        return old_value if old_value is not None else default

    @property
    def step_batch_size(self) -> int | None:
        """batch_size as the user set it (None: step() accepts any number of rows)."""
        return self._step_batch_size

    @property
    def step_mini_batch_size(self) -> int | None:
        """mini_batch_size as the user set it (None: one micro-batch per optimizer step)."""
        return self._step_mini_batch_size

    def derive_sizes(self, world_size: int = 1, dataset_size: int | None = None) -> PPOConfig:
        """OnPolicyConfig's sizes; an explicitly set batch_size / mini_batch_size must agree with them."""
        super().derive_sizes(world_size, dataset_size)
        for name, user in (("batch_size", self._step_batch_size), ("mini_batch_size", self._step_mini_batch_size)):
            derived = getattr(self, name)
            if user is not None and user != derived:
                raise ConfigError(
                    f"{name}={user} was set, but train() derives {name} = {derived} from "
                    f"per_device_train_batch_size {self.per_device_train_batch_size} "
                    f"× gradient_accumulation_steps {self.gradient_accumulation_steps}"
                    + (f" × num_mini_batches {self.num_mini_batches}" if name == "batch_size" else "")
                    + f" × world_size {world_size}. {name} is the step() size; leave it unset for train()."
                )
        return self
