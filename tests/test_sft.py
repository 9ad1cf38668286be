"""SFTTrainer / `posttrain sft`: data formats and loss masks, the chunked loss against a plain
full-logits cross-entropy, learning, exact gradient accumulation, bitwise resume, saving, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset

from helpers import SENTENCES, read_metrics, reference_loss_sum, train_argv
from helpers import sft_config as config
from helpers import sft_trainer as make_trainer
from posttrain.configs import ConfigError
from posttrain.trainers.sft import SFTTrainer
from posttrain.trainers.sft_config import SFTConfig
from posttrain.trainers.supervised import IGNORE_INDEX, BatchPlan

FORMATS = {
    "text": [{"text": s} for s in SENTENCES[:4]],
    "prompt_completion": [{"prompt": "Question: how many legs?\n", "completion": s} for s in SENTENCES[:4]],
    "messages": [
        {"messages": [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": s}]}
        for s in SENTENCES[:4]
    ],
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_trains_on_the_right_tokens(tmp_path, tiny_tokenizer, fmt):
    trainer = make_trainer(
        tmp_path,
        tiny_tokenizer,
        Dataset.from_list(FORMATS[fmt]),
        loss_chunk_tokens=3,
        assistant_only_loss=fmt == "messages",
    )
    tok = trainer.processing_class
    row = trainer.train_dataset[0]
    trained_text = tok.decode([t for t in row["labels"] if t != IGNORE_INDEX])
    # text: every token; prompt-completion: the completion only (auto completion_only_loss);
    # messages + assistant_only_loss: the assistant turn only (the template's "assistant:" and
    # the user turn are not trained). EOS closes each trained span.
    assert trained_text.strip() == SENTENCES[0] + tok.eos_token
    if fmt != "text":
        assert row["labels"][0] == IGNORE_INDEX

    batch = trainer.run.to_device(trainer.collator([trainer.train_dataset[i] for i in range(3)]))
    loss_sum, stats, _ = trainer.compute_loss(trainer.model, batch)
    # Chunks of 3 trained tokens through the lm_head == one full-logits cross-entropy.
    torch.testing.assert_close(loss_sum, reference_loss_sum(trainer.model, batch), rtol=1e-5, atol=1e-5)
    assert stats["count"] == (batch["labels"][:, 1:] != IGNORE_INDEX).sum()

    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    logged = read_metrics(tmp_path / "run")
    assert [m["step"] for m in logged] == [1, 2]
    for key in ("loss", "lr", "grad_norm", "num_tokens", "mean_token_accuracy", "entropy", "epoch"):
        assert torch.isfinite(torch.tensor(float(logged[-1][key]))), key
    assert logged[-1]["num_tokens"] > logged[0]["num_tokens"] > 0
    assert 0.0 <= logged[-1]["mean_token_accuracy"] <= 1.0


def test_completion_only_loss_false_trains_on_the_prompt_too(tmp_path, tiny_tokenizer):
    trainer = make_trainer(
        tmp_path,
        tiny_tokenizer,
        Dataset.from_list(FORMATS["prompt_completion"]),
        completion_only_loss=False,
        max_steps=1,
    )
    assert all(t != IGNORE_INDEX for t in trainer.train_dataset[0]["labels"])


def test_wrapped_packing_fills_max_length_rows(tmp_path, tiny_tokenizer):
    trainer = make_trainer(
        tmp_path,
        tiny_tokenizer,
        Dataset.from_list([{"text": s} for s in SENTENCES]),
        packing=True,
        packing_strategy="wrapped",
        max_length=16,
        max_steps=1,
    )
    lengths = [len(r["input_ids"]) for r in trainer.train_dataset]
    assert lengths[:-1] == [16] * (len(lengths) - 1) and sum(lengths) > 16 * 4
    assert "position_ids" not in trainer.train_dataset.column_names  # wrapped: attention crosses examples
    trainer.train()
    assert config(tmp_path, packing=True).packing_strategy == "bfd"  # TRL's default strategy
    with pytest.raises(ConfigError, match="packing_strategy"):
        config(tmp_path, packing=True, packing_strategy="first_fit")


def test_dft_loss_weights_tokens_by_probability(tmp_path, tiny_tokenizer):
    trainer = make_trainer(tmp_path, tiny_tokenizer, Dataset.from_list(FORMATS["text"]), loss_type="dft")
    batch = trainer.collator([trainer.train_dataset[i] for i in range(2)])
    loss_sum, stats, _ = trainer.compute_loss(trainer.model, batch)
    logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    labels = batch["labels"][:, 1:]
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    keep = labels != IGNORE_INDEX
    torch.testing.assert_close(loss_sum, -(logp.exp() * logp)[keep].sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats["nll"], -logp[keep].sum(), rtol=1e-5, atol=1e-5)


def test_sft_lowers_held_out_loss_and_saved_model_reloads(tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    # The held-out sentences share the training sentences' structure, not their exact text.
    train = Dataset.from_list(
        [{"text": f"the sea is blue and the dog is {w}."} for w in ["good", "calm", "wide", "true"] * 4]
    )
    held_out = Dataset.from_list([{"text": f"the sea is blue and the dog is {w}."} for w in ["blue", "little"]])
    trainer = make_trainer(
        tmp_path,
        tiny_tokenizer,
        train,
        held_out,
        max_steps=30,
        learning_rate=3e-3,
        per_device_train_batch_size=4,
        logging_steps=10,
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = read_metrics(tmp_path / "run")[-1]
    assert after["step"] == 30 and "eval_loss" in after and "eval_mean_token_accuracy" in after
    assert after["eval_loss"] < before - 1.0

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    ids = torch.tensor([tiny_tokenizer("the sea is blue and the dog is calm.").input_ids])
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits)


def test_gradient_accumulation_matches_one_big_batch(tmp_path, tiny_tokenizer):
    # Sentences of very different lengths: per-micro-batch means would weight tokens unequally.
    # adam_epsilon=1 makes the update a smooth function of the gradient; with the default 1e-8,
    # Adam turns float-rounding noise on near-zero gradients into lr-sized steps.
    train = Dataset.from_list([{"text": s} for s in SENTENCES])
    common = dict(max_steps=2, learning_rate=0.1, adam_epsilon=1.0, max_grad_norm=None)
    small = make_trainer(
        tmp_path,
        tiny_tokenizer,
        train,
        name="ga4",
        per_device_train_batch_size=1,
        gradient_accumulation_steps=4,
        **common,
    )
    big = make_trainer(
        tmp_path,
        tiny_tokenizer,
        train,
        name="ga1",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        **common,
    )
    initial = [p.detach().clone() for p in small.model.parameters()]
    small.train()
    big.train()
    assert max((a - b).abs().max() for a, b in zip(small.model.parameters(), initial)) > 1e-3
    for (name, a), b in zip(small.model.named_parameters(), big.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)
    # Both runs log the same token-weighted loss.
    loss_small = [m["loss"] for m in read_metrics(tmp_path / "ga4")]
    loss_big = [m["loss"] for m in read_metrics(tmp_path / "ga1")]
    assert loss_small == pytest.approx(loss_big, abs=1e-5)


def test_resume_is_bitwise_identical(tmp_path, tiny_tokenizer):
    # Dropout on, so the resumed run must also restore the RNG to match.
    train = Dataset.from_list([{"text": s} for s in SENTENCES])
    common = dict(max_steps=4, save_steps=2, model_kwargs={"attention_dropout": 0.3})
    straight = make_trainer(tmp_path, tiny_tokenizer, train, name="straight", **common)
    straight.train()
    assert (tmp_path / "straight" / "checkpoint-2").is_dir()

    torch.manual_seed(1234)  # a different global RNG state than the interrupted run had
    resumed = make_trainer(
        tmp_path,
        tiny_tokenizer,
        train,
        name="resumed",
        model_seed=7,
        resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"),
        **common,
    )
    assert resumed.run.global_step == 2
    # trainer.state comes back from the checkpoint: the step, its epoch, the log history so far.
    assert resumed.state.global_step == 2 and resumed.state.epoch == 0.5
    assert resumed.state.log_history == straight.state.log_history[:2]
    resumed.train()
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    straight_logs = read_metrics(tmp_path / "straight")
    resumed_logs = read_metrics(tmp_path / "resumed")
    assert [m["step"] for m in resumed_logs] == [3, 4]
    assert resumed_logs == straight_logs[2:]
    # The whole history but the summary (its runtime differs) equals the uninterrupted run's.
    assert resumed.state.log_history[:-1] == straight.state.log_history[:-1]


def test_batch_plan_is_a_function_of_the_step():
    plan = BatchPlan(10, 2, 2, seed=3, num_train_epochs=2)
    assert plan.steps_per_epoch == 3 and plan.total_steps == 6
    epoch0 = [i for s in range(3) for mb in plan.micro_batches(s) for i in mb]
    assert sorted(epoch0) == list(range(10))
    assert plan.micro_batches(2) == [plan.order(0)[8:10]]  # the epoch's last step is shorter
    assert plan.order(1) != plan.order(0)
    ranks = [BatchPlan(10, 2, 1, seed=3, num_train_epochs=1, world_size=2, rank=r) for r in (0, 1)]
    assert ranks[0].micro_batches(0) + ranks[1].micro_batches(0) != []
    covered = sorted(i for r in ranks for s in range(r.total_steps) for mb in r.micro_batches(s) for i in mb)
    assert covered == list(range(10))


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="truncation_mode"):
        SFTConfig(output_dir=str(tmp_path), truncation_mode="middle")
    with pytest.raises(ConfigError, match="loss_type"):
        SFTConfig(output_dir=str(tmp_path), loss_type="mse")
    with pytest.raises(ConfigError, match="model_init_kwargs"):
        SFTConfig(output_dir=str(tmp_path), model_init_kwargs="{not json")
    assert SFTConfig(output_dir=str(tmp_path), model_init_kwargs='{"revision": "main"}').model_init_kwargs == {
        "revision": "main"
    }
    defaults = SFTConfig()
    assert (defaults.learning_rate, defaults.max_length, defaults.truncation_mode, defaults.dataset_text_field) == (
        2e-5,
        1024,
        "keep_start",
        "text",
    )
    assert defaults.completion_only_loss is None and defaults.packing is False and defaults.logging_steps == 10


def test_refuses_to_overwrite_a_finished_run(tmp_path, tiny_tokenizer):
    train = Dataset.from_list(FORMATS["text"])
    make_trainer(tmp_path, tiny_tokenizer, train, max_steps=1).train()
    with pytest.raises(ConfigError, match="overwrite_output_dir"):
        make_trainer(tmp_path, tiny_tokenizer, train, max_steps=1)
    make_trainer(tmp_path, tiny_tokenizer, train, max_steps=1, overwrite_output_dir=True)


def test_cli_sft(tmp_path, tiny_tokenizer, tiny_policy_dir):
    from transformers import AutoModelForCausalLM

    from posttrain.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": "Q: hi? ", "completion": s}) + "\n" for s in SENTENCES))
    out = tmp_path / "cli"
    code = main(
        [
            *train_argv("sft", tiny_policy_dir, data, out),
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "2",
            "--learning_rate",
            "1e-3",
            "--logging_steps",
            "1",
            "--report_to",
            "none",
        ]
    )
    assert code == 0
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == len(tiny_tokenizer)
    # A second run into the same folder is refused with a message, not a traceback.
    assert (
        main(
            [
                *train_argv("sft", tiny_policy_dir, data, out),
                "--max_steps",
                "1",
            ]
        )
        == 2
    )


def test_args_none_names_the_output_dir_after_the_model_and_loads_its_tokenizer(tmp_path, monkeypatch, tiny_policy_dir):
    """TRL's conveniences: args=None gives SFTConfig(output_dir="<model name>-SFT"); a model given as
    a path (or an object loaded from one) brings its tokenizer when processing_class is None."""
    from posttrain.models import load_policy

    monkeypatch.chdir(tmp_path)
    train = Dataset.from_dict({"text": SENTENCES})
    by_path = SFTTrainer(str(tiny_policy_dir), train_dataset=train)
    assert isinstance(by_path.args, SFTConfig)
    assert by_path.args.output_dir == f"{tiny_policy_dir.name}-SFT"
    assert by_path.processing_class.get_vocab() == load_policy_tokenizer_vocab(tiny_policy_dir)
    by_object = SFTTrainer(load_policy(tiny_policy_dir), train_dataset=train)
    assert by_object.args.output_dir == f"{tiny_policy_dir.name}-SFT"


def load_policy_tokenizer_vocab(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path)).get_vocab()
