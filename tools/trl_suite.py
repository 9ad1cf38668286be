"""TRL's own tests for the trainers posttrain replaces, run on posttrain with `trl` renamed.

Downloads TRL's source distribution from the package index (its tests ship in it), copies the test
files of RLOO, PPO, XPO, Online DPO, GRPO, the judges and `trl.core`, renames `trl` to `posttrain` in them, builds
offline stand-ins for the hub repos they load (tiny Qwen2 / Llama models on a tokenizer trained here,
and the `trl-internal-testing/zen` prompt dataset in its two prompt-only configurations), and runs
them with pytest. Needs the package index (TRL's sdist, and `parameterized`, which TRL's tests
import); no Hugging Face hub access. Tests that need llm-blender, a GPU or a hub API key skip, as in
TRL's own CI without them.

    python tools/trl_suite.py                      # TRL 0.19.1, in a temporary folder
    python tools/trl_suite.py --keep /tmp/trl-suite -- -x -k rloo   # keep the folder; pytest options
    python tools/trl_suite.py --checkout ~/src/trl  # the RLOO and GRPO tests of a TRL git checkout (1.x)

TRL 1.x's releases ship no tests, so `--checkout` takes them from a clone of the TRL repository
(tests/test_rloo_trainer.py and tests/test_grpo_trainer.py, with its conftest.py and testing_utils.py),
and builds stand-ins for the extra causal LMs they train (Qwen3, Qwen3-MoE, Cohere2, GPT-OSS,
GLM-4-MoE, Gemma 2, Nemotron-H) and the Qwen3 reward model; its vision-language models are not built
(posttrain trains text models).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

TESTS = [
    "test_rloo_trainer",
    "test_ppo_trainer",
    "test_xpo_trainer",
    "test_online_dpo_trainer",
    "test_grpo_trainer",
    "test_judges",
    "test_core",
]
# Tests that check what posttrain does differently on purpose (README, "Coming from TRL"): not run, each
# printed with its reason.
DIFFERENCES = {
    "tests/test_grpo_trainer.py::GRPOTrainerTester::test_training_with_sync_ref_model": (
        "GRPOConfig's beta defaults to 0 (TRL >= 0.20; TRL 0.19's was 0.04), and sync_ref_model without a "
        "reference model (beta 0) is refused, as TRL >= 0.20 refuses it"
    ),
}
ZEN_PROMPTS = [
    "The sun is",
    "Beautiful is better than",
    "Explicit is",
    "Simple is better than",
    "Complex is better",
    "Flat is better than",
    "Sparse is",
    "Readability",
    "Special cases aren't",
    "Although practicality",
    "Errors should never",
    "In the face of ambiguity",
    "There should be one",
    "Although that way",
    "Now is better",
    "If the implementation",
    "Namespaces are",
]
DESELECT_CONFTEST = """
def pytest_collection_modifyitems(config, items):
    ids = set({ids!r})
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in ids])
    items[:] = [item for item in items if item.nodeid not in ids]
"""
ZEN_README = """---
configs:
{configs}---
"""


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True)


def fetch_tests(version: str, work: Path) -> Path:
    """TRL's test files from its sdist, with `trl` renamed to `posttrain`, in work/tests."""
    pip("download", f"trl=={version}", "--no-deps", "--no-binary", ":all:", "-d", str(work / "sdist"))
    (archive,) = (work / "sdist").glob("trl-*.tar.gz")
    out = work / "tests"
    out.mkdir()
    (out / "__init__.py").write_text("")
    with tarfile.open(archive) as tar:
        for name in [*TESTS, "testing_utils"]:
            member = tar.getmember(f"trl-{version}/tests/{name}.py")
            (out / f"{name}.py").write_text(renamed(tar.extractfile(member).read().decode()))
    return out


CHECKOUT_TESTS = ["test_rloo_trainer", "test_grpo_trainer", "testing_utils", "conftest"]


def renamed(text: str) -> str:
    """A TRL test file with `trl` renamed to `posttrain`."""
    text = re.sub(r"\bfrom trl\b", "from posttrain", text)
    text = re.sub(r"\bimport trl\b", "import posttrain", text)
    return re.sub(r"\btrl\.", "posttrain.", text)


def copy_checkout_tests(checkout: Path, work: Path) -> None:
    """The RLOO and GRPO tests of a TRL git checkout, renamed, in work/tests."""
    out = work / "tests"
    out.mkdir()
    (out / "__init__.py").write_text("")
    for name in CHECKOUT_TESTS:
        (out / f"{name}.py").write_text(renamed((checkout / "tests" / f"{name}.py").read_text()))


