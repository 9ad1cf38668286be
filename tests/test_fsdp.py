"""FSDP2 on CPU processes (gloo): `--fsdp "full_shard auto_wrap"` shards the policy, critic, reference
and reward models with PyTorch's fully_shard (accelerate shards only on GPUs), and the sharded update
equals the 1-process update with the same global batch.

One torchrun launch trains RLOO, PPO (separate critic), GRPO, XPO, SFT and reward in turn under --fsdp,
recording each rank's local share of every parameter; one plain process trains the same unsharded with the
same global batch (gradient accumulation 2 instead of 2 ranks). The final models are compared as saved
(plain safetensors folders read back with transformers). A second launch is the command line a user
types: `torchrun --nproc_per_node 2 -m posttrain rloo ... --fsdp "full_shard auto_wrap"`.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import checkpoint_steps, launch, letter_fraction, read_metrics, run_processes
from posttrain.configs import ConfigError

ALGOS = ("rloo", "ppo", "grpo", "xpo", "sft", "reward")

SCRIPT = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, sys.argv[2])
    from test_fsdp import fsdp_run
    fsdp_run(sys.argv[1])
    from posttrain.distributed import shutdown
    shutdown()
    # the threads left for interpreter teardown (tests the process-exit note in docs/internals.md)
    import json, os, pathlib
    names = [pathlib.Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    rank = os.environ.get("RANK", "0")
    (pathlib.Path(sys.argv[1]) / f"threads-{rank}.json").write_text(json.dumps(sorted(names)))
""")


def local_shares(models: dict) -> dict:
    """{model: {parameter: (numel held by this rank, full numel, rows)}}."""
    out = {}
    for name, model in models.items():
        shares = {}
        for key, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            shares[key] = (local.numel(), p.numel(), p.shape[0] if p.dim() else 1)
        out[name] = shares
    return out


def build(algo: str, out: str, world: int):
    from datasets import Dataset

    from posttrain.testing import build_tiny_causal_lm, build_tiny_reward_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    prompts = Dataset.from_dict({"prompt": [f"Prompt number {i} says" for i in range(16)]})
    common = dict(
        output_dir=out,
        gradient_accumulation_steps=2 // world,
        learning_rate=1e-3,
        max_grad_norm=0.05,  # small enough that clipping acts: the sharded global norm is compared too
        report_to="none",
        num_sample_generations=0,
        save_steps=0,
        temperature=1.0,
        seed=7,
        fsdp="full_shard auto_wrap" if world > 1 else "",
    )
    policy, ref = build_tiny_causal_lm(tok), build_tiny_causal_lm(tok, seed=3)
    rm = build_tiny_reward_model(tok, seed=5)
    if algo == "rloo":
        from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

        cfg = RLOOConfig(
            **common, per_device_train_batch_size=4, total_episodes=8, response_length=6, rloo_k=2, kl_coef=0.1
        )
        trainer = RLOOTrainer(cfg, tok, policy, ref, rm, prompts)
        return trainer, {"policy": trainer.wrapped, "ref": trainer.ref_model, "reward": rm}
    if algo == "ppo":
        from posttrain.trainers.ppo import PPOConfig, PPOTrainer

        cfg = PPOConfig(
            **common,
            per_device_train_batch_size=4,
            total_episodes=8,
            response_length=6,
            num_ppo_epochs=2,
            value_model_init="policy",
        )
        trainer = PPOTrainer(
            args=cfg, processing_class=tok, model=policy, ref_model=ref, reward_model=rm, train_dataset=prompts
        )
        return trainer, {"policy": trainer.wrapped, "ref": trainer.ref_model, "reward": rm}
    if algo == "grpo":
        from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

        cfg = GRPOConfig(
            **common,
            per_device_train_batch_size=4,
            total_episodes=8,
            response_length=6,
            num_generations=2,
            num_iterations=2,
            beta=0.1,
        )
        trainer = GRPOTrainer(policy, [rm, letter_fraction], cfg, prompts, processing_class=tok, ref_model=ref)
        return trainer, {"policy": trainer.wrapped, "ref": trainer.ref_model, "reward": rm}
    if algo in ("sft", "reward"):
        from posttrain.trainers.reward import RewardConfig, RewardTrainer
        from posttrain.trainers.sft import SFTConfig, SFTTrainer

        texts = [f"Prompt number {i} says" + " something nice" * (i % 3) for i in range(8)]
        data = Dataset.from_dict(
            {"text": texts}
            if algo == "sft"
            else {"chosen": [t + " good." for t in texts], "rejected": [t + " bad bad." for t in texts]}
        )
        del common["num_sample_generations"], common["temperature"]
        common.update(per_device_train_batch_size=2, max_steps=2)
        if algo == "sft":
            trainer = SFTTrainer(policy, SFTConfig(**common), train_dataset=data, processing_class=tok)
        else:
            trainer = RewardTrainer(rm, RewardConfig(**common), train_dataset=data, processing_class=tok)
        return trainer, {"policy": trainer.model}
    from posttrain.trainers.xpo import XPOConfig, XPOTrainer

    cfg = XPOConfig(**common, per_device_train_batch_size=2, total_episodes=8, max_new_tokens=6)
    trainer = XPOTrainer(
        policy, ref_model=ref, reward_model=[rm], args=cfg, processing_class=tok, train_dataset=prompts
    )
    return trainer, {"policy": trainer.wrapped, "ref": trainer.ref_model, "reward": rm}


