"""A health monitor for online training, from the debugging tips of TRL's RLOO/PPO documentation.

- `val/ratio` should hover around 1.0; outside [0.5, 2] the updates between consecutive policies are
  too drastic (lower the learning rate, raise num_mini_batches, check that old logprobs are taken
  in the same mode as the update).
- `objective/kl` growing large means the policy is running away from the reference (raise kl_coef).
- `objective/rlhf_reward` is the final objective and should keep rising; if it has not risen over a
  window of logging steps the run is probably not learning.
- A non-finite loss skips that optimizer step (the gradients are dropped) and is counted; after
  `max_nonfinite` in a row training stops cleanly with `TrainingDiverged`.
- An out-of-memory error is re-raised with the fix TRL's documentation recommends (smaller batches).

Each warning is printed once per run (a one-time rich warning, also returned so callers can log it).

`HealthMonitor()` is a `transformers.TrainerCallback`: the metric checks run from `on_log(logs=...)`,
so the online trainers register their monitor (`trainer.run.health`) in their callbacks and a user
can take it out with `trainer.remove_callback(HealthMonitor)` (its warnings stop). The non-finite
policy is the update loop's, not a metric check: a NaN/inf step is never taken and
`TrainingDiverged` ends the run after `max_nonfinite` in a row, with or without the callback.
This module does not import transformers (it is imported where trainers are defined; transformers'
callback module imports peft): `HealthMonitor(...)` returns an instance of
`callbacks.HealthMonitorCallback`, a subclass of both, the way `pathlib.Path(...)` returns a
`PosixPath`, so the import happens when a monitor is built, i.e. where a run is built.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


class TrainingDiverged(RuntimeError):
    """Raised after too many non-finite losses in a row."""


OOM_HINT = (
    "out of memory: lower --per_device_train_batch_size (and raise --gradient_accumulation_steps to keep "
    "the same batch), lower --local_rollout_forward_batch_size or --response_length, or enable "
    "--gradient_checkpointing / --bf16; with several GPUs, DeepSpeed ZeRO-3 "
    "(accelerate launch --config_file deepspeed_zero3.yaml) also helps."
)


@dataclass(eq=False)
class HealthMonitor:
    """The checks above. Instances are `transformers.TrainerCallback`s (see the module docstring);
    `eq=False`: a callback list removes an instance by identity, never an equal twin."""

    ratio_low: float = 0.5
    ratio_high: float = 2.0
    kl_threshold: float = 10.0
    reward_window: int = 20
    max_nonfinite: int = 5
    enabled: bool = True
    _warned: set[str] = field(default_factory=set)
    _rewards: list[float] = field(default_factory=list)
    nonfinite_in_a_row: int = 0
    nonfinite_total: int = 0

    def __new__(cls, *args: Any, **kwargs: Any) -> HealthMonitor:
        if cls is HealthMonitor:
            from posttrain.callbacks import HealthMonitorCallback

            cls = HealthMonitorCallback
        return super().__new__(cls)

    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        """transformers' on_log: check the logged metrics at `state.global_step`."""
        self.check(logs or {}, state.global_step)

    def _warn(self, key: str, message: str) -> str | None:
        if key in self._warned:
            return None
        self._warned.add(key)
        if self.enabled:
            from rich.console import Console

            Console(stderr=True, highlight=False).print(f"[bold yellow]posttrain health:[/bold yellow] {message}")
        return message

    def check(self, metrics: Mapping[str, Any], step: int) -> list[str]:
        """Look at one logging step's metrics; return the warnings issued now (each at most once per run)."""
        issued = []
        ratio = metrics.get("val/ratio")
        if ratio is not None and math.isfinite(ratio) and not self.ratio_low <= ratio <= self.ratio_high:
            issued.append(
                self._warn(
                    "ratio",
                    f"val/ratio = {ratio:.3g} at step {step} left [{self.ratio_low}, {self.ratio_high}]: "
                    "updates between consecutive policies are too drastic. Lower --learning_rate, "
                    "raise --num_mini_batches or lower --num_ppo_epochs.",
                )
            )
        kl = metrics.get("objective/kl")
        if kl is not None and math.isfinite(kl) and kl > self.kl_threshold:
            issued.append(
                self._warn(
                    "kl",
                    f"objective/kl = {kl:.3g} at step {step} exceeds {self.kl_threshold}: "
                    "the policy is drifting far from the reference (possible reward hacking). "
                    "Raise --kl_coef or lower --learning_rate.",
                )
            )
        reward = metrics.get("objective/rlhf_reward")
        if reward is not None and math.isfinite(reward):
            self._rewards.append(float(reward))
            w = self.reward_window
            if len(self._rewards) >= 2 * w:
                recent = sum(self._rewards[-w:]) / w
                before = sum(self._rewards[-2 * w : -w]) / w
                if recent <= before:
                    issued.append(
                        self._warn(
                            "reward",
                            f"objective/rlhf_reward has not risen over the last {w} logging steps "
                            f"(mean {recent:.4g} vs {before:.4g} before, step {step}). "
                            "Check the reward model, the learning rate and kl_coef.",
                        )
                    )
        for key in ("loss/policy_avg", "loss/value_avg", "objective/scores"):
            value = metrics.get(key)
            if value is not None and not math.isfinite(value):
                issued.append(self._warn(f"nan:{key}", f"{key} is {value} at step {step}."))
        return [m for m in issued if m]

    def loss_is_finite(self, loss: Any) -> bool:
        """True when `loss` is finite; otherwise count it (the caller skips this step) and stop after
        max_nonfinite non-finite losses in a row."""
        value = float(loss.detach().float().sum()) if hasattr(loss, "detach") else float(loss)
        if math.isfinite(value):
            self.nonfinite_in_a_row = 0
            return True
        self.nonfinite_in_a_row += 1
        self.nonfinite_total += 1
        self._warn("nonfinite", f"a non-finite loss ({value}) was skipped; {self.nonfinite_total} so far.")
        if self.nonfinite_in_a_row >= self.max_nonfinite:
            raise TrainingDiverged(
                f"{self.nonfinite_in_a_row} non-finite losses in a row: training stopped. Lower --learning_rate, "
                "set --max_grad_norm, or check the rewards for NaN/inf."
            )
        return False

    def state_dict(self) -> dict:
        return {"warned": sorted(self._warned), "rewards": list(self._rewards), "nonfinite_total": self.nonfinite_total}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._warned = set(state.get("warned", []))
        self._rewards = list(state.get("rewards", []))
        self.nonfinite_total = int(state.get("nonfinite_total", 0))


def is_oom(err: BaseException) -> bool:
    import torch

    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(err, oom_type):
        return True
    return isinstance(err, (RuntimeError, MemoryError)) and (
        isinstance(err, MemoryError) or "out of memory" in str(err).lower()
    )


@contextlib.contextmanager
def oom_advice() -> Iterator[None]:
    """Re-raise an out-of-memory error with what to change."""
    try:
        yield
    except BaseException as err:
        if is_oom(err):
            raise MemoryError(f"{err}\n{OOM_HINT}") from err
        raise
