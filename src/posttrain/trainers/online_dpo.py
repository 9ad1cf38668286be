"""Online DPO: DPO on pairs the policy samples itself, ranked by a reward model, reward functions
or a pairwise judge (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback";
TRL's `OnlineDPOTrainer`, trl-notes §5).

Per rollout batch:
  1. draw prompts; sample two completions per prompt from the policy (rows 2i, 2i+1 = pair i);
  2. rank each pair: scores from the reward model / reward functions (missing-EOS penalty judged on
     the completion only), ties to the first completion as TRL; or a pairwise judge, whose -1
     failures drop that pair from the loss and are counted (`judge/failures`);
  3. reference log-probs of both completions (the reference model, or the PEFT model with its
     adapter disabled);
  4. `num_mini_batches` optimizer steps over the pairs: DPO ("sigmoid") or IPO loss on summed
     completion log-probs at temperature 1 (TRL does not divide by the sampling temperature here),
     normalised by the GLOBAL number of valid pairs of the minibatch, so batch 1 × GA 4 == 4 × 1;
  5. log masked metrics.

Reward functions and judges see each prompt as the policy sees it (chat template applied for
conversational datasets) and the completion decoded without special tokens.

The pieces XPO shares (models and reference, feedback and ranking, sampling, the pair update loop,
the per-sequence metrics) are the module-level functions below; `xpo.py` imports them.

Metrics (trl-notes §5 names; per completion sums run over real completion tokens only, so padding
never enters them — TRL summed padded positions into objective/kl and entropy, TRL#6803):
  objective/kl               mean over completions of Σ_t (log π(y_t) − log π_ref(y_t))
  objective/entropy          mean over completions of −Σ_t log π(y_t) (sampled-token estimate, ≥ 0)
  objective/non_score_reward mean of −β·KL_seq
  objective/rlhf_reward      mean of score − β·KL_seq                (scores only, not with a judge)
  objective/scores           mean score of all completions            (scores only)
  objective/scores_margin    mean over pairs of score_chosen − score_rejected (scores only)
  rewards/chosen|rejected    mean of β·(log π − log π_ref) summed over the chosen / rejected completion
  rewards/margins            mean of chosen − rejected implicit reward
  rewards/accuracies         fraction of pairs with chosen implicit reward > rejected
  logps/chosen|rejected      mean summed policy log-prob of the chosen / rejected completion
  loss/dpo                   mean per-pair loss
  val/contain_eos_token      fraction of completions that ended on a stop token
  judge/failures             pairs the judge failed on (sum since the last log; judge only)
  beta, lr, episode, eps
rewards/*, logps/* and loss/dpo cover the valid pairs only; all are count-weighted over
micro-batches, logging steps and ranks (MetricAccumulator).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posttrain import distributed as dist
from posttrain.configs import ConfigError
from posttrain.losses import dpo_loss
from posttrain.rollout import Rollout, decode_completions, generate, generation_mode
from posttrain.scoring import batched_completion_logprobs, completion_logprobs
from posttrain.trainers.common import (
    OnlineRun,
    RewardSource,
    build_optimizer,
    build_scheduler,
    clip_and_step,
    global_normalizer,
    import_callable,
    load_split,
    no_sync_unless_last,
    reference_policy,
)
from posttrain.trainers.online_dpo_config import OnlineDPOConfig


# ---------------------------------------------------------------------------------------------
# models and the reference policy
# ---------------------------------------------------------------------------------------------
def prepare_models(
    model: Any, ref_model: Any, tokenizer: Any, config: OnlineDPOConfig, peft_config: Any = None
) -> tuple[nn.Module, nn.Module | None]:
    """(policy, reference); reference None means "the policy with its PEFT adapter disabled".

    `model` / `ref_model` may be modules or paths. Without a reference model and without PEFT the
    reference is a frozen copy of the initial policy (TRL's create_reference_model).
    """
    from posttrain import models

    def load(m: Any) -> nn.Module:
        if isinstance(m, str):
            return models.load_policy(
                m,
                dtype=config.torch_dtype,
                trust_remote_code=config.trust_remote_code,
                disable_dropout=config.disable_dropout,
                tokenizer=tokenizer,
            )
        if config.disable_dropout:
            models.disable_dropout(m)
        return m

    if model is None:
        raise ConfigError("model is required: pass a causal LM or its path (--model_name_or_path).")
    model = load(model)
    model = models.apply_peft(model, peft_config)
    if ref_model is None and not models.is_peft_model(model):
        ref_model = copy.deepcopy(model)
    if ref_model is not None:
        ref_model = load(ref_model).eval().requires_grad_(False)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, ref_model


# ---------------------------------------------------------------------------------------------
# feedback: scores or a pairwise judge
# ---------------------------------------------------------------------------------------------
@dataclass
class Ranking:
    """Outcome of ranking B pairs laid out as rows (2i, 2i+1)."""

    first_wins: torch.Tensor  # (B,) bool: row 2i is the chosen completion
    valid: torch.Tensor  # (B,) bool: False where the judge failed (-1)
    scores: torch.Tensor | None  # (2B,) per-row scores, None with a judge


class Feedback:
    """Preferences from a `RewardSource` (reward model and/or functions) or from a pairwise judge."""

    def __init__(self, reward: RewardSource | None = None, judge: Any = None) -> None:
        self.reward, self.judge = reward, judge

    def rank(
        self, rollout: Rollout, prompts: list[str], completions: list[str], columns: dict[str, list] | None = None
    ) -> Ranking:
        """Rank pairs (rows 2i, 2i+1) given per-row prompt and completion texts."""
        device = rollout.completion_ids.device
        if self.judge is not None:
            pairs = [[a, b] for a, b in zip(completions[0::2], completions[1::2])]
            answers = torch.tensor(self.judge.judge(prompts[0::2], pairs), dtype=torch.long, device=device)
            return Ranking(first_wins=answers == 0, valid=answers != -1, scores=None)
        scores = self.reward(rollout, prompts, completions, columns)  # (2B,)
        # TRL: mask = first_half >= second_half, a tie goes to the first completion.
        return Ranking(
            first_wins=scores[0::2] >= scores[1::2],
            valid=torch.ones(len(rollout) // 2, dtype=torch.bool, device=device),
            scores=scores,
        )

    # A judge owns its state (e.g. the RNG of its order flips); saving it keeps resume exact.
    def state_dict(self) -> dict:
        return self.judge.state_dict() if hasattr(self.judge, "state_dict") else {}

    def load_state_dict(self, state: dict) -> None:
        if state and hasattr(self.judge, "load_state_dict"):  # {}: a fresh run, nothing to restore
            self.judge.load_state_dict(state)


def build_feedback(
    config: OnlineDPOConfig,
    tokenizer: Any,
    device: torch.device,
    *,
    reward_model: Any = None,
    judge: Any = None,
    reward_funcs: Any = None,
    reward_processing_class: Any = None,
) -> Feedback:
    """Objects passed to the trainer win; otherwise config.judge / reward_model_path / reward_funcs."""
    rewards: list[Any] = []
    if reward_model is not None:
        rewards.extend(reward_model if isinstance(reward_model, (list, tuple)) else [reward_model])
    if reward_funcs is not None:
        rewards.extend(reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs])
    if judge is None and not rewards:
        if config.judge:
            from posttrain.judges import judge_from_spec

            judge = judge_from_spec(config.judge)
        if config.reward_model_path:
            from posttrain.models import load_reward_model, load_tokenizer

            reward_processing_class = load_tokenizer(
                config.reward_model_path, padding_side="right", trust_remote_code=config.trust_remote_code
            )
            rewards.append(
                load_reward_model(
                    config.reward_model_path,
                    dtype=config.torch_dtype,
                    trust_remote_code=config.trust_remote_code,
                    tokenizer=reward_processing_class,
                )
            )
        rewards.extend(import_callable(path) for path in config.reward_funcs or [])
    if judge is not None and rewards:
        raise ConfigError(
            "both a judge and a reward (reward_model / reward_funcs / reward_model_path) are given; "
            "pass one source of preferences."
        )
    if judge is not None:
        if not callable(getattr(judge, "judge", None)):
            raise ConfigError(
                f"judge must be a pairwise judge with a judge(prompts, pairs) method, got {type(judge).__name__}."
            )
        return Feedback(judge=judge)
    if not rewards:
        raise ConfigError(
            "no source of preferences: pass judge= or reward_model= / reward_funcs= "
            "(CLI: --judge, --reward_model_path or --reward_funcs)."
        )
    for r in rewards:
        if isinstance(r, nn.Module):
            r.to(device).eval().requires_grad_(False)
    return Feedback(
        reward=RewardSource(
            rewards,
            policy_tokenizer=tokenizer,
            reward_tokenizer=reward_processing_class,
            weights=config.reward_weights,
            batch_size=config.local_rollout_forward_batch_size,
            missing_eos_penalty=config.missing_eos_penalty,
        )
    )


# ---------------------------------------------------------------------------------------------
# sampling and layout
# ---------------------------------------------------------------------------------------------
def sample(
    run: OnlineRun, model: nn.Module, batch: dict, num_samples: int = 1, generator: torch.Generator | None = None
) -> Rollout:
    """Completions for the batch's prompts from `model` (the policy, or a reference in eval mode)."""
    config = run.config
    with (
        dist.unwrap_for_generation(model, run.accelerator, config.ds3_gather_for_generation) as m,
        generation_mode(m),
        run.autocast(),
    ):
        return generate(
            m,
            batch["input_ids"],
            batch["attention_mask"],
            run.sampling,
            pad_token_id=run.tokenizer.pad_token_id,
            num_samples=num_samples,
            batch_size=config.local_rollout_forward_batch_size,
            generator=run.generator if generator is None else generator,
            return_logprobs=False,
        )


def interleave_pairs(first: Rollout, second: Rollout) -> Rollout:
    """Rows (first_0, second_0, first_1, second_1, ...): pair i at rows 2i, 2i+1."""
    n = len(first)
    order = torch.arange(2 * n, device=first.prompt_ids.device).view(2, n).t().reshape(-1)
    return Rollout.cat([first, second]).select(order)


def truncate_prompts(rollout: Rollout, max_length: int) -> Rollout:
    """Drop the left prompt columns so prompt + completion columns fit in max_length (TRL `_forward`:
    the prompt is truncated from the left for the log-prob passes only)."""
    keep = max_length - rollout.completion_ids.size(1)
    if rollout.prompt_ids.size(1) <= keep:
        return rollout
    out = rollout.select(slice(None))
    out.prompt_ids, out.prompt_mask = rollout.prompt_ids[:, -keep:], rollout.prompt_mask[:, -keep:]
    return out


def row_texts(run: OnlineRun, batch: dict, rollout: Rollout, per_prompt: int) -> tuple[list, list, dict]:
    """Per-row prompt texts, completion texts and extra dataset columns (for rewards and judges)."""
    repeat = lambda values: [v for v in values for _ in range(per_prompt)]  # noqa: E731
    columns = {k: repeat(v) for k, v in batch.items() if k not in ("input_ids", "attention_mask", "prompt")}
    return repeat(batch["prompt"]), decode_completions(run.tokenizer, rollout), columns


@torch.no_grad()
def reference_logps(run: OnlineRun, model: nn.Module, ref_model: nn.Module | None, rollout: Rollout) -> torch.Tensor:
    """Σ_t log π_ref(y_t) per row (2B,), over real completion tokens only."""
    with reference_policy(model, ref_model, run.accelerator) as ref, run.autocast():
        logprobs, _ = batched_completion_logprobs(ref, rollout, batch_size=run.config.local_rollout_forward_batch_size)
    return logprobs.sum(-1)


def sample_completions(
    run: OnlineRun, model: nn.Module, num_prompts: int, feedback: Feedback | None = None
) -> list[dict]:
    """(prompt, completion[, score]) rows for the first eval prompts, sampled with a fixed seed so the
    table is comparable across steps and never moves the training sampler."""
    if run.eval_dataset is None:
        raise ConfigError("sampling completions needs an eval_dataset (--dataset_test_split).")
    batch = run.eval_prompts(num_prompts)
    generator = torch.Generator(device=run.device).manual_seed(run.config.seed)
    rollout = sample(run, model, batch, generator=generator)
    prompts, completions, columns = row_texts(run, batch, rollout, 1)
    rows = [{"prompt": p, "completion": c} for p, c in zip(prompts, completions)]
    if feedback is not None and feedback.reward is not None:
        for row, score in zip(rows, feedback.reward(rollout, prompts, completions, columns).tolist()):
            row["score"] = score
    return rows


# ---------------------------------------------------------------------------------------------
# the update and the metrics
# ---------------------------------------------------------------------------------------------
def schedule_value(values: Sequence[float], epoch: int) -> float:
    """TRL's per-epoch list: values[epoch], the last value once the list runs out."""
    return float(values[min(epoch, len(values) - 1)])


def choose(first: torch.Tensor, second: torch.Tensor, first_wins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) per pair from per-pair values of the first and second completion."""
    return torch.where(first_wins, first, second), torch.where(first_wins, second, first)


PairLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, dict]]


def pair_rows(pairs: torch.Tensor) -> torch.Tensor:
    """Row indices (2i, 2i+1) of pairs i, in pair order."""
    return torch.stack([2 * pairs, 2 * pairs + 1], dim=1).reshape(-1)


def train_on_pairs(
    run: OnlineRun,
    model: nn.Module,
    optimizer: Any,
    scheduler: Any,
    rollout: Rollout,
    valid: torch.Tensor,
    pair_loss: PairLoss,
) -> torch.Tensor:
    """num_mini_batches optimizer steps over the pairs of `rollout` (rows 2i, 2i+1).

    pair_loss(pair_idx, policy_first, policy_second, normalizer) -> (loss, stats) gets the summed
    policy log-probs (with grad) of a micro-batch's pairs; normalizer = global valid pairs of the
    minibatch / world size. A minibatch without any valid pair is skipped; a non-finite loss skips
    its optimizer step (run.loss_is_finite counts it). Returns the detached per-row policy log-prob
    sums of the update forwards (2B,) — every row, judged or not — for the metrics.
    """
    config, acc = run.config, run.accelerator
    num_pairs = len(rollout) // 2
    pairs_per_micro = config.per_device_train_batch_size // 2
    pairs_per_mini = config.local_mini_batch_size // 2
    policy_logps = torch.zeros(len(rollout), device=run.device)
    model.train()
    for start in range(0, num_pairs, pairs_per_mini):
        mini = torch.arange(start, min(start + pairs_per_mini, num_pairs), device=run.device)
        normalizer = global_normalizer(valid[mini].sum(), acc)
        if normalizer * run.world_size < 0.5:
            # No valid pair anywhere: no step, but the KL / entropy metrics still need these rows.
            rows = pair_rows(mini)
            with torch.no_grad(), run.autocast():
                logprobs, _ = batched_completion_logprobs(
                    dist.unwrap(model, acc), rollout.select(rows), batch_size=config.local_rollout_forward_batch_size
                )
            policy_logps[rows] = logprobs.sum(-1)
            continue
        micros = list(mini.split(pairs_per_micro))
        finite = True
        for i, idx in enumerate(micros):
            rows = pair_rows(idx)
            with no_sync_unless_last(acc, model, i == len(micros) - 1):
                with run.autocast():
                    logprobs, _ = completion_logprobs(model, rollout.select(rows))
                seqs = logprobs.sum(-1)  # (2m,)
                policy_logps[rows] = seqs.detach()
                loss, stats = pair_loss(idx, seqs[0::2], seqs[1::2], normalizer)
                # A non-finite loss is not backpropagated and its minibatch takes no step. (Under
                # DDP the check is per rank; a NaN on one rank only would desynchronise the ranks.)
                if not run.loss_is_finite(loss):
                    finite = False
                    continue
                acc.backward(loss)
            count = stats.pop("count", None)
            for name, value in stats.items():
                run.metrics.add(name, value * count, count)
        if finite:
            clip_and_step(model, optimizer, config, acc)
            scheduler.step()
            run.state.optimizer_steps += 1
        else:
            optimizer.zero_grad(set_to_none=True)
    return policy_logps


def valid_pair_loss(
    loss_fn: Callable[..., tuple[torch.Tensor, dict]],
    idx: torch.Tensor,
    policy_first: torch.Tensor,
    policy_second: torch.Tensor,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, dict]:
    """loss_fn(pair_rows_kept, policy_first_kept, policy_second_kept) over the valid pairs of a
    micro-batch; with none valid, a zero loss still connected to the graph (DDP needs a backward)."""
    keep = valid[idx]
    if not bool(keep.any()):
        return 0.0 * (policy_first.sum() + policy_second.sum()), {}
    return loss_fn(idx[keep], policy_first[keep], policy_second[keep])


def record_sequence_metrics(
    metrics: Any,
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    beta: float | None = None,
    scores: torch.Tensor | None = None,
) -> None:
    """objective/kl, objective/entropy (and, given beta, non_score_reward; given scores, rlhf_reward)
    from per-completion sums over real tokens (2B,)."""
    kl = policy_logps - ref_logps
    metrics.add_mean("objective/kl", kl)
    metrics.add_mean("objective/entropy", -policy_logps)
    if beta is not None:
        metrics.add_mean("objective/non_score_reward", -beta * kl)
        if scores is not None:
            metrics.add_mean("objective/rlhf_reward", scores - beta * kl)


def setup_optimization(run: OnlineRun, model: nn.Module, optimizers: tuple) -> tuple[nn.Module, Any, Any]:
    """Optimizer and schedule (given or built), prepared with the accelerator."""
    optimizer, scheduler = optimizers
    optimizer = optimizer or build_optimizer(model.parameters(), run.config)
    total_steps = run.config.num_total_batches * run.config.num_mini_batches
    scheduler = scheduler or build_scheduler(optimizer, run.config, total_steps)
    model, optimizer = run.accelerator.prepare(model, optimizer)
    return model, optimizer, scheduler


def check_pairs_fit(config: OnlineDPOConfig) -> None:
    if config.per_device_train_batch_size % 2:
        raise ConfigError(
            f"per_device_train_batch_size={config.per_device_train_batch_size} counts completions and must be even: "
            "each micro-batch holds whole pairs (2 completions per prompt)."
        )


# ---------------------------------------------------------------------------------------------
# trainer plumbing shared with XPO (functions, not a base class)
# ---------------------------------------------------------------------------------------------
def init_trainer(
    trainer: Any,
    *,
    model: Any,
    ref_model: Any,
    reward_model: Any,
    judge: Any,
    args: OnlineDPOConfig,
    data_collator: Any,
    train_dataset: Any,
    eval_dataset: Any,
    processing_class: Any,
    reward_processing_class: Any,
    peft_config: Any,
    callbacks: list | None,
    optimizers: tuple,
    reward_funcs: Any,
) -> None:
    """Set the attributes both trainers have: args, processing_class, run, model, ref_model,
    feedback, optimizer, lr_scheduler, callbacks, log_history."""
    check_pairs_fit(args)
    trainer.args = args
    from posttrain.models import ensure_pad_token

    trainer.processing_class = ensure_pad_token(processing_class or _tokenizer_for(model, args))
    trainer.run = OnlineRun(args, trainer.processing_class, train_dataset, eval_dataset)
    if data_collator is not None:
        trainer.run.collate = trainer.run.prompts.collate = data_collator
    trainer.model, trainer.ref_model = prepare_models(model, ref_model, trainer.processing_class, args, peft_config)
    if trainer.ref_model is not None:
        trainer.ref_model.to(trainer.run.device)
    trainer.feedback = build_feedback(
        args,
        trainer.processing_class,
        trainer.run.device,
        reward_model=reward_model,
        judge=judge,
        reward_funcs=reward_funcs,
        reward_processing_class=reward_processing_class,
    )
    trainer.model, trainer.optimizer, trainer.lr_scheduler = setup_optimization(trainer.run, trainer.model, optimizers)
    trainer.callbacks = list(callbacks or [])
    trainer.log_history = []


def begin_training(trainer: Any) -> None:
    """Resume (weights, optimizer, schedule, RNGs, data position, judge RNG) and call on_train_begin."""
    state = trainer.run.maybe_resume({"policy": trainer.model}, trainer.optimizer, trainer.lr_scheduler)
    trainer.feedback.load_state_dict(state.get("feedback", {}))
    for cb in trainer.callbacks:
        getattr(cb, "on_train_begin", lambda t: None)(trainer)


def finish_update(trainer: Any, update: int) -> None:
    """Log, sample table, callbacks, checkpoint, after each rollout batch."""
    run, logs = trainer.run, None
    if run.should_log(update):
        logs = run.log(update, {"lr": trainer.lr_scheduler.get_last_lr()[0]})
        trainer.log_history.append(logs)
    if run.should_sample(update):
        run.sample_table(update, trainer.sample_completions(run.config.per_device_eval_batch_size))
    for cb in trainer.callbacks:
        getattr(cb, "on_step_end", lambda t, step, logs: None)(trainer, update + 1, logs)
    if run.should_save(update):
        run.save(
            {"policy": trainer.model},
            trainer.optimizer,
            trainer.lr_scheduler,
            extra={"feedback": trainer.feedback.state_dict()},
        )


def end_training(trainer: Any) -> None:
    for cb in trainer.callbacks:
        getattr(cb, "on_train_end", lambda t: None)(trainer)
    trainer.run.finish(trainer.model)


# ---------------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------------
class PairTrainerAPI:
    """The public accessors Online DPO and XPO share (set up by `init_trainer`)."""

    train_dataset = property(lambda self: self.run.train_dataset)
    eval_dataset = property(lambda self: self.run.eval_dataset)
    state = property(lambda self: self.run.state)

    def add_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def sample_completions(self, num_prompts: int) -> list[dict]:
        return sample_completions(self.run, self.model, num_prompts, self.feedback)


class OnlineDPOTrainer(PairTrainerAPI):
    """Online DPO with a reward model, reward functions or a pairwise judge (TRL's older API).

    `model` / `ref_model` may be modules or paths; `reward_model` a sequence-classification model
    (its own tokenizer via `reward_processing_class`), a callable `f(prompts, completions, **cols)`,
    or a list of them; `reward_funcs` adds callables; `judge` a pairwise judge (not with rewards).
    Callbacks get `on_train_begin(trainer)`, `on_step_end(trainer, step, logs)`, `on_train_end(trainer)`.
    """

    def __init__(
        self,
        model: Any,
        ref_model: Any = None,
        reward_model: Any = None,
        judge: Any = None,
        args: OnlineDPOConfig | None = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_class: Any = None,
        peft_config: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        reward_funcs: Any = None,
    ) -> None:
        init_trainer(
            self,
            model=model,
            ref_model=ref_model,
            reward_model=reward_model,
            judge=judge,
            args=args if args is not None else OnlineDPOConfig(),
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_class=reward_processing_class,
            peft_config=peft_config,
            callbacks=callbacks,
            optimizers=optimizers,
            reward_funcs=reward_funcs,
        )

    def train(self) -> None:
        run, config = self.run, self.args
        begin_training(self)
        for update in run.updates():
            batch = run.next_batch()
            beta = schedule_value(config.beta, run.prompts.epoch)

            # 1. two completions per prompt; pair i = rows 2i, 2i+1
            rollout = sample(run, self.model, batch, num_samples=2)

            # 2. rank the pairs
            prompts, completions, columns = row_texts(run, batch, rollout, 2)
            ranking = self.feedback.rank(rollout, prompts, completions, columns)

            # 3. reference log-probs (prompt cut to max_length for the forward passes)
            rollout = truncate_prompts(rollout, config.max_length)
            ref_logps = reference_logps(run, self.model, self.ref_model, rollout)
            ref_chosen, ref_rejected = choose(ref_logps[0::2], ref_logps[1::2], ranking.first_wins)

            # 4. DPO / IPO updates over the valid pairs
            def dpo_on_pairs(idx: torch.Tensor, first: torch.Tensor, second: torch.Tensor, normalizer: float):
                def loss(kept: torch.Tensor, f: torch.Tensor, s: torch.Tensor):
                    chosen, rejected = choose(f, s, ranking.first_wins[kept])
                    return dpo_loss(
                        chosen, rejected, ref_chosen[kept], ref_rejected[kept], beta, config.loss_type, normalizer
                    )

                return valid_pair_loss(loss, idx, first, second, ranking.valid)

            policy_logps = train_on_pairs(
                run, self.model, self.optimizer, self.lr_scheduler, rollout, ranking.valid, dpo_on_pairs
            )

            # 5. metrics
            m = run.metrics
            record_sequence_metrics(m, policy_logps, ref_logps, beta, ranking.scores)
            m.add_mean("val/contain_eos_token", rollout.ended.float())
            if ranking.scores is not None:
                chosen_scores, rejected_scores = choose(ranking.scores[0::2], ranking.scores[1::2], ranking.first_wins)
                m.add_mean("objective/scores", ranking.scores)
                m.add_mean("objective/scores_margin", chosen_scores - rejected_scores)
            else:
                m.add_sum("judge/failures", (~ranking.valid).sum())
            m.add_value("beta", beta)
            finish_update(self, update)
        end_training(self)


def _tokenizer_for(model: Any, config: OnlineDPOConfig) -> Any:
    from posttrain.models import load_tokenizer

    path = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
    if not path:
        raise ConfigError("processing_class (the tokenizer) is required when the model was not loaded from a path.")
    return load_tokenizer(path, trust_remote_code=config.trust_remote_code)


def run_trainer(trainer_cls: type, config: OnlineDPOConfig) -> int:
    """`posttrain online-dpo` / `posttrain xpo`: load tokenizer and data, train, save."""
    from posttrain.checkpoint import OutputDirGuard
    from posttrain.health import oom_advice
    from posttrain.models import peft_config_from
    from posttrain.trainers.supervised import check_output_dir

    check_output_dir(config)
    if not config.model_name_or_path:
        raise ConfigError("model_name_or_path is not set: pass --model_name_or_path (a folder or hub name).")
    tokenizer = _tokenizer_for(config.model_name_or_path, config)
    train_dataset = load_split(config, config.dataset_train_split)
    eval_dataset = load_split(config, config.dataset_test_split, required=False)
    # With --use_peft and no reference model, the reference is the base with the adapter disabled.
    trainer = trainer_cls(
        model=config.model_name_or_path,
        args=config,
        processing_class=tokenizer,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config_from(config),
    )
    with OutputDirGuard(config.output_dir, is_main=trainer.run.is_main), oom_advice():
        trainer.train()
    return 0


def run(config: OnlineDPOConfig) -> int:
    return run_trainer(OnlineDPOTrainer, config)
