"""Datasets in, token ids out.

- `loading`: `load_any_dataset` (files, folders, the hub), `load_split` / `has_split` (a config's
  dataset_name and split), and the file / row / field checks that raise `DataError` naming the
  source, line or row, and field.
- `formats`: format detection (`detect_format`, `FORMATS`) and chat templates (`render_chat`,
  `ensure_chat_template`, `SIMPLE_CHAT_TEMPLATE`).
- `prepare`: tokenization for each trainer: `prepare_prompt_dataset`, `prepare_preference_dataset`,
  `prepare_sft_dataset`.
- `prompts`: online training's prompts: `prompt_dataset` (prepared with the run's settings) and
  `PromptStream` (the resumable, per-epoch reshuffled stream of prompt batches).
- `packing`: best-fit decreasing and wrapped packing (`best_fit_decreasing`, `PACKING_STRATEGIES`).
- `collators`: `PromptCollator`, `SFTCollator`, `PreferenceCollator` (imported on first use: torch).
- `helpers`: TRL's public data helpers (`maybe_apply_chat_template`, `unpair_preference_dataset`,
  `pack_dataset`, ...), also exported from `posttrain`.

Nothing here imports datasets, transformers or torch at import time.
"""

from __future__ import annotations

import importlib
from typing import Any

from posttrain.data.formats import FORMATS, SIMPLE_CHAT_TEMPLATE, detect_format, ensure_chat_template, render_chat
from posttrain.data.helpers import *  # noqa: F403 (the names of helpers.__all__)
from posttrain.data.helpers import __all__ as _HELPERS
from posttrain.data.loading import DataError, has_split, load_any_dataset, load_split
from posttrain.data.packing import PACKING_STRATEGIES, best_fit_decreasing
from posttrain.data.prepare import (
    IGNORE_INDEX,
    prepare_preference_dataset,
    prepare_prompt_dataset,
    prepare_sft_dataset,
)
from posttrain.data.prompts import PromptStream, prompt_dataset

_COLLATORS = ("PromptCollator", "SFTCollator", "PreferenceCollator")

__all__ = [
    "DataError",
    "load_any_dataset",
    "load_split",
    "has_split",
    "FORMATS",
    "SIMPLE_CHAT_TEMPLATE",
    "detect_format",
    "ensure_chat_template",
    "render_chat",
    "IGNORE_INDEX",
    "prepare_prompt_dataset",
    "prepare_preference_dataset",
    "prepare_sft_dataset",
    "PromptStream",
    "prompt_dataset",
    "PACKING_STRATEGIES",
    "best_fit_decreasing",
    *_COLLATORS,
    *_HELPERS,
]


def __getattr__(name: str) -> Any:
    if name in _COLLATORS:
        return getattr(importlib.import_module("posttrain.data.collators"), name)
    raise AttributeError(f"module 'posttrain.data' has no attribute {name!r}")
