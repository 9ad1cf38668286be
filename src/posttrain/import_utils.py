"""`posttrain.import_utils`: whether optional packages can be imported, under the names TRL exports
(`trl.import_utils.is_vllm_available`, ...), so code and tests written against TRL import them
unchanged. Each check asks `importlib` for the package's spec: nothing is imported.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable


def _checker(package: str) -> Callable[..., bool]:
    def is_available(min_version: str | None = None) -> bool:
        if importlib.util.find_spec(package) is None:
            return False
        if min_version is None:
            return True
        from packaging.version import Version

        try:
            return Version(importlib.metadata.version(package)) >= Version(min_version)
        except importlib.metadata.PackageNotFoundError:  # importable, but not an installed distribution
            return False

    is_available.__doc__ = f"Whether `{package}` is installed (at least `min_version` when given); it is not imported."
    return is_available


is_deepspeed_available = _checker("deepspeed")
is_diffusers_available = _checker("diffusers")
is_fastapi_available = _checker("fastapi")
is_harbor_available = _checker("harbor")
is_jmespath_available = _checker("jmespath")
is_joblib_available = _checker("joblib")
is_liger_kernel_available = _checker("liger_kernel")
is_llm_blender_available = _checker("llm_blender")
is_llmblender_available = is_llm_blender_available  # TRL 0.11's spelling
is_math_verify_available = _checker("math_verify")
is_mergekit_available = _checker("mergekit")
is_openreward_available = _checker("openreward")
is_pydantic_available = _checker("pydantic")
is_requests_available = _checker("requests")
is_rich_available = _checker("rich")
is_unsloth_available = _checker("unsloth")
is_uvicorn_available = _checker("uvicorn")
is_vllm_available = _checker("vllm")
is_vllm_ascend_available = _checker("vllm_ascend")
is_weave_available = _checker("weave")
