"""The critic of PPO: the policy and value model as one module, and how a critic is built.

`PolicyAndValue` runs the policy and the critic in one forward (one `accelerator.prepare`, so DDP
synchronises both); with a value head on the policy's trunk (models.CausalLMWithValueHead) one
trunk pass gives the logits and the values (scoring.completion_forward with hidden states).
`build_critic` makes the separate value model `value_model_init` asks for.

With LoRA (`--use_peft`) the critic is by default a second adapter on the policy's own frozen base
(`LoraCritic`, built by `attach_lora_critic`): actor = base + adapter "default", critic = base +
adapter "critic" + a value head, reference = base with adapters off. PPO then holds one copy of the
base weights (plus the reward model) instead of policy, reference, critic and their optimizer state.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from posttrain.compat import dtype_kwargs
from posttrain.configs import ConfigError
from posttrain.rollout import Rollout
from posttrain.scoring import completion_forward, completion_logprobs, completion_values, forward_logprobs

logger = logging.getLogger(__name__)

CRITIC_ADAPTER = "critic"


class PolicyAndValue(nn.Module):
    """Policy and critic as one module: one `accelerator.prepare`, one forward, so DDP syncs both
    (TRL's PolicyAndValueWrapper). `critic=None` means the critic is a value head on the policy's
    trunk (`policy` is a models.CausalLMWithValueHead) and one trunk pass gives logits and values."""

    def __init__(self, policy: nn.Module, critic: nn.Module | None = None, entropy_grad: bool = False) -> None:
        super().__init__()
        self.policy = policy
        self.critic = critic
        # Backpropagate through the entropy only when an entropy bonus is part of the loss.
        self.entropy_grad = entropy_grad

    @property
    def shared(self) -> bool:
        return self.critic is None

    @property
    def value_model(self) -> nn.Module:
        """The module whose output is V: the critic, or the policy with its value head."""
        return self.policy if self.shared else self.critic

    @property
    def lm(self) -> nn.Module:
        """The causal LM that generates."""
        return self.policy.pretrained_model if self.shared else self.policy

    def checkpoint_modules(self) -> dict[str, nn.Module]:
        """What a checkpoint saves: the policy and the value model, or the LM and its value head."""
        if self.shared:
            return {"policy": self.policy.pretrained_model, "value_head": self.policy.score}
        return {"policy": self.policy, "value_model": self.critic}

    def final_modules(self) -> tuple[nn.Module, dict[str, nn.Module] | None]:
        """(policy, extra models) of the final save: the policy at the top of output_dir (plain
        transformers loads it); the critic in output_dir/value_model, or value_head.safetensors
        beside the policy for a value head."""
        return self.policy, None if self.shared else {"value_model": self.critic}

    def forward(self, rollout: Rollout, temperature: float, with_entropy: bool = True):
        """(logprobs (B, T), entropy (B, T) | None, values (B, T)) of the completion tokens, 0 off-mask."""
        if not self.shared:
            logprobs, entropy = completion_logprobs(
                self.policy, rollout, temperature=temperature, with_entropy=with_entropy, entropy_grad=self.entropy_grad
            )
            return logprobs, entropy, completion_values(self.critic, rollout)
        # Logits and the value head's hidden states from ONE trunk pass.
        out = completion_forward(self.policy.pretrained_model, rollout, output_hidden_states=True)
        logprobs, entropy = forward_logprobs(
            out, temperature=temperature, with_entropy=with_entropy, entropy_grad=self.entropy_grad
        )
        return logprobs, entropy, out.pad(self.policy.score(out.hidden).squeeze(-1).float())


def critic_from_policy(policy: nn.Module) -> nn.Module:
    """A separate value model: the policy's trunk (copied) under a new scalar `score` head."""
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    critic = AutoModelForSequenceClassification.from_config(config, **dtype_kwargs(next(policy.parameters()).dtype))
    critic.base_model.load_state_dict(policy.base_model.state_dict())
    return critic


def build_critic(
    init: str, policy: nn.Module, value_model: Any, reward_models: list, reward_tokenizer: Any, tokenizer: Any
) -> nn.Module | None:
    """The separate value model, or None for a value head on the policy's trunk."""
    if value_model is not None and init == "head":
        raise ConfigError(
            'value_model was given and value_model_init="head": a value head needs no separate value model.'
        )
    if value_model is None and init == "reward":
        if not reward_models:
            raise ConfigError(
                'value_model_init="reward" needs a reward model; use "policy" or "head" with reward functions.'
            )
        if reward_tokenizer is not None and reward_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(
                'value_model_init="reward": the reward model has its own tokenizer, so a critic copied from it '
                'cannot read policy tokens; use value_model_init="policy" or "head".'
            )
        return copy.deepcopy(reward_models[0]).requires_grad_(True)
    if value_model is None and init == "policy":
        return critic_from_policy(policy)
    return value_model


def attach_critic(
    policy: nn.Module, value_model: Any, config: Any, reward_models: list, reward_tokenizer: Any, tokenizer: Any
) -> tuple[nn.Module, nn.Module | None]:
    """(policy, critic) as config.value_model_init says: the given value model, one loaded from
    value_model_path, a value head on the policy's trunk (the policy becomes a
    CausalLMWithValueHead, critic None), a copy of the reward model, or a copy of the policy's trunk
    under a new head (default: "head" for a value-head policy, else "reward" with a reward model,
    else "policy"). Dropout is switched off in a separate critic when config.disable_dropout."""
    from posttrain.models import CausalLMWithValueHead, disable_dropout, load_value_model, model_init_kwargs

    init = config.value_model_init or (
        "head" if isinstance(policy, CausalLMWithValueHead) else "reward" if reward_models else "policy"
    )
    if value_model is None and config.value_model_path:
        # The critic is trained, so a causal LM (TRL's examples pass the SFT model) gets a fresh value head.
        value_model = load_value_model(
            config.value_model_path, **model_init_kwargs(config), tokenizer=tokenizer, allow_new_head=True
        )
    critic = build_critic(init, policy, value_model, reward_models, reward_tokenizer, tokenizer)
    if init == "head" and not isinstance(policy, CausalLMWithValueHead):
        policy = CausalLMWithValueHead(policy)
    if critic is not None and config.disable_dropout:
        disable_dropout(critic)
    return policy, critic


# ---------------------------------------------------------------------------------------------
# LoRA roles on one base: the critic as a second adapter of the policy's PEFT model
# ---------------------------------------------------------------------------------------------
class LoraCritic(nn.Module):
    """PPO's value model as the adapter "critic" of the policy's PEFT model plus a value head.

    Looks like a sequence-classification value model to scoring code (`base_model_prefix` names a
    backbone, `score` is the head): the backbone is the policy's transformer run with the critic
    adapter active (models.AdapterSwitch), so values come from base + critic LoRA, never from the
    policy's adapter. The base model is NOT a submodule: its weights belong to the policy. The
    critic's own parameters are its LoRA matrices (the same objects the PEFT model uses, registered
    here under `adapter.`) and the head (`score.`), so its state_dict is what a checkpoint saves and a
    resume restores, and the critic loss can move nothing else.
    """

    base_model_prefix = "backbone"

    def __init__(self, policy: nn.Module, switch: Any, score: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_policy", policy)  # held, not registered: the base is the policy's
        self.switch = switch
        self.adapter = nn.ModuleDict()
        for path, module in policy.named_modules():
            names = [n for n in getattr(module, "adapter_layer_names", ()) if CRITIC_ADAPTER in getattr(module, n)]
            if not names:
                continue
            holder = nn.Module()
            for name in names:
                part = getattr(module, name)[CRITIC_ADAPTER]
                if isinstance(part, nn.Parameter):
                    holder.register_parameter(name, part)
                else:
                    holder.add_module(name, part)
            self.adapter[path.replace(".", "-")] = holder
        if not len(self.adapter):
            raise ValueError(f"the PEFT model has no {CRITIC_ADAPTER!r} adapter layers")
        self.score = score

    @property
    def config(self) -> Any:
        return self._policy.config

    @property
    def backbone(self) -> Any:
        """The policy's transformer trunk, called with the critic adapter active."""
        lm = self._policy.get_base_model()
        trunk = getattr(lm, lm.base_model_prefix)

        def run(**kwargs: Any) -> Any:
            with self.switch.use(CRITIC_ADAPTER):
                return trunk(**kwargs)

        return run


def is_lora_config(peft_config: Any) -> bool:
    """A peft.LoraConfig (the kind of adapter a second, critic adapter can join on the same base)."""
    peft_type = getattr(peft_config, "peft_type", None)
    return str(getattr(peft_type, "value", peft_type)) == "LORA"


def lora_roles_wanted(config: Any, value_model: Any) -> bool:
    """Whether PPO with PEFT puts the critic on the policy's base as a second adapter: yes unless a
    value model is given (object or value_model_path) or value_model_init="head" (the value head then
    shares the policy's adapter)."""
    return value_model is None and not config.value_model_path and config.value_model_init != "head"


def check_lora_roles_config(config: Any) -> None:
    """Refuse, before models load, what LoRA roles cannot do: reentrant gradient checkpointing
    re-runs a block without torch's recompute context, i.e. under whichever adapter is active then."""
    kwargs = config.gradient_checkpointing_kwargs or {}
    if config.gradient_checkpointing and kwargs.get("use_reentrant"):
        raise ConfigError(
            "gradient_checkpointing_kwargs use_reentrant=True: PPO with --use_peft trains the policy and the critic "
            "as two adapters on one base, which needs non-reentrant checkpointing (each block is recomputed under "
            "its own adapter). Drop use_reentrant (posttrain's default is False), or pass --value_model_init head "
            "or --value_model_path for a critic that is not an adapter."
        )


def _head_from_reward(reward_models: list, hidden_size: int, dtype: Any) -> nn.Module | None:
    """A copy of the first reward model's score head when it is a Linear(hidden_size, 1), else None."""
    from posttrain.models import _ValueHead

    head = getattr(reward_models[0], "score", None) if reward_models else None
    if not isinstance(head, nn.Linear) or head.out_features != 1 or head.in_features != hidden_size:
        return None
    copy_ = _ValueHead(hidden_size, 1, bias=head.bias is not None, dtype=dtype)
    with torch.no_grad():
        copy_.weight.copy_(head.weight.to(dtype))
        if head.bias is not None:
            copy_.bias.copy_(head.bias.to(dtype))
    return copy_


def attach_lora_critic(policy: nn.Module, config: Any, reward_models: list) -> LoraCritic:
    """Add the adapter "critic" (the policy adapter's LoRA settings; no modules_to_save, dropout off
    with config.disable_dropout) to the PEFT `policy` and return the `LoraCritic` over it.

    The head: value_model_init "reward" (the default with a reward model) starts from the reward
    model's score head when it is a Linear(hidden, 1) of the policy's width. TRL starts the whole
    critic from the reward model; here the trunk is the policy's (+ a zero-initialised LoRA, so it
    starts as the base), and a reward model trained from the same SFT base reads a closely related
    hidden space, so its head gives values on the reward's scale from the first step. Other widths,
    or "policy": a fresh head, N(0, 1/(hidden+1)), bias 0 (models.CausalLMWithValueHead's init).
    """
    from posttrain.models import AdapterSwitch, _ValueHead, disable_dropout, enable_gradient_checkpointing

    init = config.value_model_init or ("reward" if reward_models else "policy")
    if init == "reward" and not reward_models:
        raise ConfigError(
            'value_model_init="reward" needs a reward model; use "policy" or "head" with reward functions.'
        )
    adapter_config = policy.peft_config[policy.active_adapter]
    critic_config = dataclasses.replace(
        adapter_config,
        modules_to_save=None,
        lora_dropout=0.0 if config.disable_dropout else adapter_config.lora_dropout,
    )
    policy.add_adapter(CRITIC_ADAPTER, critic_config)
    for module in policy.modules():
        for name in getattr(module, "adapter_layer_names", ()):
            part = getattr(module, name)
            if CRITIC_ADAPTER in part:
                part[CRITIC_ADAPTER].requires_grad_(True)
    if config.disable_dropout:
        disable_dropout(policy)
    switch = AdapterSwitch(policy)
    lm = policy.get_base_model()
    if config.gradient_checkpointing or getattr(lm, "is_gradient_checkpointing", False):
        # Each checkpointed block is recomputed under the adapter its forward ran with (also for a
        # model object whose checkpointing was switched on before it was given).
        kwargs = {**(config.gradient_checkpointing_kwargs or {}), "context_fn": switch.checkpoint_context}
        enable_gradient_checkpointing(lm, kwargs)
    hidden_size = lm.config.get_text_config().hidden_size
    # The head is float32 whatever the LM's dtype (as models.CausalLMWithValueHead's).
    head = _head_from_reward(reward_models, hidden_size, torch.float32) if init == "reward" else None
    if head is None:
        if init == "reward":
            logger.info("the reward model's score head does not fit the policy's width: the critic's head is fresh")
        head = _ValueHead(hidden_size, 1)
        nn.init.normal_(head.weight, std=1.0 / (hidden_size + 1) ** 0.5)
        nn.init.zeros_(head.bias)
    return LoraCritic(policy, switch, head.to(next(lm.parameters()).device))
