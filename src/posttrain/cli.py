"""The `posttrain` command.

`posttrain <command> [--field value ...] [--config run.yaml]`: one subcommand per trainer or tool.
Flags are the config dataclass fields, with underscores, exactly as TRL's example scripts write them
(parsed by transformers' HfArgumentParser, so `--help` shows every field with its help and default).
A YAML file given with `--config` sets defaults that command-line flags override. Trainers are
imported only when their command runs, so `posttrain --help` is quick.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from posttrain import __version__


@dataclass(frozen=True)
class Command:
    config: str  # "module:Class" of the config dataclass
    runner: str  # "module:function" taking the parsed config, returning an exit code
    summary: str
    positional: str | None = None  # a field that may be given as the first positional argument


COMMANDS: dict[str, Command] = {
    "sft": Command(
        "posttrain.trainers.sft_config:SFTConfig", "posttrain.trainers.sft:main", "Supervised fine-tuning (step 1)."
    ),
    "reward": Command(
        "posttrain.trainers.reward_config:RewardConfig",
        "posttrain.trainers.reward:main",
        "Train a reward model on preference pairs (step 2).",
    ),
    "ppo": Command(
        "posttrain.trainers.ppo_config:PPOConfig",
        "posttrain.trainers.ppo:main",
        "PPO with a critic (actor, reference, reward, value).",
    ),
    "rloo": Command(
        "posttrain.trainers.rloo_config:RLOOConfig", "posttrain.trainers.rloo:main", "REINFORCE leave-one-out (RLOO)."
    ),
    "grpo": Command(
        "posttrain.trainers.grpo_config:GRPOConfig",
        "posttrain.trainers.grpo:main",
        "GRPO: group-normalized advantages.",
    ),
    "online-dpo": Command(
        "posttrain.trainers.online_dpo_config:OnlineDPOConfig",
        "posttrain.trainers.online_dpo:main",
        "Online DPO with a reward model or judge.",
    ),
    "xpo": Command(
        "posttrain.trainers.xpo_config:XPOConfig",
        "posttrain.trainers.xpo:main",
        "Exploratory Preference Optimization (XPO).",
    ),
    "judge": Command(
        "posttrain.evaluate:JudgeConfig", "posttrain.evaluate:main", "Win-rate evaluation of a model with a judge."
    ),
    "chat": Command(
        "posttrain.chat:ChatConfig",
        "posttrain.chat:main",
        "Talk to a trained model in the terminal.",
        "model_name_or_path",
    ),
    "demo": Command(
        "posttrain.demo.pipeline:DemoConfig",
        "posttrain.demo.pipeline:main",
        "The offline one-command RLHF demo (SFT, RM, RL, report).",
    ),
    "plot": Command(
        "posttrain.plots:PlotConfig",
        "posttrain.plots:main",
        "Redraw the plots of a run from its metrics.jsonl.",
        "output_dir",
    ),
}


def _load(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _command_available(cmd: Command) -> bool:
    module = cmd.config.partition(":")[0]
    return importlib.util.find_spec(module) is not None


def _top_parser() -> argparse.ArgumentParser:
    from posttrain.configs import (  # torch-free
        CONCURRENT_DECODE_ENV,
        CPU_LINEAR_ENV,
        MALLOC_ENV,
        SHARED_PROMPTS_ENV,
        TRACE_DECODE_ENV,
    )

    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="Post-train language models from feedback: SFT, reward models, PPO, RLOO, GRPO, Online DPO, XPO.",
        epilog="Run `posttrain <command> --help` for the flags of a command. "
        "Multi-GPU: `accelerate launch -m posttrain.cli <command> ...`. "
        f"Environment: {CPU_LINEAR_ENV}=auto|onednn|off picks the kernel of the trainers' float32 CPU "
        "linear layers (auto, the default: oneDNN where a timing at the start of train() finds it faster); "
        f"{TRACE_DECODE_ENV}=auto|off: on CPU, decode steps replay a checked torch.jit.trace of the model "
        "(auto, the default: bitwise the same tokens, faster on small models); "
        f"{MALLOC_ENV}=auto|off: on Linux with glibc, training keeps freed memory for reuse instead of "
        "returning it to the kernel (auto, the default, unless MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_, "
        "MALLOC_TOP_PAD_, MALLOC_MMAP_MAX_ or glibc.malloc tunables in GLIBC_TUNABLES set malloc's thresholds); "
        f"{CONCURRENT_DECODE_ENV}=auto|off: on CPU, XPO's policy and reference rollouts run side by side on two "
        "threads (auto, the default); "
        f"{SHARED_PROMPTS_ENV}=auto|off: the completions of one prompt share one forward pass over it where "
        "that costs fewer operations (auto, the default: long prompts, short completions), and the forward "
        "chunks and update micro-batches keep a prompt's completions together; off: one row per completion, "
        "rows in their own order.",
    )
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, cmd in COMMANDS.items():
        sub.add_parser(name, help=cmd.summary, add_help=False)
    return parser


def _closest(flag: str, valid: list[str]) -> str:
    matches = difflib.get_close_matches(flag, valid, n=3, cutoff=0.5)
    return f" Did you mean {', '.join(matches)}?" if matches else ""


def build_parser(name: str, config_cls: type):
    """The HfArgumentParser of one command (also used by tests to check help and round trips)."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(
        config_cls, prog=f"posttrain {name}", description=COMMANDS[name].summary, allow_abbrev=False
    )
    # `--bf16` alone means True for every bool field, the Optional[bool] ones (default None) included,
    # which HfArgumentParser would otherwise make require a value; dict fields read a JSON object.
    for action in parser._actions:
        if getattr(action.type, "__name__", "") == "string_to_bool" and action.nargs is None:
            action.nargs, action.const = "?", True
        if action.type is dict or getattr(action.type, "__origin__", None) is dict:
            action.type = _json_object
    parser.add_argument(
        "--config", default=None, help="YAML file of field: value defaults; command-line flags override it."
    )
    return parser


