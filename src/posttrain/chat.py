"""`posttrain chat <model_dir>`: talk to a trained model in the terminal.

TRL's XPO documentation ends with `transformers chat trl-lib/Qwen2-0.5B-XPO`; this is the same idea with
posttrain's generation engine. Each turn is rendered with the tokenizer's chat template (or the
simple "Role: content" fallback of posttrain.data.formats for tokenizers without one), the whole
history included, and the reply stops at EOS. Input is read from stdin line by line, so a conversation can be piped:

    printf 'Hello!\\nTell me more.\\n/exit\\n' | posttrain chat out/xpo --max_new_tokens 64

Commands: `/reset` clears the history (the system prompt stays), `/exit` quits (so does end of input).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from posttrain.configs import ConfigError, flag

HELP = "Commands: /reset clears the conversation, /exit quits."


@dataclass
class ChatConfig:
    model_name_or_path: str | None = flag(
        "The model to talk to (first positional argument): a folder or hub name.", default=None
    )
    max_new_tokens: int = flag("Maximum tokens per reply.", default=256)
    temperature: float = flag("Sampling temperature; 0 = greedy.", default=0.7)
    system_prompt: str | None = flag("A system message placed before the conversation.", default=None)
    seed: int = flag("Seed for sampling.", default=42)
    torch_dtype: str | None = flag("dtype to load the model in: float32, bfloat16, float16 or auto.", default=None)
    trust_remote_code: bool = flag("Allow model code from the hub.", default=False)

    def __post_init__(self) -> None:
        if not self.model_name_or_path:
            raise ConfigError("no model given: posttrain chat <model_dir> (or --model_name_or_path).")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be >= 1.")
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 (0 = greedy).")


class ChatSession:
    """A conversation with a model: `send(text)` appends the user turn, generates, keeps the reply."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.7,
        system_prompt: str | None = None,
        seed: int = 42,
    ) -> None:
        import torch

        from posttrain.data import ensure_chat_template

        self.model, self.tokenizer = model, ensure_chat_template(tokenizer)
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.system_prompt = system_prompt
        self.generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    def send(self, text: str) -> str:
        from posttrain.evaluate import generate_completions

        self.messages.append({"role": "user", "content": text})
        reply = generate_completions(
            self.model,
            self.tokenizer,
            [list(self.messages)],
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            generator=self.generator,
        )[0].strip()
        self.messages.append({"role": "assistant", "content": reply})
        return reply


def chat_loop(session: ChatSession, name: str, stdin: TextIO, stdout: TextIO) -> None:
    """Read lines until /exit or end of input; answer each non-command line."""
    interactive = stdin.isatty()
    print(f"Chatting with {name}. {HELP}", file=stdout)
    while True:
        if interactive:
            print("<user>: ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line:
            break
        text = line.rstrip("\r\n")
        command = text.strip()
        if not command:
            continue
        if command == "/exit":
            break
        if command == "/reset":
            session.reset()
            print("(conversation cleared)", file=stdout)
            continue
        if command.startswith("/") and " " not in command:
            print(f"unknown command {command!r}. {HELP}", file=stdout)
            continue
        print(f"<{name}>: {session.send(text)}", file=stdout, flush=True)


def main(config: ChatConfig) -> int:
    import torch

    from posttrain.models import load_policy, load_tokenizer

    tokenizer = load_tokenizer(config.model_name_or_path, trust_remote_code=config.trust_remote_code)
    model = load_policy(
        config.model_name_or_path,
        dtype=config.torch_dtype,
        trust_remote_code=config.trust_remote_code,
        tokenizer=tokenizer,
    )
    model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    session = ChatSession(
        model,
        tokenizer,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        system_prompt=config.system_prompt,
        seed=config.seed,
    )
    name = os.path.basename(os.path.normpath(config.model_name_or_path))
    chat_loop(session, name, sys.stdin, sys.stdout)
    return 0
