"""When trainers log, evaluate and save (transformers.TrainingArguments' strategies), the best checkpoint,
save_only_model, save_on_each_node, stateful callbacks across a resume, NEFTune and the token counts.

Every schedule below is worked out by hand from the sizes: 8 SFT examples at batch 2 make 4 steps per
epoch; the RLOO runs make 2 rollout batches per pass over the prompts.
"""

from __future__ import annotations

import math
import shutil
import types

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from helpers import SENTENCES, online_prompts, online_trainer, reward_trainer, sft_trainer
from posttrain import checkpoint as ckpt
from posttrain.callbacks import Cadence, resolve_steps
from posttrain.configs import ConfigError
from posttrain.trainers.rloo_config import RLOOConfig
from posttrain.trainers.sft_config import SFTConfig
from posttrain.trainers.supervised import neftune_hook


def sft(tmp_path, tokenizer, eval_dataset=True, callbacks=None, name="sft", train=None, **overrides):
    """8 steps over the 8 SENTENCES at batch 2 (2 epochs), evaluated on the first 2 when asked."""
    return sft_trainer(
        tmp_path,
        tokenizer,
        train if train is not None else [{"text": s} for s in SENTENCES],
        [{"text": s} for s in SENTENCES[:2]] if eval_dataset else None,
        name=name,
        callbacks=callbacks,
        **{"max_steps": 8, "logging_steps": 100, **overrides},
    )


def kinds(history):
    """(step, kind) of each log_history entry: train metrics, an evaluation, or the summary."""
    out = []
    for entry in history:
        kind = "summary" if "train_runtime" in entry else "eval" if "eval_loss" in entry else "train"
        out.append((entry["step"], kind))
    return out


def checkpoints(out):
    return [p.name for p in ckpt.list_checkpoints(out)]


def controlled_metric(trainer, values):
    """Make each evaluation also report eval_score = the next of `values` (a metric sequence we choose)."""
    original, sequence = trainer.run.evaluate, iter(values)

    def evaluate():
        metrics = original()
        metrics["eval_score"] = next(sequence)
        return metrics

    trainer.run.evaluate = evaluate


# -- the config, as transformers.TrainingArguments.__post_init__ --------------------------------------


def test_strategy_settings_are_checked_and_derived_as_transformers_does(tmp_path):
    # eval_steps alone keeps evaluating every eval_steps (posttrain's behaviour before eval_strategy existed).
    assert SFTConfig(eval_steps=5).eval_strategy == "steps" and SFTConfig(eval_steps=0).eval_strategy == "no"
    # eval_strategy "steps" without eval_steps falls back to logging_steps (transformers).
    assert SFTConfig(eval_strategy="steps", logging_steps=7).eval_steps == 7
    # Whole floats become ints; ratios stay ratios.
    config = SFTConfig(logging_steps=4.0, save_steps=0.25)
    assert config.logging_steps == 4 and isinstance(config.logging_steps, int) and config.save_steps == 0.25
    # greater_is_better follows the metric's name; load_best_model_at_end defaults the metric to "loss".
    assert SFTConfig(metric_for_best_model="accuracy").greater_is_better is True
    best = SFTConfig(load_best_model_at_end=True, eval_strategy="steps", eval_steps=2, save_steps=4)
    assert (best.metric_for_best_model, best.greater_is_better) == ("loss", False)
    with pytest.raises(ConfigError, match=r"logging_steps=2.5 must be an integer when above 1"):
        SFTConfig(logging_steps=2.5)
    with pytest.raises(ConfigError, match=r"eval_strategy='sometimes' must be one of no, steps, epoch"):
        SFTConfig(eval_strategy="sometimes")
    with pytest.raises(ConfigError, match=r"save_strategy \('steps'\) to match eval_strategy \('epoch'\)"):
        SFTConfig(load_best_model_at_end=True, eval_strategy="epoch")
    with pytest.raises(ConfigError, match=r"save_steps \(3\) to be a multiple of eval_steps \(2\)"):
        SFTConfig(load_best_model_at_end=True, eval_steps=2, save_steps=3)
    with pytest.raises(ConfigError, match=r"load_best_model_at_end needs evaluations"):
        SFTConfig(load_best_model_at_end=True)
    with pytest.raises(ConfigError, match=r"set --metric_for_best_model"):
        SFTConfig(save_strategy="best", eval_strategy="epoch")
    # The online trainers have no held-out loss to pick a checkpoint by.
    with pytest.raises(ConfigError, match="load_best_model_at_end"):
        RLOOConfig(load_best_model_at_end=True, eval_strategy="steps", eval_steps=1, save_steps=1)


def test_ratios_resolve_against_the_total_steps():
    # transformers' TrainerState.compute_steps: ceil(max_steps × ratio).
    assert [resolve_steps(v, 10) for v in (0.25, 0.1, 0.05, 3, None)] == [3, 1, 1, 3, None]
    config = types.SimpleNamespace(
        logging_steps=0.25,
        eval_steps=None,
        save_steps=0,
        logging_strategy="epoch",
        logging_first_step=False,
        eval_strategy="epoch",
        eval_delay=1.5,
        save_strategy="epoch",
    )
    # 3 steps per epoch: epochs end after steps 3, 6, 9; evaluations wait until 1.5 epochs are done.
    cadence = Cadence(config, 10, lambda step: step / 3)
    assert [s for s in range(1, 11) if cadence.log_due(s)] == [3, 6, 9]
    assert [s for s in range(1, 11) if cadence.eval_due(s)] == [6, 9]
    assert [s for s in range(1, 11) if cadence.save_due(s)] == [3, 6, 9]


# -- SFT and reward training -----------------------------------------------------------------------


def test_sft_epoch_strategies(tmp_path, tiny_tokenizer):
    # 8 steps = 2 epochs of 4: everything happens at steps 4 and 8; step 8 (the last) writes no checkpoint.
    trainer = sft(
        tmp_path, tiny_tokenizer, logging_strategy="epoch", eval_strategy="epoch", save_strategy="epoch", save_steps=1
    )
    trainer.train()
    assert kinds(trainer.state.log_history) == [(4, "train"), (4, "eval"), (8, "train"), (8, "eval"), (8, "summary")]
    assert checkpoints(tmp_path / "sft") == ["checkpoint-4"]


def test_sft_step_ratios_first_step_and_eval_delay(tmp_path, tiny_tokenizer):
    # logging 0.25 × 8 = every 2 steps, plus step 1 (logging_first_step); eval 0.5 × 8 = every 4 steps but
    # not before step 5 (eval_delay), so only the final evaluation at 8; save 0.375 × 8 = every 3 steps.
    trainer = sft(
        tmp_path,
        tiny_tokenizer,
        logging_steps=0.25,
        logging_first_step=True,
        eval_steps=0.5,
        eval_delay=5,
        save_steps=0.375,
    )
    assert (trainer.state.logging_steps, trainer.state.eval_steps, trainer.state.save_steps) == (2, 4, 3)
    trainer.train()
    assert kinds(trainer.state.log_history) == [
        (1, "train"),
        (2, "train"),
        (4, "train"),
        (6, "train"),
        (8, "train"),
        (8, "eval"),
        (8, "summary"),
    ]
    assert checkpoints(tmp_path / "sft") == ["checkpoint-3", "checkpoint-6"]


def test_sft_no_strategies_and_eval_on_start(tmp_path, tiny_tokenizer):
    trainer = sft(
        tmp_path,
        tiny_tokenizer,
        max_steps=3,
        logging_strategy="no",
        save_strategy="no",
        save_steps=1,
        eval_on_start=True,
    )
    trainer.train()
    # An evaluation before the first step, the final one, the summary; no training logs, no checkpoints.
    assert kinds(trainer.state.log_history) == [(0, "eval"), (3, "eval"), (3, "summary")]
    assert checkpoints(tmp_path / "sft") == []


def test_evaluating_without_an_eval_dataset_is_refused(tmp_path, tiny_tokenizer):
    with pytest.raises(ConfigError, match=r"eval_strategy='steps' evaluates during training but there is no eval"):
        sft(tmp_path, tiny_tokenizer, eval_dataset=False, eval_steps=2)
    with pytest.raises(ConfigError, match=r"eval_on_start=True evaluates during training"):
        sft(tmp_path, tiny_tokenizer, eval_dataset=False, eval_on_start=True)


def saved_weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_load_best_model_at_end_keeps_and_loads_the_best_checkpoint(tmp_path, tiny_tokenizer):
    # eval_score after steps 1..4: 0.3, 0.9, 0.5, 0.1 (greater is better for a name not ending in "loss").
    # Saves at 1, 2, 3 (not the last step); save_total_limit=1 keeps the newest and the best (step 2);
    # at the end the best is loaded, the others deleted, and the final model is step 2's.
    steps = []

    class Weights(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            steps.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    trainer = sft(
        tmp_path,
        tiny_tokenizer,
        callbacks=[Weights()],
        max_steps=4,
        eval_steps=1,
        save_steps=1,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="score",
    )
    controlled_metric(trainer, [0.3, 0.9, 0.5, 0.1])
    seen = []

    class Folders(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            seen.append((state.global_step, checkpoints(tmp_path / "sft")))

    trainer.add_callback(Folders())
    trainer.train()
    out = tmp_path / "sft"
    assert seen == [(1, ["checkpoint-1"]), (2, ["checkpoint-2"]), (3, ["checkpoint-2", "checkpoint-3"])]
    assert trainer.state.best_metric == 0.9 and trainer.state.best_global_step == 2
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-2")
    assert checkpoints(out) == ["checkpoint-2"]
    final = saved_weights(out)
    for key, value in saved_weights(out / "checkpoint-2" / "model").items():
        torch.testing.assert_close(final[key], value, rtol=0, atol=0)
        torch.testing.assert_close(trainer.model.state_dict()[key], value, rtol=0, atol=0)
    # The weights after step 2 (the best), not those after the last step.
    assert any(not torch.equal(steps[3][k], final[k]) for k in final)
    assert all(torch.equal(steps[1][k], final[k]) for k in final)


def test_the_best_checkpoint_survives_a_resume(tmp_path, tiny_tokenizer):
    common = dict(eval_steps=1, save_steps=1, load_best_model_at_end=True, metric_for_best_model="score")
    first = sft(tmp_path, tiny_tokenizer, max_steps=2, **common)
    controlled_metric(first, [0.9, 0.1])  # step 1 is the best; step 2 (the last) is not, so not saved
    first.train()
    out = tmp_path / "sft"
    assert checkpoints(out) == ["checkpoint-1"]
    resumed = sft(tmp_path, tiny_tokenizer, max_steps=4, resume_from_checkpoint="latest", **common)
    # Restored from checkpoint-1 before training on: the best so far and where it is.
    assert resumed.state.best_metric == 0.9 and resumed.state.best_model_checkpoint == str(out / "checkpoint-1")
    controlled_metric(resumed, [0.2, 0.3, 0.4])  # steps 2, 3, 4: none beats 0.9
    resumed.train()
    assert resumed.state.best_metric == 0.9 and resumed.state.best_global_step == 1
    final = saved_weights(out)
    for key, value in saved_weights(out / "checkpoint-1" / "model").items():
        torch.testing.assert_close(final[key], value, rtol=0, atol=0)


def test_a_best_last_evaluation_is_checkpointed(tmp_path, tiny_tokenizer):
    trainer = sft(
        tmp_path,
        tiny_tokenizer,
        max_steps=4,
        eval_steps=2,
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="score",
    )
    controlled_metric(trainer, [0.3, 0.6])
    trainer.train()
    out = tmp_path / "sft"
    # The last step normally writes no checkpoint; here its evaluation is the best, so it does.
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4"]
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-4")


def test_save_strategy_best_saves_only_improvements(tmp_path, tiny_tokenizer):
    trainer = sft(
        tmp_path,
        tiny_tokenizer,
        max_steps=5,
        eval_steps=1,
        save_strategy="best",
        metric_for_best_model="score",
        greater_is_better=False,
    )
    # Lower is better: 0.5 (save), 0.7, 0.2 (save), 0.4, 0.3 (the last step: no new best, no save).
    controlled_metric(trainer, [0.5, 0.7, 0.2, 0.4, 0.3])
    trainer.train()
    assert checkpoints(tmp_path / "sft") == ["checkpoint-1", "checkpoint-3"]
    assert trainer.state.best_metric == 0.2


def test_an_unknown_metric_for_best_model_names_the_metrics(tmp_path, tiny_tokenizer):
    trainer = sft(tmp_path, tiny_tokenizer, max_steps=1, eval_steps=1, metric_for_best_model="bleu")
    with pytest.raises(ConfigError, match=r"metric_for_best_model='bleu': the evaluation has no 'eval_bleu'"):
        trainer.train()


def test_reward_best_model_and_epoch_schedule(tmp_path, tiny_tokenizer):
    pairs = [{"chosen": f"Q: {w}? A: The sea is blue.", "rejected": f"Q: {w}? A: dog."} for w in SENTENCES]
    trainer = reward_trainer(
        tmp_path,
        tiny_tokenizer,
        pairs,
        pairs[:2],
        name="rm",
        max_steps=6,
        per_device_train_batch_size=4,  # 8 pairs: 2 steps per epoch
        logging_strategy="epoch",
        eval_strategy="epoch",
        save_strategy="epoch",
        load_best_model_at_end=True,
        metric_for_best_model="score",
    )
    controlled_metric(trainer, [0.2, 0.8, 0.5])
    trainer.train()
    out = tmp_path / "rm"
    entries = [
        (e["step"], "eval" if "eval_loss" in e else "summary" if "train_runtime" in e else "train")
        for e in trainer.state.log_history
    ]
    assert entries == [(2, "train"), (2, "eval"), (4, "train"), (4, "eval"), (6, "train"), (6, "eval"), (6, "summary")]
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4"]
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-4")
    final = saved_weights(out)
    for key, value in saved_weights(out / "checkpoint-4" / "model").items():
        torch.testing.assert_close(final[key], value, rtol=0, atol=0)


def test_save_only_model_checkpoints_hold_weights_and_refuse_resume(tmp_path, tiny_tokenizer):
    sft(tmp_path, tiny_tokenizer, eval_dataset=False, max_steps=4, save_steps=2, save_only_model=True).train()
    folder = tmp_path / "sft" / "checkpoint-2"
    assert (folder / "model" / "model.safetensors").is_file() and (folder / "trainer_state.json").is_file()
    assert not any(folder.glob("optimizer.pt")) and not any(folder.glob("scheduler.pt"))
    assert not any(folder.glob("rng_state_*.pt"))
    with pytest.raises(ckpt.CheckpointError, match=r"saved with save_only_model=True: .* cannot resume from it"):
        sft(tmp_path, tiny_tokenizer, eval_dataset=False, max_steps=4, resume_from_checkpoint=str(folder))


class StepCounter(TrainerCallback, ExportableState):
    """A stateful callback (transformers' ExportableState protocol): counts on_step_end calls."""

    def __init__(self, label: str = "counter"):
        self.label = label
        self.count = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.count += 1

    def state(self) -> dict:
        return {"args": {"label": self.label}, "attributes": {"count": self.count}}


@pytest.mark.parametrize("restore", [True, False])
def test_callback_states_are_saved_and_restored_on_request(tmp_path, tiny_tokenizer, restore):
    sft(tmp_path, tiny_tokenizer, eval_dataset=False, callbacks=[StepCounter("a")], max_steps=4, save_steps=2).train()
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "sft" / "checkpoint-2", resumed / "checkpoint-2")
    trainer = sft(
        tmp_path,
        tiny_tokenizer,
        name="resumed",
        eval_dataset=False,
        callbacks=[StepCounter("fresh")],
        max_steps=4,
        save_steps=2,
        resume_from_checkpoint="latest",
        restore_callback_states_from_checkpoint=restore,
    )
    trainer.train()
    (counter,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, StepCounter)]
    # Restored: 2 steps before the checkpoint + 2 after, with the saved constructor args.
    assert (counter.label, counter.count) == (("a", 4) if restore else ("fresh", 2))


