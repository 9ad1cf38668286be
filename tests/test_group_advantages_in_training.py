"""Review tests of the RLOO / GRPO trainers, end to end through `train()`.

What they pin down, each with numbers worked out by hand or by an independent loop next to it:
- the (k, num_prompts) block layout: every completion's advantage is computed against the other
  completions of ITS prompt and handed to the loss on ITS row, through chunked generation,
  shuffled minibatches, several epochs (RLOO leave-one-out, GRPO group normalization);
- normalize_reward / reward_clip_range / normalize_advantage and GRPO's scale_rewards on a
  4-completion batch with hand-computed advantages;
- the metric identities of the seed (objective/kl, objective/entropy, non_score_reward,
  rlhf_reward), with reference logprobs recomputed here at the sampling temperature, and the
  update forward's logprobs equal to the rollout's (same temperature);
- missing_eos_penalty on the completion only; reward_weights paired with the right reward when
  reward models and functions are mixed; GRPO's k3 term is 0 against an unchanged reference.
"""

from __future__ import annotations

import re

import pytest
import torch
from datasets import Dataset

import helpers
import posttrain.trainers.grpo as grpo
import posttrain.trainers.rloo as rloo
from helpers import prompt_dataset, train_and_last_log
from posttrain.rollout import decode_completions, decode_prompts
from posttrain.scoring import batched_completion_logprobs
from posttrain.testing import build_tiny_causal_lm
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.grpo_config import GRPOConfig
from posttrain.trainers.rloo import RLOOTrainer
from posttrain.trainers.rloo_config import RLOOConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def prompt_and_length(prompts, completions, number, **columns):
    """Distinguishable per prompt: the prompt's number plus a tenth of the completion's length."""
    return [float(n) + 0.1 * len(c) for n, c in zip(number, completions)]


def expected_score(prompt_text: str, completion_text: str) -> float:
    return float(re.search(r"number (\d+)", prompt_text).group(1)) + 0.1 * len(completion_text)


# Hand-checkable scores by row position (rows = k blocks of P = 2 prompts: rows 0, 1 are sample 0
# of prompts 0, 1; rows 2, 3 sample 1), so prompt 0 scores (0, 0) and prompt 1 scores (0, 4).
ROW_SCORES = [0.0, 0.0, 0.0, 4.0]


def by_row(prompts, completions, **columns):
    return ROW_SCORES[: len(completions)]


def rloo_config(tmp_path, **overrides) -> RLOOConfig:
    """One rollout batch: 2 prompts × 2 samples, no KL term."""
    return helpers.rloo_config(tmp_path, **{"total_episodes": 4, "kl_coef": 0.0, **overrides})


def grpo_config(tmp_path, **overrides) -> GRPOConfig:
    """One rollout batch: 2 groups of 2, no KL term."""
    return helpers.grpo_config(tmp_path, **{"num_generations": 2, "total_episodes": 4, "beta": 0.0, **overrides})


def capture(monkeypatch, module):
    """Record, per rollout batch, the rollout and every micro-batch's (rows, micro rollout,
    advantages handed to ppo_policy_loss, update-forward logprobs)."""
    if module is grpo:
        return capture_grpo(monkeypatch)
    records: list[dict] = []
    seen: dict = {}
    loss, update = module.ppo_policy_loss, module.policy_update

    def loss_spy(logprobs, old_logprobs, advantages, mask, *args, **kwargs):
        seen["advantages"], seen["logprobs"] = advantages.detach().clone(), logprobs.detach().clone()
        return loss(logprobs, old_logprobs, advantages, mask, *args, **kwargs)

    def update_spy(run, policy, optimizer, rollout, *, num_epochs, count, loss_fn, **kwargs):
        record = {"rollout": rollout, "micro": []}
        records.append(record)

        def wrapped(rows, mb, logprobs, old_logprobs, normalizer):
            out = loss_fn(rows, mb, logprobs, old_logprobs, normalizer)
            record["micro"].append((rows.clone(), mb, seen.pop("advantages"), seen.pop("logprobs")))
            return out

        return update(run, policy, optimizer, rollout, num_epochs=num_epochs, count=count, loss_fn=wrapped, **kwargs)

    monkeypatch.setattr(module, "ppo_policy_loss", loss_spy)
    monkeypatch.setattr(module, "policy_update", update_spy)
    return records


