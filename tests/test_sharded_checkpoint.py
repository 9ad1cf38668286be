"""Sharded checkpoints (checkpoint-N/dcp, torch.distributed.checkpoint) and resuming at another world size.

- FSDP2: a model sharded with `fully_shard` over 2 processes (gloo, CPU) saves its weights and AdamW
  state; each rank writes only its own half of every sharded tensor; a fresh sharded model resumes and
  takes the next step bitwise like the original; the same checkpoint loads into one plain process.
- The command line under DDP: SFT saved by `torchrun --nproc_per_node 2` resumes with 1 process (and
  1 -> 2), ending within 1e-6 of the uninterrupted run; RLOO saved by 2 processes resumes with 1.
- Bad input: a checkpoint of a differently shaped model, a changed global batch, a world size that does
  not divide the global batch: one error naming both sides, before any step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

import helpers
from helpers import CLI_PROMPTS, run_processes
from posttrain import checkpoint as ckpt
from posttrain.configs import ConfigError

SCRIPT = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, sys.argv[2])
    from test_sharded_checkpoint import fsdp_save_and_resume
    fsdp_save_and_resume(sys.argv[1])
    from posttrain.distributed import shutdown
    shutdown()
""")


def tiny_lm(seed: int, intermediate_size: int = 32):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=intermediate_size,
    )
    return transformers.LlamaForCausalLM(config)


def train_step(model, optimizer, rank: int, step: int) -> None:
    ids = torch.Generator().manual_seed(1000 * step + rank)
    batch = torch.randint(0, 64, (2, 6), generator=ids)
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def sharded(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    model = tiny_lm(seed)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def local(model, optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards of the weights and of AdamW's moments, by parameter name."""
    out = {name: p.to_local().detach().clone() for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}/{key}"] = optimizer.state[p][key].to_local().clone()
    return out


def fsdp_save_and_resume(out_dir: str) -> None:
    """Run under torchrun with 2 processes: train 2 steps, save, resume into a fresh sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from posttrain.distributed import build_accelerator

    accelerator = build_accelerator(cpu=True)
    rank = accelerator.process_index
    assert accelerator.num_processes == 2, "the launcher did not start a real 2-process group"
    model, optimizer = sharded(seed=0)
    for step in range(2):
        train_step(model, optimizer, rank, step)
    path = ckpt.save_checkpoint(
        out_dir, 2, models={"policy": model}, optimizer=optimizer, accelerator=accelerator, trainer_state={"x": 1}
    )
    saved = local(model, optimizer)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    train_step(model, optimizer, rank, 2)
    after = local(model, optimizer)

    fresh, fresh_optimizer = sharded(seed=1)
    state = ckpt.load_checkpoint(path, models={"policy": fresh}, optimizer=fresh_optimizer, accelerator=accelerator)
    loaded = local(fresh, fresh_optimizer)
    train_step(fresh, fresh_optimizer, rank, 2)
    resumed = local(fresh, fresh_optimizer)
    torch.save(
        {
            "loaded_equal": all(torch.equal(saved[k], loaded[k]) for k in saved),
            "next_step_equal": all(torch.equal(after[k], resumed[k]) for k in after),
            "keys": sorted(saved),
            "state": state["x"],
            "full": full,
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


@pytest.mark.multiproc
def test_fsdp2_sharded_model_and_optimizer_save_and_resume(tmp_path):
    from safetensors.torch import load_file

    script = tmp_path / "fsdp.py"
    script.write_text(SCRIPT)
    run_processes([str(script), str(tmp_path), str(Path(__file__).parent)], check=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for r in ranks:
        assert r["keys"] and r["state"] == 1
        assert r["loaded_equal"], "a fresh sharded model did not get back its shards"
        assert r["next_step_equal"], "the step after the resume differs from the uninterrupted one"

    path = tmp_path / "checkpoint-2"
    # Each rank wrote only its own half of every sharded tensor: gate_proj (32 x 16) is stored as
    # rows 0-15 in rank 0's file and rows 16-31 in rank 1's.
    metadata = ckpt._read_dcp_metadata(path / ckpt.DCP_DIR)
    assert sorted(p.name for p in (path / ckpt.DCP_DIR).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for key in ("model/policy.model.layers.0.mlp.gate_proj.weight", "optimizer/policy.lm_head.weight/exp_avg"):
        chunks = metadata.state_dict_metadata[key].chunks
        assert [tuple(c.offsets) for c in chunks] in ([(0, 0), (32, 0)], [(0, 0), (16, 0)])
        files = {info.relative_path for index, info in metadata.storage_data.items() if index.fqn == key}
        assert files == {"__0_0.distcp", "__1_0.distcp"}, files
    sizes = [(path / ckpt.DCP_DIR / f"__{r}_0.distcp").stat().st_size for r in range(2)]
    assert min(sizes) > 0.3 * sum(sizes), sizes  # neither rank wrote (nearly) everything

    # The model folder is the full model (gathered), under the model's own class name.
    full = ranks[0]["full"]
    folder = load_file(path / "policy" / "model.safetensors")
    assert all(torch.equal(folder[k], full[k]) for k in folder) and set(folder) <= set(full)
    assert json.loads((path / "policy" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    # Saved by 2 processes, resumed by 1 plain process: DCP reassembles the shards.
    plain = tiny_lm(seed=5)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    ckpt.load_checkpoint(path, models={"policy": plain}, optimizer=optimizer, restore_rng=False)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, full[name]), name
    assert int(optimizer.state[plain.lm_head.weight]["step"]) == 2

    # A checkpoint of a differently shaped model: one error naming the parameter and both shapes.
    wider = tiny_lm(seed=5, intermediate_size=48)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load_checkpoint(path, models={"policy": wider}, optimizer=torch.optim.AdamW(wider.parameters()))
    message = str(err.value)
    assert "policy.model.layers.0.mlp.gate_proj.weight: shape [32, 16] in the checkpoint, [48, 16] in the model" in (
        message
    )
    assert "same model architecture" in message


# ---------------------------------------------------------------------------------------------
# The command line under DDP


def launch(nproc: int, argv: list[str]) -> subprocess.CompletedProcess:
    proc = helpers.launch(argv, nproc, check=True)
    assert "Traceback" not in proc.stderr
    return proc


def sft(root: Path, out: Path, accumulation: int, *extra: str) -> list[str]:
    return [
        "sft",
        "--model_name_or_path",
        str(root / "policy"),
        "--dataset_name",
        str(root / "text.jsonl"),
        "--output_dir",
        str(out),
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        str(accumulation),
        "--max_steps",
        "4",
        "--save_steps",
        "2",
        "--learning_rate",
        "1e-2",
        "--logging_steps",
        "1",
        "--report_to",
        "none",
        *extra,
    ]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors")


def resume_copy(run: Path, step: int, into: Path) -> None:
    into.mkdir()
    shutil.copytree(run / f"checkpoint-{step}", into / f"checkpoint-{step}")


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    print(f"largest difference to the uninterrupted run: {worst:.3g}")
    assert worst <= 1e-6, worst


@pytest.mark.multiproc
def test_sft_resumes_at_another_world_size_like_the_uninterrupted_run(cli_files, tmp_path):
    """Global batch 4 = 2 per device x 2 processes x 1 = 2 per device x 1 process x 2 accumulation.
    Compared: every tensor of the final model.safetensors, within 1e-6 (the gradient sums run in another order)."""
    two, one = tmp_path / "two", tmp_path / "one"
    launch(2, sft(cli_files, two, accumulation=1))
    world = json.loads((two / "checkpoint-2" / ckpt.COMPLETE_MARKER).read_text())
    assert world["world_size"] == 2 and world["batch"] == {"global batch": 4}
    assert sorted(p.name for p in (two / "checkpoint-2" / ckpt.DCP_DIR).glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    launch(1, sft(cli_files, one, accumulation=2))

    two_to_one, one_to_two = tmp_path / "two_to_one", tmp_path / "one_to_two"
    resume_copy(two, 2, two_to_one)
    resumed = launch(1, sft(cli_files, two_to_one, 2, "--resume_from_checkpoint", "latest"))
    assert "at step 2/4" in resumed.stdout
    resume_copy(one, 2, one_to_two)
    launch(2, sft(cli_files, one_to_two, 1, "--resume_from_checkpoint", "latest"))

    assert_close(final_weights(two_to_one), final_weights(two))
    assert_close(final_weights(one_to_two), final_weights(one))


@pytest.mark.multiproc
def test_rloo_saved_by_two_processes_resumes_with_one(cli_files, tmp_path):
    out = tmp_path / "rloo"
    common = ["--model_name_or_path", str(cli_files / "policy"), "--reward_model_path", str(cli_files / "rm")]
    common += ["--dataset_name", str(cli_files / "prompts.jsonl"), "--rloo_k", "2", "--response_length", "4"]
    common += ["--per_device_train_batch_size", "2", "--num_ppo_epochs", "1", "--max_steps", "2"]
    common += ["--save_steps", "1", "--logging_steps", "1", "--report_to", "none"]
    launch(2, ["rloo", *common, "--output_dir", str(out)])
    assert (out / "checkpoint-1" / "rng_state_1.pt").is_file()
    resumed_dir = tmp_path / "resumed"
    resume_copy(out, 1, resumed_dir)
    resumed = launch(
        1,
        ["rloo", *common, "--output_dir", str(resumed_dir), "--gradient_accumulation_steps", "2"]
        + ["--resume_from_checkpoint", "latest"],
    )
    assert "at rollout batch 1" in resumed.stdout
    rows = [json.loads(line) for line in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "objective/rlhf_reward" in r] == [2]
    assert (resumed_dir / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------
# The global batch on resume


def test_a_changed_global_batch_is_refused_before_any_step(tmp_path):
    from datasets import Dataset

    from posttrain.testing import build_tiny_causal_lm, build_tiny_tokenizer
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    # A checkpoint as 2 processes with 2 per device and no accumulation write it: global batch 4.
    path = ckpt.save_checkpoint(tmp_path, 2, models={"v": torch.nn.Linear(2, 1)}, batch={"global batch": 4})
    marker = json.loads((path / ckpt.COMPLETE_MARKER).read_text())
    marker["world_size"] = 2
    (path / ckpt.COMPLETE_MARKER).write_text(json.dumps(marker))

    tok = build_tiny_tokenizer()
    data = Dataset.from_dict({"text": [p + " something nice." for p in CLI_PROMPTS]})
    config = SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=4, resume_from_checkpoint="latest"
    )
    config.report_to = "none"
    with pytest.raises(ConfigError) as err:
        SFTTrainer(build_tiny_causal_lm(tok), args=config, train_dataset=data, processing_class=tok)
    message = str(err.value)
    assert "saved by 2 process(es) with a global batch of 4" in message
    assert "this run (1 process(es), gradient_accumulation_steps 1) has 2" in message
    assert message.endswith("pass --gradient_accumulation_steps 2.")

    # 3 processes cannot make a global batch of 4 from whole per-device batches.
    with pytest.raises(ConfigError, match="4 is not divisible by 3 processes") as err:
        ckpt.check_resume_batch(path, world_size=3, sizes={"global batch": 6}, accumulation=1)
    assert "global batch of 4" in str(err.value) and "has 6" in str(err.value)
    # The same global batch passes.
    ckpt.check_resume_batch(path, world_size=1, sizes={"global batch": 4}, accumulation=2)
