"""Tensor primitives shared by every trainer: masked statistics, EOS search, and chunked
log-probabilities / entropy of selected tokens.

Everything here is pure torch: tensors in, tensors out. Masks are boolean (or 0/1) tensors that
are True on the positions that count; they come from completion lengths (see rollout.py), never
from `ids == pad`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# The chunked log-softmax works on blocks of (rows x vocab) float32 values of at most this many
# elements (16 MiB): with a 150k vocabulary that is 27 token positions per block, with a 6.8k
# vocabulary 615 — bounded memory whatever the vocabulary, while staying vectorised.
DEFAULT_CHUNK_ELEMENTS = 1 << 22
DEFAULT_CHUNK_TOKENS = None  # None: derive the rows per block from DEFAULT_CHUNK_ELEMENTS


def chunk_rows(vocab: int, chunk_tokens: int | None) -> int:
    if chunk_tokens is not None:
        return max(1, int(chunk_tokens))
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(vocab, 1))


# Rows of one LM-head block in the online trainers (scoring.completion_forward): 4 default blocks,
# 64 MiB of float32 logits. Smaller blocks would re-read the whole head weight (vocab × hidden) once per
# block in forward, recompute and backward, and add one (vocab × hidden) weight gradient per block:
# with 27-row blocks a 0.5B RLOO step at batch 8 × 64 tokens took 55 s instead of 48 s.
HEAD_CHUNK_BLOCKS = 4


def head_chunk_rows(vocab: int, chunk_tokens: int | None) -> int:
    """Rows (positions) per LM-head block in `scoring.completion_forward`: `chunk_tokens` when given,
    else HEAD_CHUNK_BLOCKS default blocks (151,936 vocabulary: 108 rows; 6,815: 2,460). A batch whose
    completion positions fit in one block gets the model's own logits whole, with no recompute."""
    if chunk_tokens is not None:
        return chunk_rows(vocab, chunk_tokens)
    return HEAD_CHUNK_BLOCKS * chunk_rows(vocab, None)


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


# The chunked functions below cut (n, V) logits into row blocks with `split`, not slicing: in backward
# a slice's gradient is a zero-filled (n, V) tensor per block (then summed), split's is one (n, V)
# tensor the blocks' gradients are concatenated into.


