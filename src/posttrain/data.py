"""Datasets in, token ids out: loading, format detection, chat templates, validation, collation.

Formats (TRL's, see docs: dataset formats):
- "prompt": `prompt` = string, or conversation (list of {"role", "content"}) → online RL trainers.
- "preference": `chosen` / `rejected` (+ optional explicit `prompt`, optional `margin`) → reward models.
- "text": `text` (or a custom `dataset_text_field`) → SFT.
- "messages": a conversation in `messages` → SFT.
- "prompt_completion": `prompt` + `completion` → SFT (loss on the completion by default).
- "tokenized": already tokenized prompts in `input_ids` (what TRL's PPO takes).

Every bad row raises `DataError` naming the source, row and field and saying how to fix it,
because datasets' own errors (arrow casts, JSON parser) rarely say which line is wrong.

`datasets`, `transformers` and `torch` are imported inside functions so `import posttrain` stays light.
"""

from __future__ import annotations

import bisect
import heapq
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100

# TRL's SIMPLE_CHAT_TEMPLATE, for tokenizers without a template (base models): "Role: content"
# blocks and an "Assistant:" generation prompt.
SIMPLE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'].capitalize() + ': ' + message['content'] + '\n\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

FORMATS = ("prompt", "preference", "text", "messages", "prompt_completion", "tokenized")
_CONVERSATIONAL_KEYS = ("prompt", "chosen", "rejected", "completion", "messages")
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_SOURCE_MARK = "posttrain source: "
PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")


class DataError(ValueError):
    """A dataset problem, reported with where it is (source, line or row, field) and how to fix it."""

    def __init__(
        self,
        problem: str,
        *,
        source: str | os.PathLike | None = None,
        row: int | None = None,
        line: int | None = None,
        field: str | None = None,
        fix: str | None = None,
    ):
        self.problem, self.source, self.row, self.line, self.field, self.fix = (
            problem,
            None if source is None else str(source),
            row,
            line,
            field,
            fix,
        )
        where = [str(source) if source is not None else "dataset"]
        if line is not None:
            where.append(f"line {line}")
        if row is not None:
            where.append(f"row {row}")
        if field is not None:
            where.append(f"field '{field}'")
        message = f"{', '.join(where)}: {problem}"
        if fix:
            message += f". Fix: {fix}"
        super().__init__(message)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _kind(value: Any) -> str | None:
    """JSON kind of a value, for the per-field consistency check (None: null, fits any kind)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    return "object"


class _RecordChecker:
    """Checks that each record is an object whose fields keep one JSON kind across the file.

    Arrow needs one type per column; a field that is a string on one line and a list on another
    otherwise fails deep inside datasets with a cast error that names no line.
    """

    def __init__(self, source: Path):
        self.source = source
        self.kinds: dict[str, tuple[str, int]] = {}
        self.count = 0

    def check(self, record: Any, *, line: int | None = None, row: int | None = None) -> None:
        if not isinstance(record, dict):
            raise DataError(
                f"expected a JSON object, got {_kind(record)}",
                source=self.source,
                line=line,
                row=row,
                fix='write one object per record, e.g. {"prompt": "..."}',
            )
        for key, value in record.items():
            kind = _kind(value)
            if kind is None:
                continue
            seen = self.kinds.setdefault(key, (kind, line if line is not None else row))
            if seen[0] != kind:
                raise DataError(
                    f"is a {kind} here but a {seen[0]} at {'line' if line is not None else 'row'} {seen[1]}",
                    source=self.source,
                    line=line,
                    row=row,
                    field=key,
                    fix="give the field the same type in every record",
                )
        self.count += 1


def _decode_utf8(raw: bytes, source: Path, line: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            f"invalid UTF-8 (byte {err.start} of the line)",
            source=source,
            line=line,
            fix="re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 in > out`",
        ) from None


def _validate_json_lines(path: Path) -> None:
    checker = _RecordChecker(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            text = _decode_utf8(raw, path, lineno)
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"malformed JSON ({err.msg} at column {err.colno})",
                    source=path,
                    line=lineno,
                    fix="each line must be one complete JSON object; check quotes, commas and brackets",
                ) from None
            checker.check(record, line=lineno)
    if checker.count == 0:
        raise DataError("the file has no records", source=path, fix="add one JSON object per line")


def _validate_json(path: Path) -> None:
    raw = path.read_bytes()
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        _decode_utf8(line, path, lineno)
    try:
        document = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError:
        # Many ".json" files are JSON lines; validate them line by line for a precise location.
        _validate_json_lines(path)
        return
    if isinstance(document, list):
        checker = _RecordChecker(path)
        for row, record in enumerate(document):
            checker.check(record, row=row)
        if checker.count == 0:
            raise DataError("the file holds an empty list", source=path, fix="add at least one record")


def _validate_csv(path: Path) -> None:
    lines = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            lines += bool(_decode_utf8(raw, path, lineno).strip())
    if lines < 2:
        raise DataError("the file has no records", source=path, fix="add a header line and one line per record")


def _mark_source(dataset: Any, source: str) -> Any:
    from datasets import DatasetDict

    parts = dataset.values() if isinstance(dataset, DatasetDict) else [dataset]
    for part in parts:
        part.info.description = f"{_SOURCE_MARK}{source}"
    return dataset


def _source_of(dataset: Any, source: str | None) -> str:
    """Name used in error messages: the caller's name and/or the file recorded by `load_any_dataset`."""
    description = getattr(getattr(dataset, "info", None), "description", None) or ""
    loaded_from = description[len(_SOURCE_MARK) :] if description.startswith(_SOURCE_MARK) else None
    if source is not None and loaded_from is not None and loaded_from != source:
        return f"{source} ({loaded_from})"
    return source or loaded_from or "dataset"


