"""Judges: compare, rank or check completions, for Online DPO / XPO and win-rate evaluation.

The protocol follows TRL's judges (trl-notes §10) so judge code ports by changing the import:

- `BasePairwiseJudge.judge(prompts, completions, shuffle_order=True) -> list[int]`: for each prompt
  and pair `[a, b]`, the index (0 or 1) of the better completion, or -1 when the judge failed.
- `BaseRankJudge.judge(prompts, completions, shuffle_order=True) -> list[list[int]]`: completion
  indices, best first.
- `BaseBinaryJudge.judge(prompts, completions, gold_completions=None, shuffle_order=True) -> list[int]`:
  1 if the completion satisfies the constraint, 0 if not, -1 on failure (CGPO-style constraints).

Position bias: LLM judges prefer one slot, so with `shuffle_order=True` a pairwise judge swaps a
random subset of pairs before asking and maps each answer back. The swap lives once, in
`BasePairwiseJudge.judge`; concrete judges implement `judge_pairs`, which answers pairs exactly in
the order given. TRL mapped a swapped answer back with `1 - rank`, which turns a -1 failure into 2
(trl-notes §10); here a failure stays -1.

Concrete judges: `RewardModelJudge` (a local sequence-classification reward model),
`CallableJudge` (any Python function), `HTTPPairwiseJudge` / `OpenAIPairwiseJudge` (an
OpenAI-compatible `/chat/completions` endpoint, standard library only), `PairRMJudge` (optional
`llm-blender`), and the `Random*Judge` helpers for tests and smoke runs. `judge_from_spec` builds one
from a CLI string and `win_rate` summarises judgements with a Wilson interval.

Importing this module is light: torch, transformers and llm-blender are imported inside the judges
that need them.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import importlib
import inspect
import json
import logging
import math
import os
import random
import re
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_PAIRWISE_SYSTEM_PROMPT",
    "AllTrueJudge",
    "BaseBinaryJudge",
    "BaseJudge",
    "BasePairwiseJudge",
    "BaseRankJudge",
    "CallableJudge",
    "HTTPPairwiseJudge",
    "OpenAIPairwiseJudge",
    "PairRMJudge",
    "RandomBinaryJudge",
    "RandomPairwiseJudge",
    "RandomRankJudge",
    "RewardModelJudge",
    "WinRate",
    "judge_from_spec",
    "win_rate",
]

# The pairwise prompt TRL's API judges use (itself adapted from AlpacaEval's leaderboard prompt), so
# win rates stay comparable with published TRL numbers. Literal braces are doubled for str.format.
# A trailing backslash joins a long line to the next without a newline.
DEFAULT_PAIRWISE_SYSTEM_PROMPT = '''I require a leaderboard for various large language models. I'll provide you with \
prompts given to these models and their corresponding outputs. Your task is to assess these responses, and select the \
model that produces the best output from a human perspective.

## Instruction

{{
    "instruction": """{prompt}""",
}}

## Model Outputs

Here are the unordered outputs from the models. Each output is associated with a specific model, identified by a \
unique model identifier.

{{
    {{
        "model_identifier": "0",
        "output": """{response0}"""
    }},
    {{
        "model_identifier": "1",
        "output": """{response1}"""
    }}
}}

## Task

Evaluate the models on the basis of the quality and relevance of their results, and select the model that generated \
the best result. Reply with the identifier of the best model. Our evaluation will only take into account the first \
character of your answer, so make sure it contains only one of the identifiers and nothing else (no quotation marks, \
no spaces, no new lines, ...).
'''

OPENAI_BASE_URL = "https://api.openai.com/v1"
OPENAI_DEFAULT_MODEL = "gpt-4o-mini"

_PAIRRM_INSTALL_HINT = (
    "PairRMJudge needs the optional package llm-blender: `pip install llm-blender`. "
    "On first use it downloads the llm-blender/PairRM weights from the Hugging Face Hub, so that "
    "first run needs network access (or a Hugging Face cache that already holds them)."
)


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


# --------------------------------------------------------------------------------------------
# Protocols
# --------------------------------------------------------------------------------------------


class BaseJudge:
    """Any judge: `judge(prompts, completions, shuffle_order=True)`; the subclasses fix the shapes."""

    def judge(self, prompts: list[Any], completions: list[Any], shuffle_order: bool = True) -> list[Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement judge()")


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
        # A failure is nobody's win: it must stay -1, not become 1 - (-1) = 2 (TRL's bug).
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
    """Checks a constraint per completion: 1 satisfied, 0 not, -1 failure (CGPO, trl-notes §10).

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


