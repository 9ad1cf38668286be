"""A model whose class defines its own generate() (a subclass, remote code, or a patched
GenerationMixin.generate, as TRL's tests do), or a run whose generation_kwargs hold settings the engine
does not implement (beam search, no_repeat_ngram_size, ...), is sampled through generate(), held to the
rollout contract: cut after the first stop id, padding after it, masks from lengths, log-probs from a
forward."""

from __future__ import annotations

import warnings
from unittest.mock import patch

import pytest
import torch
from transformers import GenerationMixin

import posttrain.trainers.grpo as grpo
from helpers import flat, grpo_config, length_reward, prompt_dataset, rloo_config, train_and_last_log
from posttrain.models import CausalLMWithValueHead
from posttrain.rollout import SamplingConfig, generate, model_generate, position_ids_from_mask
from posttrain.testing import build_tiny_causal_lm
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.rloo import RLOOTrainer

pytestmark = pytest.mark.usefixtures("one_thread")


def with_own_generate(model, fake):
    """`model` as an instance of a subclass whose generate() is `fake(self, input_ids, **kwargs)`."""
    model.__class__ = type(f"Own{type(model).__name__}", (type(model),), {"generate": fake})
    return model


def prompts(tokenizer):
    ids = torch.tensor([[tokenizer.pad_token_id, 5, 6], [7, 8, 9]])
    return ids, ids != tokenizer.pad_token_id


def test_the_rollout_holds_the_completions_of_the_models_generate(tiny_tokenizer):
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    calls = []
    # per prompt row (k = 2 samples each): truncated; EOS mid-way then junk; EOS at the limit; stop id 11 first
    completions = torch.tensor([[20, 21, 22, 23], [24, eos, 30, 31], [25, 26, 27, eos], [11, 12, eos, 13]])

    def fake(self, input_ids, **kwargs):
        calls.append((input_ids.clone(), kwargs))
        return torch.cat([input_ids, completions[: input_ids.size(0)]], dim=1)

    model = with_own_generate(build_tiny_causal_lm(tiny_tokenizer), fake).eval()
    ids, mask = prompts(tiny_tokenizer)
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.7, top_k=5, stop_token_ids=(eos, 11))
    with pytest.warns(UserWarning, match="is not transformers' GenerationMixin.generate"):
        out = generate(model, ids, mask, sampling, pad_token_id=pad, num_samples=2, return_entropy=True)

    (call_ids, kwargs) = calls[0]
    assert len(calls) == 1 and torch.equal(call_ids, ids.repeat_interleave(2, 0))
    assert torch.equal(kwargs["attention_mask"], mask.repeat_interleave(2, 0).long())
    config = kwargs["generation_config"]
    assert (config.max_new_tokens, config.do_sample, config.temperature, config.top_k) == (4, True, 0.7, 5)
    assert list(config.eos_token_id) == [eos, 11] and config.pad_token_id == pad

    assert out.completion_lengths.tolist() == [4, 2, 4, 1]
    assert out.ended.tolist() == [False, True, True, True]
    assert out.completion_ids.tolist() == [
        [20, 21, 22, 23],
        [24, eos, pad, pad],
        [25, 26, 27, eos],
        [11, pad, pad, pad],
    ]
    assert out.completion_mask.tolist() == [[True] * 4, [True, True, False, False], [True] * 4, [True] + [False] * 3]
    # log-probs and entropy: the temperature-scaled full distribution of one forward, 0 off the mask
    full = torch.cat([out.prompt_ids.masked_fill(~out.prompt_mask, 0), out.completion_ids], 1)
    attention = torch.cat([out.prompt_mask, out.completion_mask], 1)
    with torch.no_grad():
        logits = model(
            input_ids=full, attention_mask=attention.long(), position_ids=position_ids_from_mask(attention)
        ).logits
    logp = torch.log_softmax(logits[:, 2:-1].float() / 0.7, -1)
    expected = logp.gather(-1, out.completion_ids[..., None]).squeeze(-1) * out.completion_mask
    torch.testing.assert_close(out.logprobs, expected, rtol=1e-5, atol=1e-5)
    entropy = -(logp.exp() * logp).sum(-1) * out.completion_mask
    torch.testing.assert_close(out.entropy, entropy, rtol=1e-5, atol=1e-5)


def test_a_generator_state_gives_the_same_tokens_and_the_global_stream_is_left_alone(tiny_tokenizer):
    def sampled_by_transformers(self, input_ids, **kwargs):  # an override that samples with the real generate
        return super(type(self), self).generate(input_ids, **kwargs)

    model = with_own_generate(build_tiny_causal_lm(tiny_tokenizer), sampled_by_transformers).eval()
    ids, mask = prompts(tiny_tokenizer)
    sampling = SamplingConfig(max_new_tokens=6, stop_token_ids=())
    pad = tiny_tokenizer.pad_token_id

    def run(seed):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            g = torch.Generator().manual_seed(seed)
            return generate(model, ids, mask, sampling, pad_token_id=pad, num_samples=3, generator=g)

    torch.manual_seed(123)
    first = run(0)
    global_draw = torch.rand(1)
    torch.manual_seed(123)
    again = run(0)
    assert torch.equal(torch.rand(1), global_draw)  # the caller's default generator did not move
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert first.completion_ids.shape == (6, 6) and not first.ended.any()
    assert not torch.equal(run(1).completion_ids, first.completion_ids)


