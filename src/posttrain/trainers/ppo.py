"""PPO with a critic: actor, reference, reward and value models (Ouyang et al. 2022, "Training
language models to follow instructions with human feedback"; Huang et al. 2024, "The N+
Implementation Details of RLHF with PPO"; TRL's `PPOTrainer`).

Per rollout batch of B completions, with completion tokens t = 0 … T−1 and mask m_t:

1. Sample completions of a prompt batch with the policy (stop at EOS, stop token kept).
2. Score: s = reward model score at the last real token and/or Σ_f w_f·f(prompt, completion), minus
   missing_eos_penalty; optionally scaled by the running std of all scores (use_score_scaling /
   use_score_norm / score_clip, DeepSpeed-Chat's cure for a critic whose loss grows with the
   reward scale).
3. Advantages: log π_old, V_old (a no-grad forward in the update's mode and micro-batches, so the
   first minibatch sees ratio 1 exactly) and log π_ref;
      kl_t = kl_estimator(log π_old − log π_ref)  (k1, k2, k3, abs, or "full" = exact KL over the vocabulary),
      r_t  = −β·kl_t + s·[t = last real token]                      (advantages.kl_shaped_rewards),
      optional reward whitening; δ_t = r_t + γ·V_{t+1} − V_t,  A_t = Σ_l (γλ)^l δ_{t+l},
      R_t = A_t + V_t (advantages.gae); optional advantage whitening. Whitening uses the mean and
      variance of the whole batch over all ranks.
4. Update: num_ppo_epochs × shuffled minibatches × micro-batches of
      L = Σ_t m_t·[max(−A_t·ρ_t, −A_t·clip(ρ_t, 1 ± cliprange))
              + vf_coef·½·max((V_t − R_t)², (clip(V_t, V_old ± cliprange_value) − R_t)²)
              − entropy_coef·H_t] / N_tok,          ρ_t = exp(log π_θ − log π_old),
   N_tok = loss tokens of the minibatch over all ranks (batch 1 × GA 4 = batch 4 × GA 1, 2
   processes = 1 process). Early stop when the minibatch's policy KL > 1.5·target_kl; a
   micro-batch whose mean ratio exceeds ratio_threshold contributes no loss.
5. Controllers: β fixed, or adapted towards `target` (Ziegler et al. 2019,
   advantages.AdaptiveKLController); the learning-rate schedule steps once per rollout batch.

The classic generate()/step()/log_stats() API (TRL's original trainer) runs steps 3–5 on
(query, response, score) triples from any source: trainers/ppo_classic.py, selected when the
trainer is built with `config=` (or the classic positional order). The plumbing is the online
skeleton, trainers/online.py.

Metrics (train(), one line per logging step; sums and counts reduced over ranks, never means of means):
  objective/kl              mean over completions of Σ_t kl_t (the configured estimator, masked)
  objective/entropy         mean over completions of Σ_t −logprob_t (sampled-token NLL, masked, ≥ 0)
  objective/non_score_reward  mean over completions of Σ_t −β·kl_t
  objective/rlhf_reward     mean over completions of (score used + Σ_t −β·kl_t)
  objective/scores          mean raw score (after missing_eos_penalty, before scaling)
  policy/approxkl_avg, policy/policykl_avg, policy/clipfrac_avg, loss/policy_avg, loss/value_avg,
  val/clipfrac_avg, policy/entropy_avg, val/ratio, val/vpred, val/error
                            token-weighted means over every update token (all epochs, minibatches,
                            micro-batches, ranks); val/ratio_var = unbiased variance of the ratio
                            over those tokens; loss/value_avg = ½·max(...) without vf_coef
  val/num_eos_tokens        completions that ended with a stop token (sum over ranks)
  lr, objective/kl_coef     the learning rate and KL coefficient β used for the logged batch
                            (β before the adaptive controller's update, as step() reports it)
  episode, eps, epoch; also returns/*, val/mean, val/var, tokens/*,
  policy/skipped_microbatches (ratio_threshold), policy/early_stopped.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posttrain import advantages as adv
from posttrain import distributed as dist
from posttrain.configs import ConfigError
from posttrain.critic import (
    PolicyAndValue,
    attach_critic,
    attach_lora_critic,
    check_lora_roles_config,
    is_lora_config,
    lora_roles_wanted,
)
from posttrain.losses import entropy_bonus, ppo_policy_loss, ppo_value_loss
from posttrain.models import CausalLMWithValueHead
from posttrain.rollout import Rollout
from posttrain.scoring import RewardSource
from posttrain.trainers import online
from posttrain.trainers.online import (
    OnlineTrainer,
    UpdateLayout,
    default_config,
    global_normalizer,
    load_parts,
    micro_batches,
    minibatch_step,
    prepare_policy,
    sample,
    score,
    update_layout,
)
from posttrain.trainers.ppo_config import PPOConfig

__all__ = ["PPOConfig", "PPOTrainer", "PolicyAndValue", "main"]


@dataclass
class PPOBatch:
    """Step 3's output for one batch: what the update trains on."""

    rollout: Rollout
    mask: torch.Tensor  # (B, T) the tokens trained on
    old_logprobs: torch.Tensor  # (B, T)
    old_values: torch.Tensor  # (B, T)
    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor  # (B, T)
    kl: torch.Tensor  # (B, T)
    first: tuple | None  # the single-pass case's update forward (logprobs, entropy, values)