def fsdp_run(out_dir: str) -> None:
    """Train the four trainers in turn (sharded when launched with 2 processes); rank 0 writes run.json."""
    import posttrain.trainers.online as online
    from helpers import per_row_generate

    # Each rank samples from its own stream: make a row's tokens depend only on its prompt (as test_rloo).
    online.generate = per_row_generate
    world = int(os.environ.get("WORLD_SIZE", "1"))
    report = {}
    for algo in ALGOS:
        trainer, models = build(algo, os.path.join(out_dir, algo), world)
        shares = local_shares(models)
        if world > 1:
            everyone = [None] * world
            torch.distributed.all_gather_object(everyone, shares)
            shares = everyone
        report[algo] = {"world": trainer.accelerator.num_processes, "shares": shares}
        trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out_dir, "run.json").write_text(json.dumps(report))


def saved_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.multiproc
def test_fsdp_two_cpu_processes_equal_one_process(tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    script = tmp_path / "fsdp_run.py"
    script.write_text(SCRIPT)
    here = str(Path(__file__).parent)
    one, two = tmp_path / "one", tmp_path / "two"
    run_processes([str(script), str(one), here], nproc=1, check=True)
    run_processes([str(script), str(two), here], check=True)
    report = json.loads((two / "run.json").read_text())
    for rank in (0, 1):
        # shutdown() freed the process group: no gloo thread outlives it into interpreter teardown,
        # where one made a rank of a finished run abort (docs/internals.md, "Process exit")
        threads = json.loads((two / f"threads-{rank}.json").read_text())
        assert not [name for name in threads if "gloo" in name], threads
    for algo in ALGOS:
        assert report[algo]["world"] == 2
        rank0, rank1 = report[algo]["shares"]
        for model in rank0:
            assert rank0[model].keys() == rank1[model].keys()
            for key, (local0, full, rows) in rank0[model].items():
                local1 = rank1[model][key][0]
                # Shard(0): rank 0 holds ceil(rows / 2) rows, rank 1 the rest: about half of each parameter.
                assert local0 == -(-rows // 2) * (full // rows) and local0 + local1 == full, (algo, model, key)
        # the update moved the policy; 2 sharded ranks == 1 process with the same global batch
        a, b = saved_weights(one / algo), saved_weights(two / algo)
        assert a.keys() == b.keys()
        auto = AutoModelForSequenceClassification if algo == "reward" else AutoModelForCausalLM
        auto.from_pretrained(two / algo)  # a plain transformers folder
        start = _initial(algo)
        assert max(float((a[k] - start[k]).abs().max()) for k in a) > 1e-4, f"{algo} did not move the policy"
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5, msg=f"{algo} {key}")
    critic_one, critic_two = saved_weights(one / "ppo" / "value_model"), saved_weights(two / "ppo" / "value_model")
    for key in critic_one:
        torch.testing.assert_close(critic_two[key], critic_one[key], rtol=0, atol=1e-5, msg=f"critic {key}")
    AutoModelForSequenceClassification.from_pretrained(two / "ppo" / "value_model")


def _initial(algo: str) -> dict[str, torch.Tensor]:
    from posttrain.testing import build_tiny_causal_lm, build_tiny_reward_model, build_tiny_tokenizer

    if algo == "reward":
        return build_tiny_reward_model(build_tiny_tokenizer(), seed=5).state_dict()
    return build_tiny_causal_lm(build_tiny_tokenizer()).state_dict()


@pytest.mark.multiproc
def test_fsdp_command_line_under_torchrun(cli_files, tmp_path):
    """The command a user types; the final model is a plain transformers folder."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    argv = [
        "rloo",
        "--dataset_name",
        str(cli_files / "prompts.jsonl"),
        "--model_name_or_path",
        str(cli_files / "policy"),
    ]
    argv += ["--reward_model_path", str(cli_files / "rm"), "--response_length", "4", "--rloo_k", "2"]
    argv += ["--per_device_train_batch_size", "2", "--num_ppo_epochs", "1", "--output_dir", str(out)]
    argv += ["--logging_steps", "1", "--save_steps", "1", "--report_to", "none"]
    fsdp = ["--fsdp", "full_shard auto_wrap"]
    result = launch([*argv, *fsdp, "--max_steps", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    logs = read_metrics(out)
    # 2 ranks × 2 completions per rollout batch: 4 episodes a step (1 process would count 2)
    assert [entry["episode"] for entry in logs if "episode" in entry][:2] == [4, 8]
    trained = AutoModelForCausalLM.from_pretrained(out)
    start = AutoModelForCausalLM.from_pretrained(cli_files / "policy")
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), start.parameters()))
    assert (out / "checkpoint-1" / "dcp" / ".metadata").is_file()  # the last step ends with the final save

    # The sharded checkpoint-1 resumes sharded (2 processes: steps 2-3, checkpoint-2), and checkpoint-2
    # unsharded in one process (the same global batch of 4 completions in 2 accumulation steps: 3-4).
    resume = ["--resume_from_checkpoint", "latest"]
    result = launch([*argv, *fsdp, *resume, "--max_steps", "3"])
    assert result.returncode == 0, result.stderr[-3000:]
    result = launch([*argv, *resume, "--max_steps", "4", "--gradient_accumulation_steps", "2"], nproc=1)
    assert result.returncode == 0, result.stderr[-3000:]
    logs = read_metrics(out)
    assert [(entry["step"], entry["episode"]) for entry in logs if "episode" in entry][-2:] == [(3, 12), (4, 16)]
    assert checkpoint_steps(out) == [1, 2, 3]
    resumed = AutoModelForCausalLM.from_pretrained(out)
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), resumed.parameters()))


def test_units_are_layers_then_every_module_holding_parameters():
    from posttrain import distributed
    from posttrain.testing import build_tiny_causal_lm, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    plan = distributed.ShardingPlan()
    model = build_tiny_causal_lm(tok)
    names = {id(m): n for n, m in model.named_modules()}
    units = [names[id(m)] for m in distributed.shard_units(model, plan)]
    assert units == ["model.layers.0", "model.layers.1", "model.embed_tokens", "model.norm", "lm_head"]
    # Tied embeddings stay in the root's unit, so one weight lives in one unit.
    tied = build_tiny_causal_lm(tok, tie_word_embeddings=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    names = {id(m): n for n, m in tied.named_modules()}
    assert [names[id(m)] for m in distributed.shard_units(tied, plan)] == [
        "model.layers.0",
        "model.layers.1",
        "model.norm",
    ]
    # By size: the smallest modules of at least min_num_params parameters (embeddings 16384, an MLP
    # 3 × 4096, the LM head 16384; attention has 3072), then the other modules holding parameters.
    names = {id(m): n for n, m in model.named_modules()}
    sized = [names[id(m)] for m in distributed.shard_units(model, distributed.ShardingPlan(min_num_params=10_000))]
    assert sized[:4] == ["model.embed_tokens", "model.layers.0.mlp", "model.layers.1.mlp", "lm_head"]
    assert "model.layers.0.self_attn.q_proj" in sized and "model.layers.0" not in sized


def test_a_model_without_known_layers_is_a_config_error_naming_the_fix():
    from posttrain import distributed

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with pytest.raises(ConfigError, match=r"cannot shard Sequential.*transformer_layer_cls_to_wrap.*min_num_params"):
        distributed.shard_units(model, distributed.ShardingPlan())
    units = distributed.shard_units(model, distributed.ShardingPlan(layer_classes=("Linear",)))
    assert units == [model[0], model[2]]
