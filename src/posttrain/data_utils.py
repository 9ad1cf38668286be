"""TRL's `trl.data_utils` path: `from posttrain.data_utils import maybe_apply_chat_template` and the other
data helpers TRL scripts import from it (posttrain.data.helpers, whose public names these are)."""

from posttrain.data.helpers import *  # noqa: F403
from posttrain.data.helpers import __all__  # noqa: F401
