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
