"""posttrain.value_head: TRL's classic value-head models, their checkpoints, create_reference_model,
and LengthSampler. Tiny GPT-2 / Llama / T5 / BART models are built from config (no hub)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import posttrain
from helpers import VOCAB, tiny_bart, tiny_t5
from posttrain.length_sampler import LengthSampler
from posttrain.models import CausalLMWithValueHead
from posttrain.value_head import (
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    ValueHead,
    create_reference_model,
)

FIXTURES = Path(__file__).parent / "fixtures" / "trl_value_head"


# -- tiny models built offline ----------------------------------------------------------------------
def gpt2(n_layer: int = 3, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=n_layer, n_head=2, n_positions=32)
    return transformers.GPT2LMHeadModel(config).eval()


def llama(seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return transformers.LlamaForCausalLM(config).eval()


def t5(seed: int = 0) -> transformers.PreTrainedModel:
    return tiny_t5(seed).eval()


def bart(seed: int = 0) -> transformers.PreTrainedModel:
    return tiny_bart(seed).eval()


IDS = torch.tensor([[5, 17, 33, 2, 9], [9, 40, 11, 63, 4]])
DEC_IDS = torch.tensor([[0, 7, 21], [0, 50, 3]])


def head_by_hand(model, hidden: torch.Tensor) -> torch.Tensor:
    """summary(hidden) written out: hidden · w + b, (B, T)."""
    w, b = model.v_head.summary.weight[0], model.v_head.summary.bias[0]
    return hidden.float() @ w + b


def safetensors_keys(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def same_head(a, b) -> bool:
    return torch.equal(a.v_head.summary.weight, b.v_head.summary.weight) and torch.equal(
        a.v_head.summary.bias, b.v_head.summary.bias
    )


# -- exports -----------------------------------------------------------------------------------------
def test_exported_from_posttrain():
    assert posttrain.AutoModelForCausalLMWithValueHead is AutoModelForCausalLMWithValueHead
    assert posttrain.AutoModelForSeq2SeqLMWithValueHead is AutoModelForSeq2SeqLMWithValueHead
    assert posttrain.create_reference_model is create_reference_model
    assert issubclass(posttrain.AutoModelForSeq2SeqLMWithValueHead, posttrain.PreTrainedModelWrapper)
    assert issubclass(posttrain.AutoModelForCausalLMWithValueHead, posttrain.PreTrainedModelWrapper)
    assert posttrain.LengthSampler is LengthSampler
    assert AutoModelForCausalLMWithValueHead.transformers_parent_class is transformers.AutoModelForCausalLM
    assert AutoModelForSeq2SeqLMWithValueHead.transformers_parent_class is transformers.AutoModelForSeq2SeqLM


# -- forward -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_causal_forward_returns_logits_loss_and_values_from_the_last_hidden_state(build):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(build()).eval()
    mask = torch.ones_like(IDS)
    mask[0, 0] = 0
    with torch.no_grad():
        logits, loss, value = model(IDS, attention_mask=mask)
        ref = model.pretrained_model(input_ids=IDS, attention_mask=mask, output_hidden_states=True)
    assert logits.shape == (2, 5, VOCAB) and logits.dtype == torch.float32
    assert loss is None
    assert value.shape == (2, 5) and value.dtype == torch.float32
    torch.testing.assert_close(logits, ref.logits)
    torch.testing.assert_close(value, head_by_hand(model, ref.hidden_states[-1]))
    # With labels the LM's own loss comes back; keywords reach the wrapped model.
    with torch.no_grad():
        _, loss, _ = model(input_ids=IDS, attention_mask=mask, labels=IDS)
        expected = model.pretrained_model(input_ids=IDS, attention_mask=mask, labels=IDS).loss
    torch.testing.assert_close(loss, expected)


def test_causal_forward_with_cache_and_past_key_values():
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2()).eval()
    with torch.no_grad():
        full_logits, _, full_value = model(IDS, use_cache=False)
        *_, past = model(IDS[:, :3], use_cache=True, return_past_key_values=True)
        logits, _, value = model(IDS[:, 3:], past_key_values=past, use_cache=True)
    torch.testing.assert_close(logits, full_logits[:, 3:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(value, full_value[:, 3:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("build", [t5, bart], ids=["t5", "bart"])
def test_seq2seq_values_come_from_the_decoder(build):
    model = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(build()).eval()
    assert model.is_encoder_decoder is True
    with torch.no_grad():
        logits, loss, value = model(IDS, attention_mask=torch.ones_like(IDS), decoder_input_ids=DEC_IDS)
        ref = model.pretrained_model(input_ids=IDS, decoder_input_ids=DEC_IDS, output_hidden_states=True)
    # 5 encoder positions, 3 decoder positions: values follow the decoder.
    assert logits.shape == (2, 3, VOCAB) and loss is None
    assert value.shape == (2, 3)
    torch.testing.assert_close(value, head_by_hand(model, ref.decoder_hidden_states[-1]))
    with torch.no_grad():
        _, loss, value = model(IDS, labels=DEC_IDS)
    assert loss is not None and value.shape == (2, 3)


def test_generate_delegates_to_the_wrapped_model():
    causal = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2())
    out = causal.generate(IDS, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 9)
    assert torch.equal(out, causal.pretrained_model.generate(IDS, max_new_tokens=4, do_sample=False, pad_token_id=0))
    for build in (t5, bart):
        seq2seq = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(build())
        out = seq2seq.generate(IDS, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        assert out.shape == (2, 5)  # the decoder start token plus 4 new tokens
        expected = seq2seq.pretrained_model.generate(IDS, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        assert torch.equal(out, expected)


# -- the head's settings ------------------------------------------------------------------------------
def test_value_head_settings_follow_trl():
    # Neither config carries summary_dropout_prob: TRL's default 0.1.
    for build in (gpt2, llama):
        head = AutoModelForCausalLMWithValueHead.from_pretrained(build()).v_head
        assert isinstance(head.dropout, nn.Dropout) and head.dropout.p == 0.1
        assert head.summary.in_features == 16 and head.summary.out_features == 1
        assert head.summary.weight.dtype == torch.float32
    head = AutoModelForCausalLMWithValueHead.from_pretrained(llama(), summary_dropout_prob=0.3).v_head
    assert head.dropout.p == 0.3
    # A config that carries it sets the default; a keyword given explicitly wins over it.
    lm = llama()
    lm.config.summary_dropout_prob = 0.2
    assert AutoModelForCausalLMWithValueHead(lm).v_head.dropout.p == 0.2
    assert AutoModelForCausalLMWithValueHead(lm, summary_dropout_prob=0.3).v_head.dropout.p == 0.3
    head = AutoModelForCausalLMWithValueHead.from_pretrained(llama(), summary_dropout_prob=0.0).v_head
    assert isinstance(head.dropout, nn.Identity)
    # "normal": N(0, range^2) weights, zero bias; range 0 gives exact zeros.
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        gpt2(), v_head_init_strategy="normal", v_head_initializer_range=0.0
    )
    assert torch.count_nonzero(model.v_head.summary.weight) == 0
    assert torch.count_nonzero(model.v_head.summary.bias) == 0
    torch.manual_seed(1)
    model = AutoModelForCausalLMWithValueHead(llama(), v_head_init_strategy="normal", v_head_initializer_range=5.0)
    assert model.v_head.summary.weight.std() > 1.0 and model.v_head.summary.bias.item() == 0.0
    with pytest.raises(ValueError, match="v_head_init_strategy"):
        AutoModelForCausalLMWithValueHead(gpt2(), v_head_init_strategy="xavier")
    with pytest.raises(TypeError, match="summary_dropout"):
        AutoModelForCausalLMWithValueHead(gpt2(), dropout=0.1)
    with pytest.raises(ValueError, match="string or a PreTrainedModel"):
        AutoModelForCausalLMWithValueHead.from_pretrained(3)


def test_half_precision_trunk_keeps_a_float32_head(tmp_path):
    gpt2().save_pretrained(tmp_path)
    for key in ("torch_dtype", "dtype"):  # TRL 0.19 scripts pass torch_dtype; newer ones dtype
        model = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path), **{key: torch.bfloat16})
        assert model.pretrained_model.dtype == torch.bfloat16
        assert model.v_head.summary.weight.dtype == torch.float32
        logits, _, value = model(IDS)
        assert logits.dtype == torch.float32 and value.dtype == torch.float32


# -- state dicts and checkpoints -----------------------------------------------------------------------
def test_state_dict_has_trl_keys_and_loads_back():
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2())
    state = model.state_dict()
    lm_keys = set(model.pretrained_model.state_dict())
    assert set(state) == lm_keys | {"v_head.summary.weight", "v_head.summary.bias"}
    other = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2(seed=5))
    assert not same_head(model, other)
    other.load_state_dict(state)
    assert same_head(model, other)
    for key, value in model.pretrained_model.state_dict().items():
        assert torch.equal(other.pretrained_model.state_dict()[key], value)
    # Inside a parent module (as PPO's policy-and-value wrapper holds it) the layout nests under
    # the parent's attribute name, and the parent loads it back.
    parent = nn.ModuleDict({"policy": model})
    nested = parent.state_dict()
    assert "policy.v_head.summary.weight" in nested and "policy.transformer.wte.weight" in nested
    fresh = nn.ModuleDict({"policy": AutoModelForCausalLMWithValueHead.from_pretrained(gpt2(seed=6))})
    fresh.load_state_dict(nested)
    assert same_head(fresh["policy"], model)


@pytest.mark.parametrize("kind", ["causal", "seq2seq"])
def test_save_load_round_trip_in_trl_layout(tmp_path, kind):
    cls, build, plain = {
        "causal": (AutoModelForCausalLMWithValueHead, gpt2, transformers.AutoModelForCausalLM),
        "seq2seq": (AutoModelForSeq2SeqLMWithValueHead, t5, transformers.AutoModelForSeq2SeqLM),
    }[kind]
    model = cls.from_pretrained(build(), v_head_init_strategy="normal").eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "config.json").is_file()
    stored = safetensors_keys(tmp_path)
    assert torch.equal(stored["v_head.summary.weight"], model.v_head.summary.weight.detach())
    assert torch.equal(stored["v_head.summary.bias"], model.v_head.summary.bias.detach())
    assert not any(k.startswith("pretrained_model.") for k in stored)
    loaded = cls.from_pretrained(str(tmp_path)).eval()
    assert same_head(loaded, model)
    kw = {"decoder_input_ids": DEC_IDS} if kind == "seq2seq" else {}
    with torch.no_grad():
        expected, got = model(IDS, **kw), loaded(IDS, **kw)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[2], expected[2])
    # transformers' own Auto class reads the folder too (the v_head keys are skipped).
    lm = plain.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(lm(input_ids=IDS, **kw).logits, expected[0])
    # A pathlib.Path works as well as a string.
    assert same_head(cls.from_pretrained(tmp_path), model)


@pytest.mark.parametrize("kind", ["causal", "seq2seq"])
def test_sharded_checkpoint_round_trip(tmp_path, kind):
    cls, build = {
        "causal": (AutoModelForCausalLMWithValueHead, llama),
        "seq2seq": (AutoModelForSeq2SeqLMWithValueHead, bart),
    }[kind]
    model = cls.from_pretrained(build())
    model.save_pretrained(tmp_path, max_shard_size="10KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    assert {"v_head.summary.weight", "v_head.summary.bias"} <= set(index["weight_map"])
    loaded = cls.from_pretrained(str(tmp_path))
    assert same_head(loaded, model)
    for key, value in model.pretrained_model.state_dict().items():
        assert torch.equal(loaded.pretrained_model.state_dict()[key], value), key


def test_trl_checkpoint_written_by_hand_loads(tmp_path):
    """A folder holding TRL's layout, written key by key: the LM's tensors plus v_head.summary.*."""
    lm = gpt2()
    lm.save_pretrained(tmp_path / "safe")
    weight = torch.arange(16, dtype=torch.float32).reshape(1, 16) / 100
    bias = torch.tensor([0.25])
    state = {k: v.contiguous() for k, v in lm.state_dict().items() if k != "lm_head.weight"}  # tied to wte
    save_file(
        {**state, "v_head.summary.weight": weight, "v_head.summary.bias": bias},
        str(tmp_path / "safe" / "model.safetensors"),
        metadata={"format": "pt"},
    )
    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "safe")).eval()
    assert torch.equal(model.v_head.summary.weight, weight) and torch.equal(model.v_head.summary.bias, bias)
    with torch.no_grad():
        _, _, value = model(IDS)
        hidden = lm(input_ids=IDS, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(value, hidden @ weight[0] + 0.25)
    # The same layout in pytorch_model.bin (TRL's older default).
    lm.config.save_pretrained(tmp_path / "bin")
    torch.save(
        {**lm.state_dict(), "v_head.summary.weight": weight * 2, "v_head.summary.bias": bias * 2},
        tmp_path / "bin" / "pytorch_model.bin",
    )
    assert not (tmp_path / "bin" / "model.safetensors").exists()
    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "bin"))
    assert torch.equal(model.v_head.summary.weight, weight * 2) and torch.equal(model.v_head.summary.bias, bias * 2)


def test_checkpoint_without_a_head_gets_a_fresh_one(tmp_path):
    gpt2().save_pretrained(tmp_path)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        str(tmp_path), v_head_init_strategy="normal", v_head_initializer_range=0.0
    )
    assert torch.count_nonzero(model.v_head.summary.weight) == 0


def test_checkpoints_saved_by_trl_0_19_1_load_with_identical_values():
    """tests/fixtures/trl_value_head was written by TRL 0.19.1 (tests/fixtures/make_trl_value_head.py);
    the expected numbers are what TRL's own classes computed on those models."""
    causal = AutoModelForCausalLMWithValueHead.from_pretrained(str(FIXTURES / "causal")).eval()
    expected_weight = [0.05303, 0.154834, 0.110372, -0.123241, 0.051778, 0.086571, 0.213752, 0.093139]
    expected_weight += [0.014348, -0.15159, 0.10353, 0.03805, 0.207866, 0.225629, 0.159681, 0.032817]
    torch.testing.assert_close(causal.v_head.summary.weight[0], torch.tensor(expected_weight), atol=1e-6, rtol=0)
    torch.testing.assert_close(causal.v_head.summary.bias, torch.tensor([-0.153295]), atol=1e-6, rtol=0)
    ids = torch.tensor([[5, 17, 33, 2], [9, 40, 11, 63]])
    with torch.no_grad():
        logits, _, value = causal(input_ids=ids, attention_mask=torch.ones_like(ids))
    expected_values = [[0.517926, -0.643051, 0.327593, -0.268454], [0.316347, -0.864539, 0.24134, -0.003566]]
    torch.testing.assert_close(value, torch.tensor(expected_values), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        logits[0, 0, :4], torch.tensor([0.12324, -0.099743, -0.059842, -0.084852]), atol=1e-5, rtol=0
    )

    # Sharded by TRL (three files and an index).
    assert (FIXTURES / "seq2seq" / "model.safetensors.index.json").is_file()
    seq2seq = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(str(FIXTURES / "seq2seq")).eval()
    expected_weight = [-0.052545, -0.209534, -0.234682, 0.009578, 0.123903, -0.184633, 0.056197, -0.172225]
    expected_weight += [-0.087331, 0.14271, 0.056472, 0.185084, 0.239334, 0.202381, 0.167435, 0.156619]
    torch.testing.assert_close(seq2seq.v_head.summary.weight[0], torch.tensor(expected_weight), atol=1e-6, rtol=0)
    torch.testing.assert_close(seq2seq.v_head.summary.bias, torch.tensor([-0.175025]), atol=1e-6, rtol=0)
    with torch.no_grad():
        logits, _, value = seq2seq(
            input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=torch.tensor([[0, 7, 21], [0, 50, 3]])
        )
    expected_values = [[0.26152, 0.83808, 0.459897], [0.112842, -0.230916, -0.141057]]
    torch.testing.assert_close(value, torch.tensor(expected_values), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        logits[0, 0, :4], torch.tensor([1.729109, 2.215691, -1.396227, -1.512533]), atol=1e-5, rtol=0
    )


