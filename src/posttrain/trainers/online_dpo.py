"""Online DPO: DPO on pairs the policy samples itself, ranked by a reward model, reward functions
or a pairwise judge (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback";
TRL's `OnlineDPOTrainer`).

Per rollout batch of P prompts:
  1. sample two completions per prompt from the policy (rows 2i, 2i+1 = pair i);
  2. rank each pair: scores from the reward model / reward functions (missing-EOS penalty judged on
     the completion only), ties to the first completion as TRL; or a pairwise judge, whose -1
     failures drop that pair from the loss and are counted (`judge/failures`);
  3. reference log-probs of both completions (the reference model, or the PEFT model with its
     adapter disabled); with y_w the chosen and y_l the rejected completion,
     h = β·[(log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))], log π = Σ_t log π(y_t);
  4. `num_mini_batches` optimizer steps over the pairs on
        L_DPO = −log σ(h)   (loss_type="sigmoid", Rafailov et al. 2023)   or
        L_IPO = (h/β − 1/(2β))²   (loss_type="ipo", Azar et al. 2023)     (losses.dpo_loss),
     summed completion log-probs at temperature 1 (TRL does not divide by the sampling temperature
     here), normalized by the GLOBAL number of valid pairs of the minibatch, so batch 1 × GA 4 ==
     4 × 1; the learning-rate schedule steps with each optimizer step;
  5. log masked metrics.

Reward functions and judges see each prompt as the policy sees it (chat template applied for
conversational datasets) and the completion decoded without special tokens. The pair mechanics
(ranking, the pair update, the per-sequence metrics, the checkpoint and sample-table hooks of
`PairTrainer`) are in trainers/pairs.py, the plumbing in trainers/online.py.

Metrics (per completion sums run over real completion tokens only, so padding never enters them —
TRL summed padded positions into objective/kl and entropy, TRL#6803):
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

from typing import Any

import torch

from posttrain.losses import dpo_loss
from posttrain.trainers import online
from posttrain.trainers.online import as_list, default_config, row_texts, sample
from posttrain.trainers.online_dpo_config import OnlineDPOConfig
from posttrain.trainers.pairs import (
    PairTrainer,
    choose,
    one_reward_tokenizer,
    record_sequence_metrics,
    reference_logps,
    schedule_value,
    setup_pair_trainer,
    tokenizer_argument,
    train_on_pairs,
    truncate_prompts,
    valid_pair_loss,
)

__all__ = [
    "OnlineDPOTrainer",
    "choose",
    "record_sequence_metrics",
    "reference_logps",
    "schedule_value",
    "valid_pair_loss",
]


class OnlineDPOTrainer(PairTrainer):
    """Online DPO with a reward model, reward functions or a pairwise judge (TRL's older API).

    `model` / `ref_model` may be modules, hub ids or folders (model None: args.model_name_or_path);
    `reward_model` a sequence-classification model (its own tokenizer via
    `reward_processing_class`), a callable `f(prompts, completions, **cols)`, or a list of them;
    `reward_funcs` adds callables or reward models (TRL 1.x: `reward_funcs=` and
    `reward_processing_classes=`; `trainer.reward_funcs` / `trainer.reward_weights` list them);
    `judge` a pairwise judge (not with rewards). callbacks:
    `transformers.TrainerCallback` objects (see trainers/online.py, `OnlineTrainer`).
    """

    def __init__(
        self,
        model: Any = None,
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
        reward_processing_classes: Any = None,
        *,
        tokenizer: Any = None,
    ) -> None:
        args = args if args is not None else default_config(OnlineDPOConfig, model, "OnlineDPO")
        setup_pair_trainer(
            self,
            args,
            judge=judge,
            rewards=as_list(reward_model) + as_list(reward_funcs),
            model=model,
            ref_model=ref_model,
            processing_class=tokenizer_argument(processing_class, tokenizer),
            reward_processing_class=one_reward_tokenizer(reward_processing_class, reward_processing_classes),
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            peft_config=peft_config,
            data_collator=data_collator,
            optimizers=optimizers,
            callbacks=callbacks,
        )

    @classmethod
    def from_config(cls, config: OnlineDPOConfig) -> OnlineDPOTrainer:
        return cls(args=config)

    def train(self) -> Any:
        run, config = self.run, self.args
        with self.training():
            for update in run.updates():
                batch = run.next_batch()
                beta = schedule_value(config.beta, run.prompts.epoch)

                # 1. two completions per prompt; pair i = rows 2i, 2i+1
                rollout = sample(run, self.wrapped, batch["input_ids"], batch["attention_mask"], num_samples=2)

                # 2. rank the pairs
                prompts, completions, columns = row_texts(run, batch, rollout, 2, blocks=False)
                ranking = self.feedback.rank(rollout, prompts, completions, columns)

                # 3. reference log-probs (prompt cut to max_length for the forward passes)
                rollout = truncate_prompts(rollout, config.max_length)
                ref_logps = reference_logps(run, self.wrapped, self.ref_model, rollout)
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
                    run, self.wrapped, self.optimizer, self.lr_scheduler, rollout, ranking.valid, dpo_on_pairs
                )

                # 5. metrics
                m = run.metrics
                record_sequence_metrics(m, policy_logps, ref_logps, beta, ranking.scores)
                m.add_mean("val/contain_eos_token", rollout.ended.float())
                if ranking.scores is not None:
                    chosen_scores, rejected_scores = choose(
                        ranking.scores[0::2], ranking.scores[1::2], ranking.first_wins
                    )
                    m.add_mean("objective/scores", ranking.scores)
                    m.add_mean("objective/scores_margin", chosen_scores - rejected_scores)
                else:
                    m.add_sum("judge/failures", (~ranking.valid).sum())
                m.add_value("beta", beta)
                self.end_of_update(update)
        return self.train_output


def main(config: OnlineDPOConfig) -> int:
    """`posttrain online-dpo`: policy, reference, judge or rewards and prompts from the config; train."""
    return online.run_command(OnlineDPOTrainer, config)
