"""Real-size runs: SFT, reward, PPO (full and LoRA), RLOO and GRPO on a Qwen2.5-0.5B-shaped model, with
TRL's RLOO, PPO (0.19.1) and GRPO (newest) on the same model, prompts and settings.

    PYTHONPATH=src python benchmarks/build_05b.py                       # once: the artifacts (see there)
    PYTHONPATH=src python benchmarks/scale.py [--jobs sft,rloo,trl_rloo] [--steps 3] [--lock FILE]
    PYTHONPATH=src python benchmarks/scale.py --audit                   # full-vocabulary tensor audit

Every run is its own process, `/usr/bin/time -v python benchmarks/scale_probe.py ...` (one at a time;
with --lock each run holds `flock FILE` for its own duration only). Settings: batch 4 (completions per
rollout batch; SFT sequences; reward pairs), k = 2 for RLOO and GRPO, response 16 tokens, temperature 1,
one epoch of one minibatch, learning rate 3e-6, fp32, gradient checkpointing (on TRL's side enabled by the
probe on the loaded models: TRL 0.19's classic trainers ignore the field and TRL's GRPO script sets it
False), --steps optimizer steps per run. posttrain runs through its command line (`posttrain <command>`
argv, run by the probe in-process); TRL through ../shared/bench/run_<trainer>.py with the knobs of its
common.py (ART, SIZE=05b, EPISODES, BATCH, K, RESP_LEN) in the TRL virtualenvs of ../shared/bench/setup.sh.

The probe (scale_probe.py) times the same phases in both libraries: generation, no-grad forwards
(reference, reward, value, old log-probs), the update forward, backward, optimizer. Reported per run:
seconds per step (mean over the steps after the first: the first carries one-off allocations),
episodes/s over all steps (excluding loading and saving), generation and update tokens/s, peak RSS
(/usr/bin/time). Results: <out>/scale.json and <out>/scale.md (the tables benchmarks/README.md quotes).

--audit runs the same commands for one step on the tiny-hidden build of the same vocabulary
(build_05b.py --layers 2 --hidden 56 --intermediate 128 into <art>-audit) with PROBE_AUDIT: every tensor
with the vocabulary as last dimension and at least batch × vocab elements is listed with its shape,
phase and the source lines that created it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BENCH = Path(os.environ.get("POSTTRAIN_BENCH", os.path.expanduser("~/.cache/posttrain-bench")))
SIZE = "05b"
BATCH, K, RESP_LEN, LR, SEED = 4, 2, 16, 3e-6, 42
BF16 = False  # --bf16: both libraries in bf16 autocast (fp32 master weights)
VOCAB = 151_936
OURS = ("sft", "reward", "ppo", "ppo_peft", "rloo", "grpo", "grpo_fused")
TRL = ("trl_rloo", "trl_ppo", "trl_grpo")
PAIRS = {"ppo": "trl_ppo", "rloo": "trl_rloo", "grpo": "trl_grpo", "grpo_fused": "trl_grpo"}
LABELS = {
    "sft": "SFT",
    "reward": "Reward model (pairs)",
    "ppo": "PPO (critic), full",
    "ppo_peft": "PPO (critic), --use_peft",
    "rloo": "RLOO (k=2)",
    "grpo": "GRPO (k=2, beta 0.05)",
    "grpo_fused": "GRPO, --optim adamw_torch_fused",
    "trl_rloo": "TRL 0.19.1 RLOO",
    "trl_ppo": "TRL 0.19.1 PPO",
    "trl_grpo": "TRL 1.16 GRPO",
}


def ours_argv(job: str, art: Path, out: Path, steps: int) -> list[str]:
    policy, reward = str(art / f"policy-{SIZE}"), str(art / f"reward-{SIZE}")
    common = [
        "--output_dir", str(out), "--overwrite_output_dir", "--learning_rate", str(LR), "--seed", str(SEED),
        "--logging_steps", "1", "--report_to", "none", "--gradient_checkpointing", "--save_strategy", "no",
        *(["--bf16"] if BF16 else []),
    ]  # fmt: skip
    if job in ("sft", "reward"):
        data = "sft" if job == "sft" else "preference"
        model = policy if job == "sft" else reward
        return [
            job, "--model_name_or_path", model, "--dataset_name", str(art / data),
            "--per_device_train_batch_size", str(BATCH), "--max_steps", str(steps), *common,
        ]  # fmt: skip
    online = [
        "--model_name_or_path", policy, "--reward_model_path", reward, "--dataset_name", str(art / "prompts"),
        "--per_device_train_batch_size", str(BATCH), "--gradient_accumulation_steps", "1",
        "--num_mini_batches", "1", "--local_rollout_forward_batch_size", str(BATCH),
        "--total_episodes", str(steps * BATCH), "--response_length", str(RESP_LEN), "--temperature", "1.0",
        "--num_sample_generations", "0", *common,
    ]  # fmt: skip
    if job in ("ppo", "ppo_peft"):
        extra = ["--num_ppo_epochs", "1", "--value_model_init", "reward"]
        return ["ppo", *online, *extra, *(["--use_peft"] if job == "ppo_peft" else [])]
    if job == "rloo":
        return ["rloo", *online, "--rloo_k", str(K), "--num_ppo_epochs", "1", "--kl_coef", "0.05"]
    if job in ("grpo", "grpo_fused"):
        fused = ["--optim", "adamw_torch_fused"] if job == "grpo_fused" else []  # TRL 1.x's default optimizer
        return ["grpo", *online, "--num_generations", str(K), "--num_iterations", "1", "--beta", "0.05", *fused]
    raise SystemExit(f"unknown job {job!r}")


def command(job: str, art: Path, out: Path, steps: int, trl_bench: Path, python: str) -> tuple[list[str], dict]:
    """The probe's command line and the environment for one job."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "2",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONHASHSEED": "0",
    }
    probe = [str(HERE / "scale_probe.py"), str(out / "probe.json")]
    if job in OURS:
        env["PYTHONPATH"] = str(ROOT / "src")
        return [python, *probe, "posttrain", *ours_argv(job, art, out, steps)], env
    name = job.removeprefix("trl_")
    venv = BENCH / ("venv-trl" if name == "grpo" else "venv-trl-old")
    env.pop("PYTHONPATH", None)
    env.update(
        ART=str(art), SIZE=SIZE, RUNS=str(out), EPISODES=str(steps * BATCH), BATCH=str(BATCH), K=str(K),
        RESP_LEN=str(RESP_LEN), PPO_EPOCHS="1", LR=str(LR), SEED=str(SEED), TEMP="1.0", BF16=str(int(BF16)),
        PROBE_GC="1",
    )  # fmt: skip
    return [str(venv / "bin" / "python"), *probe, "script", str(trl_bench / f"run_{name}.py")], env


