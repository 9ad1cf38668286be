"""TRL's building blocks of the classic `PPOTrainer`, public with the signatures of its last release
(TRL 0.11; `compute_rewards` returns (rewards, non_score_reward, kl) as since TRL 0.7.9), on the shared
math (posttrain.advantages, posttrain.losses, posttrain.scoring, posttrain.ops): `batched_forward_pass`,
`compute_rewards`, `_kl_penalty`, `compute_advantages`, `loss`, `train_minibatch`,
`record_step_stats`, `gather_stats`. Scripts that assemble their own step from them (or test them one by one) port
unchanged; `step()` itself (trainers/ppo_classic.py) runs ppo.py's steps 3–5, which compute the same
quantities distributed-exactly.

Tensors are completion-aligned, (batch, response_length) with T = the longest response, as TRL's
documentation describes them (TRL's code returns them on the query + response positions).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from posttrain import advantages as adv
from posttrain import distributed as dist
from posttrain.critic import PolicyAndValue
from posttrain.losses import ppo_policy_loss, ppo_value_loss
from posttrain.ops import entropy_from_logits, masked_mean, masked_var
from posttrain.scoring import completion_forward, forward_logprobs
from posttrain.trainers import classic_io as io


def dist_of(values: torch.Tensor) -> np.ndarray:
    """A statistic's distribution as TRL logs it (a NumPy array)."""
    return values.detach().float().cpu().numpy()


