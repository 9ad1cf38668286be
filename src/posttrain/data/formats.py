"""Dataset formats and chat templates.

Formats (TRL's names, see its "dataset formats" documentation), told apart by `detect_format`:
- "prompt": `prompt` = string, or conversation (list of {"role", "content"}) -> online RL trainers.
- "preference": `chosen` / `rejected` (+ optional explicit `prompt`, optional `margin`) -> reward models.
- "text": `text` (or a custom `dataset_text_field`) -> SFT.
- "messages": a conversation in `messages` -> SFT.
- "prompt_completion": `prompt` + `completion` -> SFT (loss on the completion by default).
- "tokenized": already tokenized prompts in `input_ids` (what TRL's PPO takes).

`render_chat` renders one conversation with the tokenizer's template (or the simple "Role: content"
fallback); TRL's example-level `apply_chat_template` is in `helpers.py`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from posttrain.data.loading import DataError, _source_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# TRL's SIMPLE_CHAT_TEMPLATE, for tokenizers without a template (base models): "Role: content"
# blocks and an "Assistant:" generation prompt.
SIMPLE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'].capitalize() + ': ' + message['content'] + '\n\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

FORMATS = ("prompt", "preference", "text", "messages", "prompt_completion", "tokenized")


def _is_message_list(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and isinstance(value[0], dict) and "role" in value[0]


def detect_format(dataset: Any, dataset_text_field: str = "text") -> str:
    """The dataset's format, from its columns: one of `FORMATS` (see the module docstring)."""
    from datasets import DatasetDict

    if isinstance(dataset, DatasetDict):
        raise DataError(
            f"got a DatasetDict with splits {list(dataset.keys())}, not one split",
            source=_source_of(next(iter(dataset.values()), None), None),
            fix="select a split, e.g. split='train'",
        )
    columns = set(dataset.column_names)
    if {"chosen", "rejected"} <= columns or {"chosen_input_ids", "rejected_input_ids"} <= columns:
        return "preference"
    if "messages" in columns:
        return "messages"
    if {"prompt", "completion"} <= columns:
        return "prompt_completion"
    if "prompt" in columns:
        return "prompt"
    if dataset_text_field in columns:
        return "text"
    if "input_ids" in columns:
        return "tokenized"
    raise DataError(
        f"cannot tell the format from the columns {sorted(columns)}",
        source=_source_of(dataset, None),
        fix=f"provide 'prompt'; 'chosen'+'rejected'; '{dataset_text_field}'; 'messages'; "
        "'prompt'+'completion'; or 'input_ids'",
    )


def ensure_chat_template(tokenizer: PreTrainedTokenizerBase, template: str | None = None) -> PreTrainedTokenizerBase:
    """Set `template` (or `SIMPLE_CHAT_TEMPLATE` when the tokenizer has none) as the chat template."""
    if template is not None:
        tokenizer.chat_template = template
    elif getattr(tokenizer, "chat_template", None) is None:
        logger.info("tokenizer has no chat template; using the simple 'Role: content' template")
        tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    return tokenizer


def render_chat(
    messages: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    add_generation_prompt: bool = False,
    **template_kwargs: Any,
) -> str:
    """Render a conversation to text with the tokenizer's template (fallback template if none)."""
    ensure_chat_template(tokenizer)
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )


def _assistant_spans(
    messages: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    full_text: str,
    source: str,
    row: int,
    field: str,
    start_turn: int = 0,
) -> list[tuple[int, int]]:
    """Character spans of the assistant turns (index >= start_turn) in the rendered conversation.

    Renders the conversation prefix by prefix: assistant turn i spans from the end of
    render(messages[:i], generation prompt) to the end of render(messages[:i+1]). This works for any
    template whose renderings of prefixes are prefixes of the full rendering (no `{% generation %}`
    markers needed).
    """
    spans = []
    for i, message in enumerate(messages):
        if i < start_turn or message["role"] != "assistant":
            continue
        upto = render_chat(messages[: i + 1], tokenizer)
        if not full_text.startswith(upto):
            raise DataError(
                f"the chat template renders the conversation up to message {i} differently from the whole "
                "conversation, so assistant tokens cannot be located",
                source=source,
                row=row,
                field=field,
                fix="use a chat template whose rendering of a prefix is a prefix of the full rendering "
                "(templates that rewrite earlier turns, e.g. by dropping reasoning, are not)",
            )
        start = render_chat(messages[:i], tokenizer, add_generation_prompt=True) if i else ""
        if not upto.startswith(start):
            start = render_chat(messages[:i], tokenizer) if i else ""
        spans.append((len(start), len(upto)))
    return spans