# -- posttrain's own value-head interface ---------------------------------------------------------------
def test_is_a_posttrain_value_head_model():
    model = AutoModelForCausalLMWithValueHead.from_pretrained(llama())
    assert isinstance(model, CausalLMWithValueHead)
    assert model.score is model.v_head
    assert model.backbone is model.pretrained_model.model
    assert model.config is model.pretrained_model.config
    hidden = torch.randn(2, 3, 16)
    model.eval()
    torch.testing.assert_close(model.score(hidden).squeeze(-1), head_by_hand(model, hidden))
    assert not isinstance(AutoModelForSeq2SeqLMWithValueHead.from_pretrained(t5()), CausalLMWithValueHead)


def test_posttrain_ppo_step_trains_the_trl_named_model(tiny_tokenizer):
    from posttrain import PPOConfig, PPOTrainer

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(tiny_tokenizer), n_embd=16, n_layer=2, n_head=2, n_positions=64)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(transformers.GPT2LMHeadModel(config))
    ref = create_reference_model(model)
    cfg = PPOConfig(learning_rate=1e-2, batch_size=4, mini_batch_size=2, report_to="none", seed=0)
    trainer = PPOTrainer(config=cfg, model=model, ref_model=ref, tokenizer=tiny_tokenizer)
    assert trainer.model is model
    head, trunk = model.v_head.summary.weight.detach().clone(), model.pretrained_model.transformer.h[0].mlp.c_fc.weight
    trunk = trunk.detach().clone()
    queries = [torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([10, 11, 12, 13]), torch.tensor([14])]
    responses = [torch.tensor([20, 21]), torch.tensor([22, 23, 24]), torch.tensor([25]), torch.tensor([26, 27])]
    stats = trainer.step(queries, responses, [torch.tensor(s) for s in (1.0, -1.0, 0.5, 0.0)])
    assert np.isfinite(stats["ppo/loss/value"])
    assert not torch.equal(head, model.v_head.summary.weight)
    assert not torch.equal(trunk, model.pretrained_model.transformer.h[0].mlp.c_fc.weight)


