"""Hand-computed checks of posttrain.losses (CPU, fast)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from posttrain.losses import (
    bradley_terry_loss,
    chunked_nll,
    dft_loss,
    dpo_loss,
    entropy_bonus,
    ppo_policy_loss,
    ppo_value_loss,
    xpo_loss,
)
from posttrain.ops import lengths_to_mask


def _close(actual, expected, tol=1e-6):
    assert float(actual.detach() if torch.is_tensor(actual) else actual) == pytest.approx(expected, abs=tol, rel=tol)


# --------------------------------------------------------------------------------------------
# PPO policy loss
# --------------------------------------------------------------------------------------------


def test_policy_loss_ratio_one():
    # lp == old → ρ = 1 everywhere: nothing clipped, approxkl 0, loss = −mean(A) over the mask
    # = −(1 − 2 + 3)/3 = −2/3 (the 100 on padding is ignored).
    lp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    adv = torch.tensor([[1.0, -2.0, 3.0, 100.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, stats = ppo_policy_loss(lp, lp.clone(), adv, mask, cliprange=0.2)
    _close(loss, -2.0 / 3.0)
    _close(stats["approxkl"], 0.0)
    _close(stats["clipfrac"], 0.0)
    _close(stats["ratio_mean"], 1.0)
    _close(stats["ratio_var"], 0.0)
    _close(stats["count"], 3.0)


def _clip_example():
    # Three real tokens with ratios 1.5, 0.5, 1.1 and one padding token with absurd logprobs.
    lp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1), 100.0]], requires_grad=True)
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, 2.0, 5.0]])
    mask = torch.tensor([[True, True, True, False]])
    return lp, old, adv, mask


def test_policy_loss_clipping_by_hand():
    lp, old, adv, mask = _clip_example()
    # ε = 0.2, pg = max(−A·ρ, −A·clip(ρ, 0.8, 1.2)):
    #   ρ = 1.5, A = 1:  max(−1.5, −1.2) = −1.2   (clipped term chosen)
    #   ρ = 0.5, A = −1: max(0.5, 0.8)   = 0.8    (clipped term chosen)
    #   ρ = 1.1, A = 2:  max(−2.2, −2.2) = −2.2   (inside the range, not counted as clipped)
    # loss = (−1.2 + 0.8 − 2.2)/3 = −0.8666667, clipfrac = 2/3
    loss, stats = ppo_policy_loss(lp, old, adv, mask, cliprange=0.2)
    _close(loss, -2.6 / 3.0)
    _close(stats["pg_loss"], -2.6 / 3.0)
    _close(stats["clipfrac"], 2.0 / 3.0)
    _close(stats["clipfrac_high"], 1.0 / 3.0)  # ρ = 1.5 > 1.2 with A > 0
    _close(stats["clipfrac_low"], 1.0 / 3.0)  # ρ = 0.5 < 0.8 with A < 0
    # approxkl = ½·mean(ln²1.5, ln²0.5, ln²1.1) = ½·(0.1644019 + 0.4804530 + 0.0090840)/3 = 0.1089898
    _close(stats["approxkl"], 0.1089898)
    # policykl = mean(old − lp) = −(0.4054651 − 0.6931472 + 0.0953102)/3 = 0.0641240
    _close(stats["policykl"], 0.0641240)
    # ratio mean (1.5 + 0.5 + 1.1)/3 = 1.0333333; population var (0.4666667² + 0.5333333² + 0.0666667²)/3 = 0.1688889
    _close(stats["ratio_mean"], 1.0333333)
    _close(stats["ratio_var"], 0.1688889)
    assert torch.isfinite(loss)
    loss.backward()
    # Clipped tokens get no gradient; the unclipped one gets −A·ρ/3 = −2·1.1/3; padding gets 0.
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, -2.2 / 3.0, 0.0]]))


def test_policy_loss_clip_higher():
    lp, old, adv, mask = _clip_example()
    # ε_high = 0.6 → ρ = 1.5 stays inside [0.8, 1.6]: −1.5; loss = (−1.5 + 0.8 − 2.2)/3 = −2.9/3
    loss, stats = ppo_policy_loss(lp, old, adv, mask, cliprange=0.2, cliprange_high=0.6)
    _close(loss, -2.9 / 3.0)
    _close(stats["clipfrac"], 1.0 / 3.0)
    _close(stats["clipfrac_high"], 0.0)


def test_policy_loss_sequence_level():
    # seq 0: token log-ratios 0.2 and ln1.5 − 0.2 sum to ln1.5 → ρ = 1.5, A = 1 → −1.2 (clipped)
    # seq 1: one real token with log-ratio ln0.5 → ρ = 0.5, A = −1 → 0.8 (clipped); padding = 50
    # loss = (−1.2 + 0.8)/2 = −0.2; approxkl = ½·(ln²1.5 + ln²0.5)/2 = ½·(0.1644019 + 0.4804530)/2 = 0.1612137
    lp = torch.tensor([[0.2, math.log(1.5) - 0.2], [math.log(0.5), 50.0]])
    old = torch.zeros(2, 2)
    mask = torch.tensor([[True, True], [True, False]])
    adv = torch.tensor([1.0, -1.0])
    loss, stats = ppo_policy_loss(lp, old, adv, mask, cliprange=0.2, level="sequence")
    _close(loss, -0.2)
    _close(stats["clipfrac"], 1.0)
    _close(stats["approxkl"], 0.1612137)
    _close(stats["count"], 2.0)
    with pytest.raises(ValueError, match="level"):
        ppo_policy_loss(lp, old, adv, mask, cliprange=0.2, level="tokens")
    with pytest.raises(ValueError, match="one advantage per sequence"):
        ppo_policy_loss(lp, old, adv[:, None], mask, cliprange=0.2, level="sequence")


def test_policy_loss_sequence_advantages_broadcast_at_token_level():
    # GRPO passes one advantage per sequence with token-level ratios: same as repeating it over T.
    g = torch.Generator().manual_seed(0)
    lp, old = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    adv = torch.randn(3, generator=g)
    mask = lengths_to_mask(torch.tensor([4, 2, 3]), 4)
    a, _ = ppo_policy_loss(lp, old, adv, mask, cliprange=0.2)
    b, _ = ppo_policy_loss(lp, old, adv[:, None].expand(3, 4), mask, cliprange=0.2)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_policy_loss_microbatch_invariance(level):
    g = torch.Generator().manual_seed(1)
    batch, length = 6, 5
    lp = (torch.randn(batch, length, generator=g) * 0.3).requires_grad_()
    old = torch.randn(batch, length, generator=g) * 0.3
    adv = torch.randn(batch, length, generator=g) if level == "token" else torch.randn(batch, generator=g)
    mask = lengths_to_mask(torch.tensor([5, 1, 2, 4, 3, 5]), length)

    whole, _ = ppo_policy_loss(lp, old, adv, mask, cliprange=0.2, level=level)
    (grad_whole,) = torch.autograd.grad(whole, lp)

    normalizer = mask.sum() if level == "token" else batch  # global count for the whole minibatch
    parts = [
        ppo_policy_loss(lp[s], old[s], adv[s], mask[s], cliprange=0.2, level=level, normalizer=normalizer)[0]
        for s in (slice(0, 3), slice(3, 6))
    ]
    summed = parts[0] + parts[1]
    (grad_parts,) = torch.autograd.grad(summed, lp)
    torch.testing.assert_close(summed, whole)
    torch.testing.assert_close(grad_parts, grad_whole)
    if level == "token":
        # the halves hold 8 and 12 tokens, so averaging two local means would NOT match
        local = [ppo_policy_loss(lp[s], old[s], adv[s], mask[s], cliprange=0.2)[0] for s in (slice(0, 3), slice(3, 6))]
        assert not torch.allclose((local[0] + local[1]) / 2, whole)


# --------------------------------------------------------------------------------------------
# Value loss, entropy bonus
# --------------------------------------------------------------------------------------------


def test_value_loss_by_hand():
    # c = 0.2:
    #   V = 1.0, V_old = 0.5, R = 0.0: (1 − 0)² = 1; clip(1.0, 0.3, 0.7) = 0.7 → 0.49; ½·max = 0.5
    #   V = 0.0, V_old = 0.5, R = 0.1: (−0.1)² = 0.01; clip(0.0, 0.3, 0.7) = 0.3 → 0.04 (clipped); ½·0.04 = 0.02
    #   third token is padding
    # loss = (0.5 + 0.02)/2 = 0.26, vf_clipfrac 0.5, value_error (1 + 0.01)/2 = 0.505, vpred 0.5
    values = torch.tensor([[1.0, 0.0, 7.0]])
    old = torch.tensor([[0.5, 0.5, 0.0]])
    returns = torch.tensor([[0.0, 0.1, 0.0]])
    mask = torch.tensor([[True, True, False]])
    loss, stats = ppo_value_loss(values, old, returns, mask, cliprange_value=0.2)
    _close(loss, 0.26)
    _close(stats["vf_clipfrac"], 0.5)
    _close(stats["value_error"], 0.505)
    _close(stats["vpred"], 0.5)
    # no clipping: ½·(1 + 0.01)/2 = 0.2525; global normalizer 4 instead of 2 halves it
    _close(ppo_value_loss(values, old, returns, mask, cliprange_value=None)[0], 0.2525)
    _close(ppo_value_loss(values, old, returns, mask, cliprange_value=None, normalizer=4)[0], 0.12625)


def test_entropy_bonus():
    # −0.01·mean(1, 2) = −0.015 (the 9 is padding)
    loss, stats = entropy_bonus(torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[True, True, False]]), coef=0.01)
    _close(loss, -0.015)
    _close(stats["entropy"], 1.5)


# --------------------------------------------------------------------------------------------
# DPO / IPO / XPO
# --------------------------------------------------------------------------------------------

# pair 0: π_c = −1, π_r = −2, ref_c = ref_r = −1.5 → logits = (−1 + 2) − 0 = 1
# pair 1: π_c = −3, π_r = −1, ref_c = ref_r = −2   → logits = (−3 + 1) − 0 = −2
PAIRS = dict(
    chosen_logps=torch.tensor([-1.0, -3.0]),
    rejected_logps=torch.tensor([-2.0, -1.0]),
    ref_chosen_logps=torch.tensor([-1.5, -2.0]),
    ref_rejected_logps=torch.tensor([-1.5, -2.0]),
)


def test_dpo_sigmoid_by_hand():
    # β = 0.1: −logσ(0.1) = ln(1 + e^−0.1) = 0.644396641; −logσ(−0.2) = ln(1 + e^0.2) = 0.798138869
    loss, stats = dpo_loss(**PAIRS, beta=0.1)
    _close(loss, (0.644396641 + 0.798138869) / 2)
    # implicit rewards: chosen β(π_c − ref_c) = [0.05, −0.1], rejected β(π_r − ref_r) = [−0.05, 0.1]
    _close(stats["rewards/chosen"], -0.025)
    _close(stats["rewards/rejected"], 0.025)
    _close(stats["rewards/margins"], -0.05)
    _close(stats["rewards/accuracies"], 0.5)
    _close(stats["logps/chosen"], -2.0)
    # normalizer 4 (pairs in the whole minibatch) halves the mean of these two pairs
    _close(dpo_loss(**PAIRS, beta=0.1, normalizer=4)[0], (0.644396641 + 0.798138869) / 4)


def test_ipo_by_hand():
    # β = 0.1 → 1/(2β) = 5: (1 − 5)² = 16, (−2 − 5)² = 49, mean 32.5
    loss, _ = dpo_loss(**PAIRS, beta=0.1, loss_type="ipo")
    _close(loss, 32.5)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(**PAIRS, beta=0.1, loss_type="hinge")


def test_xpo_by_hand():
    # pair 0 only: DPO term 0.644396641 + α·log π_θ(y_ref) = 0.01·(−4) = −0.04 → 0.604396641
    one = {k: v[:1] for k, v in PAIRS.items()}
    loss, stats = xpo_loss(**one, policy_logps_ref_completion=torch.tensor([-4.0]), beta=0.1, alpha=0.01)
    _close(loss, 0.604396641)
    _close(stats["loss/dpo"], 0.644396641)
    _close(stats["loss/xpo"], -0.04)


def test_dpo_gradient_sign():
    # Minimising the sigmoid loss raises the chosen logprob and lowers the rejected one.
    chosen = torch.tensor([-1.0], requires_grad=True)
    rejected = torch.tensor([-1.0], requires_grad=True)
    loss, _ = dpo_loss(chosen, rejected, torch.tensor([-1.0]), torch.tensor([-1.0]), beta=0.5)
    loss.backward()
    # d/dπ_c [−logσ(β·x)] = −β·σ(−β·x) = −0.5·0.5 = −0.25 at x = 0
    torch.testing.assert_close(chosen.grad, torch.tensor([-0.25]))
    torch.testing.assert_close(rejected.grad, torch.tensor([0.25]))


# --------------------------------------------------------------------------------------------
# Bradley–Terry
# --------------------------------------------------------------------------------------------


def test_bradley_terry_by_hand():
    rc = torch.tensor([2.0, 0.0])
    rr = torch.tensor([1.0, 1.0])
    # r_c − r_r = [1, −1]: −logσ(1) = ln(1 + e^−1) = 0.313261687, −logσ(−1) = ln(1 + e) = 1.313261687
    loss, stats = bradley_terry_loss(rc, rr)
    _close(loss, (0.313261687 + 1.313261687) / 2)
    _close(stats["accuracy"], 0.5)
    _close(stats["margin"], 0.0)
    _close(stats["chosen_rewards"], 1.0)
    _close(stats["rejected_rewards"], 1.0)
    # margin [1, 0]: differences [0, −1] → ln 2 = 0.693147181 and 1.313261687
    loss_m, _ = bradley_terry_loss(rc, rr, margin=torch.tensor([1.0, 0.0]))
    _close(loss_m, (0.693147181 + 1.313261687) / 2)
    # centring 0.01·mean((r_c + r_r)²) = 0.01·(9 + 1)/2 = 0.05
    loss_c, _ = bradley_terry_loss(rc, rr, center_rewards_coefficient=0.01)
    _close(loss_c, (0.313261687 + 1.313261687) / 2 + 0.05)


# --------------------------------------------------------------------------------------------
# SFT NLL
# --------------------------------------------------------------------------------------------


def test_chunked_nll_by_hand():
    # row 0: logits [1, 0, 0], label 2 → −log(e⁰/(e + 2)) = ln 4.718281828 = 1.551444714; argmax 0 ≠ 2
    # row 1: logits [0, ln 3, 0], label 1 → p = 3/5 → ln(5/3) = 0.510825624; argmax 1 = label
    # row 2: ignored (−100)
    logits = torch.tensor([[[1.0, 0.0, 0.0], [0.0, math.log(3.0), 0.0], [5.0, 0.0, 0.0]]])
    labels = torch.tensor([[2, 1, -100]])
    loss, stats = chunked_nll(logits, labels)
    _close(loss, (1.551444714 + 0.510825624) / 2)
    _close(stats["token_accuracy"], 0.5)
    _close(stats["num_correct"], 1.0)
    _close(stats["count"], 2.0)


def test_chunked_nll_matches_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (3, 6), generator=g)
    labels[0, :2] = -100
    labels[2, 4:] = -100
    loss, _ = chunked_nll(logits, labels, chunk_tokens=4)
    (grad,) = torch.autograd.grad(loss, logits)
    expected = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)


def test_chunked_nll_all_ignored_still_backpropagates():
    logits = torch.randn(1, 3, 5, requires_grad=True)
    loss, stats = chunked_nll(logits, torch.full((1, 3), -100), normalizer=10)
    loss.backward()
    _close(loss, 0.0)
    _close(stats["count"], 0.0)
    assert torch.all(logits.grad == 0)


def test_dft_loss_by_hand():
    # Same rows as test_chunked_nll_by_hand; each token's NLL is weighted by its probability p:
    # row 0: p = 1/(e + 2) = 0.211941558, −log p = 1.551444714 → 0.211941558 · 1.551444714 = 0.328815609
    # row 1: p = 3/5, −log p = 0.510825624 → 0.6 · 0.510825624 = 0.306495374
    # loss = (0.328815609 + 0.306495374) / 2 real labels = 0.317655492
    logits = torch.tensor([[[1.0, 0.0, 0.0], [0.0, math.log(3.0), 0.0], [5.0, 0.0, 0.0]]], requires_grad=True)
    labels = torch.tensor([[2, 1, -100]])
    loss, stats = dft_loss(logits, labels)
    _close(loss, 0.317655492)
    _close(stats["nll"], (1.551444714 + 0.510825624) / 2)  # the plain NLL, unweighted
    _close(stats["token_accuracy"], 0.5)
    _close(stats["count"], 2.0)
    # The weight is detached: d/dz = p · (softmax(z) − onehot(label)) / 2.
    # row 0: softmax = [e, 1, 1] / (e + 2) = [0.576116885, 0.211941558, 0.211941558]
    #        0.211941558 · [0.576116885, 0.211941558, −0.788058442] / 2 = [0.061051555, 0.022459612, −0.083511167]
    # row 1: softmax = [0.2, 0.6, 0.2] → 0.6 · [0.2, −0.4, 0.2] / 2 = [0.06, −0.12, 0.06]; row 2 ignored.
    loss.backward()
    expected = torch.tensor([[[0.061051555, 0.022459612, -0.083511167], [0.06, -0.12, 0.06], [0.0, 0.0, 0.0]]])
    torch.testing.assert_close(logits.grad, expected, rtol=0, atol=1e-7)
    # normalizer=1: the plain sum (the SFT trainer divides by the global token count itself).
    loss_sum, _ = dft_loss(logits.detach(), labels, normalizer=1.0)
    _close(loss_sum, 0.328815609 + 0.306495374)


def test_non_finite_padding_does_not_leak():
    # Padding positions may hold anything (stale logprobs, NaN advantages, inf values); the losses
    # select with where() so neither the loss nor its gradient sees them.
    mask = torch.tensor([[True, False]])
    lp = torch.tensor([[-1.0, float("nan")]], requires_grad=True)
    adv = torch.tensor([[2.0, float("nan")]])
    loss, stats = ppo_policy_loss(lp, torch.tensor([[-1.0, 0.0]]), adv, mask, cliprange=0.2)
    loss.backward()
    _close(loss, -2.0)
    assert all(torch.isfinite(v) for v in stats.values())
    assert torch.isfinite(lp.grad).all()
    values = torch.tensor([[0.5, float("inf")]], requires_grad=True)
    vloss, vstats = ppo_value_loss(values, torch.tensor([[0.5, 0.0]]), torch.tensor([[1.5, float("nan")]]), mask, 0.2)
    vloss.backward()
    _close(vloss, 0.5)  # ½·(0.5 − 1.5)²
    assert all(torch.isfinite(v) for v in vstats.values())
    assert torch.isfinite(values.grad).all()
    eloss, _ = entropy_bonus(torch.tensor([[1.0, float("nan")]]), mask, coef=1.0)
    _close(eloss, -1.0)
