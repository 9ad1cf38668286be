"""Same learning as TRL: the reward curves of GRPO and GRPO-style RLOO, TRL 1.16 against posttrain.

One script text for both libraries. `run` trains one (trainer, seed) with `from trl import ...`: under
TRL's interpreter that is TRL; with `--posttrain` the folder `curves_shim/` goes first on sys.path and
`trl` is posttrain (GRPO untouched; RLOO's TRL >= 0.21 argument names translated one to one, see the
shim's docstring). Every setting below is passed explicitly, so neither library's defaults decide.

Task: the pythia-14m-shaped random-weight policy of ../shared/bench (artifacts `policy-14m` and
`prompts`), rewarded by a text reward function: the fraction of the completion's non-whitespace
characters that are vowels (a, e, i, o, u; 0 for an empty completion). A random policy scores
about 0.2; the policy learns to prefer vowel-heavy tokens. The reward function records the mean
reward of every batch it scores (one batch per optimizer step), so the curve is measured the same
way in both libraries, outside either trainer's logging.

    python benchmarks/learning_curves.py sweep --lock /path/to/cpu.lock   # 12 runs, then `plot`
    python benchmarks/learning_curves.py plot                             # PNG + summary from the CSVs
    python benchmarks/learning_curves.py run --trainer grpo --seed 1 --csv out.csv [--posttrain]

sweep: TRL_PYTHON (default ~/.cache/posttrain-bench/venv-trl/bin/python, TRL 1.16) and PT_PYTHON
(default .venv/bin/python of the repository, with PYTHONPATH=src) run the two libraries; each
TRL + posttrain pair (or, with --hold run, each single run) holds `--lock` (flock) if given, so other
jobs interleave between pairs. Results:
benchmarks/results/curves/<trainer>-<library>-seed<S>.csv, plots and summary in benchmarks/curves/.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BENCH = os.environ.get("POSTTRAIN_BENCH", os.path.expanduser("~/.cache/posttrain-bench"))
ART = os.environ.get("ART", os.path.join(BENCH, "artifacts"))
TRAINERS = ("grpo", "rloo")
LIBRARIES = ("trl", "posttrain")

# Identical in both libraries (TRL 1.16 names; the shim maps RLOO's to posttrain's).
STEPS = 300
SHARED = dict(
    per_device_train_batch_size=16,  # completions per optimizer step: 4 prompts x 4 generations
    gradient_accumulation_steps=1,
    num_generations=4,
    max_completion_length=16,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    learning_rate=1e-3,
    lr_scheduler_type="linear",
    warmup_steps=0,
    weight_decay=0.0,
    max_grad_norm=1.0,
    epsilon=0.2,
    num_iterations=1,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    bf16=False,
    use_cpu=True,
    gradient_checkpointing=False,
)
PER_TRAINER = {
    "grpo": dict(beta=0.0, loss_type="dapo", scale_rewards="group"),  # TRL 1.16's defaults, written out
    # TRL 1.16 RLOOConfig defaults except beta: at its default 0.05 the KL penalty pins this policy (TRL, seed 1:
    # 0.334 -> 0.344 in 300 steps; benchmarks/results/curves-rloo-beta0.05/), so the curve would show nothing
    "rloo": dict(beta=0.001, normalize_advantages=False),
}
WINDOW = 20  # the last WINDOW steps make the "final reward" of a run
MID = 101  # steps MID .. MID + WINDOW - 1: the slow rise before the policy sharpens (at these settings)
THRESHOLD = 0.5  # summary: the first step at which the WINDOW-step mean reward reaches this

VOWELS = frozenset("aeiouAEIOU")


def vowel_fraction(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c in VOWELS for c in chars) / len(chars) if chars else 0.0


# ----------------------------------------------------------------------------------------------- run


def run(trainer_name: str, seed: int, csv_path: str, steps: int) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    import trl
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    history: list[tuple[float, float, float]] = []  # (mean reward, std, mean characters) per scored batch

    def vowels(prompts, completions, **kwargs):
        rewards = [vowel_fraction(c) for c in completions]
        history.append(
            (statistics.fmean(rewards), statistics.pstdev(rewards), statistics.fmean(len(c) for c in completions))
        )
        return rewards

    set_seed(seed)
    policy = f"{ART}/policy-14m"
    tokenizer = AutoTokenizer.from_pretrained(policy)
    train = load_from_disk(f"{ART}/prompts")["train"]
    out = tempfile.mkdtemp(prefix=f"curves-{trainer_name}-{seed}-")  # the final save (posttrain saves) goes here
    settings = {**SHARED, **PER_TRAINER[trainer_name], "max_steps": steps, "seed": seed, "output_dir": out}
    classes = {"grpo": (trl.GRPOConfig, trl.GRPOTrainer), "rloo": (trl.RLOOConfig, trl.RLOOTrainer)}
    config_cls, trainer_cls = classes[trainer_name]
    trainer = trainer_cls(
        model=AutoModelForCausalLM.from_pretrained(policy),
        reward_funcs=vowels,
        args=config_cls(**settings),
        train_dataset=train,
        processing_class=tokenizer,
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    logged = [h for h in trainer.state.log_history if "train_runtime" not in h]
    os.makedirs(os.path.dirname(os.path.abspath(csv_path)), exist_ok=True)
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "reward_mean", "reward_std", "completion_chars_mean"])
        for i, (mean, std, chars) in enumerate(history, 1):
            w.writerow([i, f"{mean:.6f}", f"{std:.6f}", f"{chars:.2f}"])
    meta = dict(
        library=trl.__version__,
        trainer=trainer_name,
        seed=seed,
        steps=trainer.state.global_step,
        reward_batches=len(history),
        train_wall_s=round(wall, 2),
        settings=settings,
        logged_first=logged[0] if logged else {},
        logged_last=logged[-1] if logged else {},
    )
    with open(csv_path[: -len(".csv")] + ".json", "w") as f:
        json.dump(meta, f, indent=1, default=str)
    print(f"{trainer_name} {trl.__version__} seed {seed}: {len(history)} batches in {wall:.1f}s -> {csv_path}")


# --------------------------------------------------------------------------------------------- sweep


@contextlib.contextmanager
def held(lock: str | None):
    """flock(LOCK_EX) on the file `lock` for the duration (nothing when lock is None)."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def sweep(out: str, seeds: list[int], trainers: list[str], steps: int, lock: str | None, hold: str, skip: bool) -> None:
    trl_python = os.environ.get("TRL_PYTHON", os.path.join(BENCH, "venv-trl", "bin", "python"))
    pt_python = os.environ.get("PT_PYTHON", os.path.join(ROOT, ".venv", "bin", "python"))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "2",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONHASHSEED": "0",
    }

    def one(trainer_name: str, seed: int, library: str) -> None:
        path = os.path.join(out, f"{trainer_name}-{library}-seed{seed}.csv")
        if skip and os.path.exists(path):
            print(f"{path} exists: skipped")
            return
        cmd = [trl_python if library == "trl" else pt_python, os.path.abspath(__file__), "run"]
        cmd += ["--trainer", trainer_name, "--seed", str(seed), "--csv", path, "--steps", str(steps)]
        run_env = dict(env)
        if library == "posttrain":
            cmd.append("--posttrain")
            run_env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(ROOT, "src"), env.get("PYTHONPATH")]))
        t0 = time.perf_counter()
        with held(lock if hold == "run" else None):
            done = subprocess.run(["timeout", "900", *cmd], env=run_env, capture_output=True, text=True)
        log = path[: -len(".csv")] + ".log"
        with open(log, "w") as f:
            f.write(done.stdout + done.stderr)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed (exit {done.returncode}); log: {log}")
        print(done.stdout.strip().splitlines()[-1], f"({time.perf_counter() - t0:.0f}s with any lock wait)")

    for seed in seeds:
        for trainer_name in trainers:
            with held(lock if hold == "pair" else None):  # the two libraries back to back, TRL first
                for library in LIBRARIES:
                    one(trainer_name, seed, library)