def test_posttrain_ppo_train_saves_the_trl_layout(tmp_path, tiny_tokenizer):
    """train() treats it as a value head on the policy's trunk (value_model_init "head") and writes
    output_dir in TRL's layout: the trained head comes back through from_pretrained."""
    from datasets import Dataset

    from posttrain import PPOConfig, PPOTrainer

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(tiny_tokenizer), n_embd=16, n_layer=2, n_head=2, n_positions=64)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(transformers.GPT2LMHeadModel(config))
    head = model.v_head.summary.weight.detach().clone()
    cfg = PPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        total_episodes=4,
        response_length=4,
        learning_rate=1e-2,
        report_to="none",
        num_sample_generations=0,
        save_steps=0,
    )
    trainer = PPOTrainer(
        args=cfg,
        processing_class=tiny_tokenizer,
        model=model,
        reward_model=lambda prompts, completions: [float(len(c)) for c in completions],
        train_dataset=Dataset.from_dict({"prompt": ["hello there", "the quick brown", "what is", "tell me"]}),
    )
    assert trainer.policy_model is model and trainer.value_model is None
    trainer.train()
    assert not torch.equal(head, model.v_head.summary.weight)
    assert {"v_head.summary.weight", "v_head.summary.bias"} <= set(safetensors_keys(tmp_path / "out"))
    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "out"))
    assert same_head(loaded, model)


