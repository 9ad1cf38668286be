"""Completions of one prompt in one row (scoring.share_prompts): the packed layout by hand, the same
log-probs, entropies, gradients and reward scores as one row per completion, and the cases that keep
one row per completion."""

from __future__ import annotations

import pytest
import torch

from helpers import make_rollout
from posttrain import scoring
from posttrain.scoring import (
    SharedPrompts,
    _trimmed_inputs,
    completion_forward,
    completion_logprobs,
    forward_logprobs,
    reward_model_scores,
    share_prompts,
)
from posttrain.testing import build_tiny_causal_lm, build_tiny_reward_model


def test_layout_by_hand():
    # Rows 0 and 2 share prompt [7, 8]; row 1 has prompt [9] (one left pad). P' = 2, T' = 2.
    r = make_rollout([[7, 8], [9], [7, 8]], [[11, 12], [13], [14]], T=3, pad=1)
    ids, mask, _, P, Tc = _trimmed_inputs(r)
    assert (P, Tc) == (2, 2)
    group = torch.tensor([0, 1, 0])
    member = torch.tensor([0, 0, 1])
    s = SharedPrompts(ids, mask, P, Tc, torch.tensor([0, 1]), group, member)
    # [prompt | member 0 | member 1]; padding (ids 0 after _trimmed_inputs) where a segment is unused.
    assert s.ids.tolist() == [[7, 8, 11, 12, 14, 0], [0, 9, 13, 0, 0, 0]]
    # Prompt positions from its mask; each segment continues from the prompt's real length.
    assert s.positions.tolist() == [[0, 1, 2, 3, 2, 3], [0, 0, 1, 2, 1, 2]]
    # Group 0: member 1's token (column 4) sees the prompt and itself, not member 0's columns 2-3.
    m0 = s.mask[0, 0].int().tolist()
    assert m0 == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 1],  # member 1's padding: itself only
    ]
    # Group 1: the left pad (column 0) is no key for anyone but itself; member 1 does not exist.
    m1 = s.mask[1, 0].int().tolist()
    assert m1 == [
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    # Token 0 of every completion is predicted at the prompt's last column (1), token 1 at the
    # segment's first column: row 0 -> 2, row 1 -> 2 (its group's row), row 2 -> 4.
    assert s.index.tolist() == [[1, 2], [1, 2], [1, 4]]
    # Last real token: row 0 column 3, row 1 column 2, row 2 column 4; an empty completion reads the prompt's.
    assert s.last(torch.tensor([2, 1, 1])).tolist() == [3, 2, 4]
    assert s.last(torch.tensor([0, 1, 1])).tolist() == [1, 2, 4]


def _long_prompt_rollout(V: int, order: str):
    """Three prompts of 20-24 tokens (different left padding), short completions of 0-5 tokens: a group
    of 3, a group of 2 and a group of 1, rows in the given order."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (24, 20, 22)]
    members = {0: [5, 3, 0], 1: [4, 5], 2: [2]}
    rows = [(p, torch.randint(3, V, (n,), generator=g).tolist()) for p, ns in members.items() for n in ns]
    if order == "blocks":  # RLOO / GRPO-style: the k-th completion of every prompt, then the next
        rows = [rows[i] for i in (0, 3, 5, 1, 4, 2)]
    return make_rollout([prompts[p] for p, _ in rows], [c for _, c in rows], T=6, pad=1)


@pytest.fixture(scope="module")
def models(tiny_tokenizer):
    return {
        arch: (build_tiny_causal_lm(tiny_tokenizer, arch=arch), build_tiny_reward_model(tiny_tokenizer, arch=arch))
        for arch in ("llama", "gpt_neox")
    }


def _both(monkeypatch, fn):
    """fn() with prompts shared (the default) and with POSTTRAIN_SHARED_PROMPTS=off."""
    shared = fn()
    monkeypatch.setenv("POSTTRAIN_SHARED_PROMPTS", "off")
    usual = fn()
    monkeypatch.delenv("POSTTRAIN_SHARED_PROMPTS")
    return shared, usual


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("order", ["pairs", "blocks"])
@pytest.mark.parametrize("chunk_tokens", [None, 4])  # 4: the LM head in blocks of rows (the chunked form)
def test_same_logprobs_entropy_and_gradients(models, monkeypatch, arch, order, chunk_tokens):
    policy = models[arch][0]
    r = _long_prompt_rollout(policy.config.vocab_size, order)
    ids, mask, _, P, Tc = _trimmed_inputs(r)
    assert share_prompts(policy, ids, mask, P, Tc, lm_head=True) is not None  # the packed path is taken

    def run():
        policy.zero_grad(set_to_none=True)
        kwargs = {} if chunk_tokens is None else {"chunk_tokens": chunk_tokens}
        forward = completion_forward(policy, r, **kwargs)
        assert forward.chunked == (chunk_tokens is not None)
        lp, ent = forward_logprobs(forward, temperature=0.7, with_entropy=True)
        (lp * torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)).sum().backward()
        grads = [p.grad.clone() for p in policy.parameters()]
        return lp.detach(), ent, grads

    (lp, ent, grads), (lp0, ent0, grads0) = _both(monkeypatch, run)
    assert lp.shape == lp0.shape == (6, 6)
    assert torch.equal(lp == 0, ~r.completion_mask)  # 0 off-mask, and only there
    torch.testing.assert_close(lp, lp0, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent0, atol=2e-5, rtol=1e-5)
    for g, g0 in zip(grads, grads0):
        torch.testing.assert_close(g, g0, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_same_reward_scores(models, monkeypatch, arch):
    reward = models[arch][1]
    r = _long_prompt_rollout(reward.config.vocab_size, "blocks")
    ids, mask, _, P, Tc = _trimmed_inputs(r)
    assert share_prompts(reward, ids, mask, P, Tc, lm_head=False) is not None
    shared, usual = _both(monkeypatch, lambda: reward_model_scores(reward, r, batch_size=6))
    assert shared.shape == (6,)
    torch.testing.assert_close(shared, usual, atol=2e-5, rtol=1e-5)
    # In micro-batches of 4 rows the groups split; each micro-batch packs what it holds.
    split, _ = _both(monkeypatch, lambda: reward_model_scores(reward, r, batch_size=4))
    torch.testing.assert_close(split, usual, atol=2e-5, rtol=1e-5)


def test_one_row_per_completion_where_packing_does_not_pay(models, tiny_tokenizer, monkeypatch):
    policy = models["llama"][0]
    V = policy.config.vocab_size
    # Long completions after a short prompt: the packed row's attention outgrows the saved prompt.
    r = make_rollout([[5, 6]] * 4, [list(range(3, 3 + 40))] * 4, T=40, pad=1)
    ids, mask, _, P, Tc = _trimmed_inputs(r)
    assert share_prompts(policy, ids, mask, P, Tc, lm_head=True) is None
    # No two rows share a prompt.
    r = _long_prompt_rollout(V, "pairs").select([0, 3, 5])
    ids, mask, _, P, Tc = _trimmed_inputs(r)
    assert share_prompts(policy, ids, mask, P, Tc, lm_head=True) is None
    # The packed mask over its element budget: 3 groups of rows of 24 + 3 · 5 = 39 columns hold 3 · 39² elements.
    r = _long_prompt_rollout(V, "pairs")
    ids, mask, _, P, Tc = _trimmed_inputs(r)
    monkeypatch.setattr(scoring, "SHARED_PROMPT_MAX_MASK", 3 * 39**2)
    assert share_prompts(policy, ids, mask, P, Tc, lm_head=True) is not None
    monkeypatch.setattr(scoring, "SHARED_PROMPT_MAX_MASK", 3 * 39**2 - 1)
    assert share_prompts(policy, ids, mask, P, Tc, lm_head=True) is None
    monkeypatch.undo()
    # Switched off.
    monkeypatch.setenv("POSTTRAIN_SHARED_PROMPTS", "off")
    assert share_prompts(policy, ids, mask, P, Tc, lm_head=True) is None
    monkeypatch.setenv("POSTTRAIN_SHARED_PROMPTS", "sometimes")
    with pytest.raises(Exception, match="POSTTRAIN_SHARED_PROMPTS='sometimes'"):
        share_prompts(policy, ids, mask, P, Tc, lm_head=True)
    monkeypatch.delenv("POSTTRAIN_SHARED_PROMPTS")
    # Eager attention (no 4-D mask passed through as SDPA takes it) and a sliding window shorter than
    # the packed row keep the usual layout.
    eager = build_tiny_causal_lm(tiny_tokenizer, arch="llama", attn_implementation="eager")
    assert share_prompts(eager, ids, mask, P, Tc, lm_head=True) is None
    windowed = build_tiny_causal_lm(tiny_tokenizer, arch="llama")
    windowed.config.sliding_window = 8
    assert share_prompts(windowed, ids, mask, P, Tc, lm_head=True) is None
    # Still the same log-probs either way.
    lp = completion_logprobs(eager, r)[0]
    monkeypatch.setenv("POSTTRAIN_SHARED_PROMPTS", "off")
    torch.testing.assert_close(lp, completion_logprobs(eager, r)[0])


def test_a_bad_mode_stops_the_run_when_its_config_is_built(tmp_path, monkeypatch):
    from helpers import rloo_config
    from posttrain.configs import ConfigError

    monkeypatch.setenv("POSTTRAIN_SHARED_PROMPTS", "sometimes")
    with pytest.raises(ConfigError, match="POSTTRAIN_SHARED_PROMPTS='sometimes': expected one of auto, off"):
        rloo_config(tmp_path)
