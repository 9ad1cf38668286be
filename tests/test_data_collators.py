"""posttrain.data.collators: PromptCollator (left padding, masks from lengths)."""

from __future__ import annotations

import torch
from datasets import Dataset

from posttrain.data import PromptCollator, prepare_prompt_dataset


def test_prompt_collator_left_pads_with_masks_from_lengths(tiny_tokenizer_pad_eos):
    tok = tiny_tokenizer_pad_eos
    eos = tok.eos_token_id
    assert tok.pad_token_id == eos
    # The second prompt ends with a real EOS token: with pad == eos it must stay unmasked.
    rows = [
        {"input_ids": [5, 6, 7], "prompt": "a", "solution": 1},
        {"input_ids": [8, eos], "prompt": "b", "solution": 2},
        {"input_ids": [eos], "prompt": "c", "solution": 3},
    ]
    batch = PromptCollator(tok.pad_token_id)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [eos, 8, eos], [eos, eos, eos]]
    assert batch["attention_mask"].dtype == torch.bool
    assert batch["attention_mask"].tolist() == [[True] * 3, [False, True, True], [False, False, True]]
    assert batch["prompt"] == ["a", "b", "c"] and batch["solution"] == [1, 2, 3]


def test_prompt_collator_on_prepared_dataset(tok):
    ds = prepare_prompt_dataset(Dataset.from_dict({"prompt": ["Hello world, this is long", "Hi"]}), tok)
    batch = PromptCollator(tok.pad_token_id)([ds[0], ds[1]])
    lengths = batch["attention_mask"].sum(1).tolist()
    assert lengths == [len(ds[0]["input_ids"]), len(ds[1]["input_ids"])]
    assert batch["input_ids"][1, -lengths[1] :].tolist() == ds[1]["input_ids"]
    assert (batch["input_ids"][1, : -lengths[1]] == tok.pad_token_id).all()
