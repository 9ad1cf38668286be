"""PPO's classic API: `generate()`, then `step(queries, responses, scores)` with any reward, and
`log_stats()` (TRL's original `PPOTrainer`, before the `train()` loop existed).

`step()` runs steps 3–5 of trainers/ppo.py (advantages, update, KL controller) on one batch of
(query, response, score) triples: the same PolicyAndValue forward, the same loss and the same
non-finite policy as `train()`. The policy is a value-head model (models.CausalLMWithValueHead) and
log-probs are taken at temperature 1. `PPOTrainer(config=...)` (or the classic positional order
`PPOTrainer(config, model, ref_model, tokenizer, dataset, optimizer, data_collator,
num_shared_layers, lr_scheduler)`) builds this trainer.

step() returns the classic statistics (see STEP_STATS) computed as train()'s metrics are.

Encoder–decoder policies (T5, BART: value_head.AutoModelForSeq2SeqLMWithValueHead, detected from the
model or set by `PPOConfig.is_encoder_decoder`) follow TRL ≤ 0.11: queries are the encoder input
(right-padded), generate() returns decoder sequences [decoder_start, t1, …] without the query, and
step() runs `model(input_ids=query, attention_mask=query_mask, decoder_input_ids=response,
decoder_attention_mask=response_mask)` (scoring.seq2seq_completion_forward): log-probs of
response[1:] from logits[:, :-1], values from the decoder's hidden states at the same positions. The
start token is input only, never trained on; the rest of step() is the causal path unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from posttrain import advantages as adv
from posttrain import distributed as dist
from posttrain.configs import ConfigError
from posttrain.critic import PolicyAndValue
from posttrain.health import HealthMonitor
from posttrain.models import CausalLMWithValueHead, disable_dropout
from posttrain.optim import build_optimizer
from posttrain.rollout import Rollout, SamplingConfig, generate, generation_mode, make_sampler
from posttrain.scoring import is_encoder_decoder
from posttrain.tracking import MetricAccumulator, Tracker
from posttrain.trainers.online import OnlineRun, RunProgress
from posttrain.trainers.ppo import PPOTrainer
from posttrain.trainers.ppo_config import PPOConfig

# step() statistics (TRL classic PPOTrainer names) <- the accumulated metrics they come from.
STEP_STATS = {
    "objective/kl": "objective/kl",
    "objective/entropy": "objective/entropy",
    "objective/logprobs": "objective/logprobs",
    "objective/ref_logprobs": "objective/ref_logprobs",
    "ppo/mean_non_score_reward": "objective/non_score_reward",
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
# Keyword arguments of the classic generate() that the rollout engine understands.
GENERATION_KWARGS = {
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "do_sample",
    "eos_token_id",
    "pad_token_id",
    "min_length",
}


def share_layers(model: nn.Module, ref: nn.Module, num_shared_layers: int) -> None:
    """Classic `create_reference_model(num_shared_layers=N)`: the embeddings and first N blocks of
    `ref` ARE the policy's, frozen in both (memory saved, those layers never train)."""
    base, ref_base = model.base_model, ref.base_model
    blocks = next((name for name, m in base.named_children() if isinstance(m, nn.ModuleList)), None)
    if blocks is None or num_shared_layers > len(getattr(base, blocks)):
        raise ConfigError(
            f"num_shared_layers={num_shared_layers}: the model has no list of that many transformer blocks to share."
        )
    for name, module in base.named_children():
        if name == blocks:
            for i in range(num_shared_layers):
                getattr(base, blocks)[i].requires_grad_(False)
                getattr(ref_base, blocks)[i] = getattr(base, blocks)[i]
            break
        module.requires_grad_(False)  # embeddings come before the blocks
        setattr(ref_base, name, module)


def dict_collator(rows: list[dict]) -> dict[str, list]:
    """The classic example's collator: a dict of lists (ragged tensors stay a list)."""
    return {key: [row[key] for row in rows] for key in rows[0]}


class StepRun(OnlineRun):
    """What step() needs of an online run: the accelerator, the sampling stream, metrics, the health
    monitor (the non-finite policy) and counters; no prompt stream, tracker or checkpoints."""

    def __init__(self, config: PPOConfig) -> None:
        self.config = config
        self.accelerator = dist.accelerator_for(config)
        dist.set_seed(config.seed)
        self.world_size = dist.world_size(self.accelerator)
        self.device = dist.device(self.accelerator)
        self.is_main = dist.is_main(self.accelerator)
        self.generator = torch.Generator(device=self.device).manual_seed(
            config.seed + 7919 * dist.process_index(self.accelerator)
        )
        self.progress = RunProgress()
        self.metrics = MetricAccumulator()
        self.health = HealthMonitor(enabled=self.is_main)


