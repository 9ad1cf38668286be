"""posttrain.data.prepare: prompt, preference and SFT datasets tokenized, validated row by row, cut or dropped."""

from __future__ import annotations

import logging

import pytest
from datasets import Dataset

from helpers import CHATML, conv, write_jsonl
from posttrain.data import (
    IGNORE_INDEX,
    DataError,
    load_any_dataset,
    prepare_preference_dataset,
    prepare_prompt_dataset,
    prepare_sft_dataset,
)


def trained_text(tok, row):
    return tok.decode([t for t in row["labels"] if t != IGNORE_INDEX])


# --------------------------------------------------------------------------------------------
# prompt datasets
# --------------------------------------------------------------------------------------------


def test_prompt_dataset_standard_and_conversational(tok):
    ds = Dataset.from_dict({"prompt": ["Hello world", "The sea"], "answer": ["x", "y"]})
    out = prepare_prompt_dataset(ds, tok)
    assert out["prompt"] == ["Hello world", "The sea"]
    assert out["answer"] == ["x", "y"], "extra columns are kept for reward functions"
    assert out[0]["input_ids"] == tok("Hello world")["input_ids"]

    ds = Dataset.from_dict({"prompt": [conv(("user", "What is 2+2?"))], "solution": ["4"]})
    row = prepare_prompt_dataset(ds, tok)[0]
    assert row["prompt"] == "user: What is 2+2?\nassistant:"
    assert tok.decode(row["input_ids"]) == row["prompt"]
    assert row["solution"] == "4"


def test_prompt_dataset_custom_column_and_pretokenized(tok):
    ds = Dataset.from_dict({"question": ["Hello"], "id": [7]})
    out = prepare_prompt_dataset(ds, tok, prompt_column="question")
    assert out.column_names == ["id", "input_ids", "prompt"] or set(out.column_names) == {"id", "input_ids", "prompt"}
    assert out[0]["prompt"] == "Hello"

    ids = tok("The quick brown fox")["input_ids"]
    stale_mask = [[1] * len(ids)]
    out = prepare_prompt_dataset(
        Dataset.from_dict({"input_ids": [ids], "attention_mask": stale_mask}), tok, max_prompt_length=2
    )
    assert "attention_mask" not in out.column_names
    assert out[0]["input_ids"] == ids[-2:]
    assert out[0]["prompt"] == tok.decode(ids[-2:])


def test_prompt_dataset_reads_query_when_there_is_no_prompt(tok):
    out = prepare_prompt_dataset(Dataset.from_dict({"query": ["Hello world"], "id": [3]}), tok)
    assert set(out.column_names) == {"id", "input_ids", "prompt"}
    assert out[0]["prompt"] == "Hello world" and out[0]["input_ids"] == tok("Hello world")["input_ids"]
    # With a prompt column, query is an extra column (reward functions receive it) and prompt is read.
    out = prepare_prompt_dataset(Dataset.from_dict({"prompt": ["The sea"], "query": ["Hello world"]}), tok)
    assert out[0]["prompt"] == "The sea" and out[0]["query"] == "Hello world"
    # Pre-tokenized data keeps its input_ids.
    ids = tok("The quick brown fox")["input_ids"]
    out = prepare_prompt_dataset(Dataset.from_dict({"input_ids": [ids], "query": ["other"]}), tok)
    assert out[0]["input_ids"] == ids


def test_prompt_dataset_overlong_truncate_left_and_drop(tok, caplog):
    long, short = "The quick brown fox jumps over the lazy dog.", "Hi"
    ds = Dataset.from_dict({"prompt": [long, short, long]})
    n_long = len(tok(long)["input_ids"])
    with caplog.at_level(logging.WARNING, logger="posttrain.data"):
        out = prepare_prompt_dataset(ds, tok, max_prompt_length=4)
    assert "2 of 3 prompts are longer than 4 tokens and were truncated from the left" in caplog.text
    assert out[0]["input_ids"] == tok(long)["input_ids"][n_long - 4 :]
    assert out[0]["prompt"] == tok.decode(out[0]["input_ids"]) and long.endswith(out[0]["prompt"])
    assert out[1]["prompt"] == short

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="posttrain.data"):
        out = prepare_prompt_dataset(ds, tok, max_prompt_length=4, overflow="drop")
    assert "2 of 3 prompts are longer than 4 tokens and were dropped" in caplog.text
    assert out["prompt"] == [short]
    with pytest.raises(DataError, match="every prompt is longer than max_prompt_length=1"):
        prepare_prompt_dataset(ds, tok, max_prompt_length=1, overflow="drop")


