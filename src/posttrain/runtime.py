"""Process-wide settings every training run applies when it starts (SFT, reward and the online trainers).

- `seed_run`: `seed` for python, numpy and torch, or `transformers.enable_full_determinism(seed)`
  with `full_determinism` (deterministic algorithms, cuDNN / cuBLAS settings), as transformers.Trainer does.
- `data_seed`: the seed of the data order alone (`data_seed`, default `seed`).
- `apply_log_levels`: transformers' and posttrain's logging verbosity from `log_level` on the main
  process and `log_level_replica` on the others (`log_on_each_node`: each node's main process
  counts as main), as transformers.Trainer sets it.
"""

from __future__ import annotations

import logging
from typing import Any

from posttrain import distributed as dist

# log_level names -> logging levels ("passive": leave the level as it is).
_LEVELS = {
    "debug": logging.DEBUG,
    "detail": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def seed_run(config: Any) -> None:
    """Seed python, numpy and torch with config.seed; with config.full_determinism also switch on
    deterministic algorithms (transformers.enable_full_determinism)."""
    if getattr(config, "full_determinism", False):
        from transformers.trainer_utils import enable_full_determinism

        enable_full_determinism(config.seed)
    else:
        dist.set_seed(config.seed)


def data_seed(config: Any) -> int:
    """The seed of the data order: data_seed when set, else seed."""
    value = getattr(config, "data_seed", None)
    return config.seed if value is None else value


def process_log_level(config: Any, *, is_main: bool, is_local_main: bool) -> int | None:
    """The logging level of this process (None: "passive", leave it)."""
    should_log = is_local_main if config.log_on_each_node else is_main
    name = config.log_level if should_log else config.log_level_replica
    return _LEVELS.get(name)


def apply_log_levels(config: Any, accelerator: Any) -> int | None:
    """Set transformers' and the `posttrain` logger's verbosity for this process; returns the level set."""
    is_main = dist.is_main(accelerator)
    is_local_main = bool(getattr(accelerator, "is_local_main_process", is_main))
    level = process_log_level(config, is_main=is_main, is_local_main=is_local_main)
    if level is not None:
        import transformers

        transformers.logging.set_verbosity(level)
        logging.getLogger("posttrain").setLevel(level)
    return level
