"""TRL 1.x import paths: `trl.experimental.xpo`, `trl.experimental.online_dpo` and `trl.experimental.ppo`
become `posttrain.experimental.xpo`, ... and name the same classes as the top-level package."""
