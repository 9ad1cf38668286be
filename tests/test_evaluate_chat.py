"""`posttrain judge` (win rate with a Wilson interval and failure count) and `posttrain chat` (piped input)."""

from __future__ import annotations

import io
import json
import math
import re
import sys

import pytest

from posttrain.cli import main, parse_config
from posttrain.judges import CallableJudge


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture()
def prompt_file(tmp_path):
    rows = [
        {"prompt": p, "completion": c}
        for p, c in [
            ("Hello world", " hi"),
            ("The quick brown fox", " jumps"),
            ("What is the capital", " Paris"),
            ("Once upon a time", " a robot"),
            ("Write a poem", " the sea"),
            ("Thank you", " welcome"),
        ]
    ]
    rows.append({"prompt": "Good morning", "completion": " hi"})
    return write_jsonl(tmp_path / "prompts.jsonl", rows)


def test_judge_command_against_a_reference_column(tmp_path, prompt_file, tiny_policy_dir, capsys):
    # conversational prompts and references (chat messages): references become their text
    rows = [json.loads(line) for line in open(prompt_file)]
    chat_file = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "completion": [{"role": "assistant", "content": r["completion"]}],
            }
            for r in rows
        ],
    )
    out = tmp_path / "judged.jsonl"
    code = main(
        [
            "judge",
            "--model_name_or_path",
            str(tiny_policy_dir),
            "--judge",
            "random:0",
            "--dataset_name",
            chat_file,
            "--dataset_split",
            "train",
            "--reference_column",
            "completion",
            "--num_examples",
            "7",
            "--max_new_tokens",
            "4",
            "--output_file",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "Model win rate:" in printed and "95% CI" in printed and "judge failures: 0" in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 7 and {r["winner"] for r in rows} <= {"model", "reference"}
    assert rows[0]["reference"] == " hi" and rows[0]["prompt"] == [{"role": "user", "content": "Hello world"}]


def test_win_rate_interval_and_failures_from_files(tmp_path, prompt_file):
    from posttrain.evaluate import evaluate

    # The judge prefers text containing "good"; a NaN score is a judge failure (-1).
    def score(prompt, completion):
        return math.nan if completion == "???" else float("good" in completion)

    model_file = write_jsonl(
        tmp_path / "model.jsonl", [{"completion": c} for c in ["good 1", "good 2", "???", "good 3", "good 4"]]
    )
    ref_file = write_jsonl(tmp_path / "ref.jsonl", [{"completion": "bad"}] * 5)
    config = parse_config(
        "judge",
        [
            "--completions_file",
            model_file,
            "--reference_file",
            ref_file,
            "--dataset_name",
            prompt_file,
            "--dataset_split",
            "train",
            "--num_examples",
            "5",
            "--judge",
            "random",
        ],
    )
    result, rows = evaluate(config, judge=CallableJudge(score, seed=0))
    # 4 wins of 4 valid: Wilson 95% interval with z = 1.96: [ (1 + z²/8 − z·sqrt(z²/64)) / (1 + z²/4), 1 ] = [0.5101, 1]
    assert (result.rate, result.n, result.failures) == (1.0, 4, 1)
    assert result.ci_low == pytest.approx(0.5101, abs=1e-4) and result.ci_high == 1.0
    assert [r["winner"] for r in rows] == ["model", "model", "failure", "model", "model"]


def test_reference_model_and_greedy_generation(tmp_path, prompt_file, tiny_policy_dir):
    from posttrain.evaluate import evaluate

    config = parse_config(
        "judge",
        [
            "--model_name_or_path",
            str(tiny_policy_dir),
            "--reference_model",
            str(tiny_policy_dir),
            "--dataset_name",
            prompt_file,
            "--dataset_split",
            "train",
            "--judge",
            "random:1",
            "--max_new_tokens",
            "5",
            "--batch_size",
            "3",
        ],
    )
    _, rows = evaluate(config)
    # greedy (temperature 0) generation of the same model is deterministic, batch size or not
    assert all(r["completion"] == r["reference"] for r in rows) and len(rows) == 7


def test_judge_config_errors(prompt_file, capsys):
    with pytest.raises(SystemExit) as refused:
        parse_config(
            "judge", ["--model_name_or_path", "m", "--dataset_name", prompt_file, "--reference_column", "completion"]
        )
    assert refused.value.code == 2 and re.search("judge is not set", capsys.readouterr().err)
    with pytest.raises(SystemExit) as refused:
        parse_config(
            "judge",
            [
                "--model_name_or_path",
                "m",
                "--dataset_name",
                prompt_file,
                "--judge",
                "random",
                "--reference_column",
                "completion",
                "--reference_model",
                "m",
            ],
        )
    assert refused.value.code == 2 and re.search("exactly one reference", capsys.readouterr().err)


def test_chat_command_with_piped_input(tiny_policy_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n\n/reset\nHi there\n/nope\n/exit\nnever answered\n"))
    code = main(["chat", str(tiny_policy_dir), "--max_new_tokens", "4", "--temperature", "0"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    name = tiny_policy_dir.name
    assert lines[0].startswith(f"Chatting with {name}.")
    assert sum(line.startswith(f"<{name}>: ") for line in lines) == 2
    assert "(conversation cleared)" in lines and any("unknown command '/nope'" in line for line in lines)


def test_chat_keeps_history_and_system_prompt(tiny_policy, tiny_tokenizer, monkeypatch):
    from posttrain import evaluate
    from posttrain.chat import ChatSession

    seen = []
    monkeypatch.setattr(
        evaluate, "generate_completions", lambda model, tok, prompts, **kw: seen.append(prompts[0]) or ["ok"]
    )
    session = ChatSession(tiny_policy, tiny_tokenizer, system_prompt="Be brief.", temperature=0)
    assert session.send("first") == "ok" and session.send("second") == "ok"
    assert [m["role"] for m in seen[1]] == ["system", "user", "assistant", "user"]
    assert seen[1][1]["content"] == "first" and seen[1][2]["content"] == "ok"
    session.reset()
    assert session.messages == [{"role": "system", "content": "Be brief."}]
