"""Training losses: PPO policy / value, entropy bonus, DPO / IPO / XPO, Bradley–Terry, SFT NLL and DFT.

Every function is pure torch and returns `(loss, stats)`:
- `loss` is a 0-d tensor = Σ(per-token or per-sequence loss · mask) / normalizer. Pass the GLOBAL
  normalizer (tokens or sequences in the whole minibatch, across micro-batches and ranks) and
  the losses of the micro-batches add up to the minibatch loss, so gradient accumulation and
  data parallelism do not change the update (the "token-mean with global count" aggregation of
  verl / OpenRLHF; TRL averages per micro-batch means instead, see docs/internals.md).
  With `normalizer=None` the local count of this call is used (a plain masked mean).
- `stats` maps names to detached 0-d tensors. Each statistic is a mean over THIS call's masked
  tokens (or sequences), and `stats["count"]` is how many tokens (or sequences) it averages, so
  the caller aggregates across micro-batches and ranks with weights (sum = mean·count).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.ops import DEFAULT_CHUNK_TOKENS, masked_mean, selective_log_softmax

Normalizer = int | float | torch.Tensor | None


def _aggregate(per_item: torch.Tensor, mask: torch.Tensor | None, normalizer: Normalizer) -> torch.Tensor:
    """Σ(per_item · mask) / normalizer, normalizer defaulting to the mask's own count (min 1)."""
    if mask is None:
        total = per_item.sum()
        count = per_item.numel()
    else:
        # where() rather than a product: an inf/NaN on a padding position must not leak into the sum.
        total = torch.where(mask.bool(), per_item, torch.zeros_like(per_item)).sum()
        count = mask.to(per_item.dtype).sum()
    if normalizer is None:
        return total / (count.clamp(min=1) if torch.is_tensor(count) else max(count, 1))
    if not torch.is_tensor(normalizer) and normalizer <= 0:
        raise ValueError(
            f"normalizer must be > 0 (the number of tokens or sequences in the whole minibatch), got {normalizer}."
        )
    return total / normalizer


def _count(mask: torch.Tensor) -> torch.Tensor:
    return mask.to(torch.float32).sum().detach()