class RandomRankJudge(BaseRankJudge):
    """A random permutation per prompt; reproducible with `seed`."""

    def __init__(self, seed: int | None = None):
        self._rng = random.Random(seed)

    def judge(self, prompts: list[Any], completions: list[list[Any]], shuffle_order: bool = True) -> list[list[int]]:
        _check_lengths(prompts, completions)
        return [self._rng.sample(range(len(c)), len(c)) for c in completions]


class RandomBinaryJudge(BaseBinaryJudge):
    """0 or 1 uniformly at random; reproducible with `seed`."""

    def __init__(self, seed: int | None = None):
        self._rng = random.Random(seed)

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
# OpenAI-compatible HTTP judge (standard library only)
# --------------------------------------------------------------------------------------------


class _Secret:
    """Holds the API key so that repr(), vars() and tracebacks of the judge never show it."""

    __slots__ = ("_value",)

    def __init__(self, value: str | None):
        self._value = value

    def reveal(self) -> str | None:
        return self._value

    def __repr__(self) -> str:
        return "<hidden>" if self._value else "<none>"

    def __bool__(self) -> bool:
        return bool(self._value)


# A standalone 0 or 1, so "10" or "2024" in a chatty reply does not count as an answer.
_ANSWER_RE = re.compile(r"(?<!\d)[01](?!\d)")


