"""From scores to advantages: KL estimators, KL-shaped rewards, GAE, whitening, running score
scaling, KL-coefficient controllers, and the RLOO / GRPO group baselines.

Everything is pure torch math on tensors (the two small stateful classes, `RunningMoments` and the
KL controllers, only hold numbers and delegate to pure functions). Conventions (docs/internals.md):
`logprobs`, `ref_logprobs` are per completion token, float32, shape (B, T); `completion_mask` is
True on real completion tokens (the stop token included) and comes from completion lengths;
`scores` are one per sequence, `rewards` are per token.

Sources cited below:
- TRL ≤ 0.11 `trl/trainer/ppo_trainer.py` and `trl/core.py` (the classic `PPOTrainer.step()`);
- TRL 0.19 `trl/trainer/ppo_trainer.py` / `rloo_trainer.py` (the on-policy trainers);
- TRL 1.x `trl/trainer/grpo_trainer.py` / `rloo_trainer.py`;
- Schulman, "Approximating KL divergence" (2020) for the k1/k2/k3 estimators;
- Schulman et al., "High-Dimensional Continuous Control Using GAE" (2016);
- Ziegler et al., "Fine-Tuning Language Models from Human Preferences" (2019) for the adaptive
  KL controller;
- Chan, Golub, LeVeque, "Updating formulae and a pairwise algorithm for computing sample
  variances" (1979) for merging moments.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from posttrain.ops import DEFAULT_CHUNK_TOKENS, chunk_rows, masked_whiten

# Names accepted by `kl_penalty`. "kl"/"mse" are TRL ≤ 0.11's names, "k1"/"k2"/"k3" Schulman's;
# each pair of aliases computes the same thing.
KL_ESTIMATORS = ("k1", "kl", "abs", "mse", "k2", "k3")


# --------------------------------------------------------------------------------------------
# KL estimators
# --------------------------------------------------------------------------------------------


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k1",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from the sampled tokens' logprobs. Shape of `logprobs`.

    With logr = ref_logprobs − logprobs (log of π_ref/π at the sampled token):
      "k1" / "kl":  lp − ref                          (unbiased, high variance, can be < 0)
      "abs":        |lp − ref|
      "k2" / "mse": ½·(lp − ref)²
      "k3":         (exp(logr) − 1) − logr            (unbiased, always ≥ 0, low variance)
    Sources: TRL ≤ 0.11 `PPOTrainer._kl_penalty` ("kl", "abs", "mse"); TRL 0.19
    `kl_estimator` ("k1", "k3"); Schulman (2020) "Approximating KL divergence".
    The exact vocabulary sum ("full" in TRL) needs logits, see `full_kl`.
    Positions where `mask` is False are set to 0 when a mask is given.
    """
    diff = logprobs - ref_logprobs
    if estimator in ("k1", "kl"):
        kl = diff
    elif estimator == "abs":
        kl = diff.abs()
    elif estimator in ("k2", "mse"):
        kl = 0.5 * diff.square()
    elif estimator == "k3":
        logr = -diff
        kl = torch.expm1(logr) - logr
    elif estimator == "full":
        raise ValueError(
            "kl_penalty works from sampled-token logprobs; the exact 'full' KL needs logits: "
            "call posttrain.advantages.full_kl(logits, ref_logits, mask). "
            f"Valid estimators here: {', '.join(KL_ESTIMATORS)}."
        )
    else:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; valid names: {', '.join(KL_ESTIMATORS)} (or full_kl for 'full')."
        )
    if mask is not None:
        kl = kl.masked_fill(~mask.bool(), 0.0)
    return kl


