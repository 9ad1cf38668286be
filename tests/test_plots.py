"""`posttrain plot`: PNGs redrawn from metrics.jsonl."""

import json

import pytest

from posttrain.cli import main
from posttrain.plots import plot_run, read_metrics, series


def write_metrics(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_series_uses_episode_and_skips_nulls(tmp_path):
    write_metrics(
        tmp_path / "metrics.jsonl",
        [
            {"objective/kl": 0.1, "episode": 16, "step": 1},
            {"objective/kl": None, "episode": 32, "step": 2},
            {"objective/kl": 0.3, "episode": 48, "step": 3},
        ],
    )
    xs, ys, x_key = series(read_metrics(tmp_path), "objective/kl")
    assert (xs, ys, x_key) == ([16.0, 48.0], [0.1, 0.3], "episode")


def test_plot_command_writes_pngs(tmp_path, capsys):
    write_metrics(
        tmp_path / "metrics.jsonl",
        [
            {
                "objective/rlhf_reward": r,
                "objective/scores": r + 1,
                "objective/kl": r / 10,
                "episode": 16 * (i + 1),
                "step": i + 1,
            }
            for i, r in enumerate([0.1, 0.4, 0.2, 0.8])
        ],
    )
    assert main(["plot", str(tmp_path)]) == 0
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["objective_kl.png", "objective_rlhf_reward.png", "objective_scores.png"]
    for p in (tmp_path / "plots").glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_metrics_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        plot_run(tmp_path)


def test_malformed_line_names_the_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(tmp_path)
