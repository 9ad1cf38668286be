"""GRPO: group relative policy optimisation (Shao et al. 2024, "DeepSeekMath"), with TRL 1.16's loss family.

No value function: each prompt gets G = num_generations completions and each completion's advantage
is its reward relative to its group. One rollout batch of B = batch_size completions over all ranks:

1. Prompts: every rank draws the same P = B / G prompts; the B (prompt, sample) pairs, prompt-major
   (pair j = p·G + i), are cut into one contiguous slice per rank (TRL's RepeatSampler layout), so
   only B, not each rank's share, must divide by G and a group may span ranks. Within a rank the
   rows are ordered sample-major (blocks of the rank's prompts), as in RLOO.
2. Rollout and score: each rank samples its rows; reward r_f (reward model first, then
   reward_funcs; unweighted, `RewardSource.per_reward`), plus a column −missing_eos_penalty on
   completions without a stop token (weight 1). No KL in the reward.
3. Advantages (`grpo_losses.grpo_advantages`, on the GLOBAL (P, G, F) grid gathered from all ranks;
   each rank keeps its rows), ε = 1e-4, w = reward_weights:
     sum_then_normalize: r = Σ_f w_f·r_f, A = (r − mean_group r) / (std + ε) with std the group's
       (scale_rewards="group"), the whole batch's ("batch"), or no division ("none", Dr. GRPO);
     normalize_then_sum (GDPO): each r_f normalized in its group, weighted sum, then normalized over the batch.
4. Update: num_iterations passes × num_mini_batches minibatches (micro-batches of
   per_device_train_batch_size). With ρ per token (or per sequence, importance_sampling_level),
   ε_lo = epsilon, ε_hi = epsilon_high (default epsilon), per token:
     grpo, bnpo, dr_grpo, dapo, luspo: ℓ_t = −min(min(ρ, delta)·A, clip(ρ, 1 − ε_lo, 1 + ε_hi)·A)
     cispo: ℓ_t = −sg[min(ρ, ε_hi)]·A·log π_θ(y_t)
     sapo:  ℓ_t = −(4/τ)·σ(τ·(ρ − 1))·A, τ = sapo_temperature_pos if A > 0 else sapo_temperature_neg
     vespo: ℓ_t = −sg[φ(w)]·A·log π_θ(y_t), w = Π_t ρ_t the sequence ratio, φ(w) = e^λ·w^k·e^(−λw)
            with (k, λ) = vespo_k_pos / vespo_lambda_pos if A ≥ 0 else vespo_k_neg / vespo_lambda_neg
   times the top-entropy mask (top_entropy_quantile: the threshold is the quantile of the update
   forward's entropies over the loss tokens of the micro-batch on all ranks), plus
   beta·KL3_t (·ρ with use_bias_correction_kl), KL3 = e^(ref − lp) − (ref − lp) − 1. Aggregated over
   the loss tokens m (completion mask, minus truncated completions with mask_truncated_completions):
     grpo, sapo: mean over sequences of Σ_t ℓ·m / Σ_t m; bnpo: Σ ℓ·m / Σ m per micro-batch;
     dr_grpo: Σ ℓ·m / (b·max_completion_length); luspo: mean over sequences of Σ_t ℓ·m (GSPO's loss
     times the length)  — each divided by gradient_accumulation_steps;
     dapo, cispo, vespo: Σ ℓ·m / N_tok, N_tok the loss tokens of the minibatch over all ranks (so
     micro-batching and data parallelism leave the update unchanged).
   With entropy_coef (or use_adaptive_entropy) the loss minus coef·H, H the mean per-token entropy of
   the loss tokens (`grpo_losses.grpo_entropy_term`; coefficient from `grpo_losses.EntropyController`).
   π_old as in RLOO (exact ratio 1 on the first minibatch; the update forward's detached
   logprobs when num_iterations = num_mini_batches = 1). docs/internals.md ("GRPO loss family")
   gives each variant's source; posttrain.grpo_losses is the math, checked against TRL 1.16.

Metrics (masked, count-weighted across micro-batches and ranks):
  objective/scores            mean score Σ_f w_f·r_f − missing_eos_penalty
  reward, reward_std          mean and std of Σ_f w_f·r_f over the global batch (TRL's names)
  rewards/<name>/mean, rewards/<name>/std   each reward's own (unweighted) mean and std over the
                              global batch, rows where a reward function returned None left out
  objective/entropy           mean over sequences of Σ_t −log π(y_t) (sampled-token NLL of the rollout)
  objective/kl                mean over sequences of Σ_t k1 (log π − log π_ref on sampled tokens; with beta > 0)
  val/num_eos_tokens          completions that ended on a stop token (sum over ranks)
  completions/mean_length     mean completion length in tokens
  frac_reward_zero_std        fraction of completions whose normalizing std is 0 (no learning signal)
  loss/policy_avg             the minimised loss (KL term included), mean over optimizer steps
  kl, loss/kl_avg             token mean of the KL term beta multiplies (with beta > 0)
  clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean   (grpo, bnpo, dr_grpo, dapo, luspo)
                              fraction of loss tokens (sequences at sequence level) with
                              ρ < 1 − ε_lo and A < 0 / ρ > 1 + ε_hi and A > 0 / either
  cispo_clip_ratio            (cispo) fraction with ρ > ε_hi and A > 0
  vespo/phi_seq_mean          (vespo) mean gamma weight φ(w) over the completions
  policy/clipfrac_avg         = clip_ratio/region_mean (posttrain's name)
  policy/approxkl_avg         token mean of ½·(log π − log π_old)²
  policy/entropy_avg          token-weighted entropy of the update forward
  loss, entropy               TRL's names: = loss/policy_avg, and the entropy over the loss tokens
  policy_loss, entropy_coef   (with the entropy bonus) the loss without the bonus, and the coefficient
  off_policy_mask/dropped     (with off_policy_mask_threshold) fraction of completions dropped
  val/ratio, val/ratio_var    mean and unbiased variance of the token ratio over loss tokens
  lr, episode, eps, epoch
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from posttrain import distributed as dist
from posttrain.advantages import kl_penalty
from posttrain.configs import ConfigError
from posttrain.grpo_losses import (
    EntropyController,
    grpo_advantages,
    grpo_entropy_term,
    grpo_policy_loss,
    high_entropy_mask,
    off_policy_sequence_mask,
    truncation_loss_mask,
)
from posttrain.rollout import Rollout
from posttrain.scoring import (
    RewardSource,
    completion_forward,
    forward_logprobs,
    resolve_router_aux_loss_coef,
    router_aux_loss_enabled,
)
from posttrain.trainers import online
from posttrain.trainers.grpo_config import GRPOConfig
from posttrain.trainers.online import (
    OnlineTrainer,
    default_config,
    load_parts,
    prepare_policy,
    reference_logprobs,
    sample,
    score,
)

# Ratios logged with the weight `count/clip` (loss tokens, or completions for per-sequence values).
_CLIP_STATS = (
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "cispo_clip_ratio",
    "vespo/phi_seq_mean",
)


def rank_rows(num_prompts: int, num_generations: int, world_size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt index, sample index), each (L,), of rank `rank`'s L = P·G / world_size rows.

    The P·G pairs in prompt-major order (j = p·G + i) are cut into world_size contiguous slices
    (TRL's layout: a group may span ranks); a rank orders its slice sample-major, (i, p), which
    for whole groups is the k-block layout row = i·P_local + p_local of RLOO.
    """
    total = num_prompts * num_generations
    if total % world_size:
        raise ConfigError(f"{total} completions per rollout batch do not split evenly over {world_size} processes.")
    size = total // world_size
    j = torch.arange(rank * size, (rank + 1) * size)
    p, i = j // num_generations, j % num_generations
    order = torch.argsort(i * num_prompts + p)
    return p[order], i[order]


