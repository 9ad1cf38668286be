"""Hand-computed checks of posttrain.advantages (CPU, fast)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.advantages import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    full_kl,
    gae,
    group_advantages,
    kl_penalty,
    kl_shaped_rewards,
    last_token_indices,
    merge_moments,
    normalize_advantages,
    normalize_rewards,
    rloo_advantages,
    scale_scores,
    sequence_kl_rewards,
    token_level_kl_rewards,
    whiten_advantages,
    whiten_rewards,
)
from posttrain.ops import lengths_to_mask

# --------------------------------------------------------------------------------------------
# KL estimators
# --------------------------------------------------------------------------------------------

# The inputs of TRL ≤ 0.11 `test_ppo_trainer_kl_penalty`; lp − ref is ±0.1 except the last, −0.2.
LP = torch.tensor([[0.5, 0.2, 0.1], [0.6, 0.2, 0.1]])
REF = torch.tensor([[0.4, 0.3, 0.0], [0.7, 0.1, 0.3]])


@pytest.mark.parametrize("name", ["k1", "kl"])
def test_kl_k1(name):
    # k1 = lp − ref
    expected = torch.tensor([[0.1, -0.1, 0.1], [-0.1, 0.1, -0.2]])
    torch.testing.assert_close(kl_penalty(LP, REF, name), expected)


def test_kl_abs():
    # |lp − ref|
    expected = torch.tensor([[0.1, 0.1, 0.1], [0.1, 0.1, 0.2]])
    torch.testing.assert_close(kl_penalty(LP, REF, "abs"), expected)


@pytest.mark.parametrize("name", ["k2", "mse"])
def test_kl_k2(name):
    # ½(lp − ref)²: ½·0.01 = 0.005, ½·0.04 = 0.02
    expected = torch.tensor([[0.005, 0.005, 0.005], [0.005, 0.005, 0.02]])
    torch.testing.assert_close(kl_penalty(LP, REF, name), expected)


def test_kl_k3():
    # logr = ref − lp; k3 = e^logr − 1 − logr:
    # logr = −0.1: 0.904837418 − 1 + 0.1 = 0.004837418; logr = 0.1: 1.105170918 − 1 − 0.1 = 0.005170918;
    # logr = 0.2: 1.221402758 − 1 − 0.2 = 0.021402758
    expected = torch.tensor([[0.004837418, 0.005170918, 0.004837418], [0.005170918, 0.004837418, 0.021402758]])
    torch.testing.assert_close(kl_penalty(LP, REF, "k3"), expected)
    # and the definition on random inputs
    lp, ref = torch.randn(4, 7), torch.randn(4, 7)
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.exp(ref - lp) - 1 - (ref - lp))


def test_kl_mask_and_errors():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = kl_penalty(LP, REF, "k1", mask=mask)
    torch.testing.assert_close(out, torch.tensor([[0.1, -0.1, 0.0], [-0.1, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="k1, kl, abs, mse, k2, k3"):
        kl_penalty(LP, REF, "k4")
    with pytest.raises(ValueError, match="full_kl"):
        kl_penalty(LP, REF, "full")


def test_full_kl_hand_example():
    # p = softmax([0, 0]) = [½, ½]; q = softmax([0, ln 3]) = [¼, ¾];
    # KL(p‖q) = ½ln(½/¼) + ½ln(½/¾) = ½ln(4/3) = 0.143841036
    logits = torch.tensor([[0.0, 0.0]])
    ref = torch.tensor([[0.0, math.log(3.0)]])
    torch.testing.assert_close(full_kl(logits, ref), torch.tensor([0.143841036]))


def test_full_kl_matches_double_sum():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g)
    ref = torch.randn(2, 3, 5, generator=g)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    temperature = 0.7
    expected = torch.zeros(2, 3)
    for b in range(2):
        for t in range(3):
            if not mask[b, t]:
                continue
            zp = [math.exp(x / temperature) for x in logits[b, t].tolist()]
            zq = [math.exp(x / temperature) for x in ref[b, t].tolist()]
            p = [z / sum(zp) for z in zp]
            q = [z / sum(zq) for z in zq]
            expected[b, t] = sum(pv * (math.log(pv) - math.log(qv)) for pv, qv in zip(p, q))
    for chunk in (1, 2, 1024):
        out = full_kl(logits, ref, mask=mask, temperature=temperature, chunk_tokens=chunk)
        torch.testing.assert_close(out, expected)
    # the same distribution has zero KL
    torch.testing.assert_close(full_kl(logits, logits), torch.zeros(2, 3), atol=1e-6, rtol=0)


def test_full_kl_gradient_flows():
    logits = torch.randn(2, 3, 4, requires_grad=True)
    full_kl(logits, torch.randn(2, 3, 4), chunk_tokens=2).sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


# --------------------------------------------------------------------------------------------
# KL-shaped rewards
# --------------------------------------------------------------------------------------------


def test_kl_shaped_rewards_score_on_last_real_token():
    # lengths 2 and 4, kl = 1 everywhere, kl_coef 0.1: −0.1 on real tokens, the score added at
    # index length − 1 (row 0: index 1 → −0.1 + 1.0 = 0.9; row 1: index 3 → −0.1 + 2.0 = 1.9).
    # TRL 0.19 would have put row 0's score at index 2, a padding slot (trl#1893).
    scores = torch.tensor([1.0, 2.0])
    kl = torch.ones(2, 4)
    mask = lengths_to_mask(torch.tensor([2, 4]), 4)
    rewards, non_score = kl_shaped_rewards(scores, kl, mask, 0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.9, 0.0, 0.0], [-0.1, -0.1, -0.1, 1.9]]))
    torch.testing.assert_close(non_score, torch.tensor([[-0.1, -0.1, 0.0, 0.0], [-0.1, -0.1, -0.1, -0.1]]))


def test_last_token_indices():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    assert last_token_indices(mask).tolist() == [1, 3, 0]
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        last_token_indices(torch.tensor([[1, 0], [0, 0]]))


def test_sequence_kl_rewards():
    # non_score = −0.1·Σ kl·mask: row 0 −0.1·(0.5 + 0.5) = −0.1 (the 9 is padding);
    # row 1 −0.1·(0.2 + 0.3 + 0.5) = −0.1. rlhf = score + non_score = [0.9, 1.9].
    scores = torch.tensor([1.0, 2.0])
    kl = torch.tensor([[0.5, 0.5, 9.0], [0.2, 0.3, 0.5]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    rlhf, non_score = sequence_kl_rewards(scores, kl, mask, 0.1)
    torch.testing.assert_close(non_score, torch.tensor([-0.1, -0.1]))
    torch.testing.assert_close(rlhf, torch.tensor([0.9, 1.9]))
    rlhf_tok, non_score_tok = token_level_kl_rewards(scores, kl, mask, 0.1)
    torch.testing.assert_close(rlhf_tok, rlhf)
    torch.testing.assert_close(non_score_tok, non_score)


def test_rloo_reward():
    """TRL 0.19 `tests/test_rloo_trainer.py::test_rloo_reward`, plus the library call."""
    local_batch_size = 3
    rloo_k = 4
    rlhf_reward = torch.tensor([
        1, 2, 3,  # first rlhf reward for three prompts
        2, 3, 4,  # second rlhf reward for three prompts
        5, 6, 7,  # third rlhf reward for three prompts
        8, 9, 10,  # fourth rlhf reward for three prompts
    ]).float()  # fmt: skip
    advantages = torch.zeros_like(rlhf_reward)
    for i in range(0, len(advantages), local_batch_size):
        other_response_rlhf_rewards = []
        for j in range(0, len(advantages), local_batch_size):
            if i != j:
                other_response_rlhf_rewards.append(rlhf_reward[j : j + local_batch_size])
        advantages[i : i + local_batch_size] = rlhf_reward[i : i + local_batch_size] - torch.stack(
            other_response_rlhf_rewards
        ).mean(0)
    assert abs(1 - (2 + 5 + 8) / 3 - advantages[0].item()) < 1e-6  # first rlhf reward for the first prompt
    assert abs(6 - (3 + 2 + 9) / 3 - advantages[7].item()) < 1e-6  # third rlhf reward for the second prompt
    # vectorised (the form in TRL's RLOO documentation) and the library function agree with the double loop
    grid = rlhf_reward.reshape(rloo_k, local_batch_size)
    vec_advantages = grid - (grid.sum(0) - grid) / (rloo_k - 1)
    torch.testing.assert_close(vec_advantages.flatten(), advantages)
    torch.testing.assert_close(rloo_advantages(grid).flatten(), advantages)


def test_rloo_token_level_kl_scatter():
    """Second half of TRL's test_rloo_reward: the score sits at length − 1 and nowhere else."""
    rloo_k, prompts, length = 4, 3, 5
    rlhf_reward = torch.arange(1, rloo_k * prompts + 1).float()
    lengths = torch.tensor([3, 4, 3, 4, 5, 3, 2, 4, 3, 5, 1, 4])
    mask = lengths_to_mask(lengths, length)
    kl = torch.ones(rloo_k * prompts, length)
    kl_coef = 0.1
    rewards, non_score = kl_shaped_rewards(rlhf_reward, kl, mask, kl_coef)
    last_reward = rewards - non_score
    for i, n in enumerate(lengths.tolist()):
        assert last_reward[i, n - 1] == rlhf_reward[i]
        assert torch.all(last_reward[i, : n - 1] == 0)
        assert torch.all(last_reward[i, n:] == 0)
    # kl = 1 on every real token: Σ_t non_score = −0.1·length (TRL's test had unmasked kl = 1 on
    # all T positions and checked −0.1·T; our KL is zero on padding by construction).
    torch.testing.assert_close(non_score.sum(1), -kl_coef * lengths.float())
    full_mask = torch.ones(2, length, dtype=torch.bool)
    _, non_score_full = token_level_kl_rewards(torch.zeros(2), torch.ones(2, length), full_mask, kl_coef)
    torch.testing.assert_close(non_score_full, torch.full((2,), -kl_coef * length))


def test_rloo_advantages_leave_out_unscored_completions():
    """TRL 1.x: a completion no reward scored is out of its siblings' baseline and gets advantage 0."""
    # k = 3 samples (rows) of 2 prompts (columns); sample 1 of prompt 0 and samples 0, 2 of prompt 1 unscored
    rewards = torch.tensor([[1.0, 4.0], [0.0, 2.0], [5.0, 0.0]])
    scorable = torch.tensor([[True, False], [False, True], [True, False]])
    out = rloo_advantages(rewards, scorable)
    # prompt 0: scored 1 and 5, each baselined by the other alone: 1 - 5 = -4, 5 - 1 = 4; the unscored one 0.
    # prompt 1: the one scored sample has no scored sibling: 0, and so do the two unscored ones.
    assert out.tolist() == [[-4.0, 0.0], [0.0, 0.0], [4.0, 0.0]]
    all_scored = torch.ones(3, 2, dtype=torch.bool)
    torch.testing.assert_close(rloo_advantages(rewards, all_scored), rloo_advantages(rewards))


def test_rloo_advantages_errors():
    with pytest.raises(ValueError, match="k=1"):
        rloo_advantages(torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"\(k, num_prompts\)"):
        rloo_advantages(torch.ones(6))


# --------------------------------------------------------------------------------------------
# GAE and whitening
# --------------------------------------------------------------------------------------------


