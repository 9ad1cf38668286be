"""transformers.TrainerCallback objects in posttrain's trainers: the events all seven trainers (SFT,
reward, RLOO, GRPO, PPO, Online DPO, XPO) fire and their order, trainer.state (global_step, epoch,
log_history and the end-of-training summary), TrainOutput, callbacks stopping training or asking for a
checkpoint, log_history across a resume, the callback list, evaluate(), and LogCompletionsCallback."""

from __future__ import annotations

import json
import math
import shutil
import types

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_utils import TrainOutput

import helpers
from helpers import SENTENCES, online_trainer, reward_trainer
from posttrain.callbacks import LogCompletionsCallback
from posttrain.configs import ConfigError
from posttrain.testing import build_tiny_causal_lm

PAIRS = [{"chosen": f"Q: {w}? A: The sea is blue.", "rejected": f"Q: {w}? A: dog."} for w in SENTENCES[:4]]
SUMMARY_KEYS = {
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
    "total_flos",
    "train_loss",
    "epoch",
    "step",
}


class Recorder(TrainerCallback):
    """Records (event, state.global_step, payload) for every event, as a user's callback would."""

    def __init__(self):
        self.events = []
        self.kwargs = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.kwargs = kwargs
        self.events.append(("train_begin", state.global_step, None))

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step_end", state.global_step, state.epoch))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log", state.global_step, dict(logs)))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.events.append(("evaluate", state.global_step, dict(metrics)))

    def on_save(self, args, state, control, **kwargs):
        self.events.append(("save", state.global_step, None))

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(("train_end", state.global_step, None))


def sft_trainer(tmp_path, tokenizer, callbacks=None, eval_dataset=True, **overrides):
    """4 steps over the 8 SENTENCES at batch 2, logging every 2, evaluated on the first 2 when asked."""
    return helpers.sft_trainer(
        tmp_path,
        tokenizer,
        [{"text": s} for s in SENTENCES],
        [{"text": s} for s in SENTENCES[:2]] if eval_dataset else None,
        name="sft",
        callbacks=callbacks,
        **{"max_steps": 4, "logging_steps": 2, **overrides},
    )


def names(recorder):
    return [(name, step) for name, step, _ in recorder.events]


def add_pop_and_remove(trainer, kept: Recorder) -> Recorder:
    """The callback list as on transformers.Trainer: add_callback(a class) instantiates it and
    pop_callback(the class) hands that instance back; `kept` is added, and a second Recorder is added
    and removed again. Returns the removed one (it must see no event)."""
    before = list(trainer.callback_handler.callbacks)
    trainer.add_callback(Recorder)  # a class is instantiated
    (added,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, Recorder)]
    assert trainer.pop_callback(Recorder) is added and trainer.callback_handler.callbacks == before
    removed = Recorder()
    trainer.add_callback(kept)
    trainer.add_callback(removed)
    trainer.remove_callback(removed)
    assert trainer.callback_handler.callbacks == [*before, kept]
    return removed


def log_and_evaluate(trainer, recorder: Recorder) -> dict:
    """trainer.log then trainer.evaluate before training: both entries land in log_history at step 0
    and reach the callbacks in order. Returns the evaluation metrics."""
    trainer.log({"custom": 1.5})
    metrics = trainer.evaluate()
    assert trainer.state.log_history == [
        {"custom": 1.5, "epoch": 0.0, "step": 0},
        {**metrics, "epoch": 0.0, "step": 0},
    ]
    assert names(recorder) == [("log", 0), ("log", 0), ("evaluate", 0)]
    return metrics


def test_sft_fires_every_event_in_transformers_order(tmp_path, tiny_tokenizer):
    recorder = Recorder()
    # 8 examples, batch 2: one epoch is 4 steps, so step s ends at epoch s/4.
    trainer = sft_trainer(tmp_path, tiny_tokenizer, callbacks=[recorder], eval_steps=2, save_steps=2)
    assert isinstance(trainer.state, TrainerState) and isinstance(trainer.control, TrainerControl)
    assert trainer.state.max_steps == 4 and trainer.state.num_train_epochs == 1
    assert trainer.state.logging_steps == 2 and trainer.state.save_steps == 2 and trainer.state.eval_steps == 2
    assert trainer.state.train_batch_size == 2 and trainer.state.is_world_process_zero
    output = trainer.train()

    # on_step_end comes before the step's log / evaluation / checkpoint, as in transformers.Trainer;
    # the last step writes no checkpoint (the final save follows) and the summary is logged last.
    assert names(recorder) == [
        ("train_begin", 0),
        ("step_end", 1),
        ("step_end", 2),
        ("log", 2),
        ("log", 2),
        ("evaluate", 2),
        ("save", 2),
        ("step_end", 3),
        ("step_end", 4),
        ("log", 4),
        ("log", 4),
        ("evaluate", 4),
        ("log", 4),
        ("train_end", 4),
    ]
    assert [epoch for name, _, epoch in recorder.events if name == "step_end"] == [0.25, 0.5, 0.75, 1.0]
    assert (tmp_path / "sft" / "checkpoint-2").is_dir() and not (tmp_path / "sft" / "checkpoint-4").exists()
    # Callbacks get the model and the tokenizer as keyword arguments, as under transformers.
    assert recorder.kwargs["model"] is trainer.run.unwrapped()
    assert recorder.kwargs["processing_class"] is trainer.processing_class

    # log_history: one entry per logging step and per evaluation, with step and epoch; then the summary.
    history = trainer.state.log_history
    assert [(e["step"], e["epoch"]) for e in history] == [(2, 0.5), (2, 0.5), (4, 1.0), (4, 1.0), (4, 1.0)]
    assert {"loss", "lr", "grad_norm", "num_tokens", "mean_token_accuracy", "entropy"} <= set(history[0])
    assert {"eval_loss", "eval_mean_token_accuracy", "eval_entropy"} <= set(history[1])
    # on_log receives what was logged, with epoch (the step is the state's), as transformers passes it.
    logged = [payload for name, _, payload in recorder.events if name == "log"]
    assert logged == [{k: v for k, v in e.items() if k != "step"} for e in history]
    # on_evaluate receives the eval metrics with their epoch.
    evaluated = [payload for name, _, payload in recorder.events if name == "evaluate"]
    assert evaluated[1] == {k: v for k, v in history[3].items() if k != "step"}
    # The same numbers went to metrics.jsonl.
    jsonl = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert jsonl[2] == history[2]

    summary = history[-1]
    assert set(summary) == SUMMARY_KEYS and summary["step"] == 4 and summary["epoch"] == 1.0
    assert isinstance(output, TrainOutput) and output.global_step == 4 == trainer.state.global_step
    assert output.training_loss == summary["train_loss"] and output.metrics == {
        k: v for k, v in summary.items() if k != "step"
    }
    # 4 steps of 2 examples in train_runtime seconds.
    runtime = summary["train_runtime"]
    assert summary["train_samples_per_second"] == pytest.approx(8 / runtime, rel=2e-2)
    assert summary["train_steps_per_second"] == pytest.approx(4 / runtime, rel=2e-2)
    # transformers' estimate: 6 · input tokens · non-embedding parameters.
    params = trainer.run.unwrapped().num_parameters(exclude_embeddings=True)
    assert summary["total_flos"] == pytest.approx(6 * history[2]["num_tokens"] * params)


def test_train_loss_is_the_mean_of_the_step_losses(tmp_path, tiny_tokenizer):
    # logging_steps=1 and no accumulation: each logged loss is one step's token-mean loss.
    trainer = sft_trainer(tmp_path, tiny_tokenizer, eval_dataset=False, logging_steps=1)
    output = trainer.train()
    steps = trainer.state.log_history[:-1]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]
    assert output.training_loss == pytest.approx(sum(e["loss"] for e in steps) / 4, rel=1e-6)


def test_a_callback_stops_sft_after_that_step(tmp_path, tiny_tokenizer):
    class StopAtTwo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True

    recorder = Recorder()
    trainer = sft_trainer(
        tmp_path, tiny_tokenizer, callbacks=[StopAtTwo(), recorder], max_steps=6, logging_steps=5, save_steps=2
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    output = trainer.train()
    assert output.global_step == 2 == trainer.state.global_step
    # The stopping step ends training like the last step: logged and evaluated, no checkpoint, the model saved.
    assert names(recorder) == [
        ("train_begin", 0),
        ("step_end", 1),
        ("step_end", 2),
        ("log", 2),
        ("log", 2),
        ("evaluate", 2),
        ("log", 2),
        ("train_end", 2),
    ]
    assert not (tmp_path / "sft" / "checkpoint-2").exists()
    assert (tmp_path / "sft" / "model.safetensors").is_file()
    assert trainer.state.log_history[-1]["step"] == 2 and trainer.state.log_history[-1]["epoch"] == 0.5
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_a_callback_asks_for_a_checkpoint_and_a_log(tmp_path, tiny_tokenizer):
    class SaveAndLogAtOne(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                control.should_save = control.should_log = True

    trainer = sft_trainer(
        tmp_path, tiny_tokenizer, callbacks=[SaveAndLogAtOne()], eval_dataset=False, max_steps=3, logging_steps=10
    )
    trainer.train()
    assert (tmp_path / "sft" / "checkpoint-1").is_dir()
    assert [e["step"] for e in trainer.state.log_history] == [1, 3, 3]  # asked, last step, summary


def test_callback_list_as_on_transformers_trainer(tmp_path, tiny_tokenizer):
    trainer = sft_trainer(tmp_path, tiny_tokenizer, eval_dataset=False, max_steps=1)
    assert trainer.callback_handler.callbacks == []
    kept = Recorder()
    removed = add_pop_and_remove(trainer, kept)
    trainer.train()
    assert names(kept) == [("train_begin", 0), ("step_end", 1), ("log", 1), ("log", 1), ("train_end", 1)]
    assert removed.events == []


def test_trainer_log_and_evaluate_reach_the_state_and_callbacks(tmp_path, tiny_tokenizer):
    recorder = Recorder()
    trainer = sft_trainer(tmp_path, tiny_tokenizer, callbacks=[recorder])
    metrics = log_and_evaluate(trainer, recorder)
    assert set(metrics) == {"eval_loss", "eval_mean_token_accuracy", "eval_entropy", "eval_num_tokens"}


def test_reward_training_fires_the_events(tmp_path, tiny_tokenizer):
    recorder = Recorder()
    trainer = reward_trainer(tmp_path, tiny_tokenizer, PAIRS, PAIRS[:2], name="rm", callbacks=[recorder], save_steps=1)
    output = trainer.train()
    assert names(recorder) == [
        ("train_begin", 0),
        ("step_end", 1),
        ("log", 1),
        ("save", 1),
        ("step_end", 2),
        ("log", 2),
        ("log", 2),
        ("evaluate", 2),
        ("log", 2),
        ("train_end", 2),
    ]
    history = trainer.state.log_history
    # 4 pairs, batch 2: one epoch is 2 steps.
    assert [(e["step"], e["epoch"]) for e in history] == [(1, 0.5), (2, 1.0), (2, 1.0), (2, 1.0)]
    assert {"loss", "accuracy", "margin", "lr", "grad_norm"} <= set(history[0])
    assert {"eval_loss", "eval_accuracy", "eval_margin", "eval_min_reward"} <= set(history[2])
    evaluated = recorder.events[7][2]
    assert evaluated == {k: v for k, v in history[2].items() if k != "step"}
    assert set(history[-1]) == SUMMARY_KEYS
    assert output.global_step == 2 and output.training_loss == history[-1]["train_loss"]
    # 2 steps of 2 pairs.
    assert history[-1]["train_samples_per_second"] == pytest.approx(4 / history[-1]["train_runtime"], rel=2e-2)


# --------------------------------------------------------------------------------------------
# LogCompletionsCallback
# --------------------------------------------------------------------------------------------
class TableSink:
    def __init__(self):
        self.tables = []

    def log_table(self, name, rows, step):
        self.tables.append((name, rows, step))


def completions_trainer(**methods):
    """What LogCompletionsCallback reads from an online trainer: eval prompts, sample_completions,
    its tracker, args.logging_steps."""
    calls = []

    def sample_completions(num_prompts):
        calls.append(num_prompts)
        return [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(num_prompts)]

    trainer = types.SimpleNamespace(
        eval_dataset=[{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}],
        sample_completions=methods.get("sample_completions", sample_completions),
        run=types.SimpleNamespace(tracker=TableSink()),
        args=types.SimpleNamespace(logging_steps=2),
    )
    return trainer, calls


def test_log_completions_callback_is_a_transformers_callback():
    trainer, calls = completions_trainer()
    callback = LogCompletionsCallback(trainer, num_prompts=2)
    assert isinstance(callback, TrainerCallback)
    control = TrainerControl()
    for step in (1, 2, 2, 3, 4):  # every logging_steps (2) steps, once per step
        callback.on_step_end(trainer.args, TrainerState(global_step=step, logging_steps=2), control)
    assert calls == [2, 2]
    tables = trainer.run.tracker.tables
    assert [(name, step) for name, _, step in tables] == [("completions", 2), ("completions", 4)]
    assert tables[0][1] == [
        {"step": 2, "prompt": "p0", "completion": "c0"},
        {"step": 2, "prompt": "p1", "completion": "c1"},
    ]

    # freq overrides logging_steps; num_prompts=None samples every eval prompt (TRL's default).
    trainer, calls = completions_trainer()
    callback = LogCompletionsCallback(trainer, freq=3)
    for step in range(1, 7):
        callback.on_step_end(trainer.args, TrainerState(global_step=step, logging_steps=2), control)
    assert calls == [3, 3] and [step for *_, step in trainer.run.tracker.tables] == [3, 6]


def test_log_completions_callback_errors():
    trainer, _ = completions_trainer()
    with pytest.raises(ConfigError, match="eval_dataset"):
        LogCompletionsCallback(types.SimpleNamespace(eval_dataset=None))
    with pytest.raises(ConfigError, match="num_prompts=0"):
        LogCompletionsCallback(trainer, num_prompts=0)
    with pytest.raises(ConfigError, match="freq=0"):
        LogCompletionsCallback(trainer, freq=0)
    with pytest.raises(ConfigError, match="generation_config"):
        LogCompletionsCallback(trainer, generation_config=object())
    with pytest.raises(ConfigError, match="sample"):
        LogCompletionsCallback(types.SimpleNamespace(eval_dataset=[{"prompt": "a"}]))


def test_log_completions_callback_in_online_dpo_training(tmp_path, tiny_tokenizer):
    from posttrain.trainers.online_dpo import OnlineDPOTrainer
    from posttrain.trainers.online_dpo_config import OnlineDPOConfig

    prompts = Dataset.from_dict({"prompt": ["Hello world", "The quick brown fox", "Once upon a time", "Thank you"]})
    trainer = OnlineDPOTrainer(
        build_tiny_causal_lm(tiny_tokenizer),
        reward_funcs=[lambda prompts, completions, **kw: [float(len(c)) for c in completions]],
        args=OnlineDPOConfig(
            output_dir=str(tmp_path / "odpo"),
            per_device_train_batch_size=4,  # prompts, 2 completions each
            total_episodes=16,
            max_new_tokens=4,
            logging_steps=1,
            report_to="none",
            save_steps=0,
            num_sample_generations=0,
        ),
        processing_class=tiny_tokenizer,
        train_dataset=prompts,
        eval_dataset=prompts,
    )
    trainer.add_callback(LogCompletionsCallback(trainer, num_prompts=2))
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "odpo" / "samples.jsonl").read_text().splitlines()]
    # Two rollout batches of 4 prompts, logged at steps 1 and 2, two prompts each, with their scores.
    assert [(row["step"], row["prompt"]) for row in rows] == [
        (1, "Hello world"),
        (1, "The quick brown fox"),
        (2, "Hello world"),
        (2, "The quick brown fox"),
    ]
    assert all(isinstance(row["score"], float) for row in rows)


# --------------------------------------------------------------------------------------------
# the online trainers
# --------------------------------------------------------------------------------------------
ONLINE = ["rloo", "grpo", "ppo", "online_dpo", "xpo"]


def constant_reward(prompts, completions, **kwargs):
    return [2.0] * len(completions)


def prompts_per_pass(algo):
    """Prompts that make one pass (epoch) two rollout batches: 4 completions per batch over
    samples_per_prompt completions per prompt."""
    return 8 if algo == "ppo" else 4


@pytest.mark.parametrize("algo", ONLINE)
def test_online_trainers_fire_every_event_with_the_transformers_state(tmp_path, tiny_tokenizer, algo):
    recorder = Recorder()
    trainer = online_trainer(
        algo, tmp_path / algo, tiny_tokenizer, callbacks=[recorder], prompts=prompts_per_pass(algo)
    )
    state = trainer.state
    assert isinstance(state, TrainerState) and isinstance(trainer.control, TrainerControl)
    # One rollout batch is one step: 8 episodes of 4 completions; 2 batches make one pass over the prompts.
    assert (state.max_steps, state.num_train_epochs, state.logging_steps, state.save_steps) == (2, 1.0, 1, 1)
    # per_device_train_batch_size, as transformers' state holds it (prompts for Online DPO / XPO)
    assert state.train_batch_size == (2 if algo in ("online_dpo", "xpo") else 4) and state.is_world_process_zero
    # What TRL code reads on the trainer object.
    assert trainer.args.output_dir == str(tmp_path / algo) and trainer.processing_class is not None
    assert trainer.accelerator is trainer.run.accelerator and len(trainer.train_dataset) == prompts_per_pass(algo)
    assert trainer.eval_dataset is None and callable(trainer.data_collator)
    assert trainer.ref_model is not None  # every algorithm here has a reference by default
    before = [p.detach().clone() for p in trainer.model.parameters()]
    output = trainer.train()

    # on_step_end before the step's log and checkpoint; the last rollout batch writes no checkpoint
    # (the final save follows); the summary is logged last.
    assert names(recorder) == [
        ("train_begin", 0),
        ("step_end", 1),
        ("log", 1),
        ("save", 1),
        ("step_end", 2),
        ("log", 2),
        ("log", 2),
        ("train_end", 2),
    ]
    assert [epoch for name, _, epoch in recorder.events if name == "step_end"] == [0.5, 1.0]
    out = tmp_path / algo
    assert (out / "checkpoint-1").is_dir() and not (out / "checkpoint-2").exists()
    assert (out / "model.safetensors").is_file()
    assert recorder.kwargs["model"] is trainer.model
    assert recorder.kwargs["processing_class"] is trainer.processing_class

    history = trainer.state.log_history
    assert [(e["step"], e["epoch"]) for e in history] == [(1, 0.5), (2, 1.0), (2, 1.0)]
    assert [e["episode"] for e in history[:2]] == [4, 8] and all("lr" in e for e in history[:2])
    logged = [payload for name, _, payload in recorder.events if name == "log"]
    assert logged == [{k: v for k, v in e.items() if k != "step"} for e in history]
    # The logged numbers are the ones in metrics.jsonl.
    jsonl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert history[:2] == jsonl

    # The summary: transformers' keys, and the last rollout batch's metrics again (TRL 0.x's on-policy
    # trainers end log_history with them).
    summary = history[-1]
    assert set(summary) == SUMMARY_KEYS | set(history[-2]) and summary["total_flos"] == 0.0
    assert {k: summary[k] for k in history[-2]} == history[-2]
    assert isinstance(output, TrainOutput) and output.global_step == 2 == trainer.state.global_step
    assert output.training_loss == summary["train_loss"] and math.isfinite(output.training_loss)
    assert output.metrics == {k: summary[k] for k in SUMMARY_KEYS if k != "step"}
    # 8 episodes in 2 rollout batches in train_runtime seconds.
    runtime = summary["train_runtime"]
    assert summary["train_samples_per_second"] == pytest.approx(8 / runtime, rel=2e-2)
    assert summary["train_steps_per_second"] == pytest.approx(2 / runtime, rel=2e-2)
    if algo == "rloo":
        # One optimizer step per rollout batch whose loss is the mean clipped sequence loss:
        # train_loss is the mean of the two logged loss/policy_avg.
        expected = (history[0]["loss/policy_avg"] + history[1]["loss/policy_avg"]) / 2
        assert output.training_loss == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


@pytest.mark.parametrize("algo", ["rloo", "online_dpo"])
def test_a_callback_stops_online_training_after_that_rollout_batch(tmp_path, tiny_tokenizer, algo):
    class StopAtOne(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                control.should_training_stop = True

    recorder = Recorder()
    # 3 rollout batches, logging every 2: the stopping batch, no logging step, is logged in the summary
    # entry (as transformers / TRL do with the metrics since the last log), with no checkpoint.
    trainer = online_trainer(
        algo, tmp_path / algo, tiny_tokenizer, callbacks=[StopAtOne(), recorder], total_episodes=12, logging_steps=2
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    output = trainer.train()
    assert output.global_step == 1 == trainer.state.global_step and trainer.run.progress.update == 1
    assert names(recorder) == [("train_begin", 0), ("step_end", 1), ("log", 1), ("train_end", 1)]
    assert not (tmp_path / algo / "checkpoint-1").exists()
    assert (tmp_path / algo / "model.safetensors").is_file()
    assert [e["step"] for e in trainer.state.log_history] == [1]
    assert "lr" in trainer.state.log_history[-1] and "train_loss" in trainer.state.log_history[-1]
    assert trainer.state.log_history[-1]["train_samples_per_second"] == pytest.approx(
        4 / trainer.state.log_history[-1]["train_runtime"], rel=2e-2
    )  # transformers rounds train_runtime to 4 decimals: on a 30 ms run that is up to 0.2%
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_online_resume_keeps_log_history(tmp_path, tiny_tokenizer):
    full = online_trainer("rloo", tmp_path / "full", tiny_tokenizer)
    full.train()
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-1", resumed_dir / "checkpoint-1")
    recorder = Recorder()
    resumed = online_trainer("rloo", resumed_dir, tiny_tokenizer, callbacks=[recorder], resume_from_checkpoint="latest")
    output = resumed.train()
    # Callbacks see the resumed step at train begin; the checkpoint's entry comes first in log_history.
    assert names(recorder) == [("train_begin", 1), ("step_end", 2), ("log", 2), ("log", 2), ("train_end", 2)]
    history = resumed.state.log_history
    assert [e["step"] for e in history] == [1, 2, 2] and history[0] == full.state.log_history[0]
    assert {k: v for k, v in history[1].items() if k != "eps"} == {
        k: v for k, v in full.state.log_history[1].items() if k != "eps"
    }
    # The summary counts this call's work: 1 rollout batch of 4 episodes.
    assert output.global_step == 2
    assert history[-1]["train_steps_per_second"] == pytest.approx(1 / history[-1]["train_runtime"], rel=2e-2)
    assert history[-1]["train_samples_per_second"] == pytest.approx(4 / history[-1]["train_runtime"], rel=2e-2)


def test_online_trainer_log_evaluate_and_the_callback_list(tmp_path, tiny_tokenizer):
    eval_prompts = Dataset.from_dict({"prompt": ["Hello", "Thank you", "The sea", "Once"]})
    recorder = Recorder()
    trainer = online_trainer(
        "rloo",
        tmp_path / "rloo",
        tiny_tokenizer,
        eval_dataset=eval_prompts,
        reward=constant_reward,
        missing_eos_penalty=1.0,
        per_device_eval_batch_size=3,  # two eval batches: 3 prompts, then 1
        eval_steps=2,
    )
    removed = add_pop_and_remove(trainer, recorder)

    metrics = log_and_evaluate(trainer, recorder)
    assert set(metrics) == {
        "eval_objective/scores",
        "eval_completions/mean_length",
        "eval_val/num_eos_tokens",
        "eval_loss",  # RLOO's loss on sampled groups (TRL's name)
    }
    assert metrics["eval_loss"] == pytest.approx(0.0, abs=1e-6)  # each prompt's leave-one-out advantages sum to 0
    # Each score is 2.0, less missing_eos_penalty for the completions of the 4 prompts that did not end.
    eos = metrics["eval_val/num_eos_tokens"]
    assert 0 <= eos <= 4 and metrics["eval_objective/scores"] == pytest.approx(2.0 - (4 - eos) / 4)
    assert 1 <= metrics["eval_completions/mean_length"] <= 4  # response_length 4

    # eval_steps=2: evaluated after the second rollout batch, before the summary.
    trainer.train()
    assert [e["step"] for e in trainer.state.log_history] == [0, 0, 1, 2, 2, 2]
    assert set(trainer.state.log_history[4]) == {*metrics, "epoch", "step"}
    assert ("evaluate", 2) in names(recorder) and removed.events == []


def test_log_completions_callback_in_rloo_training(tmp_path, tiny_tokenizer):
    prompts = Dataset.from_dict({"prompt": ["Hello world", "Thank you", "Good morning"]})
    trainer = online_trainer(
        "rloo", tmp_path / "rloo", tiny_tokenizer, eval_dataset=prompts, reward=constant_reward, save_steps=0
    )
    trainer.add_callback(LogCompletionsCallback(trainer, num_prompts=2))
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "rloo" / "samples.jsonl").read_text().splitlines()]
    assert [(row["step"], row["prompt"]) for row in rows] == [
        (1, "Hello world"),
        (1, "Thank you"),
        (2, "Hello world"),
        (2, "Thank you"),
    ]
    assert all(row["score"] == 2.0 for row in rows)


TWO_PROCESS_SCRIPT = """
import atexit, json, os, pathlib, sys
import torch
from datasets import Dataset
from transformers import TrainerCallback
from posttrain.testing import build_tiny_causal_lm, build_tiny_tokenizer
from posttrain.trainers.sft import SFTTrainer
from posttrain.trainers.sft_config import SFTConfig

out, batch, sentences = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])


@atexit.register  # runs as the interpreter starts to exit
def threads_left_at_exit():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(pathlib.Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except FileNotFoundError:  # a thread that ended after the listing
            pass
    left = {"group": torch.distributed.is_initialized(), "gloo_threads": [n for n in names if "gloo" in n]}
    pathlib.Path(out, f"exit-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(left))


class Steps(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


tokenizer, steps = build_tiny_tokenizer(), Steps()
args = SFTConfig(output_dir=out, max_steps=3, per_device_train_batch_size=batch, logging_steps=1, save_steps=0,
                 report_to="none", max_length=64, learning_rate=1e-3)
trainer = SFTTrainer(build_tiny_causal_lm(tokenizer), args=args, processing_class=tokenizer,
                     train_dataset=Dataset.from_list([{"text": s} for s in sentences]), callbacks=[steps])
output = trainer.train()
result = {"global_step": output.global_step, "training_loss": output.training_loss, "steps": steps.steps,
          "history": trainer.state.log_history, "world_zero": trainer.state.is_world_process_zero}
with open(f"{out}/rank{trainer.accelerator.process_index}.json", "w") as f:
    json.dump(result, f)
"""


