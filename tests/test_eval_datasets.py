"""The online trainers' eval sets as transformers.Trainer (TRL 1.x) keeps them: `trainer.eval_dataset` is the
object given, a dict of named sets is evaluated set by set with `eval_{name}_` metrics, streaming sets are read
into memory, and `evaluate(eval_dataset=..., metric_key_prefix=...)` evaluates a set given to it."""

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDatasetDict

from helpers import build_tiny_causal_lm, flat, online_trainer
from posttrain.configs import ConfigError
from posttrain.trainers.rloo import RLOOTrainer
from posttrain.trainers.rloo_config import RLOOConfig

ONLINE = ["rloo", "grpo", "ppo", "online_dpo", "xpo"]
METRICS = ("objective/scores", "completions/mean_length", "val/num_eos_tokens")


def value_reward(prompts, completions, value=None, **kwargs):
    """Each completion scores its prompt's `value` column (0 without one, as in the train prompts): a set's
    mean score is known beforehand."""
    return [0.0] * len(completions) if value is None else [float(v) for v in value]


def prompts(n: int, value: float, word: str = "Hello") -> Dataset:
    return Dataset.from_dict({"prompt": [f"{word} {i}" for i in range(n)], "value": [value] * n})


def keys(*prefixes: str, algo: str = "") -> set[str]:
    """The metrics of an evaluation under each prefix; GRPO and RLOO add TRL's loss (`eval_loss`)."""
    metrics = (*METRICS, "loss") if algo in ("grpo", "rloo") else METRICS
    return {f"{prefix}_{metric}" for prefix in prefixes for metric in metrics}


@pytest.mark.parametrize("algo", ONLINE)
def test_named_eval_sets_are_kept_as_given_and_each_evaluated_under_its_name(tmp_path, tiny_tokenizer, algo):
    # "b" streams (load_dataset(..., streaming=True) gives the same type): it is read into memory.
    eval_sets = {"a": prompts(2, 1.0), "b": prompts(3, 3.0, "Bye").to_iterable_dataset()}
    trainer = online_trainer(
        algo, tmp_path / algo, tiny_tokenizer, reward=value_reward, eval_dataset=eval_sets, eval_on_start=True
    )
    assert trainer.eval_dataset is eval_sets  # as given; the prepared prompts stay on the run
    assert set(trainer.run.eval_dataset) == {"a", "b"} and len(trainer.run.eval_dataset["b"]) == 3
    assert "input_ids" in trainer.run.eval_dataset["b"].column_names
    # the train set as given too: raw prompts; the run holds them tokenized
    assert trainer.train_dataset.column_names == ["prompt"] and "input_ids" in trainer.run.train_dataset.column_names

    metrics = trainer.evaluate()
    assert set(metrics) == keys("eval_a", "eval_b", algo=algo)
    assert metrics["eval_a_objective/scores"] == 1.0 and metrics["eval_b_objective/scores"] == 3.0
    # one log entry per set, as transformers logs each named set's evaluation
    entries = [e for e in trainer.state.log_history if any(k.startswith("eval_") for k in e)]
    expected = [sorted(keys("eval_a", algo=algo)), sorted(keys("eval_b", algo=algo))]
    assert [sorted(e.keys() - {"step", "epoch"}) for e in entries] == expected
    # the sample tables draw from the first set
    rows = trainer.sample_completions(5)
    assert [r["prompt"] for r in rows] == ["Hello 0", "Hello 1"] and [r["score"] for r in rows] == [1.0, 1.0]

    trainer.train()  # eval_on_start: both sets evaluated before the first rollout batch, with the trainer's state
    during = [e for e in trainer.state.log_history if "eval_b_objective/scores" in e]
    assert [e["step"] for e in during] == [0, 0] and during[-1]["eval_b_objective/scores"] == 3.0


def test_evaluate_takes_a_set_or_named_sets_in_place_of_the_trainers(tmp_path, tiny_tokenizer):
    trainer = online_trainer("rloo", tmp_path / "run", tiny_tokenizer, reward=value_reward)
    with pytest.raises(ConfigError, match=r"evaluate\(\) needs an eval_dataset: pass evaluate\(eval_dataset=...\)"):
        trainer.evaluate()

    streamed = prompts(3, 2.0).to_iterable_dataset()
    metrics = trainer.evaluate(eval_dataset=streamed)
    assert set(metrics) == keys("eval", algo="rloo") and metrics["eval_objective/scores"] == 2.0

    named = DatasetDict({"x": prompts(2, 1.0), "y": prompts(2, 5.0)})
    metrics = trainer.evaluate(eval_dataset=named, ignore_keys=["past_key_values"], metric_key_prefix="test")
    assert set(metrics) == keys("test_x", "test_y", algo="rloo")
    assert (metrics["test_x_objective/scores"], metrics["test_y_objective/scores"]) == (1.0, 5.0)

    streams = IterableDatasetDict({"z": prompts(1, 4.0).to_iterable_dataset()})
    from_stream = trainer.evaluate(eval_dataset=streams)
    assert from_stream == trainer.evaluate(eval_dataset={"z": prompts(1, 4.0)})
    assert set(from_stream) == keys("eval_z", algo="rloo") and from_stream["eval_z_objective/scores"] == 4.0
    assert trainer.eval_dataset is None  # a set given to evaluate() is not kept

    # assigning the trainer's eval set prepares it; a name picks one of the trainer's named sets
    trainer.eval_dataset = named
    assert trainer.eval_dataset is named and set(trainer.run.eval_dataset) == {"x", "y"}
    by_name = trainer.evaluate("y")
    assert by_name == {k.replace("test_y_", "eval_y_"): v for k, v in metrics.items() if k.startswith("test_y_")}
    with pytest.raises(ConfigError, match=r"has no eval set of that name; its named sets are \['x', 'y'\]"):
        trainer.evaluate("w")


