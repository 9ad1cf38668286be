"""A stand-in `trl` package that is posttrain, for benchmarks/learning_curves.py and the GRPO-style
RLOO row of benchmarks/compare_all.sh: a TRL script's `from trl import ...` lines run unchanged on
posttrain (the "rename trl to posttrain" promise).

Strict, unlike a speed shim: every keyword reaches posttrain, so a setting posttrain does not know is
an error here, never silently dropped (a dropped setting would make the comparison unequal).

GRPOConfig / GRPOTrainer are posttrain's, untouched (same names, same signature as TRL 1.16).
RLOOConfig / RLOOTrainer: posttrain's RLOOTrainer is TRL 0.19's on-policy RLOO (`rloo_k`,
`kl_coef`, `config=` / `policy=` / `reward_model=`); TRL >= 0.21 renamed its arguments to GRPO's. The
algorithm is the same (sequence-level k1 KL penalty in the reward, leave-one-out baseline,
sequence-level PPO-clip on the summed log-ratio, mean over sequences), so the TRL 1.x names are
translated one to one below, and nothing else; TRL 0.19-style calls pass through unchanged.
"""

import posttrain
from posttrain import GRPOConfig, GRPOTrainer  # noqa: F401

__version__ = "posttrain-" + posttrain.__version__

# TRL 1.x RLOOConfig name -> posttrain RLOOConfig name (same meaning)
RLOO_RENAMES = {
    "num_generations": "rloo_k",
    "beta": "kl_coef",
    "max_completion_length": "response_length",
    "epsilon": "cliprange",
    "num_iterations": "num_ppo_epochs",
    "normalize_advantages": "normalize_advantage",
}
# TRL 1.x RLOOTrainer keyword -> posttrain RLOOTrainer keyword
RLOO_TRAINER_RENAMES = {
    "model": "policy",
    "reward_funcs": "reward_model",
    "args": "config",
    "reward_processing_classes": "reward_processing_class",
}


def RLOOConfig(**kwargs):  # noqa: N802 (a class in TRL)
    return posttrain.RLOOConfig(**{RLOO_RENAMES.get(k, k): v for k, v in kwargs.items()})


def RLOOTrainer(*args, **kwargs):  # noqa: N802 (a class in TRL)
    return posttrain.RLOOTrainer(*args, **{RLOO_TRAINER_RENAMES.get(k, k): v for k, v in kwargs.items()})