def _select_split(dataset: Any, split: str | None, source: str) -> Any:
    from datasets import DatasetDict

    if split is None or not isinstance(dataset, DatasetDict):
        return dataset
    if split not in dataset:
        raise DataError(
            f"no split {split!r}; available splits: {', '.join(dataset.keys())}",
            source=source,
            fix="pass one of the available split names",
        )
    return dataset[split]


def _check_not_empty(dataset: Any, source: str) -> None:
    from datasets import Dataset

    if isinstance(dataset, Dataset) and len(dataset) == 0:
        raise DataError("the dataset is empty", source=source, fix="check the file / split / filters")


def _looks_local(name: str) -> bool:
    return (
        name.startswith(("/", "./", "../", "~")) or Path(name).suffix.lower() in _FILE_BUILDERS or name.count("/") > 1
    )


def load_any_dataset(
    name_or_path: str | os.PathLike,
    split: str | None = None,
    config_name: str | None = None,
) -> Dataset | DatasetDict:
    """Load a dataset from a .jsonl/.json/.parquet/.csv file, a `save_to_disk` folder, a folder of
    data files, or the Hugging Face hub.

    A single file is one split named "train" and is returned as a `Dataset` (its `split` may be
    None, "train" or a slice like "train[:100]"). Otherwise `split` picks a split (an unknown name
    lists the available ones) and None returns the whole `DatasetDict`. JSON and CSV files are
    validated first, so a malformed line or invalid UTF-8 is reported with its line number.
    """
    import datasets

    name = str(name_or_path)
    path = Path(name).expanduser()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix not in _FILE_BUILDERS:
            raise DataError(
                f"unsupported file type {suffix!r}",
                source=path,
                fix="use .jsonl, .json, .parquet or .csv, or a folder saved with Dataset.save_to_disk",
            )
        if split is not None and not split.startswith("train"):
            raise DataError(
                f"a single file has one split, 'train'; got split={split!r}",
                source=path,
                fix="drop the split argument or use 'train'",
            )
        if suffix == ".jsonl":
            _validate_json_lines(path)
        elif suffix == ".json":
            _validate_json(path)
        elif suffix == ".csv":
            _validate_csv(path)
        try:
            dataset = datasets.load_dataset(_FILE_BUILDERS[suffix], data_files=str(path), split=split or "train")
        except Exception as err:
            raise DataError(
                f"datasets could not read the file ({type(err).__name__}: {err})",
                source=path,
                fix="check that every record has the same fields with the same types",
            ) from err
    elif path.is_dir():
        try:
            if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
                dataset = datasets.load_from_disk(str(path))
            else:
                dataset = datasets.load_dataset(str(path), config_name)
        except Exception as err:
            raise DataError(
                f"could not load the folder ({type(err).__name__}: {err})",
                source=path,
                fix="pass a folder written by save_to_disk, a folder of data files, or one file",
            ) from err
        dataset = _select_split(dataset, split, str(path))
    elif _looks_local(name):
        raise DataError("no such file or folder", source=name, fix="check the path (relative to the working directory)")
    else:
        try:
            dataset = datasets.load_dataset(name, config_name, split=split)
        except Exception as err:
            raise DataError(
                f"not a local file or folder, and loading it from the Hugging Face hub failed "
                f"({type(err).__name__}: {err})",
                source=name,
                fix="check the dataset name, config and split, network access and HF_HUB_OFFLINE",
            ) from err
    _check_not_empty(dataset, name)
    return _mark_source(dataset, name)


