"""GRPO's loss family in the trainer: TRL 1.16's GRPOConfig fields and defaults (Python and command
line), every loss_type × importance_sampling_level for one update end to end, scale_rewards and
multi_objective_aggregation on hand-computed advantages, and groups that span processes (2 ranks ×
4 completions of one 8-completion group == 1 rank × 8). The math itself is tested against TRL 1.16
in test_grpo_losses.py."""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import (
    flat,
    grpo_config,
    letter_fraction,
    per_row_generate,
    prompt_dataset,
    run_processes,
    train_and_last_log,
)
from posttrain import cli
from posttrain.configs import ConfigError
from posttrain.testing import build_tiny_causal_lm
from posttrain.trainers.grpo import GRPOTrainer, rank_rows
from posttrain.trainers.grpo_config import GRPOConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def config(tmp_path, **overrides) -> GRPOConfig:
    return grpo_config(tmp_path, **{"learning_rate": 1e-2, **overrides})


# -- the config: TRL 1.16's fields, defaults and checks ------------------------------------------------

# TRL 1.16 GRPOConfig's defaults, copied by hand from trl/trainer/grpo_config.py (v1.16).
TRL_1_16_DEFAULTS = {
    "loss_type": "dapo",
    "scale_rewards": "group",
    "importance_sampling_level": "token",
    "beta": 0.0,
    "epsilon": 0.2,
    "epsilon_high": None,
    "delta": None,
    "top_entropy_quantile": 1.0,
    "multi_objective_aggregation": "sum_then_normalize",
    "reward_weights": None,
    "mask_truncated_completions": False,
    "use_bias_correction_kl": True,
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
    "num_generations": 8,
    "num_iterations": 1,
    "learning_rate": 1e-6,
    "temperature": 1.0,
}


def letter_trainer(cfg, tokenizer, policy=None, dataset=None) -> GRPOTrainer:
    """GRPO on the letter-fraction reward: a fresh tiny policy unless given, 8 prompts unless given."""
    policy = policy if policy is not None else build_tiny_causal_lm(tokenizer)
    dataset = dataset if dataset is not None else prompt_dataset(8)
    return GRPOTrainer(policy, letter_fraction, cfg, dataset, processing_class=tokenizer)


def test_defaults_are_trl_1_16s():
    cfg = GRPOConfig()
    assert {name: getattr(cfg, name) for name in TRL_1_16_DEFAULTS} == TRL_1_16_DEFAULTS
    assert cfg.max_completion_length == cfg.response_length


@pytest.mark.parametrize(
    "given, stored",
    [("group", "group"), ("batch", "batch"), ("none", "none"), (True, "group"), (False, "none"), ("False", "none")],
)
def test_scale_rewards_aliases(given, stored):
    assert GRPOConfig(scale_rewards=given).scale_rewards == stored


@pytest.mark.parametrize(
    "field, value, accepted",
    [
        ("loss_type", "ppo", "grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo"),
        ("importance_sampling_level", "token_mean", "token, sequence"),
        ("scale_rewards", "std", "group, batch, none"),
        ("multi_objective_aggregation", "mean", "sum_then_normalize, normalize_then_sum"),
    ],
)
def test_unknown_values_name_the_field_and_the_accepted_ones(field, value, accepted):
    with pytest.raises(ConfigError, match=f"{field}='{value}' is not supported; use one of {accepted}"):
        GRPOConfig(**{field: value})


