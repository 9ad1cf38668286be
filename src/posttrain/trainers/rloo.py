"""REINFORCE leave-one-out (RLOO), as TRL's on-policy `RLOOTrainer`.

No value function: each prompt gets rloo_k completions, and each completion is baselined by the
mean reward of the other k − 1 (Ahmadian et al. 2024, "Back to Basics"). A whole completion is
one action. REINFORCE / A2C is the special case num_ppo_epochs = 1, num_mini_batches = 1.

One rollout batch (`update`), per rank, with P = prompts_per_rollout prompts and k = rloo_k:

1. Rollout. The P prompts are repeated k times as blocks (TRL's `queries.repeat(rloo_k, 1)`), so
   row i·P + p is sample i of prompt p. Completions stop at EOS / stop_token_id (kept); masks come
   from lengths (rollout.py).
2. Score. s = Σ_f w_f·r_f over the rewards r_f (reward models scored at the last real token, reward
   functions f(prompt, completion)), w = reward_weights (default 1); a function's None (it does not
   apply to that row) is left out of the sum, as TRL's nansum; a row no reward scores gets TRL's warning
   and is left out of step 4's baseline with advantage 0, as TRL 1.x (a TRL >= 0.21-style call
   passes conversational prompts and completions as messages, as TRL 1.x);
   s −= missing_eos_penalty where no stop token was produced (scoring.RewardSource).
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
   L = Σ_seq max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high)) / N_seq (ε_low = cliprange, ε_high =
   epsilon_high or cliprange: TRL 1.x / DAPO's clip-higher), N_seq = sequences in the minibatch over
   all ranks (losses.ppo_policy_loss, level="sequence"). log π_old comes from a no-grad pass in the
   same mode and micro-batches as the first minibatch of the first epoch, so ρ = 1 exactly there;
   with one epoch and one minibatch it is the update forward's own detached value (no extra pass),
   and ∇L = −Σ A·∇log π_θ / N: REINFORCE with the leave-one-out baseline.
   mask_truncated_completions (TRL 1.x): completions without a stop token get no gradient (their
   tokens are off the mask of ρ, grpo_losses.truncation_loss_mask) but still count in N_seq.
   The learning-rate schedule steps once per rollout batch over num_total_batches (as TRL).

Metrics (masked, count-weighted across micro-batches and ranks; names as TRL's):
  objective/scores            mean s (after missing_eos_penalty, before normalize_reward)
  reward, reward_std          mean and std of Σ_f w_f·r_f over the global batch (TRL >= 0.21's names;
                              before missing_eos_penalty and the KL term)
  rewards/<name>/mean, rewards/<name>/std   each reward's own (unweighted) mean and std over the
                              rows it applies to (TRL >= 0.21's names)
  objective/kl                mean over sequences of Σ_t kl_t
  objective/entropy           mean over sequences of Σ_t −log π(y_t) (sampled-token NLL of the
                              rollout, ≥ 0; TRL counted padding as INVALID_LOGPROB = 1 and could go
                              negative, huggingface/trl#2281)
  objective/non_score_reward  mean of −kl_coef·Σ_t kl_t
  objective/rlhf_reward       mean rlhf_reward = s + non_score_reward (TRL's documentation writes
                              "score − non_score_reward"; TRL's code, and this one, add the negative term)
  policy/approxkl_avg         mean over updated sequences of ½·(log ρ)²
  policy/clipfrac_avg         fraction of updated sequences whose clipped term was the max
  clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean   fraction of updated sequences
                              with ρ < 1 − ε_low and A < 0 / ρ > 1 + ε_high and A > 0 / either
                              (TRL 1.x's names)
  loss/policy_avg             mean per-sequence clipped loss
  policy/entropy_avg          token-weighted mean entropy −Σ_v π log π of the update forward
  val/ratio, val/ratio_var    mean and unbiased variance of the sequence ratio ρ that is clipped
                              (TRL reports the token ratio)
  val/clipfrac_avg            0: RLOO has no value function (TRL logs the same constant)
  val/num_eos_tokens          completions that ended on a stop token (sum over ranks)
  completions/mean_length, lr, episode, eps, epoch

The plumbing (loading, the update loop, the non-finite policy, logging, sample tables,
checkpoints) is the online skeleton, trainers/online.py.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from posttrain import advantages as adv
from posttrain import distributed as dist
from posttrain.configs import ConfigError
from posttrain.grpo_losses import truncation_loss_mask
from posttrain.losses import ppo_policy_loss
from posttrain.rollout import Rollout
from posttrain.scoring import RewardSource, resolve_router_aux_loss_coef, router_aux_loss_enabled
from posttrain.trainers import online
from posttrain.trainers.online import (
    OnlineTrainer,
    default_config,
    load_parts,
    policy_update,
    prepare_policy,
    sample_and_score,
    score,
)
from posttrain.trainers.rloo_config import RLOOConfig

# The same argument under TRL 0.19's name and TRL >= 0.21's.
RENAMED_ARGUMENTS = {
    "config": "args",
    "policy": "model",
    "reward_model": "reward_funcs",
    "reward_processing_class": "reward_processing_classes",
}


def _trl_019_call(
    config: RLOOConfig | None = None,
    processing_class: Any = None,
    policy: nn.Module | str | None = None,
    ref_policy: nn.Module | str | None = None,
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
    model: nn.Module | str | None = None,
    reward_funcs: Any = None,
    args: RLOOConfig | None = None,
    reward_processing_classes: Any = None,
) -> dict[str, Any]:
    """The arguments of a call in TRL 0.19's positional order (the TRL >= 0.21 names as keywords)."""
    return dict(locals())


