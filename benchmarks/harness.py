"""Settings and result writing shared by the bench_<trainer>.py scripts.

The knobs and artifacts are those of ../shared/bench/common.py (the TRL reference harness), read from
the same environment variables, so a posttrain run and a TRL run with the same environment do the
same work: SIZE [14m] EPISODES [512] BATCH [16 completions per step] K [2] RESP_LEN [53]
PPO_EPOCHS [1] LR [3e-6] SEED [42] TEMP [1.0] BF16 [0] THREADS [2] ART RUNS; and one knob of posttrain's
own, GC [0]: 1 turns on gradient checkpointing (benchmarks/README.md, "Trading speed for memory").
Each script prints "RESULT_DIR <dir>" and writes <dir>/result.json; run_ours.sh adds peak RSS.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import time
import warnings
from collections.abc import Callable
from typing import Any

warnings.filterwarnings("ignore")
for _var, _value in (
    ("HF_HUB_OFFLINE", "1"),
    ("HF_DATASETS_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
    ("TOKENIZERS_PARALLELISM", "false"),
):
    os.environ.setdefault(_var, _value)

ART = os.environ.get(
    "ART", os.path.join(os.environ.get("POSTTRAIN_BENCH", os.path.expanduser("~/.cache/posttrain-bench")), "artifacts")
)
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
GC = os.environ.get("GC", "0") == "1"
THREADS = int(os.environ.get("THREADS", 2))
POLICY, REWARD = f"{ART}/policy-{SIZE}", f"{ART}/reward-{SIZE}"


def out_dir(name: str) -> str:
    return os.path.join(os.environ.get("RUNS", f"{ART}/runs"), f"{name}-{SIZE}-posttrain")


def common_config(out: str) -> dict[str, Any]:
    """Config fields every online trainer gets: TRL's reference settings (one minibatch, no sample
    tables, no checkpoints, rollout chunks of BATCH rows, logging every step)."""
    return dict(
        output_dir=out,
        overwrite_output_dir=True,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        response_length=RESP_LEN,
        total_episodes=EPISODES,
        local_rollout_forward_batch_size=BATCH,
        num_sample_generations=0,
        learning_rate=LR,
        seed=SEED,
        logging_steps=1,
        save_steps=0,
        report_to="none",
        bf16=BF16,
        temperature=TEMP,
        gradient_checkpointing=GC,
    )


def load_artifacts() -> dict[str, Any]:
    """Tokenizer, prompt splits and loaders of the reference artifacts (threads set first)."""
    import torch
    from datasets import load_from_disk

    from posttrain.models import load_policy, load_reward_model, load_tokenizer

    torch.set_num_threads(THREADS)
    tokenizer = load_tokenizer(POLICY)
    prompts = load_from_disk(f"{ART}/prompts")
    return dict(
        tokenizer=tokenizer,
        train=prompts["train"],
        test=prompts["test"],
        policy=lambda: load_policy(POLICY, tokenizer=tokenizer),
        reward=lambda: load_reward_model(REWARD, tokenizer=tokenizer),
    )


def train_online(trainer: Any) -> dict:
    """trainer.train(); the metrics of its last logging step (the entry of trainer.state.log_history
    before the end-of-training summary)."""
    trainer.train()
    history = trainer.state.log_history
    return history[-2] if len(history) > 1 else {}


def timed(
    name: str,
    out: str,
    train: Callable[[], dict],
    *,
    k: int,
    optimizer_steps: Callable[[], int],
    mean_completion_len: Callable[[dict], Any],
    first_log: Callable[[], dict],
) -> dict:
    """Run train(), then write result.json (timing, settings, first/last logged metrics) and the
    RESULT_DIR / RESULT lines that run_ours.sh reads."""
    import torch
    import transformers

    import posttrain

    start = time.perf_counter()
    last = train() or {}
    wall = time.perf_counter() - start
    result = dict(
        trainer=name,
        library=f"posttrain {posttrain.__version__}",
        transformers=transformers.__version__,
        torch=torch.__version__,
        python=platform.python_version(),
        threads=torch.get_num_threads(),
        size=SIZE,
        batch=BATCH,
        k=k,
        resp_len=RESP_LEN,
        temperature=TEMP,
        lr=LR,
        seed=SEED,
        episodes=EPISODES,
        bf16=BF16,
        gradient_checkpointing=GC,
        steps=optimizer_steps(),
        train_wall_s=round(wall, 2),
        eps_wall=round(EPISODES / wall, 2),
        eps_logged_last=last.get("eps"),
        ru_maxrss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        mean_completion_len=mean_completion_len(last),
        first_log=first_log(),
        last_log=last,
    )
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("RESULT_DIR", out)
    print("RESULT", json.dumps({k: v for k, v in result.items() if k not in ("first_log", "last_log")}))
    return result
