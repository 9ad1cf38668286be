"""The judge protocol: `BaseJudge` and its pairwise, rank and binary shapes.

The signatures are TRL's (`trl.BasePairwiseJudge` and friends), so judge code ports by changing the
import:

- `BasePairwiseJudge.judge(prompts, completions, shuffle_order=True) -> list[int]`: for each prompt
  and pair `[a, b]`, the index (0 or 1) of the better completion, or -1 when the judge failed.
- `BaseRankJudge.judge(prompts, completions, shuffle_order=True) -> list[list[int]]`: completion
  indices, best first.
- `BaseBinaryJudge.judge(prompts, completions, gold_completions=None, shuffle_order=True) -> list[int]`:
  1 if the completion satisfies the constraint, 0 if not, -1 on failure (the constraint judges of
  CGPO: Xu et al. 2024, "The Perfect Blend: Redefining RLHF with Mixture of Judges").

Position bias: LLM judges prefer one slot, so with `shuffle_order=True` a pairwise judge swaps a
random subset of pairs before asking and maps each answer back. The swap lives once, in
`BasePairwiseJudge.judge`; concrete judges implement `judge_pairs`, which answers pairs exactly in
the order given. A failure stays -1 through the swap (docs/internals.md, "Judges").

State: every judge has `state_dict()` / `load_state_dict(state)` holding what an exact resume needs
(the RNG of the order flips, a random judge's answer RNG, an HTTP judge's request counters), as
JSON-friendly values, so trainers checkpoint a judge without touching its attributes.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any


def _as_text(value: Any) -> str:
    """A prompt or completion as plain text, for judges that read text (HTTP, PairRM, callables).

    Conversational values (lists of {"role", "content"} messages) become "role: content" lines;
    trainers that want the policy's own chat template render prompts before judging.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence) and all(isinstance(m, dict) and "content" in m for m in value):
        return "\n".join(f"{m.get('role', 'user')}: {m['content']}" for m in value)
    raise TypeError(f"expected a string or a list of chat messages, got {type(value).__name__}")


