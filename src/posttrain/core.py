"""`posttrain.core`: the classic helpers TRL scripts import from `trl.core`.

The gpt2-sentiment notebook and TRL's classic examples write `from trl.core import LengthSampler`;
with trl renamed to posttrain that import works unchanged.
"""

from __future__ import annotations

from posttrain.length_sampler import LengthSampler

__all__ = ["LengthSampler"]