def capture_grpo(monkeypatch):
    """`capture` for GRPO, whose update loop hands grpo_losses.grpo_policy_loss the advantages of
    each micro-batch's rows (the rows are read where the loop calls online.minibatch_step)."""
    import posttrain.trainers.online as online

    records: list[dict] = []
    seen: dict = {}
    loss, update, step = grpo.grpo_policy_loss, GRPOTrainer.update, online.minibatch_step

    def loss_spy(logprobs, old_logprobs, advantages, mask, *args, **kwargs):
        seen["advantages"], seen["logprobs"] = advantages.detach().clone(), logprobs.detach().clone()
        return loss(logprobs, old_logprobs, advantages, mask, *args, **kwargs)

    def update_spy(self, rollout, advantages, loss_mask, ref_logprobs):
        records.append({"rollout": rollout, "micro": []})
        return update(self, rollout, advantages, loss_mask, ref_logprobs)

    def step_spy(run, model, optimizer, micros, micro_loss, veto=None):
        def wrapped(rows):
            out = micro_loss(rows)
            record = records[-1]
            mb = record["rollout"].select(rows)
            record["micro"].append((rows.clone(), mb, seen.pop("advantages"), seen.pop("logprobs")))
            return out

        return step(run, model, optimizer, micros, wrapped, veto)

    monkeypatch.setattr(grpo, "grpo_policy_loss", loss_spy)
    monkeypatch.setattr(GRPOTrainer, "update", update_spy)
    monkeypatch.setattr(online, "minibatch_step", step_spy)
    return records


def row_scores(tokenizer, rollout) -> tuple[list[str], list[float]]:
    prompts = decode_prompts(tokenizer, rollout)
    completions = decode_completions(tokenizer, rollout)
    return prompts, [expected_score(p, c) for p, c in zip(prompts, completions)]


def check_micro_batches(record, expected: torch.Tensor) -> torch.Tensor:
    rollout = record["rollout"]
    covered = torch.zeros(len(rollout), dtype=torch.long)
    for rows, mb, advantages, _ in record["micro"]:
        # the micro rollout is those rows of the rollout, and each row gets its own advantage
        assert torch.equal(mb.completion_ids, rollout.completion_ids[rows])
        torch.testing.assert_close(advantages.double(), expected[rows.cpu()], rtol=1e-5, atol=1e-4)
        covered[rows.cpu()] += 1
    return covered


# -- the (k, num_prompts) layout, end to end ----------------------------------------------------------


def test_rloo_advantage_is_leave_one_out_within_each_prompt(tmp_path, tiny_tokenizer, monkeypatch):
    """k = 3 samples of P = 4 prompts, generated in chunks of 5 rows (chunks straddle the k blocks),
    2 epochs × 2 shuffled minibatches × 2 micro-batches. For every row r:
    A_r = s_r − mean(s_j : j ≠ r, prompt_j = prompt_r), computed here by a plain loop over rows
    grouped by the decoded prompt text."""
    records = capture(monkeypatch, rloo)
    cfg = rloo_config(
        tmp_path,
        rloo_k=3,
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        num_mini_batches=2,
        num_ppo_epochs=2,
        total_episodes=12,
        local_rollout_forward_batch_size=5,
    )
    RLOOTrainer(
        cfg,
        tiny_tokenizer,
        build_tiny_causal_lm(tiny_tokenizer),
        None,
        prompt_and_length,
        prompt_dataset(64, numbered=True),
    ).train()
    (record,) = records
    prompts, scores = row_scores(tiny_tokenizer, record["rollout"])
    assert len(set(prompts)) == 4 and all(prompts.count(p) == 3 for p in prompts)
    # k blocks: row i·P + p is sample i of prompt p
    assert all(prompts[i * 4 + p] == prompts[p] for i in range(3) for p in range(4))
    expected = torch.tensor(
        [scores[r] - sum(scores[j] for j in range(12) if j != r and prompts[j] == prompts[r]) / 2 for r in range(12)],
        dtype=torch.float64,
    )
    covered = check_micro_batches(record, expected)
    assert torch.equal(covered, torch.full((12,), 2))  # every row once per epoch


