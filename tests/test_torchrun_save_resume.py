"""Every trainer started the way multi-GPU users start it: `torchrun --nproc_per_node 2 -m posttrain
<command> ... --save_steps 1` (gloo on CPU), saving a checkpoint at every step, then the same command
continued with `--resume_from_checkpoint latest` and a larger budget.

A checkpoint is a collective: each rank writes only its own files, all ranks meet at one barrier,
and rank 0 alone renames the temp folder. A rank that wrote into the temp folder after rank 0 had
renamed it ("Parent directory ... does not exist") crashed every such run at its first save, which
in-process tests never see.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROMPTS = [f"Prompt number {i} says" for i in range(16)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from posttrain.testing import build_tiny_causal_lm, build_tiny_reward_model, build_tiny_tokenizer

    root = tmp_path_factory.mktemp("torchrun")
    tok = build_tiny_tokenizer()
    build_tiny_causal_lm(tok, save_dir=root / "policy")
    build_tiny_reward_model(tok, save_dir=root / "rm")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (root / "text.jsonl").write_text("".join(json.dumps({"text": p + " something nice."}) + "\n" for p in PROMPTS))
    pairs = [{"chosen": p + " good.", "rejected": p + " bad bad."} for p in PROMPTS]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    return root


def command(name: str, root: Path, out: Path, steps: int) -> list[str]:
    """The command line of `name`, running `steps` optimizer steps (one per rollout batch online)."""
    if name in ("sft", "reward"):
        data = "text.jsonl" if name == "sft" else "pairs.jsonl"
        model = "policy" if name == "sft" else "rm"
        args = ["--dataset_name", str(root / data), "--model_name_or_path", str(root / model)]
        args += ["--per_device_train_batch_size", "2", "--max_steps", str(steps)]
    else:
        args = ["--dataset_name", str(root / "prompts.jsonl"), "--model_name_or_path", str(root / "policy")]
        args += ["--reward_model_path", str(root / "rm"), "--response_length", "4"]
        args += ["--per_device_train_batch_size", "2", "--max_steps", str(steps)]
        if name == "rloo":
            args += ["--rloo_k", "2", "--num_ppo_epochs", "1"]
        if name == "grpo":
            args += ["--num_generations", "2"]
        if name == "ppo":
            args += ["--num_ppo_epochs", "1"]
    return [name, *args, "--output_dir", str(out), "--save_steps", "1", "--logging_steps", "1", "--report_to", "none"]


def torchrun(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "posttrain"]
    return subprocess.run([*launcher, *argv], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["rloo", "ppo", "grpo", "online-dpo", "xpo", "sft", "reward"])
def test_save_every_step_then_resume_under_torchrun(files, tmp_path, name):
    out = tmp_path / "out"
    first = torchrun(command(name, files, out, steps=2))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Traceback" not in first.stderr
    # checkpoint-1 mid-run; the last step ends with the final save instead
    assert (out / "checkpoint-1" / "checkpoint_complete.json").is_file()
    assert not list(out.glob(".tmp*")), "a temp checkpoint folder was left behind"
    assert (out / "config.json").is_file()

    resumed = torchrun(command(name, files, out, steps=3) + ["--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    assert (out / "checkpoint-2" / "checkpoint_complete.json").is_file()  # resumed at step 1, saved step 2
    steps = [json.loads(line).get("step") for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 3
