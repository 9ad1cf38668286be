"""A run killed with SIGKILL and continued with `--resume_from_checkpoint latest` ends bitwise equal
to the run that was never interrupted: same final weights (every safetensors file in output_dir) and
the same metrics for every step after the checkpoint. Each trainer is started through the command
line in its own process, killed once checkpoint 2 of 5 is complete, and resumed with the same command.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import checkpoint_steps, child_env, posttrain_command, read_metrics

STEPS, KILL_AFTER = 5, 2


def command(name: str, root: Path, out: Path) -> list[str]:
    if name in ("sft", "reward"):
        data, model = ("text.jsonl", "policy") if name == "sft" else ("pairs.jsonl", "rm")
        args = ["--dataset_name", str(root / data), "--model_name_or_path", str(root / model)]
    else:
        args = ["--dataset_name", str(root / "prompts.jsonl"), "--model_name_or_path", str(root / "policy")]
        args += ["--reward_model_path", str(root / "rm"), "--response_length", "4"]
        if name == "rloo":
            args += ["--rloo_k", "2", "--num_ppo_epochs", "2", "--num_mini_batches", "2"]
        if name == "grpo":
            args += ["--num_generations", "2", "--beta", "0.05"]
        if name == "ppo":  # the adaptive KL controller's state must survive the kill too
            args += [
                "--num_ppo_epochs",
                "2",
                "--num_mini_batches",
                "2",
                "--adap_kl_ctrl",
                "--target",
                "0.01",
                "--horizon",
                "100",
            ]
    # max_steps counts optimizer steps: 2 epochs x 2 mini-batches = 4 per rollout batch for PPO and RLOO
    steps = STEPS * (4 if name in ("ppo", "rloo") else 1)
    args += ["--per_device_train_batch_size", "4", "--max_steps", str(steps), "--learning_rate", "1e-3"]
    return [*posttrain_command(1), name, *args, "--output_dir", str(out), "--save_steps", "1"]


ENV = child_env()


def run(argv: list[str]) -> None:
    proc = subprocess.run(
        [*argv, "--logging_steps", "1", "--report_to", "none"], env=ENV, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def weights(out: Path) -> dict[str, bytes]:
    from safetensors.torch import load_file

    files = sorted(out.glob("*.safetensors"))
    assert files
    return {f"{f.name}:{k}": v.numpy().tobytes() for f in files for k, v in load_file(f).items()}


def metrics(out: Path) -> dict[int, dict]:
    """step -> the metrics logged at that step (wall-clock entries dropped)."""
    rows = read_metrics(out)
    timing = ("eps", "train_runtime", "train_samples_per_second", "train_steps_per_second", "time", "timestamp")
    return {r["step"]: {k: v for k, v in r.items() if k not in timing} for r in rows if "step" in r}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["ppo", "rloo", "grpo", "online-dpo", "xpo", "sft", "reward"])
def test_sigkill_then_resume_equals_the_uninterrupted_run(cli_files, tmp_path, name):
    full, killed = tmp_path / "full", tmp_path / "killed"
    run(command(name, cli_files, full))
    saved = checkpoint_steps(full)
    assert saved[: KILL_AFTER + 1] == list(range(1, KILL_AFTER + 2))  # steps left to run after the kill

    argv = command(name, cli_files, killed)
    proc = subprocess.Popen(
        [*argv, "--logging_steps", "1", "--report_to", "none"],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    marker = killed / f"checkpoint-{KILL_AFTER}" / "checkpoint_complete.json"
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    still_running = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert still_running and marker.exists(), "the run ended before it could be killed after checkpoint 2"
    assert not (killed / "model.safetensors").exists()  # it really stopped mid-run

    run([*argv, "--resume_from_checkpoint", "latest"])
    assert weights(killed) == weights(full)
    after_full, after_resumed = metrics(full), metrics(killed)
    resumed_steps = [s for s in after_full if s > KILL_AFTER]
    assert resumed_steps and all(after_resumed[s] == after_full[s] for s in resumed_steps)