def test_gae_hand_example():
    # mask [1, 1, 0] (length 2), γ = 1, λ = 0.5; the 5 and 9 on padding must be ignored.
    # t = 1 (last real token): δ = 1 + 1·0 − 0.2 = 0.8, A = 0.8, R = 0.8 + 0.2 = 1.0
    # t = 0: δ = 0 + 1·0.2 − 0.5 = −0.3, A = −0.3 + 0.5·0.8 = 0.1, R = 0.1 + 0.5 = 0.6
    rewards = torch.tensor([[0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.2, 9.0]])
    mask = torch.tensor([[True, True, False]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.1, 0.8, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.6, 1.0, 0.0]]))


def _gae_reference(rewards, values, lengths, gamma, lam):
    """Naive per-row GAE over the first `length` tokens only, in plain Python floats."""
    batch, length_max = rewards.shape
    adv = torch.zeros(batch, length_max, dtype=torch.float64)
    ret = torch.zeros(batch, length_max, dtype=torch.float64)
    for b in range(batch):
        n = int(lengths[b])
        r = rewards[b].tolist()
        v = values[b].tolist()
        running = 0.0
        for t in reversed(range(n)):
            next_value = v[t + 1] if t + 1 < n else 0.0
            delta = r[t] + gamma * next_value - v[t]
            running = delta + gamma * lam * running
            adv[b, t] = running
            ret[b, t] = running + v[t]
    return adv.float(), ret.float()


