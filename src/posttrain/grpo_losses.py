"""GRPO's loss family and its group advantages, with the semantics of TRL 1.16's `GRPOTrainer`.

Pure torch, tensors in and `(value, stats)` out; the trainer picks the objective with the
`GRPOConfig` fields of the same names (`loss_type`, `importance_sampling_level`, `epsilon`,
`epsilon_high`, `delta`, `beta`, `use_bias_correction_kl`, `sapo_temperature_pos/neg`,
`vespo_k_pos/neg`, `vespo_lambda_pos/neg`, `top_entropy_quantile`, `mask_truncated_completions`, `scale_rewards`,
`multi_objective_aggregation`, `reward_weights`). docs/internals.md ("GRPO loss family") lists each
variant with its equation and paper; tests/test_grpo_losses.py checks every variant against values
TRL 1.16 itself computed (tests/fixtures/grpo_losses_trl_1_16.json).

Conventions: `logprobs`, `old_logprobs`, `ref_logprobs`, `entropies` and `mask` are per completion
token, shape (B, T); `mask` is True on the tokens that count in the loss (the completion mask, with
truncated completions removed when `mask_truncated_completions`, see `truncation_loss_mask`);
`advantages` are one per completion, (B,), or per token, (B, T). Rewards are laid out on the
explicit group grid (num_prompts, num_generations[, num_reward_funcs]).

Sources: TRL 1.16 `trl/trainer/grpo_trainer.py` (`_compute_loss`, `get_high_entropy_mask`,
`_generate_and_score_completions`) and `grpo_config.py`; Shao et al. 2024 (GRPO, arXiv:2402.03300);
Yu et al. 2025 (DAPO, arXiv:2503.14476); Liu et al. 2025 (Dr. GRPO, arXiv:2503.20783); Zheng et al.
2025 (GSPO, arXiv:2507.18071); MiniMax 2025 (MiniMax-M1 / CISPO, arXiv:2506.13585); "Soft
Adaptive Policy Optimization" (SAPO, arXiv:2511.20347); LUSPO (arXiv:2602.05261); VESPO
(arXiv:2602.10693); INTELLECT-2 (two-sided clipping `delta`,
arXiv:2505.07291); Wang et al. 2025 ("Beyond the 80/20 rule", top-entropy tokens,
arXiv:2506.01939); DeepSeek-V3.2 (KL bias correction, arXiv:2512.02556); PPO Lite ("batch"
scaling, arXiv:2508.08221); GDPO (normalize_then_sum, arXiv:2601.05242); Schulman 2020 (k3 KL).
"""

from __future__ import annotations

import math

import torch

from posttrain.ops import masked_mean

# The accepted values, defined once with the config fields that take them.
from posttrain.trainers.grpo_config import (  # noqa: F401  (re-exported)
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    MULTI_OBJECTIVE_AGGREGATIONS,
    SCALE_REWARDS,
)

# Loss types whose policy term divides by the minibatch's global token count (not a per-micro-batch mean).
_GLOBAL_TOKEN_MEAN = ("dapo", "cispo", "vespo")
# Loss types whose objective is the hard-clipped PPO surrogate (and whose clip ratios TRL logs).
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# Added to the standard deviation before dividing (TRL 1.16 GRPO's constant).
_STD_EPS = 1e-4
# VESPO clamps the sequence log-ratio to [log 1e-8, 20] before the gamma weight (the paper's code, as TRL 1.16).
_VESPO_LOG_W_MIN = math.log(1e-8)
_VESPO_LOG_W_MAX = 20.0


# --------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------


def truncation_loss_mask(completion_mask: torch.Tensor, ended: torch.Tensor) -> torch.Tensor:
    """`mask_truncated_completions`: the loss mask without the completions that did not stop.

    completion_mask (B, T), ended (B,) True where the completion ended with a stop (EOS) token ->
    (B, T) bool mask = completion_mask ∧ ended. A truncated completion (it hit
    max_completion_length) is no evidence about its ending, so DAPO (arXiv:2503.14476, "overlong
    filtering") leaves it out of the loss. TRL 1.16 zeroes such rows of `completion_mask` before it
    counts the batch's loss tokens, so pass this mask, and its token count as `normalizer`, to
    `grpo_policy_loss`.
    """
    if ended.shape != completion_mask.shape[:1]:
        raise ValueError(
            f"ended must hold one flag per completion, shape {tuple(completion_mask.shape[:1])}; "
            f"got {tuple(ended.shape)}."
        )
    return completion_mask.bool() & ended.bool()[:, None]


