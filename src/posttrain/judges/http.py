"""LLM judges behind an OpenAI-compatible `/chat/completions` endpoint (OpenAI, vLLM, TGI, ...).

`HTTPPairwiseJudge` sends one request per pair with the standard library only (urllib in a thread
pool), retries rate limits, server errors and timeouts with backoff, and turns every failure into a
-1 answer plus one warning line per `judge()` call. `OpenAIPairwiseJudge` is the same client with
TRL's OpenAI defaults, `HfPairwiseJudge` with TRL's Hugging Face defaults (Inference Providers' router).
`DEFAULT_PAIRWISE_SYSTEM_PROMPT` is TRL's pairwise prompt.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import logging
import os
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from posttrain.judges.base import BasePairwiseJudge, _as_text

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_PAIRWISE_SYSTEM_PROMPT",
    "HF_ROUTER_URL",
    "HTTPPairwiseJudge",
    "HfPairwiseJudge",
    "OpenAIPairwiseJudge",
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
# Hugging Face Inference Providers' OpenAI-compatible endpoint for hosted models
# (https://huggingface.co/docs/inference-providers), and the judge TRL's HfPairwiseJudge asks by default.
HF_ROUTER_URL = "https://router.huggingface.co/v1"
HF_DEFAULT_MODEL = "meta-llama/Meta-Llama-3-70B-Instruct"


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
    and `num_failures` hold the running totals; `state_dict()` saves them with the flip RNG, so a
    resumed run keeps counting towards the same cap.

    The API key is read from the environment variable `api_key_env` (None: send no key, fine for
    local servers) and sent as `Authorization: Bearer ...`; it never appears in repr(), logs or
    exception messages.

    `progress`, when set (a callable, e.g. a tqdm bar's `update`), is called with the number of
    pairs settled each time a pair gets its answer or its failure, from the calling thread, so a
    progress display advances while a `judge()` call runs (`posttrain judge` shows one).
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
        progress: Callable[[int], Any] | None = None,
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
        self.progress = progress
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
        # A progress display belongs to the process that shows it.
        state = self.__dict__.copy()
        for key in ("_api_key", "_lock", "_opener"):
            state.pop(key)
        state["progress"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._api_key = _Secret(os.environ.get(self.api_key_env) if self.api_key_env else None)
        self._lock = threading.Lock()
        self._opener = urllib.request.build_opener()

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            counters = {"num_requests": self.num_requests, "num_failures": self.num_failures}
        return {**super().state_dict(), **counters}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        with self._lock:
            self.num_requests, self.num_failures = int(state["num_requests"]), int(state["num_failures"])

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
        if allowed < n and self.progress is not None:
            self.progress(n - allowed)  # past the cap: settled as -1 without a request
        if allowed:
            workers = min(self.max_concurrency, allowed)
            pool_options = {"max_workers": workers, "thread_name_prefix": "posttrain-judge"}
            with concurrent.futures.ThreadPoolExecutor(**pool_options) as pool:
                futures = {pool.submit(self._ask, prompts[i], pairs[i]): i for i in range(allowed)}
                for future in concurrent.futures.as_completed(futures):
                    answer, reason = future.result()
                    answers[futures[future]] = answer
                    if reason is not None:
                        reasons[reason] += 1
                    if self.progress is not None:
                        self.progress(1)
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
                    reason += self._key_hint()
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

    def _key_hint(self) -> str:
        """What an HTTP 401 reply suggests checking."""
        return f" (check the key in ${self.api_key_env})" if self.api_key_env else " (no API key sent)"

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


class HfPairwiseJudge(HTTPPairwiseJudge):
    """`HTTPPairwiseJudge` on a model hosted by Hugging Face Inference Providers, through their
    OpenAI-compatible router (`HF_ROUTER_URL`): TRL's `HfPairwiseJudge(model, token, system_prompt)`.

    The token is `token`, else the one huggingface_hub finds ($HF_TOKEN, or the one `hf auth login`
    saved); ValueError if there is none, since the router rejects keyless requests. A pickled judge
    (sent to another process) leaves the token behind and finds it there the same way. Every other
    `HTTPPairwiseJudge` option (max_requests, timeout, retries, concurrency, ...) is accepted by keyword.
    """

    def __init__(
        self,
        model: str = HF_DEFAULT_MODEL,
        token: str | None = None,
        system_prompt: str | None = None,
        *,
        base_url: str = HF_ROUTER_URL,
        **kwargs: Any,
    ):
        super().__init__(base_url, model, api_key_env=None, system_prompt=system_prompt, **kwargs)
        self._api_key = _Secret(token or _hub_token())
        if not self._api_key:
            raise ValueError(
                f"HfPairwiseJudge needs a Hugging Face token for {base_url}: pass token=..., set $HF_TOKEN or run "
                "`hf auth login`"
            )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._api_key = _Secret(_hub_token())

    def _key_hint(self) -> str:
        return " (check the Hugging Face token: token=..., $HF_TOKEN or `hf auth login`)"


def _hub_token() -> str | None:
    """The token huggingface_hub would send: $HF_TOKEN, else the one saved by `hf auth login`."""
    from huggingface_hub import get_token

    return get_token()
