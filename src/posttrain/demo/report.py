"""The demo's report: report.md, plots/ and before_after.jsonl in the demo's output_dir.

The report answers "did RLHF work?" with the numbers a reader needs: the reward model's held-out
accuracy, the proxy (reward-model) and gold (the task's rule) scores of the SFT and RL policies on
held-out prompts, the gold win rate of RL over SFT, the KL to the reference, curves over
training, and the same prompts answered before and after. When the proxy rose while the gold
score fell — the policy learned to please the reward model, not the rule it stands for — the
report says so (reward over-optimisation, Gao et al. 2022).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# XPO logs the proxy score of the policy's completions as objective/model_scores; GRPO keeps its
# KL in the loss and logs no objective/rlhf_reward. plot_run skips what a run did not log.
RL_PLOT_METRICS = ("objective/rlhf_reward", "objective/scores", "objective/model_scores", "objective/kl")
PROXY_KEYS = ("objective/scores", "objective/model_scores")
WIN_RATE_BAR = 0.75  # the acceptance bar of the default run
TABLE_ROWS = 10


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(results: dict) -> dict[str, float]:
    """Means of the evaluation results (see pipeline.evaluate)."""
    return {
        "gold_before": _mean(results["gold_before"]),
        "gold_after": _mean(results["gold_after"]),
        "proxy_before": _mean(results["proxy_before"]),
        "proxy_after": _mean(results["proxy_after"]),
        "win_rate": results["win_rate"],
        "kl": results["kl"],
    }


def overoptimization_warning(
    proxy_before: float, proxy_after: float, gold_before: float, gold_after: float, where: str = "on held-out prompts"
) -> str | None:
    """The sentence that flags reward over-optimisation, or None when the proxy did not rise while gold fell."""
    if proxy_after > proxy_before and gold_after < gold_before:
        return (
            f"**Reward over-optimisation:** {where} the proxy reward rose ({proxy_before:+.2f} → {proxy_after:+.2f}) "
            f"while the gold score fell ({gold_before:+.2f} → {gold_after:+.2f}). The policy learned to please the "
            "reward model rather than the rule it stands for; raise the KL coefficient, train for fewer episodes, "
            "or give the reward model more (and more varied) preference data."
        )
    return None


def curve_ends(records: list[dict], key: str, fraction: float = 0.2) -> tuple[float, float] | None:
    """Mean of `key` over the first and the last `fraction` of the records that have it."""
    values = [r[key] for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    if len(values) < 2:
        return None
    k = max(1, int(len(values) * fraction))
    return _mean(values[:k]), _mean(values[-k:])


def health_warnings(records: list[dict]) -> list[str]:
    """Replay the RL metrics through the health monitor (silently) and return its warnings."""
    from posttrain.health import HealthMonitor

    monitor = HealthMonitor(enabled=False)
    issued: list[str] = []
    for i, record in enumerate(records, 1):
        issued += [w for w in monitor.check(record, int(record.get("step", i))) if w]
    return issued


def _proxy_key(records: list[dict]) -> str:
    return next((k for k in PROXY_KEYS if any(k in r for r in records)), PROXY_KEYS[0])


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _plot_proxy_vs_gold(rl_records: list[dict], gold_records: list[dict], path: Path) -> Path | None:
    """Proxy score and gold score over training on one figure (two y axes): over-optimisation at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from posttrain.plots import series

    px, py, x_key = series(rl_records, _proxy_key(rl_records))
    gx, gy, _ = series(gold_records, "gold/score")
    if not px or not gx:
        return None
    fig, left = plt.subplots(figsize=(6, 3.5), dpi=100)
    left.plot(px, py, color="tab:blue", linewidth=1.5, label="proxy (reward model)")
    left.set_ylabel("proxy score", color="tab:blue")
    left.set_xlabel(x_key)
    right = left.twinx()
    right.plot(gx, gy, color="tab:orange", linewidth=1.5, label="gold rule")
    right.set_ylabel("gold score", color="tab:orange")
    left.set_title("proxy vs gold score of the training completions")
    left.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def make_plots(output_dir: Path) -> list[Path]:
    """PNG plots in output_dir/plots: the RL objective curves, the gold curve and proxy-vs-gold."""
    from posttrain.plots import plot_run

    plots = output_dir / "plots"
    rl_dir, gold_file = output_dir / "rl", output_dir / "rl" / "gold_metrics.jsonl"
    written: list[Path] = []
    if (rl_dir / "metrics.jsonl").is_file():
        written += plot_run(rl_dir, metrics=list(RL_PLOT_METRICS), plots_dir=plots)
    if gold_file.is_file():
        written += plot_run(gold_file, metrics=["gold/score"], plots_dir=plots)
    both = _plot_proxy_vs_gold(
        _read_jsonl(rl_dir / "metrics.jsonl"), _read_jsonl(gold_file), plots / "proxy_vs_gold.png"
    )
    if both is not None:
        written.append(both)
    return written


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") or "(empty)"