# --------------------------------------------------------------------------------------------
# Formats and chat templates
# --------------------------------------------------------------------------------------------


def _is_message_list(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and isinstance(value[0], dict) and "role" in value[0]


def is_conversational(example: dict[str, Any]) -> bool:
    """True when a prompt/chosen/rejected/completion/messages field is a list of {"role", ...} dicts."""
    return any(_is_message_list(example.get(key)) for key in _CONVERSATIONAL_KEYS)


def detect_format(dataset: Any, dataset_text_field: str = "text") -> str:
    """The dataset's format, from its columns: one of `FORMATS` (see the module docstring)."""
    from datasets import DatasetDict

    if isinstance(dataset, DatasetDict):
        raise DataError(
            f"got a DatasetDict with splits {list(dataset.keys())}, not one split",
            source=_source_of(next(iter(dataset.values()), None), None),
            fix="select a split, e.g. split='train'",
        )
    columns = set(dataset.column_names)
    if {"chosen", "rejected"} <= columns or {"chosen_input_ids", "rejected_input_ids"} <= columns:
        return "preference"
    if "messages" in columns:
        return "messages"
    if {"prompt", "completion"} <= columns:
        return "prompt_completion"
    if "prompt" in columns:
        return "prompt"
    if dataset_text_field in columns:
        return "text"
    if "input_ids" in columns:
        return "tokenized"
    raise DataError(
        f"cannot tell the format from the columns {sorted(columns)}",
        source=_source_of(dataset, None),
        fix=f"provide 'prompt'; 'chosen'+'rejected'; '{dataset_text_field}'; 'messages'; "
        "'prompt'+'completion'; or 'input_ids'",
    )


def ensure_chat_template(tokenizer: PreTrainedTokenizerBase, template: str | None = None) -> PreTrainedTokenizerBase:
    """Set `template` (or `SIMPLE_CHAT_TEMPLATE` when the tokenizer has none) as the chat template."""
    if template is not None:
        tokenizer.chat_template = template
    elif getattr(tokenizer, "chat_template", None) is None:
        logger.info("tokenizer has no chat template; using the simple 'Role: content' template")
        tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    return tokenizer


def apply_chat_template(
    messages: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    add_generation_prompt: bool = False,
    **template_kwargs: Any,
) -> str:
    """Render a conversation to text with the tokenizer's template (fallback template if none)."""
    ensure_chat_template(tokenizer)
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )


def _validate_messages(messages: list[Any], source: str, row: int, field: str) -> None:
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DataError(
                f"message {turn} has no string 'role'",
                source=source,
                row=row,
                field=field,
                fix='write each message as {"role": "user", "content": "..."}',
            )
        content = message.get("content")
        if not isinstance(content, (str, list)):
            raise DataError(
                f"message {turn} ({message['role']}) has content of type {type(content).__name__}, not a string",
                source=source,
                row=row,
                field=field,
                fix="give every message a string 'content'",
            )


def _as_text_or_messages(value: Any, source: str, row: int, field: str) -> str | list:
    """Validate one field that holds a string or a conversation; returns it unchanged."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError("is empty", source=source, row=row, field=field, fix="remove the row or fill the field")
        return value
    if isinstance(value, list):
        if not value:
            raise DataError(
                "is an empty conversation", source=source, row=row, field=field, fix="remove the row or add messages"
            )
        _validate_messages(value, source, row, field)
        return value
    raise DataError(
        f"has type {type(value).__name__}; expected a string or a list of {{role, content}} messages",
        source=source,
        row=row,
        field=field,
        fix="convert the field to text or to a conversation",
    )


def _require_columns(dataset: Any, columns: Sequence[str], source: str, purpose: str) -> None:
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise DataError(
            f"missing column(s) {missing} needed for {purpose}; available columns: {dataset.column_names}",
            source=source,
            field=missing[0],
            fix="rename the right column or pass its name",
        )


def _require_rows(dataset: Any, source: str) -> None:
    if len(dataset) == 0:
        raise DataError("the dataset is empty", source=source, fix="check the file / split / filters")


# --------------------------------------------------------------------------------------------
# Tokenization helpers
# --------------------------------------------------------------------------------------------


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


def _assistant_spans(
    messages: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    full_text: str,
    source: str,
    row: int,
    field: str,
    start_turn: int = 0,
) -> list[tuple[int, int]]:
    """Character spans of the assistant turns (index >= start_turn) in the rendered conversation.

    Renders the conversation prefix by prefix: assistant turn i spans from the end of
    render(messages[:i], generation prompt) to the end of render(messages[:i+1]). This works for any
    template whose renderings of prefixes are prefixes of the full rendering (no `{% generation %}`
    markers needed).
    """
    spans = []
    for i, message in enumerate(messages):
        if i < start_turn or message["role"] != "assistant":
            continue
        upto = apply_chat_template(messages[: i + 1], tokenizer)
        if not full_text.startswith(upto):
            raise DataError(
                f"the chat template renders the conversation up to message {i} differently from the whole "
                "conversation, so assistant tokens cannot be located",
                source=source,
                row=row,
                field=field,
                fix="use a chat template whose rendering of a prefix is a prefix of the full rendering "
                "(templates that rewrite earlier turns, e.g. by dropping reasoning, are not)",
            )
        start = apply_chat_template(messages[:i], tokenizer, add_generation_prompt=True) if i else ""
        if not upto.startswith(start):
            start = apply_chat_template(messages[:i], tokenizer) if i else ""
        spans.append((len(start), len(upto)))
    return spans


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


def prepare_prompt_dataset(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_prompt_length: int | None = None,
    overflow: str = "truncate_left",
    prompt_column: str = "prompt",
    source: str | None = None,
) -> Dataset:
    """Tokenize prompts for generation: adds `input_ids` and sets `prompt` to the text after the
    chat template; other columns are kept (reward functions receive them).

    Conversational prompts get the chat template with the generation prompt. A dataset with only
    `input_ids` (pre-tokenized, as TRL's PPO takes) is validated and decoded into `prompt`.
    Prompts longer than `max_prompt_length` are cut from the left ("truncate_left", keeping the end
    of the prompt, which the completion continues) or removed ("drop"); the count is logged.
    """
    if overflow not in ("truncate_left", "drop"):
        raise ValueError(f"overflow must be 'truncate_left' or 'drop', got {overflow!r}")
    source = _source_of(dataset, source)
    _require_rows(dataset, source)
    tokenized = prompt_column not in dataset.column_names and "input_ids" in dataset.column_names
    if not tokenized:
        _require_columns(dataset, [prompt_column], source, "prompts")
    # A stored mask would go stale after truncation; the collator builds it from lengths.
    if "attention_mask" in dataset.column_names:
        dataset = dataset.remove_columns("attention_mask")
    vocab_size = len(tokenizer)

    def encode(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        if tokenized:
            ids = [
                _check_token_ids(seq, source, row, "input_ids", vocab_size)
                for seq, row in zip(batch["input_ids"], indices)
            ]
            texts = tokenizer.batch_decode(ids, skip_special_tokens=False)
        else:
            values = [
                _as_text_or_messages(v, source, row, prompt_column) for v, row in zip(batch[prompt_column], indices)
            ]
            conversational = [isinstance(v, list) for v in values]
            texts = [
                apply_chat_template(v, tokenizer, add_generation_prompt=True) if c else v
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
        return {"input_ids": ids, "prompt": texts, "__overlong": overlong}

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


def _check_token_ids(seq: Any, source: str, row: int, field: str, vocab_size: int | None = None) -> list[int]:
    if not isinstance(seq, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in seq):
        raise DataError(
            f"must be a list of integer token ids, got {type(seq).__name__}",
            source=source,
            row=row,
            field=field,
            fix="store token ids as lists of ints",
        )
    if not seq:
        raise DataError("is empty", source=source, row=row, field=field, fix="remove the row")
    if min(seq) < 0 or (vocab_size is not None and max(seq) >= vocab_size):
        raise DataError(
            f"holds token ids outside the vocabulary [0, {vocab_size})",
            source=source,
            row=row,
            field=field,
            fix="tokenize with the same tokenizer as the model",
        )
    return seq


class PromptCollator:
    """Collates prompt rows into a left-padded batch for generation.

    `attention_mask` comes from each row's length, never from `ids == pad`, so pad == eos is safe.
    Non-tensor columns (`prompt` and any extra column) are returned as lists, in row order.
    """

    def __init__(self, pad_token_id: int):
        if pad_token_id is None:
            raise ValueError("PromptCollator needs a pad_token_id; see models.ensure_pad_token")
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        lengths = [len(row["input_ids"]) for row in rows]
        width = max(lengths)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, (row, n) in enumerate(zip(rows, lengths)):
            input_ids[i, width - n :] = torch.as_tensor(row["input_ids"], dtype=torch.long)
            attention_mask[i, width - n :] = True
        batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        for key in rows[0]:
            if key not in batch:
                batch[key] = [row[key] for row in rows]
        return batch


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
    source: str | None = None,
) -> Dataset:
    """Tokenize preference pairs for reward modelling → `chosen_input_ids`, `rejected_input_ids`
    (+ `margin` when the dataset has one).

    An explicit `prompt` is prepended to both answers; conversations are rendered with the chat
    template (which closes the assistant turn itself); standard text gets EOS appended when it does
    not end with one, so the score is read on EOS as at inference. Pre-tokenized
    `chosen_input_ids`/`rejected_input_ids` (or `chosen_ids`/`rejected_ids`) pass through.
    Pairs where either side exceeds `max_length` are dropped ("drop", like TRL) or cut to their
    first `max_length` tokens ("truncate"); the count is logged.
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
        _require_columns(dataset, ["chosen", "rejected"], source, "preference pairs")
    has_prompt = "prompt" in columns and pretokenized is None
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
                    _as_text_or_messages(batch["prompt"][row_in_batch], source, row, "prompt") if has_prompt else None
                )
                for key, field in (("chosen_input_ids", "chosen"), ("rejected_input_ids", "rejected")):
                    answer = _as_text_or_messages(batch[field][row_in_batch], source, row, field)
                    if prompt is not None and isinstance(prompt, list) != isinstance(answer, list):
                        raise DataError(
                            "mixes a conversational and a plain-text field with 'prompt'",
                            source=source,
                            row=row,
                            field=field,
                            fix="make prompt, chosen and rejected all strings or all conversations",
                        )
                    if isinstance(answer, list):
                        text = apply_chat_template((prompt or []) + answer, tokenizer)
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
        if overflow == "truncate" and max_length is not None:
            out["chosen_input_ids"] = [s[:max_length] for s in out["chosen_input_ids"]]
            out["rejected_input_ids"] = [s[:max_length] for s in out["rejected_input_ids"]]
        return out

    out = dataset.map(encode, batched=True, with_indices=True, remove_columns=columns, desc="Tokenizing pairs")
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


