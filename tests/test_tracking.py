import json
import math
import sys
import types

import pytest
import torch

from posttrain.tracking import MetricAccumulator, ProgressBar, Tracker, to_jsonable, tracker_key


def test_masked_mean_is_token_weighted_not_mean_of_means():
    acc = MetricAccumulator()
    # micro-batch 1: masked values 1, 2, 3 (the 100 is padding) -> sum 6, count 3
    acc.add_mean(
        "objective/entropy", torch.tensor([[1.0, 2.0], [3.0, 100.0]]), torch.tensor([[True, True], [True, False]])
    )
    # micro-batch 2: 10 unmasked -> sum 10, count 1
    acc.add_mean("objective/entropy", torch.tensor([10.0]))
    # (6 + 10) / (3 + 1) = 4.0, whereas the mean of micro-batch means would be (2 + 10) / 2 = 6
    assert acc.reduce()["objective/entropy"] == pytest.approx(4.0)


def test_add_value_add_and_sum_metrics():
    acc = MetricAccumulator()
    acc.add_value("loss/policy_avg", torch.tensor(0.5))
    acc.add_value("loss/policy_avg", 1.5)  # mean of observations: (0.5 + 1.5) / 2 = 1.0
    acc.add("objective/kl", torch.tensor(9.0), count=torch.tensor(3))  # 9 / 3 = 3.0
    acc.add_sum("val/num_eos_tokens", torch.tensor(2))
    acc.add_sum("val/num_eos_tokens", 5)  # 2 + 5 = 7
    out = acc.reduce()
    assert out == pytest.approx({"loss/policy_avg": 1.0, "objective/kl": 3.0, "val/num_eos_tokens": 7.0})


def test_var_metric_is_unbiased_and_masked():
    acc = MetricAccumulator()
    # masked observations 1, 2, 3, 4 (the 50 is masked out):
    # mean 2.5, sum of squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5, unbiased var 5 / 3
    acc.add_var("val/ratio_var", torch.tensor([1.0, 2.0, 50.0]), torch.tensor([1, 1, 0]))
    acc.add_var("val/ratio_var", torch.tensor([3.0]))
    acc.add_var("val/ratio_var", 4.0)
    assert acc.reduce()["val/ratio_var"] == pytest.approx(5.0 / 3.0)
    assert acc.reduce()["val/ratio_var"] == pytest.approx(torch.tensor([1.0, 2, 3, 4]).var().item())