def test_grpo_advantage_is_normalized_within_each_prompt(tmp_path, tiny_tokenizer, monkeypatch):
    """G = 3 completions of P = 4 prompts, same shapes as the RLOO test. For every row r:
    A_r = (s_r − mean_g) / (std_g + 1e-4), g = the rows with r's prompt, std unbiased (n − 1)."""
    records = capture(monkeypatch, grpo)
    cfg = grpo_config(
        tmp_path,
        num_generations=3,
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        num_mini_batches=2,
        num_iterations=2,
        total_episodes=12,
        local_rollout_forward_batch_size=5,
    )
    GRPOTrainer(
        build_tiny_causal_lm(tiny_tokenizer),
        prompt_and_length,
        cfg,
        prompt_dataset(64, numbered=True),
        processing_class=tiny_tokenizer,
    ).train()
    (record,) = records
    prompts, scores = row_scores(tiny_tokenizer, record["rollout"])
    assert len(set(prompts)) == 4 and all(prompts.count(p) == 3 for p in prompts)
    expected = []
    for r in range(12):
        group = [scores[j] for j in range(12) if prompts[j] == prompts[r]]
        mean = sum(group) / 3
        std = (sum((x - mean) ** 2 for x in group) / 2) ** 0.5
        expected.append((scores[r] - mean) / (std + 1e-4))
    covered = check_micro_batches(record, torch.tensor(expected, dtype=torch.float64))
    assert torch.equal(covered, torch.full((12,), 2))


# -- hand-computed advantages on 4 completions ---------------------------------------------------------


@pytest.mark.parametrize(
    "options, expected",
    [
        # R = [[0, 0], [0, 4]] (rows = sample, columns = prompt); baseline = the other sample:
        # prompt 0: 0 − 0 = 0, 0 − 0 = 0; prompt 1: 0 − 4 = −4, 4 − 0 = 4.
        ({}, [0.0, -4.0, 0.0, 4.0]),
        # normalize_reward: mean 1, unbiased std sqrt((1 + 1 + 1 + 9)/3) = 2 →
        # s = [−0.5, −0.5, −0.5, 1.5], clipped to ±1 → [−0.5, −0.5, −0.5, 1.0];
        # prompt 1: −0.5 − 1.0 = −1.5, 1.0 − (−0.5) = 1.5.
        ({"normalize_reward": True, "reward_clip_range": 1.0}, [0.0, -1.5, 0.0, 1.5]),
        # reward_clip_range as TRL >= 0.21's (min, max) clip of the raw rewards: R → [[0, 0], [0, 1]];
        # prompt 1: 0 − 1 = −1, 1 − 0 = 1.
        ({"reward_clip_range": (0.0, 1.0)}, [0.0, -1.0, 0.0, 1.0]),
        # normalize_advantage on [0, −4, 0, 4]: mean 0, unbiased std sqrt(32/3) = 3.26599 →
        # ±4 / 3.26599 = ±1.22474.
        ({"normalize_advantage": True}, [0.0, -1.2247449, 0.0, 1.2247449]),
    ],
)
def test_rloo_hand_computed_advantages(tmp_path, tiny_tokenizer, monkeypatch, options, expected):
    records = capture(monkeypatch, rloo)
    trainer = RLOOTrainer(
        rloo_config(tmp_path, **options),
        tiny_tokenizer,
        build_tiny_causal_lm(tiny_tokenizer),
        None,
        by_row,
        prompt_dataset(64, numbered=True),
    )
    last = train_and_last_log(trainer)
    covered = check_micro_batches(records[0], torch.tensor(expected, dtype=torch.float64))
    assert torch.equal(covered, torch.ones(4, dtype=torch.long))
    assert last["objective/scores"] == pytest.approx(1.0)  # before normalize_reward: mean(0, 0, 0, 4)
    # kl_coef = 0: rlhf_reward = (normalized or clipped) score; mean(−0.5, −0.5, −0.5, 1.0) = −0.125,
    # clipped to [0, 1]: mean(0, 0, 0, 1) = 0.25
    rlhf = -0.125 if options.get("normalize_reward") else 0.25 if "reward_clip_range" in options else 1.0
    assert last["objective/rlhf_reward"] == pytest.approx(rlhf)


@pytest.mark.parametrize(
    "scale, expected",
    [
        # groups (prompt 0: rows 0, 2 = (0, 0)); (prompt 1: rows 1, 3 = (0, 4)): mean 2, unbiased
        # std sqrt(2² + 2²) = 2.828427 → ∓2 / (2.828427 + 1e-4) = ∓0.7070818.
        (True, [0.0, -0.7070818, 0.0, 0.7070818]),
        (False, [0.0, -2.0, 0.0, 2.0]),  # Dr. GRPO: centring only
    ],
)
def test_grpo_hand_computed_advantages(tmp_path, tiny_tokenizer, monkeypatch, scale, expected):
    records = capture(monkeypatch, grpo)
    trainer = GRPOTrainer(
        build_tiny_causal_lm(tiny_tokenizer),
        by_row,
        grpo_config(tmp_path, scale_rewards=scale),
        prompt_dataset(64, numbered=True),
        processing_class=tiny_tokenizer,
    )
    last = train_and_last_log(trainer)
    check_micro_batches(records[0], torch.tensor(expected, dtype=torch.float64))
    assert last["frac_reward_zero_std"] == 0.5  # prompt 0's group is flat


