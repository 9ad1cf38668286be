"""posttrain.models: tokenizer / model loaders, dropout, the value-head wrapper; posttrain.testing's tiny builders."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from posttrain.models import (
    VALUE_HEAD_FILE,
    CausalLMWithValueHead,
    disable_dropout,
    ensure_pad_token,
    load_policy,
    load_reward_model,
    load_scalar_model,
    load_tokenizer,
    load_value_model,
    resolve_dtype,
)
from posttrain.testing import EOS_TOKEN, PAD_TOKEN, build_tiny_causal_lm, build_tiny_reward_model, build_tiny_tokenizer


def batch(tokenizer, texts):
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


# --------------------------------------------------------------------------------------------
# tokenizers
# --------------------------------------------------------------------------------------------


def test_tiny_tokenizer(tiny_tokenizer, tiny_tokenizer_pad_eos, tmp_path):
    tok = tiny_tokenizer
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN and tok.pad_token_id != tok.eos_token_id
    assert tok.padding_side == "left"
    text = "Grüße, 世界! The quick brown fox."
    assert tok.decode(tok(text)["input_ids"]) == text, "byte-level BPE round-trips any UTF-8"
    assert (
        tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
        == "user: Hi\nassistant:"
    )
    assert tiny_tokenizer_pad_eos.pad_token_id == tiny_tokenizer_pad_eos.eos_token_id

    build_tiny_tokenizer(save_dir=tmp_path)
    again = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert again.chat_template == tok.chat_template and again.padding_side == "left"


def test_load_tokenizer_keeps_existing_pad(tiny_policy_dir, tiny_tokenizer):
    tok = load_tokenizer(tiny_policy_dir, padding_side="right")
    assert tok.pad_token == PAD_TOKEN and tok.padding_side == "right"
    assert len(tok) == len(tiny_tokenizer)


def test_load_tokenizer_without_pad_uses_eos(tmp_path):
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    tok.pad_token = None
    tok.save_pretrained(str(tmp_path))
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token == EOS_TOKEN and loaded.pad_token_id == loaded.eos_token_id
    assert len(loaded) == len(tok), "no token is added"
    assert loaded.padding_side == "left"
    build_tiny_causal_lm(tok, save_dir=tmp_path / "model")
    model = load_policy(tmp_path / "model", tokenizer=loaded)
    assert model.config.pad_token_id == loaded.eos_token_id
    assert model.get_input_embeddings().num_embeddings == len(loaded)


def test_ensure_pad_token_prefers_pad_like_then_unk():
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    tok.add_special_tokens({"additional_special_tokens": ["<|finetune_right_pad_id|>"]})
    tok.pad_token = None
    n = len(tok)
    assert ensure_pad_token(tok).pad_token == "<|finetune_right_pad_id|>" and len(tok) == n

    tok = build_tiny_tokenizer(pad_equals_eos=True)
    tok.add_special_tokens({"unk_token": "<|unk|>"})
    tok.pad_token = None
    assert ensure_pad_token(tok).pad_token == "<|unk|>"


# --------------------------------------------------------------------------------------------
# loaders
# --------------------------------------------------------------------------------------------


def test_saved_tiny_model_reloads_with_plain_transformers(tiny_policy, tiny_policy_dir, tiny_tokenizer):
    ids, mask = batch(tiny_tokenizer, ["Hello world", "The quick brown fox jumps"])
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir)).eval()
    ours = load_policy(tiny_policy_dir, tokenizer=tiny_tokenizer).eval()
    with torch.no_grad():
        reference = tiny_policy(ids, attention_mask=mask).logits
        assert torch.equal(plain(ids, attention_mask=mask).logits, reference)
        assert torch.equal(ours(ids, attention_mask=mask).logits, reference)
    assert ours.config.pad_token_id == tiny_tokenizer.pad_token_id
    assert ours.dtype == torch.float32


def test_load_policy_dtype_and_gradient_checkpointing(tiny_policy_dir):
    model = load_policy(tiny_policy_dir, dtype="bfloat16", gradient_checkpointing=True)
    assert model.dtype == torch.bfloat16
    assert model.is_gradient_checkpointing and model.config.use_cache is False
    assert resolve_dtype("auto") == "auto" and resolve_dtype(None) == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        resolve_dtype("float8")


def test_load_policy_resizes_only_when_tokens_were_added(tiny_policy_dir):
    tok = load_tokenizer(tiny_policy_dir)
    n = len(tok)
    assert load_policy(tiny_policy_dir, tokenizer=tok).get_input_embeddings().num_embeddings == n
    tok.add_special_tokens({"additional_special_tokens": ["<|new|>"]})
    model = load_policy(tiny_policy_dir, tokenizer=tok)
    assert model.get_input_embeddings().num_embeddings == n + 1


@pytest.mark.parametrize("arch", ["gpt_neox", "llama"])
def test_dropout_disabled(tmp_path, tiny_tokenizer, arch):
    overrides = {"hidden_dropout": 0.5, "attention_dropout": 0.5} if arch == "gpt_neox" else {"attention_dropout": 0.5}
    build_tiny_causal_lm(tiny_tokenizer, arch=arch, save_dir=tmp_path, **overrides)
    ids, mask = batch(tiny_tokenizer, ["Hello world, the sea is wide"])

    kept = load_policy(tmp_path, disable_dropout=False).train()
    with torch.no_grad():
        assert not torch.equal(kept(ids, attention_mask=mask).logits, kept(ids, attention_mask=mask).logits)

    model = load_policy(tmp_path).train()
    assert all(m.p == 0 for m in model.modules() if isinstance(m, nn.Dropout))
    assert all(v == 0 for k, v in model.config.to_dict().items() if "dropout" in k and isinstance(v, float))
    with torch.no_grad():
        train_logits = model(ids, attention_mask=mask).logits
        assert torch.equal(train_logits, model(ids, attention_mask=mask).logits)
        assert torch.allclose(train_logits, model.eval()(ids, attention_mask=mask).logits)


def test_disable_dropout_on_plain_module():
    net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.3))
    disable_dropout(net)
    assert net[1].p == 0


def test_reward_model_pad_token_id(tiny_reward_model, tiny_reward_model_dir, tiny_tokenizer, tmp_path):
    assert tiny_reward_model.config.num_labels == 1
    assert tiny_reward_model.config.pad_token_id == tiny_tokenizer.pad_token_id

    rm = load_reward_model(tiny_reward_model_dir, tokenizer=tiny_tokenizer)
    assert isinstance(rm, transformers.LlamaForSequenceClassification)
    assert rm.config.num_labels == 1 and rm.config.pad_token_id == tiny_tokenizer.pad_token_id
    ids, mask = batch(tiny_tokenizer, ["Hello world"])
    with torch.no_grad():
        assert torch.equal(rm(ids, attention_mask=mask).logits, tiny_reward_model(ids, attention_mask=mask).logits)

    # A checkpoint whose config lost its pad id gets it from the tokenizer saved beside it.
    model = build_tiny_reward_model(tiny_tokenizer)
    model.config.pad_token_id = None
    model.save_pretrained(str(tmp_path / "rm"))
    tiny_tokenizer.save_pretrained(str(tmp_path / "rm"))
    assert load_reward_model(tmp_path / "rm").config.pad_token_id == tiny_tokenizer.pad_token_id
    # ... and without any tokenizer the error says what to pass.
    model.save_pretrained(str(tmp_path / "rm_no_tok"))
    with pytest.raises(ValueError, match="pass tokenizer= or pad_token_id="):
        load_reward_model(tmp_path / "rm_no_tok")
    assert load_reward_model(tmp_path / "rm_no_tok", pad_token_id=3).config.pad_token_id == 3


def test_value_model_from_policy_checkpoint(tiny_policy_dir, tiny_tokenizer):
    critic = load_value_model(tiny_policy_dir, tokenizer=tiny_tokenizer)
    assert critic.config.num_labels == 1 and critic.config.pad_token_id == tiny_tokenizer.pad_token_id
    ids, mask = batch(tiny_tokenizer, ["Hello", "The quick brown fox"])
    hidden = getattr(critic, critic.base_model_prefix)(ids, attention_mask=mask).last_hidden_state
    assert critic.score(hidden).shape == (2, ids.shape[1], 1)


def test_reward_and_value_loaders_are_one_scalar_loader(tiny_reward_model_dir, tiny_tokenizer, tmp_path):
    # The same folder loads to the same weights through either name (and positional arguments pass through).
    rm = load_reward_model(tiny_reward_model_dir, "float32", tokenizer=tiny_tokenizer)
    critic = load_value_model(tiny_reward_model_dir, "float32", tokenizer=tiny_tokenizer)
    assert type(rm) is type(critic)
    for (name, a), b in zip(rm.state_dict().items(), critic.state_dict().values()):
        assert torch.equal(a, b), name
    # The role only names the model in messages.
    model = build_tiny_reward_model(tiny_tokenizer)
    model.config.pad_token_id = None
    model.save_pretrained(str(tmp_path / "no_pad"))
    with pytest.raises(ValueError, match="^value model .*no_pad has no pad_token_id"):
        load_value_model(tmp_path / "no_pad")
    with pytest.raises(ValueError, match="^reward model .*no_pad has no pad_token_id"):
        load_scalar_model(tmp_path / "no_pad")
    with pytest.raises(ValueError, match=r"role must be one of \('reward', 'value'\)"):
        load_scalar_model(tiny_reward_model_dir, role="critic")


# --------------------------------------------------------------------------------------------
# value head
# --------------------------------------------------------------------------------------------


def test_value_head_forward_matches_backbone_plus_score(tiny_policy, tiny_tokenizer):
    model = CausalLMWithValueHead(tiny_policy).eval()
    ids, mask = batch(tiny_tokenizer, ["Hello world", "Hi"])
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
        assert out.logits.shape == (2, ids.shape[1], len(tiny_tokenizer))
        assert out.values.shape == ids.shape and out.values.dtype == torch.float32
        assert torch.equal(out.logits, tiny_policy(ids, attention_mask=mask).logits)
        hidden = getattr(model, model.base_model_prefix)(ids, attention_mask=mask).last_hidden_state
        assert torch.allclose(model.score(hidden).squeeze(-1), out.values)


def test_value_head_save_load_round_trip(tiny_tokenizer, tmp_path):
    model = CausalLMWithValueHead(build_tiny_causal_lm(tiny_tokenizer, arch="gpt_neox", seed=3)).eval()
    with torch.no_grad():
        model.score.bias.fill_(0.25)
    model.save_pretrained(tmp_path)
    assert (tmp_path / VALUE_HEAD_FILE).is_file()
    again = CausalLMWithValueHead.from_pretrained(tmp_path).eval()
    ids, mask = batch(tiny_tokenizer, ["Hello world", "Hi"])
    with torch.no_grad():
        a, b = model(ids, attention_mask=mask), again(ids, attention_mask=mask)
    assert torch.equal(a.values, b.values) and torch.equal(a.logits, b.logits)
    # The LM part is an ordinary checkpoint.
    assert isinstance(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)), transformers.GPTNeoXForCausalLM)


def test_value_head_on_plain_lm_checkpoint_and_bf16(tiny_policy_dir, tiny_tokenizer):
    model = CausalLMWithValueHead.from_pretrained(tiny_policy_dir, dtype="bfloat16")
    assert model.pretrained_model.dtype == torch.bfloat16 and model.score.weight.dtype == torch.float32
    ids, mask = batch(tiny_tokenizer, ["Hello world"])
    out = model(ids, attention_mask=mask)
    out.values.sum().backward()
    assert model.score.weight.grad is not None
    assert out.values.dtype == torch.float32


# --------------------------------------------------------------------------------------------
# tiny builders
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_tiny_builders_are_seeded_and_leave_global_rng_alone(tiny_tokenizer, arch):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_causal_lm(tiny_tokenizer, arch=arch, seed=5)
    assert torch.equal(torch.rand(3), expected)
    b = build_tiny_causal_lm(tiny_tokenizer, arch=arch, seed=5)
    c = build_tiny_causal_lm(tiny_tokenizer, arch=arch, seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    assert a.config.vocab_size == len(tiny_tokenizer) and a.config.pad_token_id == tiny_tokenizer.pad_token_id
    assert a.generation_config.eos_token_id == tiny_tokenizer.eos_token_id
    assert sum(p.numel() for p in a.parameters()) < 100_000
    with pytest.raises(ValueError, match="unknown tiny arch"):
        build_tiny_causal_lm(tiny_tokenizer, arch="gpt2")


def test_tiny_reward_model_with_pad_equals_eos(tiny_tokenizer_pad_eos):
    rm = build_tiny_reward_model(tiny_tokenizer_pad_eos, arch="gpt_neox")
    assert rm.config.num_labels == 1 and rm.config.pad_token_id == tiny_tokenizer_pad_eos.eos_token_id
    ids, mask = batch(tiny_tokenizer_pad_eos, ["Hello world", "Hi"])
    with torch.no_grad():
        assert rm(ids, attention_mask=mask).logits.shape == (2, 1)


def test_missing_local_model_folder_is_a_clear_error(tmp_path):
    from posttrain.models import ModelNotFoundError, load_policy, load_reward_model, load_tokenizer

    missing = str(tmp_path / "no-such-model")
    for load in (load_tokenizer, load_policy, load_reward_model):
        with pytest.raises(ModelNotFoundError, match="no such folder"):
            load(missing)
