"""One rank of a 2-process run killed with SIGKILL: the whole job ends within a bounded time with a
nonzero code and a report naming the failed rank (torchrun's elastic agent sees the dead worker and
terminates the survivor, which would otherwise wait in its next gloo collective), and the last
complete checkpoint still resumes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import checkpoint_steps, child_env, cli_command, launch, posttrain_command


def workers(parent: int) -> dict[int, int]:
    """LOCAL_RANK -> pid of the processes `parent` started."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent:
            for item in env:
                if item.startswith(b"LOCAL_RANK="):
                    found[int(item.split(b"=", 1)[1])] = int(entry.name)
    return found


@pytest.mark.multiproc
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the workers through /proc (Linux)")
def test_a_killed_rank_ends_the_job_in_bounded_time_naming_it_and_the_checkpoint_resumes(cli_files, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [*posttrain_command(2), *cli_command("rloo", cli_files, out, steps=40)],
        env=child_env(ACCELERATE_USE_CPU="true"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    marker = out / "checkpoint-1" / "checkpoint_complete.json"
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None and marker.exists(), "the run ended before its first checkpoint"
    ranks = workers(proc.pid)
    assert set(ranks) == {0, 1}
    os.kill(ranks[1], signal.SIGKILL)
    killed_at = time.monotonic()
    output, _ = proc.communicate(timeout=120)
    elapsed = time.monotonic() - killed_at
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end after rank 1 died"
    assert proc.returncode != 0
    # torchrun's report: the failed worker's global rank and the signal that ended it
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", output), output[-3000:]
    assert "Signal 9 (SIGKILL)" in output
    for pid in ranks.values():  # no survivor left waiting in a collective
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()

    # the last complete checkpoint is intact: the same command resumes from it and finishes
    done = checkpoint_steps(out, complete_only=True)
    assert done
    resumed = launch([*cli_command("rloo", cli_files, out, steps=done[-1] + 1), "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (out / "model.safetensors").is_file()
