"""Exact metric aggregation and the sinks that record it.

`MetricAccumulator` keeps every metric as raw sums (sum, sum of squares, count) rather than as
means, because a mean of per-rank or per-micro-batch means is biased whenever the pieces hold
different numbers of tokens (DESIGN.md, principle 5). The sums of all metrics are stacked into
one tensor and all-reduced once per logging step, then divided.

`Tracker` writes the reduced numbers to the console (rich), `metrics.jsonl`, TensorBoard and
Weights & Biases. Only the main process writes; optional backends are imported lazily so that
`import posttrain` never pulls in tensorboard or wandb (principle 7). The console and
`metrics.jsonl` keep the short names (`objective/kl`, `eval_loss`); TensorBoard and W&B get the
names transformers' integrations write (`train/objective/kl`, `eval/loss`: `tracker_key`), so
dashboards built for TRL runs read posttrain runs unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from posttrain import distributed

if TYPE_CHECKING:
    from accelerate import Accelerator

# Kinds of metric; each kind reduces its raw sums in a different way.
MEAN = "mean"  # sum / count
VAR = "var"  # unbiased variance from (sum, sum of squares, count)
SUM = "sum"  # plain sum across micro-batches and ranks (e.g. val/num_eos_tokens)
_KINDS = (MEAN, VAR, SUM)


def _as_number(x: torch.Tensor | float | int) -> torch.Tensor | float:
    if isinstance(x, torch.Tensor):
        # detach: metrics must never keep the autograd graph of a micro-batch alive.
        return x.detach().float().sum() if x.numel() != 1 else x.detach().float().reshape(())
    return float(x)


class MetricAccumulator:
    """Accumulates metrics as (sum, sum of squares, count) triples and reduces them exactly.

    Values may be tensors (kept on their device until `reduce`, so adding does not force a
    host sync per micro-batch) or Python numbers. Every rank must add the same metric names
    between two reductions, because the reduction is one positional all-reduce.
    """

    def __init__(self) -> None:
        # name -> [kind, sum, sum_of_squares, count]
        self._metrics: dict[str, list[Any]] = {}

    def _slot(self, name: str, kind: str) -> list[Any]:
        slot = self._metrics.get(name)
        if slot is None:
            slot = self._metrics[name] = [kind, 0.0, 0.0, 0.0]
        elif slot[0] != kind:
            raise ValueError(f"metric {name!r} was added as {slot[0]!r} and now as {kind!r}.")
        return slot

    def add(self, name: str, value_sum: torch.Tensor | float, count: torch.Tensor | float = 1) -> None:
        """Add a pre-summed value and the number of items it sums (mean metric)."""
        slot = self._slot(name, MEAN)
        slot[1] = slot[1] + _as_number(value_sum)
        slot[3] = slot[3] + _as_number(count)

    def add_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add every element of `values` (only where `mask` is true) to a token/sequence-weighted
        mean: the reported value is the mean over all added elements, not a mean of means."""
        values = values.detach().float()
        if mask is None:
            self.add(name, values.sum(), values.numel())
            return
        mask = mask.to(dtype=values.dtype, device=values.device)
        self.add(name, (values * mask).sum(), mask.sum())

    def add_value(self, name: str, x: torch.Tensor | float) -> None:
        """Add one scalar observation (e.g. a micro-batch's loss) to a mean over observations."""
        self.add(name, x, 1)

    def add_var(self, name: str, values: torch.Tensor | float, mask: torch.Tensor | None = None) -> None:
        """Add observations to an unbiased variance, sum((x - mean)^2) / (n - 1), computed
        exactly across ranks from sum(x), sum(x^2) and n."""
        slot = self._slot(name, VAR)
        if not isinstance(values, torch.Tensor):
            x = float(values)
            slot[1], slot[2], slot[3] = slot[1] + x, slot[2] + x * x, slot[3] + 1.0
            return
        # float64 keeps sum(x^2) - sum(x)^2 / n from cancelling catastrophically.
        values = values.detach().to(torch.float64 if values.device.type != "mps" else torch.float32)
        weights = torch.ones_like(values) if mask is None else mask.to(dtype=values.dtype, device=values.device)
        slot[1] = slot[1] + (values * weights).sum()
        slot[2] = slot[2] + (values * values * weights).sum()
        slot[3] = slot[3] + weights.sum()

    def add_sum(self, name: str, value: torch.Tensor | float) -> None:
        """Add to a metric reported as a plain sum over micro-batches and ranks."""
        slot = self._slot(name, SUM)
        slot[1] = slot[1] + _as_number(value)

    def __contains__(self, name: str) -> bool:
        return name in self._metrics

    def __len__(self) -> int:
        return len(self._metrics)

    def state(self) -> dict[str, tuple[str, float, float, float]]:
        """Host copy of the raw sums: name -> (kind, sum, sum_of_squares, count)."""
        return {name: (kind, float(s), float(sq), float(n)) for name, (kind, s, sq, n) in self._metrics.items()}

    def merge(self, other: MetricAccumulator | Mapping[str, tuple[str, float, float, float]]) -> None:
        """Add another accumulator's raw sums into this one (what the all-reduce does across ranks)."""
        state = other.state() if isinstance(other, MetricAccumulator) else other
        for name, (kind, s, sq, n) in state.items():
            if kind not in _KINDS:
                raise ValueError(f"metric {name!r} has unknown kind {kind!r}.")
            slot = self._slot(name, kind)
            slot[1], slot[2], slot[3] = slot[1] + s, slot[2] + sq, slot[3] + n

    def reduce(self, accelerator: Accelerator | None = None) -> dict[str, float]:
        """Sum the raw sums over ranks in one all-reduce and return the final values.

        mean: sum / count; var: (sumsq - sum^2 / n) / (n - 1); sum: the sum. A mean or variance
        with too few observations is NaN, which the jsonl sink writes as null.
        """
        if not self._metrics:
            return {}
        names = sorted(self._metrics)
        dev = distributed.device(accelerator)
        # MPS has no float64; everywhere else float64 keeps large token counts exact.
        dtype = torch.float32 if dev.type == "mps" else torch.float64
        rows = []
        for name in names:
            _, s, sq, n = self._metrics[name]
            rows.append(torch.stack([torch.as_tensor(v, dtype=dtype).to(dev).reshape(()) for v in (s, sq, n)]))
        totals = distributed.reduce_sum(torch.stack(rows), accelerator).cpu().tolist()
        out: dict[str, float] = {}
        for name, (s, sq, n) in zip(names, totals):
            kind = self._metrics[name][0]
            if kind == SUM:
                out[name] = s
            elif kind == MEAN:
                out[name] = s / n if n > 0 else math.nan
            else:
                out[name] = max(sq - s * s / n, 0.0) / (n - 1) if n > 1 else math.nan
        return out

    def reset(self) -> None:
        self._metrics.clear()