def test_range_checks():
    with pytest.raises(ConfigError, match="top_entropy_quantile=1.5 must be in"):
        GRPOConfig(top_entropy_quantile=1.5)
    with pytest.raises(ConfigError, match="delta=0.9 must be > 1"):
        GRPOConfig(delta=0.9)
    with pytest.raises(ConfigError, match="sapo_temperature_neg=0"):
        GRPOConfig(sapo_temperature_neg=0)
    for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
        with pytest.raises(ConfigError, match=f"{name}=-1.0 must be >= 0"):
            GRPOConfig(loss_type="vespo", **{name: -1.0})


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"])
def test_sequence_ratio_with_a_token_summed_loss_warns(loss_type, caplog):
    """GSPO's sequence ratio with a loss that sums token terms counts each sequence once per token:
    a warning (TRL's) names the loss and points to loss_type='grpo'; grpo and sapo average each
    sequence's tokens first, so they do not warn."""
    with caplog.at_level("WARNING", logger="posttrain"):
        GRPOConfig(importance_sampling_level="sequence", loss_type=loss_type)
        GRPOConfig(importance_sampling_level="token", loss_type=loss_type)
    warned = [r.getMessage() for r in caplog.records if "weights each sequence by its completion length" in r.message]
    assert len(warned) == (loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"))
    if warned:
        assert f"loss_type={loss_type!r}" in warned[0] and "loss_type='grpo'" in warned[0]


def test_luspo_and_vespo_warn_off_their_papers_level(caplog):
    """TRL 1.16's two warnings: LUSPO is GSPO's sequence-level loss (token level warns), VESPO builds
    its sequence weight from the token ratios (sequence level warns); their own levels do not."""
    with caplog.at_level("WARNING", logger="posttrain"):
        GRPOConfig(loss_type="luspo", importance_sampling_level="sequence")
        GRPOConfig(loss_type="vespo", importance_sampling_level="token")
    assert not caplog.records
    with caplog.at_level("WARNING", logger="posttrain"):
        GRPOConfig(loss_type="luspo", importance_sampling_level="token")
        GRPOConfig(loss_type="vespo", importance_sampling_level="sequence")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "loss_type='luspo'" in messages[0] and "importance_sampling_level='sequence'" in messages[0]
    assert "loss_type='vespo'" in messages[1] and "'token'" in messages[1]


def test_only_the_global_batch_must_hold_whole_groups():
    """TRL 1.16: generation_batch_size (all processes) % num_generations == 0. 2 processes × 4
    completions with 8 generations is one group over both ranks; 1 process × 4 is half a group."""
    cfg = GRPOConfig(per_device_train_batch_size=4, num_generations=8).derive_sizes(2, 100)
    assert (cfg.batch_size, cfg.global_prompts_per_rollout, cfg.prompts_per_rollout) == (8, 1, 1)
    with pytest.raises(ConfigError, match="4 completions per rollout batch must be divisible by num_generations"):
        GRPOConfig(per_device_train_batch_size=4, num_generations=8).derive_sizes(1, 100)


def test_rank_rows_cut_the_prompt_major_pairs():
    # P = 1 prompt, G = 8 over 2 ranks: rank 0 holds samples 0..3, rank 1 samples 4..7.
    assert [t.tolist() for t in rank_rows(1, 8, 2, 0)] == [[0, 0, 0, 0], [0, 1, 2, 3]]
    assert [t.tolist() for t in rank_rows(1, 8, 2, 1)] == [[0, 0, 0, 0], [4, 5, 6, 7]]
    # P = 4, G = 2, one rank: the k-block layout row = i·P + p.
    p, i = rank_rows(4, 2, 1, 0)
    assert p.tolist() == [0, 1, 2, 3, 0, 1, 2, 3] and i.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    # P = 3, G = 4 over 2 ranks (6 rows each): rank 1 holds samples 2, 3 of prompt 1 and all of prompt 2.
    p, i = rank_rows(3, 4, 2, 1)
    assert sorted(zip(p.tolist(), i.tolist())) == [(1, 2), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3)]


