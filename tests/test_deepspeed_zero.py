"""DeepSpeed ZeRO-2/3 without the deepspeed package: the inference config of frozen models, where the
trainers place them, the one parameter gather per generation, the 16-bit export and the config-time
checks. A stand-in `deepspeed` module records what posttrain asks of DeepSpeed (CI does not install it)."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
from torch import nn

from helpers import online_trainer
from posttrain import distributed as dist
from posttrain.configs import ConfigError

TRAIN_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "train_batch_size": 16,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": 5,
        "stage3_param_persistence_threshold": 6,
        "stage3_prefetch_bucket_size": 7,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def test_stage3_inference_config_drops_the_optimizer_and_sizes_buckets_from_the_hidden_size():
    config = dist.deepspeed_inference_config(TRAIN_CONFIG, hidden_size=896)
    assert config == {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "train_batch_size": 16,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 802816,  # 896²
            "stage3_param_persistence_threshold": 8960,  # 10 · 896
            "stage3_prefetch_bucket_size": 722534,  # int(0.9 · 896²) = int(722534.4)
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }
    assert TRAIN_CONFIG["zero_optimization"]["reduce_bucket_size"] == 5 and "optimizer" in TRAIN_CONFIG


def test_stage2_and_unknown_hidden_size_keep_the_training_buckets():
    zero2 = {**TRAIN_CONFIG, "zero_optimization": {"stage": 2, "reduce_bucket_size": 5}}
    assert dist.deepspeed_inference_config(zero2, hidden_size=896)["zero_optimization"] == {
        "stage": 2,
        "reduce_bucket_size": 5,
    }
    kept = dist.deepspeed_inference_config(TRAIN_CONFIG, hidden_size=None)
    assert kept["zero_optimization"] == TRAIN_CONFIG["zero_optimization"]
    assert "optimizer" not in kept and "scheduler" not in kept


def test_hidden_size_is_read_from_the_model_config(tiny_policy):
    assert dist.model_hidden_size(tiny_policy) == tiny_policy.config.hidden_size == 32
    staged = nn.Linear(2, 2)
    staged.config = types.SimpleNamespace(hidden_sizes=[64, 128, 320], hidden_size=None)
    assert dist.model_hidden_size(staged) == 320
    assert dist.model_hidden_size(nn.Linear(2, 2)) is None


def fake_accelerator(stage, ds_config=None, models=()):
    plugin = None if stage is None else types.SimpleNamespace(zero_stage=stage, deepspeed_config=ds_config or {})
    return types.SimpleNamespace(
        state=types.SimpleNamespace(deepspeed_plugin=plugin),
        device=torch.device("cpu"),
        num_processes=1,
        _models=list(models),
        unwrap_model=lambda m: getattr(m, "module", m),
    )


@pytest.fixture
def fake_deepspeed(monkeypatch):
    """A stand-in `deepspeed` module: records initialize() calls and parameter gathers."""
    record = types.SimpleNamespace(initialized=[], gathers=0, inside_gather=False)

    class Engine(nn.Module):
        def __init__(self, module, config):
            super().__init__()
            self.module, self.config_given = module, config

    def initialize(model, config):
        record.initialized.append((model, config))
        return Engine(model, config), None, None, None

    @contextlib.contextmanager
    def gathered(params):
        assert len(list(params)) > 0
        record.gathers += 1
        record.inside_gather = True
        yield
        record.inside_gather = False

    module = types.SimpleNamespace(initialize=initialize, zero=types.SimpleNamespace(GatheredParameters=gathered))
    monkeypatch.setitem(sys.modules, "deepspeed", module)
    return record


@pytest.mark.parametrize("stage", [None, 2])
def test_frozen_models_without_zero3_are_placed_whole_with_no_engine(stage, tiny_tokenizer, fake_deepspeed):
    from posttrain.testing import build_tiny_reward_model

    model = build_tiny_reward_model(tiny_tokenizer).train()
    accelerator = None if stage is None else fake_accelerator(stage, TRAIN_CONFIG)
    assert dist.prepare_frozen(model, accelerator) is model
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert fake_deepspeed.initialized == []
    assert dist.prepare_frozen(None, accelerator) is None  # no reference (PEFT: the adapter disabled)
    assert dist.prepare_frozen(len, accelerator) is len  # reward functions pass through


def test_frozen_models_under_zero3_get_an_inference_engine(tiny_tokenizer, fake_deepspeed):
    from posttrain.testing import build_tiny_reward_model

    model = build_tiny_reward_model(tiny_tokenizer).train()
    engine = dist.prepare_frozen(model, fake_accelerator(3, TRAIN_CONFIG))
    [(given, config)] = fake_deepspeed.initialized
    assert given is model and engine.module is model and not engine.training
    assert not any(p.requires_grad for p in model.parameters())
    assert config == dist.deepspeed_inference_config(TRAIN_CONFIG, hidden_size=32)
    assert config["zero_optimization"]["reduce_bucket_size"] == 1024  # 32²


def test_the_trainers_place_reference_and_reward_models_through_one_function(tmp_path, tiny_tokenizer, monkeypatch):
    from posttrain.testing import build_tiny_reward_model

    placed = []
    real = dist.prepare_frozen
    monkeypatch.setattr(dist, "prepare_frozen", lambda m, acc: placed.append(m) or real(m, acc))
    reward = build_tiny_reward_model(tiny_tokenizer)
    for algo in ("grpo", "ppo", "rloo", "online_dpo"):
        placed.clear()
        trainer = online_trainer(algo, tmp_path / algo, tiny_tokenizer, reward=reward)
        frozen = [m for m in placed if isinstance(m, nn.Module)]
        assert any(m is reward for m in frozen), algo
        assert any(m is trainer.ref_model for m in frozen), algo  # the reference is on the run's device
        assert not trainer.ref_model.training and not reward.training


class Offload:
    """The part of a ZeRO-3 engine that owns the per-module fetch/release hooks."""

    def __init__(self, module):
        self.module, self.forward_hooks, self.backward_hooks, self.registered = module, [], [], 0
        self._register_deepspeed_module(module)

    def _register_deepspeed_module(self, module):
        self.registered += 1
        self.forward_hooks = [m.register_forward_pre_hook(lambda *a: None) for m in module.modules()]


def test_generation_under_zero3_gathers_once_with_the_hooks_off(fake_deepspeed):
    policy = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    engine = types.SimpleNamespace(
        module=policy, zero_optimization_stage=lambda: 3, parameters=policy.parameters, optimizer=None
    )
    engine.optimizer = types.SimpleNamespace(parameter_offload=Offload(policy))
    offload = engine.optimizer.parameter_offload
    with dist.unwrap_for_generation(engine, fake_accelerator(3)) as model:
        assert model is policy and fake_deepspeed.inside_gather
        assert offload.forward_hooks == [] and not any(m._forward_pre_hooks for m in policy.modules())
    assert fake_deepspeed.gathers == 1 and offload.registered == 2
    assert all(len(m._forward_pre_hooks) == 1 for m in policy.modules())
    # PPO samples from the bare policy inside its engine: the engine holding it has its hooks taken off.
    wrapper = nn.ModuleDict({"policy": policy, "critic": nn.Linear(4, 1)})
    outer = types.SimpleNamespace(module=wrapper, zero_optimization_stage=lambda: 3, optimizer=Offload(wrapper))
    with dist.unwrap_for_generation(policy, fake_accelerator(3, models=[outer])) as model:
        assert model is policy and outer.optimizer.forward_hooks == [] and fake_deepspeed.gathers == 2
    assert outer.optimizer.registered == 2
    with dist.unwrap_for_generation(engine, fake_accelerator(3), gather_deepspeed3_params=False) as model:
        assert model is policy and not fake_deepspeed.inside_gather
    with dist.unwrap_for_generation(engine, fake_accelerator(2)) as model:
        assert model is policy
    assert fake_deepspeed.gathers == 2 and offload.registered == 2


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_one_generation_gather_per_rollout(algo, tmp_path, tiny_tokenizer, monkeypatch):
    calls = []
    real = dist.unwrap_for_generation

    def counting(model, accelerator, gather=True):
        calls.append(gather)
        return real(model, accelerator, gather)

    monkeypatch.setattr(dist, "unwrap_for_generation", counting)
    trainer = online_trainer(algo, tmp_path, tiny_tokenizer, save_strategy="no")
    trainer.train()
    assert calls == [True, True]  # total_episodes 8 = 2 rollouts of 4 completions


def test_zero3_export_gathers_the_trained_part_from_its_engine():
    policy, critic = nn.Linear(2, 2), nn.Linear(2, 1)
    wrapper = nn.ModuleDict({"policy": policy, "critic": critic})
    full = {f"{k}": torch.full(v.shape, float(i)) for i, (k, v) in enumerate(wrapper.state_dict().items())}
    gather = types.SimpleNamespace(on=True)
    engine = types.SimpleNamespace(module=wrapper, zero_gather_16bit_weights_on_model_save=lambda: gather.on)
    accelerator = fake_accelerator(3, models=[engine])
    accelerator.get_state_dict = lambda model: full if model is engine else pytest.fail("not the engine")
    assert dist.zero3_state_dict(policy, accelerator) == {"weight": full["policy.weight"], "bias": full["policy.bias"]}
    assert dist.zero3_state_dict(critic, accelerator).keys() == {"weight", "bias"}
    assert dist.zero3_state_dict(wrapper, accelerator) is full
    assert dist.zero3_state_dict(engine, accelerator) is full  # SFT and reward training pass the engine
    with pytest.raises(ValueError, match="Linear is not part of a model prepared by this accelerator"):
        dist.zero3_state_dict(nn.Linear(2, 2), accelerator)
    gather.on = False
    with pytest.raises(ConfigError, match="stage3_gather_16bit_weights_on_model_save: true"):
        dist.zero3_state_dict(policy, accelerator)


def test_zero3_without_the_16bit_gather_is_refused_before_training(monkeypatch):
    from posttrain.configs import TrainingConfig

    monkeypatch.setattr(dist, "require_deepspeed", lambda: None)
    with pytest.raises(ConfigError, match='"stage3_gather_16bit_weights_on_model_save": true to "zero_optimization"'):
        TrainingConfig(deepspeed={"zero_optimization": {"stage": 3}})
    TrainingConfig(deepspeed={"zero_optimization": {"stage": 2}})
    TrainingConfig(deepspeed={"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}})
    # An accelerate launch config (passed on in the environment).
    for name in ("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(ConfigError, match="zero3_save_16bit_model: true under deepspeed_config"):
        dist.check_zero3_export(None)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "true")
    dist.check_zero3_export(None)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL")
    dist.check_zero3_export(None)


def test_the_example_accelerate_configs_are_valid_for_accelerate_and_the_trainers():
    from pathlib import Path

    from accelerate.commands.config.config_args import ClusterConfig

    root = Path(__file__).resolve().parents[1]
    for stage in (2, 3):
        # accelerate's own reader (what `accelerate launch --config_file` uses): unknown keys raise.
        config = ClusterConfig.from_yaml_file(root / f"examples/accelerate_configs/deepspeed_zero{stage}.yaml")
        assert config.distributed_type.value == "DEEPSPEED" and config.deepspeed_config["zero_stage"] == stage
        # ZeRO-3 saves a final model transformers loads only with the 16-bit gather on.
        assert stage == 2 or config.deepspeed_config["zero3_save_16bit_model"] is True
