"""The one place that knows which transformers / accelerate / datasets version is installed.

posttrain supports every version its pyproject declares, from TRL 0.19.1's stack (transformers 4.53,
accelerate 1.8, datasets 3.6) to the newest releases; `make test-floor` runs the suite on the oldest.
Each switch between versions is a small function here, so the rest of the code calls one spelling.
"""

from __future__ import annotations

import functools
import inspect
from importlib.metadata import version
from typing import Any


@functools.cache
def _version_tuple(package: str) -> tuple[int, ...]:
    parts = []
    for piece in version(package).split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def transformers_version() -> tuple[int, ...]:
    return _version_tuple("transformers")


def default_optim() -> str:
    """transformers.TrainingArguments' default `optim` on this install: "adamw_torch_fused" from
    transformers 4.54 with torch >= 2.8 (huggingface/transformers#37358), "adamw_torch" before. Read
    from the installed versions' metadata, without importing torch or transformers."""
    try:
        fused = transformers_version() >= (4, 54) and _version_tuple("torch") >= (2, 8)
    except Exception:  # a package without metadata (a source checkout on sys.path): transformers' old default
        return "adamw_torch"
    return "adamw_torch_fused" if fused else "adamw_torch"


def dtype_kwargs(dtype: Any) -> dict[str, Any]:
    """The keyword that `from_pretrained` / `from_config` take for the weights' dtype.

    transformers 4.56 renamed `torch_dtype` to `dtype` (huggingface/transformers#39782); older versions
    pass an unknown `dtype` on to the model's `__init__`, which fails.
    """
    return {"dtype": dtype} if transformers_version() >= (4, 56) else {"torch_dtype": dtype}


