"""`judge_from_spec`: build a judge from the string the CLI takes (`--judge`); `judge_from_model_name`:
from a judge LLM's name (`--judge_model`, as TRL's judge_tldr.py takes it)."""

from __future__ import annotations

import importlib
from typing import Any

from posttrain.judges.base import BaseJudge
from posttrain.judges.http import HF_ROUTER_URL, HfPairwiseJudge, HTTPPairwiseJudge, OpenAIPairwiseJudge
from posttrain.judges.local import CallableJudge, PairRMJudge, RandomPairwiseJudge, RewardModelJudge

__all__ = ["HF_ROUTER_URL", "is_http_spec", "judge_from_model_name", "judge_from_spec"]

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


def is_http_spec(spec: str) -> bool:
    """True for the specs that build an HTTP judge (openai[:model], http:<url>#<model>, a bare URL),
    the ones that take `timeout`, `max_retries` and `max_concurrency`."""
    kind = spec.strip().partition(":")[0]
    return kind in ("openai", "http", "https")


def judge_from_model_name(name: str, **kwargs: Any) -> HTTPPairwiseJudge:
    """A judge LLM by name, as TRL's `examples/scripts/evals/judge_tldr.py --judge_model` picks it: a
    name containing "gpt" is an OpenAI model (`OpenAIPairwiseJudge`, key from $OPENAI_API_KEY); any
    other name is a model hosted by Hugging Face (`HfPairwiseJudge`, as in TRL), asked through Inference
    Providers' OpenAI-compatible endpoint `HF_ROUTER_URL` with the token from $HF_TOKEN or `hf auth login`.
    `kwargs` go to the judge's constructor (timeout, max_retries, max_concurrency, seed, ...)."""
    if not name:
        raise ValueError("judge_model is empty; name a judge model, e.g. gpt-4o-mini")
    if "gpt" in name:
        return OpenAIPairwiseJudge(name, **kwargs)
    return HfPairwiseJudge(name, **kwargs)
