"""XPO: config, TRL's documented metrics (policy-only logps), both dataset kinds, the PEFT reference
(adapter truly disabled for reference completions and log-probs), resume, and the quickstart script."""

from __future__ import annotations

import copy
import json
import math
import runpy
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from helpers import WORDS, assert_resumed_as_uninterrupted, pair_config, word_prompts
from posttrain.configs import ConfigError
from posttrain.judges import CallableJudge
from posttrain.testing import build_tiny_causal_lm, build_tiny_reward_model
from posttrain.trainers.online import reference_policy, sample
from posttrain.trainers.pairs import reference_logps
from posttrain.trainers.xpo import XPOTrainer
from posttrain.trainers.xpo_config import XPOConfig

SEED_METRICS = {
    "loss/xpo",
    "loss/dpo",
    "objective/kl",
    "objective/entropy",
    "objective/model_scores",
    "objective/ref_scores",
    "objective/scores_margin",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "val/model_contain_eos_token",
    "val/ref_contain_eos_token",
    "alpha",
    "beta",
}
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "xpo_quickstart.py"


def prompts(conversational: bool = False, n: int = 8) -> Dataset:
    return word_prompts(n, conversational)


def make_config(tmp_path, **overrides) -> XPOConfig:
    return pair_config(XPOConfig, tmp_path, **overrides)


def test_config():
    c = XPOConfig(alpha=0.5)
    assert (c.alpha, c.beta, c.max_new_tokens, c.max_length, c.temperature) == ([0.5], [0.1], 64, 512, 0.9)
    assert XPOConfig().alpha == [1e-5] and XPOConfig().loss_type == "sigmoid" and XPOConfig().disable_dropout
    with pytest.raises(ConfigError, match="alpha"):
        XPOConfig(alpha=[-1.0])


@pytest.mark.parametrize("conversational", [False, True])
def test_reward_model_run_logs_every_seed_metric(tmp_path, tiny_tokenizer, conversational):
    model = build_tiny_causal_lm(tiny_tokenizer)
    before = copy.deepcopy(model.state_dict())
    cfg = make_config(
        tmp_path, alpha=0.5, total_episodes=8, gradient_accumulation_steps=1, per_device_train_batch_size=4
    )
    trainer = XPOTrainer(
        model=model,
        reward_model=build_tiny_reward_model(tiny_tokenizer, seed=1),
        args=cfg,
        processing_class=tiny_tokenizer,
        train_dataset=prompts(conversational),
    )
    trainer.train()
    log = trainer.state.log_history[0]
    assert SEED_METRICS <= set(log) and all(math.isfinite(v) for v in log.values())
    # First update: π = π_ref, so the DPO term is log 2 and the implicit rewards and KL are 0.
    assert log["loss/dpo"] == pytest.approx(math.log(2), rel=1e-4)
    assert abs(log["rewards/margins"]) < 1e-4 and abs(log["objective/kl"]) < 1e-4
    # logps/* are the POLICY sums only (TRL#6809 added the reference's): every pair is valid, so
    # the mean of chosen and rejected is the mean policy sum over all completions = −entropy.
    assert (log["logps/chosen"] + log["logps/rejected"]) / 2 == pytest.approx(-log["objective/entropy"], rel=1e-5)
    assert log["objective/scores_margin"] == pytest.approx(
        log["objective/model_scores"] - log["objective/ref_scores"], abs=1e-6
    )
    # α·Σ log π(y_ref) < 0, and with α = 0.5 it is half the policy sum of reference completions (−0.5·~6 tokens·~6 nats)
    assert log["loss/xpo"] < -5 and log["alpha"] == 0.5
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_peft_reference_is_the_base_model(tmp_path, tiny_tokenizer):
    from peft import LoraConfig

    base = build_tiny_causal_lm(tiny_tokenizer)
    frozen_base = copy.deepcopy(base)
    # Random (non-zero) LoRA weights, so the adapter changes the model from the first step.
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    cfg = make_config(tmp_path, total_episodes=8, gradient_accumulation_steps=1, per_device_train_batch_size=4)
    trainer = XPOTrainer(
        model=base,
        judge=CallableJudge(lambda prompt, completion: -len(completion)),
        args=cfg,
        processing_class=tiny_tokenizer,
        train_dataset=prompts(),
        peft_config=lora,
    )
    assert trainer.ref_model is None
    run = trainer.run
    batch = run.collate([run.train_dataset[i] for i in range(4)])
    batch = {
        **batch,
        "input_ids": batch["input_ids"].to(run.device),
        "attention_mask": batch["attention_mask"].to(run.device),
    }

    def draw(model):
        return sample(
            run, model, batch["input_ids"], batch["attention_mask"], generator=torch.Generator().manual_seed(3)
        )

    with reference_policy(trainer.model, None, run.accelerator) as ref:
        ref_rollout = draw(ref)
    base_rollout = draw(frozen_base)
    policy_rollout = draw(trainer.model)
    assert torch.equal(ref_rollout.completion_ids, base_rollout.completion_ids)  # reference samples = base weights
    assert not torch.equal(
        policy_rollout.completion_ids, base_rollout.completion_ids
    )  # the adapter is active otherwise
    ref_sums = reference_logps(run, trainer.model, None, ref_rollout)
    base_sums = reference_logps(run, frozen_base, frozen_base, ref_rollout)
    assert torch.allclose(ref_sums, base_sums, atol=1e-5)

    lora_before = {k: v.clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert all("lora_" in k for k in lora_before) and any(not torch.equal(v, after[k]) for k, v in lora_before.items())
    base_params = {k: v for k, v in trainer.model.named_parameters() if "lora_" not in k}
    for (k, v), ref_v in zip(base_params.items(), frozen_base.parameters()):
        assert torch.equal(v, ref_v), k  # base weights frozen, so the reference never moves


def test_resume_equals_uninterrupted(tmp_path, tiny_tokenizer):
    def train(out, resume=None):
        cfg = make_config(
            tmp_path,
            output_dir=str(out),
            total_episodes=32,
            save_steps=2,
            resume_from_checkpoint=resume,
            alpha=[1e-3, 1e-2],
        )
        trainer = XPOTrainer(
            build_tiny_causal_lm(tiny_tokenizer),
            reward_model=build_tiny_reward_model(tiny_tokenizer, seed=1),
            args=cfg,
            processing_class=tiny_tokenizer,
            train_dataset=prompts(),
        )
        trainer.train()
        return trainer

    full = train(tmp_path / "a")
    assert [log["alpha"] for log in full.state.log_history[:-1]] == [1e-3, 1e-3, 1e-2, 1e-2]
    resumed = train(tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-2"))
    assert_resumed_as_uninterrupted(full, resumed, restored=2)


@pytest.mark.parametrize("feedback", ["judge", "reward_model"])
def test_quickstart_script_with_local_models(tmp_path, monkeypatch, tiny_policy_dir, tiny_reward_model_dir, feedback):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": w}]}) + "\n" for w in WORDS))
    out = tmp_path / "xpo-out"
    argv = [
        str(EXAMPLE),
        "--model",
        str(tiny_policy_dir),
        "--dataset",
        str(data),
        "--output_dir",
        str(out),
        "--total_episodes",
        "16",  # one rollout batch: the default per_device_train_batch_size 8 prompts x 2 completions
        "--max_new_tokens",
        "4",
    ]
    argv += ["--judge", "random:0"] if feedback == "judge" else ["--reward_model", str(tiny_reward_model_dir)]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    log = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert log["episode"] == 16 and "loss/xpo" in log
    assert ("judge/failures" in log) == (feedback == "judge") and ("objective/model_scores" in log) == (
        feedback != "judge"
    )
    assert (out / "model.safetensors").is_file()


def test_cli_xpo_with_reward_model_path(tmp_path, tiny_policy_dir, tiny_reward_model_dir):
    from posttrain.cli import main

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in WORDS))
    out = tmp_path / "run"
    code = main(
        [
            "xpo",
            "--model_name_or_path",
            str(tiny_policy_dir),
            "--reward_model_path",
            str(tiny_reward_model_dir),
            "--dataset_name",
            str(data),
            "--output_dir",
            str(out),
            "--per_device_train_batch_size",
            "4",
            "--total_episodes",
            "8",
            "--max_new_tokens",
            "4",
            "--missing_eos_penalty",
            "1.0",
            "--alpha",
            "1e-3",
            "--learning_rate",
            "5e-7",
            "--report_to",
            "none",
        ]
    )
    assert code == 0
    logs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logs[-1]["episode"] == 8 and logs[-1]["alpha"] == 1e-3 and math.isfinite(logs[-1]["objective/model_scores"])


