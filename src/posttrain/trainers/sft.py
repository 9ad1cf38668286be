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

The loss is computed as TRL's "chunked_nll" loss type does: the full (B, T, V) float32 logits
never exist. The model runs once with `logits_to_keep=1`, the lm_head is applied only to the
hidden states of trained positions, chunk by chunk, each chunk under activation checkpointing so
its logits are recomputed in backward instead of kept alive. loss_type="dft" weights each token's
NLL by its own detached probability (losses.dft_loss; Wu et al. 2025, arXiv:2508.05629).

Callbacks are `transformers.TrainerCallback` objects; `trainer.state` is the run's
`transformers.TrainerState` (supervised.SupervisedRun fires the events).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from posttrain import checkpoint as ckpt
from posttrain import distributed as dist
from posttrain import runtime
from posttrain.configs import ConfigError
from posttrain.data.collators import SFTCollator
from posttrain.health import oom_advice
from posttrain.losses import chunked_nll, dft_loss
from posttrain.models import apply_peft
from posttrain.ops import entropy_from_logits
from posttrain.scoring import resolve_router_aux_loss_coef
from posttrain.tracking import MetricAccumulator
from posttrain.trainers.sft_config import SFTConfig
from posttrain.trainers.supervised import (
    IGNORE_INDEX,
    SupervisedTrainerAPI,
    begin_supervised,
    eval_shards,
    rows,
    run_command,
)

if TYPE_CHECKING:
    from transformers import TrainerCallback
    from transformers.trainer_utils import TrainOutput


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


class SFTTrainer(SupervisedTrainerAPI):
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
        callbacks: list[TrainerCallback] | None = None,
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
        self.data_collator = SFTCollator(self.processing_class.pad_token_id, args.pad_to_multiple_of, args.padding_free)
        self._start_run(model, callbacks)
        resolve_router_aux_loss_coef(args, self.run.unwrapped())  # None: the model config's own
        self._forward_kwargs = _forward_kwargs(self.run.unwrapped(), args.router_aux_loss_coef)

    def _prepare(self, dataset: Any, packing: bool, source: str) -> Any:
        from posttrain.data import detect_format, prepare_sft_dataset

        if (self.args.dataset_kwargs or {}).get("skip_prepare_dataset") or (
            hasattr(dataset, "column_names") and detect_format(dataset, self.args.dataset_text_field) == "tokenized"
        ):
            return dataset
        if self.args.shuffle_dataset and source == "train_dataset":
            dataset = dataset.shuffle(seed=runtime.data_seed(self.args))
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
    def train(self) -> TrainOutput:
        """Train to max_steps / num_train_epochs (or until a callback sets control.should_training_stop),
        evaluate, save the final model; returns TrainOutput(global_step, training_loss, metrics)."""
        run = self.run
        runtime.reuse_freed_memory()
        with ckpt.OutputDirGuard(self.args.output_dir, is_main=run.is_main), oom_advice(), run.linear_kernels():
            run.model.train()
            for batches in run.steps(self.data_collator):
                (n_trained,) = run.global_counts(sum(num_trained_tokens(b) for b in batches))
                normalizer = run.normalizer(n_trained)
                for _, batch in run.micro_steps(batches):
                    loss_sum, stats, aux_loss = self.compute_loss(run.model, batch)
                    loss = loss_sum / normalizer
                    if aux_loss is not None and self.args.router_aux_loss_coef:
                        # The aux loss is a per-micro-batch mean: averaging it over micro-batches
                        # (and over ranks by DDP) weights every micro-batch equally.
                        loss = loss + self.args.router_aux_loss_coef * aux_loss / len(batches)
                        run.metrics.add_value("aux_loss", aux_loss)
                    run.backward(loss)
                    self._add_metrics(run.metrics, stats, "")
                    run.metrics.add_sum("num_tokens", batch["attention_mask"].sum())
                run.end_step()
            if not run.events.preempted:  # enable_jit_checkpoint: a SIGTERM left a checkpoint instead
                run.load_best_model()
                self.save_model()
            output = run.end_training()
        run.close()
        return output

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
            batch = run.to_device(self.data_collator(examples))
            with run.autocast():
                _, stats, _ = self.compute_loss(model, batch)
            self._add_metrics(metrics, stats, "eval_")
            metrics.add_sum(
                "eval_num_tokens", sum(len(e["input_ids"]) for e, keep in zip(examples, counts.tolist()) if keep)
            )
        values = metrics.reduce(self.accelerator)
        run.log_evaluation(values)
        model.train(was_training)
        return values


def _chunk_loss(
    lm_head: nn.Module, h: torch.Tensor, y: torch.Tensor, loss_type: str, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss sum, NLL sum, correct predictions, entropy sum) of one chunk of trained positions."""
    logits = lm_head(h).float()  # (n, V): the only float32 logits alive at a time
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if loss_type == "dft":
        loss, stats = dft_loss(logits, y, normalizer=1.0)
        nll = stats["nll"] * stats["count"]
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


def main(config: SFTConfig) -> int:
    """`posttrain sft`: load tokenizer, model and data from the config, train, save. Exit code."""
    return run_command(SFTTrainer, config)
