"""Judges that run in this process: a reward model, a Python function, PairRM, random and combined judges.

- `RewardModelJudge`: a local sequence-classification reward model, scoring text with its own tokenizer.
- `CallableJudge`: any Python function, pairwise (`fn(prompts, pairs)`) or per completion (`fn(prompt, completion)`).
- `PairRMJudge`: LLM-Blender's PairRM (optional `llm-blender` package).
- `RandomPairwiseJudge`, `RandomRankJudge`, `RandomBinaryJudge`: seeded random answers for tests and smoke runs.
- `AllTrueJudge`: 1 where every binary judge says 1.

Importing this module is light: torch, transformers and llm-blender are imported inside the judges
that need them.
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posttrain.judges.base import (
    BaseBinaryJudge,
    BasePairwiseJudge,
    BaseRankJudge,
    _as_text,
    _check_lengths,
    _is_conversational,
    rng_state,
    set_rng_state,
)

__all__ = [
    "AllTrueJudge",
    "CallableJudge",
    "PairRMJudge",
    "RandomBinaryJudge",
    "RandomPairwiseJudge",
    "RandomRankJudge",
    "RewardModelJudge",
]

_PAIRRM_INSTALL_HINT = (
    "PairRMJudge needs the optional package llm-blender: `pip install llm-blender`. "
    "On first use it downloads the llm-blender/PairRM weights from the Hugging Face Hub, so that "
    "first run needs network access (or a Hugging Face cache that already holds them)."
)


class AllTrueJudge(BaseBinaryJudge):
    """1 where every judge says 1, -1 where any judge failed, else 0 (TRL's AllTrueJudge)."""

    def __init__(self, judges: Sequence[BaseBinaryJudge]):
        if not judges:
            raise ValueError("AllTrueJudge needs at least one binary judge")
        self.judges = list(judges)

    def judge(
        self,
        prompts: list[Any],
        completions: list[Any],
        gold_completions: list[Any] | None = None,
        shuffle_order: bool = True,
    ) -> list[int]:
        _check_lengths(prompts, completions)
        verdicts = [j.judge(prompts, completions, gold_completions, shuffle_order) for j in self.judges]
        for j, v in zip(self.judges, verdicts):
            if len(v) != len(prompts):
                raise ValueError(f"{type(j).__name__} returned {len(v)} verdicts for {len(prompts)} completions")
        out = []
        for i, row in enumerate(zip(*verdicts)):
            bad = [v for v in row if v not in (0, 1, -1)]
            if bad:
                raise ValueError(f"binary judge answered {bad[0]!r} for completion {i}; expected 0, 1 or -1")
            out.append(-1 if -1 in row else int(all(v == 1 for v in row)))
        return out

    def state_dict(self) -> dict[str, Any]:
        """`{"judges": [state of each binary judge, in order]}`."""
        return {**super().state_dict(), "judges": [j.state_dict() for j in self.judges]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        if len(state["judges"]) != len(self.judges):
            raise ValueError(
                f"AllTrueJudge.load_state_dict: the state holds {len(state['judges'])} judges' states "
                f"but this AllTrueJudge combines {len(self.judges)} judges"
            )
        for j, sub_state in zip(self.judges, state["judges"]):
            j.load_state_dict(sub_state)


# --------------------------------------------------------------------------------------------
# Random judges (tests, smoke runs)
# --------------------------------------------------------------------------------------------


class RandomPairwiseJudge(BasePairwiseJudge):
    """Answers 0 or 1 uniformly at random; reproducible with `seed`. For tests and smoke runs."""

    def __init__(self, seed: int | None = None):
        super().__init__(seed)
        self._answer_rng = random.Random(None if seed is None else seed + 1)

    def judge_pairs(self, prompts: list[Any], pairs: list[list[Any]]) -> list[int]:
        return [self._answer_rng.randint(0, 1) for _ in pairs]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "answer_rng": rng_state(self._answer_rng)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        set_rng_state(self._answer_rng, state["answer_rng"])


class _SeededAnswers:
    """Mixin of a judge whose answers come from `self._rng` (`random.Random(seed)`); its state_dict holds
    that stream under "rng", so a resumed run continues it."""

    def __init__(self, seed: int | None = None):
        self._rng = random.Random(seed)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rng": rng_state(self._rng)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        set_rng_state(self._rng, state["rng"])


class RandomRankJudge(_SeededAnswers, BaseRankJudge):
    """A random permutation per prompt; reproducible with `seed`."""

    def judge(self, prompts: list[Any], completions: list[list[Any]], shuffle_order: bool = True) -> list[list[int]]:
        _check_lengths(prompts, completions)
        return [self._rng.sample(range(len(c)), len(c)) for c in completions]


class RandomBinaryJudge(_SeededAnswers, BaseBinaryJudge):
    """0 or 1 uniformly at random; reproducible with `seed`."""

    def judge(
        self,
        prompts: list[Any],
        completions: list[Any],
        gold_completions: list[Any] | None = None,
        shuffle_order: bool = True,
    ) -> list[int]:
        _check_lengths(prompts, completions)
        return [self._rng.randint(0, 1) for _ in completions]


# --------------------------------------------------------------------------------------------
# Reward model and Python callables
# --------------------------------------------------------------------------------------------


class RewardModelJudge(BasePairwiseJudge):
    """Prefers the completion a local reward model scores higher.

    `model` is a transformers `*ForSequenceClassification` with `num_labels=1` (backbone at
    `base_model_prefix` plus a `score` head, as Llama/Qwen/Mistral/GPT-NeoX reward models have) and
    `tokenizer` is ITS tokenizer, which may differ from the policy's: the judge scores text.
    Each sequence is `prompt + completion` for text prompts (tokenized with the tokenizer's special
    tokens), or the tokenizer's chat template over `prompt + [assistant completion]` for
    conversational prompts. The score is read at the last real token found from the sequence
    length, never from pad ids, because pad may equal eos (scoring.py, TRL#937).

    Ties go to the completion shown first; with `shuffle_order` that is a random one. A NaN score
    is a failure (-1). The model is put in eval mode; with `device` it is moved there, otherwise the
    judge runs where the model already is.
    """

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 16, device: Any = None, seed: int | None = None):
        super().__init__(seed)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        num_labels = getattr(getattr(model, "config", None), "num_labels", 1)
        if num_labels != 1:
            raise ValueError(
                f"the reward model has num_labels={num_labels}; a reward model outputs one score (num_labels=1)"
            )
        if device is not None:
            model = model.to(device)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size

    def _sequence_ids(self, prompt: Any, completion: Any) -> list[int]:
        if _is_conversational(prompt):
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise ValueError(
                    "the prompt is a list of chat messages but the reward model's tokenizer has no chat "
                    "template; set tokenizer.chat_template or pass prompts as rendered text"
                )
            reply = completion if _is_conversational(completion) else [{"role": "assistant", "content": completion}]
            text = self.tokenizer.apply_chat_template(prompt + reply, tokenize=False)
            # The template already writes BOS and other special tokens.
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(_as_text(prompt) + _as_text(completion), add_special_tokens=True)["input_ids"]

    def score(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[float]:
        """Reward-model score of each (prompt, completion), as Python floats."""
        import torch

        from posttrain.ops import lengths_to_mask
        from posttrain.scoring import last_token_scores

        _check_lengths(prompts, completions)
        device = next(self.model.parameters()).device
        rows = [self._sequence_ids(p, c) for p, c in zip(prompts, completions)]
        for i, row in enumerate(rows):
            if not row:
                raise ValueError(f"prompt + completion {i} tokenized to nothing; the reward model cannot score it")
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(rows), self.batch_size):
                chunk = [torch.tensor(r, dtype=torch.long) for r in rows[start : start + self.batch_size]]
                lengths = torch.tensor([len(r) for r in chunk], dtype=torch.long, device=device)
                # Right padding with id 0: the pad id never matters because the mask and the
                # read position both come from the lengths.
                ids = torch.nn.utils.rnn.pad_sequence(chunk, batch_first=True, padding_value=0).to(device)  # (B, L)
                mask = lengths_to_mask(lengths, ids.size(1))  # (B, L)
                scores.extend(last_token_scores(self.model, ids, mask, lengths - 1).float().cpu().tolist())
        return scores

    def judge_pairs(self, prompts: list[Any], pairs: list[list[Any]]) -> list[int]:
        flat_prompts = [p for p in prompts for _ in range(2)]
        flat_completions = [c for pair in pairs for c in pair]
        scores = self.score(flat_prompts, flat_completions)
        answers = []
        for first, second in zip(scores[0::2], scores[1::2]):
            answers.append(-1 if math.isnan(first) or math.isnan(second) else int(second > first))
        return answers


class CallableJudge(BasePairwiseJudge):
    """A pairwise judge from a Python function, in one of two forms:

    - `mode="pairwise"`: `fn(prompts, pairs) -> list[int]`, one 0/1/-1 per pair, pairs given in the
      (possibly flipped) order the judge asks them;
    - `mode="score"`: `fn(prompt, completion) -> float` for one completion; the higher score wins,
      a tie goes to the completion shown first, and a NaN score is a failure (-1).

    `mode="auto"` (default) reads the name of fn's first parameter: `prompts` means pairwise,
    `prompt` means score; any other name raises ValueError asking for an explicit `mode`, because
    both forms take two arguments and guessing wrong would silently judge nonsense. Exceptions
    raised by fn propagate: they are bugs in fn, not judge failures.

    `state_dict()` holds the order-flip RNG; a stateful `fn` saves its own state.
    """

    MODES = ("auto", "pairwise", "score")

    def __init__(self, fn: Callable[..., Any], mode: str = "auto", seed: int | None = None):
        super().__init__(seed)
        if not callable(fn):
            raise TypeError(f"CallableJudge needs a callable, got {type(fn).__name__}")
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        self.fn = fn
        self.mode = self._detect_mode(fn) if mode == "auto" else mode

    @staticmethod
    def _detect_mode(fn: Callable[..., Any]) -> str:
        name = getattr(fn, "__name__", type(fn).__name__)
        try:
            params = [
                p
                for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
        except (TypeError, ValueError):
            params = []
        first = params[0].name if params else None
        if first == "prompts":
            return "pairwise"
        if first == "prompt":
            return "score"
        raise ValueError(
            f"cannot tell how to call {name}: its first parameter is {first!r}, not 'prompts' "
            "(fn(prompts, pairs) -> list[int]) or 'prompt' (fn(prompt, completion) -> float); "
            "pass mode='pairwise' or mode='score'"
        )

    def judge_pairs(self, prompts: list[Any], pairs: list[list[Any]]) -> list[int]:
        if self.mode == "pairwise":
            return list(self.fn(prompts, pairs))
        answers = []
        for i, (prompt, (first, second)) in enumerate(zip(prompts, pairs)):
            a, b = self.fn(prompt, first), self.fn(prompt, second)
            try:
                a, b = float(a), float(b)
            except (TypeError, ValueError):
                raise ValueError(
                    f"scoring function returned {a!r} / {b!r} for pair {i}; it must return a float"
                ) from None
            answers.append(-1 if math.isnan(a) or math.isnan(b) else int(b > a))
        return answers


# --------------------------------------------------------------------------------------------
# PairRM (optional llm-blender)
# --------------------------------------------------------------------------------------------


class PairRMJudge(BasePairwiseJudge):
    """LLM-Blender's PairRM pairwise reward model (`llm-blender/PairRM`), as in TRL.

    Needs the optional `llm-blender` package (`pip install llm-blender`; it pins transformers<5)
    and downloads the PairRM weights from the Hugging Face Hub on first use. Without the package,
    building the judge raises ImportError saying so.

    `judge(..., return_scores=True, temperature=1.0)` returns the soft judgement instead: the
    probability that completion 0 is better, softmax(logits / temperature)[0], mapped back through
    the same order flip (p becomes 1 - p for a swapped pair).
    """

    def __init__(
        self,
        model_name: str = "llm-blender/PairRM",
        device: Any = None,
        batch_size: int = 16,
        seed: int | None = None,
    ):
        try:
            import llm_blender
        except ModuleNotFoundError as err:
            if err.name is not None and err.name.split(".")[0] == "llm_blender":
                raise ImportError(_PAIRRM_INSTALL_HINT) from None
            raise ImportError(
                f"llm-blender is installed but its dependency {err.name!r} is missing; install it"
            ) from err
        except ImportError as err:
            raise ImportError(
                f"llm-blender is installed but failed to import ({err}); it needs transformers<5. "
                f"{_PAIRRM_INSTALL_HINT}"
            ) from err
        super().__init__(seed)
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.batch_size = batch_size
        self.blender = llm_blender.Blender()
        self.blender.loadranker(model_name, device=str(device))

    def _logits(self, prompts: list[Any], pairs: list[list[Any]]) -> list[tuple[float, float]]:
        scores = self.blender.rank(
            [_as_text(p) for p in prompts],
            [[_as_text(c) for c in pair] for pair in pairs],
            return_scores=True,
            batch_size=self.batch_size,
            disable_tqdm=True,
        )
        return [(float(row[0]), float(row[1])) for row in scores]

    def judge_pairs(self, prompts: list[Any], pairs: list[list[Any]]) -> list[int]:
        return [int(second > first) for first, second in self._logits(prompts, pairs)]

    def judge(
        self,
        prompts: list[Any],
        completions: list[list[Any]],
        shuffle_order: bool = True,
        return_scores: bool = False,
        temperature: float = 1.0,
    ) -> list[int] | list[float]:
        if not return_scores:
            return super().judge(prompts, completions, shuffle_order)
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        pairs = self._check_pairs(prompts, completions)
        flips = self._draw_flips(len(pairs), shuffle_order)
        probs = []
        for (first, second), flipped in zip(self._logits(list(prompts), self._apply_flips(pairs, flips)), flips):
            # softmax over two logits: p0 = 1 / (1 + exp((l1 - l0) / T)), written to avoid overflow.
            z = (second - first) / temperature
            p_first = 1.0 / (1.0 + math.exp(z)) if z < 0 else math.exp(-z) / (1.0 + math.exp(-z))
            probs.append(1.0 - p_first if flipped else p_first)
        return probs