# ---------------------------------------------------------------------------------------------- plot


def load_curves(out: str) -> dict[tuple[str, str], dict[int, list[float]]]:
    curves: dict[tuple[str, str], dict[int, list[float]]] = {}
    for trainer_name in TRAINERS:
        for library in LIBRARIES:
            for name in sorted(os.listdir(out)):
                prefix = f"{trainer_name}-{library}-seed"
                if name.startswith(prefix) and name.endswith(".csv"):
                    with open(os.path.join(out, name)) as f:
                        rows = list(csv.DictReader(f))
                    seed = int(name[len(prefix) : -len(".csv")])
                    curves.setdefault((trainer_name, library), {})[seed] = [float(r["reward_mean"]) for r in rows]
    return curves


def crossing(curve: list[float]) -> int | None:
    """The last step of the first WINDOW-step window whose mean reward reaches THRESHOLD (None: never)."""
    for end in range(WINDOW, len(curve) + 1):
        if statistics.fmean(curve[end - WINDOW : end]) >= THRESHOLD:
            return end
    return None


def compare(trl: list[float], ours: list[float]) -> dict:
    """posttrain − TRL of the seeds' window means, against the seed spread: the largest per-library
    seed std, Welch's t (|t| under ~2.8 is within seed noise for 3 + 3 seeds), whether the ranges overlap."""
    diff = statistics.fmean(ours) - statistics.fmean(trl)
    sd_t = statistics.stdev(trl) if len(trl) > 1 else None
    sd_o = statistics.stdev(ours) if len(ours) > 1 else None
    se = (sd_t**2 / len(trl) + sd_o**2 / len(ours)) ** 0.5 if sd_t is not None and sd_o is not None else None
    return dict(
        difference_posttrain_minus_trl=diff,
        largest_seed_std=max(sd_t, sd_o) if se is not None else None,
        welch_t=diff / se if se else None,
        seed_ranges_overlap=not (min(ours) > max(trl) or min(trl) > max(ours)),
    )


