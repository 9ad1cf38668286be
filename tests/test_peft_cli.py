"""LoRA from the command line (TRL ModelConfig flags): only the adapter trains, the adapter is saved.

Each command runs 1-2 updates on the tiny Llama; `peft.get_peft_model` is wrapped to capture the
model the trainer actually trained, so its base weights can be compared with the checkpoint it
started from.
"""

from __future__ import annotations

import builtins
import json

import pytest
import torch
from safetensors.torch import load_file

peft = pytest.importorskip("peft")

from helpers import train_argv  # noqa: E402
from posttrain.cli import main  # noqa: E402
from posttrain.configs import TrainingConfig  # noqa: E402
from posttrain.models import PEFT_INSTALL_HINT, peft_config_from  # noqa: E402

LORA = ["--use_peft", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj"]
COMMON = ["--report_to", "none", "--logging_steps", "1", "--learning_rate", "1e-2", "--save_steps", "0"]
WORDS = ["sea", "sky", "dog", "fox", "robot", "book", "poem", "tree"]
# Online DPO / XPO: a random judge, one rollout batch of 4 prompts.
JUDGED = ["--judge", "random:0", "--per_device_train_batch_size", "4", "--total_episodes", "4", "--max_new_tokens", "4"]


@pytest.fixture
def captured(monkeypatch):
    """The PEFT models the trainers create, in creation order."""
    models = []
    original = peft.get_peft_model

    def capture(model, config, *args, **kwargs):
        wrapped = original(model, config, *args, **kwargs)
        models.append(wrapped)
        return wrapped

    monkeypatch.setattr(peft, "get_peft_model", capture)
    return models


def check_only_adapter_trained(model, start_dir, out_dir, head: str | None = None) -> None:
    start = load_file(str(start_dir / "model.safetensors"))
    trained = model.get_base_model().state_dict()
    compared = 0
    for name, value in trained.items():
        if "lora_" in name or "modules_to_save" in name:
            continue
        original = name.replace(".base_layer", "").replace(".original_module", "")
        assert torch.equal(value.cpu(), start[original]), f"base weight {original} changed"
        compared += 1
    assert compared == len(start)  # every base weight was checked
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable), trainable
    assert {n.split(".")[-4] for n in trainable if "lora_A" in n} == {"q_proj", "v_proj"}
    # The adapter (not a full model) is saved; LoRA B starts at zero, so a non-zero B was trained.
    assert json.loads((out_dir / "adapter_config.json").read_text())["r"] == 4
    assert not (out_dir / "model.safetensors").exists()
    adapter = load_file(str(out_dir / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapter.items())
    if head is not None:  # the new score head trains and is saved with the adapter
        assert any(head in k for k in adapter)


def train_with_lora(captured, command, model_dir, data, out, *flags):
    """`posttrain <command>` of the model in `model_dir` on `data` into `out` with the LoRA flags; the one
    PEFT model it trained."""
    assert main(train_argv(command, model_dir, data, out, *flags, *COMMON, *LORA)) == 0
    (model,) = captured
    return model


def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Write about the {w}."}) + "\n" for w in WORDS))
    return str(path)


def test_sft(tmp_path, captured, tiny_policy_dir):
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Q: {w}? ", "completion": f"The {w} is here."}) + "\n" for w in WORDS)
    )
    out = tmp_path / "sft"
    flags = ["--max_steps", "2", "--per_device_train_batch_size", "2"]
    model = train_with_lora(captured, "sft", tiny_policy_dir, data, out, *flags)
    check_only_adapter_trained(model, tiny_policy_dir, out)


def test_reward(tmp_path, captured, tiny_reward_model_dir):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"chosen": f"The {w} is good.", "rejected": f"{w}."}) + "\n" for w in WORDS))
    out = tmp_path / "reward"
    flags = ["--max_steps", "2", "--per_device_train_batch_size", "2"]
    model = train_with_lora(captured, "reward", tiny_reward_model_dir, data, out, *flags)
    assert model.peft_config["default"].task_type == "SEQ_CLS"
    check_only_adapter_trained(model, tiny_reward_model_dir, out, head="score")