def _trl_1x_call(
    model: nn.Module | str | None = None,
    reward_funcs: Any = None,
    args: RLOOConfig | None = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    processing_class: Any = None,
    reward_processing_classes: Any = None,
    callbacks: Sequence[Any] | None = None,
    optimizers: tuple[Any, Any] = (None, None),
    *,
    peft_config: Any = None,
    config: RLOOConfig | None = None,
    policy: nn.Module | str | None = None,
    ref_policy: nn.Module | str | None = None,
    reward_model: Any = None,
    data_collator: Callable | None = None,
    tokenizer: Any = None,
    reward_processing_class: Any = None,
    accelerator: Any = None,
) -> dict[str, Any]:
    """The arguments of a call in TRL >= 0.21's positional order (model, reward_funcs, args, ...)."""
    return dict(locals())


def trainer_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """RLOOTrainer's arguments by their TRL 0.19 names, from a call in either TRL's form.

    A first positional argument that is a model (nn.Module) or a model name / path selects TRL >= 0.21's
    positional order; anything else TRL 0.19's. TRL >= 0.21's keywords (model, reward_funcs, args,
    reward_processing_classes) are accepted in both; one argument under both names is a TypeError.
    reward_processing_classes may be a list aligned with reward_funcs (None: that reward model's own tokenizer).
    `trl_1x`: whether the call was TRL >= 0.21's (its positional order or any of its keywords)."""
    first = args[0] if args else None
    call = _trl_1x_call if isinstance(first, (str, os.PathLike, nn.Module)) else _trl_019_call
    values = call(*args, **kwargs)
    values["trl_1x"] = call is _trl_1x_call or any(values[new] is not None for new in RENAMED_ARGUMENTS.values())
    for old, new in RENAMED_ARGUMENTS.items():
        if values[old] is not None and values[new] is not None:
            raise TypeError(
                f"RLOOTrainer got both {old}= (TRL 0.19's name) and {new}= (TRL >= 0.21's name) for the same "
                "argument; give only one."
            )
    classes = values.pop("reward_processing_classes")  # one per reward (online.load_parts)
    if classes is not None and not isinstance(classes, (list, tuple)):
        classes = [classes]  # TRL >= 0.21: one tokenizer is a list of one
    if classes is not None:
        values["reward_processing_class"] = classes
    values["config_name"] = "args" if values["args"] is not None else "config"
    for old in ("config", "policy", "reward_model"):
        new = values.pop(RENAMED_ARGUMENTS[old])
        if new is not None:
            values[old] = new
    return values