def test_a_generate_that_breaks_the_contract_is_named(tiny_tokenizer):
    def only_new_tokens(self, input_ids, **kwargs):
        return torch.ones(input_ids.size(0), 3, dtype=torch.long)

    model = with_own_generate(build_tiny_causal_lm(tiny_tokenizer), only_new_tokens)
    ids, mask = prompts(tiny_tokenizer)
    with (
        warnings.catch_warnings(),
        pytest.raises(ValueError, match=r"OwnLlamaForCausalLM\.generate returned \(2, 3\) for 2 prompts of 3"),
    ):
        warnings.simplefilter("ignore")
        generate(model, ids, mask, SamplingConfig(max_new_tokens=4), pad_token_id=tiny_tokenizer.pad_token_id)


def test_only_a_replaced_generate_leaves_the_engine(tiny_tokenizer):
    model = build_tiny_causal_lm(tiny_tokenizer)
    assert model_generate(model) is None  # transformers' own generate: posttrain's engine
    assert model_generate(CausalLMWithValueHead(model)) is None  # the wrapper delegates, it is not a model
    with patch("transformers.generation.utils.GenerationMixin.generate") as mocked:
        assert model_generate(model) is not None
        model_generate(model)(torch.ones(1, 2, dtype=torch.long))
        assert mocked.call_count == 1


def test_grpo_trains_on_the_ended_completions_of_a_patched_generate(tmp_path, tiny_tokenizer, monkeypatch):
    """TRL's mask_truncated_completions test: generate() patched to return one truncated completion,
    one that ends mid-way and one that ends at the limit, per group of 3; only the two that ended train."""
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    completions = torch.tensor([[20, 21, 22, 23], [24, 25, eos, pad], [26, 27, 28, eos]])

    def fake_generate(input_ids, **kwargs):
        return torch.cat([input_ids, completions.repeat(input_ids.size(0) // 3, 1)], dim=1)

    cfg = grpo_config(
        tmp_path, num_generations=3, per_device_train_batch_size=6, total_episodes=12, response_length=4,
        mask_truncated_completions=True, learning_rate=0.1,
    )  # fmt: skip
    masks = []
    loss = grpo.grpo_policy_loss
    monkeypatch.setattr(grpo, "grpo_policy_loss", lambda lp, old, adv, mask, *a, **kw: masks.append(mask) or loss(
        lp, old, adv, mask, *a, **kw))  # fmt: skip
    policy = build_tiny_causal_lm(tiny_tokenizer)
    before = flat(policy).clone()
    trainer = GRPOTrainer(policy, length_reward, cfg, prompt_dataset(8), processing_class=tiny_tokenizer)
    with (
        patch("transformers.generation.utils.GenerationMixin.generate", side_effect=fake_generate) as mocked,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        last = train_and_last_log(trainer)
    assert mocked.call_count == 2  # one call per rollout batch of 6 rows
    assert last["val/num_eos_tokens"] == 4 and last["completions/mean_length"] == pytest.approx((4 + 3 + 4) / 3)
    # the loss sees the two completions of each group that ended, whole, and nothing of the truncated one
    assert [sorted(m.sum(-1).tolist()) for m in masks] == [[0, 0, 3, 3, 4, 4]] * 2
    assert not torch.equal(before, flat(trainer.model))


def test_settings_the_engine_lacks_reach_transformers_generate(tiny_tokenizer):
    """no_repeat_ngram_size=1 (transformers' processor; the engine has none): no completion token repeats a
    token of its row, prompt included, and the log-probs are the forward's, as for the engine's rollouts."""
    model = build_tiny_causal_lm(tiny_tokenizer).eval()
    ids, mask = prompts(tiny_tokenizer)
    sampling = SamplingConfig(max_new_tokens=12, stop_token_ids=(), generation_kwargs={"no_repeat_ngram_size": 1})
    g = torch.Generator().manual_seed(0)
    out = generate(model, ids, mask, sampling, pad_token_id=tiny_tokenizer.pad_token_id, num_samples=2, generator=g)
    assert out.completion_ids.shape == (4, 12) and out.completion_mask.all()
    for row in range(4):
        tokens = out.prompt_ids[row][out.prompt_mask[row]].tolist() + out.completion_ids[row].tolist()
        assert len(set(tokens)) == len(tokens)
    plain = SamplingConfig(max_new_tokens=12, stop_token_ids=())
    engine = generate(model, ids, mask, plain, pad_token_id=tiny_tokenizer.pad_token_id, num_samples=2, generator=g)
    assert any(len(set(r.tolist())) < 12 for r in engine.completion_ids)  # the engine's own rollout does repeat


def test_rloo_trains_with_beam_search_settings(tmp_path, tiny_tokenizer):
    """TRL's test_training_with_generation_kwargs: num_beams=2 and length_penalty with sampling."""
    calls = []
    original = GenerationMixin.generate

    def spy(self, *args, **kwargs):
        calls.append(kwargs["generation_config"])
        return original(self, *args, **kwargs)

    with pytest.warns(UserWarning, match="length_penalty, num_beams: posttrain's rollout engine does not implement"):
        cfg = rloo_config(
            tmp_path, num_generations=2, learning_rate=0.1,
            generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1},
        )  # fmt: skip
    policy = build_tiny_causal_lm(tiny_tokenizer)
    before = flat(policy).clone()
    trainer = RLOOTrainer(policy, length_reward, cfg, prompt_dataset(8), processing_class=tiny_tokenizer)
    with patch.object(GenerationMixin, "generate", spy):
        train_and_last_log(trainer)
    assert calls and all((c.num_beams, c.length_penalty, c.top_k, c.do_sample) == (2, -0.1, 50, True) for c in calls)
    assert not torch.equal(before, flat(trainer.model))