def high_entropy_mask(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    top_entropy_quantile: float,
    all_entropies: torch.Tensor | None = None,
) -> torch.Tensor:
    """`top_entropy_quantile`: True on the loss tokens whose entropy is in the top quantile.

    threshold = quantile(H over all loss tokens, 1 − top_entropy_quantile) (torch.quantile, linear
    interpolation); keep = (H·mask ≥ threshold) ∧ mask. 1.0 keeps every token, 0.0 only the
    highest-entropy one(s). Source: Wang et al. 2025 "Beyond the 80/20 Rule" (arXiv:2506.01939,
    recommends 0.2), TRL 1.16 `GRPOTrainer.get_high_entropy_mask`, which takes the quantile over the
    loss tokens of every process: in multi-process runs pass them, gathered, as `all_entropies`
    (1-D); by default the quantile is over this call's `entropies[mask]`. No loss token at all ->
    an all-False mask. entropies, mask (B, T) -> bool (B, T).
    """
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}.")
    m = mask.bool()
    pool = entropies[m].float() if all_entropies is None else all_entropies.reshape(-1).float()
    if pool.numel() == 0:
        return torch.zeros_like(m)
    threshold = torch.quantile(pool, 1.0 - top_entropy_quantile)
    return (torch.where(m, entropies.float(), torch.zeros_like(entropies, dtype=torch.float32)) >= threshold) & m


