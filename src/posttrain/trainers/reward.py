"""Reward modelling (step 2 of RLHF): a scalar score trained on preference pairs (Bradley–Terry).

    for each optimizer step:
        micro-batches  <- the step's pairs (BatchPlan); chosen rows then rejected rows, right-padded
        N              <- pairs in the whole accumulated batch, summed over ranks
        for each micro-batch:
            r          <- score head at the LAST REAL token of every row (one forward for both sides)
            r_c, r_r   <- r[:B], r[B:]
            loss_sum   <- Σ −log σ(r_c − r_r − margin) + coef·(r_c + r_r)²
            backward(loss_sum / N)
        clip, AdamW step, schedule step; log / evaluate / save when due

The score position comes from each row's length, never from `ids == pad`: the pad token may be
the EOS that ends every sequence, and transformers' own pooling (the rightmost non-pad token)
would then read the token before EOS (DESIGN.md principle 4; TRL #937 is the related bug of an
unset pad id). Chosen and rejected go through ONE forward pass, as TRL's
DataCollatorForPreference lays them out. Evaluation prints what DeepSpeed-Chat's step-2 eval
prints (chosen_last_scores, reject_last_scores, acc) plus the margin, and a table of pairs.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from posttrain import checkpoint as ckpt
from posttrain import distributed as dist
from posttrain import runtime
from posttrain.configs import ConfigError
from posttrain.data.collators import PreferenceCollator
from posttrain.health import oom_advice
from posttrain.losses import bradley_terry_loss
from posttrain.models import apply_peft
from posttrain.tracking import MetricAccumulator
from posttrain.trainers.reward_config import RewardConfig
from posttrain.trainers.supervised import (
    SupervisedTrainerAPI,
    begin_supervised,
    eval_shards,
    rows,
    run_command,
)

if TYPE_CHECKING:
    from transformers import TrainerCallback
    from transformers.trainer_utils import TrainOutput


def score_head(model: nn.Module) -> nn.Module:
    """The linear head of a sequence-classification model (`score` for decoder LMs)."""
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
    raise ConfigError(
        f"{type(model).__name__} has no `score` (or `classifier`) head; load the reward model with "
        "AutoModelForSequenceClassification (num_labels=1)."
    )


def last_token_scores(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, lengths: torch.Tensor, head: nn.Module
) -> torch.Tensor:
    """(N,) float32 score of each row at its last real token (position length − 1)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    hidden = out.hidden_states[-1]  # (N, T, H), the states the head reads
    last = hidden[torch.arange(hidden.size(0), device=hidden.device), lengths.to(hidden.device) - 1]  # (N, H)
    return head(last).squeeze(-1).float()