@pytest.mark.multiproc
def test_two_processes_cli(tmp_path, tiny_policy_dir, tiny_reward_model_dir):
    """DDP on CPU (gloo): no_sync micro-batches, global pair normalizer, metrics reduced across ranks;
    the number of steps is TRL's for 2 processes."""
    from helpers import run_processes

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in WORDS[:6]))
    out = tmp_path / "run"
    # `accelerate launch --cpu --num_processes 2` starts ONE process with accelerate 1.15 (its simple
    # launcher); torchrun with ACCELERATE_USE_CPU gives a real 2-rank gloo group.
    run_processes(
        [
            "-m",
            "posttrain.cli",
            "xpo",
            "--model_name_or_path",
            str(tiny_policy_dir),
            "--reward_model_path",
            str(tiny_reward_model_dir),
            "--dataset_name",
            str(data),
            "--output_dir",
            str(out),
            "--per_device_train_batch_size",
            "1",
            "--gradient_accumulation_steps",
            "2",
            "--num_train_epochs",
            "2",
            "--max_new_tokens",
            "4",
            "--logging_steps",
            "1",
            "--report_to",
            "none",
        ],
        timeout=180,
        check=True,
    )
    logs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # TRL (transformers.Trainer) on 2 processes: ceil(6 prompts / (1 × 2)) = 3 batches per process, ceil(3 / GA 2)
    # = 2 optimizer steps per epoch, 4 in 2 epochs (6 x 2 x 2 completions / 8 per step would make 3).
    # Each step: 2 ranks × (1 prompt × GA 2) × 2 completions = 8 completions.
    assert [log["step"] for log in logs] == [1, 2, 3, 4]
    assert [log["episode"] for log in logs] == [8, 16, 24, 32]
    assert all(math.isfinite(v) for log in logs for v in log.values() if isinstance(v, float))
    assert (out / "model.safetensors").is_file()
