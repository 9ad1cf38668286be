"""posttrain RLOO and GRPO on exactly the settings of the TRL reference runs (shared/bench/run_rloo.py,
run_rloo_grpo.py, run_grpo.py + common.py).

Same artifacts (~/.cache/posttrain-bench/artifacts: policy-<SIZE>, reward-<SIZE>, prompts saved with
save_to_disk), same knobs by environment: SIZE [14m] EPISODES [512] BATCH [16 completions per step]
K [2] RESP_LEN [53] PPO_EPOCHS [1] LR [3e-6] SEED [42] TEMP [1.0] BF16 [0] THREADS [2]; TRAINER picks
the run:

  rloo       our RLOO vs TRL 0.19.1's classic RLOOTrainer: per_device_train_batch_size = BATCH,
             gradient accumulation 1, 1 minibatch, rloo_k = K, num_ppo_epochs = PPO_EPOCHS,
             local_rollout_forward_batch_size = BATCH, kl_coef 0.05 (both defaults), no sample tables.
  rloo_grpo  the same RLOO run, named for the comparison with TRL 1.x's GRPO-style RLOOTrainer
             (num_generations = K, beta 0.05 = our kl_coef, num_iterations = PPO_EPOCHS).
  grpo       our GRPO vs TRL 1.x's GRPOTrainer: BATCH completions per step = BATCH/K prompts × K,
             num_iterations = PPO_EPOCHS, beta 0.05 (a reference model, as the TRL run).

Both use the reward model as the reward, the reference a second copy of the policy, fp32 unless
BF16=1. Random-weight models rarely emit EOS, so completions run to RESP_LEN as TRL's do (classic
TRL always samples the full length); the mean completion length is reported. The timed span is
`trainer.train()`, which includes saving the final policy (TRL's reference runs save nothing).
Writes <RUNS>/<TRAINER>-<SIZE>-posttrain/result.json and prints RESULT_DIR / RESULT lines like the TRL
scripts, so benchmarks/run_ours.sh adds peak RSS (/usr/bin/time -v):

    bash benchmarks/run_ours.sh rloo 14m            # or: TRAINER=grpo python benchmarks/bench_rloo_grpo.py
"""

from __future__ import annotations

import os

import harness
from harness import PPO_EPOCHS, K


def main() -> dict:
    trainer_name = os.environ.get("TRAINER", "rloo")
    if trainer_name not in ("rloo", "rloo_grpo", "grpo"):
        raise SystemExit(f"TRAINER={trainer_name!r}: use rloo, rloo_grpo or grpo.")
    from posttrain.trainers.grpo import GRPOTrainer
    from posttrain.trainers.grpo_config import GRPOConfig
    from posttrain.trainers.rloo import RLOOTrainer
    from posttrain.trainers.rloo_config import RLOOConfig

    art = harness.load_artifacts()
    out = harness.out_dir(trainer_name)
    common = harness.common_config(out)
    if trainer_name == "grpo":
        config = GRPOConfig(**common, num_generations=K, num_iterations=PPO_EPOCHS, beta=0.05)
        trainer = GRPOTrainer(
            art["policy"](),
            art["reward"](),
            config,
            art["train"],
            art["test"],
            processing_class=art["tokenizer"],
            ref_model=art["policy"](),
        )
    else:
        config = RLOOConfig(**common, rloo_k=K, num_ppo_epochs=PPO_EPOCHS, kl_coef=0.05)
        trainer = RLOOTrainer(
            config,
            art["tokenizer"],
            art["policy"](),
            art["policy"](),
            art["reward"](),
            art["train"],
            eval_dataset=art["test"],
        )
    return harness.timed(
        trainer_name,
        out,
        lambda: harness.train_online(trainer),
        k=K,
        optimizer_steps=lambda: trainer.run.progress.optimizer_steps,
        mean_completion_len=lambda last: last.get("completions/mean_length"),
        first_log=lambda: trainer.state.log_history[0],
    )


if __name__ == "__main__":
    main()
