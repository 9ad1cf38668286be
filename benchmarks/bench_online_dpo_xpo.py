"""posttrain Online DPO / XPO on exactly the settings of the TRL reference runs
(shared/bench/run_online_dpo.py, run_xpo.py + common.py).

Same artifacts (~/.cache/posttrain-bench/artifacts: policy-<SIZE>, reward-<SIZE>, prompts), same knobs by
environment: SIZE [14m] EPISODES [512] BATCH [16 completions per optimizer step] RESP_LEN [53] LR [3e-6]
SEED [42] TEMP [1.0] BF16 [0] THREADS [2]. As in TRL's scripts: BATCH/2 prompts per step with 2
completions each (Online DPO: two policy samples; XPO: one policy and one reference sample), gradient
accumulation 1, the reference a second copy of the policy, the reward model reward-<SIZE> (same
tokenizer), no sample tables, no checkpoints. posttrain's per_device_train_batch_size counts
completions, so it is BATCH here where TRL's counts prompts (BATCH // 2). The timed span is
`trainer.train()`, which here includes saving the final policy (TRL's reference run saves nothing).
Writes <RUNS>/<trainer>-<SIZE>-posttrain/result.json and prints RESULT_DIR / RESULT lines like the TRL
scripts, so benchmarks/run_ours.sh can add peak RSS.

    bash benchmarks/run_ours.sh online_dpo 14m      # or: TRAINER=xpo python benchmarks/bench_online_dpo_xpo.py
"""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
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

ART = os.environ.get("ART", os.path.join(os.environ.get("POSTTRAIN_BENCH", os.path.expanduser("~/.cache/posttrain-bench")), "artifacts"))
SIZE = os.environ.get("SIZE", "14m")
EPISODES = int(os.environ.get("EPISODES", 512))
BATCH = int(os.environ.get("BATCH", 16))
RESP_LEN = int(os.environ.get("RESP_LEN", 53))
LR = float(os.environ.get("LR", 3e-6))
SEED = int(os.environ.get("SEED", 42))
TEMP = float(os.environ.get("TEMP", 1.0))
BF16 = os.environ.get("BF16", "0") == "1"
POLICY, REWARD = f"{ART}/policy-{SIZE}", f"{ART}/reward-{SIZE}"


def main(name: str) -> dict:
    if name == "online_dpo":
        from posttrain.trainers.online_dpo import OnlineDPOTrainer as Trainer
        from posttrain.trainers.online_dpo_config import OnlineDPOConfig as Config
    elif name == "xpo":
        from posttrain.trainers.xpo import XPOTrainer as Trainer
        from posttrain.trainers.xpo_config import XPOConfig as Config
    else:
        raise SystemExit(f"unknown trainer {name!r}: online_dpo or xpo")
    torch.set_num_threads(int(os.environ.get("THREADS", 2)))
    out = os.path.join(os.environ.get("RUNS", f"{ART}/runs"), f"{name}-{SIZE}-posttrain")
    tokenizer = load_tokenizer(POLICY)
    prompts = load_from_disk(f"{ART}/prompts")
    config = Config(
        output_dir=out, overwrite_output_dir=True, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
        total_episodes=EPISODES, max_new_tokens=RESP_LEN, local_rollout_forward_batch_size=BATCH, num_sample_generations=0,
        learning_rate=LR, seed=SEED, logging_steps=1, save_steps=0, report_to="none", bf16=BF16, temperature=TEMP,
    )
    trainer = Trainer(
        model=load_policy(POLICY, tokenizer=tokenizer), ref_model=load_policy(POLICY, tokenizer=tokenizer),
        reward_model=load_reward_model(REWARD, tokenizer=tokenizer), args=config, processing_class=tokenizer,
        train_dataset=prompts["train"],
    )
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    logs = trainer.log_history
    last = logs[-1] if logs else {}
    result = dict(
        trainer=name, library=f"posttrain {posttrain.__version__}", transformers=transformers.__version__,
        torch=torch.__version__, python=platform.python_version(), threads=torch.get_num_threads(), size=SIZE,
        batch=BATCH, k=2, resp_len=RESP_LEN, temperature=TEMP, lr=LR, seed=SEED, episodes=EPISODES, bf16=BF16,
        steps=trainer.state.optimizer_steps, train_wall_s=round(wall, 2), eps_wall=round(EPISODES / wall, 2),
        eps_logged_last=last.get("eps"), ru_maxrss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        n_logs=len(logs), first_log=logs[0] if logs else {}, last_log=last,
    )
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("RESULT_DIR", out)
    print("RESULT", json.dumps({k: v for k, v in result.items() if k not in ("first_log", "last_log")}))
    print(f"{name}: {result['eps_wall']} episodes/s ({EPISODES} episodes in {result['train_wall_s']} s)")
    return result


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("TRAINER", "online_dpo"))
