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
from posttrain.trainers.ppo import PPOConfig, PPOTrainer  # noqa: E402

ART = os.environ.get("ART", os.path.join(os.environ.get("POSTTRAIN_BENCH", os.path.expanduser("~/.cache/posttrain-bench")), "artifacts"))
SIZE = os.environ.get("SIZE", "14m")
EPISODES = int(os.environ.get("EPISODES", 512))
BATCH = int(os.environ.get("BATCH", 16))
RESP_LEN = int(os.environ.get("RESP_LEN", 53))
PPO_EPOCHS = int(os.environ.get("PPO_EPOCHS", 1))
LR = float(os.environ.get("LR", 3e-6))
SEED = int(os.environ.get("SEED", 42))
TEMP = float(os.environ.get("TEMP", 1.0))
BF16 = os.environ.get("BF16", "0") == "1"
POLICY, REWARD = f"{ART}/policy-{SIZE}", f"{ART}/reward-{SIZE}"


def main() -> dict:
    torch.set_num_threads(int(os.environ.get("THREADS", 2)))
    out = os.path.join(os.environ.get("RUNS", f"{ART}/runs"), f"ppo-{SIZE}-posttrain")
    tokenizer = load_tokenizer(POLICY)
    prompts = load_from_disk(f"{ART}/prompts")
    config = PPOConfig(
        output_dir=out, overwrite_output_dir=True, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
        num_mini_batches=1, num_ppo_epochs=PPO_EPOCHS, response_length=RESP_LEN, total_episodes=EPISODES,
        local_rollout_forward_batch_size=BATCH, num_sample_generations=0, learning_rate=LR, seed=SEED, logging_steps=1,
        save_steps=0, report_to="none", bf16=BF16, temperature=TEMP, value_model_init="reward",
    )
    trainer = PPOTrainer(
        args=config, processing_class=tokenizer, model=load_policy(POLICY, tokenizer=tokenizer),
        ref_model=load_policy(POLICY, tokenizer=tokenizer), reward_model=load_reward_model(REWARD, tokenizer=tokenizer),
        train_dataset=prompts["train"], eval_dataset=prompts["test"],
    )
    start = time.perf_counter()
    last = trainer.train()
    wall = time.perf_counter() - start
    lines = (open(os.path.join(out, "metrics.jsonl")).read().splitlines())
    first = json.loads(lines[-trainer.run.config.num_total_batches]) if lines else {}
    result = dict(
        trainer="ppo", library=f"posttrain {posttrain.__version__}", transformers=transformers.__version__,
        torch=torch.__version__, python=platform.python_version(), threads=torch.get_num_threads(), size=SIZE,
        batch=BATCH, k=1, resp_len=RESP_LEN, temperature=TEMP, lr=LR, seed=SEED, episodes=EPISODES, bf16=BF16,
        steps=trainer.run.state.optimizer_steps, train_wall_s=round(wall, 2), eps_wall=round(EPISODES / wall, 2),
        eps_logged_last=last.get("eps"), ru_maxrss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        mean_completion_len=last.get("tokens/responses_len_mean"), first_log=first, last_log=last,
    )
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("RESULT_DIR", out)
    print("RESULT", json.dumps({k: v for k, v in result.items() if k not in ("first_log", "last_log")}))
    return result


if __name__ == "__main__":
    main()
