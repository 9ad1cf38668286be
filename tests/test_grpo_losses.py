"""posttrain.grpo_losses: hand-derived numbers for each GRPO variant, and equality with TRL 1.16.

The TRL comparison reads tests/fixtures/grpo_losses_trl_1_16.json, written by
tests/fixtures/make_grpo_losses_trl_1_16.py with TRL 1.16's own `GRPOTrainer._compute_loss` and
advantage code (see that script's docstring); TRL itself is not needed to run these tests.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from posttrain.grpo_losses import (
    EntropyController,
    grpo_advantages,
    grpo_entropy_term,
    grpo_policy_loss,
    high_entropy_mask,
    log_importance_weights,
    off_policy_sequence_mask,
    resolve_scale_rewards,
    truncation_loss_mask,
    vespo_weights,
)
from posttrain.trainers.grpo_config import LOSS_TYPES

FIXTURE = Path(__file__).parent / "fixtures" / "grpo_losses_trl_1_16.json"


def _close(actual, expected, tol=1e-6):
    value = float(actual.detach() if torch.is_tensor(actual) else actual)
    assert value == pytest.approx(expected, abs=tol, rel=tol)


def _tiny():
    """2 sequences × 3 tokens; old logprobs 0, so the token ratios are ρ = exp(lp):

    sequence 0: ρ = (1.5, 0.5, 1.1), 3 real tokens, A = +1
    sequence 1: ρ = (0.7, 1.0, ·),   2 real tokens (the third is padding, with an absurd logprob), A = −1
    """
    lp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1)], [math.log(0.7), 0.0, 50.0]], requires_grad=True)
    old = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return lp, old, adv, mask


# Per-token clipped surrogate of _tiny() with ε = 0.2, ℓ = −min(ρ·A, clip(ρ, 0.8, 1.2)·A):
#   seq 0 (A = +1): ρ 1.5 → −min(1.5, 1.2) = −1.2;  ρ 0.5 → −min(0.5, 0.8) = −0.5;  ρ 1.1 → −1.1   (sum −2.8)
#   seq 1 (A = −1): ρ 0.7 → −min(−0.7, −0.8) = 0.8;  ρ 1.0 → 1.0                                    (sum 1.8)
SEQ0_SUM, SEQ1_SUM = -2.8, 1.8


@pytest.mark.parametrize(
    ("loss_type", "kwargs", "expected"),
    [
        # grpo: mean over sequences of each sequence's token mean = (−2.8/3 + 1.8/2) / 2
        ("grpo", {}, (SEQ0_SUM / 3 + SEQ1_SUM / 2) / 2),
        # bnpo: token sum / tokens of this batch = (−2.8 + 1.8) / 5
        ("bnpo", {}, (SEQ0_SUM + SEQ1_SUM) / 5),
        # dr_grpo: token sum / (B · max_completion_length) = −1 / (2 · 4)
        ("dr_grpo", {"max_completion_length": 4}, (SEQ0_SUM + SEQ1_SUM) / 8),
        # dapo: token sum / normalizer (the global token count); by default this call's 5 tokens
        ("dapo", {}, (SEQ0_SUM + SEQ1_SUM) / 5),
        ("dapo", {"normalizer": 10}, (SEQ0_SUM + SEQ1_SUM) / 10),
    ],
)
def test_clipped_loss_types_by_hand(loss_type, kwargs, expected):
    lp, old, adv, mask = _tiny()
    loss, stats = grpo_policy_loss(lp, old, adv, mask, loss_type=loss_type, **kwargs)
    _close(loss, expected)
    _close(stats["policy_loss"], expected)
    # clip flags over the 5 loss tokens: low = ρ < 0.8 with A < 0 (ρ 0.7 of seq 1), high = ρ > 1.2 with
    # A > 0 (ρ 1.5 of seq 0); ρ 0.5 has A > 0, so it is not a low clip.
    _close(stats["clip_ratio/low_mean"], 1 / 5)
    _close(stats["clip_ratio/high_mean"], 1 / 5)
    _close(stats["clip_ratio/region_mean"], 2 / 5)
    # per sequence: low (0/3, 1/2) -> min 0; high (1/3, 0/2) -> max 1/3
    _close(stats["clip_ratio/low_min"], 0.0)
    _close(stats["clip_ratio/high_max"], 1 / 3)
    _close(stats["count"], 5)
    _close(stats["count/clip"], 5)
    assert "kl" not in stats


def test_dapo_gradient_flows_only_through_unclipped_tokens():
    lp, old, adv, mask = _tiny()
    loss, _ = grpo_policy_loss(lp, old, adv, mask, loss_type="dapo")
    loss.backward()
    # dℓ/dlp = −A·ρ on unclipped tokens, 0 where the clipped term is the min; / 5 tokens:
    # seq 0: ρ 1.5 clipped → 0; ρ 0.5 → −0.5/5; ρ 1.1 → −1.1/5;  seq 1: ρ 0.7 clipped → 0; ρ 1.0 → +1/5; pad 0
    expected = torch.tensor([[0.0, -0.1, -0.22], [0.0, 0.2, 0.0]])
    torch.testing.assert_close(lp.grad, expected, atol=1e-6, rtol=1e-6)


def test_epsilon_high_raises_only_the_upper_clip():
    lp, old, adv, mask = _tiny()
    # ε_high = 0.6: ρ 1.5 with A = +1 is no longer clipped: −min(1.5, clip(1.5, 0.8, 1.6)) = −1.5, so
    # seq 0 sums to −3.1 and dapo = (−3.1 + 1.8) / 5 = −0.26; the low clip (ρ 0.7, A < 0) is unchanged.
    loss, stats = grpo_policy_loss(lp, old, adv, mask, loss_type="dapo", epsilon=0.2, epsilon_high=0.6)
    _close(loss, -0.26)
    _close(stats["clip_ratio/high_mean"], 0.0)
    _close(stats["clip_ratio/low_mean"], 1 / 5)


def test_delta_caps_the_ratio_of_negative_advantage_tokens():
    # One sequence, ρ = (2.0, 0.5), A = −1, ε = 0.2. ℓ = −min(ρ̃·A, clip(ρ)·A) = max(ρ̃, clip(ρ)):
    #   without delta: ρ 2.0 → max(2.0, 1.2) = 2.0;  ρ 0.5 → max(0.5, 0.8) = 0.8   → dapo (2.0 + 0.8)/2 = 1.4
    #   delta = 1.3:   ρ̃ = min(2.0, 1.3) = 1.3 → max(1.3, 1.2) = 1.3                 → dapo (1.3 + 0.8)/2 = 1.05
    lp = torch.tensor([[math.log(2.0), math.log(0.5)]], requires_grad=True)
    old, adv, mask = torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2, dtype=torch.bool)
    plain, _ = grpo_policy_loss(lp, old, adv, mask, loss_type="dapo")
    _close(plain, 1.4)
    capped, stats = grpo_policy_loss(lp, old, adv, mask, loss_type="dapo", delta=1.3)
    _close(capped, 1.05)
    capped.backward()
    # the capped token's loss is the constant 1.3: no gradient; ρ 0.5 is clipped (0.8 > 0.5): none either
    torch.testing.assert_close(lp.grad, torch.zeros(1, 2))
    # the clip flags use the capped ratio (as TRL logs them): low = 0.5 < 0.8 with A < 0 → 1 of 2
    _close(stats["clip_ratio/low_mean"], 0.5)


def test_sequence_level_importance_sampling_is_gspo():
    lp, old, adv, mask = _tiny()
    # GSPO: log ρ_seq = mean of the token log-ratios over the completion, broadcast over its tokens.
    # seq 0: ρ = (1.5·0.5·1.1)^(1/3) = 0.825^(1/3) ≈ 0.9379;  seq 1: ρ = (0.7·1.0)^(1/2) ≈ 0.8367 (pad ignored)
    rho0, rho1 = 0.825 ** (1 / 3), 0.7**0.5
    log_w = log_importance_weights(lp, old, mask, "sequence")
    assert log_w.shape == (2, 1)
    torch.testing.assert_close(log_w.exp().squeeze(1), torch.tensor([rho0, rho1]))
    # Neither ratio leaves [0.8, 1.2], so ℓ = −ρ·A on every token of the sequence:
    #   grpo: (−ρ0 + ρ1) / 2 (each sequence's token mean is its constant);
    #   dapo: (3·(−ρ0) + 2·ρ1) / 5 (the per-sequence term is summed over its tokens).
    grpo, stats = grpo_policy_loss(lp, old, adv, mask, loss_type="grpo", importance_sampling_level="sequence")
    _close(grpo, (-rho0 + rho1) / 2)
    dapo, _ = grpo_policy_loss(lp, old, adv, mask, loss_type="dapo", importance_sampling_level="sequence")
    _close(dapo, (-3 * rho0 + 2 * rho1) / 5)
    # the clip ratios are then counted per sequence (2), not per token
    _close(stats["count/clip"], 2)
    _close(stats["clip_ratio/region_mean"], 0.0)
    # with ε = 0.1 seq 1 (ρ 0.837 < 0.9, A < 0) is low-clipped: 1 of 2 sequences
    _, stats = grpo_policy_loss(lp, old, adv, mask, loss_type="grpo", importance_sampling_level="sequence", epsilon=0.1)
    _close(stats["clip_ratio/low_mean"], 0.5)
    _close(stats["clip_ratio/low_min"], 0.0)


def test_token_and_sequence_level_agree_for_one_token_sequences():
    # With one token per completion the sequence mean of log-ratios is the token log-ratio itself.
    lp = torch.tensor([[math.log(1.5)], [math.log(0.7)]])
    old, adv, mask = torch.zeros(2, 1), torch.tensor([1.0, -1.0]), torch.ones(2, 1, dtype=torch.bool)
    for loss_type in ("grpo", "dapo", "cispo", "sapo"):
        token, _ = grpo_policy_loss(lp, old, adv, mask, loss_type=loss_type, importance_sampling_level="token")
        seq, _ = grpo_policy_loss(lp, old, adv, mask, loss_type=loss_type, importance_sampling_level="sequence")
        _close(seq, float(token))


def test_cispo_by_hand():
    lp, old, adv, mask = _tiny()
    # CISPO with ε_high = 1.2 as an absolute cap: c = sg[min(ρ, 1.2)], ℓ = −c·A·log π.
    # seq 0 (A = +1): c = (1.2, 0.5, 1.1), ℓ = −(1.2·ln 1.5 + 0.5·ln 0.5 + 1.1·ln 1.1)
    # seq 1 (A = −1): c = (0.7, 1.0),      ℓ = +(0.7·ln 0.7 + 1.0·ln 1.0)
    # aggregated as dapo: / 5 tokens
    seq0 = -(1.2 * math.log(1.5) + 0.5 * math.log(0.5) + 1.1 * math.log(1.1))
    seq1 = 0.7 * math.log(0.7)
    loss, stats = grpo_policy_loss(lp, old, adv, mask, loss_type="cispo", epsilon_high=1.2)
    _close(loss, (seq0 + seq1) / 5)
    # ρ > 1.2 with A > 0: only ρ 1.5 → 1/5; no clip_ratio/* stats for cispo
    _close(stats["cispo_clip_ratio"], 1 / 5)
    assert "clip_ratio/low_mean" not in stats
    loss.backward()
    # the weight is detached: dℓ/dlp = −c·A / 5
    expected = torch.tensor([[-1.2, -0.5, -1.1], [0.7, 1.0, 0.0]]) / 5
    torch.testing.assert_close(lp.grad, expected, atol=1e-6, rtol=1e-6)


def test_sapo_by_hand():
    lp, old, adv, mask = _tiny()
    # SAPO: ℓ = −(4/τ)·σ(τ(ρ − 1))·A, τ = 1.0 for A > 0 (seq 0), 1.05 for A ≤ 0 (seq 1); grpo aggregation.
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    seq0 = [-4 * sig(r - 1) for r in (1.5, 0.5, 1.1)]
    seq1 = [(4 / 1.05) * sig(1.05 * (r - 1)) for r in (0.7, 1.0)]
    expected = (sum(seq0) / 3 + sum(seq1) / 2) / 2
    loss, stats = grpo_policy_loss(lp, old, adv, mask, loss_type="sapo")
    _close(loss, expected)
    assert set(stats) == {"policy_loss", "count", "count/clip"}
    # other temperatures: τ_pos = 2, τ_neg = 0.5
    seq0 = [-2 * sig(2 * (r - 1)) for r in (1.5, 0.5, 1.1)]
    seq1 = [8 * sig(0.5 * (r - 1)) for r in (0.7, 1.0)]
    loss, _ = grpo_policy_loss(lp, old, adv, mask, loss_type="sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=0.5)
    _close(loss, (sum(seq0) / 3 + sum(seq1) / 2) / 2)


def test_luspo_by_hand():
    lp, old, adv, mask = _tiny()
    # LUSPO: the clipped surrogate, summed over each sequence's tokens, then averaged over sequences.
    # Token level: (SEQ0_SUM + SEQ1_SUM) / 2; the clip ratios are grpo's (ρ 1.5 high-clipped, ρ 0.7 low-clipped).
    loss, stats = grpo_policy_loss(lp, old, adv, mask, loss_type="luspo")
    _close(loss, (SEQ0_SUM + SEQ1_SUM) / 2)
    _close(stats["clip_ratio/high_mean"], 1 / 5)
    _close(stats["clip_ratio/low_mean"], 1 / 5)
    # Sequence level (the paper's setup): ρ_0 = (1.5·0.5·1.1)^(1/3) ≈ 0.938, A = +1, unclipped, over 3 tokens;
    # ρ_1 = 0.7^(1/2) ≈ 0.837, A = −1, unclipped (inside [0.8, 1.2]), over 2 tokens: (−3·ρ_0 + 2·ρ_1) / 2.
    rho0, rho1 = (1.5 * 0.5 * 1.1) ** (1 / 3), 0.7**0.5
    loss, _ = grpo_policy_loss(lp, old, adv, mask, loss_type="luspo", importance_sampling_level="sequence")
    _close(loss, (-3 * rho0 + 2 * rho1) / 2)
    # ∂/∂lp_t of −A·L·ρ_seq / B with ρ_seq = exp(mean log ρ): −A·ρ_seq / B on each of the sequence's tokens.
    loss.backward()
    expected = torch.tensor([[-rho0 / 2] * 3, [rho1 / 2, rho1 / 2, 0.0]])
    torch.testing.assert_close(lp.grad, expected, atol=1e-6, rtol=1e-6)
    _close(grpo_policy_loss(lp, old, adv, mask, loss_type="luspo", accumulation_steps=2)[0], (SEQ0_SUM + SEQ1_SUM) / 4)


def test_vespo_by_hand():
    lp, old, adv, mask = _tiny()
    # Sequence ratios (products over the loss tokens; the padding's logprob 50 is left out):
    #   w_0 = 1.5·0.5·1.1 = 0.825 with A = +1: k 2, λ 3 → φ_0 = e^3·0.825²·e^(−3·0.825)
    #   w_1 = 0.7·1.0 = 0.7     with A = −1: k 3, λ 2 → φ_1 = e^2·0.7³·e^(−2·0.7)
    phi0 = math.exp(3) * 0.825**2 * math.exp(-3 * 0.825)
    phi1 = math.exp(2) * 0.7**3 * math.exp(-2 * 0.7)
    torch.testing.assert_close(
        vespo_weights(lp.detach() - old, adv, mask), torch.tensor([[phi0], [phi1]]), atol=1e-6, rtol=1e-6
    )
    # ℓ_t = −φ·A·log π_θ(y_t), summed and divided by the 5 loss tokens (dapo's aggregation)
    seq0 = -phi0 * (math.log(1.5) + math.log(0.5) + math.log(1.1))
    seq1 = phi1 * (math.log(0.7) + 0.0)
    loss, stats = grpo_policy_loss(lp, old, adv, mask, loss_type="vespo")
    _close(loss, (seq0 + seq1) / 5)
    _close(stats["vespo/phi_seq_mean"], (phi0 + phi1) / 2)
    assert stats["count/clip"].item() == 2 and "clip_ratio/low_mean" not in stats
    # φ is detached: the gradient is −φ·A / 5 on every loss token, the REINFORCE gradient reweighted
    loss.backward()
    expected = torch.tensor([[-phi0] * 3, [phi1, phi1, 0.0]]) / 5
    torch.testing.assert_close(lp.grad, expected, atol=1e-6, rtol=1e-6)
    # φ(1) = 1 whatever k and λ; φ peaks at w = k/λ; an overflowing ratio gets weight 0, not NaN
    one = vespo_weights(torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), k_pos=5.0)
    assert one.item() == pytest.approx(1.0)
    peak = vespo_weights(torch.tensor([[math.log(2 / 3)]]), torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool))
    assert peak.item() == pytest.approx(math.e * 4 / 9)
    huge = vespo_weights(torch.full((1, 3), 30.0), torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.bool))
    assert huge.item() == 0.0


def test_every_loss_type_has_the_policy_gradient_at_ratio_one():
    # On-policy (ρ = 1): the gradient of every variant is −A·∇log π, weighted by its aggregation.
    # grpo / sapo weight each token by 1/(B·|y_b|): seq 0 tokens −1/(2·3), seq 1 tokens +1/(2·2).
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], requires_grad=True)
    _, _, adv, mask = _tiny()
    expected = torch.tensor([[-1 / 6, -1 / 6, -1 / 6], [0.25, 0.25, 0.0]])
    for loss_type in ("grpo", "sapo"):
        lp.grad = None
        grpo_policy_loss(lp, lp.detach(), adv, mask, loss_type=loss_type)[0].backward()
        torch.testing.assert_close(lp.grad, expected, atol=1e-6, rtol=1e-6)
    # luspo: each token weighs 1/B
    lp.grad = None
    grpo_policy_loss(lp, lp.detach(), adv, mask, loss_type="luspo")[0].backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5, -0.5, -0.5], [0.5, 0.5, 0.0]]), atol=1e-6, rtol=1e-6)
    # bnpo / dapo / cispo / vespo (φ(1) = 1): 1/5 per token
    for loss_type in ("bnpo", "dapo", "cispo", "vespo"):
        lp.grad = None
        grpo_policy_loss(lp, lp.detach(), adv, mask, loss_type=loss_type, epsilon_high=5.0)[0].backward()
        torch.testing.assert_close(lp.grad, torch.tensor([[-0.2, -0.2, -0.2], [0.2, 0.2, 0.0]]), atol=1e-6, rtol=1e-6)


def test_kl_term_k3_with_and_without_bias_correction():
    # One token, ρ = 1.5 (lp = ln 1.5, old = 0), ref = lp + ln 2, A = 0 (no policy term):
    # k3 = e^(ref − lp) − (ref − lp) − 1 = 2 − ln 2 − 1 ≈ 0.30685; with the bias correction (TRL 1.16's
    # default) KL·ρ = 1.5·0.30685. loss = beta·KL (dapo, one token).
    lp = torch.tensor([[math.log(1.5)]])
    ref = lp + math.log(2.0)
    k3 = 1 - math.log(2.0)
    args = (lp, torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1, dtype=torch.bool))
    loss, stats = grpo_policy_loss(*args, beta=0.1, ref_logprobs=ref)
    _close(loss, 0.1 * 1.5 * k3)
    _close(stats["kl"], 1.5 * k3)
    loss, stats = grpo_policy_loss(*args, beta=0.1, ref_logprobs=ref, use_bias_correction_kl=False)
    _close(loss, 0.1 * k3)
    _close(stats["kl"], k3)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_policy_loss(*args, beta=0.1)


def test_high_entropy_mask_and_its_effect_on_the_loss():
    lp, old, adv, mask = _tiny()
    entropies = torch.tensor([[0.1, 2.0, 0.5], [1.0, 3.0, 9.9]])  # 9.9 sits on padding and is ignored
    # top 40%: threshold = quantile of (0.1, 0.5, 1.0, 2.0, 3.0) at 0.6 = 1.0 + 0.4·(2.0 − 1.0) = 1.4
    keep = high_entropy_mask(entropies, mask, 0.4)
    assert keep.tolist() == [[False, True, False], [False, True, False]]
    # 1.0 keeps every loss token, 0.0 only the highest-entropy one
    assert torch.equal(high_entropy_mask(entropies, mask, 1.0), mask)
    assert high_entropy_mask(entropies, mask, 0.0).tolist() == [[False, False, False], [False, True, False]]
    # the quantile may come from every process's tokens: with a pooled 10.0 the top 20% keeps nothing here
    pooled = torch.tensor([0.1, 2.0, 0.5, 1.0, 3.0, 10.0, 10.0, 10.0, 10.0, 10.0])
    assert not high_entropy_mask(entropies, mask, 0.2, all_entropies=pooled).any()
    # dapo with the mask: only ρ 0.5 of seq 0 (ℓ −0.5) and ρ 1.0 of seq 1 (ℓ 1.0) keep their loss, but the
    # denominator still counts all 5 loss tokens (as TRL): (−0.5 + 1.0) / 5 = 0.1
    loss, _ = grpo_policy_loss(lp, old, adv, mask, loss_type="dapo", entropy_mask=keep)
    _close(loss, 0.1)
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        high_entropy_mask(entropies, mask, 1.5)


def test_mask_truncated_completions():
    lp, old, adv, mask = _tiny()
    # sequence 1 did not stop: it leaves the loss. dapo: −2.8 / 3 tokens; grpo still averages over the
    # B = 2 sequences, the masked one contributing 0 (TRL's behaviour): (−2.8/3 + 0) / 2.
    loss_mask = truncation_loss_mask(mask, torch.tensor([True, False]))
    assert loss_mask.tolist() == [[True, True, True], [False, False, False]]
    dapo, stats = grpo_policy_loss(lp, old, adv, loss_mask, loss_type="dapo")
    _close(dapo, SEQ0_SUM / 3)
    _close(stats["count"], 3)
    grpo, _ = grpo_policy_loss(lp, old, adv, loss_mask, loss_type="grpo")
    _close(grpo, SEQ0_SUM / 3 / 2)
    with pytest.raises(ValueError, match="one flag per completion"):
        truncation_loss_mask(mask, torch.tensor([True]))


def test_accumulation_steps_divide_the_mean_losses_only():
    lp, old, adv, mask = _tiny()
    grpo, stats = grpo_policy_loss(lp, old, adv, mask, loss_type="grpo", accumulation_steps=4)
    _close(grpo, (SEQ0_SUM / 3 + SEQ1_SUM / 2) / 2 / 4)
    _close(stats["policy_loss"], (SEQ0_SUM / 3 + SEQ1_SUM / 2) / 2)
    # dapo's normalizer already says how many tokens the whole step holds
    dapo, _ = grpo_policy_loss(lp, old, adv, mask, loss_type="dapo", accumulation_steps=4, normalizer=10)
    _close(dapo, (SEQ0_SUM + SEQ1_SUM) / 10)


def test_policy_loss_errors():
    lp, old, adv, mask = _tiny()
    with pytest.raises(ValueError, match="loss_type must be one of"):
        grpo_policy_loss(lp, old, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        grpo_policy_loss(lp, old, adv, mask, importance_sampling_level="batch")
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_policy_loss(lp, old, adv, mask, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="normalizer"):
        grpo_policy_loss(lp, old, adv, mask, normalizer=0)


# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------


def test_scale_rewards_group_batch_none():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [4.0, 4.0, 4.0]])  # (num_prompts = 2, num_generations = 3)
    # group: mean (2, 4); unbiased std (1, 0) → A = (−1, 0, 1)/(1 + 1e-4) and 0/(0 + 1e-4) = 0
    adv, stats = grpo_advantages(rewards, scale_rewards="group")
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]) / 1.0001)
    _close(stats["frac_reward_zero_std"], 0.5)
    _close(stats["reward"], 3.0)
    # batch: the group mean is still subtracted, divided by the std of all six rewards:
    # mean 3, squared deviations 4 + 1 + 0 + 1 + 1 + 1 = 8, unbiased var 8/5 → std √1.6
    adv, stats = grpo_advantages(rewards, scale_rewards="batch")
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]) / (math.sqrt(1.6) + 1e-4))
    _close(stats["frac_reward_zero_std"], 0.0)
    # none (Dr. GRPO): only centred
    adv, stats = grpo_advantages(rewards, scale_rewards="none")
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))
    _close(stats["frac_reward_zero_std"], 0.5)
    # True / False are the aliases TRL 1.16 accepts
    torch.testing.assert_close(grpo_advantages(rewards, scale_rewards=True)[0], grpo_advantages(rewards)[0])
    torch.testing.assert_close(grpo_advantages(rewards, scale_rewards=False)[0], adv)


def test_resolve_scale_rewards():
    assert resolve_scale_rewards(True) == "group"
    assert resolve_scale_rewards(False) == "none"
    assert resolve_scale_rewards("False") == "none"
    assert resolve_scale_rewards("batch") == "batch"
    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        resolve_scale_rewards("global")


def test_multi_objective_aggregation():
    # 2 prompts × 2 generations × 2 reward functions, weights (1, 0.5)
    f1 = torch.tensor([[1.0, 3.0], [0.0, 0.0]])
    f2 = torch.tensor([[10.0, 10.0], [2.0, 6.0]])
    rewards = torch.stack([f1, f2], dim=-1)
    s = math.sqrt(2)  # unbiased std of two values a, b is |a − b|/√2
    # sum_then_normalize: r = f1 + 0.5·f2 = [[6, 8], [1, 3]]; group means (7, 2), stds (√2, √2)
    adv, stats = grpo_advantages(rewards, reward_weights=[1.0, 0.5])
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 1.0], [-1.0, 1.0]]) / (s + 1e-4))
    _close(stats["reward"], 4.5)
    # normalize_then_sum (GDPO): each function per group first:
    #   f1: group 0 (1, 3) → ±1/(√2 + 1e-4); group 1 (0, 0) → 0
    #   f2: group 0 (10, 10) → 0;             group 1 (2, 6) → ±2/(2√2 + 1e-4)
    # r = f1n + 0.5·f2n, then (r − batch mean) / (batch std + 1e-4)
    a, b = 1 / (s + 1e-4), 0.5 * 2 / (2 * s + 1e-4)
    r = torch.tensor([-a, a, -b, b])
    expected = ((r - r.mean()) / (r.std() + 1e-4)).view(2, 2)
    adv, _ = grpo_advantages(rewards, reward_weights=[1.0, 0.5], multi_objective_aggregation="normalize_then_sum")
    torch.testing.assert_close(adv, expected)
    # scale_rewards does not apply to normalize_then_sum
    same, _ = grpo_advantages(
        rewards, reward_weights=[1.0, 0.5], multi_objective_aggregation="normalize_then_sum", scale_rewards="none"
    )
    torch.testing.assert_close(same, expected)
    with pytest.raises(ValueError, match="multi_objective_aggregation"):
        grpo_advantages(rewards, multi_objective_aggregation="mean")
    with pytest.raises(ValueError, match="reward_weights has 1 entries for 2"):
        grpo_advantages(rewards, reward_weights=[1.0])


def test_unscorable_completion_gets_zero_advantage():
    # The middle completion has no reward (NaN): it is left out of the group statistics and gets 0:
    # mean of (1, 3) = 2, std √2.
    adv, _ = grpo_advantages(torch.tensor([[1.0, math.nan, 3.0]]))
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0, 1.0]]) / (math.sqrt(2) + 1e-4))


def test_advantages_shape_errors():
    with pytest.raises(ValueError, match="num_prompts, num_generations"):
        grpo_advantages(torch.zeros(6))


# --------------------------------------------------------------------------------------------
# Equality with TRL 1.16 (values TRL itself computed; see tests/fixtures/make_grpo_losses_trl_1_16.py)
# --------------------------------------------------------------------------------------------


def _fixture():
    return json.loads(FIXTURE.read_text())


_DEFAULTS = {
    "loss_type": "dapo",
    "importance_sampling_level": "token",
    "epsilon": 0.2,
    "epsilon_high": None,
    "delta": None,
    "beta": 0.0,
    "use_bias_correction_kl": True,
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
    "top_entropy_quantile": 1.0,
    "gradient_accumulation_steps": 1,
    "steps_per_generation": 1,
    "generation_tokens_factor": 1,
}


def _loss_case_id(case):
    return f"{case['inputs']}-" + "-".join(f"{k}={v}" for k, v in case["config"].items())


@pytest.mark.parametrize("case", _fixture()["losses"], ids=_loss_case_id)
def test_loss_equals_trl_1_16(case):
    data = {k: torch.tensor(v) for k, v in _fixture()["inputs"][case["inputs"]].items()}
    cfg = {**_DEFAULTS, "max_completion_length": data["mask"].size(1), **case["config"]}
    mask = data["mask"].bool()
    logprobs = data["logprobs"].clone().requires_grad_(True)
    # TRL's dapo / cispo normalizer: num_items_in_batch / num_processes · accumulation / steps_per_generation
    num_items = mask.sum() * cfg["generation_tokens_factor"]
    normalizer = num_items / 1 * cfg["gradient_accumulation_steps"] / cfg["steps_per_generation"]
    entropy_mask = None
    if cfg["top_entropy_quantile"] < 1.0:
        entropy_mask = high_entropy_mask(data["entropies"], mask, cfg["top_entropy_quantile"])
    loss, stats = grpo_policy_loss(
        logprobs,
        data["old_logprobs"],
        data["advantages"],
        mask,
        loss_type=cfg["loss_type"],
        importance_sampling_level=cfg["importance_sampling_level"],
        epsilon=cfg["epsilon"],
        epsilon_high=cfg["epsilon_high"],
        delta=cfg["delta"],
        sapo_temperature_pos=cfg["sapo_temperature_pos"],
        sapo_temperature_neg=cfg["sapo_temperature_neg"],
        vespo_k_pos=cfg["vespo_k_pos"],
        vespo_lambda_pos=cfg["vespo_lambda_pos"],
        vespo_k_neg=cfg["vespo_k_neg"],
        vespo_lambda_neg=cfg["vespo_lambda_neg"],
        beta=cfg["beta"],
        ref_logprobs=data["ref_logprobs"],
        use_bias_correction_kl=cfg["use_bias_correction_kl"],
        entropy_mask=entropy_mask,
        normalizer=normalizer,
        max_completion_length=cfg["max_completion_length"],
        accumulation_steps=cfg["gradient_accumulation_steps"],
    )
    _close(loss, case["loss"])
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor(case["grad"]), atol=1e-6, rtol=1e-6)
    logged = {k: v for k, v in case["metrics"].items() if k != "entropy"}  # entropy: logged by the trainer
    assert set(logged) <= set(stats)
    for name, value in logged.items():
        _close(stats[name], value)


@pytest.mark.parametrize(
    "case",
    _fixture()["advantages"],
    ids=lambda c: f"{c['name']}-{c['multi_objective_aggregation']}-{c['scale_rewards']}",
)
def test_advantages_equal_trl_1_16(case):
    rewards = torch.tensor([math.nan if v is None else v for v in case["rewards"]]).view(case["shape"])
    adv, stats = grpo_advantages(
        rewards,
        reward_weights=case["reward_weights"],
        scale_rewards=case["scale_rewards"],
        multi_objective_aggregation=case["multi_objective_aggregation"],
    )
    torch.testing.assert_close(adv, torch.tensor(case["advantages"]), atol=1e-6, rtol=1e-6)
    _close(stats["frac_reward_zero_std"], case["frac_reward_zero_std"])


def test_fixture_covers_every_loss_type_and_level():
    fixture = _fixture()
    assert fixture["trl_version"] == "1.16.0"
    seen = {
        (c["config"]["loss_type"], c["config"].get("importance_sampling_level", "token")) for c in fixture["losses"]
    }
    assert seen == {(t, lv) for t in LOSS_TYPES for lv in ("token", "sequence")}


# -- the entropy bonus (TRL 1.9's entropy_coef / use_adaptive_entropy) -------------------------------------


def test_entropy_term_is_the_mean_token_entropy_for_every_loss_type():
    # 4 loss tokens with entropies 1, 2, 3, 4 (padding 9 ignored): mean H = 2.5
    entropies = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # global-token-mean losses divide by the minibatch's token count (here 4 tokens split over 2 micro-batches
    # of 4 and 4 tokens: normalizer 8 gives half the mean from each)
    assert grpo_entropy_term(entropies, mask, loss_type="dapo", normalizer=8).item() == pytest.approx(10 / 8)
    assert grpo_entropy_term(entropies, mask, loss_type="cispo", normalizer=4).item() == pytest.approx(2.5)
    assert grpo_entropy_term(entropies, mask, loss_type="vespo", normalizer=4).item() == pytest.approx(2.5)
    # the others: the micro-batch's token mean / accumulation steps
    for loss_type in ("grpo", "bnpo", "dr_grpo", "sapo", "luspo"):
        assert grpo_entropy_term(entropies, mask, loss_type=loss_type).item() == pytest.approx(2.5)
        assert grpo_entropy_term(entropies, mask, loss_type=loss_type, accumulation_steps=2).item() == 1.25
    grpo_entropy_term(entropies, mask, loss_type="grpo").backward()
    assert entropies.grad.tolist() == [[0.25, 0.25, 0.25], [0.25, 0.0, 0.0]]
    with pytest.raises(ValueError, match="global token count"):
        grpo_entropy_term(entropies, mask, loss_type="dapo")


def test_entropy_controller_fixed_and_adaptive():
    fixed = EntropyController(0.1)
    fixed.update(5.0)
    assert (fixed.enabled, fixed.coef, fixed.applied()) == (True, 0.1, 0.1)
    assert not EntropyController(0.0).enabled
    assert EntropyController(0.0, adaptive=True).enabled  # adaptive control can raise a zero coefficient
    c = EntropyController(0.01, adaptive=True, target=1.0, delta=0.005, coef_min=0.0, coef_max=0.02)
    assert c.applied() == 0.0  # no measurement yet: no bonus on the first step
    c.update(0.5)  # entropy below target: up, and applied
    assert (c.coef, c.applied()) == (pytest.approx(0.015), pytest.approx(0.015))
    c.update(0.5)
    c.update(0.5)  # capped at coef_max
    assert c.coef == pytest.approx(0.02)
    c.update(2.0)  # above target: down, and not applied on the next step
    assert (c.coef, c.applied()) == (pytest.approx(0.015), 0.0)
    for _ in range(5):
        c.update(2.0)
    assert c.coef == 0.0  # floored at coef_min
    restored = EntropyController(0.01, adaptive=True, target=1.0)
    restored.load_state_dict(c.state_dict())
    assert (restored.coef, restored.last_entropy) == (0.0, 2.0)


# -- off-policy sequence masking (TRL 1.9's off_policy_mask_threshold, DeepSeek-V3.2) ----------------


def test_off_policy_sequence_mask_drops_negative_advantage_far_off_policy_sequences():
    sampling = torch.zeros(4, 3)
    logprobs = torch.tensor(
        [
            [-2.0, -2.0, -2.0],  # A > 0, mean KL 2: kept (positive advantage)
            [-0.5, -0.5, -0.5],  # A < 0, mean KL 0.5 <= 1: kept
            [-2.0, -2.0, -2.0],  # A < 0, mean KL 2 > 1: dropped
            [-1.5, -0.5, -50.0],  # A < 0, mean over its 2 loss tokens (1.5 + 0.5) / 2 = 1; padding ignored: kept
        ]
    )
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    keep = off_policy_sequence_mask(torch.tensor([1.0, -1.0, -1.0, -1.0]), logprobs, sampling, mask, 1.0)
    assert keep.tolist() == [[1.0], [1.0], [0.0], [1.0]]
    # in the loss: the dropped sequence's policy term is 0, its KL term stays (as TRL)
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0])
    ref = logprobs - 0.3
    common = dict(loss_type="grpo", beta=0.1, ref_logprobs=ref, use_bias_correction_kl=False)
    masked, _ = grpo_policy_loss(logprobs, logprobs, adv, mask, off_policy_mask=keep, **common)
    plain, _ = grpo_policy_loss(logprobs, logprobs, adv, mask, **common)
    # ρ = 1: each kept sequence's policy term is −A; sequence 2 (A = −1, term +1) is dropped: mean changes by 1/4
    assert plain.item() - masked.item() == pytest.approx(0.25, abs=1e-6)