def test_two_ranks_merge_equals_one_rank_with_all_data():
    values = torch.tensor([[0.1, 0.7, 0.3], [2.0, -1.0, 0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)

    whole = MetricAccumulator()
    whole.add_mean("m", values, mask)
    whole.add_var("v", values, mask)
    whole.add_sum("s", mask.sum())

    rank0, rank1 = MetricAccumulator(), MetricAccumulator()
    for acc, rows in ((rank0, slice(0, 1)), (rank1, slice(1, 2))):
        acc.add_mean("m", values[rows], mask[rows])
        acc.add_var("v", values[rows], mask[rows])
        acc.add_sum("s", mask[rows].sum())
    rank0.merge(rank1.state())

    merged, expected = rank0.reduce(), whole.reduce()
    # masked elements 0.1, 0.7, 2.0, -1.0, 0.5: mean 2.3 / 5 = 0.46; 5 tokens
    assert merged["m"] == pytest.approx(0.46)
    assert merged["s"] == 5.0
    assert merged == pytest.approx(expected)


def test_empty_and_reset():
    acc = MetricAccumulator()
    assert acc.reduce() == {}
    acc.add_mean("m", torch.tensor([1.0]), torch.tensor([False]))
    acc.add_var("v", 1.0)
    out = acc.reduce()
    assert math.isnan(out["m"]) and math.isnan(out["v"])  # 0 tokens; 1 observation has no variance
    acc.reset()
    assert len(acc) == 0 and acc.reduce() == {}


def test_kind_conflict_is_an_error():
    acc = MetricAccumulator()
    acc.add_value("x", 1.0)
    with pytest.raises(ValueError, match="'x'"):
        acc.add_sum("x", 1.0)


def test_reduce_does_not_keep_graph():
    w = torch.tensor(2.0, requires_grad=True)
    acc = MetricAccumulator()
    acc.add_mean("m", w * torch.ones(3))
    assert acc.reduce()["m"] == pytest.approx(2.0)
    assert acc.state()["m"] == ("mean", 6.0, 0.0, 3.0)


def test_jsonl_one_object_per_log_and_nan_is_null(tmp_path, capsys):
    tracker = Tracker(tmp_path, report_to="none", config={"lr": 1e-3})
    tracker.log({"objective/kl": 0.25, "loss/policy_avg": torch.tensor(float("nan"))}, step=1)
    tracker.log({"objective/kl": float("inf"), "episode": 64}, step=2)
    tracker.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    # Python's json.loads accepts NaN, so check the text too: strict parsers would reject it.
    records = [json.loads(line) for line in lines]
    assert "NaN" not in lines[0] and "Infinity" not in lines[1]
    assert records[0] == {"objective/kl": 0.25, "loss/policy_avg": None, "step": 1}
    assert records[1] == {"objective/kl": None, "episode": 64, "step": 2}
    assert "objective/kl" in capsys.readouterr().out


def test_log_table_prints_and_writes_samples(tmp_path, capsys):
    tracker = Tracker(tmp_path, report_to=[], config=None)
    rows = [
        {"prompt": "hi", "completion": "there", "score": 0.5},
        {"prompt": "a", "completion": "[b] stays literal", "score": float("nan")},
    ]
    tracker.log_table("completions", rows, step=3)
    tracker.close()
    out = capsys.readouterr().out
    assert "completions" in out and "there" in out and "[b] stays literal" in out
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples[0] == {"step": 3, "table": "completions", "prompt": "hi", "completion": "there", "score": 0.5}
    assert samples[1]["score"] is None


def test_non_main_process_writes_nothing(tmp_path):
    out = tmp_path / "run"
    tracker = Tracker(out, report_to="tensorboard", config={}, is_main=False)
    tracker.log({"a": 1.0}, step=1)
    tracker.log_table("t", [{"a": 1}], step=1)
    tracker.close()
    assert not out.exists()


def test_tensorboard_sink_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    tracker = Tracker(tmp_path, report_to=["tensorboard"], config={"seed": 1}, run_name="r1")
    tracker.log({"objective/scores": 1.5}, step=1)
    tracker.close()
    events = list((tmp_path / "runs" / "r1").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_report_to_parsing_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown sink"):
        Tracker(tmp_path, report_to="comet", config={})
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ImportError, match=r"pip install posttrain\[wandb\]"):
        Tracker(tmp_path, report_to="wandb", config={})
    # "all" takes whatever is installed and never fails on the rest
    tracker = Tracker(tmp_path, report_to="all", config={})
    assert "wandb" not in tracker.sinks
    tracker.close()


def test_to_jsonable_handles_configs():
    from dataclasses import dataclass
    from pathlib import Path

    @dataclass
    class Cfg:
        lr: float = 1e-3
        out: Path = Path("/tmp/x")
        ids: tuple = (1, 2)
        bad: float = float("nan")

    assert to_jsonable(Cfg()) == {"lr": 1e-3, "out": "/tmp/x", "ids": [1, 2], "bad": None}


def test_progress_bar_counts_episodes():
    bar = ProgressBar(total_episodes=100, disable=True)
    bar.update(32)
    bar.update(32)
    bar.set_postfix({"objective/kl": torch.tensor(0.01), "episode": 64})
    assert bar.n == 64
    bar.close()


def test_console_line_keeps_the_headline_metrics_when_many_are_logged(tmp_path, capsys):
    import json

    from posttrain.tracking import CONSOLE_MAX, Tracker

    many = {f"extra/m{i}": float(i) for i in range(CONSOLE_MAX)}
    many.update({"objective/kl": 0.5, "val/ratio": 1.0})
    tracker = Tracker(tmp_path, "none")
    tracker.log(many, step=3)
    tracker.close()
    out = capsys.readouterr().out
    assert "objective/kl 0.5" in out and "val/ratio 1" in out and "extra/m3" not in out
    assert f"(+{CONSOLE_MAX} more in metrics.jsonl)" in " ".join(out.split())
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["extra/m3"] == 3.0 and len(record) == CONSOLE_MAX + 3  # everything is still written


def test_tracker_key_is_transformers_rewrite_logs():
    # transformers' integrations (TensorBoardCallback, WandbCallback) write these names.
    assert tracker_key("loss") == "train/loss"
    assert tracker_key("objective/kl") == "train/objective/kl"
    assert tracker_key("lr") == "train/lr"
    assert tracker_key("eval_loss") == "eval/loss"
    assert tracker_key("eval_objective/scores") == "eval/objective/scores"
    assert tracker_key("test_accuracy") == "test/accuracy"
    assert tracker_key("evaluation") == "train/evaluation"  # only the "eval_" prefix is an eval metric


def test_wandb_gets_prefixed_keys_and_jsonl_keeps_short_names(tmp_path, monkeypatch, capsys):
    logged = []

    class FakeRun:
        def log(self, values, step=None):
            logged.append((values, step))

        def finish(self):
            pass

    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    tracker = Tracker(tmp_path, report_to="wandb", config={})
    tracker.log({"objective/kl": 0.5, "eval_loss": 1.25, "episode": 8}, step=3)
    tracker.close()
    assert logged == [({"train/objective/kl": 0.5, "eval/loss": 1.25, "train/episode": 8, "train/global_step": 3}, 3)]
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
        "objective/kl": 0.5,
        "eval_loss": 1.25,
        "episode": 8,
        "step": 3,
    }
    assert "| objective/kl 0.5" in capsys.readouterr().out
