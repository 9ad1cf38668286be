"""`LengthSampler`: a random length per call, as in TRL's classic PPO examples (`trl.core.LengthSampler`).

The classic gpt2-sentiment loop draws each query's length and each response's `max_new_tokens` from
one: `LengthSampler(2, 8)()` is an int in [2, 8), uniformly.
"""

from __future__ import annotations


class LengthSampler:
    """Draw an int uniformly from `range(min_value, max_value)` (upper bound excluded) on each call.

    Draws come from NumPy's global generator the way TRL draws them (`np.random.choice` over the
    range), so a script seeded with `np.random.seed` / `transformers.set_seed` gets the same lengths
    as under TRL. The value is a Python `int`.
    """

    def __init__(self, min_value: int, max_value: int) -> None:
        if int(max_value) <= int(min_value):
            raise ValueError(
                f"LengthSampler({min_value}, {max_value}): the range [min_value, max_value) is empty; "
                "max_value is excluded, so it must be larger than min_value."
            )
        self.min_value, self.max_value = int(min_value), int(max_value)
        self.values = list(range(self.min_value, self.max_value))

    def __call__(self) -> int:
        import numpy as np

        return int(np.random.choice(self.values))

    def __repr__(self) -> str:
        return f"LengthSampler({self.min_value}, {self.max_value})"
