"""PPO's classic API: `generate()`, then `step(queries, responses, scores)` with any reward, and
`log_stats()` (TRL 0.7's `PPOTrainer` and its gpt2-sentiment notebook, before `train()` existed).

    trainer = PPOTrainer(config, model, ref_model, tokenizer, dataset=dataset, data_collator=collator)
    for batch in trainer.dataloader:                       # config.batch_size rows
        responses = trainer.generate(batch["input_ids"], return_prompt=False, **generation_kwargs)
        stats = trainer.step(batch["input_ids"], responses, rewards)
        trainer.log_stats(stats, batch, rewards)

The positional order is TRL's (config, model, ref_model, tokenizer, dataset, optimizer,
data_collator, num_shared_layers, lr_scheduler); any mix with keywords works. Unset config fields
take their classic defaults (`PPOConfig.apply_classic_defaults`: init_kl_coef 0.2 adaptive,
learning_rate 1e-5, batch_size 256, mini_batch_size 1, seed 0, no gradient clipping).

`step()` runs steps 3–5 of trainers/ppo.py (advantages, update, KL controller) on one batch of
(query, response, score) triples: the same PolicyAndValue forward, the same loss and the same
non-finite policy as `train()`. The policy is a value-head model (models.CausalLMWithValueHead) and
log-probs are taken at temperature 1. It returns TRL's statistics (STEP_STATS and the *_dist arrays),
reduced over all processes and token-weighted (TRL averages per-minibatch means).

TRL's building blocks are public with TRL's signatures, on the shared math (posttrain.advantages,
posttrain.losses, posttrain.scoring): `batched_forward_pass`, `compute_rewards`, `_kl_penalty`,
`compute_advantages`, `loss`, `train_minibatch`, `_step_safety_checker`, `record_step_stats`,
`gather_stats`, `prepare_dataloader`, `prepare_model_inputs`, `create_model_card`, `save_pretrained`. Their tensors
are completion-aligned, (batch, response_length), as TRL's documentation describes them.

Encoder–decoder policies (T5, BART: value_head.AutoModelForSeq2SeqLMWithValueHead, detected from the
model or set by `PPOConfig.is_encoder_decoder`) follow TRL: queries are the encoder input
(right-padded), generate() returns decoder sequences [decoder_start, t1, …] without the query, and
step() runs `model(input_ids=query, decoder_input_ids=response, ...)` (scoring.seq2seq_completion_forward);
the start token is input only, never trained on (docs/internals.md).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from posttrain import advantages as adv
from posttrain import distributed as dist
from posttrain import runtime
from posttrain.configs import ConfigError
from posttrain.critic import PolicyAndValue
from posttrain.models import CausalLMWithValueHead, disable_dropout
from posttrain.optim import build_optimizer
from posttrain.rollout import generate, generation_mode
from posttrain.scoring import is_encoder_decoder
from posttrain.trainers import classic_io as io
from posttrain.trainers.classic_blocks import ClassicBuildingBlocks, dist_of
from posttrain.trainers.ppo import PPOBatch, PPOTrainer
from posttrain.trainers.ppo_config import PPOConfig

# step() statistics (TRL's names) <- the accumulated metrics they come from.
STEP_STATS = {
    "objective/kl": "objective/kl",
    "objective/entropy": "objective/entropy",
    "objective/logprobs": "objective/logprobs",
    "objective/ref_logprobs": "objective/ref_logprobs",
    "ppo/mean_non_score_reward": "ppo/mean_non_score_reward",
    "ppo/mean_scores": "objective/scores",
    "ppo/mean_rlhf_reward": "objective/rlhf_reward",
    "ppo/loss/policy": "loss/policy_avg",
    "ppo/loss/value": "loss/value_avg",
    "ppo/loss/total": "loss/total_avg",
    "ppo/policy/entropy": "policy/entropy_avg",
    "ppo/policy/approxkl": "policy/approxkl_avg",
    "ppo/policy/policykl": "policy/policykl_avg",
    "ppo/policy/clipfrac": "policy/clipfrac_avg",
    "ppo/policy/advantages_mean": "policy/advantages_mean",
    "ppo/policy/ratio_mean": "val/ratio",
    "ppo/returns/mean": "returns/mean",
    "ppo/returns/var": "returns/var",
    "ppo/val/vpred": "val/vpred",
    "ppo/val/error": "val/error",
    "ppo/val/clipfrac": "val/clipfrac_avg",
    "ppo/val/mean": "val/mean",
    "ppo/val/var": "val/var",
    "ppo/early_stopped": "policy/early_stopped",
    "tokens/queries_len_mean": "tokens/queries_len_mean",
    "tokens/responses_len_mean": "tokens/responses_len_mean",
}
# Keywords only the classic constructor takes (the on-policy one takes args=, processing_class=, ...).
CLASSIC_KEYWORDS = {"config", "tokenizer", "dataset", "optimizer", "num_shared_layers", "lr_scheduler"}


def is_classic_call(args: tuple, kwargs: dict) -> bool:
    """Whether `PPOTrainer(...)` is the classic constructor: a classic-only keyword, or a model
    module second positionally (the on-policy order has the tokenizer there)."""
    if any(kwargs.get(k) is not None for k in CLASSIC_KEYWORDS):
        return True
    return len(args) > 1 and isinstance(args[1], nn.Module)


class ClassicPPOTrainer(ClassicBuildingBlocks, PPOTrainer):
    """`PPOTrainer(config, model, ref_model=None, tokenizer, dataset=None, optimizer=None,
    data_collator=None, num_shared_layers=None, lr_scheduler=None)`; see the module docstring."""

    @property
    def model(self) -> nn.Module:
        """The policy with its value head, as TRL 0.11's PPOTrainer.model."""
        return self.policy_model

    def __init__(
        self,
        config: PPOConfig | None = None,
        model: nn.Module | None = None,
        ref_model: nn.Module | None = None,
        tokenizer: Any = None,
        dataset: Any = None,
        optimizer: Any = None,
        data_collator: Callable | None = None,
        num_shared_layers: int | None = None,
        lr_scheduler: Any = None,
        *,
        args: PPOConfig | None = None,
        processing_class: Any = None,
    ) -> None:
        if args is not None:
            raise ConfigError("pass either args= (train() API) or config= (generate()/step() API), not both.")
        if not isinstance(config, PPOConfig):
            raise ConfigError(f"PPOTrainer needs a PPOConfig as args= (or config=), got {type(config).__name__}.")
        if model is None:
            raise ConfigError(
                "model is required: the policy (a causal LM, an AutoModelForCausalLMWithValueHead, or an "
                "encoder-decoder LM / AutoModelForSeq2SeqLMWithValueHead)."
            )
        tokenizer = processing_class if processing_class is not None else tokenizer
        if tokenizer is None:
            raise ConfigError("a tokenizer is required: pass processing_class= (or tokenizer= with config=).")
        from posttrain.models import ensure_pad_token
        from posttrain.value_head import AutoModelForSeq2SeqLMWithValueHead, create_reference_model, share_layers

        self.config = self.args = config.apply_classic_defaults()
        self.processing_class = self.tokenizer = ensure_pad_token(tokenizer)
        self.callbacks, self.log_history = [], []
        self.running = adv.RunningMoments()
        self.kl_ctl = self.kl_controller(config)
        self.run = io.StepRun(config)
        self.accelerator, self.device = self.run.accelerator, self.run.device
        self.current_device = self.device
        self.temperature = 1.0  # the classic step() scores logprobs at temperature 1
        self.current_step = 0
        self.is_encoder_decoder = detected = is_encoder_decoder(model)
        if config.is_encoder_decoder is not None and config.is_encoder_decoder != detected:
            raise ConfigError(
                f"config.is_encoder_decoder={config.is_encoder_decoder} but the model is "
                f"{'an encoder-decoder' if detected else 'a causal'} LM; leave it None to detect it."
            )
        head_cls = AutoModelForSeq2SeqLMWithValueHead if detected else CausalLMWithValueHead
        vh = model if isinstance(model, head_cls) else head_cls(model)
        if isinstance(ref_model, head_cls):
            ref_model = ref_model.pretrained_model
        if config.disable_dropout:
            disable_dropout(vh)
        if ref_model is not None and is_encoder_decoder(ref_model) != detected:
            raise ConfigError("ref_model must have the policy's architecture (both causal or both encoder-decoder).")
        self.is_peft_model = hasattr(vh.pretrained_model, "disable_adapter")
        if ref_model is None and not self.is_peft_model:
            if detected:  # create_reference_model shares layers by name (e.g. BART's model.decoder.layers.N)
                ref_model = create_reference_model(vh.pretrained_model, num_shared_layers=num_shared_layers)
            else:
                ref_model = copy.deepcopy(vh.pretrained_model)
                if num_shared_layers:
                    share_layers(vh.pretrained_model, ref_model, num_shared_layers)
        elif num_shared_layers is not None:  # TRL warns and goes on with two unshared models
            warnings.warn(
                f"num_shared_layers={num_shared_layers} is ignored: it applies only when the trainer creates the "
                "reference model (ref_model=None); the given ref_model and the policy share no layers.",
                UserWarning,
                stacklevel=2,
            )
        config.set_runtime(self.run.world_size, detected, self.is_peft_model)
        if ref_model is not None:  # frozen before the policy is prepared: it may share layers with it
            ref_model.eval().requires_grad_(False)
        wrapper = PolicyAndValue(vh, entropy_grad=bool(config.entropy_coef))
        optimizer = optimizer or build_optimizer(wrapper.parameters(), config)
        if dist.sharding_plan(self.accelerator) is not None:
            raise ConfigError(
                "the classic PPOTrainer (step() API) does not shard with FSDP; drop --fsdp / the FSDP accelerate "
                "config, or train with `posttrain ppo` (PPOTrainer(args=...)), which does."
            )
        self.wrapped, self.optimizer = self.accelerator.prepare(wrapper, optimizer)
        # Placed (under ZeRO-3: sharded) after the policy, whose preparation fills the DeepSpeed config.
        self.ref_model = dist.prepare_frozen(ref_model, self.accelerator)
        self.lr_scheduler = self.prepare_scheduler(lr_scheduler)
        self.dataset, self.data_collator = dataset, data_collator or io.dict_collator
        self.dataloader = None if dataset is None else self.prepare_dataloader(dataset, self.data_collator)
        if dataset is None:
            warnings.warn(
                f"No dataset is provided: step() takes config.batch_size = {config.batch_size} rows; set it to the "
                "number of (query, response, score) triples you pass (or prepare your own DataLoader with "
                "trainer.accelerator.prepare when running on several processes).",
                UserWarning,
                stacklevel=2,
            )
        self.tracker = io.build_tracker(config, self.accelerator)
        runtime.reuse_freed_memory()  # step() trains from here on (runtime.py)

    def prepare_scheduler(self, lr_scheduler: Any) -> Any:
        """The user's torch LR scheduler in accelerate's wrapper (`.scheduler` is the user's object, as in
        TRL), stepped once per step() call on every process (TRL's accelerator.prepare would step it
        once per process per call: num_processes times)."""
        if lr_scheduler is None:
            return None
        if not isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise ConfigError(
                f"lr_scheduler must be a torch.optim.lr_scheduler.LRScheduler, got {type(lr_scheduler).__name__}."
            )
        from accelerate.scheduler import AcceleratedScheduler

        return AcceleratedScheduler(lr_scheduler, self.optimizer, step_with_optimizer=False)

    def train(self) -> dict[str, float]:
        raise ConfigError("this trainer was built with config= for generate()/step(); build it with args= to train().")

    # -- data -----------------------------------------------------------------------------------------
    def prepare_dataloader(self, dataset: Any, data_collator: Callable | None = None) -> Any:
        """A shuffled DataLoader of config.batch_size rows per batch (the last partial batch dropped),
        prepared by the accelerator (each process gets its own rows). A `datasets.Dataset` loses the
        columns the model's forward does not take (query, response and label kept) when
        config.remove_unused_columns. The default collator gives a dict of lists (ragged queries)."""
        if self.config.remove_unused_columns:
            dataset = io.remove_unused_columns(dataset, self.model)
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=self.config.batch_size or 1,
            shuffle=True,
            collate_fn=data_collator or io.dict_collator,
            drop_last=True,
        )
        return self.accelerator.prepare(loader)

    def prepare_model_inputs(self, queries: list[torch.Tensor], responses: list[torch.Tensor]) -> dict:
        """Padded model input of (query, response) pairs: input_ids / attention_mask of query + response
        (left-padded) for a causal LM; the queries plus decoder_input_ids / decoder_attention_mask for
        an encoder–decoder."""
        pad, device = self.tokenizer.pad_token_id, self.device
        if not self.is_encoder_decoder:
            ids, mask = io.pad_queries([torch.cat([q, r]) for q, r in zip(queries, responses)], pad, device, False)
            return {"input_ids": ids, "attention_mask": mask.long()}
        ids, mask = io.pad_queries(queries, pad, device, True)
        dec, dec_mask = io.pad_queries(responses, pad, device, True)
        return {"input_ids": ids, "attention_mask": mask.long(), "decoder_input_ids": dec,
                "decoder_attention_mask": dec_mask.long()}  # fmt: skip

    # -- generation -----------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        query_tensor: torch.Tensor | list[torch.Tensor],
        length_sampler: Callable | None = None,
        batch_size: int = 4,
        return_prompt: bool = True,
        generate_ref_response: bool = False,
        remove_padding: bool = True,
        **generation_kwargs: Any,
    ):
        """Sample responses: a 1-D query tensor gives a (1, L) tensor; a list gives a list of 1-D
        tensors, `batch_size` queries per generation call, each cut after its stop token (kept) when
        `remove_padding` (else padded to its batch's longest). `return_prompt=False` leaves the query
        out; `generate_ref_response=True` also returns the reference model's responses.
        Generation kwargs: max_new_tokens, temperature (1.0), top_k (0), top_p (1.0), do_sample,
        eos_token_id (default the tokenizer's; None = no stop), pad_token_id; `length_sampler()`
        draws max_new_tokens per batch."""
        single = isinstance(query_tensor, torch.Tensor)
        if single and query_tensor.dim() != 1:
            raise ValueError(
                f"generate() takes a 1-D query tensor or a list of them, got shape {tuple(query_tensor.shape)}."
            )
        queries = [query_tensor] if single else list(query_tensor)
        models = [self.generation_model] + ([self.ref_model or self.generation_model] if generate_ref_response else [])
        results: list[list[torch.Tensor]] = [[] for _ in models]
        for s in range(0, len(queries), batch_size):
            part = queries[s : s + batch_size]
            ids, mask = io.pad_queries(part, self.tokenizer.pad_token_id, self.device, self.is_encoder_decoder)
            if length_sampler is not None:
                generation_kwargs["max_new_tokens"] = length_sampler()
            sampling = io.sampling_from_kwargs(generation_kwargs, self.tokenizer, self.config.response_length)
            for k, model in enumerate(models):
                ctx = model.disable_adapter() if k == 1 and self.ref_model is None else contextlib.nullcontext()
                with generation_mode(model), ctx, self.run.autocast():
                    if self.is_encoder_decoder:  # decoder sequences: never the query (return_prompt is moot)
                        results[k].extend(io.seq2seq_sample(model, ids, mask, sampling, self.run.generator))
                        continue
                    r = generate(
                        model,
                        ids,
                        mask,
                        sampling,
                        pad_token_id=self.tokenizer.pad_token_id,
                        generator=self.run.generator,
                    )
                for q, c, n in zip(part, r.completion_ids, r.completion_lengths.tolist()):
                    c = c[:n] if remove_padding else c
                    results[k].append(torch.cat([q.to(c.device).long(), c]) if return_prompt else c)
        if single:
            results = [[r[0][None, :]] for r in results]
            return (results[0][0], results[1][0]) if generate_ref_response else results[0][0]
        return (results[0], results[1]) if generate_ref_response else results[0]

    # -- step -----------------------------------------------------------------------------------------
    def _step_safety_checker(
        self,
        batch_size: int | None,
        queries: list[torch.Tensor],
        responses: list[torch.Tensor],
        scores: list[torch.Tensor],
        masks: list[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
        """step()'s input checks (io.check_step_inputs: ValueError naming the argument and row) with
        `batch_size` rows; returns (queries, responses, scores, masks) on the trainer's device, each
        score a 0-d float tensor."""
        score_t = io.check_step_inputs(queries, responses, scores, masks, batch_size, self.is_encoder_decoder)
        device = self.current_device
        return (
            [q.to(device) for q in queries],
            [r.to(device) for r in responses],
            list(score_t.to(device).unbind()),
            None if masks is None else [torch.as_tensor(m).to(device) for m in masks],
        )

    def step(
        self,
        queries: list[torch.Tensor],
        responses: list[torch.Tensor],
        scores: list[torch.Tensor],
        response_masks: list[torch.Tensor] | None = None,
    ) -> dict[str, Any]:
        """One PPO optimisation on (query, response, score) triples from any source.

        Lists of 1-D token tensors (ragged), one score per pair (0-d / 1-element tensor or number),
        optional 0/1 masks over each response's tokens (0 = not trained on, e.g. tool output).
        Rows per optimizer step = mini_batch_size × gradient_accumulation_steps; returns TRL's
        statistics, reduced over all processes."""
        cfg = self.config
        cfg.sync_assigned()  # e.g. config.kl_penalty / ppo_epochs assigned since the trainer was built
        n = len(queries) if isinstance(queries, (list, tuple)) else 0
        score_t = io.check_step_inputs(
            queries, responses, scores, response_masks, cfg.step_batch_size, self.is_encoder_decoder
        ).to(self.device)
        micro = cfg.step_mini_batch_size or n
        if n % (micro * cfg.gradient_accumulation_steps):
            raise ConfigError(
                f"step(): {n} rows must be divisible by mini_batch_size {micro} × gradient_accumulation_steps "
                f"{cfg.gradient_accumulation_steps} (rows per optimizer step)."
            )
        started, kl_coef, M = time.time(), self.kl_ctl.value, self.run.metrics
        rollout, loss_mask = io.step_rollout(
            queries, responses, response_masks, self.tokenizer, self.device, self.is_encoder_decoder
        )
        M.reset()
        self._ratios, self._advantages = [], []
        # Steps 3-5 of ppo.py on this batch.
        layout = self.layout(n, micro, cfg.gradient_accumulation_steps)
        batch = self.advantages(rollout, score_t, layout, loss_mask=loss_mask)
        M.add_mean("ppo/mean_non_score_reward", -kl_coef * batch.kl, batch.mask)
        advantages_done = time.time()
        self.update(batch, layout)
        optimized = time.time()
        self.update_kl_controller(batch.kl)
        phases = dict(self.phase_seconds)
        values = M.reduce(self.accelerator)
        M.reset()
        stats: dict[str, Any] = {name: values[key] for name, key in STEP_STATS.items() if key in values}
        gathered = {
            "objective/kl_dist": batch.kl.sum(-1),
            "ppo/std_scores": score_t,
            "tokens/queries_dist": rollout.prompt_mask.sum(-1).float(),
            "tokens/responses_dist": rollout.completion_lengths.float(),
        }
        gathered = {k: dist.gather(v, self.accelerator) for k, v in gathered.items()}
        for name in ("queries", "responses"):
            lengths = gathered[f"tokens/{name}_dist"]
            stats[f"tokens/{name}_len_std"] = float(lengths.std()) if lengths.numel() > 1 else 0.0
            stats[f"tokens/{name}_dist"] = dist_of(lengths)
        stats["objective/kl_dist"] = dist_of(gathered["objective/kl_dist"])
        scores_all = gathered["ppo/std_scores"]
        stats["ppo/std_scores"] = float(scores_all.std()) if scores_all.numel() > 1 else 0.0
        for name, parts in (("ppo/policy/ratio", self._ratios), ("ppo/policy/advantages", self._advantages)):
            stats[name] = dist_of(dist.gather_values(torch.cat(parts), self.accelerator))
        stats["ppo/val/var_explained"] = (
            1.0 - values["val/error"] / values["returns/var"] if values["returns/var"] else math.nan
        )
        stats["objective/kl_coef"] = kl_coef
        stats["ppo/learning_rate"] = self.optimizer.param_groups[0]["lr"]
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.current_step += 1
        if stats["objective/kl"] < -1.0:
            warnings.warn(
                f"KL divergence is negative ({stats['objective/kl']:.2f}): the generation kwargs may sample from "
                "another distribution than the policy's (top_k / top_p / temperature / min_length).",
                stacklevel=2,
            )
        for phase, seconds in phases.items():
            stats[f"time/ppo/{phase}"] = seconds
        stats["time/ppo/optimize_step"] = optimized - advantages_done
        stats["time/ppo/calc_stats"] = time.time() - optimized
        stats["time/ppo/total"] = time.time() - started
        if cfg.optimize_cuda_cache:
            io.empty_device_cache()
        return stats

    def micro_batch_loss(self, out: tuple, b: PPOBatch, rows: torch.Tensor, normalizer: float):
        """ppo.py's micro-batch loss; also keeps the ratios and advantages of its tokens for the
        ppo/policy/ratio and ppo/policy/advantages distributions of step()."""
        loss, pg = super().micro_batch_loss(out, b, rows, normalizer)
        m = b.mask[rows]
        self._ratios.append(torch.exp(out[0].detach() - b.old_logprobs[rows])[m].float())
        self._advantages.append(b.advantages[rows][m].float())
        return loss, pg

    # -- logging and saving ---------------------------------------------------------------------------
    def log_stats(
        self, stats: dict, batch: dict, rewards: list, columns_to_log: Sequence[str] = ("query", "response")
    ) -> None:
        """Write step() statistics with env/reward_mean, env/reward_std and env/reward_dist (over all
        processes) to the console, metrics.jsonl and config.log_with, and a `game_log` table of
        `columns_to_log` + reward (also in samples.jsonl)."""
        rewards_t = torch.tensor([float(torch.as_tensor(r).reshape(-1)[0]) for r in rewards], device=self.device)
        everyone = dist.gather(rewards_t, self.accelerator)
        values = dict(stats)
        values["env/reward_mean"] = float(everyone.mean())
        values["env/reward_std"] = float(everyone.std()) if everyone.numel() > 1 else 0.0
        values["env/reward_dist"] = dist_of(everyone)
        self.tracker.log(values, step=self.current_step)
        if "query" not in batch and "response" not in batch:
            warnings.warn("The game logs will not be logged: the batch has no 'query' or 'response'.", stacklevel=2)
            return
        missing = [c for c in columns_to_log if c not in batch]
        if missing:
            raise ValueError(f"log_stats(): columns_to_log {missing} are not in the batch (keys: {sorted(batch)}).")
        rows = [
            {**{c: batch[c][i] for c in columns_to_log}, "reward": float(rewards_t[i])} for i in range(len(rewards_t))
        ]
        self.tracker.log_table("game_log", rows, step=self.current_step)

    def create_model_card(self, path: str, model_name: str | None = "TRL Model") -> None:
        """Write `path/README.md`, a model card for the trained model (classic_io.write_model_card)."""
        if dist.is_main(self.accelerator):
            io.write_model_card(path, model_name or "TRL Model")

    def _save_pretrained(self, save_directory: str) -> None:
        self.model.save_pretrained(save_directory)
        self.tokenizer.save_pretrained(save_directory)
        self.create_model_card(save_directory)

    def save_pretrained(self, save_directory: str | os.PathLike, *, push_to_hub: bool = False) -> None:
        """Save the value-head model (TRL's layout: LM weights and v_head.summary.*), the tokenizer and
        a model card on the main process. Pushing is left to `huggingface_hub.upload_folder`."""
        if push_to_hub:
            raise ValueError("save_pretrained(push_to_hub=True) is not supported; push the folder with upload_folder.")
        if dist.is_main(self.accelerator):
            self._save_pretrained(str(save_directory))
