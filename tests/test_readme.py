"""Every `posttrain <command> ...` line in README.md parses: the documented flags exist."""

import re
import shlex
from pathlib import Path

import pytest

from posttrain import cli

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_commands() -> list[list[str]]:
    text = README.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split("#", 1)[0].strip()
            if "posttrain" not in line:
                continue
            words = shlex.split(line.split("|", 1)[-1].strip())
            if "posttrain.cli" in words:  # launcher lines: accelerate launch ... -m posttrain.cli <cmd> ...
                words = ["posttrain", *words[words.index("posttrain.cli") + 1 :]]
            if "posttrain" not in words:  # e.g. PYTHONPATH=. posttrain ... is split as one word before
                continue
            words = words[words.index("posttrain") :]
            if len(words) >= 2 and words[1] in cli.COMMANDS and "..." not in words:
                commands.append(words[1:])
    return commands


def test_readme_has_commands_for_every_trainer():
    names = {c[0] for c in readme_commands()}
    assert {"sft", "reward", "ppo", "rloo", "grpo", "online-dpo", "xpo", "judge", "chat"} <= names


@pytest.mark.parametrize("argv", readme_commands(), ids=lambda a: " ".join(a)[:60])
def test_readme_command_parses(argv):
    config = cli.parse_config(argv[0], argv[1:])
    assert config is not None
