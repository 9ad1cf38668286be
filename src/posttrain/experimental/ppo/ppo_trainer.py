"""`posttrain.experimental.ppo.ppo_trainer` (TRL 1.x module path): the trainer and the masked statistics."""

from posttrain.ops import masked_mean, masked_var, masked_whiten
from posttrain.trainers.ppo import PPOTrainer

__all__ = ["PPOTrainer", "masked_mean", "masked_var", "masked_whiten"]