# -- metrics and temperature ---------------------------------------------------------------------------


def test_rloo_kl_entropy_metrics_and_temperature(tmp_path, tiny_tokenizer, monkeypatch):
    """At temperature 0.7: objective/kl = mean_b Σ_t (log π − log π_ref) with π_ref recomputed here
    at 0.7; objective/entropy = mean_b Σ_t −log π ≥ 0; non_score_reward = −kl_coef·kl;
    rlhf_reward = scores + non_score_reward; the update forward (REINFORCE case, before any step)
    gives the rollout's own logprobs, so the ratio and the KL use one distribution."""
    records = capture(monkeypatch, rloo)
    ref = build_tiny_causal_lm(tiny_tokenizer, seed=3)
    cfg = rloo_config(
        tmp_path,
        kl_coef=0.1,
        temperature=0.7,
        per_device_train_batch_size=8,
        rloo_k=4,
        total_episodes=8,
        response_length=8,
    )
    last = train_and_last_log(
        RLOOTrainer(
            cfg,
            tiny_tokenizer,
            build_tiny_causal_lm(tiny_tokenizer),
            ref,
            prompt_and_length,
            prompt_dataset(64, numbered=True),
        )
    )
    rollout = records[0]["rollout"]
    mask = rollout.completion_mask
    ref_logprobs, _ = batched_completion_logprobs(ref, rollout, batch_size=64, temperature=0.7)
    kl = ((rollout.logprobs - ref_logprobs) * mask).sum(-1).mean().item()
    entropy = (-(rollout.logprobs * mask).sum(-1)).mean().item()
    assert abs(kl) > 1e-2  # a different reference: the check below is not 0 == 0
    assert last["objective/kl"] == pytest.approx(kl, rel=1e-4, abs=1e-5)
    assert last["objective/entropy"] == pytest.approx(entropy, rel=1e-5) and entropy > 0
    assert last["objective/non_score_reward"] == pytest.approx(-0.1 * last["objective/kl"], rel=1e-5, abs=1e-6)
    assert last["objective/rlhf_reward"] == pytest.approx(
        last["objective/scores"] + last["objective/non_score_reward"], rel=1e-5, abs=1e-6
    )
    for rows, mb, _, logprobs in records[0]["micro"]:
        torch.testing.assert_close(logprobs * mb.completion_mask, rollout.logprobs[rows], rtol=0, atol=1e-4)
    assert last["val/ratio"] == 1.0 and last["val/ratio_var"] == pytest.approx(0.0, abs=1e-12)


def test_missing_eos_penalty_looks_at_the_completion_only(tmp_path, tiny_tokenizer):
    """Reward 0 everywhere and penalty 1: objective/scores = −(B − #ended)/B. Every prompt holds an
    EOS token, so a check over prompt + completion (TRL#6805) would find EOS in every row."""

    def zero(prompts, completions, **columns):
        return [0.0] * len(completions)

    eos = tiny_tokenizer.eos_token
    prompts = Dataset.from_dict({"prompt": [f"Prompt {eos} number {i} says" for i in range(16)]})
    assert tiny_tokenizer.eos_token_id in tiny_tokenizer(prompts[0]["prompt"])["input_ids"]
    cfg = rloo_config(
        tmp_path, missing_eos_penalty=1.0, per_device_train_batch_size=8, total_episodes=8, response_length=4
    )
    last = train_and_last_log(
        RLOOTrainer(cfg, tiny_tokenizer, build_tiny_causal_lm(tiny_tokenizer), None, zero, prompts)
    )
    assert last["val/num_eos_tokens"] < 8  # some completions were truncated: the penalty is exercised
    assert last["objective/scores"] == pytest.approx(-(8 - last["val/num_eos_tokens"]) / 8)


# -- GRPO: reward weights, KL term -------------------------------------------------------------------------