def _check_number(value: Any, source: str, row: int, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(
            f"must be a finite number, got {value!r}",
            source=source,
            row=row,
            field=field,
            fix="store a number (or drop the column)",
        )
    return float(value)


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
    # Only "wrapped" and "bfd_split" keep every token of an overlong row.
    truncate = not packing or packing_strategy == "bfd"
    source = _source_of(dataset, source)
    _require_rows(dataset, source)
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
    if completion_only_loss is None:
        completion_only_loss = fmt == "prompt_completion"
    eos_id = tokenizer.eos_token_id

    def text_row(value: Any, row: int) -> tuple[list[int], list[bool]]:
        if not isinstance(value, str):
            raise DataError(
                f"has type {type(value).__name__}, expected a string",
                source=source,
                row=row,
                field=dataset_text_field,
                fix="store plain text in this column (or use 'messages' for conversations)",
            )
        _as_text_or_messages(value, source, row, dataset_text_field)
        ids = _append_eos(list(tokenizer(value)["input_ids"]), eos_id)
        return ids, [True] * len(ids)

    def messages_row(value: Any, row: int) -> tuple[list[int], list[bool]]:
        value = _as_text_or_messages(value, source, row, "messages")
        if not isinstance(value, list):
            raise DataError(
                "is a string; expected a list of {role, content} messages",
                source=source,
                row=row,
                field="messages",
                fix="store the conversation as a list of messages (or use a 'text' column)",
            )
        text = apply_chat_template(value, tokenizer)
        if assistant_only_loss:
            spans = _assistant_spans(value, tokenizer, text, source, row, "messages")
            if not spans:
                raise DataError(
                    "has no assistant message to train on",
                    source=source,
                    row=row,
                    field="messages",
                    fix="add an assistant turn or turn assistant_only_loss off",
                )
        else:
            spans = [(0, len(text))]
        return _trainable_tokens(tokenizer, text, spans, add_special_tokens=False)

    def prompt_completion_row(prompt: Any, completion: Any, row: int) -> tuple[list[int], list[bool]]:
        prompt = _as_text_or_messages(prompt, source, row, "prompt")
        completion = _as_text_or_messages(completion, source, row, "completion")
        if isinstance(prompt, list) != isinstance(completion, list):
            raise DataError(
                "one of prompt / completion is a conversation and the other a string",
                source=source,
                row=row,
                field="completion",
                fix="make both strings or both conversations",
            )
        if isinstance(prompt, str):
            # Prompt and completion are tokenized separately (as TRL does, and as the policy sees them
            # at generation time), so a BPE merge across the boundary (a trailing space in the prompt
            # joining the completion's first word) can never hide completion tokens from the loss.
            (prompt_ids,) = _encode(tokenizer, [prompt], [False])
            completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
            ids = list(prompt_ids) + list(completion_ids)
            mask = [not completion_only_loss] * len(prompt_ids) + [True] * len(completion_ids)
            if eos_id is not None and (not ids or ids[-1] != eos_id):
                ids, mask = ids + [eos_id], mask + [True]
            return ids, mask
        conversation = prompt + completion
        text = apply_chat_template(conversation, tokenizer)
        if assistant_only_loss:
            spans = _assistant_spans(
                conversation,
                tokenizer,
                text,
                source,
                row,
                "completion",
                start_turn=len(prompt) if completion_only_loss else 0,
            )
        elif completion_only_loss:
            start = apply_chat_template(prompt, tokenizer, add_generation_prompt=True)
            if not text.startswith(start):
                start = apply_chat_template(prompt, tokenizer)
            if not text.startswith(start):
                raise DataError(
                    "the chat template renders the prompt differently inside the full conversation, so the "
                    "completion tokens cannot be located",
                    source=source,
                    row=row,
                    field="completion",
                    fix="use a template whose prompt rendering is a prefix of the full rendering",
                )
            spans = [(len(start), len(text))]
        else:
            spans = [(0, len(text))]
        return _trainable_tokens(tokenizer, text, spans, add_special_tokens=False)

    def encode(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": [], "__truncated": [], "__empty": []}
        for k, row in enumerate(indices):
            if fmt == "text":
                ids, mask = text_row(batch[dataset_text_field][k], row)
            elif fmt == "messages":
                ids, mask = messages_row(batch["messages"][k], row)
            else:
                ids, mask = prompt_completion_row(batch["prompt"][k], batch["completion"][k], row)
            truncated = truncate and max_length is not None and len(ids) > max_length
            if truncated:
                keep = slice(None, max_length) if truncation == "keep_start" else slice(-max_length, None)
                ids, mask = ids[keep], mask[keep]
            out["input_ids"].append(ids)
            out["labels"].append([t if m else IGNORE_INDEX for t, m in zip(ids, mask)])
            out["__truncated"].append(truncated)
            out["__empty"].append(not any(mask))
        return out

    out = dataset.map(
        encode, batched=True, with_indices=True, remove_columns=dataset.column_names, desc="Tokenizing SFT data"
    )
    _overflow_note(
        sum(out["__truncated"]),
        len(dataset),
        f"rows are longer than {max_length} tokens and were truncated ({truncation})",
    )
    n_empty = sum(out["__empty"])
    if n_empty:
        out = out.filter(lambda flags: [not f for f in flags], input_columns="__empty", batched=True)
        _overflow_note(n_empty, len(dataset), "rows have no token to train on (after truncation) and were dropped")
        if len(out) == 0:
            raise DataError(
                "no row has a token to train on",
                source=source,
                fix="check completion_only_loss / assistant_only_loss and max_length",
            )
    out = out.remove_columns(["__truncated", "__empty"])
    if packing and packing_strategy == "wrapped":
        out = out.map(_pack(max_length), batched=True, batch_size=1000, desc="Packing")
    elif packing:
        n_rows = len(out)
        out = (
            out.with_format("arrow")
            .map(
                _pack_bfd_table,
                fn_kwargs={"capacity": max_length, "split": packing_strategy == "bfd_split"},
                batched=True,
                batch_size=_BFD_BATCH_ROWS,
                remove_columns=out.column_names,
                desc="Packing (BFD)",
            )
            .with_format(None)
        )
        logger.info(
            "packed %d rows into %d rows of at most %d tokens (%s)", n_rows, len(out), max_length, packing_strategy
        )
    return out


def _pack(block: int) -> Callable[[dict[str, list]], dict[str, list]]:
    def pack(batch: dict[str, list]) -> dict[str, list]:
        ids = [t for seq in batch["input_ids"] for t in seq]
        labels = [t for seq in batch["labels"] for t in seq]
        return {
            "input_ids": [ids[i : i + block] for i in range(0, len(ids), block)],
            "labels": [labels[i : i + block] for i in range(0, len(labels), block)],
        }

    return pack


# Rows packed together per map batch: large enough that best-fit decreasing fills nearly every
# row, small enough that the flattened token arrays of one batch stay a few hundred MB.
_BFD_BATCH_ROWS = 20_000


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group item indices into bins holding at most `capacity` (e.g. tokens), best-fit decreasing.

    Items go longest first (equal lengths keep their order), each into the open bin whose free
    space is the smallest that still fits it (ties: the oldest bin), else into a new bin; bins are
    returned in creation order, each listing its items in placement order. Open bins are bucketed
    by free space (a heap of bin numbers per value) and the distinct free-space values kept in a
    sorted list of at most `capacity` entries, so each placement is a bisect plus a short-list
    insert: 100k items take a fraction of a second, where scanning the bins would be quadratic.
    """
    import numpy as np

    sizes = np.asarray(lengths, dtype=np.int64)
    if sizes.size and int(sizes.max()) > capacity:
        raise ValueError(f"an item of length {int(sizes.max())} exceeds the bin capacity {capacity}")
    order = np.argsort(-sizes, kind="stable").tolist()
    sizes_list = sizes.tolist()
    bins: list[list[int]] = []
    free_values: list[int] = []  # sorted distinct free spaces of bins that still have room
    bins_with_free: dict[int, list[int]] = {}
    for item in order:
        size = sizes_list[item]
        k = bisect.bisect_left(free_values, size)
        if k < len(free_values):
            free = free_values[k]
            bucket = bins_with_free[free]
            b = heapq.heappop(bucket)
            if not bucket:
                del bins_with_free[free]
                del free_values[k]
        else:
            b, free = len(bins), capacity
            bins.append([])
        bins[b].append(item)
        left = free - size
        if left > 0:
            bucket = bins_with_free.get(left)
            if bucket is None:
                bucket = bins_with_free[left] = []
                bisect.insort(free_values, left)
            heapq.heappush(bucket, b)
    return bins


def _pack_bfd_table(table: Any, capacity: int, split: bool) -> Any:
    """One map batch (a pyarrow Table with `input_ids`, `labels`) → BFD-packed rows with
    `position_ids` and `seq_lengths`. Tokens move as numpy gathers: no per-token Python."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    ids = table["input_ids"].combine_chunks()
    labels = table["labels"].combine_chunks()
    lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = np.cumsum(lengths) - lengths  # first flat token of each row
    if split:
        # Overlong rows become ceil(n / capacity) pieces of `capacity` tokens (the last shorter).
        counts = np.maximum(-(-lengths // capacity), 1)
        row = np.repeat(np.arange(len(lengths)), counts)
        k = np.arange(row.size) - np.repeat(np.cumsum(counts) - counts, counts)
        piece_start = starts[row] + k * capacity
        piece_len = np.minimum(capacity, lengths[row] - k * capacity)
    else:
        piece_start, piece_len = starts, lengths
    bins = best_fit_decreasing(piece_len, capacity)
    order = np.fromiter((p for b in bins for p in b), dtype=np.int64, count=piece_len.size)
    seq_len = piece_len[order]
    seq_first = np.cumsum(seq_len) - seq_len  # first token of each sequence in the packed stream
    within = np.arange(int(seq_len.sum())) - np.repeat(seq_first, seq_len)
    take = pa.array(np.repeat(piece_start[order], seq_len) + within)
    pieces_per_bin = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    piece_offsets = np.concatenate([[0], np.cumsum(pieces_per_bin)])
    token_offsets = pa.array(np.concatenate([[0], np.cumsum(seq_len)])[piece_offsets], type=pa.int32())

    def packed(values: Any) -> Any:
        return pa.ListArray.from_arrays(token_offsets, values)

    return pa.table(
        {
            "input_ids": packed(ids.flatten().take(take)),
            "labels": packed(labels.flatten().take(take)),
            "position_ids": packed(pa.array(within, type=pa.int32())),
            "seq_lengths": pa.ListArray.from_arrays(
                pa.array(piece_offsets, type=pa.int32()), pa.array(seq_len, type=pa.int32())
            ),
        }
    )
