"""TRL >= 0.21's RLOO API on posttrain's RLOO: the GRPO-style RLOOConfig names (num_generations, beta,
max_completion_length, epsilon, num_iterations, normalize_advantages) and the RLOOTrainer(model=,
reward_funcs=, args=, ...) call give the run of TRL 0.19's names and call."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import flat, letter_fraction, prompt_dataset
from posttrain import cli
from posttrain.configs import ConfigError
from posttrain.testing import build_tiny_causal_lm
from posttrain.trainers.rloo import RLOOTrainer
from posttrain.trainers.rloo_config import TRL_1X_NAMES, RLOOConfig

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = dict(
    num_generations=4, beta=0.1, max_completion_length=16, epsilon=0.3, num_iterations=2, normalize_advantages=True
)
OLD = dict(rloo_k=4, kl_coef=0.1, response_length=16, cliprange=0.3, num_ppo_epochs=2, normalize_advantage=True)


# -- RLOOConfig -------------------------------------------------------------------------------------


def test_trl_1x_names_set_the_trl_019_fields():
    new, old = RLOOConfig(**NEW), RLOOConfig(**OLD)
    assert (new.rloo_k, new.kl_coef, new.response_length, new.cliprange, new.num_ppo_epochs) == (4, 0.1, 16, 0.3, 2)
    assert new.normalize_advantage is True
    # what the trainer derives from them: 4 samples per prompt, 2 optimizer steps per rollout batch
    assert (new.samples_per_prompt, new.optimizer_steps_per_rollout) == (4, 2)
    # every other field equals the TRL 0.19-named config's
    for f in dataclasses.fields(RLOOConfig):
        if f.name not in TRL_1X_NAMES:
            assert getattr(new, f.name) == getattr(old, f.name), f.name
    # the new names keep what was given; unset, they are None and the TRL 0.19 defaults stand
    assert {name: getattr(new, name) for name in TRL_1X_NAMES} == NEW
    default = RLOOConfig()
    assert all(getattr(default, name) is None for name in TRL_1X_NAMES)
    assert (default.rloo_k, default.kl_coef, default.response_length, default.cliprange) == (2, 0.05, 53, 0.2)
    assert (default.num_ppo_epochs, default.normalize_advantage) == (4, False)
    # beta=0 turns the KL term off as kl_coef=0 does
    assert RLOOConfig(beta=0.0).kl_coef == 0.0


@pytest.mark.parametrize("new, old", list(TRL_1X_NAMES.items()))
def test_both_names_with_different_values_is_an_error(new, old):
    # (a TRL 0.19 field at its default yields to the new name, so the bool pair conflicts the other way)
    given, other = (False, True) if old == "normalize_advantage" else (NEW[new], OLD[old] + 1)
    with pytest.raises(ConfigError, match=rf"{new}={given!r} and {old}={other!r} .*give only one"):
        RLOOConfig(**{new: given, old: other})
    # the same value under both names is fine
    assert getattr(RLOOConfig(**{new: NEW[new], old: OLD[old]}), old) == OLD[old]


@pytest.mark.parametrize(
    "values, name",
    [
        (dict(num_generations=1), "num_generations=1"),
        (dict(beta=-0.1), "beta=-0.1"),
        (dict(max_completion_length=0), "max_completion_length=0"),
        (dict(epsilon=0.0), "epsilon=0.0"),
        (dict(num_iterations=0), "num_iterations=0"),
        (dict(reward_clip_range=(1.0, -1.0)), r"reward_clip_range=\(1.0, -1.0\): a clip of the raw rewards"),
        (dict(reward_clip_range=(-1.0, 1.0), normalize_reward=True), r"reward_clip_range=\(-1.0, 1.0\) with norm"),
    ],
)
def test_bad_values_are_refused_under_the_name_given(values, name):
    with pytest.raises(ConfigError, match=name):
        RLOOConfig(**values)


def test_reward_clip_range_pair_on_the_command_line():
    assert cli.parse_config("rloo", ["--reward_clip_range=-1,1"]).reward_clip_range == (-1.0, 1.0)
    assert cli.parse_config("rloo", ["--reward_clip_range", "[0, 2.5]"]).reward_clip_range == (0.0, 2.5)
    assert cli.parse_config("rloo", ["--reward_clip_range", "3", "--normalize_reward"]).reward_clip_range == 3.0
    with pytest.raises(ConfigError, match=r"reward_clip_range='a,b': give a float c"):
        RLOOConfig(reward_clip_range="a,b")


def test_trl_1x_names_on_the_command_line(capsys):
    flags = "--num_generations 4 --beta 0.1 --max_completion_length 16 --epsilon 0.3 --num_iterations 2"
    config = cli.parse_config("rloo", [*flags.split(), "--normalize_advantages"])
    assert (config.rloo_k, config.kl_coef, config.response_length, config.cliprange, config.num_ppo_epochs) == (
        4,
        0.1,
        16,
        0.3,
        2,
    )
    assert config.normalize_advantage is True
    with pytest.raises(SystemExit) as refused:
        cli.parse_config("rloo", ["--num_generations", "4", "--rloo_k", "3"])
    assert refused.value.code == 2
    assert "num_generations=4 and rloo_k=3" in capsys.readouterr().err
    text = cli.build_parser("rloo", RLOOConfig).format_help()
    assert "--num_generations" in text and "TRL >= 0.21 name of rloo_k" in text


# -- RLOOTrainer ------------------------------------------------------------------------------------


def reward_1x(completions, **kwargs):
    """A reward function in TRL >= 0.21's form (prompts and dataset columns as keywords)."""
    return letter_fraction(kwargs["prompts"], completions)


