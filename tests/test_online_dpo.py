"""Online DPO: trainer-level formulas on hand-built tensors, masking, judge failures, learning with
a judge, both dataset kinds, a reward model with its own tokenizer, resume == uninterrupted, CLI."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from datasets import Dataset

from helpers import WORDS, assert_resumed_as_uninterrupted, pair_config, tensorboard_scalars, word_prompts
from posttrain.configs import ConfigError
from posttrain.judges import CallableJudge, win_rate
from posttrain.rollout import Rollout
from posttrain.testing import build_tiny_causal_lm, build_tiny_reward_model, build_tiny_tokenizer
from posttrain.tracking import MetricAccumulator
from posttrain.trainers.online_dpo import (
    OnlineDPOTrainer,
    choose,
    record_sequence_metrics,
    reference_logps,
    schedule_value,
    valid_pair_loss,
)
from posttrain.trainers.online_dpo_config import OnlineDPOConfig


def standard_prompts(n: int = 16) -> Dataset:
    return word_prompts(n)


def conversational_prompts(n: int = 16) -> Dataset:
    return word_prompts(n, conversational=True)


def shorter(prompt, completion) -> float:
    """Judge score: fewer bytes is better — dense and learnable by a random tiny model."""
    return -float(len(completion.encode()))


def make_config(tmp_path, **overrides) -> OnlineDPOConfig:
    return pair_config(OnlineDPOConfig, tmp_path, **overrides)


def judged_trainer(tiny_tokenizer, cfg: OnlineDPOConfig, model=None, prompts=None) -> OnlineDPOTrainer:
    """An Online DPO trainer ranking with the `shorter` judge on the standard prompts."""
    return OnlineDPOTrainer(
        model if model is not None else build_tiny_causal_lm(tiny_tokenizer),
        judge=CallableJudge(shorter),
        args=cfg,
        processing_class=tiny_tokenizer,
        train_dataset=prompts if prompts is not None else standard_prompts(),
    )


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------
def test_config_aliases_schedules_and_errors():
    c = OnlineDPOConfig(beta=0.2)
    assert (c.max_new_tokens, c.response_length, c.beta, c.temperature, c.learning_rate) == (64, 64, [0.2], 0.9, 5e-7)
    assert OnlineDPOConfig(response_length=7).max_new_tokens == 7
    assert OnlineDPOConfig(max_new_tokens=7, response_length=7).response_length == 7
    with pytest.raises(ConfigError, match="max_new_tokens=8 and response_length=9"):
        OnlineDPOConfig(max_new_tokens=8, response_length=9)
    with pytest.raises(ConfigError, match="loss_type"):
        OnlineDPOConfig(loss_type="hinge")
    with pytest.raises(ConfigError, match="max_length"):
        OnlineDPOConfig(max_new_tokens=64, max_length=64)
    with pytest.raises(ConfigError, match="beta"):
        OnlineDPOConfig(beta=[0.1, 0.0])
    # a per-epoch list; past its end the last value stays
    assert [schedule_value([0.1, 0.2], e) for e in range(3)] == [0.1, 0.2, 0.2]


def test_per_device_train_batch_size_counts_prompts(tmp_path, tiny_tokenizer):
    """An odd per_device_train_batch_size is fine: it counts prompts (TRL), each sampled twice."""
    cfg = make_config(tmp_path, per_device_train_batch_size=3, gradient_accumulation_steps=2, total_episodes=12)
    trainer = judged_trainer(tiny_tokenizer, cfg)
    # 3 prompts x GA 2 = 6 prompts = 12 completions per rollout batch; total_episodes=12 -> 1 batch.
    assert (cfg.local_mini_batch_size, cfg.batch_size, cfg.num_total_batches) == (12, 12, 1)
    assert trainer.run.prompts.batch_size == 6
    trainer.train()
    assert trainer.run.progress.optimizer_steps == 1 and trainer.state.log_history[0]["episode"] == 12
    with pytest.raises(
        ConfigError, match=r"batch_size = 12 completions = 2 per prompt × per_device_train_batch_size 3"
    ):
        make_config(
            tmp_path, per_device_train_batch_size=3, gradient_accumulation_steps=2, total_episodes=8
        ).derive_sizes(1, 16)


# --------------------------------------------------------------------------------------------
# formulas on hand-built tensors
# --------------------------------------------------------------------------------------------
def test_sequence_metrics_hand_computed():
    # Per-completion sums: policy [-3, -5, -2, -4], reference [-4, -4, -2, -6] -> KL_seq = [1, -1, 0, 2].
    policy = torch.tensor([-3.0, -5.0, -2.0, -4.0])
    ref = torch.tensor([-4.0, -4.0, -2.0, -6.0])
    scores = torch.tensor([1.0, 0.0, 2.0, 3.0])
    m = MetricAccumulator()
    record_sequence_metrics(m, policy, ref, beta=0.5, scores=scores)
    out = m.reduce()
    assert out["objective/kl"] == pytest.approx(0.5)  # mean [1, -1, 0, 2]
    assert out["objective/entropy"] == pytest.approx(3.5)  # mean [3, 5, 2, 4]
    assert out["objective/non_score_reward"] == pytest.approx(-0.25)  # -0.5 * 0.5
    assert out["objective/rlhf_reward"] == pytest.approx(1.25)  # mean [0.5, 0.5, 2, 2]


def test_pair_loss_selection_and_dropped_pairs():
    # Pair 0: first wins; pair 1: second wins.
    first = torch.tensor([-1.0, -3.0], requires_grad=True)
    second = torch.tensor([-2.0, -1.0], requires_grad=True)
    first_wins = torch.tensor([True, False])
    ref_first, ref_second = torch.tensor([-1.5, -2.0]), torch.tensor([-2.0, -2.0])
    ref_chosen, ref_rejected = choose(ref_first, ref_second, first_wins)
    assert ref_chosen.tolist() == [-1.5, -2.0] and ref_rejected.tolist() == [-2.0, -2.0]

    from posttrain.losses import dpo_loss

    def loss_fn(kept, f, s):
        chosen, rejected = choose(f, s, first_wins[kept])
        return dpo_loss(chosen, rejected, ref_chosen[kept], ref_rejected[kept], 1.0, "sigmoid", float(len(kept)))

    idx = torch.tensor([0, 1])
    # chosen = [-1, -1], rejected = [-2, -3]; logits = (c - r) - (ref_c - ref_r) = [1 - 0.5, 2 - 0] = [0.5, 2]
    loss, stats = valid_pair_loss(loss_fn, idx, first, second, torch.tensor([True, True]))
    expected = (
        -torch.nn.functional.logsigmoid(torch.tensor(0.5)) - torch.nn.functional.logsigmoid(torch.tensor(2.0))
    ) / 2
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert stats["rewards/chosen"].item() == pytest.approx((0.5 + 1.0) / 2)  # beta·(c − ref_c) = [0.5, 1]
    assert stats["rewards/accuracies"].item() == 1.0
    # Judge failed on pair 1: only pair 0 counts.
    loss, stats = valid_pair_loss(loss_fn, idx, first, second, torch.tensor([True, False]))
    assert loss.item() == pytest.approx(-torch.nn.functional.logsigmoid(torch.tensor(0.5)).item(), abs=1e-6)
    assert stats["count"].item() == 1
    # Every pair failed: a zero loss that still backpropagates (DDP needs the backward).
    loss, stats = valid_pair_loss(loss_fn, idx, first, second, torch.tensor([False, False]))
    loss.backward()
    assert loss.item() == 0.0 and stats == {} and first.grad is not None and first.grad.abs().sum() == 0


# --------------------------------------------------------------------------------------------
# trainer runs
# --------------------------------------------------------------------------------------------
def test_padding_never_enters_reference_sums(tmp_path, tiny_tokenizer):
    trainer = judged_trainer(tiny_tokenizer, make_config(tmp_path))
    prompt = torch.tensor([[5, 6, 7], [1, 8, 9]])
    lengths = torch.tensor([4, 2])
    completion = torch.tensor([[10, 11, 12, 13, 1, 1], [14, 15, 1, 1, 1, 1]])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    rollout = Rollout(
        prompt,
        torch.tensor([[True] * 3, [False, True, True]]),
        completion,
        mask,
        lengths,
        torch.tensor([False, False]),
        None,
        None,
        pad_token_id=1,
    )
    garbage = copy.copy(rollout)
    garbage.completion_ids = torch.where(mask, completion, torch.randint(20, 100, completion.shape))
    clean = reference_logps(trainer.run, trainer.model, trainer.ref_model, rollout)
    assert torch.equal(clean, reference_logps(trainer.run, trainer.model, trainer.ref_model, garbage))
    # = the sum over the real tokens only, computed without any padding column
    short = Rollout(
        prompt[1:, 1:],
        torch.ones(1, 2, dtype=torch.bool),
        completion[1:, :2],
        mask[1:, :2],
        lengths[1:],
        torch.tensor([False]),
        None,
        None,
        pad_token_id=1,
    )
    assert clean[1].item() == pytest.approx(
        reference_logps(trainer.run, trainer.model, trainer.ref_model, short).item(), abs=1e-5
    )


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_first_update_policy_equals_reference(tmp_path, tiny_tokenizer, loss_type):
    """At the first update π = π_ref, so every log-ratio is 0: loss/dpo = log 2 (sigmoid) or
    (1/(2β))² = 25 for β = 0.1 (ipo), implicit rewards and KL are 0; and the parameters move."""
    model = build_tiny_causal_lm(tiny_tokenizer)
    before = params(model)
    cfg = make_config(
        tmp_path, loss_type=loss_type, total_episodes=8, gradient_accumulation_steps=1, per_device_train_batch_size=4
    )
    trainer = OnlineDPOTrainer(
        model,
        reward_funcs=[lambda prompts, completions, **kw: [float(len(c)) for c in completions]],
        args=cfg,
        processing_class=tiny_tokenizer,
        train_dataset=standard_prompts(),
    )
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["loss/dpo"] == pytest.approx(math.log(2) if loss_type == "sigmoid" else 25.0, rel=1e-4)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "objective/kl"):
        assert abs(log[name]) < 1e-4, name
    assert log["objective/entropy"] > 0 and log["objective/scores_margin"] >= 0
    assert log["episode"] == 8 and log["beta"] == 0.1 and "lr" in log and "eps" in log
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_judge_raises_win_rate_against_initial_policy(tmp_path, tiny_tokenizer):
    from posttrain.evaluate import generate_completions

    model = build_tiny_causal_lm(tiny_tokenizer)
    initial = copy.deepcopy(model)
    cfg = make_config(
        tmp_path,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        total_episodes=16 * 20,
        max_new_tokens=8,
        learning_rate=3e-2,
        lr_scheduler_type="constant",
        temperature=1.0,
        logging_steps=5,
    )
    trainer = OnlineDPOTrainer(
        model,
        judge=CallableJudge(shorter, seed=0),
        args=cfg,
        processing_class=tiny_tokenizer,
        train_dataset=standard_prompts(32),
    )
    trainer.train()
    prompts = [f"{w} {i}" for i in range(4) for w in WORDS]
    trained = generate_completions(trainer.model, tiny_tokenizer, prompts, max_new_tokens=8, temperature=1.0, seed=1)
    start = generate_completions(initial, tiny_tokenizer, prompts, max_new_tokens=8, temperature=1.0, seed=1)
    result = win_rate(CallableJudge(shorter, seed=0).judge(prompts, [[a, b] for a, b in zip(trained, start)]))
    assert result.ci_low > 0.5 and result.rate >= 0.8, str(result)


def test_conversational_prompts_and_judge_failures(tmp_path, tiny_tokenizer):
    """Failed judgements (-1) leave the loss and are counted; a batch where every pair failed takes no step."""
    calls = []

    def flaky(prompts, pairs):
        calls.append(prompts)
        return [-1 if i % 2 == 0 else 0 for i in range(len(pairs))] if len(calls) == 1 else [-1] * len(pairs)

    model = build_tiny_causal_lm(tiny_tokenizer)
    cfg = make_config(tmp_path, total_episodes=16, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    trainer = OnlineDPOTrainer(
        model,
        judge=CallableJudge(flaky, mode="pairwise"),
        args=cfg,
        processing_class=tiny_tokenizer,
        train_dataset=conversational_prompts(),
    )
    trainer.train()
    first, second, summary = trainer.state.log_history
    assert [first["step"], second["step"], summary["step"]] == [1, 2, 2] and "train_runtime" in summary
    assert calls[0][0].startswith("user: ") and calls[0][0].endswith("assistant:")  # chat template applied
    assert first["judge/failures"] == 2 and "rewards/chosen" in first
    assert second["judge/failures"] == 4 and "rewards/chosen" not in second and "loss/dpo" not in second
    assert trainer.run.progress.optimizer_steps == 1
    # KL covers every completion, judged or not; it is near 0 after one small step (not −Σ log π_ref)
    assert abs(second["objective/kl"]) < 1.0 and second["objective/entropy"] > 10


def test_reward_model_with_its_own_tokenizer_and_eos_penalty(tmp_path, tiny_tokenizer):
    other = build_tiny_tokenizer(vocab_size=300)
    other.padding_side = "right"
    cfg = make_config(tmp_path, missing_eos_penalty=1.0, total_episodes=16)
    trainer = OnlineDPOTrainer(
        build_tiny_causal_lm(tiny_tokenizer),
        reward_model=build_tiny_reward_model(other, seed=3),
        reward_processing_class=other,
        args=cfg,
        processing_class=tiny_tokenizer,
        train_dataset=standard_prompts(),
    )
    trainer.train()
    for log in trainer.state.log_history[:-1]:
        assert all(math.isfinite(v) for v in log.values())
        assert log["objective/scores_margin"] >= 0  # chosen = higher score
    # with a constant reward, scores = −penalty · (1 − contain_eos) exactly
    cfg = make_config(tmp_path, missing_eos_penalty=1.0, total_episodes=8, output_dir=str(tmp_path / "eos"))
    trainer = OnlineDPOTrainer(
        build_tiny_causal_lm(tiny_tokenizer),
        reward_funcs=lambda prompts, completions, **kw: [0.0] * len(completions),
        args=cfg,
        processing_class=tiny_tokenizer,
        train_dataset=standard_prompts(),
    )
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["objective/scores"] == pytest.approx(-(1 - log["val/contain_eos_token"]))


def test_resume_equals_uninterrupted(tmp_path, tiny_tokenizer):
    def train(out, resume=None):
        cfg = make_config(
            tmp_path,
            output_dir=str(out),
            total_episodes=32,
            save_steps=2,
            resume_from_checkpoint=resume,
            beta=[0.1, 0.3],
        )
        trainer = OnlineDPOTrainer(
            build_tiny_causal_lm(tiny_tokenizer),
            judge=CallableJudge(shorter, seed=5),
            args=cfg,
            processing_class=tiny_tokenizer,
            train_dataset=standard_prompts(8),
        )
        trainer.train()
        return trainer

    full = train(tmp_path / "a")
    assert [log["beta"] for log in full.state.log_history[:-1]] == [0.1, 0.1, 0.3, 0.3]  # 2 rollout batches per epoch
    resumed = train(tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-2"))
    # The resumed run keeps the checkpoint's 2 entries of log_history and logs the last 2 rollout batches.
    assert resumed.run.progress.update == 4 and resumed.state.global_step == 4
    assert len(resumed.state.log_history) == 5
    assert_resumed_as_uninterrupted(full, resumed, restored=2)


def test_cli_online_dpo(tmp_path, tiny_policy_dir):
    from transformers import AutoModelForCausalLM

    from posttrain.cli import main

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in WORDS))
    out = tmp_path / "run"
    code = main(
        [
            "online-dpo",
            "--model_name_or_path",
            str(tiny_policy_dir),
            "--dataset_name",
            str(data),
            "--judge",
            "random:0",
            "--output_dir",
            str(out),
            "--per_device_train_batch_size",
            "2",
            "--total_episodes",
            "8",
            "--max_new_tokens",
            "4",
            "--learning_rate",
            "1e-3",
            "--logging_steps",
            "1",
            "--report_to",
            "none",
        ]
    )
    assert code == 0
    AutoModelForCausalLM.from_pretrained(out)
    log = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert log["judge/failures"] == 0 and "loss/dpo" in log


def test_non_finite_loss_skips_the_step(tmp_path, tiny_tokenizer):
    model = build_tiny_causal_lm(tiny_tokenizer)
    cfg = make_config(tmp_path, total_episodes=16, per_device_train_batch_size=4, gradient_accumulation_steps=1)
    trainer = judged_trainer(tiny_tokenizer, cfg, model, standard_prompts(8))
    with torch.no_grad():
        trainer.model.lm_head.weight[:, 0] = float("nan")  # every log-softmax, hence every loss, is NaN
    before = params(trainer.model)
    trainer.train()
    assert trainer.run.progress.optimizer_steps == 0 and trainer.run.health.nonfinite_total == 2
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v.isnan(), before[k].isnan()) and torch.equal(v.nan_to_num(), before[k].nan_to_num()), k


def test_tensorboard_tags_carry_transformers_prefixes(tmp_path, tiny_tokenizer):
    """TensorBoard gets the names transformers' TensorBoardCallback writes (train/..., eval/...);
    metrics.jsonl keeps the short names."""
    cfg = make_config(tmp_path, total_episodes=8, report_to=["tensorboard"], run_name="tb")
    trainer = OnlineDPOTrainer(
        build_tiny_causal_lm(tiny_tokenizer),
        reward_funcs=[lambda prompts, completions, **kw: [float(len(c)) for c in completions]],
        args=cfg,
        processing_class=tiny_tokenizer,
        train_dataset=standard_prompts(),
        eval_dataset=standard_prompts(4),
    )
    trainer.train()
    trainer.evaluate()
    trainer.run.tracker.close()
    scalars = tensorboard_scalars(tmp_path / "out" / "runs" / "tb")
    tags = set(scalars)
    for tag in ("train/objective/kl", "train/objective/entropy", "train/loss/dpo", "train/lr", "train/episode"):
        assert tag in tags, tag
    assert "eval/objective/scores" in tags and "eval/completions/mean_length" in tags
    assert not any(tag.startswith("objective/") or tag.startswith("eval_") or tag == "lr" for tag in tags)
    assert scalars["train/objective/kl"] == [1]
    record = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert "objective/kl" in record and "lr" in record and "train/objective/kl" not in record


def trl_max_steps(prompts: int, per_device: int, grad_accum: int, world: int, epochs: float) -> int:
    """transformers.Trainer's count, under TRL's OnlineDPOTrainer / XPOTrainer: the dataloader has
    ceil(P / (per_device · W)) batches per process; an epoch makes ceil(len / GA) optimizer steps;
    max_steps = ceil(epochs · steps per epoch)."""
    return math.ceil(epochs * max(math.ceil(math.ceil(prompts / (per_device * world)) / grad_accum), 1))


# (prompts, per_device_train_batch_size, gradient_accumulation_steps, processes, num_train_epochs, TRL's
# max_steps worked out by hand)
STEP_CASES = [
    (32, 4, 1, 1, 1.0, 8),  # 8 batches of 4 prompts -> 8 steps, each on 4 prompts x 2 completions
    (32, 4, 1, 1, 3.0, 24),  # the default num_train_epochs: 3 x 8
    (10, 2, 2, 1, 1.5, 5),  # 5 batches; ceil(5 / 2) = 3 steps per epoch (the last accumulates 1); ceil(4.5) = 5
    (36, 4, 4, 1, 2.5, 8),  # 9 batches -> 3 steps per epoch; ceil(7.5) = 8 (floor(9 / 4) would say 2 per epoch)
    (30, 2, 2, 2, 1.0, 4),  # 2 processes: ceil(30 / 4) = 8 batches each -> 4 steps
    (10, 4, 1, 2, 2.0, 4),  # 2 processes: ceil(10 / 8) = 2 batches each -> 2 per epoch; 4 (not ceil(20 / 8) = 3)
]


@pytest.mark.parametrize(("prompts", "per_device", "grad_accum", "world", "epochs", "expected"), STEP_CASES)
def test_step_count_is_trls(prompts, per_device, grad_accum, world, epochs, expected):
    from posttrain.trainers.xpo_config import XPOConfig

    assert trl_max_steps(prompts, per_device, grad_accum, world, epochs) == expected
    for cls in (OnlineDPOConfig, XPOConfig):
        cfg = cls(
            per_device_train_batch_size=per_device, gradient_accumulation_steps=grad_accum, num_train_epochs=epochs
        )
        cfg.derive_sizes(world, prompts)
        # One optimizer step (num_mini_batches = 1) per rollout batch of per_device x GA prompts per process.
        assert cfg.num_total_batches == expected, cls.__name__
        assert cfg.batch_size == 2 * per_device * grad_accum * world  # completions per rollout batch
        assert cfg.total_episodes == expected * cfg.batch_size
    # num_mini_batches (posttrain's; TRL has 1) splits a rollout batch into that many optimizer steps.
    cfg = OnlineDPOConfig(per_device_train_batch_size=per_device, num_mini_batches=2, num_train_epochs=epochs)
    assert cfg.derive_sizes(world, prompts).num_total_batches == math.ceil(
        trl_max_steps(prompts, per_device, 1, world, epochs) / 2
    )


@pytest.mark.parametrize(
    ("prompts", "per_device", "grad_accum", "epochs", "expected"), [(32, 4, 1, 1.0, 8), (10, 2, 2, 1.5, 5)]
)
def test_training_runs_trls_steps_and_lr_schedule(
    tmp_path, tiny_tokenizer, prompts, per_device, grad_accum, epochs, expected
):
    """The same command runs TRL's number of optimizer steps; the linear schedule spans them (lr 0 at the end)."""
    cfg = make_config(
        tmp_path,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=grad_accum,
        num_train_epochs=epochs,
        total_episodes=None,
        max_new_tokens=2,
        logging_steps=100,
    )
    trainer = OnlineDPOTrainer(
        build_tiny_causal_lm(tiny_tokenizer),
        reward_funcs=[lambda prompts, completions, **kw: [float(len(c)) for c in completions]],
        args=cfg,
        processing_class=tiny_tokenizer,
        train_dataset=standard_prompts(prompts),
    )
    assert trainer.state.max_steps == expected
    trainer.train()
    assert trainer.state.global_step == expected == trainer.run.progress.optimizer_steps
    assert trainer.run.progress.episode == expected * 2 * per_device * grad_accum
    assert trainer.lr_scheduler.last_epoch == expected and trainer.lr_scheduler.get_last_lr() == [0.0]


@pytest.mark.filterwarnings("ignore:min_p=")
def test_trl_1x_sampling_options_reach_the_sampler(tmp_path, tiny_tokenizer):
    """TRL 1.x's OnlineDPOConfig sampling fields (min_p, repetition_penalty, generation_kwargs) are honoured
    by the rollout engine; generation_kwargs override the fields of the same name."""
    cfg = make_config(
        tmp_path, min_p=0.05, repetition_penalty=1.2, top_k=7, generation_kwargs={"top_k": 5, "do_sample": True}
    )
    assert (cfg.min_p, cfg.repetition_penalty, cfg.top_k) == (0.05, 1.2, 5)
    trainer = judged_trainer(tiny_tokenizer, cfg)
    sampling = trainer.run.sampling
    assert (sampling.min_p, sampling.repetition_penalty, sampling.top_k) == (0.05, 1.2, 5)
    with pytest.raises(ConfigError, match="do_sample=False: online training samples"):
        make_config(tmp_path, generation_kwargs={"do_sample": False})
