"""Optimizer, learning-rate schedule and the clipped optimizer step, shared by every trainer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def build_optimizer(params: Sequence[nn.Parameter] | Any, config: Any) -> torch.optim.Optimizer:
    """AdamW with the config's lr, betas, eps and weight decay (biases and norms included, as TRL)."""
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
        weight_decay=config.weight_decay,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, config: Any, num_training_steps: int):
    """transformers' named schedules (linear, cosine, constant, ...) with warmup_ratio / warmup_steps."""
    from transformers import get_scheduler

    return get_scheduler(
        config.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=config.warmup_for(num_training_steps),
        num_training_steps=num_training_steps,
    )


def clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, config: Any, accelerator: Any) -> float:
    """Clip the global grad norm (if max_grad_norm) and take an optimizer step; returns the norm."""
    norm = float("nan")
    if config.max_grad_norm:
        norm = float(accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm
