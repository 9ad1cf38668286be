"""Checkpoints under DeepSpeed ZeRO: every rank's engine saves and loads its own partition.

Under ZeRO-1/2/3 each rank's DeepSpeed optimizer holds only its partition of the optimizer state
and of the fp32 master weights, so a checkpoint is the engine's own collective `save_checkpoint`
on every rank (checkpoint-N/deepspeed/), read back by `load_checkpoint` on every rank. Two ranks
run here as two threads whose collectives meet at a barrier, with a stand-in engine that writes
DeepSpeed's file layout (CI does not install deepspeed); a save or load that skipped a rank would
leave the other waiting at the barrier and fail. With deepspeed installed, the last test runs the
real engine through the command line (one process, ZeRO-2 and ZeRO-3 on CPU).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from posttrain import checkpoint as ckpt
from posttrain import distributed as dist
from posttrain.checkpoint import CheckpointError, load_checkpoint, save_checkpoint


class Ranks:
    """`world` ranks of one run as threads: posttrain's collectives (broadcast_object,
    wait_for_everyone) and the stand-in engine's meet at one barrier."""

    def __init__(self, world: int) -> None:
        self.world, self.barrier, self.box = world, threading.Barrier(world, timeout=30), {}

    def broadcast(self, obj, accelerator, from_process=0):
        if accelerator.process_index == from_process:
            self.box["value"] = obj
        self.barrier.wait()
        value = self.box["value"]
        self.barrier.wait()  # nobody overwrites the box before every rank has read it
        return value

    def run(self, fn):
        """fn(rank) on every rank at once; the results by rank (the first error is raised)."""
        results, errors = [None] * self.world, []

        def body(rank):
            try:
                results[rank] = fn(rank)
            except BaseException as err:  # noqa: BLE001 - re-raised below, after the other ranks stop
                errors.append(err)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(rank,)) for rank in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


class ZeroOptimizer:
    """What a ZeRO optimizer holds on one rank: its slice of the flattened fp32 master weights and
    their Adam moments (`base` is the torch optimizer inside, as in DeepSpeed)."""

    def __init__(self, base: torch.optim.Optimizer, module: nn.Module, rank: int, world: int) -> None:
        self.optimizer, self.rank, self.world = base, rank, world
        trained = [p for p in module.parameters() if p.requires_grad]
        flat = torch.cat([p.detach().reshape(-1) for p in trained]).float()
        self.master = flat.chunk(world)[rank].clone()
        self.exp_avg, self.step = torch.zeros_like(self.master), 0

    def take_step(self, value: float) -> None:
        self.step += 1
        self.exp_avg += value
        self.master -= 0.1 * value


class Engine(nn.Module):
    """A stand-in DeepSpeed engine with DeepSpeed's checkpoint layout: `save_checkpoint` and
    `load_checkpoint` are collectives; each rank writes and reads its own
    zero_pp_rank_<rank>_mp_rank_00_optim_states.pt, rank 0 the module states and `latest`."""

    def __init__(self, module: nn.Module, ranks: Ranks, rank: int, stage: int = 2) -> None:
        super().__init__()
        self.module, self.ranks, self.rank, self.stage = module, ranks, rank, stage
        base = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
        self.optimizer = ZeroOptimizer(base, module, rank, ranks.world)
        self.saves, self.loads = [], []

    def zero_optimization_stage(self):
        return self.stage

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        self.saves.append({"save_dir": save_dir, "tag": tag, "exclude_frozen_parameters": exclude_frozen_parameters})
        self.ranks.barrier.wait()
        folder = Path(save_dir) / tag
        partition = {"master": self.optimizer.master, "exp_avg": self.optimizer.exp_avg, "step": self.optimizer.step}
        torch.save(partition, folder / f"zero_pp_rank_{self.rank}_mp_rank_00_optim_states.pt")
        if self.rank == 0:
            module = {
                k: v for k, v in self.module.named_parameters() if v.requires_grad or not exclude_frozen_parameters
            }
            torch.save({"module": module}, folder / "mp_rank_00_model_states.pt")
            (Path(save_dir) / "latest").write_text(tag)
        self.ranks.barrier.wait()

    def load_checkpoint(
        self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True, load_lr_scheduler_states=True
    ):
        self.loads.append(
            {
                "tag": tag,
                "strict": load_module_strict,
                "optimizer": load_optimizer_states,
                "scheduler": load_lr_scheduler_states,
            }
        )
        self.ranks.barrier.wait()
        folder = Path(load_dir) / tag
        saved_world = len(list(folder.glob("zero_pp_rank_*_optim_states.pt")))
        assert saved_world == self.ranks.world, "DeepSpeed refuses another data-parallel world size"
        module = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=True)["module"]
        self.module.load_state_dict(module, strict=load_module_strict)
        own = torch.load(folder / f"zero_pp_rank_{self.rank}_mp_rank_00_optim_states.pt", weights_only=True)
        self.optimizer.master, self.optimizer.exp_avg, self.optimizer.step = own["master"], own["exp_avg"], own["step"]
        self.ranks.barrier.wait()
        return str(folder), {}


