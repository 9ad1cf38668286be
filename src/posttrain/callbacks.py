"""Trainer callbacks for the online preference trainers (Online DPO, XPO).

posttrain trainers are not `transformers.Trainer`s, so the callback protocol is small: a trainer
calls, when a callback defines them,

    on_train_begin(trainer)
    on_step_end(trainer, step, logs)   # after every rollout batch; logs = the metrics just logged, or None
    on_train_end(trainer)

`LogCompletionsCallback` keeps TRL's constructor (`LogCompletionsCallback(trainer, num_prompts=8,
freq=None)`, trl-notes §6 / seed 003) and its purpose: a table of sampled completions on the eval
set, here sent through the run's tracker (console table, samples.jsonl, and W&B when enabled).
"""

from __future__ import annotations

from typing import Any

from posttrain.configs import ConfigError


class TrainerCallback:
    """Base class with no-op hooks; subclass and override what you need."""

    def on_train_begin(self, trainer: Any) -> None:
        pass

    def on_step_end(self, trainer: Any, step: int, logs: dict | None) -> None:
        pass

    def on_train_end(self, trainer: Any) -> None:
        pass


class LogCompletionsCallback(TrainerCallback):
    """Every `freq` rollout batches (default: the trainer's logging_steps), sample completions for the
    first `num_prompts` prompts of the trainer's eval dataset and log them as the table
    "completions" (columns prompt, completion, and score when the trainer scores with rewards).

    Sampling uses the trainer's sampling settings with a generator seeded from config.seed, so the
    tables of different steps are comparable and the training sampler is never advanced.
    """

    def __init__(self, trainer: Any, num_prompts: int = 8, freq: int | None = None) -> None:
        if getattr(trainer, "eval_dataset", None) is None:
            raise ConfigError(
                "LogCompletionsCallback needs a trainer built with eval_dataset= (the prompts it samples)."
            )
        if num_prompts < 1:
            raise ConfigError(f"num_prompts={num_prompts} must be >= 1.")
        if freq is not None and freq < 1:
            raise ConfigError(f"freq={freq} must be >= 1 (or None for the trainer's logging_steps).")
        self.trainer = trainer
        self.num_prompts = num_prompts
        self.freq = freq

    def on_step_end(self, trainer: Any, step: int, logs: dict | None) -> None:
        freq = self.freq or trainer.args.logging_steps
        if step % freq != 0:
            return
        rows = trainer.sample_completions(self.num_prompts)
        trainer.run.tracker.log_table("completions", [{"step": step, **row} for row in rows], step=step)
