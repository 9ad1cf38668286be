"""Streaming train sets (`load_dataset(..., streaming=True)`, a `datasets.IterableDataset`) for every online
trainer: read in the stream's order, pass after pass, each rank keeping its slice of every global batch,
resumable, with max_steps required and bad rows refused when they are read (data/prompts.py,
`StreamedPrompts`; TRL 1.x trains GRPO and RLOO on iterable datasets)."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset

from helpers import cli_command, launch, online_prompts, online_trainer, read_metrics
from posttrain.configs import ConfigError
from posttrain.data import DataError
from posttrain.data.prompts import StreamedPrompts

ONLINE = ["rloo", "grpo", "ppo", "online_dpo", "xpo"]


def in_order(algo: str) -> dict:
    """Settings under which a map-style set is read in its own order, as a stream is."""
    return {"train_sampling_strategy": "sequential", **({"shuffle_dataset": False} if algo == "grpo" else {})}


def params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("algo", ONLINE)
def test_a_stream_trains_exactly_as_the_same_prompts_read_in_order(tmp_path, tiny_tokenizer, algo):
    # 6 prompts, rollout batches of 2 prompts (PPO: 4): 4 rollout batches run past the end of the stream,
    # which then starts again, as an in-order map-style set starts its next epoch. The budget: max_steps, or
    # total_episodes for the trainers that take it (TRL's classic RLOO and PPO).
    budget = dict(total_episodes=16) if algo in ("rloo", "ppo") else dict(max_steps=4)
    settings = dict(save_steps=0, **budget, **in_order(algo))
    listed = online_trainer(algo, tmp_path / "map", tiny_tokenizer, train_dataset=online_prompts(6), **settings)
    listed.train()
    stream = online_prompts(6).to_iterable_dataset()
    streamed = online_trainer(algo, tmp_path / "stream", tiny_tokenizer, train_dataset=stream, **settings)
    assert streamed.train_dataset is stream  # as given; the run holds it prepared (lazily)
    streamed.train()

    assert streamed.state.global_step == listed.state.global_step == 4
    expected = params(listed)
    assert all(torch.equal(p, expected[n]) for n, p in params(streamed).items())
    # as TRL for iterable sets: no loader workers, every process reads the stream itself
    assert streamed.args.dataloader_num_workers == 0
    assert streamed.args.accelerator_config.dispatch_batches is False


def test_every_rank_keeps_its_slice_of_the_global_batch_and_passes_restart_after_set_epoch():
    rows = Dataset.from_dict({"prompt": [f"p{i}" for i in range(7)]}).to_iterable_dataset()
    epochs = []
    rows.set_epoch = lambda epoch, orig=rows.set_epoch: (epochs.append(epoch), orig(epoch))

    def stream(rank, world):
        return StreamedPrompts(rows, 2, lambda batch: [r["prompt"] for r in batch], rank=rank, world_size=world)

    one = stream(0, 1)
    assert [next(one) for _ in range(4)] == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"], ["p0", "p1"]]
    assert one.state_dict() == {"epoch": 1, "position": 1} and epochs == [0, 1]  # p6 is a partial batch: dropped
    # two ranks, 2 prompts each: a global batch of 4 (p4..p6 cannot fill one), rank r its half
    first, second = stream(0, 2), stream(1, 2)
    assert [next(first), next(first)] == [["p0", "p1"], ["p0", "p1"]]
    assert [next(second), next(second)] == [["p2", "p3"], ["p2", "p3"]]


def test_a_stream_resumes_at_the_batch_after_the_one_checkpointed():
    rows = Dataset.from_dict({"prompt": [f"p{i}" for i in range(5)]}).to_iterable_dataset()
    original = StreamedPrompts(rows, 2, lambda batch: [r["prompt"] for r in batch])
    for _ in range(3):
        next(original)
    state = original.state_dict()
    assert state == {"epoch": 1, "position": 1}
    resumed = StreamedPrompts(rows, 2, lambda batch: [r["prompt"] for r in batch])
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint stores it
    assert (
        [next(resumed) for _ in range(3)]
        == [next(original) for _ in range(3)]
        == [
            ["p2", "p3"],
            ["p0", "p1"],
            ["p2", "p3"],
        ]
    )


def test_a_streamed_run_resumed_mid_pass_ends_where_the_uninterrupted_run_does(tmp_path, tiny_tokenizer):
    def trainer(out, steps, **extra):
        stream = online_prompts(6).to_iterable_dataset()
        return online_trainer(
            "grpo", out, tiny_tokenizer, train_dataset=stream, max_steps=steps, **in_order("grpo"), **extra
        )

    whole = trainer(tmp_path / "whole", 5)  # a checkpoint at every step
    whole.train()
    # from step 2 of 5: the stream is mid-pass (3 batches a pass), and passes into the next one
    resumed = trainer(tmp_path / "resumed", 5, resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    resumed.train()
    assert resumed.state.global_step == 5
    expected = params(whole)
    assert all(torch.equal(p, expected[n]) for n, p in params(resumed).items())


def on_a_stream(algo, out, tokenizer, prompts=6, **settings):
    """online_trainer over `prompts` prompts given as a stream."""
    return online_trainer(algo, out, tokenizer, train_dataset=online_prompts(prompts).to_iterable_dataset(), **settings)


def test_a_stream_without_max_steps_is_refused_with_the_fix(tmp_path, tiny_tokenizer):
    with pytest.raises(ConfigError, match=r"streaming datasets.IterableDataset .* no length.* set max_steps"):
        on_a_stream("grpo", tmp_path, tiny_tokenizer, total_episodes=None)


@pytest.mark.parametrize("strategy", ["save_strategy", "eval_strategy"])
def test_epoch_strategies_are_refused_on_a_stream(tmp_path, tiny_tokenizer, strategy):
    extra = {"eval_dataset": online_prompts(2)} if strategy == "eval_strategy" else {}
    with pytest.raises(ConfigError, match=rf'{strategy}="epoch" cannot be honoured; use {strategy}="steps"'):
        on_a_stream("rloo", tmp_path, tiny_tokenizer, max_steps=2, **{strategy: "epoch"}, **extra)


def test_an_empty_stream_or_one_without_prompts_is_refused_before_training(tmp_path, tiny_tokenizer):
    empty = online_prompts(2).to_iterable_dataset().filter(lambda row: False)
    with pytest.raises(DataError, match="train_dataset: the streaming dataset yields no rows"):
        online_trainer("grpo", tmp_path / "a", tiny_tokenizer, train_dataset=empty, max_steps=1)
    wrong = Dataset.from_dict({"question": ["a", "b"]}).to_iterable_dataset()
    with pytest.raises(DataError, match=r"missing column\(s\) \['prompt'\].*available columns: \['question'\]"):
        online_trainer("grpo", tmp_path / "b", tiny_tokenizer, train_dataset=wrong, max_steps=1)


def test_a_bad_row_deep_in_the_stream_is_refused_by_its_place_when_it_is_read(tmp_path, tiny_tokenizer):
    prompts = [f"Hello {i}" for i in range(8)]
    prompts[5] = ""  # row 6
    stream = Dataset.from_dict({"prompt": prompts}).to_iterable_dataset()
    trainer = online_trainer("online_dpo", tmp_path, tiny_tokenizer, train_dataset=stream, max_steps=4)
    with pytest.raises(DataError, match=r"train_dataset, row 6, field 'prompt'"):
        trainer.train()


def test_a_stream_shorter_than_one_rollout_batch_says_so(tmp_path, tiny_tokenizer):
    trainer = on_a_stream("grpo", tmp_path, tiny_tokenizer, prompts=1, max_steps=1)  # GRPO's batch here: 2 prompts
    with pytest.raises(ConfigError, match="yields 1 prompts in a pass, fewer than one rollout batch needs"):
        trainer.train()


def test_dataset_streaming_is_for_the_online_trainers():
    from posttrain.trainers.sft_config import SFTConfig

    with pytest.raises(ConfigError, match="dataset_streaming=True is for the online trainers"):
        SFTConfig(output_dir="unused", dataset_streaming=True)


@pytest.mark.multiproc
def test_dataset_streaming_under_torchrun_saves_and_resumes(cli_files, tmp_path):
    """`torchrun --nproc_per_node 2 -m posttrain grpo --dataset_streaming ...`: both ranks read the JSON-lines
    file as a stream, a checkpoint at every step, then the same command resumed with a larger budget."""
    out = tmp_path / "out"
    first = launch(cli_command("grpo", cli_files, out, steps=2) + ["--dataset_streaming"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "checkpoint-1" / "checkpoint_complete.json").is_file()
    resumed = launch(
        cli_command("grpo", cli_files, out, steps=3) + ["--dataset_streaming", "--resume_from_checkpoint", "latest"]
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    assert [record.get("step") for record in read_metrics(out)][-1] == 3