def _scalar(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy scalars and arrays
        return value.tolist()
    return value


def to_jsonable(value: Any) -> Any:
    """Convert configs, tensors and paths into plain JSON values; non-finite floats -> None so
    every line stays valid JSON (json.dumps would otherwise write the non-standard NaN)."""
    value = _scalar(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


SINKS = ("tensorboard", "wandb")


def _parse_report_to(report_to: Iterable[str] | str | None) -> list[str]:
    if report_to is None:
        return []
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    names = [n.strip().lower() for n in names if n and n.strip()]
    if "none" in names:
        return []
    if "all" in names:
        # Like transformers' report_to="all": every installed integration, no error for the rest.
        return [n for n in SINKS if _importable(n)]
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise ValueError(
            f"report_to={report_to!r}: unknown sink(s) {unknown}; choose from "
            f"{', '.join(('none', 'all') + SINKS)}. Console and metrics.jsonl are always written."
        )
    return list(dict.fromkeys(names))


def _importable(name: str) -> bool:
    try:
        _import_sink(name)
    except ImportError:
        return False
    return True


def _import_sink(name: str) -> Any:
    try:
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            return SummaryWriter
        import wandb

        return wandb
    except ImportError as err:
        raise ImportError(
            f"report_to includes {name!r} but {name} is not installed. "
            f"Install it with `pip install posttrain[{name}]`, or drop {name!r} from report_to."
        ) from err


def tracker_key(name: str) -> str:
    """The TensorBoard / W&B name of a metric, as transformers' `rewrite_logs` writes it for its
    TensorBoardCallback and WandbCallback: `eval_x` -> `eval/x`, `test_x` -> `test/x`, anything
    else -> `train/x` (so `objective/kl` -> `train/objective/kl`, `lr` -> `train/lr`)."""
    for prefix in ("eval", "test"):
        if name.startswith(prefix + "_"):
            return f"{prefix}/{name[len(prefix) + 1 :]}"
    return f"train/{name}"


def _format_number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4g}"


# The console line shows these (when logged) so a step stays readable; every metric still goes to
# metrics.jsonl, TensorBoard and W&B. Runs that log few metrics (<= CONSOLE_MAX) show them all.
CONSOLE_KEYS = (
    "loss",
    "eval_loss",
    "accuracy",
    "eval_accuracy",
    "mean_token_accuracy",
    "objective/scores",
    "objective/rlhf_reward",
    "objective/kl",
    "objective/entropy",
    "objective/scores_margin",
    "loss/policy_avg",
    "loss/value_avg",
    "loss/dpo",
    "loss/xpo",
    "rewards/accuracies",
    "val/ratio",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "gold/score",
    "lr",
    "eps",
    "episode",
)
CONSOLE_MAX = 16


def console_keys(values: Mapping[str, Any]) -> list[str]:
    """The metric names printed on the console line, in logged order."""
    if len(values) <= CONSOLE_MAX:
        return list(values)
    return [k for k in values if k in CONSOLE_KEYS]


class Tracker:
    """Writes logged metrics to the console, `metrics.jsonl`, TensorBoard and W&B.

    Files are opened on first use, so a run that fails before its first log leaves no sink
    files behind. Non-main processes construct a Tracker that does nothing.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        report_to: Iterable[str] | str | None,
        config: Any = None,
        run_name: str | None = None,
        is_main: bool = True,
        *,
        logging_dir: str | os.PathLike | None = None,
        project: str | None = None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        transformers_keys: bool = True,
    ) -> None:
        """project: the W&B project (default $WANDB_PROJECT or "posttrain"); init_kwargs: extra
        keywords per sink ({"wandb": {...}} for wandb.init, {"tensorboard": {...}} for SummaryWriter),
        as accelerate's `init_trackers(init_kwargs=)`; logging_dir: TensorBoard's folder (the config's
        logging_dir; default output_dir/runs/run_name); transformers_keys: False keeps metric names
        unprefixed in TensorBoard / W&B."""
        self.output_dir = Path(output_dir)
        self.logging_dir = Path(os.path.expanduser(logging_dir)) if logging_dir else None
        self.project = project
        # TensorBoard / W&B names: transformers' (`train/objective/kl`), or as given (the classic PPO
        # API logs through accelerate's trackers, which add no prefix).
        self.tracker_key = tracker_key if transformers_keys else str
        self.init_kwargs = {k: dict(v) for k, v in (init_kwargs or {}).items()}
        self.is_main = is_main
        self.run_name = run_name or time.strftime("%Y%m%d-%H%M%S")
        self.config = to_jsonable(config) if config is not None else {}
        self.sinks = _parse_report_to(report_to)
        self._jsonl = None
        self._samples = None
        self._tb_writer = None
        self._wandb_run = None
        self._console = None
        if not is_main:
            return
        # Import now so a missing optional package fails before any training work is done.
        self._tb_cls = _import_sink("tensorboard") if "tensorboard" in self.sinks else None
        self._wandb = _import_sink("wandb") if "wandb" in self.sinks else None
        from rich.console import Console

        self._console = Console(highlight=False)

    def _open(self, name: str):
        self.output_dir.mkdir(parents=True, exist_ok=True)
        # Append: a resumed run continues the same files.
        return open(self.output_dir / name, "a", encoding="utf-8")

    def _tb(self):
        if self._tb_writer is None and self._tb_cls is not None:
            log_dir = self.logging_dir or self.output_dir / "runs" / self.run_name
            self._tb_writer = self._tb_cls(log_dir=str(log_dir), **self.init_kwargs.get("tensorboard", {}))
            if self.config:
                self._tb_writer.add_text("config", f"```\n{json.dumps(self.config, indent=2)}\n```")
        return self._tb_writer

    def _wb(self):
        if self._wandb_run is None and self._wandb is not None:
            settings = {
                "project": self.project or os.environ.get("WANDB_PROJECT", "posttrain"),
                "name": self.run_name,
                "config": self.config,
                "dir": str(self.output_dir),
            }
            self._wandb_run = self._wandb.init(**{**settings, **self.init_kwargs.get("wandb", {})})
        return self._wandb_run

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record one logging step: console and metrics.jsonl get the keys exactly as given (plus
        "step" in metrics.jsonl); TensorBoard and W&B get them as `tracker_key` writes them, and W&B
        also `train/global_step` (the x-axis transformers' WandbCallback defines)."""
        if not self.is_main:
            return
        values = {k: _scalar(v) for k, v in metrics.items()}
        record = to_jsonable({**values, "step": int(step)})
        if self._jsonl is None:
            self._jsonl = self._open("metrics.jsonl")
        self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        self._jsonl.flush()

        from rich.text import Text

        # Text, not markup: metric names and values may contain "[...]".
        shown = console_keys(values)
        line = Text(f"step {step}", style="bold")
        line.append("".join(f" | {k} {_format_number(values[k])}" for k in shown))
        if len(shown) < len(values):
            line.append(f" | (+{len(values) - len(shown)} more in metrics.jsonl)", style="dim")
        self._console.print(line, soft_wrap=True)

        writer = self._tb()
        if writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    writer.add_scalar(self.tracker_key(key), value, global_step=step)
            writer.flush()
        run = self._wb()
        if run is not None:
            named = {self.tracker_key(k): v for k, v in values.items()}
            if self.tracker_key is tracker_key:
                named["train/global_step"] = int(step)
            run.log(named, step=step)

    def log_table(self, name: str, rows: list[Mapping[str, Any]], step: int) -> None:
        """Print sample rows (e.g. prompt / completion / score) as a rich table, like TRL's
        `print_rich_table`, and append them to `samples.jsonl` (one object per row)."""
        if not self.is_main or not rows:
            return
        from rich.table import Table
        from rich.text import Text

        columns = list(dict.fromkeys(k for row in rows for k in row))
        table = Table(title=Text(f"{name} (step {step})"), show_lines=True)
        for column in columns:
            table.add_column(Text(str(column)))
        for row in rows:
            # Text, not markup: completions often contain "[...]" that rich would swallow.
            table.add_row(*(Text(str(_scalar(row.get(c, "")))) for c in columns))
        self._console.print(table)

        if self._samples is None:
            self._samples = self._open("samples.jsonl")
        for row in rows:
            record = to_jsonable({"step": int(step), "table": name, **row})
            self._samples.write(json.dumps(record, allow_nan=False) + "\n")
        self._samples.flush()

        run = self._wb()
        if run is not None:
            data = [[to_jsonable(row.get(c)) for c in columns] for row in rows]
            run.log({name: self._wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        for handle in (self._jsonl, self._samples):
            if handle is not None:
                handle.close()
        self._jsonl = self._samples = None
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class ProgressBar:
    """Episode progress: count, episodes/s and ETA (tqdm), with the latest metrics as postfix."""

    def __init__(self, total_episodes: int, disable: bool = False, desc: str = "episodes") -> None:
        from tqdm.auto import tqdm

        # Counted here because a disabled tqdm bar (non-main ranks) does not count.
        self.n = 0
        self._bar = tqdm(
            total=total_episodes,
            desc=desc,
            unit="ep",
            disable=disable,
            dynamic_ncols=True,
            smoothing=0.1,
        )

    def update(self, episodes: int) -> None:
        self.n += episodes
        self._bar.update(episodes)

    def set_postfix(self, values: Mapping[str, Any]) -> None:
        self._bar.set_postfix({k: _format_number(_scalar(v)) for k, v in values.items()}, refresh=False)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def progress_bar(total_episodes: int, disable: bool = False) -> ProgressBar:
    """Shorthand used by trainers: a `ProgressBar` over `total_episodes`."""
    return ProgressBar(total_episodes, disable=disable)