# -- create_reference_model ------------------------------------------------------------------------------
def test_reference_model_is_a_frozen_copy():
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2()).train()
    ref = create_reference_model(model)
    assert isinstance(ref, AutoModelForCausalLMWithValueHead) and not ref.training
    assert all(not p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in model.parameters())
    mine = {id(p) for p in model.parameters()}
    assert not any(id(p) in mine for p in ref.parameters())
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(ref(IDS)[2], model(IDS)[2])
        model.v_head.summary.bias.add_(1.0)
    assert not torch.equal(ref.v_head.summary.bias, model.v_head.summary.bias)


def test_reference_model_shares_exactly_the_first_layers():
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2(n_layer=3))
    ref = create_reference_model(model, num_shared_layers=2)
    before = ("pretrained_model.transformer.wte.", "pretrained_model.transformer.wpe.")
    first = ("pretrained_model.transformer.h.0.", "pretrained_model.transformer.h.1.")
    ours = dict(model.named_parameters())
    for name, param in ref.named_parameters():
        assert not param.requires_grad
        shared = name.startswith(before + first)
        assert (param is ours[name]) == shared, name
        assert ours[name].requires_grad == (not shared), name
    # The GPT-2 LM head is tied to the embeddings: the copy's tie points at the shared tensor too.
    assert ref.pretrained_model.lm_head.weight is model.pretrained_model.transformer.wte.weight
    assert (
        ref.pretrained_model.transformer.h[2].attn.c_attn.weight
        is not model.pretrained_model.transformer.h[2].attn.c_attn.weight
    )
    # Llama names its layers model.layers.{i}; an explicit pattern works the same way.
    for kwargs in ({}, {"pattern": "model.layers.{layer}"}):
        model = AutoModelForCausalLMWithValueHead.from_pretrained(llama())
        ref = create_reference_model(model, num_shared_layers=1, **kwargs)
        shared = {n for n, p in ref.named_parameters() if p is model.get_parameter(n)}
        assert shared == {
            n
            for n, _ in model.named_parameters()
            if n.startswith(("pretrained_model.model.embed_tokens.", "pretrained_model.model.layers.0."))
        }
    with pytest.raises(ValueError, match="Layer pattern could not be matched"):
        create_reference_model(AutoModelForCausalLMWithValueHead.from_pretrained(gpt2(n_layer=3)), num_shared_layers=3)
    with pytest.raises(ValueError, match="Layer pattern could not be matched"):
        create_reference_model(AutoModelForSeq2SeqLMWithValueHead.from_pretrained(t5()), num_shared_layers=0)