def build_checkout_fixtures(root: Path) -> None:
    """The extra text models of TRL 1.x's RLOO / GRPO tests, tiny, on the fixtures' tokenizer."""
    import torch
    import transformers

    torch.manual_seed(1)
    base = root / "trl-internal-testing"
    tokenizer = transformers.AutoTokenizer.from_pretrained(base / "tiny-Qwen2ForCausalLM-2.5")
    shape = dict(vocab_size=len(tokenizer) + 64, hidden_size=16, intermediate_size=32, num_hidden_layers=2)
    shape.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    shape.update(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    shape.update(pad_token_id=tokenizer.pad_token_id)
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=16)
    specs = {
        "tiny-Qwen3ForCausalLM": ("Qwen3", dict(head_dim=8)),
        "tiny-Qwen3MoeForCausalLM": ("Qwen3Moe", dict(head_dim=8, num_experts=4, **moe)),
        "tiny-Cohere2ForCausalLM": ("Cohere2", {}),
        "tiny-GptOssForCausalLM": ("GptOss", dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2)),
        "tiny-Glm4MoeForCausalLM": (
            "Glm4Moe",
            dict(head_dim=8, n_routed_experts=4, first_k_dense_replace=1, n_group=1, topk_group=1, **moe),
        ),
        "tiny-Gemma2ForCausalLM": ("Gemma2", dict(head_dim=8)),
        "tiny-NemotronHForCausalLM-nano": (
            "NemotronH",
            dict(head_dim=8, num_hidden_layers=4, hybrid_override_pattern="M*M-", mamba_num_heads=4, mamba_head_dim=8)
            | dict(ssm_state_size=8, n_groups=1, mamba_n_groups=1),
        ),
    }
    for name, (family, extra) in specs.items():
        config_cls = getattr(transformers, f"{family}Config", None)
        if config_cls is None:  # an architecture this transformers does not have: its tests fail to load it
            print(f"not built: {name} (transformers {transformers.__version__} has no {family})")
            continue
        model = getattr(transformers, f"{family}ForCausalLM")(config_cls(**{**shape, **extra}))
        model.save_pretrained(base / name)
        tokenizer.save_pretrained(base / name)
    # the second reward model of the reward_processing_classes tests
    config = transformers.Qwen3Config(**shape, head_dim=8, num_labels=1)
    transformers.Qwen3ForSequenceClassification(config).save_pretrained(base / "tiny-Qwen3ForSequenceClassification")
    tokenizer.save_pretrained(base / "tiny-Qwen3ForSequenceClassification")


# Qwen2.5's special-token ids, which TRL's tests write as numbers (a patched generate() returns completions
# ending in 151645, its <|im_end|>, padded with 151643, its <|endoftext|>).
QWEN_PAD, QWEN_IM_START, QWEN_EOS = 151643, 151644, 151645