def test_grpo_reward_weights_pair_with_their_reward(tmp_path, tiny_tokenizer, tiny_reward_model):
    """Rewards [f ≡ 1, reward model, g ≡ 3] with weights [0.5, 0, 2]: s = 0.5·1 + 0·rm + 2·3 = 6.5
    for every completion (weights must follow their reward when models and functions are mixed)."""

    def one(prompts, completions, **columns):
        return [1.0] * len(completions)

    def three(prompts, completions, **columns):
        return [3.0] * len(completions)

    cfg = grpo_config(tmp_path, reward_weights=[0.5, 0.0, 2.0])
    last = train_and_last_log(
        GRPOTrainer(
            build_tiny_causal_lm(tiny_tokenizer),
            [one, tiny_reward_model, three],
            cfg,
            prompt_dataset(64, numbered=True),
            processing_class=tiny_tokenizer,
        )
    )
    assert last["objective/scores"] == pytest.approx(6.5)
    assert last["frac_reward_zero_std"] == 1.0


def test_grpo_k3_term_against_the_initial_policy(tmp_path, tiny_tokenizer):
    """beta > 0 without ref_model: the reference is a frozen copy of the initial policy, so on the
    first update (one iteration, the update forward before any step) KL3 = e^0 − 0 − 1 = 0."""
    cfg = grpo_config(tmp_path, beta=0.1, per_device_train_batch_size=8, num_generations=4, total_episodes=8)
    trainer = GRPOTrainer(
        build_tiny_causal_lm(tiny_tokenizer),
        prompt_and_length,
        cfg,
        prompt_dataset(64, numbered=True),
        processing_class=tiny_tokenizer,
    )
    assert trainer.ref_model is not None
    last = train_and_last_log(trainer)
    assert last["loss/kl_avg"] == pytest.approx(0.0, abs=1e-6)
    assert last["objective/kl"] == pytest.approx(0.0, abs=1e-4)


def test_grpo_reward_model_path_brings_its_own_tokenizer(tmp_path, tiny_tokenizer):
    """GRPOTrainer(reward_funcs="path/to/rm") with a reward model trained on another vocabulary: the
    completions must be re-tokenized with the tokenizer saved next to it (TRL GRPO loads it from the
    path when reward_processing_classes is None), not scored as the policy's token ids."""
    from posttrain.testing import build_tiny_reward_model, build_tiny_tokenizer

    other = build_tiny_tokenizer(corpus=["zebra quartz vixen " * 20, "jumbo fjord wyvern " * 20], vocab_size=300)
    assert other.get_vocab() != tiny_tokenizer.get_vocab()
    path = tmp_path / "rm"
    build_tiny_reward_model(other, seed=1, save_dir=path)
    trainer = GRPOTrainer(
        build_tiny_causal_lm(tiny_tokenizer),
        str(path),
        grpo_config(tmp_path),
        prompt_dataset(64, numbered=True),
        processing_class=tiny_tokenizer,
    )
    reward = trainer.reward
    assert reward.reward_tokenizer is not None and reward.reward_tokenizer.get_vocab() == other.get_vocab()
    assert reward.models[0].config.pad_token_id == other.pad_token_id


def test_grpo_resume_equals_uninterrupted(tmp_path, tiny_tokenizer):
    """GRPO through the shared checkpoints: beta > 0 (the reference is a copy of the initial policy,
    rebuilt the same way on resume), 2 iterations × 2 minibatches; weights and metrics match."""
    import shutil

    def trainer_for(out, **kw) -> GRPOTrainer:
        cfg = grpo_config(
            tmp_path,
            output_dir=str(out),
            beta=0.1,
            total_episodes=16,
            num_iterations=2,
            num_mini_batches=2,
            per_device_train_batch_size=2,
            save_steps=2,
            **kw,
        )
        return GRPOTrainer(
            build_tiny_causal_lm(tiny_tokenizer),
            prompt_and_length,
            cfg,
            prompt_dataset(64, numbered=True),
            processing_class=tiny_tokenizer,
        )

    full = trainer_for(tmp_path / "full")
    full.train()
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = trainer_for(tmp_path / "resumed", resume_from_checkpoint="latest")
    resumed.train()
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    assert torch.equal(flat(full.model), flat(resumed.model))
    # 4 rollout batches + the summary; the resumed run keeps the checkpoint's 2 entries and logs 2 more.
    assert len(full.state.log_history) == 5 and len(resumed.state.log_history) == 5
    assert resumed.state.log_history[:2] == full.state.log_history[:2]
    for a, b in zip(full.state.log_history[2:4], resumed.state.log_history[2:4]):
        assert {k: v for k, v in a.items() if k != "eps"} == {k: v for k, v in b.items() if k != "eps"}
