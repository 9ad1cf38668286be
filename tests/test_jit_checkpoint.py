"""enable_jit_checkpoint: a SIGTERM (a preemption notice) ends a run after the current step with a resumable
checkpoint and no final model, and `--resume_from_checkpoint latest` finishes it. Started the way users
start it: `python -m posttrain` in one process, and `torchrun --nproc_per_node 2 -m posttrain` (gloo on
CPU), where the signal reaches torchrun, which forwards it to both workers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import checkpoint_steps, child_env, cli_command, python_command, read_metrics
from posttrain.preemption import Preemption


def test_the_handler_records_sigterm_and_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    preemption = Preemption(True)
    with preemption.installed():
        assert preemption.requested() is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested() is True
    assert signal.getsignal(signal.SIGTERM) is before
    off = Preemption(False)
    with off.installed():
        assert signal.getsignal(signal.SIGTERM) is before
    assert off.requested() is False


def logged_steps(out: Path) -> list[int]:
    if not (out / "metrics.jsonl").exists():
        return []
    try:
        return [r["step"] for r in read_metrics(out) if "step" in r]
    except ValueError:  # a line being written
        return []


def run_until_sigterm(argv: list[str], out: Path, nproc: int) -> tuple[int, str]:
    """Start `posttrain *argv`, send SIGTERM once a step is logged, and return (exit code, stderr)."""
    env = child_env(ACCELERATE_USE_CPU="true")
    proc = subprocess.Popen(
        [*python_command(nproc), "-m", "posttrain", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not logged_steps(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before a SIGTERM could reach it: " + proc.stderr.read()[-2000:]
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=240)
    return proc.returncode, stderr


@pytest.mark.multiproc
@pytest.mark.parametrize(("name", "nproc"), [("sft", 1), ("rloo", 1), ("grpo", 2)])
def test_sigterm_saves_a_checkpoint_and_the_run_resumes(cli_files, tmp_path, name, nproc):
    out = tmp_path / "out"
    argv = cli_command(name, cli_files, out, steps=5000) + ["--save_steps", "0", "--enable_jit_checkpoint"]
    code, stderr = run_until_sigterm(argv, out, nproc)
    if nproc == 1:
        assert code == 0 and "Traceback" not in stderr, stderr[-3000:]
    else:  # torchrun re-raises the signal it forwarded; the workers themselves must not have failed
        assert "ChildFailedError" not in stderr, stderr[-3000:]
    assert "enable_jit_checkpoint: SIGTERM received; saved" in stderr
    saved = checkpoint_steps(out, complete_only=True)
    assert len(saved) == 1 and saved == checkpoint_steps(out), "one complete checkpoint, no partial one"
    step = saved[0]
    assert 1 <= step < 5000
    assert not (out / "config.json").exists(), "a preempted run writes no final model"
    assert max(logged_steps(out)) == step

    resume = cli_command(name, cli_files, out, steps=step + 1) + ["--resume_from_checkpoint", "latest"]
    proc = subprocess.run(
        [*python_command(nproc), "-m", "posttrain", *resume],
        env=child_env(ACCELERATE_USE_CPU="true"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert max(logged_steps(out)) == step + 1
    assert (out / "config.json").is_file()  # the resumed run finished and saved its final model
