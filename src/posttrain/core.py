"""`posttrain.core`: the classic helpers TRL scripts import from `trl.core`.

The gpt2-sentiment notebook and TRL's classic examples write `from trl.core import LengthSampler`
(or `respond_to_batch`, `set_seed`, `masked_mean` / `masked_var` / `masked_whiten`); with trl renamed to
posttrain those imports work unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from posttrain.length_sampler import LengthSampler

if TYPE_CHECKING:
    import torch
    from torch import nn

_OPS = ("masked_mean", "masked_var", "masked_whiten")  # posttrain.ops, imported on first use (torch)
__all__ = ["LengthSampler", "respond_to_batch", "set_seed", *_OPS]


def __getattr__(name: str) -> Any:
    if name in _OPS:
        from posttrain import ops

        return getattr(ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (every device's) random generators: `transformers.set_seed`."""
    from transformers import set_seed as seed_everything

    seed_everything(seed)


def respond_to_batch(
    model: nn.Module, queries: torch.Tensor, txt_len: int = 20, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Sample exactly `txt_len` tokens after each row of `queries` (B, L) and return them (B, txt_len).

    The classic helper of TRL's first examples: one full forward per token (no KV cache, no stop
    token: an EOS is sampled like any token), top-k (0: off) and top-p (1.0: off) filtering with
    transformers' logits processors. `model` returns logits first (a causal LM or a value-head model).
    """
    import torch
    from transformers import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

    filters = LogitsProcessorList()
    if top_k > 0:
        filters.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        filters.append(TopPLogitsWarper(top_p))
    ids = queries
    with torch.no_grad():
        for _ in range(txt_len):
            logits = model(ids)[0][:, -1, :]
            probs = torch.softmax(filters(ids, logits), dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, num_samples=1)], dim=-1)
    return ids[:, -txt_len:]
