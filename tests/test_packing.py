"""SFT packing: best-fit decreasing (bfd, bfd_split), per-sequence position ids, block-diagonal
attention, padding-free batches, and losses that equal each sequence's loss on its own."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch
from datasets import Dataset

from helpers import SENTENCES, sft_trainer
from posttrain.data import SFTCollator, best_fit_decreasing, pack_dataset, prepare_sft_dataset, truncate_dataset
from posttrain.data.packing import first_fit_decreasing
from posttrain.testing import build_tiny_causal_lm
from posttrain.trainers.sft import num_trained_tokens, packed_attention_inputs


def naive_bfd(lengths, capacity):
    """Reference: scan every bin for the tightest fit (ties: lowest bin number)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins, free = [], []
    for i in order:
        fits = [b for b in range(len(bins)) if free[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (free[b], b))
        else:
            b = len(bins)
            bins.append([])
            free.append(capacity)
        bins[b].append(i)
        free[b] -= lengths[i]
    return bins


def sequences_of(row):
    """Split a packed row into its sequences (input_ids, labels) using seq_lengths."""
    out, start = [], 0
    for n in row["seq_lengths"]:
        out.append((row["input_ids"][start : start + n], row["labels"][start : start + n]))
        start += n
    return out


# --------------------------------------------------------------------------------------------
# best-fit decreasing
# --------------------------------------------------------------------------------------------


def test_best_fit_decreasing_hand_example():
    # capacity 10, lengths [1, 7, 5, 4] -> placed 7, 5, 4, 1:
    #   7 -> new bin 0 (free 3); 5 -> new bin 1 (free 5); 4 -> bin 1 (free 1);
    #   1 -> fits bin 0 (free 3) and bin 1 (free 1): best fit is bin 1 (first fit would pick bin 0).
    assert best_fit_decreasing([1, 7, 5, 4], 10) == [[1], [2, 3, 0]]
    # Equal free space: the oldest bin wins; equal lengths keep their order.
    assert best_fit_decreasing([6, 6, 3, 3], 10) == [[0, 2], [1, 3]]
    assert best_fit_decreasing([], 4) == []
    with pytest.raises(ValueError, match="capacity"):
        best_fit_decreasing([5], 4)


def test_best_fit_decreasing_matches_the_bin_scanning_reference():
    rng = random.Random(0)
    for _ in range(300):
        capacity = rng.randint(1, 16)
        lengths = [rng.randint(1, capacity) for _ in range(rng.randint(0, 30))]
        assert best_fit_decreasing(lengths, capacity) == naive_bfd(lengths, capacity), (lengths, capacity)


def test_best_fit_decreasing_at_scale_places_everything_and_fills_bins():
    rng = random.Random(1)
    capacity = 1024
    lengths = [rng.randint(1, capacity) for _ in range(20_000)]
    bins = best_fit_decreasing(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    lower_bound = -(-sum(lengths) // capacity)
    assert len(bins) <= 1.01 * lower_bound  # uniform lengths pack almost perfectly


def test_first_fit_decreasing_hand_example_and_reference():
    # the hand example above: the 1 goes to the first bin with room (bin 0), not the fullest (bin 1)
    assert first_fit_decreasing([1, 7, 5, 4], 10) == [[1, 0], [2, 3]]
    # capacity 10, [7, 4, 4, 2]: 7 -> bin 0 (free 3); 4 -> bin 1 (free 6); 4 -> bin 1 (free 2);
    # 2 -> bin 0 (free 3, the first with room), where best fit takes bin 1 (free 2)
    assert first_fit_decreasing([7, 4, 4, 2], 10) == [[0, 3], [1, 2]]
    assert best_fit_decreasing([7, 4, 4, 2], 10) == [[0], [1, 2, 3]]
    assert first_fit_decreasing([], 4) == []
    with pytest.raises(ValueError, match="capacity"):
        first_fit_decreasing([5], 4)
    rng = random.Random(2)
    for _ in range(300):  # against scanning the bins in order
        capacity = rng.randint(1, 16)
        lengths = [rng.randint(1, capacity) for _ in range(rng.randint(0, 30))]
        bins, free = [], []
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            b = next((b for b, room in enumerate(free) if room >= lengths[i]), len(bins))
            if b == len(bins):
                bins.append([])
                free.append(capacity)
            bins[b].append(i)
            free[b] -= lengths[i]
        assert first_fit_decreasing(lengths, capacity) == bins, (lengths, capacity)


def test_pack_dataset_ffd_is_trl_019s_strategy_and_streams():
    """TRL 0.19's pack_dataset(strategy="ffd"): first-fit decreasing, truncation, position ids; also
    on a streaming dataset (as truncate_dataset)."""
    rows = {"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11], [12]], "mask": [[1] * 5, [1] * 2, [1] * 4, [1]]}
    expected = {
        "input_ids": [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7, 12]],
        "mask": [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1]],
        "position_ids": [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 0]],
    }
    assert pack_dataset(Dataset.from_dict(rows), 4, strategy="ffd").to_dict() == expected
    streamed = pack_dataset(Dataset.from_dict(rows).to_iterable_dataset(), 4, strategy="ffd")
    assert next(iter(streamed.batch(batch_size=4))) == expected
    truncated = truncate_dataset(Dataset.from_dict(rows).to_iterable_dataset(), 2)
    assert next(iter(truncated.batch(batch_size=4)))["input_ids"] == [[1, 2], [6, 7], [8, 9], [12]]
    with pytest.raises(ValueError, match="Invalid packing strategy 'first'"):
        pack_dataset(Dataset.from_dict(rows), 4, strategy="first")


# --------------------------------------------------------------------------------------------
# dataset preparation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("truncation", ["keep_start", "keep_end"])
def test_bfd_packs_truncated_sequences_with_restarting_positions(tok, truncation):
    data = Dataset.from_dict({"text": SENTENCES})
    plain = prepare_sft_dataset(data, tok, 20, truncation=truncation)  # truncated, not packed
    assert max(len(ids) for ids in prepare_sft_dataset(data, tok, None)["input_ids"]) > 20
    packed = prepare_sft_dataset(data, tok, 20, truncation=truncation, packing=True)
    assert set(packed.column_names) == {"input_ids", "labels", "position_ids", "seq_lengths"}
    assert len(packed) < len(plain)
    for row in packed:
        assert len(row["input_ids"]) == len(row["labels"]) == sum(row["seq_lengths"]) <= 20
        assert row["position_ids"] == [p for n in row["seq_lengths"] for p in range(n)]
    # Every (truncated) example appears exactly once, whole, with its labels.
    pieces = sorted(s for row in packed for s in sequences_of(row))
    assert pieces == sorted(zip(plain["input_ids"], plain["labels"]))


def test_bfd_split_keeps_every_token_in_max_length_pieces(tok, caplog):
    data = Dataset.from_dict({"text": SENTENCES})
    full = prepare_sft_dataset(data, tok, None)
    assert max(len(ids) for ids in full["input_ids"]) > 12  # some rows need splitting
    with caplog.at_level(logging.WARNING, logger="posttrain.data"):
        packed = prepare_sft_dataset(data, tok, 12, packing=True, packing_strategy="bfd_split")
    assert "truncated" not in caplog.text
    expected = sorted(
        (ids[k : k + 12], labels[k : k + 12])
        for ids, labels in zip(full["input_ids"], full["labels"])
        for k in range(0, len(ids), 12)
    )
    assert sorted(s for row in packed for s in sequences_of(row)) == expected
    assert all(len(row["input_ids"]) <= 12 for row in packed)


# --------------------------------------------------------------------------------------------
# collation and attention
# --------------------------------------------------------------------------------------------


def test_collator_hides_each_sequence_start_from_the_loss(tok):
    a, b, c = ([100 + i for i in range(n)] for n in (3, 2, 4))
    packed_row = {"input_ids": a + b, "labels": a + b, "position_ids": [0, 1, 2, 0, 1], "seq_lengths": [3, 2]}
    plain_row = {"input_ids": c, "labels": c}
    batch = SFTCollator(pad_token_id=0)([packed_row, plain_row])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]  # padding counts on its own
    # b's first token (column 3) is not a target of a's last token; c's pad is not trained.
    assert batch["labels"].tolist() == [[-100, 101, 102, -100, 101], [-100, 101, 102, 103, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert num_trained_tokens(batch) == (3 - 1) + (2 - 1) + (4 - 1)

    free = SFTCollator(pad_token_id=0, pad_to_multiple_of=8, padding_free=True)([packed_row, plain_row])
    assert free["input_ids"].tolist() == [a + b + c + [0, 0, 0, 0, 0, 0, 0]]
    assert free["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]]
    assert num_trained_tokens(free) == num_trained_tokens(batch)
    assert free["attention_mask"].sum() == 9


def test_attention_inputs_per_implementation():
    position_ids = torch.tensor([[0, 1, 0, 1, 2]])
    sdpa = packed_attention_inputs(position_ids, "sdpa", torch.float32)["attention_mask"]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert sdpa.dtype == torch.bool and torch.equal(sdpa[0, 0], expected)
    eager = packed_attention_inputs(position_ids, "eager", torch.float32)["attention_mask"]
    assert torch.equal(eager[0, 0] == 0, expected) and eager.min() == torch.finfo(torch.float32).min
    flash = packed_attention_inputs(position_ids, "flash_attention_2", torch.bfloat16)
    assert flash["attention_mask"] is None and torch.equal(flash["position_ids"], position_ids)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_logits_equal_each_sequence_alone(tiny_tokenizer, arch, attn):
    model = build_tiny_causal_lm(tiny_tokenizer, arch=arch, attn_implementation=attn).eval()
    assert model.config._attn_implementation == attn
    seqs = [tiny_tokenizer(s)["input_ids"] for s in SENTENCES[:3]]
    batch = SFTCollator(tiny_tokenizer.pad_token_id, pad_to_multiple_of=16, padding_free=True)(
        [{"input_ids": s} for s in seqs]
    )
    with torch.no_grad():
        packed = model(
            input_ids=batch["input_ids"], **packed_attention_inputs(batch["position_ids"], attn, torch.float32)
        ).logits[0]
        # Control: plain causal attention over the same row lets later sequences see earlier ones.
        leaky = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            attention_mask=torch.ones_like(batch["input_ids"]),
        ).logits[0]
        start = 0
        for s in seqs:
            alone = model(input_ids=torch.tensor([s])).logits[0]
            torch.testing.assert_close(packed[start : start + len(s)], alone, rtol=1e-5, atol=1e-5)
            start += len(s)
    last = slice(start - len(seqs[-1]), start)
    assert (leaky[last] - packed[last]).abs().max() > 1e-3


def test_position_ids_alone_isolate_sequences_in_transformers(tiny_tokenizer):
    # The flash-attention path passes no mask, only position_ids; transformers' own packed-
    # sequence detection (shared by every attention implementation) must then isolate sequences.
    # It runs only without a KV cache: the SFT forward passes use_cache=False.
    model = build_tiny_causal_lm(tiny_tokenizer).eval()
    seqs = [tiny_tokenizer(s)["input_ids"] for s in SENTENCES[3:6]]
    batch = SFTCollator(tiny_tokenizer.pad_token_id, padding_free=True)([{"input_ids": s} for s in seqs])
    with torch.no_grad():
        masked = model(
            input_ids=batch["input_ids"], **packed_attention_inputs(batch["position_ids"], "sdpa", torch.float32)
        ).logits
        detected = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    torch.testing.assert_close(detected, masked, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# the SFT loss and training
# --------------------------------------------------------------------------------------------


def make_trainer(tmp_path, tokenizer, train, name="run", eval_dataset=None, **overrides):
    return sft_trainer(
        tmp_path, tokenizer, train, eval_dataset, name=name, **{"max_length": 32, "loss_chunk_tokens": 5, **overrides}
    )


def test_bfd_packed_loss_equals_each_sequence_alone(tmp_path, tiny_tokenizer):
    data = Dataset.from_list([{"prompt": "Question: say something.\n", "completion": s} for s in SENTENCES])
    trainer = make_trainer(tmp_path, tiny_tokenizer, data, packing=True, max_length=48)
    assert trainer.args.packing_strategy == "bfd"
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    assert any(len(r["seq_lengths"]) > 1 for r in rows)
    packed = trainer.collator(rows)
    loss_packed, stats_packed, _ = trainer.compute_loss(trainer.model, packed)
    alone = [{"input_ids": ids, "labels": labels} for r in rows for ids, labels in sequences_of(r)]
    assert len(alone) == len(SENTENCES)
    plain = SFTCollator(trainer.processing_class.pad_token_id)(alone)
    assert "position_ids" not in plain
    loss_plain, stats_plain, _ = trainer.compute_loss(trainer.model, plain)
    assert stats_packed["count"] == stats_plain["count"] == num_trained_tokens(packed)
    torch.testing.assert_close(loss_packed, loss_plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats_packed["correct"], stats_plain["correct"])


def test_padding_free_loss_equals_padded_loss(tmp_path, tiny_tokenizer):
    trainer = make_trainer(
        tmp_path, tiny_tokenizer, Dataset.from_list([{"text": s} for s in SENTENCES]), padding_free=True
    )
    examples = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    free = trainer.collator(examples)
    assert free["input_ids"].shape == (1, sum(len(e["input_ids"]) for e in examples))
    padded = SFTCollator(trainer.processing_class.pad_token_id)(examples)
    loss_free, stats_free, _ = trainer.compute_loss(trainer.model, free)
    loss_padded, stats_padded, _ = trainer.compute_loss(trainer.model, padded)
    assert stats_free["count"] == stats_padded["count"]
    torch.testing.assert_close(loss_free, loss_padded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats_free["entropy"], stats_padded["entropy"], rtol=1e-5, atol=1e-5)


def test_padding_free_training_matches_padded_training(tmp_path, tiny_tokenizer):
    # Exact normalization by the global trained-token count makes the updates equal.
    # adam_epsilon=1 keeps Adam from amplifying float noise on near-zero gradients.
    train = Dataset.from_list([{"text": s} for s in SENTENCES])
    held_out = Dataset.from_list([{"text": s} for s in SENTENCES[:3]])
    common = dict(learning_rate=0.1, adam_epsilon=1.0, max_grad_norm=None, per_device_train_batch_size=4)
    free = make_trainer(tmp_path, tiny_tokenizer, train, "free", held_out, padding_free=True, **common)
    padded = make_trainer(tmp_path, tiny_tokenizer, train, "padded", held_out, **common)
    initial = [p.detach().clone() for p in free.model.parameters()]
    free.train()
    padded.train()
    assert max((a - b).abs().max() for a, b in zip(free.model.parameters(), initial)) > 1e-3
    for (name, a), b in zip(free.model.named_parameters(), padded.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)
    logs = {
        k: [json.loads(line) for line in (tmp_path / k / "metrics.jsonl").read_text().splitlines()]
        for k in ("free", "padded")
    }
    for key in ("loss", "eval_loss", "num_tokens", "eval_num_tokens"):
        got = [m[key] for m in logs["free"] if key in m]
        assert got and got == pytest.approx([m[key] for m in logs["padded"] if key in m], abs=1e-5), key


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split"])
def test_packed_training_runs(tmp_path, tiny_tokenizer, strategy):
    train = Dataset.from_list([{"text": s} for s in SENTENCES * 2])
    trainer = make_trainer(
        tmp_path,
        tiny_tokenizer,
        train,
        eval_dataset=Dataset.from_list([{"text": SENTENCES[0]}]),
        packing=True,
        packing_strategy=strategy,
        max_length=16,
    )
    assert all(len(r["input_ids"]) <= 16 for r in trainer.train_dataset)
    assert "seq_lengths" in trainer.eval_dataset.column_names  # eval_packing None: same as packing
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    last = {}
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        last.update(json.loads(line))  # train and eval metrics are separate lines
    for key in ("loss", "eval_loss", "mean_token_accuracy", "entropy", "num_tokens"):
        assert torch.isfinite(torch.tensor(float(last[key]))), key
