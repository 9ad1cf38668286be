"""Judges: compare, rank or check completions, for Online DPO / XPO and win-rate evaluation.

- `base`: the protocol, with TRL's signatures (`BaseJudge`, `BasePairwiseJudge`, `BaseRankJudge`,
  `BaseBinaryJudge`), the order flip against position bias, and `state_dict()` / `load_state_dict()`.
- `local`: judges that run in this process: `RewardModelJudge`, `CallableJudge`, `PairRMJudge`,
  `AllTrueJudge` and the `Random*Judge` helpers for tests and smoke runs.
- `http`: `HTTPPairwiseJudge`, an OpenAI-compatible `/chat/completions` client (standard library
  only), and TRL's `OpenAIPairwiseJudge` / `HfPairwiseJudge` on it.
- `spec`: `judge_from_spec`, a judge from a CLI string; `judge_from_model_name`, a judge LLM by name.
- `winrate`: `win_rate`, judgements summarised with a Wilson interval.

Every public name is importable from `posttrain.judges`. Importing it is light: torch,
transformers and llm-blender are imported inside the judges that need them.
"""

from __future__ import annotations

from posttrain.judges.base import BaseBinaryJudge, BaseJudge, BasePairwiseJudge, BaseRankJudge
from posttrain.judges.http import (
    DEFAULT_PAIRWISE_SYSTEM_PROMPT,
    HfPairwiseJudge,
    HTTPPairwiseJudge,
    OpenAIPairwiseJudge,
)
from posttrain.judges.local import (
    AllTrueJudge,
    CallableJudge,
    PairRMJudge,
    RandomBinaryJudge,
    RandomPairwiseJudge,
    RandomRankJudge,
    RewardModelJudge,
)
from posttrain.judges.spec import judge_from_model_name, judge_from_spec
from posttrain.judges.winrate import WinRate, win_rate

__all__ = [
    "DEFAULT_PAIRWISE_SYSTEM_PROMPT",
    "AllTrueJudge",
    "BaseBinaryJudge",
    "BaseJudge",
    "BasePairwiseJudge",
    "BaseRankJudge",
    "CallableJudge",
    "HTTPPairwiseJudge",
    "HfPairwiseJudge",
    "OpenAIPairwiseJudge",
    "PairRMJudge",
    "RandomBinaryJudge",
    "RandomPairwiseJudge",
    "RandomRankJudge",
    "RewardModelJudge",
    "WinRate",
    "judge_from_model_name",
    "judge_from_spec",
    "win_rate",
]
