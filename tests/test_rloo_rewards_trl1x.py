"""TRL >= 0.21's reward options on posttrain's RLOO (and the None rewards GRPO shares): reward_weights,
the per-reward metrics rewards/<name>/mean and /std with the weighted reward / reward_std, and
reward functions that return None for rows they do not apply to."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import flat, grpo_config, prompt_dataset, rloo_config, train_and_last_log, word_prompts
from posttrain.configs import ConfigError
from posttrain.scoring import RewardFunctionError, reward_function_matrix, reward_function_scores
from posttrain.testing import build_tiny_causal_lm
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.rloo import RLOOTrainer
from posttrain.trainers.rloo_config import RLOOConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def number(completions, number, **kwargs):
    """The prompt's number (prompt_dataset(numbered=True)): a reward known per row whatever is sampled."""
    return [float(n) for n in number]


def even_only(completions, number, **kwargs):
    """1 on even-numbered prompts; None (does not apply) on odd ones — TRL's multi-task form."""
    return [1.0 if n % 2 == 0 else None for n in number]


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def e_count_on_even(completions, number, **kwargs):
    """The completion's count of 'e' on even-numbered prompts; None on odd ones."""
    return [float(c.count("e")) if n % 2 == 0 else None for c, n in zip(completions, number)]


def weighted(completions, number, **kwargs):
    """0.7·length + 0.3·e_count_on_even with its None left out: what reward_weights=[0.7, 0.3] sums."""
    return [0.7 * len(c) + (0.3 * c.count("e") if n % 2 == 0 else 0.0) for c, n in zip(completions, number)]


def rloo(tmp_path, tiny_tokenizer, name, reward_funcs, **overrides) -> RLOOTrainer:
    """TRL >= 0.21's call: prompts 0 and 1, both in every rollout batch of 4 (2 generations each)."""
    args = RLOOConfig(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        num_iterations=1,
        learning_rate=1e-3,
        temperature=1.0,
        max_steps=2,
        seed=5,
        report_to="none",
        num_sample_generations=0,
        save_steps=0,
        **overrides,
    )
    return RLOOTrainer(
        model=build_tiny_causal_lm(tiny_tokenizer),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=prompt_dataset(2, numbered=True),
        processing_class=tiny_tokenizer,
    )


def test_reward_weights_and_trl_1x_reward_metrics(tmp_path, tiny_tokenizer):
    # beta 0: no KL term in the reward. With one, its per-token values are the rollout's log-probs minus
    # the reference forward's, equal only up to float rounding where the CPU's kernels block the decode
    # step and the full forward differently (AVX2), and AdamW turns even a 1e-9 advantage into a step.
    trainer = rloo(tmp_path, tiny_tokenizer, "weighted", [number, even_only], reward_weights=[0.7, 0.3], beta=0.0)
    last = train_and_last_log(trainer)
    assert trainer.state.log_history[-1]["train_loss"] is not None
    # every rollout batch holds rows numbered [0, 1, 0, 1]:
    #   number:    mean 0.5, unbiased std sqrt(1/3)
    #   even_only: [1, None, 1, None] -> mean 1 and std 0 over the two rows it applies to
    #   weighted sum 0.7·number + 0.3·even_only (None skipped) = [0.3, 0.7, 0.3, 0.7]: mean 0.5,
    #   std 0.2·sqrt(4/3)
    assert last["rewards/number/mean"] == pytest.approx(0.5)
    assert last["rewards/number/std"] == pytest.approx(math.sqrt(1 / 3))
    assert (last["rewards/even_only/mean"], last["rewards/even_only/std"]) == (1.0, 0.0)
    assert last["reward"] == pytest.approx(0.5)
    assert last["reward_std"] == pytest.approx(0.2 * math.sqrt(4 / 3))
    # TRL 0.19's name of the score is still logged
    assert last["objective/scores"] == pytest.approx(0.5)
    # a reward of the prompt alone is the same for every completion of it: no leave-one-out advantage
    assert torch.equal(flat(trainer.policy), flat(build_tiny_causal_lm(tiny_tokenizer)))