@pytest.mark.parametrize(
    "seed,batch,length,gamma,lam",
    [(0, 1, 1, 1.0, 0.95), (1, 4, 7, 1.0, 0.95), (2, 5, 12, 0.99, 0.9), (3, 8, 3, 0.5, 1.0)],
)
def test_gae_matches_naive_loop(seed, batch, length, gamma, lam):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=g)
    values = torch.randn(batch, length, generator=g)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = lengths_to_mask(lengths, length)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = _gae_reference(rewards, values, lengths, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-5, atol=1e-5)
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)


def test_whiten_advantages():
    # over the mask [1, 2, 3]: mean 2, unbiased var (1 + 0 + 1)/2 = 1 → [−1, 0, 1]; padding → 0
    adv = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[True, True, True, False]])
    torch.testing.assert_close(whiten_advantages(adv, mask), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))


def test_whiten_rewards_keeps_mean():
    # [1, 3, 5]: mean 3, unbiased var (4 + 0 + 4)/2 = 4 → (r − 3)/2 = [−1, 0, 1]; shift_mean=False
    # adds the mean back → [2, 3, 4]; padding → 0
    rewards = torch.tensor([[1.0, 3.0, 5.0, -7.0]])
    mask = torch.tensor([[True, True, True, False]])
    torch.testing.assert_close(whiten_rewards(rewards, mask), torch.tensor([[2.0, 3.0, 4.0, 0.0]]))
    torch.testing.assert_close(whiten_rewards(rewards, mask, shift_mean=True), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))


# --------------------------------------------------------------------------------------------
# Running moments and score scaling
# --------------------------------------------------------------------------------------------


def test_running_moments_merge():
    running = RunningMoments()
    # [1, 2, 3]: mean 2, unbiased std 1
    assert running.update(torch.tensor([1.0, 2.0, 3.0])) == pytest.approx((2.0, 1.0))
    assert (running.mean, running.std, running.count) == pytest.approx((2.0, 1.0, 3.0))
    # + [4, 5] (batch mean 4.5, std √0.5): all five values 1..5 have mean 3, population var 2,
    # unbiased var 2.5 → std √2.5 = 1.5811388
    batch_mean, batch_std = running.update(torch.tensor([4.0, 5.0]))
    assert (batch_mean, batch_std) == pytest.approx((4.5, math.sqrt(0.5)))
    assert (running.mean, running.var, running.count) == pytest.approx((3.0, 2.0, 5.0))
    assert running.std == pytest.approx(math.sqrt(2.5))
    restored = RunningMoments()
    restored.load_state_dict(running.state_dict())
    assert restored.state_dict() == running.state_dict()
    # Chan's merge by hand: δ = 2.5, n = 5, mean = 2 + 2.5·2/5 = 3, M2 = (2/3)·3 + 0.25·2 + 6.25·6/5 = 10
    assert merge_moments(2.0, 2.0 / 3.0, 3.0, 4.5, 0.25, 2.0) == pytest.approx((3.0, 2.0, 5.0))


def test_running_moments_many_batches_match_all_at_once():
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(100, generator=g) * 3 + 1
    running = RunningMoments()
    for chunk in xs.split(7):
        running.update(chunk)
    assert running.mean == pytest.approx(xs.double().mean().item())
    assert running.std == pytest.approx(xs.double().std().item())


