"""`from posttrain.experimental.ppo import PPOConfig, PPOTrainer, AutoModelForCausalLMWithValueHead` (TRL 1.x path)."""

from posttrain.trainers.ppo import PPOTrainer
from posttrain.trainers.ppo_config import PPOConfig
from posttrain.value_head import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead

__all__ = ["AutoModelForCausalLMWithValueHead", "AutoModelForSeq2SeqLMWithValueHead", "PPOConfig", "PPOTrainer"]