class RLOOTrainer(OnlineTrainer):
    """TRL's RLOO trainer, called the way TRL 0.19 or TRL >= 0.21 calls it, then `.train()`:

    - TRL 0.19: `RLOOTrainer(config, processing_class, policy, ref_policy, reward_model, train_dataset,
      data_collator=None, eval_dataset=None, optimizers=(None, None), callbacks=None)`;
    - TRL >= 0.21: `RLOOTrainer(model, reward_funcs, args=None, train_dataset=None, eval_dataset=None,
      processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
      peft_config=None)`, with `RLOOConfig(num_generations=..., beta=..., ...)` (rloo_config.py maps
      those names onto TRL 0.19's). model / reward_funcs / args are policy / reward_model / config
      (`trainer_arguments`); both names of one argument is a TypeError.

    policy / ref_policy: modules, hub ids or folders (None: config.sft_model_path). reward_model: a
    sequence-classification reward model (nn.Module or path), a text reward function
    `f(prompts, completions, **columns) -> list[float]`, TRL's one-argument form `f(texts) -> list[float]`
    (texts = prompt + completion, special tokens skipped; trl#2612), or a list of them (summed, weighted
    by reward_weights); None reads config.reward_model_path / reward_funcs. ref_policy None with
    kl_coef > 0: a frozen copy of the initial policy, or with `peft_config` (a peft.LoraConfig: only the
    adapter trains) the policy with its adapter disabled. `tokenizer=` is accepted for `processing_class` (TRL <= 0.11),
    `reward_processing_class=` (TRL >= 0.21: `reward_processing_classes=`, one per reward)
    when the reward model has its own tokenizer (texts are re-tokenized), `accelerator=` to share one.
    callbacks: `transformers.TrainerCallback` objects (trainers/online.py, `OnlineTrainer`: the events,
    `trainer.state`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        a = trainer_arguments(args, kwargs)
        config, policy, processing_class = a["config"], a["policy"], a["processing_class"]
        if config is None:
            config = default_config(RLOOConfig, policy, "RLOO")
        if not isinstance(config, RLOOConfig):
            raise ConfigError(f"{a['config_name']} must be an RLOOConfig, got {type(config).__name__}.")
        online.check_reference_sync(config, a["peft_config"])
        self.use_reference = config.kl_coef > 0
        parts = load_parts(
            config,
            model=policy,
            ref_model=a["ref_policy"],
            rewards=a["reward_model"],
            processing_class=processing_class if processing_class is not None else a["tokenizer"],
            reward_processing_class=a["reward_processing_class"],
            train_dataset=a["train_dataset"],
            eval_dataset=a["eval_dataset"],
            peft_config=a["peft_config"],
            needs_reference=self.use_reference,
        )
        policy, self.ref_model = prepare_policy(
            parts.policy,
            parts.reference,
            config,
            peft_config=parts.peft_config,
            needs_reference=self.use_reference,
            accelerator=a["accelerator"],
        )
        self.wrapped = self.setup(
            config,
            parts.tokenizer,
            policy,
            train_dataset=parts.train_dataset,
            eval_dataset=parts.eval_dataset,
            data_collator=a["data_collator"],
            optimizers=a["optimizers"],
            callbacks=a["callbacks"],
            position_limits=parts.position_limits,
            accelerator=a["accelerator"],
        )
        self.ref_model = dist.prepare_frozen(self.ref_model, self.accelerator)
        online.sync_reference(self)
        self.reward_processing_classes = parts.reward_processing_classes
        # a mixture-of-experts policy adds its router load-balancing loss (router_aux_loss_coef), as TRL 1.9
        resolve_router_aux_loss_coef(config, self.policy_model)  # None: the model config's own
        self.aux_loss_enabled = router_aux_loss_enabled(self.policy_model, config.router_aux_loss_coef)
        self.reward = self.reward_source(parts.rewards, parts.reward_tokenizers)
        # TRL >= 0.21 passes reward functions a conversational prompt's messages and the completion as
        # [{"role": "assistant", "content": text}]; TRL 0.19's reward callables got texts.
        self.reward.messages = a["trl_1x"]

    @classmethod
    def from_config(cls, config: RLOOConfig) -> RLOOTrainer:
        return cls(config)

    @property
    def policy(self) -> nn.Module:
        return self.policy_model

    def train(self) -> Any:
        """Run to total_episodes (resuming if asked); save the policy; return a transformers TrainOutput."""
        config, run, metrics, k = self.args, self.run, self.run.metrics, self.args.rloo_k
        with self.training():
            for update in run.updates():
                # 1-2. rollout k completions per prompt (k blocks of P prompts) and score them
                exp = sample_and_score(
                    run,
                    self.wrapped,
                    self.ref_model,
                    self.reward,
                    run.next_batch(),
                    k,
                    with_reference=self.use_reference,
                )
                online.log_reward_metrics(run, self.reward, exp.rewards, total=True)
                # 2-4. scores, KL-shaped reward, leave-one-out advantages
                advantages = self.advantages(exp)
                online.log_completions_table(self, update, exp.rollout, exp.rewards, advantages)

                # 5. sequence-level PPO-clip updates
                def loss_fn(
                    rows: torch.Tensor,
                    mb: Rollout,
                    logprobs: torch.Tensor,
                    old_logprobs: torch.Tensor,
                    normalizer: float,
                ) -> torch.Tensor:
                    mask = mb.completion_mask
                    if config.mask_truncated_completions:
                        # TRL 1.x: a truncated completion's ratio is exp(0) = 1, so its term carries no
                        # gradient; it still counts in the sequence normalizer, as TRL's mean does.
                        mask = truncation_loss_mask(mask, mb.ended)
                    loss, stats = ppo_policy_loss(
                        logprobs,
                        old_logprobs,
                        advantages[rows],
                        mask,
                        config.cliprange,
                        config.epsilon_high,
                        level="sequence",
                        normalizer=normalizer,
                    )
                    n = stats["count"]
                    metrics.add("loss/policy_avg", stats["pg_loss"] * n, n)
                    metrics.add("policy/approxkl_avg", stats["approxkl"] * n, n)
                    metrics.add("policy/clipfrac_avg", stats["clipfrac"] * n, n)
                    low, high = stats["clipfrac_low"], stats["clipfrac_high"]
                    metrics.add("clip_ratio/low_mean", low * n, n)
                    metrics.add("clip_ratio/high_mean", high * n, n)
                    metrics.add("clip_ratio/region_mean", (low + high) * n, n)  # disjoint: A < 0 and A > 0
                    with torch.no_grad():
                        log_ratio = ((logprobs - old_logprobs) * mask).sum(-1)
                        metrics.add_mean("val/ratio", log_ratio.exp())
                        metrics.add_var("val/ratio_var", log_ratio.exp())
                    return loss

                policy_update(
                    run,
                    self.wrapped,
                    self.optimizer,
                    exp.rollout,
                    num_epochs=config.num_ppo_epochs,
                    count=lambda rows: rows.numel(),
                    loss_fn=loss_fn,
                    router_aux_loss_coef=config.router_aux_loss_coef if self.aux_loss_enabled else 0.0,
                )
                self.end_of_update(update, {"val/clipfrac_avg": 0.0})
        return self.train_output

    @torch.no_grad()
    def advantages(self, exp: online.Experience, *, training: bool = True) -> torch.Tensor:
        """Steps 2 (clipping or normalizing the scores) to 4 of one rollout batch: its advantages (B,).
        training: statistics over the rows of all ranks, objective/non_score_reward and
        objective/rlhf_reward logged; False (an evaluation): this rank's rows, nothing logged."""
        config, run, k = self.args, self.run, self.args.rloo_k
        moments = run.batch_moments if training else (lambda values: None)
        mask = exp.rollout.completion_mask
        scores = exp.scores
        if isinstance(config.reward_clip_range, tuple):  # TRL >= 0.21: clip the raw rewards
            scores = scores.clamp(*config.reward_clip_range)
        elif config.normalize_reward:
            scores = adv.normalize_rewards(scores, config.reward_clip_range, moments=moments(scores))
        # 3. KL-shaped reward, one number per sequence
        kl = exp.kl if exp.kl is not None else torch.zeros_like(exp.rollout.logprobs)
        shape = adv.token_level_kl_rewards if config.token_level_kl else adv.sequence_kl_rewards
        rlhf_reward, non_score_reward = shape(scores, kl, mask, config.kl_coef)  # (B,), (B,)
        if training:
            run.metrics.add_mean("objective/non_score_reward", non_score_reward)
            run.metrics.add_mean("objective/rlhf_reward", rlhf_reward)
        if config.whiten_rewards:
            everywhere = torch.ones_like(rlhf_reward, dtype=torch.bool)
            rlhf_reward = adv.whiten_rewards(rlhf_reward, everywhere, moments=moments(rlhf_reward))
        # 4. leave-one-out baseline over the explicit (k, num_prompts) grid; a completion no reward
        # scored (every reward function returned None) is left out of it (TRL 1.x)
        scorable = ~torch.isnan(exp.rewards[:, : len(self.reward.names)]).all(-1)
        grid = (k, exp.num_prompts)
        advantages = adv.rloo_advantages(rlhf_reward.view(grid), scorable.view(grid)).flatten()  # (B,)
        if config.normalize_advantage:
            advantages = adv.normalize_advantages(advantages, moments=moments(advantages))
        return advantages

    @torch.no_grad()
    def eval_loss(self, batch: dict, generator: torch.Generator) -> torch.Tensor:
        """TRL's eval_loss: step 5's loss (without the MoE router loss) on rloo_k completions of each
        prompt of `batch`, sampled with `generator` and scored and advantaged as in training (this
        batch's statistics), at the policy that sampled them (ratio 1)."""
        config = self.args
        exp = sample_and_score(
            self.run,
            self.wrapped,
            self.ref_model,
            self.reward,
            batch,
            config.rloo_k,
            with_reference=self.use_reference,
            generator=generator,
            log_metrics=False,
        )
        mask = exp.rollout.completion_mask
        if config.mask_truncated_completions:
            mask = truncation_loss_mask(mask, exp.rollout.ended)
        logprobs = exp.rollout.logprobs
        loss, _ = ppo_policy_loss(
            logprobs,
            logprobs,
            self.advantages(exp, training=False),
            mask,
            config.cliprange,
            config.epsilon_high,
            level="sequence",
        )
        return loss

    def reward_source(self, rewards: list[Any], reward_tokenizers: list[Any]) -> RewardSource:
        """The reward models (in eval mode on the run's device) and functions, TRL RLOO's one-argument
        callables adapted."""
        return RewardSource(
            [full_text_reward(dist.prepare_frozen(r, self.accelerator)) for r in rewards],
            policy_tokenizer=self.processing_class,
            reward_tokenizer=reward_tokenizers,
            weights=self.args.reward_weights,
            batch_size=self.args.local_rollout_forward_batch_size,
            missing_eos_penalty=self.args.missing_eos_penalty,
        )

    def checkpoint_models(self) -> dict[str, nn.Module]:
        """The policy, and with sync_ref_model the reference it moves (a resume must restore both)."""
        if self.args.sync_ref_model:
            return {"policy": self.policy_model, "ref_model": self.ref_model}
        return {"policy": self.policy_model}

    def table_scores(self, rollout: Rollout, batch: dict) -> torch.Tensor:
        return score(self.run, self.reward, rollout, batch, 1)


# help(RLOOTrainer) / IDEs: TRL 0.19's positional order with TRL >= 0.21's keywords.
RLOOTrainer.__init__.__signature__ = inspect.signature(_trl_019_call).replace(  # type: ignore[attr-defined]
    parameters=[
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *inspect.signature(_trl_019_call).parameters.values(),
    ],
    return_annotation=None,
)


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


def main(config: RLOOConfig) -> int:
    """`posttrain rloo`: policy, reference, reward and prompts from the config; train."""
    return online.run_command(RLOOTrainer, config)
