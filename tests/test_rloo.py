"""RLOO trainer: TRL's documented command lines, learning, exact first ratio, token-level KL in the
trainer, metrics, resume == uninterrupted, 2 processes == 1 process.

The leave-one-out numbers of TRL's `test_rloo_reward` live in test_advantages.py; here they
are checked where the trainer uses them (the (k, num_prompts) layout of a real rollout).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from datasets import DatasetDict
from transformers import TrainerCallback

import posttrain.advantages as adv
import posttrain.trainers.online as online
import posttrain.trainers.rloo as rloo
from helpers import (
    RL_METRICS,
    flat,
    learning_rloo_config,
    letter_fraction,
    prompt_dataset,
    read_metrics,
    run_processes,
    train_and_last_log,
)
from helpers import rloo_config as config
from posttrain import cli
from posttrain.testing import build_tiny_causal_lm
from posttrain.trainers.rloo import RLOOTrainer
from posttrain.trainers.rloo_config import RLOOConfig

pytestmark = pytest.mark.usefixtures("one_thread")


# -- TRL's documented command lines ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts_on_disk(tmp_path_factory) -> Path:
    """A save_to_disk folder with the documented split name, a train split (rloo_tldr) and a test split."""
    path = tmp_path_factory.mktemp("prompts")
    DatasetDict(
        {"descriptiveness": prompt_dataset(64), "train": prompt_dataset(64), "test": prompt_dataset(8)}
    ).save_to_disk(path)
    return path


def check_run_dir(out: Path, updates: int) -> list[dict]:
    records = read_metrics(out)
    assert len(records) == updates
    for record in records:
        for name in RL_METRICS:
            assert name in record and math.isfinite(record[name]), name
        assert record["objective/entropy"] >= 0 and record["policy/entropy_avg"] >= 0
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # plain transformers loads the result
    return records


def test_seed_minimal_command_runs(tmp_path, prompts_on_disk, tiny_policy_dir, tiny_reward_model_dir):
    """The "getting started" command of TRL's RLOO docs, as written, with local paths and fewer episodes."""
    out = tmp_path / "models" / "minimal" / "rloo"
    argv = [
        "rloo",
        "--dataset_name",
        str(prompts_on_disk),
        "--dataset_train_split",
        "descriptiveness",
        "--learning_rate",
        "3e-6",
        "--output_dir",
        str(out),
        "--per_device_train_batch_size",
        "64",
        "--gradient_accumulation_steps",
        "1",
        "--total_episodes",
        "64",
        "--model_name_or_path",
        str(tiny_policy_dir),
        "--reward_model_path",
        str(tiny_reward_model_dir),
        "--missing_eos_penalty",
        "1.0",
    ]
    assert cli.main(argv) == 0
    (record,) = check_run_dir(out, updates=1)
    assert record["episode"] == 64


def test_seed_tldr_command_runs(tmp_path, prompts_on_disk, tiny_policy_dir, tiny_reward_model_dir):
    """Seed 000/001 rloo_tldr benchmark flags (2 epochs × 2 minibatches × GA 8) on tiny models."""
    out = tmp_path / "rloo_tldr"
    argv = [
        "rloo",
        "--dataset_name",
        str(prompts_on_disk),
        "--output_dir",
        str(out),
        "--num_ppo_epochs",
        "2",
        "--num_mini_batches",
        "2",
        "--learning_rate",
        "3e-6",
        "--per_device_train_batch_size",
        "8",
        "--gradient_accumulation_steps",
        "8",
        "--total_episodes",
        "128",
        "--model_name_or_path",
        str(tiny_policy_dir),
        "--sft_model_path",
        str(tiny_policy_dir),
        "--reward_model_path",
        str(tiny_reward_model_dir),
        "--local_rollout_forward_batch_size",
        "16",
        "--missing_eos_penalty",
        "1.0",
        "--stop_token",
        "eos",
        "--kl_coef",
        "0.03",
        "--num_sample_generations",
        "1",
    ]
    assert cli.main(argv) == 0
    check_run_dir(out, updates=1)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and {"query", "model response", "score"} <= set(samples[0])


def test_missing_reward_is_a_clear_error(tmp_path, prompts_on_disk, tiny_policy_dir, capsys):
    argv = [
        "rloo",
        "--dataset_name",
        str(prompts_on_disk),
        "--output_dir",
        str(tmp_path / "o"),
        "--model_name_or_path",
        str(tiny_policy_dir),
        "--total_episodes",
        "64",
    ]
    assert cli.main(argv) == 2
    assert "--reward_model_path" in capsys.readouterr().err


# -- the algorithm in the trainer ------------------------------------------------------------------


