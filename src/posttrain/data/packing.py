"""Packing: several tokenized examples per row of at most `capacity` tokens.

- "bfd" / "bfd_split": whole examples placed by best-fit decreasing (`best_fit_decreasing`); an
  overlong example is truncated to `capacity` ("bfd") or cut into `capacity`-token pieces, each
  piece its own sequence ("bfd_split"). Packed rows get `seq_lengths` (and, for SFT, `position_ids`
  restarting at 0 for every sequence), from which the collator keeps sequences from attending to
  each other. "Fewer Truncations Improve Language Modeling" (Ding et al. 2024) is the method.
- "wrapped": the rows of a map batch are concatenated and cut into `capacity`-token blocks, the
  classic pre-training packing; attention crosses example boundaries within a block.

Both work on pyarrow tables (one `datasets.map` batch in "arrow" format): tokens move as numpy
gathers, never one Python object per token. They pack every column, which must all be lists with
the same length per row (`input_ids`, `labels`, `attention_mask`, ...).
"""

from __future__ import annotations

import bisect
import heapq
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")

# Rows packed together per map batch: large enough that best-fit decreasing fills nearly every
# row, small enough that the flattened token arrays of one batch stay a few hundred MB.
_BFD_BATCH_ROWS = 20_000


def best_fit_decreasing(lengths: Sequence[int], capacity: int, *, fifo_ties: bool = False) -> list[list[int]]:
    """Group item indices into bins holding at most `capacity` (e.g. tokens), best-fit decreasing.

    Items go longest first (equal lengths keep their order), each into the open bin whose free
    space is the smallest that still fits it, else into a new bin; bins are returned in creation
    order, each listing its items in placement order. Among bins with the same free space the
    oldest bin wins, or with `fifo_ties` the bin that reached that free space first (the rule of
    TRL's `pack_dataset`, whose results `helpers.pack_dataset` reproduces).

    Open bins are bucketed by free space and the distinct free-space values kept in a sorted list
    of at most `capacity` entries, so each placement is a bisect plus a short-list insert: 100k
    items take a fraction of a second, where scanning the bins would be quadratic.
    """
    import numpy as np

    sizes = np.asarray(lengths, dtype=np.int64)
    if sizes.size and int(sizes.max()) > capacity:
        raise ValueError(f"an item of length {int(sizes.max())} exceeds the bin capacity {capacity}")
    order = np.argsort(-sizes, kind="stable").tolist()
    sizes_list = sizes.tolist()
    bins: list[list[int]] = []
    free_values: list[int] = []  # sorted distinct free spaces of bins that still have room
    bins_with_free: dict[int, Any] = {}  # free space -> bin numbers (a heap, or a deque with fifo_ties)
    take = deque.popleft if fifo_ties else heapq.heappop
    put = deque.append if fifo_ties else heapq.heappush
    for item in order:
        size = sizes_list[item]
        k = bisect.bisect_left(free_values, size)
        if k < len(free_values):
            free = free_values[k]
            bucket = bins_with_free[free]
            b = take(bucket)
            if not bucket:
                del bins_with_free[free]
                del free_values[k]
        else:
            b, free = len(bins), capacity
            bins.append([])
        bins[b].append(item)
        left = free - size
        if left > 0:
            bucket = bins_with_free.get(left)
            if bucket is None:
                bucket = bins_with_free[left] = deque() if fifo_ties else []
                bisect.insort(free_values, left)
            put(bucket, b)
    return bins


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group item indices into bins holding at most `capacity`, first-fit decreasing (TRL 0.19's "ffd").

    Items go longest first (equal lengths keep their order), each into the first bin, in creation
    order, that still has room for it, else into a new bin; bins are returned in creation order, each
    listing its items in placement order. A max-tree over the bins' free space finds that bin in
    log time, where scanning the bins would be quadratic.
    """
    import numpy as np

    sizes = np.asarray(lengths, dtype=np.int64)
    if sizes.size and int(sizes.max()) > capacity:
        raise ValueError(f"an item of length {int(sizes.max())} exceeds the bin capacity {capacity}")
    order = np.argsort(-sizes, kind="stable").tolist()
    sizes_list = sizes.tolist()
    leaves = 1 << max(0, len(order) - 1).bit_length()
    tree = [0] * (2 * leaves)  # leaf leaves + b: free space of bin b (0 until it opens); above: max of children
    bins: list[list[int]] = []
    for item in order:
        size = sizes_list[item]
        if tree[1] >= size:
            node = 1
            while node < leaves:
                node = 2 * node if tree[2 * node] >= size else 2 * node + 1
            b = node - leaves
        else:
            b = len(bins)
            bins.append([])
            tree[leaves + b] = capacity
        bins[b].append(item)
        node = leaves + b
        tree[node] -= size
        while node > 1:
            node //= 2
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
    return bins


def _list_columns(table: Any) -> list[Any]:
    """The table's columns as single arrays, checked to be lists with equal lengths per row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = [table[name].combine_chunks() for name in table.column_names]
    if not columns:
        raise ValueError("packing needs at least one column of token lists")
    for name, column in zip(table.column_names, columns):
        if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
            raise TypeError(f"packing needs every column to hold lists; column {name!r} holds {column.type}")
    first = pc.list_value_length(columns[0])
    for name, column in zip(table.column_names[1:], columns[1:]):
        if not pc.list_value_length(column).equals(first):
            raise ValueError(
                f"column {name!r} has rows of other lengths than {table.column_names[0]!r}; "
                "packing needs every column to have one value per token"
            )
    return columns


def _with_offsets(column: Any, offsets: Any, values: Any) -> Any:
    import numpy as np

    return type(column).from_arrays(np.asarray(offsets).astype(column.offsets.type.to_pandas_dtype()), values)


def pack_bfd_table(
    table: Any,
    capacity: int,
    *,
    split: bool = False,
    position_ids: bool = False,
    fifo_ties: bool = False,
    first_fit: bool = False,
    seq_lengths: bool = True,
) -> Any:
    """One map batch (a pyarrow Table of list columns) -> best-fit-decreasing packed rows.

    Empty rows are dropped. Overlong rows keep their first `capacity` tokens, or with `split`
    become ceil(n / capacity) pieces of `capacity` tokens (the last shorter), each its own sequence.
    Every column is packed the same way; `seq_lengths` (the lengths of the sequences of each packed
    row) is appended unless `seq_lengths` is False, and with `position_ids` also per-token positions
    restarting at 0 for every sequence. `fifo_ties`: see `best_fit_decreasing`. `first_fit`: bins by
    `first_fit_decreasing` instead (TRL 0.19's "ffd").
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = _list_columns(table)
    lengths = pc.list_value_length(columns[0]).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = np.cumsum(lengths) - lengths  # first flat token of each row
    rows = np.flatnonzero(lengths > 0)
    if split:
        counts = -(-lengths[rows] // capacity)
        row = np.repeat(rows, counts)
        k = np.arange(row.size) - np.repeat(np.cumsum(counts) - counts, counts)  # piece number within its row
        piece_start = starts[row] + k * capacity
        piece_len = np.minimum(capacity, lengths[row] - k * capacity)
    else:
        piece_start, piece_len = starts[rows], np.minimum(lengths[rows], capacity)
    if first_fit:
        bins = first_fit_decreasing(piece_len, capacity)
    else:
        bins = best_fit_decreasing(piece_len, capacity, fifo_ties=fifo_ties)
    order = np.fromiter((p for b in bins for p in b), dtype=np.int64, count=piece_len.size)
    seq_len = piece_len[order]
    seq_first = np.cumsum(seq_len) - seq_len  # first token of each sequence in the packed stream
    within = np.arange(int(seq_len.sum())) - np.repeat(seq_first, seq_len)
    take = pa.array(np.repeat(piece_start[order], seq_len) + within)
    pieces_per_bin = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    piece_offsets = np.concatenate([[0], np.cumsum(pieces_per_bin)])
    token_offsets = np.concatenate([[0], np.cumsum(seq_len)])[piece_offsets]

    out = {
        name: _with_offsets(column, token_offsets, column.flatten().take(take))
        for name, column in zip(table.column_names, columns)
    }
    if position_ids:
        out["position_ids"] = pa.ListArray.from_arrays(
            pa.array(token_offsets, type=pa.int32()), pa.array(within, type=pa.int32())
        )
    if seq_lengths:
        out["seq_lengths"] = pa.ListArray.from_arrays(
            pa.array(piece_offsets, type=pa.int32()), pa.array(seq_len, type=pa.int32())
        )
    return pa.table(out)


def pack_wrapped_table(table: Any, capacity: int) -> Any:
    """One map batch (a pyarrow Table of list columns) -> its tokens concatenated and cut into
    rows of `capacity` tokens (the last row of the batch shorter)."""
    import numpy as np
    import pyarrow as pa

    columns = _list_columns(table)
    values = [column.flatten() for column in columns]
    n = len(values[0])
    offsets = np.concatenate([np.arange(0, n, capacity), [n]])
    return pa.table(
        {name: _with_offsets(column, offsets, flat) for name, column, flat in zip(table.column_names, columns, values)}
    )


def pack_sft_rows(dataset: Any, max_length: int, strategy: str) -> Any:
    """Pack prepared SFT rows (`input_ids`, `labels`) as `prepare_sft_dataset` documents."""
    if strategy == "wrapped":
        packed = dataset.with_format("arrow").map(
            pack_wrapped_table, fn_kwargs={"capacity": max_length}, batched=True, batch_size=1000, desc="Packing"
        )
        return packed.with_format(None)
    n_rows = len(dataset)
    packed = (
        dataset.with_format("arrow")
        .map(
            pack_bfd_table,
            fn_kwargs={"capacity": max_length, "split": strategy == "bfd_split", "position_ids": True},
            batched=True,
            batch_size=_BFD_BATCH_ROWS,
            remove_columns=dataset.column_names,
            desc="Packing (BFD)",
        )
        .with_format(None)
    )
    logger.info("packed %d rows into %d rows of at most %d tokens (%s)", n_rows, len(packed), max_length, strategy)
    return packed
