"""The offline one-command RLHF demo (`posttrain demo`): an embedded task (task.py), the pipeline
SFT -> reward model -> RL (pipeline.py) and its report (report.py)."""
