"""transformers' device and launch fields, as every trainer builds its accelerator from them
(posttrain.distributed.accelerator_for): use_cpu / no_cuda, tf32, torch_empty_cache_steps, the ddp_*
fields, accelerator_config, fsdp / fsdp_config and deepspeed.

Here the FSDP plugin is built from the flags and checked field by field, and a one-process run with
--fsdp is a clear error (sharded runs of several CPU processes: tests/test_fsdp.py).
"""

from __future__ import annotations

import copy
import json
import os
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from posttrain import distributed
from posttrain.configs import ConfigError, TrainingConfig
from posttrain.testing import build_tiny_causal_lm


@pytest.fixture(autouse=True)
def fresh_accelerator_state(monkeypatch):
    """accelerate's state is a process-wide singleton: each test builds its own and leaves none behind
    (nor the ACCELERATE_USE_* variables accelerate sets when given a plugin)."""
    from accelerate.state import AcceleratorState, GradientState

    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.setenv(name, "false")  # recorded, so the original state comes back afterwards
        monkeypatch.delenv(name)
    monkeypatch.setattr(distributed, "_ENV_SET_HERE", set())
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# -- use_cpu, DDP kwargs, process group ----------------------------------------------------------------


def test_ddp_fields_become_accelerate_kwargs_handlers(monkeypatch):
    config = TrainingConfig(
        use_cpu=True,
        ddp_backend="gloo",
        ddp_timeout=120,
        ddp_find_unused_parameters=True,
        ddp_bucket_cap_mb=10,
    )
    accelerator = distributed.accelerator_for(config)
    assert accelerator.device.type == "cpu"
    # One process: no process group, so no backend (as transformers); a launched run gets it.
    assert accelerator.init_handler.to_kwargs() == {"timeout": timedelta(seconds=120)}
    assert accelerator.ddp_handler.find_unused_parameters is True
    assert accelerator.ddp_handler.bucket_cap_mb == 10
    # Only the fields that were set are passed: broadcast_buffers keeps DDP's default.
    assert distributed.ddp_kwargs(config) == {"find_unused_parameters": True, "bucket_cap_mb": 10}
    assert accelerator.ddp_handler.broadcast_buffers is True
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.process_group_kwargs(config) == {"backend": "gloo", "timeout": timedelta(seconds=120)}


def test_without_ddp_fields_no_ddp_handler_and_the_default_timeout():
    accelerator = distributed.accelerator_for(TrainingConfig())
    assert accelerator.ddp_handler is None
    assert accelerator.init_handler.to_kwargs() == {"timeout": timedelta(seconds=1800)}


@pytest.mark.parametrize("flag", ["use_cpu", "no_cuda"])
def test_use_cpu_and_its_alias_ask_accelerate_for_the_cpu(flag, monkeypatch):
    import accelerate

    seen = {}
    real = accelerate.Accelerator

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(accelerate, "Accelerator", spy)
    config = TrainingConfig(**{flag: True})
    assert config.use_cpu is True
    distributed.accelerator_for(config)
    assert seen["cpu"] is True
    seen.clear()
    distributed.accelerator_for(TrainingConfig())
    assert seen["cpu"] is False


def test_bad_ddp_values_are_config_errors():
    with pytest.raises(ConfigError, match="ddp_backend='ncl' is not one of nccl, gloo"):
        TrainingConfig(ddp_backend="ncl")
    with pytest.raises(ConfigError, match="ddp_timeout=0 must be > 0"):
        TrainingConfig(ddp_timeout=0)
    with pytest.raises(ConfigError, match="torch_empty_cache_steps=0 must be >= 1"):
        TrainingConfig(torch_empty_cache_steps=0)


# -- tf32 ----------------------------------------------------------------------------------------------


def test_tf32_without_a_gpu_is_a_clear_error_before_the_model_loads(tmp_path, tiny_tokenizer, monkeypatch):
    from posttrain.trainers.sft import SFTTrainer
    from posttrain.trainers.sft_config import SFTConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--tf32 requires Ampere or a newer GPU, and no CUDA GPU is available"):
        distributed.accelerator_for(TrainingConfig(tf32=True))
    args = SFTConfig(output_dir=str(tmp_path / "out"), tf32=True, report_to="none")
    # A path that does not exist: the error must come first, before anything is loaded.
    with pytest.raises(ConfigError, match="--tf32 requires Ampere"):
        SFTTrainer(str(tmp_path / "no-such-model"), args=args, train_dataset=Dataset.from_dict({"text": ["a b"]}))
    # tf32=False asks for nothing a CPU lacks.
    assert distributed.accelerator_for(TrainingConfig(tf32=False)).device.type == "cpu"