def test_command_line_flags(capsys):
    argv = [
        "--loss_type",
        "cispo",
        "--scale_rewards",
        "batch",
        "--importance_sampling_level",
        "sequence",
        "--epsilon_high",
        "5.0",
        "--delta",
        "1.5",
        "--top_entropy_quantile",
        "0.2",
        "--multi_objective_aggregation",
        "normalize_then_sum",
        "--reward_weights",
        "1.0",
        "0.5",
        "--mask_truncated_completions",
        "--use_bias_correction_kl",
        "false",
        "--sapo_temperature_pos",
        "0.9",
        "--sapo_temperature_neg",
        "1.2",
        "--vespo_k_pos",
        "1.5",
        "--vespo_lambda_neg",
        "0.5",
        "--beta",
        "0.04",
    ]
    cfg = cli.parse_config("grpo", argv)
    assert (cfg.loss_type, cfg.scale_rewards, cfg.importance_sampling_level) == ("cispo", "batch", "sequence")
    assert (cfg.epsilon_high, cfg.delta, cfg.top_entropy_quantile) == (5.0, 1.5, 0.2)
    assert cfg.multi_objective_aggregation == "normalize_then_sum" and cfg.reward_weights == [1.0, 0.5]
    assert cfg.mask_truncated_completions is True and cfg.use_bias_correction_kl is False
    assert (cfg.sapo_temperature_pos, cfg.sapo_temperature_neg, cfg.beta) == (0.9, 1.2, 0.04)
    assert (cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg) == (1.5, 3.0, 3.0, 0.5)
    for value, stored in (("group", "group"), ("false", "none"), ("False", "none"), ("true", "group")):
        assert cli.parse_config("grpo", ["--scale_rewards", value]).scale_rewards == stored
    with pytest.raises(SystemExit):
        cli.parse_config("grpo", ["--loss_type", "ppo"])
    assert "loss_type='ppo' is not supported; use one of grpo, bnpo" in capsys.readouterr().err
    help_text = cli.build_parser("grpo", GRPOConfig).format_help()
    for flag in (
        "--loss_type",
        "--scale_rewards",
        "--importance_sampling_level",
        "--epsilon_high",
        "--delta",
        "--top_entropy_quantile",
        "--multi_objective_aggregation",
        "--reward_weights",
        "--mask_truncated_completions",
        "--use_bias_correction_kl",
        "--sapo_temperature_pos",
        "--sapo_temperature_neg",
        "--vespo_k_pos",
        "--vespo_lambda_pos",
        "--vespo_k_neg",
        "--vespo_lambda_neg",
    ):
        assert flag in help_text, flag


# -- every loss type, end to end -------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_each_loss_type_trains(tmp_path, tiny_tokenizer, loss_type, level):
    """One rollout batch, 2 iterations × 2 minibatches × 2 micro-batches, beta > 0 against a
    different reference (the bias-corrected KL term), delta and clip-higher on: parameters move and
    every logged metric is finite; the clip ratios (or cispo's) are fractions."""
    extra = {"epsilon_high": 5.0} if loss_type == "cispo" else {"epsilon_high": 0.28, "delta": 1.5}
    cfg = config(
        tmp_path,
        loss_type=loss_type,
        importance_sampling_level=level,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_mini_batches=2,
        num_iterations=2,
        beta=0.04,
        **extra,
    )
    policy = build_tiny_causal_lm(tiny_tokenizer)
    before = flat(policy).clone()
    trainer = GRPOTrainer(
        policy,
        letter_fraction,
        cfg,
        prompt_dataset(32, numbered=True),
        processing_class=tiny_tokenizer,
        ref_model=build_tiny_causal_lm(tiny_tokenizer, seed=3),
    )
    last = train_and_last_log(trainer)
    assert not torch.equal(before, flat(trainer.model))
    assert all(math.isfinite(v) for v in last.values()), last
    names = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
    names = {"cispo": ["cispo_clip_ratio"], "sapo": [], "vespo": []}.get(loss_type, names)
    for name in names:
        assert 0.0 <= last[name] <= 1.0, name
    if loss_type == "vespo":
        # φ(w) = e^λ·w^k·e^(−λw) peaks at w = k/λ: e·(2/3)² ≈ 1.208 for A ≥ 0 (k 2, λ 3), e^−1·1.5³ ≈ 1.242 for A < 0
        assert 0.0 < last["vespo/phi_seq_mean"] <= 1.242
    assert last["kl"] > 0 and last["objective/kl"] != 0  # a different reference: a real KL term
    assert last["val/ratio"] > 0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_entropy_bonus_is_coef_times_the_mean_token_entropy(tmp_path, tiny_tokenizer, loss_type):
    """entropy_coef: the minimised loss is the policy loss − coef · H, H the mean per-token entropy of
    the loss tokens (one optimizer step, one micro-batch: H is policy/entropy_avg) for a per-sequence
    (grpo) and a global-token-mean (dapo) loss alike; the bonus has gradients, so the parameters end
    up elsewhere than without it, and policy_loss (TRL's name) is the loss without the bonus."""
    coef = 0.5

    def run(entropy_coef):
        torch.manual_seed(0)
        cfg = config(
            tmp_path, name=f"e{entropy_coef}", loss_type=loss_type, total_episodes=4, entropy_coef=entropy_coef
        )
        policy = build_tiny_causal_lm(tiny_tokenizer)
        trainer = letter_trainer(cfg, tiny_tokenizer, policy)
        return train_and_last_log(trainer), flat(policy).clone(), trainer

    plain, plain_params, _ = run(0.0)
    bonus, bonus_params, trainer = run(coef)
    assert "policy_loss" not in plain and "entropy_coef" not in plain
    assert bonus["entropy_coef"] == coef and trainer.entropy_coef == coef
    assert bonus["loss/policy_avg"] == pytest.approx(
        bonus["policy_loss"] - coef * bonus["policy/entropy_avg"], abs=1e-5
    )
    # TRL's names: loss is the minimised loss, entropy the mean token entropy of the loss tokens
    assert bonus["loss"] == bonus["loss/policy_avg"] and bonus["entropy"] == bonus["policy/entropy_avg"]
    assert bonus["policy_loss"] - bonus["loss"] == pytest.approx(coef * bonus["entropy"], abs=1e-5)
    # same rollout and same starting policy: the policy term is the plain run's loss
    assert bonus["policy_loss"] == pytest.approx(plain["loss/policy_avg"], abs=1e-6)
    assert not torch.equal(plain_params, bonus_params)