class AcceleratedOptimizer:
    """accelerate's DeepSpeedOptimizerWrapper: what the trainers hold, around the engine's optimizer."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def accelerator(engine: Engine, stage: int = 2):
    ranks = engine.ranks
    return types.SimpleNamespace(
        state=types.SimpleNamespace(deepspeed_plugin=types.SimpleNamespace(zero_stage=stage, deepspeed_config={})),
        num_processes=ranks.world,
        process_index=engine.rank,
        is_main_process=engine.rank == 0,
        is_local_main_process=engine.rank == 0,
        device=torch.device("cpu"),
        _models=[engine],
        unwrap_model=lambda m: getattr(m, "module", m),
        get_state_dict=lambda m: dist.unwrap(m, None).state_dict(),
        wait_for_everyone=lambda: ranks.barrier.wait(),
    )


def model(seed: int) -> nn.Module:
    """A policy with a frozen first layer (a LoRA base, say) and a trained second one."""
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    module[0].requires_grad_(False)
    return module


def run_rank(ranks: Ranks, rank: int, seed: int):
    engine = Engine(model(seed), ranks, rank)
    optimizer = AcceleratedOptimizer(engine.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer.optimizer, lambda s: 1.0 / (1 + s))
    return engine, optimizer, scheduler, accelerator(engine)


@pytest.fixture
def two_ranks(monkeypatch):
    ranks = Ranks(2)
    monkeypatch.setattr(dist, "broadcast_object", ranks.broadcast)
    return ranks


def test_every_rank_saves_its_own_zero_partition_and_loads_it_back(tmp_path, two_ranks):
    def save(rank):
        engine, optimizer, scheduler, acc = run_rank(two_ranks, rank, seed=0)
        for value in (1.0, 2.0, 4.0):  # three steps; rank 1's partition differs from rank 0's
            engine.optimizer.take_step(value * (rank + 1))
            engine.optimizer.optimizer.step()  # no gradients: the base optimizer's step changes nothing
            scheduler.step()
        path = save_checkpoint(
            tmp_path,
            3,
            models={"policy": engine.module},
            optimizer=optimizer,
            scheduler=scheduler,
            trainer_state={"episode": 12},
            accelerator=acc,
            rank_state={"rank": torch.tensor(rank)},
        )
        partition = (engine.optimizer.master.clone(), engine.optimizer.exp_avg.clone(), engine.optimizer.step)
        return path, engine, partition, dict(engine.module.state_dict())

    saved = two_ranks.run(save)
    path = saved[0][0]
    assert saved[1][0] == path == tmp_path / "checkpoint-3"
    for _, engine, _, _ in saved:  # the collective save on every rank, frozen parameters left out
        [call] = engine.saves
        assert Path(call["save_dir"]).name == "deepspeed" and Path(call["save_dir"]).parent.parent == tmp_path
        assert call["tag"] == "global_step3" and call["exclude_frozen_parameters"] is True
    engine_dir = path / "deepspeed" / "global_step3"
    assert sorted(p.name for p in engine_dir.iterdir()) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert not (path / "optimizer.pt").exists() and not (path / "dcp").exists()
    marker = json.loads((path / "checkpoint_complete.json").read_text())
    assert marker["world_size"] == 2
    assert marker["deepspeed"] == {"zero_stage": 2, "tag": "global_step3", "exclude_frozen_parameters": True}
    # Rank 1's partition is on disk (a main-process-only save lost it): step 3, moments 2 + 4 + 8.
    rank1 = torch.load(engine_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt", weights_only=True)
    assert rank1["step"] == 3 and torch.equal(rank1["exp_avg"], torch.full_like(rank1["exp_avg"], 14.0))

    def resume(rank):
        engine, optimizer, scheduler, acc = run_rank(two_ranks, rank, seed=1)  # other weights, fresh state
        state = load_checkpoint(
            path, models={"policy": engine.module}, optimizer=optimizer, scheduler=scheduler, accelerator=acc
        )
        return engine, scheduler, state

    resumed = two_ranks.run(resume)
    for rank, (engine, scheduler, state) in enumerate(resumed):
        master, exp_avg, step = saved[rank][2]
        assert engine.loads == [{"tag": "global_step3", "strict": False, "optimizer": True, "scheduler": True}]
        assert step == engine.optimizer.step == 3
        assert torch.equal(engine.optimizer.master, master) and torch.equal(engine.optimizer.exp_avg, exp_avg)
        # The trained layer comes from the engine's module states; the frozen one is the run's own.
        assert torch.equal(engine.module[1].weight, saved[0][3]["1.weight"])
        assert not torch.equal(engine.module[0].weight, saved[0][3]["0.weight"])
        assert scheduler.last_epoch == 3 and state["episode"] == 12
        assert torch.equal(state["rank_state"]["rank"], torch.tensor(rank))
    # Each rank got its own partition back: ranks 0 and 1 hold different moments (7 and 14).
    assert resumed[0][0].optimizer.exp_avg[0] == 7.0 and resumed[1][0].optimizer.exp_avg[0] == 14.0


def deepspeed_marker(path: Path, *, world: int, stage: int | None) -> None:
    """Mark a checkpoint as saved by `world` processes, under DeepSpeed ZeRO-`stage` (None: without)."""
    marker = {"step": 1, "models": ["policy"], "world_size": world}
    if stage is not None:
        marker["deepspeed"] = {"zero_stage": stage, "tag": "global_step1", "exclude_frozen_parameters": False}
    (path / "checkpoint_complete.json").write_text(json.dumps(marker))


def one_rank(stage: int, world: int = 1):
    ranks = Ranks(1)
    engine = Engine(model(0), ranks, 0, stage)
    acc = accelerator(engine, stage)
    acc.num_processes = world
    return engine, AcceleratedOptimizer(engine.optimizer), acc


def test_a_deepspeed_checkpoint_resumes_only_at_the_stage_and_world_size_that_saved_it(tmp_path):
    path = tmp_path / "checkpoint-1"
    path.mkdir()
    deepspeed_marker(path, world=2, stage=2)
    for stage, world, this in (
        (2, 1, "1 process(es) under DeepSpeed ZeRO-2"),
        (3, 2, "2 process(es) under DeepSpeed ZeRO-3"),
    ):
        engine, optimizer, acc = one_rank(stage, world)
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(path, models={"policy": engine.module}, optimizer=optimizer, accelerator=acc)
        message = str(err.value)
        assert f"was saved under DeepSpeed ZeRO-2 by 2 process(es); this run has {this}." in message
        assert "Resume under ZeRO-2 with 2 process(es)" in message
        assert f"--model_name_or_path {path / 'policy'}" in message and "zero_to_fp32.py" in message
        assert engine.loads == []  # refused before anything is loaded
    with pytest.raises(
        CheckpointError, match=r"ZeRO-2 by 2 process\(es\); this run has 1 process\(es\) without DeepSpeed\."
    ):
        ckpt.check_resume_deepspeed(path, None)
    # The stage and world size that saved it pass the check.
    engine, _, acc = one_rank(2, 2)
    ckpt.check_resume_deepspeed(path, acc)
    ckpt.check_resume_deepspeed(None, acc)  # no resume


def test_a_checkpoint_saved_without_deepspeed_is_refused_under_it(tmp_path):
    policy = model(0)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    path = save_checkpoint(tmp_path, 1, models={"policy": policy}, optimizer=optimizer)
    engine, wrapped, acc = one_rank(2)
    with pytest.raises(
        CheckpointError, match=r"holds no DeepSpeed engine state: its optimizer state is in torch\.distributed"
    ):
        load_checkpoint(path, models={"policy": engine.module}, optimizer=wrapped, accelerator=acc)
    shutil.rmtree(path / "dcp")
    with pytest.raises(CheckpointError, match="optimizer.pt, an older posttrain's layout") as err:
        ckpt.check_resume_deepspeed(path, acc)
    assert "Resume without --deepspeed, or start a new run from its weights" in str(err.value)
    assert engine.loads == []


class LossScaler:
    """Stands for the DeepSpeed objects an older posttrain pickled into optimizer.pt."""


def test_older_checkpoints_with_optimizer_pt_still_load(tmp_path):
    """Before dcp/, the optimizer state was a plain torch state dict in optimizer.pt: it still loads.
    One that an older posttrain wrote under DeepSpeed (DeepSpeed objects, rank 0's partition only)
    is refused with the fix."""
    policy = model(0)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    policy(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    path = save_checkpoint(tmp_path, 1, models={"policy": policy}, optimizer=optimizer)
    shutil.rmtree(path / "dcp")
    (path / "optimizer_groups.pt").unlink()
    torch.save(optimizer.state_dict(), path / "optimizer.pt")
    deepspeed_marker(path, world=1, stage=None)
    fresh = model(1)
    fresh_optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    load_checkpoint(path, models={"policy": fresh}, optimizer=fresh_optimizer)
    assert torch.equal(fresh[1].weight, policy[1].weight)
    saved, loaded = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys() == {0, 1}
    assert all(torch.equal(saved[k]["exp_avg"], loaded[k]["exp_avg"]) for k in saved)

    torch.save({"loss_scaler": LossScaler(), "base_optimizer_state": {}}, path / "optimizer.pt")
    with pytest.raises(CheckpointError, match="holds objects other than tensors") as err:
        load_checkpoint(path, models={"policy": fresh}, optimizer=fresh_optimizer)
    assert f"start a new run from its weights (--model_name_or_path {path / 'policy'}" in str(err.value)


def test_the_trainers_refuse_a_deepspeed_checkpoint_before_any_step(tmp_path, tiny_tokenizer):
    """A run without DeepSpeed resuming a DeepSpeed checkpoint stops at construction, before a step."""
    from helpers import online_trainer

    path = tmp_path / "run" / "checkpoint-1"
    path.mkdir(parents=True)
    deepspeed_marker(path, world=1, stage=3)
    with pytest.raises(
        CheckpointError,
        match=r"saved under DeepSpeed ZeRO-3 by 1 process\(es\); this run has 1 process\(es\) without DeepSpeed",
    ):
        online_trainer("grpo", tmp_path / "run", tiny_tokenizer, resume_from_checkpoint=str(path))


# -- the real engine (deepspeed installed): one process on CPU, through the command line -------------


def _torchrun(argv: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "posttrain"]
    return subprocess.run([*launcher, *argv], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.multiproc
@pytest.mark.parametrize("stage", [2, 3])
def test_real_zero_checkpoint_resumes_the_saved_optimizer_state(stage, tmp_path):
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    from posttrain.testing import build_tiny_causal_lm, build_tiny_tokenizer

    build_tiny_causal_lm(build_tiny_tokenizer(), save_dir=tmp_path / "policy")
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": f"Line {i} says hi."}) + "\n" for i in range(8)))
    zero = {"stage": stage, **({"stage3_gather_16bit_weights_on_model_save": True} if stage == 3 else {})}
    ds = {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto"}
    (tmp_path / "ds.json").write_text(json.dumps({**ds, "gradient_accumulation_steps": "auto"}))

    def sft(out: Path, *extra: str) -> None:
        args = ["sft", "--model_name_or_path", str(tmp_path / "policy"), "--dataset_name", str(tmp_path / "text.jsonl")]
        args += ["--per_device_train_batch_size", "2", "--max_steps", "3", "--save_steps", "1", "--report_to", "none"]
        done = _torchrun([*args, "--output_dir", str(out), "--deepspeed", str(tmp_path / "ds.json"), *extra])
        assert done.returncode == 0, done.stderr[-3000:]

    sft(tmp_path / "straight")  # 3 steps, checkpoints 1 and 2
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "straight" / "checkpoint-1", tmp_path / "resumed" / "checkpoint-1")
    sft(tmp_path / "resumed", "--resume_from_checkpoint", "latest")  # steps 2 and 3 from checkpoint-1
    straight, resumed = (load_file(tmp_path / r / "model.safetensors") for r in ("straight", "resumed"))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)

    def adam(run: str) -> dict:
        [file] = (tmp_path / run / "checkpoint-2" / "deepspeed" / "global_step2").glob("*optim_states.pt")
        state = torch.load(file, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        return (state.get("base_optimizer_state") or state["optimizer_state_dict"])["state"]

    a, b = adam("straight"), adam("resumed")
    # Step 2 in both: the resumed run continued from the saved step 1, not from a fresh optimizer.
    assert a[0]["step"].item() == b[0]["step"].item() == 2
    assert all(torch.equal(a[0][k], b[0][k]) for k in ("exp_avg", "exp_avg_sq"))