def test_tf32_on_a_pre_ampere_gpu_names_its_compute_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    with pytest.raises(ConfigError, match=r"compute capability >= 8.0\); this GPU is 7.5"):
        distributed.check_tf32_available()
    with pytest.raises(ConfigError, match="--use_cpu is set"):
        distributed.check_tf32_available(cpu=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    distributed.check_tf32_available()  # Ampere: allowed


# -- torch_empty_cache_steps ---------------------------------------------------------------------------


@pytest.fixture
def cache_clears(monkeypatch):
    """Count accelerate's clear_device_cache calls (torch.cuda.empty_cache on CUDA, a no-op on CPU)."""
    from accelerate.utils import memory

    calls = []
    monkeypatch.setattr(memory, "clear_device_cache", lambda *a, **k: calls.append(1))
    return calls


def test_empty_cache_every_n_sft_optimizer_steps(tmp_path, tiny_tokenizer, cache_clears):
    from posttrain.trainers.sft import SFTTrainer
    from posttrain.trainers.sft_config import SFTConfig

    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=5,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        torch_empty_cache_steps=2,
        save_steps=0,
        report_to="none",
        max_length=32,
    )
    data = Dataset.from_dict({"text": [f"Sentence number {i} is here." for i in range(8)]})
    trainer = SFTTrainer(
        build_tiny_causal_lm(tiny_tokenizer), args=args, train_dataset=data, processing_class=tiny_tokenizer
    )
    trainer.train()
    # 5 optimizer steps (10 micro-batches): emptied after steps 2 and 4.
    assert len(cache_clears) == 2


def test_empty_cache_every_n_rloo_optimizer_steps(tmp_path, tiny_tokenizer, cache_clears):
    from posttrain.trainers.rloo import RLOOTrainer
    from posttrain.trainers.rloo_config import RLOOConfig

    config = RLOOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        rloo_k=2,
        num_ppo_epochs=2,
        num_mini_batches=2,
        total_episodes=8,
        response_length=3,
        report_to=["none"],
        num_sample_generations=0,
        save_steps=0,
        torch_empty_cache_steps=3,
    )
    data = Dataset.from_dict({"prompt": [f"Prompt number {i} says" for i in range(8)]})

    def reward(prompts, completions, **kw):
        return [float(len(c)) for c in completions]

    trainer = RLOOTrainer(config, tiny_tokenizer, build_tiny_causal_lm(tiny_tokenizer), None, reward, data)
    trainer.train()
    # 2 rollout batches × 2 epochs × 2 minibatches = 8 optimizer steps: emptied after steps 3 and 6.
    assert trainer.run.progress.optimizer_steps == 8
    assert len(cache_clears) == 2


def test_empty_cache_counts_only_this_accelerators_optimizers(cache_clears):
    accelerator = distributed.accelerator_for(TrainingConfig(torch_empty_cache_steps=1))
    model = torch.nn.Linear(2, 1)
    _, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    other = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    other.step()
    assert cache_clears == []
    optimizer.step()
    optimizer.step()
    assert len(cache_clears) == 2


# -- accelerator_config --------------------------------------------------------------------------------


def test_accelerator_config_unknown_key_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"accelerator_config has unknown key\(s\) \['split_batch'\]; valid keys: "):
        TrainingConfig(accelerator_config={"split_batch": True})
    with pytest.raises(ConfigError, match="sync_each_batch"):
        TrainingConfig(accelerator_config={"gradient_accumulation_kwargs": {"sync_every": True}})


def test_accelerator_config_values_posttrain_cannot_honour_are_refused():
    with pytest.raises(ConfigError, match=r"split_batches=True is not supported .*per_device_train_batch_size"):
        TrainingConfig(accelerator_config='{"split_batches": true}')
    with pytest.raises(ConfigError, match="num_steps=4 .*gradient_accumulation_steps instead"):
        TrainingConfig(accelerator_config={"gradient_accumulation_kwargs": {"num_steps": 4}})


def test_accelerator_config_from_a_json_file_reaches_accelerate(tmp_path):
    path = tmp_path / "acc.json"
    keys = {"split_batches": False, "even_batches": True, "use_seedable_sampler": True, "non_blocking": False}
    path.write_text(json.dumps({**keys, "gradient_accumulation_kwargs": {"sync_each_batch": True}}))
    config = TrainingConfig(accelerator_config=str(path))
    assert config.accelerator_config["gradient_accumulation_kwargs"] == {"sync_each_batch": True}
    accelerator = distributed.accelerator_for(config)
    assert accelerator.dataloader_config.use_seedable_sampler is True
    assert accelerator.gradient_state.plugin_kwargs["sync_each_batch"] is True
    with pytest.raises(ConfigError, match="neither a JSON object nor an existing JSON file"):
        TrainingConfig(accelerator_config=str(tmp_path / "missing.json"))


