"""Shared fixtures: tiny offline tokenizer and models built from config (no network, ever)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Set before datasets / transformers / huggingface_hub are imported: they read these at import.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# Keep datasets' arrow cache of the test files out of the user's home cache.
if "HF_DATASETS_CACHE" not in os.environ:
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="posttrain-test-datasets-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import one_thread, write_cli_files  # noqa: E402, F401  (one_thread: a fixture modules take)

# Under pytest-xdist (`make test` runs two workers on two cores) each worker computes on one thread,
# and the torchrun launches of different workers rendezvous on different ports (torchrun reads
# PET_MASTER_PORT); the subprocesses inherit both settings.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["PET_MASTER_PORT"] = str(29500 + 7 * (1 + int(_WORKER.removeprefix("gw"))))
    torch.set_num_threads(1)
else:
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """Byte-level BPE tokenizer with `<|endoftext|>` eos, `<|pad|>` pad and a chat template.

    Session-scoped: tests that change it (padding side, template) must work on a copy.
    """
    from posttrain.testing import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture
def tok(tiny_tokenizer):
    """A private copy of tiny_tokenizer, for tests that change its chat template or padding side."""
    import copy

    return copy.deepcopy(tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_tokenizer_pad_eos():
    """Same tokenizer family with pad == eos (the case masks-from-lengths must survive)."""
    from posttrain.testing import build_tiny_tokenizer

    return build_tiny_tokenizer(pad_equals_eos=True)


@pytest.fixture(scope="session")
def tiny_policy(tiny_tokenizer):
    """Tiny Llama (hidden 32, 2 layers) in eval mode. Shared: tests that train must build their own."""
    from posttrain.testing import build_tiny_causal_lm

    return build_tiny_causal_lm(tiny_tokenizer).eval()


@pytest.fixture(scope="session")
def tiny_reward_model(tiny_tokenizer):
    """Tiny Llama sequence classifier, num_labels=1, pad_token_id set. Shared: do not train it."""
    from posttrain.testing import build_tiny_reward_model

    return build_tiny_reward_model(tiny_tokenizer, seed=1).eval()


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory, tiny_tokenizer):
    """A folder with a saved tiny Llama policy and its tokenizer (loadable by path)."""
    from posttrain.testing import build_tiny_causal_lm

    path = tmp_path_factory.mktemp("tiny_policy")
    build_tiny_causal_lm(tiny_tokenizer, save_dir=path)
    return path


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory, tiny_tokenizer):
    """A folder with a saved tiny reward model and its tokenizer."""
    from posttrain.testing import build_tiny_reward_model

    path = tmp_path_factory.mktemp("tiny_reward_model")
    build_tiny_reward_model(tiny_tokenizer, seed=1, save_dir=path)
    return path


@pytest.fixture(scope="session")
def cli_files(tmp_path_factory):
    """The files the command-line tests start from (helpers.write_cli_files); tests write their runs
    elsewhere (tmp_path), never here."""
    return write_cli_files(tmp_path_factory.mktemp("cli"))
