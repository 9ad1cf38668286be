"""Prompts for online training: the prepared prompt dataset and the resumable stream of batches.

- `prompt_dataset`: `prepare_prompt_dataset` with the run's settings (max_prompt_length,
  prompt_overflow), naming the dataset (`source`) in every error.
- `PromptStream`: an endless stream of prompt batches, reshuffled each epoch from (seed, epoch),
  whose position is checkpointed for an exact resume; under data parallelism each rank takes its
  own slice of every global batch. `StreamedPrompts`: the same over a streaming dataset, in its order.
- `eval_dataset_sets`: an eval set, or a dict of named ones, prepared (streaming sets read into
  memory first, `materialize`).

torch is imported on first use, so `import posttrain.data` stays light.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from posttrain.configs import ConfigError


def prompt_dataset(config: Any, tokenizer: Any, dataset: Any, source: str, limits: Sequence[Any] = ()) -> Any:
    """Tokenize (chat template applied) and validate a prompt dataset with config.max_prompt_length
    and config.prompt_overflow; see prepare.prepare_prompt_dataset. `limits`: the
    positions.PositionLimit of each model reading the sequences; prompt + config.response_length
    must fit them all (see posttrain.positions for what is truncated, dropped or refused)."""
    from posttrain import positions
    from posttrain.data.prepare import prepare_prompt_dataset

    if is_streaming(dataset):
        return _prompt_stream_dataset(config, tokenizer, dataset, source, limits)

    def prepare(max_prompt_length: int | None) -> Any:
        return prepare_prompt_dataset(
            dataset,
            tokenizer,
            max_prompt_length=max_prompt_length,
            overflow=config.prompt_overflow,
            source=source,
            chat_template_kwargs=getattr(config, "chat_template_kwargs", None),  # GRPO / RLOO
        )

    response_length = config.response_length
    bound, tight = positions.prompt_bound(
        limits, response_length=response_length, max_prompt_length=config.max_prompt_length
    )
    prepared = prepare(config.max_prompt_length)
    if tight is not None:
        positions.check_fits(
            [len(ids) for ids in prepared["input_ids"]],
            tight,
            response_length=response_length,
            max_prompt_length=config.max_prompt_length,
            overflow=config.prompt_overflow,
            source=source,
        )
        if max(len(ids) for ids in prepared["input_ids"]) > bound:
            prepared = prepare(bound)
    positions.check_other_tokenizers(
        list(prepared["prompt"]),
        [len(ids) for ids in prepared["input_ids"]],
        limits,
        response_length=response_length,
        source=source,
    )
    return prepared


def _prompt_stream_dataset(config: Any, tokenizer: Any, dataset: Any, source: str, limits: Sequence[Any]) -> Any:
    """prompt_dataset for a streaming dataset (prepare.prepare_prompt_dataset on a stream): its prompts cannot be
    measured before training, so the room the tightest model leaves bounds them (prompt_overflow
    applies to longer ones as they are read), and a user's own max_prompt_length that does not fit
    that model is refused now; prompts re-tokenized for a reward model with its own tokenizer are
    checked batch by batch (`check_prompt_batch`)."""
    from posttrain import positions
    from posttrain.data.prepare import prepare_prompt_dataset

    bound, tight = positions.prompt_bound(
        limits, response_length=config.response_length, max_prompt_length=config.max_prompt_length
    )
    if tight is not None and config.max_prompt_length is not None:
        positions.check_fits(
            [config.max_prompt_length],
            tight,
            response_length=config.response_length,
            max_prompt_length=config.max_prompt_length,
            overflow=config.prompt_overflow,
            source=source,
        )
    return prepare_prompt_dataset(
        dataset,
        tokenizer,
        max_prompt_length=bound,
        overflow=config.prompt_overflow,
        source=source,
        chat_template_kwargs=getattr(config, "chat_template_kwargs", None),
    )


def check_prompt_batch(rows: list[dict], limits: Sequence[Any], *, response_length: int, source: str) -> None:
    """A streamed batch of prepared prompts against the reward models that re-tokenize them
    (positions.check_other_tokenizers; a map-style set is checked whole before training)."""
    from posttrain import positions

    if any(lim.tokenizer is not None for lim in limits):
        positions.check_other_tokenizers(
            [r["prompt"] for r in rows],
            [len(r["input_ids"]) for r in rows],
            limits,
            response_length=response_length,
            source=source,
        )


def is_streaming(dataset: Any) -> bool:
    """True for a `datasets.IterableDataset` (load_dataset(..., streaming=True))."""
    import datasets

    return isinstance(dataset, datasets.IterableDataset)


def materialize(dataset: Any) -> Any:
    """A streaming `datasets.IterableDataset` read into a `datasets.Dataset` (its features kept when
    known); any other dataset as it is. For eval sets, which are finite and small."""
    if not is_streaming(dataset):
        return dataset
    import datasets

    rows = list(dataset)
    features = dataset.features if rows and dataset.features is not None else None
    return datasets.Dataset.from_list(rows, features=features)


def eval_dataset_sets(config: Any, tokenizer: Any, dataset: Any, limits: Sequence[Any] = ()) -> Any:
    """An eval set as the online trainers evaluate it: None; one prepared prompt dataset (see
    `prompt_dataset`); or, for a dict / `datasets.DatasetDict` / `datasets.IterableDatasetDict` of
    named sets (transformers.Trainer's `eval_dataset={"name": ...}`), a dict name -> prepared set.
    Streaming sets (`datasets.IterableDataset`) are read into memory first."""
    if dataset is None:
        return None
    if isinstance(dataset, dict):
        if not dataset:
            raise ConfigError("eval_dataset is an empty dict; give at least one named eval set, or None.")
        return {
            str(name): prompt_dataset(
                config, tokenizer, materialize(d), source=f"eval_dataset[{name!r}]", limits=limits
            )
            for name, d in dataset.items()
        }
    return prompt_dataset(config, tokenizer, materialize(dataset), source="eval_dataset", limits=limits)


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
        import torch

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


class StreamedPrompts:
    """PromptStream for a streaming dataset (`datasets.IterableDataset`): batches in the stream's own
    order, which has no length and cannot be indexed.

    Every rank reads the whole stream and keeps its own slice of each global batch, so N processes
    train on exactly the batches one process would. A pass ends when the stream does (its last partial
    global batch is dropped) and the next pass starts it again, after `set_epoch(epoch)` (a stream
    shuffled with `.shuffle(seed, buffer_size)` reshuffles per pass). The position (pass, global batches
    read in it) is checkpointed; a resume reads the stream again and skips the batches already trained
    on, so it continues with the same rows. `check(rows)` (optional) runs on each global batch.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        collate: Callable[[list[dict]], dict],
        rank: int = 0,
        world_size: int = 1,
        check: Callable[[list[dict]], None] | None = None,
        source: str = "train_dataset",
    ) -> None:
        self.dataset, self.batch_size, self.collate, self.check = dataset, batch_size, collate, check
        self.rank, self.world_size, self.source = rank, world_size, source
        self.epoch, self.position = 0, 0
        self._rows: Any = None  # the iterator of the current pass, opened on first use

    def _open(self) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        self._rows = itertools.islice(iter(self.dataset), self.position * self.batch_size * self.world_size, None)

    def __iter__(self) -> StreamedPrompts:
        return self

    def __next__(self) -> dict:
        global_batch = self.batch_size * self.world_size
        for _ in range(2):
            if self._rows is None:
                self._open()
            rows = list(itertools.islice(self._rows, global_batch))
            if len(rows) == global_batch:
                break
            if self.position == 0:
                raise ConfigError(
                    f"{self.source}: the streaming dataset yields {len(rows)} prompts in a pass, fewer than one "
                    f"rollout batch needs ({global_batch} prompts = {self.batch_size} per device × "
                    f"{self.world_size} devices); add prompts or lower per_device_train_batch_size."
                )
            self.epoch, self.position, self._rows = self.epoch + 1, 0, None
        if self.check is not None:
            self.check(rows)
        self.position += 1
        return self.collate(rows[self.rank * self.batch_size : (self.rank + 1) * self.batch_size])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self._rows = int(state["epoch"]), int(state["position"]), None
