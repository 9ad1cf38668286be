"""Offline tiny tokenizers and models, built from config alone, for tests, the demo and the benchmarks.

`build_tiny_tokenizer` trains a byte-level BPE tokenizer on a built-in English sample;
`build_tiny_causal_lm` and `build_tiny_reward_model` make randomly initialised Llama / GPT-NeoX
models sized for it. Nothing here touches the network, and building a model never moves the
caller's global torch RNG. These are not for training real models: load those with
`posttrain.models`.

`transformers` and `tokenizers` are imported inside the builders.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from posttrain.compat import dtype_kwargs

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "EOS_TOKEN",
    "PAD_TOKEN",
    "TINY_CHAT_TEMPLATE",
    "build_tiny_causal_lm",
    "build_tiny_reward_model",
    "build_tiny_tokenizer",
]

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

# Chat template of the tiny tokenizer: "role: content" per turn, EOS closing each assistant turn
# (so generation stops on EOS), and a generation prompt that is a strict prefix of the rendered
# assistant turn (so assistant spans can be found by rendering prefixes). Newlines are written as
# `{{ '\n' }}` because transformers renders templates with trim_blocks, which eats a literal
# newline that follows a block tag.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] + ': ' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)

# Default training text for the tiny tokenizer: enough English for BPE merges of common words,
# chat role names and digits, so test strings tokenize into a handful of tokens each.
_DEFAULT_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "user: What is the capital of France?\nassistant: The capital of France is Paris.",
    "system: You are a helpful assistant.\nuser: Write a short poem about the sea.",
    "assistant: The sea is wide and blue, the waves are calm and true.",
    "Once upon a time there was a little robot who loved to read books.",
    "Summarize the following text in one sentence. The movie was great and funny.",
    "I think this answer is good, but that one is better and more helpful.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 2024.",
    "Question: how many legs does a spider have? Answer: eight legs.",
    "Please explain reinforcement learning from human feedback in simple words.",
    "The reward model scores each response; the policy learns to write better responses.",
    "Hello world! Good morning. Thank you very much. Yes, no, maybe.",
]


def build_tiny_tokenizer(
    corpus: list[str] | None = None,
    vocab_size: int = 512,
    save_dir: str | os.PathLike | None = None,
    *,
    pad_equals_eos: bool = False,
    chat_template: str | None = TINY_CHAT_TEMPLATE,
) -> PreTrainedTokenizerBase:
    """Train a byte-level BPE tokenizer on `corpus` (a built-in English sample by default).

    Special tokens: `<|endoftext|>` (eos, also bos) and `<|pad|>` (pad), or pad = eos with
    `pad_equals_eos=True` to exercise that case. Byte-level means any UTF-8 text is encodable.
    Returns a fast tokenizer with left padding and `chat_template` set.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = [EOS_TOKEN] if pad_equals_eos else [EOS_TOKEN, PAD_TOKEN]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps character offsets exact, which label masking relies on.
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus if corpus is not None else _DEFAULT_CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN if pad_equals_eos else PAD_TOKEN,
        padding_side="left",
    )
    tokenizer.chat_template = chat_template
    if save_dir is not None:
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def _tiny_config(
    tokenizer: PreTrainedTokenizerBase,
    arch: str,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    overrides: dict[str, Any],
):
    from transformers import GPTNeoXConfig, LlamaConfig

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        # Grouped-query attention (2 query heads per KV head) exercises the GQA path.
        kv_heads = num_heads // 2 if num_heads % 2 == 0 else num_heads
        return LlamaConfig(**{**common, "num_key_value_heads": kv_heads, **overrides})
    if arch == "gpt_neox":
        return GPTNeoXConfig(**{**common, "use_parallel_residual": True, **overrides})
    raise ValueError(f"unknown tiny arch {arch!r}; use 'llama' or 'gpt_neox'")


def _build_tiny(
    auto_cls_name: str,
    tokenizer: PreTrainedTokenizerBase,
    arch: str,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    seed: int,
    save_dir: str | os.PathLike | None,
    overrides: dict[str, Any],
) -> PreTrainedModel:
    import transformers

    config = _tiny_config(tokenizer, arch, hidden_size, num_layers, num_heads, overrides)
    auto_cls = getattr(transformers, auto_cls_name)
    # A private RNG fork: building a model must not move the caller's global random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto_cls.from_config(config, **dtype_kwargs(torch.float32))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if save_dir is not None:
        model.save_pretrained(str(save_dir))
        tokenizer.save_pretrained(str(save_dir))
    return model


def build_tiny_causal_lm(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    arch: str = "llama",
    seed: int = 0,
    *,
    save_dir: str | os.PathLike | None = None,
    **config_overrides: Any,
) -> PreTrainedModel:
    """A randomly initialised causal LM ("llama" or "gpt_neox") sized for `tokenizer`; float32.

    `config_overrides` go to the config class (e.g. `hidden_dropout=0.1`). With `save_dir`, the
    model and tokenizer are saved there (loadable with plain `from_pretrained`).
    """
    return _build_tiny(
        "AutoModelForCausalLM",
        tokenizer,
        arch,
        hidden_size,
        num_layers,
        num_heads,
        seed,
        save_dir,
        config_overrides,
    )


def build_tiny_reward_model(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    arch: str = "llama",
    seed: int = 0,
    *,
    save_dir: str | os.PathLike | None = None,
    **config_overrides: Any,
) -> PreTrainedModel:
    """A randomly initialised sequence-classification model, `num_labels=1`, `pad_token_id` set."""
    return _build_tiny(
        "AutoModelForSequenceClassification",
        tokenizer,
        arch,
        hidden_size,
        num_layers,
        num_heads,
        seed,
        save_dir,
        {"num_labels": 1, **config_overrides},
    )