class ClassicPPOTrainer(PPOTrainer):
    """`PPOTrainer(config=PPOConfig(...), model=value_head_model, ref_model=None, tokenizer=tok)`;
    `responses = trainer.generate(queries, return_prompt=False, **generation_kwargs)`;
    `stats = trainer.step(queries, responses, scores)`; `trainer.log_stats(stats, batch, scores)`.
    The policy may be a causal LM or an encoder–decoder LM (see the module docstring)."""

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
                "model is required: the policy (a causal LM, a models.CausalLMWithValueHead, or an encoder-decoder "
                "LM / value_head.AutoModelForSeq2SeqLMWithValueHead)."
            )
        tokenizer = processing_class if processing_class is not None else tokenizer
        if tokenizer is None:
            raise ConfigError("a tokenizer is required: pass processing_class= (or tokenizer= with config=).")
        from posttrain.models import ensure_pad_token

        self.args = config
        self.processing_class = self.tokenizer = ensure_pad_token(tokenizer)
        self.callbacks, self.log_history = [], []
        self.running = adv.RunningMoments()
        self.kl_ctl = self.kl_controller(config)
        self.run = StepRun(config)
        self.accelerator, self.device = self.run.accelerator, self.run.device
        self.temperature = 1.0  # the classic step() scores logprobs at temperature 1
        self.tracker: Tracker | None = None
        self.current_step = 0
        self.is_encoder_decoder = detected = is_encoder_decoder(model)
        if config.is_encoder_decoder is not None and config.is_encoder_decoder != detected:
            raise ConfigError(
                f"config.is_encoder_decoder={config.is_encoder_decoder} but the model is "
                f"{'an encoder-decoder' if detected else 'a causal'} LM; leave it None to detect it."
            )
        if detected:
            from posttrain.value_head import AutoModelForSeq2SeqLMWithValueHead, create_reference_model

            # Queries feed the encoder, responses are decoder sequences (TRL <= 0.11's encoder-decoder
            # path); the value head reads the decoder's last hidden state.
            vh = (
                model
                if isinstance(model, AutoModelForSeq2SeqLMWithValueHead)
                else AutoModelForSeq2SeqLMWithValueHead(model)
            )
            if isinstance(ref_model, AutoModelForSeq2SeqLMWithValueHead):
                ref_model = ref_model.pretrained_model
        else:
            vh = model if isinstance(model, CausalLMWithValueHead) else CausalLMWithValueHead(model)
            if isinstance(ref_model, CausalLMWithValueHead):
                ref_model = ref_model.pretrained_model
        if config.disable_dropout:
            disable_dropout(vh)
        if ref_model is not None and is_encoder_decoder(ref_model) != detected:
            raise ConfigError("ref_model must have the policy's architecture (both causal or both encoder-decoder).")
        if ref_model is None and not hasattr(vh.pretrained_model, "disable_adapter"):
            if detected:  # create_reference_model shares layers by name (e.g. BART's model.decoder.layers.N)
                ref_model = create_reference_model(vh.pretrained_model, num_shared_layers=num_shared_layers)
            else:
                ref_model = copy.deepcopy(vh.pretrained_model)
                if num_shared_layers:
                    share_layers(vh.pretrained_model, ref_model, num_shared_layers)
        elif num_shared_layers is not None:
            raise ConfigError(
                "num_shared_layers applies only when the trainer creates the reference model (ref_model=None)."
            )
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.eval().requires_grad_(False).to(self.device)
        wrapper = PolicyAndValue(vh, entropy_grad=bool(config.entropy_coef))
        optimizer = optimizer or build_optimizer(wrapper.parameters(), config)
        self.wrapped, self.optimizer = self.accelerator.prepare(wrapper, optimizer)
        self.lr_scheduler = lr_scheduler
        self.dataset, self.data_collator = dataset, data_collator or dict_collator
        self.dataloader = None
        if dataset is not None:
            # Classic default batch size 128 when batch_size is unset (TRL's classic PPOConfig).
            self.dataloader = torch.utils.data.DataLoader(
                dataset,
                batch_size=config.step_batch_size or 128,
                shuffle=True,
                collate_fn=self.data_collator,
                drop_last=True,
            )

    def train(self) -> dict[str, float]:
        raise ConfigError("this trainer was built with config= for generate()/step(); build it with args= to train().")

    def _sampling(self, kwargs: dict, max_new_tokens: int | None) -> SamplingConfig:
        unknown = sorted(set(kwargs) - GENERATION_KWARGS)
        if unknown or (kwargs.get("min_length") or -1) > 0:
            raise ConfigError(
                f"generate() does not support {unknown or ['min_length > 0']}; supported generation kwargs: "
                f"{', '.join(sorted(GENERATION_KWARGS))} (min_length only as -1/0/None)."
            )
        eos = kwargs.get("eos_token_id", self.tokenizer.eos_token_id)
        stops = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        return SamplingConfig(
            max_new_tokens=max_new_tokens or kwargs.get("max_new_tokens") or self.args.response_length,
            temperature=float(kwargs.get("temperature", 1.0)),
            top_k=int(kwargs.get("top_k", 0) or 0),
            top_p=float(kwargs.get("top_p", 1.0)),
            do_sample=bool(kwargs.get("do_sample", True)),
            stop_token_ids=stops,
        )

    def _left_pad(self, queries: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(q) for q in queries)
        ids = torch.full((len(queries), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(queries), width, dtype=torch.bool)
        for i, q in enumerate(queries):
            ids[i, width - len(q) :], mask[i, width - len(q) :] = q.long().cpu(), True
        return ids.to(self.run.device), mask.to(self.run.device)

    def _pad_queries(self, queries: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries as model input: left-padded for a causal LM; right-padded encoder input for an
        encoder-decoder (models with absolute positions, e.g. BART, number encoder tokens from 0)."""
        ids, mask = self._left_pad(queries)
        if not self.is_encoder_decoder:
            return ids, mask
        for i, q in enumerate(queries):
            ids[i], mask[i] = ids[i].roll(len(q) - ids.size(1)), mask[i].roll(len(q) - ids.size(1))
        return ids, mask

    @torch.no_grad()
    def _seq2seq_generate(
        self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, sampling: SamplingConfig
    ) -> list[torch.Tensor]:
        """Sample decoder sequences for right-padded encoder inputs: each starts with the model's
        decoder start token and ends after its first stop token (kept), or after max_new_tokens new
        tokens. The encoder runs once; the decoder step by step with its key/value cache."""
        config = model.config
        start = getattr(config, "decoder_start_token_id", None)
        if start is None:
            start = getattr(getattr(model, "generation_config", None), "decoder_start_token_id", None)
        if start is None:
            raise ConfigError("the encoder-decoder model's config has no decoder_start_token_id.")
        B, device = ids.size(0), ids.device
        attention = mask.long()
        encoder_outputs = model.get_encoder()(input_ids=ids.masked_fill(~mask, 0), attention_mask=attention)
        sampler = make_sampler(sampling, self.run.generator, False, False)
        stops = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=device)
        tokens = torch.full((B, 1), int(start), dtype=torch.long, device=device)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        lengths = torch.ones(B, dtype=torch.long, device=device)
        step_input, past = tokens, None
        for _ in range(sampling.max_new_tokens):
            out = model(
                encoder_outputs=encoder_outputs,
                attention_mask=attention,
                decoder_input_ids=step_input,
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            logits = out.logits[:, -1, :]
            tok = sampler(logits, logits.size(0), None)[0]
            lengths += ~finished
            finished |= torch.isin(tok, stops)
            step_input = tok[:, None]  # a finished row's later tokens are cut off below
            tokens = torch.cat([tokens, step_input], dim=1)
            if bool(finished.all()):
                break
        return [tokens[i, :n] for i, n in enumerate(lengths.tolist())]

    @torch.no_grad()
    def generate(
        self,
        query_tensor: torch.Tensor | list[torch.Tensor],
        length_sampler: Callable | None = None,
        batch_size: int = 4,
        return_prompt: bool = True,
        generate_ref_response: bool = False,
        **generation_kwargs: Any,
    ):
        """Sample responses (classic API): a 1-D query tensor gives a (1, L) tensor; a list gives a
        list of 1-D tensors without padding, each cut after its stop token (kept). With
        `generate_ref_response=True` the reference model's responses are returned too.
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
            ids, mask = self._pad_queries(part)
            sampling = self._sampling(generation_kwargs, length_sampler() if length_sampler is not None else None)
            for k, model in enumerate(models):
                ctx = model.disable_adapter() if k == 1 and self.ref_model is None else contextlib.nullcontext()
                if self.is_encoder_decoder:  # decoder sequences: never the query (return_prompt is moot)
                    with generation_mode(model), ctx, self.run.autocast():
                        results[k].extend(self._seq2seq_generate(model, ids, mask, sampling))
                    continue
                with generation_mode(model), ctx, self.run.autocast():
                    r = generate(
                        model,
                        ids,
                        mask,
                        sampling,
                        pad_token_id=self.tokenizer.pad_token_id,
                        generator=self.run.generator,
                    )
                for q, c, n in zip(part, r.completion_ids, r.completion_lengths.tolist()):
                    results[k].append(torch.cat([q.to(c.device).long(), c[:n]]) if return_prompt else c[:n])
        if single:
            results = [[r[0][None, :]] for r in results]
            return (results[0][0], results[1][0]) if generate_ref_response else results[0][0]
        return (results[0], results[1]) if generate_ref_response else results[0]

    def _step_rollout(self, queries, responses, response_masks) -> tuple[Rollout, torch.Tensor | None]:
        """(rollout, loss_mask). The rollout's completion_mask covers every response token: it is
        also the attention mask, and a token left out of the loss (response_masks 0, e.g. a tool's
        output) is still context for the tokens after it (classic TRL multiplies response_masks into
        the loss mask only). loss_mask = completion_mask ∧ response_masks, None without masks."""
        prompt_ids, prompt_mask = self._pad_queries(queries)
        lengths = torch.tensor([len(r) for r in responses], dtype=torch.long, device=self.run.device)
        T = int(lengths.max())
        ids = torch.full((len(responses), T), self.tokenizer.pad_token_id, dtype=torch.long, device=self.run.device)
        mask = torch.zeros(len(responses), T, dtype=torch.bool, device=self.run.device)
        loss_mask = None if response_masks is None else torch.zeros_like(mask)
        for i, r in enumerate(responses):
            ids[i, : len(r)] = r.long().to(self.run.device)
            mask[i, : len(r)] = True
            if loss_mask is not None:
                loss_mask[i, : len(r)] = torch.as_tensor(response_masks[i]).bool().to(self.run.device)
        if self.is_encoder_decoder:
            # Responses are decoder sequences whose token 0 (the decoder start token) is input only:
            # it is never predicted, so it is never trained on, KL-penalised or counted.
            first = torch.zeros_like(mask)
            first[:, 0] = True
            loss_mask = (mask if loss_mask is None else loss_mask) & ~first
        eos = self.tokenizer.eos_token_id
        ended = torch.tensor([eos is not None and int(r[-1]) == eos for r in responses], device=self.run.device)
        return Rollout(
            prompt_ids, prompt_mask, ids, mask, lengths, ended, None, None, self.tokenizer.pad_token_id
        ), loss_mask

    def step(
        self,
        queries: list[torch.Tensor],
        responses: list[torch.Tensor],
        scores: list[torch.Tensor],
        response_masks: list[torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """One PPO optimisation on (query, response, score) triples from any source (classic API).

        Lists of 1-D token tensors (ragged), one score per pair (0-d / 1-element tensor or number),
        optional 0/1 masks over each response's tokens (0 = not trained on, e.g. tool output).
        Rows per optimizer step = mini_batch_size × gradient_accumulation_steps; returns the
        classic statistics (STEP_STATS), reduced over all processes."""
        cfg = self.args
        n = len(queries)
        for name, value in (("queries", queries), ("responses", responses), ("scores", scores)) + (
            (("response_masks", response_masks),) if response_masks is not None else ()
        ):
            if not isinstance(value, (list, tuple)) or len(value) != n:
                raise ValueError(
                    f"step(): {name} must be a list of {n} tensors (one per query), got {type(value).__name__} "
                    f"of length {len(value) if hasattr(value, '__len__') else '?'}."
                )
        if cfg.step_batch_size is not None and n != cfg.step_batch_size:
            raise ValueError(
                f"step() got {n} queries but config.batch_size = {cfg.step_batch_size}; pass exactly batch_size rows."
            )
        for i, (q, r) in enumerate(zip(queries, responses)):
            if not (
                isinstance(q, torch.Tensor)
                and q.dim() == 1
                and len(q)
                and isinstance(r, torch.Tensor)
                and r.dim() == 1
                and len(r)
            ):
                raise ValueError(f"step(): queries[{i}] and responses[{i}] must be non-empty 1-D token tensors.")
            skip = 1 if self.is_encoder_decoder else 0  # the decoder start token is never trained on
            if self.is_encoder_decoder and len(r) < 2:
                raise ValueError(
                    f"step(): responses[{i}] must hold the decoder start token and at least one generated token."
                )
            if response_masks is not None and (
                len(response_masks[i]) != len(r) or not bool(torch.as_tensor(response_masks[i])[skip:].any())
            ):
                raise ValueError(
                    f"step(): response_masks[{i}] must have len(responses[{i}]) = {len(r)} entries, at least one 1"
                    + (" after the decoder start token." if skip else ".")
                )
        for i, s in enumerate(scores):
            # One number per pair (classic TRL: 0-d or 1-element); taking element 0 of a longer
            # tensor would silently train on the wrong reward.
            t = torch.as_tensor(s)
            if t.numel() != 1 or t.dim() > 1:
                raise ValueError(
                    f"step(): scores[{i}] must be a 0-d or 1-element tensor (one score per response), "
                    f"got shape {tuple(t.shape)}."
                )
        score_t = torch.tensor(
            [float(torch.as_tensor(s).reshape(-1)[0]) for s in scores], dtype=torch.float32, device=self.run.device
        )
        if not bool(torch.isfinite(score_t).all()):
            raise ValueError(f"step(): scores must be finite, got {score_t.tolist()}.")
        micro = cfg.step_mini_batch_size or n
        if n % (micro * cfg.gradient_accumulation_steps):
            raise ConfigError(
                f"step(): {n} rows must be divisible by mini_batch_size {micro} × gradient_accumulation_steps "
                f"{cfg.gradient_accumulation_steps} (rows per optimizer step)."
            )
        started, kl_coef = time.time(), self.kl_ctl.value
        rollout, loss_mask = self._step_rollout(queries, responses, response_masks)
        self.run.metrics.reset()
        # Steps 3-5 of ppo.py on this batch.
        layout = self.layout(n, micro, cfg.gradient_accumulation_steps)
        batch = self.advantages(rollout, score_t, layout, loss_mask=loss_mask)
        self.update(batch, layout)
        self.update_kl_controller(batch.kl)
        values = self.run.metrics.reduce(self.accelerator)
        self.run.metrics.reset()
        lr = self.optimizer.param_groups[0]["lr"]
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.current_step += 1
        stats = {name: values[key] for name, key in STEP_STATS.items() if key in values}
        scores_var = values["objective/scores_var"]
        stats["ppo/std_scores"] = math.sqrt(scores_var) if math.isfinite(scores_var) else 0.0
        stats["ppo/val/var_explained"] = (
            1.0 - values["val/error"] / values["returns/var"] if values["returns/var"] else math.nan
        )
        stats["objective/kl_coef"] = kl_coef
        stats["ppo/learning_rate"] = lr
        stats["time/ppo/total"] = time.time() - started
        return stats

    def log_stats(
        self, stats: dict, batch: dict, rewards: list, columns_to_log: Sequence[str] = ("query", "response")
    ) -> None:
        """Write step() statistics (plus env/reward_mean, env/reward_std) to the console, metrics.jsonl
        and report_to sinks, and a `game_log` table of `columns_to_log` + reward (classic API)."""
        rewards_t = torch.tensor([float(torch.as_tensor(r).reshape(-1)[0]) for r in rewards], device=self.run.device)
        everyone = dist.gather(rewards_t, self.accelerator)
        if self.tracker is None:
            self.tracker = Tracker(
                self.args.output_dir,
                self.args.report_to,
                config=self.args.to_dict(),
                run_name=self.args.run_name,
                is_main=dist.is_main(self.accelerator),
            )
        values = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
        values["env/reward_mean"] = float(everyone.mean())
        values["env/reward_std"] = float(everyone.std()) if everyone.numel() > 1 else 0.0
        self.tracker.log(values, step=self.current_step)
        columns = [c for c in columns_to_log if c in batch]
        if columns:
            rows = [{**{c: batch[c][i] for c in columns}, "reward": float(rewards_t[i])} for i in range(len(rewards_t))]
            self.tracker.log_table("game_log", rows, step=self.current_step)

    def save_pretrained(self, save_directory: str) -> None:
        """Save the value-head model (LM + value_head.safetensors) and the tokenizer (classic API)."""
        if dist.is_main(self.accelerator):
            self.model.save_pretrained(save_directory)
            self.tokenizer.save_pretrained(save_directory)
