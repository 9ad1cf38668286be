"""The `posttrain` command line: help, version, unknown flags, YAML configs, light imports."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain import __version__, cli
from posttrain.cli import COMMANDS, Command

SEED_RLOO_FLAGS = [
    "--learning_rate",
    "3e-6",
    "--output_dir",
    "models/minimal/rloo",
    "--per_device_train_batch_size",
    "64",
    "--gradient_accumulation_steps",
    "1",
    "--total_episodes",
    "10000",
    "--model_name_or_path",
    "tiny/policy",
    "--reward_model_path",
    "tiny/rm",
    "--missing_eos_penalty",
    "1.0",
]

CALLS: list = []


def fake_runner(config):
    CALLS.append(config)
    return 0


@pytest.fixture
def fake_command(monkeypatch):
    monkeypatch.setitem(
        COMMANDS, "fake", Command("posttrain.configs:OnPolicyConfig", "test_cli:fake_runner", "A test command.")
    )
    CALLS.clear()
    return "fake"


def test_help_lists_every_command():
    out = subprocess.run(
        [sys.executable, "-m", "posttrain", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in ["sft", "reward", "ppo", "rloo", "grpo", "online-dpo", "xpo", "judge", "chat", "demo", "plot"]:
        assert name in out
    flat = " ".join(out.split())  # argparse wraps the epilog
    assert "POSTTRAIN_CPU_LINEAR=auto|onednn|off" in flat and "POSTTRAIN_TRACE_DECODE=auto|off" in flat
    assert "POSTTRAIN_MALLOC=auto|off" in flat and "POSTTRAIN_CONCURRENT_DECODE=auto|off" in flat
    assert "POSTTRAIN_SHARED_PROMPTS=auto|off" in flat


def test_version():
    out = subprocess.run(
        [sys.executable, "-m", "posttrain", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == f"posttrain {__version__}"


def test_no_arguments_prints_help(capsys):
    assert cli.main([]) == 0
    assert "<command>" in capsys.readouterr().out


def test_unknown_command_suggests_the_closest(capsys):
    with pytest.raises(SystemExit):
        cli.main(["rlo"])
    assert "Did you mean rloo" in capsys.readouterr().err


def test_seed_flags_parse_into_the_config(fake_command):
    assert cli.main([fake_command, *SEED_RLOO_FLAGS]) == 0
    (config,) = CALLS
    assert config.learning_rate == 3e-6
    assert config.per_device_train_batch_size == 64
    assert config.total_episodes == 10000
    assert config.reward_model_path == "tiny/rm"
    assert config.missing_eos_penalty == 1.0
    assert config.sft_model_path == "tiny/policy"  # defaults to model_name_or_path


def test_unknown_flag_names_the_closest_valid_flags(fake_command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([fake_command, "--learning_rat", "1e-3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--learning_rat" in err and "--learning_rate" in err


def test_abbreviated_flags_are_not_silently_accepted(fake_command, capsys):
    with pytest.raises(SystemExit):
        cli.main([fake_command, "--learning", "1e-3"])
    assert "--learning_rate" in capsys.readouterr().err


def test_command_help_lists_every_field_with_help_and_default(fake_command):
    from posttrain.configs import OnPolicyConfig, config_fields

    text = cli.build_parser(fake_command, OnPolicyConfig).format_help()
    for f in config_fields(OnPolicyConfig):
        assert f"--{f.name}" in text, f.name
    assert "Maximum new tokens per completion. (default: 53)" in " ".join(text.split())
    # derived sizes are flags as in TRL, documented as derived (a value given is checked, not trusted)
    assert "Derived: rollout batches in the run (if given, checked)." in " ".join(text.split())


def test_yaml_config_with_command_line_override(fake_command, tmp_path: Path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("learning_rate: 1.0e-4\nresponse_length: 16\nreport_to: [tensorboard]\nstop_token: eos\n")
    cli.main([fake_command, "--config", str(cfg), "--response_length", "8", "--total_episodes", "32"])
    (config,) = CALLS
    assert config.learning_rate == 1e-4  # from YAML
    assert config.response_length == 8  # the flag wins over YAML
    assert config.report_to == ["tensorboard"]
    assert config.stop_token == "eos"


def test_yaml_round_trip_of_a_saved_config(fake_command, tmp_path: Path):
    import yaml

    from posttrain.configs import OnPolicyConfig, config_fields

    original = OnPolicyConfig(learning_rate=2e-5, temperature=0.9)
    values = {f.name: getattr(original, f.name) for f in config_fields(OnPolicyConfig)}
    cfg = tmp_path / "saved.yaml"
    cfg.write_text(yaml.safe_dump(values))
    cli.main([fake_command, "--config", str(cfg)])
    (config,) = CALLS
    for name, value in values.items():
        assert getattr(config, name) == value, name


def test_yaml_unknown_key_is_an_error(fake_command, tmp_path: Path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("learning_rat: 1.0\n")
    with pytest.raises(SystemExit) as refused:
        cli.main([fake_command, "--config", str(cfg)])
    assert refused.value.code == 2 and re.search(
        "unknown field 'learning_rat'.*--learning_rate", capsys.readouterr().err
    )


def test_invalid_value_is_reported_before_anything_runs(fake_command, capsys):
    with pytest.raises(SystemExit) as refused:
        cli.main([fake_command, "--stop_token", "eot"])
    assert refused.value.code == 2 and re.search("stop_token", capsys.readouterr().err)
    assert CALLS == []


def test_a_command_whose_module_is_missing_says_so(monkeypatch, capsys):
    monkeypatch.setitem(
        COMMANDS, "later", Command("posttrain.not_built_yet:Config", "posttrain.not_built_yet:run", "x")
    )
    assert cli.main(["later"]) == 2
    assert "not built yet" in capsys.readouterr().err


def test_import_posttrain_stays_light():
    code = (
        "import sys, posttrain, posttrain.cli, posttrain.configs\n"
        "heavy = [m for m in ('torch', 'transformers', 'wandb', 'tensorboard', 'deepspeed', 'peft', 'vllm')"
        " if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_importing_trainers_does_not_pull_optional_trackers():
    code = (
        "import sys, posttrain\n"
        "import posttrain.trainers.online, posttrain.trainers.pairs\n"
        "import posttrain.trainers.rloo, posttrain.trainers.grpo\n"
        "import posttrain.trainers.ppo, posttrain.trainers.ppo_classic\n"
        "import posttrain.trainers.online_dpo, posttrain.trainers.xpo\n"
        "print(','.join(m for m in ('wandb', 'tensorboard', 'deepspeed', 'peft', 'vllm') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_help_lists_all_its_fields(name):
    from posttrain.configs import config_fields

    config_cls = cli._load(COMMANDS[name].config)
    text = cli.build_parser(name, config_cls).format_help()
    missing = [f.name for f in config_fields(config_cls) if f.init and f"--{f.name}" not in text]
    assert missing == []
    assert "--config" in text


def failing_runner(config):
    from posttrain.data import DataError

    raise DataError("has no 'prompt' column", source="prompts.jsonl", field="prompt", fix="rename the column")


def test_user_errors_are_one_line_with_exit_code_2(monkeypatch, capsys):
    monkeypatch.setitem(
        COMMANDS, "failing", Command("posttrain.configs:OnPolicyConfig", "test_cli:failing_runner", "x")
    )
    assert cli.main(["failing"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("posttrain failing: prompts.jsonl") and "Traceback" not in err


def oom_runner(config):
    raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")


def test_out_of_memory_suggests_smaller_batches(monkeypatch, capsys):
    monkeypatch.setitem(COMMANDS, "oom", Command("posttrain.configs:OnPolicyConfig", "test_cli:oom_runner", "x"))
    assert cli.main(["oom"]) == 1
    err = capsys.readouterr().err
    assert "out of memory" in err and "--per_device_train_batch_size" in err and "--gradient_accumulation_steps" in err


def test_example_yaml_config_parses(fake_command):
    example = Path(__file__).resolve().parents[1] / "examples" / "rloo_tldr.yaml"
    config = cli.parse_config("rloo", ["--config", str(example), "--total_episodes", "64"])
    assert (config.num_ppo_epochs, config.num_mini_batches, config.kl_coef, config.stop_token) == (2, 2, 0.03, "eos")
    assert config.total_episodes == 64


def test_a_saved_run_config_can_be_passed_back_with_config(fake_command, tmp_path: Path):
    import json

    from posttrain.configs import OnPolicyConfig

    saved = (
        OnPolicyConfig(learning_rate=2e-5, total_episodes=64, per_device_train_batch_size=8).derive_sizes(1).to_dict()
    )
    path = tmp_path / "posttrain_config.json"
    path.write_text(json.dumps(saved))
    cli.main([fake_command, "--config", str(path), "--learning_rate", "1e-4"])
    (config,) = CALLS
    assert config.learning_rate == 1e-4 and config.total_episodes == 64 and config.per_device_train_batch_size == 8
    assert config.batch_size is None  # derived sizes are recomputed by the trainer, not read back


def test_negative_numbers_parse_as_separate_words(capsys):
    """`--learning_rate -1e-3` is the value -0.001 (then refused by the config's own check), not an unknown flag."""
    from posttrain.cli import parse_config

    config = parse_config("rloo", ["--missing_eos_penalty", "-1.0", "--seed", "-3"])
    assert config.missing_eos_penalty == -1.0 and config.seed == -3
    with pytest.raises(SystemExit) as refused:
        parse_config("sft", ["--learning_rate", "-1e-3"])
    assert refused.value.code == 2 and re.search("learning_rate=-0.001 must be >= 0", capsys.readouterr().err)


@pytest.mark.parametrize("with_checkpoint", [False, True])
def test_ctrl_c_exits_130_with_where_to_resume(tmp_path, monkeypatch, capsys, with_checkpoint):
    import torch  # noqa: F401  (the message looks for checkpoints only once a run has loaded torch)

    from posttrain import cli
    from posttrain.trainers import rloo

    out = tmp_path / "out"
    if with_checkpoint:
        (out / "checkpoint-4").mkdir(parents=True)
        (out / "checkpoint-4" / "checkpoint_complete.json").write_text("{}")

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(rloo, "main", interrupted)
    code = cli.main(["rloo", "--output_dir", str(out), "--model_name_or_path", "m", "--reward_funcs", "a:b"])
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    if with_checkpoint:
        assert f"Last checkpoint: {out / 'checkpoint-4'} (step 4)" in err and "--resume_from_checkpoint latest" in err
    else:
        assert "No checkpoint was saved yet" in err


def nan_reward(prompts, completions, **columns):
    return [float("nan")] * len(completions)


def test_a_reward_function_returning_nan_is_one_line_naming_it(tmp_path, tiny_policy_dir, capsys):
    from posttrain import cli

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "Prompt {i}"}}\n' for i in range(4)))
    argv = ["rloo", "--dataset_name", str(data), "--model_name_or_path", str(tiny_policy_dir)]
    argv += ["--reward_funcs", f"{__name__}:nan_reward", "--output_dir", str(tmp_path / "out")]
    argv += ["--per_device_train_batch_size", "4", "--total_episodes", "4", "--response_length", "3"]
    code = cli.main([*argv, "--report_to", "none"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "reward function 'nan_reward' returned nan at row 1 of 4" in err


def test_trl_example_scripts_add_their_dataset_unless_given(monkeypatch):
    """examples/scripts/rloo/rloo.py is `posttrain rloo` with TRL's script's dataset when the command line
    names none (the docs' getting-started command gives no --dataset_name); a given dataset or a --config wins."""
    import runpy
    from pathlib import Path

    calls = []
    monkeypatch.setattr(cli, "main", lambda argv: calls.append(argv) or 0)
    script = str(Path(__file__).resolve().parents[1] / "examples" / "scripts" / "rloo" / "rloo.py")
    for argv in (["--learning_rate", "3e-6"], ["--dataset_name=prompts.jsonl"], ["--config", "run.yaml"]):
        monkeypatch.setattr(sys, "argv", [script, *argv])
        with pytest.raises(SystemExit) as stop:
            runpy.run_path(script, run_name="__main__")
        assert stop.value.code == 0
    dataset = ["--dataset_name", "trl-internal-testing/descriptiveness-sentiment-trl-style"]
    assert calls[0] == ["rloo", *dataset, "--dataset_train_split", "descriptiveness", "--learning_rate", "3e-6"]
    assert calls[1] == ["rloo", "--dataset_name=prompts.jsonl"]
    assert calls[2] == ["rloo", "--config", "run.yaml"]