class RewardTrainer(SupervisedTrainerAPI):
    """TRL-compatible reward-model trainer (no transformers.Trainer underneath).

    model: an `AutoModelForSequenceClassification` with num_labels=1, or its path / hub name (a
    causal LM path gets a fresh score head). peft_config: a peft.LoraConfig to train LoRA adapters
    plus the score head only (task type SEQ_CLS is enforced). Datasets: preference pairs, `chosen` / `rejected`
    with an implicit prompt (recommended) or an explicit `prompt` / `query` column (or the column
    named by args.prompt_column), plain text or
    conversations, optional `margin`; or pre-tokenized `chosen_input_ids` / `rejected_input_ids`.
    """

    def __init__(
        self,
        model: nn.Module | str,
        args: RewardConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        *,
        callbacks: list[TrainerCallback] | None = None,
        accelerator: Any = None,
        peft_config: Any = None,
    ) -> None:
        args, self.accelerator, model, self.processing_class = begin_supervised(
            model, args, RewardConfig, "Reward", train_dataset, processing_class, accelerator, kind="reward"
        )
        self.args = args
        if getattr(model.config, "num_labels", 1) != 1:
            raise ConfigError(
                f"the reward model has num_labels={model.config.num_labels}; it must output one score (num_labels=1)."
            )
        # TRL #937: without pad_token_id transformers' head cannot batch and, when it can, scores
        # the wrong token; saved with the model so plain transformers reads it back.
        model.config.pad_token_id = self.processing_class.pad_token_id
        if peft_config is not None and peft_config.task_type != "SEQ_CLS":
            # Only peft's SEQ_CLS model trains and saves the (new) score head alongside the adapter
            # (it adds `score` / `classifier` to modules_to_save); any other task type would leave
            # the head frozen at its random initialisation.
            peft_config = dataclasses.replace(peft_config, task_type="SEQ_CLS")
        model = apply_peft(model, peft_config)
        self.train_dataset = self._prepare(train_dataset, "train_dataset")
        self.eval_dataset = self._prepare(eval_dataset, "eval_dataset") if eval_dataset is not None else None
        self.data_collator = PreferenceCollator(self.processing_class.pad_token_id, args.pad_to_multiple_of)
        self._start_run(model, callbacks)
        self.head = score_head(self.run.unwrapped())

    def _prepare(self, dataset: Any, source: str) -> Any:
        from posttrain.data import prepare_preference_dataset

        with dist.main_process_first(self.accelerator):
            prepared = prepare_preference_dataset(
                dataset,
                self.processing_class,
                self.args.max_length,
                overflow=self.args.max_length_overflow,
                prompt_column=self.args.prompt_column,
                source=source,
            )
        if dist.is_main(self.accelerator) and len(prepared) < len(dataset):
            print(
                f"{source}: dropped {len(dataset) - len(prepared)} of {len(dataset)} pairs longer than "
                f"max_length={self.args.max_length} (max_length_overflow='drop').",
                file=sys.stderr,
            )
        return prepared

    # -- the loss ---------------------------------------------------------------------------
    def compute_scores(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen scores (B,), rejected scores (B,)) from one forward over the 2B rows."""
        scores = last_token_scores(model, batch["input_ids"], batch["attention_mask"], batch["lengths"], self.head)
        half = scores.size(0) // 2
        return scores[:half], scores[half:]

    def compute_loss(
        self, model: nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Σ over the micro-batch's pairs of the Bradley–Terry loss (not divided) and the scores."""
        chosen, rejected = self.compute_scores(model, batch)
        loss_sum, _ = bradley_terry_loss(
            chosen,
            rejected,
            margin=batch.get("margin"),
            center_rewards_coefficient=self.args.center_rewards_coefficient,
            normalizer=1.0,
        )
        return loss_sum, {"chosen": chosen.detach(), "rejected": rejected.detach(), "loss": loss_sum.detach()}

    @staticmethod
    def _add_metrics(metrics: MetricAccumulator, stats: dict, prefix: str, keep: torch.Tensor | None = None) -> None:
        """TRL's reward metrics as pair-weighted sums: accuracy = mean(r_c > r_r) (ties count as
        wrong), margin = mean(r_c − r_r), mean/min/max over all scores."""
        chosen, rejected = stats["chosen"], stats["rejected"]
        if keep is not None:
            chosen, rejected = chosen[keep], rejected[keep]
        n = chosen.numel()
        metrics.add(f"{prefix}loss", stats["loss"], n)
        metrics.add(f"{prefix}accuracy", (chosen > rejected).float().sum(), n)
        metrics.add(f"{prefix}margin", (chosen - rejected).sum(), n)
        metrics.add(f"{prefix}chosen_scores", chosen.sum(), n)
        metrics.add(f"{prefix}rejected_scores", rejected.sum(), n)
        both = torch.cat([chosen, rejected])
        metrics.add(f"{prefix}mean_reward", both.sum(), both.numel())
        metrics.add_var(f"{prefix}reward_var", both)

    # -- training ---------------------------------------------------------------------------
    def train(self) -> TrainOutput:
        """Train to max_steps / num_train_epochs (or until a callback sets control.should_training_stop),
        evaluate, save the final model; returns TrainOutput(global_step, training_loss, metrics)."""
        run = self.run
        runtime.reuse_freed_memory()
        with ckpt.OutputDirGuard(self.args.output_dir, is_main=run.is_main), oom_advice(), run.linear_kernels():
            run.model.train()
            for batches in run.steps(self.data_collator):
                (n_pairs,) = run.global_counts(sum(b["lengths"].numel() // 2 for b in batches))
                normalizer = run.normalizer(n_pairs)
                for _, batch in run.micro_steps(batches):
                    loss_sum, stats = self.compute_loss(run.model, batch)
                    run.backward(loss_sum / normalizer)
                    self._add_metrics(run.metrics, stats, "")
                    run.metrics.add_sum("num_tokens", batch["lengths"].sum())
                run.end_step()
            if not run.events.preempted:  # enable_jit_checkpoint: a SIGTERM left a checkpoint instead
                run.load_best_model()
                self.save_model()
            output = run.end_training()
        run.close()
        return output

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Scores of the whole eval set: logged as eval_* metrics, printed like DeepSpeed-Chat, and
        the first `num_print_samples` pairs shown in a table."""
        if self.eval_dataset is None:
            raise ConfigError("evaluate() needs an eval_dataset.")
        run, model = self.run, self.run.model
        was_training = model.training
        model.eval()
        metrics = MetricAccumulator()
        samples: list[dict[str, Any]] = []
        low = torch.tensor(float("inf"), device=run.device)
        high = torch.tensor(float("-inf"), device=run.device)
        for indices, keep in eval_shards(
            len(self.eval_dataset), self.args.per_device_eval_batch_size, self.accelerator
        ):
            examples = rows(self.eval_dataset, indices)
            batch = run.to_device(self.data_collator(examples))
            keep = keep.to(run.device)
            with run.autocast():
                chosen, rejected = self.compute_scores(model, batch)
            margin = batch.get("margin")
            # Repeats that only keep ranks in step are left out of every sum.
            loss_sum, _ = bradley_terry_loss(
                chosen[keep],
                rejected[keep],
                margin=None if margin is None else margin[keep],
                center_rewards_coefficient=self.args.center_rewards_coefficient,
                normalizer=1.0,
            )
            stats = {"chosen": chosen, "rejected": rejected, "loss": loss_sum}
            self._add_metrics(metrics, stats, "eval_", keep)
            both = torch.cat([stats["chosen"][keep], stats["rejected"][keep]])
            if both.numel():
                low, high = torch.minimum(low, both.min()), torch.maximum(high, both.max())
            if len(samples) < self.args.num_print_samples and run.is_main:
                samples += self._sample_rows(examples, stats, keep)[: self.args.num_print_samples - len(samples)]
        values = metrics.reduce(self.accelerator)
        # min / max do not reduce as sums: gather one value per rank instead.
        values["eval_min_reward"] = float(dist.gather(low.reshape(1), self.accelerator).min())
        values["eval_max_reward"] = float(dist.gather(high.reshape(1), self.accelerator).max())
        run.log_evaluation(values)
        if run.is_main:
            print(
                f"chosen_last_scores (higher is better) : {values['eval_chosen_scores']}, "
                f"reject_last_scores (lower is better) : {values['eval_rejected_scores']}, "
                f"acc (higher is better) : {values['eval_accuracy']}, "
                f"margin (higher is better) : {values['eval_margin']}"
            )
            run.tracker.log_table("eval_pairs", samples, step=run.global_step)
        model.train(was_training)
        return values

    def _sample_rows(self, examples: list[dict], stats: dict, keep: torch.Tensor) -> list[dict[str, Any]]:
        """(prompt, chosen, rejected, scores) rows; the prompt is the longest common token prefix,
        which recovers an implicit prompt and an explicit one alike."""
        tok = self.processing_class
        out = []
        for i, example in enumerate(examples):
            if not bool(keep[i]):
                continue
            c, r = list(example["chosen_input_ids"]), list(example["rejected_input_ids"])
            k = 0
            while k < min(len(c), len(r)) and c[k] == r[k]:
                k += 1
            out.append(
                {
                    "prompt": tok.decode(c[:k], skip_special_tokens=True).strip(),
                    "chosen": tok.decode(c[k:], skip_special_tokens=True).strip(),
                    "rejected": tok.decode(r[k:], skip_special_tokens=True).strip(),
                    "chosen_score": round(float(stats["chosen"][i]), 4),
                    "rejected_score": round(float(stats["rejected"][i]), 4),
                }
            )
        return out


def main(config: RewardConfig) -> int:
    """`posttrain reward`: load tokenizer, model and data from the config, train, save. Exit code."""
    return run_command(RewardTrainer, config, task_type="SEQ_CLS")
