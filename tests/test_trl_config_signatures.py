"""Every field of TRL's documented RLOOConfig and XPOConfig signatures is accepted by posttrain's config of
the same name, in Python and on the command line, with the documented default.

tests/fixtures/trl_config_signatures.json holds the signatures as TRL's documentation prints them
(name, type, default). A field that posttrain cannot honour is accepted at its default and refused with a
ConfigError naming it at any other value; the deliberate default differences are listed below with
their reasons (also in README.md, "Coming from TRL").
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from posttrain import RLOOConfig, XPOConfig, compat
from posttrain.cli import parse_config
from posttrain.configs import UNSUPPORTED_FIELDS, ConfigError

SIGNATURES = json.loads((Path(__file__).parent / "fixtures" / "trl_config_signatures.json").read_text())
CLASSES = {"RLOOConfig": (RLOOConfig, "rloo"), "XPOConfig": (XPOConfig, "xpo")}

# Deliberate differences from the documented defaults, and why.
DIFFERENT_DEFAULTS = {
    # transformers falls back to "trainer_output"; posttrain's trainers name the folder after the model
    # when args is None, and the config's own default keeps runs under outputs/.
    "output_dir": "outputs/run",
    # TRL's on-policy trainers log every rollout batch whatever logging_steps says; posttrain honours
    # logging_steps, so it defaults to 1 to log as often as TRL does.
    ("RLOOConfig", "logging_steps"): 1,
    # None is accepted and means off: posttrain never turns on bf16 by itself (CPUs without native bf16
    # emulate it ~100x slower).
    "bf16": False,
    # None is accepted and means no tracker besides console and metrics.jsonl (transformers 5's meaning).
    "report_to": ["none"],
    # TRL defaults both to EleutherAI/pythia-160m, a model the user never named; posttrain defaults them
    # to model_name_or_path and asks for a model when none is given.
    "sft_model_path": None,
    "reward_model_path": None,
    # transformers.TrainingArguments' own default depends on the install (adamw_torch_fused from
    # transformers 4.54 with torch >= 2.8, huggingface/transformers#37358); posttrain follows it.
    "optim": compat.default_optim(),
}


# transformers' deprecated names, which set the new one (a refusal then names the new one).
ALIASES = {
    "per_gpu_train_batch_size": "per_device_train_batch_size",
    "per_gpu_eval_batch_size": "per_device_eval_batch_size",
    "push_to_hub_model_id": "hub_model_id",
    "push_to_hub_organization": "hub_model_id",
    "push_to_hub_token": "hub_token",
    "torchdynamo": "torch_compile",
    "no_cuda": "use_cpu",
    "adafactor": "optim",
    "fp16_backend": "half_precision_backend",
}


def documented_default(entry: dict) -> object:
    text = (entry["default"] or "").strip()
    if text == "<factory>":
        return {"lr_scheduler_kwargs": {}, "include_for_metrics": [], "beta": [0.1]}.get(entry["name"], "<factory>")
    return ast.literal_eval(text) if text else None


def cases():
    for cls_name, fields in SIGNATURES.items():
        for name, entry in fields.items():
            yield cls_name, name, {**entry, "name": name}


ALL = list(cases())


@pytest.mark.parametrize("cls_name, name, entry", ALL, ids=[f"{c}.{n}" for c, n, _ in ALL])
def test_documented_field_exists_with_its_default(cls_name, name, entry):
    cls, _ = CLASSES[cls_name]
    config = cls()
    assert hasattr(config, name), f"{cls_name} lacks the documented field {name}"
    expected = documented_default(entry)
    if expected == "<factory>":
        return_value = getattr(config, name)
        assert return_value is not None
        return
    key = (cls_name, name) if (cls_name, name) in DIFFERENT_DEFAULTS else name
    if key in DIFFERENT_DEFAULTS:
        expected = DIFFERENT_DEFAULTS[key]
    assert getattr(config, name) == expected


def test_the_signatures_are_the_documented_sizes():
    assert len(SIGNATURES["RLOOConfig"]) == 160
    assert len(SIGNATURES["XPOConfig"]) == 146


def sample_value(entry: dict) -> str | None:
    """A command-line value for a field: its documented default, or for a None default a value of its type."""
    default = documented_default(entry)
    if default not in (None, "<factory>", "", [], {}):
        return str(default)
    kind = entry["type"]
    if "dict" in kind:
        return '{"a": 1}'
    if "bool" in kind:
        return "True"
    if "int" in kind and "float" not in kind and "str" not in kind:
        return "2"
    if "float" in kind:
        return "0.5"
    return "eos" if entry["name"] == "stop_token" else "value"


@pytest.mark.parametrize("cls_name, name, entry", ALL, ids=[f"{c}.{n}" for c, n, _ in ALL])
def test_documented_field_parses_on_the_command_line(cls_name, name, entry, capsys):
    _, command = CLASSES[cls_name]
    value = sample_value(entry)
    argv = [f"--{name}", value]
    try:
        config = parse_config(command, argv)
    except SystemExit:
        err = capsys.readouterr().err
        # Refused values are refused by name, never "unknown argument".
        assert "unknown argument" not in err, err
        assert name in err or ALIASES.get(name, name) in err, err
        return
    parsed = getattr(config, name)
    if value == str(documented_default(entry)):
        # The default given explicitly is the default (modulo the normalisations listed above).
        key = (cls_name, name) if (cls_name, name) in DIFFERENT_DEFAULTS else name
        assert parsed == DIFFERENT_DEFAULTS.get(key, documented_default(entry)) or str(parsed) == value
    else:
        assert parsed is not None


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FIELDS))
def test_unsupported_values_are_refused_by_name(name):
    config = RLOOConfig()
    default = getattr(config, name)
    if isinstance(default, bool):
        other = not default
    elif isinstance(default, int):
        other = default + 3
    elif isinstance(default, float):
        other = default + 0.5
    elif isinstance(default, list):
        other = ["x"]
    elif isinstance(default, dict):
        other = {"x": 1}
    else:  # str or None
        other = "sgd" if name == "optim" else "other"
    with pytest.raises(ConfigError, match=name):
        RLOOConfig(**{name: other})


def test_deprecated_aliases_set_the_new_name():
    with pytest.warns(FutureWarning, match="per_device_train_batch_size"):
        config = RLOOConfig(per_gpu_train_batch_size=3)
    assert config.per_device_train_batch_size == 3
    with pytest.raises(ConfigError, match="per_gpu_train_batch_size"):
        RLOOConfig(per_gpu_train_batch_size=3, per_device_train_batch_size=5)


def test_vllm_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"use_vllm=True .*posttrain.rollout"):
        XPOConfig(use_vllm=True)


def test_derived_sizes_are_accepted_and_checked():
    config = RLOOConfig(per_device_train_batch_size=4, rloo_k=2, batch_size=4, total_episodes=16)
    config.derive_sizes(world_size=1)
    assert config.batch_size == 4
    # per_device 4 × GA 1 × num_mini_batches 1 × 2 processes = 8, not the 4 given.
    config = RLOOConfig(per_device_train_batch_size=4, rloo_k=2, batch_size=4, total_episodes=16)
    with pytest.raises(ConfigError, match=r"batch_size=4 was given.*batch_size=8"):
        config.derive_sizes(world_size=2)


def test_remove_unused_columns_false_says_it_has_no_effect():
    with pytest.warns(UserWarning, match="remove_unused_columns=False has no effect"):
        RLOOConfig(remove_unused_columns=False)
