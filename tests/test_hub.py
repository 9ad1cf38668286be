"""Sharing on the Hub (posttrain.hub): every trainer's push_to_hub / create_model_card, the pushes
push_to_hub=True makes at checkpoint saves (hub_strategy) and at the end of train(), and the model
card's content. No network: huggingface_hub.create_repo / create_branch / upload_folder are replaced
by recorders; the files an upload would send are listed with huggingface_hub's own pattern filter."""

from __future__ import annotations

import copy
import inspect
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from datasets import Dataset

from helpers import count_e
from posttrain import hub
from posttrain.configs import ConfigError
from posttrain.testing import build_tiny_causal_lm, build_tiny_reward_model
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
from posttrain.trainers.ppo import PPOConfig, PPOTrainer
from posttrain.trainers.reward import RewardTrainer
from posttrain.trainers.reward_config import RewardConfig
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer
from posttrain.trainers.sft import SFTTrainer
from posttrain.trainers.sft_config import SFTConfig
from posttrain.trainers.xpo import XPOConfig, XPOTrainer

PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time", "Thank you very much"] * 2
SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Hello world! Good morning.", "The sea is blue."] * 2
PAIRS = [{"chosen": "Q: sea? A: The sea is blue.", "rejected": "Q: sea? A: dog."}] * 4
ALGORITHMS = ["sft", "reward", "ppo", "rloo", "grpo", "online_dpo", "xpo"]
PAPERS = {  # the paper each algorithm's card must cite (arXiv / DOI link)
    "sft": "https://arxiv.org/abs/2203.02155",
    "reward": "https://doi.org/10.2307/2334029",
    "ppo": "https://arxiv.org/abs/1707.06347",
    "rloo": "https://arxiv.org/abs/2402.14740",
    "grpo": "https://arxiv.org/abs/2402.03300",
    "online_dpo": "https://arxiv.org/abs/2402.04792",
    "xpo": "https://arxiv.org/abs/2405.21046",
}


def make_trainer(algo: str, output_dir: Path, tokenizer, base_dir: Path, **fields):
    """A tiny trainer of `algo` (two optimizer steps / rollout batches) started from the model saved in
    `base_dir`; `fields` go to its config."""
    tokenizer = copy.deepcopy(tokenizer)
    common = dict(output_dir=str(output_dir), report_to="none", learning_rate=1e-3, logging_steps=1, **fields)
    if algo in ("sft", "reward"):
        config_cls, trainer_cls = (SFTConfig, SFTTrainer) if algo == "sft" else (RewardConfig, RewardTrainer)
        data = Dataset.from_dict({"text": SENTENCES}) if algo == "sft" else Dataset.from_list(PAIRS)
        args = config_cls(max_steps=2, per_device_train_batch_size=2, max_length=64, **common)
        return trainer_cls(str(base_dir), args=args, train_dataset=data, processing_class=tokenizer)
    online = dict(
        per_device_train_batch_size=4, total_episodes=8, response_length=4, num_sample_generations=0, **common
    )
    prompts = Dataset.from_dict({"prompt": PROMPTS})
    policy = str(base_dir)
    if algo == "rloo":
        return RLOOTrainer(RLOOConfig(**online), tokenizer, policy=policy, reward_model=count_e, train_dataset=prompts)
    if algo == "grpo":
        return GRPOTrainer(
            policy, count_e, GRPOConfig(num_generations=2, **online), prompts, processing_class=tokenizer
        )
    if algo == "ppo":
        return PPOTrainer(
            args=PPOConfig(**online),
            processing_class=tokenizer,
            model=policy,
            reward_model=count_e,
            train_dataset=prompts,
        )
    config_cls, trainer_cls = (OnlineDPOConfig, OnlineDPOTrainer) if algo == "online_dpo" else (XPOConfig, XPOTrainer)
    # Online DPO / XPO count per_device_train_batch_size in prompts (TRL): 2 prompts = 4 completions.
    online["per_device_train_batch_size"] = 2
    return trainer_cls(
        policy, reward_model=count_e, args=config_cls(**online), processing_class=tokenizer, train_dataset=prompts
    )


