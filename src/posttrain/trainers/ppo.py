"""PPO with a critic: actor, reference, reward and value models, and the classic generate()/step() loop.

The algorithm (Ouyang et al. 2022; "The N+ implementation details of RLHF with PPO"; TRL 0.19's
PPOTrainer, trl-notes §3; the classic `step()` trainer, §2), per rollout batch:

1. rollout:  sample completions of a prompt batch with the policy (stop at EOS, stop token kept);
2. score:    one score per completion from a reward model and/or text reward functions, minus
             missing_eos_penalty; optionally scaled by the running std of all scores
             (use_score_scaling / use_score_norm / score_clip: DeepSpeed-Chat's cure for a critic
             whose loss grows with the reward scale, seed 002);
3. advantages: reference logprobs, old logprobs and old values; per-token reward
             r_t = −β·kl_t plus the score on the LAST REAL token; optional reward whitening;
             GAE(γ, λ); advantage whitening;
4. update:   num_ppo_epochs × shuffled minibatches × gradient-accumulation micro-batches of the
             clipped policy loss + vf_coef · clipped value loss (0.5·max) − entropy_coef · entropy,
             normalised by the GLOBAL token count of the minibatch (so batch 1 × GA 4 = batch 4 × GA 1
             and 2 processes = 1 process); early stop on policy KL > 1.5·target_kl; a micro-batch whose
             mean ratio exceeds ratio_threshold is skipped;
5. KL coefficient: fixed, or adapted towards `target` (Ziegler et al. 2019); then log.

TRL bugs fixed on purpose (trl-notes §14):
- the score sits on the last real token (the stop token), not one slot after it (TRL#1893, #3750);
- old logprobs / values come from a forward in the SAME mode and on the SAME micro-batches as the
  first update (dropout off), so ratio == 1 and approxkl == 0 exactly at the first minibatch of the
  first epoch (TRL#454); with 1 epoch × 1 minibatch × 1 micro-batch that forward IS the update's
  forward (its detached outputs are the old ones), so it is not run twice;
- objective/entropy is masked (never negative: TRL#2281, #2496) and every `_avg` metric is a
  token-weighted mean over all micro-batches and ranks, not a mean of means (TRL#7012);
- generation stops at EOS (TRL#2387); rewards may be text functions (TRL#2518) and the reward model
  may have its own tokenizer (TRL#1979); the critic is saved and training resumes exactly (TRL#2657);
  the classic generate()/step() API is back (TRL#3270).

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
step() returns the classic names of trl-notes §2.4 (see STEP_STATS), computed the same way.

Two ways in, one trainer:
    PPOTrainer(args=PPOConfig(...), processing_class=tok, model=policy, ref_model=ref,
               reward_model=rm_or_function, train_dataset=prompts, value_model=None).train()
    PPOTrainer(config=PPOConfig(...), model=value_head_model, ref_model=None, tokenizer=tok)
        responses = trainer.generate(queries, return_prompt=False, **generation_kwargs)
        stats = trainer.step(queries, responses, scores); trainer.log_stats(stats, batch, scores)
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from posttrain import distributed as dist
from posttrain.advantages import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    full_kl,
    gae,
    kl_penalty,
    kl_shaped_rewards,
    scale_scores,
    whiten_advantages,
    whiten_rewards,
)
from posttrain.compat import dtype_kwargs
from posttrain.configs import ConfigError
from posttrain.health import HealthMonitor
from posttrain.losses import entropy_bonus, ppo_policy_loss, ppo_value_loss
from posttrain.models import CausalLMWithValueHead, apply_peft, disable_dropout
from posttrain.ops import logprobs_and_entropy, selective_log_softmax
from posttrain.rollout import (
    Rollout,
    SamplingConfig,
    accepts_logits_to_keep,
    decode_completions,
    generate,
    generation_mode,
)
from posttrain.scoring import (
    _lm_logits,
    _trimmed_inputs,
    batched_completion_logprobs,
    completion_logprobs,
    completion_values,
)
from posttrain.tracking import MetricAccumulator, Tracker
from posttrain.trainers.common import (
    OnlineRun,
    RewardSource,
    build_optimizer,
    build_scheduler,
    clip_and_step,
    global_normalizer,
    micro_batches,
    no_sync_unless_last,
)
from posttrain.trainers.ppo_config import PPOConfig

__all__ = ["PPOConfig", "PPOTrainer", "PolicyAndValue", "run"]

# step() statistics (classic names, trl-notes §2.4) <- the accumulated metrics they come from.
STEP_STATS = {
    "objective/kl": "objective/kl",
    "objective/entropy": "objective/entropy",
    "objective/logprobs": "objective/logprobs",
    "objective/ref_logprobs": "objective/ref_logprobs",
    "ppo/mean_non_score_reward": "objective/non_score_reward",
    "ppo/mean_scores": "objective/scores",
    "ppo/mean_rlhf_reward": "objective/rlhf_reward",
    "ppo/loss/policy": "loss/policy_avg",
    "ppo/loss/value": "loss/value_avg",
    "ppo/loss/total": "loss/total_avg",
    "ppo/policy/entropy": "policy/entropy_avg",
    "ppo/policy/approxkl": "policy/approxkl_avg",
    "ppo/policy/policykl": "policy/policykl_avg",
    "ppo/policy/clipfrac": "policy/clipfrac_avg",
    "ppo/policy/advantages_mean": "policy/advantages_mean",
    "ppo/policy/ratio_mean": "val/ratio",
    "ppo/returns/mean": "returns/mean",
    "ppo/returns/var": "returns/var",
    "ppo/val/vpred": "val/vpred",
    "ppo/val/error": "val/error",
    "ppo/val/clipfrac": "val/clipfrac_avg",
    "ppo/val/mean": "val/mean",
    "ppo/val/var": "val/var",
    "ppo/early_stopped": "policy/early_stopped",
    "tokens/queries_len_mean": "tokens/queries_len_mean",
    "tokens/responses_len_mean": "tokens/responses_len_mean",
}
# Keyword arguments of the classic generate() that the rollout engine understands.
_GENERATION_KWARGS = {
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "do_sample",
    "eos_token_id",
    "pad_token_id",
    "min_length",
}


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

    def forward(self, rollout: Rollout, temperature: float, with_entropy: bool = True):
        """(logprobs (B, T), entropy (B, T) | None, values (B, T)) of the completion tokens, 0 off-mask."""
        if not self.shared:
            logprobs, entropy = completion_logprobs(
                self.policy, rollout, temperature=temperature, with_entropy=with_entropy, entropy_grad=self.entropy_grad
            )
            return logprobs, entropy, completion_values(self.critic, rollout)
        # Same positions as scoring.completion_logprobs / completion_values, from ONE trunk pass.
        T = rollout.completion_ids.size(1)
        ids, mask, positions, P, Tc = _trimmed_inputs(rollout)
        lm = self.policy.pretrained_model
        keep = (
            {"logits_to_keep": torch.arange(P - 1, P - 1 + Tc, device=ids.device)} if accepts_logits_to_keep(lm) else {}
        )
        out = lm(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=False,
            output_hidden_states=True,
            **keep,
        )
        logits = out.logits if keep else out.logits[:, P - 1 : P - 1 + Tc]
        values = self.policy.score(out.hidden_states[-1][:, P - 1 : P - 1 + Tc]).squeeze(-1).float()
        targets, cmask = rollout.completion_ids[:, :Tc], rollout.completion_mask[:, :Tc]
        if with_entropy:
            logprobs, entropy = logprobs_and_entropy(logits, targets, temperature, entropy_grad=self.entropy_grad)
            entropy = nn.functional.pad(entropy.masked_fill(~cmask, 0.0), (0, T - Tc))
        else:
            logprobs, entropy = selective_log_softmax(logits, targets, temperature), None
        pad = lambda x: nn.functional.pad(x.masked_fill(~cmask, 0.0), (0, T - Tc))  # noqa: E731
        return pad(logprobs), entropy, pad(values)


def _critic_from_policy(policy: nn.Module) -> nn.Module:
    """A separate value model: the policy's trunk (copied) under a new scalar `score` head."""
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    critic = AutoModelForSequenceClassification.from_config(config, **dtype_kwargs(next(policy.parameters()).dtype))
    critic.base_model.load_state_dict(policy.base_model.state_dict())
    return critic