def test_reference_model_layer_pattern_is_not_a_prefix_match():
    """Layer 1 of 12 is `h.1.`, never `h.10.`/`h.11.`: sharing 1 layer shares layer 0 only."""
    model = gpt2(n_layer=12)
    ref = create_reference_model(model, num_shared_layers=1)
    shared = {n.split(".")[2] for n, p in ref.named_parameters() if p is model.get_parameter(n) and ".h." in n}
    assert shared == {"0"}


# -- LengthSampler -----------------------------------------------------------------------------------
def test_length_sampler_draws_ints_in_the_half_open_range():
    sampler = LengthSampler(2, 6)
    np.random.seed(0)
    draws = [sampler() for _ in range(400)]
    assert all(type(d) is int for d in draws)
    assert set(draws) == {2, 3, 4, 5}
    np.random.seed(0)
    assert [sampler() for _ in range(400)] == draws  # reproducible from NumPy's seed, as in TRL
    assert LengthSampler(7, 8)() == 7
    with pytest.raises(ValueError, match="empty"):
        LengthSampler(4, 4)


def test_value_head_module_casts_its_input():
    config = transformers.GPT2Config(n_embd=8, summary_dropout_prob=0.0)
    head = ValueHead(config)
    hidden = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    out = head(hidden)
    assert out.shape == (2, 3, 1) and out.dtype == torch.float32


def test_peft_adapter_with_value_head_saves_and_loads(tmp_path):
    peft = pytest.importorskip("peft")
    llama().save_pretrained(tmp_path / "base")
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "base"), peft_config=lora).eval()
    assert model.is_peft_model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("v_head.") for n in trainable)
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    # TRL's layout: the head alone in pytorch_model.bin beside the adapter
    head = torch.load(tmp_path / "adapter" / "pytorch_model.bin", weights_only=True)
    assert set(head) == {"v_head.summary.weight", "v_head.summary.bias"}
    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "adapter")).eval()
    assert loaded.is_peft_model and same_head(loaded, model)
    # a folder an earlier version wrote, with v_head.safetensors, loads the same head
    from safetensors.torch import save_file

    (tmp_path / "adapter" / "pytorch_model.bin").unlink()
    save_file(head, tmp_path / "adapter" / "v_head.safetensors")
    assert same_head(AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "adapter")), model)
    with torch.no_grad():
        expected, got = model(IDS), loaded(IDS)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[2], expected[2])
