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

import os
import sys

import harness


def main(name: str) -> dict:
    if name == "online_dpo":
        from posttrain.trainers.online_dpo import OnlineDPOTrainer as Trainer
        from posttrain.trainers.online_dpo_config import OnlineDPOConfig as Config
    elif name == "xpo":
        from posttrain.trainers.xpo import XPOTrainer as Trainer
        from posttrain.trainers.xpo_config import XPOConfig as Config
    else:
        raise SystemExit(f"unknown trainer {name!r}: online_dpo or xpo")
    art = harness.load_artifacts()
    out = harness.out_dir(name)
    common = harness.common_config(out)
    # Online DPO / XPO name the completion length max_new_tokens and take no num_mini_batches knob.
    common["max_new_tokens"] = common.pop("response_length")
    common.pop("num_mini_batches")
    trainer = Trainer(
        model=art["policy"](),
        ref_model=art["policy"](),
        reward_model=art["reward"](),
        args=Config(**common),
        processing_class=art["tokenizer"],
        train_dataset=art["train"],
    )

    return harness.timed(
        name,
        out,
        lambda: harness.train_online(trainer),
        k=2,
        optimizer_steps=lambda: trainer.run.progress.optimizer_steps,
        mean_completion_len=lambda last: None,
        first_log=lambda: trainer.state.log_history[0],
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("TRAINER", "online_dpo"))
