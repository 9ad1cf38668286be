"""Configuration of XPO (`posttrain xpo`, `XPOTrainer`): OnlineDPOConfig plus `alpha`.

As in TRL's `XPOConfig` (Xie et al. 2024, arXiv:2405.21046). Each prompt yields one completion from the policy
and one from the reference model; `per_device_train_batch_size` counts prompts, as TRL's, so 4 means
4 pairs (8 completions, both counted as episodes) per micro-batch, and the number of optimizer steps
and the learning-rate schedule are TRL's (see online_dpo_config, `OnlineDPOConfig.derive_sizes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.configs import ConfigError, flag
from posttrain.trainers.online_dpo_config import OnlineDPOConfig, resolve_schedule


@dataclass
class XPOConfig(OnlineDPOConfig):
    """Exploratory Preference Optimization (Xie et al. 2024)."""

    alpha: list[float] = flag(
        "Weight of the exploration term alpha·Σ log π(y_ref): one value, or one per epoch.",
        default_factory=lambda: [1e-5],
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.alpha = resolve_schedule("alpha", self.alpha)
        if any(a < 0 for a in self.alpha):
            raise ConfigError(f"alpha={self.alpha} must be >= 0.")