def test_sync_each_batch_all_reduces_every_micro_batch():
    """Two processes: no_sync on all but the last micro-batch, unless sync_each_batch is asked for."""
    no_sync = object()

    def fake(sync_each_batch: bool):
        return SimpleNamespace(
            num_processes=2,
            gradient_state=SimpleNamespace(plugin_kwargs={"sync_each_batch": sync_each_batch}),
            no_sync=lambda model: no_sync,
        )

    model = torch.nn.Linear(1, 1)
    assert distributed.no_sync_unless_last(fake(False), model, is_last=False) is no_sync
    assert distributed.no_sync_unless_last(fake(False), model, is_last=True) is not no_sync
    assert distributed.no_sync_unless_last(fake(True), model, is_last=False) is not no_sync


# -- FSDP ----------------------------------------------------------------------------------------------


def test_fsdp_flags_map_to_the_fsdp2_plugin():
    config = TrainingConfig(
        fsdp="full_shard auto_wrap",
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": "LlamaDecoderLayer"},
    )
    assert distributed.fsdp_plugin_kwargs(config) == {
        "fsdp_version": 2,
        "reshard_after_forward": True,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_cls_names_to_wrap": ["LlamaDecoderLayer"],
        "state_dict_type": "FULL_STATE_DICT",
    }
    plugin = distributed.fsdp_plugin_from(config)
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert plugin.state_dict_type.name == "FULL_STATE_DICT"


def test_fsdp_shard_grad_op_offload_and_size_based_wrap():
    config = TrainingConfig(
        fsdp=["shard_grad_op", "offload"],
        fsdp_min_num_params=1000,
        fsdp_config={"activation_checkpointing": "true", "state_dict_type": "sharded_state_dict"},
    )
    kwargs = distributed.fsdp_plugin_kwargs(config)
    assert kwargs == {
        "fsdp_version": 2,
        "reshard_after_forward": False,
        "cpu_offload": True,
        "auto_wrap_policy": "SIZE_BASED_WRAP",
        "min_num_params": 1000,
        "state_dict_type": "SHARDED_STATE_DICT",
        "activation_checkpointing": True,
    }
    plugin = distributed.fsdp_plugin_from(config)
    assert plugin.reshard_after_forward is False and plugin.min_num_params == 1000
    assert plugin.activation_checkpointing is True


def test_fsdp_true_is_transformers_5_shorthand_and_version_1_keeps_its_options():
    assert TrainingConfig(fsdp=True).fsdp == "full_shard auto_wrap"
    config = TrainingConfig(
        fsdp="hybrid_shard", fsdp_config={"version": 1, "backward_prefetch": "backward_pre", "use_orig_params": False}
    )
    kwargs = distributed.fsdp_plugin_kwargs(config)
    assert kwargs["fsdp_version"] == 1 and kwargs["reshard_after_forward"] == "HYBRID_SHARD"
    assert kwargs["backward_prefetch"] == "BACKWARD_PRE"
    assert kwargs["use_orig_params"] is False and kwargs["sync_module_states"] is True
    assert kwargs["forward_prefetch"] is False


def test_fsdp1_only_keys_with_fsdp2_are_warned_about():
    with pytest.warns(UserWarning, match="use_orig_params apply to FSDP1 only"):
        config = TrainingConfig(fsdp="full_shard", fsdp_config={"use_orig_params": True})
    with pytest.warns(UserWarning, match="use_orig_params apply to FSDP1 only"):
        kwargs = distributed.fsdp_plugin_kwargs(config)
    assert "use_orig_params" not in kwargs


