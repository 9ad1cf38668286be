"""Reward functions get TRL GRPO's keywords in every online trainer that scores with them:
`completion_ids` (each completion's token ids, up to and including its stop token) and
`trainer_state` (the trainer's transformers.TrainerState, whose global_step counts the rollout
batches already trained on)."""

from __future__ import annotations

import pytest

from helpers import online_trainer


@pytest.mark.parametrize("algo", ["grpo", "rloo", "online_dpo"])
def test_reward_functions_get_completion_ids_and_trainer_state(algo, tmp_path, tiny_tokenizer):
    seen = []

    def reward(completions, completion_ids, trainer_state, **kwargs):
        seen.append((list(completions), [list(ids) for ids in completion_ids], trainer_state.global_step))
        return [float(len(ids)) for ids in completion_ids]

    trainer = online_trainer(algo, tmp_path, tiny_tokenizer, reward=reward, save_strategy="no")
    trainer.train()
    assert [step for _, _, step in seen] == [0, 1]  # scored before each rollout batch's update
    for completions, ids, _ in seen:
        assert len(ids) == len(completions) == 4
        for text, row in zip(completions, ids):
            assert 1 <= len(row) <= 4  # response_length 4, nothing past the stop token
            assert tiny_tokenizer.decode(row, skip_special_tokens=True) == text
