"""Optimizer, learning-rate schedule and the clipped optimizer step, shared by every trainer."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from posttrain import distributed
from posttrain.configs import BNB_OPTIMIZERS, ConfigError


def parse_optim_args(text: str | None) -> dict[str, Any]:
    """`optim_args` ("key=value,key=value", spaces ignored, as transformers splits it) as keyword
    arguments: true/false (yes/no) become bools, none None, numbers int or float, anything else stays text."""
    out: dict[str, Any] = {}
    if not text:
        return out
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        key, sep, raw = part.partition("=")
        if not sep or not key:
            raise ConfigError(f'optim_args={text!r}: {part!r} is not key=value; write "key=value,key=value".')
        lowered = raw.lower()
        value: Any
        if lowered in ("true", "false", "yes", "no"):
            value = lowered in ("true", "yes")
        elif lowered == "none":
            value = None
        else:
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    value = raw
        out[key] = value
    return out


def optimizer_class_and_kwargs(config: Any) -> tuple[type, dict[str, Any]]:
    """The optimizer class `config.optim` names and its keyword arguments, as transformers.Trainer
    builds them: lr everywhere; AdamW: betas (adam_beta1, adam_beta2) and eps (adam_epsilon);
    Adafactor: scale_parameter=False, relative_step=False (an external lr); bitsandbytes: optim_bits 8
    or 32 and is_paged from the name. weight_decay goes to every optimizer (to every parameter, as
    posttrain always applied it). `optim_args` then overrides or adds keyword arguments."""
    name = config.optim
    lr, decay = config.learning_rate, config.weight_decay
    adam = {"betas": (config.adam_beta1, config.adam_beta2), "eps": config.adam_epsilon}
    kwargs: dict[str, Any] = {"lr": lr, "weight_decay": decay}
    cls: type
    if name == "adamw_torch":
        cls, kwargs = torch.optim.AdamW, {**kwargs, **adam}
    elif name == "adamw_torch_fused":
        cls, kwargs = torch.optim.AdamW, {**kwargs, **adam, "fused": True}
    elif name == "adafactor":
        from transformers.optimization import Adafactor

        cls, kwargs = Adafactor, {**kwargs, "scale_parameter": False, "relative_step": False}
    elif name == "sgd":
        cls = torch.optim.SGD
    elif name == "adagrad":
        cls = torch.optim.Adagrad
    elif name == "rmsprop":
        cls = torch.optim.RMSprop
    elif name in BNB_OPTIMIZERS:
        try:
            import bitsandbytes.optim as bnb
        except ImportError:
            raise ConfigError(f"optim={name!r} needs bitsandbytes: pip install bitsandbytes") from None
        bits = {"optim_bits": 8 if "8bit" in name else 32}
        if "adam" in name:
            cls, kwargs = bnb.AdamW, {**kwargs, **adam, **bits, "is_paged": "paged" in name}
        elif "lion" in name:
            cls, kwargs = bnb.Lion, {**kwargs, "betas": adam["betas"], **bits, "is_paged": "paged" in name}
        else:
            cls, kwargs = bnb.RMSprop, {**kwargs, **bits}
    else:  # configs.py refuses unknown names first; this guards configs built around __post_init__
        raise ConfigError(f"optim={name!r} is not a known optimizer.")
    extra = parse_optim_args(config.optim_args)
    if extra:
        accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "params")]
        unknown = sorted(set(extra) - set(accepted))
        if unknown and not any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values()
        ):
            raise ConfigError(
                f"optim_args={config.optim_args!r}: {cls.__name__} (optim={name!r}) takes no {unknown}; "
                f"its arguments are {accepted}."
            )
        kwargs.update(extra)
    return cls, kwargs


def build_optimizer(params: Sequence[nn.Parameter] | Any, config: Any) -> torch.optim.Optimizer:
    """The optimizer `config.optim` names (default AdamW) over the trainable parameters, with the
    config's lr, betas, eps, weight decay (biases and norms included) and `optim_args`."""
    cls, kwargs = optimizer_class_and_kwargs(config)
    return cls([p for p in params if p.requires_grad], **kwargs)


def build_scheduler(optimizer: torch.optim.Optimizer, config: Any, num_training_steps: int):
    """transformers' named schedules (linear, cosine, constant, ...) with warmup_ratio / warmup_steps
    and `lr_scheduler_kwargs` (e.g. num_cycles of cosine_with_restarts, min_lr of cosine_with_min_lr)."""
    from transformers import get_scheduler

    kwargs = dict(config.lr_scheduler_kwargs or {})
    if kwargs and config.lr_scheduler_type in ("constant", "constant_with_warmup"):
        # transformers drops them without a word for these two schedules.
        raise ConfigError(
            f"lr_scheduler_kwargs={kwargs!r}: lr_scheduler_type={config.lr_scheduler_type!r} takes no arguments; "
            "drop lr_scheduler_kwargs or pick a schedule that takes them (e.g. cosine_with_restarts)."
        )
    try:
        return get_scheduler(
            config.lr_scheduler_type,
            optimizer=optimizer,
            num_warmup_steps=config.warmup_for(num_training_steps),
            num_training_steps=num_training_steps,
            scheduler_specific_kwargs=kwargs,
        )
    except TypeError as err:
        raise ConfigError(
            f"lr_scheduler_kwargs={config.lr_scheduler_kwargs!r} does not fit lr_scheduler_type="
            f"{config.lr_scheduler_type!r} ({err}); pass only that schedule's arguments."
        ) from None


def clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, config: Any, accelerator: Any) -> float:
    """Clip the global grad norm (if max_grad_norm) and take an optimizer step; returns the norm."""
    norm = float("nan")
    if config.max_grad_norm:
        norm = distributed.clip_grad_norm(accelerator, model.parameters(), config.max_grad_norm)
    optimizer.step()
    # The optimizer's own default (torch, accelerate: set_to_none=True), as TRL's trainers call it, so a
    # script that patches `trainer.optimizer.zero_grad` (e.g. set_to_none=False, to read grads) sees it used.
    optimizer.zero_grad()
    return norm
