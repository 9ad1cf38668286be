"""Mechanisms shared by the dataset-driven trainers (SFT and reward modelling).

Each trainer file tells its own loop: collate a step's micro-batches, count what it trains on,
backward `loss_sum / global_count` per micro-batch, step. What lives here is the plumbing around
that loop, written once:

- `BatchPlan`: which examples every optimizer step uses, as a pure function of the step number
  and the seed. Resuming therefore needs only the step to find its data position, and the same
  examples land in the same accumulated batch whatever the micro-batch size.
- `SupervisedRun`: accelerator, optimizer and schedule (the online trainers' builders from
  `common`), exact gradient accumulation, logging, evaluation and checkpoint cadence, the
  callback events (`callbacks.TrainerEvents`: `trainer.state`, `transformers.TrainerCallback`
  hooks, the end-of-training summary), resume (weights, optimizer, schedule, RNG, counters,
  pending metrics, log history) and the final save.
- `SupervisedTrainerAPI`: the accessors SFTTrainer and RewardTrainer share (state, callbacks,
  log, save_model), as TRL users touch them on a `transformers.Trainer`.
- small collation helpers (right padding, attention masks from lengths).
"""

from __future__ import annotations

import contextlib
import functools
import math
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain import checkpoint as ckpt
from posttrain import cpu_linear, hub, runtime
from posttrain import distributed as dist
from posttrain.configs import ConfigError, TrainingConfig
from posttrain.distributed import no_sync_unless_last
from posttrain.models import compile_for_training, enable_gradient_checkpointing
from posttrain.optim import build_optimizer, build_scheduler
from posttrain.positions import check_sequence_lengths
from posttrain.preemption import log_preempted
from posttrain.tracking import MetricAccumulator, ProgressBar, Tracker

IGNORE_INDEX = -100


# ---------------------------------------------------------------------------------------------
# collation
# ---------------------------------------------------------------------------------------------
def rows(dataset: Any, indices: Sequence[int]) -> list[dict]:
    return [dataset[int(i)] for i in indices]


