"""`posttrain plot <output_dir>`: draw PNG plots of a run from its metrics.jsonl.

One PNG per metric (x axis: episode when logged, else step), written to <output_dir>/plots/.
matplotlib is an optional dependency (`pip install posttrain[plots]`); it is imported only here.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_METRICS = (
    "objective/rlhf_reward",
    "objective/scores",
    "objective/kl",
    "objective/entropy",
    "gold/score",
    "loss/policy_avg",
    "loss/value_avg",
    "val/ratio",
    "loss",
    "eval/loss",
    "eval/accuracy",
)


@dataclass
class PlotConfig:
    output_dir: str = field(default="outputs/run", metadata={"help": "Run folder holding metrics.jsonl."})
    metrics: list[str] | None = field(
        default=None, metadata={"help": "Metrics to plot (default: the objective/loss/ratio metrics present)."}
    )
    plots_dir: str | None = field(default=None, metadata={"help": "Where to write PNGs (default: <output_dir>/plots)."})


def read_metrics(path: str | Path) -> list[dict]:
    """Records of a metrics.jsonl file; a clear error when it is missing or malformed."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl here; give the output_dir of a posttrain run.")
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {lineno}: not valid JSON ({err.msg}).") from None
    return records


def series(records: list[dict], key: str) -> tuple[list[float], list[float], str]:
    """(x, y, x_label) of one metric, skipping records without it or with null values."""
    x_key = "episode" if any("episode" in r for r in records) else "step"
    xs, ys = [], []
    for r in records:
        value = r.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            xs.append(float(r.get(x_key, r.get("step", len(xs)))))
            ys.append(float(value))
    return xs, ys, x_key


def _filename(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key) + ".png"


def plot_run(
    output_dir: str | Path, metrics: list[str] | None = None, plots_dir: str | Path | None = None
) -> list[Path]:
    """Write one PNG per metric; return the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'posttrain[plots]'") from None
    records = read_metrics(output_dir)
    out = Path(plots_dir) if plots_dir else Path(output_dir) / "plots"
    keys = metrics or [k for k in DEFAULT_METRICS if any(k in r for r in records)]
    written = []
    for key in keys:
        xs, ys, x_key = series(records, key)
        if not xs:
            continue
        out.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, linewidth=1.5)
        ax.set_title(key)
        ax.set_xlabel(x_key)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / _filename(key)
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def main(config: PlotConfig) -> int:
    written = plot_run(config.output_dir, config.metrics, config.plots_dir)
    if not written:
        print(f"No plottable metrics in {config.output_dir}/metrics.jsonl.")
        return 1
    for path in written:
        print(path)
    return 0
