"""A stand-in `trl` package that is posttrain, for benchmarks/learning_curves.py and the GRPO-style
RLOO row of benchmarks/compare_all.sh: a TRL script's `from trl import ...` lines run unchanged on
posttrain (the "rename trl to posttrain" promise).

Strict, unlike a speed shim: every keyword reaches posttrain, so a setting posttrain does not know is
an error here, never silently dropped (a dropped setting would make the comparison unequal).

Nothing is translated: posttrain's GRPOConfig / GRPOTrainer take TRL 1.16's names, and its RLOOConfig /
RLOOTrainer take TRL 1.x's GRPO-style RLOO names (num_generations, beta, max_completion_length, epsilon,
num_iterations, normalize_advantages; model= / reward_funcs= / args= / reward_processing_classes=) as
well as TRL 0.19's (src/posttrain/trainers/rloo_config.py).
"""

import posttrain
from posttrain import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: F401

__version__ = "posttrain-" + posttrain.__version__
