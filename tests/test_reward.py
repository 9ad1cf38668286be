"""RewardTrainer / `posttrain reward`: data formats, the score position (pad == eos), one forward
pass per pair batch, the Bradley–Terry loss with margin and centring, learning a rule to >= 90%
held-out accuracy, exact gradient accumulation, resume, the DeepSpeed-Chat eval print, saving, CLI."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset

from helpers import read_metrics, train_argv
from helpers import reward_config as config
from helpers import reward_trainer as make_trainer
from posttrain.configs import ConfigError
from posttrain.trainers.reward import RewardTrainer, last_token_scores
from posttrain.trainers.reward_config import RewardConfig

WORDS = ["dog", "cat", "sea", "blue", "robot", "book"]


def rule_pairs(n: int, seed: int) -> list[dict]:
    """Pairs over the same six words where chosen holds more "good" than rejected."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.choice(WORDS) for _ in range(6)]
        more, fewer = sorted(rng.sample(range(4), 2), reverse=True)

        def with_good(k: int, base: list[str] = base) -> str:
            words = base[:]
            for j in rng.sample(range(6), k):
                words[j] = "good"
            return " ".join(words)

        out.append({"chosen": with_good(more), "rejected": with_good(fewer)})
    return out


FORMATS = {
    "implicit": [{"chosen": "Q: sea? A: The sea is blue.", "rejected": "Q: sea? A: dog."}] * 4,
    "explicit": [{"prompt": "Q: sea? A:", "chosen": " The sea is blue.", "rejected": " dog."}] * 4,
    "conversational": [
        {
            "prompt": [{"role": "user", "content": "The sea?"}],
            "chosen": [{"role": "assistant", "content": "The sea is blue."}],
            "rejected": [{"role": "assistant", "content": "dog"}],
        }
    ]
    * 4,
    "margin": [{"chosen": "The sea is blue.", "rejected": "dog.", "margin": float(m)} for m in range(4)],
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_trains(tmp_path, tiny_tokenizer, fmt):
    trainer = make_trainer(tmp_path, tiny_tokenizer, FORMATS[fmt], center_rewards_coefficient=0.01)
    tok = trainer.processing_class
    row = trainer.train_dataset[0]
    # Both sides hold the prompt and end with EOS (conversations: the template's turn end, EOS + newline).
    tail = -2 if fmt == "conversational" else -1
    assert tok.decode(row["chosen_input_ids"]).count("sea") >= 1
    assert row["chosen_input_ids"][tail] == row["rejected_input_ids"][tail] == tok.eos_token_id

    batch = trainer.collator([trainer.train_dataset[i] for i in range(4)])
    loss_sum, stats = trainer.compute_loss(trainer.model, batch)
    rc, rr = stats["chosen"], stats["rejected"]
    margin = batch["margin"] if fmt == "margin" else torch.zeros(4)
    expected = (-F.logsigmoid(rc - rr - margin) + 0.01 * (rc + rr) ** 2).sum()
    torch.testing.assert_close(loss_sum, expected)

    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert all(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()) if a.numel() > 1)
    logged = read_metrics(tmp_path / "run")[-1]
    for key in ("loss", "accuracy", "margin", "mean_reward", "num_tokens", "lr", "grad_norm", "epoch"):
        assert torch.isfinite(torch.tensor(float(logged[key]))), key


def test_score_is_read_at_the_last_real_token_when_pad_is_eos(tmp_path, tiny_tokenizer_pad_eos):
    tok = tiny_tokenizer_pad_eos
    trainer = make_trainer(tmp_path, tok, [{"chosen": "The sea is wide and blue.", "rejected": "dog"}] * 2)
    model = trainer.model.eval()
    assert model.config.pad_token_id == tok.eos_token_id
    batch = trainer.collator([trainer.train_dataset[0]])  # rejected row is right-padded with pad == eos
    with torch.no_grad():
        scores = last_token_scores(model, batch["input_ids"], batch["attention_mask"], batch["lengths"], model.score)
        for row, ids in enumerate(
            (trainer.train_dataset[0]["chosen_input_ids"], trainer.train_dataset[0]["rejected_input_ids"])
        ):
            alone = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
            torch.testing.assert_close(scores[row], model.score(alone).squeeze(-1), rtol=1e-5, atol=1e-5)