def test_learnable_reward_raises_scores(tmp_path, tiny_tokenizer):
    cfg = learning_rloo_config(tmp_path)
    trainer = RLOOTrainer(
        cfg, tiny_tokenizer, build_tiny_causal_lm(tiny_tokenizer), None, letter_fraction, prompt_dataset()
    )
    trainer.train()
    scores = [h["objective/scores"] for h in trainer.state.log_history[:-1]]
    assert len(scores) == 30
    assert sum(scores[-5:]) / 5 > sum(scores[:5]) / 5 + 0.08, scores


def test_first_minibatch_ratio_is_exactly_one(tmp_path, tiny_tokenizer, monkeypatch):
    calls = []

    def spy(logprobs, old_logprobs, *args, **kwargs):
        calls.append((logprobs.detach().clone(), old_logprobs.clone()))
        return adv_loss(logprobs, old_logprobs, *args, **kwargs)

    adv_loss = rloo.ppo_policy_loss
    monkeypatch.setattr(rloo, "ppo_policy_loss", spy)

    # 2 epochs × 2 minibatches × 2 micro-batches per update; the first minibatch (2 micro-batches)
    # runs before any optimizer step, so its ratio must be exactly 1.
    def trl_style_reward(texts):  # TRL RLOO's one-argument reward callable: decoded query + response
        assert all(t.startswith("Prompt number") for t in texts)
        return [t.count("e") / len(t) for t in texts]

    cfg = config(
        tmp_path,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_mini_batches=2,
        num_ppo_epochs=2,
        total_episodes=16,
    )
    RLOOTrainer(
        cfg, tiny_tokenizer, build_tiny_causal_lm(tiny_tokenizer), None, trl_style_reward, prompt_dataset()
    ).train()
    assert len(calls) == 2 * 8
    for update in range(2):
        first = calls[update * 8 : update * 8 + 8]
        assert all(torch.equal(new, old) for new, old in first[:2])
        assert not all(torch.equal(new, old) for new, old in first[2:])


