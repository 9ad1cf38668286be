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

import json
import os
import platform
import resource
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
from datasets import load_from_disk  # noqa: E402

import posttrain  # noqa: E402
from posttrain.models import load_policy, load_reward_model, load_tokenizer  # noqa: E402
from posttrain.trainers.grpo import GRPOTrainer  # noqa: E402
from posttrain.trainers.grpo_config import GRPOConfig  # noqa: E402
from posttrain.trainers.rloo import RLOOTrainer  # noqa: E402
from posttrain.trainers.rloo_config import RLOOConfig  # noqa: E402

ART = os.environ.get("ART", os.path.join(os.environ.get("POSTTRAIN_BENCH", os.path.expanduser("~/.cache/posttrain-bench")), "artifacts"))
TRAINER = os.environ.get("TRAINER", "rloo")
SIZE = os.environ.get("SIZE", "14m")
EPISODES = int(os.environ.get("EPISODES", 512))
BATCH = int(os.environ.get("BATCH", 16))
K = int(os.environ.get("K", 2))
RESP_LEN = int(os.environ.get("RESP_LEN", 53))
PPO_EPOCHS = int(os.environ.get("PPO_EPOCHS", 1))
LR = float(os.environ.get("LR", 3e-6))
SEED = int(os.environ.get("SEED", 42))
TEMP = float(os.environ.get("TEMP", 1.0))
BF16 = os.environ.get("BF16", "0") == "1"
POLICY, REWARD = f"{ART}/policy-{SIZE}", f"{ART}/reward-{SIZE}"


def main() -> dict:
    if TRAINER not in ("rloo", "rloo_grpo", "grpo"):
        raise SystemExit(f"TRAINER={TRAINER!r}: use rloo, rloo_grpo or grpo.")
    torch.set_num_threads(int(os.environ.get("THREADS", 2)))
    out = os.path.join(os.environ.get("RUNS", f"{ART}/runs"), f"{TRAINER}-{SIZE}-posttrain")
    tokenizer = load_tokenizer(POLICY)
    prompts = load_from_disk(f"{ART}/prompts")
    common = dict(
        output_dir=out, overwrite_output_dir=True, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
        num_mini_batches=1, response_length=RESP_LEN, total_episodes=EPISODES, local_rollout_forward_batch_size=BATCH,
        num_sample_generations=0, learning_rate=LR, seed=SEED, logging_steps=1, save_steps=0, report_to="none",
        bf16=BF16, temperature=TEMP,
    )
    policy, reference = load_policy(POLICY, tokenizer=tokenizer), load_policy(POLICY, tokenizer=tokenizer)
    reward = load_reward_model(REWARD, tokenizer=tokenizer)
    if TRAINER == "grpo":
        config = GRPOConfig(**common, num_generations=K, num_iterations=PPO_EPOCHS, beta=0.05)
        trainer = GRPOTrainer(policy, reward, config, prompts["train"], prompts["test"], processing_class=tokenizer,
                              ref_model=reference)
    else:
        config = RLOOConfig(**common, rloo_k=K, num_ppo_epochs=PPO_EPOCHS, kl_coef=0.05)
        trainer = RLOOTrainer(config, tokenizer, policy, reference, reward, prompts["train"], eval_dataset=prompts["test"])
    start = time.perf_counter()
    last = trainer.train()
    wall = time.perf_counter() - start
    first = trainer.log_history[0] if trainer.log_history else {}
    result = dict(
        trainer=TRAINER, library=f"posttrain {posttrain.__version__}", transformers=transformers.__version__,
        torch=torch.__version__, python=platform.python_version(), threads=torch.get_num_threads(), size=SIZE,
        batch=BATCH, k=K, resp_len=RESP_LEN, temperature=TEMP, lr=LR, seed=SEED, episodes=EPISODES, bf16=BF16,
        steps=trainer.setup.run.state.optimizer_steps, train_wall_s=round(wall, 2), eps_wall=round(EPISODES / wall, 2),
        eps_logged_last=last.get("eps"), ru_maxrss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        mean_completion_len=last.get("completions/mean_length"), first_log=first, last_log=last,
    )
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("RESULT_DIR", out)
    print("RESULT", json.dumps({k: v for k, v in result.items() if k not in ("first_log", "last_log")}))
    return result


if __name__ == "__main__":
    main()
