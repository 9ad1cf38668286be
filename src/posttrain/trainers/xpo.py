"""XPO: Online DPO whose pair is (policy completion, reference completion), plus an exploration
term (Xie et al. 2024, "Exploratory Preference Optimization"; TRL's `XPOTrainer`, trl-notes §6,
seed 003).

Per rollout batch:
  1. draw prompts; sample one completion per prompt from the policy and one from the reference
     (the reference model, or the PEFT policy with its adapter truly disabled — TRL sampled the
     "reference" with `get_base_model()`, which keeps LoRA active, peft#430); pair i = rows
     (2i: policy, 2i+1: reference);
  2. rank each pair with the reward model / reward functions (policy chosen on ties, as TRL) or a
     pairwise judge (-1: the pair leaves the loss, counted in `judge/failures`); the missing-EOS
     penalty looks at the completion only (TRL searched prompt + completion, TRL#6805);
  3. reference log-probs of both completions;
  4. optimizer steps on  loss = DPO(chosen, rejected) + α · Σ_t log π_θ(y_ref,t)  per pair
     (losses.xpo_loss), normalised by the global number of valid pairs; minimising the second term
     pushes probability away from what the reference says (exploration);
  5. log masked metrics.
Everything but steps 1 and 4 is Online DPO's code (imported from online_dpo.py).

Metrics (seed 003 names; completion sums over real tokens only):
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
from posttrain.trainers.online_dpo import (
    PairTrainerAPI,
    begin_training,
    choose,
    end_training,
    finish_update,
    init_trainer,
    interleave_pairs,
    record_sequence_metrics,
    reference_logps,
    reference_policy,
    row_texts,
    run_trainer,
    sample,
    schedule_value,
    train_on_pairs,
    truncate_prompts,
    valid_pair_loss,
)
from posttrain.trainers.xpo_config import XPOConfig


class XPOTrainer(PairTrainerAPI):
    """XPO with a reward model (or reward callables) or a pairwise judge; TRL's signature.

    `model` / `ref_model` may be modules or paths. With `peft_config` and no `ref_model` the
    reference is the base model (adapter disabled). Callbacks as OnlineDPOTrainer.
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
    ) -> None:
        init_trainer(
            self,
            model=model,
            ref_model=ref_model,
            reward_model=reward_model,
            judge=judge,
            args=args if args is not None else XPOConfig(),
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_class=None,
            peft_config=peft_config,
            callbacks=callbacks,
            optimizers=optimizers,
            reward_funcs=None,
        )

    def train(self) -> None:
        run, config = self.run, self.args
        begin_training(self)
        for update in run.updates():
            batch = run.next_batch()
            epoch = run.prompts.epoch
            beta, alpha = schedule_value(config.beta, epoch), schedule_value(config.alpha, epoch)

            # 1. one completion from the policy, one from the reference; pair i = rows (2i, 2i+1)
            policy_rollout = sample(run, self.model, batch)
            with reference_policy(self.model, self.ref_model, run.accelerator) as ref:
                ref_rollout = sample(run, ref, batch)
            rollout = interleave_pairs(policy_rollout, ref_rollout)

            # 2. rank: is the policy's completion the chosen one?
            prompts, completions, columns = row_texts(run, batch, rollout, 2)
            ranking = self.feedback.rank(rollout, prompts, completions, columns)

            # 3. reference log-probs of both completions
            rollout = truncate_prompts(rollout, config.max_length)
            ref_logps = reference_logps(run, self.model, self.ref_model, rollout)
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
                run, self.model, self.optimizer, self.lr_scheduler, rollout, ranking.valid, xpo_on_pairs
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
            finish_update(self, update)
        end_training(self)


def run(config: XPOConfig) -> int:
    return run_trainer(XPOTrainer, config)
