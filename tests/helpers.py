"""Helpers shared by several test files (not collected: no test_ prefix)."""

import torch

from posttrain.rollout import Rollout, generate


def per_row_generate(model, prompt_ids, prompt_mask, sampling, *, pad_token_id, batch_size=None, generator=None, **kw):
    """`rollout.generate` whose tokens for a row depend only on that row's prompt (and how many times
    the prompt was seen in this call): each rank of a data-parallel run samples from its own stream,
    so the 2-process == 1-process tests patch the trainers' `generate` with this."""
    seen: dict[tuple, int] = {}
    rows = []
    for ids, mask in zip(prompt_ids, prompt_mask):
        key = tuple(ids[mask.bool()].tolist())
        seen[key] = seen.get(key, -1) + 1
        seed = (sum((i + 1) * t for i, t in enumerate(key)) * 1009 + seen[key]) % (2**31)
        g = torch.Generator(device=ids.device).manual_seed(seed)
        rows.append(
            generate(
                model,
                ids[mask.bool()][None],
                mask[mask.bool()][None],
                sampling,
                pad_token_id=pad_token_id,
                generator=g,
                **kw,
            )
        )
    return Rollout.cat(rows)


def train_and_last_log(trainer) -> dict:
    """Train an online trainer; the entry of its last logging step in trainer.state.log_history (the
    entry before the end-of-training summary)."""
    trainer.train()
    history = trainer.state.log_history
    assert "train_runtime" in history[-1] and "train_runtime" not in history[-2]
    return history[-2]