def test_prompt_dataset_bad_data(tok, tmp_path):
    with pytest.raises(
        DataError,
        match=r"train_dataset, field 'prompt': missing column\(s\) \['prompt'\].*available columns: \['question'\]",
    ):
        prepare_prompt_dataset(Dataset.from_dict({"question": ["x"]}), tok, source="train_dataset")
    with pytest.raises(DataError, match=r"row 2, field 'prompt': is empty"):
        prepare_prompt_dataset(Dataset.from_dict({"prompt": ["ok", "   "]}), tok)
    with pytest.raises(DataError, match=r"row 1, field 'prompt': has type int"):
        prepare_prompt_dataset(Dataset.from_dict({"prompt": [3]}), tok)
    with pytest.raises(DataError, match=r"row 1, field 'prompt': message 1 .*content of type int"):
        prepare_prompt_dataset(Dataset.from_list([{"prompt": [{"role": "user", "content": 5}]}]), tok)
    with pytest.raises(DataError, match=r"row 1, field 'input_ids': is empty"):
        prepare_prompt_dataset(Dataset.from_dict({"input_ids": [[]]}), tok)
    with pytest.raises(DataError, match=r"row 2, field 'input_ids': holds token ids outside the vocabulary"):
        prepare_prompt_dataset(Dataset.from_dict({"input_ids": [[1], [len(tok)]]}), tok)
    with pytest.raises(DataError, match=r"row 1, field 'input_ids': must be a list of integer token ids"):
        prepare_prompt_dataset(Dataset.from_dict({"input_ids": [[1.5]]}), tok)
    with pytest.raises(DataError, match="the dataset is empty"):
        prepare_prompt_dataset(Dataset.from_dict({"prompt": []}), tok)
    with pytest.raises(ValueError, match="overflow must be"):
        prepare_prompt_dataset(Dataset.from_dict({"prompt": ["x"]}), tok, overflow="truncate_right")

    # The file a dataset was loaded from is named in row-level errors.
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "fine"}, {"prompt": ""}])
    with pytest.raises(DataError, match=r"train_dataset \(.*prompts\.jsonl\), row 2, field 'prompt': is empty"):
        prepare_prompt_dataset(load_any_dataset(path), tok, source="train_dataset")


# --------------------------------------------------------------------------------------------
# preference datasets
# --------------------------------------------------------------------------------------------


def test_preference_standard_explicit_and_implicit_prompt(tok):
    eos = tok.eos_token_id
    ds = Dataset.from_dict({"prompt": ["Q: hi"], "chosen": [" good"], "rejected": [" bad"], "margin": [0.5], "x": [1]})
    row = prepare_preference_dataset(ds, tok, max_length=64)[0]
    assert set(row) == {"chosen_input_ids", "rejected_input_ids", "margin"}
    assert row["chosen_input_ids"] == tok("Q: hi good")["input_ids"] + [eos]
    assert row["rejected_input_ids"][-1] == eos and row["margin"] == 0.5

    ds = Dataset.from_dict({"chosen": ["Q: hi good<|endoftext|>"], "rejected": ["Q: hi bad"]})
    row = prepare_preference_dataset(ds, tok, max_length=64)[0]
    assert row["chosen_input_ids"].count(eos) == 1, "EOS is not appended twice"
    assert row["rejected_input_ids"][-1] == eos


def test_preference_conversational_and_pretokenized(tok):
    ds = Dataset.from_dict(
        {
            "prompt": [conv(("user", "Hi"))],
            "chosen": [conv(("assistant", "Hello!"))],
            "rejected": [conv(("assistant", "Go away"))],
        }
    )
    row = prepare_preference_dataset(ds, tok, max_length=64)[0]
    assert tok.decode(row["chosen_input_ids"]) == "user: Hi\nassistant: Hello!<|endoftext|>\n"
    implicit = Dataset.from_dict(
        {
            "chosen": [conv(("user", "Hi"), ("assistant", "Hello!"))],
            "rejected": [conv(("user", "Hi"), ("assistant", "Go away"))],
        }
    )
    assert prepare_preference_dataset(implicit, tok, max_length=64)[0]["chosen_input_ids"] == row["chosen_input_ids"]

    pre = Dataset.from_dict({"chosen_input_ids": [[1, 2, 3]], "rejected_input_ids": [[4, 5]]})
    assert prepare_preference_dataset(pre, tok, max_length=64)[0] == {
        "chosen_input_ids": [1, 2, 3],
        "rejected_input_ids": [4, 5],
    }


def test_preference_overflow_counts(tok, caplog):
    ds = Dataset.from_dict({"chosen": ["short", "a much longer chosen answer here"], "rejected": ["no", "no"]})
    with caplog.at_level(logging.WARNING, logger="posttrain.data"):
        out = prepare_preference_dataset(ds, tok, max_length=4)
    assert "1 of 2 preference pairs are longer than 4 tokens and were dropped" in caplog.text
    assert len(out) == 1
    out = prepare_preference_dataset(ds, tok, max_length=4, overflow="truncate")
    assert len(out) == 2 and max(len(s) for s in out["chosen_input_ids"]) == 4


