"""TRL's `trl.trainer.grpo_trainer` path: `GRPOConfig` / `GRPOTrainer`, and the batch helpers scripts and
tests import from it: `RepeatSampler` (also under its older name `RepeatRandomSampler`),
`split_tensor_dict` and `shuffle_tensor_dict`."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

__all__ = [
    "GRPOConfig",
    "GRPOTrainer",
    "RepeatRandomSampler",
    "RepeatSampler",
    "shuffle_tensor_dict",
    "split_tensor_dict",
]


class RepeatSampler(Sampler[int]):
    """Indices of `data_source` in batches of `batch_size` distinct indices, each index repeated
    `mini_repeat_count` times in a row and each batch repeated `repeat_count` times in a row:
    the prompts of a GRPO group side by side, and a generation batch reused for several updates.

    The order is a permutation drawn from a generator of this sampler's own (seeded by `seed`) when
    `shuffle`, else 0, 1, 2, ...; a last batch of fewer than `batch_size` indices is dropped. With 7
    items, mini_repeat_count=2, batch_size=3, repeat_count=2 and the permutation 4 3 0 1 2 6 5:
    4 4 3 3 0 0 4 4 3 3 0 0 1 1 2 2 6 6 1 1 2 2 6 6 (5 is dropped).
    """

    def __init__(
        self,
        data_source: Sized,
        mini_repeat_count: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int | None = None,
    ) -> None:
        counts = (("mini_repeat_count", mini_repeat_count), ("batch_size", batch_size), ("repeat_count", repeat_count))
        for name, value in counts:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.data_source = data_source
        self.mini_repeat_count, self.batch_size, self.repeat_count = mini_repeat_count, batch_size, repeat_count
        self.num_samples = len(data_source)
        self.shuffle, self.seed = shuffle, seed
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            indices = torch.randperm(self.num_samples, generator=self.generator).tolist()
        else:
            indices = list(range(self.num_samples))
        whole = self.num_samples // self.batch_size * self.batch_size
        for start in range(0, whole, self.batch_size):
            batch = indices[start : start + self.batch_size]
            for _ in range(self.repeat_count):
                for index in batch:
                    yield from [index] * self.mini_repeat_count

    def __len__(self) -> int:
        return self.num_samples // self.batch_size * self.batch_size * self.mini_repeat_count * self.repeat_count


RepeatRandomSampler = RepeatSampler  # TRL < 0.17's name


def split_tensor_dict(tensor_dict: dict[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    """`num_chunks` dicts, each with every tensor's next slice of rows (rows // num_chunks of them; the
    first dimension must divide evenly); None values stay None in every chunk."""
    first = next((t for t in tensor_dict.values() if t is not None), None)
    if first is None:
        return [dict(tensor_dict) for _ in range(num_chunks)]
    rows = first.shape[0]
    if num_chunks < 1 or rows % num_chunks:
        raise ValueError(f"cannot split {rows} rows into {num_chunks} equal chunks")
    size = rows // num_chunks
    return [
        {key: None if t is None else t[i * size : (i + 1) * size] for key, t in tensor_dict.items()}
        for i in range(num_chunks)
    ]


def shuffle_tensor_dict(tensor_dict: dict[str, Any]) -> dict[str, Any]:
    """The rows of every tensor in one random order (torch's global generator), the same for all of
    them, so row i of each still belongs together; None values stay None."""
    first = next((t for t in tensor_dict.values() if t is not None), None)
    if first is None:
        return dict(tensor_dict)
    permutation = torch.randperm(first.shape[0])
    return {key: None if t is None else t[permutation] for key, t in tensor_dict.items()}