@pytest.mark.multiproc
def test_two_processes_sft_state_equals_one_process(tmp_path):
    """2 ranks × batch 2 train on the examples of 1 rank × batch 4: every rank's state and TrainOutput
    hold the all-rank numbers, equal to the one-process run's."""
    from helpers import run_processes

    script = tmp_path / "train.py"
    script.write_text(TWO_PROCESS_SCRIPT)
    runs = {}
    for name, nproc, batch in (("two", 2, 2), ("one", 1, 4)):
        out = tmp_path / name
        run_processes([str(script), str(out), str(batch), json.dumps(SENTENCES)], nproc, check=True)
        runs[name] = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    (one,), (rank0, rank1) = runs["one"], runs["two"]
    # The script ends after train() with its trainer in module globals, as TRL's examples do, and never calls
    # shutdown(): posttrain destroyed and freed the process group as exit began, so no gloo thread was left
    # for interpreter teardown, where one made a rank of a finished run abort with SIGABRT (docs/internals.md,
    # "Process exit"; the DDP-wrapped model kept the group and its three gloo threads alive before).
    for rank in (0, 1):
        left = json.loads((tmp_path / "two" / f"exit-{rank}.json").read_text())
        assert left == {"group": False, "gloo_threads": []}, left
    assert rank0["world_zero"] and not rank1["world_zero"]
    for rank in (rank0, rank1):
        assert rank["global_step"] == 3 and rank["steps"] == [1, 2, 3]
        assert rank["training_loss"] == pytest.approx(one["training_loss"], abs=1e-5)
        history, expected = rank["history"], one["history"]
        assert [e["step"] for e in history] == [1, 2, 3, 3]
        assert [e["loss"] for e in history[:3]] == pytest.approx([e["loss"] for e in expected[:3]], abs=1e-5)
        assert [e["num_tokens"] for e in history[:3]] == [e["num_tokens"] for e in expected[:3]]
        # 3 steps of 4 examples (2 per rank) in train_runtime seconds.
        summary = history[-1]
        assert summary["train_samples_per_second"] == pytest.approx(12 / summary["train_runtime"], rel=2e-2)