def test_preference_bad_data(tok):
    with pytest.raises(DataError, match=r"missing column\(s\) \['rejected'\].*available columns: \['chosen'\]"):
        prepare_preference_dataset(Dataset.from_dict({"chosen": ["a"]}), tok, 8)
    with pytest.raises(DataError, match=r"row 2, field 'chosen': is empty"):
        prepare_preference_dataset(Dataset.from_dict({"chosen": ["a", ""], "rejected": ["b", "c"]}), tok, 8)
    with pytest.raises(DataError, match=r"row 1, field 'rejected': has type int"):
        prepare_preference_dataset(Dataset.from_dict({"chosen": ["a"], "rejected": [1]}), tok, 8)
    with pytest.raises(DataError, match=r"row 1, field 'margin': must be a finite number"):
        prepare_preference_dataset(
            Dataset.from_dict({"chosen": ["a"], "rejected": ["b"], "margin": [float("nan")]}), tok, 8
        )
    with pytest.raises(DataError, match="every pair is longer"):
        prepare_preference_dataset(Dataset.from_dict({"chosen": ["a b c d e f"], "rejected": ["b"]}), tok, 1)


# --------------------------------------------------------------------------------------------
# SFT datasets
# --------------------------------------------------------------------------------------------


def test_sft_text_and_custom_field(tok):
    eos = tok.eos_token_id
    row = prepare_sft_dataset(Dataset.from_dict({"text": ["Hello world"]}), tok, 64)[0]
    assert row["input_ids"] == tok("Hello world")["input_ids"] + [eos]
    assert row["labels"] == row["input_ids"]
    row = prepare_sft_dataset(
        Dataset.from_dict({"body": ["Hi<|endoftext|>"], "id": [1]}), tok, 64, dataset_text_field="body"
    )[0]
    assert set(row) == {"input_ids", "labels"} and row["input_ids"].count(eos) == 1


def test_sft_prompt_completion(tok):
    ds = Dataset.from_dict({"prompt": ["The capital of France is"], "completion": [" Paris."]})
    row = prepare_sft_dataset(ds, tok, 64)[0]
    assert tok.decode(row["input_ids"]) == "The capital of France is Paris.<|endoftext|>"
    assert trained_text(tok, row) == " Paris.<|endoftext|>"
    assert row["labels"][0] == IGNORE_INDEX
    full = prepare_sft_dataset(ds, tok, 64, completion_only_loss=False)[0]
    assert full["labels"] == full["input_ids"]

    ds = Dataset.from_dict({"prompt": [conv(("user", "Hi"))], "completion": [conv(("assistant", "Hello!"))]})
    row = prepare_sft_dataset(ds, tok, 64)[0]
    assert tok.decode(row["input_ids"]) == "user: Hi\nassistant: Hello!<|endoftext|>\n"
    assert trained_text(tok, row) == " Hello!<|endoftext|>\n"


@pytest.mark.parametrize("template", ["tiny", "simple", "chatml"])
def test_sft_messages_assistant_only_loss(tok, template):
    if template == "simple":
        tok.chat_template = None
    elif template == "chatml":
        tok.chat_template = CHATML
    messages = conv(
        ("system", "Be kind."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye"), ("assistant", "See you")
    )
    ds = Dataset.from_dict({"messages": [messages]})
    full = prepare_sft_dataset(ds, tok, 256)[0]
    assert full["labels"] == full["input_ids"]
    row = prepare_sft_dataset(ds, tok, 256, assistant_only_loss=True)[0]
    assert row["input_ids"] == full["input_ids"]
    trained = trained_text(tok, row)
    assert "Hello!" in trained and "See you" in trained
    assert "Hi" not in trained and "Bye" not in trained and "Be kind" not in trained
    # Tokens of each assistant turn are contiguous runs of labels.
    runs, inside = 0, False
    for label in row["labels"]:
        if label != IGNORE_INDEX and not inside:
            runs += 1
        inside = label != IGNORE_INDEX
    assert runs == 2


def test_sft_truncation_and_empty_rows(tok, caplog):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok(text)["input_ids"] + [tok.eos_token_id]
    ds = Dataset.from_dict({"text": [text, "Hi"]})
    with caplog.at_level(logging.WARNING, logger="posttrain.data"):
        out = prepare_sft_dataset(ds, tok, 5)
    assert "1 of 2 rows are longer than 5 tokens and were truncated (keep_start)" in caplog.text
    assert out[0]["input_ids"] == ids[:5]
    assert prepare_sft_dataset(ds, tok, 5, truncation="keep_end")[0]["input_ids"] == ids[-5:]

    # A prompt that fills max_length leaves nothing to train on: the row is dropped and counted.
    pc = Dataset.from_dict({"prompt": [text, "Hi"], "completion": [" yes", " no"]})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="posttrain.data"):
        out = prepare_sft_dataset(pc, tok, 5)
    assert "1 of 2 rows have no token to train on" in caplog.text and len(out) == 1


