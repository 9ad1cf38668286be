"""TRL 1.16's configs on posttrain: every field of TRL 1.16's GRPOConfig, RLOOConfig, SFTConfig and
RewardConfig (transformers 5's TrainingArguments fields under them included) exists in posttrain's config
of the same name and accepts TRL's default; the fields added for them do what they say, and the ones
posttrain cannot honour are refused with a message naming them.

tests/fixtures/trl_1_16_config_fields.json was written by tests/fixtures/make_trl_1_16_fields.py with TRL
1.16.0 and transformers 5.23 installed (the benchmark harness's environment).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import posttrain
from helpers import grpo_config, length_reward, prompt_dataset, rloo_config, sft_trainer
from posttrain import distributed
from posttrain.configs import ConfigError
from posttrain.models import Float32LMHead, cast_lm_head_to_fp32
from posttrain.scoring import resolve_router_aux_loss_coef
from posttrain.testing import build_tiny_causal_lm
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.grpo_config import GRPOConfig
from posttrain.trainers.rloo import RLOOTrainer
from posttrain.trainers.rloo_config import RLOOConfig
from posttrain.trainers.sft_config import SFTConfig
from posttrain.trainers.supervised import StepBatches, StepRange, input_tokens, step_loader

pytestmark = pytest.mark.usefixtures("one_thread")

FIELDS = json.loads((Path(__file__).parent / "fixtures" / "trl_1_16_config_fields.json").read_text())


@pytest.mark.parametrize("name", sorted(FIELDS["classes"]))
def test_every_trl_1_16_field_exists_and_takes_trl_default(name, tmp_path):
    cls = getattr(posttrain, name)
    ours = {f.name for f in dataclasses.fields(cls)}
    assert sorted(set(FIELDS["classes"][name]) - ours) == []
    for field, spec in FIELDS["classes"][name].items():
        value = spec["default"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = cls(**{"output_dir": str(tmp_path), field: value})
        if field == "output_dir":  # transformers 5's None: posttrain's default folder
            assert config.output_dir == "outputs/run"


# -- transformers 5's TrainingArguments fields --------------------------------------------------------------


def test_activation_checkpointing_names_set_the_gradient_checkpointing_fields(tmp_path):
    config = SFTConfig(
        output_dir=str(tmp_path),
        activation_checkpointing=True,
        activation_checkpointing_kwargs='{"use_reentrant": true}',
    )
    assert config.gradient_checkpointing is True
    assert config.gradient_checkpointing_kwargs == {"use_reentrant": True}
    with pytest.raises(ConfigError, match="gradient_checkpointing_kwargs=.*activation_checkpointing_kwargs="):
        SFTConfig(
            output_dir=str(tmp_path),
            gradient_checkpointing_kwargs={"use_reentrant": False},
            activation_checkpointing_kwargs={"use_reentrant": True},
        )
    for bad in ({"every_n_layers": 0}, {"every_n_layers": "2"}, {"offload": "yes"}):
        with pytest.raises(ConfigError, match="gradient_checkpointing_kwargs (every_n_layers|offload)="):
            SFTConfig(output_dir=str(tmp_path), gradient_checkpointing=True, gradient_checkpointing_kwargs=bad)


def test_every_n_layers_checkpoints_every_second_decoder_layer(tmp_path, tiny_tokenizer):
    from transformers import PreTrainedModel

    kwargs = {"every_n_layers": 2}
    if not hasattr(PreTrainedModel, "activation_checkpointing_enable"):  # the floor stack (transformers 4.x)
        with pytest.raises(ConfigError, match="activation_checkpointing_enable, which transformers"):
            SFTConfig(output_dir=str(tmp_path), gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs)
        return
    rows = [{"text": f"row {i} says hello"} for i in range(8)]
    trainer = sft_trainer(
        tmp_path,
        tiny_tokenizer,
        rows,
        model_kwargs={"num_layers": 4},
        gradient_checkpointing=True,
        activation_checkpointing_kwargs=kwargs,
        max_steps=1,
    )
    layers = trainer.model.model.layers
    assert [layer.gradient_checkpointing for layer in layers] == [True, False, True, False]
    trainer.train()
    assert trainer.state.global_step == 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"use_cache": True}, "use_cache=True is not supported .*KV cache"),
        ({"dataloader_in_order": False}, "dataloader_in_order=False is not supported .*exact resume"),
        ({"parallelism_config": {"tp_size": 2}}, "parallelism_config=.* is not supported .*fsdp or deepspeed"),
        ({"train_sampling_strategy": "group_by_length"}, "'group_by_length' is not supported .*packing"),
        ({"train_sampling_strategy": "batch_rebalance"}, "'batch_rebalance' is not supported"),
        ({"train_sampling_strategy": "shuffled"}, "must be one of random, sequential"),
        ({"dataloader_multiprocessing_context": "spawn"}, "needs worker processes"),
        (
            {"dataloader_multiprocessing_context": "thread", "dataloader_num_workers": 1},
            "must be one of fork, spawn, forkserver",
        ),
        ({"include_num_input_tokens_seen": "some"}, "one of no, all, non_padding"),
        ({"pad_to_multiple_of": "eight"}, 'a whole number, "auto" or None'),
    ],
)
def test_what_posttrain_cannot_honour_is_refused_by_name(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        SFTConfig(output_dir=str(tmp_path), **fields)


def test_transformers_5_value_spellings(tmp_path):
    assert SFTConfig(output_dir=str(tmp_path), pad_to_multiple_of="auto").pad_to_multiple_of is None
    assert SFTConfig(output_dir=str(tmp_path), pad_to_multiple_of="8").pad_to_multiple_of == 8
    for given, read in (("no", False), ("all", True), ("non_padding", "non_padding")):
        config = SFTConfig(output_dir=str(tmp_path), include_num_input_tokens_seen=given)
        assert config.include_num_input_tokens_seen == read
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}
    assert (input_tokens(batch), input_tokens(batch, non_padding=True)) == (6, 5)


def test_trackio_settings_are_ignored_with_one_warning(tmp_path):
    with pytest.warns(UserWarning, match=r"project='mine', trackio_space_id='me/space': ignored \(Trackio"):
        SFTConfig(output_dir=str(tmp_path), project="mine", trackio_space_id="me/space")


def test_ddp_static_graph_reaches_ddp(tmp_path):
    config = SFTConfig(output_dir=str(tmp_path), ddp_static_graph=True, ddp_bucket_cap_mb=10)
    assert distributed.ddp_kwargs(config) == {"bucket_cap_mb": 10, "static_graph": True}


def test_multiprocessing_context_reaches_the_data_loader(tmp_path, tiny_tokenizer):
    config = SFTConfig(output_dir=str(tmp_path), dataloader_num_workers=1, dataloader_multiprocessing_context="spawn")
    rows = [{"text": f"row {i}"} for i in range(4)]
    trainer = sft_trainer(tmp_path, tiny_tokenizer, rows, name="ctx", max_steps=1)
    loader = step_loader(config, StepBatches(trainer.run.plan, trainer.run.train_dataset, list), StepRange(), False)
    assert loader.multiprocessing_context is multiprocessing.get_context("spawn")


def test_sequential_sampling_keeps_dataset_order(tmp_path, tiny_tokenizer):
    rows = [{"text": f"row {i} says hello"} for i in range(16)]
    orders = {}
    for strategy in ("random", "sequential"):
        trainer = sft_trainer(tmp_path, tiny_tokenizer, rows, name=strategy, train_sampling_strategy=strategy)
        orders[strategy] = trainer.run.plan.order(0)
    assert orders["sequential"] == list(range(16))
    assert sorted(orders["random"]) == list(range(16)) and orders["random"] != list(range(16))
    config = rloo_config(tmp_path, name="rloo", train_sampling_strategy="sequential")
    trainer = RLOOTrainer(config=config, policy=build_tiny_causal_lm(tiny_tokenizer), reward_model=length_reward,
                          train_dataset=prompt_dataset(), processing_class=tiny_tokenizer)  # fmt: skip
    assert trainer.run.prompts.shuffle is False


def test_router_aux_loss_coef_none_is_the_models_own(tmp_path):
    class Model(nn.Module):
        def __init__(self, **config):
            super().__init__()
            self.config = type("Config", (), config)()

    config = GRPOConfig(output_dir=str(tmp_path), router_aux_loss_coef=None)
    assert resolve_router_aux_loss_coef(config, Model(router_aux_loss_coef=0.02)) == 0.02
    assert config.router_aux_loss_coef == 0.02
    config = GRPOConfig(output_dir=str(tmp_path), router_aux_loss_coef=None)
    assert resolve_router_aux_loss_coef(config, Model()) == 0.0
    config = GRPOConfig(output_dir=str(tmp_path), router_aux_loss_coef=0.5)
    assert resolve_router_aux_loss_coef(config, Model(router_aux_loss_coef=0.02)) == 0.5


# -- TRL 1.16's GRPO / RLOO fields ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "fields", "message"),
    [
        (GRPOConfig, {"max_tool_calling_iterations": 3}, "max_tool_calling_iterations=3 is not supported .*tools"),
        (GRPOConfig, {"log_completions_hub_repo": "me/logs"}, "log_completions_hub_repo='me/logs' is not supported"),
        (GRPOConfig, {"use_transformers_continuous_batching": True}, "continuous batching is not used"),
        (RLOOConfig, {"transformers_continuous_batching_config": {"a": 1}}, "continuous batching is not used"),
        (RLOOConfig, {"epsilon_high": 0.1}, r"epsilon_high=0.1 must be >= cliprange=0.2"),
    ],
)
def test_grpo_and_rloo_refusals(tmp_path, cls, fields, message):
    with pytest.raises(ConfigError, match=message):
        cls(output_dir=str(tmp_path), **fields)


def test_rloo_epsilon_high_is_the_upper_clip(tmp_path, tiny_tokenizer, monkeypatch):
    import posttrain.trainers.rloo as rloo

    bounds = []
    real = rloo.ppo_policy_loss

    def spy(*args, **kwargs):
        bounds.append(args[4:6])
        return real(*args, **kwargs)

    monkeypatch.setattr(rloo, "ppo_policy_loss", spy)
    config = rloo_config(tmp_path, epsilon=0.2, epsilon_high=0.28, total_episodes=4, logging_steps=1)
    trainer = RLOOTrainer(config=config, policy=build_tiny_causal_lm(tiny_tokenizer), reward_model=length_reward,
                          train_dataset=prompt_dataset(), processing_class=tiny_tokenizer)  # fmt: skip
    trainer.train()
    assert bounds and set(bounds) == {(0.2, 0.28)}
    logged = trainer.state.log_history[0]
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert logged[name] == 0.0  # one pass over the rollout: every ratio is exactly 1


def test_log_unique_prompts_keeps_one_row_per_prompt(tmp_path, tiny_tokenizer):
    tables = {}
    for unique in (False, True):
        config = grpo_config(
            tmp_path,
            name=f"unique{unique}",
            num_generations=2,  # 2 prompts × 2 completions per rollout batch
            total_episodes=4,
            log_completions=True,
            log_unique_prompts=unique,
            logging_steps=1,
        )
        policy = build_tiny_causal_lm(tiny_tokenizer)
        trainer = GRPOTrainer(policy, length_reward, config, prompt_dataset(), processing_class=tiny_tokenizer)
        trainer.train()
        lines = (tmp_path / f"unique{unique}" / "samples.jsonl").read_text().splitlines()
        tables[unique] = [json.loads(line) for line in lines]
    prompts = [row["prompt"] for row in tables[False]]
    assert len(prompts) == 4 and len(set(prompts)) == 2
    assert [row["prompt"] for row in tables[True]] == list(dict.fromkeys(prompts))
    first = {row["prompt"]: row for row in reversed(tables[False])}  # the first row of each prompt
    assert [row["completion"] for row in tables[True]] == [first[p]["completion"] for p in dict.fromkeys(prompts)]


# -- cast_lm_head_to_fp32 ------------------------------------------------------------------------------------


def test_float32_head_computes_in_float32_under_bf16_autocast():
    torch.manual_seed(0)
    plain = nn.Linear(16, 40, bias=False)
    head = Float32LMHead(16, 40, bias=False)
    head.weight.data.copy_(plain.weight.data)
    x = torch.randn(3, 16)
    exact = (x.double() @ plain.weight.double().T).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rounded, full = plain(x), head(x.bfloat16())
    assert rounded.dtype == torch.bfloat16 and full.dtype == torch.float32
    # the bf16 input is the only rounding left: compare with the exact product of the same bf16 input
    torch.testing.assert_close(full, (x.bfloat16().double() @ plain.weight.double().T).float(), atol=1e-5, rtol=1e-5)
    assert (rounded.float() - exact).abs().max() > 1e-3  # what autocast's bf16 head would have given


def test_cast_lm_head_to_fp32_in_grpo(tmp_path, tiny_tokenizer):
    policy = build_tiny_causal_lm(tiny_tokenizer).to(torch.bfloat16)
    config = grpo_config(tmp_path, cast_lm_head_to_fp32=True, beta=0.1, total_episodes=4)
    trainer = GRPOTrainer(policy, length_reward, config, prompt_dataset(), processing_class=tiny_tokenizer)
    for model in (trainer.model, trainer.ref_model):
        head = model.get_output_embeddings()
        assert isinstance(head, Float32LMHead) and head.weight.dtype == torch.float32
        assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    before = trainer.model.lm_head.weight.detach().clone()
    trainer.train()
    assert not torch.equal(trainer.model.lm_head.weight, before)  # the float32 head trains
    saved = (tmp_path / "out").glob("*.safetensors")
    from safetensors.torch import load_file

    weights = {k: v for f in saved for k, v in load_file(f).items()}
    assert weights["lm_head.weight"].dtype == torch.float32


def test_cast_lm_head_to_fp32_with_tied_embeddings_keeps_one_matrix(tiny_tokenizer):
    tied = build_tiny_causal_lm(tiny_tokenizer, tie_word_embeddings=True).to(torch.bfloat16)
    ids = torch.tensor([[1, 2, 3]])
    before = tied(ids).logits.float()
    cast_lm_head_to_fp32(tied)
    head, embed = tied.get_output_embeddings(), tied.get_input_embeddings()
    assert isinstance(head, Float32LMHead) and head.weight is embed.weight and head.weight.dtype == torch.float32
    assert embed(ids).dtype == torch.bfloat16  # the rest of the model still gets bf16 inputs
    after = tied(ids).logits
    assert after.dtype == torch.float32
    # the same bf16 trunk; only the head's rounding differs
    torch.testing.assert_close(after, before, atol=0.05, rtol=0.02)


def test_cast_lm_head_to_fp32_refuses_a_lora_head(tiny_tokenizer):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        build_tiny_causal_lm(tiny_tokenizer), peft.LoraConfig(r=2, target_modules=["lm_head", "q_proj"])
    )
    with pytest.raises(ConfigError, match="LM head is a LoRA layer"):
        cast_lm_head_to_fp32(model)