def test_metric_for_best_model_names_the_set_when_there_are_several(tmp_path, tiny_tokenizer):
    eval_sets = {"a": prompts(2, 1.0), "b": prompts(2, 3.0)}
    common = dict(reward=value_reward, eval_dataset=eval_sets, eval_strategy="steps", eval_steps=1)
    trainer = online_trainer(
        "grpo", tmp_path / "named", tiny_tokenizer, metric_for_best_model="b_objective/scores", **common
    )
    trainer.train()
    assert trainer.state.best_metric == 3.0 and trainer.state.best_global_step == 1

    # As transformers: with several sets the metric must name one; the error lists what the evaluation reports.
    trainer = online_trainer(
        "grpo", tmp_path / "bare", tiny_tokenizer, metric_for_best_model="objective/scores", **common
    )
    with pytest.raises(ConfigError, match=r"has no 'eval_objective/scores'; it reports \[.*'eval_a_objective/scores'"):
        trainer.train()

    # one set: the bare metric name keeps working
    one = dict(common, eval_dataset=prompts(2, 2.0))
    trainer = online_trainer("grpo", tmp_path / "one", tiny_tokenizer, metric_for_best_model="objective/scores", **one)
    trainer.train()
    assert trainer.state.best_metric == 2.0


def test_the_command_line_eval_split_is_the_loaded_dataset(tmp_path, tiny_tokenizer):
    folder = tmp_path / "data"
    DatasetDict({"train": prompts(4, 1.0), "test": prompts(2, 2.0, "Bye")}).save_to_disk(str(folder))
    config = RLOOConfig(
        output_dir=str(tmp_path / "out"),
        dataset_name=str(folder),
        per_device_train_batch_size=4,
        total_episodes=8,
        rloo_k=2,
        response_length=4,
        report_to="none",
    )
    trainer = RLOOTrainer(config, tiny_tokenizer, build_tiny_causal_lm(tiny_tokenizer), None, value_reward)
    assert isinstance(trainer.eval_dataset, Dataset) and trainer.eval_dataset["prompt"] == ["Bye 0", "Bye 1"]
    assert "input_ids" not in trainer.eval_dataset.column_names  # the split as loaded
    assert trainer.evaluate()["eval_objective/scores"] == 2.0


def token_count(completions, completion_ids, **kwargs):
    """Each completion's length in tokens (its stop token included)."""
    return [float(len(ids)) for ids in completion_ids]


@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_eval_loss_is_the_training_loss_on_sampled_groups(tmp_path, tiny_tokenizer, monkeypatch, algo):
    """TRL's eval_loss: the trainer's loss at ratio 1 on groups sampled from each eval prompt, from a stream of
    its own: evaluating twice gives the same number, and evaluating does not move training's samples."""
    from posttrain.trainers import grpo as grpo_module
    from posttrain.trainers import online

    common = dict(reward=token_count, eval_dataset=prompts(3, 0.0), per_device_eval_batch_size=2)
    if algo == "grpo":
        # dapo weighs each completion's advantage by its length; stop id 155 ends some completions early
        # (the first eval batch's first group gets lengths 2 and 8), so the loss is not 0
        common.update(loss_type="dapo", beta=0.0, response_length=8, stop_token_id=155)
    trainer = online_trainer(algo, tmp_path / "a", tiny_tokenizer, **common)
    seen = []
    module = grpo_module if algo == "grpo" else online

    def recording(*args, **kwargs):
        rollout = sample(*args, **kwargs)
        seen.append(rollout)
        return rollout

    sample = module.sample
    monkeypatch.setattr(module, "sample", recording)
    first = trainer.evaluate()
    monkeypatch.setattr(module, "sample", sample)
    loss = first["eval_loss"]
    assert trainer.evaluate()["eval_loss"] == loss
    # by hand, from the sampled lengths: batches of 2 and 1 prompts, weighted by their prompts
    group = 2
    expected = []
    # the sampled groups of each batch (RLOO's module also draws each batch's greedy completions first)
    for rollout in seen if algo == "grpo" else seen[1::2]:
        lengths = rollout.completion_lengths.float()
        if algo == "grpo":  # prompt-major groups; A = (r - mean) / (unbiased std + 1e-4); dapo: token sum / tokens
            grid = lengths.view(-1, group)
            std = grid.std(dim=1, keepdim=True) if group > 1 else torch.zeros_like(grid[:, :1])
            advantages = ((grid - grid.mean(dim=1, keepdim=True)) / (std + 1e-4)).flatten()
            expected.append(float(-(advantages * lengths).sum() / lengths.sum()))
        else:  # RLOO: the leave-one-out advantages of each prompt sum to 0, so the sequence mean is 0
            expected.append(0.0)
    assert len(expected) == 2
    assert loss == pytest.approx((2 * expected[0] + expected[1]) / 3, abs=1e-6)

    # evaluating before training leaves training's samples (and so the trained weights) as they were
    trainer.train()
    plain = online_trainer(algo, tmp_path / "b", tiny_tokenizer, **{**common, "eval_dataset": None})
    plain.train()
    assert torch.equal(flat(trainer.model), flat(plain.model))
