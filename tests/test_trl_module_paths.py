"""TRL's helpers under TRL's module paths, where TRL's tests and scripts import them:
`posttrain.trainer.grpo_trainer` (trl.trainer.grpo_trainer's batch helpers) and
`posttrain.experimental.ppo.ppo_trainer.batch_generation`."""

from __future__ import annotations

import pytest
import torch

from posttrain.trainer.grpo_trainer import (
    GRPOTrainer,
    RepeatRandomSampler,
    RepeatSampler,
    shuffle_tensor_dict,
    split_tensor_dict,
)
from posttrain.trainers.grpo import GRPOTrainer as Trainer


def test_repeat_sampler_in_order_by_hand():
    # batches of 3 distinct indices (the 7th item does not fill one and is dropped), each index twice in a
    # row, each batch twice in a row
    sampler = RepeatSampler(list("abcdefg"), mini_repeat_count=2, batch_size=3, repeat_count=2, shuffle=False)
    expected = [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 3, 3, 4, 4, 5, 5]
    assert list(sampler) == expected and len(sampler) == 24
    assert list(RepeatSampler(range(3), mini_repeat_count=1, shuffle=False)) == [0, 1, 2]


def test_repeat_sampler_shuffles_with_its_own_seeded_generator():
    a = list(RepeatSampler(range(8), mini_repeat_count=2, batch_size=2, repeat_count=3, seed=7))
    torch.manual_seed(0)  # the global generator plays no part
    b = list(RepeatSampler(range(8), mini_repeat_count=2, batch_size=2, repeat_count=3, seed=7))
    assert a == b and len(a) == 8 * 2 * 3 and sorted(set(a)) == list(range(8))
    for start in range(0, len(a), 12):  # one batch: 2 indices x 2, repeated 3 times
        block = a[start : start + 12]
        assert block[:4] * 3 == block and block[0] == block[1] and block[2] == block[3] != block[0]
    assert RepeatRandomSampler is RepeatSampler and GRPOTrainer is Trainer
    with pytest.raises(ValueError, match="mini_repeat_count must be >= 1"):
        RepeatSampler(range(3), mini_repeat_count=0)


def test_split_and_shuffle_tensor_dicts_keep_rows_together():
    x, y = torch.arange(12).reshape(6, 2), torch.arange(6)
    chunks = split_tensor_dict({"x": x, "y": y, "none": None}, 3)
    assert [c["y"].tolist() for c in chunks] == [[0, 1], [2, 3], [4, 5]]
    assert torch.equal(chunks[2]["x"], torch.tensor([[8, 9], [10, 11]])) and chunks[1]["none"] is None
    with pytest.raises(ValueError, match="cannot split 6 rows into 4 equal chunks"):
        split_tensor_dict({"x": x}, 4)
    torch.manual_seed(3)
    shuffled = shuffle_tensor_dict({"x": x, "y": y, "none": None})
    assert shuffled["none"] is None and sorted(shuffled["y"].tolist()) == list(range(6))
    assert torch.equal(shuffled["x"], x[shuffled["y"]])  # row i of x still goes with row i of y


def test_batch_generation_returns_queries_with_responses_and_their_scores(tiny_tokenizer):
    from transformers import GenerationConfig

    from posttrain.experimental.ppo.ppo_trainer import batch_generation
    from posttrain.testing import build_tiny_causal_lm

    model = build_tiny_causal_lm(tiny_tokenizer).eval()
    pad = tiny_tokenizer.pad_token_id
    queries = tiny_tokenizer(["Hello world", "Good morning to you", "Yes"], padding=True, return_tensors="pt")
    queries = queries["input_ids"]
    eos = tiny_tokenizer.eos_token_id
    config = GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=pad, eos_token_id=eos)
    query_responses, logits = batch_generation(model, queries, 2, pad, config)  # batches of 2 rows, then 1
    assert query_responses.shape == (3, queries.size(1) + 5)
    assert logits.shape == (3, 5, model.config.vocab_size)
    assert torch.equal(query_responses[:, : queries.size(1)], queries)
    # greedy: each generated token up to the row's EOS is the argmax of the scores returned for its
    # position; generate() pads a row after its EOS
    responses, greedy = query_responses[:, queries.size(1) :], logits.argmax(-1)
    for response, best in zip(responses, greedy):
        ends = (response == eos).nonzero()
        n = int(ends[0]) + 1 if len(ends) else response.numel()
        assert torch.equal(response[:n], best[:n]) and bool((response[n:] == pad).all())


def test_base_config_is_every_configs_base(monkeypatch, tmp_path):
    """TRL >= 1.0's `trl.trainer.base_config._BaseConfig`: its conftest forces use_cpu on every config by
    patching this class's __post_init__, which must reach each trainer's config."""
    from posttrain import GRPOConfig, OnlineDPOConfig, PPOConfig, RLOOConfig, SFTConfig, XPOConfig
    from posttrain.trainer.base_config import _BaseConfig

    original = _BaseConfig.__post_init__
    seen = []

    def forced(self):
        seen.append(type(self).__name__)
        self.use_cpu = True
        original(self)

    monkeypatch.setattr(_BaseConfig, "__post_init__", forced)
    for cls in (RLOOConfig, GRPOConfig, PPOConfig, OnlineDPOConfig, XPOConfig, SFTConfig):
        assert cls(output_dir=str(tmp_path)).use_cpu is True
    assert seen == ["RLOOConfig", "GRPOConfig", "PPOConfig", "OnlineDPOConfig", "XPOConfig", "SFTConfig"]
