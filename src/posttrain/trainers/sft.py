"""Supervised fine-tuning (step 1 of RLHF): next-token cross-entropy on the tokens worth learning.

    for each optimizer step:
        micro-batches  <- the step's examples (BatchPlan), right-padded
        N              <- trained tokens in the whole accumulated batch, summed over ranks
        for each micro-batch:
            h          <- last hidden states (one forward; lm_head on the last position only)
            loss_sum   <- Σ_trained −log softmax(lm_head(h_t))[y_{t+1}]   (lm_head in chunks)
            backward(loss_sum / N)
        clip, AdamW step, schedule step; log / evaluate / save when due

Which tokens are trained (data.prepare_sft_dataset marks them in `labels`, −100 elsewhere):
every token of `text`; the completion of prompt-completion data (completion_only_loss, on by
default for that format); every token of `messages`, or only the assistant turns with
assistant_only_loss. Padding is never trained on: masks come from lengths.

Packing ("bfd" / "bfd_split", data.prepare_sft_dataset) and padding_free put several sequences in
one row. Their `position_ids` restart at 0 for each sequence; the forward turns them into a
block-diagonal causal mask (sdpa / eager) or hands them to flash-attention's varlen path, and the
first token of each sequence is no target, so every sequence's loss equals its loss alone.

The loss is TRL's "chunked_nll" (trl-notes §8): the full (B, T, V) float32 logits never exist.
The model runs once with `logits_to_keep=1`, the lm_head is applied only to the hidden states of
trained positions, chunk by chunk, each chunk under activation checkpointing so its logits are
recomputed in backward instead of kept alive.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from posttrain import checkpoint as ckpt
from posttrain import distributed as dist
from posttrain.configs import ConfigError
from posttrain.health import oom_advice
from posttrain.losses import chunked_nll
from posttrain.models import apply_peft
from posttrain.ops import entropy_from_logits, lengths_to_mask, selective_log_softmax
from posttrain.tracking import MetricAccumulator
from posttrain.trainers.sft_config import SFTConfig
from posttrain.trainers.supervised import (
    IGNORE_INDEX,
    SupervisedRun,
    begin_supervised,
    check_output_dir,
    eval_shards,
    pad_right,
    rows,
)


def _labels_of(row: dict) -> list[int]:
    """Labels of a prepared row, or of a pre-tokenized one (skip_prepare_dataset): `labels`, else
    input_ids masked by `completion_mask` / `assistant_masks` when present, else every token."""
    if "labels" in row:
        return row["labels"]
    ids = row["input_ids"]
    for key in ("completion_mask", "assistant_masks"):
        if key in row and row[key] is not None:
            return [t if m else IGNORE_INDEX for t, m in zip(ids, row[key])]
    return list(ids)


def _positions_of(row: dict) -> list[int]:
    """Per-token positions restarting at 0 for every sequence of a row: `position_ids` of a
    BFD-packed row, else built from its `seq_lengths`, else one sequence 0..n-1."""
    if row.get("position_ids") is not None:
        return list(row["position_ids"])
    if row.get("seq_lengths") is not None:
        return [p for n in row["seq_lengths"] for p in range(n)]
    return list(range(len(row["input_ids"])))


class SFTCollator:
    """Right-pads `input_ids` and `labels`; the attention mask comes from the lengths.

    Rows holding several sequences (BFD packing: `position_ids` / `seq_lengths`) and every
    batch with `padding_free` also get `position_ids` (B, T) restarting at 0 for each sequence,
    from which the forward builds attention that stays inside each sequence. `padding_free`
    concatenates the micro-batch into a single row (B = 1; TRL's padding-free), so no pad token is
    computed at all (unless pad_to_multiple_of asks for some). Padding positions count 0, 1, ...
    as a sequence of their own, so they never join the last real sequence.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None, padding_free: bool = False) -> None:
        self.pad_token_id, self.pad_to_multiple_of, self.padding_free = pad_token_id, pad_to_multiple_of, padding_free

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        ids = [list(e["input_ids"]) for e in examples]
        labels = [list(_labels_of(e)) for e in examples]
        multi = self.padding_free or any(
            e.get("position_ids") is not None or e.get("seq_lengths") is not None for e in examples
        )
        if not multi:
            input_ids, lengths = pad_right(ids, self.pad_token_id, self.pad_to_multiple_of)
            padded_labels, _ = pad_right(labels, IGNORE_INDEX, self.pad_to_multiple_of)
            return {
                "input_ids": input_ids,  # (B, T)
                "attention_mask": lengths_to_mask(lengths, input_ids.size(1)).long(),  # (B, T)
                "labels": padded_labels,  # (B, T), −100 on untrained and padded positions
            }
        positions = [_positions_of(e) for e in examples]
        if self.padding_free:
            ids, labels, positions = ([[t for row in part for t in row]] for part in (ids, labels, positions))
        input_ids, lengths = pad_right(ids, self.pad_token_id, self.pad_to_multiple_of)
        padded_labels, _ = pad_right(labels, IGNORE_INDEX, self.pad_to_multiple_of)
        width = input_ids.size(1)
        position_ids = torch.arange(width).repeat(len(ids), 1)  # padding: a sequence of its own
        for row, (pos, n) in enumerate(zip(positions, lengths.tolist())):
            position_ids[row, :n] = torch.as_tensor(pos, dtype=torch.long)
            position_ids[row, n:] -= n
        # The first token of a sequence is predicted by nothing of its own sequence: without this
        # it would be the target of the previous sequence's last token (labels are shifted in the loss).
        padded_labels[position_ids == 0] = IGNORE_INDEX
        return {
            "input_ids": input_ids,  # (B, T); B = 1 with padding_free
            "attention_mask": lengths_to_mask(lengths, width).long(),  # (B, T), real tokens (counts only)
            "labels": padded_labels,  # (B, T)
            "position_ids": position_ids,  # (B, T), 0 at the start of every sequence
        }