def logs_and_weights(trainer: RLOOTrainer) -> tuple[list[dict], torch.Tensor]:
    """The two logged steps (max_steps=2, one optimizer step per rollout batch) without the timing, and the
    trained weights. The per-reward metrics rewards/<function name>/... are renamed rewards/<i>/..."""
    trainer.train()
    history = trainer.state.log_history
    assert [e["step"] for e in history] == [1, 2, 2] and "train_runtime" in history[2]
    names = {f"rewards/{name}/": f"rewards/{i}/" for i, name in enumerate(trainer.reward.names)}

    def renamed(key: str) -> str:
        return next((key.replace(a, b) for a, b in names.items() if key.startswith(a)), key)

    return [{renamed(k): v for k, v in e.items() if k != "eps"} for e in history[:2]], flat(trainer.policy)


def test_trl_1x_call_trains_like_the_trl_019_call(tmp_path, tiny_tokenizer):
    common = dict(
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to="none",
        num_sample_generations=0,
        save_steps=0,
        temperature=1.0,
        max_steps=2,
        seed=3,
    )
    old_cfg = RLOOConfig(
        output_dir=str(tmp_path / "old"), rloo_k=2, kl_coef=0.2, response_length=6, num_ppo_epochs=1, **common
    )
    new_cfg = dict(num_generations=2, beta=0.2, max_completion_length=6, num_iterations=1, epsilon=0.2, **common)
    old = RLOOTrainer(
        old_cfg, tiny_tokenizer, build_tiny_causal_lm(tiny_tokenizer), None, letter_fraction, prompt_dataset()
    )
    new = RLOOTrainer(
        model=build_tiny_causal_lm(tiny_tokenizer),
        reward_funcs=reward_1x,
        args=RLOOConfig(output_dir=str(tmp_path / "new"), **new_cfg),
        train_dataset=prompt_dataset(),
        processing_class=tiny_tokenizer,
        reward_processing_classes=[None],
    )
    # TRL >= 0.21's positional form: model, reward_funcs, then keywords
    positional = RLOOTrainer(
        build_tiny_causal_lm(tiny_tokenizer),
        [reward_1x],
        args=RLOOConfig(output_dir=str(tmp_path / "positional"), **new_cfg),
        train_dataset=prompt_dataset(),
        processing_class=tiny_tokenizer,
    )
    old_logs, old_weights = logs_and_weights(old)
    # step 2 samples from the updated policy: a KL penalty of beta = kl_coef = 0.2 is in the reward
    second = old_logs[1]
    assert second["objective/kl"] != 0.0
    assert second["objective/non_score_reward"] == pytest.approx(-0.2 * second["objective/kl"])
    for trainer in (new, positional):
        logs, weights = logs_and_weights(trainer)
        assert logs == old_logs
        assert torch.equal(weights, old_weights)
    assert not torch.equal(old_weights, flat(build_tiny_causal_lm(tiny_tokenizer)))


def test_old_and_new_argument_names_together_are_an_error(tiny_tokenizer):
    cfg = RLOOConfig(output_dir="unused")
    with pytest.raises(TypeError, match="config= .* and args= "):
        RLOOTrainer(cfg, tiny_tokenizer, args=cfg)
    with pytest.raises(TypeError, match="reward_model= .* and reward_funcs= "):
        RLOOTrainer("some/model", letter_fraction, reward_model=letter_fraction)
    with pytest.raises(ConfigError, match="args must be an RLOOConfig"):
        RLOOTrainer(model="some/model", reward_funcs=letter_fraction, args=object())


def test_a_missing_train_dataset_is_refused_in_trls_words(tmp_path):
    """TRL's message (its test suite matches "`train_dataset` is required"), raised before a model loads:
    the model name here does not exist."""
    cfg = RLOOConfig(output_dir=str(tmp_path / "out"), report_to="none")
    with pytest.raises(ValueError, match="`train_dataset` is required: pass a prompt dataset"):
        RLOOTrainer(model="no/such-model", reward_funcs=letter_fraction, args=cfg)
    assert not (tmp_path / "out").exists()
