"""The one loader of the online trainers (online.load_parts), seen from the Python API: TRL's
constructor conveniences and a reward model saved without a tokenizer, for every online trainer."""

from __future__ import annotations

import pytest
from datasets import Dataset

from helpers import count_e, train_and_last_log
from posttrain.testing import build_tiny_causal_lm, build_tiny_reward_model
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
from posttrain.trainers.ppo import PPOConfig, PPOTrainer
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer
from posttrain.trainers.xpo import XPOConfig, XPOTrainer

PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time", "Thank you very much"] * 2


def prompts():
    return Dataset.from_dict({"prompt": PROMPTS})


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if any policy is loaded (checks that must run before the models load)."""
    import posttrain.models as models

    def no_model_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(models, "load_policy", no_model_loading)


def test_no_config_and_no_tokenizer_give_trls_defaults(tmp_path, monkeypatch, tiny_policy_dir, tiny_tokenizer):
    """args=None: the trainer's config with output_dir f"{last part of the model path}-{Algo}" (TRL's
    default); processing_class=None: the tokenizer saved with the model; the model given by path."""
    monkeypatch.chdir(tmp_path)
    path = str(tiny_policy_dir)
    builds = {
        "RLOO": lambda: RLOOTrainer(policy=path, reward_model=count_e, train_dataset=prompts()),
        "GRPO": lambda: GRPOTrainer(model=path, reward_funcs=count_e, train_dataset=prompts()),
        "PPO": lambda: PPOTrainer(model=path, reward_model=count_e, train_dataset=prompts()),
        "OnlineDPO": lambda: OnlineDPOTrainer(model=path, reward_funcs=count_e, train_dataset=prompts()),
        "XPO": lambda: XPOTrainer(model=path, reward_model=count_e, train_dataset=prompts()),
    }
    for algo, build in builds.items():
        trainer = build()
        assert trainer.args.output_dir == f"{tiny_policy_dir.name}-{algo}", algo
        assert trainer.processing_class.get_vocab() == tiny_tokenizer.get_vocab(), algo
        assert trainer.policy_model.config.vocab_size == len(tiny_tokenizer), algo


def test_a_reward_model_saved_without_its_tokenizer_shares_the_policys(tmp_path, tiny_tokenizer):
    """Only the weights were saved: every trainer loads the reward model by path and scores the
    policy's tokens directly (no second tokenizer, no re-tokenization)."""
    reward_dir = tmp_path / "rm"
    build_tiny_reward_model(tiny_tokenizer, seed=1).save_pretrained(reward_dir)
    assert not (reward_dir / "tokenizer_config.json").exists()
    common = dict(
        per_device_train_batch_size=4,
        total_episodes=4,
        response_length=4,
        report_to="none",
        num_sample_generations=0,
        save_steps=0,
    )

    def policy():
        return build_tiny_causal_lm(tiny_tokenizer)

    rm = str(reward_dir)
    trainers = {
        "rloo": RLOOTrainer(
            RLOOConfig(output_dir=str(tmp_path / "rloo"), **common), tiny_tokenizer, policy(), None, rm, prompts()
        ),
        "grpo": GRPOTrainer(
            policy(),
            rm,
            GRPOConfig(output_dir=str(tmp_path / "grpo"), num_generations=2, **common),
            prompts(),
            processing_class=tiny_tokenizer,
        ),
        "ppo": PPOTrainer(
            args=PPOConfig(output_dir=str(tmp_path / "ppo"), **common),
            processing_class=tiny_tokenizer,
            model=policy(),
            reward_model=rm,
            train_dataset=prompts(),
        ),
        "online_dpo": OnlineDPOTrainer(
            policy(),
            reward_model=rm,
            args=OnlineDPOConfig(output_dir=str(tmp_path / "dpo"), **common),
            processing_class=tiny_tokenizer,
            train_dataset=prompts(),
        ),
        "xpo": XPOTrainer(
            policy(),
            reward_model=rm,
            args=XPOConfig(output_dir=str(tmp_path / "xpo"), **common),
            processing_class=tiny_tokenizer,
            train_dataset=prompts(),
        ),
    }
    for algo, trainer in trainers.items():
        source = trainer.feedback.reward if algo in ("online_dpo", "xpo") else trainer.reward
        assert len(source.models) == 1 and source.reward_tokenizer is None, algo
        assert source.models[0].config.pad_token_id == tiny_tokenizer.pad_token_id, algo
    last = train_and_last_log(trainers["grpo"])
    assert last["objective/scores"] == last["objective/scores"]  # a number: the reward model scored


def test_total_episodes_smaller_than_one_batch_runs_one_batch(tmp_path, tiny_tokenizer):
    cfg = RLOOConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        total_episodes=2,
        num_ppo_epochs=1,
        response_length=4,
        report_to="none",
        num_sample_generations=0,
        save_steps=0,
    )
    with pytest.warns(UserWarning, match=r"total_episodes=2 is smaller than one rollout batch \(4 completions\)"):
        trainer = RLOOTrainer(cfg, tiny_tokenizer, build_tiny_causal_lm(tiny_tokenizer), None, count_e, prompts())
    assert (trainer.args.total_episodes, trainer.args.num_total_batches) == (4, 1)
    trainer.train()
    assert trainer.run.progress.episode == 4 and trainer.run.progress.optimizer_steps == 1


