"""REINFORCE leave-one-out (RLOO), as TRL's on-policy `RLOOTrainer` (seed docs 000/001, trl-notes §4.1).

No value function: each prompt gets rloo_k completions, and each completion is baselined by the
mean reward of the other k − 1 (Ahmadian et al. 2024, "Back to Basics"). A whole completion is
one action. REINFORCE / A2C is the special case num_ppo_epochs = 1, num_mini_batches = 1.

One rollout batch (`update`), per rank, with P = prompts_per_rollout prompts and k = rloo_k:

1. Rollout. The P prompts are repeated k times as blocks (TRL's `queries.repeat(rloo_k, 1)`), so
   row i·P + p is sample i of prompt p. Completions stop at EOS / stop_token_id (kept); masks come
   from lengths (rollout.py).
2. Score. s = reward model score at the last real token and/or Σ_f w_f·f(prompt, completion);
   s −= missing_eos_penalty where no stop token was produced (common.RewardSource).
   normalize_reward: s ← clip((s − mean)/(std + 1e-8), ±reward_clip_range) over the global batch.
3. KL-shaped reward, one number per sequence. kl_t = log π(y_t) − log π_ref(y_t) (k1 on the
   sampled tokens: generation-time logprobs and reference logprobs at the sampling temperature,
   0 on padding). Sequence level (default): non_score_reward = −kl_coef·Σ_t kl_t,
   rlhf_reward = s + non_score_reward. token_level_kl: r_t = −kl_coef·kl_t + s·[t = last token],
   rlhf_reward = Σ_t r_t (equal to the sequence form with a masked KL; advantages.py).
   whiten_rewards: rlhf_reward ← rlhf_reward / std (mean kept) over the global batch.
4. Advantage. R = rlhf_reward.view(k, P) (rows = sample index, columns = prompt);
   A = R − (Σ_j R_j − R)/(k − 1)  (advantages.rloo_advantages). normalize_advantage:
   A ← (A − mean)/(std + 1e-8) over the global batch.
5. Update. num_ppo_epochs passes; each pass shuffles the batch into num_mini_batches minibatches
   (one optimizer step each) of per_device_train_batch_size × gradient_accumulation_steps rows:
   ρ = exp(Σ_t log π_θ(y_t) − Σ_t log π_old(y_t)),
   L = Σ_seq max(−A·ρ, −A·clip(ρ, 1 ± cliprange)) / N_seq, N_seq = sequences in the minibatch over
   all ranks (losses.ppo_policy_loss, level="sequence"). log π_old comes from a no-grad pass in the
   same mode and micro-batches as the first minibatch of the first epoch, so ρ = 1 exactly there;
   with one epoch and one minibatch it is the update forward's own detached value (no extra pass),
   and ∇L = −Σ A·∇log π_θ / N: REINFORCE with the leave-one-out baseline.
   The learning-rate schedule steps once per rollout batch over num_total_batches (as TRL).

Metrics (masked, count-weighted across micro-batches and ranks; names as TRL's):
  objective/scores            mean s (after missing_eos_penalty, before normalize_reward)
  objective/kl                mean over sequences of Σ_t kl_t
  objective/entropy           mean over sequences of Σ_t −log π(y_t) (sampled-token NLL of the
                              rollout, ≥ 0; TRL counted padding as INVALID_LOGPROB = 1 and could go
                              negative, huggingface/trl#2281)
  objective/non_score_reward  mean of −kl_coef·Σ_t kl_t
  objective/rlhf_reward       mean rlhf_reward = s + non_score_reward (the seed docs write
                              "score − non_score_reward"; TRL's code, and this one, add the negative term)
  policy/approxkl_avg         mean over updated sequences of ½·(log ρ)²
  policy/clipfrac_avg         fraction of updated sequences whose clipped term was the max
  loss/policy_avg             mean per-sequence clipped loss
  policy/entropy_avg          token-weighted mean entropy −Σ_v π log π of the update forward
  val/ratio, val/ratio_var    mean and unbiased variance of the sequence ratio ρ that is clipped
                              (TRL reports the token ratio)
  val/clipfrac_avg            0: RLOO has no value function (TRL logs the same constant)
  val/num_eos_tokens          completions that ended on a stop token (sum over ranks)
  completions/mean_length, lr, episode, eps, epoch

The steps that GRPO shares (rollout + scoring, the epochs × minibatches update loop, logging,
sample tables, checkpoints, loading from a config) are the functions in the second half of this
file; grpo.py imports them and differs only in its advantage and loss.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posttrain import advantages as adv
from posttrain import checkpoint as ckpt
from posttrain import distributed as dist
from posttrain.configs import ConfigError, OnPolicyConfig
from posttrain.health import oom_advice
from posttrain.losses import ppo_policy_loss
from posttrain.rollout import Rollout, decode_completions, generate, generation_mode
from posttrain.scoring import batched_completion_logprobs, completion_logprobs
from posttrain.trainers.common import (
    OnlineRun,
    RewardSource,
    build_optimizer,
    build_scheduler,
    check_finite,
    clip_and_step,
    global_normalizer,
    import_callable,
    load_split,
    micro_batches,
    no_sync_unless_last,
    reference_policy,
)
from posttrain.trainers.rloo_config import RLOOConfig


class RLOOTrainer:
    """TRL's on-policy RLOO trainer: `RLOOTrainer(config, processing_class, policy, ref_policy,
    reward_model, train_dataset, data_collator=None, eval_dataset=None, optimizers=(None, None),
    callbacks=None)`, then `.train()`.

    reward_model: a sequence-classification reward model (nn.Module), a text reward function
    `f(prompts, completions, **columns) -> list[float]`, TRL's one-argument form `f(texts) -> list[float]`
    (texts = prompt + completion, special tokens skipped; trl#2612), or a list of them (summed). ref_policy:
    the frozen reference; None with kl_coef > 0 uses a frozen copy of the initial policy, or with
    `peft_config` (a peft.LoraConfig: only the adapter trains) the policy with its adapter disabled.
    `tokenizer=` is accepted for `processing_class` (TRL ≤ 0.11), `reward_processing_class=` when the
    reward model has its own tokenizer (texts are re-tokenized), `accelerator=` to share one.
    Callbacks: objects with `on_log(config, state, control, logs=...)` and/or
    `on_train_end(config, state, control)` (the transformers TrainerCallback method names).
    """

    def __init__(
        self,
        config: RLOOConfig,
        processing_class: Any = None,
        policy: nn.Module | None = None,
        ref_policy: nn.Module | None = None,
        reward_model: Any = None,
        train_dataset: Any = None,
        data_collator: Callable | None = None,
        eval_dataset: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        callbacks: Sequence[Any] | None = None,
        *,
        tokenizer: Any = None,
        reward_processing_class: Any = None,
        accelerator: Any = None,
        peft_config: Any = None,
    ) -> None:
        if not isinstance(config, RLOOConfig):
            raise ConfigError(f"config must be an RLOOConfig, got {type(config).__name__}.")
        self.config = config
        if isinstance(reward_model, (list, tuple)):
            reward_model = [full_text_reward(r) for r in reward_model]
        elif reward_model is not None:
            reward_model = full_text_reward(reward_model)
        self.setup = TrainerSetup.create(
            config,
            processing_class if processing_class is not None else tokenizer,
            policy,
            ref_policy,
            reward_model,
            train_dataset,
            eval_dataset,
            data_collator=data_collator,
            optimizers=optimizers,
            callbacks=callbacks,
            reward_processing_class=reward_processing_class,
            accelerator=accelerator,
            needs_reference=config.kl_coef > 0,
            peft_config=peft_config,
        )
        self.log_history: list[dict[str, float]] = self.setup.log_history

    @property
    def policy(self) -> nn.Module:
        return dist.unwrap(self.setup.policy, self.setup.run.accelerator)

    def train(self) -> dict[str, float]:
        """Run to total_episodes (resuming if asked); save the policy; return the last logged metrics."""
        s, config = self.setup, self.config
        run, metrics, k = s.run, s.run.metrics, config.rloo_k
        with ckpt.OutputDirGuard(config.output_dir, is_main=run.is_main), oom_advice():
            s.resume()
            for update in run.updates():
                # 1-2. rollout k completions per prompt (seed layout: k blocks of P prompts) and score them
                exp = sample_and_score(
                    run, s.policy, s.ref_policy, s.reward, run.next_batch(), k, adapter_reference=s.adapter_reference
                )
                mask = exp.rollout.completion_mask
                scores = exp.scores
                if config.normalize_reward:
                    scores = batch_wide(run, scores, lambda x: adv.normalize_rewards(x, config.reward_clip_range))
                # 3. KL-shaped reward, one number per sequence
                kl = exp.kl if exp.kl is not None else torch.zeros_like(exp.rollout.logprobs)
                shape = adv.token_level_kl_rewards if config.token_level_kl else adv.sequence_kl_rewards
                rlhf_reward, non_score_reward = shape(scores, kl, mask, config.kl_coef)  # (B,), (B,)
                metrics.add_mean("objective/non_score_reward", non_score_reward)
                metrics.add_mean("objective/rlhf_reward", rlhf_reward)
                if config.whiten_rewards:
                    rlhf_reward = batch_wide(
                        run, rlhf_reward, lambda r: adv.whiten_rewards(r, torch.ones_like(r, dtype=torch.bool))
                    )
                # 4. leave-one-out baseline over the explicit (k, num_prompts) grid
                advantages = adv.rloo_advantages(rlhf_reward.view(k, exp.num_prompts)).flatten()  # (B,)
                if config.normalize_advantage:
                    advantages = batch_wide(run, advantages, adv.normalize_advantages)

                # 5. sequence-level PPO-clip updates
                def loss_fn(
                    rows: torch.Tensor,
                    mb: Rollout,
                    logprobs: torch.Tensor,
                    old_logprobs: torch.Tensor,
                    normalizer: float,
                ) -> torch.Tensor:
                    loss, stats = ppo_policy_loss(
                        logprobs,
                        old_logprobs,
                        advantages[rows],
                        mb.completion_mask,
                        config.cliprange,
                        level="sequence",
                        normalizer=normalizer,
                    )
                    n = stats["count"]
                    metrics.add("loss/policy_avg", stats["pg_loss"] * n, n)
                    metrics.add("policy/approxkl_avg", stats["approxkl"] * n, n)
                    metrics.add("policy/clipfrac_avg", stats["clipfrac"] * n, n)
                    with torch.no_grad():
                        log_ratio = ((logprobs - old_logprobs) * mb.completion_mask).sum(-1)
                        metrics.add_mean("val/ratio", log_ratio.exp())
                        metrics.add_var("val/ratio_var", log_ratio.exp())
                    return loss

                policy_update(
                    run,
                    s.policy,
                    s.optimizer,
                    exp.rollout,
                    num_epochs=config.num_ppo_epochs,
                    count=lambda rows: rows.numel(),
                    loss_fn=loss_fn,
                )
                s.end_of_update(update, extra={"val/clipfrac_avg": 0.0})
            s.finish()
        return self.log_history[-1] if self.log_history else {}

    def save_model(self, output_dir: str | None = None) -> None:
        """Save the policy (safetensors) and tokenizer where plain transformers can load them."""
        self.setup.save_model(output_dir)


def full_text_reward(reward: Any) -> Any:
    """Adapt TRL RLOO's one-argument reward callable `f(texts)` (texts = decoded query + response) to the
    `f(prompts, completions, **columns)` protocol; models and two-argument functions pass unchanged."""
    if isinstance(reward, nn.Module) or not callable(reward):
        return reward
    try:
        params = list(inspect.signature(reward).parameters.values())
    except (TypeError, ValueError):
        return reward
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    variadic = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)
    if len(positional) != 1 or variadic:
        return reward

    @functools.wraps(reward)
    def on_full_texts(prompts: list[str], completions: list[str], **columns: Any) -> Any:
        return reward([p + c for p, c in zip(prompts, completions)])

    return on_full_texts


def run(config: RLOOConfig) -> int:
    """`posttrain rloo`: load tokenizer, policy, reference, reward and prompts from the config; train."""
    return run_from_config(
        "rloo",
        config,
        lambda parts: RLOOTrainer(
            config,
            parts.tokenizer,
            parts.policy,
            parts.reference,
            parts.rewards,
            parts.train_dataset,
            eval_dataset=parts.eval_dataset,
            reward_processing_class=parts.reward_tokenizer,
            accelerator=parts.accelerator,
            peft_config=parts.peft_config,
        ),
        needs_reference=True,
    )


# =============================================================================================
# Steps shared with grpo.py: rollout + scoring, the update loop, logging / samples / checkpoints
# =============================================================================================


@dataclass
class Experience:
    """One rollout batch on this rank in the seed's layout: row = sample_index · num_prompts + prompt_index."""

    rollout: Rollout
    scores: torch.Tensor  # (B,) float32, after missing_eos_penalty
    ref_logprobs: torch.Tensor | None  # (B, T), None without a reference model
    kl: torch.Tensor | None  # (B, T) k1 = rollout logprobs − ref_logprobs, 0 off-mask
    num_prompts: int
    k: int


@torch.no_grad()
def sample_and_score(
    run: OnlineRun,
    policy: nn.Module,
    ref_policy: nn.Module | None,
    reward: RewardSource,
    batch: dict,
    k: int,
    *,
    adapter_reference: bool = False,
) -> Experience:
    """Generate k completions per prompt, score them, and take the reference logprobs (from
    ref_policy, or with `adapter_reference` from the PEFT policy with its adapter disabled).

    Prompts are repeated as k blocks (TRL's `queries.repeat(rloo_k, 1)`), so `scores.view(k, P)` is
    the (sample, prompt) grid. Logs objective/scores, objective/entropy, objective/kl,
    val/num_eos_tokens and completions/mean_length.
    """
    config, tokenizer = run.config, run.tokenizer
    num_prompts = batch["input_ids"].size(0)
    prompt_ids = batch["input_ids"].repeat(k, 1)  # (k·P, L)
    prompt_mask = batch["attention_mask"].repeat(k, 1)
    with (
        dist.unwrap_for_generation(policy, run.accelerator, config.ds3_gather_for_generation) as model,
        generation_mode(model),
        run.autocast(),
    ):
        rollout = generate(
            model,
            prompt_ids,
            prompt_mask,
            run.sampling,
            pad_token_id=tokenizer.pad_token_id,
            batch_size=config.local_rollout_forward_batch_size,
            generator=run.generator,
        )
    scores = score(run, reward, rollout, batch, k)
    mask = rollout.completion_mask
    ref_logprobs = kl = None
    if ref_policy is not None or adapter_reference:
        with reference_policy(policy, ref_policy, run.accelerator) as ref, run.autocast():
            ref_logprobs, _ = batched_completion_logprobs(
                ref,
                rollout,
                batch_size=config.local_rollout_forward_batch_size,
                temperature=run.sampling.logprob_temperature,
            )
        kl = adv.kl_penalty(rollout.logprobs, ref_logprobs, "k1", mask)
        run.metrics.add_mean("objective/kl", kl.sum(-1))
    m = run.metrics
    m.add_mean("objective/scores", scores)
    m.add_mean("objective/entropy", -(rollout.logprobs * mask).sum(-1))
    m.add_sum("val/num_eos_tokens", rollout.ended.sum())
    m.add_mean("completions/mean_length", rollout.completion_lengths.float())
    return Experience(rollout, scores, ref_logprobs, kl, num_prompts, k)


def score(run: OnlineRun, reward: RewardSource, rollout: Rollout, batch: dict, k: int) -> torch.Tensor:
    """Scores (B,) of a rollout whose prompts are `batch` repeated as k blocks; texts decoded only
    for reward functions.
    """
    n = len(rollout)
    prompts, completions, columns = [""] * n, [""] * n, {}
    if reward.funcs:
        prompts = list(batch["prompt"]) * k
        completions = decode_completions(run.tokenizer, rollout)
        columns = {key: list(v) * k for key, v in batch.items() if key not in ("input_ids", "attention_mask", "prompt")}
    with run.autocast():
        scores = reward(rollout, prompts, completions, columns)
    check_finite("reward scores", scores)
    return scores


def batch_wide(run: OnlineRun, values: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Apply `fn` to the values of the whole rollout batch (all ranks, rank order) and return this rank's part,
    so batch statistics (means, stds) do not depend on the number of processes."""
    everything = dist.gather(values.contiguous(), run.accelerator)
    rank = dist.process_index(run.accelerator)
    return fn(everything).view(run.world_size, -1)[rank]


LossFn = Callable[[torch.Tensor, Rollout, torch.Tensor, torch.Tensor, float], torch.Tensor]


def policy_update(
    run: OnlineRun,
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    rollout: Rollout,
    *,
    num_epochs: int,
    count: Callable[[torch.Tensor], Any],
    loss_fn: LossFn,
) -> None:
    """num_epochs × num_mini_batches optimizer steps over one rollout batch (PPO's inner loops).

    Each epoch draws a permutation of the rows; each minibatch (local_mini_batch_size rows) is split
    into micro-batches of per_device_train_batch_size whose losses are divided by the minibatch's
    GLOBAL `count` (sequences or tokens, common.global_normalizer), gradients synchronised on the last
    micro-batch only. `loss_fn(rows, micro_rollout, logprobs, old_logprobs, normalizer)` returns the
    micro-batch loss and logs its own metrics; this loop logs policy/entropy_avg.
    """
    config, acc = run.config, run.accelerator
    temperature = run.sampling.logprob_temperature
    n = len(rollout)
    orders = [
        torch.randperm(n, generator=run.generator, device=run.generator.device).to(run.device)
        for _ in range(num_epochs)
    ]
    reuse_update_forward = num_epochs == 1 and config.num_mini_batches == 1
    policy.train()
    old_logprobs = None
    if not reuse_update_forward:
        old_logprobs = old_policy_logprobs(run, dist.unwrap(policy, acc), rollout, orders[0], temperature)
    for order in orders:
        for start in range(0, n, config.local_mini_batch_size):
            rows = order[start : start + config.local_mini_batch_size]
            normalizer = global_normalizer(count(rows), acc)
            micro = list(micro_batches(rows, config.per_device_train_batch_size))
            total = torch.zeros((), device=run.device)
            for i, micro_rows in enumerate(micro):
                mb = rollout.select(micro_rows)
                with no_sync_unless_last(acc, policy, i == len(micro) - 1):
                    with run.autocast():
                        logprobs, entropy = completion_logprobs(policy, mb, temperature=temperature, with_entropy=True)
                    old = logprobs.detach() if old_logprobs is None else old_logprobs[micro_rows]
                    loss = loss_fn(micro_rows, mb, logprobs, old, normalizer)
                    acc.backward(loss)
                total = total + loss.detach().float()
                run.metrics.add_mean("policy/entropy_avg", entropy, mb.completion_mask)
            # A NaN/inf loss skips this optimizer step (its gradients are dropped) and is counted by
            # the health monitor; the loss is summed over ranks first so every rank decides the same.
            if run.loss_is_finite(dist.reduce_sum(total, acc)):
                clip_and_step(policy, optimizer, config, acc)
                run.state.optimizer_steps += 1
            else:
                optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def old_policy_logprobs(
    run: OnlineRun, policy: nn.Module, rollout: Rollout, first_order: torch.Tensor, temperature: float
) -> torch.Tensor:
    """log π_old per completion token (B, T), computed in the first epoch's micro-batches with the same
    function and mode as the update forward, so the first minibatch's ratio is exactly 1."""
    out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=rollout.completion_ids.device)
    for rows in micro_batches(first_order, run.config.per_device_train_batch_size):
        with run.autocast():
            logprobs, _ = completion_logprobs(policy, rollout.select(rows), temperature=temperature, with_entropy=True)
        out[rows] = logprobs.float()
    return out


@dataclass
class TrainerSetup:
    """The prepared pieces of an RLOO / GRPO run and the steps around the algorithm (resume, end of
    update, sample table, final save). Built once by `create`."""

    run: OnlineRun
    policy: nn.Module  # prepared (DDP-wrapped when distributed)
    ref_policy: nn.Module | None
    reward: RewardSource
    optimizer: Any
    scheduler: Any
    callbacks: list[Any]
    log_history: list[dict[str, float]]
    # True when the reference is the PEFT policy with its adapter disabled (ref_policy is then None).
    adapter_reference: bool = False

    @classmethod
    def create(
        cls,
        config: OnPolicyConfig,
        tokenizer: Any,
        policy: nn.Module | None,
        ref_policy: nn.Module | None,
        reward: Any,
        train_dataset: Any,
        eval_dataset: Any,
        *,
        data_collator: Callable | None,
        optimizers: tuple[Any, Any],
        callbacks: Sequence[Any] | None,
        reward_processing_class: Any,
        accelerator: Any,
        needs_reference: bool,
        reward_weights: Sequence[float] | None = None,
        peft_config: Any = None,
    ) -> TrainerSetup:
        from posttrain.models import apply_peft, disable_dropout, is_peft_model

        if tokenizer is None:
            raise ConfigError("processing_class (the policy's tokenizer) is required.")
        if policy is None:
            raise ConfigError("policy is required: pass the causal LM to train.")
        if ref_policy is not None and ref_policy is policy:
            raise ConfigError("ref_policy is the policy object itself; pass a separate copy (or None to copy it).")
        if reward is None or (isinstance(reward, (list, tuple)) and not reward):
            raise ConfigError(
                "no reward: pass reward_model (a reward model or reward functions), or on the command "
                "line --reward_model_path / --reward_funcs."
            )
        run = OnlineRun(config, tokenizer, train_dataset, eval_dataset, accelerator=accelerator)
        if data_collator is not None:
            run.collate = run.prompts.collate = data_collator
        # Wrapped before dropout is disabled below, so the LoRA dropout is switched off with the rest.
        policy = apply_peft(policy, peft_config)
        adapter_reference = needs_reference and ref_policy is None and is_peft_model(policy)
        if needs_reference and ref_policy is None and not adapter_reference:
            ref_policy = copy.deepcopy(policy)  # the initial policy, frozen
        if config.disable_dropout:
            for model in (policy, ref_policy):
                if model is not None:
                    disable_dropout(model)
        # Reference and reward models only run under no_grad, in eval mode.
        if ref_policy is not None:
            ref_policy = ref_policy.to(run.device).eval()
        rewards = list(reward) if isinstance(reward, (list, tuple)) else [reward]
        for r in rewards:
            if isinstance(r, nn.Module):
                r.to(run.device).eval()
        source = RewardSource(
            rewards,
            policy_tokenizer=tokenizer,
            reward_tokenizer=reward_processing_class,
            weights=reward_weights,
            batch_size=config.local_rollout_forward_batch_size,
            missing_eos_penalty=config.missing_eos_penalty,
        )
        optimizer, scheduler = optimizers
        if optimizer is None:
            optimizer = build_optimizer(policy.parameters(), config)
        if scheduler is None:
            # Stepped once per rollout batch, as TRL's on-policy trainers do.
            scheduler = build_scheduler(optimizer, config, num_training_steps=config.num_total_batches)
        policy, optimizer = run.accelerator.prepare(policy, optimizer)
        return cls(run, policy, ref_policy, source, optimizer, scheduler, list(callbacks or []), [], adapter_reference)

    def resume(self) -> None:
        self.run.maybe_resume({"policy": self.policy}, self.optimizer, self.scheduler)

    def end_of_update(self, update: int, extra: dict[str, float] | None = None) -> None:
        """Step the schedule; log, print the sample table and checkpoint when due."""
        run = self.run
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        if run.should_log(update):
            values = run.log(update, {"lr": lr, **(extra or {})})
            self.log_history.append(values)
            for callback in self.callbacks:
                if hasattr(callback, "on_log"):
                    callback.on_log(run.config, run.state, None, logs=values)
        if run.should_sample(update):
            self.sample_table(update)
        if run.should_save(update):
            run.save({"policy": self.policy}, self.optimizer, self.scheduler)

    @torch.no_grad()
    def sample_table(self, update: int) -> None:
        """The seed's (query, model response, score) table: greedy completions of the first
        per_device_eval_batch_size eval prompts (TRL samples at temperature 0.01), decoded with special
        tokens (EOS shown, padding not), scored like objective/scores (missing_eos_penalty included)."""
        run, config = self.run, self.run.config
        batch = run.eval_prompts(config.per_device_eval_batch_size)
        greedy = dataclasses.replace(run.sampling, temperature=0.0, do_sample=False)
        with (
            dist.unwrap_for_generation(self.policy, run.accelerator, config.ds3_gather_for_generation) as model,
            generation_mode(model),
            run.autocast(),
        ):
            rollout = generate(
                model,
                batch["input_ids"],
                batch["attention_mask"],
                greedy,
                pad_token_id=run.tokenizer.pad_token_id,
                batch_size=config.local_rollout_forward_batch_size,
                return_logprobs=False,
            )
        scores = score(run, self.reward, rollout, batch, 1)
        shown = decode_completions(run.tokenizer, rollout, skip_special_tokens=False)
        rows = [
            {"query": q, "model response": r, "score": float(s)}
            for q, r, s in zip(batch["prompt"], shown, scores.tolist())
        ]
        run.sample_table(update, rows)

    def save_model(self, output_dir: str | None = None) -> None:
        run = self.run
        target = output_dir or run.config.output_dir
        ckpt.save_final(
            target,
            dist.unwrap(self.policy, run.accelerator),
            tokenizer=run.tokenizer,
            config=run.config.to_dict(),
            accelerator=run.accelerator,
        )

    def finish(self) -> None:
        self.run.finish(self.policy)
        for callback in self.callbacks:
            if hasattr(callback, "on_train_end"):
                callback.on_train_end(self.run.config, self.run.state, None)


@dataclass
class LoadedParts:
    """What `run_from_config` loads for a trainer constructor."""

    tokenizer: Any
    policy: nn.Module
    reference: nn.Module | None
    rewards: list[Any]
    reward_tokenizer: Any
    train_dataset: Any
    eval_dataset: Any
    accelerator: Any
    peft_config: Any = None  # a peft.LoraConfig with --use_peft


def load_parts(config: OnPolicyConfig, needs_reference: bool) -> LoadedParts:
    """Tokenizer from model_name_or_path (TRL's scripts), policy and reference from sft_model_path,
    reward model from reward_model_path and/or reward functions from reward_funcs, prompts from
    dataset_name / dataset_train_split (+ dataset_test_split for sample tables when it exists).
    Cheap checks (paths set, reward functions importable, data readable) run before any model loads."""
    from posttrain.models import load_policy, load_reward_model, load_tokenizer, peft_config_from

    if not config.sft_model_path:
        raise ConfigError("no policy: pass --model_name_or_path (or --sft_model_path), a folder or a hub name.")
    if not config.reward_model_path and not config.reward_funcs:
        raise ConfigError(
            "no reward: pass --reward_model_path (a reward model) and/or --reward_funcs (module:function ...)."
        )
    funcs = [import_callable(path) for path in config.reward_funcs or []]
    peft_config = peft_config_from(config)
    # With LoRA the reference is the base model with the adapter disabled: no copy is loaded.
    needs_reference = needs_reference and peft_config is None
    train_dataset = load_split(config, config.dataset_train_split)
    eval_dataset = load_split(config, config.dataset_test_split, required=False)
    accelerator = dist.build_accelerator(mixed_precision=config.mixed_precision)
    common = dict(
        dtype=config.torch_dtype, trust_remote_code=config.trust_remote_code, disable_dropout=config.disable_dropout
    )
    tokenizer = load_tokenizer(
        config.model_name_or_path or config.sft_model_path, trust_remote_code=config.trust_remote_code
    )
    policy = load_policy(
        config.sft_model_path, gradient_checkpointing=config.gradient_checkpointing, tokenizer=tokenizer, **common
    )
    reference = load_policy(config.sft_model_path, tokenizer=tokenizer, **common) if needs_reference else None
    rewards: list[Any] = []
    reward_tokenizer = None
    if config.reward_model_path:
        try:
            reward_tokenizer = load_tokenizer(config.reward_model_path, trust_remote_code=config.trust_remote_code)
        except (OSError, ValueError):
            reward_tokenizer = None  # no tokenizer saved with the reward model: it shares the policy's
        rewards.append(load_reward_model(config.reward_model_path, tokenizer=reward_tokenizer or tokenizer, **common))
    rewards.extend(funcs)
    return LoadedParts(
        tokenizer, policy, reference, rewards, reward_tokenizer, train_dataset, eval_dataset, accelerator, peft_config
    )


def run_from_config(
    command: str, config: OnPolicyConfig, build: Callable[[LoadedParts], Any], needs_reference: bool
) -> int:
    """Shared body of `posttrain rloo` / `posttrain grpo`: refuse to overwrite a finished run, load,
    build the trainer, train. Errors meant for people print one line and exit with code 2."""
    from posttrain.data import DataError
    from posttrain.trainers.supervised import check_output_dir

    try:
        check_output_dir(config)
        build(load_parts(config, needs_reference)).train()
    except (ConfigError, DataError, ckpt.CheckpointError) as err:
        print(f"posttrain {command}: {err}", file=sys.stderr)
        return 2
    return 0
