"""posttrain.data.formats: format detection from the columns, rendering conversations with chat templates."""

from __future__ import annotations

import pytest
from datasets import Dataset, DatasetDict

from helpers import CHATML, conv
from posttrain.data import (
    SIMPLE_CHAT_TEMPLATE,
    DataError,
    detect_format,
    ensure_chat_template,
    is_conversational,
    render_chat,
)

# --------------------------------------------------------------------------------------------
# formats and chat templates
# --------------------------------------------------------------------------------------------


def test_detect_format_and_is_conversational():
    cases = {
        "prompt": {"prompt": ["hi"]},
        "preference": {"prompt": ["q"], "chosen": ["a"], "rejected": ["b"]},
        "text": {"text": ["hello"]},
        "messages": {"messages": [conv(("user", "hi"), ("assistant", "yo"))]},
        "prompt_completion": {"prompt": ["q"], "completion": ["a"]},
        "tokenized": {"input_ids": [[1, 2]]},
    }
    for fmt, columns in cases.items():
        assert detect_format(Dataset.from_dict(columns)) == fmt
    assert detect_format(Dataset.from_dict({"body": ["x"]}), dataset_text_field="body") == "text"
    assert detect_format(Dataset.from_dict({"chosen": ["a"], "rejected": ["b"]})) == "preference"
    with pytest.raises(DataError, match=r"cannot tell the format from the columns \['foo'\]"):
        detect_format(Dataset.from_dict({"foo": ["x"]}))
    with pytest.raises(DataError, match="select a split"):
        detect_format(DatasetDict({"train": Dataset.from_dict({"prompt": ["x"]})}))

    assert is_conversational({"prompt": conv(("user", "hi"))})
    assert is_conversational({"chosen": conv(("assistant", "a")), "rejected": conv(("assistant", "b"))})
    assert not is_conversational({"prompt": "hi", "completion": "there"})
    assert not is_conversational({"messages": []})


def test_fallback_chat_template(tok):
    tok.chat_template = None
    text = render_chat(conv(("system", "Be brief."), ("user", "Hi")), tok, add_generation_prompt=True)
    assert text == "System: Be brief.\n\nUser: Hi\n\nAssistant:"
    assert tok.chat_template == SIMPLE_CHAT_TEMPLATE
    ensure_chat_template(tok, CHATML)
    assert render_chat(conv(("user", "x")), tok) == "<|im_start|>user\nx<|im_end|>\n"
