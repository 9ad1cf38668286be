"""Loading datasets and validating files, rows and fields.

`load_any_dataset` reads a .jsonl/.json/.parquet/.csv file, a `save_to_disk` folder, a folder of data
files or a hub dataset. JSON and CSV files are validated first, and every bad row raises `DataError`
naming the source, line or row and field and saying how to fix it, because datasets' own errors
(arrow casts, JSON parser) rarely say which line is wrong. The row/field checks here are shared by
the preparers in `prepare.py`.

`datasets` is imported inside functions so `import posttrain` stays light.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_SOURCE_MARK = "posttrain source: "


class DataError(ValueError):
    """A dataset problem, reported with where it is (source, line or row, field) and how to fix it.

    `row` is the 0-based index of the row in the dataset (what `dataset[i]` takes); the message
    counts rows from 1, as it counts file lines (`line`) and messages of a conversation, so the
    first record of a file is "line 1" in a JSON-lines file and "row 1" once loaded. `self.row` is
    that 1-based number and `self.index` the 0-based index.
    """

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
        self.problem, self.source, self.index, self.line, self.field, self.fix = (
            problem,
            None if source is None else str(source),
            row,
            line,
            field,
            fix,
        )
        self.row = None if row is None else row + 1
        where = [str(source) if source is not None else "dataset"]
        if line is not None:
            where.append(f"line {line}")
        if self.row is not None:
            where.append(f"row {self.row}")
        if field is not None:
            where.append(f"field '{field}'")
        message = f"{', '.join(where)}: {problem}"
        if fix:
            message += f". Fix: {fix}"
        super().__init__(message)


# --------------------------------------------------------------------------------------------
# Files
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
            # Where the field was first seen, as the message counts: line N, or row index + 1.
            seen = self.kinds.setdefault(key, (kind, line if line is not None else row + 1))
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


def _check_data_file(path: Path, split: str | None) -> str:
    """A data file's suffix, once its type and split are known to load and (JSON, CSV) every line parses."""
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
    return suffix


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
        suffix = _check_data_file(path, split)
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


def load_split(config: Any, split: str, required: bool = True, streaming: bool = False) -> Dataset | None:
    """The `split` of config.dataset_name (a hub name, a saved folder or a data file), loaded with
    config.dataset_config; None when an optional split (`required=False`) is absent. `streaming`: a
    `datasets.IterableDataset` read as training goes (`load_stream`)."""
    from posttrain.configs import ConfigError

    if not config.dataset_name:
        raise ConfigError("dataset_name is not set: pass --dataset_name (a hub name, a saved folder or a data file).")
    if streaming:
        return load_stream(config.dataset_name, split=split, config_name=config.dataset_config)
    if not required and not has_split(config.dataset_name, split):
        return None
    return load_any_dataset(config.dataset_name, split=split, config_name=config.dataset_config)


def load_stream(name_or_path: str | os.PathLike, split: str, config_name: str | None = None) -> Any:
    """One split as a streaming `datasets.IterableDataset` (TRL's `--dataset_streaming`): a data file
    (JSON files checked line by line first, as load_any_dataset does), a folder of data files or a hub
    dataset through `load_dataset(..., streaming=True)`; a `save_to_disk` folder is already on disk
    and is streamed from its arrow files (`to_iterable_dataset`)."""
    import datasets

    name = str(name_or_path)
    path = Path(name).expanduser()
    if "[" in split:
        raise DataError(
            f"split={split!r}: a streamed split cannot be sliced",
            source=name,
            fix="name the whole split, or load without streaming to slice it",
        )
    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        return load_any_dataset(name, split=split, config_name=config_name).to_iterable_dataset()
    if path.is_file():
        builder, kwargs = _FILE_BUILDERS[_check_data_file(path, split)], {"data_files": str(path)}
    elif _looks_local(name) and not path.is_dir():
        raise DataError("no such file or folder", source=name, fix="check the path (relative to the working directory)")
    else:
        builder, kwargs = str(path) if path.is_dir() else name, {"name": config_name}
    try:
        return datasets.load_dataset(builder, split=split, streaming=True, **kwargs)
    except Exception as err:
        raise DataError(
            f"could not be opened as a stream ({type(err).__name__}: {err})",
            source=name,
            fix="check the dataset name, config and split (and network access for a hub dataset)",
        ) from err


def has_split(name_or_path: str | os.PathLike, split: str) -> bool:
    """Whether an optional split (e.g. the test split used for sample tables) exists. A single data
    file holds only "train"; a saved DatasetDict folder lists its splits; for hub datasets we try to
    load and treat only a missing split as absent — any other data error still stops the run."""
    path = os.path.expanduser(str(name_or_path))
    if os.path.isfile(path):
        return split.startswith("train")
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        with open(os.path.join(path, "dataset_dict.json")) as f:
            return split in json.load(f).get("splits", [])
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "dataset_info.json")):
        return split.startswith("train")
    try:
        load_any_dataset(name_or_path, split=split)
    except DataError as err:
        if "no split" in str(err):
            return False
        raise
    return True


# --------------------------------------------------------------------------------------------
# Row and field checks (shared by the preparers in prepare.py)
# --------------------------------------------------------------------------------------------


# Roles chat templates know: system, user, assistant, tool (transformers' chat-template docs),
# developer (OpenAI's system-level role, gpt-oss templates), ipython (Llama 3.1's tool-output role).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
# ShareGPT's speaker names, which maybe_convert_to_chatml keeps as roles.
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}


def _validate_messages(messages: list[Any], source: str, row: int, field: str) -> None:
    for turn, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DataError(
                f"message {turn} has no string 'role'",
                source=source,
                row=row,
                field=field,
                fix='write each message as {"role": "user", "content": "..."}',
            )
        role = message["role"]
        if role not in CHAT_ROLES:
            if role.lower() in _SHAREGPT_ROLES:
                fix = "rename the ShareGPT roles: " + ", ".join(f"{k} -> {v}" for k, v in _SHAREGPT_ROLES.items())
            else:
                fix = "use one of the accepted roles (a chat template renders no other role correctly)"
            raise DataError(
                f"message {turn} has the unknown role {role!r}; accepted roles: {', '.join(CHAT_ROLES)}",
                source=source,
                row=row,
                field=field,
                fix=fix,
            )
        content = message.get("content")
        if not isinstance(content, (str, list)):
            raise DataError(
                f"message {turn} ({role}) has content of type {type(content).__name__}, not a string",
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


def _require_columns(available: Sequence[str], columns: Sequence[str], source: str, purpose: str) -> None:
    """`columns` must be among the dataset's column names `available`."""
    missing = [c for c in columns if c not in available]
    if missing:
        raise DataError(
            f"missing column(s) {missing} needed for {purpose}; available columns: {list(available)}",
            source=source,
            field=missing[0],
            fix="rename the right column or pass its name",
        )


def _require_rows(dataset: Any, source: str) -> None:
    if len(dataset) == 0:
        raise DataError("the dataset is empty", source=source, fix="check the file / split / filters")


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