def _is_conversational(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _check_lengths(prompts: Sequence[Any], completions: Sequence[Any], what: str = "completions") -> None:
    if len(prompts) != len(completions):
        raise ValueError(f"got {len(prompts)} prompts but {len(completions)} {what}; pass one entry per prompt")


def rng_state(rng: random.Random) -> list[Any]:
    """`rng`'s state as JSON-friendly lists: [version, [624 + 1 ints], gauss_next]."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_rng_state(rng: random.Random, state: Sequence[Any]) -> None:
    """Restore a state written by `rng_state` (lists or tuples)."""
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


class BaseJudge:
    """Any judge: `judge(prompts, completions, shuffle_order=True)`; the subclasses fix the shapes.

    `state_dict()` returns what resuming needs to continue exactly where the judge stopped (empty
    for a judge without state); `load_state_dict(state)` restores it and raises ValueError when the
    keys differ from the ones this judge saves. A subclass with its own state extends both, calling
    super().
    """

    def judge(self, prompts: list[Any], completions: list[Any], shuffle_order: bool = True) -> list[Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement judge()")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        expected, given = set(self.state_dict()), set(state)
        if expected != given:
            missing, unexpected = sorted(expected - given), sorted(given - expected)
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state does not fit this judge "
                f"(missing keys {missing}, unexpected keys {unexpected}); was it saved from another judge?"
            )


class BaseRankJudge(BaseJudge):
    """Ranks several completions per prompt: `judge(...)` returns, per prompt, indices best first."""

    def judge(self, prompts: list[Any], completions: list[list[Any]], shuffle_order: bool = True) -> list[list[int]]:
        raise NotImplementedError(f"{type(self).__name__} must implement judge()")


class BasePairwiseJudge(BaseJudge):
    """Picks the better of two completions per prompt.

    Subclasses implement `judge_pairs(prompts, pairs) -> list[int]` (0, 1, or -1 for a failure),
    answering each pair in the order given; `judge()` adds the order flip and validates the answer.
    A subclass written for TRL that overrides `judge()` itself also works (it then owns the flip).

    `seed` makes the flips reproducible; it only drives the flips, never the judge's own answers.
    The flip RNG's state is the `"flip_rng"` entry of `state_dict()`.
    """

    def __init__(self, seed: int | None = None):
        self._flip_rng = random.Random(seed)

    def judge(self, prompts: list[Any], completions: list[list[Any]], shuffle_order: bool = True) -> list[int]:
        """Index (0/1) of the better completion of each pair, -1 where the judge failed."""
        pairs = self._check_pairs(prompts, completions)
        if not pairs:
            return []
        flips = self._draw_flips(len(pairs), shuffle_order)
        answers = self.judge_pairs(list(prompts), self._apply_flips(pairs, flips))
        answers = self._check_answers(answers, len(pairs))
        return [self._unflip(answer, flipped) for answer, flipped in zip(answers, flips)]

    def judge_pairs(self, prompts: list[Any], pairs: list[list[Any]]) -> list[int]:
        """Answer each pair in the order given: 0, 1, or -1 on failure. No flipping here."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement judge_pairs(prompts, pairs) "
            "(the order flip is done by judge()) or override judge()"
        )

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "flip_rng": rng_state(self._rng)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        set_rng_state(self._rng, state["flip_rng"])

    # The order-flip mechanism, shared by every pairwise judge (PairRMJudge reuses it for scores).

    @property
    def _rng(self) -> random.Random:
        # Subclasses ported from TRL may not call super().__init__(); give them an unseeded RNG.
        if "_flip_rng" not in self.__dict__:
            self._flip_rng = random.Random()
        return self._flip_rng

    def _draw_flips(self, n: int, shuffle_order: bool) -> list[bool]:
        if not shuffle_order:
            return [False] * n
        return [self._rng.random() < 0.5 for _ in range(n)]

    @staticmethod
    def _apply_flips(pairs: list[list[Any]], flips: list[bool]) -> list[list[Any]]:
        return [[b, a] if flipped else [a, b] for (a, b), flipped in zip(pairs, flips)]

    @staticmethod
    def _unflip(answer: int, flipped: bool) -> int:
        # A failure is nobody's win: it must stay -1, not become 1 - (-1) = 2 (docs/internals.md, "Judges").
        if answer == -1 or not flipped:
            return answer
        return 1 - answer

    def _check_pairs(self, prompts: Sequence[Any], completions: Sequence[Sequence[Any]]) -> list[list[Any]]:
        _check_lengths(prompts, completions, "completion pairs")
        pairs = []
        for i, pair in enumerate(completions):
            if isinstance(pair, str) or len(pair) != 2:
                raise ValueError(
                    f"completions[{i}] must be a pair [completion_a, completion_b]; a pairwise judge "
                    f"compares exactly 2 completions (got {pair!r:.80})"
                )
            pairs.append(list(pair))
        return pairs

    def _check_answers(self, answers: Sequence[Any], n: int) -> list[int]:
        name = type(self).__name__
        answers = list(answers)
        if len(answers) != n:
            raise ValueError(f"{name}.judge_pairs returned {len(answers)} answers for {n} pairs")
        checked = []
        for i, answer in enumerate(answers):
            if answer not in (0, 1, -1):
                raise ValueError(
                    f"{name} answered {answer!r} for pair {i}; a pairwise judge answers 0, 1, or -1 (failure)"
                )
            checked.append(int(answer))
        return checked


class BaseBinaryJudge(BaseJudge):
    """Checks a constraint per completion: 1 satisfied, 0 not, -1 failure (CGPO's constraint judges).

    `shuffle_order` exists for TRL signature compatibility; a binary judge has no order to shuffle.
    """

    def judge(
        self,
        prompts: list[Any],
        completions: list[Any],
        gold_completions: list[Any] | None = None,
        shuffle_order: bool = True,
    ) -> list[int]:
        raise NotImplementedError(f"{type(self).__name__} must implement judge()")
