"""Preference pairs the policy samples itself: the shared mechanics of Online DPO and XPO.

A rollout batch holds B pairs as rows (2i, 2i+1). This module ranks them (a reward model, reward
functions or a pairwise judge: `Feedback`), takes the reference log-probs of both completions,
runs the pair update (`train_on_pairs`: minibatches of whole pairs, micro-batches of whole pairs,
normalized by the global number of valid pairs, on the online skeleton's `minibatch_step` and its
non-finite policy) and records the per-sequence metrics both trainers log. `PairTrainer` fills in the
skeleton's hooks both trainers answer alike (checkpointed judge state, sample-table scores).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posttrain import distributed as dist
from posttrain.configs import ConfigError
from posttrain.rollout import Rollout
from posttrain.scoring import RewardSource, batched_completion_logprobs, completion_logprobs
from posttrain.trainers.online import (
    OnlineRun,
    OnlineTrainer,
    Parts,
    global_normalizer,
    load_parts,
    minibatch_step,
    prepare_policy,
    reference_policy,
    row_texts,
)


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
    config: Any, tokenizer: Any, accelerator: Any, *, rewards: list[Any], judge: Any, reward_tokenizer: Any
) -> Feedback:
    """A judge or the rewards (reward models frozen on the run's device by `dist.prepare_frozen`, reward
    functions); not both."""
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
    return Feedback(
        reward=RewardSource(
            [dist.prepare_frozen(r, accelerator) for r in rewards],
            policy_tokenizer=tokenizer,
            reward_tokenizer=reward_tokenizer,
            weights=config.reward_weights,
            batch_size=config.local_rollout_forward_batch_size,
            missing_eos_penalty=config.missing_eos_penalty,
        )
    )


def load_pair_parts(
    config: Any, *, judge: Any, rewards: list[Any], needs_reference: bool = True, **given: Any
) -> tuple[Parts, Any]:
    """online.load_parts for a pair trainer, and its judge. Objects passed to the trainer win;
    with neither a judge nor a reward passed, config.judge / reward_model_path / reward_funcs
    (a config judge together with a config reward is refused by build_feedback)."""
    if judge is None and not rewards and config.judge:
        from posttrain.judges import judge_from_spec

        judge = judge_from_spec(config.judge)
        rewards_from_config = True
    else:
        rewards_from_config = judge is None
    parts = load_parts(
        config,
        rewards=rewards,
        needs_reference=needs_reference,
        needs_reward=False,
        rewards_from_config=rewards_from_config,
        **given,
    )
    return parts, judge


def tokenizer_argument(processing_class: Any, tokenizer: Any) -> Any:
    """`processing_class=`, or `tokenizer=`: the name TRL's Online DPO / XPO trainers took until 0.11."""
    if processing_class is not None and tokenizer is not None and processing_class is not tokenizer:
        raise ConfigError("pass the tokenizer once: processing_class= (tokenizer= is its older name), not both.")
    return processing_class if processing_class is not None else tokenizer


def setup_pair_trainer(
    trainer: Any,
    args: Any,
    *,
    judge: Any,
    rewards: list[Any],
    data_collator: Any,
    optimizers: tuple,
    callbacks: list | None,
    **given: Any,
) -> None:
    """The start of Online DPO and XPO alike: parts and judge, policy and reference, the skeleton's
    setup, and the feedback (reward models / functions or the judge) on the run's device."""
    parts, judge = load_pair_parts(args, judge=judge, rewards=rewards, **given)
    policy, trainer.ref_model = prepare_policy(
        parts.policy, parts.reference, args, peft_config=parts.peft_config, needs_reference=True
    )
    trainer.wrapped = trainer.setup(
        args,
        parts.tokenizer,
        policy,
        train_dataset=parts.train_dataset,
        eval_dataset=parts.eval_dataset,
        data_collator=data_collator,
        optimizers=optimizers,
        callbacks=callbacks,
        position_limits=parts.position_limits,
    )
    trainer.ref_model = dist.prepare_frozen(trainer.ref_model, trainer.accelerator)
    trainer.feedback = build_feedback(
        args,
        trainer.processing_class,
        trainer.accelerator,
        rewards=parts.rewards,
        judge=judge,
        reward_tokenizer=parts.reward_tokenizers,
    )
    for r in trainer.feedback.reward.models if trainer.feedback.reward is not None else ():
        dist.prepare_frozen(r, trainer.accelerator)  # under --fsdp sharded like the policy
    # TRL 1.x attributes: the reward models / functions in order, and their weights as a tensor.
    reward = trainer.feedback.reward
    trainer.reward_funcs = list(reward.items) if reward is not None else []
    trainer.reward_weights = torch.tensor(reward.weights) if reward is not None else None