@pytest.fixture
def hub_calls(monkeypatch):
    """Record every call at the huggingface_hub boundary. Each upload records its arguments, the
    files it would send (huggingface_hub.utils.filter_repo_objects applies the patterns as
    upload_folder does) and the README.md text at that moment. Each call's arguments must bind to the
    installed huggingface_hub function's signature."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    calls: list[tuple[str, dict]] = []
    real = {name: getattr(huggingface_hub, name) for name in ("create_repo", "create_branch", "upload_folder")}

    def record(name: str, kw: dict) -> None:
        inspect.signature(real[name]).bind(**kw)  # the installed huggingface_hub takes these arguments
        calls.append((name, kw))

    def create_repo(repo_id, **kw):
        record("create_repo", {"repo_id": repo_id, **kw})
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"me/{repo_id}")

    def create_branch(repo_id, **kw):
        record("create_branch", {"repo_id": repo_id, **kw})

    def upload_folder(**kw):
        folder = Path(kw["folder_path"])
        names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        kept = filter_repo_objects(names, ignore_patterns=kw.get("ignore_patterns"))
        readme = folder / "README.md"
        inspect.signature(real["upload_folder"]).bind(**kw)
        kw = {**kw, "files": sorted(kept), "readme": readme.read_text() if readme.is_file() else None}
        calls.append(("upload_folder", kw))
        return SimpleNamespace(commit_message=kw["commit_message"])

    monkeypatch.setattr(huggingface_hub, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub, "create_branch", create_branch)
    monkeypatch.setattr(huggingface_hub, "upload_folder", upload_folder)
    return calls


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory, tiny_tokenizer):
    """Saved tiny base models (policy and reward model), each with a README naming a license."""
    dirs = {}
    for kind, build in (("policy", build_tiny_causal_lm), ("reward", build_tiny_reward_model)):
        path = tmp_path_factory.mktemp(f"base_{kind}")
        build(tiny_tokenizer, save_dir=path)
        (path / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
        dirs[kind] = path
    return dirs


def uploads(calls):
    return [kw for name, kw in calls if name == "upload_folder"]


def front_matter(text: str) -> dict:
    match = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert match, text[:200]
    return yaml.safe_load(match.group(1))


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_every_trainer_pushes_at_saves_and_at_the_end_and_writes_its_card(
    algo, tmp_path, tiny_tokenizer, base_dirs, hub_calls
):
    """push_to_hub=True, hub_strategy "every_save", save_steps=1: the model and card are pushed after the
    checkpoint of step 1 ("Training in progress, step 1") and at the end ("End of training"), to the
    repository created private with the config's token; checkpoint folders stay local. Then
    trainer.push_to_hub(...) with its own message, token and revision, card keywords passed on. The
    repository is created (exist_ok) when the trainer is built and before each push."""
    base = base_dirs["reward" if algo == "reward" else "policy"]
    out = tmp_path / f"tiny-{algo}"
    trainer = make_trainer(
        algo,
        out,
        tiny_tokenizer,
        base,
        save_steps=1,
        push_to_hub=True,
        hub_model_id=f"org/tiny-{algo}",
        hub_private_repo=True,
        hub_token="hf_secret_token",
    )
    # The repository is created when the trainer is built: a bad token or name fails before training.
    assert [name for name, _ in hub_calls] == ["create_repo"]
    trainer.train()
    assert [name for name, _ in hub_calls] == ["create_repo"] + ["create_repo", "upload_folder"] * 2
    for name, kw in hub_calls:
        if name == "create_repo":
            assert kw == {"repo_id": f"org/tiny-{algo}", "token": "hf_secret_token", "private": True, "exist_ok": True}
    at_save, at_end = uploads(hub_calls)
    assert at_save["commit_message"] == "Training in progress, step 1"
    assert at_end["commit_message"] == "End of training"
    for kw in (at_save, at_end):
        assert kw["repo_id"] == f"org/tiny-{algo}" and kw["folder_path"] == str(out)
        assert kw["token"] == "hf_secret_token" and kw["revision"] is None
        # The model (as plain transformers loads it), tokenizer and card; no checkpoint, no optimizer state.
        assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(kw["files"]), kw["files"]
        assert not any(f.startswith(("checkpoint-", "dcp/")) or f.endswith("optimizer_groups.pt") for f in kw["files"])
        assert (out / "checkpoint-1" / "optimizer_groups.pt").is_file()  # it exists, it is just not sent
    # At the save the card has the metrics logged so far; at the end the training summary too.
    assert "Training summary" not in at_save["readme"] and "Last training log (step 1)" in at_save["readme"]
    assert "Training summary (step 2)" in at_end["readme"]
    # The token is written neither in the card nor in the saved config.
    assert "hf_secret_token" not in at_end["readme"]
    assert json.loads((out / "posttrain_config.json").read_text())["hub_token"] is None

    hub_calls.clear()
    result = trainer.push_to_hub(
        commit_message="Manual push", token="hf_other", revision="dev", dataset_name="org/data", tags=["extra"]
    )
    assert [name for name, _ in hub_calls] == ["create_repo", "create_branch", "upload_folder"]
    assert hub_calls[1][1] == {"repo_id": f"org/tiny-{algo}", "branch": "dev", "token": "hf_other", "exist_ok": True}
    (manual,) = uploads(hub_calls)
    assert result.commit_message == "Manual push"
    assert (manual["commit_message"], manual["token"], manual["revision"], manual["run_as_future"]) == (
        "Manual push",
        "hf_other",
        "dev",
        False,
    )
    card = (out / "README.md").read_text()
    assert manual["readme"] == card
    meta = front_matter(card)
    method = hub.METHODS[algo]
    assert meta["library_name"] == "posttrain" and meta["model_name"] == f"tiny-{algo}"
    assert meta["tags"] == ["posttrain", method.tag, "extra"]
    assert meta["datasets"] == ["org/data"] and meta["license"] == "apache-2.0"
    assert "base_model" not in meta  # a local folder is no Hub id
    assert f"fine-tuned version of `{base}`" in card
    assert f"posttrain's {method.name} trainer" in card and PAPERS[algo] in card
    # Trained from Python: the config, as YAML, without the token.
    config_block = re.search(r"```yaml\n(.*?)\n```", card, re.S).group(1)
    shown = yaml.safe_load(config_block)
    assert shown["hub_model_id"] == f"org/tiny-{algo}" and shown["save_steps"] == 1 and shown["learning_rate"] == 1e-3
    assert "hub_token" not in shown and "output_dir" not in shown  # neither the token nor a local path
    summary = trainer.state.log_history[-1]
    assert f"| train_loss | {summary['train_loss']:.6g} |" in card
    import torch
    import transformers

    assert f"- Transformers: {transformers.__version__}" in card and f"- PyTorch: {torch.__version__}" in card


@pytest.mark.parametrize("algo", ["sft", "rloo"])
@pytest.mark.parametrize("strategy", ["end", "checkpoint", "all_checkpoints"])
def test_hub_strategy_decides_what_is_pushed_and_when(algo, strategy, tmp_path, tiny_tokenizer, base_dirs, hub_calls):
    """end: one push, at the end. checkpoint: each save also pushes the checkpoint (optimizer state
    included) as last-checkpoint/, replacing the previous one; the end push sends the newest again.
    all_checkpoints: each checkpoint under its own name; the end push includes every checkpoint."""
    out = tmp_path / "run"
    trainer = make_trainer(
        algo, out, tiny_tokenizer, base_dirs["policy"], save_steps=1, push_to_hub=True, hub_strategy=strategy
    )
    trainer.train()
    got = [(kw["commit_message"], kw.get("path_in_repo"), kw["folder_path"]) for kw in uploads(hub_calls)]
    ckpt = str(out / "checkpoint-1")
    expected = {
        "end": [("End of training", None, str(out))],
        "checkpoint": [
            ("Training in progress, step 1", None, str(out)),
            ("Training in progress, step 1, checkpoint", "last-checkpoint", ckpt),
            ("End of training", None, str(out)),
            ("End of training, checkpoint", "last-checkpoint", ckpt),
        ],
        "all_checkpoints": [
            ("Training in progress, step 1", None, str(out)),
            ("Training in progress, step 1, checkpoint", "checkpoint-1", ckpt),
            ("End of training", None, str(out)),
        ],
    }[strategy]
    assert got == expected
    # The default repository name: the output_dir's folder name, in the token owner's namespace.
    assert {kw["repo_id"] for kw in uploads(hub_calls)} == {"me/run"}
    assert all(kw["private"] is None for name, kw in hub_calls if name == "create_repo")
    for kw in uploads(hub_calls):
        if kw["folder_path"] == ckpt:
            assert {"optimizer_groups.pt", "dcp/.metadata", "checkpoint_complete.json"} <= set(kw["files"])
            assert kw["delete_patterns"] == (["*"] if strategy == "checkpoint" else None)
    end = next(kw for kw in uploads(hub_calls) if kw["commit_message"] == "End of training")
    in_checkpoints = [f for f in end["files"] if f.startswith("checkpoint-1/")]
    assert ("checkpoint-1/optimizer_groups.pt" in in_checkpoints) == (strategy == "all_checkpoints")


@pytest.mark.parametrize("algo", ["sft", "rloo"])
def test_only_the_main_process_pushes(algo, tmp_path, tiny_tokenizer, base_dirs, hub_calls):
    """On the other processes push_to_hub saves (a collective) but neither writes the card nor uploads."""
    trainer = make_trainer(algo, tmp_path / "run", tiny_tokenizer, base_dirs["policy"], hub_model_id="org/x")
    trainer.run.is_main = False
    assert trainer.push_to_hub() is None
    assert hub_calls == [] and not (tmp_path / "run" / "README.md").exists()
    trainer.args.push_to_hub = True  # a save would push on the main process
    hub.push_checkpoint(
        trainer.args, tmp_path, 1, is_main=False, write_card=lambda: pytest.fail("card written off the main process")
    )
    assert hub_calls == []
    trainer.run.is_main = True
    trainer.push_to_hub(blocking=False)
    (upload,) = uploads(hub_calls)
    assert upload["run_as_future"] is True and upload["repo_id"] == "org/x"


def test_a_repository_that_cannot_be_created_stops_before_training(tmp_path, tiny_tokenizer, base_dirs, monkeypatch):
    """A bad token or name (any create_repo failure) is one ConfigError naming the repository and the fix,
    raised when the trainer is built."""
    import huggingface_hub

    def refuse(repo_id, **kw):
        raise PermissionError("401 Client Error: Unauthorized (invalid token)")

    monkeypatch.setattr(huggingface_hub, "create_repo", refuse)
    with pytest.raises(ConfigError, match=r"hub_model_id='org/x'.*401 Client Error.*hf auth login.*hub_token"):
        make_trainer(
            "rloo", tmp_path / "run", tiny_tokenizer, base_dirs["policy"], push_to_hub=True, hub_model_id="org/x"
        )


def test_push_to_hub_false_pushes_nothing_during_training(tmp_path, tiny_tokenizer, base_dirs, hub_calls):
    trainer = make_trainer("sft", tmp_path / "run", tiny_tokenizer, base_dirs["policy"], save_steps=1)
    trainer.train()
    assert hub_calls == [] and not (tmp_path / "run" / "README.md").exists()


def test_card_of_a_hub_base_model_and_a_cli_run(monkeypatch, tmp_path):
    """A Hub base model is the card's base_model (linked); launched as `posttrain ...`, the card shows
    that command line with the token masked instead of the config."""
    monkeypatch.setattr(
        sys,
        "argv",
        ["/venv/bin/posttrain", "rloo", "--model_name_or_path", "Qwen/Qwen2-0.5B", "--hub_token", "hf_abc",
         "--push_to_hub_token=hf_def", "--learning_rate", "3e-6"],
    )  # fmt: skip
    config = RLOOConfig(output_dir=str(tmp_path / "out"), model_name_or_path="Qwen/Qwen2-0.5B")
    log_history = [
        {"loss": 0.5, "objective/scores": 1.25, "epoch": 0.5, "step": 1},
        {"eval_objective/scores": 2.0, "epoch": 0.5, "step": 1},
        {"train_runtime": 3.0, "train_loss": 0.25, "epoch": 1.0, "step": 2},
    ]
    path = hub.write_model_card(config, method="rloo", log_history=log_history, model=None)
    card = path.read_text()
    meta = front_matter(card)
    assert meta["base_model"] == "Qwen/Qwen2-0.5B" and meta["tags"] == ["posttrain", "rloo"]
    assert "datasets" not in meta and "license" not in meta  # neither is known
    assert "fine-tuned version of [Qwen/Qwen2-0.5B](https://huggingface.co/Qwen/Qwen2-0.5B)" in card
    assert (
        "posttrain rloo --model_name_or_path Qwen/Qwen2-0.5B --hub_token '***' '--push_to_hub_token=***' "
        "--learning_rate 3e-6" in card
    )
    assert "hf_abc" not in card and "hf_def" not in card and "```yaml" not in card
    assert "Training summary (step 2)" in card and "| train_loss | 0.25 |" in card
    assert "Last training log (step 1)" in card and "| objective/scores | 1.25 |" in card
    assert "Last evaluation (step 1)" in card and "| eval_objective/scores | 2 |" in card
    assert 'pipeline("text-generation", model="out")' in card


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/venv/bin/posttrain", "sft", "--hub_token=hf_a"], "posttrain sft '--hub_token=***'"),
        (["/site/posttrain/__main__.py", "grpo", "--x", "1"], "posttrain grpo --x 1"),  # python -m posttrain
        (["/site/posttrain/cli.py", "xpo", "--hub_token", "hf_a", "--b"], "posttrain xpo --hub_token '***' --b"),
        (["/usr/bin/pytest", "tests"], None),  # not the CLI: the card shows the config instead
        (["train.py"], None),
    ],
)
def test_launch_command(argv, expected):
    assert hub.launch_command(argv) == expected


def test_the_card_config_is_a_config_file_the_cli_reads(tmp_path):
    """Trained from Python: the card's YAML block holds the fields set away from the defaults (not the
    token, not the local output_dir); saved as a file, it gives `posttrain rloo --config` the same settings."""
    from posttrain.cli import parse_config

    config = RLOOConfig(output_dir=str(tmp_path / "out"), learning_rate=1e-5, rloo_k=4, hub_token="hf_x")
    card = hub.model_card(config, method="rloo", log_history=[], base_model=None)
    block = re.search(r"```yaml\n(.*?)\n```", card, re.S).group(1)
    assert "No metrics were logged." in card and "hf_x" not in card
    (tmp_path / "run.yaml").write_text(block)
    assert yaml.safe_load(block) == {"learning_rate": 1e-5, "rloo_k": 4}
    parsed = parse_config("rloo", ["--config", str(tmp_path / "run.yaml"), "--output_dir", str(tmp_path / "new")])
    assert (parsed.learning_rate, parsed.rloo_k, parsed.hub_token) == (1e-5, 4, None)


def test_hub_fields_parse_on_the_command_line_and_bad_strategy_is_refused(tmp_path):
    from posttrain.cli import parse_config

    config = parse_config(
        "grpo",
        ["--output_dir", str(tmp_path), "--push_to_hub", "--hub_strategy", "checkpoint", "--hub_private_repo", "true",
         "--hub_model_id", "org/m", "--hub_revision", "dev", "--hub_always_push"],
    )  # fmt: skip
    assert (config.push_to_hub, config.hub_strategy, config.hub_private_repo) == (True, "checkpoint", True)
    assert (config.hub_model_id, config.hub_revision, config.hub_always_push) == ("org/m", "dev", True)
    with pytest.raises(ConfigError, match="hub_strategy='sometimes'.*every_save"):
        SFTConfig(output_dir=str(tmp_path), hub_strategy="sometimes")


def test_deprecated_push_to_hub_names_reach_the_upload(tmp_path, hub_calls):
    """push_to_hub_organization / push_to_hub_model_id / push_to_hub_token (transformers' old names)."""
    with pytest.warns(FutureWarning):
        config = SFTConfig(
            output_dir=str(tmp_path / "out"),
            push_to_hub_model_id="name",
            push_to_hub_organization="org",
            push_to_hub_token="hf_old",
        )
    hub.push(config, is_main=True, write_card=lambda: None)
    (create,) = [kw for name, kw in hub_calls if name == "create_repo"]
    assert (create["repo_id"], create["token"]) == ("org/name", "hf_old")
    assert uploads(hub_calls)[0]["repo_id"] == "org/name"
