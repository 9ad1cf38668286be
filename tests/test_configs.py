"""Config derivations and validation errors (no model is loaded for any of these)."""

import pytest

from posttrain.configs import ConfigError, OnPolicyConfig, TrainingConfig


def test_derived_sizes_match_the_documented_formulas():
    # per_device 4 × GA 2 × num_mini_batches 2 = 16 completions per device; × 3 processes = 48 per rollout.
    c = OnPolicyConfig(
        per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=2, total_episodes=1000
    )
    c.derive_sizes(world_size=3)
    assert c.local_batch_size == 16
    assert c.batch_size == 48
    assert c.local_mini_batch_size == 8
    assert c.mini_batch_size == 24
    assert c.micro_batch_size == 12
    # ceil(1000 / 48) = 21 rollout batches.
    assert c.num_total_batches == 21


def test_total_episodes_defaults_to_epochs_times_dataset():
    c = OnPolicyConfig(per_device_train_batch_size=4, num_train_epochs=2)
    c.derive_sizes(world_size=1, dataset_size=100)
    assert c.total_episodes == 200
    assert c.num_total_batches == 50


def test_samples_per_prompt_must_divide_the_local_batch():
    class K3(OnPolicyConfig):
        @property
        def samples_per_prompt(self) -> int:
            return 3

    c = K3(per_device_train_batch_size=4, total_episodes=100)
    with pytest.raises(ConfigError, match=r"16|4.*divisible by the samples per prompt \(3\)"):
        c.derive_sizes(1)


def test_total_episodes_smaller_than_one_batch_names_both_numbers():
    c = OnPolicyConfig(per_device_train_batch_size=64, total_episodes=10)
    with pytest.raises(ConfigError, match=r"total_episodes \(10\).*batch_size = 64"):
        c.derive_sizes(1)


def test_missing_total_episodes_without_dataset_is_explained():
    with pytest.raises(ConfigError, match="total_episodes"):
        OnPolicyConfig().derive_sizes(1)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"warmup_ratio": 1.5}, "warmup_ratio"),
        ({"report_to": ["mlflow"]}, "report_to"),
        ({"bf16": True, "fp16": True}, "bf16"),
    ],
)
def test_training_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        TrainingConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"stop_token": "eot"}, "stop_token"),
        ({"stop_token": "eos", "stop_token_id": 3}, "stop_token_id"),
        ({"num_mini_batches": 0}, "num_mini_batches"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"prompt_overflow": "cut"}, "prompt_overflow"),
    ],
)
def test_on_policy_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        OnPolicyConfig(**kwargs)


def test_sft_model_path_and_model_name_default_to_each_other():
    assert OnPolicyConfig(model_name_or_path="m").sft_model_path == "m"
    assert OnPolicyConfig(sft_model_path="s").model_name_or_path == "s"


def test_report_to_accepts_comma_separated_string():
    assert TrainingConfig(report_to="tensorboard,wandb").report_to == ["tensorboard", "wandb"]


def test_warmup_steps_override_ratio():
    assert TrainingConfig(warmup_ratio=0.1).warmup_for(100) == 10
    assert TrainingConfig(warmup_ratio=0.1, warmup_steps=3).warmup_for(100) == 3


def test_to_dict_includes_derived_sizes():
    c = OnPolicyConfig(total_episodes=64, per_device_train_batch_size=8).derive_sizes(2)
    d = c.to_dict()
    assert d["batch_size"] == 16 and d["num_total_batches"] == 4 and d["learning_rate"] == 3e-6


def test_truncated_sampling_warns_that_updates_are_off_policy():
    with pytest.warns(UserWarning, match="off-policy"):
        OnPolicyConfig(top_k=5)