def time_v(path: Path) -> dict:
    text = path.read_text()
    wall = re.search(r"Elapsed \(wall clock\) time.*: (.*)", text)[1].split(":")
    return {
        "peak_rss_mb": round(int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)[1]) / 1024, 1),
        "process_wall_s": round(sum(float(x) * 60**i for i, x in enumerate(reversed(wall))), 1),
        "cpu_percent": int(re.search(r"Percent of CPU this job got: (\d+)%", text)[1]),
    }


def digest(job: str, probe: dict, timing: dict) -> dict:
    """Per-run numbers from the probe's steps: s/step (after the first), episodes/s (all steps),
    per-phase seconds (after the first step) and tokens/s."""
    steps = probe["steps"]
    later = steps[1:] or steps
    phases: dict[str, dict] = {}
    for step in later:
        for name, p in step["phases"].items():
            acc = phases.setdefault(name, {"s": 0.0, "tokens": 0, "rss_rise_mb": 0.0})
            acc["s"] += p["s"] / len(later)
            acc["tokens"] += p.get("tokens", 0) / len(later)
            acc["rss_rise_mb"] = max(acc["rss_rise_mb"], p.get("rss_rise_mb", 0.0))
    gen = phases.get("generate", {"s": 0.0, "tokens": 0})
    update_s = sum(phases.get(k, {"s": 0.0})["s"] for k in ("forward_grad", "backward", "optimizer"))
    update_tokens = phases.get("forward_grad", {"tokens": 0})["tokens"]
    rise = max((step["phases"].get(k, {}).get("rss_rise_mb", 0.0) for step in steps for k in ("forward_grad",
               "backward", "optimizer")), default=0.0)  # fmt: skip
    return {
        "job": job,
        "label": LABELS[job],
        "steps": len(steps),
        "first_step_s": steps[0]["s"] if steps else None,
        "s_per_step": round(sum(s["s"] for s in later) / len(later), 2) if later else None,
        "episodes_per_s": round(len(steps) * BATCH / sum(s["s"] for s in steps), 3) if steps else None,
        "generate_tok_s": round(gen["tokens"] / gen["s"], 1) if gen["s"] else None,
        "update_tok_s": round(update_tokens / update_s, 1) if update_s else None,
        "update_tokens_per_step": int(update_tokens),
        "phases_s": {k: round(v["s"], 2) for k, v in sorted(phases.items())},
        "update_rss_rise_mb": round(rise, 1),
        "rss_after_load_mb": probe.get("first_event_rss_mb"),
        "peak_set_in": probe.get("peak_set_in"),
        **timing,
    }