def test_reinforce_case_skips_the_old_logprob_pass(tmp_path, tiny_tokenizer, tiny_reward_model, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("one epoch and one minibatch must reuse the update forward")

    class Recorder(TrainerCallback):
        def __init__(self):
            self.logs, self.ended = [], False

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(logs)

        def on_train_end(self, args, state, control, **kwargs):
            self.ended = True

    monkeypatch.setattr(online, "old_policy_logprobs", fail)
    recorder = Recorder()
    # TRL's keyword names, `tokenizer=` (TRL <= 0.11) for processing_class, a reward model plus a function.
    trainer = RLOOTrainer(
        config=config(tmp_path),
        tokenizer=tiny_tokenizer,
        policy=build_tiny_causal_lm(tiny_tokenizer),
        ref_policy=None,
        reward_model=[tiny_reward_model, letter_fraction],
        train_dataset=prompt_dataset(),
        callbacks=[recorder],
    )
    before = flat(trainer.policy).clone()
    last = train_and_last_log(trainer)
    assert last["val/ratio"] == 1.0 and last["policy/clipfrac_avg"] == 0.0
    assert not torch.equal(before, flat(trainer.policy))
    # on_log gets each logged entry (and the summary) with its epoch; log_history adds the step.
    history = trainer.state.log_history
    assert [e["step"] for e in history] == [1, 2, 2] and recorder.ended
    assert recorder.logs == [{k: v for k, v in e.items() if k != "step"} for e in history]


def test_token_level_kl_in_the_trainer(tmp_path, tiny_tokenizer, monkeypatch):
    """token_level_kl scatters the score onto each real completion's last token, and the resulting
    per-sequence reward (hence the whole run) equals the sequence-level one."""
    seen = []
    original = adv.token_level_kl_rewards

    def spy(scores, kl, mask, kl_coef):
        seen.append((scores, kl, mask))
        return original(scores, kl, mask, kl_coef)

    monkeypatch.setattr(adv, "token_level_kl_rewards", spy)
    policies = {}
    for token_level in (True, False):
        cfg = config(
            tmp_path / str(token_level),
            token_level_kl=token_level,
            kl_coef=0.1,
            total_episodes=16,
            num_ppo_epochs=2,
            response_length=8,
        )
        trainer = RLOOTrainer(
            cfg,
            tiny_tokenizer,
            build_tiny_causal_lm(tiny_tokenizer),
            build_tiny_causal_lm(tiny_tokenizer, seed=3),
            letter_fraction,
            prompt_dataset(),
        )
        trainer.train()
        policies[token_level] = (flat(trainer.policy), trainer.state.log_history[:-1])
    assert len(seen) == 4  # one call per rollout batch (16 episodes / 4), only in the token-level run
    for scores, kl, mask in seen:
        assert torch.all(kl[~mask] == 0) and kl[mask].abs().sum() > 0
        rewards, non_score = adv.kl_shaped_rewards(scores, kl, mask, 0.1)
        lengths = mask.sum(-1)
        last = rewards - non_score
        rows = torch.arange(len(scores))
        torch.testing.assert_close(last[rows, lengths - 1], scores)
        assert torch.count_nonzero(last) == torch.count_nonzero(scores)
    (tok_params, tok_log), (seq_params, seq_log) = policies[True], policies[False]
    # Float summation order differs (Σ_t(score·onehot + kl) vs score + Σ_t kl); Adam's first steps
    # amplify such last-bit differences on near-zero gradients to ~lr·1e-3.
    torch.testing.assert_close(tok_params, seq_params, rtol=0, atol=1e-5)
    for a, b in zip(tok_log, seq_log):
        assert a["objective/rlhf_reward"] == pytest.approx(b["objective/rlhf_reward"], abs=1e-6)
        assert a["objective/non_score_reward"] == pytest.approx(b["objective/non_score_reward"], abs=1e-6)


def test_resume_equals_uninterrupted(tmp_path, tiny_tokenizer):
    def trainer_for(out: Path, **kw) -> RLOOTrainer:
        cfg = config(
            tmp_path,
            output_dir=str(out),
            total_episodes=32,
            num_ppo_epochs=2,
            num_mini_batches=2,
            per_device_train_batch_size=2,
            save_steps=2,
            normalize_advantage=True,
            whiten_rewards=True,
            # the reference moves every 3 optimizer steps (4 per rollout batch): the checkpoint holds it
            sync_ref_model=True,
            ref_model_sync_steps=3,
            **kw,
        )
        return RLOOTrainer(
            cfg, tiny_tokenizer, build_tiny_causal_lm(tiny_tokenizer), None, letter_fraction, prompt_dataset()
        )

    full = trainer_for(tmp_path / "full")
    full.train()
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-2", resumed_dir / "checkpoint-2")
    resumed = trainer_for(resumed_dir, resume_from_checkpoint="latest")
    resumed.train()
    assert torch.equal(flat(full.policy), flat(resumed.policy))
    assert torch.equal(flat(full.ref_model), flat(resumed.ref_model))
    assert not torch.equal(flat(full.ref_model), flat(build_tiny_causal_lm(tiny_tokenizer)))
    # 32 episodes, 4 per rollout batch: 8 entries and the summary; the resumed run keeps the
    # checkpoint's 2 entries of log_history and logs 6 more.
    assert len(full.state.log_history) == 9 and len(resumed.state.log_history) == 9
    assert resumed.state.log_history[:2] == full.state.log_history[:2]
    for a, b in zip(full.state.log_history[2:8], resumed.state.log_history[2:8]):
        assert {k: v for k, v in a.items() if k != "eps"} == {k: v for k, v in b.items() if k != "eps"}


def test_save_checkpoint_between_rollout_batches_resumes_from_there(tmp_path, tiny_tokenizer):
    """transformers' `_save_checkpoint(model, trial)`, which TRL's RLOO test calls on a new trainer:
    checkpoint-{global_step} of the state as it is; a run resumed from it equals one never stopped."""

    def trainer_for(out: Path, **kw) -> RLOOTrainer:
        cfg = config(tmp_path, output_dir=str(out), total_episodes=8, per_device_train_batch_size=2, **kw)
        return RLOOTrainer(
            cfg, tiny_tokenizer, build_tiny_causal_lm(tiny_tokenizer), None, letter_fraction, prompt_dataset()
        )

    full = trainer_for(tmp_path / "full")
    full._save_checkpoint(full.model, trial=None)
    shutil.copytree(tmp_path / "full" / "checkpoint-0", tmp_path / "resumed" / "checkpoint-0")
    shutil.rmtree(tmp_path / "full" / "checkpoint-0")
    full.train()
    resumed = trainer_for(tmp_path / "resumed", resume_from_checkpoint="latest")
    resumed.train()
    assert full.state.global_step == resumed.state.global_step == 4  # 8 episodes, 2 per rollout batch
    assert torch.equal(flat(full.policy), flat(resumed.policy))
    # TRL 0.x's RLOO ends log_history with the last step's metrics: the summary entry holds them too.
    assert full.state.log_history[-1]["objective/rlhf_reward"] == full.state.log_history[-2]["objective/rlhf_reward"]
    assert "train_loss" in full.state.log_history[-1]


def test_config_checks():
    with pytest.raises(ValueError, match="rloo_k"):
        RLOOConfig(rloo_k=1)
    with pytest.raises(ValueError, match="divisible"):
        RLOOConfig(per_device_train_batch_size=3, rloo_k=2).derive_sizes(1, 10)
    cfg = RLOOConfig()
    assert (cfg.kl_coef, cfg.cliprange, cfg.rloo_k, cfg.num_ppo_epochs, cfg.temperature, cfg.token_level_kl) == (
        0.05,
        0.2,
        2,
        4,
        0.7,
        False,
    )
    assert (cfg.reward_clip_range, cfg.normalize_reward, cfg.normalize_advantage, cfg.whiten_rewards) == (
        10.0,
        False,
        False,
        False,
    )


# -- 2 processes == 1 process ----------------------------------------------------------------------
# Completions are made independent of how prompts are spread over ranks: each row is sampled on its
# own, from a generator seeded by its prompt tokens and its sample index. Everything downstream
# (scores, reference logprobs, leave-one-out advantages, the global loss normalizer, DDP's gradient
# average, clipping, the optimizer step) is what the test compares. One process runs GA 2 with
# micro-batch 4; two processes run GA 1 with micro-batch 4 each: the same global batch of 8.
DP_SCRIPT = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, sys.argv[3])
    from test_rloo import dp_run
    dp_run(sys.argv[1], sys.argv[2])
    from posttrain.distributed import shutdown
    shutdown()