@pytest.mark.parametrize(
    "values, message",
    [
        ({"fsdp": "full_shard autowrap"}, r"fsdp has unknown option\(s\) \['autowrap'\]; valid"),
        (
            {"fsdp": "full_shard", "fsdp_config": {"min_params": 3}},
            r"fsdp_config has unknown key\(s\) \['min_params'\]",
        ),
        ({"fsdp": "hybrid_shard"}, "hybrid_shard is an FSDP1 strategy"),
        ({"fsdp": "full_shard shard_grad_op"}, "several sharding strategies"),
        ({"fsdp": "full_shard", "fsdp_config": {"version": 3}}, "version=3 must be 1 or 2"),
        ({"fsdp": "full_shard", "fsdp_config": {"state_dict_type": "LOCAL_STATE_DICT"}}, "with FSDP2"),
        ({"fsdp_config": {"version": 2}}, 'fsdp_config set but --fsdp is not; add --fsdp "full_shard auto_wrap"'),
        ({"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}, "fsdp_transformer_layer_cls_to_wrap set but"),
        ({"fsdp": "full_shard", "fsdp_config": "{not json"}, "fsdp_config='{not json' is not valid JSON"),
    ],
)
def test_bad_fsdp_values_are_config_errors(values, message):
    with pytest.raises(ConfigError, match=message):
        TrainingConfig(**values)


def test_fsdp_on_one_process_is_refused_rather_than_silently_unsharded():
    with pytest.raises(ConfigError, match="--fsdp needs several processes"):
        distributed.accelerator_for(TrainingConfig(fsdp="full_shard auto_wrap"))
    # accelerate's "FSDP on" mark is taken back with the refusal.
    assert "ACCELERATE_USE_FSDP" not in os.environ


def test_a_plugin_posttrain_gave_is_not_mistaken_for_a_launchers(monkeypatch):
    """accelerate marks ACCELERATE_USE_FSDP itself when given a plugin; a later trainer in the same
    process must not read that as `accelerate launch --config_file` having turned FSDP on."""
    import accelerate

    real = accelerate.Accelerator

    def marking(*args, **kwargs):
        os.environ["ACCELERATE_USE_FSDP"] = "true"  # what accelerate does with an fsdp_plugin
        return real(*args, **{k: v for k, v in kwargs.items() if k != "fsdp_plugin"})

    monkeypatch.setattr(accelerate, "Accelerator", marking)
    monkeypatch.setattr(distributed, "fsdp_plugin_from", lambda config: None)
    distributed.accelerator_for(TrainingConfig(fsdp="full_shard"))
    assert os.environ["ACCELERATE_USE_FSDP"] == "true"
    distributed.check_launch_conflicts(TrainingConfig(fsdp="full_shard"))  # no conflict: posttrain set it


# -- DeepSpeed -----------------------------------------------------------------------------------------

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 10}},
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": False},
    "zero_optimization": {"stage": 2},
}


def test_deepspeed_auto_values_are_filled_from_the_training_config():
    config = TrainingConfig(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=3,
        max_grad_norm=0.5,
        learning_rate=2e-5,
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_epsilon=1e-6,
        weight_decay=0.1,
        bf16=True,
    )
    filled = distributed.deepspeed_fill_auto(DS_CONFIG, config, world_size=2)
    assert filled == {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 3,
        "train_batch_size": 24,  # 2 processes × 4 × 3
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 2e-5, "warmup_num_steps": 10}},
        "bf16": {"enabled": True},
        "fp16": {"enabled": False},
        "zero_optimization": {"stage": 2},
    }
    assert DS_CONFIG["train_batch_size"] == "auto"  # the input is left untouched


def test_deepspeed_values_that_disagree_with_the_flags_are_listed():
    config = TrainingConfig(per_device_train_batch_size=4, fp16=True)
    ds = copy.deepcopy(DS_CONFIG)
    ds["train_micro_batch_size_per_gpu"] = 8
    with pytest.raises(
        ConfigError,
        match=r"train_micro_batch_size_per_gpu=8 vs per_device_train_batch_size=4; "
        r"fp16.enabled=False vs fp16=True",
    ):
        distributed.deepspeed_fill_auto(ds, config, world_size=1)


def test_deepspeed_without_the_package_names_the_install_command(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS_CONFIG))
    with pytest.raises(ConfigError, match=r"--deepspeed needs the deepspeed package.*pip install deepspeed"):
        TrainingConfig(deepspeed=str(path))


def test_a_flag_plugin_does_not_fight_accelerate_launchs(monkeypatch):
    with pytest.raises(ConfigError, match="--fsdp and --deepspeed are both set"):
        TrainingConfig(fsdp="full_shard", deepspeed={"zero_optimization": {"stage": 3}})
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match="--fsdp is set, and accelerate launch's config already turns DeepSpeed on"):
        TrainingConfig(fsdp="full_shard")
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setattr(distributed, "require_deepspeed", lambda: None)
    with pytest.raises(ConfigError, match="--deepspeed is set, and accelerate launch's config already turns FSDP on"):
        TrainingConfig(deepspeed={"zero_optimization": {"stage": 3}})


def test_accelerator_config_reads_as_attributes_with_transformers_defaults():
    config = TrainingConfig(accelerator_config='{"even_batches": true}')
    options = config.accelerator_config
    assert options == {"even_batches": True}  # the mapping as given
    assert options.even_batches is True and options.split_batches is False and options.dispatch_batches is None
    with pytest.raises(AttributeError, match="accelerator_config has no key 'split_batch'"):
        options.split_batch  # noqa: B018
    assert TrainingConfig().accelerator_config is None