def test_adaptive_entropy_moves_the_coefficient_once_per_optimizer_step(tmp_path, tiny_tokenizer):
    """use_adaptive_entropy: 2 rollout batches × 2 optimizer steps of 2 micro-batches. Entropy always
    below a target of 100: +delta per optimizer step (4 steps: 0.01 + 4 · 0.005), kept for resume.
    Entropy always above a target of 0: −delta per step down to entropy_coef_min, and never applied,
    so the minimised loss is the policy loss."""

    def run(target):
        cfg = config(
            tmp_path,
            name=f"t{target}",
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            num_mini_batches=2,
            total_episodes=16,
            logging_steps=1,
            entropy_coef=0.01,
            use_adaptive_entropy=True,
            entropy_target=target,
            entropy_coef_delta=0.005,
        )
        trainer = letter_trainer(cfg, tiny_tokenizer)
        trainer.train()
        return trainer, [h for h in trainer.state.log_history if "entropy_coef" in h and "train_runtime" not in h]

    rising, logs = run(100.0)
    assert rising.entropy_coef == pytest.approx(0.03)
    assert [h["entropy_coef"] for h in logs] == pytest.approx([0.0175, 0.0275])  # mean of each batch's 2 steps
    state = rising.extra_state()["entropy_control"]
    assert state["coef"] == pytest.approx(0.03) and 0 < state["last_entropy"] < 100.0
    falling, logs = run(0.0)
    assert falling.entropy_coef == 0.0
    for h in logs:
        assert h["loss/policy_avg"] == pytest.approx(h["policy_loss"], abs=1e-7)


def test_off_policy_mask_threshold_in_training(tmp_path, tiny_tokenizer):
    """off_policy_mask_threshold: logged as the fraction of completions dropped; a threshold no
    sequence exceeds drops none and leaves the loss that of the run without it."""

    def run(threshold):
        torch.manual_seed(0)
        cfg = config(tmp_path, name=f"o{threshold}", num_iterations=2, off_policy_mask_threshold=threshold)
        return train_and_last_log(letter_trainer(cfg, tiny_tokenizer))

    loose, plain = run(1e9), run(None)
    assert loose["off_policy_mask/dropped"] == 0.0 and "off_policy_mask/dropped" not in plain
    assert loose["loss/policy_avg"] == pytest.approx(plain["loss/policy_avg"], abs=1e-7)
    assert 0.0 <= run(0.0)["off_policy_mask/dropped"] <= 1.0
    with pytest.raises(ConfigError, match="off_policy_mask_threshold=-1 must be >= 0"):
        GRPOConfig(off_policy_mask_threshold=-1)


