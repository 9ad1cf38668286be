"""posttrain.data.loading: files, folders and hub names in; errors that name the file, line and field."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset, DatasetDict

from helpers import write_jsonl
from posttrain.data import DataError, load_any_dataset

# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------

ROWS = [{"prompt": "hello", "n": 1}, {"prompt": "world", "n": 2}, {"prompt": "again", "n": 3}]


def test_load_jsonl_json_csv_parquet(tmp_path):
    jsonl = write_jsonl(tmp_path / "a.jsonl", ROWS)
    as_list = tmp_path / "b.json"
    as_list.write_text(json.dumps(ROWS), encoding="utf-8")
    lines_in_json = write_jsonl(tmp_path / "c.json", ROWS)
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,n\nhello,1\nworld,2\nagain,3\n", encoding="utf-8")
    parquet = tmp_path / "e.parquet"
    Dataset.from_list(ROWS).to_parquet(str(parquet))
    for path in (jsonl, as_list, lines_in_json, csv, parquet):
        ds = load_any_dataset(path)
        assert isinstance(ds, Dataset), path
        assert ds["prompt"] == ["hello", "world", "again"] and ds["n"] == [1, 2, 3]
    assert load_any_dataset(str(jsonl), split="train").num_rows == 3
    assert load_any_dataset(jsonl, split="train[:2]").num_rows == 2


def test_load_saved_folders_and_splits(tmp_path):
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert load_any_dataset(tmp_path / "one").num_rows == 3
    DatasetDict({"train": Dataset.from_list(ROWS), "test": Dataset.from_list(ROWS[:1])}).save_to_disk(
        str(tmp_path / "dict")
    )
    whole = load_any_dataset(tmp_path / "dict")
    assert isinstance(whole, DatasetDict) and set(whole) == {"train", "test"}
    assert load_any_dataset(tmp_path / "dict", split="test").num_rows == 1
    with pytest.raises(DataError, match=r"no split 'validation'; available splits: train, test"):
        load_any_dataset(tmp_path / "dict", split="validation")


def test_load_errors_name_file_and_line(tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": "c",}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl, line 4: malformed JSON .*Fix:"):
        load_any_dataset(bad_json)

    bad_utf8 = tmp_path / "latin1.jsonl"
    bad_utf8.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl, line 2: invalid UTF-8.*iconv"):
        load_any_dataset(bad_utf8)

    bad_csv = tmp_path / "latin1.csv"
    bad_csv.write_bytes(b"prompt\nok\ncaf\xe9\n")
    with pytest.raises(DataError, match=r"latin1\.csv, line 3: invalid UTF-8"):
        load_any_dataset(bad_csv)

    not_object = tmp_path / "list.jsonl"
    not_object.write_text('{"prompt": "a"}\n["prompt"]\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"list\.jsonl, line 2: expected a JSON object"):
        load_any_dataset(not_object)

    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a"}, {"prompt": None}, {"prompt": [1, 2]}])
    with pytest.raises(DataError, match=r"mixed\.jsonl, line 3, field 'prompt': is a list here but a string at line 1"):
        load_any_dataset(mixed)

    json_list = tmp_path / "rows.json"
    json_list.write_text(json.dumps([{"prompt": "a"}, "oops"]), encoding="utf-8")
    with pytest.raises(DataError, match=r"rows\.json, row 2: expected a JSON object"):
        load_any_dataset(json_list)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"empty\.jsonl: the file has no records"):
        load_any_dataset(empty)

    (tmp_path / "x.txt").write_text("hi", encoding="utf-8")
    with pytest.raises(DataError, match=r"unsupported file type '\.txt'"):
        load_any_dataset(tmp_path / "x.txt")
    with pytest.raises(DataError, match=r"one split, 'train'"):
        load_any_dataset(write_jsonl(tmp_path / "ok.jsonl", ROWS), split="test")
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file"):
        load_any_dataset(tmp_path / "missing.jsonl")


def test_load_hub_name_offline_gives_clear_error():
    with pytest.raises(DataError, match=r"no-such-org/no-such-dataset: not a local file or folder.*hub"):
        load_any_dataset("no-such-org/no-such-dataset", split="train")


def test_load_empty_dataset(tmp_path):
    header_only = tmp_path / "empty.csv"
    header_only.write_text("prompt\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"empty\.csv: the file has no records"):
        load_any_dataset(header_only)


def test_load_stream_reads_files_and_saved_folders_as_streams_and_refuses_what_cannot_stream(tmp_path):
    from datasets import IterableDataset

    from posttrain.data.loading import load_stream

    rows = [{"prompt": f"p{i}"} for i in range(3)]
    stream = load_stream(write_jsonl(tmp_path / "p.jsonl", rows), split="train")
    assert isinstance(stream, IterableDataset) and [r["prompt"] for r in stream] == ["p0", "p1", "p2"]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    saved = load_stream(tmp_path / "saved", split="train")
    assert isinstance(saved, IterableDataset) and [r["prompt"] for r in saved] == ["p0", "p1", "p2"]
    # a malformed line is reported by its number before anything streams, as when the file is loaded whole
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": \n', encoding="utf-8")
    with pytest.raises(DataError, match="line 2"):
        load_stream(bad, split="train")
    with pytest.raises(DataError, match=r"split='train\[:2\]': a streamed split cannot be sliced"):
        load_stream(tmp_path / "p.jsonl", split="train[:2]")
    with pytest.raises(DataError, match="no such file or folder"):
        load_stream(tmp_path / "missing.jsonl", split="train")
