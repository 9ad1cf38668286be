"""`from posttrain.trainer.utils import SIMPLE_CHAT_TEMPLATE`, as TRL's example scripts import it."""

# A chat template for tokenizers that have none: "Role: content" turns separated by a blank line, and
# "Assistant:" as the generation prompt.
SIMPLE_CHAT_TEMPLATE = (
    "{% for message in messages %}{{message['role'].capitalize() + ': ' + message['content'] + '\\n\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

__all__ = ["SIMPLE_CHAT_TEMPLATE"]