def before_after_table(results: dict, rows: int = TABLE_ROWS) -> str:
    lines = ["| prompt | SFT policy (before) | gold | RL policy (after) | gold |", "|---|---|---:|---|---:|"]
    for i in range(min(rows, len(results["prompts"]))):
        lines.append(
            f"| {_cell(results['prompts'][i])} | {_cell(results['before'][i])} | {results['gold_before'][i]:+.0f} "
            f"| {_cell(results['after'][i])} | {results['gold_after'][i]:+.0f} |"
        )
    return "\n".join(lines)


def _fmt(value: Any, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) and math.isfinite(value) else "n/a"


def render(
    *,
    config: dict,
    rm_stats: dict,
    sft_eval: dict,
    results: dict,
    timings: dict,
    rl_args: dict,
    rl_records: list[dict],
    gold_records: list[dict],
    plots: list[str],
) -> str:
    """report.md as a string (pure: tests call it with made-up numbers)."""
    s = summarize(results)
    algo, n = config.get("algo", "ppo"), len(results["prompts"])
    verdict_ok = s["win_rate"] >= WIN_RATE_BAR
    lines = [
        f"# posttrain demo: RLHF ({algo}) on the embedded review task",
        "",
        "The three steps of RLHF (supervised fine-tuning → reward model → RL, as in DeepSpeed-Chat) on short "
        "reviews written in a tiny generated English. A **gold rule** plays the human labeller: a review scores "
        "(distinct positive terms) − (distinct negative terms) − (repeated terms), where *not* flips the next "
        "sentiment word. The RL step never sees the gold rule; it optimises a reward model that learned the rule "
        "from gold-labelled pairs (the **proxy**).",
        "",
        "## Headline",
        "",
        f"- Gold win rate of the RL policy over the SFT policy on {n} held-out prompts: **{s['win_rate']:.1%}** "
        f"({results['wins']} wins, {results['ties']} ties, {results['losses']} losses; ties count half). "
        + (f"Meets the {WIN_RATE_BAR:.0%} bar." if verdict_ok else f"Below the {WIN_RATE_BAR:.0%} bar."),
        f"- Gold score: {s['gold_before']:+.2f} (SFT) → **{s['gold_after']:+.2f}** (RL).",
        f"- Proxy (reward-model) score: {s['proxy_before']:+.2f} (SFT) → **{s['proxy_after']:+.2f}** (RL).",
        f"- KL(RL ‖ SFT) per completion on held-out prompts: **{_fmt(s['kl'], '.2f')}** nats "
        f"(final training `objective/kl`: {_fmt((rl_records[-1] if rl_records else {}).get('objective/kl'), '.2f')}).",
        f"- Reward model held-out accuracy: **{_fmt(rm_stats.get('accuracy'), '.1%')}**.",
        "- Mean completion length (tokens, stop token included): "
        f"{_fmt(results['length_before'], '.1f')} → {_fmt(results['length_after'], '.1f')}.",
        "",
    ]
    warnings = []
    held_out = overoptimization_warning(s["proxy_before"], s["proxy_after"], s["gold_before"], s["gold_after"])
    if held_out:
        warnings.append(held_out)
    proxy_curve, gold_curve = curve_ends(rl_records, _proxy_key(rl_records)), curve_ends(gold_records, "gold/score")
    if proxy_curve and gold_curve:
        during = overoptimization_warning(
            proxy_curve[0],
            proxy_curve[1],
            gold_curve[0],
            gold_curve[1],
            where="over training (first vs last fifth of the run)",
        )
        if during:
            warnings.append(during)
    if warnings:
        lines += ["## Warnings", "", *[f"- {w}" for w in warnings], ""]
    else:
        lines += ["No reward over-optimisation: the gold score did not fall while the proxy rose.", ""]

    health = health_warnings(rl_records)
    lines += ["## Health checks", ""]
    lines += (
        [f"- {w}" for w in health]
        if health
        else [
            "The health monitor (val/ratio within [0.5, 2], objective/kl below 10, objective/rlhf_reward rising) "
            "raised no warning during RL."
        ]
    )
    lines += [
        "",
        "## Step 1: supervised fine-tuning",
        "",
        f"A {config.get('model', 'tiny Llama')} trained from scratch on the generated reviews. Held-out loss "
        f"**{_fmt(sft_eval.get('eval_loss'))}** "
        f"(perplexity {_fmt(math.exp(sft_eval['eval_loss']) if 'eval_loss' in sft_eval else None, '.2f')}), "
        f"next-token accuracy {_fmt(sft_eval.get('eval_mean_token_accuracy'), '.1%')}. Model and metrics: `sft/`.",
        "",
        "## Step 2: reward model",
        "",
        f"Two SFT samples per prompt, the better one by the gold rule is *chosen* ({rm_stats.get('train_pairs', 0)} "
        f"training pairs, {rm_stats.get('ties_dropped', 0)} ties dropped). A reward model initialised from the SFT "
        f"weights learned them; on {rm_stats.get('eval_pairs', 0)} pairs of held-out prompts "
        "(DeepSpeed-Chat's log line):",
        "",
        "```",
        f"chosen_last_scores (higher is better) : {_fmt(rm_stats.get('chosen_score'), '.4f')}, "
        f"reject_last_scores (lower is better) : {_fmt(rm_stats.get('rejected_score'), '.4f')}, "
        f"acc (higher is better) : {_fmt(rm_stats.get('accuracy'), '.4f')}",
        "```",
        "",
        f"## Step 3: RL ({algo})",
        "",
        f"{_fmt(rl_args.get('total_episodes'), 'd')} episodes, learning rate {rl_args.get('learning_rate')}, "
        f"KL coefficient {rl_args.get('kl_coef', rl_args.get('beta'))}, "
        f"sampling temperature {rl_args.get('temperature')}. "
        "The gold curve is the gold score of the very completions the trainer scored at each logging step.",
        "",
    ]
    for plot in plots:
        lines.append(f"![{Path(plot).stem}]({plot})")
    lines += [
        "",
        "## Before and after",
        "",
        f"The same held-out prompts answered by the SFT policy and by the RL policy (same sampling seed; "
        f"all {n} in `before_after.jsonl`):",
        "",
        before_after_table(results),
        "",
        "## Time",
        "",
        " · ".join(f"{k} {v:.0f} s" for k, v in timings.items()),
        "",
    ]
    return "\n".join(lines)


