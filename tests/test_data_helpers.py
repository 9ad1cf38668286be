"""TRL's public data helpers (posttrain.data.helpers, exported from posttrain): chat templates on
standard and conversational rows, prompt extraction, unpairing, ChatML conversion, packing and
truncation, each against outputs written out by hand."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
from datasets import Dataset, DatasetDict

import posttrain
from posttrain import (
    DataError,
    apply_chat_template,
    extract_prompt,
    is_conversational,
    maybe_apply_chat_template,
    maybe_convert_to_chatml,
    maybe_extract_prompt,
    maybe_unpair_preference_dataset,
    pack_dataset,
    pack_examples,
    truncate_dataset,
    unpair_preference_dataset,
)
from posttrain.data import best_fit_decreasing

# ChatML, with the names of the tools in a system block when tools are given.
CHATML = (
    "{% if tools %}{{ '<|im_start|>system\\nTools:' }}{% for t in tools %}{{ ' ' + t['function']['name'] }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama 2: BOS, [INST] user turns, assistant turns after a space and closed by EOS; no generation prompt.
LLAMA2 = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
)
# Zephyr: <|role|> headers, every turn closed by EOS.
ZEPHYR = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# DeepSeek-R1 style: the generation prompt opens a <think> block that an answered turn does not have.
THINK = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<|User|>' + m['content'] }}"
    "{% else %}{{ '<|Assistant|>' + m['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|Assistant|><think>\\n' }}{% endif %}"
)
EOS = "<|endoftext|>"  # the tiny tokenizer's EOS and BOS


def user(text):
    return [{"role": "user", "content": text}]


def assistant(text):
    return [{"role": "assistant", "content": text}]


@pytest.fixture
def tokenizer(tiny_tokenizer):
    """A private copy whose chat_template each test sets."""
    return copy.deepcopy(tiny_tokenizer)


def with_template(tokenizer, template):
    tokenizer.chat_template = template
    return tokenizer


# --------------------------------------------------------------------------------------------
# is_conversational
# --------------------------------------------------------------------------------------------


def test_is_conversational_standard_conversational_and_other_rows():
    assert is_conversational({"prompt": user("What color is the sky?")})
    assert is_conversational({"chosen": user("q") + assistant("a"), "rejected": user("q") + assistant("b")})
    assert is_conversational({"messages": user("hi") + assistant("yo"), "id": 3})
    assert not is_conversational({"prompt": "The sky is"})
    assert not is_conversational({"prompt": "The sky is", "completion": " blue.", "label": True})
    assert not is_conversational({"input_ids": [1, 2, 3]})  # no text field: not conversational
    assert not is_conversational({"messages": []})


def test_a_row_neither_standard_nor_conversational_names_its_keys():
    with pytest.raises(DataError, match=r"prompt \(string\), completion \(conversation\)") as err:
        is_conversational({"prompt": "The sky is", "completion": assistant("blue")})
    assert "neither standard nor conversational" in str(err.value)
    assert "prompt, chosen, rejected, completion, messages" in str(err.value)
    with pytest.raises(DataError, match=r"prompt \(int\)"):
        is_conversational({"prompt": 7})
    with pytest.raises(DataError, match=r"messages \(list\)"):
        is_conversational({"messages": ["hi", "yo"]})
    with pytest.raises(ValueError):  # DataError is a ValueError
        maybe_apply_chat_template({"prompt": user("q"), "completion": "a"}, None)


# --------------------------------------------------------------------------------------------
# apply_chat_template / maybe_apply_chat_template
# --------------------------------------------------------------------------------------------


def test_chatml_every_layout(tokenizer):
    tok = with_template(tokenizer, CHATML)
    q = "<|im_start|>user\nq<|im_end|>\n"
    gen = "<|im_start|>assistant\n"
    assert apply_chat_template({"messages": user("q") + assistant("a")}, tok) == {"text": q + gen + "a<|im_end|>\n"}
    assert apply_chat_template({"prompt": user("q")}, tok) == {"prompt": q + gen}
    assert apply_chat_template({"prompt": user("q"), "completion": assistant("a")}, tok) == {
        "prompt": q + gen,
        "completion": "a<|im_end|>\n",
    }
    assert apply_chat_template({"prompt": user("q"), "chosen": assistant("a"), "rejected": assistant("b")}, tok) == {
        "prompt": q + gen,
        "chosen": "a<|im_end|>\n",
        "rejected": "b<|im_end|>\n",
    }
    # Implicit prompt: each answer is rendered whole.
    assert apply_chat_template({"chosen": user("q") + assistant("a"), "rejected": user("q") + assistant("b")}, tok) == {
        "chosen": q + gen + "a<|im_end|>\n",
        "rejected": q + gen + "b<|im_end|>\n",
    }
    # Unpaired preference: the label passes through; other keys are left out of the result.
    row = {"prompt": user("q"), "completion": assistant("a"), "label": False, "id": 4}
    assert apply_chat_template(row, tok) == {"prompt": q + gen, "completion": "a<|im_end|>\n", "label": False}


def test_prompt_ending_with_assistant_or_tool_turn(tokenizer):
    tok = with_template(tokenizer, CHATML)
    # An assistant turn last: continued (continue_final_message), not closed and no new header.
    prompt = user("q") + assistant("The answer is")
    assert apply_chat_template({"prompt": prompt}, tok) == {
        "prompt": "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nThe answer is"
    }
    # A tool turn last: answered, so the generation prompt is added.
    prompt = user("q") + [{"role": "tool", "content": "42"}]
    assert apply_chat_template({"prompt": prompt}, tok)["prompt"] == (
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(DataError, match="ends with a 'system' message"):
        apply_chat_template({"prompt": [{"role": "system", "content": "Be brief."}]}, tok)


def test_llama2_template_keeps_the_space_and_eos_with_the_answer(tokenizer):
    tok = with_template(tokenizer, LLAMA2)
    assert apply_chat_template({"prompt": user("q"), "completion": assistant("a")}, tok) == {
        "prompt": f"{EOS}[INST] q [/INST]",
        "completion": f" a{EOS}",
    }
    assert apply_chat_template({"messages": user("q") + assistant("a") + user("r")}, tok) == {
        "text": f"{EOS}[INST] q [/INST] a{EOS}[INST] r [/INST]"
    }
    row = {"prompt": user("q"), "chosen": assistant("yes"), "rejected": assistant("no")}
    assert apply_chat_template(row, tok) == {
        "prompt": f"{EOS}[INST] q [/INST]",
        "chosen": f" yes{EOS}",
        "rejected": f" no{EOS}",
    }


def test_zephyr_template(tokenizer):
    tok = with_template(tokenizer, ZEPHYR)
    row = {"prompt": [{"role": "system", "content": "Be brief."}] + user("q"), "completion": assistant("a")}
    assert apply_chat_template(row, tok) == {
        "prompt": f"<|system|>\nBe brief.{EOS}\n<|user|>\nq{EOS}\n<|assistant|>\n",
        "completion": f"a{EOS}\n",
    }
    assert apply_chat_template({"messages": user("hi")}, tok) == {"text": f"<|user|>\nhi{EOS}\n"}


def test_prompt_is_the_common_prefix_when_the_generation_prompt_differs(tokenizer):
    # The prompt alone renders "<|Assistant|><think>\n", prompt + answer renders "<|Assistant|>a":
    # the prompt keeps only what both share, so prompt + completion is the full rendering.
    tok = with_template(tokenizer, THINK)
    assert apply_chat_template({"prompt": user("q"), "completion": assistant("a")}, tok) == {
        "prompt": "<|User|>q<|Assistant|>",
        "completion": "a<|end|>",
    }


def test_tools_and_template_kwargs_reach_the_template(tokenizer):
    tok = with_template(tokenizer, CHATML + "{% if shout is defined and shout %}{{ '!' }}{% endif %}")
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    clock = {"type": "function", "function": {"name": "get_time", "description": "Time.", "parameters": {}}}
    out = apply_chat_template({"messages": user("q")}, tok, tools=[weather, clock])
    assert out == {"text": "<|im_start|>system\nTools: get_weather get_time<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"}
    # Tools reach the prompt and completion renderings too; the tool block stays in the prompt.
    out = maybe_apply_chat_template({"prompt": user("q"), "completion": assistant("a")}, tok, tools=[weather])
    assert out == {
        "prompt": "<|im_start|>system\nTools: get_weather<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
        "<|im_start|>assistant\n",
        "completion": "a<|im_end|>\n",
    }
    # An empty tool list renders like no tools (Llama's template would print its tool preamble).
    assert apply_chat_template({"messages": user("q")}, tok, tools=[]) == {"text": "<|im_start|>user\nq<|im_end|>\n"}
    # Keyword arguments and the row's own chat_template_kwargs reach the template.
    assert apply_chat_template({"messages": user("q")}, tok, shout=True)["text"].endswith("<|im_end|>\n!")
    row = {"messages": user("q"), "chat_template_kwargs": {"shout": True}}
    assert apply_chat_template(row, tok)["text"].endswith("<|im_end|>\n!")


def test_maybe_apply_chat_template_leaves_standard_rows_and_maps_datasets(tokenizer):
    tok = with_template(tokenizer, CHATML)
    row = {"prompt": "The sky is", "completion": " blue."}
    assert maybe_apply_chat_template(row, tok) is row
    dataset = Dataset.from_list(
        [
            {"prompt": user("q1"), "completion": assistant("a1")},
            {"prompt": user("q2"), "completion": assistant("a2")},
        ]
    )
    out = dataset.map(maybe_apply_chat_template, fn_kwargs={"tokenizer": tok})
    assert out[:] == {
        "prompt": [
            "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n",
            "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n",
        ],
        "completion": ["a1<|im_end|>\n", "a2<|im_end|>\n"],
    }


def test_apply_chat_template_rejects_bad_keys_and_standard_rows(tokenizer):
    tok = with_template(tokenizer, CHATML)
    with pytest.raises(DataError, match=r"the keys \['completion'\]; it accepts .*prompt \+ completion") as err:
        apply_chat_template({"completion": assistant("a")}, tok)
    assert "chosen + rejected" in str(err.value) and "messages" in str(err.value)
    with pytest.raises(DataError, match=r"\['chosen', 'messages', 'rejected'\]"):
        apply_chat_template({"messages": user("q"), "chosen": assistant("a"), "rejected": assistant("b")}, tok)
    with pytest.raises(DataError, match="standard .* use maybe_apply_chat_template"):
        apply_chat_template({"prompt": "The sky is"}, tok)


# --------------------------------------------------------------------------------------------
# extract_prompt / maybe_extract_prompt / maybe_convert_to_chatml
# --------------------------------------------------------------------------------------------


def test_extract_prompt_standard_and_conversational():
    # "The sky is " is shared; the space before the first difference stays with the answers.
    assert extract_prompt({"chosen": "The sky is blue.", "rejected": "The sky is green."}) == {
        "prompt": "The sky is",
        "chosen": " blue.",
        "rejected": " green.",
    }
    row = {"chosen": user("q") + assistant("a"), "rejected": user("q") + assistant("b")}
    assert extract_prompt(row) == {"prompt": user("q"), "chosen": assistant("a"), "rejected": assistant("b")}
    # One answer a prefix of the other: as in TRL, the last shared element stays with the answers.
    assert extract_prompt({"chosen": "abc", "rejected": "abcd"}) == {"prompt": "ab", "chosen": "c", "rejected": "cd"}
    # Different from the first character: no prompt (TRL would look at the last character here).
    assert extract_prompt({"chosen": "yes ", "rejected": "no"}) == {"prompt": "", "chosen": "yes ", "rejected": "no"}


def test_maybe_extract_prompt():
    row = {"chosen": user("q") + assistant("a"), "rejected": user("q") + assistant("b")}
    assert maybe_extract_prompt(row) == {"prompt": user("q"), "chosen": assistant("a"), "rejected": assistant("b")}
    # A text prompt next to full conversations is replaced by the conversational one.
    assert maybe_extract_prompt({"prompt": "q", **row}) == {
        "prompt": user("q"),
        "chosen": assistant("a"),
        "rejected": assistant("b"),
    }
    explicit = {"prompt": user("q"), "chosen": assistant("a"), "rejected": assistant("b")}
    assert maybe_extract_prompt(explicit) is explicit
    standard = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    assert maybe_extract_prompt(standard) is standard
    not_a_pair = {"prompt": "q", "completion": "a"}
    assert maybe_extract_prompt(not_a_pair) is not_a_pair


def test_maybe_convert_to_chatml():
    row = {
        "conversations": [{"from": "user", "value": "What color is the sky?"}, {"from": "assistant", "value": "Blue."}]
    }
    assert maybe_convert_to_chatml(row) == {
        "messages": [{"role": "user", "content": "What color is the sky?"}, {"role": "assistant", "content": "Blue."}]
    }
    row = {"prompt": [{"from": "user", "value": "q"}], "completion": [{"from": "assistant", "value": "a"}]}
    assert maybe_convert_to_chatml(row) == {"prompt": user("q"), "completion": assistant("a")}
    standard = {"prompt": "q", "completion": "a"}
    assert maybe_convert_to_chatml(dict(standard)) == standard


# --------------------------------------------------------------------------------------------
# unpair_preference_dataset
# --------------------------------------------------------------------------------------------


def test_unpair_preference_dataset_standard_with_extra_columns():
    pairs = Dataset.from_dict(
        {
            "prompt": ["The sky is", "The sun is"],
            "chosen": [" blue.", " hot."],
            "rejected": [" green.", " cold."],
            "id": [0, 1],
        }
    )
    out = unpair_preference_dataset(pairs)
    # Chosen rows first (label True), then rejected rows (label False); extra columns copied.
    assert out.to_list() == [
        {"prompt": "The sky is", "completion": " blue.", "label": True, "id": 0},
        {"prompt": "The sun is", "completion": " hot.", "label": True, "id": 1},
        {"prompt": "The sky is", "completion": " green.", "label": False, "id": 0},
        {"prompt": "The sun is", "completion": " cold.", "label": False, "id": 1},
    ]
    assert maybe_unpair_preference_dataset(pairs, desc="Unpairing").to_list() == out.to_list()


def test_unpair_conversational_implicit_prompt_and_dataset_dict():
    pairs = Dataset.from_list([{"chosen": user("q") + assistant("a"), "rejected": user("q") + assistant("b")}])
    splits = maybe_unpair_preference_dataset(DatasetDict({"train": pairs, "test": pairs}))
    assert set(splits["test"].column_names) == {"completion", "label"}
    assert splits["train"].to_list() == [
        {"completion": user("q") + assistant("a"), "label": True},
        {"completion": user("q") + assistant("b"), "label": False},
    ]
    unpaired = Dataset.from_dict({"prompt": ["q"], "completion": ["a"], "label": [True]})
    assert maybe_unpair_preference_dataset(unpaired) is unpaired


# --------------------------------------------------------------------------------------------
# pack_dataset / pack_examples / truncate_dataset
# --------------------------------------------------------------------------------------------

ROWS = {
    "input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]],
    "attention_mask": [[1, 1, 1, 0, 0], [1, 0], [1, 1, 0], [1]],
}


def test_pack_dataset_bfd_truncates_overlong_rows():
    # seq_length 4: lengths after truncation [4, 2, 3, 1], placed longest first:
    #   row 0 (4) -> bin 0, full;  row 2 (3) -> new bin 1 (free 1);  row 1 (2) -> no room, new bin 2 (free 2);
    #   row 3 (1) -> fits bin 1 (free 1) and bin 2 (free 2): best fit is bin 1.  Token 5 is dropped.
    packed = pack_dataset(Dataset.from_dict(ROWS), seq_length=4, strategy="bfd")
    assert packed[:] == {
        "input_ids": [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]],
        "attention_mask": [[1, 1, 1, 0], [1, 1, 0, 1], [1, 0]],
        "seq_lengths": [[4], [3, 1], [2]],
    }


def test_pack_dataset_bfd_split_keeps_every_token():
    # Row 0 becomes pieces [1 2 3 4] and [5]; pieces sorted by length (stable): [1..4], [8 9 10], [6 7], [5], [11]:
    #   [1..4] -> bin 0;  [8 9 10] -> bin 1 (free 1);  [6 7] -> bin 2 (free 2);  [5] -> bin 1 (best fit, free 1);
    #   [11] -> bin 2 (the only room left).
    packed = pack_dataset(Dataset.from_dict(ROWS), seq_length=4, strategy="bfd_split")
    assert packed[:] == {
        "input_ids": [[1, 2, 3, 4], [8, 9, 10, 5], [6, 7, 11]],
        "attention_mask": [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1]],
        "seq_lengths": [[4], [3, 1], [2, 1]],
    }


def test_pack_dataset_bfd_ties_go_to_the_bin_that_had_the_room_first():
    # Lengths [1, 7, 2, 9, 1, 2, 7, 6, 4, 5, 4], seq_length 10, placed 9, 7, 7, 6, 5, 4, 4, 2, 2, 1, 1:
    #   9 (row 3) -> bin 0 (free 1)   7 (row 1) -> bin 1 (free 3)   7 (row 6) -> bin 2 (free 3)
    #   6 (row 7) -> bin 3 (free 4)   5 (row 9) -> bin 4 (free 5)   4 (row 8) -> bin 3 (free 0)
    #   4 (row 10) -> bin 4 (free 1)  2 (row 2) -> bin 1 (free 1)   2 (row 5) -> bin 2 (free 1)
    #   1 (row 0) -> bins 0, 4, 1, 2 have free 1, in the order they got it: bin 0
    #   1 (row 4) -> bins 4, 1, 2: bin 4 (TRL's rule; the oldest bin, 1, is what posttrain's SFT packing takes).
    lengths = [1, 7, 2, 9, 1, 2, 7, 6, 4, 5, 4]
    expected = [[3, 0], [1, 2], [6, 5], [7, 8], [9, 10, 4]]
    assert best_fit_decreasing(lengths, 10, fifo_ties=True) == expected
    assert best_fit_decreasing(lengths, 10) == [[3, 0], [1, 2, 4], [6, 5], [7, 8], [9, 10]]
    rows = [[row] * n for row, n in enumerate(lengths)]  # row r is n copies of the token r
    packed = pack_dataset(Dataset.from_dict({"input_ids": rows}), seq_length=10)
    assert packed["input_ids"] == [[t for r in bin_ for t in rows[r]] for bin_ in expected]
    assert packed["seq_lengths"] == [[lengths[r] for r in bin_] for bin_ in expected]


def test_pack_dataset_wrapped_per_map_batch_and_keeps_the_format():
    # All tokens 1..11 cut every 3: [1 2 3] [4 5 6] [7 8 9] [10 11].
    data = Dataset.from_dict(ROWS)
    assert pack_dataset(data, seq_length=3, strategy="wrapped")["input_ids"] == [
        [1, 2, 3],
        [4, 5, 6],
        [7, 8, 9],
        [10, 11],
    ]
    # Map batches of 2 rows are packed separately: [1..5, 6 7] then [8 9 10, 11].
    packed = pack_dataset(data, seq_length=3, strategy="wrapped", map_kwargs={"batch_size": 2})
    assert packed[:] == {
        "input_ids": [[1, 2, 3], [4, 5, 6], [7], [8, 9, 10], [11]],
        "attention_mask": [[1, 1, 1], [0, 0, 1], [0], [1, 1, 0], [1]],
    }
    torch_packed = pack_dataset(data.with_format("torch"), seq_length=4)
    assert torch_packed.format["type"] == "torch"
    assert torch_packed[1]["input_ids"].tolist() == [8, 9, 10, 11]
    assert torch_packed[1]["seq_lengths"].tolist() == [3, 1]


def test_pack_dataset_drops_empty_rows():
    data = Dataset.from_dict({"input_ids": [[], [1, 2], []]})
    assert pack_dataset(data, seq_length=4)[:] == {"input_ids": [[1, 2]], "seq_lengths": [[2]]}
    # A map batch of empty rows only packs to no rows (TRL's arrow `take` fails on it).
    packed = pack_dataset(data, seq_length=4, strategy="bfd_split", map_kwargs={"batch_size": 1})
    assert packed[:] == {"input_ids": [[1, 2]], "seq_lengths": [[2]]}


def test_pack_dataset_rejects_bad_input():
    with pytest.raises(ValueError, match="packing strategy 'ffd_split'"):  # ffd is TRL 0.19's (test_packing.py)
        pack_dataset(Dataset.from_dict(ROWS), seq_length=4, strategy="ffd_split")
    with pytest.raises(TypeError, match="column 'text' holds string"):
        pack_dataset(Dataset.from_dict({"input_ids": [[1]], "text": ["a"]}), seq_length=4)
    with pytest.raises(ValueError, match="column 'labels' has rows of other lengths"):
        pack_dataset(Dataset.from_dict({"input_ids": [[1, 2]], "labels": [[1]]}), seq_length=4)


def test_pack_examples_is_deprecated_wrapped_packing_of_a_batch():
    examples = {"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8]], "attention_mask": [[0, 1, 1], [0, 0, 1, 1], [1]]}
    with pytest.warns(DeprecationWarning, match="pack_dataset"):
        assert pack_examples(examples, seq_length=5) == {
            "input_ids": [[1, 2, 3, 4, 5], [6, 7, 8]],
            "attention_mask": [[0, 1, 1, 0, 0], [1, 1, 1]],
        }
    with pytest.warns(DeprecationWarning):
        assert pack_examples(examples, seq_length=2) == {
            "input_ids": [[1, 2], [3, 4], [5, 6], [7, 8]],
            "attention_mask": [[0, 1], [1, 0], [0, 1], [1, 1]],
        }


def test_truncate_dataset_cuts_list_columns_only():
    data = Dataset.from_dict(
        {"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8]], "attention_mask": [[0, 1, 1], [0, 0, 1, 1], [1]], "id": [0, 1, 2]}
    )
    assert truncate_dataset(data, max_length=2)[:] == {
        "input_ids": [[1, 2], [4, 5], [8]],
        "attention_mask": [[0, 1], [0, 0], [1]],
        "id": [0, 1, 2],
    }
    splits = truncate_dataset(DatasetDict({"train": data}).with_format("torch"), 1, map_kwargs={"batch_size": 1})
    assert splits["train"].format["type"] == "torch"
    assert splits["train"][1]["input_ids"].tolist() == [4]


# --------------------------------------------------------------------------------------------
# exports
# --------------------------------------------------------------------------------------------


def test_helpers_are_exported_from_posttrain_without_heavy_imports():
    names = [
        "apply_chat_template",
        "maybe_apply_chat_template",
        "extract_prompt",
        "maybe_extract_prompt",
        "is_conversational",
        "unpair_preference_dataset",
        "maybe_unpair_preference_dataset",
        "maybe_convert_to_chatml",
        "pack_dataset",
        "pack_examples",
        "truncate_dataset",
    ]
    assert set(names) <= set(posttrain.__all__)
    code = (
        "import sys, posttrain\n"
        f"for name in {names!r}: getattr(posttrain, name)\n"
        "import posttrain.data\n"
        "print(','.join(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_trl_module_paths_data_utils_and_core():
    """`trl.data_utils` and `trl.core`'s masked statistics under posttrain's name, as TRL's tests and
    scripts import them; `posttrain.core` imports torch only when a masked statistic is asked for."""
    import posttrain.core
    import posttrain.data_utils
    from posttrain.data import helpers

    assert set(posttrain.data_utils.__all__) >= {"maybe_apply_chat_template", "pack_dataset", "truncate_dataset"}
    assert all(getattr(posttrain.data_utils, name) is getattr(helpers, name) for name in posttrain.data_utils.__all__)
    from posttrain.data_utils import is_conversational_from_value

    sharegpt = {"conversations": [{"from": "user", "value": "Hi"}, {"from": "assistant", "value": "Hello"}]}
    assert is_conversational_from_value(sharegpt)
    assert not is_conversational_from_value({"messages": [{"role": "user", "content": "Hi"}]})
    assert not is_conversational_from_value({"conversations": [{"role": "user", "content": "Hi"}]})
    assert not is_conversational_from_value({"text": "Hi"})

    import torch

    from posttrain.core import masked_mean, masked_var, masked_whiten

    values, mask = torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1, 1, 1, 0])
    assert masked_mean(values, mask).item() == 2.0  # (1 + 2 + 3) / 3
    assert masked_var(values, mask).item() == 1.0  # unbiased: (1 + 0 + 1) / (3 - 1)
    assert torch.allclose(masked_whiten(values, mask)[:3], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-6)
    with pytest.raises(AttributeError, match="no attribute 'masked_median'"):
        posttrain.core.masked_median  # noqa: B018