class ClassicBuildingBlocks:
    """Mixed into trainers/ppo_classic.ClassicPPOTrainer (config, kl_ctl, tokenizer, accelerator,
    wrapped, optimizer, run come from there)."""

    def batched_forward_pass(
        self,
        model: nn.Module,
        queries: list[torch.Tensor],
        responses: list[torch.Tensor],
        model_inputs: dict | None = None,
        return_logits: bool = False,
        response_masks: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(logprobs (B, T), logits (B, T, V) or None, values (B, T), masks (B, T)) of the response tokens,
        config.mini_batch_size rows per forward, T = the longest response. `model`: the policy (values
        from its value head) or the reference LM (values 0). masks: 1 on response tokens (times
        response_masks). `model_inputs` (prepare_model_inputs' dict) must describe the same pairs."""
        if model_inputs is not None and len(model_inputs["input_ids"]) != len(queries):
            raise ValueError(f"model_inputs has {len(model_inputs['input_ids'])} rows for {len(queries)} queries.")
        rollout, loss_mask = io.step_rollout(
            queries, responses, response_masks, self.tokenizer, self.device, self.is_encoder_decoder
        )
        mask = rollout.completion_mask if loss_mask is None else loss_mask
        target = dist.unwrap(model, self.accelerator)
        target = target.policy if isinstance(target, PolicyAndValue) else target
        head = getattr(target, "score", None) if hasattr(target, "pretrained_model") else None
        lm = target.pretrained_model if head is not None else target
        fbs, T, parts = self.config.mini_batch_size or len(queries), rollout.completion_ids.size(1), []
        for s in range(0, len(rollout), fbs):
            # The (rows, T, V) logits are built only when the caller asked for them (return_logits);
            # otherwise the LM head runs block by block (scoring.completion_forward).
            out = completion_forward(
                lm, rollout.select(slice(s, s + fbs)), output_hidden_states=head is not None, full_logits=return_logits
            )
            logprobs = forward_logprobs(out)[0]
            values = out.pad(head(out.hidden).squeeze(-1).float()) if head is not None else torch.zeros_like(logprobs)
            logits = nn.functional.pad(out.logits, (0, 0, 0, T - out.logits.size(1))) if return_logits else None
            parts.append((logprobs, logits, values))
        cat = [torch.cat([p[i] for p in parts]) if parts[0][i] is not None else None for i in range(3)]
        return cat[0], cat[1], cat[2], mask.long()

    def compute_rewards(
        self, scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, masks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rewards, non_score_reward, kl), all (B, T) as TRL 0.11 returns them: kl_t the per-token
        penalty of `_kl_penalty` (0 off the mask), non_score_reward = −kl_coef·kl_t, rewards = that plus
        the score on the last response token (advantages.kl_shaped_rewards)."""
        mask = masks.bool()
        kl = self._kl_penalty(logprobs, ref_logprobs).float()
        kl = kl.masked_fill(~mask, 0.0)
        scores = torch.stack([torch.as_tensor(s, dtype=torch.float32).reshape(()) for s in scores])
        rewards, non_score = adv.kl_shaped_rewards(scores.to(kl.device), kl, mask, self.kl_ctl.value)
        return rewards, non_score, kl

    def _kl_penalty(self, logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
        """The per-token KL penalty of config.kl_penalty on log-probabilities: "kl" lp − ref, "abs"
        |lp − ref|, "mse" ½(lp − ref)², "k3"; "full" takes (..., V) log-probabilities and returns
        Σ_v p_v (log p_v − log p_ref,v) of shape (...) (advantages.kl_penalty / full_kl)."""
        estimator = self.config.resolved_kl_estimator()
        if estimator == "full" or logprob.dim() == 3:
            if logprob.dim() != 3:
                raise ValueError('kl_penalty="full" needs (batch, length, vocab) log-probabilities.')
            return adv.full_kl(logprob, ref_logprob)
        return adv.kl_penalty(logprob, ref_logprob, estimator)

    def compute_advantages(
        self, values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(values·mask, advantages, returns): GAE with config.gamma / lam (advantages.gae), advantages
        whitened over the mask (config.whiten_advantages, on as in TRL)."""
        m = mask.bool()
        values = values.float().masked_fill(~m, 0.0)
        advantages, returns = adv.gae(rewards, values, m, self.config.gamma, self.config.lam)
        if self.config.whiten_advantages:
            advantages = adv.whiten_advantages(advantages, m)
        return values, advantages.detach(), returns

    def loss(
        self,
        old_logprobs: torch.Tensor,
        values: torch.Tensor,
        logits: torch.Tensor,
        vpreds: torch.Tensor,
        logprobs: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor,
        returns: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(policy loss, vf_coef · value loss, stats): the clipped objectives of losses.ppo_policy_loss /
        ppo_value_loss as masked means; both 0 when the mean ratio exceeds config.ratio_threshold."""
        cfg, m = self.config, mask.bool()
        pg_loss, pg = ppo_policy_loss(logprobs, old_logprobs, advantages, m, cfg.cliprange)
        vf_loss, vf = ppo_value_loss(vpreds, values, returns, m, cfg.cliprange_value)
        if float(pg["ratio_mean"]) > cfg.ratio_threshold:
            warnings.warn(
                f"The average ratio of batch ({float(pg['ratio_mean']):.2f}) exceeds threshold "
                f"{cfg.ratio_threshold:.2f}. Skipping batch.",
                stacklevel=2,
            )
            pg_loss, vf_loss = pg_loss * 0.0, vf_loss * 0.0
        ratio = torch.exp((logprobs - old_logprobs).masked_fill(~m, 0.0)).detach()
        stats = {
            "loss/policy": pg_loss.detach(),
            "loss/value": vf_loss.detach(),
            "loss/total": (pg_loss + cfg.vf_coef * vf_loss).detach(),
            "policy/entropy": masked_mean(entropy_from_logits(logits.detach()), m),
            "policy/approxkl": pg["approxkl"],
            "policy/policykl": pg["policykl"],
            "policy/clipfrac": pg["clipfrac"],
            "policy/advantages": advantages.detach(),
            "policy/advantages_mean": masked_mean(advantages.detach(), m),
            "policy/ratio": ratio,
            "returns/mean": masked_mean(returns.detach(), m),
            "returns/var": masked_var(returns.detach(), m),
            "val/vpred": vf["vpred"],
            "val/error": vf["value_error"],
            "val/clipfrac": vf["vf_clipfrac"],
            "val/mean": masked_mean(values.detach(), m),
            "val/var": masked_var(values.detach(), m),
        }
        return pg_loss, cfg.vf_coef * vf_loss, stats

    def train_minibatch(
        self,
        old_logprobs: torch.Tensor,
        values: torch.Tensor,
        logprobs: torch.Tensor,
        logits: torch.Tensor,
        vpreds: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor,
        returns: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """One optimizer step on `loss(...)` (gradient clipped to config.max_grad_norm); its stats."""
        loss_p, loss_v, stats = self.loss(old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns)
        self.accelerator.backward(loss_p + loss_v)
        if self.config.max_grad_norm:
            self.accelerator.clip_grad_norm_(self.wrapped.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return stats

    def record_step_stats(self, kl_coef: float, **data: Any) -> dict[str, Any]:
        """TRL's step statistics from one batch's data: scores (B,), logprobs / ref_logprobs /
        non_score_reward / masks (B, T), queries / responses (lists), train_stats (stat -> a tensor
        stacked over minibatches, averaged here under "ppo/")."""
        mask = data["masks"].bool()
        scores = torch.as_tensor(data["scores"], dtype=torch.float32).reshape(-1)
        kl_list = ((data["logprobs"] - data["ref_logprobs"]) * mask).sum(-1)
        stats: dict[str, Any] = {
            "objective/kl": kl_list.mean(),
            "objective/kl_dist": kl_list,
            "objective/logprobs": data["logprobs"],
            "objective/ref_logprobs": data["ref_logprobs"],
            "objective/kl_coef": kl_coef,
            "objective/entropy": (-data["logprobs"] * mask).sum(-1).mean(),
            "ppo/mean_non_score_reward": masked_mean(data["non_score_reward"], mask),
            "ppo/mean_scores": scores.mean(),
            "ppo/std_scores": scores.std() if scores.numel() > 1 else torch.tensor(0.0),
        }
        for name in ("queries", "responses"):
            lengths = torch.tensor([len(x) for x in data[name]], dtype=torch.float)
            stats[f"tokens/{name}_len_mean"] = float(lengths.mean())
            stats[f"tokens/{name}_len_std"] = float(lengths.std()) if lengths.numel() > 1 else 0.0
            stats[f"tokens/{name}_dist"] = dist_of(lengths)
        for k, v in data.get("train_stats", {}).items():
            stats[f"ppo/{k}"] = torch.as_tensor(v).float().mean(0)
        if "ppo/val/error" in stats and "ppo/returns/var" in stats:
            stats["ppo/val/var_explained"] = 1 - stats["ppo/val/error"] / stats["ppo/returns/var"]
        return stats

    def gather_stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        """Average every tensor of `stats` over all processes (other values are kept as they are)."""
        world = self.run.world_size
        return {
            k: dist.reduce_sum(v.to(self.device), self.accelerator) / world if isinstance(v, torch.Tensor) else v
            for k, v in stats.items()
        }