def test_include_num_input_tokens_seen_and_tokens_per_second(tmp_path, tiny_tokenizer):
    # Pre-tokenized rows of 6 tokens: every step of 2 rows holds 2 × 6 = 12 input tokens.
    rows = Dataset.from_list([{"input_ids": [5 + i, 6, 7, 8, 9, 10]} for i in range(8)])
    trainer = sft(
        tmp_path,
        tiny_tokenizer,
        eval_dataset=False,
        train=rows,
        max_steps=3,
        logging_steps=1,
        include_num_input_tokens_seen=True,
        include_tokens_per_second=True,
    )
    trainer.train()
    history = trainer.state.log_history
    assert [e["num_input_tokens_seen"] for e in history] == [12, 24, 36, 36]
    assert all(e["train_tokens_per_second"] > 0 for e in history)
    assert trainer.state.num_input_tokens_seen == 36


def test_neftune_noise_bound_and_eval_mode():
    alpha = 5.0
    embed = torch.nn.Embedding(50, 16)
    ids = torch.randint(0, 50, (3, 40))
    handle = embed.register_forward_hook(neftune_hook(alpha))
    clean = torch.nn.functional.embedding(ids, embed.weight)
    noise = (embed(ids) - clean).detach()
    bound = alpha / math.sqrt(40 * 16)  # alpha / sqrt(L · d) = 5 / sqrt(640) ≈ 0.1976
    assert noise.abs().max() <= bound + 1e-6
    # 1920 uniform draws: the largest is within 1% of the bound with overwhelming probability.
    assert noise.abs().max() > 0.99 * bound and abs(float(noise.mean())) < 0.02
    embed.eval()
    assert torch.equal(embed(ids), clean)
    handle.remove()


