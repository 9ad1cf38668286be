"""posttrain PPO (critic) on exactly the settings of the TRL reference run (shared/bench/run_ppo.py + common.py).

Same artifacts (~/.cache/posttrain-bench/artifacts: policy-<SIZE>, reward-<SIZE>, prompts), same knobs
by environment: SIZE [14m] EPISODES [512] BATCH [16] RESP_LEN [53] PPO_EPOCHS [1] LR [3e-6] SEED [42]
TEMP [1.0] BF16 [0] THREADS [2]. As in TRL's script: per_device_train_batch_size = BATCH, gradient
accumulation 1, 1 minibatch, local_rollout_forward_batch_size = BATCH, no sample tables, no
checkpoints, the reference a second copy of the policy and the value model initialised from the
reward model. The timed span is `trainer.train()`, which here includes saving the final policy
and critic (TRL's reference run saves nothing). Writes <RUNS>/ppo-<SIZE>-posttrain/result.json and
prints RESULT_DIR / RESULT lines like the TRL scripts, so benchmarks/run_ours.sh can add peak RSS.

    bash benchmarks/run_ours.sh ppo 14m          # or: python benchmarks/bench_ppo.py
"""

from __future__ import annotations

import harness
from harness import PPO_EPOCHS


def main() -> dict:
    from posttrain.trainers.ppo import PPOConfig, PPOTrainer

    art = harness.load_artifacts()
    out = harness.out_dir("ppo")
    config = PPOConfig(**harness.common_config(out), num_ppo_epochs=PPO_EPOCHS, value_model_init="reward")
    trainer = PPOTrainer(
        args=config,
        processing_class=art["tokenizer"],
        model=art["policy"](),
        ref_model=art["policy"](),
        reward_model=art["reward"](),
        train_dataset=art["train"],
        eval_dataset=art["test"],
    )
    return harness.timed(
        "ppo",
        out,
        lambda: harness.train_online(trainer),
        k=1,
        optimizer_steps=lambda: trainer.run.progress.optimizer_steps,
        mean_completion_len=lambda last: last.get("tokens/responses_len_mean"),
        first_log=lambda: trainer.state.log_history[0],
    )


if __name__ == "__main__":
    main()
