"""GRPO: group relative policy optimisation (Shao et al. 2024, "DeepSeekMath").

No value function: each prompt gets G completions and each completion's advantage is its score
relative to its group. One rollout batch, per rank, with P prompts and G = num_generations:

1. Rollout and score: the P prompts repeated as G blocks (row i·P + p is sample
   i of prompt p), s = Σ_j w_j·reward_j (reward_weights; reward model first, then reward_funcs),
   s −= missing_eos_penalty without a stop token. No KL in the reward.
2. Advantage, one per completion (advantages.group_advantages on the explicit (P, G) grid =
   s.view(G, P).T): A = (s − mean_group(s)) / (std_group(s) + 1e-4) with the unbiased std, or
   A = s − mean_group(s) when scale_rewards is False (Dr. GRPO). A group whose scores are all
   equal gets A = 0 (counted in frac_reward_zero_std).
3. Update: num_iterations passes × num_mini_batches minibatches, token-level ratio
   ρ_t = exp(log π_θ(y_t) − log π_old(y_t)) and per-token loss
   ℓ_t = max(−A·ρ_t, −A·clip(ρ_t, 1 − epsilon, 1 + epsilon_high)) + beta·KL3_t,
   KL3_t = exp(ref_t − lp_t) − (ref_t − lp_t) − 1 (k3, unbiased and ≥ 0, advantages.kl_penalty),
   L = Σ_t ℓ_t·m_t / N_tok with N_tok = loss tokens of the minibatch over all ranks: a token mean
   over the global token count (TRL's loss_type="dapo"), so micro-batching and data parallelism
   leave the update unchanged. m = completion_mask, minus truncated completions (no stop token)
   when mask_truncated_completions. π_old as in RLOO (exact ratio 1 on the first minibatch, the
   update forward's detached logprobs when num_iterations = num_mini_batches = 1).

Metrics (masked, count-weighted across micro-batches and ranks):
  objective/scores            mean score s (after missing_eos_penalty)
  objective/entropy           mean over sequences of Σ_t −log π(y_t) (sampled-token NLL of the rollout)
  objective/kl                mean over sequences of Σ_t k1 (log π − log π_ref on sampled tokens; with beta > 0)
  val/num_eos_tokens          completions that ended on a stop token (sum over ranks)
  completions/mean_length     mean completion length in tokens
  frac_reward_zero_std        fraction of groups whose scores are all equal (no learning signal)
  loss/policy_avg             token mean of the clipped surrogate term
  loss/kl_avg                 token mean of KL3 (the term beta multiplies; with beta > 0)
  policy/approxkl_avg         token mean of ½·(log ρ_t)²
  policy/clipfrac_avg         fraction of tokens whose clipped term was the max
  clip_ratio/low_mean, clip_ratio/high_mean  fraction of tokens with ρ < 1 − epsilon and A < 0 /
                              ρ > 1 + epsilon_high and A > 0 (TRL GRPO's clip_ratio/*)
  policy/entropy_avg          token-weighted entropy of the update forward
  val/ratio, val/ratio_var    mean and unbiased variance of the token ratio ρ_t over loss tokens
  lr, episode, eps, epoch
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from posttrain import advantages as adv
from posttrain.configs import ConfigError
from posttrain.losses import ppo_policy_loss
from posttrain.rollout import Rollout
from posttrain.scoring import RewardSource
from posttrain.trainers import online
from posttrain.trainers.grpo_config import GRPOConfig
from posttrain.trainers.online import (
    OnlineTrainer,
    default_config,
    load_parts,
    policy_update,
    prepare_policy,
    sample_and_score,
    score,
)


class GRPOTrainer(OnlineTrainer):
    """`GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset=None, processing_class,
    reward_processing_classes=None, callbacks=None, optimizers=(None, None))`, then `.train()`,
    with TRL GRPOTrainer's argument names.

    model: a causal LM, a hub id or a folder (None: args.sft_model_path). reward_funcs: a reward
    model (nn.Module or path), a text reward function `f(prompts, completions, **columns) -> list[float]`,
    or a list of them, weighted by args.reward_weights (None: args.reward_model_path /
    reward_funcs). A reward model path brings the tokenizer saved with it (completions are
    re-tokenized when it differs) unless reward_processing_classes is given. ref_model: the frozen
    reference (beta > 0); None copies the initial policy, or with `peft_config` (a peft.LoraConfig:
    only the adapter trains) uses the policy with its adapter disabled. `accelerator=` shares an
    existing Accelerator.
    """

    def __init__(
        self,
        model: nn.Module | str | None = None,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Sequence[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        *,
        ref_model: nn.Module | str | None = None,
        data_collator: Callable | None = None,
        accelerator: Any = None,
        peft_config: Any = None,
    ) -> None:
        if args is None:
            args = default_config(GRPOConfig, model, "GRPO")
        if not isinstance(args, GRPOConfig):
            raise ConfigError(f"args must be a GRPOConfig, got {type(args).__name__}.")
        if isinstance(reward_processing_classes, (list, tuple)):
            # One reward tokenizer is supported: the first one given for a reward model.
            reward_processing_classes = next((t for t in reward_processing_classes if t is not None), None)
        self.use_reference = args.beta > 0
        parts = load_parts(
            args,
            model=model,
            ref_model=ref_model,
            rewards=reward_funcs,
            processing_class=processing_class,
            reward_processing_class=reward_processing_classes,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            peft_config=peft_config,
            needs_reference=self.use_reference,
        )
        policy, self.ref_model = prepare_policy(
            parts.policy, parts.reference, args, peft_config=parts.peft_config, needs_reference=self.use_reference
        )
        self.wrapped = self.setup(
            args,
            parts.tokenizer,
            policy,
            train_dataset=parts.train_dataset,
            eval_dataset=parts.eval_dataset,
            data_collator=data_collator,
            optimizers=optimizers,
            callbacks=callbacks,
            accelerator=accelerator,
        )
        for r in parts.rewards:
            if isinstance(r, nn.Module):
                r.to(self.run.device).eval()
        self.reward = RewardSource(
            parts.rewards,
            policy_tokenizer=self.processing_class,
            reward_tokenizer=parts.reward_tokenizer,
            weights=args.reward_weights,
            batch_size=args.local_rollout_forward_batch_size,
            missing_eos_penalty=args.missing_eos_penalty,
        )

    @classmethod
    def from_config(cls, config: GRPOConfig) -> GRPOTrainer:
        return cls(args=config)

    def train(self) -> Any:
        """Run to total_episodes (resuming if asked); save the policy; return a transformers TrainOutput."""
        config, run, metrics, G = self.args, self.run, self.run.metrics, self.args.num_generations
        with self.training():
            for update in run.updates():
                # 1. rollout G completions per prompt (G blocks of P prompts) and score them
                exp = sample_and_score(
                    run,
                    self.wrapped,
                    self.ref_model,
                    self.reward,
                    run.next_batch(),
                    G,
                    with_reference=self.use_reference,
                )
                # 2. group-relative advantages on the explicit (num_prompts, G) grid
                grid = exp.scores.view(G, exp.num_prompts).T  # (P, G)
                advantages = adv.group_advantages(grid, scale_std=config.scale_rewards).T.reshape(-1)  # (B,) blocks
                metrics.add_mean("frac_reward_zero_std", (grid.max(dim=1).values == grid.min(dim=1).values).float())
                loss_mask = exp.rollout.completion_mask
                if config.mask_truncated_completions:
                    loss_mask = loss_mask & exp.rollout.ended[:, None]
                ref_logprobs = exp.ref_logprobs if config.beta > 0 else None

                # 3. token-level PPO-clip + beta·KL(π‖π_ref), token mean over the global token count
                def loss_fn(
                    rows: torch.Tensor,
                    mb: Rollout,
                    logprobs: torch.Tensor,
                    old_logprobs: torch.Tensor,
                    normalizer: float,
                ) -> torch.Tensor:
                    mask = loss_mask[rows]
                    loss, stats = ppo_policy_loss(
                        logprobs,
                        old_logprobs,
                        advantages[rows],
                        mask,
                        config.epsilon,
                        cliprange_high=config.epsilon_high,
                        level="token",
                        normalizer=normalizer,
                    )
                    n = stats["count"]
                    for name, key in (
                        ("loss/policy_avg", "pg_loss"),
                        ("policy/approxkl_avg", "approxkl"),
                        ("policy/clipfrac_avg", "clipfrac"),
                        ("clip_ratio/low_mean", "clipfrac_low"),
                        ("clip_ratio/high_mean", "clipfrac_high"),
                    ):
                        metrics.add(name, stats[key] * n, n)
                    if ref_logprobs is not None:
                        kl3 = adv.kl_penalty(logprobs, ref_logprobs[rows], "k3", mask)  # (b, T), 0 off-mask
                        loss = loss + config.beta * kl3.sum() / normalizer
                        metrics.add_mean("loss/kl_avg", kl3, mask)
                    with torch.no_grad():
                        ratio = (logprobs - old_logprobs).exp()
                        metrics.add_mean("val/ratio", ratio, mask)
                        metrics.add_var("val/ratio_var", ratio, mask)
                    return loss

                policy_update(
                    run,
                    self.wrapped,
                    self.optimizer,
                    exp.rollout,
                    num_epochs=config.num_iterations,
                    count=lambda rows: loss_mask[rows].sum(),
                    loss_fn=loss_fn,
                )
                self.end_of_update(update)
        return self.train_output

    def table_scores(self, rollout: Rollout, batch: dict) -> torch.Tensor:
        return score(self.run, self.reward, rollout, batch, 1)


def run(config: GRPOConfig) -> int:
    """`posttrain grpo`: policy, reference (beta > 0), rewards and prompts from the config; train."""
    return online.run(GRPOTrainer, config)