def full_kl(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Exact per-position KL(p‖p_ref) = Σ_v p_v·(log p_v − log p_ref,v), p = softmax(logits / temperature).

    logits, ref_logits: (..., V) any float dtype; returns float32 (...), 0 where `mask` is False.
    Source: TRL ≤ 0.11 `kl_penalty="full"`, `F.kl_div(ref_logp, logp, log_target=True).sum(-1)`,
    which materialises two full (B, T, V) log-softmaxes; here only (chunk_tokens, V) float32 blocks
    are alive at a time. Gradients flow into `logits` (and `ref_logits` if it requires grad).
    """
    if logits.shape != ref_logits.shape:
        raise ValueError(
            "full_kl needs logits and ref_logits of the same shape, "
            f"got {tuple(logits.shape)} and {tuple(ref_logits.shape)}."
        )
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.size(-1))
    ref_flat = ref_logits.reshape(-1, ref_logits.size(-1))
    out = []
    chunk_tokens = chunk_rows(flat.size(-1), chunk_tokens)
    for start in range(0, flat.size(0), chunk_tokens):
        block = flat[start : start + chunk_tokens].float()
        ref_block = ref_flat[start : start + chunk_tokens].float()
        if temperature != 1.0:
            block = block / temperature
            ref_block = ref_block / temperature
        logp = F.log_softmax(block, dim=-1)
        ref_logp = F.log_softmax(ref_block, dim=-1)
        out.append((logp.exp() * (logp - ref_logp)).sum(-1))
    kl = torch.cat(out).reshape(lead) if out else flat.new_zeros(lead, dtype=torch.float32)
    if mask is not None:
        kl = kl.masked_fill(~mask.bool(), 0.0)
    return kl


# --------------------------------------------------------------------------------------------
# KL-shaped rewards
# --------------------------------------------------------------------------------------------


def last_token_indices(completion_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of the last True position of each row: length − 1 for a right-padded mask.

    Computed as T − 1 − argmax(fliplr(mask)) (TRL 0.19 RLOO `eos_indices`), so it is right
    even for a mask with holes. Raises on a row with no True position: such a completion has no
    token to carry its score.
    """
    mask = completion_mask.bool()
    empty = ~mask.any(dim=-1)
    if bool(empty.any()):
        rows = torch.nonzero(empty).flatten().tolist()
        raise ValueError(
            f"completion_mask rows {rows} have no completion token, so their score has nowhere to go; "
            "drop them before shaping rewards."
        )
    return mask.size(-1) - 1 - mask.long().flip(-1).argmax(dim=-1)


def kl_shaped_rewards(
    scores: torch.Tensor, kl: torch.Tensor, completion_mask: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO rewards: r_t = −kl_coef·kl_t on real tokens, 0 off-mask, + score on the last real token.

    scores (B,), kl (B, T), completion_mask (B, T) -> (rewards (B, T), non_score_rewards (B, T)),
    non_score_rewards = −kl_coef·kl·mask. float32.
    The score is added at index length − 1, the last real token (the stop token when the
    completion stopped), as in TRL ≤ 0.11 `compute_rewards` (`mask.nonzero()[-1]`) and OpenAI's
    "learning to summarize". This fixes TRL 0.19 and 1.x experimental PPO, which adds the
    score one position past the stop token (the first pad slot; huggingface/trl#1893, #3750), so
    the critic had to value a padding position.
    """
    mask = completion_mask.bool()
    non_score = (-kl_coef * kl.float()).masked_fill(~mask, 0.0)
    last = last_token_indices(mask)
    rewards = non_score.clone()
    rewards[torch.arange(rewards.size(0), device=rewards.device), last] += scores.to(rewards.dtype)
    return rewards, non_score


def sequence_kl_rewards(
    scores: torch.Tensor, kl: torch.Tensor, completion_mask: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level KL-penalised reward (RLOO default): one number per completion.

    non_score = −kl_coef·Σ_t kl_t·mask_t;  rlhf_reward = score + non_score.
    Returns (rlhf_reward (B,), non_score_reward (B,)). Source: TRL 0.19 `RLOOTrainer`
    (`token_level_kl=False`).
    """
    non_score = -kl_coef * (kl.float() * completion_mask.to(torch.float32)).sum(dim=-1)
    return scores.float() + non_score, non_score


def token_level_kl_rewards(
    scores: torch.Tensor, kl: torch.Tensor, completion_mask: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO token-level variant: scatter the score onto the last real token, add −kl_coef·kl_t, sum over t.

    last_reward[b, length_b − 1] = score_b; kl_reward = −kl_coef·kl·mask;
    rlhf_reward = Σ_t (last_reward + kl_reward);  non_score_reward = Σ_t kl_reward.
    Returns (rlhf_reward (B,), non_score_reward (B,)). Source: TRL 0.19 `RLOOTrainer`
    (`token_level_kl=True`) and its `test_rloo_reward`. With the KL zeroed off-mask this equals
    `sequence_kl_rewards`; it exists so RLOO can expose TRL's option unchanged.
    """
    rewards, non_score = kl_shaped_rewards(scores, kl, completion_mask, kl_coef)
    return rewards.sum(dim=-1), non_score.sum(dim=-1)


# --------------------------------------------------------------------------------------------
# GAE and whitening
# --------------------------------------------------------------------------------------------


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over right-padded completions.

    δ_t = r_t + γ·V_{t+1} − V_t,  A_t = δ_t + γλ·A_{t+1},  returns R_t = A_t + V_t,
    with V and r taken as 0 beyond the last real token (so V_{last+1} = 0: the episode ends at the
    stop token, where `kl_shaped_rewards` put the score) and A = R = 0 off-mask.
    Source: Schulman et al. 2016 (GAE); TRL ≤ 0.11 `PPOTrainer.compute_advantages`.
    rewards, values, mask: (B, T) -> (advantages (B, T), returns (B, T)), float32. A Python loop
    over T, vectorised over B. Assumes each row's mask is a prefix (right padding), as built from
    completion lengths.
    """
    m = mask.to(torch.float32)
    r = rewards.float().masked_fill(~mask.bool(), 0.0)
    v = values.float().masked_fill(~mask.bool(), 0.0)
    batch, length = r.shape
    advantages = torch.zeros_like(r)
    last_gae = r.new_zeros(batch)
    next_values = r.new_zeros(batch)
    for t in reversed(range(length)):
        delta = r[:, t] + gamma * next_values - v[:, t]
        last_gae = delta + gamma * lam * last_gae
        advantages[:, t] = last_gae
        next_values = v[:, t]
    advantages = advantages * m
    returns = (advantages + v) * m
    return advantages, returns


def whiten_rewards(
    rewards: torch.Tensor, mask: torch.Tensor, shift_mean: bool = False, moments: tuple | None = None
) -> torch.Tensor:
    """Masked reward whitening before GAE: (r − mean)/sqrt(var + 1e-8) (+ mean back when shift_mean=False).

    Default shift_mean=False keeps the mean (only rescales), as TRL ≤ 0.11 and 0.19
    `whiten_rewards` (`masked_whiten(rewards, mask, shift_mean=False)`). Off-mask positions are 0
    (TRL leaves them whitened, which leaks padding into GAE). Needs ≥ 2 masked positions.
    `moments` = (mean, unbiased var) of the whole batch when it is spread over several ranks.
    """
    m = mask.bool()
    clean = rewards.float().masked_fill(~m, 0.0)
    return masked_whiten(clean, m, shift_mean=shift_mean, moments=moments).masked_fill(~m, 0.0)


def whiten_advantages(
    advantages: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, moments: tuple | None = None
) -> torch.Tensor:
    """Masked advantage whitening: (A − mean)/sqrt(var + 1e-8) over the mask (unbiased var), 0 off-mask.

    Source: TRL ≤ 0.11 and 0.19 PPO (`masked_whiten(advantages, mask)` then zeroing padding).
    `moments` = (mean, unbiased var) of the whole batch when it is spread over several ranks.
    """
    m = mask.bool()
    clean = advantages.float().masked_fill(~m, 0.0)
    return masked_whiten(clean, m, shift_mean=shift_mean, moments=moments).masked_fill(~m, 0.0)


# --------------------------------------------------------------------------------------------
# Running score scaling
# --------------------------------------------------------------------------------------------


def merge_moments(
    mean_a: float, var_a: float, count_a: float, mean_b: float, var_b: float, count_b: float
) -> tuple[float, float, float]:
    """Combine two (mean, population variance, count) summaries into one (Chan et al. 1979).

    δ = mean_b − mean_a;  n = n_a + n_b;  mean = mean_a + δ·n_b/n;
    M2 = var_a·n_a + var_b·n_b + δ²·n_a·n_b/n;  var = M2/n.
    """
    count = count_a + count_b
    if count == 0:
        return 0.0, 0.0, 0.0
    delta = mean_b - mean_a
    mean = mean_a + delta * count_b / count
    m2 = var_a * count_a + var_b * count_b + delta * delta * count_a * count_b / count
    return mean, m2 / count, count


class RunningMoments:
    """Running mean / std of every score seen so far (reward scaling of TRL ≤ 0.11 `RunningMoments`).

    `update(xs)` merges the batch's moments into the running ones with `merge_moments`. In
    multi-process training the caller passes the scores already gathered from all ranks, so
    every rank holds the same statistics (TRL computes global statistics the same way).
    `std` is the unbiased (n − 1) running std, 1.0 until two scores were seen.
    State is three Python floats (float64), so it survives `state_dict()` / `load_state_dict()`.
    """

    def __init__(self) -> None:
        self.mean = 0.0
        self.var = 0.0
        self.count = 0.0

    @property
    def std(self) -> float:
        if self.count < 2:
            return 1.0
        return math.sqrt(self.var * self.count / (self.count - 1))

    def update(self, xs: torch.Tensor) -> tuple[float, float]:
        """Merge the values of `xs` in; returns the batch's (mean, unbiased std), std 0.0 for one value."""
        flat = xs.detach().double().flatten()
        n = flat.numel()
        if n == 0:
            return 0.0, 0.0
        var, mean = torch.var_mean(flat, unbiased=False)
        batch_mean, batch_var = float(mean), float(var)
        self.mean, self.var, self.count = merge_moments(
            self.mean, self.var, self.count, batch_mean, batch_var, float(n)
        )
        batch_std = math.sqrt(batch_var * n / (n - 1)) if n > 1 else 0.0
        return batch_mean, batch_std

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), float(state["count"])


def scale_scores(
    scores: torch.Tensor,
    running: RunningMoments | None,
    use_score_scaling: bool = False,
    use_score_norm: bool = False,
    score_clip: float | None = None,
    stats_scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scale scores by running statistics, then clip (TRL ≤ 0.11 `PPOConfig` semantics).

    use_score_scaling: update `running` with `stats_scores` (default `scores`; pass the scores
      gathered from all ranks in multi-process runs), then s / (running.std + eps_dtype);
    use_score_norm (requires use_score_scaling): (s − running.mean) / (running.std + eps_dtype);
    score_clip: clamp to [−score_clip, score_clip] afterwards (applies with or without scaling).
    This is the reward-scaling cure for DeepSpeed-Chat-style drifting reward scales (trlx's
    running scaling, OpenRLHF's running reward normalization, TRL ≤ 0.11 `PPOTrainer.step()`).
    TRL silently ignores use_score_norm without use_score_scaling; here it is an error.
    """
    if use_score_norm and not use_score_scaling:
        raise ValueError("use_score_norm only takes effect with use_score_scaling=True; set both or neither.")
    out = scores
    if use_score_scaling:
        if running is None:
            raise ValueError("use_score_scaling=True needs a RunningMoments instance to hold the running statistics.")
        running.update(scores if stats_scores is None else stats_scores)
        factor = running.std + torch.finfo(scores.dtype).eps
        out = (scores - running.mean) / factor if use_score_norm else scores / factor
    if score_clip is not None:
        out = out.float().clamp(-score_clip, score_clip).to(scores.dtype)
    return out


# --------------------------------------------------------------------------------------------
# KL coefficient controllers
# --------------------------------------------------------------------------------------------


def adaptive_kl_update(value: float, current_kl: float, target: float, horizon: float, n_steps: int) -> float:
    """Ziegler et al. (2019) proportional controller for the KL coefficient.

    err = clip(current_kl / target − 1, −0.2, 0.2);  value ← value·(1 + err·n_steps / horizon).
    Source: TRL ≤ 0.11 `AdaptiveKLController.update` (n_steps = samples in the step, all ranks).
    """
    err = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return value * (1.0 + err * n_steps / horizon)


class FixedKLController:
    """Constant KL coefficient (TRL ≤ 0.11 `FixedKLController`; `update` does nothing)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        return None

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient steering the measured KL towards `target` (see `adaptive_kl_update`).

    TRL ≤ 0.11 defaults: init_kl_coef 0.2, target 6.0, horizon 10000.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs target > 0 and horizon > 0, got target={target}, horizon={horizon}."
            )
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        self.value = adaptive_kl_update(self.value, float(current_kl), self.target, self.horizon, n_steps)

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


# --------------------------------------------------------------------------------------------
# Baselines without a critic: RLOO, GRPO
# --------------------------------------------------------------------------------------------


def rloo_advantages(rewards: torch.Tensor, scorable: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE leave-one-out advantages. rewards: (k, num_prompts) -> advantages (k, num_prompts).

    Row i is the i-th sample of every prompt (TRL 0.19 layout: `rlhf_reward.reshape(rloo_k, −1)`).
    baseline_i = (Σ_j r_j − r_i)/(k − 1) (mean of the other k − 1 samples of the same prompt);
    A_i = r_i − baseline_i. Source: Ahmadian et al. 2024 "Back to Basics"; TRL 0.19
    `RLOOTrainer` and `test_rloo_reward`. Rollouts laid out prompt-major (rollout.generate with
    num_samples = k) are `rewards.view(num_prompts, k).T`.

    scorable (k, num_prompts) bool, optional: False for a completion that no reward scored (every reward
    function returned None). As TRL 1.x's RLOO, such a completion is left out of its siblings' baseline
    (the mean of the other scorable samples) and gets advantage 0, as does a scorable one with no
    scorable sibling.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rloo_advantages expects rewards shaped (k, num_prompts), got shape {tuple(rewards.shape)}.")
    k = rewards.size(0)
    if k < 2:
        raise ValueError(f"RLOO needs at least 2 samples per prompt for a leave-one-out baseline, got k={k}.")
    if scorable is None or bool(scorable.all()):
        baseline = (rewards.sum(dim=0, keepdim=True) - rewards) / (k - 1)
        return rewards - baseline
    kept = torch.where(scorable, rewards, torch.zeros_like(rewards))
    others = scorable.sum(dim=0, keepdim=True) - 1  # scorable siblings of a scorable sample
    baseline = (kept.sum(dim=0, keepdim=True) - kept) / others.clamp(min=1)
    return torch.where(scorable & (others > 0), rewards - baseline, torch.zeros_like(rewards))


def group_advantages(rewards: torch.Tensor, scale_std: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """GRPO group-relative advantages. rewards: (num_prompts, G) -> advantages (num_prompts, G).

    A = (r − mean_g(r)) / (std_g(r) + eps) with std unbiased (n − 1), the default of torch.std and
    what TRL 1.x GRPO computes (`rewards.view(-1, G).std(dim=1)`, eps 1e-4); scale_std=False gives
    the Dr. GRPO mean-only variant. A group whose rewards are all equal gets A = 0.
    """
    if rewards.dim() != 2:
        raise ValueError(f"group_advantages expects rewards shaped (num_prompts, G), got shape {tuple(rewards.shape)}.")
    group = rewards.size(1)
    if group < 2:
        raise ValueError(f"group_advantages needs at least 2 completions per prompt (G), got G={group}.")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def normalize_rewards(
    scores: torch.Tensor, clip_range: float | None = None, moments: tuple | None = None
) -> torch.Tensor:
    """(s − mean)/(std + 1e-8) over the batch (unbiased std), then clamp to ±clip_range.

    Source: TRL 0.19 RLOO `normalize_reward` / `reward_clip_range` (Reinforce++, trl#2552).
    `moments` = (mean, unbiased var) of the whole batch when it is spread over several ranks.
    """
    if moments is None and scores.numel() < 2:
        raise ValueError(f"normalize_rewards needs at least 2 scores for a standard deviation, got {scores.numel()}.")
    mean, std = (scores.mean(), scores.std()) if moments is None else (moments[0], moments[1].sqrt())
    out = (scores - mean) / (std + 1e-8)
    return out if clip_range is None else out.clamp(-clip_range, clip_range)


def normalize_advantages(advantages: torch.Tensor, eps: float = 1e-8, moments: tuple | None = None) -> torch.Tensor:
    """(A − mean)/(std + eps) over the whole tensor (unbiased std).

    Source: TRL 0.19 RLOO `normalize_advantage` (eps 1e-8); TRL 1.x RLOO uses eps 1e-4.
    For per-token advantages with padding use `whiten_advantages` instead. `moments` = (mean,
    unbiased var) of the whole batch when it is spread over several ranks.
    """
    if moments is None and advantages.numel() < 2:
        raise ValueError(
            f"normalize_advantages needs at least 2 values for a standard deviation, got {advantages.numel()}."
        )
    mean, std = (advantages.mean(), advantages.std()) if moments is None else (moments[0], moments[1].sqrt())
    return (advantages - mean) / (std + eps)