def summarize(curves: dict[tuple[str, str], dict[int, list[float]]]) -> dict:
    summary: dict = {
        "window": WINDOW,
        "mid_window_start": MID,
        "threshold": THRESHOLD,
        "reward": "vowel fraction of non-whitespace characters",
        "trainers": {},
    }
    for trainer_name in TRAINERS:
        per_lib = {}
        for library in LIBRARIES:
            seeds = curves.get((trainer_name, library), {})
            if not seeds:
                continue
            first = {s: statistics.fmean(c[:WINDOW]) for s, c in seeds.items()}
            mid = {s: statistics.fmean(c[MID - 1 : MID - 1 + WINDOW]) for s, c in seeds.items()}
            final = {s: statistics.fmean(c[-WINDOW:]) for s, c in seeds.items()}
            per_lib[library] = dict(
                seeds=sorted(seeds),
                steps=min(len(c) for c in seeds.values()),
                first_window_mean=dict(sorted(first.items())),
                mid_window_mean=dict(sorted(mid.items())),
                step_reaching_threshold={s: crossing(c) for s, c in sorted(seeds.items())},
                final_window_mean=dict(sorted(final.items())),
                final_mean_over_seeds=statistics.fmean(final.values()),
                final_seed_range=[min(final.values()), max(final.values())],
                final_seed_std=statistics.stdev(final.values()) if len(final) > 1 else None,
            )
        entry: dict = {"libraries": per_lib}
        if len(per_lib) == 2:
            for window in ("mid", "final"):
                entry[window] = compare(
                    list(per_lib["trl"][f"{window}_window_mean"].values()),
                    list(per_lib["posttrain"][f"{window}_window_mean"].values()),
                )
        summary["trainers"][trainer_name] = entry
    return summary


