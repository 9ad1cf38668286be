"""Text reward functions for `--reward_funcs` (and the `reward_model=` / `reward_funcs=` arguments).

A reward function takes the prompts and the decoded completions of one rollout batch (plus every
extra dataset column as a keyword argument, one value per completion) and returns one float per
completion. Use them from the command line by import path, with the project root importable:

    PYTHONPATH=. posttrain rloo --reward_funcs examples.rewards:letter_fraction ...

They are toy objectives that a tiny random model can learn in a few dozen steps, useful to check
that a trainer learns at all before spending compute on a real reward model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def letter_fraction(
    prompts: Sequence[str], completions: Sequence[str], letter: str = "e", **columns: Any
) -> list[float]:
    """Fraction of the completion's characters that are `letter` (0 for an empty completion)."""
    return [c.count(letter) / len(c) if c else 0.0 for c in completions]


def length_reward(prompts: Sequence[str], completions: Sequence[str], target: int = 40, **columns: Any) -> list[float]:
    """−|len(completion) − target| / target: highest for completions of `target` characters."""
    return [-abs(len(c) - target) / target for c in completions]


def contains_word(prompts: Sequence[str], completions: Sequence[str], word: str = "the", **columns: Any) -> list[float]:
    """1.0 when the completion contains `word` as a whole word (case-insensitive), else 0.0."""
    return [1.0 if word.lower() in c.lower().split() else 0.0 for c in completions]
