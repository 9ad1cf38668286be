"""Bad inputs and faults a user meets: one clear error each, through the Python API and the command line.

Each command-line case runs `python -m posttrain ...` as a user types it and checks the exit code
(2: a mistake the user can fix), that no traceback is printed, and that the message names the
culprit (file, row, field, model path). docs/errors.md lists every case with its message and fix.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from helpers import train_argv, write_jsonl
from posttrain import checkpoint as ckpt
from posttrain.configs import ConfigError, load_config_file
from posttrain.data import DataError, load_any_dataset
from posttrain.data.prepare import prepare_preference_dataset, prepare_prompt_dataset, prepare_sft_dataset
from posttrain.models import ModelLoadError, ModelNotFoundError, load_policy, load_reward_model, load_value_model


def posttrain(*args: str | os.PathLike, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run the command line as a user does; offline (the test environment's HF_*_OFFLINE are inherited)."""
    return subprocess.run(
        [sys.executable, "-m", "posttrain", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def assert_user_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit code 2, no traceback, and every needle in stderr; returns stderr."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr[-3000:])
    return result.stderr


# --------------------------------------------------------------------------------------------
# A causal LM given where a reward / value model is expected
# --------------------------------------------------------------------------------------------


def test_reward_model_without_a_trained_head_is_said_loudly(tiny_policy_dir, tiny_reward_model_dir, tiny_tokenizer):
    # The policy folder holds LlamaForCausalLM weights: no `score.weight`, so the head is random. TRL's
    # getting-started commands use a causal LM as a dummy reward model: a warning, not a refusal.
    with pytest.warns(UserWarning) as caught:
        dummy = load_reward_model(tiny_policy_dir, tokenizer=tiny_tokenizer)
    (message,) = [str(w.message) for w in caught if "score head" in str(w.message)]
    assert message.startswith(f"reward model '{tiny_policy_dir}' has no trained score head: score.weight")
    assert "saved as LlamaForCausalLM" in message and "posttrain reward" in message
    assert dummy.score.weight.shape == (1, dummy.config.hidden_size)

    with pytest.raises(ModelLoadError, match=r"^value model .* has no trained score head.*allow_new_head=True") as info:
        load_value_model(tiny_policy_dir, tokenizer=tiny_tokenizer)
    # It is a user error the command line prints in one line (a ModelNotFoundError subclass).
    assert isinstance(info.value, ModelNotFoundError)

    # The explicit opt-in gives the fresh head (a critic initialised from the policy) ...
    critic = load_value_model(tiny_policy_dir, tokenizer=tiny_tokenizer, allow_new_head=True)
    assert critic.score.weight.shape == (1, critic.config.hidden_size)
    # ... and a real reward model needs no opt-in (the usual PPO critic initialisation too).
    assert load_reward_model(tiny_reward_model_dir, tokenizer=tiny_tokenizer).config.num_labels == 1
    assert load_value_model(tiny_reward_model_dir, tokenizer=tiny_tokenizer).config.num_labels == 1


def test_cli_rloo_with_a_causal_lm_as_reward_model_runs_with_a_warning(tmp_path, tiny_policy_dir):
    """TRL's RLOO getting-started command as its docs write it, `python examples/scripts/rloo/rloo.py`
    with a causal LM as dummy reward model (`--reward_model_path EleutherAI/pythia-14m`), run from the
    repository root; local paths, fewer episodes."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Hello"}, {"prompt": "The quick"}])
    out = tmp_path / "models" / "minimal" / "rloo"
    flags = {
        "--dataset_name": prompts,
        "--learning_rate": "3e-6",
        "--output_dir": out,
        "--per_device_train_batch_size": "4",
        "--gradient_accumulation_steps": "1",
        "--total_episodes": "4",
        "--model_name_or_path": tiny_policy_dir,
        "--reward_model_path": tiny_policy_dir,
        "--missing_eos_penalty": "1.0",
        "--response_length": "4",
        "--report_to": "none",
    }
    result = subprocess.run(
        [sys.executable, "examples/scripts/rloo/rloo.py", *[str(x) for kv in flags.items() for x in kv]],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"reward model '{tiny_policy_dir}' has no trained score head" in result.stderr
    assert "posttrain reward" in result.stderr and (out / "model.safetensors").is_file()


# --------------------------------------------------------------------------------------------
# Truncated or corrupt weight files
# --------------------------------------------------------------------------------------------


def _copy_model(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def test_truncated_safetensors_names_the_file(tmp_path, tiny_policy_dir, tiny_reward_model_dir, tiny_tokenizer):
    policy = _copy_model(tiny_policy_dir, tmp_path / "policy")
    _truncate(policy / "model.safetensors")
    with pytest.raises(ModelLoadError) as info:
        load_policy(policy)
    assert str(info.value).startswith(f"model '{policy}': {policy / 'model.safetensors'} is truncated or corrupt (")
    assert str(info.value).endswith("; re-save or re-download it.")

    rm = _copy_model(tiny_reward_model_dir, tmp_path / "rm")
    (rm / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match=r"^reward model .*rm/model\.safetensors is truncated or corrupt"):
        load_reward_model(rm, tokenizer=tiny_tokenizer)


def test_truncated_pytorch_bin_names_the_file(tmp_path, tiny_policy_dir):
    # A pickle-format checkpoint (pytorch_model.bin, a zip archive) cut short by an interrupted copy.
    from safetensors.torch import load_file

    folder = _copy_model(tiny_policy_dir, tmp_path / "bin_policy")
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    assert load_policy(folder).config.hidden_size == 32  # the intact .bin loads
    _truncate(folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"bin_policy/pytorch_model\.bin is truncated or corrupt \("):
        load_policy(folder)


def test_cli_sft_with_a_truncated_model(tmp_path, tiny_policy_dir):
    policy = _copy_model(tiny_policy_dir, tmp_path / "policy")
    _truncate(policy / "model.safetensors")
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": "Hello world"}, {"text": "Good morning"}])
    result = posttrain(
        *train_argv("sft", policy, data, tmp_path / "out"),
        "--max_steps",
        "1",
        "--report_to",
        "none",
    )
    assert_user_error(result, f"{policy / 'model.safetensors'} is truncated or corrupt", "re-download")


# --------------------------------------------------------------------------------------------
# Data: unknown chat roles, tied preference pairs, 1-based row numbers
# --------------------------------------------------------------------------------------------


def test_unknown_chat_role_is_refused_naming_row_and_role(tok):
    ok = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    wizard = [{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "Abracadabra"}]
    with pytest.raises(DataError) as info:
        prepare_prompt_dataset(Dataset.from_list([{"prompt": ok}, {"prompt": wizard}]), tok)
    assert str(info.value).startswith(
        "dataset, row 2, field 'prompt': message 2 has the unknown role 'wizard'; "
        "accepted roles: system, developer, user, assistant, tool, ipython"
    )
    assert (info.value.row, info.value.index) == (2, 1)

    # ShareGPT speaker names get the renaming as the fix.
    sharegpt = [{"role": "human", "content": "Hi"}, {"role": "gpt", "content": "Hello"}]
    with pytest.raises(
        DataError, match=r"row 1, field 'messages': message 1 has the unknown role 'human'.*human -> user"
    ):
        prepare_sft_dataset(Dataset.from_list([{"messages": sharegpt}]), tok, max_length=None)

    # Every accepted role passes (tool and developer included).
    roles = ["system", "developer", "user", "assistant", "tool", "ipython"]
    conversation = [{"role": r, "content": f"{r} says hi"} for r in roles] + [{"role": "user", "content": "?"}]
    assert len(prepare_prompt_dataset(Dataset.from_list([{"prompt": conversation}]), tok)) == 1


def test_cli_sft_with_an_unknown_role(tmp_path, tiny_policy_dir):
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "Poof"}]},
    ]
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    result = posttrain(
        *train_argv("sft", tiny_policy_dir, data, tmp_path / "out"),
        "--max_steps",
        "1",
        "--report_to",
        "none",
    )
    assert_user_error(result, "chats.jsonl", "row 3, field 'messages': message 2 has the unknown role 'wizard'")


def test_tied_preference_pairs_are_dropped_with_a_count(tok, caplog):
    pairs = [
        {"chosen": "The answer is four.", "rejected": "The answer is five."},
        {"chosen": "Same text.", "rejected": "Same text."},
        {"chosen": "Good morning.", "rejected": "Bad morning."},
    ]
    with caplog.at_level("WARNING"):
        out = prepare_preference_dataset(Dataset.from_list(pairs), tok, max_length=None)
    assert "1 of 3 preference pairs have chosen == rejected (ties) and were dropped" in caplog.text
    # The two real pairs stay, in order.
    assert len(out) == 2
    assert out[0]["chosen_input_ids"] != out[0]["rejected_input_ids"]
    assert tok.decode(out[1]["chosen_input_ids"]).startswith("Good morning.")

    # Conversations that render identically are ties too.
    answer = [{"role": "assistant", "content": "Yes."}]
    conv = [{"prompt": [{"role": "user", "content": "Ok?"}], "chosen": answer, "rejected": answer}] * 2
    with pytest.raises(DataError, match=r"^dataset, field 'rejected': every pair \(2\) has chosen == rejected"):
        prepare_preference_dataset(Dataset.from_list(conv), tok, max_length=None)


def test_cli_reward_with_only_tied_pairs(tmp_path, tiny_reward_model_dir):
    data = write_jsonl(tmp_path / "pairs.jsonl", [{"chosen": f"text {i}", "rejected": f"text {i}"} for i in range(4)])
    result = posttrain(
        *train_argv("reward", tiny_reward_model_dir, data, tmp_path / "out"),
        "--max_steps",
        "1",
        "--report_to",
        "none",
    )
    assert_user_error(result, "pairs.jsonl", "every pair (4) has chosen == rejected")


def test_row_numbers_are_one_based_like_line_numbers(tmp_path, tok):
    # The third record is bad both ways: line 3 of a JSON-lines file, row 3 of a JSON list.
    records = [{"prompt": "a"}, {"prompt": "b"}, {"prompt": ["c"]}]
    with pytest.raises(DataError, match=r"p\.jsonl, line 3, field 'prompt': is a list here but a string at line 1"):
        load_any_dataset(write_jsonl(tmp_path / "p.jsonl", records))
    as_list = tmp_path / "p.json"
    as_list.write_text(json.dumps(records), encoding="utf-8")
    with pytest.raises(DataError, match=r"p\.json, row 3, field 'prompt': is a list here but a string at row 1"):
        load_any_dataset(as_list)
    # Once loaded, the same record is "row 3" in every check.
    loaded = load_any_dataset(write_jsonl(tmp_path / "q.jsonl", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": " "}]))
    with pytest.raises(DataError, match=r"q\.jsonl, row 3, field 'prompt': is empty"):
        prepare_prompt_dataset(loaded, tok)


# --------------------------------------------------------------------------------------------
# --config files
# --------------------------------------------------------------------------------------------


def test_config_file_errors_name_file_line_and_column(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("learning_rate: 3.0e-6\noutput_dir: out: rloo\n", encoding="utf-8")
    # The second ':' of line 2 is its 16th character ("output_dir" 10, ": " 12, "out" 15), 1-based as editors count.
    with pytest.raises(ConfigError, match=rf"^--config {bad}, line 2, column 16: YAML syntax error: mapping values"):
        load_config_file(bad)

    unclosed = tmp_path / "unclosed.yaml"
    unclosed.write_text("report_to: [wandb\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"line 2, column 1: .*flow sequence started at line 1, column 12"):
        load_config_file(unclosed)

    listing = tmp_path / "list.yaml"
    listing.write_text("- learning_rate\n- 3e-6\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"list\.yaml must hold a mapping of field: value, not a list"):
        load_config_file(listing)
    with pytest.raises(ConfigError, match=r"missing\.yaml: no such file"):
        load_config_file(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"is a directory"):
        load_config_file(tmp_path)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("run_name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.yaml: not UTF-8 text \(byte 13\)"):
        load_config_file(latin1)

    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n", encoding="utf-8")
    assert load_config_file(empty) == {}
    good = tmp_path / "good.yaml"
    good.write_text("learning_rate: 3.0e-6\nreport_to: [none]\n", encoding="utf-8")
    assert load_config_file(good) == {"learning_rate": 3.0e-6, "report_to": ["none"]}


# --------------------------------------------------------------------------------------------
# output_dir: a file, under a file, read-only
# --------------------------------------------------------------------------------------------


def test_output_dir_that_is_a_file_or_not_writable(tmp_path, monkeypatch):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine", encoding="utf-8")
    is_a_file = rf"^output_dir='{a_file}' is a file; pass the path of a folder"
    with pytest.raises(ConfigError, match=is_a_file):
        ckpt.check_output_dir_writable(a_file)
    # has_output is the trainers' check before any model loads; the guard wraps the run itself.
    with pytest.raises(ConfigError, match=is_a_file):
        ckpt.has_output(a_file)
    with pytest.raises(ConfigError, match=is_a_file):
        with ckpt.OutputDirGuard(a_file):
            pass
    assert a_file.read_text(encoding="utf-8") == "mine"

    with pytest.raises(ConfigError, match=rf"cannot be created: '{a_file}' is a file, not a folder"):
        ckpt.check_output_dir_writable(a_file / "run")

    # A new folder is checked in its nearest existing parent, and nothing is left behind.
    ckpt.check_output_dir_writable(tmp_path / "new" / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]

    # A folder that refuses writes (read-only mount, permissions): the error says so.
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(ckpt.tempfile, "mkdtemp", refuse)
    with pytest.raises(ConfigError, match=rf"^output_dir='{tmp_path}' is not writable \(Permission denied\)"):
        ckpt.check_output_dir_writable(tmp_path)
    with pytest.raises(ConfigError, match=rf"output_dir='{tmp_path / 'x'}' cannot be created in '{tmp_path}'"):
        ckpt.check_output_dir_writable(tmp_path / "x")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes through permission bits")
def test_read_only_output_dir_with_real_permissions(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match="is not writable"):
            ckpt.check_output_dir_writable(locked)
    finally:
        locked.chmod(0o755)


def test_cli_output_dir_is_a_file_fails_before_any_model_loads(tmp_path):
    a_file = tmp_path / "out"
    a_file.write_text("not a folder", encoding="utf-8")
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": "Hello"}])
    # The model path does not exist: the output_dir error must come first, before loading is tried.
    result = posttrain(
        *train_argv("sft", tmp_path / "no_model_here", data, a_file),
        "--report_to",
        "none",
    )
    stderr = assert_user_error(result, f"output_dir='{a_file}' is a file")
    assert "no_model_here" not in stderr


# --------------------------------------------------------------------------------------------
# A full disk while saving a checkpoint
# --------------------------------------------------------------------------------------------


def _tiny_lm(seed: int):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    return transformers.LlamaForCausalLM(config)


def _disk_full_after(monkeypatch, calls_ok: int) -> None:
    """Make torch.save write half a file and fail with ENOSPC from call number `calls_ok + 1` on."""
    real_save = torch.save
    count = {"n": 0}

    def save(obj, f, *args, **kwargs):
        count["n"] += 1
        if count["n"] <= calls_ok:
            return real_save(obj, f, *args, **kwargs)
        if hasattr(f, "write"):  # torch.distributed.checkpoint saves into open streams
            f.write(b"\0" * 16)
        else:
            Path(f).write_bytes(b"\0" * 16)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", save)


def test_full_disk_during_checkpoint_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = _tiny_lm(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = ckpt.save_checkpoint(tmp_path, 1, models={"policy": model}, optimizer=optimizer)
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    _disk_full_after(monkeypatch, calls_ok=0)  # the optimizer state is the first torch.save
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.save_checkpoint(tmp_path, 2, models={"policy": model}, optimizer=optimizer, save_total_limit=1)
    message = str(info.value)
    assert message.startswith(
        f"no space left on device (or disk quota exceeded) while saving checkpoint-2 in {tmp_path}"
    )
    assert f"the previous checkpoint {first} is intact (resume with --resume_from_checkpoint latest)" in message
    assert "--save_total_limit" in message
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    monkeypatch.undo()

    # No temp dir and no checkpoint-2 remain; checkpoint-1 (not rotated away) is the newest and loads.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]
    assert ckpt.latest_checkpoint(tmp_path) == first
    fresh = _tiny_lm(5)
    ckpt.load_checkpoint(first, models={"policy": fresh}, optimizer=torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_full_disk_on_the_first_save_and_the_final_model(tmp_path, monkeypatch):
    _disk_full_after(monkeypatch, calls_ok=0)
    with pytest.raises(ckpt.CheckpointError, match=r"while saving checkpoint-3 .*no earlier checkpoint exists"):
        ckpt.save_checkpoint(tmp_path, 3, models={"policy": _tiny_lm(0)}, optimizer=None, trainer_state={"x": 1})
    assert list(tmp_path.iterdir()) == []

    # save_final writes weights with safetensors (not torch.save): fail the config write instead.
    monkeypatch.undo()

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "_write_json", no_space)
    with pytest.raises(ckpt.CheckpointError, match=r"while saving the final model in .*free space"):
        ckpt.save_final(tmp_path / "final", _tiny_lm(0), config={"learning_rate": 1.0})
    assert [p.name for p in (tmp_path / "final").iterdir()] == []

    # Any other write error is not a disk problem and keeps its own type.
    def broken(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ckpt, "_write_json", broken)
    with pytest.raises(OSError, match="Input/output error") as info:
        ckpt.save_final(tmp_path / "final", _tiny_lm(0), config={"learning_rate": 1.0})
    assert not isinstance(info.value, ckpt.CheckpointError)


def test_cli_sft_disk_full_at_the_second_checkpoint(tmp_path, tiny_policy_dir, monkeypatch, capsys):
    # The whole command in-process (so the disk can be made to fill up): SFT saving every step, the
    # second checkpoint hits ENOSPC half-way through writing the optimizer state.
    from posttrain.cli import main

    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if ".tmp-checkpoint-2-" in str(f):
            Path(f).write_bytes(b"\0" * 16)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": "Hello world"}, {"text": "Good morning"}] * 2)
    out = tmp_path / "out"
    code = main(
        [
            *train_argv("sft", tiny_policy_dir, data, out),
            "--max_steps",
            "3",
            "--save_steps",
            "1",
            "--per_device_train_batch_size",
            "2",
            "--report_to",
            "none",
        ]
    )
    stderr = capsys.readouterr().err
    assert code == 2, stderr[-2000:]
    assert "Traceback" not in stderr
    assert (
        f"posttrain sft: no space left on device (or disk quota exceeded) while saving checkpoint-2 in {out}" in stderr
    )
    assert f"the previous checkpoint {out / 'checkpoint-1'} is intact" in stderr
    # checkpoint-1 is complete and is what "latest" resumes from; no temp dir is left.
    assert ckpt.latest_checkpoint(out) == out / "checkpoint-1"
    assert not [p.name for p in out.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize(
    "message",
    [
        "Error while serializing: I/O error: No space left on device (os error 28)",  # safetensors 0.6+
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })',
    ],
)
def test_full_disk_reported_by_the_safetensors_writer(tmp_path, monkeypatch, message):
    # The weights are the biggest files of a checkpoint, so a disk usually fills up while safetensors
    # writes them; its writer names the OS error only in its text (both spellings it has used).
    import safetensors.torch
    from safetensors import SafetensorError

    def no_space(*args, **kwargs):
        raise SafetensorError(message)

    monkeypatch.setattr(safetensors.torch, "save_file", no_space)
    with pytest.raises(ckpt.CheckpointError, match=r"^no space left on device .* while saving checkpoint-1 in"):
        ckpt.save_checkpoint(tmp_path, 1, models={"head": torch.nn.Linear(2, 1)})
    assert list(tmp_path.iterdir()) == []


def test_torch_save_failure_on_a_nearly_full_disk(tmp_path, monkeypatch):
    # torch.save's zip writer fails with a RuntimeError that names no cause: with almost no free
    # space left, the disk is named as the cause; with plenty, the error is a bug and stays as it is.
    import shutil

    def zip_writer_fails(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", zip_writer_fails)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage._replace(free=4096))
    with pytest.raises(ckpt.CheckpointError, match=r"^no space left on device .* while saving checkpoint-1"):
        ckpt.save_checkpoint(tmp_path, 1, models={"head": torch.nn.Linear(2, 1)})
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage._replace(free=10 * 2**30))
    with pytest.raises(RuntimeError, match="unexpected pos") as info:
        ckpt.save_checkpoint(tmp_path, 1, models={"head": torch.nn.Linear(2, 1)})
    assert not isinstance(info.value, ckpt.CheckpointError)
    assert list(tmp_path.iterdir()) == []
