"""The version switches in posttrain.compat, exercised on whichever transformers is installed.

CI runs this file (with the rest of the suite) on the newest transformers and on the oldest that
pyproject.toml accepts (`make test-floor`), so each switch is checked on both sides.
"""

import torch
import transformers

from posttrain import compat
from posttrain.compat import dtype_kwargs, transformers_version
from posttrain.models import load_policy, load_reward_model


def test_version_tuple_matches_the_installed_transformers():
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    assert transformers_version()[:2] == (major, minor)


def test_dtype_keyword_is_the_one_from_config_accepts():
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = transformers.AutoModelForCausalLM.from_config(config, **dtype_kwargs(torch.bfloat16))
    assert next(model.parameters()).dtype == torch.bfloat16


def test_loaders_pass_the_dtype_through(tiny_policy_dir, tiny_reward_model_dir):
    assert next(load_policy(tiny_policy_dir, dtype="bfloat16").parameters()).dtype == torch.bfloat16
    assert next(load_reward_model(tiny_reward_model_dir, dtype="float16").parameters()).dtype == torch.float16
    assert next(load_policy(tiny_policy_dir).parameters()).dtype == torch.float32


def test_the_kv_cache_goes_by_the_name_the_model_takes(tiny_policy):
    import inspect
    from types import SimpleNamespace

    # transformers 5 calls it `cache` (the old `past_key_values` warns and goes in 5.40); older
    # releases and models with the old signature take `past_key_values`.
    name = compat.cache_argument(tiny_policy.forward)
    params = inspect.signature(tiny_policy.forward).parameters
    assert name in params and name == ("cache" if "cache" in params else "past_key_values")

    def old_style(input_ids, attention_mask=None, past_key_values=None, use_cache=None):
        return None

    assert compat.cache_argument(old_style) == "past_key_values"
    assert compat.output_cache(SimpleNamespace(past_key_values="kv")) == "kv"
    assert compat.output_cache(SimpleNamespace(cache="kv", past_key_values=None)) == "kv"
    ids = torch.tensor([[1, 2, 3]])
    out = tiny_policy(input_ids=ids, use_cache=True)
    assert compat.output_cache(out) is not None
