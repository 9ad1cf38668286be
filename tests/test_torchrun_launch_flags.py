"""The launch flags through the CLI under `torchrun --nproc_per_node 2` (gloo on CPU): the DDP
settings reach a real 2-process run, and an --fsdp option that CPU processes cannot honour stops with
one clear error (the sharded runs themselves: tests/test_fsdp.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import child_env, launch, posttrain_command, read_metrics


def command(name: str, root: Path, out: Path) -> list[str]:
    model = ["--model_name_or_path", str(root / "policy"), "--per_device_train_batch_size", "2", "--max_steps", "2"]
    if name == "sft":
        args = ["--dataset_name", str(root / "text.jsonl"), *model]
    else:
        args = ["--dataset_name", str(root / "prompts.jsonl"), *model, "--response_length", "3"]
        args += ["--reward_model_path", str(root / "rm"), "--rloo_k", "2", "--num_ppo_epochs", "1"]
    return [name, *args, "--output_dir", str(out), "--save_steps", "0", "--logging_steps", "1", "--report_to", "none"]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["sft", "rloo"])
def test_ddp_flags_in_a_two_process_run(cli_files, tmp_path, name):
    ddp = ["--ddp_backend", "gloo", "--ddp_timeout", "120", "--ddp_find_unused_parameters", "true"]
    result = launch(command(name, cli_files, tmp_path / "out") + ddp)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    steps = [record.get("step") for record in read_metrics(tmp_path / "out")]
    assert steps[-1] == 2
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["model_type"]  # the trained model was saved for plain transformers


@pytest.mark.multiproc
def test_fsdp_option_cpu_processes_cannot_honour_is_one_clear_error(cli_files, tmp_path):
    # --fsdp shards CPU processes too (tests/test_fsdp.py); offloading to CPU memory has no meaning there.
    fsdp = ["--fsdp", "full_shard auto_wrap offload", "--fsdp_config", '{"fsdp_version": 2}']
    result = launch(command("sft", cli_files, tmp_path / "out") + fsdp)
    assert result.returncode != 0
    # Each rank prints the one-line ConfigError (torchrun then reports the failed children).
    assert "--fsdp offload (cpu_offload)" in result.stderr, result.stderr[-3000:]
    assert 'File "' + str(Path(__file__).parents[1] / "src") not in result.stderr


@pytest.mark.multiproc
@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without GPUs")
def test_torchrun_without_gpus_or_use_cpu_is_one_two_process_run(cli_files, tmp_path):
    # A GPU recipe typed as it is on a CPU machine: no --use_cpu, no ACCELERATE_USE_CPU. accelerate joins the
    # processes only when told to use the CPU; without that, each trained alone and both wrote one output_dir.
    out = tmp_path / "out"
    result = subprocess.run(
        [*posttrain_command(2), *command("rloo", cli_files, out)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]  # one writer
    assert [r["episode"] for r in records] == [4, 8]  # 2 processes x 2 completions a step
    assert result.stdout.count("step 1 ") == 1  # one process prints