def test_sft_packing(tok):
    texts = ["Hello world", "The sea is wide", "Thank you very much"]
    plain = prepare_sft_dataset(Dataset.from_dict({"text": texts}), tok, 64)
    stream = [t for seq in plain["input_ids"] for t in seq]
    packed = prepare_sft_dataset(Dataset.from_dict({"text": texts}), tok, 4, packing=True, packing_strategy="wrapped")
    assert all(len(seq) == 4 for seq in packed["input_ids"][:-1]) and 0 < len(packed["input_ids"][-1]) <= 4
    assert [t for seq in packed["input_ids"] for t in seq] == stream
    assert [t for seq in packed["labels"] for t in seq] == [t for seq in plain["labels"] for t in seq]


def test_sft_bad_data(tok):
    with pytest.raises(
        DataError, match=r"SFT needs 'text', 'messages' or 'prompt'\+'completion'.*available columns: \['prompt'\]"
    ):
        prepare_sft_dataset(Dataset.from_dict({"prompt": ["x"]}), tok, 8)
    with pytest.raises(DataError, match="assistant_only_loss needs conversational data"):
        prepare_sft_dataset(Dataset.from_dict({"text": ["x"]}), tok, 8, assistant_only_loss=True)
    with pytest.raises(DataError, match=r"row 2, field 'text': is empty"):
        prepare_sft_dataset(Dataset.from_dict({"text": ["x", ""]}), tok, 8)
    with pytest.raises(DataError, match=r"row 1, field 'text': has type int"):
        prepare_sft_dataset(Dataset.from_dict({"text": [4]}), tok, 8)
    with pytest.raises(DataError, match=r"row 1, field 'messages': is a string"):
        prepare_sft_dataset(Dataset.from_dict({"messages": ["hi"]}), tok, 8)
    with pytest.raises(DataError, match=r"row 1, field 'messages': has no assistant message"):
        prepare_sft_dataset(Dataset.from_dict({"messages": [conv(("user", "hi"))]}), tok, 8, assistant_only_loss=True)
    with pytest.raises(DataError, match=r"row 1, field 'completion': one of prompt / completion is a conversation"):
        prepare_sft_dataset(
            Dataset.from_dict({"prompt": [conv(("user", "hi"))], "completion": [conv(("assistant", "a"))]}).map(
                lambda r: {"completion": "text"}, remove_columns="completion"
            ),
            tok,
            8,
        )
    with pytest.raises(DataError, match="the dataset is empty"):
        prepare_sft_dataset(Dataset.from_dict({"text": []}), tok, 8)


def test_sft_labels_without_offsets(tok, monkeypatch):
    # Tokenizers without character offsets locate the completion by tokenizing the text before it.
    ds = Dataset.from_dict({"prompt": ["The capital of France is"], "completion": [" Paris."]})
    expected = prepare_sft_dataset(ds, tok, 64)[0]
    monkeypatch.setattr(type(tok), "is_fast", property(lambda self: False))
    assert prepare_sft_dataset(ds, tok, 64)[0] == expected


def test_sft_template_that_rewrites_history_is_rejected(tok):
    # Drops earlier assistant turns (as reasoning templates do): prefixes no longer match.
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
    )
    ds = Dataset.from_dict({"messages": [conv(("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"))]})
    with pytest.raises(DataError, match=r"row 1, field 'messages': the chat template renders .* differently"):
        prepare_sft_dataset(ds, tok, 64, assistant_only_loss=True)


def test_tokenizer_that_appends_eos(tok):
    # Tokenizers whose post-processor appends EOS (T5-style): prompts must not end with it, and
    # SFT completions must train on it exactly once.
    from tokenizers import processors

    eos = tok.eos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {tok.eos_token}", special_tokens=[(tok.eos_token, eos)]
    )
    assert tok("Hi")["input_ids"][-1] == eos
    prompt = prepare_prompt_dataset(Dataset.from_dict({"prompt": ["Hello world"]}), tok)[0]
    assert prompt["input_ids"][-1] != eos
    ds = Dataset.from_dict({"prompt": ["The capital of France is"], "completion": [" Paris."]})
    row = prepare_sft_dataset(ds, tok, 64)[0]
    assert row["input_ids"].count(eos) == 1 and row["labels"][-1] == eos
    assert trained_text(tok, row) == " Paris.<|endoftext|>"