def one_reward_tokenizer(reward_processing_class: Any, reward_processing_classes: Any) -> Any:
    """TRL's older `reward_processing_class` or 1.x `reward_processing_classes` (one tokenizer or a list,
    one per reward); one tokenizer is supported for the reward models, so a list keeps its first entry
    that is not None. Both names at once is a TypeError, as a doubled keyword would be."""
    if reward_processing_class is not None and reward_processing_classes is not None:
        raise TypeError("pass reward_processing_class or reward_processing_classes, not both.")
    if isinstance(reward_processing_classes, (list, tuple)):
        return next((t for t in reward_processing_classes if t is not None), None)
    return reward_processing_class if reward_processing_class is not None else reward_processing_classes


class PairTrainer(OnlineTrainer):
    """The online skeleton's hooks for a trainer set up by `setup_pair_trainer` (Online DPO, XPO).

    The learning-rate schedule steps once per optimizer step (as TRL's Online DPO / XPO), not once
    per rollout batch; a checkpoint keeps the judge's state (resume is exact); the sample table
    shows the reward's scores (none with a judge).
    """

    schedule_per_update = False
    feedback: Feedback

    def extra_state(self) -> dict:
        return {"feedback": self.feedback.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        self.feedback.load_state_dict(state.get("feedback", {}))

    def table_scores(self, rollout: Rollout, batch: dict) -> torch.Tensor | None:
        if self.feedback.reward is None:
            return None
        return self.feedback.reward(rollout, *row_texts(self.run, batch, rollout, 1, blocks=False))


# ---------------------------------------------------------------------------------------------
# layout and reference log-probs
# ---------------------------------------------------------------------------------------------
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


@torch.no_grad()
def reference_logps(run: OnlineRun, model: nn.Module, ref_model: nn.Module | None, rollout: Rollout) -> torch.Tensor:
    """Σ_t log π_ref(y_t) per row (2B,), over real completion tokens only, at temperature 1."""
    with reference_policy(model, ref_model, run.accelerator) as ref, run.autocast():
        logprobs, _ = batched_completion_logprobs(ref, rollout, batch_size=run.config.local_rollout_forward_batch_size)
    return logprobs.sum(-1)


def schedule_value(values: Sequence[float], epoch: int) -> float:
    """TRL's per-epoch list: values[epoch], the last value once the list runs out."""
    return float(values[min(epoch, len(values) - 1)])


def choose(first: torch.Tensor, second: torch.Tensor, first_wins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) per pair from per-pair values of the first and second completion."""
    return torch.where(first_wins, first, second), torch.where(first_wins, second, first)


# ---------------------------------------------------------------------------------------------
# the pair update and the metrics
# ---------------------------------------------------------------------------------------------
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
    minibatch / world size. A minibatch without any valid pair on any rank is skipped; a non-finite
    loss on any rank skips the step on every rank (online.minibatch_step). The schedule steps with
    each optimizer step. Returns the detached per-row policy log-prob sums of the update forwards
    (2B,) — every row, judged or not — for the metrics.
    """
    config, acc = run.config, run.accelerator
    num_pairs = len(rollout) // 2
    pairs_per_micro = config.per_device_train_batch_size  # counted in prompts, as TRL (online_dpo_config)
    pairs_per_mini = config.local_mini_batch_size // 2
    policy_logps = torch.zeros(len(rollout), device=run.device)
    model.train()

    def micro_loss(idx: torch.Tensor) -> torch.Tensor:
        rows = pair_rows(idx)
        with run.autocast():
            logprobs, _ = completion_logprobs(model, rollout.select(rows))
        seqs = logprobs.sum(-1)  # (2m,)
        policy_logps[rows] = seqs.detach()
        loss, stats = pair_loss(idx, seqs[0::2], seqs[1::2], normalizer)
        count = stats.pop("count", None)
        for name, value in stats.items():
            run.metrics.add(name, value * count, count)
        return loss

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
        if minibatch_step(run, model, optimizer, list(mini.split(pairs_per_micro)), micro_loss):
            scheduler.step()
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
