"""What TRL 1.x's GRPOTrainer and RLOOTrainer pass reward functions, in posttrain's GRPO and RLOO:
conversational prompts as messages and completions as [{"role": "assistant", "content": text}]."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import flat, grpo_config, read_metrics, word_prompts
from posttrain.configs import ConfigError
from posttrain.scoring import RewardFunctionRaised
from posttrain.testing import build_tiny_causal_lm
from posttrain.trainers.grpo import GRPOTrainer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_grpo_conversational_prompts_reach_reward_functions_as_messages(tmp_path, tiny_tokenizer):
    """TRL's GRPO call: a conversational row's prompt is its messages as the dataset gave them, its
    completion [{"role": "assistant", "content": text}] with the text the policy sampled."""
    seen = []

    def content_length(prompts, completions, completion_ids, **kwargs):
        seen.append((prompts, completions, completion_ids))
        assert "prompt_messages" not in kwargs
        return [float(len(completion[0]["content"])) for completion in completions]

    model = build_tiny_causal_lm(tiny_tokenizer)
    before = flat(model).clone()
    trainer = GRPOTrainer(
        model,
        content_length,
        grpo_config(tmp_path, num_generations=2, total_episodes=4),
        word_prompts(2, conversational=True),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    ((prompts, completions, ids),) = seen
    assert len(prompts) == len(completions) == 4
    # the global batch is both prompts, 2 samples each
    assert sorted(p[0]["content"] for p in prompts) == ["Hello world"] * 2 + ["The quick brown fox"] * 2
    assert all(len(p) == 1 and p[0]["role"] == "user" for p in prompts)
    for completion, row in zip(completions, ids):
        assert len(completion) == 1 and completion[0]["role"] == "assistant"
        assert completion[0]["content"] == tiny_tokenizer.decode(row, skip_special_tokens=True)
    assert not flat(trainer.model).equal(before)


def test_grpo_plain_prompts_stay_texts(tmp_path, tiny_tokenizer):
    seen = []

    def length(prompts, completions, **kwargs):
        seen.append((prompts, completions))
        return [float(len(c)) for c in completions]

    GRPOTrainer(
        build_tiny_causal_lm(tiny_tokenizer),
        length,
        grpo_config(tmp_path, num_generations=2, total_episodes=4),
        word_prompts(2),
        processing_class=tiny_tokenizer,
    ).train()
    ((prompts, completions),) = seen
    assert sorted(prompts) == ["Hello world"] * 2 + ["The quick brown fox"] * 2
    assert all(isinstance(c, str) for c in completions)


def test_log_metric_and_log_extra(tmp_path, tiny_tokenizer):
    """TRL 1.x's log_metric / log_extra keywords: a metric is the mean of a rollout batch's values,
    averaged over the rollout batches of the logging step (and logged as eval_<name> when evaluating);
    a column joins the sample table (samples.jsonl) next to its completion."""

    def graded(completions, trainer_state, **kwargs):
        step = trainer_state.global_step
        kwargs["log_extra"]("echo", list(completions))
        kwargs["log_metric"]("custom", 10.0 * step + 1)
        if step == 0:
            kwargs["log_metric"]("custom", 10.0 * step + 2)
        return [float(len(c)) for c in completions]

    def named(completions, log_metric):  # no **kwargs: gets the keywords it names
        log_metric("named", 3.0)
        return [0.0] * len(completions)

    trainer = GRPOTrainer(
        build_tiny_causal_lm(tiny_tokenizer),
        [graded, named],
        grpo_config(
            tmp_path,
            num_generations=2,
            logging_steps=2,
            num_sample_generations=1,
            per_device_eval_batch_size=2,
            eval_strategy="steps",
            eval_steps=2,
            log_completions=True,
        ),
        word_prompts(2),
        eval_dataset=word_prompts(2),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    history = trainer.state.log_history
    (train,) = [e for e in history if "custom" in e and "train_runtime" not in e]
    assert history[-1]["custom"] == train["custom"]  # the summary repeats the last batch's metrics
    # rollout batch 1 (global_step 0) logged 1 and 2: mean 1.5; batch 2 logged 11: (1.5 + 11) / 2
    assert train["custom"] == pytest.approx(6.25)
    assert train["named"] == 3.0
    # the evaluation after rollout batch 2 (global_step 2) logged 21 once
    (evaluation,) = [e for e in history if "eval_objective/scores" in e]
    assert evaluation["eval_custom"] == 21.0
    lines = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    rows = [r for r in lines if r.get("table") != "rollout_completions"]
    assert len(rows) == 2
    for row in rows:
        assert row["model response"].replace(tiny_tokenizer.eos_token, "") == row["echo"]
    # log_completions: the training rollouts' table (logged at step 2) carries the column too
    table = [r for r in lines if r.get("table") == "rollout_completions"]
    assert len(table) == 4 and all(r["echo"] == r["completion"] for r in table)
    # TRL's `trainer._logs`: the last rollout batch (the 4 completions of step 2), with the logged column
    logs = trainer._logs
    assert len(logs["prompt"]) == len(logs["completion"]) == len(logs["advantages"]) == 4
    assert logs["extra"]["echo"] == logs["completion"] and set(logs["rewards"]) == {"graded", "named"}
    assert logs["rewards"]["named"] == [0.0] * 4


def test_log_metric_and_log_extra_errors_name_the_function(tmp_path, tiny_tokenizer):
    def short_column(completions, log_extra, **kwargs):
        log_extra("first", completions[:1])
        return [1.0] * len(completions)

    def text_metric(completions, log_metric, **kwargs):
        log_metric("acc", "high")
        return [1.0] * len(completions)

    for func, message in ((short_column, "got 1 values for 4 completions"), (text_metric, "one finite number")):
        trainer = GRPOTrainer(
            build_tiny_causal_lm(tiny_tokenizer),
            func,
            grpo_config(tmp_path, func.__name__, num_generations=2),
            word_prompts(2),
            processing_class=tiny_tokenizer,
        )
        with pytest.raises(RewardFunctionRaised, match=func.__name__) as err:
            trainer.train()
        assert message in str(err.value.__cause__)


def test_each_reward_model_scores_with_its_own_tokenizer(tmp_path, tiny_tokenizer):
    """TRL's reward_processing_classes: one entry per reward, None meaning the tokenizer saved with that
    reward model. Two reward models with different tokenizers each score the text tokenized their own
    way; the one sharing the policy's tokenizer reads the policy's token ids as they are."""
    from posttrain.scoring import reward_model_scores
    from posttrain.testing import build_tiny_reward_model, build_tiny_tokenizer
    from posttrain.trainers.online import sample

    other = build_tiny_tokenizer(corpus=["zebra quartz vixen " * 20, "jumbo fjord wyvern " * 20], vocab_size=300)
    build_tiny_reward_model(other, seed=1, save_dir=tmp_path / "rm_other")
    build_tiny_reward_model(tiny_tokenizer, seed=2, save_dir=tmp_path / "rm_same")
    given = build_tiny_reward_model(other, seed=3)  # a module: its tokenizer given in the list
    trainer = GRPOTrainer(
        build_tiny_causal_lm(tiny_tokenizer),
        [str(tmp_path / "rm_other"), str(tmp_path / "rm_same"), given, length_of],
        grpo_config(tmp_path, num_generations=2),
        word_prompts(2),
        processing_class=tiny_tokenizer,
        reward_processing_classes=[None, None, other, None],
    )
    source = trainer.reward
    # TRL's trainer.reward_processing_classes: each reward model's tokenizer, None for a function
    classes = trainer.reward_processing_classes
    assert classes[2] is other and classes[3] is None
    assert [t.get_vocab() for t in classes[:2]] == [other.get_vocab(), tiny_tokenizer.get_vocab()]
    vocabularies = [t.get_vocab() if t is not None else None for t in source.reward_tokenizers]
    assert vocabularies == [other.get_vocab(), None, other.get_vocab()]
    batch = tiny_tokenizer(["Hello world", "Good morning"], return_tensors="pt", padding=True, padding_side="left")
    rollout = sample(trainer.run, trainer.wrapped, batch["input_ids"], batch["attention_mask"])
    scores = source.per_reward(rollout, ["Hello world", "Good morning"], ["", ""])
    for j, (model, tokenizer) in enumerate(zip(source.models, [other, None, other])):
        expected = reward_model_scores(
            model, rollout, batch_size=8, policy_tokenizer=tiny_tokenizer, reward_tokenizer=tokenizer
        )
        assert torch.equal(scores[:, j], expected), j
    # (the policy's ids would not even fit `other`'s 300-token embedding)
    assert len(tiny_tokenizer) > len(other)

    # conversational rows (GRPO passes messages): a reward model with its own tokenizer reads the
    # conversation rendered with its own chat template (TRL 1.x), without added special tokens
    assert other.chat_template
    chats = [[{"role": "user", "content": "Hello world"}], [{"role": "user", "content": "Good morning"}]]
    replies = [[{"role": "assistant", "content": "zebra"}], [{"role": "assistant", "content": "fjord wyvern"}]]
    scores = source.per_reward(rollout, chats, replies)
    for i, (chat, reply) in enumerate(zip(chats, replies)):
        ids = other(other.apply_chat_template(chat + reply, tokenize=False), add_special_tokens=False)["input_ids"]
        assert ids[-1] != other.pad_token_id
        with torch.no_grad():
            expected = source.models[0](torch.tensor([ids])).logits[0, 0]
        assert scores[i, 0] == pytest.approx(float(expected), abs=1e-5)
    assert scores[:, 3].tolist() == [1.0, 1.0]  # length_of got the messages: one assistant message each

    # as in TRL, a single tokenizer is a list of one, whose length must match the rewards'
    for classes in ([other], other):
        with pytest.raises(ConfigError, match="reward_processing_classes has 1 entries for 2 rewards.*must match"):
            GRPOTrainer(
                build_tiny_causal_lm(tiny_tokenizer),
                [given, length_of],
                grpo_config(tmp_path, "bad"),
                word_prompts(2),
                processing_class=tiny_tokenizer,
                reward_processing_classes=classes,
            )


def length_of(completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_log_history_shape_trl_tests_rely_on(tmp_path, tiny_tokenizer):
    """As transformers.Trainer (and so TRL): when the last rollout batch is not a logging step, its
    metrics join the end-of-training summary, so log_history[-1] holds train_loss and the reward metrics;
    metrics.jsonl still has a line for that step."""
    trainer = GRPOTrainer(
        build_tiny_causal_lm(tiny_tokenizer),
        length_of,
        grpo_config(tmp_path, num_generations=2, total_episodes=12, logging_steps=2),
        word_prompts(2),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    history = trainer.state.log_history
    assert [e["step"] for e in history] == [2, 3]
    assert history[-1]["train_loss"] is not None and "train_runtime" in history[-1]
    assert "rewards/length_of/mean" in history[-1] and "reward" in history[-1]
    assert "train_loss" not in history[-2] and "rewards/length_of/mean" in history[-2]
    steps = [line["step"] for line in read_metrics(tmp_path / "out") if "rewards/length_of/mean" in line]
    assert steps == [2, 3]