def test_scale_scores():
    scores = torch.tensor([2.0, 4.0, 6.0])  # mean 4, unbiased std 2
    torch.testing.assert_close(
        scale_scores(scores, RunningMoments(), use_score_scaling=True), torch.tensor([1.0, 2.0, 3.0])
    )
    normed = scale_scores(scores, RunningMoments(), use_score_scaling=True, use_score_norm=True)
    torch.testing.assert_close(normed, torch.tensor([-1.0, 0.0, 1.0]))
    clipped = scale_scores(scores, RunningMoments(), use_score_scaling=True, use_score_norm=True, score_clip=0.5)
    torch.testing.assert_close(clipped, torch.tensor([-0.5, 0.0, 0.5]))
    # clipping alone, no running statistics needed
    torch.testing.assert_close(scale_scores(scores, None, score_clip=3.0), torch.tensor([2.0, 3.0, 3.0]))
    # one rank's score scaled by statistics of the gathered batch: 2 / 2 = 1
    local = scale_scores(torch.tensor([2.0]), RunningMoments(), use_score_scaling=True, stats_scores=scores)
    torch.testing.assert_close(local, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="use_score_scaling"):
        scale_scores(scores, RunningMoments(), use_score_norm=True)


# --------------------------------------------------------------------------------------------
# KL controllers
# --------------------------------------------------------------------------------------------


def test_adaptive_kl_controller():
    # target 6, horizon 10000, n_steps 256 → err·256/10000 = err·0.0256
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000.0)
    ctl.update(12.0, n_steps=256)  # 12/6 − 1 = 1 → clipped to 0.2: 0.2·(1 + 0.2·0.0256) = 0.201024
    assert ctl.value == pytest.approx(0.201024)
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000.0)
    ctl.update(torch.tensor(3.0), n_steps=256)  # 3/6 − 1 = −0.5 → −0.2: 0.2·(1 − 0.00512) = 0.198976
    assert ctl.value == pytest.approx(0.198976)
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000.0)
    ctl.update(6.6, n_steps=256)  # 6.6/6 − 1 = 0.1 (inside the clip): 0.2·(1 + 0.00256) = 0.200512
    assert ctl.value == pytest.approx(0.200512)
    restored = AdaptiveKLController(1.0, target=1.0, horizon=1.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.state_dict() == ctl.state_dict()
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=10.0)


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, n_steps=64)
    assert ctl.value == 0.05
    restored = FixedKLController(0.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == 0.05


# --------------------------------------------------------------------------------------------
# Group baselines and normalization
# --------------------------------------------------------------------------------------------


def test_group_advantages():
    # row 0 [1, 2, 3]: mean 2, unbiased std 1 → [−1, 0, 1]/(1 + 1e-4); row 1 is constant → 0
    rewards = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]])
    expected = torch.tensor([[-1.0 / 1.0001, 0.0, 1.0 / 1.0001], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(group_advantages(rewards), expected)
    torch.testing.assert_close(
        group_advantages(rewards, scale_std=False), torch.tensor([[-1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    )
    with pytest.raises(ValueError, match="G=1"):
        group_advantages(torch.ones(3, 1))


def test_normalize_rewards_and_advantages():
    # [1, 2, 3, 4]: mean 2.5, unbiased std √(5/3) = 1.2909944 → ±0.3872983, ±1.1618950
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0])
    torch.testing.assert_close(normalize_rewards(scores), torch.tensor([-1.1618950, -0.3872983, 0.3872983, 1.1618950]))
    torch.testing.assert_close(
        normalize_rewards(scores, clip_range=1.0), torch.tensor([-1.0, -0.3872983, 0.3872983, 1.0])
    )
    # [1, 3]: mean 2, unbiased std √2 → ±1/√2
    torch.testing.assert_close(normalize_advantages(torch.tensor([1.0, 3.0])), torch.tensor([-0.7071068, 0.7071068]))


def test_non_finite_padding_does_not_leak():
    mask = torch.tensor([[True, True, False]])
    nan = float("nan")
    adv, ret = gae(torch.tensor([[0.0, 1.0, nan]]), torch.tensor([[0.5, 0.2, float("inf")]]), mask, 1.0, 0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.1, 0.8, 0.0]]))  # same numbers as test_gae_hand_example
    torch.testing.assert_close(ret, torch.tensor([[0.6, 1.0, 0.0]]))
    # [1, 3] mean 2, unbiased var 2 → ±1/√2
    torch.testing.assert_close(
        whiten_advantages(torch.tensor([[1.0, 3.0, nan]]), mask), torch.tensor([[-0.7071068, 0.7071068, 0.0]])
    )
