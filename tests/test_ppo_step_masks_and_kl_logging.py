"""PPO review: masks, score shapes and logged KL coefficient, with expected numbers worked out by hand
or from an independent full-sequence forward. Tiny offline models, CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import ppo_config
from posttrain.models import CausalLMWithValueHead
from posttrain.testing import build_tiny_causal_lm
from posttrain.trainers.ppo import PPOTrainer
from posttrain.trainers.ppo_config import PPOConfig

QUERIES = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
RESPONSES = [torch.tensor([10, 11, 12, 13]), torch.tensor([14, 15])]


def _step_trainer(tok, **kw) -> tuple[PPOTrainer, torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)  # the value head's initialisation
    lm, ref = build_tiny_causal_lm(tok), build_tiny_causal_lm(tok, seed=5)
    cfg = PPOConfig(**{"ppo_epochs": 1, "batch_size": 2, "learning_rate": 1e-3, "report_to": "none", **kw})
    return PPOTrainer(config=cfg, model=CausalLMWithValueHead(lm), ref_model=ref, tokenizer=tok), lm, ref


@torch.no_grad()
def _logits(model, q: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """(len(r), V) float32 logits predicting each response token from the WHOLE query + response
    prefix (no padding, every token attended): the ground truth the trainer must reproduce."""
    ids = torch.cat([q, r])[None]
    return model(input_ids=ids).logits[0, len(q) - 1 : -1].float()


def _token_logprobs(model, q, r):
    return _logits(model, q, r).log_softmax(-1).gather(-1, r[:, None]).squeeze(-1)


@pytest.mark.parametrize("estimator", ["k1", "full"])
def test_step_response_masks_mask_the_loss_not_the_context(tiny_tokenizer, estimator):
    """A 0 in response_masks (e.g. a tool's output inside the response) removes that token from the
    loss, the KL and the statistics, but the token is still part of the context the later tokens
    were produced from (classic TRL: response_masks multiply the loss mask only; the attention mask
    covers the whole sequence). So the logprobs of row 0's tokens 2 and 3 must be those of the full
    sequence, not of a sequence with token 1 cut out of attention."""
    trainer, lm, ref = _step_trainer(tiny_tokenizer, kl_penalty=estimator)
    masks = [torch.tensor([1, 0, 1, 1]), torch.tensor([1, 1])]
    keep = [m.bool() for m in masks]
    lp = [_token_logprobs(lm, q, r) for q, r in zip(QUERIES, RESPONSES)]  # before the update
    ref_lp = [_token_logprobs(ref, q, r) for q, r in zip(QUERIES, RESPONSES)]
    if estimator == "k1":  # kl_t = lp_t − ref_t
        kl = [a - b for a, b in zip(lp, ref_lp)]
    else:  # kl_t = Σ_v p_v (log p_v − log ref_v)
        kl = []
        for q, r in zip(QUERIES, RESPONSES):
            logp, ref_logp = _logits(lm, q, r).log_softmax(-1), _logits(ref, q, r).log_softmax(-1)
            kl.append((logp.exp() * (logp - ref_logp)).sum(-1))
    tokens = sum(int(k.sum()) for k in keep)  # 3 + 2 = 5 trained tokens
    expected_lp = sum(float(x[k].sum()) for x, k in zip(lp, keep)) / tokens
    expected_ref = sum(float(x[k].sum()) for x, k in zip(ref_lp, keep)) / tokens
    expected_kl = sum(float(x[k].sum()) for x, k in zip(kl, keep)) / 2  # mean over 2 rows of Σ_t kl_t

    stats = trainer.step(QUERIES, RESPONSES, [torch.tensor(1.0), torch.tensor(-1.0)], response_masks=masks)
    assert stats["objective/logprobs"] == pytest.approx(expected_lp, abs=1e-5)
    assert stats["objective/ref_logprobs"] == pytest.approx(expected_ref, abs=1e-5)
    assert stats["objective/kl"] == pytest.approx(expected_kl, abs=1e-5)
    # objective/entropy = mean over rows of Σ_t −lp_t over the trained tokens only.
    assert stats["objective/entropy"] == pytest.approx(-expected_lp * tokens / 2, abs=1e-5)
    assert stats["tokens/responses_len_mean"] == 3.0  # (4 + 2) / 2: masks do not change lengths


def test_step_returns_carry_the_score_of_the_last_real_token(tiny_tokenizer):
    """With kl_coef 0, γ = λ = 1, the only reward is the score on each row's last real token, so
    GAE gives R_t = A_t + V_t = Σ_{s≥t} r_s = score on every real token, whatever the critic says,
    and nothing on row 1's padding (it is 2 tokens long, row 0 is 4).
    returns/mean = (4·2 + 2·(−1)) / 6 = 1.0; returns/var (unbiased over the 6 tokens) =
    (4·(2 − 1)² + 2·(−1 − 1)²) / 5 = 12 / 5 = 2.4; rlhf_reward = mean score = (2 − 1)/2 = 0.5."""
    trainer, _, _ = _step_trainer(tiny_tokenizer, init_kl_coef=0.0, gamma=1.0, lam=1.0)
    stats = trainer.step(QUERIES, RESPONSES, [torch.tensor(2.0), torch.tensor([-1.0])])
    assert stats["ppo/returns/mean"] == pytest.approx(1.0, abs=1e-6)
    assert stats["ppo/returns/var"] == pytest.approx(2.4, abs=1e-5)
    assert stats["ppo/mean_rlhf_reward"] == pytest.approx(0.5, abs=1e-6)
    assert stats["ppo/mean_non_score_reward"] == 0.0


def test_step_scores_must_be_one_number_each(tiny_tokenizer):
    """Classic step(): one score per pair as a 0-d or 1-element tensor (or a number). A score tensor
    with several elements, or with more than one dimension, is a mistake (e.g. per-token rewards or
    a whole batch passed as one score) and must not be silently reduced to its first element."""
    trainer, _, _ = _step_trainer(tiny_tokenizer)
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor([[1.0]])):
        with pytest.raises(ValueError, match=r"scores\[0\]"):
            trainer.step(QUERIES, RESPONSES, [bad, torch.tensor(0.0)])
    stats = trainer.step(QUERIES, RESPONSES, [torch.tensor([1.0]), 0.5])
    assert stats["ppo/mean_scores"] == pytest.approx(0.75)


def test_train_logs_the_kl_coef_that_shaped_the_logged_rewards(tmp_path, tiny_tokenizer):
    """objective/kl_coef is the β used for the batch it is logged with (as step() reports it), not
    the value the adaptive controller moved it to afterwards: per logged batch, with the k1
    estimator, objective/non_score_reward = mean_b Σ_t −β·kl_t = −β · objective/kl exactly."""
    cfg = ppo_config(
        tmp_path,
        total_episodes=12,
        logging_steps=1,
        adap_kl_ctrl=True,
        kl_coef=0.05,
        target=1e-3,
        horizon=10.0,
        value_model_init="head",
    )
    from datasets import Dataset

    trainer = PPOTrainer(
        args=cfg,
        processing_class=tiny_tokenizer,
        model=build_tiny_causal_lm(tiny_tokenizer),
        ref_model=build_tiny_causal_lm(tiny_tokenizer, seed=3),
        reward_model=lambda prompts, completions: [float(len(c)) for c in completions],
        train_dataset=Dataset.from_dict({"prompt": ["Hello world", "The sea", "Once upon", "Thank you"] * 2}),
    )
    trainer.train()
    lines = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and lines[0]["objective/kl_coef"] == 0.05
    for line in lines:
        assert line["objective/non_score_reward"] == pytest.approx(
            -line["objective/kl_coef"] * line["objective/kl"], rel=1e-5
        )
    assert lines[1]["objective/kl_coef"] != 0.05  # the controller did move it