def run_job(job: str, args: argparse.Namespace, out_root: Path, env_extra: dict | None = None) -> dict:
    out = out_root / job
    out.mkdir(parents=True, exist_ok=True)
    cmd, env = command(job, args.art, out, args.steps, args.trl_bench, args.python)
    env.update(env_extra or {})
    timed = ["/usr/bin/time", "-v", "-o", str(out / "time.txt"), *cmd]
    if args.lock:
        timed = ["flock", args.lock, *timed]
    (out / "command.txt").write_text(" ".join(cmd) + "\n")
    started = time.time()
    with open(out / "run.log", "w") as log:
        code = subprocess.call(timed, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=out)
    if code:
        tail = (out / "run.log").read_text()[-3000:]
        print(tail)
        return {"job": job, "label": LABELS[job], "failed": code, "log": str(out / "run.log")}
    probe = json.loads((out / "probe.json").read_text())
    result = digest(job, probe, time_v(out / "time.txt"))
    result["audit"] = probe.get("audit", [])
    result["elapsed_incl_lock_wait_s"] = round(time.time() - started, 1)
    return result


def fmt(x, nd=2):
    return "–" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def tables(results: dict[str, dict]) -> str:
    lines = [
        "| trainer | ours s/step | TRL s/step | speed ratio (TRL s/step ÷ ours) | ours episodes/s | TRL episodes/s "
        "| ours peak RSS MB | TRL peak RSS MB | RSS ratio (ours ÷ TRL) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for job in OURS:
        r = results.get(job)
        if not r or r.get("failed"):
            continue
        t = results.get(PAIRS.get(job, ""), {})
        t = {} if t.get("failed") else t
        speed = t["s_per_step"] / r["s_per_step"] if t.get("s_per_step") else None
        rss = r["peak_rss_mb"] / t["peak_rss_mb"] if t.get("peak_rss_mb") else None
        lines.append(
            f"| {LABELS[job]} | {fmt(r['s_per_step'])} | {fmt(t.get('s_per_step'))} "
            f"| {fmt(speed) + '×' if speed else '–'} | {fmt(r['episodes_per_s'], 3)} "
            f"| {fmt(t.get('episodes_per_s'), 3)} | {fmt(r['peak_rss_mb'], 0)} | {fmt(t.get('peak_rss_mb'), 0)} "
            f"| {fmt(rss)} |"
        )
    lines += [
        "",
        "| run | s/step | first step s | generate s | no-grad forwards s | update forward s | backward s "
        "| optimizer s | other s | generate tok/s | RSS at step 1 start MB | update RSS rise MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        if r.get("failed"):
            lines.append(f"| {LABELS[r['job']]} | failed ({r['log']}) |" + " |" * 10)
            continue
        p = r["phases_s"]
        lines.append(
            f"| {LABELS[r['job']]} | {fmt(r['s_per_step'])} | {fmt(r['first_step_s'])} | {fmt(p.get('generate'))} "
            f"| {fmt(p.get('forward_nograd'))} | {fmt(p.get('forward_grad'))} | {fmt(p.get('backward'))} "
            f"| {fmt(p.get('optimizer'))} | {fmt(p.get('other'))} | {fmt(r['generate_tok_s'], 1)} "
            f"| {fmt(r['rss_after_load_mb'], 0)} | {fmt(r['update_rss_rise_mb'], 0)} |"
        )
    return "\n".join(lines) + "\n"


# Ops that return a view of memory that already exists (or a weight's transpose): not new allocations.
VIEWS = ("view", "_unsafe_view", "as_strided", "t", "select", "slice", "detach", "expand", "transpose", "alias")


def audit_table(results: dict[str, dict]) -> str:
    """The vocabulary-sized tensors each run allocated (views left out), largest first."""
    lines = ["| run | shape | dtype | MB | phase | op | created at (innermost first) |", "|---" * 7 + "|"]
    for job, r in results.items():
        allocated = [a for a in r.get("audit", []) if a["op"].removeprefix("aten.").split(".")[0] not in VIEWS]
        for a in allocated[:8]:
            where = " ← ".join(reversed(a["where"][-3:]))
            lines.append(
                f"| {LABELS[job]} | {tuple(a['shape'])} | {a['dtype'].removeprefix('torch.')} | {a['mb']} "
                f"| {a['phase']} | {a['op'].removeprefix('aten.')} | {where} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    global BATCH, RESP_LEN, BF16
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--art", type=Path, default=BENCH / f"artifacts-{SIZE}", help="build_05b.py's output")
    parser.add_argument("--jobs", default=",".join(OURS + TRL), help=f"comma-separated, of {', '.join(OURS + TRL)}")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default <art>/runs-scale)")
    parser.add_argument("--lock", default=None, help="flock this file around each run")
    parser.add_argument("--trl-bench", type=Path, default=ROOT.parent / "shared" / "bench", help="TRL's run_*.py")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the posttrain runs")
    parser.add_argument("--audit", action="store_true", help="full-vocabulary tensor audit on <art>-audit")
    parser.add_argument("--batch", type=int, default=BATCH, help="completions per rollout batch (both libraries)")
    parser.add_argument("--response_length", type=int, default=RESP_LEN, help="tokens per completion")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast in both libraries (default fp32)")
    args = parser.parse_args(argv)
    BATCH, RESP_LEN, BF16 = args.batch, args.response_length, args.bf16
    jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    for j in jobs:
        if j not in LABELS:
            raise SystemExit(f"--jobs: unknown {j!r}; use {', '.join(OURS + TRL)}")
    env_extra = None
    if args.audit:
        tiny = Path(f"{args.art}-audit")
        if not (tiny / f"policy-{SIZE}").exists():
            build = [args.python, str(HERE / "build_05b.py"), str(tiny), "--layers", "2", "--hidden", "56"]
            build = [*(["flock", args.lock] if args.lock else []), *build, "--intermediate", "128"]
            subprocess.check_call(build, env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "2"})
        args.art, args.steps = tiny, 1
        env_extra = {"PROBE_AUDIT": str(BATCH * VOCAB)}
    # absolute: each run starts in its own folder under it (its /usr/bin/time report is written there)
    out_root = (args.out or args.art / ("runs-audit" if args.audit else "runs-scale")).resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    results_path = out_root / "scale.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for job in jobs:
        print(f"[{time.strftime('%H:%M:%S')}] {job} ...", flush=True)
        results[job] = run_job(job, args, out_root, env_extra)
        r = results[job]
        print(
            f"  s/step {r.get('s_per_step')} eps/s {r.get('episodes_per_s')} peak RSS {r.get('peak_rss_mb')} MB "
            f"phases {r.get('phases_s')}",
            flush=True,
        )
        results_path.write_text(json.dumps(results, indent=1))
    ordered = {j: results[j] for j in (*OURS, *TRL) if j in results}
    text = audit_table(ordered) if args.audit else tables(ordered)
    (out_root / ("audit.md" if args.audit else "scale.md")).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
