"""Configuration of `posttrain ppo` / `PPOTrainer`: PPO with a critic, both ways in.

One dataclass serves both APIs of trainers/ppo.py:
- `train()` (TRL 0.19 "on-policy" PPOTrainer): the OnPolicyConfig sizes plus
  num_ppo_epochs, kl_coef, kl_estimator, whiten_rewards, cliprange, vf_coef, cliprange_value,
  gamma, lam;
- `generate()` / `step()` (TRL 0.7 PPOTrainer and its gpt2-sentiment notebook, trainers/ppo_classic.py):
  every field of that PPOConfig, with its meaning and default (CLASSIC_DEFAULTS below).

Where the two TRL generations name the same setting twice, both names are accepted and resolved in
`__post_init__`; giving both with different values is a ConfigError. After resolution both names
hold the same value (`apply_classic_defaults` spells kl_penalty the classic way: "kl", "mse"):

    on-policy name     classic name         meaning
    num_ppo_epochs     ppo_epochs           optimisation epochs over each batch
    kl_coef            init_kl_coef         KL coefficient (initial value when adaptive)
    kl_estimator       kl_penalty           k1 = "kl", k2 = "mse", k3, abs, full
    total_episodes     steps                completions in the whole run
    report_to          log_with             metric sinks besides console and metrics.jsonl
    mini_batch_size    forward_batch_size   (classic, deprecated there too) rows per forward/backward

Defaults: which API is used decides them. The config remembers which fields the caller set
(`explicit_fields`: the keyword and positional arguments of the constructor; either name of an alias
pair counts). `train()` / `posttrain ppo` uses the on-policy defaults (TRL 0.19: seed 42,
learning_rate 3e-6, kl_coef 0.05, fixed KL, max_grad_norm 1.0). The classic trainer calls
`apply_classic_defaults()`, which gives every field the caller did not set its TRL 0.7 default:

    seed 0, learning_rate 1e-5, adap_kl_ctrl True, init_kl_coef 0.2, batch_size 256,
    mini_batch_size 1, max_grad_norm None, steps 20000, exp_name = the script's name

(the other classic defaults equal the on-policy ones). `dataclasses.replace` passes every field, so
its result counts every field as set.

`batch_size` and `mini_batch_size` are derived, read-only sizes in OnPolicyConfig; here they are
settable because `step()` needs them (classic meaning: `batch_size` rows per `step()` call,
forward/backward micro-batches of `mini_batch_size` rows, one optimizer step per
`backward_batch_size = mini_batch_size × gradient_accumulation_steps` rows). `train()` still derives
both (batch_size = episodes per rollout batch, mini_batch_size = episodes per optimizer step); a value
set explicitly must then equal the derived one, else ConfigError names both.

Classic-only fields: `task_name`, `model_name`, `query_dataset`, `reward_model` are recorded with the
run's config (nothing loads from them, as in TRL); `tracker_project_name`, `tracker_kwargs` (per
tracker: `{"wandb": {...}, "tensorboard": {...}}`), `accelerator_kwargs`, `project_kwargs`
(accelerate's ProjectConfiguration; its `logging_dir` holds TensorBoard runs),
`remove_unused_columns` and `optimize_cuda_cache` act in the classic trainer and are refused by
`train()` when not at their default. `push_to_hub_if_best_kwargs` / `compare_steps` (pushing to
the Hub from inside `step()`) are refused: save with `trainer.save_pretrained(dir)` and push that
folder. `world_size`, `backward_batch_size`, `global_backward_batch_size`, `global_batch_size`,
`is_encoder_decoder` and `is_peft_model` are filled in by the classic trainer; a value given must match
(`train()` derives `world_size` itself and refuses `is_peft_model`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from posttrain.configs import ConfigError, OnPolicyConfig, flag

# Equivalent names of the same estimator (advantages.KL_ESTIMATORS plus the exact "full" KL).
_KL_CANONICAL = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "abs": "abs", "full": "full"}
VALUE_MODEL_INITS = ("reward", "policy", "head")
# Alias pairs: the field a classic default is written to <- every name that sets it.
_NAMES = {
    "kl_coef": ("kl_coef", "init_kl_coef"),
    "total_episodes": ("total_episodes", "steps"),
    "mini_batch_size": ("mini_batch_size", "forward_batch_size"),
}
# Alias pairs (current name, classic name) a script may assign on a built config (kl: resolved_kl_estimator).
_ASSIGNABLE_ALIASES = (
    ("num_ppo_epochs", "ppo_epochs"),
    ("kl_coef", "init_kl_coef"),
    ("total_episodes", "steps"),
    ("mini_batch_size", "forward_batch_size"),
)
# Classic-only settings train() cannot apply: field -> (default, why).
_CLASSIC_ONLY = {
    "tracker_kwargs": ({}, "train() logs through report_to / run_name"),
    "accelerator_kwargs": ({}, "train() builds its Accelerator from the launch environment"),
    "project_kwargs": ({}, "train() writes everything under output_dir"),
    "tracker_project_name": ("trl", "train() names its run with run_name"),
    "remove_unused_columns": (True, "train() keeps every column for reward functions"),
    "optimize_cuda_cache": (False, "train() manages its own memory"),
    "is_peft_model": (None, "train() detects PEFT from the model and peft_config"),
}


def script_name() -> str:
    """TRL's classic exp_name default: the running script's file name without ".py"."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    return name[: -len(".py")] if name.endswith(".py") else name