class GRPOTrainer(OnlineTrainer):
    """`GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset=None, processing_class,
    reward_processing_classes=None, callbacks=None, optimizers=(None, None))`, then `.train()`,
    with TRL GRPOTrainer's argument names.

    model: a causal LM, a hub id or a folder (None: args.sft_model_path). reward_funcs: a reward
    model (nn.Module or path), a text reward function `f(prompts, completions, **columns) -> list[float]`,
    or a list of them, weighted by args.reward_weights (None: args.reward_model_path /
    reward_funcs). reward_processing_classes: each reward model's tokenizer, a list aligned with
    reward_funcs (TRL's); a None entry, or no list, means the tokenizer saved with that reward model
    (completions are re-tokenized when it differs from the policy's). ref_model: the frozen
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
        if reward_processing_classes is not None and not isinstance(reward_processing_classes, (list, tuple)):
            reward_processing_classes = [reward_processing_classes]  # TRL: one tokenizer is a list of one
        online.check_reference_sync(args, peft_config)
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
            parts.policy,
            parts.reference,
            args,
            peft_config=parts.peft_config,
            needs_reference=self.use_reference,
            accelerator=accelerator,
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
            position_limits=parts.position_limits,
            accelerator=accelerator,
        )
        self.ref_model = dist.prepare_frozen(self.ref_model, self.accelerator)
        online.sync_reference(self)
        self.reward_processing_classes = parts.reward_processing_classes
        # a mixture-of-experts policy adds its router load-balancing loss (router_aux_loss_coef), as TRL 1.9
        resolve_router_aux_loss_coef(args, self.policy_model)  # None: the model config's own
        self.aux_loss_enabled = router_aux_loss_enabled(self.policy_model, args.router_aux_loss_coef)
        self.reward = RewardSource(
            [dist.prepare_frozen(r, self.accelerator) for r in parts.rewards],
            policy_tokenizer=self.processing_class,
            reward_tokenizer=parts.reward_tokenizers,
            weights=args.reward_weights,
            batch_size=args.local_rollout_forward_batch_size,
            missing_eos_penalty=args.missing_eos_penalty,
        )
        # TRL's GRPO passes reward functions a conversational prompt's messages and each completion as
        # [{"role": "assistant", "content": text}] (plain-text prompts: texts).
        self.reward.messages = True
        # Every rank draws the same global prompt batch and keeps its rows of the (prompt, sample)
        # pairs (`rank_rows`), so a group may span ranks. Same permutation and checkpoint state as
        # the per-rank stream it replaces.
        run = self.run
        run.prompts = run.prompt_stream(args.global_prompts_per_rollout, shuffle=args.shuffle_dataset)
        self.entropy_control = EntropyController(
            args.entropy_coef,
            adaptive=args.use_adaptive_entropy,
            target=args.entropy_target,
            delta=args.entropy_coef_delta,
            coef_min=args.entropy_coef_min,
            coef_max=args.entropy_coef_max,
        )
        world, rank = run.world_size, dist.process_index(run.accelerator)
        self.layout = [rank_rows(args.global_prompts_per_rollout, args.num_generations, world, r) for r in range(world)]
        self.prompt_index, self.sample_index = (t.to(run.device) for t in self.layout[rank])

    @classmethod
    def from_config(cls, config: GRPOConfig) -> GRPOTrainer:
        return cls(args=config)

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's method: True on the tokens of `mask` whose entropy is at least the `threshold` quantile
        (1 − top_entropy_quantile) of the entropies of the masked tokens of every process."""
        pool = dist.gather_values(entropies[mask.bool()].float(), self.accelerator)
        return high_entropy_mask(entropies, mask, 1.0 - threshold, all_entropies=pool)

    @staticmethod
    def get_off_policy_mask(
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """TRL's method: the (B, 1) keep (1.0) / drop (0.0) mask of off_policy_mask_threshold
        (`grpo_losses.off_policy_sequence_mask`)."""
        return off_policy_sequence_mask(
            advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold
        )

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus coefficient now (TRL's attribute): entropy_coef, moved by adaptive control."""
        return self.entropy_control.coef

    def train(self) -> Any:
        """Run to total_episodes (resuming if asked); save the policy; return a transformers TrainOutput."""
        config, run = self.args, self.run
        with self.training():
            for update in run.updates():
                # 1-2. this rank's rows of the global batch, sampled and scored
                rollout, rewards = self.sample_and_score(run.next_batch())
                # 3. group-relative advantages on the global (P, G, F) grid
                advantages = self.advantages(rewards)
                online.log_completions_table(self, update, rollout, rewards, advantages)
                loss_mask = rollout.completion_mask
                if config.mask_truncated_completions:
                    loss_mask = truncation_loss_mask(loss_mask, rollout.ended)
                ref_logprobs = None
                if self.use_reference:
                    ref_logprobs = reference_logprobs(run, self.wrapped, self.ref_model, rollout)
                    kl = kl_penalty(rollout.logprobs, ref_logprobs, "k1", rollout.completion_mask)
                    run.metrics.add_mean("objective/kl", kl.sum(-1))
                # 4. the loss of config.loss_type, num_iterations × num_mini_batches optimizer steps
                self.update(rollout, advantages, loss_mask, ref_logprobs)
                self.end_of_update(update)
        return self.train_output

    @torch.no_grad()
    def sample_and_score(self, batch: dict) -> tuple[Rollout, torch.Tensor]:
        """This rank's completions of the global prompt batch and their rewards, (L, F) unweighted
        (+ the missing-EOS column); logs the rollout metrics."""
        run, rows = self.run, self.prompt_index
        ids, mask = batch["input_ids"][rows], batch["attention_mask"][rows]
        first = int(mask.any(0).nonzero()[0])  # drop the left padding no row of this rank needs
        rollout = sample(run, self.wrapped, ids[:, first:], mask[:, first:], return_logprobs=True)
        n = len(rollout)
        prompts, completions, columns = [""] * n, [""] * n, {}
        if self.reward.needs_texts:
            prompts, completions, columns = online.rows_texts(run, batch, rollout, rows.tolist(), messages=True)
        with run.autocast():
            rewards = self.reward.per_reward(rollout, prompts, completions, columns)
        self.reward.check_finite(rewards)  # NaN only where a reward function returned None
        penalty = self.args.missing_eos_penalty
        if penalty is not None:
            missing = -penalty * (~rollout.ended.to(rewards.device, torch.bool)).to(rewards.dtype)
            rewards = torch.cat([rewards, missing[:, None]], dim=1)
        m, completion_mask = run.metrics, rollout.completion_mask
        online.log_reward_metrics(run, self.reward, rewards, total=False)  # reward / reward_std: `advantages`
        m.add_mean("objective/scores", (rewards * self.reward_weights(rewards)).nansum(-1))
        m.add_mean("objective/entropy", -(rollout.logprobs * completion_mask).sum(-1))
        m.add_sum("val/num_eos_tokens", rollout.ended.sum())
        m.add_mean("completions/mean_length", rollout.completion_lengths.float())
        return rollout, rewards

    def reward_weights(self, rewards: torch.Tensor) -> torch.Tensor:
        """The weight of each column of `rewards`: reward_weights, then 1 for the missing-EOS column."""
        weights = list(self.reward.weights) + [1.0] * (rewards.size(1) - len(self.reward.weights))
        return torch.tensor(weights, dtype=rewards.dtype, device=rewards.device)

    @torch.no_grad()
    def eval_loss(self, batch: dict, generator: torch.Generator) -> torch.Tensor:
        """TRL's eval_loss: step 4's loss (without the entropy bonus and the MoE router loss) on
        num_generations completions of each prompt of `batch`, sampled with `generator` and scored
        and advantaged as in training, at the policy that sampled them (ratio 1)."""
        config, run = self.args, self.run
        group = config.num_generations
        rows = torch.arange(batch["input_ids"].size(0), device=batch["input_ids"].device).repeat_interleave(group)
        ids, mask = batch["input_ids"][rows], batch["attention_mask"][rows]
        rollout = sample(run, self.wrapped, ids, mask, generator=generator, return_logprobs=True)
        prompts, completions, columns = [""] * len(rollout), [""] * len(rollout), {}
        if self.reward.needs_texts:
            prompts, completions, columns = online.rows_texts(run, batch, rollout, rows.tolist(), messages=True)
        with run.autocast():
            rewards = self.reward.per_reward(rollout, prompts, completions, columns)
        self.reward.check_finite(rewards)
        if config.missing_eos_penalty is not None:
            missing = -config.missing_eos_penalty * (~rollout.ended.to(rewards.device, torch.bool)).to(rewards.dtype)
            rewards = torch.cat([rewards, missing[:, None]], dim=1)
        advantages, _ = grpo_advantages(
            rewards.view(-1, group, rewards.size(1)),
            reward_weights=self.reward_weights(rewards),
            scale_rewards=config.scale_rewards,
            multi_objective_aggregation=config.multi_objective_aggregation,
        )
        loss_mask = rollout.completion_mask
        if config.mask_truncated_completions:
            loss_mask = truncation_loss_mask(loss_mask, rollout.ended)
        ref_logprobs = reference_logprobs(run, self.wrapped, self.ref_model, rollout) if self.use_reference else None
        logprobs = rollout.logprobs
        loss, _ = grpo_policy_loss(
            logprobs, logprobs, advantages.reshape(-1), loss_mask, ref_logprobs=ref_logprobs, **self.loss_options()
        )
        return loss

    def loss_options(self) -> dict[str, Any]:
        """The keywords of `grpo_policy_loss` that come from the config: the loss variant and its constants."""
        config = self.args
        return dict(
            loss_type=config.loss_type,
            importance_sampling_level=config.importance_sampling_level,
            epsilon=config.epsilon,
            epsilon_high=config.epsilon_high,
            delta=config.delta,
            sapo_temperature_pos=config.sapo_temperature_pos,
            sapo_temperature_neg=config.sapo_temperature_neg,
            vespo_k_pos=config.vespo_k_pos,
            vespo_lambda_pos=config.vespo_lambda_pos,
            vespo_k_neg=config.vespo_k_neg,
            vespo_lambda_neg=config.vespo_lambda_neg,
            beta=config.beta,
            use_bias_correction_kl=config.use_bias_correction_kl,
            max_completion_length=config.response_length,
        )

    @torch.no_grad()
    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Advantages (L,) of this rank's rows, from the rewards of ALL ranks on the (P, G, F) grid."""
        config, run = self.args, self.run
        everyone = dist.gather(rewards, run.accelerator)  # (B, F), rank order
        p = torch.cat([pi for pi, _ in self.layout]).to(everyone.device)
        i = torch.cat([si for _, si in self.layout]).to(everyone.device)
        grid = everyone.new_zeros(config.global_prompts_per_rollout, config.num_generations, everyone.size(1))
        grid[p, i] = everyone
        advantages, stats = grpo_advantages(
            grid,
            reward_weights=self.reward_weights(rewards),
            scale_rewards=config.scale_rewards,
            multi_objective_aggregation=config.multi_objective_aggregation,
        )
        # Global values: every rank adds the same number, so the mean over ranks is that number.
        for name in ("frac_reward_zero_std", "reward", "reward_std"):
            run.metrics.add(name, stats[name], 1)
        return advantages[self.prompt_index, self.sample_index]

    def update(
        self,
        rollout: Rollout,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
    ) -> None:
        """num_iterations × num_mini_batches optimizer steps (the loop of `online.policy_update`, with
        the update forward's entropies passed to the loss for top_entropy_quantile)."""
        config, run, acc, metrics = self.args, self.run, self.run.accelerator, self.run.metrics
        policy, temperature = self.wrapped, run.sampling.logprob_temperature
        orders = online.shuffled_orders(run, len(rollout), config.num_iterations)
        if config.loss_type != "bnpo" and config.top_entropy_quantile == 1.0 and not self.aux_loss_enabled:
            # Every other aggregation sums over the minibatch's rows (token or sequence terms over a
            # normalizer, or means over its equal micro-batches), so it is the same whichever rows share a
            # micro-batch: a prompt's completions go into the same ones, where they can be packed. (bnpo's
            # token mean, top_entropy_quantile's threshold and a router aux loss are per micro-batch.)
            orders = online.prompt_grouped(
                orders, rollout, config.local_mini_batch_size, config.per_device_train_batch_size
            )
        policy.train()
        old_logprobs = None
        if not (config.num_iterations == 1 and config.num_mini_batches == 1):
            old_logprobs = online.old_policy_logprobs(run, dist.unwrap(policy, acc), rollout, orders[0], temperature)
        control = self.entropy_control
        window: list[torch.Tensor] = []  # (Σ H·m, Σ m) of each micro-batch of the optimizer step (adaptive control)

        def micro_loss(rows: torch.Tensor, normalizer: float, accumulation: int) -> torch.Tensor:
            mb = rollout.select(rows)
            with run.autocast():
                forward = completion_forward(policy, mb, router_aux=self.aux_loss_enabled)
                logprobs, entropy = forward_logprobs(
                    forward, temperature=temperature, with_entropy=True, entropy_grad=control.enabled
                )
            old = logprobs.detach() if old_logprobs is None else old_logprobs[rows]
            mask = loss_mask[rows]
            metrics.add_mean("policy/entropy_avg", entropy, mb.completion_mask)
            metrics.add_mean("entropy", entropy, mask)  # TRL's name: over the loss tokens
            entropy_mask = None
            if config.top_entropy_quantile < 1.0:
                detached = entropy.detach().float()
                pool = dist.gather_values(detached[mask], acc)  # the loss tokens of every rank
                entropy_mask = high_entropy_mask(detached, mask, config.top_entropy_quantile, all_entropies=pool)
            off_policy = None
            if config.off_policy_mask_threshold is not None:
                # TRL 1.9 without an inference engine: π_old stands for the sampling policy
                off_policy = off_policy_sequence_mask(
                    advantages[rows], logprobs, old, mask, config.off_policy_mask_threshold
                )
                metrics.add("off_policy_mask/dropped", (1 - off_policy).sum(), off_policy.numel())
            loss, stats = grpo_policy_loss(
                logprobs,
                old,
                advantages[rows],
                mask,
                ref_logprobs=ref_logprobs[rows] if ref_logprobs is not None else None,
                entropy_mask=entropy_mask,
                off_policy_mask=off_policy,
                normalizer=normalizer,
                accumulation_steps=accumulation,
                **self.loss_options(),
            )
            if control.enabled:
                # the bonus acts on the tokens the policy term trains (the top-entropy ones, if selected)
                bonus_mask = mask.bool() if entropy_mask is None else mask.bool() & entropy_mask
                term = grpo_entropy_term(
                    entropy,
                    bonus_mask,
                    loss_type=config.loss_type,
                    normalizer=normalizer,
                    accumulation_steps=accumulation,
                )
                metrics.add("policy_loss", loss.detach().float(), 1.0 / accumulation)  # TRL's: before the bonus
                loss = loss - control.applied() * term
                detached = entropy.detach().float() * bonus_mask
                window.append(torch.stack([detached.sum(), bonus_mask.sum().float()]))
            loss = online.add_router_aux_loss(run, loss, forward, config.router_aux_loss_coef, accumulation)
            # Each micro-batch adds 1/accumulation: per rank and minibatch the sum is the step's loss.
            for name in ("loss/policy_avg", "loss"):
                metrics.add(name, loss.detach().float(), 1.0 / accumulation)
            for name in _CLIP_STATS:
                if name in stats:
                    metrics.add(name, stats[name] * stats["count/clip"], stats["count/clip"])
            if "clip_ratio/region_mean" in stats:
                metrics.add(
                    "policy/clipfrac_avg", stats["clip_ratio/region_mean"] * stats["count/clip"], stats["count/clip"]
                )
            if "kl" in stats:
                for name in ("kl", "loss/kl_avg"):
                    metrics.add(name, stats["kl"] * stats["count"], stats["count"])
            with torch.no_grad():
                log_ratio = logprobs.detach() - old
                metrics.add_mean("policy/approxkl_avg", 0.5 * log_ratio**2, mask)
                metrics.add_mean("val/ratio", log_ratio.exp(), mask)
                metrics.add_var("val/ratio_var", log_ratio.exp(), mask)
            return loss

        for order in orders:
            for start in range(0, len(rollout), config.local_mini_batch_size):
                rows = order[start : start + config.local_mini_batch_size]
                normalizer = online.global_normalizer(loss_mask[rows].sum(), acc)
                micros = list(online.micro_batches(rows, config.per_device_train_batch_size))
                window.clear()
                online.minibatch_step(
                    run, policy, self.optimizer, micros, lambda r, n=normalizer, a=len(micros): micro_loss(r, n, a)
                )
                if control.enabled:
                    if control.adaptive:
                        # the step's mean per-token entropy over the bonus tokens of every rank
                        total = dist.reduce_sum(torch.stack(window).sum(0), acc)
                        control.update(float(total[0] / total[1].clamp(min=1.0)))
                    metrics.add("entropy_coef", control.coef, 1)

    def extra_state(self) -> dict:
        """The adaptive entropy controller (its coefficient and last measured entropy), for resume."""
        return {"entropy_control": self.entropy_control.state_dict()} if self.args.use_adaptive_entropy else {}

    def load_extra_state(self, state: dict) -> None:
        if "entropy_control" in state:
            self.entropy_control.load_state_dict(state["entropy_control"])

    def checkpoint_models(self) -> dict[str, nn.Module]:
        """The policy, and with sync_ref_model the reference it moves (a resume must restore both)."""
        if self.args.sync_ref_model:
            return {"policy": self.policy_model, "ref_model": self.ref_model}
        return {"policy": self.policy_model}

    def table_scores(self, rollout: Rollout, batch: dict) -> torch.Tensor:
        return score(self.run, self.reward, rollout, batch, 1)


def main(config: GRPOConfig) -> int:
    """`posttrain grpo`: policy, reference (beta > 0), rewards and prompts from the config; train."""
    return online.run_command(GRPOTrainer, config)
