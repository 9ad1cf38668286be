"""Tensor primitives shared by every trainer: masked statistics, EOS search, and chunked
log-probabilities / entropy of selected tokens.

Everything here is pure torch: tensors in, tensors out. Masks are boolean (or 0/1) tensors that
are True on the positions that count; they come from completion lengths (see rollout.py), never
from `ids == pad`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The chunked log-softmax works on blocks of (rows x vocab) float32 values of at most this many
# elements (16 MiB): with a 150k vocabulary that is 27 token positions per block, with a 6.8k
# vocabulary 615 — bounded memory whatever the vocabulary, while staying vectorised.
DEFAULT_CHUNK_ELEMENTS = 1 << 22
DEFAULT_CHUNK_TOKENS = None  # None: derive the rows per block from DEFAULT_CHUNK_ELEMENTS


def chunk_rows(vocab: int, chunk_tokens: int | None) -> int:
    if chunk_tokens is not None:
        return max(1, int(chunk_tokens))
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(vocab, 1))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is True (over `dim`, or everything)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() if dim is None else (values * mask).sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over the True positions of `mask`: sum(v·m) / sum(m).

    An all-False mask gives 0 (not NaN), so a fully-padded micro-batch contributes nothing.
    """
    mask = mask.to(values.dtype)
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the True positions: Σ m·(v − mean)² / (n − 1) (Bessel-corrected when unbiased).

    Raises when unbiased and fewer than two positions are unmasked, since the estimate is undefined
    (the same guard as TRL's masked_var, which fails on a mask sum of 0 or 1).
    """
    mask = mask.to(values.dtype)
    n = mask.sum()
    mean = (values * mask).sum() / n.clamp(min=1)
    sq = ((values - mean) ** 2 * mask).sum()
    if unbiased:
        if n.item() < 2:
            raise ValueError(
                f"masked_var needs at least 2 unmasked values for an unbiased estimate, got {int(n.item())}; "
                "use a larger batch (e.g. raise per_device_train_batch_size) or whiten less often."
            )
        return sq / (n - 1)
    return sq / n.clamp(min=1)


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    moments: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """(v − mean)·rsqrt(var + eps) over the True positions (unbiased var).

    With shift_mean=False the mean is added back, so only the scale changes (reward whitening in
    the "N implementation details of RLHF" keeps the sign of the rewards this way).
    Masked positions are returned whitened too; callers zero them if they need to. `moments`
    (mean, var) computed elsewhere (e.g. over all ranks) replace the ones of `values`.
    """
    mean, var = moments if moments is not None else (masked_mean(values, mask), masked_var(values, mask))
    whitened = (values - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


def first_true_indices(bools: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Index of the first True in each row of a (B, T) tensor, or T where a row has none."""
    row_len = bools.size(-1)
    idx = torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(row_len * (~bools).to(dtype) + idx, dim=-1).values


def lengths_to_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """(B,) lengths -> (B, max_len) bool mask, True on positions < length."""
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


def _rows(logits: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    lead = logits.shape[:-1]
    return logits.reshape(-1, logits.size(-1)), tuple(lead)


def selective_log_softmax(
    logits: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """log softmax(logits / temperature)[index] for each position, computed in chunks of rows.

    logits: (..., V) any float dtype; index: (...) token ids. Returns float32 (...).
    Only a (chunk_tokens, V) float32 block (by default ~16 MiB) is alive at a time, so a (B, T, V)
    float32 log-softmax is never built whole. Gradients flow through (used with grad in the update).
    It runs the same kernel as `logprobs_and_entropy`, so both give bitwise the same logprobs (a
    PPO ratio of exactly 1 needs that). The same temperature must be used here as in sampling so
    train-time logprobs match rollout logprobs ("N implementation details of RLHF with PPO").
    """
    flat, lead = _rows(logits)
    chunk_tokens = chunk_rows(flat.size(-1), chunk_tokens)
    idx = index.reshape(-1)
    out = []
    for start in range(0, flat.size(0), chunk_tokens):
        block = flat[start : start + chunk_tokens].float()
        if temperature != 1.0:
            block = block / temperature
        logp = F.log_softmax(block, dim=-1)
        out.append(logp.gather(-1, idx[start : start + chunk_tokens, None]).squeeze(-1))
    if not out:
        return flat.new_zeros(lead, dtype=torch.float32)
    return torch.cat(out).reshape(lead)


def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS
) -> torch.Tensor:
    """Entropy −Σ_v p_v log p_v of softmax(logits / temperature) per position, in chunks. float32 (...)."""
    flat, lead = _rows(logits)
    chunk_tokens = chunk_rows(flat.size(-1), chunk_tokens)
    out = []
    for start in range(0, flat.size(0), chunk_tokens):
        block = flat[start : start + chunk_tokens].float()
        if temperature != 1.0:
            block = block / temperature
        logp = F.log_softmax(block, dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    if not out:
        return flat.new_zeros(lead, dtype=torch.float32)
    return torch.cat(out).reshape(lead)


def logprobs_and_entropy(
    logits: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected-token logprobs and entropy from one chunked log-softmax pass (float32 each).

    The entropy is a diagnostic unless an entropy bonus is trained: with entropy_grad=False it is
    computed from the detached log-softmax, so backward does not run through exp(logp)·logp over
    the vocabulary (it is the same value either way).
    """
    flat, lead = _rows(logits)
    chunk_tokens = chunk_rows(flat.size(-1), chunk_tokens)
    idx = index.reshape(-1)
    lps, ents = [], []
    for start in range(0, flat.size(0), chunk_tokens):
        block = flat[start : start + chunk_tokens].float()
        if temperature != 1.0:
            block = block / temperature
        logp = F.log_softmax(block, dim=-1)
        lps.append(logp.gather(-1, idx[start : start + chunk_tokens, None]).squeeze(-1))
        source = logp if entropy_grad else logp.detach()
        ents.append(-(source.exp() * source).sum(-1))
    if not lps:
        z = flat.new_zeros(lead, dtype=torch.float32)
        return z, z.clone()
    return torch.cat(lps).reshape(lead), torch.cat(ents).reshape(lead)


def exact_div(a: int, b: int, what_a: str, what_b: str) -> int:
    """a / b when b divides a, else a ValueError naming both quantities and their values."""
    if b == 0 or a % b != 0:
        raise ValueError(
            f"{what_a} ({a}) must be divisible by {what_b} ({b}); change one of them so it divides exactly."
        )
    return a // b