def plot(out: str, fig_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = load_curves(out)
    os.makedirs(fig_dir, exist_ok=True)
    fig, axes = plt.subplots(1, len(TRAINERS), figsize=(11, 4), sharey=True)
    titles = {"grpo": "GRPO", "rloo": "RLOO (GRPO-style)"}
    colors = {"trl": "tab:blue", "posttrain": "tab:orange"}
    for ax, trainer_name in zip(axes, TRAINERS):
        for library in LIBRARIES:
            seeds = curves.get((trainer_name, library))
            if not seeds:
                continue
            n = min(len(c) for c in seeds.values())
            cols = [[c[i] for c in seeds.values()] for i in range(n)]
            x = list(range(1, n + 1))
            label = ("TRL 1.16" if library == "trl" else "posttrain") + f" ({len(seeds)} seeds)"
            ax.plot(x, [statistics.fmean(v) for v in cols], color=colors[library], label=label)
            ax.fill_between(x, [min(v) for v in cols], [max(v) for v in cols], color=colors[library], alpha=0.2)
        ax.set_title(titles[trainer_name])
        ax.set_xlabel("optimizer step (16 completions)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    axes[0].set_ylabel("mean reward (vowel fraction)")
    fig.suptitle("Reward per step, mean over seeds; band: min-max over seeds")
    fig.tight_layout()
    png = os.path.join(fig_dir, "learning_curves.png")
    fig.savefig(png, dpi=110)
    summary = summarize(curves)
    summary["settings"] = {"steps": STEPS, **SHARED, "per_trainer": PER_TRAINER}
    with open(os.path.join(fig_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    lines = [
        f"Mean reward per seed (in seed order) over steps 1-{WINDOW}, {MID}-{MID + WINDOW - 1} and the last {WINDOW};"
        f" the first step whose {WINDOW}-step mean reaches {THRESHOLD}:",
        "",
        f"| trainer | library | steps 1-{WINDOW} | steps {MID}-{MID + WINDOW - 1} | last {WINDOW} steps |"
        f" last {WINDOW}: mean (seed std) | step reaching {THRESHOLD} |",
        "|---|---|---|---|---|---|---|",
    ]

    def fmt(values: dict) -> str:
        return ", ".join(f"{v:.3f}" for v in values.values())

    for trainer_name, entry in summary["trainers"].items():
        for library, s in entry["libraries"].items():
            std = f"{s['final_seed_std']:.3f}" if s["final_seed_std"] is not None else "-"
            reach = ", ".join("never" if v is None else str(v) for v in s["step_reaching_threshold"].values())
            lines.append(
                f"| {trainer_name} | {library} | {fmt(s['first_window_mean'])} | {fmt(s['mid_window_mean'])} |"
                f" {fmt(s['final_window_mean'])} | {s['final_mean_over_seeds']:.3f} ({std}) | {reach} |"
            )
    lines.append("")
    for trainer_name, entry in summary["trainers"].items():
        for window, label in (("mid", f"steps {MID}-{MID + WINDOW - 1}"), ("final", f"last {WINDOW} steps")):
            if window not in entry:
                continue
            c = entry[window]
            sd = "-" if c["largest_seed_std"] is None else f"{c['largest_seed_std']:.3f}"
            t = "-" if c["welch_t"] is None else f"{c['welch_t']:+.2f}"
            lines.append(
                f"- {trainer_name}, {label}: posttrain − TRL = {c['difference_posttrain_minus_trl']:+.3f}; largest seed"
                f" std {sd}; Welch t {t}; seed ranges {'overlap' if c['seed_ranges_overlap'] else 'do not overlap'}"
            )
    with open(os.path.join(fig_dir, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("->", png)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one training run in this interpreter")
    r.add_argument("--trainer", choices=TRAINERS, required=True)
    r.add_argument("--seed", type=int, required=True)
    r.add_argument("--csv", required=True)
    r.add_argument("--steps", type=int, default=STEPS)
    r.add_argument("--posttrain", action="store_true", help="import posttrain as trl (curves_shim/)")
    s = sub.add_parser("sweep", help="every (trainer, seed, library), one process each, then plot")
    s.add_argument("--out", default=os.path.join(HERE, "results", "curves"))
    s.add_argument("--figures", default=os.path.join(HERE, "curves"))
    s.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    s.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    s.add_argument("--steps", type=int, default=STEPS)
    s.add_argument("--lock", default=os.environ.get("BENCH_LOCK"), help="flock this file (see --hold)")
    s.add_argument(
        "--hold",
        choices=("pair", "run"),
        default="pair",
        help="hold the lock around each TRL + posttrain pair (default; ~2.5 min) or around each single run",
    )
    s.add_argument("--skip-existing", action="store_true", help="keep runs whose CSV is already there")
    g = sub.add_parser("plot", help="PNG and summary from the CSVs")
    g.add_argument("--out", default=os.path.join(HERE, "results", "curves"))
    g.add_argument("--figures", default=os.path.join(HERE, "curves"))
    a = p.parse_args()
    if a.cmd == "run":
        if a.posttrain:
            sys.path.insert(0, os.path.join(HERE, "curves_shim"))
        run(a.trainer, a.seed, a.csv, a.steps)
    elif a.cmd == "sweep":
        os.makedirs(a.out, exist_ok=True)
        sweep(a.out, a.seeds, a.trainers, a.steps, a.lock, a.hold, a.skip_existing)
        plot(a.out, a.figures)
    else:
        plot(a.out, a.figures)


if __name__ == "__main__":
    main()