def test_chosen_and_rejected_share_one_forward_pass(tmp_path, tiny_tokenizer):
    trainer = make_trainer(tmp_path, tiny_tokenizer, FORMATS["implicit"])
    calls = []
    handle = trainer.model.register_forward_hook(lambda module, args, kwargs_out: calls.append(1))
    batch = trainer.collator([trainer.train_dataset[i] for i in range(3)])
    trainer.compute_loss(trainer.model, batch)
    handle.remove()
    assert len(calls) == 1 and batch["input_ids"].size(0) == 6


def test_learns_a_rule_to_90_percent_held_out_and_reloads(tmp_path, tiny_tokenizer, capsys):
    from transformers import AutoModelForSequenceClassification

    trainer = make_trainer(
        tmp_path,
        tiny_tokenizer,
        rule_pairs(256, seed=0),
        rule_pairs(64, seed=1),
        max_steps=60,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        logging_steps=20,
        num_print_samples=3,
    )
    trainer.train()
    final = read_metrics(tmp_path / "run")[-1]
    assert final["step"] == 60 and final["eval_accuracy"] >= 0.9
    assert final["eval_margin"] > 0 and final["eval_chosen_scores"] > final["eval_rejected_scores"]
    assert final["eval_min_reward"] <= final["eval_mean_reward"] <= final["eval_max_reward"]
    printed = capsys.readouterr().out
    assert "chosen_last_scores (higher is better)" in printed and "reject_last_scores (lower is better)" in printed
    assert "acc (higher is better) : " in printed and "eval_pairs" in printed
    assert len((tmp_path / "run" / "samples.jsonl").read_text().splitlines()) == 3

    # pad != eos here, so transformers' own pooling (rightmost non-pad token) reads the same token.
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run").eval()
    assert reloaded.config.pad_token_id == tiny_tokenizer.pad_token_id and reloaded.config.num_labels == 1
    row = trainer.eval_dataset[0]
    ids = torch.tensor([row["chosen_input_ids"]])
    trainer.model.eval()
    with torch.no_grad():
        ours = last_token_scores(trainer.model, ids, torch.ones_like(ids), torch.tensor([ids.size(1)]), trainer.head)
        torch.testing.assert_close(reloaded(input_ids=ids).logits.squeeze(-1), ours, rtol=1e-5, atol=1e-5)


def test_gradient_accumulation_matches_one_big_batch(tmp_path, tiny_tokenizer):
    pairs = rule_pairs(8, seed=2)
    for p, m in zip(pairs, range(8)):
        p["margin"] = m / 4
    common = dict(max_steps=2, learning_rate=0.1, adam_epsilon=1.0, max_grad_norm=None, center_rewards_coefficient=0.1)
    small = make_trainer(
        tmp_path,
        tiny_tokenizer,
        pairs,
        name="ga4",
        per_device_train_batch_size=1,
        gradient_accumulation_steps=4,
        **common,
    )
    big = make_trainer(tmp_path, tiny_tokenizer, pairs, name="ga1", per_device_train_batch_size=4, **common)
    initial = [p.detach().clone() for p in small.model.parameters()]
    small.train()
    big.train()
    assert max((a - b).abs().max() for a, b in zip(small.model.parameters(), initial)) > 1e-3
    for (name, a), b in zip(small.model.named_parameters(), big.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)


def test_resume_is_bitwise_identical(tmp_path, tiny_tokenizer):
    pairs = rule_pairs(8, seed=3)
    straight = make_trainer(tmp_path, tiny_tokenizer, pairs, name="straight", max_steps=4, save_steps=2)
    straight.train()
    resumed = make_trainer(
        tmp_path,
        tiny_tokenizer,
        pairs,
        name="resumed",
        model_seed=5,
        max_steps=4,
        save_steps=2,
        resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"),
    )
    resumed.train()
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


def test_overlong_pairs_are_dropped_with_a_count(tmp_path, tiny_tokenizer, capsys):
    pairs = [{"chosen": "good " * 40, "rejected": "dog"}] + FORMATS["implicit"]
    trainer = make_trainer(tmp_path, tiny_tokenizer, pairs, max_length=16)
    assert len(trainer.train_dataset) == 4
    assert "dropped 1 of 5 pairs longer than max_length=16" in capsys.readouterr().err
    truncated = make_trainer(
        tmp_path, tiny_tokenizer, pairs, name="trunc", max_length=16, max_length_overflow="truncate"
    )
    assert len(truncated.train_dataset) == 5 and len(truncated.train_dataset[0]["chosen_input_ids"]) == 16


