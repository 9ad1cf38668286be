"""Helpers shared by several test files (not collected: no test_ prefix)."""

import struct

import torch
from datasets import Dataset

from posttrain.rollout import Rollout, generate
from posttrain.testing import build_tiny_causal_lm


def per_row_generate(model, prompt_ids, prompt_mask, sampling, *, pad_token_id, batch_size=None, generator=None, **kw):
    """`rollout.generate` whose tokens for a row depend only on that row's prompt (and how many times
    the prompt was seen in this call): each rank of a data-parallel run samples from its own stream,
    so the 2-process == 1-process tests patch the trainers' `generate` with this."""
    seen: dict[tuple, int] = {}
    rows = []
    for ids, mask in zip(prompt_ids, prompt_mask):
        key = tuple(ids[mask.bool()].tolist())
        seen[key] = seen.get(key, -1) + 1
        seed = (sum((i + 1) * t for i, t in enumerate(key)) * 1009 + seen[key]) % (2**31)
        g = torch.Generator(device=ids.device).manual_seed(seed)
        rows.append(
            generate(
                model,
                ids[mask.bool()][None],
                mask[mask.bool()][None],
                sampling,
                pad_token_id=pad_token_id,
                generator=g,
                **kw,
            )
        )
    return Rollout.cat(rows)


def train_and_last_log(trainer) -> dict:
    """Train an online trainer; the entry of its last logging step in trainer.state.log_history (the
    entry before the end-of-training summary)."""
    trainer.train()
    history = trainer.state.log_history
    assert "train_runtime" in history[-1] and "train_runtime" not in history[-2]
    return history[-2]


def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def online_trainer(
    algo, out, tokenizer, callbacks=None, prompts=4, reward=length_reward, peft_config=None, **overrides
):
    """A tiny online trainer whose rollout batch is 4 completions (2 prompts × 2 samples; PPO: 4
    prompts × 1), over `prompts` prompts per pass, with 2 rollout batches (8 episodes) by default.
    peft_config: a peft.LoraConfig for the policy (the trainer's `peft_config=`)."""
    from posttrain.trainers.grpo import GRPOTrainer
    from posttrain.trainers.grpo_config import GRPOConfig
    from posttrain.trainers.online_dpo import OnlineDPOTrainer
    from posttrain.trainers.online_dpo_config import OnlineDPOConfig
    from posttrain.trainers.ppo import PPOTrainer
    from posttrain.trainers.ppo_config import PPOConfig
    from posttrain.trainers.rloo import RLOOTrainer
    from posttrain.trainers.rloo_config import RLOOConfig
    from posttrain.trainers.xpo import XPOTrainer
    from posttrain.trainers.xpo_config import XPOConfig

    values = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        total_episodes=8,
        learning_rate=1e-3,
        logging_steps=1,
        save_steps=1,
        report_to="none",
        num_sample_generations=0,
        seed=0,
    )
    eval_dataset = overrides.pop("eval_dataset", None)
    values.update(overrides)
    words = ["Hello world", "The quick brown fox", "Once upon a time", "Thank you", "Good morning", "Blue sea"]
    dataset = Dataset.from_dict({"prompt": [words[i % len(words)] + f" {i}" for i in range(prompts)]})
    policy = build_tiny_causal_lm(tokenizer)
    common = dict(train_dataset=dataset, eval_dataset=eval_dataset, callbacks=callbacks, peft_config=peft_config)
    if algo == "rloo":
        args = RLOOConfig(rloo_k=2, response_length=4, **values)
        return RLOOTrainer(args, tokenizer, policy, None, reward, **common)
    if algo == "grpo":
        # beta > 0: a KL term and a reference (TRL 1.16's default beta is 0.0, no reference)
        args = GRPOConfig(num_generations=2, response_length=4, beta=0.05, **values)
        return GRPOTrainer(policy, reward, args, processing_class=tokenizer, **common)
    if algo == "ppo":
        args = PPOConfig(response_length=4, value_model_init="policy", **values)
        return PPOTrainer(args=args, processing_class=tokenizer, model=policy, reward_model=reward, **common)
    config_cls, trainer_cls = (OnlineDPOConfig, OnlineDPOTrainer) if algo == "online_dpo" else (XPOConfig, XPOTrainer)
    # Online DPO / XPO count per_device_train_batch_size in prompts (TRL): 2 prompts = 4 completions.
    values["per_device_train_batch_size"] = overrides.get("per_device_train_batch_size", 2)
    args = config_cls(max_new_tokens=4, **values)
    return trainer_cls(policy, reward_model=[reward], args=args, processing_class=tokenizer, **common)


def tensorboard_scalars(folder) -> dict[str, list[int]]:
    """{tag: [steps]} of the scalars in a TensorBoard folder, read with tensorboard's EventAccumulator;
    on the oldest stack (tensorboard 2.15, whose readers need numpy < 2) the TFRecord framing (u64
    length, u32 crc, data, u32 crc) is read here and each record parsed as tensorboard's Event proto."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except AttributeError:  # tensorboard 2.15 + numpy 2: np.string_ at import
        from tensorboard.compat.proto.event_pb2 import Event

        scalars: dict[str, list[int]] = {}
        for path in sorted(folder.glob("events.out.tfevents.*")):
            data, pos = path.read_bytes(), 0
            while pos < len(data):
                (length,) = struct.unpack("<Q", data[pos : pos + 8])
                event = Event.FromString(data[pos + 12 : pos + 12 + length])
                pos += 12 + length + 4
                for value in event.summary.value:
                    scalars.setdefault(value.tag, []).append(event.step)
        return scalars
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
