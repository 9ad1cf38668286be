"""Review checks of Online DPO / XPO: the update's gradient equals the hand-written objective over the
valid pairs (global pair normalizer), micro-batching does not change it, and the per-pair selection,
reference log-probs and metrics agree with independent recomputations."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from helpers import pair_config, word_prompts
from posttrain.judges import CallableJudge
from posttrain.losses import dpo_loss, xpo_loss
from posttrain.scoring import completion_logprobs
from posttrain.testing import build_tiny_causal_lm
from posttrain.trainers.online_dpo import OnlineDPOTrainer
from posttrain.trainers.online_dpo_config import OnlineDPOConfig
from posttrain.trainers.pairs import choose, train_on_pairs
from posttrain.trainers.xpo import XPOTrainer
from posttrain.trainers.xpo_config import XPOConfig


def config(cls, tmp_path, **overrides):
    """One micro-batch of 4 prompts, 8 episodes, lr 1.0, no clipping, a constant schedule."""
    values = dict(per_device_train_batch_size=4, gradient_accumulation_steps=1, total_episodes=8, learning_rate=1.0)
    values.update(max_grad_norm=0.0, lr_scheduler_type="constant")
    return pair_config(cls, tmp_path, **{**values, **overrides})


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("algo", ["online_dpo", "xpo"])
def test_update_is_minus_gradient_of_mean_over_valid_pairs(tmp_path, tiny_tokenizer, monkeypatch, algo, loss_type):
    """One rollout batch of 4 pairs, the judge fails on one pair, micro-batches of 1 pair, a reference
    model that differs from the policy: the SGD (lr 1) step equals −∇ of (1/3)·Σ_valid loss_i written
    here in one pass, and the logged implicit rewards / KL use that reference."""
    model = build_tiny_causal_lm(tiny_tokenizer, seed=0)
    ref = build_tiny_causal_lm(tiny_tokenizer, seed=1).eval()
    answers = [0, -1, 1, 0]
    judge = CallableJudge(lambda p, pairs: answers[: len(pairs)], mode="pairwise", seed=0)
    cls, cfg_cls = (XPOTrainer, XPOConfig) if algo == "xpo" else (OnlineDPOTrainer, OnlineDPOConfig)
    extra = {"alpha": 0.3} if algo == "xpo" else {}
    cfg = config(
        cfg_cls,
        tmp_path,
        per_device_train_batch_size=1,  # one prompt = one pair per micro-batch
        gradient_accumulation_steps=4,
        beta=0.2,
        loss_type=loss_type,
        **extra,
    )
    trainer = cls(
        model=model,
        ref_model=copy.deepcopy(ref),
        judge=judge,
        args=cfg,
        processing_class=tiny_tokenizer,
        train_dataset=word_prompts(4),
        optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None),
    )
    captured = {}
    real_rank = trainer.feedback.rank

    def rank(*args, **kwargs):
        captured["ranking"] = real_rank(*args, **kwargs)
        return captured["ranking"]

    def spy(run, m, optimizer, scheduler, rollout, valid, pair_loss):
        captured["rollout"] = rollout
        captured["before"] = {k: v.detach().clone() for k, v in m.named_parameters()}
        return train_on_pairs(run, m, optimizer, scheduler, rollout, valid, pair_loss)

    monkeypatch.setattr(trainer.feedback, "rank", rank)
    monkeypatch.setattr(importlib.import_module(f"posttrain.trainers.{algo}"), "train_on_pairs", spy)
    trainer.train()
    rollout, ranking = captured["rollout"], captured["ranking"]
    # The judge may flip a pair before asking (then maps the answer back); a failure stays a failure.
    assert ranking.valid.tolist() == [True, False, True, True]
    first_wins, keep = ranking.first_wins, ranking.valid

    check = copy.deepcopy(model)
    check.load_state_dict(captured["before"])
    logps = completion_logprobs(check, rollout)[0].sum(-1)  # (8,) policy sums before the step, with grad
    with torch.no_grad():
        ref_logps = completion_logprobs(ref, rollout)[0].sum(-1)
    pol_c, pol_r = choose(logps[0::2], logps[1::2], first_wins)
    ref_c, ref_r = choose(ref_logps[0::2], ref_logps[1::2], first_wins)
    if algo == "xpo":  # row 2i+1 is the reference model's completion
        loss, _ = xpo_loss(pol_c[keep], pol_r[keep], ref_c[keep], ref_r[keep], logps[1::2][keep], 0.2, 0.3, loss_type)
    else:
        loss, _ = dpo_loss(pol_c[keep], pol_r[keep], ref_c[keep], ref_r[keep], 0.2, loss_type)
    loss.backward()
    after = dict(trainer.model.named_parameters())
    for name, p in check.named_parameters():
        assert torch.allclose(after[name].detach() - captured["before"][name], -p.grad, atol=1e-6, rtol=1e-4), name

    log = trainer.state.log_history[0]
    assert log["judge/failures"] == 1
    with torch.no_grad():
        assert log["logps/chosen"] == pytest.approx(pol_c[keep].mean().item(), rel=1e-5)
        assert log["rewards/chosen"] == pytest.approx((0.2 * (pol_c - ref_c))[keep].mean().item(), rel=1e-4)
        assert log["rewards/rejected"] == pytest.approx((0.2 * (pol_r - ref_r))[keep].mean().item(), rel=1e-4)
        # KL over all 8 completions, judged or not, real tokens only (the two models clearly differ)
        assert (logps - ref_logps).abs().mean() > 0.1
        assert log["objective/kl"] == pytest.approx((logps - ref_logps).mean().item(), rel=1e-4, abs=1e-5)