""")


def dp_run(algo: str, out_path: str) -> None:
    import tempfile

    import posttrain.trainers.online as shared
    from helpers import per_row_generate, train_and_last_log
    from posttrain.testing import build_tiny_tokenizer

    shared.generate = per_row_generate
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tok = build_tiny_tokenizer()
    policy = build_tiny_causal_lm(tok)
    common = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2 // world,
        total_episodes=8,
        response_length=6,
        report_to=["none"],
        num_sample_generations=0,
        save_steps=0,
        temperature=1.0,
        seed=7,
        # TR-DPO's reference update after each of the 2 optimizer steps: every rank mixes its own copy
        sync_ref_model=True,
        ref_model_sync_steps=1,
        ref_model_mixup_alpha=0.5,
    )
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    if algo == "rloo":
        cfg = RLOOConfig(**common, rloo_k=2, num_ppo_epochs=2, kl_coef=0.1, normalize_advantage=True)
        trainer = RLOOTrainer(
            cfg,
            tok,
            policy,
            build_tiny_causal_lm(tok, seed=3),
            letter_fraction,
            prompt_dataset(),
            optimizers=(optimizer, None),
        )
        params = trainer.policy
    else:
        from posttrain.trainers.grpo import GRPOTrainer
        from posttrain.trainers.grpo_config import GRPOConfig

        cfg = GRPOConfig(**common, num_generations=2, num_iterations=2, beta=0.1)
        trainer = GRPOTrainer(
            policy,
            letter_fraction,
            cfg,
            prompt_dataset(),
            processing_class=tok,
            ref_model=build_tiny_causal_lm(tok, seed=3),
            optimizers=(optimizer, None),
        )
        params = trainer.model
    assert trainer.run.world_size == world, "the launcher did not start a real process group"
    last = train_and_last_log(trainer)
    torch.save(flat(trainer.ref_model), f"{out_path}.ref{trainer.run.accelerator.process_index}")
    if trainer.run.is_main:
        torch.save({"params": flat(params), "scores": last["objective/scores"]}, out_path)


def run_dp_equivalence(tmp_path: Path, algo: str) -> None:
    script = tmp_path / "dp.py"
    script.write_text(DP_SCRIPT)
    here = str(Path(__file__).parent)
    run_processes([str(script), algo, str(tmp_path / "one.pt"), here], nproc=1, timeout=150, check=True)
    # `accelerate launch --cpu --num_processes 2` starts a single process with accelerate 1.15;
    # torchrun with ACCELERATE_USE_CPU gives accelerate a real 2-rank gloo group.
    run_processes([str(script), algo, str(tmp_path / "two.pt"), here], timeout=150, check=True)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    from posttrain.testing import build_tiny_tokenizer

    initial = flat(build_tiny_causal_lm(build_tiny_tokenizer()))
    assert not torch.equal(one["params"], initial)
    assert two["scores"] == pytest.approx(one["scores"], rel=1e-6)
    torch.testing.assert_close(two["params"], one["params"], rtol=0, atol=1e-6)
    # sync_ref_model: the reference moved, identically on both ranks and as with one process
    refs = [torch.load(tmp_path / name) for name in ("one.pt.ref0", "two.pt.ref0", "two.pt.ref1")]
    assert not torch.equal(refs[0], flat(build_tiny_causal_lm(build_tiny_tokenizer(), seed=3)))
    assert torch.equal(refs[1], refs[2])
    torch.testing.assert_close(refs[1], refs[0], rtol=0, atol=1e-6)


@pytest.mark.multiproc
def test_two_processes_equal_one_process(tmp_path):
    run_dp_equivalence(tmp_path, "rloo")


def nan_loss_policy(tiny_tokenizer):
    """A policy whose training loss is NaN: one NaN in the LM head makes every logit row NaN."""
    policy = build_tiny_causal_lm(tiny_tokenizer)
    with torch.no_grad():
        policy.get_output_embeddings().weight[0, 0] = float("nan")
    return policy


@pytest.mark.parametrize("algo", ["rloo", "grpo"])
def test_nonfinite_losses_skip_steps_then_stop_cleanly(tmp_path, tiny_tokenizer, algo):
    from posttrain.health import TrainingDiverged
    from posttrain.trainers.grpo import GRPOTrainer
    from posttrain.trainers.grpo_config import GRPOConfig

    def build(updates: int):
        common = dict(
            output_dir=str(tmp_path / f"{algo}-{updates}"),
            per_device_train_batch_size=4,
            total_episodes=4 * updates,
            response_length=4,
            report_to="none",
            num_sample_generations=0,
            save_steps=0,
            logging_steps=1,
        )
        policy = nan_loss_policy(tiny_tokenizer)
        if algo == "rloo":
            return RLOOTrainer(
                RLOOConfig(**common, rloo_k=2, kl_coef=0.0, num_ppo_epochs=1),
                tiny_tokenizer,
                policy,
                None,
                letter_fraction,
                prompt_dataset(),
            ), policy
        return GRPOTrainer(
            policy,
            letter_fraction,
            GRPOConfig(**common, num_generations=2, beta=0.0),
            prompt_dataset(),
            processing_class=tiny_tokenizer,
        ), policy

    trainer, policy = build(updates=3)
    before = flat(policy)
    trainer.train()  # three NaN losses in a row: each step skipped, training goes on
    after = flat(policy)
    finite = torch.isfinite(before)
    assert torch.equal(before[finite], after[finite])  # no optimizer step was taken
    assert trainer.run.health.nonfinite_total == 3
    assert trainer.run.progress.optimizer_steps == 0

    trainer, _ = build(updates=6)
    with pytest.raises(TrainingDiverged, match="5 non-finite losses in a row"):
        trainer.train()


@pytest.mark.parametrize(("epochs", "max_steps", "updates"), [(1, 2, 2), (2, 3, 2)])
def test_max_steps_overrides_the_episode_budget(tmp_path, prompts_on_disk, tiny_policy_dir, epochs, max_steps, updates):
    """`--max_steps N` stops after N optimizer steps (ceil(N / steps per rollout batch) rollout batches),
    whatever the dataset size would give: 64 prompts × 2 samples would be 32 updates of 4."""
    out = tmp_path / "out"
    argv = [
        "rloo",
        "--dataset_name",
        str(prompts_on_disk),
        "--model_name_or_path",
        str(tiny_policy_dir),
        "--reward_funcs",
        f"{__name__}:letter_fraction",
        "--output_dir",
        str(out),
        "--per_device_train_batch_size",
        "4",
        "--rloo_k",
        "2",
        "--num_ppo_epochs",
        str(epochs),
        "--max_steps",
        str(max_steps),
        "--response_length",
        "4",
        "--logging_steps",
        "1",
        "--report_to",
        "none",
    ]
    assert cli.main(argv) == 0
    records = read_metrics(out)
    assert len(records) == updates
    assert records[-1]["episode"] == updates * 4


def test_max_steps_sets_the_rollout_count_of_every_online_config():
    from posttrain import GRPOConfig, OnlineDPOConfig, PPOConfig

    grpo = GRPOConfig(per_device_train_batch_size=16, num_generations=2, max_steps=32).derive_sizes(1, 10_000)
    assert grpo.total_episodes == 512 and grpo.num_total_batches == 32  # TRL's own benchmark settings
    ppo = PPOConfig(per_device_train_batch_size=4, num_mini_batches=2, num_ppo_epochs=4, max_steps=16)
    assert ppo.derive_sizes(2, 1000).num_total_batches == 2  # 8 optimizer steps per rollout batch
    dpo = OnlineDPOConfig(per_device_train_batch_size=4, max_steps=3).derive_sizes(1, 1000)
    assert dpo.num_total_batches == 3