def test_rloo(tmp_path, captured, tiny_policy_dir, tiny_reward_model_dir):
    out = tmp_path / "rloo"
    flags = ["--reward_model_path", str(tiny_reward_model_dir), "--rloo_k", "2", "--per_device_train_batch_size", "4"]
    flags += ["--total_episodes", "4", "--response_length", "4", "--num_sample_generations", "0"]
    model = train_with_lora(captured, "rloo", tiny_policy_dir, prompts_file(tmp_path), out, *flags)
    check_only_adapter_trained(model, tiny_policy_dir, out)
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    # The reference is the adapter-disabled base: identical to the policy before the first update.
    assert record["objective/kl"] == pytest.approx(0.0, abs=1e-5)


def test_ppo(tmp_path, captured, tiny_policy_dir, tiny_reward_model_dir):
    out = tmp_path / "ppo"
    flags = ["--reward_model_path", str(tiny_reward_model_dir), "--per_device_train_batch_size", "4"]
    flags += ["--total_episodes", "4", "--response_length", "4", "--num_sample_generations", "0"]
    model = train_with_lora(captured, "ppo", tiny_policy_dir, prompts_file(tmp_path), out, *flags)
    check_only_adapter_trained(model, tiny_policy_dir, out)
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert record["objective/kl"] == pytest.approx(0.0, abs=1e-5)


def test_online_dpo(tmp_path, captured, tiny_policy_dir):
    out = tmp_path / "odpo"
    model = train_with_lora(captured, "online-dpo", tiny_policy_dir, prompts_file(tmp_path), out, *JUDGED)
    check_only_adapter_trained(model, tiny_policy_dir, out)


def test_peft_config_from():
    assert peft_config_from(TrainingConfig()) is None
    cfg = TrainingConfig(
        use_peft=True,
        lora_r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        lora_target_modules=["q_proj"],
        lora_modules_to_save=["lm_head"],
    )
    lora = peft_config_from(cfg)
    assert isinstance(lora, peft.LoraConfig)
    assert (lora.r, lora.lora_alpha, lora.lora_dropout, lora.task_type) == (8, 16, 0.0, "CAUSAL_LM")
    assert set(lora.target_modules) == {"q_proj"} and lora.modules_to_save == ["lm_head"]
    assert peft_config_from(cfg, task_type="SEQ_CLS").task_type == "SEQ_CLS"
    # TRL's defaults; None targets = peft's default modules for the architecture
    default = peft_config_from(TrainingConfig(use_peft=True))
    assert (default.r, default.lora_alpha, default.lora_dropout, default.target_modules) == (16, 32, 0.05, None)
    assert (
        peft_config_from(TrainingConfig(use_peft=True, lora_target_modules=["all-linear"])).target_modules
        == "all-linear"
    )


def test_missing_peft_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_peft(name, *args, **kwargs):
        if name == "peft" or name.startswith("peft."):
            raise ModuleNotFoundError("No module named 'peft'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    with pytest.raises(ImportError, match=r"pip install posttrain\[peft\]"):
        peft_config_from(TrainingConfig(use_peft=True))
    assert "pip install posttrain[peft]" in PEFT_INSTALL_HINT
    assert peft_config_from(TrainingConfig()) is None  # without --use_peft peft is never imported


def test_grpo(tmp_path, captured, tiny_policy_dir, tiny_reward_model_dir):
    out = tmp_path / "grpo"
    flags = ["--reward_model_path", str(tiny_reward_model_dir), "--num_generations", "2"]
    flags += ["--per_device_train_batch_size", "4", "--total_episodes", "4", "--max_completion_length", "4"]
    flags += ["--beta", "0.1", "--num_sample_generations", "0"]
    model = train_with_lora(captured, "grpo", tiny_policy_dir, prompts_file(tmp_path), out, *flags)
    check_only_adapter_trained(model, tiny_policy_dir, out)
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert record["objective/kl"] == pytest.approx(0.0, abs=1e-5)


def test_xpo(tmp_path, captured, tiny_policy_dir):
    out = tmp_path / "xpo"
    model = train_with_lora(captured, "xpo", tiny_policy_dir, prompts_file(tmp_path), out, *JUDGED)
    check_only_adapter_trained(model, tiny_policy_dir, out)