# --------------------------------------------------------------------------------------------
# PPO
# --------------------------------------------------------------------------------------------


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
    level: str = "token",
    normalizer: Normalizer = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate objective of PPO (Schulman et al. 2017), as a loss to minimise.

    pg = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high)), ε_low = cliprange, ε_high = cliprange_high
    (default cliprange; a larger ε_high is DAPO's "clip-higher").
    level="token" (PPO, GRPO): ρ_t = exp(lp_t − old_t) per token; logprobs, old_logprobs, mask
      (B, T); advantages (B, T) or (B,) (broadcast over tokens, as GRPO does);
      loss = Σ_t pg_t·mask_t / normalizer (default: tokens in this call).
      Source: TRL ≤ 0.11 `PPOTrainer.loss`, TRL 0.19 `PPOTrainer`.
    level="sequence" (RLOO): ρ_b = exp(Σ_t lp·mask − Σ_t old·mask) per sequence; advantages (B,);
      loss = Σ_b pg_b / normalizer (default: sequences in this call).
      Source: TRL 0.19 and 1.x `RLOOTrainer`.
    The log-ratio is zeroed off-mask before exp, so garbage logprobs on padding cannot overflow.
    stats (means over this call's tokens, or sequences at sequence level; `count` = how many):
      pg_loss (mean pg), approxkl = ½·mean((lp − old)²), policykl = mean(old − lp),
      clipfrac = mean(clipped term > unclipped term), clipfrac_low / clipfrac_high (ρ below 1 − ε_low
      with A < 0 / above 1 + ε_high with A > 0, TRL 1.x GRPO `clip_ratio/*`), ratio_mean,
      ratio_var (population variance of ρ over this call), count.
    """
    eps_low = cliprange
    eps_high = cliprange if cliprange_high is None else cliprange_high
    m = mask.bool()
    if level == "token":
        log_ratio = torch.where(m, logprobs - old_logprobs, torch.zeros_like(logprobs))
        adv = advantages.unsqueeze(-1) if advantages.dim() == logprobs.dim() - 1 else advantages
        adv = torch.where(m, adv, torch.zeros_like(adv))
        item_mask = m
    elif level == "sequence":
        diff = torch.where(m, logprobs - old_logprobs, torch.zeros_like(logprobs))
        log_ratio = diff.sum(dim=-1)
        if advantages.shape != log_ratio.shape:
            raise ValueError(
                f"level='sequence' needs one advantage per sequence, shape {tuple(log_ratio.shape)}; "
                f"got {tuple(advantages.shape)}."
            )
        adv = advantages
        item_mask = torch.ones_like(log_ratio, dtype=torch.bool)
    else:
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}.")

    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    unclipped = -adv * ratio
    clipped = -adv * clipped_ratio
    per_item = torch.maximum(unclipped, clipped)
    loss = _aggregate(per_item, item_mask, normalizer)

    with torch.no_grad():
        lr = log_ratio.detach()
        r = ratio.detach()
        a = adv.detach().expand_as(r)
        ratio_mean = masked_mean(r, item_mask)
        stats = {
            "pg_loss": masked_mean(per_item.detach(), item_mask),
            "approxkl": 0.5 * masked_mean(lr.square(), item_mask),
            "policykl": masked_mean(-lr, item_mask),
            "clipfrac": masked_mean((clipped.detach() > unclipped.detach()).float(), item_mask),
            "clipfrac_low": masked_mean(((r < 1.0 - eps_low) & (a < 0)).float(), item_mask),
            "clipfrac_high": masked_mean(((r > 1.0 + eps_high) & (a > 0)).float(), item_mask),
            "ratio_mean": ratio_mean,
            "ratio_var": masked_mean((r - ratio_mean).square(), item_mask),
            "count": _count(item_mask),
        }
    return loss, stats


def ppo_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float | None,
    normalizer: Normalizer = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: ½·max((V − R)², (clip(V, V_old − c, V_old + c) − R)²), summed over mask / normalizer.

    values (B, T) current critic predictions (with grad), old_values (B, T) from the rollout,
    returns (B, T) GAE returns. cliprange_value=None disables clipping (½·(V − R)²).
    Source: TRL ≤ 0.11 `PPOTrainer.loss`, TRL 0.19 `PPOTrainer`.
    stats: vf_loss (mean per-token loss), vf_clipfrac (clipped term > unclipped), value_error
    (mean (V − R)²), vpred (mean V), count (tokens).
    """
    m = mask.bool()
    zero = torch.zeros((), device=values.device)
    values = torch.where(m, values.float(), zero)
    returns = torch.where(m, returns.float(), zero)
    unclipped = (values - returns).square()
    if cliprange_value is None:
        clipped = unclipped
    else:
        old = torch.where(m, old_values.float(), zero)
        clipped = (torch.clamp(values, old - cliprange_value, old + cliprange_value) - returns).square()
    per_token = 0.5 * torch.maximum(unclipped, clipped)
    loss = _aggregate(per_token, m, normalizer)
    with torch.no_grad():
        stats = {
            "vf_loss": masked_mean(per_token.detach(), m),
            "vf_clipfrac": masked_mean((clipped.detach() > unclipped.detach()).float(), m),
            "value_error": masked_mean(unclipped.detach(), m),
            "vpred": masked_mean(values.detach(), m),
            "count": _count(m),
        }
    return loss, stats


def entropy_bonus(
    entropy: torch.Tensor, mask: torch.Tensor, coef: float, normalizer: Normalizer = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Entropy bonus as a loss term: −coef·Σ_t H_t·mask_t / normalizer (adding it maximises entropy).

    entropy (B, T): per-token entropy of the policy (ops.entropy_from_logits, with grad).
    stats: entropy (mean H over this call's tokens), count.
    """
    m = mask.bool()
    entropy = torch.where(m, entropy.float(), torch.zeros((), device=entropy.device))
    loss = -coef * _aggregate(entropy, m, normalizer)
    with torch.no_grad():
        stats = {"entropy": masked_mean(entropy.detach(), m), "count": _count(m)}
    return loss, stats


# --------------------------------------------------------------------------------------------
# Preference losses
# --------------------------------------------------------------------------------------------


def _dpo_terms(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair DPO / IPO losses (B,) and their stats (means over the pairs)."""
    chosen_ratio = chosen_logps.float() - ref_chosen_logps.float()
    rejected_ratio = rejected_logps.float() - ref_rejected_logps.float()
    logits = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1.0 / (2.0 * beta)).square()
    else:
        raise ValueError(f"loss_type must be 'sigmoid' or 'ipo', got {loss_type!r}.")
    with torch.no_grad():
        chosen_rewards = beta * chosen_ratio.detach()
        rejected_rewards = beta * rejected_ratio.detach()
        stats = {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "logps/chosen": chosen_logps.detach().float().mean(),
            "logps/rejected": rejected_logps.detach().float().mean(),
        }
    return losses, stats


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    normalizer: Normalizer = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO (Rafailov et al. 2023) / IPO (Azar et al. 2023) on summed completion logprobs, all (B,).

    logits = (π_c − π_r) − (ref_c − ref_r);
    "sigmoid": −log σ(β·logits);  "ipo": (logits − 1/(2β))² (not length-normalized, as TRL Online
    DPO; TRL's offline DPOTrainer divides IPO logprobs by token counts).
    loss = Σ_pairs / normalizer (default B). Source: TRL's `OnlineDPOTrainer`; Guo et al. 2024, arXiv:2402.04792.
    stats (means over pairs): rewards/chosen = β(π_c − ref_c), rewards/rejected = β(π_r − ref_r),
    rewards/margins, rewards/accuracies (chosen reward > rejected), logps/chosen, logps/rejected,
    count (pairs).
    """
    losses, stats = _dpo_terms(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta, loss_type)
    loss = _aggregate(losses, None, normalizer)
    stats["loss/dpo"] = losses.detach().mean()
    stats["count"] = torch.tensor(float(losses.numel()), device=losses.device)
    return loss, stats


def xpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    policy_logps_ref_completion: torch.Tensor,
    beta: float,
    alpha: float,
    loss_type: str = "sigmoid",
    normalizer: Normalizer = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """XPO (Xie et al. 2024): DPO term + α·Σ_t log π_θ(y_ref,t), per pair, summed / normalizer.

    (chosen, rejected) is (policy completion, reference completion) or the reverse, whichever the
    reward prefers; `policy_logps_ref_completion` (B,) is the policy's summed logprob of the
    reference model's completion (with grad). Minimising α·log π_θ(y_ref) pushes probability away
    from what the reference would say (exploration). Source: Xie et al. 2024,
    arXiv:2405.21046; TRL 1.x `XPOTrainer.training_step`: loss = mean(dpo_losses + alpha·model_logprobs_ref_data_sum).
    stats: the `dpo_loss` stats plus loss/dpo and loss/xpo (means of the two terms), count.
    """
    losses, stats = _dpo_terms(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta, loss_type)
    xpo_terms = alpha * policy_logps_ref_completion.float()
    loss = _aggregate(losses + xpo_terms, None, normalizer)
    stats["loss/dpo"] = losses.detach().mean()
    stats["loss/xpo"] = xpo_terms.detach().mean()
    stats["count"] = torch.tensor(float(losses.numel()), device=losses.device)
    return loss, stats


def bradley_terry_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
    normalizer: Normalizer = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reward-model pairwise loss: −log σ(r_c − r_r − margin) + coef·(r_c + r_r)², summed / normalizer.

    chosen_rewards, rejected_rewards, margin: (B,). With normalizer=None this is the batch mean,
    exactly TRL's `RewardTrainer.compute_loss` (mean of −logsigmoid + coef·mean((r_c + r_r)²);
    TRL's `RewardTrainer`; centring from Eisenstein et al. 2023).
    stats: accuracy (mean r_c > r_r), margin (mean r_c − r_r), chosen_rewards, rejected_rewards
    (means), count (pairs).
    """
    rc = chosen_rewards.float()
    rr = rejected_rewards.float()
    diff = rc - rr
    if margin is not None:
        diff = diff - margin.float()
    per_pair = -F.logsigmoid(diff)
    if center_rewards_coefficient:
        per_pair = per_pair + center_rewards_coefficient * (rc + rr).square()
    loss = _aggregate(per_pair, None, normalizer)
    with torch.no_grad():
        stats = {
            "accuracy": (rc > rr).float().mean(),
            "margin": (rc - rr).mean(),
            "chosen_rewards": rc.mean(),
            "rejected_rewards": rr.mean(),
            "count": torch.tensor(float(rc.numel()), device=rc.device),
        }
    return loss, stats


# --------------------------------------------------------------------------------------------
# SFT
# --------------------------------------------------------------------------------------------


def chunked_nll(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    normalizer: Normalizer = None,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Next-token NLL: Σ_{labels ≠ ignore} −log softmax(logits)[label] / normalizer.

    logits (..., V) and labels (...) must already be ALIGNED (the caller shifts:
    `logits[:, :-1]`, `labels[:, 1:]`). Only rows with a real label enter the chunked float32
    log-softmax (ops.selective_log_softmax), as TRL's "chunked_nll" SFT loss does.
    normalizer defaults to the number of real labels in this call.
    stats: nll (mean over this call's labelled tokens), token_accuracy (argmax == label),
    num_correct, count (labelled tokens).
    """
    return _labelled_token_loss(logits, labels, ignore_index, normalizer, chunk_tokens, weighted=False)


def dft_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    normalizer: Normalizer = None,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dynamic Fine-Tuning loss: Σ_{labels ≠ ignore} −sg(p_t) · log p_t / normalizer, p_t = softmax(logits)[label].

    Wu et al. 2025, "On the Generalization of SFT: A Reinforcement Learning Perspective with Reward
    Rectification" (arXiv:2508.05629): the SFT gradient is a policy gradient whose implicit reward
    is 1/p_t, so tokens the model finds unlikely get huge weights; scaling each token's NLL by its
    own probability, detached (sg = stop-gradient), cancels that factor. The gradient with respect
    to the logits of one token is p_t · (softmax − onehot(label)) / normalizer.

    Same arguments, alignment and stats as `chunked_nll` (stats["nll"] is the plain NLL, without
    the weights); normalizer defaults to the number of real labels in this call.
    """
    return _labelled_token_loss(logits, labels, ignore_index, normalizer, chunk_tokens, weighted=True)


def _labelled_token_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    normalizer: Normalizer,
    chunk_tokens: int | None,
    weighted: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Σ over the labelled tokens of −log p_t (weighted: −sg(p_t) · log p_t) / normalizer, and the stats
    of `chunked_nll`."""
    flat = logits.reshape(-1, logits.size(-1))
    flat_labels = labels.reshape(-1)
    valid = flat_labels != ignore_index
    rows = flat[valid]
    targets = flat_labels[valid]
    logp = selective_log_softmax(rows, targets, chunk_tokens=chunk_tokens)
    loss = _aggregate(-logp.detach().exp() * logp if weighted else -logp, None, normalizer)
    if targets.numel() == 0:
        # A micro-batch whose labels are all ignored still has to return a loss connected to the
        # graph, so that backward() (and DDP's gradient hooks) run on every rank.
        loss = loss + 0.0 * logits.sum()
    with torch.no_grad():
        count = torch.tensor(float(targets.numel()), device=logits.device)
        num_correct = (rows.detach().argmax(dim=-1) == targets).float().sum()
        stats = {
            "nll": -logp.detach().sum() / count.clamp(min=1),
            "token_accuracy": num_correct / count.clamp(min=1),
            "num_correct": num_correct,
            "count": count,
        }
    return loss, stats