def test_neftune_changes_training_only_and_is_removed(tmp_path, tiny_tokenizer):
    active = []

    class Hooked(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            active.append(len(model.get_input_embeddings()._forward_hooks))

    plain = sft(tmp_path, tiny_tokenizer, name="plain", max_steps=2, logging_steps=1)
    noisy = sft(
        tmp_path,
        tiny_tokenizer,
        name="noisy",
        callbacks=[Hooked()],
        max_steps=2,
        logging_steps=1,
        neftune_noise_alpha=5.0,
    )
    # Same weights before training: evaluation (eval mode) is not noised.
    assert noisy.evaluate()["eval_loss"] == plain.evaluate()["eval_loss"]
    plain.train()
    noisy.train()
    assert active == [1, 1] and len(noisy.model.get_input_embeddings()._forward_hooks) == 0
    # The first step trained on noised embeddings, so its loss differs.
    first = [[e["loss"] for e in t.state.log_history if "loss" in e][0] for t in (noisy, plain)]
    assert first[0] != first[1]


def test_neftune_in_reward_training(tmp_path, tiny_tokenizer):
    pairs = [{"chosen": f"Q: {w}? A: The sea is blue.", "rejected": f"Q: {w}? A: dog."} for w in SENTENCES]
    losses, hooks = [], []

    class Hooked(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            hooks.append(len(model.get_input_embeddings()._forward_hooks))

    for alpha in (None, 5.0):
        trainer = reward_trainer(
            tmp_path,
            tiny_tokenizer,
            pairs,
            name=f"rm-{alpha}",
            callbacks=[Hooked()],
            max_steps=1,
            per_device_train_batch_size=4,
            neftune_noise_alpha=alpha,
        )
        trainer.train()
        losses.append(trainer.state.log_history[0]["loss"])
        assert len(trainer.model.get_input_embeddings()._forward_hooks) == 0
    # The hook is present while training with alpha only, and the noised step's loss differs.
    assert hooks == [0, 1] and losses[0] != losses[1]


def test_logging_dir_holds_the_tensorboard_events(tmp_path, tiny_tokenizer):
    pytest.importorskip("tensorboard")
    logs = tmp_path / "tb"
    sft(
        tmp_path, tiny_tokenizer, eval_dataset=False, max_steps=1, report_to="tensorboard", logging_dir=str(logs)
    ).train()
    assert list(logs.glob("events.out.tfevents.*")) and not (tmp_path / "sft" / "runs").exists()


def test_save_on_each_node_writes_on_every_node_main_process(tmp_path, tiny_tokenizer):
    # The second node's first process (global rank 2, local rank 0) writes only with save_on_each_node.
    node1 = types.SimpleNamespace(is_main_process=False, is_local_main_process=True)
    assert not ckpt.is_writer(node1) and ckpt.is_writer(node1, on_each_node=True)
    trainer = sft(tmp_path, tiny_tokenizer, eval_dataset=False, max_steps=2, save_steps=1, save_on_each_node=True)
    trainer.train()
    assert checkpoints(tmp_path / "sft") == ["checkpoint-1"] and (tmp_path / "sft" / "model.safetensors").is_file()


# -- the online trainers (RLOO) ----------------------------------------------------------------------


def rloo(tmp_path, tokenizer, callbacks=None, **overrides):
    """RLOO over 4 prompts, 16 episodes = 4 rollout batches of 4 completions (2 prompts × 2), evaluated
    on the first 2 prompts."""
    values = {"total_episodes": 16, "logging_steps": 100, "save_steps": 0, **overrides}
    return online_trainer(
        "rloo", tmp_path / "rloo", tokenizer, callbacks, prompts=4, eval_dataset=online_prompts(2), **values
    )


def test_rloo_epoch_strategies_first_step_and_eval_on_start(tmp_path, tiny_tokenizer):
    # 4 prompts × 2 samples = 8 episodes per pass = 2 rollout batches: epochs end after batches 2 and 4.
    trainer = rloo(
        tmp_path,
        tiny_tokenizer,
        logging_strategy="epoch",
        logging_first_step=True,
        eval_strategy="epoch",
        save_strategy="epoch",
        eval_on_start=True,
    )
    trainer.train()
    entries = [
        (e["step"], "eval" if "eval_completions/mean_length" in e else "summary" if "train_runtime" in e else "train")
        for e in trainer.state.log_history
    ]
    assert entries == [
        (0, "eval"),
        (1, "train"),
        (2, "train"),
        (2, "eval"),
        (4, "train"),
        (4, "eval"),
        (4, "summary"),
    ]
    assert checkpoints(tmp_path / "rloo") == ["checkpoint-2"]


def test_rloo_step_ratios_and_save_strategy_best(tmp_path, tiny_tokenizer):
    # logging 0.5 × 4 = every 2 batches; eval every batch; "best" saves after each improvement, the last
    # rollout batch's included (it is the best checkpoint).
    trainer = rloo(
        tmp_path,
        tiny_tokenizer,
        logging_steps=0.5,
        eval_steps=1,
        save_strategy="best",
        metric_for_best_model="score",
    )
    scores = iter([1.0, 3.0, 2.0, 4.0])
    original = trainer.evaluate

    def evaluate():
        metrics = original()
        metrics["eval_score"] = next(scores)
        return metrics

    trainer.evaluate = evaluate
    trainer.train()
    logged = [e["step"] for e in trainer.state.log_history if "loss/policy_avg" in e and "train_runtime" not in e]
    assert logged == [2, 4]
    assert checkpoints(tmp_path / "rloo") == ["checkpoint-1", "checkpoint-2", "checkpoint-4"]
    assert trainer.state.best_metric == 4.0 and trainer.state.best_global_step == 4
    assert trainer.state.best_model_checkpoint == str(tmp_path / "rloo" / "checkpoint-4")


def test_command_line_takes_strategies_and_ratios():
    from posttrain.cli import parse_config

    config = parse_config(
        "sft",
        ["--logging_steps", "0.1", "--save_steps", "0.5", "--eval_strategy", "epoch", "--save_strategy", "epoch"]
        + ["--load_best_model_at_end", "--metric_for_best_model", "eval_accuracy", "--logging_first_step"],
    )
    assert (config.logging_steps, config.save_steps, config.eval_strategy) == (0.1, 0.5, "epoch")
    assert config.load_best_model_at_end and config.greater_is_better and config.logging_first_step
    online = parse_config("rloo", ["--logging_steps", "0.25", "--save_strategy", "no", "--eval_steps", "2"])
    assert (online.logging_steps, online.save_strategy, online.eval_strategy, online.eval_steps) == (
        0.25,
        "no",
        "steps",
        2,
    )


def test_load_best_model_at_end_is_refused_on_sharded_models():
    from accelerate.utils import DistributedType

    from posttrain.trainers.supervised import SupervisedRun

    config = SFTConfig(load_best_model_at_end=True, eval_steps=1, save_steps=1)
    for distributed_type, stage in ((DistributedType.FSDP, None), (DistributedType.DEEPSPEED, 3)):
        plugin = None if stage is None else types.SimpleNamespace(zero_stage=stage)
        accelerator = types.SimpleNamespace(
            state=types.SimpleNamespace(deepspeed_plugin=plugin), distributed_type=distributed_type
        )
        run = types.SimpleNamespace(config=config, accelerator=accelerator)
        with pytest.raises(ConfigError, match="load_best_model_at_end cannot load the best checkpoint into a ZeRO-3"):
            SupervisedRun._check_load_best_sharding(run)
    # ZeRO-2 keeps whole parameters on every rank: allowed.
    zero2 = types.SimpleNamespace(
        state=types.SimpleNamespace(deepspeed_plugin=types.SimpleNamespace(zero_stage=2)),
        distributed_type=DistributedType.DEEPSPEED,
    )
    SupervisedRun._check_load_best_sharding(types.SimpleNamespace(config=config, accelerator=zero2))
