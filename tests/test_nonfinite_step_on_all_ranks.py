"""The one non-finite policy of the online trainers, on 2 processes (gloo, CPU).

Rank 1's policy produces NaN logits in every gradient-enabled forward of the FIRST rollout batch
(rollouts, reference and old log-probs run without gradients and stay finite), so only rank 1's loss
is NaN at the first optimizer step. The ranks must agree: both skip that step (each counts one
non-finite loss and drops its gradients), both take the step of the second rollout batch, and the
parameters stay identical on both ranks. Deciding per rank would let rank 0 step on gradients
that DDP averaged with rank 1's NaNs (NaN weights), or leave the ranks with different weights.
One script runs all five trainers to pay the process start-up once.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import count_e, flat, run_processes

ALGOS = ("rloo", "grpo", "ppo", "online_dpo", "xpo")

SCRIPT = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, sys.argv[2])
    from test_nonfinite_step_on_all_ranks import run_all
    run_all(sys.argv[1])
    from posttrain.distributed import shutdown
    shutdown()
""")

PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time", "Thank you very much"]


def build(algo: str, out: str):
    """A 2-update run of `algo` on a tiny policy (one optimizer step per update; PPO two, one per epoch)."""
    from datasets import Dataset

    from posttrain.testing import build_tiny_causal_lm, build_tiny_tokenizer
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
    from posttrain.trainers.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
    from posttrain.trainers.ppo import PPOConfig, PPOTrainer
    from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer
    from posttrain.trainers.xpo import XPOConfig, XPOTrainer

    tok = build_tiny_tokenizer()
    policy = build_tiny_causal_lm(tok)
    data = Dataset.from_dict({"prompt": PROMPTS * 2})
    common = dict(
        output_dir=out,
        per_device_train_batch_size=2,
        total_episodes=8,
        response_length=4,
        learning_rate=1e-2,
        report_to="none",
        num_sample_generations=0,
        save_steps=0,
        logging_steps=1,
        seed=11,
    )
    if algo == "rloo":
        cfg = RLOOConfig(**common, rloo_k=2, num_ppo_epochs=1, kl_coef=0.05)
        return RLOOTrainer(cfg, tok, policy, None, count_e, data), policy
    if algo == "grpo":
        cfg = GRPOConfig(**common, num_generations=2, beta=0.05)
        return GRPOTrainer(policy, count_e, cfg, data, processing_class=tok), policy
    if algo == "ppo":
        cfg = PPOConfig(**common, num_ppo_epochs=2, value_model_init="policy")
        return PPOTrainer(
            args=cfg, processing_class=tok, model=policy, reward_model=count_e, train_dataset=data
        ), policy
    # Online DPO / XPO count per_device_train_batch_size in prompts (2 completions each), as TRL.
    pairs = {**common, "per_device_train_batch_size": 1}
    if algo == "online_dpo":
        cfg = OnlineDPOConfig(**pairs)
        return OnlineDPOTrainer(
            policy, reward_funcs=count_e, args=cfg, processing_class=tok, train_dataset=data
        ), policy
    cfg = XPOConfig(**pairs)
    return XPOTrainer(policy, reward_model=count_e, args=cfg, processing_class=tok, train_dataset=data), policy


def run_all(out_dir: str) -> None:
    import tempfile

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = {}
    for algo in ALGOS:
        trainer, policy = build(algo, tempfile.mkdtemp())
        assert trainer.run.world_size == 2 == world, "the launcher did not start a real 2-process group"
        initial = flat(policy)

        def nan_in_first_update(module, inputs, output, trainer=trainer):
            if rank == 1 and torch.is_grad_enabled() and trainer.run.progress.update == 0:
                return output * float("nan")
            return None

        policy.get_output_embeddings().register_forward_hook(nan_in_first_update)
        trainer.train()
        results[algo] = {
            "initial": initial,
            "params": flat(policy),
            "nonfinite": trainer.run.health.nonfinite_total,
            "steps": trainer.run.progress.optimizer_steps,
        }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.multiproc
def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    script = tmp_path / "nonfinite.py"
    script.write_text(SCRIPT)
    run_processes([str(script), str(tmp_path), str(Path(__file__).parent)], timeout=400, check=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for algo in ALGOS:
        zero, one = ranks[0][algo], ranks[1][algo]
        steps_per_update = 2 if algo == "ppo" else 1  # PPO: num_ppo_epochs = 2
        # The first update's steps are skipped on BOTH ranks (rank 0's own loss was finite) ...
        assert zero["nonfinite"] == one["nonfinite"] == steps_per_update, algo
        # ... and the second update's steps are taken on both.
        assert zero["steps"] == one["steps"] == steps_per_update, algo
        assert torch.isfinite(zero["params"]).all(), algo
        assert not torch.equal(zero["params"], zero["initial"]), algo
        assert torch.equal(zero["params"], one["params"]), algo
