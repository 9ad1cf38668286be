"""`from posttrain.experimental.xpo import XPOConfig, XPOTrainer` (TRL 1.x path)."""

from posttrain.trainers.xpo import XPOTrainer
from posttrain.trainers.xpo_config import XPOConfig

__all__ = ["XPOConfig", "XPOTrainer"]
