"""Every trainer started the way multi-GPU users start it: `torchrun --nproc_per_node 2 -m posttrain
<command> ... --save_steps 1` (gloo on CPU), saving a checkpoint at every step, then the same command
continued with `--resume_from_checkpoint latest` and a larger budget.

A checkpoint is a collective: each rank writes only its own files, all ranks meet at one barrier,
and rank 0 alone renames the temp folder. A rank that wrote into the temp folder after rank 0 had
renamed it ("Parent directory ... does not exist") crashed every such run at its first save, which
in-process tests never see.
"""

from __future__ import annotations

import pytest

from helpers import cli_command, launch, read_metrics


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["rloo", "ppo", "grpo", "online-dpo", "xpo", "sft", "reward"])
def test_save_every_step_then_resume_under_torchrun(cli_files, tmp_path, name):
    out = tmp_path / "out"
    first = launch(cli_command(name, cli_files, out, steps=2))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Traceback" not in first.stderr
    # checkpoint-1 mid-run; the last step ends with the final save instead
    assert (out / "checkpoint-1" / "checkpoint_complete.json").is_file()
    assert not list(out.glob(".tmp*")), "a temp checkpoint folder was left behind"
    assert (out / "config.json").is_file()

    resumed = launch(cli_command(name, cli_files, out, steps=3) + ["--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    assert (out / "checkpoint-2" / "checkpoint_complete.json").is_file()  # resumed at step 1, saved step 2
    steps = [record.get("step") for record in read_metrics(out)]
    assert steps[-1] == 3
