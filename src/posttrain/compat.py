"""The one place that knows which transformers / accelerate / datasets version is installed.

posttrain supports every version its pyproject declares, from TRL 0.19.1's stack (transformers 4.53,
accelerate 1.8, datasets 3.6) to the newest releases; `make test-floor` runs the suite on the oldest.
Each switch between versions is a small function here, so the rest of the code calls one spelling.
"""

from __future__ import annotations

import functools
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


def dtype_kwargs(dtype: Any) -> dict[str, Any]:
    """The keyword that `from_pretrained` / `from_config` take for the weights' dtype.

    transformers 4.56 renamed `torch_dtype` to `dtype` (huggingface/transformers#39782); older versions
    pass an unknown `dtype` on to the model's `__init__`, which fails.
    """
    return {"dtype": dtype} if transformers_version() >= (4, 56) else {"torch_dtype": dtype}


def _cache_layer_kv(cache: Any, layer_idx: int) -> tuple[Any, Any] | None:
    """The (keys, values) a DynamicCache holds for one layer, or None before the layer's first update.
    transformers 4.54 moved them from `key_cache` / `value_cache` lists to `layers[i].keys / .values`."""
    if hasattr(cache, "layers"):
        if layer_idx >= len(cache.layers) or not getattr(cache.layers[layer_idx], "is_initialized", True):
            return None
        layer = cache.layers[layer_idx]
        return (layer.keys, layer.values) if layer.keys is not None and layer.keys.numel() else None
    if layer_idx >= len(cache.key_cache) or not cache.key_cache[layer_idx].numel():
        return None
    return cache.key_cache[layer_idx], cache.value_cache[layer_idx]


def _set_cache_layer_kv(cache: Any, layer_idx: int, keys: Any, values: Any) -> None:
    if hasattr(cache, "layers"):
        cache.layers[layer_idx].keys, cache.layers[layer_idx].values = keys, values
    else:
        cache.key_cache[layer_idx], cache.value_cache[layer_idx] = keys, values


def preallocated_dynamic_cache(capacity: int) -> Any:
    """A transformers DynamicCache that appends new keys/values in place into per-layer buffers of
    `capacity` positions instead of concatenating (a cat copies the whole cache every step).

    What the model sees is unchanged: each layer's keys/values are the filled prefix (a view) of the
    buffer, so lengths, masks and `batch_select_indices` behave as in a plain DynamicCache; after a
    row selection the next update copies the selected rows into a fresh buffer.
    """
    from transformers import DynamicCache

    class PreallocatedDynamicCache(DynamicCache):
        def __init__(self) -> None:
            super().__init__()
            self._capacity = capacity
            self._buffers: dict[int, tuple[Any, Any]] = {}

        def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any):
            current = _cache_layer_kv(self, layer_idx)
            if current is None:  # first update of the layer: let DynamicCache set up its own state
                current = super().update(key_states, value_states, layer_idx, *args, **kwargs)
                new = None
            else:
                new = (key_states, value_states)
                if not hasattr(self, "layers") and layer_idx == 0 and hasattr(self, "_seen_tokens"):
                    self._seen_tokens += key_states.shape[-2]
            keys, values = current
            length = keys.shape[-2]
            total = length + (new[0].shape[-2] if new is not None else 0)
            buffers = self._buffers.get(layer_idx)
            if (
                buffers is None
                or keys.data_ptr() != buffers[0].data_ptr()
                or keys.shape[0] != buffers[0].shape[0]
                or total > buffers[0].shape[-2]
            ):
                size = max(self._capacity, total)
                buffers = tuple(t.new_empty(*t.shape[:-2], size, t.shape[-1]) for t in (keys, values))
                buffers[0][..., :length, :] = keys
                buffers[1][..., :length, :] = values
                self._buffers[layer_idx] = buffers
            if new is not None:
                buffers[0][..., length:total, :] = new[0]
                buffers[1][..., length:total, :] = new[1]
            keys, values = buffers[0][..., :total, :], buffers[1][..., :total, :]
            _set_cache_layer_kv(self, layer_idx, keys, values)
            return keys, values

    return PreallocatedDynamicCache()