def _json_object(text: str) -> dict:
    """A dict-valued flag: `--tracker_kwargs '{"wandb": {"entity": "me"}}'`."""
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err}); write it like '{{\"key\": 1}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"key\": 1}'")
    return value


def _refuse(message: str) -> NoReturn:
    """A setting refused while parsing: one line on stderr, exit status 2 (a usage error, as argparse's)."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _attach_negative_numbers(argv: list[str]) -> list[str]:
    """`--learning_rate -1e-3` -> `--learning_rate=-1e-3`: argparse takes "-1e-3" for a flag (its
    negative-number pattern has no exponent), so a negative value given as its own word is attached."""
    out: list[str] = []
    for word in argv:
        previous = out[-1] if out else ""
        if word.startswith("-") and _is_number(word) and previous.startswith("--") and "=" not in previous:
            out[-1] = f"{previous}={word}"
        else:
            out.append(word)
    return out


def parse_config(name: str, argv: list[str]) -> Any:
    """Parse the flags (and optional --config YAML) of command `name` into its config dataclass."""
    cmd = COMMANDS[name]
    config_cls = _load(cmd.config)
    parser = build_parser(name, config_cls)
    valid_flags = sorted({opt for action in parser._actions for opt in action.option_strings if opt.startswith("--")})
    if cmd.positional and argv and not argv[0].startswith("-"):
        argv = [f"--{cmd.positional}", *argv]

    argv = _attach_negative_numbers(argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        from posttrain.configs import DERIVED_SIZES, ConfigError, load_config_file

        try:
            values = load_config_file(known.config)
        except ConfigError as err:
            _refuse(f"posttrain {name}: {err}")
        dests = {action.dest for action in parser._actions}
        # A saved posttrain_config.json (JSON is YAML) also holds the derived sizes; they are
        # recomputed from the other fields, so they are skipped rather than rejected.
        values = {k: v for k, v in values.items() if k not in DERIVED_SIZES}
        for key in values:
            if key not in dests:
                _refuse(
                    f"posttrain {name}: --config {known.config}: unknown field {key!r}."
                    f"{_closest('--' + key, valid_flags)}"
                )
        parser.set_defaults(**values)

    namespace, remaining = parser.parse_known_args(argv)
    if remaining:
        first = next((r for r in remaining if r.startswith("-")), remaining[0])
        flag = first.split("=", 1)[0]
        parser.error(f"unknown argument {first!r}.{_closest(flag, valid_flags)}")
    values = {k: v for k, v in vars(namespace).items() if k != "config"}
    from posttrain.configs import ConfigError

    try:
        return config_cls(**values)
    except ConfigError as err:
        _refuse(f"posttrain {name}: {err}")


# The dataset each of TRL's example scripts loads when the command line names none.
TRL_SCRIPT_DATASETS = {
    "descriptiveness": {
        "--dataset_name": "trl-internal-testing/descriptiveness-sentiment-trl-style",
        "--dataset_train_split": "descriptiveness",
    },
    "tldr": {
        "--dataset_name": "trl-internal-testing/tldr-preference-sft-trl-style",
        "--dataset_test_split": "validation",
    },
}


def run_as(command: str, dataset: str | None = None) -> None:
    """`posttrain <command> <this process's arguments>`, then exit: the body of the scripts under
    examples/scripts, which run TRL's documented commands (`python examples/scripts/rloo/rloo.py ...`).
    `dataset` names the TRL_SCRIPT_DATASETS entry the script's TRL version loads; its flags are added
    when the command line gives none of them and no --config file."""
    argv = sys.argv[1:]
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    flags = TRL_SCRIPT_DATASETS[dataset] if dataset else {}
    extra = [] if given & {"--config", *flags} else [x for item in flags.items() for x in item]
    sys.exit(main([command, *extra, *argv]))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not argv or argv[0] in ("-h", "--help", "--version"):
        if not argv:
            top.print_help()
            return 0
        top.parse_args(argv[:1])
        return 0
    name = argv[0]
    if name not in COMMANDS:
        top.error(f"unknown command {name!r}.{_closest(name, list(COMMANDS))} Commands: {', '.join(COMMANDS)}.")
    cmd = COMMANDS[name]
    if not _command_available(cmd):
        print(f"posttrain {name}: this command is not built yet in posttrain {__version__}.", file=sys.stderr)
        return 2
    config = parse_config(name, argv[1:])
    runner: Callable[[Any], int | None] = _load(cmd.runner)
    try:
        code = int(runner(config) or 0)
        _shutdown_distributed()
        return code
    except KeyboardInterrupt:
        print(f"posttrain {name}: {_interrupted_message(config)}", file=sys.stderr)
        return 130
    except Exception as err:
        if _is_user_error(err):
            print(f"posttrain {name}: {err}", file=sys.stderr)
            frames = getattr(err, "user_frames", None)  # a reward function's own frames, not posttrain's
            if frames:
                print(f"In your code (most recent call last):\n{frames}", file=sys.stderr)
            return 2
        from posttrain.health import OOM_HINT, is_oom

        if is_oom(err):
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            print(f"posttrain {name}: {first}\n{OOM_HINT}", file=sys.stderr)
            return 1
        raise


def _interrupted_message(config: Any) -> str:
    """What a user needs after Ctrl-C: where the run can pick up again."""
    output_dir = getattr(config, "output_dir", None)
    latest = None
    if output_dir and "torch" in sys.modules:
        from posttrain.checkpoint import checkpoint_step, latest_checkpoint

        latest = latest_checkpoint(output_dir)
    if latest is None:
        return "interrupted. No checkpoint was saved yet (--save_steps N saves every N steps); a new run starts over."
    return (
        f"interrupted. Last checkpoint: {latest} (step {checkpoint_step(latest)}); "
        f"continue with the same command plus --resume_from_checkpoint latest."
    )


def _shutdown_distributed() -> None:
    """Tear down a process group the command started (only if torch was loaded at all)."""
    if "torch" in sys.modules:
        from posttrain.distributed import shutdown

        shutdown()


# Errors that describe a mistake in the user's flags, data, model paths or checkpoints: printed as
# one line (the message names the field / file / row and the fix) instead of a traceback.
_USER_ERRORS = (
    ("posttrain.configs", "ConfigError"),
    ("posttrain.data", "DataError"),
    ("posttrain.models", "ModelNotFoundError"),
    ("posttrain.models", "MissingDependencyError"),
    ("posttrain.checkpoint", "CheckpointError"),
    ("posttrain.scoring", "RewardFunctionError"),
)


def _is_user_error(err: BaseException) -> bool:
    for module, name in _USER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(err, cls):
            return True
    return False


if __name__ == "__main__":
    sys.exit(main())
