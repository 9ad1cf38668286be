"""docs/errors.md is true: every command-line case in its table runs here, through `posttrain.cli.main`
as a user types it, and gives the documented exit code and message with no traceback.

Cases run in-process (one Python start for all) on tiny models and small files. A case whose
message changes must change in docs/errors.md too: `test_every_case_is_documented` checks that
each case's id and message fragment appear in the table.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from posttrain.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"

# Files the cases read, by name. {…} in a case's arguments: a file here, or policy / rm / out / tmp.
_CHAT_OK = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
FILES: dict[str, str | bytes] = {
    "prompts.jsonl": '{"prompt": "Hello"}\n{"prompt": "The quick"}\n',
    "text.jsonl": '{"text": "Hello world"}\n{"text": "Good morning"}\n',
    "notes.txt": "plain text\n",
    "malformed.jsonl": '{"prompt": "a"}\n{"prompt": "b",}\n',
    "latin1.jsonl": b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n',
    "not_object.jsonl": '{"prompt": "a"}\n["prompt"]\n',
    "mixed_types.jsonl": '{"prompt": "a"}\n{"prompt": ["b"]}\n',
    "empty.jsonl": "\n\n",
    "empty_list.json": "[]",
    "header_only.csv": "prompt\n",
    "question.jsonl": '{"question": "a"}\n',
    "empty_prompt.jsonl": '{"prompt": "a"}\n{"prompt": "  "}\n',
    "int_prompt.jsonl": '{"prompt": 3}\n',
    "no_role.jsonl": json.dumps({"prompt": [{"content": "Hi"}]}) + "\n",
    "int_content.jsonl": json.dumps({"prompt": [{"role": "user", "content": 5}]}) + "\n",
    "wizard.jsonl": "".join(
        json.dumps({"messages": m}) + "\n" for m in (_CHAT_OK, [{"role": "wizard", "content": "Poof"}])
    ),
    "sharegpt.jsonl": json.dumps({"messages": [{"role": "human", "content": "Hi"}]}) + "\n",
    "empty_conversation.jsonl": json.dumps({"prompt": [], "x": 1}) + "\n",
    "big_ids.jsonl": '{"input_ids": [1, 2]}\n{"input_ids": [1, 999999]}\n',
    "float_ids.jsonl": '{"input_ids": [1.5]}\n',
    "ties.jsonl": "".join(json.dumps({"chosen": f"text {i}", "rejected": f"text {i}"}) + "\n" for i in range(3)),
    "empty_chosen.jsonl": '{"chosen": "a", "rejected": "b"}\n{"chosen": "", "rejected": "b"}\n',
    "bad_margin.jsonl": '{"chosen": "a", "rejected": "b", "margin": "high"}\n',
    "mixed_pair.jsonl": json.dumps({"prompt": "Q", "chosen": _CHAT_OK[1:], "rejected": _CHAT_OK[1:]}) + "\n",
    "pairs.jsonl": '{"chosen": "The answer is four.", "rejected": "The answer is five."}\n',
    "prompt_and_query.jsonl": '{"prompt": "Q", "query": "Q", "chosen": " yes", "rejected": " no"}\n',
    "no_columns.jsonl": '{"foo": "a"}\n',
    "messages_string.jsonl": '{"messages": "Hi there"}\n',
    "no_assistant.jsonl": json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n",
    "mixed_pc.jsonl": json.dumps({"prompt": "Hi", "completion": _CHAT_OK[1:]}) + "\n",
    "run_list.yaml": "- learning_rate\n- 3e-6\n",
    "run_unknown.yaml": "learning_rat: 3e-6\n",
    "run_syntax.yaml": "learning_rate: 3e-6\nper_device: train: 4\n",
}

SFT = ["sft", "--model_name_or_path", "{policy}", "--output_dir", "{out}", "--max_steps", "1", "--report_to", "none"]
REWARD = ["reward", "--model_name_or_path", "{rm}", "--output_dir", "{out}", "--max_steps", "1", "--report_to", "none"]
RLOO = [
    "rloo",
    "--model_name_or_path",
    "{policy}",
    "--reward_model_path",
    "{rm}",
    "--output_dir",
    "{out}",
    "--total_episodes",
    "4",
    "--per_device_train_batch_size",
    "2",
    "--response_length",
    "4",
    "--report_to",
    "none",
]

# (id, arguments, exit code, message fragment). Exit 2 for every mistake a user can fix: a setting
# refused while parsing, argparse usage errors, and every error raised once the command runs (data,
# models, output_dir, checkpoints).
CASES: list[tuple[str, list[str], int, str]] = [
    # -- command line and --config ----------------------------------------------------------------
    ("unknown-command", ["rlo"], 2, "unknown command 'rlo'. Did you mean rloo"),
    ("unknown-flag", ["sft", "--learning_rat", "1e-5"], 2, "unknown argument '--learning_rat'. Did you mean"),
    ("bad-number", ["sft", "--learning_rate", "fast"], 2, "invalid float value: 'fast'"),
    ("config-missing", ["sft", "--config", "{tmp}/nope.yaml"], 2, "nope.yaml: no such file."),
    (
        "config-not-mapping",
        ["sft", "--config", "{run_list.yaml}"],
        2,
        "must hold a mapping of field: value, not a list",
    ),
    ("config-unknown-field", ["sft", "--config", "{run_unknown.yaml}"], 2, "unknown field 'learning_rat'."),
    (
        "config-syntax",
        ["sft", "--config", "{run_syntax.yaml}"],
        2,
        "run_syntax.yaml, line 2, column 18: YAML syntax error",
    ),
    # -- shared training fields -------------------------------------------------------------------
    ("negative-lr", [*SFT, "--learning_rate=-1e-3"], 2, "learning_rate=-0.001 must be >= 0."),
    ("batch-size-0", [*SFT, "--per_device_train_batch_size", "0"], 2, "per_device_train_batch_size=0 must be >= 1."),
    ("eval-batch-0", [*SFT, "--per_device_eval_batch_size", "0"], 2, "per_device_eval_batch_size=0 must be >= 1."),
    ("grad-accum-0", [*SFT, "--gradient_accumulation_steps", "0"], 2, "gradient_accumulation_steps=0 must be >= 1."),
    ("warmup-ratio", [*SFT, "--warmup_ratio", "1.5"], 2, "warmup_ratio=1.5 must be within [0, 1]."),
    ("logging-steps-0", [*SFT, "--logging_steps", "0"], 2, "logging_steps=0 must be >= 1."),
    ("save-steps-negative", [*SFT, "--save_steps=-1"], 2, "save_steps=-1 must be >= 0."),
    ("bf16-and-fp16", [*SFT, "--bf16", "--fp16"], 2, "bf16 and fp16 are both set; choose one mixed-precision mode."),
    ("report-to", [*SFT, "--report_to", "mlflow"], 2, "report_to has unknown sink(s) ['mlflow']"),
    ("lora-r-0", [*SFT, "--use_peft", "--lora_r", "0"], 2, "lora_r=0 must be >= 1."),
    ("lora-dropout", [*SFT, "--use_peft", "--lora_dropout", "1.0"], 2, "lora_dropout=1.0 must be within [0, 1)."),
    ("save-total-limit-0", [*SFT, "--save_total_limit", "0"], 2, "save_total_limit=0 must be >= 1 or None."),
    ("model-init-kwargs-json", [*SFT, "--model_init_kwargs", "{bad"], 2, "model_init_kwargs='{bad' is not valid JSON"),
    (
        "model-init-kwargs-list",
        [*SFT, "--model_init_kwargs", "[1]"],
        2,
        "model_init_kwargs='[1]' must be a JSON object",
    ),
    (
        "pad-to-multiple-0",
        [*SFT, "--pad_to_multiple_of", "0"],
        2,
        "pad_to_multiple_of=0 must be >= 1 (None: no padding).",
    ),
    ("sft-max-length-1", [*SFT, "--max_length", "1"], 2, "max_length=1 must be >= 2"),
    ("sft-truncation-mode", [*SFT, "--truncation_mode", "middle"], 2, "truncation_mode='middle' must be one of"),
    ("sft-loss-type", [*SFT, "--loss_type", "mse"], 2, "loss_type='mse' must be one of"),
    ("reward-overflow", [*REWARD, "--max_length_overflow", "wrap"], 2, "max_length_overflow='wrap' must be one of"),
    ("reward-centering", [*REWARD, "--center_rewards_coefficient=-1"], 2, "center_rewards_coefficient=-1.0 must be"),
    ("reward-max-length-0", [*REWARD, "--max_length", "0"], 2, "max_length=0 must be >= 1 or None."),
    # -- online (rollout) fields ------------------------------------------------------------------
    ("stop-token", [*RLOO, "--stop_token", "</s>"], 2, "stop_token='</s>': the only supported value is \"eos\""),
    ("stop-token-both", [*RLOO, "--stop_token", "eos", "--stop_token_id", "3"], 2, "stop_token and stop_token_id"),
    ("num-mini-batches-0", [*RLOO, "--num_mini_batches", "0"], 2, "num_mini_batches=0 must be >= 1."),
    ("response-length-0", [*RLOO, "--response_length", "0"], 2, "response_length=0 must be >= 1."),
    ("forward-batch-0", [*RLOO, "--local_rollout_forward_batch_size", "0"], 2, "must be >= 1."),
    ("temperature", [*RLOO, "--temperature=-1"], 2, "temperature=-1.0 must be >= 0 (0 = greedy)."),
    ("top-p", [*RLOO, "--top_p", "0"], 2, "top_p=0.0 must be in (0, 1]."),
    ("prompt-overflow", [*RLOO, "--prompt_overflow", "cut"], 2, "prompt_overflow='cut' must be"),
    ("total-episodes-0", [*RLOO, "--total_episodes", "0"], 2, "total_episodes=0 must be >= 1."),
    ("rloo-k-1", [*RLOO, "--rloo_k", "1"], 2, "rloo_k=1: RLOO needs at least 2 completions per prompt"),
    (
        "rloo-two-names",
        [*RLOO, "--num_generations", "4", "--rloo_k", "3"],
        2,
        "num_generations=4 and rloo_k=3 are two names of the same setting",
    ),
    # -- win-rate evaluation (judge) --------------------------------------------------------------
    (
        "judge-and-judge-model",
        ["judge", "--model_name_or_path", "{policy}", "--judge", "random", "--judge_model", "gpt-4o-mini"],
        2,
        "--judge random and --judge_model gpt-4o-mini both name the judge",
    ),
    (
        "judge-http-flags",
        ["judge", "--model_name_or_path", "{policy}", "--judge", "random", "--timeout", "10"],
        2,
        "--timeout apply to HTTP judges (openai, http:<url>#<model>, --judge_model) only",
    ),
    # -- data files -------------------------------------------------------------------------------
    ("no-dataset", SFT, 2, "dataset_name is not set: pass --dataset_name"),
    ("data-missing", [*SFT, "--dataset_name", "{tmp}/nope.jsonl"], 2, "nope.jsonl: no such file or folder"),
    ("data-type", [*SFT, "--dataset_name", "{notes.txt}"], 2, "notes.txt: unsupported file type '.txt'"),
    ("data-malformed", [*SFT, "--dataset_name", "{malformed.jsonl}"], 2, "malformed.jsonl, line 2: malformed JSON"),
    ("data-utf8", [*SFT, "--dataset_name", "{latin1.jsonl}"], 2, "latin1.jsonl, line 2: invalid UTF-8"),
    ("data-not-object", [*SFT, "--dataset_name", "{not_object.jsonl}"], 2, "line 2: expected a JSON object, got list"),
    (
        "data-field-type",
        [*SFT, "--dataset_name", "{mixed_types.jsonl}"],
        2,
        "mixed_types.jsonl, line 2, field 'prompt': is a list here but a string at line 1",
    ),
    ("data-empty", [*SFT, "--dataset_name", "{empty.jsonl}"], 2, "empty.jsonl: the file has no records"),
    ("data-empty-list", [*SFT, "--dataset_name", "{empty_list.json}"], 2, "empty_list.json: the file holds an empty"),
    ("data-csv-header", [*SFT, "--dataset_name", "{header_only.csv}"], 2, "header_only.csv: the file has no records"),
    # -- data rows --------------------------------------------------------------------------------
    (
        "prompt-column",
        [*RLOO, "--dataset_name", "{question.jsonl}"],
        2,
        "field 'prompt': missing column(s) ['prompt'] needed for prompts; available columns: ['question']",
    ),
    ("prompt-empty", [*RLOO, "--dataset_name", "{empty_prompt.jsonl}"], 2, "row 2, field 'prompt': is empty"),
    ("prompt-type", [*RLOO, "--dataset_name", "{int_prompt.jsonl}"], 2, "row 1, field 'prompt': has type int"),
    ("message-role", [*RLOO, "--dataset_name", "{no_role.jsonl}"], 2, "row 1, field 'prompt': message 1 has no string"),
    (
        "message-content",
        [*RLOO, "--dataset_name", "{int_content.jsonl}"],
        2,
        "row 1, field 'prompt': message 1 (user) has content of type int",
    ),
    (
        "unknown-role",
        [*SFT, "--dataset_name", "{wizard.jsonl}"],
        2,
        "row 2, field 'messages': message 1 has the unknown role 'wizard'; accepted roles: system, developer, "
        "user, assistant, tool, ipython",
    ),
    ("sharegpt-role", [*SFT, "--dataset_name", "{sharegpt.jsonl}"], 2, "rename the ShareGPT roles: human -> user"),
    (
        "empty-conversation",
        [*RLOO, "--dataset_name", "{empty_conversation.jsonl}"],
        2,
        "row 1, field 'prompt': is an empty conversation",
    ),
    (
        "token-ids-vocab",
        [*RLOO, "--dataset_name", "{big_ids.jsonl}"],
        2,
        "row 2, field 'input_ids': holds token ids outside the vocabulary",
    ),
    (
        "token-ids-type",
        [*RLOO, "--dataset_name", "{float_ids.jsonl}"],
        2,
        "row 1, field 'input_ids': must be a list of integer token ids",
    ),
    (
        "all-prompts-too-long",
        [*RLOO, "--dataset_name", "{prompts.jsonl}", "--max_prompt_length", "1", "--prompt_overflow", "drop"],
        2,
        "every prompt is longer than max_prompt_length=1",
    ),
    ("pair-ties", [*REWARD, "--dataset_name", "{ties.jsonl}"], 2, "every pair (3) has chosen == rejected"),
    ("pair-empty", [*REWARD, "--dataset_name", "{empty_chosen.jsonl}"], 2, "row 2, field 'chosen': is empty"),
    ("pair-margin", [*REWARD, "--dataset_name", "{bad_margin.jsonl}"], 2, "row 1, field 'margin': must be a finite"),
    (
        "pair-mixed",
        [*REWARD, "--dataset_name", "{mixed_pair.jsonl}"],
        2,
        "row 1, field 'chosen': mixes a conversational and a plain-text field with 'prompt'",
    ),
    (
        "pair-prompt-and-query",
        [*REWARD, "--dataset_name", "{prompt_and_query.jsonl}"],
        2,
        "field 'query': has both a 'prompt' and a 'query' column",
    ),
    (
        "pair-prompt-column",
        [*REWARD, "--dataset_name", "{pairs.jsonl}", "--prompt_column", "question"],
        2,
        "field 'question': prompt_column='question' is not a column",
    ),
    (
        "pairs-too-long",
        [*REWARD, "--dataset_name", "{pairs.jsonl}", "--max_length", "2"],
        2,
        "every pair is longer than max_length=2",
    ),
    ("sft-columns", [*SFT, "--dataset_name", "{no_columns.jsonl}"], 2, "cannot tell the format from the columns"),
    (
        "assistant-only-text",
        [*SFT, "--dataset_name", "{text.jsonl}", "--assistant_only_loss"],
        2,
        "assistant_only_loss needs conversational data",
    ),
    ("messages-string", [*SFT, "--dataset_name", "{messages_string.jsonl}"], 2, "row 1, field 'messages': is a string"),
    (
        "no-assistant-turn",
        [*SFT, "--dataset_name", "{no_assistant.jsonl}", "--assistant_only_loss"],
        2,
        "row 1, field 'messages': has no assistant message to train on",
    ),
    (
        "prompt-completion-mixed",
        [*SFT, "--dataset_name", "{mixed_pc.jsonl}"],
        2,
        "row 1, field 'completion': one of prompt / completion is a conversation and the other a string",
    ),
    (
        "eos-token-unknown",
        [*SFT, "--dataset_name", "{text.jsonl}", "--eos_token", "<|nope|>"],
        2,
        "eos_token='<|nope|>' is not a token of the tokenizer's vocabulary",
    ),
    # -- models -----------------------------------------------------------------------------------
    (
        "model-missing",
        [*SFT, "--dataset_name", "{text.jsonl}", "--model_name_or_path", "{tmp}/no_model"],
        2,
        "no_model': no such folder. Give a folder saved with save_pretrained or a hub model name.",
    ),
    (
        "model-hub-offline",
        [*SFT, "--dataset_name", "{text.jsonl}", "--model_name_or_path", "nobody/no-such-model"],
        2,
        "'nobody/no-such-model' could not be loaded: it is not a local folder and the hub did not provide it",
    ),
    (
        "hub-repo-unreachable",
        [*SFT, "--dataset_name", "{text.jsonl}", "--push_to_hub", "--hub_model_id", "me/tiny-sft"],
        2,
        "push_to_hub: cannot create the Hub repository hub_model_id='me/tiny-sft': Cannot reach",
    ),
    (
        "model-truncated",
        [*SFT, "--dataset_name", "{text.jsonl}", "--model_name_or_path", "{truncated}"],
        2,
        "model.safetensors is truncated or corrupt (",
    ),
    (
        "response-fills-positions",
        [*RLOO, "--dataset_name", "{prompts.jsonl}", "--response_length", "1024"],
        2,
        "response_length=1024 leaves no room for a prompt in the policy (",
    ),
    # -- output_dir and checkpoints ---------------------------------------------------------------
    (
        "output-dir-file",
        [*SFT, "--dataset_name", "{text.jsonl}", "--output_dir", "{notes.txt}"],
        2,
        "notes.txt' is a file; pass the path of a folder (new or existing).",
    ),
    (
        "output-dir-under-file",
        [*RLOO, "--dataset_name", "{prompts.jsonl}", "--output_dir", "{notes.txt}/run"],
        2,
        "notes.txt' is a file, not a folder; choose another --output_dir.",
    ),
    (
        "output-dir-has-run",
        [*SFT, "--dataset_name", "{text.jsonl}", "--output_dir", "{finished}"],
        2,
        "already holds a run (checkpoints, weights or metrics). Pass --resume_from_checkpoint latest",
    ),
    (
        "resume-nothing",
        [*SFT, "--dataset_name", "{text.jsonl}", "--resume_from_checkpoint", "latest"],
        2,
        "resume_from_checkpoint='latest' but",
    ),
    (
        "resume-missing-path",
        [*SFT, "--dataset_name", "{text.jsonl}", "--resume_from_checkpoint", "{tmp}/checkpoint-9"],
        2,
        "checkpoint-9' does not exist.",
    ),
    (
        "resume-incomplete",
        [*SFT, "--dataset_name", "{text.jsonl}", "--resume_from_checkpoint", "{incomplete}"],
        2,
        "is not a complete posttrain checkpoint (no checkpoint_complete.json)",
    ),
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_policy_dir, tiny_reward_model_dir):
    import shutil

    root = tmp_path_factory.mktemp("errors")
    paths = {"tmp": str(root), "policy": str(tiny_policy_dir), "rm": str(tiny_reward_model_dir)}
    for name, content in FILES.items():
        file = root / name
        file.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
        paths[name] = str(file)
    truncated = root / "truncated"
    shutil.copytree(tiny_policy_dir, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    paths["truncated"] = str(truncated)
    finished = root / "finished"
    finished.mkdir()
    (finished / "metrics.jsonl").write_text('{"step": 1}\n', encoding="utf-8")
    paths["finished"] = str(finished)
    incomplete = root / "checkpoint-3"
    incomplete.mkdir()
    paths["incomplete"] = str(incomplete)
    return paths


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """Exit code and stderr of `posttrain <argv>`, as the shell would see them."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        if isinstance(exit_.code, str):  # the interpreter prints it to stderr and exits with 1
            return 1, capsys.readouterr().err + exit_.code
        return int(exit_.code or 0), capsys.readouterr().err
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("case", "args", "code", "fragment"), CASES, ids=[c[0] for c in CASES])
def test_error_case(case, args, code, fragment, workdir, tmp_path, capsys):
    paths = {**workdir, "out": str(tmp_path / "out")}
    argv = [re.sub(r"\{([^{}]+)\}", lambda m: paths.get(m.group(1), m.group(0)), a) for a in args]
    got_code, stderr = run_cli(argv, capsys)
    assert "Traceback" not in stderr
    assert fragment in stderr, stderr[-2000:]
    assert got_code == code, stderr[-2000:]
    # A refused run leaves no output folder behind.
    assert not (tmp_path / "out").exists()


def test_every_case_is_documented():
    table = DOC.read_text(encoding="utf-8")
    missing = [case for case, _, _, fragment in CASES if f"`{case}`" not in table]
    assert not missing, f"cases not in docs/errors.md: {missing}"
    rows = {line.split("|")[1].strip().strip("`"): line for line in table.splitlines() if line.startswith("| `")}
    for case, _, code, fragment in CASES:
        # The table shows messages as `code`: backticks inside a fragment are not used.
        assert fragment.replace("|", "\\|") in rows[case], (case, fragment)
        assert f"| {code} |" in rows[case], (case, code)