def test_a_stop_token_outside_the_vocabulary_is_refused_before_models_load(tmp_path, tiny_policy_dir, no_model_loads):
    from posttrain import RLOOConfig
    from posttrain.configs import ConfigError
    from posttrain.trainers.online import load_parts

    config = RLOOConfig(output_dir=str(tmp_path / "out"), model_name_or_path=str(tiny_policy_dir), stop_token_id=10**6)
    with pytest.raises(ConfigError, match=r"stop_token_id=1000000 is outside the tokenizer's vocabulary"):
        load_parts(
            config,
            rewards=[lambda prompts, completions, **kw: [0.0] * len(completions)],
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        )


def test_a_missing_train_dataset_is_refused_before_models_load(tmp_path, tiny_policy_dir, no_model_loads):
    from posttrain.configs import ConfigError
    from posttrain.trainers.online import load_parts

    config = RLOOConfig(output_dir=str(tmp_path / "out"), model_name_or_path=str(tiny_policy_dir))
    with pytest.raises(ConfigError, match=r"`train_dataset` is required: pass a prompt dataset \(or --dataset_name"):
        load_parts(config, rewards=[lambda prompts, completions, **kw: [0.0] * len(completions)])


def test_a_prompt_dataset_without_a_prompt_column_is_refused_before_models_load(
    tmp_path, tiny_policy_dir, no_model_loads
):
    """A data file whose prompts sit under another name fails with the column, the columns it has and
    the fix, before the policy (or any other model) loads; an empty dataset likewise."""
    import json

    from posttrain.data.loading import DataError
    from posttrain.trainers.online import load_parts

    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in PROMPTS))
    config = RLOOConfig(
        output_dir=str(tmp_path / "out"), model_name_or_path=str(tiny_policy_dir), dataset_name=str(data)
    )
    count = [lambda prompts, completions, **kw: [0.0] * len(completions)]
    with pytest.warns(UserWarning, match="no 'test' split"):
        with pytest.raises(
            DataError, match=r"field 'prompt': missing column\(s\) \['prompt'\].*available columns: \['text'\]"
        ):
            load_parts(config, rewards=count)
    from datasets import Dataset

    with pytest.raises(DataError, match="train_dataset: the dataset is empty"):
        load_parts(config, rewards=count, train_dataset=Dataset.from_dict({"prompt": []}))


def test_impossible_batch_arithmetic_is_refused_before_models_load(tmp_path, tiny_policy_dir, no_model_loads):
    """3 completions per device cannot hold whole groups of rloo_k = 2: the ConfigError comes before the
    policy loads, and the config the user passed is not changed by the early check."""
    from posttrain.configs import ConfigError
    from posttrain.trainers.online import load_parts

    count = [lambda prompts, completions, **kw: [0.0] * len(completions)]
    config = RLOOConfig(
        output_dir=str(tmp_path / "out"),
        model_name_or_path=str(tiny_policy_dir),
        per_device_train_batch_size=3,
        rloo_k=2,
        num_sample_generations=0,
    )
    with pytest.raises(ConfigError, match=r"= 3 completions per device must be divisible by the samples per prompt"):
        load_parts(config, rewards=count, train_dataset=prompts())
    assert config.total_episodes is None and getattr(config, "batch_size", None) is None


def test_a_dataset_without_its_test_split_warns_once_how_to_get_the_sample_tables_back(tmp_path, tiny_tokenizer):
    """A data file holds only a "train" split: the run trains, draws no sample table, and says so
    once, naming the split and the flags that bring the tables back."""
    import json
    import warnings

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))

    def config(out, num_sample_generations):
        return RLOOConfig(
            output_dir=str(tmp_path / out),
            dataset_name=str(data),
            per_device_train_batch_size=4,
            total_episodes=8,
            rloo_k=2,
            response_length=4,
            report_to="none",
            save_steps=0,
            num_sample_generations=num_sample_generations,
        )

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = RLOOTrainer(config("run", 2), tiny_tokenizer, build_tiny_causal_lm(tiny_tokenizer), None, count_e)
        trainer.train()
    about_tables = [str(w.message) for w in caught if "sample tables" in str(w.message)]
    assert about_tables == [
        f"the dataset {str(data)!r} has no 'test' split (--dataset_test_split test), so this run draws no sample "
        "tables of completions and cannot evaluate. To get them back, pass --dataset_test_split <split> naming a "
        "split the dataset has, or eval_dataset= in Python; --num_sample_generations 0 turns the tables, and this "
        "warning, off."
    ]
    assert trainer.eval_dataset is None and trainer.state.global_step == 2
    assert not (tmp_path / "run" / "samples.jsonl").exists()

    # No tables asked for: nothing to warn about.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RLOOTrainer(config("quiet", 0), tiny_tokenizer, build_tiny_causal_lm(tiny_tokenizer), None, count_e)
    assert not [w for w in caught if "sample tables" in str(w.message)]