def qwen_ids_tokenizer(tokenizer):
    """`tokenizer` (posttrain.testing's tiny BPE) renumbered with Qwen2.5's special ids: its BPE tokens from
    0, unused reserved tokens up to 151642, then <|endoftext|> (pad), <|im_start|> and <|im_end|> (eos)."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    specials = {t["content"] for t in state["added_tokens"]}
    regular = [
        tok for tok, _ in sorted(state["model"]["vocab"].items(), key=lambda item: item[1]) if tok not in specials
    ]
    vocab = {tok: i for i, tok in enumerate(regular)}
    vocab.update({f"<|reserved_{i}|>": i for i in range(len(regular), QWEN_PAD)})
    added = {"<|endoftext|>": QWEN_PAD, "<|im_start|>": QWEN_IM_START, "<|im_end|>": QWEN_EOS}
    vocab.update(added)
    state["model"]["vocab"] = vocab
    flags = dict(single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
    state["added_tokens"] = [dict(id=i, content=tok, **flags) for tok, i in added.items()]
    qwen = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(state)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="right",
    )
    qwen.chat_template = tokenizer.chat_template
    return qwen


def build_fixtures(root: Path) -> None:
    """The hub repos the tests load, as local folders under root (from_pretrained and load_dataset
    take a relative folder before the hub)."""
    import torch
    from datasets import Dataset
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2ForSequenceClassification,
    )

    from posttrain.testing import build_tiny_tokenizer

    torch.manual_seed(0)  # the stand-ins' random weights, and so the tests' numbers, the same in every build
    tokenizer = build_tiny_tokenizer(vocab_size=512)
    tokenizer.padding_side = "right"  # as the hub tokenizers; the tests set left padding where they need it
    # a Qwen-style template: the tests apply it to conversational prompts
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    base = root / "trl-internal-testing"
    # room above the tokenizer's ids: the tests add a [PAD] token
    shape = dict(vocab_size=len(tokenizer) + 64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4)
    shape.update(num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    shape.update(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    # the Qwen2 stand-ins with Qwen2.5's special ids, as the hub's tiny Qwen2 models; room above the tokenizer's
    # ids as every stand-in has, so the models built on this tokenizer share one vocabulary size
    qwen_tokenizer = qwen_ids_tokenizer(tokenizer)
    qwen_vocab = len(qwen_tokenizer) + 64
    qwen = dict(shape, vocab_size=qwen_vocab, eos_token_id=QWEN_EOS, bos_token_id=None, pad_token_id=QWEN_PAD)
    models = {
        "tiny-Qwen2ForCausalLM-2.5": (Qwen2ForCausalLM(Qwen2Config(hidden_size=16, **qwen)), qwen_tokenizer),
        "small-Qwen2ForCausalLM-2.5": (Qwen2ForCausalLM(Qwen2Config(hidden_size=32, **qwen)), qwen_tokenizer),
        "tiny-Qwen2ForSequenceClassification-2.5": (
            Qwen2ForSequenceClassification(Qwen2Config(hidden_size=16, num_labels=1, **qwen)),
            qwen_tokenizer,
        ),
        "tiny-LlamaForCausalLM-3.2": (LlamaForCausalLM(LlamaConfig(hidden_size=16, **shape)), tokenizer),
        "tiny-LlamaForSequenceClassification-3.2": (
            LlamaForSequenceClassification(
                LlamaConfig(hidden_size=16, num_labels=1, pad_token_id=tokenizer.pad_token_id, **shape)
            ),
            tokenizer,
        ),
    }
    for name, (model, model_tokenizer) in models.items():
        model.save_pretrained(base / name)
        model_tokenizer.save_pretrained(base / name)
    zen, configs = base / "zen", ""
    columns = {
        "standard_prompt_only": ZEN_PROMPTS,
        "conversational_prompt_only": [[{"role": "user", "content": p}] for p in ZEN_PROMPTS],
    }
    for config, prompts in columns.items():
        configs += f"- config_name: {config}\n  data_files:\n"
        for split, rows in (("train", prompts[:15]), ("test", prompts[15:])):
            Dataset.from_dict({"prompt": rows}).to_parquet(str(zen / config / f"{split}.parquet"))
            configs += f"  - split: {split}\n    path: {config}/{split}.parquet\n"
    (zen / "README.md").write_text(ZEN_README.format(configs=configs))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-version", default="0.19.1", help="the TRL release whose tests run (default 0.19.1)")
    parser.add_argument("--keep", type=Path, help="build and run in this (new) folder and keep it")
    parser.add_argument(
        "--checkout", type=Path, help="a TRL git checkout: run its RLOO and GRPO tests instead of a release's"
    )
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest, after --")
    args = parser.parse_args()
    if args.keep is not None:
        args.keep.mkdir(parents=True)
        work = args.keep
    else:
        work = Path(tempfile.mkdtemp(prefix="trl-suite-"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if importlib.util.find_spec("parameterized") is None:
        pip("install", "--target", str(work / "site"), "parameterized")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(work / "site"), env.get("PYTHONPATH")]))
    if args.checkout is not None:
        copy_checkout_tests(args.checkout, work)
    else:
        fetch_tests(args.trl_version, work)
    build_fixtures(work)
    if args.checkout is not None:
        build_checkout_fixtures(work)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "tests", *args.pytest_args]
    if args.checkout is None:
        for test, reason in DIFFERENCES.items():
            print(f"not run: {test}: {reason}")
        # exact node ids (pytest's --deselect also drops every test whose id starts with the one given)
        (work / "conftest.py").write_text(DESELECT_CONFTEST.format(ids=sorted(DIFFERENCES)))
    source = f"the checkout {args.checkout}" if args.checkout is not None else f"TRL {args.trl_version}"
    print(f"{source}'s tests on posttrain in {work}:", " ".join(command), flush=True)
    return subprocess.run(command, cwd=work, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