def test_reward_weights_train_as_the_weighted_sum(tmp_path, tiny_tokenizer):
    """Completion-dependent rewards, one of them None on odd prompts: reward_weights=[0.7, 0.3] trains as
    one function returning 0.7·length + 0.3·e_count_on_even (None left out)."""
    pair = rloo(tmp_path, tiny_tokenizer, "pair", [length, e_count_on_even], reward_weights=[0.7, 0.3])
    single = rloo(tmp_path, tiny_tokenizer, "single", weighted)
    pair.train()
    single.train()
    assert torch.allclose(flat(pair.policy), flat(single.policy), atol=1e-6)
    assert not torch.equal(flat(pair.policy), flat(build_tiny_causal_lm(tiny_tokenizer)))
    assert pair.state.log_history[-2]["reward"] == pytest.approx(single.state.log_history[-2]["reward"])


def e_count_or_constant(completions, number, **kwargs):
    """e_count_on_even, with 7.0 where that returns None."""
    return [float(c.count("e")) if n % 2 == 0 else 7.0 for c, n in zip(completions, number)]


def test_completions_no_reward_scores_train_with_trls_warning(tmp_path, tiny_tokenizer, caplog):
    """Odd prompts' completions get None from the only reward: TRL's warning, and (TRL 1.x) they are left out
    of the baseline with advantage 0, so the run trains as one where both completions of an odd prompt
    score the same (no advantage between them) and even prompts' completions are scored alike."""
    with caplog.at_level("WARNING"):
        unscored = rloo(tmp_path, tiny_tokenizer, "unscored", e_count_on_even, beta=0.0)
        last = train_and_last_log(unscored)
    warnings = [r.getMessage() for r in caplog.records if "All reward functions returned None" in r.getMessage()]
    assert len(warnings) == 2  # one per rollout batch: rows 2 and 4 of each get no reward
    assert "2 of 4 completions" in warnings[0] and "'number': 1" in warnings[0]
    constant = rloo(tmp_path, tiny_tokenizer, "constant", e_count_or_constant, beta=0.0)
    constant.train()
    assert torch.allclose(flat(unscored.policy), flat(constant.policy), atol=1e-6)
    assert not torch.equal(flat(unscored.policy), flat(build_tiny_causal_lm(tiny_tokenizer)))
    assert last["rewards/e_count_on_even/mean"] == pytest.approx(last["rewards/e_count_on_even/mean"])  # not NaN


def test_reward_weights_must_match_the_rewards(tmp_path, tiny_tokenizer):
    with pytest.raises(ConfigError, match="reward_weights is empty"):
        RLOOConfig(reward_weights=[])
    with pytest.raises(ConfigError, match="reward_weights has 1 entries for 2 rewards"):
        RLOOConfig(reward_funcs=["a:f", "a:g"], reward_weights=[1.0])
    with pytest.raises(ConfigError, match="reward_weights has 3 entries for 2 rewards"):
        rloo(tmp_path, tiny_tokenizer, "bad", [number, even_only], reward_weights=[1.0, 1.0, 1.0])


def test_none_rewards_in_the_reward_function_matrix(caplog):
    def first(prompts, completions, **kwargs):
        return [1.0, None, None][: len(completions)]

    def second(prompts, completions, **kwargs):
        return [None, 2.0, None][: len(completions)]

    prompts, completions = ["p", "q", "r"], ["a", "b", "c"]
    with caplog.at_level("WARNING"):
        matrix = reward_function_matrix([first, second], prompts, completions, scored_elsewhere=True)
    assert torch.isnan(matrix).tolist() == [[False, True], [True, False], [True, True]]
    assert not caplog.records  # a reward model scores the third row
    # a row no function scores: TRL's warning, naming the row and every function; its reward is 0 (nansum)
    with caplog.at_level("WARNING"):
        out = reward_function_scores([first, second], prompts, completions, columns={"topic": ["x", "y", "z"]})
    assert out.tolist() == [1.0, 2.0, 0.0]
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith("All reward functions returned None for the following kwargs:")
    assert "'topic': 'z'" in message and "'completion': 'c'" in message and "'first', 'second'" in message
    assert "1 of 3 completions" in message
    with pytest.raises(RewardFunctionError, match="returned 'x' at row 1 of 1"):  # a non-number is still an error
        reward_function_scores([lambda prompts, completions, **kw: ["x"]], ["p"], ["a"])
    # the weighted sum skips a function's None (TRL's nansum)
    out = reward_function_scores([first, second], prompts[:2], completions[:2], weights=[0.5, 3.0])
    assert out.tolist() == [0.5, 6.0]


