"""XPO: Online DPO whose pair is (policy completion, reference completion), plus an exploration
term (Xie et al. 2024, "Exploratory Preference Optimization"; TRL's `XPOTrainer`).

Per rollout batch of P prompts:
  1. sample one completion per prompt from the policy and one from the reference (the reference
     model, or the PEFT policy with its adapter truly disabled — TRL sampled the "reference" with
     `get_base_model()`, which keeps LoRA active, peft#430); pair i = rows (2i: policy,
     2i+1: reference). The reference draws from a stream forked from the run's at each step, and
     on CPU the two rollouts run side by side on two threads (online.sample_with_reference);
  2. rank each pair with the reward model / reward functions (policy chosen on ties, as TRL) or a
     pairwise judge (-1: the pair leaves the loss, counted in `judge/failures`); the missing-EOS
     penalty looks at the completion only (TRL searched prompt + completion, TRL#6805);
  3. reference log-probs of both completions; with y_w chosen, y_l rejected and y_ref the
     reference's completion, h = β·[(log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))];
  4. optimizer steps on, per pair,
        L = −log σ(h)  (or IPO's (h/β − 1/(2β))²)  +  α · Σ_t log π_θ(y_ref,t)      (losses.xpo_loss),
     normalized by the global number of valid pairs; minimising the second term pushes probability
     away from what the reference says (exploration);
  5. log masked metrics.
The pair mechanics (ranking, the pair update, the per-sequence metrics, the checkpoint and
sample-table hooks of `PairTrainer`) are in trainers/pairs.py, the plumbing in trainers/online.py.

Metrics (completion sums over real tokens only):
  loss/xpo, loss/dpo         means of α·Σ log π_θ(y_ref) and of the DPO term, over valid pairs
  objective/kl               mean over both completions of Σ_t (log π − log π_ref); on reference
                             samples this estimates −KL(π_ref‖π), as TRL's
  objective/entropy          mean over both completions of −Σ_t log π(y_t)
  objective/model_scores, objective/ref_scores, objective/scores_margin (= model − ref)  (scores only)
  rewards/chosen|rejected|margins|accuracies   β·log-ratio implicit rewards, as Online DPO
  logps/chosen|rejected      POLICY summed log-probs of the chosen / rejected completion (TRL added
                             the reference's log-probs to them, TRL#6809)
  val/model_contain_eos_token, val/ref_contain_eos_token   fraction ending on a stop token
  judge/failures, alpha, beta, lr, episode, eps
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.losses import xpo_loss
from posttrain.trainers import online
from posttrain.trainers.online import (
    as_list,
    default_config,
    row_texts,
    sample_with_reference,
)
from posttrain.trainers.pairs import (
    PairTrainer,
    choose,
    interleave_pairs,
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
from posttrain.trainers.xpo_config import XPOConfig


class XPOTrainer(PairTrainer):
    """XPO with a reward model (or reward callables) or a pairwise judge; TRL's signature.

    TRL 1.x's `reward_funcs=` (reward models and/or callables) and `reward_processing_classes=` are
    accepted too; `trainer.reward_funcs` / `trainer.reward_weights` list the rewards and their weights.

    `model` / `ref_model` may be modules, hub ids or folders (model None: args.model_name_or_path).
    With `peft_config` and no `ref_model` the reference is the base model (adapter disabled).
    callbacks: `transformers.TrainerCallback` objects (see trainers/online.py, `OnlineTrainer`).
    """

    def __init__(
        self,
        model: Any = None,
        ref_model: Any = None,
        reward_model: Any = None,
        judge: Any = None,
        args: XPOConfig | None = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        reward_funcs: Any = None,
        reward_processing_class: Any = None,
        reward_processing_classes: Any = None,
        *,
        tokenizer: Any = None,
    ) -> None:
        args = args if args is not None else default_config(XPOConfig, model, "XPO")
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
    def from_config(cls, config: XPOConfig) -> XPOTrainer:
        return cls(args=config)

    def train(self) -> Any:
        run, config = self.run, self.args
        with self.training():
            for update in run.updates():
                batch = run.next_batch()
                epoch = run.prompts.epoch
                beta, alpha = schedule_value(config.beta, epoch), schedule_value(config.alpha, epoch)

                # 1. one completion from the policy, one from the reference; pair i = rows (2i, 2i+1)
                prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
                policy_rollout, ref_rollout = sample_with_reference(
                    run, self.wrapped, self.ref_model, prompt_ids, prompt_mask
                )
                rollout = interleave_pairs(policy_rollout, ref_rollout)

                # 2. rank: is the policy's completion the chosen one?
                prompts, completions, columns = row_texts(run, batch, rollout, 2, blocks=False)
                ranking = self.feedback.rank(rollout, prompts, completions, columns)

                # 3. reference log-probs of both completions
                rollout = truncate_prompts(rollout, config.max_length)
                ref_logps = reference_logps(run, self.wrapped, self.ref_model, rollout)
                ref_chosen, ref_rejected = choose(ref_logps[0::2], ref_logps[1::2], ranking.first_wins)

                # 4. DPO term + alpha · policy log-likelihood of the reference completion (the second row)
                def xpo_on_pairs(idx: torch.Tensor, first: torch.Tensor, second: torch.Tensor, normalizer: float):
                    def loss(kept: torch.Tensor, f: torch.Tensor, s: torch.Tensor):
                        chosen, rejected = choose(f, s, ranking.first_wins[kept])
                        return xpo_loss(
                            chosen,
                            rejected,
                            ref_chosen[kept],
                            ref_rejected[kept],
                            s,
                            beta,
                            alpha,
                            config.loss_type,
                            normalizer,
                        )

                    return valid_pair_loss(loss, idx, first, second, ranking.valid)

                policy_logps = train_on_pairs(
                    run, self.wrapped, self.optimizer, self.lr_scheduler, rollout, ranking.valid, xpo_on_pairs
                )

                # 5. metrics
                m = run.metrics
                record_sequence_metrics(m, policy_logps, ref_logps)
                m.add_mean("val/model_contain_eos_token", rollout.ended[0::2].float())
                m.add_mean("val/ref_contain_eos_token", rollout.ended[1::2].float())
                if ranking.scores is not None:
                    model_scores, ref_scores = ranking.scores[0::2], ranking.scores[1::2]
                    m.add_mean("objective/model_scores", model_scores)
                    m.add_mean("objective/ref_scores", ref_scores)
                    m.add_mean("objective/scores_margin", model_scores - ref_scores)
                else:
                    m.add_sum("judge/failures", (~ranking.valid).sum())
                m.add_value("alpha", alpha)
                m.add_value("beta", beta)
                self.end_of_update(update)
        return self.train_output


def main(config: XPOConfig) -> int:
    """`posttrain xpo`: policy, reference, judge or rewards and prompts from the config; train."""
    return online.run_command(XPOTrainer, config)