def test_entropy_bonus_config_checks():
    for field in ("entropy_coef", "entropy_coef_min", "entropy_coef_delta"):
        with pytest.raises(ConfigError, match=f"{field}=-0.1 must be >= 0"):
            GRPOConfig(**{field: -0.1})
    with pytest.raises(ConfigError, match="entropy_coef_max=0.1 must be >= entropy_coef_min=0.2"):
        GRPOConfig(entropy_coef_min=0.2, entropy_coef_max=0.1)


def test_top_entropy_quantile_keeps_the_high_entropy_tokens(tmp_path, tiny_tokenizer, monkeypatch):
    """top_entropy_quantile = 0.2: the loss keeps the loss tokens whose update-forward entropy is at
    or above the 0.8 quantile of the micro-batch's loss tokens, about a fifth of them."""
    import posttrain.trainers.grpo as grpo

    kept = []
    original = grpo.high_entropy_mask

    def spy(entropies, mask, q, all_entropies=None):
        out = original(entropies, mask, q, all_entropies=all_entropies)
        kept.append((int(out.sum()), int(mask.sum()), bool((out & ~mask).any())))
        return out

    monkeypatch.setattr(grpo, "high_entropy_mask", spy)
    cfg = config(tmp_path, top_entropy_quantile=0.2, response_length=12)
    policy = build_tiny_causal_lm(tiny_tokenizer)
    before = flat(policy).clone()
    last = train_and_last_log(letter_trainer(cfg, tiny_tokenizer, policy, prompt_dataset(32, numbered=True)))
    assert all(math.isfinite(v) for v in last.values()), last
    assert not torch.equal(before, flat(policy))
    assert len(kept) == 2  # one micro-batch per rollout batch
    for n_kept, n_tokens, outside in kept:
        assert not outside and 1 <= n_kept <= 0.2 * n_tokens + 1, (n_kept, n_tokens)


# -- advantages: scale_rewards and multi-objective aggregation ---------------------------------------------

# Rows are k blocks of P = 2 prompts (row i·P + p is sample i of prompt p): prompt 0 scores (0, 0)
# on rows 0, 2 and prompt 1 scores (0, 4) on rows 1, 3.
ROW_SCORES = [0.0, 0.0, 0.0, 4.0]
SECOND = [1.0, 2.0, 3.0, 5.0]  # prompt 0: (1, 3); prompt 1: (2, 5)


def by_row(prompts, completions, **columns):
    return ROW_SCORES[: len(completions)]


def second(prompts, completions, **columns):
    return SECOND[: len(completions)]


def advantages_of(tmp_path, tiny_tokenizer, monkeypatch, rewards, **overrides) -> tuple[list[float], dict]:
    seen = []
    update = GRPOTrainer.update
    monkeypatch.setattr(
        GRPOTrainer, "update", lambda self, r, a, m, ref: seen.append(a.tolist()) or update(self, r, a, m, ref)
    )
    cfg = config(tmp_path, num_generations=2, total_episodes=4, **overrides)
    last = train_and_last_log(
        GRPOTrainer(
            build_tiny_causal_lm(tiny_tokenizer),
            rewards,
            cfg,
            prompt_dataset(32, numbered=True),
            processing_class=tiny_tokenizer,
        )
    )
    (advantages,) = seen
    return advantages, last


@pytest.mark.parametrize(
    "scale, expected, zero_std",
    [
        # group: prompt 1 has mean 2 and unbiased std sqrt(2² + 2²) = 2.828427 → ∓2 / 2.828527 = ∓0.7070818;
        # prompt 0's std is 0 (half of the completions have zero std).
        ("group", [0.0, -0.7070818, 0.0, 0.7070818], 0.5),
        # batch: centred per group, (0, 0, −2, 2), divided by the std of all 4 rewards (0, 0, 0, 4):
        # mean 1, unbiased std sqrt((1 + 1 + 1 + 9) / 3) = 2 → ∓2 / 2.0001 = ∓0.99995.
        ("batch", [0.0, -0.99995, 0.0, 0.99995], 0.0),
        ("none", [0.0, -2.0, 0.0, 2.0], 0.5),  # Dr. GRPO: centring only
    ],
)
def test_scale_rewards(tmp_path, tiny_tokenizer, monkeypatch, scale, expected, zero_std):
    advantages, last = advantages_of(tmp_path, tiny_tokenizer, monkeypatch, by_row, scale_rewards=scale)
    assert advantages == pytest.approx(expected, abs=1e-6)
    assert last["frac_reward_zero_std"] == zero_std
    assert last["reward"] == pytest.approx(1.0) and last["reward_std"] == pytest.approx(2.0)


