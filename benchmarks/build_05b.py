"""Build a Qwen2.5-0.5B-shaped policy, reward model, tokenizer and datasets offline (random weights).

    PYTHONPATH=src python benchmarks/build_05b.py [OUT]     # default ~/.cache/posttrain-bench/artifacts-05b

Writes, in the layout of ../shared/bench/build_artifacts.py (so TRL's run_*.py scripts take it with
ART=OUT SIZE=05b):

  tokenizer/      byte-level BPE with exactly 151,936 entries (Qwen2.5's vocabulary size)
  policy-05b/     Qwen2ForCausalLM with Qwen2.5-0.5B's config: hidden 896, 24 layers, 14 heads, 2 KV
                  heads, intermediate 4864, vocabulary 151,936, tied embeddings, rope theta 1e6
                  (494,032,768 parameters, float32); random weights (seed 1)
  reward-05b/     Qwen2ForSequenceClassification of the same shape, num_labels 1 (seed 2)
  prompts/        DatasetDict train (1000) / test (100), column "prompt"
  sft/            DatasetDict train / test, columns "prompt", "completion"
  preference/     DatasetDict train / test, columns "prompt", "chosen", "rejected"

Hub downloads are impossible on the benchmark machine, so the tokenizer is trained here: a byte-level BPE
with Qwen2's normalizer (NFC) and pre-tokenizer split, learned on Python's bundled documentation and the
prompts (8,192 entries), then grown to 151,936 entries with merges of two learned word pieces (appended
last, so they only join pieces the learned merges leave adjacent). Every entry is one pre-tokenizer chunk,
reachable by BPE, and decodes to text. AutoTokenizer loads it for the qwen2 model folder on every
supported transformers version: 4.x as the PreTrainedTokenizerFast that tokenizer_config.json names, 5.x
as its Qwen2Tokenizer built from the same vocabulary, merges and split (same ids). config.json carries
both `rope_theta` (read by transformers 4.x) and `rope_parameters` (5.x).

--layers / --hidden / --intermediate shrink the model (same vocabulary) for a quick check.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from pathlib import Path

VOCAB = 151_936
EOS, PAD = "<|endoftext|>", "<|pad|>"
SPECIALS = [EOS, PAD, "<|im_start|>", "<|im_end|>"]
SIZE = "05b"
QWEN25_05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=VOCAB,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    use_sliding_window=False,
    attention_dropout=0.0,
)


def default_out() -> str:
    bench = os.environ.get("POSTTRAIN_BENCH", os.path.expanduser("~/.cache/posttrain-bench"))
    return os.path.join(bench, f"artifacts-{SIZE}")


# ---- text ------------------------------------------------------------------------------------------
SUBJECTS = [
    "a cat", "the river", "an old robot", "my neighbour", "the city", "a small bird", "the teacher", "a lost key",
    "the ocean", "a quiet library", "the last train", "a broken clock", "the garden", "a young king", "the mountain",
    "a friendly dog", "the storm", "a secret door", "the market", "a red balloon", "the moon", "a tired doctor",
]  # fmt: skip
VERBS = ["finds", "loses", "builds", "remembers", "follows", "paints", "hides", "explains", "visits", "fixes"]
OBJECTS = [
    "a map", "the answer", "a strange letter", "an empty box", "the sunrise", "a tiny house", "a long song",
    "the recipe", "a golden coin", "the way home", "a new friend", "the silence",
]  # fmt: skip
TEMPLATES = [
    "Write a short story where {s} {v} {o}.", "Summarize: {S} {v} {o} one morning.", "Explain why {s} {v} {o}.",
    "Continue the text: {S} {v} {o}, and then", "Describe how {s} {v} {o} in two sentences.",
    "Question: what happens when {s} {v} {o}? Answer:", "Write a poem about how {s} {v} {o}.",
]  # fmt: skip
ENDINGS = [
    "It was late, and nobody noticed.", "Everyone smiled at the end of the day.", "Then the rain started again.",
    "Nothing was ever the same after that.", "It took a long time, but it worked.", "The answer was simple.",
]  # fmt: skip


def texts(seed: int = 0) -> tuple[list[str], list[tuple[str, str, str]]]:
    """1100 distinct prompts and, for each, a (good, bad) pair of completions."""
    rng = random.Random(seed)
    prompts: set[str] = set()
    while len(prompts) < 1100:
        s, v, o, t = rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(TEMPLATES)
        prompts.add(t.format(s=s, S=s[0].upper() + s[1:], v=v, o=o))
    ordered = sorted(prompts)
    rng.shuffle(ordered)
    pairs = []
    for p in ordered:
        s, o = rng.choice(SUBJECTS), rng.choice(OBJECTS)
        good = f" {s[0].upper() + s[1:]} {rng.choice(VERBS)} {o}. {rng.choice(ENDINGS)}"
        bad = f" {rng.choice(ENDINGS)} {rng.choice(ENDINGS)}"
        pairs.append((p, good, bad))
    return ordered, pairs


# ---- tokenizer ------------------------------------------------------------------------------------
# Qwen2's split: letters with one leading non-letter, single digits, punctuation runs, whitespace
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_tokenizer(corpus: list[str], vocab_size: int = VOCAB):
    """A byte-level BPE PreTrainedTokenizerFast with exactly `vocab_size` entries and Qwen2's
    normalizer (NFC) and pre-tokenizer (see the module docstring)."""
    import pydoc_data.topics

    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    docs = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(docs + corpus, trainer=trainer)
    spec = json.loads(bpe.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    merges = [m.split(" ") if isinstance(m, str) else list(m) for m in spec["model"]["merges"]]
    # Grow the vocabulary with merges of two learned letter pieces, most frequent first: a word start
    # ("Ġthe", "the") followed by a word continuation ("re"). Each new entry is a longer word piece, one
    # pre-tokenizer chunk, so BPE can reach it and it decodes to text.
    by_id = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in SPECIALS]
    starts = [t for t in by_id if re.fullmatch(r"Ġ?[A-Za-z]+", t)]
    continuations = [t for t in by_id if re.fullmatch(r"[a-z]+", t)]
    need = vocab_size - len(vocab)
    for width in range(1, max(len(starts), len(continuations)) + 1):
        if len(starts[:width]) * len(continuations[:width]) >= 2 * need:
            break
    for a in starts[:width]:
        for b in continuations[:width]:
            if need == 0:
                break
            if a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append([a, b])
                need -= 1
    if len(vocab) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(vocab)} entries, wanted {vocab_size}")
    spec["model"]["merges"] = merges
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token=EOS,
        eos_token=EOS,
        unk_token=EOS,
        pad_token=PAD,
        padding_side="left",
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} entries, wanted {vocab_size}")
    return tokenizer


def save_tokenizer(tokenizer, path: Path) -> None:
    """save_pretrained, then a tokenizer_config.json that transformers 4.x and 5.x both read: the
    PreTrainedTokenizerFast class (5.x writes its own backend's name, unknown to 4.x; for a qwen2 model
    folder 5.x builds Qwen2Tokenizer from the same vocabulary, merges and split) and the chat markers as
    additional_special_tokens (5.x writes a list under extra_special_tokens, which 4.x reads as a dict)."""
    tokenizer.save_pretrained(path)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("backend", "extra_special_tokens"):
        cfg.pop(key, None)
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", additional_special_tokens=SPECIALS[2:])
    cfg_path.write_text(json.dumps(cfg, indent=2))


# ---- models ---------------------------------------------------------------------------------------
def model_config(tokenizer, **overrides):
    from transformers import Qwen2Config

    dims = {**QWEN25_05B, **{k: v for k, v in overrides.items() if v is not None}}
    return Qwen2Config(
        **dims,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def save_model(model, path: Path, rope_theta: float) -> None:
    """save_pretrained, then config.json with rope_theta at the top level too (transformers 4.x reads
    only that; 5.x writes only rope_parameters) and the float32 dtype under both names."""
    model.save_pretrained(path)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_theta"] = rope_theta
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def build(out: str, *, layers: int | None = None, hidden: int | None = None, intermediate: int | None = None) -> dict:
    import torch
    from datasets import Dataset, DatasetDict
    from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    prompts, pairs = texts()
    tokenizer = build_tokenizer(prompts + [g + b for _, g, b in pairs])
    save_tokenizer(tokenizer, root / "tokenizer")

    dims = dict(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate)
    config = model_config(tokenizer, **dims)
    rope_theta = QWEN25_05B["rope_theta"]
    torch.manual_seed(1)
    policy = Qwen2ForCausalLM(config).float()
    policy.generation_config.pad_token_id = tokenizer.pad_token_id
    policy.generation_config.eos_token_id = tokenizer.eos_token_id
    save_model(policy, root / f"policy-{SIZE}", rope_theta)
    params = {"policy": sum(p.numel() for p in policy.parameters())}
    del policy
    torch.manual_seed(2)
    reward_config = model_config(tokenizer, **dims)
    reward_config.num_labels = 1
    reward = Qwen2ForSequenceClassification(reward_config).float()
    save_model(reward, root / f"reward-{SIZE}", rope_theta)
    params["reward"] = sum(p.numel() for p in reward.parameters())
    del reward
    for d in (f"policy-{SIZE}", f"reward-{SIZE}"):
        save_tokenizer(tokenizer, root / d)

    train, test = slice(0, 1000), slice(1000, 1100)
    DatasetDict(
        train=Dataset.from_dict({"prompt": prompts[train]}), test=Dataset.from_dict({"prompt": prompts[test]})
    ).save_to_disk(str(root / "prompts"))
    sft = {"prompt": [p for p, _, _ in pairs], "completion": [g for _, g, _ in pairs]}
    DatasetDict(
        train=Dataset.from_dict({k: v[train] for k, v in sft.items()}),
        test=Dataset.from_dict({k: v[test] for k, v in sft.items()}),
    ).save_to_disk(str(root / "sft"))
    pref = {
        "prompt": [p for p, _, _ in pairs],
        "chosen": [g for _, g, _ in pairs],
        "rejected": [b for _, _, b in pairs],
    }
    DatasetDict(
        train=Dataset.from_dict({k: v[train] for k, v in pref.items()}),
        test=Dataset.from_dict({k: v[test] for k, v in pref.items()}),
    ).save_to_disk(str(root / "preference"))

    lengths = [len(tokenizer(p).input_ids) for p in prompts]
    full = [len(tokenizer(p + g).input_ids) for p, g, _ in pairs]
    summary = dict(
        out=str(root),
        vocab=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        params=params,
        prompt_tokens=dict(min=min(lengths), mean=round(sum(lengths) / len(lengths), 2), max=max(lengths)),
        sft_tokens=dict(min=min(full), mean=round(sum(full) / len(full), 2), max=max(full)),
    )
    (root / "build.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default=default_out(), help="output directory (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default 24)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden_size (default 896)")
    parser.add_argument("--intermediate", type=int, default=None, help="intermediate_size (default 4864)")
    args = parser.parse_args(argv)
    print(json.dumps(build(args.out, layers=args.layers, hidden=args.hidden, intermediate=args.intermediate), indent=1))


if __name__ == "__main__":
    main()
