"""Callbacks: `transformers.TrainerCallback` objects, driven exactly as `transformers.Trainer` drives them.

A user passes `callbacks=[MyCallback()]` (or calls `trainer.add_callback`) with subclasses of
`transformers.TrainerCallback`, as with TRL. Each trainer owns one `TrainerEvents`, which holds the
`transformers.TrainerState` exposed as `trainer.state`, the `transformers.TrainerControl` and
transformers' own `CallbackHandler`, and fires the events at the points `transformers.Trainer` does.

Every trainer (SFT, reward, PPO, RLOO, GRPO, Online DPO, XPO) fires the same events with the same
state; docs/internals.md ("callbacks.py") says where each fires.

`HealthMonitorCallback` is what `health.HealthMonitor(...)` builds: the health checks as a
TrainerCallback (on_log), registered by every online trainer.

`LogCompletionsCallback` keeps TRL's constructor and purpose: a table of the policy's (greedy)
completions on the eval prompts, sent through the run's tracker (console table, samples.jsonl,
W&B when enabled).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler
from transformers.trainer_utils import TrainOutput, speed_metrics

from posttrain import distributed as dist
from posttrain.configs import ConfigError
from posttrain.health import HealthMonitor
from posttrain.preemption import Preemption


def resolve_steps(value: float | None, max_steps: int) -> int | None:
    """logging_steps / eval_steps / save_steps as a whole number of steps: a value in (0, 1) is a ratio
    of max_steps, rounded up (transformers' TrainerState.compute_steps)."""
    if value is None:
        return None
    return math.ceil(max_steps * value) if 0 < value < 1 else int(value)


class Cadence:
    """When a run logs, evaluates and saves, from the config's strategies (transformers'
    DefaultFlowCallback, step by step).

    `epoch_of(step)` gives the fractional epochs done after `step` steps; a step ends an epoch when
    the whole part grows ("epoch" strategies). What this does not decide, the trainer does: a
    callback's control requests, the last step (which logs unless logging_strategy is "no", and in
    SFT / reward training evaluates), and save_strategy "best" (after an evaluation that improved
    the best metric).
    """

    def __init__(self, config: Any, max_steps: int, epoch_of: Callable[[int], float]) -> None:
        self.config = config
        self.max_steps = max_steps
        self.epoch_of = epoch_of
        self.logging_steps = resolve_steps(config.logging_steps, max_steps)
        self.eval_steps = resolve_steps(getattr(config, "eval_steps", None), max_steps)
        self.save_steps = resolve_steps(config.save_steps, max_steps)

    def epoch_end(self, step: int) -> bool:
        # A small tolerance: epochs of the online trainers are episodes / dataset size, a float.
        return step >= 1 and math.floor(self.epoch_of(step) + 1e-9) > math.floor(self.epoch_of(step - 1) + 1e-9)

    def log_due(self, step: int) -> bool:
        strategy = self.config.logging_strategy
        if step == 1 and self.config.logging_first_step:
            return True
        if strategy == "steps":
            return step % self.logging_steps == 0
        return strategy == "epoch" and self.epoch_end(step)

    def eval_due(self, step: int) -> bool:
        strategy, delay = self.config.eval_strategy, self.config.eval_delay or 0
        if strategy == "steps":
            return step % self.eval_steps == 0 and delay <= step
        return strategy == "epoch" and self.epoch_end(step) and delay <= self.epoch_of(step) + 1e-9

    def save_due(self, step: int) -> bool:
        strategy = self.config.save_strategy
        if strategy == "steps":
            return bool(self.save_steps) and step % self.save_steps == 0
        return strategy == "epoch" and self.epoch_end(step)


class TrainerEvents:
    """The callback state of one training run, and the events a trainer fires.

    Construction (once per trainer, after the model, optimizer and schedule exist)::

        events = TrainerEvents(config, callbacks, model=..., processing_class=..., optimizer=...,
                               lr_scheduler=..., accelerator=..., max_steps=N,
                               train_batch_size=per_device_batch_size, num_train_epochs=E)

    `events.state` is a `transformers.TrainerState` (max_steps, logging_steps / eval_steps /
    save_steps from the config, train_batch_size, num_train_epochs, is_world_process_zero /
    is_local_process_zero from the accelerator); `events.control` a `transformers.TrainerControl`.
    `config` is what callbacks receive as `args`. Callbacks also receive model, processing_class,
    optimizer and lr_scheduler as keyword arguments, as under transformers. Import this module
    where the run is built, not at a trainer module's top: transformers' callback module imports
    peft, which `import posttrain.trainers...` must not pull in.

    The training loop calls, in this order (a trainer that resumes sets `state.global_step` and
    `state.log_history` before `train_begin`)::

        events.train_begin()                            # on_train_begin
        for each optimizer step (online: each update):
            ... the update ...
            events.step_end(global_step, epoch)         # state.global_step / epoch; on_step_end
            # A callback's requests (control.should_log / should_evaluate / should_save) are read
            # here: step_end cleared them before on_step_end, on_log / on_evaluate / on_save clear them.
            if logging is due or requested:
                events.log(metrics)                     # state.log_history += {**metrics, epoch, step}; on_log
            if evaluation is due or requested:
                events.evaluate(eval_metrics)           # logged like a logging step, then on_evaluate
            if a checkpoint is due or requested:
                ... save it ...; events.save()          # on_save
            if events.control.should_training_stop:     # max_steps reached, or a callback stopped training
                break
        ... save the final model ...
        return events.train_end(training_loss, num_samples, total_flos)  # summary entry, on_train_end

    With enable_jit_checkpoint, the loop runs inside `events.preemption.installed()`; after a SIGTERM
    on any process, `step_end` sets `preempted` and control.should_training_stop on every process
    (posttrain.preemption), and the trainer saves a checkpoint of that step instead of the final model.

    `step_end` returns `control.should_training_stop`: True after the step that reaches max_steps
    (as transformers' DefaultFlowCallback sets it) or when a callback set it (a callback may also
    set it in on_log / on_evaluate, hence the check at the end of the step). The summary entry
    `train_end` appends to `log_history` is the one transformers writes: train_runtime,
    train_samples_per_second, train_steps_per_second (over this call's steps), total_flos,
    train_loss, epoch, step; it returns `TrainOutput(global_step, training_loss, metrics)`.
    """

    def __init__(
        self,
        config: Any,
        callbacks: list[Any] | None,
        *,
        model: Any,
        processing_class: Any,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        accelerator: Any = None,
        max_steps: int,
        train_batch_size: int,
        num_train_epochs: float,
    ) -> None:
        self.args = config
        eval_steps = resolve_steps(getattr(config, "eval_steps", None), max_steps)
        self.state = TrainerState(
            epoch=0.0,
            max_steps=max_steps,
            logging_steps=resolve_steps(config.logging_steps, max_steps),
            # No eval_steps means evaluation at the end only, i.e. every max_steps steps.
            eval_steps=eval_steps or max_steps,
            save_steps=resolve_steps(config.save_steps, max_steps),
            train_batch_size=train_batch_size,
            num_train_epochs=num_train_epochs,
            is_world_process_zero=dist.is_main(accelerator),
            is_local_process_zero=bool(getattr(accelerator, "is_local_main_process", True)),
        )
        self.control = TrainerControl()
        # CallbackHandler warns when transformers' DefaultFlowCallback is missing; that callback reads
        # TrainingArguments fields (logging_strategy, ...) a posttrain config does not have, and the
        # flow it implements (when to log, evaluate, save, stop) is the trainer's own here.
        handler_logger = logging.getLogger("transformers.trainer_callback")
        disabled, handler_logger.disabled = handler_logger.disabled, True
        try:
            self.handler = CallbackHandler(list(callbacks or []), model, processing_class, optimizer, lr_scheduler)
        finally:
            handler_logger.disabled = disabled
        self._start_time: float | None = None
        self._start_step = 0
        self._start_tokens = 0
        # enable_jit_checkpoint: `preempted` turns True at the step_end after a SIGTERM (any process).
        self.preemption = Preemption(bool(getattr(config, "enable_jit_checkpoint", False)), accelerator)
        self.preempted = False

    # -- the callback list, as on transformers.Trainer ------------------------------------------
    @property
    def callbacks(self) -> list[Any]:
        return self.handler.callbacks

    def add_callback(self, callback: Any) -> None:
        """Add a callback (an instance, or a class, which is instantiated)."""
        self.handler.add_callback(callback)

    def pop_callback(self, callback: Any) -> Any:
        """Remove a callback (an instance, or the first of a class) and return it, or None."""
        return self.handler.pop_callback(callback)

    def remove_callback(self, callback: Any) -> None:
        """Remove a callback (an instance, or the first of a class)."""
        self.handler.remove_callback(callback)

    # -- events ------------------------------------------------------------------------------------
    def train_begin(self) -> None:
        self._start_time, self._start_step = time.time(), self.state.global_step
        self._start_tokens = self.state.num_input_tokens_seen
        self.control = self.handler.on_train_begin(self.args, self.state, self.control)

    def step_end(self, global_step: int, epoch: float) -> bool:
        """Record the finished step and call on_step_end; True when training stops after this step."""
        self.state.global_step, self.state.epoch = int(global_step), float(epoch)
        self.control.should_log = self.control.should_evaluate = self.control.should_save = False
        if self.state.global_step >= self.state.max_steps:
            self.control.should_training_stop = True
        elif self.preemption.requested():  # a collective: every process calls step_end at every step
            # enable_jit_checkpoint after a SIGTERM: the trainer saves a checkpoint of this step and stops.
            self.preempted = self.control.should_training_stop = True
        self.control = self.handler.on_step_end(self.args, self.state, self.control)
        return self.control.should_training_stop

    def log(self, logs: dict[str, float]) -> dict[str, float]:
        """Append `{**logs, "epoch": state.epoch, "step": state.global_step}` to state.log_history
        and call on_log(logs=...) with the logs and their epoch; returns the appended entry."""
        logs = {**logs, "epoch": self.state.epoch}
        if getattr(self.args, "include_num_input_tokens_seen", False):
            # As transformers.Trainer.log: the input tokens so far, and (not in the summary, which has
            # its own speeds) this train() call's token rate.
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
            if self._start_time is not None and "train_runtime" not in logs:
                seen = self.state.num_input_tokens_seen - self._start_tokens
                logs.update(speed_metrics("train", self._start_time, num_tokens=seen))
                logs.pop("train_runtime", None)
        entry = {**logs, "step": self.state.global_step}
        self.state.log_history.append(entry)
        self.control = self.handler.on_log(self.args, self.state, self.control, logs)
        return entry

    def evaluate(self, metrics: dict[str, float]) -> None:
        """What transformers.Trainer.evaluate does with its metrics: log them, then
        on_evaluate(metrics=...) with the metrics and their epoch."""
        self.log(metrics)
        metrics = {**metrics, "epoch": self.state.epoch}
        self.control = self.handler.on_evaluate(self.args, self.state, self.control, metrics)

    def save(self) -> None:
        """Call on_save; fire it after a checkpoint has been written."""
        self.control = self.handler.on_save(self.args, self.state, self.control)

    # -- the best checkpoint (metric_for_best_model), as transformers.Trainer tracks it -------------
    def update_best(self, metrics: dict[str, float]) -> bool:
        """Compare an evaluation's `metric_for_best_model` (the "eval_" prefix added when missing) with
        state.best_metric; on improvement record it and the step (state.best_global_step). True when
        it improved; False when no metric_for_best_model is set."""
        name = getattr(self.args, "metric_for_best_model", None)
        if name is None:
            return False
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            raise ConfigError(
                f"metric_for_best_model={name!r}: the evaluation has no {key!r}; it reports "
                f"{sorted(metrics)}. Set --metric_for_best_model to one of them."
            )
        value, best = float(metrics[key]), self.state.best_metric
        greater = bool(self.args.greater_is_better)
        if best is None or (value > best if greater else value < best):
            self.state.best_metric = value
            if self.args.save_strategy in ("steps", "epoch", "best"):
                self.state.best_global_step = self.state.global_step
            return True
        return False

    def note_checkpoint(self, output_dir: str | Path) -> None:
        """After a checkpoint is written: point state.best_model_checkpoint at the best step's
        checkpoint when it exists (transformers checks the same folder)."""
        best_step = getattr(self.state, "best_global_step", None)
        if best_step:
            folder = Path(output_dir) / f"checkpoint-{best_step}"
            if folder.is_dir():
                self.state.best_model_checkpoint = str(folder)

    # -- what a checkpoint keeps of the callback state ---------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        """The best-model fields and the states of stateful callbacks (transformers.ExportableState:
        one `state()` per callback, a list for several of one class), for a checkpoint."""
        from transformers.trainer_callback import ExportableState

        stateful: dict[str, Any] = {}
        for callback in self.handler.callbacks:
            if isinstance(callback, ExportableState):
                name = type(callback).__name__
                if name in stateful:
                    previous = stateful[name]
                    stateful[name] = [*(previous if isinstance(previous, list) else [previous]), callback.state()]
                else:
                    stateful[name] = callback.state()
        return {
            "best_metric": self.state.best_metric,
            "best_global_step": getattr(self.state, "best_global_step", None),
            "best_model_checkpoint": self.state.best_model_checkpoint,
            "stateful_callbacks": stateful,
        }

    def restore_checkpoint_state(self, saved: dict[str, Any]) -> None:
        """Restore what `checkpoint_state` wrote: the best-model fields always (a best checkpoint
        that no longer exists is forgotten, as transformers does), and, with
        restore_callback_states_from_checkpoint, every stateful callback whose class is among this
        run's callbacks is rebuilt from its saved args and attributes (transformers'
        `_load_callback_state`)."""
        self.state.best_metric = saved.get("best_metric")
        if hasattr(self.state, "best_global_step"):
            self.state.best_global_step = saved.get("best_global_step")
        best = saved.get("best_model_checkpoint")
        self.state.best_model_checkpoint = best if best is not None and Path(best).is_dir() else None
        if not getattr(self.args, "restore_callback_states_from_checkpoint", False):
            return
        for name, data in (saved.get("stateful_callbacks") or {}).items():
            present = [cb for cb in self.handler.callbacks if type(cb).__name__ == name]
            for callback, entry in zip(present, data if isinstance(data, list) else [data]):
                restored = type(callback)(**entry.get("args", {}))
                for attribute, value in entry.get("attributes", {}).items():
                    setattr(restored, attribute, value)
                index = self.handler.callbacks.index(callback)
                self.handler.callbacks[index] = restored

    def train_end(
        self, training_loss: float, num_samples: int, total_flos: float = 0.0, logs: dict[str, float] | None = None
    ) -> TrainOutput:
        """Log the end-of-training summary, call on_train_end and return the TrainOutput.

        training_loss: the mean loss over this call's optimizer steps; num_samples: the examples
        (or episodes) trained on in this call, all ranks; total_flos: the floating-point operations
        of training (transformers' estimate, 6 · tokens · parameters); logs: metrics not yet logged
        (since the last logging step), which join the summary entry as in transformers.Trainer.
        """
        start = self._start_time if self._start_time is not None else time.time()
        tokens = None
        if getattr(self.args, "include_tokens_per_second", False):
            tokens = self.state.num_input_tokens_seen - self._start_tokens
        metrics = speed_metrics(
            "train",
            start,
            num_samples=num_samples,
            num_steps=self.state.global_step - self._start_step,
            num_tokens=tokens,
        )
        self.state.total_flos = float(total_flos)
        metrics["total_flos"] = self.state.total_flos
        metrics["train_loss"] = float(training_loss)
        metrics["epoch"] = self.state.epoch
        self.log({**(logs or {}), **metrics})
        self.control = self.handler.on_train_end(self.args, self.state, self.control)
        return TrainOutput(self.state.global_step, float(training_loss), metrics)


class HealthMonitorCallback(HealthMonitor, TrainerCallback):
    """The class of every `health.HealthMonitor(...)`: its checks, from on_log(logs=...), as a
    `transformers.TrainerCallback` (the other events are TrainerCallback's no-ops)."""


class LogCompletionsCallback(TrainerCallback):
    """Every `freq` steps (default: the trainer's logging_steps), log a table "completions" of the
    completions for the first `num_prompts` prompts of the trainer's eval dataset (None: all of them):
    columns step, prompt, completion, score (None where the trainer has no scores, e.g. with a judge).

    A plain `transformers.TrainerCallback` driven by on_step_end(args, state, control): the step is
    `state.global_step` (in an online trainer, the rollout batches done). The rows come from the
    trainer's `sample_completions(num_prompts)`: greedy completions (the sample table's), so the
    tables of different steps are comparable and the training sampler is never advanced; they are
    sent through the trainer's tracker (`trainer.run.tracker`: console table, samples.jsonl, W&B
    when enabled). generation_config is accepted for TRL's signature only by trainers whose
    sample_completions takes one; the online trainers sample with their own settings.
    """

    def __init__(
        self, trainer: Any, generation_config: Any = None, num_prompts: int | None = None, freq: int | None = None
    ) -> None:
        eval_dataset = getattr(trainer, "eval_dataset", None)
        if eval_dataset is None:
            raise ConfigError(
                "LogCompletionsCallback needs a trainer built with eval_dataset= (the prompts it samples)."
            )
        if not hasattr(trainer, "sample_completions"):
            raise ConfigError(
                f"LogCompletionsCallback samples with an online trainer's policy; {type(trainer).__name__} has none."
            )
        if num_prompts is not None and num_prompts < 1:
            raise ConfigError(f"num_prompts={num_prompts} must be >= 1 (or None for every eval prompt).")
        if freq is not None and freq < 1:
            raise ConfigError(f"freq={freq} must be >= 1 (or None for the trainer's logging_steps).")
        if generation_config is not None:
            import inspect

            if "generation_config" not in inspect.signature(trainer.sample_completions).parameters:
                raise ConfigError(
                    f"{type(trainer).__name__} samples the table with its own sampling settings "
                    "(temperature, top_k, top_p, max_new_tokens of its config); leave generation_config=None."
                )
        self.trainer = trainer
        self.generation_config = generation_config
        # every prompt of the prepared set the table draws from (online trainers: the first of several named sets)
        sampled = getattr(getattr(trainer, "run", None), "sample_dataset", None)
        self.num_prompts = (
            num_prompts if num_prompts is not None else len(sampled if sampled is not None else eval_dataset)
        )
        self.freq = freq
        self._last_logged_step = -1

    def on_step_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        step = state.global_step
        if step == self._last_logged_step or step % (self.freq or state.logging_steps) != 0:
            return
        extra = {} if self.generation_config is None else {"generation_config": self.generation_config}
        rows = self.trainer.sample_completions(self.num_prompts, **extra)
        self.trainer.run.tracker.log_table("completions", [{"step": step, **row} for row in rows], step=step)
        self._last_logged_step = step
