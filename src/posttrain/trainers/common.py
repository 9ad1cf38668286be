"""Mechanisms every online trainer (PPO, RLOO, GRPO, Online DPO, XPO) shares.

The algorithm of each trainer lives in its own file and reads top to bottom; what lives here is
the plumbing around it, written once: the accelerator and derived batch sizes, the endless prompt
stream (resumable), sampling settings and stop tokens, the reward source (model, functions or
both), optimizer and schedule, micro-batch iteration with exact loss normalisation, logging,
sample tables, checkpoints, resume and the final save.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posttrain import checkpoint as ckpt
from posttrain import distributed as dist
from posttrain.configs import ConfigError, OnPolicyConfig
from posttrain.health import HealthMonitor
from posttrain.rollout import Rollout, SamplingConfig, generation_mode
from posttrain.tracking import MetricAccumulator, ProgressBar, Tracker


# ---------------------------------------------------------------------------------------------
# the reference policy
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def reference_policy(model: nn.Module, ref_model: nn.Module | None, accelerator: Any) -> Iterator[nn.Module]:
    """The reference model in eval mode, or the PEFT policy with its adapter TRULY disabled.

    Shared by Online DPO, XPO, RLOO and GRPO: with LoRA (`peft_config` / --use_peft) and no
    reference model, the reference is the frozen base, i.e. the policy with its adapter off, so no
    second copy of the weights is held. TRL's XPO generated "reference" completions with
    `get_base_model()`, which in PEFT still runs the LoRA layers (peft#430, trl-notes §6), so they
    came from the policy; `disable_adapter()` really switches the adapter off for logprobs and
    generation alike.
    """
    if ref_model is not None:
        with generation_mode(ref_model):
            yield ref_model
        return
    policy = dist.unwrap(model, accelerator)
    with policy.disable_adapter(), generation_mode(policy):
        yield policy


# ---------------------------------------------------------------------------------------------
# sampling and stop tokens
# ---------------------------------------------------------------------------------------------
def stop_token_ids(config: OnPolicyConfig, tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a completion.

    Completions always stop at the tokenizer's EOS (TRL 0.19's PPO/RLOO sample to response_length
    unless told otherwise — issue #2387 — which wastes time and feeds the reward model text after
    EOS); `stop_token_id` adds another stop id (e.g. an end-of-turn token). `stop_token="eos"` is
    accepted for TRL command lines and means the EOS id.
    """
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if config.stop_token_id is not None and config.stop_token_id not in ids:
        ids.append(int(config.stop_token_id))
    return tuple(ids)


def sampling_config(config: OnPolicyConfig, tokenizer: Any, max_new_tokens: int | None = None) -> SamplingConfig:
    return SamplingConfig(
        max_new_tokens=max_new_tokens or config.response_length,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        do_sample=config.temperature > 0,
        stop_token_ids=stop_token_ids(config, tokenizer),
    )


# ---------------------------------------------------------------------------------------------
# optimisation
# ---------------------------------------------------------------------------------------------
def build_optimizer(params: Sequence[nn.Parameter] | Any, config: Any) -> torch.optim.Optimizer:
    """AdamW with the config's lr, betas, eps and weight decay (biases and norms included, as TRL)."""
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
        weight_decay=config.weight_decay,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, config: Any, num_training_steps: int):
    """transformers' named schedules (linear, cosine, constant, ...) with warmup_ratio / warmup_steps."""
    from transformers import get_scheduler

    return get_scheduler(
        config.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=config.warmup_for(num_training_steps),
        num_training_steps=num_training_steps,
    )