def _share_layers(model: nn.Module, ref: nn.Module, num_shared_layers: int) -> None:
    """Classic `create_reference_model(num_shared_layers=N)`: the embeddings and first N blocks of
    `ref` ARE the policy's, frozen in both (memory saved, those layers never train)."""
    base, ref_base = model.base_model, ref.base_model
    blocks = next((name for name, m in base.named_children() if isinstance(m, nn.ModuleList)), None)
    if blocks is None or num_shared_layers > len(getattr(base, blocks)):
        raise ConfigError(
            f"num_shared_layers={num_shared_layers}: the model has no list of that many transformer blocks to share."
        )
    for name, module in base.named_children():
        if name == blocks:
            for i in range(num_shared_layers):
                getattr(base, blocks)[i].requires_grad_(False)
                getattr(ref_base, blocks)[i] = getattr(base, blocks)[i]
            break
        module.requires_grad_(False)  # embeddings come before the blocks
        setattr(ref_base, name, module)


def _dict_collator(rows: list[dict]) -> dict[str, list]:
    """The classic example's collator: a dict of lists (ragged tensors stay a list)."""
    return {key: [row[key] for row in rows] for key in rows[0]}


class PPOTrainer:
    """PPO with a critic. High level: `PPOTrainer(args, processing_class, model, ref_model,
    reward_model, train_dataset, value_model=None, ...).train()`. Low level (classic TRL, seed 004):
    `PPOTrainer(config=, model=, ref_model=None, tokenizer=, dataset=None, optimizer=None,
    data_collator=None, num_shared_layers=None, lr_scheduler=None)`, then `generate()`, `step()`,
    `log_stats()`. The classic positional order `PPOTrainer(config, model, ref_model, tokenizer, ...)`
    is recognised (its second argument is a model, not a tokenizer).

    reward_model: an nn.Module (sequence-classification reward model), a text reward function
    `f(prompts, completions, **columns) -> list[float]`, a list of those, or a common.RewardSource;
    `reward_processing_class` is the reward model's own tokenizer when it differs from the policy's.
    value_model: the critic; None builds one as `args.value_model_init` says. callbacks: objects whose
    optional `on_log(args, state, control, logs=...)` is called after each logging step. A
    `data_collator` is accepted for TRL compatibility; train() always left-pads prompts with
    data.PromptCollator (masks from lengths).
    """

    def __init__(
        self,
        args: PPOConfig | None = None,
        processing_class: Any = None,
        model: nn.Module | None = None,
        ref_model: nn.Module | None = None,
        reward_model: Any = None,
        train_dataset: Any = None,
        value_model: nn.Module | None = None,
        data_collator: Callable | None = None,
        eval_dataset: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        callbacks: list | None = None,
        peft_config: Any = None,
        *,
        config: PPOConfig | None = None,
        tokenizer: Any = None,
        dataset: Any = None,
        optimizer: Any = None,
        num_shared_layers: int | None = None,
        lr_scheduler: Any = None,
        reward_processing_class: Any = None,
    ) -> None:
        if isinstance(processing_class, nn.Module):
            # Classic positional call: (config, model, ref_model, tokenizer, dataset, optimizer,
            # data_collator, num_shared_layers, lr_scheduler).
            config, model, ref_model, tokenizer, dataset = args, processing_class, model, ref_model, reward_model
            optimizer, data_collator, num_shared_layers, lr_scheduler = (
                train_dataset,
                value_model,
                data_collator,
                eval_dataset,
            )
            args = processing_class = reward_model = train_dataset = value_model = eval_dataset = None
        if args is not None and config is not None:
            raise ConfigError("pass either args= (train() API) or config= (generate()/step() API), not both.")
        self.args = args if args is not None else config
        if not isinstance(self.args, PPOConfig):
            raise ConfigError(f"PPOTrainer needs a PPOConfig as args= (or config=), got {type(self.args).__name__}.")
        if model is None:
            raise ConfigError("model is required: the policy (a causal LM, or a models.CausalLMWithValueHead).")
        self.config = self.args
        self.processing_class = self.tokenizer = processing_class if processing_class is not None else tokenizer
        if self.tokenizer is None:
            raise ConfigError("a tokenizer is required: pass processing_class= (or tokenizer= with config=).")
        from posttrain.models import ensure_pad_token

        ensure_pad_token(self.tokenizer)
        self.callbacks = list(callbacks or [])
        self.running = RunningMoments()
        cfg = self.args
        self.kl_ctl = (
            AdaptiveKLController(cfg.kl_coef, cfg.target, cfg.horizon)
            if cfg.adap_kl_ctrl
            else FixedKLController(cfg.kl_coef)
        )
        self.step_api = config is not None
        if self.step_api:
            self._init_step_api(model, ref_model, dataset, optimizer, data_collator, num_shared_layers, lr_scheduler)
        else:
            if data_collator is not None:
                warnings.warn(
                    "PPOTrainer ignores data_collator: prompts are left-padded by data.PromptCollator.", stacklevel=2
                )
            self._init_train_api(
                model,
                ref_model,
                reward_model,
                train_dataset,
                value_model,
                eval_dataset,
                optimizers,
                peft_config,
                reward_processing_class,
            )

    # -- construction -------------------------------------------------------------------------------
    def _init_train_api(
        self,
        model,
        ref_model,
        reward_model,
        train_dataset,
        value_model,
        eval_dataset,
        optimizers,
        peft_config,
        reward_processing_class,
    ) -> None:
        cfg = self.args
        self.run = OnlineRun(cfg, self.tokenizer, train_dataset, eval_dataset)
        self.accelerator, self.device = self.run.accelerator, self.run.device
        self.metrics, self.health, self.generator = self.run.metrics, self.run.health, self.run.generator
        self.temperature = self.run.sampling.logprob_temperature
        self.reward = (
            reward_model
            if isinstance(reward_model, RewardSource)
            else RewardSource(
                reward_model,
                policy_tokenizer=self.tokenizer,
                reward_tokenizer=reward_processing_class,
                batch_size=cfg.local_rollout_forward_batch_size,
                missing_eos_penalty=cfg.missing_eos_penalty,
            )
        )
        for rm in self.reward.models:
            rm.eval().requires_grad_(False).to(self.device)
        init = cfg.value_model_init or (
            "head" if isinstance(model, CausalLMWithValueHead) else "reward" if self.reward.models else "policy"
        )
        if value_model is None and cfg.value_model_path:
            from posttrain.models import load_value_model

            value_model = load_value_model(cfg.value_model_path, dtype=cfg.torch_dtype, tokenizer=self.tokenizer)
        if value_model is not None and init == "head":
            raise ConfigError(
                'value_model was given and value_model_init="head": a value head needs no separate value model.'
            )
        if value_model is None and init == "reward":
            if not self.reward.models:
                raise ConfigError(
                    'value_model_init="reward" needs a reward model; use "policy" or "head" with reward functions.'
                )
            if (
                reward_processing_class is not None
                and reward_processing_class.get_vocab() != self.tokenizer.get_vocab()
            ):
                raise ConfigError(
                    'value_model_init="reward": the reward model has its own tokenizer, so a critic copied from it '
                    'cannot read policy tokens; use value_model_init="policy" or "head".'
                )
            value_model = copy.deepcopy(self.reward.models[0]).requires_grad_(True)
        if value_model is None and init == "policy":
            value_model = _critic_from_policy(model)
        if init == "head" and not isinstance(model, CausalLMWithValueHead):
            model = CausalLMWithValueHead(model)
        lm = model.pretrained_model if isinstance(model, CausalLMWithValueHead) else model
        if ref_model is None and peft_config is None:
            ref_model = copy.deepcopy(lm)
        if peft_config is not None:
            lm = apply_peft(lm, peft_config)
            if isinstance(model, CausalLMWithValueHead):
                model.pretrained_model = lm
            else:
                model = lm
        self.ref_model = ref_model.pretrained_model if isinstance(ref_model, CausalLMWithValueHead) else ref_model
        if self.ref_model is not None:
            self.ref_model.eval().requires_grad_(False).to(self.device)
        for m in (model, value_model):
            if m is not None and cfg.disable_dropout:
                disable_dropout(m)
        wrapper = PolicyAndValue(model, value_model, entropy_grad=bool(cfg.entropy_coef))
        optimizer, scheduler = optimizers
        optimizer = optimizer or build_optimizer(wrapper.parameters(), cfg)
        # One LR-schedule step per rollout batch, as TRL's on-policy trainers.
        self.lr_scheduler = scheduler or build_scheduler(optimizer, cfg, cfg.num_total_batches)
        self.wrapper, self.optimizer = self.accelerator.prepare(wrapper, optimizer)
        self.model = dist.unwrap(self.wrapper, self.accelerator).policy
        self.value_model = dist.unwrap(self.wrapper, self.accelerator).critic

    def _init_step_api(
        self, model, ref_model, dataset, optimizer, data_collator, num_shared_layers, lr_scheduler
    ) -> None:
        cfg = self.args
        self.run = None
        self.accelerator = dist.build_accelerator(mixed_precision=cfg.mixed_precision)
        dist.set_seed(cfg.seed)
        self.device = dist.device(self.accelerator)
        self.metrics, self.health = MetricAccumulator(), HealthMonitor(enabled=dist.is_main(self.accelerator))
        self.generator = torch.Generator(device=self.device).manual_seed(
            cfg.seed + 7919 * dist.process_index(self.accelerator)
        )
        self.temperature = 1.0  # the classic step() scores logprobs at temperature 1
        self.tracker: Tracker | None = None
        self.current_step = 0
        vh = model if isinstance(model, CausalLMWithValueHead) else CausalLMWithValueHead(model)
        if cfg.disable_dropout:
            disable_dropout(vh)
        if isinstance(ref_model, CausalLMWithValueHead):
            ref_model = ref_model.pretrained_model
        if ref_model is None and not hasattr(vh.pretrained_model, "disable_adapter"):
            ref_model = copy.deepcopy(vh.pretrained_model)
            if num_shared_layers:
                _share_layers(vh.pretrained_model, ref_model, num_shared_layers)
        elif num_shared_layers is not None:
            raise ConfigError(
                "num_shared_layers applies only when the trainer creates the reference model (ref_model=None)."
            )
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.eval().requires_grad_(False).to(self.device)
        wrapper = PolicyAndValue(vh, entropy_grad=bool(cfg.entropy_coef))
        optimizer = optimizer or build_optimizer(wrapper.parameters(), cfg)
        self.wrapper, self.optimizer = self.accelerator.prepare(wrapper, optimizer)
        self.model = dist.unwrap(self.wrapper, self.accelerator).policy
        self.lr_scheduler = lr_scheduler
        self.dataset, self.data_collator = dataset, data_collator or _dict_collator
        self.dataloader = None
        if dataset is not None:
            # Classic default batch size 128 when batch_size is unset (trl-notes §2.2).
            self.dataloader = torch.utils.data.DataLoader(
                dataset,
                batch_size=cfg.step_batch_size or 128,
                shuffle=True,
                collate_fn=self.data_collator,
                drop_last=True,
            )

    # -- the pieces of one PPO update -------------------------------------------------------------
    def _autocast(self):
        if self.run is not None:
            return self.run.autocast()
        return self.accelerator.autocast() if self.args.mixed_precision != "no" else contextlib.nullcontext()

    def _lm(self) -> nn.Module:
        return dist.unwrap(self.wrapper, self.accelerator).lm

    @torch.no_grad()
    def _ref_logprobs(self, rollout: Rollout) -> torch.Tensor:
        bs = self.args.local_rollout_forward_batch_size
        if self.ref_model is not None:
            return batched_completion_logprobs(self.ref_model, rollout, batch_size=bs, temperature=self.temperature)[0]
        with self._lm().disable_adapter():  # PEFT: the reference is the base model, adapters off
            return batched_completion_logprobs(self._lm(), rollout, batch_size=bs, temperature=self.temperature)[0]

    @torch.no_grad()
    def _full_kl(self, rollout: Rollout) -> torch.Tensor:
        """Exact per-token KL(π‖π_ref) over the vocabulary (kl_estimator="full"), chunked."""
        bs, T, out = self.args.local_rollout_forward_batch_size, rollout.completion_ids.size(1), []
        for s in range(0, len(rollout), bs):
            part = rollout.select(slice(s, s + bs))
            ids, mask, positions, P, Tc = _trimmed_inputs(part)
            logits = _lm_logits(self._lm(), ids, mask, positions, P, Tc)
            if self.ref_model is not None:
                ref_logits = _lm_logits(self.ref_model, ids, mask, positions, P, Tc)
            else:
                with self._lm().disable_adapter():
                    ref_logits = _lm_logits(self._lm(), ids, mask, positions, P, Tc)
            kl = full_kl(logits, ref_logits, part.completion_mask[:, :Tc], temperature=self.temperature)
            out.append(nn.functional.pad(kl, (0, T - Tc)))
        return torch.cat(out)

    def _whiten(self, x: torch.Tensor, mask: torch.Tensor, shift_mean: bool) -> torch.Tensor:
        """advantages.whiten_* on one process; with several, the same formula with mean and
        variance reduced over all ranks, so N processes whiten exactly like one process with the
        global batch (TRL whitens per rank)."""
        if dist.world_size(self.accelerator) == 1:
            return whiten_advantages(x, mask) if shift_mean else whiten_rewards(x, mask)
        m = mask.to(torch.float32)
        sums = dist.reduce_sum(torch.stack([(x * m).sum(), m.sum()]), self.accelerator)
        mean = sums[0] / sums[1]
        var = dist.reduce_sum(((x - mean).square() * m).sum(), self.accelerator) / (sums[1] - 1)
        out = (x - mean) * torch.rsqrt(var + 1e-8)
        return (out if shift_mean else out + mean).masked_fill(~mask.bool(), 0.0)

    def _optimize(
        self,
        rollout: Rollout,
        scores: torch.Tensor,
        micro: int,
        accum: int,
        num_minibatches: int,
        loss_mask: torch.Tensor | None = None,
    ) -> None:
        """Steps 2–5 of the module docstring on one (local) batch; metrics go to self.metrics.
        loss_mask (B, T): the tokens trained on, KL-penalised and counted in the statistics, a subset
        of rollout.completion_mask (step()'s response_masks); default the completion mask. The score
        sits on its last True position (classic TRL `mask.nonzero()[-1]`)."""
        cfg, acc, M = self.args, self.accelerator, self.metrics
        B = len(rollout)
        mask = rollout.completion_mask if loss_mask is None else loss_mask & rollout.completion_mask
        one_pass = cfg.num_ppo_epochs == 1 and num_minibatches == 1 and accum == 1 and cfg.kl_estimator != "full"
        perms = (
            None
            if one_pass
            else [
                torch.randperm(B, generator=self.generator, device=self.generator.device).to(self.device)
                for _ in range(cfg.num_ppo_epochs)
            ]
        )
        self.wrapper.train()
        with torch.no_grad(), self._autocast():
            ref_logprobs = self._ref_logprobs(rollout)
            kl_full = self._full_kl(rollout) if cfg.kl_estimator == "full" else None
        if one_pass:  # the update's own forward supplies the old logprobs and values
            with self._autocast():
                first = self.wrapper(rollout, self.temperature)
            old_logprobs, old_values = first[0].detach(), first[2].detach()
        else:  # on epoch 0's micro-batches, so the first update sees bitwise the same forward
            old_logprobs, old_values = torch.zeros_like(ref_logprobs), torch.zeros_like(ref_logprobs)
            with torch.no_grad(), self._autocast():
                for rows in micro_batches(perms[0], micro):
                    # with_entropy as in the update: the same log-softmax kernel, bitwise the same logprobs
                    lp, _, v = self.wrapper(rollout.select(rows), self.temperature, with_entropy=True)
                    old_logprobs[rows], old_values[rows] = lp.float(), v.float()

        # -- scores -> per-token rewards -> advantages ---------------------------------------------
        raw_scores = scores
        if cfg.use_score_scaling or cfg.score_clip is not None:
            gathered = dist.gather(scores, acc) if cfg.use_score_scaling else None
            scores = scale_scores(
                scores, self.running, cfg.use_score_scaling, cfg.use_score_norm, cfg.score_clip, stats_scores=gathered
            )
        # _full_kl masks by the completion mask only; tokens outside the loss mask carry no KL either.
        kl = (
            kl_full.masked_fill(~mask, 0.0)
            if kl_full is not None
            else kl_penalty(old_logprobs, ref_logprobs, cfg.kl_estimator, mask)
        )
        rewards, non_score = kl_shaped_rewards(scores, kl, mask, self.kl_ctl.value)
        if cfg.whiten_rewards:
            rewards = self._whiten(rewards, mask, shift_mean=False)
        advantages, returns = gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            advantages = self._whiten(advantages, mask, shift_mean=True)

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

        # -- epochs × minibatches × micro-batches ------------------------------------------------
        step_rows = micro * accum
        stop = False
        for epoch in range(cfg.num_ppo_epochs):
            order = torch.arange(B, device=self.device) if one_pass else perms[epoch]
            for start in range(0, B, step_rows):
                mb_rows = order[start : start + step_rows]
                normalizer = global_normalizer(mask[mb_rows].sum(), acc)
                chunks = list(micro_batches(mb_rows, micro))
                total, policykl = torch.zeros((), device=self.device), torch.zeros(2, device=self.device)
                for i, rows in enumerate(chunks):
                    with no_sync_unless_last(acc, self.wrapper, i == len(chunks) - 1):
                        if one_pass:
                            out = first
                        else:
                            with self._autocast():
                                out = self.wrapper(rollout.select(rows), self.temperature)
                        m = mask[rows]
                        loss, pg = self._loss(
                            out, m, old_logprobs[rows], old_values[rows], advantages[rows], returns[rows], normalizer
                        )
                        acc.backward(loss)
                    total = total + loss.detach()
                    policykl = policykl + torch.stack([pg["policykl"] * pg["count"], pg["count"]])
                if cfg.early_stopping:
                    policykl = dist.reduce_sum(policykl, acc)
                    stop = bool(policykl[0] / policykl[1].clamp(min=1) > 1.5 * cfg.target_kl)
                # Decided on the loss summed over ranks, so every rank skips (or steps) together.
                if stop or not self.health.loss_is_finite(dist.reduce_sum(total, acc)):
                    self.optimizer.zero_grad(set_to_none=True)
                    if stop:
                        break
                    continue
                clip_and_step(self.wrapper, self.optimizer, cfg, acc)
                if self.run is not None:
                    self.run.state.optimizer_steps += 1
            if stop:
                break
        M.add_sum("policy/early_stopped", float(stop))

        if cfg.adap_kl_ctrl:  # Ziegler et al.: the batch's mean KL over all ranks, n = global batch
            totals = dist.reduce_sum(torch.stack([kl.sum(), torch.tensor(float(B), device=kl.device)]), acc)
            self.kl_ctl.update(float(totals[0] / totals[1]), int(totals[1]))

    def _loss(self, out, m, old_logprobs, old_values, advantages, returns, normalizer):
        """Clipped policy loss + vf_coef · clipped value loss − entropy bonus of one micro-batch (sum
        over its tokens / the minibatch's global token count), and its token-weighted metrics."""
        cfg, M = self.args, self.metrics
        logprobs, entropy, values = out
        pg_loss, pg = ppo_policy_loss(logprobs, old_logprobs, advantages, m, cfg.cliprange, normalizer=normalizer)
        vf_loss, vf = ppo_value_loss(values, old_values, returns, m, cfg.cliprange_value, normalizer=normalizer)
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

    # -- high level: train() ------------------------------------------------------------------------
    def _checkpoint_models(self) -> dict[str, nn.Module]:
        w = dist.unwrap(self.wrapper, self.accelerator)
        if w.shared:
            return {"policy": w.policy.pretrained_model, "value_head": w.policy.score}
        return {"policy": w.policy, "value_model": w.critic}

    def _extra_state(self) -> dict:
        return {"kl_ctl": self.kl_ctl.state_dict(), "running_moments": self.running.state_dict()}

    @torch.no_grad()
    def _rollout(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingConfig) -> Rollout:
        with dist.unwrap_for_generation(self.wrapper, self.accelerator, self.args.ds3_gather_for_generation) as w:
            with generation_mode(w.lm), self._autocast():
                return generate(
                    w.lm,
                    prompt_ids,
                    prompt_mask,
                    sampling,
                    pad_token_id=self.tokenizer.pad_token_id,
                    batch_size=self.args.local_rollout_forward_batch_size,
                    generator=self.generator,
                    return_logprobs=False,
                )

    def _score(self, rollout: Rollout, batch: dict) -> torch.Tensor:
        columns = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "prompt")}
        completions = decode_completions(self.tokenizer, rollout) if self.reward.funcs else []
        with self._autocast():
            return self.reward(rollout, batch.get("prompt", []), completions, columns or None).float()

    def train(self) -> dict[str, float]:
        """Run the whole training (resuming if asked) and save; returns the last logged metrics."""
        if self.step_api:
            raise ConfigError(
                "this trainer was built with config= for generate()/step(); build it with args= to train()."
            )
        from posttrain import checkpoint as ckpt
        from posttrain.health import oom_advice

        cfg, run = self.args, self.run
        logged: dict[str, float] = {}
        with ckpt.OutputDirGuard(cfg.output_dir, is_main=run.is_main), oom_advice():
            extra = run.maybe_resume(self._checkpoint_models(), self.optimizer, self.lr_scheduler)
            if extra:
                self.kl_ctl.load_state_dict(extra["kl_ctl"])
                self.running.load_state_dict(extra["running_moments"])
            micro, accum = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
            for update in run.updates():
                batch = run.next_batch()
                rollout = self._rollout(batch["input_ids"], batch["attention_mask"], run.sampling)
                with torch.no_grad():
                    scores = self._score(rollout, batch)
                # The β that shapes this batch's rewards (as step() reports it), read before the
                # adaptive controller moves it at the end of _optimize.
                kl_coef = self.kl_ctl.value
                self._optimize(rollout, scores, micro, accum, cfg.num_mini_batches)
                lr = self.lr_scheduler.get_last_lr()[0]
                self.lr_scheduler.step()
                if run.should_log(update):
                    logged = run.log(update, {"lr": lr, "objective/kl_coef": kl_coef})
                    for cb in self.callbacks:
                        if hasattr(cb, "on_log"):
                            cb.on_log(cfg, run.state, None, logs=logged)
                if run.should_sample(update):
                    self._sample_table(update)
                if run.should_save(update):
                    run.save(self._checkpoint_models(), self.optimizer, self.lr_scheduler, extra=self._extra_state())
            w = dist.unwrap(self.wrapper, self.accelerator)
            # Policy at the top of output_dir (plain transformers loads it); the critic in
            # output_dir/value_model, or value_head.safetensors beside the policy for a value head.
            run.finish(w.policy, None if w.shared else {"value_model": w.critic})
        return logged

    def _sample_table(self, update: int) -> None:
        """The (query, model response, score) table of one eval batch, greedy decoding."""
        run = self.run
        batch = run.eval_prompts(self.args.per_device_eval_batch_size)
        greedy = SamplingConfig(
            max_new_tokens=self.args.response_length,
            temperature=0.0,
            do_sample=False,
            stop_token_ids=run.sampling.stop_token_ids,
        )
        rollout = self._rollout(batch["input_ids"], batch["attention_mask"], greedy)
        with torch.no_grad():
            scores = self._score(rollout, batch).tolist()
        completions = decode_completions(self.tokenizer, rollout)
        rows = [{"query": q, "model response": c, "score": s} for q, c, s in zip(batch["prompt"], completions, scores)]
        run.sample_table(update, rows)

    # -- low level: generate() / step() / log_stats() --------------------------------------------
    def _sampling(self, kwargs: dict, max_new_tokens: int | None) -> SamplingConfig:
        unknown = sorted(set(kwargs) - _GENERATION_KWARGS)
        if unknown or (kwargs.get("min_length") or -1) > 0:
            raise ConfigError(
                f"generate() does not support {unknown or ['min_length > 0']}; supported generation kwargs: "
                f"{', '.join(sorted(_GENERATION_KWARGS))} (min_length only as -1/0/None)."
            )
        eos = kwargs.get("eos_token_id", self.tokenizer.eos_token_id)
        stops = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        return SamplingConfig(
            max_new_tokens=max_new_tokens or kwargs.get("max_new_tokens") or self.args.response_length,
            temperature=float(kwargs.get("temperature", 1.0)),
            top_k=int(kwargs.get("top_k", 0) or 0),
            top_p=float(kwargs.get("top_p", 1.0)),
            do_sample=bool(kwargs.get("do_sample", True)),
            stop_token_ids=stops,
        )

    def _left_pad(self, queries: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(q) for q in queries)
        ids = torch.full((len(queries), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(queries), width, dtype=torch.bool)
        for i, q in enumerate(queries):
            ids[i, width - len(q) :], mask[i, width - len(q) :] = q.long().cpu(), True
        return ids.to(self.device), mask.to(self.device)

    @torch.no_grad()
    def generate(
        self,
        query_tensor: torch.Tensor | list[torch.Tensor],
        length_sampler: Callable | None = None,
        batch_size: int = 4,
        return_prompt: bool = True,
        generate_ref_response: bool = False,
        **generation_kwargs: Any,
    ):
        """Sample responses (classic API): a 1-D query tensor gives a (1, L) tensor; a list gives a
        list of 1-D tensors without padding, each cut after its stop token (kept). With
        `generate_ref_response=True` the reference model's responses are returned too.
        Generation kwargs: max_new_tokens, temperature (1.0), top_k (0), top_p (1.0), do_sample,
        eos_token_id (default the tokenizer's; None = no stop), pad_token_id; `length_sampler()`
        draws max_new_tokens per batch."""
        single = isinstance(query_tensor, torch.Tensor)
        if single and query_tensor.dim() != 1:
            raise ValueError(
                f"generate() takes a 1-D query tensor or a list of them, got shape {tuple(query_tensor.shape)}."
            )
        queries = [query_tensor] if single else list(query_tensor)
        models = [self._lm()] + ([self.ref_model or self._lm()] if generate_ref_response else [])
        results: list[list[torch.Tensor]] = [[] for _ in models]
        for s in range(0, len(queries), batch_size):
            part = queries[s : s + batch_size]
            ids, mask = self._left_pad(part)
            sampling = self._sampling(generation_kwargs, length_sampler() if length_sampler is not None else None)
            for k, model in enumerate(models):
                ctx = model.disable_adapter() if k == 1 and self.ref_model is None else contextlib.nullcontext()
                with generation_mode(model), ctx, self._autocast():
                    r = generate(
                        model, ids, mask, sampling, pad_token_id=self.tokenizer.pad_token_id, generator=self.generator
                    )
                for q, c, n in zip(part, r.completion_ids, r.completion_lengths.tolist()):
                    results[k].append(torch.cat([q.to(c.device).long(), c[:n]]) if return_prompt else c[:n])
        if single:
            results = [[r[0][None, :]] for r in results]
            return (results[0][0], results[1][0]) if generate_ref_response else results[0][0]
        return (results[0], results[1]) if generate_ref_response else results[0]

    def _step_rollout(self, queries, responses, response_masks) -> tuple[Rollout, torch.Tensor | None]:
        """(rollout, loss_mask). The rollout's completion_mask covers every response token: it is
        also the attention mask, and a token left out of the loss (response_masks 0, e.g. a tool's
        output) is still context for the tokens after it (classic TRL multiplies response_masks into
        the loss mask only). loss_mask = completion_mask ∧ response_masks, None without masks."""
        prompt_ids, prompt_mask = self._left_pad(queries)
        lengths = torch.tensor([len(r) for r in responses], dtype=torch.long, device=self.device)
        T = int(lengths.max())
        ids = torch.full((len(responses), T), self.tokenizer.pad_token_id, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(responses), T, dtype=torch.bool, device=self.device)
        loss_mask = None if response_masks is None else torch.zeros_like(mask)
        for i, r in enumerate(responses):
            ids[i, : len(r)] = r.long().to(self.device)
            mask[i, : len(r)] = True
            if loss_mask is not None:
                loss_mask[i, : len(r)] = torch.as_tensor(response_masks[i]).bool().to(self.device)
        eos = self.tokenizer.eos_token_id
        ended = torch.tensor([eos is not None and int(r[-1]) == eos for r in responses], device=self.device)
        return Rollout(
            prompt_ids, prompt_mask, ids, mask, lengths, ended, None, None, self.tokenizer.pad_token_id
        ), loss_mask

    def step(
        self,
        queries: list[torch.Tensor],
        responses: list[torch.Tensor],
        scores: list[torch.Tensor],
        response_masks: list[torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """One PPO optimisation on (query, response, score) triples from any source (classic API).

        Lists of 1-D token tensors (ragged), one score per pair (0-d / 1-element tensor or number),
        optional 0/1 masks over each response's tokens (0 = not trained on, e.g. tool output).
        Rows per optimizer step = mini_batch_size × gradient_accumulation_steps; returns the
        statistics named in trl-notes §2.4, reduced over all processes."""
        cfg = self.args
        if not self.step_api:
            raise ConfigError(
                "step() is the classic API: build the trainer with config= (train() runs the whole loop)."
            )
        n = len(queries)
        for name, value in (("queries", queries), ("responses", responses), ("scores", scores)) + (
            (("response_masks", response_masks),) if response_masks is not None else ()
        ):
            if not isinstance(value, (list, tuple)) or len(value) != n:
                raise ValueError(
                    f"step(): {name} must be a list of {n} tensors (one per query), got {type(value).__name__} "
                    f"of length {len(value) if hasattr(value, '__len__') else '?'}."
                )
        if cfg.step_batch_size is not None and n != cfg.step_batch_size:
            raise ValueError(
                f"step() got {n} queries but config.batch_size = {cfg.step_batch_size}; pass exactly batch_size rows."
            )
        for i, (q, r) in enumerate(zip(queries, responses)):
            if not (
                isinstance(q, torch.Tensor)
                and q.dim() == 1
                and len(q)
                and isinstance(r, torch.Tensor)
                and r.dim() == 1
                and len(r)
            ):
                raise ValueError(f"step(): queries[{i}] and responses[{i}] must be non-empty 1-D token tensors.")
            if response_masks is not None and (
                len(response_masks[i]) != len(r) or not bool(torch.as_tensor(response_masks[i]).any())
            ):
                raise ValueError(
                    f"step(): response_masks[{i}] must have len(responses[{i}]) = {len(r)} entries, at least one 1."
                )
        for i, s in enumerate(scores):
            # One number per pair (classic TRL: 0-d or 1-element); taking element 0 of a longer
            # tensor would silently train on the wrong reward.
            t = torch.as_tensor(s)
            if t.numel() != 1 or t.dim() > 1:
                raise ValueError(
                    f"step(): scores[{i}] must be a 0-d or 1-element tensor (one score per response), "
                    f"got shape {tuple(t.shape)}."
                )
        score_t = torch.tensor(
            [float(torch.as_tensor(s).reshape(-1)[0]) for s in scores], dtype=torch.float32, device=self.device
        )
        if not bool(torch.isfinite(score_t).all()):
            raise ValueError(f"step(): scores must be finite, got {score_t.tolist()}.")
        micro = cfg.step_mini_batch_size or n
        if n % (micro * cfg.gradient_accumulation_steps):
            raise ConfigError(
                f"step(): {n} rows must be divisible by mini_batch_size {micro} × gradient_accumulation_steps "
                f"{cfg.gradient_accumulation_steps} (rows per optimizer step)."
            )
        started, kl_coef = time.time(), self.kl_ctl.value
        rollout, loss_mask = self._step_rollout(queries, responses, response_masks)
        self.metrics.reset()
        self._optimize(
            rollout,
            score_t,
            micro,
            cfg.gradient_accumulation_steps,
            n // (micro * cfg.gradient_accumulation_steps),
            loss_mask=loss_mask,
        )
        values = self.metrics.reduce(self.accelerator)
        self.metrics.reset()
        lr = self.optimizer.param_groups[0]["lr"]
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.current_step += 1
        stats = {name: values[key] for name, key in STEP_STATS.items() if key in values}
        scores_var = values["objective/scores_var"]
        stats["ppo/std_scores"] = math.sqrt(scores_var) if math.isfinite(scores_var) else 0.0
        stats["ppo/val/var_explained"] = (
            1.0 - values["val/error"] / values["returns/var"] if values["returns/var"] else math.nan
        )
        stats["objective/kl_coef"] = kl_coef
        stats["ppo/learning_rate"] = lr
        stats["time/ppo/total"] = time.time() - started
        return stats

    def log_stats(
        self, stats: dict, batch: dict, rewards: list, columns_to_log: Sequence[str] = ("query", "response")
    ) -> None:
        """Write step() statistics (plus env/reward_mean, env/reward_std) to the console, metrics.jsonl
        and report_to sinks, and a `game_log` table of `columns_to_log` + reward (classic API)."""
        rewards_t = torch.tensor([float(torch.as_tensor(r).reshape(-1)[0]) for r in rewards], device=self.device)
        everyone = dist.gather(rewards_t, self.accelerator)
        if self.tracker is None:
            self.tracker = Tracker(
                self.args.output_dir,
                self.args.report_to,
                config=self.args.to_dict(),
                run_name=self.args.run_name,
                is_main=dist.is_main(self.accelerator),
            )
        values = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
        values["env/reward_mean"] = float(everyone.mean())
        values["env/reward_std"] = float(everyone.std()) if everyone.numel() > 1 else 0.0
        self.tracker.log(values, step=self.current_step)
        columns = [c for c in columns_to_log if c in batch]
        if columns:
            rows = [{**{c: batch[c][i] for c in columns}, "reward": float(rewards_t[i])} for i in range(len(rewards_t))]
            self.tracker.log_table("game_log", rows, step=self.current_step)

    def save_pretrained(self, save_directory: str) -> None:
        """Save the value-head model (LM + value_head.safetensors) and the tokenizer (classic API)."""
        if dist.is_main(self.accelerator):
            dist.unwrap(self.wrapper, self.accelerator).policy.save_pretrained(save_directory)
            self.tokenizer.save_pretrained(save_directory)


def run(config: PPOConfig) -> int:
    """`posttrain ppo`: load tokenizer, policy, reference, reward and data from the config, train, save."""
    from posttrain import checkpoint as ckpt
    from posttrain.data import DataError
    from posttrain.models import load_policy, load_reward_model, load_tokenizer, peft_config_from
    from posttrain.trainers.common import import_callable, load_split
    from posttrain.trainers.supervised import check_output_dir

    try:
        check_output_dir(config)
        if not config.sft_model_path:
            raise ConfigError("sft_model_path (or model_name_or_path) is not set: pass the policy to start from.")
        if not config.reward_model_path and not config.reward_funcs:
            raise ConfigError("no reward: pass --reward_model_path (a reward model) or --reward_funcs (import paths).")
        tokenizer = load_tokenizer(config.model_name_or_path, trust_remote_code=config.trust_remote_code)
        train_dataset = load_split(config, config.dataset_train_split)
        eval_dataset = load_split(config, config.dataset_test_split, required=False)

        def policy():
            return load_policy(
                config.sft_model_path,
                dtype=config.torch_dtype,
                trust_remote_code=config.trust_remote_code,
                disable_dropout=config.disable_dropout,
                gradient_checkpointing=config.gradient_checkpointing,
                tokenizer=tokenizer,
            )

        rewards: list[Any] = [import_callable(path) for path in config.reward_funcs or []]
        reward_tokenizer = None
        if config.reward_model_path:
            reward_tokenizer = load_tokenizer(config.reward_model_path, trust_remote_code=config.trust_remote_code)
            rewards.insert(
                0,
                load_reward_model(
                    config.reward_model_path,
                    dtype=config.torch_dtype,
                    trust_remote_code=config.trust_remote_code,
                    tokenizer=reward_tokenizer,
                ),
            )
        peft_config = peft_config_from(config)
        # With LoRA the reference is the base model with the adapter disabled: no second copy is loaded.
        trainer = PPOTrainer(
            args=config,
            processing_class=tokenizer,
            model=policy(),
            ref_model=None if peft_config is not None else policy(),
            peft_config=peft_config,
            reward_model=rewards if len(rewards) > 1 else rewards[0],
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            reward_processing_class=reward_tokenizer,
        )
        trainer.train()
    except (ConfigError, DataError, ckpt.CheckpointError) as err:
        print(f"posttrain ppo: {err}", file=sys.stderr)
        return 2
    return 0
