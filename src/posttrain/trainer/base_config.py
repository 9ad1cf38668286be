"""TRL's `trl.trainer.base_config` module path: `_BaseConfig`, the class every trainer config derives from.

TRL >= 1.0 collects the fields its configs share in `trl.trainer.base_config._BaseConfig`, and code written
for TRL (its own test suite's `conftest.py`, for one) reaches every config through it, e.g. by patching
its `__post_init__`. In posttrain that class is `posttrain.configs.TrainingConfig`.
"""

from posttrain.configs import TrainingConfig as _BaseConfig

__all__ = ["_BaseConfig"]