def packed_attention_inputs(
    position_ids: torch.Tensor, attn_implementation: str | None, dtype: torch.dtype
) -> dict[str, torch.Tensor | None]:
    """Model inputs that keep each packed sequence to itself, from `position_ids` (B, T) that
    restart at 0 at every sequence start.

    sdpa and eager get an explicit block-diagonal causal mask (B, 1, T, T), which transformers
    passes through as is: boolean (True = attend) for sdpa, additive float (0 / dtype min) for eager,
    which adds it to the scores. Memory grows as T², so long padding-free rows want flash
    attention. Other implementations (flash-attention, flex) take no mask and only `position_ids`:
    transformers then finds the sequence starts from the restarts itself (varlen kernels).
    """
    if attn_implementation not in ("sdpa", "eager"):
        return {"attention_mask": None, "position_ids": position_ids}
    seq = (position_ids == 0).cumsum(-1)  # (B, T): sequence index of every token
    width = position_ids.size(1)
    causal = torch.ones(width, width, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (seq[:, :, None] == seq[:, None, :]) & causal  # (B, T, T), query × key
    if attn_implementation == "sdpa":
        mask = allowed[:, None]
    else:
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
    return {"attention_mask": mask, "position_ids": position_ids}


def num_trained_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens with a next-token target: labels are predicted from the previous position."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


class SFTTrainer:
    """TRL-compatible supervised fine-tuning trainer (no transformers.Trainer underneath).

    model: a causal LM or its path / hub name. peft_config: a peft.LoraConfig to train LoRA adapters
    only (the saved model is then the adapter; merge with `merge_and_unload`). train_dataset / eval_dataset:
    `datasets.Dataset` in text (`dataset_text_field`), `messages` or prompt-completion format, or pre-tokenized
    (`input_ids`, optional `labels` / `completion_mask`) with dataset_kwargs skip_prepare_dataset.
    """

    def __init__(
        self,
        model: nn.Module | str,
        args: SFTConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        *,
        accelerator: Any = None,
        peft_config: Any = None,
    ) -> None:
        args, self.accelerator, model, self.processing_class = begin_supervised(
            model, args, SFTConfig, "SFT", train_dataset, processing_class, accelerator, kind="causal_lm"
        )
        self.args = args
        model = apply_peft(model, peft_config)
        self.train_dataset = self._prepare(train_dataset, args.packing, "train_dataset")
        self.eval_dataset = (
            self._prepare(
                eval_dataset, args.packing if args.eval_packing is None else args.eval_packing, "eval_dataset"
            )
            if eval_dataset is not None
            else None
        )
        self.collator = SFTCollator(self.processing_class.pad_token_id, args.pad_to_multiple_of, args.padding_free)
        self.run = SupervisedRun(
            args,
            model,
            self.processing_class,
            self.train_dataset,
            accelerator=self.accelerator,
            activation_offloading=args.activation_offloading,
        )
        self._forward_kwargs = _forward_kwargs(self.run.unwrapped(), args.router_aux_loss_coef)

    @property
    def model(self) -> nn.Module:
        return self.run.model

    def _prepare(self, dataset: Any, packing: bool, source: str) -> Any:
        from posttrain.data import detect_format, prepare_sft_dataset

        if (self.args.dataset_kwargs or {}).get("skip_prepare_dataset") or (
            hasattr(dataset, "column_names") and detect_format(dataset, self.args.dataset_text_field) == "tokenized"
        ):
            return dataset
        if self.args.shuffle_dataset and source == "train_dataset":
            dataset = dataset.shuffle(seed=self.args.seed)
        with dist.main_process_first(self.accelerator):
            return prepare_sft_dataset(
                dataset,
                self.processing_class,
                self.args.max_length,
                dataset_text_field=self.args.dataset_text_field,
                completion_only_loss=self.args.completion_only_loss,
                assistant_only_loss=self.args.assistant_only_loss,
                truncation=self.args.truncation_mode,
                packing=packing,
                packing_strategy=self.args.packing_strategy,
                source=source,
            )

    # -- the loss ---------------------------------------------------------------------------
    def compute_loss(
        self, model: nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
        """(Σ of the per-token loss over trained tokens, not divided; statistics as sums over
        those tokens plus their `count`; the model's router aux loss or None)."""
        bare = dist.unwrap(model, self.accelerator)
        if "position_ids" in batch:
            attention = packed_attention_inputs(
                batch["position_ids"], bare.config._attn_implementation, bare.get_input_embeddings().weight.dtype
            )
        else:
            attention = {"attention_mask": batch["attention_mask"]}
        out = model(input_ids=batch["input_ids"], **attention, **self._forward_kwargs)
        hidden = out.hidden_states[-1][:, :-1]  # (B, T-1, H): position t predicts token t+1
        # Packed rows: the collator already hid each sequence's first token from the loss.
        targets = batch["labels"][:, 1:]  # (B, T-1)
        trained = targets != IGNORE_INDEX
        h, y = hidden[trained], targets[trained]  # (N, H), (N,)
        lm_head = bare.get_output_embeddings()
        softcap = getattr(bare.config, "final_logit_softcapping", None)
        # The 0-weighted logits keep every parameter in the graph when no token is trained here,
        # so DDP's gradient hooks still fire on this rank.
        loss_sum = out.logits.sum() * 0.0
        stats = {k: torch.zeros((), device=hidden.device) for k in ("loss", "nll", "correct", "entropy")}
        chunk = self.args.loss_chunk_tokens
        for start in range(0, y.numel(), chunk):
            part = checkpoint(
                _chunk_loss,
                lm_head,
                h[start : start + chunk],
                y[start : start + chunk],
                self.args.loss_type,
                softcap,
                use_reentrant=False,
            )
            loss_sum = loss_sum + part[0]
            for key, value in zip(("nll", "correct", "entropy"), part[1:]):
                stats[key] = stats[key] + value
        stats["loss"] = loss_sum.detach()
        stats["count"] = torch.tensor(float(y.numel()), device=hidden.device)
        return loss_sum, stats, getattr(out, "aux_loss", None)

    # -- training ---------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Train to max_steps / num_train_epochs, evaluate, save the final model; returns the last logged metrics."""
        run = self.run
        with ckpt.OutputDirGuard(self.args.output_dir, is_main=run.is_main), oom_advice():
            run.model.train()
            for batches in run.steps(self.collator):
                (n_trained,) = run.global_counts(sum(num_trained_tokens(b) for b in batches))
                normaliser = run.normaliser(n_trained)
                for _, batch in run.micro_steps(batches):
                    loss_sum, stats, aux_loss = self.compute_loss(run.model, batch)
                    loss = loss_sum / normaliser
                    if aux_loss is not None and self.args.router_aux_loss_coef:
                        # The aux loss is a per-micro-batch mean: averaging it over micro-batches
                        # (and over ranks by DDP) weights every micro-batch equally.
                        loss = loss + self.args.router_aux_loss_coef * aux_loss / len(batches)
                        run.metrics.add_value("aux_loss", aux_loss)
                    run.backward(loss)
                    self._add_metrics(run.metrics, stats, "")
                    run.metrics.add_sum("num_tokens", batch["attention_mask"].sum())
                run.end_step(evaluate=self.evaluate if self.eval_dataset is not None else None)
            self.save_model()
        run.close()
        return run.last_logged or {}

    def _add_metrics(self, metrics: MetricAccumulator, stats: dict, prefix: str) -> None:
        metrics.add(f"{prefix}loss", stats["loss"], stats["count"])
        metrics.add(f"{prefix}mean_token_accuracy", stats["correct"], stats["count"])
        metrics.add(f"{prefix}entropy", stats["entropy"], stats["count"])

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Token-weighted eval loss (NLL), mean token accuracy and entropy over the whole eval set."""
        if self.eval_dataset is None:
            raise ConfigError("evaluate() needs an eval_dataset.")
        run, model = self.run, self.run.model
        was_training = model.training
        model.eval()
        metrics = MetricAccumulator()
        for indices, counts in eval_shards(
            len(self.eval_dataset), self.args.per_device_eval_batch_size, self.accelerator
        ):
            examples = rows(self.eval_dataset, indices)
            # Repeats that only keep ranks in step are not scored. Masked per example, before
            # collation, because a padding-free batch is a single row.
            examples = [
                e if keep else {**e, "labels": [IGNORE_INDEX] * len(e["input_ids"])}
                for e, keep in zip(examples, counts.tolist())
            ]
            batch = run.to_device(self.collator(examples))
            with run.autocast():
                _, stats, _ = self.compute_loss(model, batch)
            self._add_metrics(metrics, stats, "eval_")
            metrics.add_sum(
                "eval_num_tokens", sum(len(e["input_ids"]) for e, keep in zip(examples, counts.tolist()) if keep)
            )
        values = metrics.reduce(self.accelerator)
        run.tracker.log(values, step=run.global_step)
        model.train(was_training)
        return values

    def save_model(self, output_dir: str | None = None) -> None:
        """Save model + tokenizer with save_pretrained (safetensors) into output_dir."""
        self.run.save_final(output_dir)


def _chunk_loss(
    lm_head: nn.Module, h: torch.Tensor, y: torch.Tensor, loss_type: str, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss sum, NLL sum, correct predictions, entropy sum) of one chunk of trained positions."""
    logits = lm_head(h).float()  # (n, V): the only float32 logits alive at a time
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if loss_type == "dft":
        # Dynamic Fine-Tuning (Wu et al. 2025): each token's NLL weighted by its own probability,
        # detached, which damps the gradient of tokens the model finds very unlikely.
        logp = selective_log_softmax(logits, y)
        loss = -(logp.detach().exp() * logp).sum()
        nll = -logp.detach().sum()
    else:
        loss, _ = chunked_nll(logits, y, normalizer=1.0)
        nll = loss.detach()
    with torch.no_grad():
        correct = (logits.argmax(-1) == y).float().sum()
        entropy = entropy_from_logits(logits).sum()
    return loss, nll, correct, entropy


def _forward_kwargs(model: nn.Module, router_aux_loss_coef: float) -> dict[str, Any]:
    """Ask for the last hidden states and skip the full-vocabulary logits where the model allows."""
    kwargs: dict[str, Any] = {"output_hidden_states": True, "use_cache": False}
    params = inspect.signature(model.forward).parameters
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    if router_aux_loss_coef and hasattr(model.config, "output_router_logits") and "output_router_logits" in params:
        kwargs["output_router_logits"] = True
    return kwargs


def run(config: SFTConfig) -> int:
    """`posttrain sft`: load tokenizer, model and data from the config, train, save. Exit code."""
    from posttrain.data import DataError
    from posttrain.models import peft_config_from
    from posttrain.trainers.online import load_split

    try:
        check_output_dir(config)
        if not config.model_name_or_path:
            raise ConfigError("model_name_or_path is not set: pass --model_name_or_path (a folder or a hub name).")
        train_dataset = load_split(config, config.dataset_train_split)
        eval_dataset = load_split(config, config.dataset_test_split, required=False)
        trainer = SFTTrainer(
            config.model_name_or_path,
            args=config,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            peft_config=peft_config_from(config),
        )
        trainer.train()
    except (ConfigError, DataError, ckpt.CheckpointError) as err:
        print(f"posttrain sft: {err}", file=sys.stderr)
        return 2
    return 0
