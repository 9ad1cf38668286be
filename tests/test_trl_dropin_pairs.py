"""TRL drop-in details of Online DPO and XPO that TRL's own test suites use: the 1.x keywords
`reward_funcs=` / `reward_processing_classes=` and attributes `reward_funcs` / `reward_weights`,
the 1.x import paths under `posttrain.experimental`, and a model that already carries a LoRA adapter
given together with `peft_config` (TRL merges the old adapter and trains only the new one)."""

from __future__ import annotations

import pytest
import torch

from helpers import pair_config, word_prompts
from posttrain.testing import build_tiny_causal_lm, build_tiny_reward_model, build_tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def half(prompts, completions, **kwargs):
    return [0.5] * len(completions)


def test_experimental_import_paths_name_the_same_classes():
    from posttrain import OnlineDPOConfig, OnlineDPOTrainer, PPOConfig, PPOTrainer, XPOConfig, XPOTrainer
    from posttrain.experimental import online_dpo, ppo, xpo
    from posttrain.experimental.ppo.ppo_trainer import masked_mean
    from posttrain.trainer.utils import SIMPLE_CHAT_TEMPLATE

    assert (xpo.XPOConfig, xpo.XPOTrainer) == (XPOConfig, XPOTrainer)
    assert (online_dpo.OnlineDPOConfig, online_dpo.OnlineDPOTrainer) == (OnlineDPOConfig, OnlineDPOTrainer)
    assert (ppo.PPOConfig, ppo.PPOTrainer) == (PPOConfig, PPOTrainer)
    # masked mean of [1, 2, 3] over the first two = 1.5
    assert masked_mean(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 1, 0])).item() == 1.5
    tok = build_tiny_tokenizer(chat_template=SIMPLE_CHAT_TEMPLATE)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "User: Hi\n\nAssistant:"


def test_trl1x_reward_keywords_and_attributes(tmp_path, tiny_tokenizer):
    from posttrain import OnlineDPOTrainer, XPOConfig, XPOTrainer
    from posttrain.trainers.online_dpo_config import OnlineDPOConfig

    other = build_tiny_tokenizer(vocab_size=300)
    cfg = pair_config(XPOConfig, tmp_path, total_episodes=4, gradient_accumulation_steps=1)
    xpo = XPOTrainer(
        model=build_tiny_causal_lm(tiny_tokenizer),
        reward_funcs=[build_tiny_reward_model(other, seed=3), half],
        reward_processing_classes=[other, None],
        args=cfg,
        processing_class=tiny_tokenizer,
        train_dataset=word_prompts(4),
    )
    assert len(xpo.reward_funcs) == 2 and xpo.reward_funcs[1] is half
    assert xpo.feedback.reward.reward_tokenizer is other
    assert torch.equal(xpo.reward_weights, torch.tensor([1.0, 1.0]))
    xpo.train()
    assert "train_loss" in xpo.state.log_history[-1]

    cfg = pair_config(OnlineDPOConfig, tmp_path, reward_weights=[0.7, 0.3], output_dir=str(tmp_path / "odpo"))
    odpo = OnlineDPOTrainer(
        model=build_tiny_causal_lm(tiny_tokenizer),
        reward_funcs=[half, half],
        args=cfg,
        processing_class=tiny_tokenizer,
        train_dataset=word_prompts(4),
    )
    assert len(odpo.reward_funcs) == 2
    assert torch.allclose(odpo.reward_weights, torch.tensor([0.7, 0.3]))
    with pytest.raises(TypeError, match="reward_processing_class"):
        OnlineDPOTrainer(
            model=build_tiny_causal_lm(tiny_tokenizer),
            reward_funcs=[half],
            args=cfg,
            processing_class=tiny_tokenizer,
            reward_processing_class=other,
            reward_processing_classes=other,
            train_dataset=word_prompts(4),
        )


def test_peft_model_with_peft_config_merges_the_old_adapter(tmp_path, tiny_tokenizer):
    peft = pytest.importorskip("peft")
    from posttrain import XPOConfig, XPOTrainer

    base = build_tiny_causal_lm(tiny_tokenizer)
    old = peft.get_peft_model(
        base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False)
    )
    with torch.no_grad():
        ids = torch.tensor([[5, 6, 7]])
        expected = old(ids).logits  # base + old adapter
    cfg = pair_config(XPOConfig, tmp_path, total_episodes=4, gradient_accumulation_steps=1)
    trainer = XPOTrainer(
        model=old,
        reward_funcs=half,
        args=cfg,
        processing_class=tiny_tokenizer,
        train_dataset=word_prompts(4),
        peft_config=peft.LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj"]),
    )
    model = trainer.model
    # one adapter left, the new one (on v_proj); the old one is merged into the base weights
    assert list(model.peft_config) == ["default"] and model.peft_config["default"].target_modules == {"v_proj"}
    assert not any("q_proj.lora" in n for n, _ in model.named_parameters())
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if "lora_" in n
    }
    with torch.no_grad(), model.disable_adapter():
        assert torch.allclose(model(ids).logits, expected, atol=1e-5)  # the reference = base + old adapter


def test_trl011_tokenizer_keyword_and_availability_checks(tmp_path, tiny_tokenizer):
    """TRL 0.11's Online DPO / XPO took the tokenizer as `tokenizer=`; its tests import
    `is_llm_blender_available` from the package and the others from `trl.import_utils`."""
    import importlib.util

    from posttrain import OnlineDPOTrainer, XPOConfig, XPOTrainer, is_llm_blender_available
    from posttrain.configs import ConfigError
    from posttrain.import_utils import is_rich_available, is_vllm_available

    assert is_rich_available() is True  # a dependency
    assert is_rich_available(min_version="1.0") is True and is_rich_available(min_version="9999") is False
    assert is_vllm_available() is (importlib.util.find_spec("vllm") is not None)
    assert is_llm_blender_available() is (importlib.util.find_spec("llm_blender") is not None)
    cfg = pair_config(XPOConfig, tmp_path, total_episodes=4, gradient_accumulation_steps=1)
    model = build_tiny_causal_lm(tiny_tokenizer)
    trainer = XPOTrainer(
        model=model, reward_model=half, args=cfg, tokenizer=tiny_tokenizer, train_dataset=word_prompts(4)
    )
    assert trainer.processing_class.get_vocab() == tiny_tokenizer.get_vocab()
    with pytest.raises(
        ConfigError, match=r"pass the tokenizer once: processing_class= \(tokenizer= is its older name\)"
    ):
        OnlineDPOTrainer(
            model=model,
            reward_model=half,
            args=cfg,
            processing_class=tiny_tokenizer,
            tokenizer=build_tiny_tokenizer(vocab_size=300),
            train_dataset=word_prompts(4),
        )