def write_report(
    output_dir: Path | str, *, config: dict, rm_stats: dict, sft_eval: dict, results: dict, timings: dict, rl_args: dict
) -> Path:
    """Write plots/, before_after.jsonl and report.md; return the report's path."""
    output_dir = Path(output_dir)
    written = make_plots(output_dir)
    rl_records = _read_jsonl(output_dir / "rl" / "metrics.jsonl")
    gold_records = _read_jsonl(output_dir / "rl" / "gold_metrics.jsonl")
    with open(output_dir / "before_after.jsonl", "w", encoding="utf-8") as f:
        for i, prompt in enumerate(results["prompts"]):
            f.write(
                json.dumps(
                    {
                        "prompt": prompt,
                        "before": results["before"][i],
                        "after": results["after"][i],
                        "gold_before": results["gold_before"][i],
                        "gold_after": results["gold_after"][i],
                        "proxy_before": results["proxy_before"][i],
                        "proxy_after": results["proxy_after"][i],
                    }
                )
                + "\n"
            )
    text = render(
        config=config,
        rm_stats=rm_stats,
        sft_eval=sft_eval,
        results=results,
        timings=timings,
        rl_args=rl_args,
        rl_records=rl_records,
        gold_records=gold_records,
        plots=[p.relative_to(output_dir).as_posix() for p in written],
    )
    path = output_dir / "report.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    summary = {**summarize(results), "rm_accuracy": rm_stats.get("accuracy"), "timings": timings}
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return path