# ---------------------------------------------------------------------------------------------
# which examples each step trains on
# ---------------------------------------------------------------------------------------------
class BatchPlan:
    """The examples of every optimizer step, derived from (seed, step) alone.

    Epoch e visits a permutation drawn from (seed, e), wrapped around to a multiple of the world
    size (as torch's DistributedSampler pads) so every rank gets equally many examples. Global
    micro-batch m holds permutation[m·B·W : (m+1)·B·W] and rank r takes every W-th of them; an
    optimizer step takes `gradient_accumulation_steps` consecutive micro-batches (the last step of
    an epoch may take fewer, and the epoch's last micro-batch may be smaller: exact loss
    normalization makes both harmless). Batch 1 × accumulation 4 and batch 4 × accumulation 1
    therefore train step s on exactly the same examples. With `drop_last` an epoch ends at its last
    complete micro-batch instead.
    """

    def __init__(
        self,
        num_examples: int,
        per_device_batch_size: int,
        gradient_accumulation_steps: int,
        *,
        seed: int,
        num_train_epochs: float,
        max_steps: int = -1,
        world_size: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if num_examples < 1:
            raise ConfigError("the training set is empty after preparation; check the data and max_length.")
        self.num_examples = num_examples
        self.batch_size = per_device_batch_size
        self.accumulation = gradient_accumulation_steps
        self.seed, self.world_size, self.rank, self.shuffle = seed, world_size, rank, shuffle
        self.padded = math.ceil(num_examples / world_size) * world_size
        self.global_micro = per_device_batch_size * world_size
        # drop_last (dataloader_drop_last): the epoch's last, incomplete micro-batch is not trained on.
        self.micro_per_epoch = (
            (self.padded // self.global_micro) if drop_last else math.ceil(self.padded / self.global_micro)
        )
        if self.micro_per_epoch < 1:
            raise ConfigError(
                f"dataloader_drop_last=True drops every batch: the training set has {num_examples} examples, fewer "
                f"than one batch of {self.global_micro} (per_device_train_batch_size {per_device_batch_size} × "
                f"{world_size} processes); lower the batch size or set dataloader_drop_last=False."
            )
        self.steps_per_epoch = math.ceil(self.micro_per_epoch / gradient_accumulation_steps)
        if max_steps > 0:
            self.total_steps = max_steps
        else:
            self.total_steps = max(1, math.ceil(num_train_epochs * self.steps_per_epoch))
        self._cached: tuple[int, list[int]] | None = None

    def order(self, epoch: int) -> list[int]:
        if self._cached is None or self._cached[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                perm = torch.randperm(self.num_examples, generator=g).tolist()
            else:
                perm = list(range(self.num_examples))
            self._cached = (epoch, (perm * 2)[: self.padded] if self.padded > len(perm) else perm)
        return self._cached[1]

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's example indices for each micro-batch of optimizer step `step` (0-based)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        order = self.order(epoch)
        first = k * self.accumulation
        last = min(first + self.accumulation, self.micro_per_epoch)
        out = []
        for m in range(first, last):
            chunk = order[m * self.global_micro : (m + 1) * self.global_micro]
            out.append(chunk[self.rank :: self.world_size])
        return out

    def epoch(self, steps_done: int) -> float:
        """Fractional epochs completed after `steps_done` optimizer steps."""
        return steps_done / self.steps_per_epoch


def input_tokens(batch: dict, non_padding: bool = False) -> int:
    """A batch's input tokens as transformers counts them: every input_ids position, or (non_padding)
    the attended ones (a padding-free batch has no padding)."""
    mask = batch.get("attention_mask")
    if non_padding and mask is not None:
        return int(mask.sum())
    return batch["input_ids"].numel()


def eval_shards(num_examples: int, batch_size: int, accelerator: Any) -> Iterator[tuple[list[int], torch.Tensor]]:
    """This rank's eval batches as (indices, counts (B,) bool): every example is scored once.

    Ranks get equally many batches (the list is wrapped to a multiple of the world size and the
    repeats are flagged False), because under ZeRO-3 every forward is a collective that all ranks
    must join.
    """
    world, rank = dist.world_size(accelerator), dist.process_index(accelerator)
    padded = math.ceil(num_examples / world) * world
    mine = list(range(rank, padded, world))
    for start in range(0, len(mine), batch_size):
        part = mine[start : start + batch_size]
        yield [i % num_examples for i in part], torch.tensor([i < num_examples for i in part])


class StepBatches(torch.utils.data.Dataset):
    """Item s: the collated micro-batches of optimizer step s, which DataLoader workers
    (dataloader_num_workers) may build ahead of the training loop."""

    def __init__(self, plan: BatchPlan, dataset: Any, collate: Callable[[list[dict]], dict]) -> None:
        self.plan, self.dataset, self.collate = plan, dataset, collate

    def __len__(self) -> int:
        return self.plan.total_steps

    def __getitem__(self, step: int) -> list[dict]:
        return [self.collate(rows(self.dataset, idx)) for idx in self.plan.micro_batches(step)]


class StepRange(torch.utils.data.Sampler):
    """The steps the loader's next pass yields (one epoch's remaining steps), set before each pass."""

    def __init__(self) -> None:
        self.steps: range = range(0)

    def __iter__(self) -> Iterator[int]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)


def _as_is(batch: Any) -> Any:
    return batch


def step_loader(config: TrainingConfig, steps: StepBatches, sampler: StepRange, pin: bool) -> Any:
    """The training DataLoader: one item per optimizer step, in order, with the config's
    dataloader_num_workers, dataloader_prefetch_factor, dataloader_persistent_workers,
    dataloader_multiprocessing_context and (on CUDA) dataloader_pin_memory."""
    workers = config.dataloader_num_workers
    return torch.utils.data.DataLoader(
        steps,
        batch_size=None,
        sampler=sampler,
        collate_fn=_as_is,
        num_workers=workers,
        pin_memory=pin,
        prefetch_factor=config.dataloader_prefetch_factor if workers > 0 else None,
        persistent_workers=config.dataloader_persistent_workers and workers > 0,
        multiprocessing_context=config.dataloader_multiprocessing_context if workers > 0 else None,
        # Its own generator: each pass draws a worker base seed, which must not shift the global
        # torch stream (dropout) that an exact resume restores.
        generator=torch.Generator().manual_seed(runtime.data_seed(config)),
    )


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def neftune_hook(alpha: float) -> Callable:
    """A forward hook for the input embedding layer: NEFTune (Jain et al. 2023, arXiv:2310.05914).

    In training mode, adds noise drawn uniformly from [−alpha/sqrt(L·d), alpha/sqrt(L·d)] to the
    embeddings (B, L, d) of a batch of L positions; in eval mode (evaluation, generation) returns
    them unchanged. The scale is transformers' `neftune_post_forward_hook`."""

    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        bound = alpha / math.sqrt(output.size(1) * output.size(2))
        return output + torch.zeros_like(output).uniform_(-bound, bound)

    return hook


def check_output_dir(config: TrainingConfig) -> None:
    """Refuse an output_dir that cannot be written or already holds a run, before any model loads."""
    ckpt.check_output_dir_writable(config.output_dir)
    if config.resume_from_checkpoint or config.overwrite_output_dir:
        return
    if ckpt.has_output(config.output_dir):
        raise ConfigError(
            f"output_dir={config.output_dir!r} already holds a run (checkpoints, weights or metrics). "
            "Pass --resume_from_checkpoint latest to continue it, --overwrite_output_dir to write over it, "
            "or choose another --output_dir."
        )


def check_evaluation_setup(config: TrainingConfig, *, has_eval_dataset: bool) -> None:
    """Settings that evaluate during training need an eval dataset (transformers.Trainer refuses the same)."""
    if has_eval_dataset:
        return
    for name, asks in (
        ("eval_strategy", config.eval_strategy != "no"),
        ("eval_on_start", config.eval_on_start),
        ("load_best_model_at_end", config.load_best_model_at_end),
    ):
        if asks:
            value = getattr(config, name)
            raise ConfigError(
                f"{name}={value!r} evaluates during training but there is no eval_dataset; pass eval_dataset= "
                "(on the command line: a dataset with a --dataset_test_split split) or leave "
                f"{name} at {'no' if name == 'eval_strategy' else False!r} (and eval_steps unset)."
            )


def set_special_tokens(tokenizer: Any, eos_token: str | None, pad_token: str | None) -> Any:
    """Apply the config's eos_token / pad_token (tokens that must already exist) and ensure a pad."""
    from posttrain.models import ensure_pad_token

    for name, token in (("eos_token", eos_token), ("pad_token", pad_token)):
        if token is None:
            continue
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id and token != tokenizer.unk_token:
            raise ConfigError(f"{name}={token!r} is not a token of the tokenizer's vocabulary; pick an existing token.")
        setattr(tokenizer, name, token)
    return ensure_pad_token(tokenizer)


class SupervisedRun:
    """The environment of one dataset-driven training run (SFT or reward).

    Gradient accumulation is done here rather than by accelerate: the trainer counts the trained
    units (tokens, pairs) of the whole accumulated batch first, then each micro-batch backwards
    `loss_sum / normalizer`, where normalizer = global count / world size (DDP averages gradients
    over ranks). The update then equals one big batch's mean-loss gradient exactly, which per
    micro-batch means (HF Trainer's default) do not give when micro-batches hold different counts.
    """

    def __init__(
        self,
        config: TrainingConfig,
        model: nn.Module,
        tokenizer: Any,
        train_dataset: Any,
        *,
        accelerator: Any = None,
        activation_offloading: bool = False,
        callbacks: list[Any] | None = None,
        evaluate: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        self.config = config
        # The trainer's evaluate() when it has an eval_dataset: what eval_strategy / eval_on_start /
        # the last step call.
        self.evaluate = evaluate
        check_evaluation_setup(config, has_eval_dataset=evaluate is not None)
        self.tokenizer = tokenizer
        self.accelerator = accelerator or dist.accelerator_for(config)
        self.world_size = dist.world_size(self.accelerator)
        self.device = dist.device(self.accelerator)
        self.is_main = dist.is_main(self.accelerator)
        self.activation_offloading = activation_offloading
        runtime.apply_log_levels(config, self.accelerator)
        # Seeds dropout and anything else drawn from the global generators (full_determinism: also
        # deterministic algorithms); a resume then overwrites these states with the checkpoint's.
        runtime.seed_run(config)
        self.train_dataset = train_dataset
        self.plan = BatchPlan(
            len(train_dataset),
            config.per_device_train_batch_size,
            config.gradient_accumulation_steps,
            seed=runtime.data_seed(config),
            num_train_epochs=config.num_train_epochs,
            max_steps=config.max_steps,
            world_size=self.world_size,
            rank=dist.process_index(self.accelerator),
            drop_last=config.dataloader_drop_last,
            shuffle=config.train_sampling_strategy != "sequential",
        )
        # A resume at another world size keeps the global batch, and a DeepSpeed checkpoint its ZeRO
        # stage and world size: checked before any model step.
        resume = ckpt.resolve_checkpoint(config.output_dir, config.resume_from_checkpoint)
        ckpt.check_resume_deepspeed(resume, self.accelerator)
        ckpt.check_resume_batch(
            resume,
            world_size=self.world_size,
            sizes=self.batch_sizes(),
            accumulation=config.gradient_accumulation_steps,
        )
        self.global_step = 0
        self.num_tokens = 0.0  # input tokens seen, all ranks (TRL's num_tokens)
        # This call's training loss (Σ over steps of the step's mean loss, this rank's share) and
        # examples, for the end-of-training summary.
        self.loss_total, self.samples_seen, self.steps_run = 0.0, 0, 0
        self.metrics = MetricAccumulator()
        self.tracker = Tracker(
            config.output_dir,
            config.report_to,
            config=config.to_dict(),
            run_name=config.run_name,
            is_main=self.is_main,
            logging_dir=config.logging_dir,
        )
        from posttrain.callbacks import Cadence

        self.cadence = Cadence(config, self.plan.total_steps, self.plan.epoch)
        self.count_input_tokens = bool(config.include_num_input_tokens_seen or config.include_tokens_per_second)

        model.to(self.device)
        if config.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            enable_gradient_checkpointing(model, config.gradient_checkpointing_kwargs)
        compile_for_training(model, config)
        optimizer = build_optimizer(model.parameters(), config)
        scheduler = build_scheduler(optimizer, config, self.plan.total_steps)
        resume_path = ckpt.resolve_checkpoint(config.output_dir, config.resume_from_checkpoint)
        state: dict[str, Any] = {}
        # Under DeepSpeed the engine loads its own state, so after prepare(); otherwise before it: under
        # FSDP sharded parameters cannot take a full state dict.
        engine_resume = resume_path is not None and dist.deepspeed_stage(self.accelerator) is not None
        if resume_path is not None and not engine_resume:
            state = ckpt.load_checkpoint(
                resume_path, models={"model": model}, optimizer=optimizer, scheduler=scheduler, accelerator=None
            )
        self._set_deepspeed_batch_size()
        self._check_load_best_sharding()
        self.model, self.optimizer = dist.prepare_trained(model, optimizer, self.accelerator)
        if engine_resume:
            state = ckpt.load_checkpoint(
                resume_path,
                models={"model": self.model},
                optimizer=self.optimizer,
                scheduler=scheduler,
                accelerator=self.accelerator,
            )
        self.scheduler = scheduler
        # Imported here: transformers' callback module pulls in peft, which importing a trainer must not.
        from posttrain.callbacks import TrainerEvents

        self.events = TrainerEvents(
            config,
            callbacks,
            model=self.unwrapped(),
            processing_class=tokenizer,
            optimizer=self.optimizer,
            lr_scheduler=self.scheduler,
            accelerator=self.accelerator,
            max_steps=self.plan.total_steps,
            train_batch_size=config.per_device_train_batch_size,
            num_train_epochs=math.ceil(self.plan.total_steps / self.plan.steps_per_epoch),
        )
        if resume_path is not None:
            self.global_step = int(state["global_step"])
            self.num_tokens = float(state.get("num_tokens", 0.0))
            self.events.state.global_step = self.global_step
            self.events.state.epoch = self.plan.epoch(self.global_step)
            self.events.state.log_history = list(state.get("log_history", []))
            self.events.state.num_input_tokens_seen = int(state.get("num_input_tokens_seen", 0))
            self.events.restore_checkpoint_state(state.get("callback_state", {}))
            if self.is_main and state.get("pending_metrics"):
                self.metrics.merge(state["pending_metrics"])
            if self.is_main:
                print(f"Resumed from {resume_path} at step {self.global_step}/{self.plan.total_steps}.")
        self.last_logged: dict[str, float] | None = None
        if config.push_to_hub and self.is_main:
            # As transformers: the repository exists before training, so a bad token or name fails now.
            hub.create_repo(config, token=config.hub_token, revision=config.hub_revision)

    def batch_sizes(self) -> dict[str, int]:
        """The global batch a checkpoint records and a resume must keep (checkpoint.check_resume_batch)."""
        config = self.config
        return {
            "global batch": config.per_device_train_batch_size * self.world_size * config.gradient_accumulation_steps
        }

    def _set_deepspeed_batch_size(self) -> None:
        # DeepSpeed wants a micro-batch size at prepare() time; without a dataloader accelerate
        # cannot infer it, so it is filled from the config (as TRL's online trainers do).
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if plugin is not None:
            plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = self.config.per_device_train_batch_size
            plugin.deepspeed_config["gradient_accumulation_steps"] = 1

    def _check_load_best_sharding(self) -> None:
        # The best weights are loaded into the trained model after training: sharded parameters
        # (ZeRO-3, FSDP) cannot take a full state dict, so refuse now rather than after the run.
        if not self.config.load_best_model_at_end:
            return
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        sharded = (plugin is not None and getattr(plugin, "zero_stage", 0) == 3) or str(
            getattr(self.accelerator, "distributed_type", "")
        ).endswith("FSDP")
        if sharded:
            raise ConfigError(
                "load_best_model_at_end cannot load the best checkpoint into a ZeRO-3 / FSDP sharded model; "
                "train with DDP or ZeRO-2, or leave it off and load state.best_model_checkpoint's model folder "
                "yourself."
            )

    # -- the training loop ------------------------------------------------------------------
    def steps(self, collate: Callable[[list[dict]], dict]) -> Iterator[list[dict]]:
        """Fire on_train_begin, then yield, for each remaining optimizer step, its collated
        micro-batches (on device), until max_steps or until a callback stops training.

        The caller backwards every micro-batch and then calls `end_step`; after the loop, `end_training`.
        """
        self.loss_total, self.samples_seen, self.steps_run = 0.0, 0, 0
        self.events.train_begin()
        if self.config.eval_on_start and self.evaluate is not None:
            self.evaluate()
        neftune = None
        if self.config.neftune_noise_alpha is not None:
            neftune = (
                self.unwrapped()
                .get_input_embeddings()
                .register_forward_hook(neftune_hook(self.config.neftune_noise_alpha))
            )
        plan, control = self.plan, self.events.control
        non_padding = self.config.include_num_input_tokens_seen == "non_padding"
        sampler = StepRange()
        pin = bool(self.config.dataloader_pin_memory) and self.device.type == "cuda"
        loader = step_loader(self.config, StepBatches(plan, self.train_dataset, collate), sampler, pin)
        progress = ProgressBar(
            plan.total_steps, disable=not self.is_main or bool(self.config.disable_tqdm), desc="steps"
        )
        progress.update(self.global_step)
        preemption = self.events.preemption.installed()
        preemption.__enter__()
        try:
            while self.global_step < plan.total_steps and not control.should_training_stop:
                # One loader pass per epoch (persistent workers then outlive it), from the current step.
                epoch_end = (self.global_step // plan.steps_per_epoch + 1) * plan.steps_per_epoch
                sampler.steps = range(self.global_step, min(epoch_end, plan.total_steps))
                for step, batches in zip(sampler.steps, loader):
                    if step != self.global_step:
                        raise RuntimeError("each step's batches must be followed by end_step() before the next.")
                    self.samples_seen += sum(len(idx) for idx in plan.micro_batches(step))
                    if self.count_input_tokens:
                        # transformers' count over all ranks: every input_ids position (non_padding: the attended ones).
                        (tokens,) = self.global_counts(sum(input_tokens(b, non_padding) for b in batches))
                        self.events.state.num_input_tokens_seen += int(tokens)
                    yield [self.to_device(b) for b in batches]
                    progress.update(1)
                    if self.last_logged is not None:
                        progress.set_postfix({k: v for k, v in self.last_logged.items() if k in ("loss", "lr")})
                    if control.should_training_stop:
                        break
        finally:
            preemption.__exit__(None, None, None)
            progress.close()
            if neftune is not None:
                neftune.remove()

    def to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def global_counts(self, *local: float | torch.Tensor) -> list[float]:
        """Sum per-rank counts over ranks (one all-reduce)."""
        t = torch.tensor(
            [float(x) for x in local],
            dtype=torch.float64 if self.device.type != "mps" else torch.float32,
            device=self.device,
        )
        return dist.reduce_sum(t, self.accelerator).tolist()

    def normalizer(self, global_count: float) -> float:
        """Divide a micro-batch's loss sum by this: DDP's average over ranks then gives Σ / N_global."""
        return max(global_count, 1.0) / self.world_size

    def micro_steps(self, batches: list[dict]) -> Iterator[tuple[int, dict]]:
        """Enumerate micro-batches inside the right context: DDP sync only on the last one,
        autocast for mixed precision, activations kept on the CPU when asked."""
        for i, batch in enumerate(batches):
            with contextlib.ExitStack() as stack:
                stack.enter_context(no_sync_unless_last(self.accelerator, self.model, i == len(batches) - 1))
                stack.enter_context(self.autocast())
                if self.activation_offloading:
                    stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()))
                yield i, batch

    def linear_kernels(self) -> contextlib.AbstractContextManager:
        """The model's float32 CPU linear layers through oneDNN where it measures faster, for the run
        (`cpu_linear`, POSTTRAIN_CPU_LINEAR); mixed precision and torch_compile keep torch's path."""
        compiled = bool(getattr(self.config, "torch_compile", False))
        return cpu_linear.for_training([self.model], mixed_precision=self.config.mixed_precision, compiled=compiled)

    def autocast(self):
        if self.config.mixed_precision == "no":
            return contextlib.nullcontext()
        return self.accelerator.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        if not torch.isfinite(loss.detach()):
            raise FloatingPointError(
                f"the loss is {loss.item()} at step {self.global_step + 1}; lower the learning_rate, "
                "check the data, or use bf16 instead of fp16."
            )
        self.loss_total += float(loss.detach())
        self.accelerator.backward(loss)

    def end_step(self, evaluate: Callable[[], dict[str, float]] | None = None) -> None:
        """Clip, step optimizer and schedule, fire on_step_end, then log / evaluate / save when due
        (the config's strategies, `callbacks.Cadence`) or when a callback asked through
        control.should_log / should_evaluate / should_save.

        The last step (max_steps, or a callback set control.should_training_stop) logs unless
        logging_strategy is "no", evaluates when there is an eval_dataset, and writes no checkpoint
        (the final save follows) unless its evaluation is a new best with save_strategy "best" or
        load_best_model_at_end, so that state.best_model_checkpoint names it. A step that stops for a
        SIGTERM (enable_jit_checkpoint) always writes its checkpoint, and no final save follows.
        """
        evaluate = evaluate or self.evaluate
        lr = self.scheduler.get_last_lr()[0]
        max_norm = self.config.max_grad_norm or math.inf
        grad_norm = dist.clip_grad_norm(self.accelerator, self.model.parameters(), max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        self.steps_run += 1
        self.metrics.add_value("grad_norm", grad_norm)
        step, events = self.global_step, self.events
        events.step_end(step, self.plan.epoch(step))
        # A callback's requests, read now: on_log / on_evaluate / on_save reset them.
        log_now, eval_now, save_now = (
            events.control.should_log,
            events.control.should_evaluate,
            events.control.should_save,
        )
        cadence, stop = self.cadence, events.control.should_training_stop
        if cadence.log_due(step) or log_now or (stop and self.config.logging_strategy != "no"):
            self.log_metrics({"lr": lr})
        improved = False
        if evaluate is not None and (cadence.eval_due(step) or eval_now or events.control.should_training_stop):
            improved = events.update_best(evaluate())
        keeps_best = self.config.save_strategy == "best" or bool(self.config.load_best_model_at_end)
        save_due = cadence.save_due(step) or (self.config.save_strategy == "best" and improved)
        saves = (save_due or save_now) and not events.control.should_training_stop or (stop and improved and keeps_best)
        if saves or events.preempted:
            self.save_checkpoint()
            events.save()
            if hub.pushes_at_save(self.config):
                self.push_from_checkpoint()
        if events.preempted:
            log_preempted(self.config.output_dir, step, is_main=self.is_main)

    def log_metrics(self, extra: dict[str, float]) -> dict[str, float]:
        """Reduce the window's metrics across ranks (one all-reduce) and log them with `extra`."""
        values = self.metrics.reduce(self.accelerator)
        self.metrics.reset()
        self.num_tokens += values.pop("num_tokens", 0.0)
        values.update(extra)
        values["num_tokens"] = self.num_tokens
        values["epoch"] = self.plan.epoch(self.global_step)
        self.log(values)
        self.last_logged = values
        return values

    def log(self, logs: dict[str, float]) -> None:
        """Write `logs` at the current step (tracker sinks, state.log_history, on_log)."""
        self.tracker.log(logs, step=self.global_step)
        self.events.log(logs)

    def log_evaluation(self, metrics: dict[str, float]) -> None:
        """Write eval metrics at the current step (tracker sinks, state.log_history, on_log, on_evaluate)."""
        self.tracker.log(metrics, step=self.global_step)
        self.events.evaluate(metrics)

    def end_training(self) -> Any:
        """The end-of-training summary (state.log_history, on_log, on_train_end) -> TrainOutput.

        train_loss is the mean over this call's steps of each step's mean loss (what was
        backpropagated, summed over micro-batches and ranks), as transformers reports it.
        """
        loss_total, samples = self.global_counts(self.loss_total, self.samples_seen)
        training_loss = loss_total / self.world_size / max(self.steps_run, 1)
        output = self.events.train_end(training_loss, int(samples), total_flos=self._flos())
        if self.config.push_to_hub and not self.events.preempted:
            hub.push(self.config, is_main=self.is_main, write_card=self.write_model_card)
        return output

    def _flos(self) -> float:
        """transformers' estimate of the training compute: 6 · input tokens · non-embedding parameters."""
        model = self.unwrapped()
        counter = getattr(model, "num_parameters", None)
        params = counter(exclude_embeddings=True) if callable(counter) else sum(p.numel() for p in model.parameters())
        return 6.0 * self.num_tokens * params

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        state = {
            "global_step": self.global_step,
            "num_tokens": self.num_tokens,
            # The metrics of a not-yet-logged window (main process's share), so a resumed run
            # logs the same numbers as an uninterrupted one on a single process.
            "pending_metrics": self.metrics.state(),
            "data_epoch": self.global_step // self.plan.steps_per_epoch,
            "time": time.time(),
            "log_history": self.events.state.log_history,
            "num_input_tokens_seen": self.events.state.num_input_tokens_seen,
        }
        events = self.events
        # This checkpoint may be the best one: name it before the state is written and rotation runs.
        events.state.global_step = self.global_step
        best_step = getattr(events.state, "best_global_step", None)
        if best_step == self.global_step:
            events.state.best_model_checkpoint = str(Path(self.config.output_dir) / f"checkpoint-{best_step}")
        state["callback_state"] = events.checkpoint_state()
        ckpt.save_checkpoint(
            self.config.output_dir,
            self.global_step,
            models={"model": self.model},
            tokenizer=self.tokenizer,
            config=self.config.to_dict(),
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            trainer_state=state,
            save_total_limit=self.config.save_total_limit,
            accelerator=self.accelerator,
            best=events.state.best_model_checkpoint,
            model_only=self.config.save_only_model,
            on_each_node=self.config.save_on_each_node,
            batch=self.batch_sizes(),
        )
        events.note_checkpoint(self.config.output_dir)

    def load_best_model(self) -> None:
        """load_best_model_at_end: load the weights of state.best_model_checkpoint into the model
        (before the final save, so the saved model is the best one); with save_total_limit=1 the
        other checkpoints are then deleted, as transformers does."""
        best = self.events.state.best_model_checkpoint
        if not self.config.load_best_model_at_end or best is None:
            return
        if self.is_main:
            print(
                f"Loading the best model from {best} ({self.config.metric_for_best_model}: "
                f"{self.events.state.best_metric})."
            )
        ckpt.load_checkpoint(best, models={"model": self.unwrapped()}, restore_rng=False, accelerator=self.accelerator)
        if self.config.save_total_limit == 1 and self.is_main:
            for other in ckpt.list_checkpoints(self.config.output_dir):
                if other != Path(best):
                    shutil.rmtree(other, ignore_errors=True)

    def save_final(self, output_dir: str | None = None) -> None:
        """The trained model at the top of output_dir, loadable with plain `from_pretrained`."""
        ckpt.save_final(
            output_dir or self.config.output_dir,
            self.model,
            tokenizer=self.tokenizer,
            config=self.config.to_dict(),
            accelerator=self.accelerator,
            on_each_node=self.config.save_on_each_node,
        )

    # -- sharing on the Hub (posttrain.hub) ------------------------------------------------------
    def write_model_card(self, method: str | None = None, **card: Any) -> None:
        """output_dir/README.md (main process only); `card`: create_model_card's keywords."""
        if self.is_main:
            method = method or hub.method_of(self.config)
            log_history = self.events.state.log_history
            hub.write_model_card(self.config, method=method, log_history=log_history, model=self.unwrapped(), **card)

    def push_from_checkpoint(self) -> None:
        """After a checkpoint save (push_to_hub, hub_strategy != "end"): the model saved at the top of
        output_dir (every process: weights are gathered), then hub.push_checkpoint."""
        self.save_final()
        folder = f"{self.config.output_dir}/{ckpt.CHECKPOINT_PREFIX}{self.global_step}"
        hub.push_checkpoint(
            self.config, folder, self.global_step, is_main=self.is_main, write_card=self.write_model_card
        )

    def unwrapped(self) -> nn.Module:
        return dist.unwrap(self.model, self.accelerator)

    def close(self) -> None:
        self.tracker.close()


class SupervisedTrainerAPI(hub.PushToHub):
    """What SFTTrainer and RewardTrainer expose as a `transformers.Trainer` does (set up in their
    constructors: `args`, `accelerator`, `processing_class`, `train_dataset`, `eval_dataset`,
    `data_collator`, `run`)."""

    run: SupervisedRun

    @property
    def model(self) -> nn.Module:
        return self.run.model

    @property
    def state(self) -> Any:
        """The `transformers.TrainerState`: global_step, epoch, log_history (one entry per logging
        step or evaluation, with step and epoch; after train() the summary entry), max_steps, ..."""
        return self.run.events.state

    @property
    def control(self) -> Any:
        return self.run.events.control

    @property
    def callback_handler(self) -> Any:
        return self.run.events.handler

    @property
    def collator(self) -> Any:  # posttrain's earlier name for data_collator
        return self.data_collator

    def _start_run(self, model: nn.Module, callbacks: list | None) -> None:
        """The constructors' last step, once `args`, `accelerator`, `processing_class` and the prepared
        datasets are set: refuse rows longer than the model's positions, then set up `run` (evaluating
        only with an eval_dataset)."""
        for data, source in ((self.train_dataset, "train_dataset"), (self.eval_dataset, "eval_dataset")):
            check_sequence_lengths(data, model, max_length=self.args.max_length, source=source)
        self.run = SupervisedRun(
            self.args,
            model,
            self.processing_class,
            self.train_dataset,
            accelerator=self.accelerator,
            activation_offloading=self.args.activation_offloading,
            callbacks=callbacks,
            evaluate=self.evaluate if self.eval_dataset is not None else None,
        )

    def add_callback(self, callback: Any) -> None:
        """Add a `transformers.TrainerCallback` (an instance, or a class, which is instantiated)."""
        self.run.events.add_callback(callback)

    def pop_callback(self, callback: Any) -> Any:
        """Remove a callback (an instance, or the first of a class) and return it, or None."""
        return self.run.events.pop_callback(callback)

    def remove_callback(self, callback: Any) -> None:
        """Remove a callback (an instance, or the first of a class)."""
        self.run.events.remove_callback(callback)

    def log(self, logs: dict[str, float]) -> None:
        """Log `logs` at the current step: metrics.jsonl and the trackers, state.log_history, on_log."""
        self.run.log(logs)

    def save_model(self, output_dir: str | None = None) -> None:
        """Save model + tokenizer with save_pretrained (safetensors) into output_dir."""
        self.run.save_final(output_dir)

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        license: str | None = None,
    ) -> None:
        """Write output_dir/README.md: base model, algorithm and paper, the command or config that trained
        it, the final metrics of state.log_history, framework versions (main process only; hub.model_card)."""
        self.run.write_model_card(
            hub.method_of(self, self.args), model_name=model_name, dataset_name=dataset_name, tags=tags, license=license
        )


def resolve_model_and_tokenizer(
    model: Any, processing_class: Any, config: TrainingConfig, *, kind: str, model_init_kwargs: dict | None
) -> tuple[nn.Module, Any]:
    """Accept a model object or a path / hub name (TRL's `model=` accepts both) and a tokenizer or None."""
    from posttrain import models

    tokenizer = processing_class
    path = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
    if tokenizer is None:
        if not path:
            raise ConfigError("processing_class is required when the model was not loaded from a path.")
        tokenizer = models.load_tokenizer(path, trust_remote_code=config.trust_remote_code)
    tokenizer = set_special_tokens(tokenizer, getattr(config, "eos_token", None), getattr(config, "pad_token", None))
    if isinstance(model, str):
        kwargs = dict(model_init_kwargs or {})
        dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", config.torch_dtype))
        trust_remote_code = kwargs.pop("trust_remote_code", config.trust_remote_code)
        if kind == "causal_lm":
            loader = models.load_policy
        else:
            # Reward training starts from a base or SFT model: its score head is new by design.
            loader = functools.partial(models.load_reward_model, allow_new_head=True)
        model = loader(
            model,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            disable_dropout=config.disable_dropout,
            tokenizer=tokenizer,
            **kwargs,
        )
    elif config.disable_dropout:
        models.disable_dropout(model)
    return model, tokenizer


def apply_chat_template_path(tokenizer: Any, path: str | None) -> None:
    """chat_template_path: a Jinja file, or a tokenizer folder / hub name whose template is used."""
    if path is None:
        return
    from pathlib import Path

    if Path(path).is_file():
        tokenizer.chat_template = Path(path).read_text(encoding="utf-8")
        return
    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(path).chat_template
    if template is None:
        raise ConfigError(f"chat_template_path={path!r}: that tokenizer has no chat template.")
    tokenizer.chat_template = template


def begin_supervised(
    model: Any,
    args: Any,
    config_cls: type,
    suffix: str,
    train_dataset: Any,
    processing_class: Any,
    accelerator: Any,
    *,
    kind: str,
) -> tuple[Any, Any, Any, Any]:
    """The common start of SFTTrainer / RewardTrainer: a default config named after the model,
    checks that need no model (train_dataset given, output_dir free), the accelerator (created
    before dataset preparation so that runs on the main process first), model + tokenizer, and the
    chat template. Returns (args, accelerator, model, tokenizer)."""
    if args is None:
        # As TRL: the model id's last part, from the config of a model object.
        name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
        name = name or type(model).__name__
        args = config_cls(output_dir=f"{str(name).rstrip('/').split('/')[-1]}-{suffix}")
    if train_dataset is None:
        raise ConfigError("`train_dataset` is required (or --dataset_name on the command line).")
    check_output_dir(args)
    accelerator = accelerator or dist.accelerator_for(args)
    model, tokenizer = resolve_model_and_tokenizer(
        model, processing_class, args, kind=kind, model_init_kwargs=args.model_init_kwargs
    )
    apply_chat_template_path(tokenizer, args.chat_template_path)
    return args, accelerator, model, tokenizer


def run_command(trainer_cls: type, config: TrainingConfig, **peft: Any) -> int:
    """`posttrain sft` / `posttrain reward`: refuse to overwrite a finished run, load the model named by
    model_name_or_path (with a LoRA adapter from the --use_peft flags; `peft` to `peft_config_from`) and
    the dataset's train / test splits, train, save. Errors are reported by cli.main."""
    from posttrain.data import load_split
    from posttrain.models import peft_config_from

    check_output_dir(config)
    if not config.model_name_or_path:
        raise ConfigError("model_name_or_path is not set: pass --model_name_or_path (a folder or a hub name).")
    trainer = trainer_cls(
        config.model_name_or_path,
        args=config,
        train_dataset=load_split(config, config.dataset_train_split),
        eval_dataset=load_split(config, config.dataset_test_split, required=False),
        peft_config=peft_config_from(config, **peft),
    )
    trainer.train()
    return 0
