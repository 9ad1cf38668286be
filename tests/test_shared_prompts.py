"""Completions of one prompt in one row (scoring.share_prompts): the packed layout by hand, the same
log-probs, entropies, gradients and reward scores as one row per completion, and the cases that keep
one row per completion."""

from __future__ import annotations

import pytest
import torch

from helpers import make_rollout
from posttrain import scoring
from posttrain.rollout import grouped_rows
from posttrain.scoring import (
    SharedPrompts,
    _trimmed_inputs,
    batched_completion_logprobs,
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


def test_grouped_rows_by_hand():
    ids = torch.tensor([[4, 5], [6, 7], [8, 9]] * 2)  # k = 2 blocks of 3 prompts
    mask = torch.ones_like(ids, dtype=torch.bool)
    assert grouped_rows(ids, mask, 2).tolist() == [0, 3, 1, 4, 2, 5]
    assert grouped_rows(ids, mask, 6) is None  # one chunk: nothing to regroup
    assert grouped_rows(ids[:3], mask[:3], 2) is None  # no prompt repeats
    assert grouped_rows(ids[[0, 3, 1, 4]], mask[[0, 3, 1, 4]], 2) is None  # already grouped
    # The same ids with different left padding are different prompts.
    padded = mask.clone()
    padded[3, 0] = False
    assert grouped_rows(ids, padded, 2).tolist() == [0, 1, 4, 2, 5, 3]


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_forwards_in_chunks_take_whole_groups(models, monkeypatch, arch):
    # Blocks: rows (g0, g1, g2, g0, g1, g0). Chunks of 3 rows taken as they are hold no two rows of one prompt;
    # taken group by group they are rows (0, 3, 5) -> one packed row and (1, 4, 2) -> two.
    policy, reward = models[arch]
    r = _long_prompt_rollout(policy.config.vocab_size, "blocks")
    assert grouped_rows(r.prompt_ids, r.prompt_mask, 3).tolist() == [0, 3, 5, 1, 4, 2]
    sizes = []
    hook = policy.register_forward_pre_hook(
        lambda mod, args, kwargs: sizes.append(kwargs["input_ids"].size(0)), with_kwargs=True
    )
    try:
        (lp, ent), (lp0, ent0) = _both(
            monkeypatch, lambda: batched_completion_logprobs(policy, r, batch_size=3, with_entropy=True)
        )
    finally:
        hook.remove()
    assert sizes == [1, 2, 3, 3]  # grouped and packed, then POSTTRAIN_SHARED_PROMPTS=off: as they are
    torch.testing.assert_close(lp, lp0, atol=2e-5, rtol=1e-5)  # every row's own result, in the rollout's order
    torch.testing.assert_close(ent, ent0, atol=2e-5, rtol=1e-5)
    assert torch.equal(lp == 0, ~r.completion_mask)
    scores, scores0 = _both(monkeypatch, lambda: reward_model_scores(reward, r, batch_size=3))
    torch.testing.assert_close(scores, scores0, atol=2e-5, rtol=1e-5)


def test_prompt_grouped_minibatches_by_hand(monkeypatch):
    from posttrain.trainers.online import prompt_grouped

    # k = 2 blocks of prompts A, B, C, D: rows 0-3 and 4-7.
    r = make_rollout([[10], [11], [12], [13]] * 2, [[5]] * 8, T=1, pad=1)
    order = torch.tensor([5, 2, 1, 0, 4, 7, 6, 3])
    # Minibatches of 4: (5 B, 2 C, 1 B, 0 A) -> B's pair first, then C and A; (4 A, 7 D, 6 C, 3 D) -> D's pair first.
    assert prompt_grouped([order], r, 4, 2)[0].tolist() == [5, 1, 2, 0, 7, 3, 4, 6]
    # One minibatch of 8: four pairs, in the order of their first rows.
    assert prompt_grouped([order], r, 8, 2)[0].tolist() == [5, 1, 2, 6, 0, 4, 7, 3]
    # A group of 3 before a pair, whatever comes first: rows 0, 1, 2, 3, 4 with prompts A, B, B, A, B.
    r3 = make_rollout([[10], [11], [11], [10], [11]], [[5]] * 5, T=1, pad=1)
    assert prompt_grouped([torch.arange(5)], r3, 5, 1)[0].tolist() == [1, 2, 4, 0, 3]
    assert prompt_grouped([order], r, 4, 4)[0] is order  # one micro-batch per minibatch: nothing to regroup
    monkeypatch.setenv("POSTTRAIN_SHARED_PROMPTS", "off")
    assert prompt_grouped([order], r, 4, 2)[0] is order


def _long_prompt_dataset():
    """4 prompts of about 40 tokens: with 4-token completions, a pair of them packs (`share_prompts`)."""
    from datasets import Dataset

    long = " ".join(["the long prompt"] * 12)
    return Dataset.from_dict({"prompt": [f"{long} number {i}" for i in range(4)]})


def test_rloo_update_packs_grouped_micro_batches_and_learns_the_same(tmp_path, tiny_tokenizer, monkeypatch):
    """RLOO's k blocks through chunks of 2 rows and micro-batches of 2: with the rows grouped by prompt every
    forward holds one prompt's pair, packed into one row; the trained weights are those of one row per
    completion in the blocks' own chunks (POSTTRAIN_SHARED_PROMPTS=off), since each minibatch keeps its rows."""
    from helpers import rloo_config
    from posttrain.trainers.rloo import RLOOTrainer

    prompts = _long_prompt_dataset()

    def train(name):
        cfg = rloo_config(
            tmp_path,
            name,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=4,
            local_rollout_forward_batch_size=2,
            num_ppo_epochs=2,
            total_episodes=8,
            response_length=4,
            seed=3,
        )
        policy = build_tiny_causal_lm(tiny_tokenizer)
        reward = build_tiny_reward_model(tiny_tokenizer, seed=1)
        rows = []
        for model in (policy, reward):
            model.register_forward_pre_hook(
                lambda mod, args, kwargs: rows.append((mod.training, kwargs["input_ids"].size(0))), with_kwargs=True
            )
        RLOOTrainer(cfg, tiny_tokenizer, policy, None, reward, prompts).train()
        return policy, rows

    grouped, grouped_rows_seen = train("auto")
    monkeypatch.setenv("POSTTRAIN_SHARED_PROMPTS", "off")
    usual, usual_rows_seen = train("off")
    # 8 rows = 4 prompts x 2 in chunks of 2: generation takes a prompt's pair together (one prefill, 3 decode
    # steps) either way; then the reward model's 4 chunks, and the 4 micro-batches of the old log-probs and of
    # each of 2 epochs: one packed row each where rows are grouped, two rows each as the blocks come.
    assert grouped_rows_seen[:16] == usual_rows_seen[:16] == [(False, 1), (False, 2), (False, 2), (False, 2)] * 4
    assert grouped_rows_seen[16:] == [(False, 1)] * 4 + [(True, 1)] * 12
    assert usual_rows_seen[16:] == [(False, 2)] * 4 + [(True, 2)] * 12
    for p, p0 in zip(grouped.parameters(), usual.parameters()):
        torch.testing.assert_close(p, p0, atol=1e-5, rtol=1e-4)


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


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_grpo_groups_micro_batches_where_its_loss_allows(tmp_path, tiny_tokenizer, loss_type):
    """GRPO's dapo loss sums over the minibatch's tokens, so a prompt's completions share micro-batches (one
    packed row each); bnpo's token mean is per micro-batch, so its micro-batches stay as the shuffle drew them."""
    from helpers import grpo_config
    from posttrain.trainers.grpo import GRPOTrainer

    prompts = _long_prompt_dataset()
    cfg = grpo_config(
        tmp_path,
        num_generations=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        num_iterations=2,
        local_rollout_forward_batch_size=2,
        total_episodes=8,
        response_length=4,
        seed=3,
        loss_type=loss_type,
    )
    policy = build_tiny_causal_lm(tiny_tokenizer)
    rows = []
    policy.register_forward_pre_hook(
        lambda mod, args, kwargs: rows.append(kwargs["input_ids"].size(0)) if mod.training else None, with_kwargs=True
    )
    reward = build_tiny_reward_model(tiny_tokenizer, seed=1)
    GRPOTrainer(
        model=policy, reward_funcs=reward, args=cfg, train_dataset=prompts, processing_class=tiny_tokenizer
    ).train()
    assert len(rows) == 12  # the old log-probs' 4 micro-batches and 2 iterations' 4
    if loss_type == "dapo":
        assert rows == [1] * 12
    else:
        assert 2 in rows