def classic_defaults() -> dict[str, Any]:
    """The classic PPOConfig's defaults (TRL 0.7) where they differ from the on-policy ones."""
    return {
        "seed": 0,
        "learning_rate": 1e-5,
        "adap_kl_ctrl": True,
        "kl_coef": 0.2,
        "batch_size": 256,
        "mini_batch_size": 1,
        "max_grad_norm": None,
        "total_episodes": 20000,
        "exp_name": script_name(),
    }


def _records_explicit_fields(cls: type) -> type:
    """Wrap the dataclass __init__ so the instance knows which fields its caller gave."""
    init = cls.__init__
    names = [f.name for f in dataclasses.fields(cls) if f.init]

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.explicit_fields = frozenset(names[: len(args)]) | frozenset(kwargs)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


@_records_explicit_fields
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
        'policy\'s own trunk). Default: "reward" with a reward model, else "policy". With --use_peft, "reward" and '
        '"policy" make the critic a second LoRA adapter on the policy\'s base plus a value head (for "reward" the '
        "head starts from the reward model's score head when it fits).",
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

    forward_batch_size: int | None = flag("Deprecated classic name of mini_batch_size (as in TRL 0.7).", default=None)
    # -- classic PPOConfig (TRL 0.7): tracking, accelerate and runtime fields -----------------------
    task_name: str | None = flag("Classic: name of the task, recorded with the config.", default=None)
    model_name: str | None = flag("Classic: name of the model, recorded with the config.", default=None)
    query_dataset: str | None = flag("Classic: name of the query dataset, recorded with the config.", default=None)
    reward_model: str | None = flag("Classic: name of the reward model, recorded with the config.", default=None)
    remove_unused_columns: bool = flag(
        "Classic: the trainer's dataloader drops dataset columns the model's forward does not take "
        "(query, response and label are kept).",
        default=True,
    )
    tracker_kwargs: dict = flag(
        'Classic: tracker init keywords per tracker, e.g. {"wandb": {"entity": "me"}}.', default_factory=dict
    )
    accelerator_kwargs: dict = flag("Classic: keywords for accelerate.Accelerator.", default_factory=dict)
    project_kwargs: dict = flag(
        "Classic: keywords for accelerate's ProjectConfiguration (logging_dir holds TensorBoard runs).",
        default_factory=dict,
    )
    tracker_project_name: str = flag("Classic: project (W&B) / run folder (TensorBoard) name.", default="trl")
    push_to_hub_if_best_kwargs: dict = flag(
        "Classic: push to the Hub from step() when the mean score improves (not supported: refused).",
        default_factory=dict,
    )
    compare_steps: int = flag("Classic: steps between push_to_hub_if_best comparisons (not supported).", default=1)
    optimize_cuda_cache: bool = flag(
        "Classic: collect garbage and empty the CUDA cache after each step().", default=False
    )
    world_size: int | None = flag("Runtime: number of processes (filled in by the trainer).", default=None)
    is_peft_model: bool | None = flag(
        "Classic runtime: whether the policy is a PEFT model (None: detected).", default=None
    )
    backward_batch_size: int | None = flag(
        "Classic runtime: rows per optimizer step = mini_batch_size × gradient_accumulation_steps.", default=None
    )
    global_backward_batch_size: int | None = flag("Classic runtime: backward_batch_size × world_size.", default=None)
    global_batch_size: int | None = flag("Classic runtime: batch_size × world_size.", default=None)

    def __post_init__(self) -> None:
        if not hasattr(self, "explicit_fields"):  # built without the recording __init__ (e.g. copy)
            self.explicit_fields = frozenset()
        if self.forward_batch_size is not None:
            warnings.warn(
                "forward_batch_size is deprecated (as in TRL 0.7): it sets mini_batch_size, the rows of each "
                "forward pass and of each PPO minibatch; use mini_batch_size.",
                FutureWarning,
                stacklevel=3,
            )
        self.mini_batch_size = self.forward_batch_size = self._alias(
            "mini_batch_size", self.mini_batch_size, "forward_batch_size", self.forward_batch_size, None
        )
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
        self.kl_penalty = self._kl_resolved = self.kl_estimator
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
            ("compare_steps", self.compare_steps >= 1, "must be >= 1"),
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
        if self.push_to_hub_if_best_kwargs or self.compare_steps != 1:
            raise ConfigError(
                "push_to_hub_if_best_kwargs / compare_steps: pushing to the Hub from inside step() is not "
                "supported; call trainer.save_pretrained(folder) when the reward improves and push that folder "
                "(huggingface_hub.upload_folder)."
            )
        for name in ("tracker_kwargs", "accelerator_kwargs", "project_kwargs"):
            if not isinstance(getattr(self, name), dict):
                raise ConfigError(f"{name} must be a dict, got {type(getattr(self, name)).__name__}.")
        unknown = sorted(set(self.tracker_kwargs) - {"wandb", "tensorboard"})
        if unknown:
            raise ConfigError(
                f"tracker_kwargs has settings for {unknown}; its keys are tracker names (wandb, tensorboard), "
                'e.g. tracker_kwargs={"wandb": {"entity": "me"}}.'
            )
        self.backward_batch_size = self._runtime(
            "backward_batch_size",
            None if self.mini_batch_size is None else self.mini_batch_size * self.gradient_accumulation_steps,
        )
        self._check_batch_sizes_fit_an_api()
        if self.value_model_path is not None and self.value_model_init == "head":
            raise ConfigError(
                'value_model_path and value_model_init="head" contradict each other: '
                "a value head has no separate weights."
            )
        self._assigned = self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        """The values of the fields apply_classic_defaults may set (both names of an alias pair)."""
        names = set(classic_defaults()) | {n for pair in _ASSIGNABLE_ALIASES for n in pair}
        return {name: getattr(self, name) for name in names}

    def _fields_assigned_since_built(self) -> set[str]:
        """Fields the caller assigned on the built config (`config.ppo_epochs = 1`, as TRL scripts do
        between trainers): those whose value changed since the last snapshot. An alias assigned under
        one name is copied to the other; both assigned to different values is a ConfigError."""
        before = getattr(self, "_assigned", None) or self._snapshot()
        changed = {n for n, v in before.items() if getattr(self, n) != v}
        for new, old in _ASSIGNABLE_ALIASES:
            new_v, old_v = getattr(self, new), getattr(self, old)
            if new in changed and old in changed and old_v is not None and new_v != old_v:
                raise ConfigError(
                    f"{new}={new_v!r} and {old}={old_v!r} were both assigned, to different values; "
                    f"they are two names of one setting: assign only one."
                )
            if old in changed and old_v is not None and new not in changed:
                setattr(self, new, old_v)
                changed.add(new)
        return changed

    def _check_batch_sizes_fit_an_api(self) -> None:
        """An explicit batch_size must hold whole optimizer steps of mini_batch_size ×
        gradient_accumulation_steps rows (the classic sizes; TRL's PPOConfig raises this at
        construction) unless the sizes can be train()'s derived ones (mini_batch_size = a multiple of
        per_device_train_batch_size × gradient_accumulation_steps, batch_size = a multiple of it)."""
        batch, mini, accum = self.batch_size, self.mini_batch_size, self.gradient_accumulation_steps
        if batch is None or mini is None or batch % (mini * accum) == 0:
            return  # an unset mini_batch_size: apply_classic_defaults checks its default
        if mini % (self.per_device_train_batch_size * accum) == 0 and batch % mini == 0:
            return
        raise ConfigError(
            f"batch_size={batch} must be a multiple of mini_batch_size × gradient_accumulation_steps = "
            f"{mini} × {accum} (rows per optimizer step of step()); raise batch_size or lower the other two."
        )

    def sync_assigned(self) -> None:
        """Bring the config in line with fields assigned since the trainer was built (TRL reads the
        config at each step()): alias pairs, the KL estimator's two names, the step() sizes."""
        changed = self._fields_assigned_since_built()
        self.resolved_kl_estimator()
        if "batch_size" in changed:
            self._step_batch_size = self.batch_size
        if "mini_batch_size" in changed:
            self._step_mini_batch_size = self.mini_batch_size
        self._assigned = self._snapshot()

    def resolved_kl_estimator(self) -> str:
        """The KL estimator after the caller may have assigned `kl_penalty` or `kl_estimator` on the
        built config (TRL scripts set `config.kl_penalty = "abs"` before building a trainer); both
        names are brought back in line. Assigning both to different estimators is a ConfigError."""
        changed = {}
        for name in ("kl_estimator", "kl_penalty"):
            value = getattr(self, name)
            if value not in _KL_CANONICAL:
                raise ConfigError(f"{name}={value!r} is not a KL estimator; use one of {', '.join(_KL_CANONICAL)}.")
            if _KL_CANONICAL[value] != self._kl_resolved:
                changed[name] = _KL_CANONICAL[value]
        if len(set(changed.values())) > 1:
            raise ConfigError(
                f"kl_estimator={self.kl_estimator!r} and kl_penalty={self.kl_penalty!r} were both changed, to "
                "different estimators; set only one of them."
            )
        resolved = next(iter(changed.values()), self._kl_resolved)
        self._kl_resolved = self.kl_estimator = resolved
        if self.kl_penalty is None or _KL_CANONICAL[self.kl_penalty] != resolved:
            self.kl_penalty = {"k1": "kl", "k2": "mse"}.get(resolved, resolved)
        return resolved

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

    def _runtime(self, name: str, value: Any) -> Any:
        """A field the trainer fills in: a value the caller gave must equal it."""
        given = getattr(self, name)
        if name in self.explicit_fields and given is not None and value is not None and given != value:
            raise ConfigError(f"{name}={given} was given, but it is {value} here; leave it unset (it is computed).")
        return value

    def apply_classic_defaults(self) -> PPOConfig:
        """Give every field the caller did not set its classic (TRL 0.7) default; fill in and check
        the classic sizes. Called by the classic trainer; returns self."""
        assigned = self._fields_assigned_since_built()
        for name, value in classic_defaults().items():
            if not (self.explicit_fields | assigned) & set(_NAMES.get(name, (name,))):
                setattr(self, name, value)
        self.init_kl_coef, self.steps, self.forward_batch_size = self.kl_coef, self.total_episodes, None
        self.resolved_kl_estimator()
        self.kl_penalty = {"k1": "kl", "k2": "mse"}.get(self.kl_estimator, self.kl_estimator)  # classic spelling
        self._step_batch_size, self._step_mini_batch_size = self.batch_size, self.mini_batch_size
        mini = self.mini_batch_size or self.batch_size
        self.backward_batch_size = self._runtime(
            "backward_batch_size", None if mini is None else mini * self.gradient_accumulation_steps
        )
        if self.batch_size is not None and self.batch_size % self.backward_batch_size:
            raise ConfigError(
                f"batch_size={self.batch_size} must be a multiple of mini_batch_size × gradient_accumulation_steps "
                f"= {mini} × {self.gradient_accumulation_steps} (rows per optimizer step)."
            )
        self._assigned = self._snapshot()
        return self

    def set_runtime(self, world_size: int, is_encoder_decoder: bool, is_peft_model: bool) -> None:
        """The classic trainer's runtime fields (TRL 0.7 fills the same ones in its constructor)."""
        self.world_size = self._runtime("world_size", world_size)
        self.global_batch_size = self._runtime(
            "global_batch_size", None if self.batch_size is None else self.batch_size * world_size
        )
        self.global_backward_batch_size = self._runtime(
            "global_backward_batch_size",
            None if self.backward_batch_size is None else self.backward_batch_size * world_size,
        )
        self.is_encoder_decoder = is_encoder_decoder
        self.is_peft_model = self._runtime("is_peft_model", is_peft_model)

    @property
    def total_ppo_epochs(self) -> int | None:
        """Classic: ceil(steps / batch_size), the number of step() calls the steps budget allows."""
        if self.total_episodes is None or self.batch_size is None:
            return None
        return math.ceil(self.total_episodes / self.batch_size)

    @property
    def step_batch_size(self) -> int | None:
        """batch_size as the user set it (None: step() accepts any number of rows)."""
        return self._step_batch_size

    @property
    def step_mini_batch_size(self) -> int | None:
        """mini_batch_size as the user set it (None: one micro-batch per optimizer step)."""
        return self._step_mini_batch_size

    def derive_sizes(self, world_size: int = 1, dataset_size: int | None = None) -> PPOConfig:
        """OnPolicyConfig's sizes; an explicitly set batch_size / mini_batch_size must agree with them.
        Classic-only settings that train() cannot apply are refused here, before any model loads."""
        for name, (default, why) in _CLASSIC_ONLY.items():
            if getattr(self, name) != default:
                raise ConfigError(
                    f"{name}={getattr(self, name)!r} applies to the classic generate()/step() trainer only; "
                    f"{why}. Leave it at {default!r} for train()."
                )
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