def off_policy_sequence_mask(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """`off_policy_mask_threshold`: DeepSeek-V3.2's off-policy sequence masking (arXiv:2512.02556, eq. 9).

    Per sequence, the mean over its loss tokens of log π_sampling − log π_θ (π_θ detached; padding
    ignored) estimates how far the policy has moved from the one that sampled it; a sequence with a
    negative advantage AND a mean above `threshold` is dropped from the policy loss (learning from
    its own mistakes is least reliable when it is most off-policy). advantages (B,) or (B, 1);
    logprobs, sampling_logprobs, mask (B, T) -> (B, 1) of 1.0 (keep) / 0.0 (drop), in mask's float
    dtype. Without an inference engine TRL 1.9 passes the old policy's logprobs as sampling_logprobs.
    """
    m = mask.to(logprobs.dtype) if mask.dtype == torch.bool else mask
    adv = advantages.reshape(-1, 1)
    kl = (sampling_logprobs - logprobs.detach()) * m
    mean_kl = kl.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    return ((adv >= 0) | (mean_kl <= threshold)).to(m.dtype)


# --------------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------------


def log_importance_weights(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """log ρ: per token (B, T) or per sequence (B, 1).

    "token":    log ρ_t = log π_θ(y_t) − log π_old(y_t)  (0 off-mask, so padding cannot overflow exp).
    "sequence": log ρ = Σ_t m_t·(log π_θ − log π_old) / max(Σ_t m_t, 1), one per completion,
                broadcast over its tokens: GSPO's length-normalized sequence ratio (Zheng et al.
                2025, arXiv:2507.18071, eq. 7), TRL 1.16 `importance_sampling_level="sequence"`.
    """
    m = mask.bool()
    log_ratio = torch.where(m, logprobs - old_logprobs, torch.zeros_like(logprobs))
    if level == "token":
        return log_ratio
    if level == "sequence":
        return (log_ratio.sum(-1) / m.sum(-1).clamp(min=1).to(log_ratio.dtype)).unsqueeze(-1)
    raise ValueError(
        f"importance_sampling_level must be one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}, got {level!r}."
    )


@torch.no_grad()
def vespo_weights(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> torch.Tensor:
    """VESPO's sequence weight φ(w) = e^λ · w^k · e^(−λ·w) (arXiv:2602.10693), detached, (B, 1).

    w = exp(Σ_t m_t·clamp(log π_θ − log π_old, −20, 20)), the sequence's importance ratio (a product
    over its loss tokens, not GSPO's length-normalized mean), with log w clamped to [log 1e-8, 20];
    (k, λ) = (k_pos, λ_pos) where A ≥ 0, else (k_neg, λ_neg); λ is floored at 1e-4. φ(1) = 1 and φ peaks
    at w = k/λ: a smooth, asymmetric replacement for hard clipping. Computed in log space
    (log φ = λ + k·log w − λ·w); a NaN or infinite weight becomes 0, as in TRL 1.16's
    `GRPOTrainer.get_gamma_weights`. log_ratio, mask (B, T); advantages (B,) or (B, 1).
    """
    m = mask.to(log_ratio.dtype)
    seq = (torch.clamp(log_ratio, -20.0, 20.0) * m).sum(-1, keepdim=True)
    log_w = torch.clamp(seq, _VESPO_LOG_W_MIN, _VESPO_LOG_W_MAX)
    nonneg = advantages.reshape(-1, 1) >= 0 if advantages.dim() == 1 else advantages >= 0
    k = torch.where(nonneg, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def grpo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    use_bias_correction_kl: bool = True,
    entropy_mask: torch.Tensor | None = None,
    off_policy_mask: torch.Tensor | None = None,
    normalizer: int | float | torch.Tensor | None = None,
    max_completion_length: int | None = None,
    accumulation_steps: int = 1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO objective of TRL 1.16 `GRPOTrainer._compute_loss`, as a loss to minimise.

    Importance weight ρ = exp(log ρ) (`log_importance_weights`, token or sequence level), then per
    token, with ε_lo = epsilon, ε_hi = epsilon_high (default epsilon):
      grpo, bnpo, dr_grpo, dapo, luspo:
                                  ℓ_t = −min(ρ̃·A, clip(ρ, 1 − ε_lo, 1 + ε_hi)·A), ρ̃ = min(ρ, delta)
                                  when delta is set (INTELLECT-2's two-sided clipping, arXiv:2505.07291),
                                  else ρ̃ = ρ (PPO-clip, Shao et al. 2024, arXiv:2402.03300; ε_hi > ε_lo
                                  is DAPO's clip-higher).
      cispo:  ℓ_t = −sg[min(ρ, ε_hi)]·A·log π_θ(y_t): the IS weight is clipped and detached, the gradient
              flows through log π_θ (MiniMax-M1, arXiv:2506.13585). Note ε_hi is an absolute cap
              on ρ here (ScaleRL's ε_max, recommended 5.0), and, as in TRL, it defaults to epsilon (0.2).
      sapo:   ℓ_t = −(4/τ)·σ(τ·(ρ − 1))·A, τ = sapo_temperature_pos where A > 0 else
              sapo_temperature_neg: a soft gate in place of the hard clip (SAPO, arXiv:2511.20347).
      vespo:  ℓ_t = −φ(w)·A·log π_θ(y_t), φ the detached gamma weight of the sequence ratio w
              (`vespo_weights`, VESPO arXiv:2602.10693); ρ enters only the KL bias correction.
    Then ℓ_t ← ℓ_t·off_policy_mask (off_policy_mask_threshold; `off_policy_sequence_mask`, one per
    sequence), ℓ_t ← ℓ_t·entropy_mask_t (top_entropy_quantile; `high_entropy_mask`), and with beta ≠ 0
    ℓ_t ← ℓ_t + beta·KL_t, KL_t = exp(ref − lp) − (ref − lp) − 1 (k3, Schulman 2020), multiplied by ρ
    when use_bias_correction_kl (TRL 1.16's default, DeepSeek-V3.2 arXiv:2512.02556; ρ before
    the delta clamp). Aggregation over the loss tokens m (`mask`):
      grpo, sapo: (1/B)·Σ_b (Σ_t ℓ·m / max(Σ_t m, 1)) / accumulation_steps   (sequence mean of token means)
      bnpo:       Σ ℓ·m / max(Σ m, 1) / accumulation_steps                     (local token mean)
      dr_grpo:    Σ ℓ·m / (B·max_completion_length) / accumulation_steps      (Dr. GRPO, arXiv:2503.20783)
      luspo:      (1/B)·Σ_b Σ_t ℓ·m / accumulation_steps   (sequence sums: GSPO's loss × length, LUSPO)
      dapo, cispo, vespo: Σ ℓ·m / normalizer                                   (DAPO, arXiv:2503.14476)
    accumulation_steps is TRL's division by `current_gradient_accumulation_steps` of the
    per-micro-batch means. For dapo, cispo and vespo, `normalizer` is the number of loss tokens the sum is
    divided by: TRL uses num_items_in_batch / num_processes · gradient_accumulation_steps /
    steps_per_generation, with num_items_in_batch the loss tokens of the whole generation batch over
    all processes (DDP then averages over processes, so the step's loss is a token mean over the
    global batch); None means this call's own loss-token count (one process, one micro-batch).

    Returns (loss, stats); stats are detached 0-d tensors:
      policy_loss  the loss before the accumulation_steps division (TRL's logged policy_loss);
      kl           mean of KL_t (after the bias correction) over the loss tokens; with beta ≠ 0;
      clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean  (clipped loss types) fraction
                   with ρ̃ < 1 − ε_lo and A < 0, ρ̃ > 1 + ε_hi and A > 0, either; over loss tokens at
                   token level, over all B sequences at sequence level;
      clip_ratio/low_min, clip_ratio/high_max  min / max over sequences of the per-sequence
                   fractions (NaN-skipping; NaN when there is none);
      cispo_clip_ratio  (cispo) fraction with ρ > ε_hi and A > 0, weighted as the clip ratios;
      vespo/phi_seq_mean  (vespo) mean of φ over the B sequences (weight count/clip = B);
      count        loss tokens in this call (the weight of `kl`); count/clip: the weight of the
                   clip ratios (loss tokens, or B at sequence level). Across micro-batches and ranks,
                   TRL reduces these as Σ mean·count / Σ count.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}.")
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError(f"beta={beta} needs ref_logprobs (the reference policy's per-token logprobs).")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' divides by B·max_completion_length; pass max_completion_length.")
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}.")
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    m = mask.bool()
    zeros = torch.zeros_like(logprobs)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)

    log_ratio = log_importance_weights(logprobs, old_logprobs, m, importance_sampling_level)  # (B, T|1)
    coef_1 = torch.exp(log_ratio)

    per_token_kl = None
    if beta != 0.0:
        ref = torch.where(m, ref_logprobs, logprobs.detach())
        log_r = ref - logprobs
        per_token_kl = torch.exp(log_r) - log_r - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    if loss_type in _CLIPPED:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    elif loss_type == "cispo":
        clamped = torch.clamp(coef_1, max=eps_high).detach()
        per_token_loss = -clamped * adv * torch.where(m, logprobs, zeros)
    elif loss_type == "vespo":
        # φ reads the per-token ratios whatever importance_sampling_level says (it only sets the KL's ρ)
        token_log_ratio = (
            log_ratio if importance_sampling_level == "token" else log_importance_weights(logprobs, old_logprobs, m)
        )
        phi = vespo_weights(
            token_log_ratio,
            adv,
            m,
            k_pos=vespo_k_pos,
            lambda_pos=vespo_lambda_pos,
            k_neg=vespo_k_neg,
            lambda_neg=vespo_lambda_neg,
        )
        per_token_loss = -phi * adv * torch.where(m, logprobs, zeros)
    else:  # sapo
        tau = torch.where(
            adv > 0,
            torch.as_tensor(sapo_temperature_pos, dtype=coef_1.dtype, device=coef_1.device),
            torch.as_tensor(sapo_temperature_neg, dtype=coef_1.dtype, device=coef_1.device),
        )
        per_token_loss = -(torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau) * adv

    if off_policy_mask is not None:  # (B, 1): a dropped sequence keeps only its KL term, as in TRL
        per_token_loss = per_token_loss * off_policy_mask.to(per_token_loss.dtype)
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask.to(per_token_loss.dtype)
    if per_token_kl is not None:
        per_token_loss = per_token_loss + beta * per_token_kl

    # (B, T) masked loss; where() rather than a product, so an inf on padding cannot leak.
    masked = torch.where(m, per_token_loss.expand_as(logprobs), zeros)
    tokens = m.to(logprobs.dtype)
    if loss_type in ("grpo", "sapo"):
        policy_loss = (masked.sum(-1) / tokens.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        policy_loss = masked.sum() / tokens.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        policy_loss = masked.sum() / (logprobs.size(0) * max_completion_length)
    elif loss_type == "luspo":
        policy_loss = masked.sum(-1).mean()
    else:  # dapo, cispo, vespo
        if normalizer is None:
            normalizer = tokens.sum().clamp(min=1.0)
        elif not torch.is_tensor(normalizer) and normalizer <= 0:
            raise ValueError(f"normalizer must be > 0 (loss tokens the sum is divided by), got {normalizer}.")
        policy_loss = masked.sum() / normalizer
    loss = policy_loss if loss_type in _GLOBAL_TOKEN_MEAN else policy_loss / accumulation_steps

    with torch.no_grad():
        n_tokens = tokens.sum().detach()
        r, a = coef_1.detach(), adv.detach()
        # The clip flags have one column per sequence at sequence level (ρ and A both (B, 1)); TRL then
        # averages them over all B sequences, otherwise over the loss tokens.
        sequence_level = torch.broadcast_shapes(r.shape, a.shape)[-1] == 1
        stats: dict[str, torch.Tensor] = {"policy_loss": policy_loss.detach(), "count": n_tokens}
        stats["count/clip"] = n_tokens.new_tensor(float(logprobs.size(0))) if sequence_level else n_tokens

        def mean_over_items(x: torch.Tensor) -> torch.Tensor:
            # TRL's global_masked_mean
            return x.float().mean() if sequence_level else masked_mean(x.float(), m)

        def per_sequence(x: torch.Tensor) -> torch.Tensor:
            # TRL's masked_seq_mean: a row with no loss token gives NaN, skipped by the min / max
            return x.float().squeeze(1) if sequence_level else (x.float() * tokens).sum(-1) / tokens.sum(-1)

        if per_token_kl is not None:
            stats["kl"] = masked_mean(per_token_kl.detach().expand_as(logprobs), m)
        if loss_type in _CLIPPED:
            low = (r < 1 - eps_low) & (a < 0)
            high = (r > 1 + eps_high) & (a > 0)
            stats["clip_ratio/low_mean"] = mean_over_items(low)
            stats["clip_ratio/high_mean"] = mean_over_items(high)
            stats["clip_ratio/region_mean"] = mean_over_items(low | high)
            low_seq, high_seq = per_sequence(low), per_sequence(high)
            stats["clip_ratio/low_min"] = _nan_reduce(low_seq, torch.min)
            stats["clip_ratio/high_max"] = _nan_reduce(high_seq, torch.max)
        elif loss_type == "cispo":
            stats["cispo_clip_ratio"] = mean_over_items((r > eps_high) & (a > 0))
        elif loss_type == "vespo":
            stats["vespo/phi_seq_mean"] = phi.float().mean()  # one weight per sequence, as TRL averages it
            stats["count/clip"] = n_tokens.new_tensor(float(logprobs.size(0)))
    return loss, stats


def _nan_reduce(x: torch.Tensor, reduce) -> torch.Tensor:
    kept = x[~torch.isnan(x)]
    return reduce(kept) if kept.numel() else torch.tensor(float("nan"), device=x.device)


# --------------------------------------------------------------------------------------------
# Entropy bonus
# --------------------------------------------------------------------------------------------


def grpo_entropy_term(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    normalizer: int | float | torch.Tensor | None = None,
    accumulation_steps: int = 1,
) -> torch.Tensor:
    """The entropy H that `entropy_coef` multiplies (loss = policy loss − coef·H), for one micro-batch.

    H is the mean per-token entropy of the minibatch whatever the loss type, so entropy_coef means the
    same for all of them (TRL 1.9 `GRPOTrainer._compute_loss`): summed over the micro-batches of an
    optimizer step (and averaged over processes, as gradients are), the terms add up to
      dapo, cispo, vespo: Σ_t H_t·m_t / normalizer (the minibatch's loss tokens over all ranks, as the policy
                   term: `online.global_normalizer`), i.e. the global token mean;
      others:      (Σ_t H_t·m_t / Σ_t m_t) / accumulation_steps, the mean of the micro-batch token means.
    `mask`: the loss tokens (times the top-entropy mask when top_entropy_quantile < 1). entropies, mask
    (B, T) -> scalar, with gradients through `entropies` (computed with grad for the bonus).
    """
    m = mask.bool()
    total = torch.where(m, entropies.float(), torch.zeros((), device=entropies.device)).sum()
    if loss_type in _GLOBAL_TOKEN_MEAN:
        if normalizer is None:
            raise ValueError(f"loss_type={loss_type!r} needs the minibatch's global token count as `normalizer`.")
        return total / normalizer
    return total / m.sum().clamp(min=1).float() / accumulation_steps


class EntropyController:
    """The entropy bonus coefficient: fixed (`entropy_coef`), or adaptive (`use_adaptive_entropy`,
    Skywork-OR1's adaptive entropy control, He et al. 2025, arXiv:2505.22312; TRL 1.9's fields).

    Adaptive: after each optimizer step, with H the step's mean per-token entropy over the loss tokens
    of all processes, coef ← min(coef + delta, coef_max) if H ≤ target else max(coef − delta, coef_min);
    the bonus of the next step is applied only if H ≤ target (coef, else 0). Before the first
    measurement H = +inf: the first step applies no bonus. A fixed coefficient is always applied.
    """

    def __init__(
        self,
        coef: float,
        *,
        adaptive: bool = False,
        target: float = 0.2,
        delta: float = 0.005,
        coef_min: float = 0.0,
        coef_max: float = 1.0,
    ) -> None:
        self.coef, self.adaptive, self.target = float(coef), adaptive, float(target)
        self.delta, self.coef_min, self.coef_max = float(delta), float(coef_min), float(coef_max)
        self.last_entropy = math.inf

    @property
    def enabled(self) -> bool:
        """Whether the loss has an entropy term at all (adaptive control keeps it even at coef 0)."""
        return self.adaptive or self.coef != 0.0

    def applied(self) -> float:
        """The coefficient of this optimizer step's bonus."""
        if self.adaptive and not self.last_entropy <= self.target:
            return 0.0
        return self.coef

    def update(self, entropy: float) -> None:
        """After an optimizer step whose mean per-token entropy (all processes) was `entropy`."""
        if not self.adaptive:
            return
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = float(entropy)

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])


# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------


def resolve_scale_rewards(scale_rewards: str | bool) -> str:
    """`scale_rewards` as TRL 1.16 accepts it: "group", "batch", "none"; True → "group", False → "none".

    The strings "true" / "false" (any case, as a command line gives them) are the same aliases.
    """
    if isinstance(scale_rewards, bool):
        return "group" if scale_rewards else "none"
    value = str(scale_rewards).strip().lower()
    value = {"true": "group", "false": "none"}.get(value, value)
    if value not in SCALE_REWARDS:
        raise ValueError(
            f"scale_rewards must be one of {', '.join(SCALE_REWARDS)} (or True / False), got {scale_rewards!r}."
        )
    return value


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased (n − 1) standard deviation ignoring NaNs; NaN where fewer than 2 values (TRL's `nanstd`)."""
    if dim is None:
        return nanstd(x.reshape(-1), dim=0)
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = torch.sqrt(var * correction)
    return std if keepdim else std.squeeze(dim)


def grpo_advantages(
    rewards: torch.Tensor,
    *,
    reward_weights: torch.Tensor | list[float] | None = None,
    scale_rewards: str | bool = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group-relative advantages of TRL 1.16 GRPO. rewards (P, G) or (P, G, F) -> advantages (P, G).

    P prompts, G = num_generations completions each, F reward functions (a 2-D input is F = 1);
    w = reward_weights (F,), default all 1. NaN marks a reward a function did not give; a completion
    with no reward at all gets advantage 0. With ε = 1e-4:
      "sum_then_normalize" (default): r = Σ_f w_f·r_f (NaN-skipping sum), then
          A = (r − mean_group(r)) / (std + ε), std = std_group(r) for scale_rewards="group"
          (Shao et al. 2024), std over the whole batch for "batch" (PPO Lite, arXiv:2508.08221);
          A = r − mean_group(r) for "none" (Dr. GRPO, arXiv:2503.20783).
      "normalize_then_sum" (GDPO, arXiv:2601.05242): each function is normalized within its group,
          r̂_f = (r_f − mean_group(r_f)) / (std_group(r_f) + ε), then r = Σ_f w_f·r̂_f and
          A = (r − mean_batch(r)) / (std_batch(r) + ε); scale_rewards is not used.
    Stds are unbiased (n − 1) and NaN-skipping (TRL's `nanstd`); a group of one completion
    (G = 1) has std 0. In multi-process runs pass the rewards of the whole generation batch (TRL
    gathers them before normalizing, so a group may span processes) and keep this rank's slice.
    stats: frac_reward_zero_std (fraction of completions whose std is 0: groups with all-equal
    rewards, or the whole batch for "batch" / "normalize_then_sum"), reward and reward_std (mean and
    std of Σ_f w_f·r_f over the scorable completions).
    """
    if rewards.dim() == 2:
        rewards = rewards.unsqueeze(-1)
    if rewards.dim() != 3:
        raise ValueError(
            "grpo_advantages expects rewards shaped (num_prompts, num_generations) or "
            f"(num_prompts, num_generations, num_reward_funcs), got shape {tuple(rewards.shape)}."
        )
    num_prompts, group, num_funcs = rewards.shape
    scale = resolve_scale_rewards(scale_rewards)
    if reward_weights is None:
        weights = torch.ones(num_funcs, dtype=rewards.dtype, device=rewards.device)
    else:
        weights = torch.as_tensor(reward_weights, dtype=rewards.dtype, device=rewards.device).reshape(-1)
    if weights.numel() != num_funcs:
        raise ValueError(f"reward_weights has {weights.numel()} entries for {num_funcs} reward functions.")
    flat = rewards.reshape(num_prompts * group, num_funcs)  # prompt-major, TRL's layout
    unscorable = torch.isnan(flat).all(dim=1)

    if multi_objective_aggregation == "sum_then_normalize":
        summed = (flat * weights).nansum(dim=1)
        summed[unscorable] = torch.nan
        grid = summed.view(num_prompts, group)
        mean = torch.nanmean(grid, dim=1, keepdim=True).expand_as(grid)
        if scale in ("group", "none"):  # with "none" the std only feeds frac_reward_zero_std
            std = nanstd(grid, dim=1, keepdim=True) if group > 1 else torch.zeros_like(mean)
        else:
            std = nanstd(grid) if grid.numel() > 1 else torch.zeros((), dtype=grid.dtype, device=grid.device)
        std = std.expand_as(grid)
        advantages = grid - mean
        if scale != "none":
            advantages = advantages / (std + _STD_EPS)
    elif multi_objective_aggregation == "normalize_then_sum":
        mean_k = torch.nanmean(rewards, dim=1, keepdim=True)
        std_k = nanstd(rewards, dim=1, keepdim=True) if group > 1 else torch.zeros_like(mean_k)
        normalized = ((rewards - mean_k) / (std_k + _STD_EPS)).reshape(num_prompts * group, num_funcs)
        summed = (normalized * weights).nansum(dim=1)
        summed[unscorable] = torch.nan
        std = nanstd(summed) if summed.numel() > 1 else torch.zeros((), dtype=summed.dtype, device=summed.device)
        advantages = ((summed - torch.nanmean(summed)) / (std + _STD_EPS)).view(num_prompts, group)
        std = std.expand_as(advantages)
    else:
        raise ValueError(
            f"multi_objective_aggregation must be one of {', '.join(MULTI_OBJECTIVE_AGGREGATIONS)}, "
            f"got {multi_objective_aggregation!r}."
        )
    advantages = torch.nan_to_num(advantages, nan=0.0)

    with torch.no_grad():
        logged = (flat * weights).nansum(dim=1)
        logged[unscorable] = torch.nan
        stats = {
            "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean(),
            "reward": torch.nanmean(logged),
            "reward_std": nanstd(logged),
        }
    return advantages, stats
