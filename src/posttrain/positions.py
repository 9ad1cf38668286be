"""Prompt + completion against the position limits of every model that reads the sequence.

A model with learned position embeddings (GPT-2's `wpe`) fails with "IndexError: index out of
range" on a sequence longer than its table, after minutes of loading; a rotary model (Llama) runs
past `max_position_embeddings` silently, on positions it never trained on. Online training reads
prompt + up to `response_length` completion tokens in the policy, the reference, the critic and
each reward model (re-tokenized with its own tokenizer when it has one), so before the first rollout
the longest prompt plus `response_length` must fit every one of them:

- `response_length` alone reaching a limit: stop, naming the model (lower `--response_length`);
- `max_prompt_length` unset: the room the tightest model leaves becomes the prompt bound and
  `prompt_overflow` applies (truncate_left / drop), with a printed count of the prompts it touched;
- `max_prompt_length` set, and prompts of that length do not fit: stop, naming the model, its limit,
  the lengths and the fix (`--max_prompt_length N` or a lower `--response_length`);
- a reward model with its own tokenizer: its token count of the prompts is measured; when they do
  not fit, stop with a suggested `--max_prompt_length` (the completion's re-tokenized length is
  estimated as `response_length`).

Models with no limit in their config (no `max_position_embeddings` / `n_positions` / ...) pass.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.configs import ConfigError

# Config attributes holding the number of positions a decoder reads, most common first.
_LIMIT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


@dataclass(frozen=True)
class PositionLimit:
    """A model that reads the training sequences and the most positions it takes."""

    name: str  # e.g. "policy (path/to/model)", used in messages
    limit: int
    tokenizer: Any = None  # None: reads the policy's tokens; else re-tokenizes the decoded text


def position_limit(model: Any) -> int | None:
    """The number of positions `model`'s config allows, or None (no limit, or not a decoder-only model)."""
    config = getattr(model, "config", None)
    if config is None and hasattr(model, "pretrained_model"):  # a causal LM with a value head
        config = getattr(model.pretrained_model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None
    for field in _LIMIT_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def model_name(role: str, model: Any) -> str:
    """`role (path)` when the model was loaded from a path, else `role`."""
    config = getattr(model, "config", None) or getattr(getattr(model, "pretrained_model", None), "config", None)
    path = getattr(config, "_name_or_path", None)
    return f"{role} ({path})" if path else role


def limits_of(models: Iterable[tuple[str, Any, Any]]) -> list[PositionLimit]:
    """PositionLimit for each (role, model, own tokenizer or None) whose model has a limit."""
    out = []
    for role, model, tokenizer in models:
        limit = position_limit(model) if model is not None else None
        if limit is not None:
            out.append(PositionLimit(model_name(role, model), limit, tokenizer))
    return out


def _fix(budget: int) -> str:
    return f"Fix: pass --max_prompt_length {budget} (max_prompt_length= in Python) or a lower --response_length."


def prompt_bound(
    limits: Sequence[PositionLimit], *, response_length: int, max_prompt_length: int | None
) -> tuple[int | None, PositionLimit | None]:
    """(prompt bound in the policy's tokens, the model that sets it) for models reading the policy's
    tokens; (max_prompt_length, None) when no such model is tighter. Raises ConfigError when
    `response_length` leaves no room for a prompt."""
    same = [lim for lim in limits if lim.tokenizer is None]
    if not same:
        return max_prompt_length, None
    tight = min(same, key=lambda lim: lim.limit)
    budget = tight.limit - response_length
    if budget < 1:
        raise ConfigError(
            f"response_length={response_length} leaves no room for a prompt in the {tight.name}, which reads at "
            f"most {tight.limit} positions (prompt + completion). Fix: lower --response_length below {tight.limit}."
        )
    if max_prompt_length is not None and max_prompt_length <= budget:
        return max_prompt_length, None
    return budget, tight


def check_fits(
    lengths: Sequence[int],
    limit: PositionLimit,
    *,
    response_length: int,
    max_prompt_length: int | None,
    overflow: str,
    source: str,
) -> None:
    """Before preparing with the model's bound (`limit.limit − response_length`): refuse when the
    user's own max_prompt_length does not fit, or when prompt_overflow="drop" would drop every
    prompt; otherwise warn how many prompts the overflow policy touches."""
    budget = limit.limit - response_length
    longest = max(lengths, default=0)
    over = sum(n > budget for n in lengths)
    if not over:
        return
    shown = longest if max_prompt_length is None else min(longest, max_prompt_length)
    if max_prompt_length is not None or (overflow == "drop" and over == len(lengths)):
        raise ConfigError(
            f"{source}: prompts of up to {shown} tokens"
            + (f" (max_prompt_length={max_prompt_length})" if max_prompt_length is not None else "")
            + f" + response_length={response_length} = {shown + response_length} positions do not fit the "
            f"{limit.name}, which reads at most {limit.limit}. {_fix(budget)}"
        )
    action = "dropped" if overflow == "drop" else "truncated from the left"
    warnings.warn(
        f"{source}: {over} of {len(lengths)} prompts are longer than {budget} tokens, the room the {limit.name} "
        f"(at most {limit.limit} positions) leaves with response_length={response_length}; they are {action} "
        f"(prompt_overflow={overflow!r}). Set --max_prompt_length to choose the bound yourself.",
        stacklevel=5,
    )


def check_other_tokenizers(
    prompts: Sequence[str],
    policy_lengths: Sequence[int],
    limits: Sequence[PositionLimit],
    *,
    response_length: int,
    source: str,
) -> None:
    """Reward models with their own tokenizer: the prompts, re-tokenized as scoring does, plus
    response_length must fit; else ConfigError with a --max_prompt_length estimated from the ratio
    of the two tokenizers' counts on the longest re-tokenized prompt."""
    for lim in limits:
        if lim.tokenizer is None or not prompts:
            continue
        counts = [len(ids) for ids in lim.tokenizer(list(prompts), add_special_tokens=True)["input_ids"]]
        worst = max(range(len(counts)), key=counts.__getitem__)
        if counts[worst] + response_length <= lim.limit:
            continue
        room = lim.limit - response_length
        if room < 1:
            raise ConfigError(
                f"response_length={response_length} leaves no room for a prompt in the {lim.name}, which reads at "
                f"most {lim.limit} positions. Fix: lower --response_length below {lim.limit}."
            )
        suggested = max(1, room * policy_lengths[worst] // counts[worst])
        raise ConfigError(
            f"{source}: prompts re-tokenized for the {lim.name} reach {counts[worst]} tokens + "
            f"response_length={response_length} = {counts[worst] + response_length} positions, more than the "
            f"{lim.limit} it reads. {_fix(suggested)}"
        )


def check_sequence_lengths(dataset: Any, model: Any, *, max_length: int | None, source: str) -> None:
    """SFT and reward training: every prepared sequence (`input_ids`, or each side of a pair) must
    fit `model`'s positions; else ConfigError naming the model, its limit, the longest sequence and
    the fix (`--max_length` at most the limit)."""
    limit = position_limit(model)
    if limit is None or dataset is None or not hasattr(dataset, "column_names"):
        return
    columns = [c for c in ("input_ids", "chosen_input_ids", "rejected_input_ids") if c in dataset.column_names]
    longest = max((len(ids) for c in columns for ids in dataset[c]), default=0)
    if longest > limit:
        raise ConfigError(
            f"{source}: sequences of up to {longest} tokens (max_length={max_length}) do not fit the "
            f"{model_name('model', model)}, which reads at most {limit} positions. Fix: pass --max_length {limit} "
            "(max_length= in Python) or less."
        )