def cache_argument(forward: Any) -> str:
    """The keyword a model's `forward` takes its KV cache by.

    transformers 5 renamed the inputs and outputs `past_key_values` / `cache_params` to `cache` (the old
    names warn, and are removed in 5.40); older releases, and remote-code or wrapper models that keep the
    old signature, take `past_key_values`.
    """
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def output_cache(output: Any) -> Any:
    """The KV cache a model returned: `output.cache` where transformers names it so, else
    `output.past_key_values` (read without the deprecation warning the old name gives on new outputs)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


# Models whose forward builds ALiBi biases from the 2-D padding mask (transformers 5 gives them
# `create_causal_mask` too): their decode steps keep the 2-D mask.
_ALIBI_MODEL_TYPES = frozenset({"bloom", "falcon", "mpt"})


def takes_prepared_decode_mask(model: Any, total_length: int) -> bool:
    """Whether a one-token decode step of `model` may be given its attention mask already prepared,
    as a (rows, 1, 1, keys) bool tensor, instead of the 2-D padding mask.

    transformers' `masking_utils` (4.53+) turns the 2-D mask into that tensor again at every step (a
    few hundred small operations and, on GPUs, a host sync); a 4-D mask is passed through as-is. That
    is only the same attention when the model's mask is the plain causal one over `total_length`
    positions, which holds when: the model's module builds its mask with `create_causal_mask` (so a 4-D
    mask is returned unchanged) and reads the 2-D mask nowhere else (ALiBi models: Bloom, Falcon, MPT), attention
    runs through SDPA (which takes a bool mask; flash attention wants the 2-D one), and no layer uses a
    sliding window or chunk shorter than the sequence (Gemma's, Mistral's, Llama 4's).
    """
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    # The model's own class: FSDP2's fully_shard swaps in a subclass defined in torch's module.
    cls = next((c for c in type(model).__mro__ if c.__module__.startswith("transformers")), type(model))
    module = inspect.getmodule(cls)
    if module is None or "create_causal_mask" not in vars(module):
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "model_type", None) in _ALIBI_MODEL_TYPES:
        return False
    if set(getattr(text, "layer_types", None) or ()) - {"full_attention", "sliding_attention", "chunked_attention"}:
        return False  # linear-attention or state-space layers
    window = getattr(text, "sliding_window", None)
    if window and getattr(text, "use_sliding_window", True) and total_length > window:
        return False
    chunk = getattr(text, "attention_chunk_size", None)
    return not (chunk and total_length > chunk)


def static_cache(config: Any, batch_size: int, max_cache_len: int, device: Any, dtype: Any) -> Any:
    """A transformers `StaticCache` of `batch_size` rows and `max_cache_len` positions for `config`'s model.

    transformers 4.56 made StaticCache allocate lazily on its first update and dropped its
    `max_batch_size` / `device` / `dtype` arguments; older versions allocate in the constructor.
    """
    import inspect

    from transformers import StaticCache

    if "max_batch_size" in inspect.signature(StaticCache.__init__).parameters:
        return StaticCache(
            config=config, max_batch_size=batch_size, max_cache_len=max_cache_len, device=device, dtype=dtype
        )
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    for layer in cache.layers:
        layer.update = _values_in_key_dtype(layer.update)
    return cache


def _values_in_key_dtype(update: Any) -> Any:
    """A lazily allocated cache layer's `update` that stores the values in the keys' dtype.

    Under autocast over float32 weights (bf16=True) the keys reach the cache in float32 (rotary
    embeddings multiply the bf16 projection by float32 cos/sin) and the values in bf16. Some
    transformers 5.x releases (5.17 among them) allocate both buffers in the keys' dtype, and the
    values' `index_copy_` then fails ("self and source expected to have the same dtype"); later
    releases allocate each in its own dtype. Casting the values here gives every release the same
    cache; attention under autocast casts its inputs to the autocast dtype either way.
    """

    def update_values_in_key_dtype(key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
        return update(key_states, value_states.to(key_states.dtype), *args, **kwargs)

    return update_values_in_key_dtype


def static_cache_select_rows(cache: Any, index: Any) -> None:
    """Keep only batch rows `index` of a filled StaticCache, in place; the new buffers are marked as
    static addresses again (as StaticCache does on allocation) so compiled steps keep treating them so.

    transformers ≥ 4.56 keeps per-layer `keys` / `values` in `cache.layers` (its StaticLayer has no
    `batch_select_indices`); older versions keep `key_cache` / `value_cache` lists.
    """
    import torch

    def pick(t: torch.Tensor) -> torch.Tensor:
        out = t.index_select(0, index)
        torch._dynamo.mark_static_address(out)
        return out

    if hasattr(cache, "layers"):
        for layer in cache.layers:
            layer.keys, layer.values = pick(layer.keys), pick(layer.values)
            if hasattr(layer, "batch_size"):
                layer.batch_size = int(index.numel())
    else:
        cache.key_cache = [pick(t) for t in cache.key_cache]
        cache.value_cache = [pick(t) for t in cache.value_cache]
        cache.max_batch_size = int(index.numel())


def dynamic_cache_tensors(cache: Any) -> list[tuple[Any, Any]] | None:
    """The per-layer (keys, values) tensors of a filled transformers DynamicCache (its exact class), or
    None for any other cache. transformers ≥ 4.56 keeps them in `cache.layers` (DynamicLayer objects;
    a sliding-window or other layer type gives None), older versions in `key_cache` / `value_cache`."""
    from transformers import DynamicCache

    if type(cache) is not DynamicCache:
        return None
    layers = getattr(cache, "layers", None)
    if layers is None:
        keys, values = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
        if not keys or values is None or len(keys) != len(values):
            return None
        return list(zip(keys, values))
    from transformers.cache_utils import DynamicLayer

    if not layers or any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in layers):
        return None
    return [(layer.keys, layer.values) for layer in layers]


def set_dynamic_cache_tensors(cache: Any, pairs: list[tuple[Any, Any]]) -> None:
    """Replace the per-layer (keys, values) of a DynamicCache that `dynamic_cache_tensors` accepted."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        cache.key_cache = [k for k, _ in pairs]
        cache.value_cache = [v for _, v in pairs]
        return
    for layer, (keys, values) in zip(layers, pairs):
        layer.keys, layer.values = keys, values


def dynamic_cache_of(pairs: list[tuple[Any, Any]]) -> Any:
    """A DynamicCache holding the given per-layer (keys, values) tensors themselves (no copy). Each layer
    is created by the cache's own `update` with a zero-length slice (on transformers ≥ 4.56 that sets
    whatever the layer records on its first update), then given the tensors."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for index, (keys, values) in enumerate(pairs):
        cache.update(keys[..., :0, :], values[..., :0, :], index)
    set_dynamic_cache_tensors(cache, pairs)
    return cache
