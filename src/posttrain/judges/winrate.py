"""`win_rate`: summarise pairwise judgements as a win rate with a Wilson confidence interval."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["WinRate", "win_rate"]


@dataclass(frozen=True)
class WinRate:
    """Share of valid judgements won, with a Wilson confidence interval.

    `n` counts valid judgements (failures excluded); `failures` counts the -1s. With n = 0 the rate
    and interval are NaN.
    """

    rate: float
    ci_low: float
    ci_high: float
    n: int
    failures: int

    def __str__(self) -> str:
        return f"{self.rate:.1%} [{self.ci_low:.1%}, {self.ci_high:.1%}] (n={self.n}, failures={self.failures})"


def win_rate(judgements: Sequence[int], index: int = 0, confidence: float = 0.95) -> WinRate:
    """Fraction of valid judgements equal to `index` (default 0), with a Wilson interval.

    Wilson score interval (Wilson 1927), with w wins out of n, p = w / n and z the two-sided normal
    quantile for `confidence` (1.95996... for 95%):

        center = (p + z²/(2n)) / (1 + z²/n)
        half   = z * sqrt(p(1 - p)/n + z²/(4n²)) / (1 + z²/n)
        [center - half, center + half]

    Unlike p ± z·sqrt(p(1-p)/n) it stays inside [0, 1] and is not degenerate at p = 0 or 1, which
    matters for the small evaluation sets win rates are often computed on. -1 (failure) is left out
    of both w and n and counted in `failures`.
    """
    if index not in (0, 1):
        raise ValueError(f"index must be 0 or 1, got {index}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    wins = valid = failures = 0
    for i, j in enumerate(judgements):
        if j == -1:
            failures += 1
        elif j in (0, 1):
            valid += 1
            wins += int(j == index)
        else:
            raise ValueError(f"judgement {i} is {j!r}; expected 0, 1 or -1")
    if valid == 0:
        nan = float("nan")
        return WinRate(nan, nan, nan, 0, failures)
    z = statistics.NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    p = wins / valid
    denom = 1 + z * z / valid
    center = (p + z * z / (2 * valid)) / denom
    half = z * math.sqrt(p * (1 - p) / valid + z * z / (4 * valid * valid)) / denom
    return WinRate(p, max(0.0, center - half), min(1.0, center + half), valid, failures)