def test_reward_weights_with_sum_then_normalize(tmp_path, tiny_tokenizer, monkeypatch):
    """r = 1·ROW_SCORES + 0.5·SECOND = (0.5, 1, 1.5, 6.5): prompt 0 (0.5, 1.5), prompt 1 (1, 6.5).
    Group stds sqrt(0.5² + 0.5²) = 0.7071068 and sqrt(2.75² + 2.75²) = 3.8890873:
    ∓0.5 / 0.7072068 = ∓0.7070068, ∓2.75 / 3.8891873 = ∓0.7070886."""
    advantages, last = advantages_of(tmp_path, tiny_tokenizer, monkeypatch, [by_row, second], reward_weights=[1.0, 0.5])
    assert advantages == pytest.approx([-0.7070068, -0.7070886, 0.7070068, 0.7070886], abs=1e-6)
    assert last["objective/scores"] == pytest.approx((0.5 + 1 + 1.5 + 6.5) / 4)
    # each reward's own mean, unweighted: mean(0, 0, 0, 4) = 1, mean(1, 2, 3, 5) = 2.75
    assert (last["rewards/by_row/mean"], last["rewards/second/mean"]) == pytest.approx((1.0, 2.75))


def test_normalize_then_sum(tmp_path, tiny_tokenizer, monkeypatch):
    """GDPO: each reward normalized within its group (ε = 1e-4), weighted sum, then over the batch.
    ROW_SCORES: prompt 0 flat → 0, 0; prompt 1 (0, 4) → ∓2 / 2.8285271 = ∓0.7070818.
    SECOND: prompt 0 (1, 3) → ∓1 / 1.4143136 = ∓0.7070568; prompt 1 (2, 5) → ∓1.5 / 2.1214203 = ∓0.7070802.
    Weights (1, 2): rows (p0 i0, p1 i0, p0 i1, p1 i1) = (−1.4141136, −2.1212422, 1.4141136, 2.1212422);
    batch mean 0, unbiased std sqrt(2·(1.4141136² + 2.1212422²) / 3) = 2.0816087 → ÷ 2.0817087."""
    advantages, _ = advantages_of(
        tmp_path,
        tiny_tokenizer,
        monkeypatch,
        [by_row, second],
        reward_weights=[1.0, 2.0],
        multi_objective_aggregation="normalize_then_sum",
    )
    std = math.sqrt(2 * (1.4141136**2 + 2.1212422**2) / 3) + 1e-4
    expected = [x / std for x in (-1.4141136, -2.1212422, 1.4141136, 2.1212422)]
    assert advantages == pytest.approx(expected, abs=1e-5)
    assert advantages[1] == pytest.approx(-1.0190, abs=1e-4)  # −2.1212422 / 2.0817087


# -- a group that spans processes ----------------------------------------------------------------------------

# Each row is sampled from a generator seeded by its prompt and its GLOBAL sample index, so the
# completions do not depend on how the group is spread over ranks: with P = 1 prompt and G = 8, rank
# r holds samples 4r .. 4r + 3 (rank_rows). Everything downstream (gathered rewards, group
# advantages on the global grid, the cross-rank entropy quantile, the global token normalizer,
# DDP's average) is what the test compares: 1 process × micro-batch 8 == 2 processes × 4.
SPAN_SCRIPT = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, sys.argv[2])
    from test_grpo_loss_family import span_run
    span_run(sys.argv[1], float(sys.argv[3]))
    from posttrain.distributed import shutdown
    shutdown()