class HTTPPairwiseJudge(BasePairwiseJudge):
    """An LLM judge behind an OpenAI-compatible `/chat/completions` endpoint (OpenAI, vLLM, TGI, ...).

    Each pair becomes one request whose single user message is `system_prompt` formatted with
    `{prompt}`, `{response0}` and `{response1}`; the reply's first standalone "0" or "1" is the
    answer (`max_tokens=1`, `temperature=0` by default). Requests run `max_concurrency` at a time in
    threads; only the standard library is used, and proxies come from the usual `*_proxy` variables.

    Failures never raise: a malformed body, a reply without 0/1, an HTTP error or a timeout gives
    -1 for that pair, and each `judge()` call logs ONE warning line counting its failures by reason.
    Retries: HTTP 429, HTTP 5xx, timeouts and connection errors are retried up to `max_retries`
    times, sleeping `backoff * 2**attempt` seconds (capped at `max_backoff`, with jitter; a
    `Retry-After` header is honoured up to the cap). Other 4xx (bad key, bad model name) are not
    retried. `timeout` is per socket operation, in seconds.

    `max_requests` caps the number of pairs this judge sends over its lifetime (a cost guard, as in
    TRL; retries do not count); pairs past the cap get -1 and a one-time warning. `num_requests`
    and `num_failures` hold the running totals.

    The API key is read from the environment variable `api_key_env` (None: send no key, fine for
    local servers) and sent as `Authorization: Bearer ...`; it never appears in repr(), logs or
    exception messages.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str | None = "OPENAI_API_KEY",
        system_prompt: str | None = None,
        max_concurrency: int = 8,
        timeout: float = 30.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        max_requests: int = 1000,
        *,
        max_backoff: float = 30.0,
        max_tokens: int | None = 1,
        temperature: float | None = 0.0,
        seed: int | None = None,
    ):
        super().__init__(seed)
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        limits = (
            ("max_concurrency", max_concurrency, 1),
            ("max_retries", max_retries, 0),
            ("max_requests", max_requests, 0),
        )
        for field, value, low in limits:
            if value < low:
                raise ValueError(f"{field} must be >= {low}, got {value}")
        if timeout <= 0 or backoff < 0 or max_backoff < 0:
            raise ValueError("timeout must be > 0, backoff and max_backoff >= 0")
        self.system_prompt = DEFAULT_PAIRWISE_SYSTEM_PROMPT if system_prompt is None else system_prompt
        try:
            self.system_prompt.format(prompt="", response0="", response1="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"system_prompt must use only the fields {{prompt}}, {{response0}} and {{response1}} "
                f"(write literal braces as {{{{ and }}}}): {err!r}"
            ) from None
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key_env = api_key_env
        self._api_key = _Secret(os.environ.get(api_key_env) if api_key_env else None)
        self.max_concurrency = max_concurrency
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.num_requests = 0
        self.num_failures = 0
        self._cap_warned = False
        self._lock = threading.Lock()
        # Jitter has its own RNG so retries never shift the seeded order flips.
        self._jitter = random.Random()
        # A private opener reads the proxy settings when the judge is built, not when urllib's
        # global opener happened to be first used.
        self._opener = urllib.request.build_opener()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(base_url={self.base_url!r}, model={self.model!r}, "
            f"api_key_env={self.api_key_env!r}, max_concurrency={self.max_concurrency}, "
            f"timeout={self.timeout}, max_retries={self.max_retries}, max_requests={self.max_requests})"
        )

    def __getstate__(self) -> dict[str, Any]:
        # Pickled judges (e.g. sent to worker processes) re-read the key from their environment.
        state = self.__dict__.copy()
        for key in ("_api_key", "_lock", "_opener"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._api_key = _Secret(os.environ.get(self.api_key_env) if self.api_key_env else None)
        self._lock = threading.Lock()
        self._opener = urllib.request.build_opener()

    def judge_pairs(self, prompts: list[Any], pairs: list[list[Any]]) -> list[int]:
        n = len(pairs)
        with self._lock:
            allowed = max(0, min(n, self.max_requests - self.num_requests))
            self.num_requests += allowed
            warn_cap = allowed < n and not self._cap_warned
            self._cap_warned = self._cap_warned or warn_cap
        if warn_cap:
            logger.warning(
                "%s reached max_requests=%d; this and every later pair is judged -1 (no preference). "
                "Raise max_requests to judge more.",
                type(self).__name__,
                self.max_requests,
            )
        answers = [-1] * n
        reasons: Counter[str] = Counter()
        if allowed:
            workers = min(self.max_concurrency, allowed)
            pool_options = {"max_workers": workers, "thread_name_prefix": "posttrain-judge"}
            with concurrent.futures.ThreadPoolExecutor(**pool_options) as pool:
                outcomes = list(pool.map(self._ask, prompts[:allowed], pairs[:allowed]))
            for i, (answer, reason) in enumerate(outcomes):
                answers[i] = answer
                if reason is not None:
                    reasons[reason] += 1
        failed = sum(reasons.values())
        if failed:
            with self._lock:
                self.num_failures += failed
            detail = ", ".join(f"{reason} x{count}" for reason, count in reasons.most_common())
            logger.warning(
                "%s: %d of %d pairs failed (%s); they count as -1 (no preference)",
                type(self).__name__,
                failed,
                allowed,
                self._redact(detail),
            )
        return answers

    def _ask(self, prompt: Any, pair: list[Any]) -> tuple[int, str | None]:
        """(answer, None) or (-1, short failure reason) for one pair, with retries."""
        content = self.system_prompt.format(
            prompt=_as_text(prompt), response0=_as_text(pair[0]), response1=_as_text(pair[1])
        )
        payload: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": content}]}
        if self.max_tokens is not None:
            payload["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            payload["temperature"] = self.temperature
        data = json.dumps(payload).encode("utf-8")
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key.reveal()}"
        for attempt in range(self.max_retries + 1):
            retry_after = None
            url = f"{self.base_url}/chat/completions"
            request = urllib.request.Request(url, data=data, headers=headers, method="POST")
            try:
                with self._opener.open(request, timeout=self.timeout) as response:
                    body = response.read()
            except urllib.error.HTTPError as err:
                code = err.code
                retry_after = err.headers.get("Retry-After") if err.headers else None
                err.close()
                reason = f"HTTP {code}"
                if code == 401:
                    reason += f" (check the key in ${self.api_key_env})" if self.api_key_env else " (no API key sent)"
                retryable = code == 429 or code >= 500
            except urllib.error.URLError as err:
                timed_out = isinstance(err.reason, TimeoutError)
                reason, retryable = ("timeout" if timed_out else "connection error"), True
            except TimeoutError:
                reason, retryable = "timeout", True
            except (http.client.HTTPException, OSError):
                reason, retryable = "connection error", True
            else:
                return self._parse(body)
            if not retryable or attempt == self.max_retries:
                return -1, reason
            time.sleep(self._delay(attempt, retry_after))
        raise AssertionError("unreachable: the retry loop always returns")

    @staticmethod
    def _parse(body: bytes) -> tuple[int, str | None]:
        try:
            content = json.loads(body)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return -1, "malformed reply"
        match = _ANSWER_RE.search(content) if isinstance(content, str) else None
        if match is None:
            return -1, "reply without 0/1"
        return int(match.group()), None

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        if retry_after is not None:
            try:
                return min(self.max_backoff, max(0.0, float(retry_after)))
            except ValueError:
                pass  # an HTTP-date Retry-After: fall back to exponential backoff
        delay = min(self.max_backoff, self.backoff * 2**attempt)
        # Jitter in [delay/2, delay] keeps concurrent workers from retrying in lockstep.
        return delay * (0.5 + 0.5 * self._jitter.random())

    def _redact(self, text: str) -> str:
        key = self._api_key.reveal()
        return text.replace(key, "<hidden>") if key else text


class OpenAIPairwiseJudge(HTTPPairwiseJudge):
    """`HTTPPairwiseJudge` on the OpenAI API: `model="gpt-4o-mini"`, key from `$OPENAI_API_KEY`.

    TRL's signature (`model, system_prompt, max_requests`) comes first; every other
    `HTTPPairwiseJudge` option is accepted by keyword. The key is required here (ValueError if the
    variable is unset or empty), since the OpenAI API rejects every keyless request.
    """

    def __init__(
        self,
        model: str = OPENAI_DEFAULT_MODEL,
        system_prompt: str | None = None,
        max_requests: int = 1000,
        *,
        base_url: str = OPENAI_BASE_URL,
        api_key_env: str = "OPENAI_API_KEY",
        **kwargs: Any,
    ):
        if not os.environ.get(api_key_env):
            raise ValueError(f"OpenAIPairwiseJudge reads the API key from ${api_key_env}, which is not set")
        super().__init__(
            base_url, model, api_key_env=api_key_env, system_prompt=system_prompt, max_requests=max_requests, **kwargs
        )


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


# --------------------------------------------------------------------------------------------
# Factory for the CLI
# --------------------------------------------------------------------------------------------

_SPEC_HELP = (
    "judge specs: 'pair_rm', 'openai' or 'openai:<model>', 'http:<base_url>#<model>', "
    "'reward_model:<path or hub name>', 'python:<module>:<function>', 'random' or 'random:<seed>'"
)


def judge_from_spec(spec: str, **kwargs: Any) -> BaseJudge:
    """Build a judge from a CLI string; `kwargs` go to the judge's constructor.

    - `pair_rm` -> PairRMJudge()
    - `openai` / `openai:<model>` -> OpenAIPairwiseJudge (key from $OPENAI_API_KEY)
    - `http:<base_url>#<model>` -> HTTPPairwiseJudge, e.g. `http:http://localhost:8000/v1#Qwen/Qwen2.5-7B-Instruct`
      (a bare `http(s)://...#<model>` works too)
    - `reward_model:<path>` -> RewardModelJudge over the model and tokenizer saved at path (or hub name)
    - `python:<module>:<attribute>` -> imports module, follows the dotted attribute; a judge
      instance is returned as is, a judge class is instantiated with kwargs, any other callable is
      wrapped in CallableJudge(fn, **kwargs)
    - `random` / `random:<seed>` -> RandomPairwiseJudge
    """
    kind, sep, rest = spec.strip().partition(":")
    if kind == "pair_rm" and not sep:
        return PairRMJudge(**kwargs)
    if kind == "openai":
        return OpenAIPairwiseJudge(rest, **kwargs) if rest else OpenAIPairwiseJudge(**kwargs)
    if kind in ("http", "https") and rest.startswith("//"):
        # A bare URL ("http://host/v1#model") is accepted too: the prefix is easy to forget.
        kind, rest = "http", spec.strip()
    if kind == "http" and sep:
        base_url, hash_sep, model = rest.rpartition("#")
        if not hash_sep or not base_url or not model:
            raise ValueError(
                f"bad judge spec {spec!r}: write http:<base_url>#<model>, e.g. http:http://localhost:8000/v1#my-model"
            )
        return HTTPPairwiseJudge(base_url, model, **kwargs)
    if kind == "reward_model" and rest:
        from posttrain.models import load_reward_model, load_tokenizer

        tokenizer = load_tokenizer(rest, padding_side="right")
        return RewardModelJudge(load_reward_model(rest, tokenizer=tokenizer), tokenizer, **kwargs)
    if kind == "python" and rest:
        return _judge_from_python(spec, rest, kwargs)
    if kind == "random":
        if not rest:
            return RandomPairwiseJudge(**kwargs)
        try:
            seed = int(rest)
        except ValueError:
            raise ValueError(f"bad judge spec {spec!r}: random:<seed> takes an integer seed") from None
        return RandomPairwiseJudge(seed, **kwargs)
    raise ValueError(f"unknown judge spec {spec!r}; {_SPEC_HELP}")


def _judge_from_python(spec: str, target: str, kwargs: dict[str, Any]) -> BaseJudge:
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(
            f"bad judge spec {spec!r}: write python:<module>:<function>, e.g. python:my_pkg.judges:prefer_short"
        )
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"judge spec {spec!r}: {module_name} has no attribute {attr_path!r}") from None
    if isinstance(obj, BaseJudge):
        return obj
    if isinstance(obj, type) and issubclass(obj, BaseJudge):
        return obj(**kwargs)
    if callable(obj):
        return CallableJudge(obj, **kwargs)
    raise ValueError(f"judge spec {spec!r}: {attr_path} is a {type(obj).__name__}, not a judge or a function")


# --------------------------------------------------------------------------------------------
# Win rate
# --------------------------------------------------------------------------------------------


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