def micro_batches(indices: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    for start in range(0, indices.numel(), size):
        yield indices[start : start + size]


def global_normalizer(local_count: torch.Tensor | float, accelerator: Any) -> float:
    """The per-rank normaliser that makes a DDP-averaged gradient equal Σ_all / N_global.

    DDP averages gradients over ranks, so each rank divides its loss sum by N_global / world_size.
    Passing this to the losses makes micro-batching and data parallelism leave the loss unchanged
    (verl's global token-mean; TRL's per-micro-batch means do not have this property).
    """
    count = torch.as_tensor(local_count, dtype=torch.float32, device=dist.device(accelerator))
    total = dist.reduce_sum(count.clone(), accelerator)
    return max(float(total.item()) / dist.world_size(accelerator), 1e-8)


# ---------------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------------
class PromptStream:
    """An endless, reshuffled-per-epoch stream of prompt batches that can be checkpointed.

    Each epoch's order is a permutation drawn from (seed, epoch), so resuming at (epoch, position)
    reproduces exactly the batches an uninterrupted run would have seen. Partial batches at the end
    of an epoch are dropped (every rollout batch has the same size). Under data parallelism each
    rank takes its own contiguous slice of every global batch.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        collate: Callable[[list[dict]], dict],
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
    ) -> None:
        global_batch = batch_size * world_size
        if len(dataset) < global_batch:
            raise ConfigError(
                f"the prompt dataset has {len(dataset)} rows, fewer than one rollout batch needs "
                f"({global_batch} prompts = {batch_size} per device × {world_size} devices); "
                "add prompts or lower per_device_train_batch_size / gradient_accumulation_steps."
            )
        self.dataset, self.batch_size, self.collate = dataset, batch_size, collate
        self.seed, self.rank, self.world_size, self.shuffle = seed, rank, world_size, shuffle
        self.batches_per_epoch = len(dataset) // global_batch
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(len(self.dataset), generator=g).tolist()

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> dict:
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation()
        global_batch = self.batch_size * self.world_size
        start = self.position * global_batch + self.rank * self.batch_size
        rows = [self.dataset[i] for i in self._order[start : start + self.batch_size]]
        self.position += 1
        return self.collate(rows)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation()


def prompt_dataset(config: OnPolicyConfig, tokenizer: Any, dataset: Any, source: str) -> Any:
    """Tokenize (chat template applied) and validate a prompt dataset; see data.prepare_prompt_dataset."""
    from posttrain.data import prepare_prompt_dataset

    return prepare_prompt_dataset(
        dataset, tokenizer, max_prompt_length=config.max_prompt_length, overflow=config.prompt_overflow, source=source
    )


def load_split(config: Any, split: str, required: bool = True) -> Any:
    from posttrain.data import load_any_dataset

    if not config.dataset_name:
        raise ConfigError("dataset_name is not set: pass --dataset_name (a hub name, a saved folder or a data file).")
    if not required and not has_split(config.dataset_name, split):
        return None
    return load_any_dataset(config.dataset_name, split=split, config_name=config.dataset_config)


def has_split(name_or_path: str, split: str) -> bool:
    """Whether an optional split (e.g. the test split used for sample tables) exists. A single data
    file holds only "train"; a saved DatasetDict folder lists its splits; for hub datasets we try to
    load and treat only a missing split as absent — any other data error still stops the run."""
    import os

    from posttrain.data import DataError, load_any_dataset

    path = os.path.expanduser(str(name_or_path))
    if os.path.isfile(path):
        return split.startswith("train")
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        import json

        with open(os.path.join(path, "dataset_dict.json")) as f:
            return split in json.load(f).get("splits", [])
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "dataset_info.json")):
        return split.startswith("train")
    try:
        load_any_dataset(name_or_path, split=split)
    except DataError as err:
        if "no split" in str(err):
            return False
        raise
    return True


# ---------------------------------------------------------------------------------------------
# rewards
# ---------------------------------------------------------------------------------------------
def import_callable(path: str) -> Callable:
    """Resolve "package.module:function" or "package.module.function" to the object."""
    import os
    import sys

    # The console script does not put the working directory on sys.path (python -m does); reward
    # modules next to the user's data are the common case, so look there too.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    if not module or not name:
        raise ConfigError(f"reward function {path!r} must be an import path like my_pkg.rewards:length_reward.")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"cannot import reward function {path!r}: {err}") from None
    if not callable(fn):
        raise ConfigError(f"reward function {path!r} is not callable.")
    return fn


class RewardSource:
    """Scores completions: a reward model, text reward functions, or both (summed with weights).

    `reward` may be an nn.Module (a sequence-classification reward model; scored at the last real
    token, re-tokenized when its tokenizer differs from the policy's), a callable
    `f(prompts, completions, **columns) -> list[float]`, or a list of those. The missing-EOS
    penalty looks at the completion only (`rollout.ended`, set by the configured stop tokens).
    """

    def __init__(
        self,
        reward: Any,
        *,
        policy_tokenizer: Any,
        reward_tokenizer: Any = None,
        weights: Sequence[float] | None = None,
        batch_size: int = 64,
        missing_eos_penalty: float | None = None,
    ) -> None:
        items = list(reward) if isinstance(reward, (list, tuple)) else [reward]
        if not items or any(r is None for r in items):
            raise ConfigError(
                "no reward given: pass a reward model (reward_model_path) or reward functions (reward_funcs)."
            )
        self.models = [r for r in items if isinstance(r, nn.Module)]
        self.funcs = [r for r in items if not isinstance(r, nn.Module)]
        if weights is not None and len(weights) != len(items):
            raise ConfigError(
                f"reward_weights has {len(weights)} entries for {len(items)} rewards; give one weight per reward."
            )
        weights = list(weights) if weights is not None else [1.0] * len(items)
        self.model_weights = [w for r, w in zip(items, weights) if isinstance(r, nn.Module)]
        self.func_weights = [w for r, w in zip(items, weights) if not isinstance(r, nn.Module)]
        self.policy_tokenizer, self.reward_tokenizer = policy_tokenizer, reward_tokenizer
        self.batch_size, self.missing_eos_penalty = batch_size, missing_eos_penalty

    @torch.no_grad()
    def __call__(
        self, rollout: Rollout, prompts: list[str], completions: list[str], columns: dict[str, list] | None = None
    ) -> torch.Tensor:
        from posttrain.scoring import apply_missing_eos_penalty, reward_function_scores, reward_model_scores

        device = rollout.completion_ids.device
        scores = torch.zeros(len(rollout), dtype=torch.float32, device=device)
        for model, w in zip(self.models, self.model_weights):
            s = reward_model_scores(
                model,
                rollout,
                batch_size=self.batch_size,
                policy_tokenizer=self.policy_tokenizer,
                reward_tokenizer=self.reward_tokenizer,
            )
            scores = scores + w * s.to(device=device, dtype=torch.float32)
        if self.funcs:
            s = reward_function_scores(self.funcs, prompts, completions, weights=self.func_weights, columns=columns)
            scores = scores + s.to(device=device, dtype=torch.float32)
        return apply_missing_eos_penalty(scores, rollout.ended, self.missing_eos_penalty)


# ---------------------------------------------------------------------------------------------
# the run: accelerator, logging, checkpoints
# ---------------------------------------------------------------------------------------------
@dataclass
class RunState:
    """Counters that a checkpoint must restore for an exact resume."""

    update: int = 0  # rollout batches done
    episode: int = 0  # completions generated (global)
    optimizer_steps: int = 0


class OnlineRun:
    """The environment of one online training run, shared by all online trainers.

    Owns: the accelerator (one Accelerator per run; gradient accumulation is handled by the trainers
    with exact global normalisation, so accelerate's own loss scaling stays off), derived sizes
    (validated before any forward pass), the prompt stream, the tracker and progress bar, metric
    accumulation, sample tables, checkpointing and resume.
    """

    def __init__(
        self,
        config: OnPolicyConfig,
        tokenizer: Any,
        train_dataset: Any,
        eval_dataset: Any = None,
        *,
        accelerator: Any = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.accelerator = accelerator or dist.build_accelerator(mixed_precision=config.mixed_precision)
        dist.set_seed(config.seed)
        self.world_size = dist.world_size(self.accelerator)
        self.device = dist.device(self.accelerator)
        self.is_main = dist.is_main(self.accelerator)
        if train_dataset is None:
            raise ConfigError(
                "train_dataset is required: pass a prompt dataset (or --dataset_name on the command line)."
            )
        self.train_dataset = prompt_dataset(config, tokenizer, train_dataset, source="train_dataset")
        # Sizes count the prompts that survived validation (overflow="drop" may remove some).
        config.derive_sizes(self.world_size, len(self.train_dataset))
        self.eval_dataset = (
            prompt_dataset(config, tokenizer, eval_dataset, source="eval_dataset") if eval_dataset is not None else None
        )
        from posttrain.data import PromptCollator

        self.collate = PromptCollator(tokenizer.pad_token_id)
        self.prompts = PromptStream(
            self.train_dataset,
            config.prompts_per_rollout,
            self.collate,
            config.seed,
            rank=dist.process_index(self.accelerator),
            world_size=self.world_size,
        )
        self.sampling = sampling_config(config, tokenizer)
        # Sampling stream: one per rank, seeded so runs are reproducible and ranks differ.
        self.generator = torch.Generator(device=self.device).manual_seed(
            config.seed + 7919 * dist.process_index(self.accelerator)
        )
        self.state = RunState()
        self.metrics = MetricAccumulator()
        self.tracker = Tracker(
            config.output_dir, config.report_to, config=config.to_dict(), run_name=config.run_name, is_main=self.is_main
        )
        self.health = HealthMonitor(enabled=self.is_main)
        self.progress: ProgressBar | None = None
        self.start_time = time.time()
        self._episodes_at_start = 0

    # -- context managers -------------------------------------------------------------------------
    def autocast(self):
        """bf16/fp16 autocast for forwards when mixed precision is on (CPU AMX or GPU)."""
        if self.config.mixed_precision == "no":
            return contextlib.nullcontext()
        return self.accelerator.autocast()

    # -- the outer loop ---------------------------------------------------------------------------
    def updates(self) -> Iterator[int]:
        """Yield rollout-batch indices from the resumed position to num_total_batches − 1."""
        total = self.config.num_total_batches
        self.progress = ProgressBar(self.config.total_episodes, disable=not self.is_main)
        self.progress.update(self.state.episode)
        self._episodes_at_start = self.state.episode
        self.start_time = time.time()
        try:
            while self.state.update < total:
                yield self.state.update
                self.state.update += 1
                self.state.episode += self.config.batch_size
                self.progress.update(self.config.batch_size)
        finally:
            self.progress.close()

    def next_batch(self) -> dict:
        batch = next(self.prompts)
        batch["input_ids"] = batch["input_ids"].to(self.device)
        batch["attention_mask"] = batch["attention_mask"].to(self.device)
        return batch

    @property
    def eps(self) -> float:
        """Episodes per second since this process started training (TRL's `eps`)."""
        elapsed = max(time.time() - self.start_time, 1e-9)
        return (self.state.episode + self.config.batch_size - self._episodes_at_start) / elapsed

    def should_log(self, update: int) -> bool:
        return (update + 1) % self.config.logging_steps == 0 or update + 1 == self.config.num_total_batches

    def log(self, update: int, extra: dict[str, float]) -> dict[str, float]:
        """Reduce accumulated metrics across ranks (one all-reduce), add counters, write to sinks."""
        values = self.metrics.reduce(self.accelerator)
        self.metrics.reset()
        values.update(extra)
        values["eps"] = self.eps
        values["episode"] = self.state.episode + self.config.batch_size
        values["epoch"] = values["episode"] / max(len(self.train_dataset) * self.config.samples_per_prompt, 1)
        self.tracker.log(values, step=update + 1)
        self.health.check(values, update + 1)
        return values

    def loss_is_finite(self, loss: torch.Tensor) -> bool:
        """False (and counted) for a NaN/inf loss, whose optimizer step the trainer then skips;
        raises TrainingDiverged after HealthMonitor.max_nonfinite of them in a row."""
        return self.health.loss_is_finite(loss)

    def should_sample(self, update: int) -> bool:
        freq = self.config.sample_generations_freq
        return freq > 0 and self.eval_dataset is not None and (update + 1) % freq == 0

    def sample_table(self, update: int, rows: list[dict]) -> None:
        """The seed's (query, model response, score) table, printed with rich and saved to samples.jsonl."""
        self.tracker.log_table("completions", rows, step=update + 1)

    def eval_prompts(self, n: int) -> dict:
        rows = [self.eval_dataset[i] for i in range(min(n, len(self.eval_dataset)))]
        batch = self.collate(rows)
        batch["input_ids"] = batch["input_ids"].to(self.device)
        batch["attention_mask"] = batch["attention_mask"].to(self.device)
        return batch

    # -- checkpoints ------------------------------------------------------------------------------
    def should_save(self, update: int) -> bool:
        steps = self.config.save_steps
        return steps > 0 and (update + 1) % steps == 0 and update + 1 < self.config.num_total_batches

    def save(self, models: dict[str, nn.Module], optimizer: Any, scheduler: Any, extra: dict | None = None) -> None:
        """A resumable checkpoint after the current rollout batch (counters already advanced)."""
        state = {
            "run": {
                "update": self.state.update + 1,
                "episode": self.state.episode + self.config.batch_size,
                "optimizer_steps": self.state.optimizer_steps,
            },
            "prompts": self.prompts.state_dict(),
            "generator": self.generator.get_state(),
            "health": self.health.state_dict(),
            **(extra or {}),
        }
        unwrapped = {k: dist.unwrap(m, self.accelerator) for k, m in models.items()}
        ckpt.save_checkpoint(
            self.config.output_dir,
            self.state.update + 1,
            models=unwrapped,
            tokenizer=self.tokenizer,
            config=self.config.to_dict(),
            optimizer=optimizer,
            scheduler=scheduler,
            trainer_state=state,
            save_total_limit=self.config.save_total_limit,
            accelerator=self.accelerator,
        )

    def maybe_resume(self, models: dict[str, nn.Module], optimizer: Any, scheduler: Any) -> dict:
        """Restore weights, optimizer, scheduler, RNG, counters and data position; return the extra state."""
        path = ckpt.resolve_checkpoint(self.config.output_dir, self.config.resume_from_checkpoint)
        if path is None:
            return {}
        unwrapped = {k: dist.unwrap(m, self.accelerator) for k, m in models.items()}
        state = ckpt.load_checkpoint(
            path, models=unwrapped, optimizer=optimizer, scheduler=scheduler, accelerator=self.accelerator
        )
        run = state.pop("run")
        self.state = RunState(update=run["update"], episode=run["episode"], optimizer_steps=run["optimizer_steps"])
        self.prompts.load_state_dict(state.pop("prompts"))
        self.generator.set_state(state.pop("generator"))
        self.health.load_state_dict(state.pop("health", {}))
        if self.is_main:
            print(f"Resumed from {path} at rollout batch {self.state.update} (episode {self.state.episode}).")
        return state

    def finish(self, model: nn.Module, extra_models: dict[str, nn.Module] | None = None) -> None:
        """Save the trained policy (and e.g. the critic) where plain transformers can load it.
        Called on every rank: under ZeRO-3 / FSDP the full weights are gathered collectively."""
        dist.wait_for_everyone(self.accelerator)
        ckpt.save_final(
            self.config.output_dir,
            dist.unwrap(model, self.accelerator),
            tokenizer=self.tokenizer,
            config=self.config.to_dict(),
            extra_models={k: dist.unwrap(m, self.accelerator) for k, m in (extra_models or {}).items()},
            accelerator=self.accelerator,
        )
        self.tracker.close()


def check_finite(name: str, value: torch.Tensor) -> None:
    if not torch.isfinite(value).all():
        raise FloatingPointError(f"{name} is not finite ({value.detach().flatten()[:4].tolist()} ...).")


def clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, config: Any, accelerator: Any) -> float:
    """Clip the global grad norm (if max_grad_norm) and take an optimizer step; returns the norm."""
    norm = float("nan")
    if config.max_grad_norm:
        norm = float(accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def no_sync_unless_last(accelerator: Any, model: nn.Module, is_last: bool):
    """Skip the DDP gradient all-reduce on all but the last micro-batch of an accumulation."""
    if is_last or accelerator.num_processes == 1:
        return contextlib.nullcontext()
    return accelerator.no_sync(model)