class PPOTrainer(OnlineTrainer):
    """PPO with a critic: `PPOTrainer(args, processing_class, model, ref_model, reward_model,
    train_dataset, value_model=None, data_collator=None, eval_dataset=None, optimizers=(None, None),
    callbacks=None, peft_config=None).train()`. Built with `config=` (or the classic positional
    order `PPOTrainer(config, model, ref_model, tokenizer, ...)`) it is the classic
    generate()/step() trainer of trainers/ppo_classic.py.

    model / ref_model: modules, hub ids or folders (model None: args.sft_model_path); model may be a
    models.CausalLMWithValueHead. reward_model: an nn.Module (sequence-classification reward model)
    or path, a text reward function `f(prompts, completions, **columns) -> list[float]`, a list of
    those, or a scoring.RewardSource; `reward_processing_class` is the reward model's own tokenizer
    when it differs from the policy's. value_model: the critic; None builds one as
    `args.value_model_init` says (with a LoRA `peft_config` / --use_peft: a second adapter on the
    policy's base, critic.attach_lora_critic; the reference is the base with adapters off).
    callbacks: `transformers.TrainerCallback` objects
    (see trainers/online.py, `OnlineTrainer`). A `data_collator` is accepted for TRL
    compatibility; train() always left-pads prompts with data.PromptCollator (masks from lengths).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> PPOTrainer:
        if cls is PPOTrainer:
            from posttrain.trainers.ppo_classic import ClassicPPOTrainer, is_classic_call

            if is_classic_call(args, kwargs):
                return super().__new__(ClassicPPOTrainer)
        return super().__new__(cls)

    def __init__(
        self,
        args: PPOConfig | None = None,
        processing_class: Any = None,
        model: nn.Module | str | None = None,
        ref_model: nn.Module | str | None = None,
        reward_model: Any = None,
        train_dataset: Any = None,
        value_model: nn.Module | None = None,
        data_collator: Callable | None = None,
        eval_dataset: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        callbacks: list | None = None,
        peft_config: Any = None,
        *,
        reward_processing_class: Any = None,
    ) -> None:
        if args is None:
            args = default_config(PPOConfig, model, "PPO")
        if not isinstance(args, PPOConfig):
            raise ConfigError(f"PPOTrainer needs a PPOConfig as args= (or config=), got {type(args).__name__}.")
        if data_collator is not None:
            warnings.warn(
                "PPOTrainer ignores data_collator: prompts are left-padded by data.PromptCollator.", stacklevel=2
            )
        given_source = reward_model if isinstance(reward_model, RewardSource) else None
        lora_roles = lora_roles_wanted(args, value_model) and (peft_config is not None or args.use_peft)
        if lora_roles:
            check_lora_roles_config(args)
        parts = load_parts(
            args,
            model=model,
            ref_model=ref_model,
            rewards=None if given_source is not None else reward_model,
            processing_class=processing_class,
            reward_processing_class=reward_processing_class,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            peft_config=peft_config,
            needs_reference=True,
            needs_reward=given_source is None,
            rewards_from_config=given_source is None,
        )
        self.temperature = online.sampling_config(args, parts.tokenizer).logprob_temperature
        self.running = adv.RunningMoments()
        self.kl_ctl = self.kl_controller(args)
        reward_models = (
            given_source.models if given_source is not None else [r for r in parts.rewards if isinstance(r, nn.Module)]
        )
        # The critic (step 3's V); new heads are initialised from the seed: every rank builds the same.
        dist.set_seed(args.seed)
        if lora_roles and is_lora_config(parts.peft_config) and not isinstance(parts.policy, CausalLMWithValueHead):
            # LoRA roles on one base: actor = adapter "default", critic = adapter "critic" + value
            # head, reference = adapters off (critic.attach_lora_critic).
            model, self.ref_model = prepare_policy(
                parts.policy, parts.reference, args, peft_config=parts.peft_config, needs_reference=True
            )
            critic = attach_lora_critic(model, args, reward_models)
        else:
            model, critic = attach_critic(
                parts.policy, value_model, args, reward_models, parts.reward_tokenizer, parts.tokenizer
            )
            model, self.ref_model = prepare_policy(
                model, parts.reference, args, peft_config=parts.peft_config, needs_reference=True
            )
        wrapper = PolicyAndValue(model, critic, entropy_grad=bool(args.entropy_coef))
        self.wrapped = self.setup(
            args,
            parts.tokenizer,
            wrapper,
            train_dataset=parts.train_dataset,
            eval_dataset=parts.eval_dataset,
            optimizers=optimizers,
            callbacks=callbacks,
            position_limits=parts.position_limits,
        )
        self.ref_model = dist.prepare_frozen(self.ref_model, self.accelerator)
        self.reward = given_source or RewardSource(
            parts.rewards,
            policy_tokenizer=self.processing_class,
            reward_tokenizer=parts.reward_tokenizers,
            batch_size=args.local_rollout_forward_batch_size,
            missing_eos_penalty=args.missing_eos_penalty,
        )
        self.reward.models[:] = [dist.prepare_frozen(rm, self.accelerator) for rm in self.reward.models]

    @classmethod
    def from_config(cls, config: PPOConfig) -> PPOTrainer:
        return cls(args=config)

    # -- the models ---------------------------------------------------------------------------------
    @staticmethod
    def kl_controller(config: PPOConfig) -> Any:
        if config.adap_kl_ctrl:
            return adv.AdaptiveKLController(config.kl_coef, config.target, config.horizon)
        return adv.FixedKLController(config.kl_coef)

    @property
    def unwrapped(self) -> PolicyAndValue:
        return dist.unwrap(self.wrapped, self.accelerator)

    @property
    def policy_model(self) -> nn.Module:
        """The policy (a models.CausalLMWithValueHead when the critic is a value head)."""
        return self.unwrapped.policy

    @property
    def model(self) -> PolicyAndValue:
        """Policy and critic as one module, as TRL's PPOTrainer.model: `.policy`, `.value_model`."""
        return self.unwrapped

    @property
    def value_model(self) -> nn.Module | None:
        return self.unwrapped.critic

    @property
    def generation_model(self) -> nn.Module:
        return self.unwrapped.lm

    # -- train() ------------------------------------------------------------------------------------
    def train(self) -> Any:
        """Run the whole training (resuming if asked) and save; returns a transformers TrainOutput."""
        config, run = self.args, self.run
        with self.training():
            for update in run.updates():
                batch = run.next_batch()
                # 1. sample
                rollout = sample(run, self.generation_model, batch["input_ids"], batch["attention_mask"])
                # 2. score
                scores = score(run, self.reward, rollout, batch, 1).float()
                # 3. advantages (β read before the controller moves it: the β that shaped these rewards)
                kl_coef = self.kl_ctl.value
                layout = self.layout(
                    len(rollout), config.per_device_train_batch_size, config.gradient_accumulation_steps
                )
                ppo_batch = self.advantages(rollout, scores, layout)
                # 4. update
                self.update(ppo_batch, layout)
                # 5. controllers
                self.update_kl_controller(ppo_batch.kl)
                self.end_of_update(update, {"objective/kl_coef": kl_coef})
        return self.train_output

    # -- steps 3-5, shared with the classic step() --------------------------------------------------
    def layout(self, B: int, micro: int, accum: int) -> UpdateLayout:
        """Step 4's cut of B local rows (micro-batches of `micro`, `accum` per optimizer step)."""
        cfg = self.args
        single = cfg.kl_estimator != "full"
        return update_layout(self.run, B, micro, accum, cfg.num_ppo_epochs, allow_single_pass=single)

    def advantages(self, rollout: Rollout, scores: torch.Tensor, layout: UpdateLayout, loss_mask=None) -> PPOBatch:
        """Step 3 on one (local) batch; logs the objective/*, returns/*, val/* and tokens/* metrics.
        loss_mask (B, T): the tokens trained on, KL-penalised and counted in the statistics, a subset
        of rollout.completion_mask (step()'s response_masks); default the completion mask. The score
        sits on its last True position."""
        cfg, run, M = self.args, self.run, self.run.metrics
        started = time.time()
        B = len(rollout)
        mask = rollout.completion_mask if loss_mask is None else loss_mask & rollout.completion_mask
        self.wrapped.train()
        ref_logprobs = online.reference_logprobs(run, self.generation_model, self.ref_model, rollout, self.temperature)
        kl_full = None
        if cfg.kl_estimator == "full":
            kl_full = online.reference_full_kl(run, self.generation_model, self.ref_model, rollout, self.temperature)
        first = None
        if layout.orders is None:  # the update's own forward supplies the old logprobs and values
            with run.autocast():
                first = self.wrapped(rollout, self.temperature)
            old_logprobs, old_values = first[0].detach(), first[2].detach()
        else:  # on epoch 0's micro-batches, so the first update sees bitwise the same forward
            old_logprobs, old_values = torch.zeros_like(ref_logprobs), torch.zeros_like(ref_logprobs)
            with torch.no_grad(), run.autocast():
                for rows in micro_batches(layout.orders[0], layout.micro):
                    # with_entropy as in the update: the same log-softmax kernel, bitwise the same logprobs
                    lp, _, v = self.wrapped(rollout.select(rows), self.temperature, with_entropy=True)
                    old_logprobs[rows], old_values[rows] = lp.float(), v.float()

        forwarded = time.time()
        raw_scores = scores
        if cfg.use_score_scaling or cfg.score_clip is not None:
            gathered = dist.gather(scores, run.accelerator) if cfg.use_score_scaling else None
            scores = adv.scale_scores(
                scores, self.running, cfg.use_score_scaling, cfg.use_score_norm, cfg.score_clip, stats_scores=gathered
            )
        # full_kl masks by the completion mask only; tokens outside the loss mask carry no KL either.
        kl = (
            kl_full.masked_fill(~mask, 0.0)
            if kl_full is not None
            else adv.kl_penalty(old_logprobs, ref_logprobs, cfg.kl_estimator, mask)
        )
        rewards, non_score = adv.kl_shaped_rewards(scores, kl, mask, self.kl_ctl.value)
        if cfg.whiten_rewards:
            rewards = adv.whiten_rewards(rewards, mask, moments=run.batch_moments(rewards, mask))
        rewarded = time.time()
        advantages, returns = adv.gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            advantages = adv.whiten_advantages(advantages, mask, moments=run.batch_moments(advantages, mask))
        # Host wall-clock seconds of step 3's phases (the classic step() reports them as time/ppo/*).
        self.phase_seconds = {
            "forward_pass": forwarded - started,
            "compute_rewards": rewarded - forwarded,
            "compute_advantages": time.time() - rewarded,
        }

        # Sequence-level objective metrics: means over completions of per-completion sums.
        M.add("objective/kl", kl.sum(), B)
        M.add("objective/entropy", -(old_logprobs * mask).sum(), B)  # sampled-token NLL, masked: >= 0
        M.add("objective/non_score_reward", non_score.sum(), B)
        M.add("objective/rlhf_reward", scores.sum() + non_score.sum(), B)
        M.add("objective/scores", raw_scores.sum(), B)
        M.add_var("objective/scores_var", raw_scores)
        M.add_sum("val/num_eos_tokens", rollout.ended.sum())
        M.add("tokens/responses_len_mean", rollout.completion_lengths.sum(), B)
        M.add("tokens/queries_len_mean", rollout.prompt_mask.sum(), B)
        M.add_mean("objective/logprobs", old_logprobs, mask)
        M.add_mean("objective/ref_logprobs", ref_logprobs, mask)
        M.add_mean("returns/mean", returns, mask)
        M.add_var("returns/var", returns, mask)
        M.add_mean("val/mean", old_values, mask)
        M.add_var("val/var", old_values, mask)
        M.add_mean("policy/advantages_mean", advantages, mask)
        return PPOBatch(rollout, mask, old_logprobs, old_values, advantages, returns, kl, first)

    def update(self, b: PPOBatch, layout: UpdateLayout) -> bool:
        """Step 4: epochs × minibatches × micro-batches; returns whether early stopping fired."""
        cfg, run = self.args, self.run
        B, step_rows, stop = len(b.rollout), layout.micro * layout.accum, False
        for epoch in range(cfg.num_ppo_epochs):
            order = torch.arange(B, device=run.device) if layout.orders is None else layout.orders[epoch]
            for start in range(0, B, step_rows):
                mb_rows = order[start : start + step_rows]
                normalizer = global_normalizer(b.mask[mb_rows].sum(), run.accelerator)
                policykl = torch.zeros(2, device=run.device)

                def micro_loss(rows: torch.Tensor) -> torch.Tensor:
                    nonlocal policykl
                    if b.first is not None:
                        out = b.first
                    else:
                        with run.autocast():
                            out = self.wrapped(b.rollout.select(rows), self.temperature)
                    loss, pg = self.micro_batch_loss(out, b, rows, normalizer)
                    policykl = policykl + torch.stack([pg["policykl"] * pg["count"], pg["count"]])
                    return loss

                def early_stop() -> bool:
                    nonlocal stop
                    if cfg.early_stopping:
                        total = dist.reduce_sum(policykl, run.accelerator)
                        stop = bool(total[0] / total[1].clamp(min=1) > 1.5 * cfg.target_kl)
                    return stop

                chunks = list(micro_batches(mb_rows, layout.micro))
                minibatch_step(run, self.wrapped, self.optimizer, chunks, micro_loss, veto=early_stop)
                if stop:
                    break
            if stop:
                break
        run.metrics.add_sum("policy/early_stopped", float(stop))
        return stop

    def micro_batch_loss(
        self, out: tuple, b: PPOBatch, rows: torch.Tensor, normalizer: float
    ) -> tuple[torch.Tensor, dict]:
        """Clipped policy loss + vf_coef · clipped value loss − entropy bonus of one micro-batch (sum
        over its tokens / the minibatch's global token count), and its token-weighted metrics."""
        cfg, M = self.args, self.run.metrics
        logprobs, entropy, values = out
        m, old_logprobs = b.mask[rows], b.old_logprobs[rows]
        pg_loss, pg = ppo_policy_loss(
            logprobs, old_logprobs, b.advantages[rows], m, cfg.cliprange, normalizer=normalizer
        )
        vf_loss, vf = ppo_value_loss(
            values, b.old_values[rows], b.returns[rows], m, cfg.cliprange_value, normalizer=normalizer
        )
        loss = pg_loss + cfg.vf_coef * vf_loss
        if cfg.entropy_coef:
            loss = loss + entropy_bonus(entropy, m, cfg.entropy_coef, normalizer=normalizer)[0]
        # Classic ratio_threshold guard, without a host sync: the micro-batch's loss becomes 0.
        skip = pg["ratio_mean"] > cfg.ratio_threshold
        loss = torch.where(skip, loss * 0.0, loss)
        n = pg["count"]
        for name, key, stats in (
            ("policy/approxkl_avg", "approxkl", pg),
            ("policy/policykl_avg", "policykl", pg),
            ("policy/clipfrac_avg", "clipfrac", pg),
            ("loss/policy_avg", "pg_loss", pg),
            ("loss/value_avg", "vf_loss", vf),
            ("val/clipfrac_avg", "vf_clipfrac", vf),
            ("val/vpred", "vpred", vf),
            ("val/error", "value_error", vf),
        ):
            M.add(name, stats[key] * n, n)
        M.add("loss/total_avg", (pg["pg_loss"] + cfg.vf_coef * vf["vf_loss"]) * n, n)
        M.add_mean("policy/entropy_avg", entropy, m)
        ratio = torch.exp((logprobs.detach() - old_logprobs).masked_fill(~m, 0.0))
        M.add_mean("val/ratio", ratio, m)
        M.add_var("val/ratio_var", ratio, m)
        M.add_sum("policy/skipped_microbatches", skip.float())
        return loss, pg

    def update_kl_controller(self, kl: torch.Tensor) -> None:
        """Step 5 (Ziegler et al.): the batch's mean KL over all ranks, n = the global batch."""
        if self.args.adap_kl_ctrl:
            B = torch.tensor(float(kl.size(0)), device=kl.device)
            totals = dist.reduce_sum(torch.stack([kl.sum(), B]), self.run.accelerator)
            self.kl_ctl.update(float(totals[0] / totals[1]), int(totals[1]))

    # -- checkpoints, final save, sample table ------------------------------------------------------
    def checkpoint_models(self) -> dict[str, nn.Module]:
        return self.unwrapped.checkpoint_modules()

    def extra_state(self) -> dict:
        return {"kl_ctl": self.kl_ctl.state_dict(), "running_moments": self.running.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.running.load_state_dict(state["running_moments"])

    def final_models(self) -> tuple[nn.Module, dict[str, nn.Module] | None]:
        return self.unwrapped.final_modules()

    def table_scores(self, rollout: Rollout, batch: dict) -> torch.Tensor:
        return score(self.run, self.reward, rollout, batch, 1)


def main(config: PPOConfig) -> int:
    """`posttrain ppo`: policy, reference, reward, critic and prompts from the config; train."""
    return online.run_command(PPOTrainer, config)
