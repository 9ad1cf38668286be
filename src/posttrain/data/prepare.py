"""Preparation: datasets in, token ids out, for each kind of trainer.

- `prepare_prompt_dataset`: prompts for generation (online RL) -> `input_ids` + rendered `prompt`.
- `prepare_preference_dataset`: preference pairs (reward models) -> `chosen_input_ids` / `rejected_input_ids`.
- `prepare_sft_dataset`: text, conversations or prompt-completion pairs (SFT) -> `input_ids` + `labels`,
  optionally packed (`packing.py`).

Every bad row raises `DataError` naming the source, row and field. Rows that do not fit are
truncated or dropped as asked, and how many is logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from posttrain.data.formats import _assistant_spans, detect_format, render_chat
from posttrain.data.loading import (
    DataError,
    _as_text_or_messages,
    _check_number,
    _check_token_ids,
    _require_columns,
    _require_rows,
    _source_of,
)
from posttrain.data.packing import PACKING_STRATEGIES, pack_sft_rows

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
# The conversational prompt as the dataset gave it (a list of messages), kept by prepare_prompt_dataset
# next to the rendered `prompt`: TRL 1.x passes it to reward functions as `prompts`.
PROMPT_MESSAGES = "prompt_messages"


# --------------------------------------------------------------------------------------------
# Tokenization helpers
# --------------------------------------------------------------------------------------------


def _as_prompt_ids(value: Any, tokenizer: PreTrainedTokenizerBase, source: str, row: int, noted: set[str]) -> Any:
    """A pre-tokenized prompt row, read as TRL's on-policy trainers take it: a single token id (what
    `Dataset.from_dict({"input_ids": ids})` makes of one tokenized prompt) is a one-token prompt; a
    tokenizer's output (`{"input_ids": [...], "attention_mask": [...]}`, which `apply_chat_template`
    returns in transformers 5) gives its input_ids; text is tokenized as a prompt. Each reading is
    logged once per dataset; anything else is left to _check_token_ids to refuse."""
    kind = None
    if isinstance(value, int) and not isinstance(value, bool):
        kind, value = "a single token id, read as a one-token prompt", [value]
    elif isinstance(value, dict) and "input_ids" in value:
        kind, value = "a tokenizer output, whose input_ids are the prompt", value["input_ids"]
    elif isinstance(value, str):
        kind, value = "text, tokenized as the prompt", _encode(tokenizer, [value], [False])[0]
    if kind is not None and kind not in noted:
        noted.add(kind)
        logger.warning(
            "%s, row %d, field 'input_ids': holds %s (store lists of token ids to avoid this)", source, row + 1, kind
        )
    return value


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str], conversational: list[bool]) -> list[list[int]]:
    """Token ids per text. Templated text already holds its special tokens (BOS included), so only
    plain text gets the tokenizer's special tokens; a trailing EOS added by the tokenizer is
    removed, since it would end a prompt before anything is generated."""
    ids: list[list[int]] = [[] for _ in texts]
    for templated in (True, False):
        idx = [i for i, c in enumerate(conversational) if c == templated]
        if not idx:
            continue
        batch = tokenizer([texts[i] for i in idx], add_special_tokens=not templated)["input_ids"]
        for i, seq in zip(idx, batch):
            ids[i] = list(seq)
    eos, eos_text = tokenizer.eos_token_id, tokenizer.eos_token
    for i, seq in enumerate(ids):
        if (
            not conversational[i]
            and eos is not None
            and seq
            and seq[-1] == eos
            and not texts[i].endswith(eos_text or "\0")
        ):
            ids[i] = seq[:-1]
    return ids


def _trainable_tokens(
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    spans: list[tuple[int, int]],
    *,
    add_special_tokens: bool,
) -> tuple[list[int], list[bool]]:
    """Tokenize `text`; a token is trainable when it starts inside one of the character `spans`.

    Fast tokenizers give character offsets directly; for others the token index of each span
    boundary is found by tokenizing the text up to it.
    """
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        ids, mask, prev_end = list(enc["input_ids"]), [], 0
        for start, end in enc["offset_mapping"]:
            if start == end:
                # Added by the tokenizer (BOS / EOS, zero width): it belongs to the span it closes.
                mask.append(any(a < prev_end <= b for a, b in spans))
            else:
                mask.append(any(a <= start < b for a, b in spans))
                prev_end = end
        return ids, mask
    ids = list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    mask = [False] * len(ids)
    for a, b in spans:
        first = len(tokenizer(text[:a], add_special_tokens=add_special_tokens)["input_ids"])
        last = len(tokenizer(text[:b], add_special_tokens=add_special_tokens)["input_ids"])
        for k in range(first, min(last, len(ids))):
            mask[k] = True
    return ids, mask


def _overflow_note(count: int, total: int, what: str) -> None:
    if count:
        logger.warning("%d of %d %s", count, total, what)


def _resolve_overflow(out: Any, total: int, drop: bool, what: str, kept: str, empty: DataError) -> Any:
    """Drop (or keep, already cut) the rows flagged in the `__overlong` column, print how many, and
    raise `empty` if dropping left nothing; returns the dataset without the flag column."""
    n_over = sum(out["__overlong"])
    if n_over and drop:
        out = out.filter(lambda flags: [not f for f in flags], input_columns="__overlong", batched=True)
        _overflow_note(n_over, total, f"{what} and were dropped")
        if len(out) == 0:
            raise empty
    else:
        _overflow_note(n_over, total, f"{what} and were {kept}")
    return out.remove_columns("__overlong")


# --------------------------------------------------------------------------------------------
# Prompt datasets (online RL)
# --------------------------------------------------------------------------------------------


def _prompt_column(dataset: Dataset, prompt_column: str | None, source: str) -> tuple[str, bool]:
    """(column the prompts are read from, whether they are pre-tokenized `input_ids`) of a prompt
    dataset, refusing one without rows or without a prompt column (see prepare_prompt_dataset)."""
    _require_rows(dataset, source)
    return _prompt_column_of(dataset.column_names, prompt_column, source)


def _prompt_column_of(columns: list[str], prompt_column: str | None, source: str) -> tuple[str, bool]:
    """_prompt_column from the column names alone (a stream's, known from its first row)."""
    if prompt_column is None:
        fallback = "query" in columns and "prompt" not in columns and "input_ids" not in columns
        prompt_column = "query" if fallback else "prompt"
    tokenized = prompt_column not in columns and "input_ids" in columns
    if not tokenized:
        _require_columns(columns, [prompt_column], source, "prompts")
    return prompt_column, tokenized


def check_prompt_columns(dataset: Any, source: str | None = None) -> None:
    """prepare_prompt_dataset's cheap checks (rows present, a `prompt` / `query` / `input_ids` column)
    on a `datasets.Dataset`, or on the first row of a streaming `datasets.IterableDataset`, so a wrong
    prompt dataset is refused before any model loads; other dataset types (dicts of eval sets) are
    checked when they are prepared."""
    from datasets import Dataset, IterableDataset

    if isinstance(dataset, Dataset):
        _prompt_column(dataset, None, _source_of(dataset, source))
    elif isinstance(dataset, IterableDataset):
        _stream_columns(dataset, None, source or "dataset")


def _stream_columns(dataset: Any, prompt_column: str | None, source: str) -> tuple[dict, str, bool]:
    """(first row, prompt column, pre-tokenized) of a streaming prompt dataset (see _prompt_column)."""
    first = next(iter(dataset), None)
    if first is None:
        raise DataError("the streaming dataset yields no rows", source=source, fix="check the files / split / filters")
    prompt_column, tokenized = _prompt_column_of(list(dataset.column_names or first), prompt_column, source)
    return first, prompt_column, tokenized


def _prompt_encoder(
    tokenizer: PreTrainedTokenizerBase,
    prompt_column: str,
    tokenized: bool,
    keep_messages: bool,
    max_prompt_length: int | None,
    overflow: str,
    source: str,
    chat_template_kwargs: dict[str, Any] | None,
) -> Any:
    """The batched `map` function of prepare_prompt_dataset (map-style or streaming): (batch, row
    indices) -> input_ids, rendered prompt, the `__overlong` flag (and the messages of a
    conversational prompt), refusing a bad row by its index."""
    vocab_size = len(tokenizer)
    noted: set[str] = set()

    def encode(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        if tokenized:
            ids = [
                _check_token_ids(
                    _as_prompt_ids(seq, tokenizer, source, row, noted), source, row, "input_ids", vocab_size
                )
                for seq, row in zip(batch["input_ids"], indices)
            ]
            texts = tokenizer.batch_decode(ids, skip_special_tokens=False)
        else:
            values = [
                _as_text_or_messages(v, source, row, prompt_column) for v, row in zip(batch[prompt_column], indices)
            ]
            conversational = [isinstance(v, list) for v in values]
            texts = [
                render_chat(v, tokenizer, add_generation_prompt=True, **(chat_template_kwargs or {})) if c else v
                for v, c in zip(values, conversational)
            ]
            ids = _encode(tokenizer, texts, conversational)
            for seq, row in zip(ids, indices):
                if not seq:
                    raise DataError(
                        "tokenizes to no tokens",
                        source=source,
                        row=row,
                        field=prompt_column,
                        fix="remove the row or fill the prompt",
                    )
        overlong = [max_prompt_length is not None and len(seq) > max_prompt_length for seq in ids]
        if overflow == "truncate_left" and any(overlong):
            for k, long in enumerate(overlong):
                if long:
                    ids[k] = ids[k][-max_prompt_length:]
                    texts[k] = tokenizer.decode(ids[k], skip_special_tokens=False)
        out = {"input_ids": ids, "prompt": texts, "__overlong": overlong}
        if keep_messages:
            out[PROMPT_MESSAGES] = [v if c else None for v, c in zip(values, conversational)]
        return out

    return encode


def prepare_prompt_dataset(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_prompt_length: int | None = None,
    overflow: str = "truncate_left",
    prompt_column: str | None = None,
    source: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> Dataset:
    """Tokenize prompts for generation: adds `input_ids` and sets `prompt` to the text after the
    chat template; other columns are kept (reward functions receive them). A conversational
    dataset also keeps each prompt's messages in `prompt_messages` (PROMPT_MESSAGES; None for a
    plain-text row), which reward functions get as `prompts` in TRL 1.x's form.

    The prompts are read from `prompt_column`; None reads `prompt`, or `query` (the name of
    DeepSpeed-Chat-style and older TRL data) when the dataset has neither `prompt` nor `input_ids`.

    Conversational prompts get the chat template with the generation prompt (and the keyword
    arguments `chat_template_kwargs`, e.g. {"enable_thinking": False}). A dataset with only
    `input_ids` (pre-tokenized, as TRL's PPO takes) is validated and decoded into `prompt`.
    Prompts longer than `max_prompt_length` are cut from the left ("truncate_left", keeping the end
    of the prompt, which the completion continues) or removed ("drop"); the count is logged.

    A streaming `datasets.IterableDataset` (load_dataset(..., streaming=True)) is prepared lazily: its
    first row is read here to find the prompt column and whether prompts are conversations, and the
    same tokenization and per-row checks run as rows are read (a bad row is refused when it is
    reached, by its place in the stream; overlong prompts are cut or skipped as they come).
    """
    from datasets import IterableDataset

    if overflow not in ("truncate_left", "drop"):
        raise ValueError(f"overflow must be 'truncate_left' or 'drop', got {overflow!r}")
    streaming = isinstance(dataset, IterableDataset)
    if streaming:
        source = source or "dataset"
        first, prompt_column, tokenized = _stream_columns(dataset, prompt_column, source)
        columns = list(dataset.column_names or first)
    else:
        source = _source_of(dataset, source)
        prompt_column, tokenized = _prompt_column(dataset, prompt_column, source)
        columns = dataset.column_names
        first = dataset[0] if len(dataset) > 0 else None
    keep_messages = not tokenized and first is not None and isinstance(first[prompt_column], list)
    # A stored mask would go stale after truncation; the collator builds it from lengths.
    if "attention_mask" in columns:
        dataset = dataset.remove_columns("attention_mask")
    encode = _prompt_encoder(
        tokenizer, prompt_column, tokenized, keep_messages, max_prompt_length, overflow, source, chat_template_kwargs
    )
    if streaming:
        out = dataset.map(encode, batched=True, with_indices=True)
        if overflow == "drop" and max_prompt_length is not None:
            out = out.filter(lambda flags: [not f for f in flags], input_columns="__overlong", batched=True)
        unused = [prompt_column] if prompt_column != "prompt" and prompt_column in columns else []
        return out.remove_columns(["__overlong", *unused])
    out = dataset.map(encode, batched=True, with_indices=True, desc="Tokenizing prompts")
    out = _resolve_overflow(
        out,
        len(dataset),
        overflow == "drop",
        f"prompts are longer than {max_prompt_length} tokens",
        "truncated from the left",
        DataError(
            f"every prompt is longer than max_prompt_length={max_prompt_length}",
            source=source,
            field=prompt_column,
            fix="raise max_prompt_length or use overflow='truncate_left'",
        ),
    )
    if prompt_column != "prompt" and prompt_column in out.column_names:
        out = out.remove_columns(prompt_column)
    return out


# --------------------------------------------------------------------------------------------
# Preference datasets (reward models)
# --------------------------------------------------------------------------------------------


def _append_eos(ids: list[int], eos_id: int | None) -> list[int]:
    return ids + [eos_id] if eos_id is not None and (not ids or ids[-1] != eos_id) else ids


def prepare_preference_dataset(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int | None,
    overflow: str = "drop",
    *,
    prompt_column: str | None = None,
    source: str | None = None,
) -> Dataset:
    """Tokenize preference pairs for reward modelling → `chosen_input_ids`, `rejected_input_ids`
    (+ `margin` when the dataset has one).

    An explicit prompt is prepended to both answers. It is read from `prompt_column`, or, when that
    is None, from `prompt` or `query` (`{"query", "chosen", "rejected"}` is the DeepSpeed-Chat
    layout of reward data); a dataset with both is refused rather than one being silently
    dropped. Without either the prompt is implicit (inside chosen and rejected). Conversations are
    rendered with the chat template (which closes the assistant turn itself); standard text gets
    EOS appended when it does not end with one, so the score is read on EOS as at inference. Pre-tokenized
    `chosen_input_ids`/`rejected_input_ids` (or `chosen_ids`/`rejected_ids`) pass through.
    Pairs where either side exceeds `max_length` are dropped ("drop", like TRL) or cut to their
    first `max_length` tokens ("truncate"); pairs whose two sides tokenize identically (ties) are
    dropped; both counts are logged, and a dataset of ties only is refused.
    """
    if overflow not in ("drop", "truncate"):
        raise ValueError(f"overflow must be 'drop' or 'truncate', got {overflow!r}")
    source = _source_of(dataset, source)
    _require_rows(dataset, source)
    columns = dataset.column_names
    pretokenized = next(
        (
            (c, r)
            for c, r in (("chosen_input_ids", "rejected_input_ids"), ("chosen_ids", "rejected_ids"))
            if c in columns and r in columns
        ),
        None,
    )
    if pretokenized is None:
        _require_columns(dataset.column_names, ["chosen", "rejected"], source, "preference pairs")
    prompt_field = None if pretokenized is not None else _preference_prompt_column(columns, prompt_column, source)
    has_prompt = prompt_field is not None
    has_margin = "margin" in columns
    eos_id = tokenizer.eos_token_id

    def encode(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"chosen_input_ids": [], "rejected_input_ids": []}
        if pretokenized is not None:
            for key, field in zip(("chosen_input_ids", "rejected_input_ids"), pretokenized):
                out[key] = [
                    _check_token_ids(s, source, r, field, len(tokenizer)) for s, r in zip(batch[field], indices)
                ]
        else:
            for row_in_batch, row in enumerate(indices):
                prompt = (
                    _as_text_or_messages(batch[prompt_field][row_in_batch], source, row, prompt_field)
                    if has_prompt
                    else None
                )
                for key, field in (("chosen_input_ids", "chosen"), ("rejected_input_ids", "rejected")):
                    answer = _as_text_or_messages(batch[field][row_in_batch], source, row, field)
                    if prompt is not None and isinstance(prompt, list) != isinstance(answer, list):
                        raise DataError(
                            f"mixes a conversational and a plain-text field with '{prompt_field}'",
                            source=source,
                            row=row,
                            field=field,
                            fix=f"make {prompt_field}, chosen and rejected all strings or all conversations",
                        )
                    if isinstance(answer, list):
                        text = render_chat((prompt or []) + answer, tokenizer)
                        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
                    else:
                        ids = _append_eos(list(tokenizer((prompt or "") + answer)["input_ids"]), eos_id)
                    out[key].append(ids)
        if has_margin:
            out["margin"] = [_check_number(m, source, r, "margin") for m, r in zip(batch["margin"], indices)]
        out["__overlong"] = [
            max_length is not None and max(len(c), len(r)) > max_length
            for c, r in zip(out["chosen_input_ids"], out["rejected_input_ids"])
        ]
        out["__tie"] = [c == r for c, r in zip(out["chosen_input_ids"], out["rejected_input_ids"])]
        if overflow == "truncate" and max_length is not None:
            out["chosen_input_ids"] = [s[:max_length] for s in out["chosen_input_ids"]]
            out["rejected_input_ids"] = [s[:max_length] for s in out["rejected_input_ids"]]
        return out

    out = dataset.map(encode, batched=True, with_indices=True, remove_columns=columns, desc="Tokenizing pairs")
    out = _drop_ties(out, len(dataset), source)
    return _resolve_overflow(
        out,
        len(dataset),
        overflow == "drop",
        f"preference pairs are longer than {max_length} tokens",
        "truncated",
        DataError(
            f"every pair is longer than max_length={max_length}",
            source=source,
            fix="raise max_length or use overflow='truncate'",
        ),
    )


def _preference_prompt_column(columns: list[str], prompt_column: str | None, source: str) -> str | None:
    """The column holding the explicit prompt of preference pairs, or None for an implicit prompt."""
    if prompt_column is not None:
        if prompt_column not in columns:
            raise DataError(
                f"prompt_column={prompt_column!r} is not a column; available columns: {columns}",
                source=source,
                field=prompt_column,
                fix="pass the name of the column holding the prompts, or leave prompt_column unset",
            )
        return prompt_column
    found = [c for c in ("prompt", "query") if c in columns]
    if len(found) == 2:
        raise DataError(
            "has both a 'prompt' and a 'query' column; either could be the prompt of the pairs",
            source=source,
            field="query",
            fix="pass prompt_column (--prompt_column prompt or query), or remove the other column",
        )
    return found[0] if found else None


def _drop_ties(out: Any, total: int, source: str) -> Any:
    """Drop the pairs flagged `__tie` (chosen == rejected token for token) and say how many.

    A tie carries no preference: the Bradley-Terry loss of an identical pair is log 2 whatever the
    model does, so it only dilutes the batch, and it counts as a miss in the accuracy (the margin is
    exactly 0). A dataset made only of ties is refused.
    """
    n_ties = sum(out["__tie"])
    if n_ties:
        if n_ties == total:
            raise DataError(
                f"every pair ({total}) has chosen == rejected, so there is no preference to learn",
                source=source,
                field="rejected",
                fix="check that the chosen and rejected columns are not the same column",
            )
        out = out.filter(lambda flags: [not f for f in flags], input_columns="__tie", batched=True)
        _overflow_note(n_ties, total, "preference pairs have chosen == rejected (ties) and were dropped")
    return out.remove_columns("__tie")


# --------------------------------------------------------------------------------------------
# SFT datasets
# --------------------------------------------------------------------------------------------


def prepare_sft_dataset(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int | None,
    *,
    dataset_text_field: str = "text",
    completion_only_loss: bool | None = None,
    assistant_only_loss: bool = False,
    truncation: str = "keep_start",
    packing: bool = False,
    packing_strategy: str = "bfd",
    source: str | None = None,
) -> Dataset:
    """Tokenize SFT data → `input_ids` and `labels` (aligned with `input_ids`; -100 = no loss).

    - text: loss on every token; EOS appended when missing.
    - prompt_completion: loss on the completion only unless `completion_only_loss=False`; EOS is
      appended to plain-text completions; conversations are rendered with the chat template.
    - messages: loss on every token, or with `assistant_only_loss` on assistant turns only. Assistant
      spans are found by rendering the conversation prefix by prefix (any template works).
    Rows longer than `max_length` keep their start ("keep_start") or end ("keep_end"); rows left
    without any trained token are dropped; both counts are logged.

    With `packing`, rows become rows of at most `max_length` tokens holding several examples:
    - "bfd" (TRL's default): overlong examples are truncated as above, then whole examples are
      placed by best-fit decreasing (`best_fit_decreasing`). Each packed row also gets
      `position_ids` restarting at 0 for every example and `seq_lengths` (the examples' lengths),
      from which the SFT collator and forward keep examples from attending to each other.
    - "bfd_split": like "bfd", but overlong examples are cut into `max_length` pieces (each piece
      its own sequence) instead of truncated, so no token is thrown away.
    - "wrapped": rows are concatenated (in batches of 1000) and cut into `max_length` blocks; no
      `position_ids`, so attention crosses example boundaries within a block (each example ends
      with EOS), the classic pre-training packing.
    """
    if truncation not in ("keep_start", "keep_end"):
        raise ValueError(f"truncation must be 'keep_start' or 'keep_end', got {truncation!r}")
    if packing_strategy not in PACKING_STRATEGIES:
        raise ValueError(f"packing_strategy must be one of {PACKING_STRATEGIES}, got {packing_strategy!r}")
    if packing and not max_length:
        raise ValueError("packing needs max_length (the block size)")
    source = _source_of(dataset, source)
    _require_rows(dataset, source)
    fmt = _sft_format(dataset, dataset_text_field, assistant_only_loss, source)
    rows = _SFTRows(
        tokenizer,
        source,
        dataset_text_field,
        completion_only_loss=fmt == "prompt_completion" if completion_only_loss is None else completion_only_loss,
        assistant_only_loss=assistant_only_loss,
    )
    # Only "wrapped" and "bfd_split" keep every token of an overlong row.
    cut = max_length if not packing or packing_strategy == "bfd" else None
    out = dataset.map(
        rows.encode_batch,
        fn_kwargs={"fmt": fmt, "max_length": cut, "truncation": truncation},
        batched=True,
        with_indices=True,
        remove_columns=dataset.column_names,
        desc="Tokenizing SFT data",
    )
    _overflow_note(
        sum(out["__truncated"]),
        len(dataset),
        f"rows are longer than {max_length} tokens and were truncated ({truncation})",
    )
    out = _drop_untrained_rows(out, len(dataset), source)
    return pack_sft_rows(out, max_length, packing_strategy) if packing else out


def _sft_format(dataset: Any, dataset_text_field: str, assistant_only_loss: bool, source: str) -> str:
    """The SFT format of the dataset ("text", "messages" or "prompt_completion"), or a DataError."""
    fmt = detect_format(dataset, dataset_text_field)
    if fmt not in ("text", "messages", "prompt_completion"):
        raise DataError(
            f"SFT needs '{dataset_text_field}', 'messages' or 'prompt'+'completion' columns; "
            f"available columns: {dataset.column_names}",
            source=source,
            fix="rename the text column or pass dataset_text_field",
        )
    if assistant_only_loss and fmt == "text":
        raise DataError(
            "assistant_only_loss needs conversational data ('messages' or conversational prompt/completion)",
            source=source,
            field=dataset_text_field,
            fix="convert the data to conversations or turn the option off",
        )
    return fmt


def _drop_untrained_rows(out: Any, total: int, source: str) -> Any:
    """Drop rows flagged `__empty` (no token to train on), say how many; remove the flag columns."""
    n_empty = sum(out["__empty"])
    if n_empty:
        out = out.filter(lambda flags: [not f for f in flags], input_columns="__empty", batched=True)
        _overflow_note(n_empty, total, "rows have no token to train on (after truncation) and were dropped")
        if len(out) == 0:
            raise DataError(
                "no row has a token to train on",
                source=source,
                fix="check completion_only_loss / assistant_only_loss and max_length",
            )
    return out.remove_columns(["__truncated", "__empty"])


@dataclass
class _SFTRows:
    """Turns one SFT row of each format into (token ids, trained-token mask)."""

    tokenizer: PreTrainedTokenizerBase
    source: str
    dataset_text_field: str
    completion_only_loss: bool
    assistant_only_loss: bool

    def encode_batch(
        self, batch: dict[str, list], indices: list[int], fmt: str, max_length: int | None, truncation: str
    ) -> dict[str, list]:
        """A map batch → `input_ids`, `labels` (cut to `max_length` if given) and the flags
        `__truncated`, `__empty` (no trained token left)."""
        out: dict[str, list] = {"input_ids": [], "labels": [], "__truncated": [], "__empty": []}
        for k, row in enumerate(indices):
            if fmt == "text":
                ids, mask = self.text(batch[self.dataset_text_field][k], row)
            elif fmt == "messages":
                ids, mask = self.messages(batch["messages"][k], row)
            else:
                ids, mask = self.prompt_completion(batch["prompt"][k], batch["completion"][k], row)
            truncated = max_length is not None and len(ids) > max_length
            if truncated:
                keep = slice(None, max_length) if truncation == "keep_start" else slice(-max_length, None)
                ids, mask = ids[keep], mask[keep]
            out["input_ids"].append(ids)
            out["labels"].append([t if m else IGNORE_INDEX for t, m in zip(ids, mask)])
            out["__truncated"].append(truncated)
            out["__empty"].append(not any(mask))
        return out

    def text(self, value: Any, row: int) -> tuple[list[int], list[bool]]:
        """Plain text: every token trained, EOS appended when missing."""
        field = self.dataset_text_field
        if not isinstance(value, str):
            raise DataError(
                f"has type {type(value).__name__}, expected a string",
                source=self.source,
                row=row,
                field=field,
                fix="store plain text in this column (or use 'messages' for conversations)",
            )
        _as_text_or_messages(value, self.source, row, field)
        ids = _append_eos(list(self.tokenizer(value)["input_ids"]), self.tokenizer.eos_token_id)
        return ids, [True] * len(ids)

    def messages(self, value: Any, row: int) -> tuple[list[int], list[bool]]:
        """A conversation: every token trained, or the assistant turns only."""
        value = _as_text_or_messages(value, self.source, row, "messages")
        if not isinstance(value, list):
            raise DataError(
                "is a string; expected a list of {role, content} messages",
                source=self.source,
                row=row,
                field="messages",
                fix="store the conversation as a list of messages (or use a 'text' column)",
            )
        text = render_chat(value, self.tokenizer)
        if self.assistant_only_loss:
            spans = _assistant_spans(value, self.tokenizer, text, self.source, row, "messages")
            if not spans:
                raise DataError(
                    "has no assistant message to train on",
                    source=self.source,
                    row=row,
                    field="messages",
                    fix="add an assistant turn or turn assistant_only_loss off",
                )
        else:
            spans = [(0, len(text))]
        return _trainable_tokens(self.tokenizer, text, spans, add_special_tokens=False)

    def prompt_completion(self, prompt: Any, completion: Any, row: int) -> tuple[list[int], list[bool]]:
        """A prompt and its completion, both strings or both conversations."""
        prompt = _as_text_or_messages(prompt, self.source, row, "prompt")
        completion = _as_text_or_messages(completion, self.source, row, "completion")
        if isinstance(prompt, list) != isinstance(completion, list):
            raise DataError(
                "one of prompt / completion is a conversation and the other a string",
                source=self.source,
                row=row,
                field="completion",
                fix="make both strings or both conversations",
            )
        if isinstance(prompt, str):
            return self._plain_prompt_completion(prompt, completion)
        return self._chat_prompt_completion(prompt, completion, row)

    def _plain_prompt_completion(self, prompt: str, completion: str) -> tuple[list[int], list[bool]]:
        # Prompt and completion are tokenized separately (as TRL does, and as the policy sees them
        # at generation time), so a BPE merge across the boundary (a trailing space in the prompt
        # joining the completion's first word) can never hide completion tokens from the loss.
        (prompt_ids,) = _encode(self.tokenizer, [prompt], [False])
        completion_ids = self.tokenizer(completion, add_special_tokens=False)["input_ids"]
        ids = list(prompt_ids) + list(completion_ids)
        mask = [not self.completion_only_loss] * len(prompt_ids) + [True] * len(completion_ids)
        eos_id = self.tokenizer.eos_token_id
        if eos_id is not None and (not ids or ids[-1] != eos_id):
            ids, mask = ids + [eos_id], mask + [True]
        return ids, mask

    def _chat_prompt_completion(self, prompt: list, completion: list, row: int) -> tuple[list[int], list[bool]]:
        conversation = prompt + completion
        text = render_chat(conversation, self.tokenizer)
        if self.assistant_only_loss:
            start_turn = len(prompt) if self.completion_only_loss else 0
            spans = _assistant_spans(
                conversation, self.tokenizer, text, self.source, row, "completion", start_turn=start_turn
            )
        elif self.completion_only_loss:
            start = render_chat(prompt, self.tokenizer, add_generation_prompt=True)
            if not text.startswith(start):
                start = render_chat(prompt, self.tokenizer)
            if not text.startswith(start):
                raise DataError(
                    "the chat template renders the prompt differently inside the full conversation, so the "
                    "completion tokens cannot be located",
                    source=self.source,
                    row=row,
                    field="completion",
                    fix="use a template whose prompt rendering is a prefix of the full rendering",
                )
            spans = [(len(start), len(text))]
        else:
            spans = [(0, len(text))]
        return _trainable_tokens(self.tokenizer, text, spans, add_special_tokens=False)
