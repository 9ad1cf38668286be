"""The critic of PPO: the policy and value model as one module, and how a critic is built.

`PolicyAndValue` runs the policy and the critic in one forward (one `accelerator.prepare`, so DDP
synchronises both); with a value head on the policy's trunk (models.CausalLMWithValueHead) one
trunk pass gives the logits and the values (scoring.completion_forward with hidden states).
`build_critic` makes the separate value model `value_model_init` asks for.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from posttrain.compat import dtype_kwargs
from posttrain.configs import ConfigError
from posttrain.rollout import Rollout
from posttrain.scoring import completion_forward, completion_logprobs, completion_values, forward_logprobs


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
