"""Collators: dataset rows in, padded tensor batches out.

- `PromptCollator`: prompts left-padded for generation (online RL trainers).
- `SFTCollator`: right-padded `input_ids` / `labels`, with per-sequence `position_ids` for packed
  rows and padding-free batches.
- `PreferenceCollator`: chosen rows then rejected rows in one right-padded batch (reward models).

Attention masks always come from the rows' lengths, never from `ids == pad`, because the pad token
may be the EOS that ends every sequence (DESIGN.md, principle 4). torch is imported here, so
`posttrain.data` loads this module only when a collator is asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from posttrain.data.prepare import IGNORE_INDEX
from posttrain.ops import lengths_to_mask


def pad_right(
    sequences: Sequence[Sequence[int]], pad_value: int, pad_to_multiple_of: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad int sequences into a (B, T) tensor; returns (padded, lengths (B,)).

    Masks are built from the lengths (ops.lengths_to_mask), never from `ids == pad`, because the
    pad token may be the EOS token that ends every sequence (see the module docstring).
    """
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    width = max(int(lengths.max()), 1) if len(sequences) else 1
    if pad_to_multiple_of:
        width = math.ceil(width / pad_to_multiple_of) * pad_to_multiple_of
    out = torch.full((len(sequences), width), pad_value, dtype=torch.long)
    for row, seq in enumerate(sequences):
        out[row, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
    return out, lengths


class PromptCollator:
    """Collates prompt rows into a left-padded batch for generation.

    `attention_mask` comes from each row's length, never from `ids == pad`, so pad == eos is safe.
    Non-tensor columns (`prompt` and any extra column) are returned as lists, in row order.
    """

    def __init__(self, pad_token_id: int):
        if pad_token_id is None:
            raise ValueError("PromptCollator needs a pad_token_id; see models.ensure_pad_token")
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        lengths = [len(row["input_ids"]) for row in rows]
        width = max(lengths)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, (row, n) in enumerate(zip(rows, lengths)):
            input_ids[i, width - n :] = torch.as_tensor(row["input_ids"], dtype=torch.long)
            attention_mask[i, width - n :] = True
        batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        for key in rows[0]:
            if key not in batch:
                batch[key] = [row[key] for row in rows]
        return batch


def _labels_of(row: dict) -> list[int]:
    """Labels of a prepared row, or of a pre-tokenized one (skip_prepare_dataset): `labels`, else
    input_ids masked by `completion_mask` / `assistant_masks` when present, else every token."""
    if "labels" in row:
        return row["labels"]
    ids = row["input_ids"]
    for key in ("completion_mask", "assistant_masks"):
        if key in row and row[key] is not None:
            return [t if m else IGNORE_INDEX for t, m in zip(ids, row[key])]
    return list(ids)


def _positions_of(row: dict) -> list[int]:
    """Per-token positions restarting at 0 for every sequence of a row: `position_ids` of a
    BFD-packed row, else built from its `seq_lengths`, else one sequence 0..n-1."""
    if row.get("position_ids") is not None:
        return list(row["position_ids"])
    if row.get("seq_lengths") is not None:
        return [p for n in row["seq_lengths"] for p in range(n)]
    return list(range(len(row["input_ids"])))


class SFTCollator:
    """Right-pads `input_ids` and `labels`; the attention mask comes from the lengths.

    Rows holding several sequences (BFD packing: `position_ids` / `seq_lengths`) and every
    batch with `padding_free` also get `position_ids` (B, T) restarting at 0 for each sequence,
    from which the forward builds attention that stays inside each sequence. `padding_free`
    concatenates the micro-batch into a single row (B = 1; TRL's padding-free), so no pad token is
    computed at all (unless pad_to_multiple_of asks for some). Padding positions count 0, 1, ...
    as a sequence of their own, so they never join the last real sequence.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None, padding_free: bool = False) -> None:
        self.pad_token_id, self.pad_to_multiple_of, self.padding_free = pad_token_id, pad_to_multiple_of, padding_free

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        ids = [list(e["input_ids"]) for e in examples]
        labels = [list(_labels_of(e)) for e in examples]
        multi = self.padding_free or any(
            e.get("position_ids") is not None or e.get("seq_lengths") is not None for e in examples
        )
        if not multi:
            input_ids, lengths = pad_right(ids, self.pad_token_id, self.pad_to_multiple_of)
            padded_labels, _ = pad_right(labels, IGNORE_INDEX, self.pad_to_multiple_of)
            return {
                "input_ids": input_ids,  # (B, T)
                "attention_mask": lengths_to_mask(lengths, input_ids.size(1)).long(),  # (B, T)
                "labels": padded_labels,  # (B, T), −100 on untrained and padded positions
            }
        positions = [_positions_of(e) for e in examples]
        if self.padding_free:
            ids, labels, positions = ([[t for row in part for t in row]] for part in (ids, labels, positions))
        input_ids, lengths = pad_right(ids, self.pad_token_id, self.pad_to_multiple_of)
        padded_labels, _ = pad_right(labels, IGNORE_INDEX, self.pad_to_multiple_of)
        width = input_ids.size(1)
        position_ids = torch.arange(width).repeat(len(ids), 1)  # padding: a sequence of its own
        for row, (pos, n) in enumerate(zip(positions, lengths.tolist())):
            position_ids[row, :n] = torch.as_tensor(pos, dtype=torch.long)
            position_ids[row, n:] -= n
        # The first token of a sequence is predicted by nothing of its own sequence: without this
        # it would be the target of the previous sequence's last token (labels are shifted in the loss).
        padded_labels[position_ids == 0] = IGNORE_INDEX
        return {
            "input_ids": input_ids,  # (B, T); B = 1 with padding_free
            "attention_mask": lengths_to_mask(lengths, width).long(),  # (B, T), real tokens (counts only)
            "labels": padded_labels,  # (B, T)
            "position_ids": position_ids,  # (B, T), 0 at the start of every sequence
        }


class PreferenceCollator:
    """Chosen rows then rejected rows in one right-padded (2B, T) batch, plus lengths and margins."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad_token_id, self.pad_to_multiple_of = pad_token_id, pad_to_multiple_of

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        sequences = [e["chosen_input_ids"] for e in examples] + [e["rejected_input_ids"] for e in examples]
        input_ids, lengths = pad_right(sequences, self.pad_token_id, self.pad_to_multiple_of)
        batch = {
            "input_ids": input_ids,  # (2B, T)
            "attention_mask": lengths_to_mask(lengths, input_ids.size(1)).long(),  # (2B, T)
            "lengths": lengths,  # (2B,)
        }
        if "margin" in examples[0]:
            batch["margin"] = torch.tensor([float(e["margin"]) for e in examples])  # (B,)
        return batch