def test_config_defaults_and_errors(tmp_path):
    defaults = RewardConfig()
    assert (defaults.learning_rate, defaults.max_length, defaults.disable_dropout) == (1e-4, 1024, True)
    assert defaults.center_rewards_coefficient is None and defaults.max_length_overflow == "drop"
    with pytest.raises(ConfigError, match="max_length_overflow"):
        RewardConfig(output_dir=str(tmp_path), max_length_overflow="wrap")
    with pytest.raises(ConfigError, match="center_rewards_coefficient"):
        RewardConfig(output_dir=str(tmp_path), center_rewards_coefficient=-1.0)


def test_cli_reward(tmp_path, tiny_tokenizer, tiny_reward_model_dir):
    from transformers import AutoModelForSequenceClassification

    from posttrain.cli import main

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in rule_pairs(8, seed=4)))
    out = tmp_path / "cli"
    code = main(
        [
            *train_argv("reward", tiny_reward_model_dir, data, out),
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "2",
            "--logging_steps",
            "1",
            "--center_rewards_coefficient",
            "0.01",
            "--report_to",
            "none",
        ]
    )
    assert code == 0
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    assert AutoModelForSequenceClassification.from_pretrained(out).config.pad_token_id == tiny_tokenizer.pad_token_id


def test_reward_training_starts_from_a_causal_lm_folder_with_a_new_score_head(tmp_path, tiny_policy_dir):
    """`posttrain reward --model_name_or_path <SFT or base model>`: the usual RLHF step 2 starts from a
    causal LM, whose score head is new by design (a reward model *used* for RL must have one)."""
    trainer = RewardTrainer(
        str(tiny_policy_dir), args=config(tmp_path, max_steps=1), train_dataset=Dataset.from_list(rule_pairs(8, 0))
    )
    trainer.train()
    from transformers import AutoModelForSequenceClassification

    saved = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run")
    assert saved.config.num_labels == 1


def test_query_is_the_prompt_column_of_preference_data(tmp_path, tiny_tokenizer):
    """{query, chosen, rejected} (DeepSpeed-Chat's reward data) trains exactly as the same pairs
    under `prompt`, and as under any column named by prompt_column."""
    rows = [
        {"prompt": f"Q{i}: where is the sea?", "chosen": f" The sea is blue {i}.", "rejected": f" dog {i}."}
        for i in range(4)
    ]
    as_query = [{"query": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]} for r in rows]
    as_named = [{"question": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]} for r in rows]
    implicit = [{"chosen": r["chosen"], "rejected": r["rejected"]} for r in rows]

    runs = {
        "prompt": make_trainer(tmp_path, tiny_tokenizer, rows, name="prompt"),
        "query": make_trainer(tmp_path, tiny_tokenizer, as_query, name="query"),
        "named": make_trainer(tmp_path, tiny_tokenizer, as_named, name="named", prompt_column="question"),
    }
    reference = runs["prompt"].train_dataset
    # The prompt is really prepended: the tokens differ from the same pairs without it.
    no_prompt = make_trainer(tmp_path, tiny_tokenizer, implicit, name="implicit").train_dataset
    assert reference["chosen_input_ids"][0] != no_prompt["chosen_input_ids"][0]
    first = tiny_tokenizer(rows[0]["prompt"] + rows[0]["chosen"])["input_ids"]
    assert reference["chosen_input_ids"][0][: len(first)] == first
    for name in ("query", "named"):
        for column in ("chosen_input_ids", "rejected_input_ids"):
            assert runs[name].train_dataset[column] == reference[column], (name, column)

    losses = {}
    for name, trainer in runs.items():
        trainer.train()
        losses[name] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses["prompt"]) == 2
    assert losses["query"] == losses["prompt"] == losses["named"]
    weights = {name: trainer.model.state_dict() for name, trainer in runs.items()}
    for key, value in weights["prompt"].items():
        assert torch.equal(weights["query"][key], value), key
        assert torch.equal(weights["named"][key], value), key


def test_preference_prompt_column_errors(tmp_path, tiny_tokenizer):
    from posttrain.data import DataError

    both = [{"prompt": "Q?", "query": "Q?", "chosen": " yes", "rejected": " no"}] * 2
    with pytest.raises(DataError, match="both a 'prompt' and a 'query' column") as err:
        make_trainer(tmp_path, tiny_tokenizer, both)
    assert "--prompt_column" in str(err.value)
    # Naming one of them settles it.
    trainer = make_trainer(tmp_path, tiny_tokenizer, both, name="named", prompt_column="query")
    assert len(trainer.train_dataset) == 2
    with pytest.raises(DataError, match="prompt_column='question' is not a column"):
        make_trainer(tmp_path, tiny_tokenizer, FORMATS["explicit"], name="missing", prompt_column="question")
