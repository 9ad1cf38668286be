"""`from posttrain.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer` (TRL 1.x path)."""

from posttrain.trainers.online_dpo import OnlineDPOTrainer
from posttrain.trainers.online_dpo_config import OnlineDPOConfig

__all__ = ["OnlineDPOConfig", "OnlineDPOTrainer"]