def _rows(logits: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    lead = logits.shape[:-1]
    return logits.reshape(-1, logits.size(-1)), tuple(lead)


def _log_softmax(block: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 log softmax(block / temperature) over the last dimension: the one kernel behind every
    log-prob, entropy and KL in this file, so the chunked and head-chunked forms agree bitwise."""
    block = block.float()
    if temperature != 1.0:
        block = block / temperature
    return F.log_softmax(block, dim=-1)


def _gather(logp: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """logp[i, index[i]] for a (n, V) block and (n,) ids."""
    return logp.gather(-1, index[:, None]).squeeze(-1)


def _entropy(logp: torch.Tensor, grad: bool = True) -> torch.Tensor:
    """−Σ_v p_v log p_v of a (n, V) log-softmax block; detached first unless `grad` (then backward does
    not run through exp(logp)·logp over the vocabulary; the value is the same either way)."""
    source = logp if grad else logp.detach()
    if torch.is_grad_enabled() and source.requires_grad:
        return -(source.exp() * source).sum(-1)
    # Nothing to differentiate: the product goes into exp's output, one (n, V) buffer instead of two
    # (the same values, bitwise; 7–34% faster per block on a 2-core CPU, benchmarks/README.md).
    return -source.exp().mul_(source).sum(-1)


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
    rows = chunk_rows(flat.size(-1), chunk_tokens)
    idx = index.reshape(-1)
    out = [_gather(_log_softmax(block, temperature), i) for block, i in zip(flat.split(rows), idx.split(rows))]
    return torch.cat(out).reshape(lead) if out else flat.new_zeros(lead, dtype=torch.float32)


def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS
) -> torch.Tensor:
    """Entropy −Σ_v p_v log p_v of softmax(logits / temperature) per position, in chunks. float32 (...)."""
    flat, lead = _rows(logits)
    rows = chunk_rows(flat.size(-1), chunk_tokens)
    out = [_entropy(_log_softmax(block, temperature)) for block in flat.split(rows)]
    return torch.cat(out).reshape(lead) if out else flat.new_zeros(lead, dtype=torch.float32)


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
    rows = chunk_rows(flat.size(-1), chunk_tokens)
    idx = index.reshape(-1)
    lps, ents = [], []
    for block, block_idx in zip(flat.split(rows), idx.split(rows)):
        logp = _log_softmax(block, temperature)
        lps.append(_gather(logp, block_idx))
        ents.append(_entropy(logp, entropy_grad))
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


# --------------------------------------------------------------------------------------------
# The LM head in chunks: log-probs / entropy / full KL from hidden states
# --------------------------------------------------------------------------------------------


def _head_block(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    index: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, ...]:
    """(selected log-probs[, entropy]) of one block of rows: the only float32 logits alive at a time."""
    logp = _log_softmax(head(hidden), temperature)
    selected = _gather(logp, index)
    return (selected, _entropy(logp, entropy_grad)) if with_entropy else (selected,)


def _blocks(fn: Callable[..., tuple[torch.Tensor, ...]], *args: Any) -> tuple[torch.Tensor, ...]:
    """fn(*args), under non-reentrant activation checkpointing when autograd records: backward then
    recomputes this block's logits instead of keeping them (and their log-softmax) alive."""
    if torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def head_logprobs_and_entropy(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    index: torch.Tensor,
    vocab: int,
    temperature: float = 1.0,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`logprobs_and_entropy(head(hidden), index, ...)` without ever building head(hidden) whole.

    hidden: (..., H) the last hidden states at the positions whose next token is `index` (...);
    head: (n, H) -> (n, vocab) logits (the model's LM head with its own logit scaling / softcapping).
    The head runs on chunk_rows(vocab, chunk_tokens) rows at a time, each block's logits cast to float32,
    divided by the temperature, log-softmaxed, the target gathered (and the entropy taken, detached
    unless entropy_grad); with autograd recording, each block runs under non-reentrant activation
    checkpointing, so backward recomputes one block's logits at a time and neither the (..., vocab)
    logits nor their gradient exist whole. Returns float32 (...) log-probs and entropy (or None); a
    block computes exactly what `logprobs_and_entropy` computes on the same logits.
    """
    lead = tuple(index.shape)
    flat = hidden.reshape(-1, hidden.size(-1))
    idx = index.reshape(-1)
    rows = chunk_rows(vocab, chunk_tokens)
    lps, ents = [], []
    for start in range(0, flat.size(0), rows):
        part = _blocks(
            _head_block, head, flat[start : start + rows], idx[start : start + rows], temperature, with_entropy,
            entropy_grad,
        )  # fmt: skip
        lps.append(part[0])
        if with_entropy:
            ents.append(part[1])
    if not lps:
        zeros = flat.new_zeros(lead, dtype=torch.float32)
        return zeros, (zeros.clone() if with_entropy else None)
    entropy = torch.cat(ents).reshape(lead) if with_entropy else None
    return torch.cat(lps).reshape(lead), entropy


def _kl_block(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    ref_head: Callable[[torch.Tensor], torch.Tensor],
    ref_hidden: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor]:
    logp, ref_logp = _log_softmax(head(hidden), temperature), _log_softmax(ref_head(ref_hidden), temperature)
    return ((logp.exp() * (logp - ref_logp)).sum(-1),)


def head_full_kl(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    ref_head: Callable[[torch.Tensor], torch.Tensor],
    ref_hidden: torch.Tensor,
    vocab: int,
    temperature: float = 1.0,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Exact per-position KL(p‖p_ref) over the vocabulary (advantages.full_kl) from two models' last
    hidden states (..., H) and LM heads: both heads run on the same chunk_rows(vocab, chunk_tokens)
    rows at a time (checkpointed when autograd records), so neither model's (..., vocab) logits exist
    whole. float32 (...)."""
    if hidden.shape[:-1] != ref_hidden.shape[:-1]:
        raise ValueError(
            f"head_full_kl needs hidden states at the same positions, got {tuple(hidden.shape)} "
            f"and {tuple(ref_hidden.shape)}."
        )
    lead = tuple(hidden.shape[:-1])
    flat = hidden.reshape(-1, hidden.size(-1))
    ref_flat = ref_hidden.reshape(-1, ref_hidden.size(-1))
    rows = chunk_rows(vocab, chunk_tokens)
    out = [
        _blocks(_kl_block, head, flat[s : s + rows], ref_head, ref_flat[s : s + rows], temperature)[0]
        for s in range(0, flat.size(0), rows)
    ]
    return torch.cat(out).reshape(lead) if out else flat.new_zeros(lead, dtype=torch.float32)
