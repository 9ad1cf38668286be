"""Prompt + response_length against the position limit of every model reading the sequence (policy,
reference, reward model, critic), checked before the first rollout. Tiny models are built with a
small max_position_embeddings; the Llama-shaped ones would otherwise run past it silently."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from datasets import Dataset
from tests.helpers import length_reward

from posttrain.configs import ConfigError
from posttrain.testing import build_tiny_causal_lm, build_tiny_reward_model
from posttrain.trainers.rloo import RLOOTrainer
from posttrain.trainers.rloo_config import RLOOConfig

LONG = "the quick brown fox jumps over the lazy dog " * 4  # far more than 16 tokens


def prompts(n=4):
    return Dataset.from_dict({"prompt": [f"{i} " + LONG for i in range(n)] + ["Hi"] * n})


def rloo(tmp_path, tokenizer, *, positions=16, reward=length_reward, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        total_episodes=4,
        response_length=4,
        rloo_k=2,
        report_to="none",
        num_sample_generations=0,
    )
    values.update(overrides)
    policy = build_tiny_causal_lm(tokenizer, max_position_embeddings=positions)
    return RLOOTrainer(RLOOConfig(**values), tokenizer, policy, None, reward, train_dataset=prompts())


def test_without_max_prompt_length_the_policys_room_bounds_the_prompts_with_a_count(tmp_path, tiny_tokenizer):
    with pytest.warns(UserWarning, match=r"train_dataset: 4 of 8 prompts are longer than 12 tokens") as caught:
        trainer = rloo(tmp_path, tiny_tokenizer)
    message = str(caught[0].message)
    assert "policy" in message and "at most 16 positions" in message and "truncated from the left" in message
    lengths = [len(ids) for ids in trainer.run.train_dataset["input_ids"]]
    assert max(lengths) == 16 - 4  # 16 positions − response_length 4
    assert len(lengths) == 8  # truncated, not dropped
    trainer.train()  # one rollout batch through the reference and the policy, within 16 positions


def test_drop_removes_only_the_prompts_that_do_not_fit(tmp_path, tiny_tokenizer):
    with pytest.warns(UserWarning, match="4 of 8 prompts .* they are dropped"):
        trainer = rloo(tmp_path, tiny_tokenizer, prompt_overflow="drop")
    assert trainer.run.train_dataset["prompt"] == ["Hi"] * 4


def test_a_max_prompt_length_that_does_not_fit_stops_naming_model_limit_lengths_and_fix(tmp_path, tiny_tokenizer):
    with pytest.raises(ConfigError) as info:
        rloo(tmp_path, tiny_tokenizer, max_prompt_length=20)
    assert str(info.value) == (
        "train_dataset: prompts of up to 20 tokens (max_prompt_length=20) + response_length=4 = 24 positions do "
        "not fit the policy, which reads at most 16. Fix: pass --max_prompt_length 12 (max_prompt_length= in "
        "Python) or a lower --response_length."
    )


def test_a_response_length_filling_the_model_stops(tmp_path, tiny_tokenizer):
    with pytest.raises(
        ConfigError, match=r"response_length=16 leaves no room for a prompt in the policy, which reads "
    ):
        rloo(tmp_path, tiny_tokenizer, response_length=16)


def test_drop_that_would_drop_every_prompt_names_the_model(tmp_path, tiny_tokenizer):
    data = Dataset.from_dict({"prompt": [LONG] * 4})
    config = RLOOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        total_episodes=4,
        response_length=4,
        prompt_overflow="drop",
        report_to="none",
    )
    policy = build_tiny_causal_lm(tiny_tokenizer, max_position_embeddings=16)
    with pytest.raises(ConfigError, match="do not fit the policy, which reads at most 16. Fix: pass --max_prompt_len"):
        RLOOTrainer(config, tiny_tokenizer, policy, None, length_reward, train_dataset=data)


def test_the_tightest_model_sets_the_bound_here_the_reward_model(tmp_path, tiny_tokenizer):
    reward_model = build_tiny_reward_model(tiny_tokenizer, max_position_embeddings=10)
    with pytest.warns(UserWarning, match=r"longer than 6 tokens, the room the reward model \(at most 10 positions\)"):
        trainer = rloo(tmp_path, tiny_tokenizer, positions=64, reward=reward_model)
    assert max(len(ids) for ids in trainer.run.train_dataset["input_ids"]) == 6


def test_a_model_without_a_position_limit_passes(tiny_tokenizer):
    from posttrain.positions import position_limit

    policy = build_tiny_causal_lm(tiny_tokenizer, max_position_embeddings=16)
    assert position_limit(policy) == 16
    # a config with no position table (e.g. relative positions) and an encoder-decoder: no limit to check
    assert position_limit(SimpleNamespace(config=SimpleNamespace(hidden_size=32))) is None
    assert position_limit(SimpleNamespace(config=SimpleNamespace(is_encoder_decoder=True, n_positions=8))) is None


def test_the_command_line_exits_2_naming_the_reward_model_and_its_limit(tmp_path, tiny_tokenizer):
    policy_dir, rm_dir = tmp_path / "policy", tmp_path / "rm"
    build_tiny_causal_lm(tiny_tokenizer, max_position_embeddings=64, save_dir=policy_dir)
    build_tiny_reward_model(tiny_tokenizer, max_position_embeddings=12, save_dir=rm_dir)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "{i} {LONG}"}}\n' for i in range(4)))
    argv = ["rloo", "--model_name_or_path", str(policy_dir), "--reward_model_path", str(rm_dir)]
    argv += ["--dataset_name", str(data), "--output_dir", str(tmp_path / "out"), "--max_prompt_length", "30"]
    argv += ["--per_device_train_batch_size", "2", "--total_episodes", "2", "--response_length", "4"]
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain", *argv, "--report_to", "none"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert (
        f"posttrain rloo: train_dataset: prompts of up to 30 tokens (max_prompt_length=30) + response_length=4 = "
        f"34 positions do not fit the reward model ({rm_dir}), which reads at most 12. Fix: pass "
        "--max_prompt_length 8" in proc.stderr
    )


def test_sft_sequences_longer_than_the_models_positions_stop_before_training(tmp_path, tiny_tokenizer):
    from posttrain.trainers.sft import SFTTrainer
    from posttrain.trainers.sft_config import SFTConfig

    model = build_tiny_causal_lm(tiny_tokenizer, max_position_embeddings=16)
    data = Dataset.from_dict({"text": [LONG, "Hi"]})
    args = SFTConfig(output_dir=str(tmp_path / "out"), report_to="none")  # max_length 1024 by default
    with pytest.raises(ConfigError) as info:
        SFTTrainer(model, args, train_dataset=data, processing_class=tiny_tokenizer)
    message = str(info.value)
    assert message.startswith("train_dataset: sequences of up to ")
    assert message.endswith(
        "(max_length=1024) do not fit the model, which reads at most 16 positions. Fix: pass --max_length 16 "
        "(max_length= in Python) or less."
    )
    # the fix works: truncated to the model's positions, the trainer builds
    args = SFTConfig(output_dir=str(tmp_path / "out"), report_to="none", max_length=16)
    trainer = SFTTrainer(model, args, train_dataset=data, processing_class=tiny_tokenizer)
    assert max(len(ids) for ids in trainer.train_dataset["input_ids"]) == 16


def test_reward_pairs_longer_than_the_models_positions_stop_before_training(tmp_path, tiny_tokenizer):
    from posttrain.trainers.reward import RewardTrainer
    from posttrain.trainers.reward_config import RewardConfig

    model = build_tiny_reward_model(tiny_tokenizer, max_position_embeddings=16)
    data = Dataset.from_dict({"chosen": [LONG, "Yes"], "rejected": ["No", "Nope"]})
    args = RewardConfig(output_dir=str(tmp_path / "out"), report_to="none", max_length=None)
    with pytest.raises(
        ConfigError, match=r"do not fit the model, which reads at most 16 positions. Fix: pass --max_le"
    ):
        RewardTrainer(model, args, train_dataset=data, processing_class=tiny_tokenizer)


def test_a_reward_model_with_its_own_tokenizer_is_checked_in_its_tokens(tmp_path, tiny_tokenizer):
    from posttrain.testing import build_tiny_tokenizer

    rm_tokenizer = build_tiny_tokenizer(vocab_size=300)  # fewer merges: more tokens for the same text
    reward_model = build_tiny_reward_model(rm_tokenizer, max_position_embeddings=20)
    config = RLOOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        total_episodes=4,
        response_length=4,
        max_prompt_length=30,
        report_to="none",
    )
    policy = build_tiny_causal_lm(tiny_tokenizer, max_position_embeddings=64)  # 30 + 4 fit the policy
    longest = max(len(rm_tokenizer(p + LONG)["input_ids"]) for p in ("0 ", "1 ", "2 ", "3 "))
    assert longest + 4 > 20
    with pytest.raises(ConfigError, match=r"prompts re-tokenized for the reward model reach \d+ tokens \+ resp"):
        RLOOTrainer(
            config,
            tiny_tokenizer,
            policy,
            None,
            reward_model,
            train_dataset=prompts(),
            reward_processing_class=rm_tokenizer,
        )