""")


def spanning_generate(*args, **kw):
    """per_row_generate, with this rank's first sample index of the one group (4 per rank)."""
    return per_row_generate(*args, first_index=4 * int(os.environ.get("RANK", "0")), **kw)


def span_run(out_path: str, top_entropy_quantile: float) -> None:
    import tempfile

    import posttrain.trainers.grpo as grpo
    import posttrain.trainers.online as shared
    from posttrain.testing import build_tiny_tokenizer

    shared.generate = spanning_generate
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    tok = build_tiny_tokenizer()
    policy = build_tiny_causal_lm(tok)
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=8 // world,
        num_generations=8,
        total_episodes=8,
        response_length=6,
        report_to=["none"],
        num_sample_generations=0,
        save_steps=0,
        seed=7,
        num_iterations=2,
        beta=0.1,
        top_entropy_quantile=top_entropy_quantile,
    )
    seen, pools = [], []
    entropy_mask = grpo.high_entropy_mask

    def spy(entropies, mask, q, all_entropies=None):
        pools.append((all_entropies.numel(), float(torch.quantile(all_entropies.float(), 1 - q))))
        return entropy_mask(entropies, mask, q, all_entropies=all_entropies)

    grpo.high_entropy_mask = spy
    update = GRPOTrainer.update
    GRPOTrainer.update = lambda self, r, a, m, ref: seen.append(a.detach().clone()) or update(self, r, a, m, ref)
    trainer = GRPOTrainer(
        policy,
        letter_fraction,
        cfg,
        prompt_dataset(32, numbered=True),
        processing_class=tok,
        ref_model=build_tiny_causal_lm(tok, seed=3),
        optimizers=(torch.optim.SGD(policy.parameters(), lr=0.5), None),
    )
    assert trainer.run.world_size == world, "the launcher did not start a real process group"
    last = train_and_last_log(trainer)
    torch.save(
        {"params": flat(trainer.model), "advantages": seen[0], "scores": last["objective/scores"], "pools": pools},
        f"{out_path}.{rank}",
    )


def run_span(tmp_path: Path, top_entropy_quantile: float) -> tuple[dict, list[dict]]:
    script = tmp_path / "span.py"
    script.write_text(SPAN_SCRIPT)
    args = [str(script), str(tmp_path / "one.pt"), str(Path(__file__).parent), str(top_entropy_quantile)]
    run_processes(args, nproc=1, timeout=150, check=True)
    args[1] = str(tmp_path / "two.pt")
    run_processes(args, timeout=150, check=True)
    return torch.load(tmp_path / "one.pt.0"), [torch.load(tmp_path / f"two.pt.{r}") for r in range(2)]


@pytest.mark.multiproc
def test_a_group_spanning_two_processes_equals_one_process(tmp_path):
    one, two = run_span(tmp_path, 1.0)
    assert one["advantages"].abs().sum() > 0  # the group's completions differ: a real signal
    torch.testing.assert_close(torch.cat([t["advantages"] for t in two]), one["advantages"], rtol=0, atol=1e-6)
    assert two[0]["scores"] == pytest.approx(one["scores"], rel=1e-6)
    from posttrain.testing import build_tiny_tokenizer

    assert not torch.equal(one["params"], flat(build_tiny_causal_lm(build_tiny_tokenizer())))
    for t in two:
        torch.testing.assert_close(t["params"], one["params"], rtol=0, atol=1e-5)


@pytest.mark.multiproc
def test_the_entropy_quantile_is_over_the_loss_tokens_of_every_rank(tmp_path):
    """top_entropy_quantile on a group split over 2 ranks: each rank's threshold is taken over the
    loss tokens of BOTH ranks, the pool of the one-process run (the parameters are not compared:
    all rows share the prompt, so entropies tie at the threshold and float noise between a batch of 8
    and of 4 decides those ties)."""
    one, two = run_span(tmp_path, 0.5)
    assert len(one["pools"]) == 2  # one micro-batch per iteration
    for t in two:
        assert [n for n, _ in t["pools"]] == [n for n, _ in one["pools"]]
        assert [q for _, q in t["pools"]] == pytest.approx([q for _, q in one["pools"]], abs=1e-5)
