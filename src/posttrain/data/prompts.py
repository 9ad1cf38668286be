"""Prompts for online training: the prepared prompt dataset and the resumable stream of batches.

- `prompt_dataset`: `prepare_prompt_dataset` with the run's settings (max_prompt_length,
  prompt_overflow), naming the dataset (`source`) in every error.
- `PromptStream`: an endless stream of prompt batches, reshuffled each epoch from (seed, epoch),
  whose position is checkpointed for an exact resume; under data parallelism each rank takes its
  own slice of every global batch.
- `eval_dataset_sets`: an eval set, or a dict of named ones, prepared (streaming sets read into
  memory first, `materialize`).

torch is imported on first use, so `import posttrain.data` stays light.
"""

from __future__ import annotations

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