def test_grpo_trains_with_none_rewards(tmp_path, tiny_tokenizer):
    """GRPO's per-reward grid keeps a function's None as NaN: it skips it in the group statistics
    and in the metrics instead of failing the run."""
    cfg = grpo_config(tmp_path, num_generations=2, max_steps=2, reward_weights=[0.7, 0.3])
    trainer = GRPOTrainer(
        build_tiny_causal_lm(tiny_tokenizer),
        [number, even_only],
        cfg,
        prompt_dataset(2, numbered=True),
        processing_class=tiny_tokenizer,
    )
    last = train_and_last_log(trainer)
    assert (last["rewards/even_only/mean"], last["rewards/even_only/std"]) == (1.0, 0.0)
    assert last["rewards/number/mean"] == pytest.approx(0.5)
    assert last["reward"] == pytest.approx(0.5)
    # every group holds one prompt: number is constant in it, even_only too, so no learning signal
    assert last["frac_reward_zero_std"] == 1.0
    assert math.isfinite(last["loss/policy_avg"])


def test_eval_steps_with_num_generations_eval(tmp_path, tiny_tokenizer):
    """TRL >= 0.21's evaluation settings: eval_strategy="steps" evaluates every eval_steps rollout batches
    (one greedy completion per eval prompt, so num_generations_eval=1 is what runs); other values are refused."""
    trainer = RLOOTrainer(
        model=build_tiny_causal_lm(tiny_tokenizer),
        reward_funcs=length,
        args=RLOOConfig(
            output_dir=str(tmp_path / "eval"),
            per_device_train_batch_size=3,
            per_device_eval_batch_size=3,
            num_generations=3,
            max_completion_length=4,
            num_iterations=1,
            num_generations_eval=1,
            eval_strategy="steps",
            eval_steps=2,
            max_steps=2,
            report_to="none",
            num_sample_generations=0,
            save_steps=0,
        ),
        train_dataset=prompt_dataset(4),
        eval_dataset=prompt_dataset(3),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    evals = [e for e in trainer.state.log_history if "eval_objective/scores" in e]
    assert [e["step"] for e in evals] == [2]
    # the score is the mean length in characters of the 3 greedy completions, each of 1 to 4 tokens
    assert evals[0]["eval_completions/mean_length"] <= 4 and evals[0]["eval_objective/scores"] > 0
    assert trainer.state.log_history[-1]["train_loss"] is not None
    with pytest.raises(ConfigError, match="num_generations_eval=2: .*one greedy completion"):
        RLOOConfig(num_generations_eval=2)


def test_conversational_prompts_give_reward_functions_messages(tmp_path, tiny_tokenizer):
    """TRL >= 0.21's form: with a conversational prompt, a reward function gets the prompt's messages and
    each completion as [{"role": "assistant", "content": text}]; a TRL 0.19-style call keeps the texts."""
    seen = {}

    def content_length(prompts, completions, **kwargs):
        seen.setdefault("prompts", prompts)
        seen.setdefault("completions", completions)
        assert "prompt_messages" not in kwargs
        return [float(len(completion[0]["content"])) for completion in completions]

    args = dict(per_device_train_batch_size=4, max_completion_length=6, num_iterations=1, max_steps=1)
    args = RLOOConfig(output_dir=str(tmp_path / "chat"), learning_rate=1e-3, report_to="none", save_steps=0, **args)
    model = build_tiny_causal_lm(tiny_tokenizer)
    before = flat(model).clone()
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=content_length,
        args=args,
        train_dataset=word_prompts(2, conversational=True),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    prompts, completions = seen["prompts"], seen["completions"]
    assert len(prompts) == len(completions) == 4
    assert sorted(p[0]["content"] for p in prompts) == ["Hello world"] * 2 + ["The quick brown fox"] * 2
    assert all(p[0]["role"] == "user" and len(p) == 1 for p in prompts)
    assert all(len(c) == 1 and c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in completions)
    assert not torch.equal(before, flat(trainer.policy))

    # TRL 0.19's call: the rendered prompt text and the completion text
    texts = {}

    def text_reward(prompts, completions, **kwargs):
        texts.setdefault("prompt", prompts[0])
        texts.setdefault("completion", completions[0])
        return [float(len(c)) for c in completions]

    config = rloo_config(tmp_path, "chat019", max_steps=1)
    RLOOTrainer(
        config,
        tiny_tokenizer,
        build_tiny_causal_lm(tiny_tokenizer),
        None,
        text_reward,
        word_prompts(2, conversational=True),
    ).train()
    assert isinstance(texts["prompt"], str) and texts["prompt"].endswith("assistant:")
    assert isinstance(texts["completion"], str)
