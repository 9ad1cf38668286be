"""TRL's public data helpers, with TRL's signatures and results, so data code written for TRL ports
by changing the import:

    from posttrain import maybe_apply_chat_template
    dataset = dataset.map(maybe_apply_chat_template, fn_kwargs={"tokenizer": tokenizer})

Row helpers (for `Dataset.map`): `is_conversational`, `is_conversational_from_value`, `apply_chat_template`,
`maybe_apply_chat_template`, `extract_prompt`, `maybe_extract_prompt`, `maybe_convert_to_chatml`.
Dataset helpers: `unpair_preference_dataset`, `maybe_unpair_preference_dataset`, `pack_dataset`,
`truncate_dataset`; `pack_examples` is TRL's deprecated batch-level wrapped packing.

Where TRL fails obscurely, these raise one clear error instead (docs/internals.md, "data/"): a
row mixing plain-text and conversational fields, or holding something else in them, raises
`DataError` naming the keys (TRL answers True or False depending on the order of a set); a row
with unsupported keys raises `DataError` (a ValueError) listing the accepted key sets, where TRL
raises `KeyError`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from posttrain.data.formats import _is_message_list
from posttrain.data.loading import DataError
from posttrain.data.packing import PACKING_STRATEGIES, pack_bfd_table, pack_wrapped_table

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "apply_chat_template",
    "extract_prompt",
    "is_conversational",
    "is_conversational_from_value",
    "maybe_apply_chat_template",
    "maybe_convert_to_chatml",
    "maybe_extract_prompt",
    "maybe_unpair_preference_dataset",
    "pack_dataset",
    "pack_examples",
    "truncate_dataset",
    "unpair_preference_dataset",
]

_MESSAGE_KEYS = ("prompt", "chosen", "rejected", "completion", "messages")
# The example layouts apply_chat_template accepts (TRL's dataset types), by their keys.
_LAYOUTS = (
    ("messages",),  # language modeling
    ("prompt",),  # prompt-only
    ("prompt", "completion"),  # prompt-completion
    ("prompt", "chosen", "rejected"),  # preference
    ("chosen", "rejected"),  # preference with implicit prompt
    ("prompt", "completion", "label"),  # unpaired preference
)


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


def is_conversational(example: dict[str, Any]) -> bool:
    """True when the example's prompt / chosen / rejected / completion / messages fields are
    conversations (lists of {"role", "content"} messages), False when they are strings (or the
    example has none of them, e.g. a tokenized row).

    Empty or missing (None) fields count as neither. A row mixing strings and conversations, or
    holding anything else in those fields, raises `DataError` naming its keys.
    """
    kinds = {}
    for key in _MESSAGE_KEYS:
        value = example.get(key)
        if value is None or (isinstance(value, list) and not value):
            continue
        if isinstance(value, str):
            kinds[key] = "string"
        elif _is_message_list(value):
            kinds[key] = "conversation"
        else:
            kinds[key] = type(value).__name__
    if set(kinds.values()) <= {"string"}:
        return False
    if set(kinds.values()) == {"conversation"}:
        return True
    found = ", ".join(f"{key} ({kind})" for key, kind in kinds.items())
    raise DataError(
        f"the row is neither standard nor conversational: its fields are {found}; expected "
        f"{', '.join(_MESSAGE_KEYS)} to be all strings (standard) or all lists of "
        '{"role", "content"} messages (conversational)',
        fix='convert the fields to one kind, e.g. wrap a string prompt as [{"role": "user", "content": prompt}]',
    )


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list, tools: Any, kwargs: dict[str, Any], **options: Any
) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **options, **kwargs)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


def apply_chat_template(
    example: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    tools: list[dict | Callable] | None = None,
    **template_kwargs: Any,
) -> dict[str, Any]:
    """Render a conversational example to text with the tokenizer's chat template (TRL's function).

    Accepted keys (other keys are ignored and left out of the result): "messages"; "prompt";
    "prompt" + "completion"; "prompt" + "chosen" + "rejected"; "chosen" + "rejected"; "prompt" +
    "completion" + "label". "messages" becomes "text". A prompt ending with a user or tool turn
    gets the generation prompt; one ending with an assistant turn is continued
    (`continue_final_message`). chosen / rejected / completion are rendered after the prompt and
    returned without it: the prompt is the longest common prefix of its own rendering and every
    rendering of prompt + answer (templates such as DeepSeek-R1's render the generation prompt
    differently from an answered turn). `tools` (JSON schemas or functions) and `template_kwargs`,
    plus the example's own "chat_template_kwargs", reach the template.
    """
    tools = tools or None  # Llama's template renders tool boilerplate for tools=[]
    keys = frozenset(key for key in example if key in (*_MESSAGE_KEYS, "label"))
    if keys not in {frozenset(layout) for layout in _LAYOUTS}:
        accepted = "; ".join(" + ".join(layout) for layout in _LAYOUTS)
        raise DataError(
            f"apply_chat_template got a row with the keys {sorted(keys)}; it accepts {accepted}",
            fix="rename the columns to one of these layouts",
        )
    if not is_conversational(example):
        raise DataError(
            f"apply_chat_template got a standard (plain-text) row with the keys {sorted(keys)}",
            fix="use maybe_apply_chat_template, which leaves plain-text rows as they are",
        )
    kwargs = {**(example.get("chat_template_kwargs") or {}), **template_kwargs}
    output: dict[str, Any] = {}
    if "messages" in example:
        output["text"] = _render(tokenizer, example["messages"], tools, kwargs)
    if "prompt" not in example:  # implicit prompt: each answer is the whole conversation
        for key in ("chosen", "rejected"):
            if key in example:
                output[key] = _render(tokenizer, example[key], tools, kwargs)
        return output
    last_role = example["prompt"][-1]["role"]
    if last_role not in ("user", "tool", "assistant"):
        raise DataError(
            f"the prompt ends with a {last_role!r} message; expected 'user' or 'tool' (answered by the "
            "completion) or 'assistant' (continued by it)",
            field="prompt",
        )
    prompt = _render(
        tokenizer,
        example["prompt"],
        tools,
        kwargs,
        add_generation_prompt=last_role != "assistant",
        continue_final_message=last_role == "assistant",
    )
    answers = {
        key: _render(tokenizer, example["prompt"] + example[key], tools, kwargs)
        for key in ("chosen", "rejected", "completion")
        if key in example
    }
    for full in answers.values():
        prompt = _common_prefix(prompt, full)
    output["prompt"] = prompt
    for key, full in answers.items():
        output[key] = full[len(prompt) :]
    if "label" in example:
        output["label"] = example["label"]
    return output


def maybe_apply_chat_template(
    example: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    tools: list[dict | Callable] | None = None,
    **template_kwargs: Any,
) -> dict[str, Any]:
    """`apply_chat_template` for a conversational example; a standard example is returned as is."""
    if is_conversational(example):
        return apply_chat_template(example, tokenizer, tools, **template_kwargs)
    return example


def extract_prompt(example: dict[str, Sequence]) -> dict[str, Sequence]:
    """Split the prompt shared by "chosen" and "rejected" off both (TRL's function).

    The prompt is their longest common prefix, in characters for strings and in messages for
    conversations; a space just before the point where they differ stays with the answers. As in
    TRL, when one answer is a prefix of the other, the last shared element goes to the answers.
    """
    chosen, rejected = example["chosen"], example["rejected"]
    shortest = min(len(chosen), len(rejected))
    if shortest == 0:
        raise DataError("extract_prompt needs non-empty 'chosen' and 'rejected'", field="chosen")
    idx = shortest - 1
    for k in range(shortest):
        if chosen[k] != rejected[k]:
            # TRL reads chosen[k - 1] here, which for k == 0 is the last character: guarded on purpose.
            idx = k - 1 if k > 0 and chosen[k - 1] == " " else k
            break
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def maybe_extract_prompt(example: dict[str, Any]) -> dict[str, Any]:
    """`extract_prompt` for a preference example whose prompt is implicit.

    Examples that are not preference pairs, or already hold a prompt of the same kind (both
    strings or both conversations) as their answers, are returned as they are; a prompt of the
    other kind (a dataset may store the question as text next to full conversations) is replaced.
    """
    if "chosen" not in example or "rejected" not in example:
        return example
    if "prompt" in example:
        chosen_conversational = is_conversational({"chosen": example["chosen"]})
        prompt_conversational = is_conversational({"prompt": example["prompt"]})
        if chosen_conversational == prompt_conversational:
            return example
    return extract_prompt({"chosen": example["chosen"], "rejected": example["rejected"]})


def is_conversational_from_value(example: dict[str, Any]) -> bool:
    """True when the example holds a ShareGPT-style "conversations" list of {"from", "value"} messages
    (what `maybe_convert_to_chatml` converts), False otherwise."""
    conversation = example.get("conversations")
    return (
        isinstance(conversation, list)
        and bool(conversation)
        and all(isinstance(m, dict) and "from" in m and "value" in m for m in conversation)
    )


def maybe_convert_to_chatml(example: dict[str, Any]) -> dict[str, Any]:
    """ShareGPT-style messages ({"from", "value"}) to ChatML ({"role", "content"}), in place; a
    "conversations" column becomes "messages". Other examples are returned unchanged."""
    for key in ("prompt", "completion", "chosen", "rejected", "messages", "conversations"):
        if isinstance(example.get(key), list):
            for message in example[key]:
                if isinstance(message, dict):
                    if "from" in message:
                        message["role"] = message.pop("from")
                    if "value" in message:
                        message["content"] = message.pop("value")
    if "conversations" in example:
        example["messages"] = example.pop("conversations")
    return example


# --------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------


def _column_names(dataset: Any) -> list[str]:
    from datasets import DatasetDict

    if isinstance(dataset, DatasetDict):
        return next(iter(dataset.values())).column_names
    return dataset.column_names


def _unpair_rows(batch: dict[str, list]) -> dict[str, list]:
    """A batch of pairs -> its chosen rows (label True), then its rejected rows (label False)."""
    n = len(batch["chosen"])
    out = {"completion": batch["chosen"] + batch["rejected"], "label": [True] * n + [False] * n}
    if "prompt" in batch:
        out = {"prompt": batch["prompt"] + batch["prompt"], **out}
    for key, values in batch.items():
        if key not in ("prompt", "chosen", "rejected"):
            out[key] = values + values
    return out


def unpair_preference_dataset(dataset: Any, num_proc: int | None = None, desc: str | None = None) -> Any:
    """Preference pairs -> unpaired rows: "prompt" (when present), "completion" and "label" (True for
    chosen, False for rejected); other columns are copied to both rows. Within each map batch of
    1000 pairs the chosen rows come first, then the rejected ones, as in TRL."""
    return dataset.map(_unpair_rows, batched=True, remove_columns=_column_names(dataset), num_proc=num_proc, desc=desc)


def maybe_unpair_preference_dataset(dataset: Any, num_proc: int | None = None, desc: str | None = None) -> Any:
    """`unpair_preference_dataset` when the dataset has "chosen" and "rejected", else the dataset as is."""
    columns = _column_names(dataset)
    if "chosen" in columns and "rejected" in columns:
        return unpair_preference_dataset(dataset, num_proc=num_proc, desc=desc)
    return dataset


def _dataset_format(dataset: Any) -> dict[str, Any]:
    """The arguments of `with_format` that restore the dataset's current format (a streaming dataset:
    its format type)."""
    from datasets import DatasetDict, IterableDataset, IterableDatasetDict

    if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
        dataset = next(iter(dataset.values()))
    if isinstance(dataset, IterableDataset):
        formatting = getattr(dataset, "_formatting", None)
        return {"type": getattr(formatting, "format_type", None)}
    fmt = dict(dataset.format)
    fmt.update(fmt.pop("format_kwargs", None) or {})
    return fmt


def pack_dataset(dataset: Any, seq_length: int, strategy: str = "bfd", map_kwargs: dict[str, Any] | None = None) -> Any:
    """Pack the rows of a tokenized dataset into rows of at most `seq_length` tokens (TRL's function).

    Every column must hold lists of one length per row (`input_ids`, `attention_mask`, ...); each map
    batch (1000 rows unless `map_kwargs` says otherwise) is packed on its own. A streaming
    (`IterableDataset`) dataset is packed as it is read.
    - "bfd": best-fit decreasing; rows longer than `seq_length` keep their first `seq_length`
      tokens; empty rows are dropped. A `seq_lengths` column lists the lengths of the sequences in
      each packed row (from which a collator builds position ids that restart per sequence).
    - "bfd_split": like "bfd", but long rows are split into `seq_length` pieces, so no token is lost.
    - "ffd": TRL 0.19's strategy: first-fit decreasing, rows longer than `seq_length` truncated, and
      a `position_ids` column (positions restarting at 0 for every sequence) instead of `seq_lengths`.
    - "wrapped": all tokens concatenated and cut every `seq_length` tokens; no `seq_lengths`.
    The dataset's format (e.g. "torch") is kept.
    """
    strategies = (*PACKING_STRATEGIES, "ffd")
    if strategy not in strategies:
        raise ValueError(f"Invalid packing strategy {strategy!r}; must be one of {strategies}")
    if seq_length < 1:
        raise ValueError(f"seq_length must be at least 1, got {seq_length}")
    fmt = _dataset_format(dataset)
    if strategy == "wrapped":
        function, fn_kwargs = pack_wrapped_table, {"capacity": seq_length}
    elif strategy == "ffd":
        function = pack_bfd_table
        fn_kwargs = {"capacity": seq_length, "first_fit": True, "position_ids": True, "seq_lengths": False}
        if fmt.get("columns") is not None:
            fmt["columns"] = [*fmt["columns"], "position_ids"]
    else:
        split = strategy == "bfd_split"
        function, fn_kwargs = pack_bfd_table, {"capacity": seq_length, "split": split, "fifo_ties": True}
        if fmt.get("columns") is not None:
            fmt["columns"] = [*fmt["columns"], "seq_lengths"]
    packed = dataset.with_format("arrow").map(function, batched=True, fn_kwargs=fn_kwargs, **(map_kwargs or {}))
    return packed.with_format(**fmt)


def pack_examples(examples: dict[str, list[list]], seq_length: int) -> dict[str, list[list]]:
    """Deprecated in TRL (use `pack_dataset`): a batch's lists, per column, concatenated and cut
    every `seq_length` items ("wrapped" packing of one batch), e.g. for `dataset.map(batched=True)`."""
    warnings.warn(
        "pack_examples is deprecated (as in TRL); use pack_dataset(dataset, seq_length, strategy='wrapped')",
        DeprecationWarning,
        stacklevel=2,
    )
    out = {}
    for key, rows in examples.items():
        flat = [x for row in rows for x in row]
        out[key] = [flat[i : i + seq_length] for i in range(0, len(flat), seq_length)]
    return out


def _truncate_table(table: Any, max_length: int) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = []
    for name in table.column_names:
        column = table[name]
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            column = pc.list_slice(column, 0, max_length)
        columns.append(column)
    return pa.Table.from_arrays(columns, names=table.column_names)


def truncate_dataset(dataset: Any, max_length: int, map_kwargs: dict[str, Any] | None = None) -> Any:
    """Keep the first `max_length` items of every list column (TRL's function); other columns and
    the dataset's format are kept."""
    fmt = _dataset_format(dataset)
    truncated = dataset.with_format("arrow").map(
        _truncate_table, batched=True, fn_kwargs={"max_length": max_length}, **(map_kwargs or {})
    )
    return truncated.with_format(**fmt)
