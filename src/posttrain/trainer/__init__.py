"""TRL's `trl.trainer` module path, for the names example scripts import from it."""
