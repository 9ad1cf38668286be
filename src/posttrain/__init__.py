"""posttrain: post-train language models from feedback.

SFT, reward models, PPO (with a critic, and the classic generate()/step() loop), RLOO, GRPO,
Online DPO and XPO, scored by a reward model, any text reward function, or a judge.

Importing the package is cheap: the public names below are resolved lazily on first use, so
`import posttrain` loads neither torch nor transformers (and never wandb, tensorboard, deepspeed,
peft or vllm).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "TrainingConfig": "posttrain.configs",
    "OnPolicyConfig": "posttrain.configs",
    "ConfigError": "posttrain.configs",
    "SFTConfig": "posttrain.trainers.sft_config",
    "SFTTrainer": "posttrain.trainers.sft",
    "RewardConfig": "posttrain.trainers.reward_config",
    "RewardTrainer": "posttrain.trainers.reward",
    "PPOConfig": "posttrain.trainers.ppo_config",
    "PPOTrainer": "posttrain.trainers.ppo",
    "RLOOConfig": "posttrain.trainers.rloo_config",
    "RLOOTrainer": "posttrain.trainers.rloo",
    "GRPOConfig": "posttrain.trainers.grpo_config",
    "GRPOTrainer": "posttrain.trainers.grpo",
    "OnlineDPOConfig": "posttrain.trainers.online_dpo_config",
    "OnlineDPOTrainer": "posttrain.trainers.online_dpo",
    "XPOConfig": "posttrain.trainers.xpo_config",
    "XPOTrainer": "posttrain.trainers.xpo",
    "BasePairwiseJudge": "posttrain.judges",
    "BaseRankJudge": "posttrain.judges",
    "BaseBinaryJudge": "posttrain.judges",
    "RewardModelJudge": "posttrain.judges",
    "CallableJudge": "posttrain.judges",
    "HTTPPairwiseJudge": "posttrain.judges",
    "HfPairwiseJudge": "posttrain.judges",
    "OpenAIPairwiseJudge": "posttrain.judges",
    "PairRMJudge": "posttrain.judges",
    "BaseJudge": "posttrain.judges",
    "AllTrueJudge": "posttrain.judges",
    "RandomPairwiseJudge": "posttrain.judges",
    "judge_from_spec": "posttrain.judges",
    "win_rate": "posttrain.judges",
    "WinRate": "posttrain.judges",
    "LogCompletionsCallback": "posttrain.callbacks",
    "Rollout": "posttrain.rollout",
    "DataError": "posttrain.data",
    "AutoModelForCausalLMWithValueHead": "posttrain.value_head",
    "AutoModelForSeq2SeqLMWithValueHead": "posttrain.value_head",
    "PreTrainedModelWrapper": "posttrain.value_head",
    "create_reference_model": "posttrain.value_head",
    "LengthSampler": "posttrain.length_sampler",
    "set_seed": "posttrain.core",
    # TRL's availability checks (the others are in posttrain.import_utils)
    "is_deepspeed_available": "posttrain.import_utils",
    "is_diffusers_available": "posttrain.import_utils",
    "is_liger_kernel_available": "posttrain.import_utils",
    "is_llm_blender_available": "posttrain.import_utils",
    "is_llmblender_available": "posttrain.import_utils",
    # TRL's public data helpers
    "apply_chat_template": "posttrain.data.helpers",
    "maybe_apply_chat_template": "posttrain.data.helpers",
    "extract_prompt": "posttrain.data.helpers",
    "maybe_extract_prompt": "posttrain.data.helpers",
    "is_conversational": "posttrain.data.helpers",
    "is_conversational_from_value": "posttrain.data.helpers",
    "unpair_preference_dataset": "posttrain.data.helpers",
    "maybe_unpair_preference_dataset": "posttrain.data.helpers",
    "maybe_convert_to_chatml": "posttrain.data.helpers",
    "pack_dataset": "posttrain.data.helpers",
    "pack_examples": "posttrain.data.helpers",
    "truncate_dataset": "posttrain.data.helpers",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as err:
        if err.name == module:
            raise AttributeError(f"posttrain.{name} is not available in this version ({__version__}).") from None
        raise
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
