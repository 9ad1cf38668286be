"""The one generation engine shared by every online trainer (PPO, RLOO, GRPO, Online DPO, XPO).

`generate(model, prompt_ids, prompt_mask, sampling, ...)` samples completions for left-padded prompts
with the model's KV cache and returns a `Rollout`. The EOS/stop contract (docs/internals.md), with the
upstream bugs each rule avoids:

- each row stops at the first sampled id in `sampling.stop_token_ids`; the stop token is kept and
  counted, every position after it holds `pad_token_id` and is False in `completion_mask`;
- the decode loop ends as soon as every row has stopped, never forced to `max_new_tokens`
  (TRL#2387 ran every rollout to the maximum; DeepSpeed-Chat passed min_length = max_length,
  microsoft/DeepSpeedExamples#539);
- masks come from lengths, never from `ids == pad`, so pad == eos is safe (TRL PR #5303 review,
  DeepSpeed-Chat PR#672);
- `ended` says whether a row stopped on a stop token, judged on the completion only (TRL#6805
  searched prompt + completion for EOS).

Recorded log-probabilities are log softmax(logits / temperature) of the sampled token under the FULL
temperature-scaled distribution, before top-k / top-p filtering. That is the distribution the
trainer recomputes (scoring.completion_logprobs applies only the temperature), so at the first PPO
epoch ratio = 1 exactly up to float error. With top-k / top-p the recorded logprob therefore is not
the probability of the filtered sampler; this is the same convention as TRL and the "N
implementation details of RLHF with PPO" (temperature is applied, truncation is not). The same
holds for min_p and repetition_penalty: they shape the distribution tokens are DRAWN from (HF's
order: repetition penalty on the logits, then temperature, top-k, top-p, min-p), while the recorded
log-probs stay log softmax(raw logits / temperature), what training recomputes (TRL's GRPO / RLOO
also score the raw logits / temperature).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F

from posttrain import compat, cpu_linear
from posttrain.ops import lengths_to_mask


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are sampled.

    temperature 0 or do_sample=False means greedy decoding. top_k = 0, top_p = 1.0 and min_p = 0.0
    disable those filters (min_p: keep tokens whose probability is at least min_p times the most
    likely token's). repetition_penalty θ (1.0: off) divides the positive and multiplies the negative
    logits of every token already in the row's prompt or completion (transformers'
    RepetitionPenaltyLogitsProcessor; greedy decoding too, as there). stop_token_ids: ids at which a
    row stops (usually the EOS id, plus e.g. an end-of-turn id); empty means every row runs to
    max_new_tokens. generation_kwargs: transformers `GenerationConfig` settings this engine does not
    implement (num_beams, no_repeat_ngram_size, ...); when any is given, `generate` samples with the
    model's transformers generate() instead (`_generate_with_model`).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    do_sample: bool = True
    stop_token_ids: tuple[int, ...] = ()
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # transformers GenerationConfig settings the engine does not implement (num_beams, no_repeat_ngram_size,
    # ...): when given, the completions are sampled by the model's transformers generate() with them
    generation_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        ids = self.stop_token_ids
        if isinstance(ids, int):
            ids = (ids,)
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids if i is not None))

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """Temperature under which logprobs are recorded (and must be recomputed): the sampling
        temperature, or 1.0 for temperature-0 greedy decoding where logits / 0 is undefined."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class Rollout:
    """Prompts and sampled completions, row-aligned.

    prompt_ids (B, P) left-padded; completion_ids (B, T) right-padded with pad_token_id;
    completion_mask True on real completion tokens (stop token included); completion_lengths (B,);
    ended (B,) True where the row stopped on a stop token; logprobs / entropy (B, T) float32 under
    the sampling temperature, 0 off-mask, or None when not recorded.
    """

    prompt_ids: torch.Tensor  # (B, P)
    prompt_mask: torch.Tensor  # (B, P) bool
    completion_ids: torch.Tensor  # (B, T)
    completion_mask: torch.Tensor  # (B, T) bool
    completion_lengths: torch.Tensor  # (B,)
    ended: torch.Tensor  # (B,) bool
    logprobs: torch.Tensor | None  # (B, T) float32
    entropy: torch.Tensor | None  # (B, T) float32
    pad_token_id: int

    def __len__(self) -> int:
        return self.prompt_ids.size(0)

    @property
    def sequence_ids(self) -> torch.Tensor:  # (B, P + T)
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def sequence_mask(self) -> torch.Tensor:  # (B, P + T) bool
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    @property
    def position_ids(self) -> torch.Tensor:  # (B, P + T)
        """cumsum(mask) − 1 clamped at 0: real tokens get 0, 1, 2, … whatever the left padding,
        matching the positions used during generation."""
        return position_ids_from_mask(self.sequence_mask)

    def select(self, idx: torch.Tensor | Sequence[int] | slice) -> Rollout:
        """Rows `idx` (tensor, list or slice); T is kept so per-token tensors of the batch still align."""
        if not isinstance(idx, slice):
            idx = torch.as_tensor(idx, dtype=torch.long, device=self.prompt_ids.device)
        return self._map(lambda t: t[idx])

    def to(self, device: torch.device | str) -> Rollout:
        return self._map(lambda t: t.to(device))

    def _map(self, fn: Any) -> Rollout:
        kwargs = {}
        for f in fields(self):
            value = getattr(self, f.name)
            kwargs[f.name] = fn(value) if isinstance(value, torch.Tensor) else value
        return Rollout(**kwargs)

    def padded_to_multiple(self, multiple: int | None) -> Rollout:
        """The same rows with the prompts left-padded and the completions right-padded (pad_token_id,
        mask False, logprobs 0) to widths that are multiples of `multiple` (None: self unchanged);
        lengths, `ended` and every real token stay as they are."""
        if not multiple:
            return self
        P, T = self.prompt_ids.size(1), self.completion_ids.size(1)
        left, right = -P % multiple, -T % multiple
        if not (left or right):
            return self

        def pad(t: torch.Tensor | None, value: Any, before: int, after: int) -> torch.Tensor | None:
            return None if t is None else F.pad(t, (before, after), value=value)

        return Rollout(
            prompt_ids=pad(self.prompt_ids, self.pad_token_id, left, 0),
            prompt_mask=pad(self.prompt_mask, False, left, 0),
            completion_ids=pad(self.completion_ids, self.pad_token_id, 0, right),
            completion_mask=pad(self.completion_mask, False, 0, right),
            completion_lengths=self.completion_lengths,
            ended=self.ended,
            logprobs=pad(self.logprobs, 0.0, 0, right),
            entropy=pad(self.entropy, 0.0, 0, right),
            pad_token_id=self.pad_token_id,
        )

    @staticmethod
    def cat(rollouts: Sequence[Rollout]) -> Rollout:
        """Concatenate rows; prompts are re-left-padded to the longest P and completions
        re-right-padded to the longest T (with pad_token_id, mask False, logprobs 0)."""
        if not rollouts:
            raise ValueError("Rollout.cat needs at least one rollout")
        pad = rollouts[0].pad_token_id
        if any(r.pad_token_id != pad for r in rollouts):
            raise ValueError(
                f"cannot concatenate rollouts with different pad_token_id: {[r.pad_token_id for r in rollouts]}"
            )
        P = max(r.prompt_ids.size(1) for r in rollouts)
        T = max(r.completion_ids.size(1) for r in rollouts)

        def left(t: torch.Tensor, value: Any) -> torch.Tensor:
            return F.pad(t, (P - t.size(1), 0), value=value)

        def right(t: torch.Tensor, value: Any) -> torch.Tensor:
            return F.pad(t, (0, T - t.size(1)), value=value)

        def cat_optional(name: str) -> torch.Tensor | None:
            values = [getattr(r, name) for r in rollouts]
            if any(v is None for v in values):
                return None
            return torch.cat([right(v, 0.0) for v in values])

        return Rollout(
            prompt_ids=torch.cat([left(r.prompt_ids, pad) for r in rollouts]),
            prompt_mask=torch.cat([left(r.prompt_mask, False) for r in rollouts]),
            completion_ids=torch.cat([right(r.completion_ids, pad) for r in rollouts]),
            completion_mask=torch.cat([right(r.completion_mask, False) for r in rollouts]),
            completion_lengths=torch.cat([r.completion_lengths for r in rollouts]),
            ended=torch.cat([r.ended for r in rollouts]),
            logprobs=cat_optional("logprobs"),
            entropy=cat_optional("entropy"),
            pad_token_id=pad,
        )


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids for a padded batch: cumsum(mask) − 1, clamped at 0 on leading pads."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def bare_module(model: torch.nn.Module) -> torch.nn.Module:
    """The bare transformers module under DDP / DeepSpeed (kept at `.module`) and PEFT (behind
    `get_base_model()`): the one whose forward signature tells what it accepts and whose config and
    output embeddings describe the model. Needs no accelerator (unlike `distributed.unwrap`)."""
    model = getattr(model, "module", model)
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes `logits_to_keep` (transformers ≥ 4.50 causal LMs): then the
    LM head runs only on the positions we need."""
    try:
        params = inspect.signature(bare_module(model).forward).parameters
    except (TypeError, ValueError):
        return False
    return "logits_to_keep" in params


@contextlib.contextmanager
def generation_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Eval mode and no gradient checkpointing for the duration of generation, restored exactly after.

    Gradient checkpointing is switched off through the per-module `gradient_checkpointing` flag
    (the one transformers layers read), so the checkpoint function and its kwargs survive; TRL's
    `unwrap_model_for_generation` does the same disable/restore. Each module's own
    training flag is restored, so modules a caller deliberately left in eval stay in eval.
    """
    modules = list(model.modules())
    training = [m.training for m in modules]
    checkpointing = [m for m in modules if getattr(m, "gradient_checkpointing", False) is True]
    for m in checkpointing:
        m.gradient_checkpointing = False
    model.eval()
    try:
        yield model
    finally:
        for m, was_training in zip(modules, training):
            m.training = was_training
        for m in checkpointing:
            m.gradient_checkpointing = True


def sample_from_probs(
    probs: torch.Tensor, generator: torch.Generator | None = None, *, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """One draw per row of (B, V) probabilities (rows need not sum exactly to 1) by inverse CDF.

    Needs B uniform numbers instead of B·V: torch.multinomial (and the exponential-race trick) draw
    one random number per vocabulary entry, which measured 2.2 ms for a (16, 6815) batch on CPU
    against 0.06 ms here — most of a tiny model's decode step. Zero-probability tokens are never
    picked (`right=True` needs cdf[i] > u ≥ cdf[i−1]). `uniform` (B, 1) in [0, 1) replaces the draw
    (the decode loop draws for every original row and passes the live rows' numbers).
    """
    cdf = probs.cumsum(-1)
    if uniform is None:
        uniform = torch.rand(probs.size(0), 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    u = uniform * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.size(-1) - 1)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor: the logit x of every token with `seen` True
    (already in the row's prompt or completion) becomes x / penalty if x > 0 else x · penalty; the
    others are unchanged. logits (L, V), seen (L, V) bool; a new float32 tensor."""
    x = logits.float()
    return torch.where(seen, torch.where(x < 0, x * penalty, x / penalty), x)


def seen_tokens(ids: torch.Tensor, mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(N, vocab_size) bool: True at each token id present among the real (`mask` True) ids of a row
    (the repetition penalty's history; padding never counts). Rows are left-padded, so the last id of
    each row is real and stands in for its masked slots."""
    ids = ids.masked_fill(~mask, 0) + (~mask).long() * ids[:, -1:]
    seen = torch.zeros(ids.size(0), vocab_size, dtype=torch.bool, device=ids.device)
    return seen.scatter_(1, ids.clamp(0, vocab_size - 1), True)


def make_sampler(
    sampling: SamplingConfig, generator: torch.Generator | None, return_logprobs: bool, return_entropy: bool
):
    """Returns fn(logits (L, V), num_rows, rows, seen=None) -> (tokens (L,), logprobs (L,) | None,
    entropy (L,) | None).

    `rows` (L,) are the batch's row indices among `num_rows` (None: all of them, L = num_rows). Each
    sampling step draws `num_rows` uniforms from `generator` whatever L is, so dropping stopped rows
    out of the batch leaves every live row's draws unchanged. Chosen once so the decode loop does no
    per-step branching. One float32 (L, V) log-softmax per step is the only full-vocab copy on the
    plain sampling path; probabilities for the sampler are its exp(), shared with the entropy.
    `seen` (L, V) bool, given when sampling.repetition_penalty != 1: the tokens each row already
    holds (`seen_tokens`). Logprobs and entropy are always those of the raw logits / temperature.
    """
    temp = sampling.logprob_temperature
    top_k, top_p, min_p = sampling.top_k, sampling.top_p, sampling.min_p
    penalty = sampling.repetition_penalty
    log_min_p = math.log(min_p) if min_p > 0 else None

    def scaled_logp(logits: torch.Tensor) -> torch.Tensor:
        x = logits.float()
        if temp != 1.0:
            x = x / temp
        return torch.log_softmax(x, dim=-1)

    def drawn_from(logits: torch.Tensor, logp: torch.Tensor, seen: torch.Tensor | None) -> torch.Tensor:
        """The scaled log-probs tokens are drawn from: logp itself, or with the penalty applied first."""
        return logp if seen is None else scaled_logp(apply_repetition_penalty(logits, seen, penalty))

    def stats(logp: torch.Tensor, tok: torch.Tensor, probs: torch.Tensor | None = None):
        lp = logp.gather(-1, tok[:, None]).squeeze(-1) if return_logprobs else None
        ent = None
        if return_entropy:
            probs = logp.exp() if probs is None else probs
            ent = -(probs * logp).sum(-1)
        return lp, ent

    def uniforms(num_rows: int, rows: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        u = torch.rand(num_rows, 1, generator=generator, device=device, dtype=torch.float32)
        return u if rows is None else u[rows]

    if sampling.greedy:

        def greedy(logits: torch.Tensor, num_rows: int, rows: torch.Tensor | None, seen: torch.Tensor | None = None):
            tok = (logits if seen is None else apply_repetition_penalty(logits, seen, penalty)).argmax(-1)
            if not (return_logprobs or return_entropy):
                return tok, None, None
            logp = scaled_logp(logits)
            return (tok, *stats(logp, tok))

        return greedy

    if top_k == 0 and top_p >= 1.0 and log_min_p is None:

        def plain(logits: torch.Tensor, num_rows: int, rows: torch.Tensor | None, seen: torch.Tensor | None = None):
            logp = scaled_logp(logits)
            probs = logp.exp()
            draw = probs if seen is None else drawn_from(logits, logp, seen).exp()
            tok = sample_from_probs(draw, uniform=uniforms(num_rows, rows, logits.device))
            return (tok, *stats(logp, tok, probs))

        return plain

    if top_k == 0 and top_p >= 1.0:

        def min_p_only(
            logits: torch.Tensor, num_rows: int, rows: torch.Tensor | None, seen: torch.Tensor | None = None
        ):
            logp = scaled_logp(logits)
            draw = drawn_from(logits, logp, seen)
            # p_i ≥ min_p · p_max  ⇔  log p_i ≥ log p_max + log min_p (no sort: the most likely token is kept)
            keep = draw >= draw.max(-1, keepdim=True).values + log_min_p
            tok = sample_from_probs(draw.exp() * keep, uniform=uniforms(num_rows, rows, logits.device))
            return (tok, *stats(logp, tok))

        return min_p_only

    def filtered(logits: torch.Tensor, num_rows: int, rows: torch.Tensor | None, seen: torch.Tensor | None = None):
        logp = scaled_logp(logits)
        draw = drawn_from(logits, logp, seen)
        # Filtering works on log-probs: they order the vocabulary like the scaled logits and the
        # softmax over any subset of them is the renormalized filtered distribution (HF applies
        # temperature, then top-k, then top-p, then min-p — same order here).
        if top_k > 0:
            cand, cand_idx = torch.topk(draw, min(top_k, draw.size(-1)), dim=-1)  # sorted, descending
        else:
            cand, cand_idx = torch.sort(draw, dim=-1, descending=True)
        if top_p < 1.0:
            p = torch.softmax(cand, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before
            # it already does (the most likely token is always kept).
            drop = (p.cumsum(-1) - p) >= top_p
            cand = cand.masked_fill(drop, float("-inf"))
        if log_min_p is not None:
            # min-p compares each survivor with the most likely one (cand[:, 0]); renormalizing after
            # top-k / top-p leaves that ratio unchanged.
            cand = cand.masked_fill(cand < cand[:, :1] + log_min_p, float("-inf"))
        pick = sample_from_probs(torch.softmax(cand, dim=-1), uniform=uniforms(num_rows, rows, logits.device))
        tok = cand_idx.gather(-1, pick[:, None]).squeeze(-1)
        return (tok, *stats(logp, tok))

    return filtered


def _select_cache_rows(past: Any, index: torch.Tensor) -> Any:
    """The KV cache restricted (or expanded) to batch rows `index`, or None when its layout is unknown.

    transformers' DynamicCache (4.53 and 5.x alike) selects in place with `batch_select_indices`
    (rows may repeat, so this also expands one prefill to k samples); a legacy tuple of per-layer
    (key, value) tensors is indexed on dim 0. Any other cache (a model's own, a static or
    hybrid cache) returns None and the caller keeps every row.
    """
    from transformers import DynamicCache

    if isinstance(past, DynamicCache):
        past.batch_select_indices(index)
        return past
    if (
        isinstance(past, tuple)
        and past
        and all(isinstance(layer, tuple) and all(isinstance(t, torch.Tensor) for t in layer) for layer in past)
    ):
        return tuple(tuple(t.index_select(0, index) for t in layer) for layer in past)
    return None


def prompt_groups(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows with the same prompt (ids and left padding) form a group: (first (U,) the first row of each
    group, group (B,) each row's group, counts (U,) the rows per group), groups in `torch.unique`'s order."""
    key = prompt_ids.masked_fill(~prompt_mask, -1)
    _, group, counts = torch.unique(key, dim=0, return_inverse=True, return_counts=True)
    rows = torch.arange(key.size(0), device=key.device)
    first = torch.full_like(counts, key.size(0)).scatter_reduce(0, group, rows, "amin")
    return first, group, counts


def grouped_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, chunk: int) -> torch.Tensor | None:
    """The order in which chunks of `chunk` rows keep rows that share a prompt together, or None where
    there is one chunk or the rows already are in it.

    Groups (`prompt_groups`) follow each other in the order of their first rows, and the rows of a group
    keep their own order. RLOO's and GRPO's k blocks (row = sample · prompts + prompt) then run as chunks
    of whole groups. A chunk prefills each prompt once in generation, and it packs a prompt's completions
    into one row in the scoring forwards (`scoring.share_prompts`)."""
    n = prompt_ids.size(0)
    if chunk >= n:
        return None
    first, group, _ = prompt_groups(prompt_ids, prompt_mask)
    if first.numel() == n:
        return None
    rows = torch.arange(n, device=prompt_ids.device)
    order = torch.argsort(first[group] * n + rows)
    return None if torch.equal(order, rows) else order


def _distinct_prompts(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(distinct prompts (U, P), their mask, row_prompt (B,)) of left-padded rows that repeat prompts, as
    RLOO's and GRPO's k copies of each prompt do; (prompts, mask, None) when no two rows are the same."""
    first, row_prompt, _ = prompt_groups(prompt_ids, prompt_mask)
    if first.numel() == prompt_ids.size(0):
        return prompt_ids, prompt_mask, None
    return prompt_ids[first], prompt_mask[first], row_prompt


def _default_generator(device: torch.device) -> torch.Generator | None:
    """The generator torch.rand uses on `device` when given none (CPU and CUDA; None elsewhere)."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return None


@torch.no_grad()
def _generate_chunk(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    row_prompt: torch.Tensor | None,
    sampling: SamplingConfig,
    pad_token_id: int,
    sampler: Any,
    keep_kwargs: dict[str, int],
    return_logprobs: bool,
    return_entropy: bool,
    compact: bool,
    sync_every: int,
    rng: torch.Generator | None,
    static: bool = False,
    step_fn: Any = None,
    traced: Any = None,
) -> Rollout:
    """Decode one chunk. prompt_ids / prompt_mask (U, P) are prefilled once; row_prompt (N,) maps
    each completion row to its prompt (None: one row per prompt, N = U). `rng`: the generator the
    sampler draws from, rewound after steps run past the last stop (sync_every > 1). static: decode
    into a preallocated StaticCache of P + max_new positions (row_prompt must be None); step_fn:
    the callable that runs the one-token decode forwards (the model, or its compiled call); traced: a
    `decode_trace.TracedDecode` that runs the dynamic engine's decode forwards where it can."""
    device = prompt_ids.device
    max_new = sampling.max_new_tokens
    out_prompt_ids, out_prompt_mask = prompt_ids, prompt_mask  # what the Rollout reports
    if step_fn is not None:
        # A compiled step compiles (and on CUDA records a graph) for every new shape, so its shapes
        # must not change from one rollout to the next: the prompt width is padded up to a multiple
        # of COMPILED_PROMPT_BUCKET (the static cache then has the same length whenever the
        # prompts' width falls in the same bucket) and rows are never compacted (each batch size
        # would be a new compilation). Extra left padding is masked out: it changes no real token.
        width = -(-prompt_ids.size(1) // COMPILED_PROMPT_BUCKET) * COMPILED_PROMPT_BUCKET
        prompt_ids = F.pad(prompt_ids, (width - prompt_ids.size(1), 0), value=0)
        prompt_mask = F.pad(prompt_mask, (width - prompt_mask.size(1), 0), value=False)
        compact = False
    # Masked prompt slots get id 0: an out-of-vocabulary pad (TRL examples add [PAD] without
    # resizing embeddings) must never reach the embedding; masked ids do not affect real tokens.
    prefill_ids = prompt_ids.masked_fill(~prompt_mask, 0)
    prefill_mask = prompt_mask
    if row_prompt is not None:
        prompt_ids, prompt_mask = prompt_ids[row_prompt], prompt_mask[row_prompt]
    N, P = prompt_ids.shape

    # One preallocated attention mask whose growing prefix is passed each step (a view, no cat).
    # Columns after the prompt stay 1 even after a row stops: a stopped row's later tokens are
    # discarded, so what it attends to does not matter, and live rows never see other rows.
    attention = torch.ones(N, P + max_new, dtype=torch.long, device=device)
    attention[:, :P] = prompt_mask
    # Where the model's mask is plain causal + padding, the decode steps get it prepared, (N, 1, 1,
    # keys) bool, so transformers does not rebuild it every token (compat.takes_prepared_decode_mask).
    # It is what transformers would pass to SDPA: that mask while a row holds padding, no mask once
    # none does (`unpadded`, checked again when compaction drops rows), so the logits are the same.
    prepared, unpadded = None, False
    if not static and compat.takes_prepared_decode_mask(bare_module(model), P + max_new):
        prepared = attention.bool()[:, None, None, :]
        unpadded = bool(prepared.all())
    if prepared is None:
        traced = None  # a trace replays the prepared-mask step only (decode_trace's rules)
    positions = prompt_mask.sum(-1)[:, None] + torch.arange(max_new, device=device)  # (N, max_new)

    completion = torch.full((N, max_new), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(N, max_new, dtype=torch.float32, device=device) if return_logprobs else None
    entropy = torch.zeros(N, max_new, dtype=torch.float32, device=device) if return_entropy else None
    finished = torch.zeros(N, dtype=torch.bool, device=device)
    lengths = torch.zeros(N, dtype=torch.long, device=device)
    stop_ids = sampling.stop_token_ids
    stop_tensor = torch.tensor(stop_ids, dtype=torch.long, device=device) if len(stop_ids) > 1 else None

    cache_name = compat.cache_argument(bare_module(model).forward)

    def forward(
        input_ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, past: Any, fn: Any = model, **kw: Any
    ) -> Any:
        return fn(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            **{cache_name: past},
            use_cache=True,
            **keep_kwargs,
            **kw,
        )

    # A static cache holds P + max_new positions from the start: every forward passes the whole
    # (N, P + max_new) mask and the model's causal mask hides the slots not yet written, so each
    # decode step has the same shapes (what a compiled step needs). Models whose forward takes
    # `cache_position` (transformers < 4.56) are told the slot explicitly; newer StaticCaches count
    # it themselves. `cache_slots[P + t]` is the slot of the token fed after step t.
    past = None
    cache_slots = None
    if static and max_new > 0:
        base = bare_module(model)
        past = compat.static_cache(base.config, N, P + max_new, device, next(model.parameters()).dtype)
        if "cache_position" in inspect.signature(base.forward).parameters:
            cache_slots = torch.arange(P + max_new, device=device)
    step_fn = model if step_fn is None else step_fn

    def step_kwargs(start: int, length: int) -> dict[str, torch.Tensor]:
        return {} if cache_slots is None else {"cache_position": cache_slots[start : start + length]}

    steps = 0
    if max_new > 0:
        if static:
            out = forward(prefill_ids, attention, position_ids_from_mask(prefill_mask), past, **step_kwargs(0, P))
        else:
            out = forward(prefill_ids, prefill_mask.long(), position_ids_from_mask(prefill_mask), None)
        past, logits = compat.output_cache(out), out.logits[:, -1, :]
        if row_prompt is not None:
            # k samples of a prompt share its prefill: the cache rows and first-token logits are
            # repeated, so the sampler sees exactly the (N, V) logits a prefill per row gives.
            expanded = _select_cache_rows(past, row_prompt)
            if expanded is None:  # a cache layout we cannot index: prefill every row
                row_ids = prompt_ids.masked_fill(~prompt_mask, 0)
                out = forward(row_ids, attention[:, :P], position_ids_from_mask(prompt_mask), None)
                past, logits = compat.output_cache(out), out.logits[:, -1, :]
            else:
                past, logits = expanded, logits[row_prompt]
    # The repetition penalty's history (None when it is off: the loop then does no extra work).
    seen = None
    if max_new > 0 and sampling.repetition_penalty != 1.0:
        seen = seen_tokens(prompt_ids, prompt_mask, logits.size(-1))

    # The loop writes into per-batch views of the results. Once rows are compacted out of the
    # batch, `live` holds the batch's row indices and the buffers are copies, scattered back into
    # the results at the next compaction and at the end.
    buffers = [completion, logprobs, entropy, finished, lengths]
    live: torch.Tensor | None = None

    def scatter_back() -> None:
        if live is not None:
            for full, part in zip((completion, logprobs, entropy, finished, lengths), buffers):
                if full is not None:
                    full[live] = part

    rng_states: list[torch.Tensor] = []  # before each draw since the last check (sync_every > 1)
    rng_base = 0
    for t in range(max_new):
        comp_b, lp_b, ent_b, done, lens = buffers
        rows = done.size(0)
        if rng is not None:
            rng_states.append(rng.get_state())
        # Every step draws N uniforms whatever the batch holds now (see make_sampler).
        tok, lp, ent = sampler(logits, N, live) if seen is None else sampler(logits, N, live, seen)
        steps = t + 1
        if seen is not None:
            seen.scatter_(1, tok[:, None], True)
        comp_b[:, t] = tok.masked_fill(done, pad_token_id)
        if lp_b is not None:
            lp_b[:, t] = lp.masked_fill(done, 0.0)
        if ent_b is not None:
            ent_b[:, t] = ent.masked_fill(done, 0.0)
        lens += ~done
        if stop_ids:
            hit = tok == stop_ids[0] if stop_tensor is None else torch.isin(tok, stop_tensor)
            done |= hit
            # The only host sync, every `sync_every` steps; without stop tokens there is none.
            if steps % sync_every == 0 and steps < max_new:
                if not compact:
                    if bool(done.all()):
                        break
                else:
                    n_done = int(done.sum())
                    if n_done == rows:
                        break
                    if 2 * n_done >= rows:
                        keep = (~done).nonzero().squeeze(-1)
                        if static:
                            compat.static_cache_select_rows(past, keep)
                            selected = past
                        else:
                            selected = _select_cache_rows(past, keep)
                        if selected is not None:
                            scatter_back()
                            buffers = [b[keep] if b is not None else None for b in buffers]
                            live = keep if live is None else live[keep]
                            past, tok = selected, tok[keep]
                            seen = seen[keep] if seen is not None else None
                            attention, positions = attention[keep], positions[keep]
                            if prepared is not None:
                                prepared = prepared[keep]
                                unpadded = bool(prepared.all())
                # A row is still live, so every step so far counts: no rewind before this point.
                rng_states, rng_base = [], steps
        if steps == max_new:
            break
        # The sampled token (not pad) is fed even for stopped rows: it is always a valid id.
        if static:
            out = forward(tok[:, None], attention, positions[:, t : t + 1], past, step_fn, **step_kwargs(P + t, 1))
            logits = out.logits[:, -1, :]
        else:
            if prepared is None:
                mask = attention[:, : P + steps]
            else:
                mask = None if unpadded else prepared[..., : P + steps]
            logits = None if traced is None else traced(tok[:, None], mask, positions[:, t : t + 1], past)
            if logits is None:
                out = forward(tok[:, None], mask, positions[:, t : t + 1], past, step_fn)
                past, logits = compat.output_cache(out), out.logits[:, -1, :]
    scatter_back()

    if sync_every > 1 and N > 0 and steps > 0:
        # Steps run after every row stopped wrote nothing; the longest row sets T as before, and the
        # generator goes back to its state before the first such step, so later draws (the next
        # chunk, the next call) are the ones an engine checking every step would make.
        used = int(lengths.max())
        if rng is not None and used < steps:
            rng.set_state(rng_states[used - rng_base])
        steps = used
    # A row ended on a stop token iff it finished; length counts the stop token.
    if row_prompt is not None:
        out_prompt_ids, out_prompt_mask = out_prompt_ids[row_prompt], out_prompt_mask[row_prompt]
    return Rollout(
        prompt_ids=out_prompt_ids,
        prompt_mask=out_prompt_mask,
        completion_ids=completion[:, :steps],
        completion_mask=lengths_to_mask(lengths, steps),
        completion_lengths=lengths,
        ended=finished,
        logprobs=logprobs[:, :steps] if logprobs is not None else None,
        entropy=entropy[:, :steps] if entropy is not None else None,
        pad_token_id=pad_token_id,
    )


def model_generate(model: torch.nn.Module) -> Any:
    """The model's own `generate` where its class replaces transformers' `GenerationMixin.generate`
    (a subclass or remote code that defines one, or one patched in), else None.

    Such a model is sampled through its `generate` (`_generate_with_model`), as TRL calls it; a model
    that inherits transformers' generate is sampled by this module's engine. Only transformers models
    qualify: posttrain's value-head wrappers delegate `generate` to the model they wrap."""
    base = bare_module(model)
    try:
        from transformers import GenerationMixin
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    if not isinstance(base, GenerationMixin):
        return None
    module = getattr(getattr(type(base), "generate", None), "__module__", None) or ""
    if module == "transformers" or module.startswith("transformers."):
        return None
    return base.generate


def _generation_config(sampling: SamplingConfig, pad_token_id: int) -> Any:
    """`SamplingConfig` as a transformers `GenerationConfig` (filters at their off values left out)."""
    from transformers import GenerationConfig

    kwargs: dict[str, Any] = {"max_new_tokens": sampling.max_new_tokens, "pad_token_id": pad_token_id}
    kwargs.update(eos_token_id=list(sampling.stop_token_ids) or None, do_sample=not sampling.greedy)
    if sampling.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = sampling.repetition_penalty
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k or None)
        if sampling.top_p < 1.0:
            kwargs["top_p"] = sampling.top_p
        if sampling.min_p > 0:
            kwargs["min_p"] = sampling.min_p
    return GenerationConfig(**kwargs, **sampling.generation_kwargs)


def _generate_with_model(
    model: torch.nn.Module,
    generate_fn: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    sampling: SamplingConfig,
    pad_token_id: int,
    generator: torch.Generator | None,
    return_logprobs: bool,
    return_entropy: bool,
) -> Rollout:
    """One chunk sampled by the model's own `generate` (`model_generate`), held to this module's
    contract: the completion is cut after its first stop id, later positions are padding, masks come
    from the lengths, and log-probs / entropy come from one forward over prompt + completion (the
    temperature-scaled full distribution, as the engine records them). With a `generator`, the call
    runs on the default generator seeded from it, so a generator state still gives the same tokens."""
    device = prompt_ids.device
    N, P = prompt_ids.shape
    config = _generation_config(sampling, pad_token_id)
    with contextlib.ExitStack() as stack:
        if generator is not None:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
            stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
            torch.random.default_generator.manual_seed(seed)
            if device.type == "cuda":
                torch.cuda.manual_seed(seed)
        out = generate_fn(prompt_ids, attention_mask=prompt_mask.long(), generation_config=config)
    sequences = getattr(out, "sequences", out)
    if (
        not isinstance(sequences, torch.Tensor)
        or sequences.dim() != 2
        or sequences.size(0) != N
        or sequences.size(1) < P
        or not torch.equal(sequences[:, :P].to(prompt_ids.device), prompt_ids)
    ):
        shape = tuple(sequences.shape) if isinstance(sequences, torch.Tensor) else type(sequences).__name__
        raise ValueError(
            f"{type(bare_module(model)).__name__}.generate returned {shape} for {N} prompts of {P} tokens: "
            "a model's own generate() must return the prompts followed by the completions, (prompts, "
            "prompt tokens + new tokens), as transformers' generate() does"
        )
    completion = sequences[:, P : P + sampling.max_new_tokens].to(device=device, dtype=torch.long)
    T = completion.size(1)
    stops = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=device)
    hit = torch.isin(completion, stops) if len(stops) else torch.zeros_like(completion, dtype=torch.bool)
    ended = hit.any(-1)
    lengths = torch.where(ended, hit.long().argmax(-1) + 1, torch.full_like(ended, T, dtype=torch.long))
    width = int(lengths.max()) if N else 0
    mask = lengths_to_mask(lengths, width)
    completion = completion[:, :width].masked_fill(~mask, pad_token_id)
    rollout = Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion,
        completion_mask=mask,
        completion_lengths=lengths,
        ended=ended,
        logprobs=None,
        entropy=None,
        pad_token_id=pad_token_id,
    )
    if (return_logprobs or return_entropy) and width == 0:
        empty = torch.zeros(N, 0, dtype=torch.float32, device=device)
        rollout.logprobs, rollout.entropy = (empty if return_logprobs else None), (empty if return_entropy else None)
    elif return_logprobs or return_entropy:
        from posttrain.scoring import completion_logprobs  # the training forward's own log-probs

        with torch.no_grad():
            logprobs, entropy = completion_logprobs(
                model, rollout, temperature=sampling.logprob_temperature, with_entropy=return_entropy
            )
        rollout.logprobs = logprobs.float() if return_logprobs else None
        rollout.entropy = entropy.float() if return_entropy else None
    return rollout


CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")
COMPILED_PROMPT_BUCKET = 64  # prompt widths a compiled decode step rounds up to (see _generate_chunk)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_COMPILED: dict[str, Any] = {}
_OWN_GENERATE_ANNOUNCED: set[str] = set()  # model classes whose own generate() was announced


def _call(model: torch.nn.Module, **kwargs: Any) -> Any:
    return model(**kwargs)


def compiled_decode_step(model: torch.nn.Module, mode: str) -> Any:
    """fn(**forward_kwargs): `model`'s one-token decode forward compiled by torch.compile in `mode`.
    The compiled function is built once per mode and shared by every model (the model is its
    argument, so torch.compile specialises on the model's class and shapes, not on one instance)."""
    if mode not in _COMPILED:
        _COMPILED[mode] = torch.compile(_call, mode=None if mode == "default" else mode)
    return functools.partial(_COMPILED[mode], model)


def decode_engine(cache_implementation: str | None, model: torch.nn.Module) -> dict[str, Any]:
    """`generate` options for a trainer's `cache_implementation` (TRL's GRPOConfig field name): None or
    "dynamic" keeps the default engine; "static" is the preallocated cache with a compiled decode step,
    torch.compile's "reduce-overhead" mode (CUDA graphs) on CUDA and its default mode elsewhere — as
    transformers' generate() compiles its decode step when given a static cache."""
    if cache_implementation in (None, "dynamic"):
        return {}
    if cache_implementation != "static":
        raise ValueError(f'cache_implementation must be None, "dynamic" or "static", got {cache_implementation!r}')
    device = next(model.parameters()).device
    return {"cache_implementation": "static", "compile_mode": "reduce-overhead" if device.type == "cuda" else "default"}


def generate(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    sampling: SamplingConfig,
    *,
    pad_token_id: int,
    num_samples: int = 1,
    batch_size: int | None = None,
    generator: torch.Generator | None = None,
    return_logprobs: bool = True,
    return_entropy: bool = False,
    share_prefill: bool = True,
    compact: bool = True,
    sync_every: int = 1,
    cache_implementation: str | None = None,
    compile_mode: str | None = None,
    trace: bool = True,
) -> Rollout:
    """Sample completions for left-padded prompts (B, P) and return a `Rollout` of B·num_samples rows.

    Rows are prompt-major: row = prompt_index * num_samples + sample_index. Generation runs in
    chunks of `batch_size` rows (local_rollout_forward_batch_size; None = all at once), each chunk
    ending as soon as all its rows stopped; prompt rows that repeat a prompt (RLOO's and GRPO's k
    blocks) are taken into the chunks group by group (`grouped_rows`), so a prompt's copies share a
    chunk. `generator` makes sampling reproducible (it must live on the model's device); the same
    generator state gives the same tokens for the same chunking.
    Call inside `generation_mode(model)` to get eval mode without gradient checkpointing.

    Engine options (none changes which tokens a generator state samples, except that compiled
    kernels round differently; benchmarks/README.md "Decode engine" has the measurements):
    - share_prefill: the num_samples completions of a prompt share one prompt prefill (its KV cache
      rows are repeated) instead of prefilling the prompt num_samples times; so do rows that repeat a
      prompt themselves (RLOO's and GRPO's k copies of each prompt, within a chunk).
    - compact: once at least half the rows of the batch have stopped, they are dropped from the
      batch (KV cache, mask, positions) and decoding continues on the live rows. Each step still
      draws one uniform per original row, so the live rows' random numbers are unchanged.
    - sync_every: check "have all rows stopped?" (a device-to-host sync) every this many steps. On a
      GPU a larger value keeps the device busy; the loop then may run up to sync_every − 1 steps
      past the last stop, whose tokens are discarded and whose random draws are undone (the
      generator is rewound), so the output and the generator's final state are the same.
    - cache_implementation: None / "dynamic" (transformers' DynamicCache, grown each token) or
      "static": a StaticCache preallocated for P + max_new_tokens positions, so every decode step
      has the same shapes. The same tokens as the dynamic cache in fp32; prompts are prefilled once
      per row (no prefill sharing). Needs a transformers model (its config sizes the cache).
    - compile_mode: None (eager) or a torch.compile mode ("default", "reduce-overhead" = CUDA graphs,
      ...): the one-token decode forward runs compiled, with a static cache. Every new shape would
      compile again, so with a compiled step the prompts are left-padded to a multiple of
      COMPILED_PROMPT_BUCKET tokens (masked: no real token changes) and rows are not compacted:
      a training run's rollouts of the same batch size then share one compilation. Compiled
      kernels round differently from eager ones, so a draw within float error of a token boundary
      can pick a neighbouring token.
    - trace: run the dynamic cache's one-token decode forwards from a `torch.jit.trace` of the model's
      forward (posttrain.decode_trace: the same kernels, bitwise the same logits, without the Python of
      the model code; each trace is checked against the eager forward when it is made). True (the
      default): where the model qualifies (decode_trace.traceable: a bare CPU model in eval mode, no
      hooks, PEFT, autocast or length-dependent rotary scaling) and POSTTRAIN_TRACE_DECODE is not
      `off`; False: never. A static cache never traces.
    `decode_engine` maps a trainer's `cache_implementation` field to these options.
    Prefill sharing and compaction need a KV cache whose rows can be indexed (transformers'
    DynamicCache or a tuple of per-layer tensors). With any other cache, compaction is skipped and
    each chunk's shared prefill is followed by the per-row prefill it could not replace.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"cache_implementation must be one of {list(CACHE_IMPLEMENTATIONS)}, got {cache_implementation!r}"
        )
    if compile_mode is not None and compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode must be None or one of {list(COMPILE_MODES)}, got {compile_mode!r}")
    static = cache_implementation == "static" or compile_mode is not None
    if static and getattr(bare_module(model), "config", None) is None:
        raise ValueError(
            "cache_implementation='static' and compile_mode need a transformers causal LM (its .config sizes the "
            "StaticCache); this model has no config: leave cache_implementation=None and compile_mode=None"
        )
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")
    if prompt_ids.dim() != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError(
            "prompt_ids and prompt_mask must both be (B, P), "
            f"got {tuple(prompt_ids.shape)} and {tuple(prompt_mask.shape)}"
        )
    device = next(model.parameters()).device
    prompt_ids = prompt_ids.to(device=device, dtype=torch.long)
    prompt_mask = prompt_mask.to(device=device, dtype=torch.bool)
    if prompt_ids.size(1) == 0 or not bool(prompt_mask[:, -1].all()):
        raise ValueError(
            "prompts must be left-padded with at least one real token each (prompt_mask[:, -1] all True); "
            "use a left-padding collator (data.PromptCollator) and give empty prompts a BOS token"
        )
    own_generate = model_generate(model)
    if own_generate is None and sampling.generation_kwargs:
        own_generate = bare_module(model).generate  # transformers' generate() with settings the engine lacks
    elif own_generate is not None:
        # The model's class defines its own generate(): sample with it (engine options do not apply).
        name = f"{type(bare_module(model)).__module__}.{type(bare_module(model)).__qualname__}"
        if name not in _OWN_GENERATE_ANNOUNCED:
            _OWN_GENERATE_ANNOUNCED.add(name)
            warnings.warn(
                f"{name}.generate is not transformers' GenerationMixin.generate: rollouts call it (the sampling "
                "settings as a GenerationConfig, the log-probs from one forward after it) instead of posttrain's "
                "decode engine",
                stacklevel=2,
            )
    if own_generate is not None:
        ids, mask = prompt_ids.repeat_interleave(num_samples, 0), prompt_mask.repeat_interleave(num_samples, 0)
        step = ids.size(0) if batch_size is None else batch_size
        if step < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        parts = [
            _generate_with_model(
                model,
                own_generate,
                ids[s : s + step],
                mask[s : s + step],
                sampling,
                pad_token_id,
                generator,
                return_logprobs,
                return_entropy,
            )
            for s in range(0, ids.size(0), step)
        ]
        return parts[0] if len(parts) == 1 else Rollout.cat(parts)
    k = num_samples
    if k > 1 and (static or not share_prefill):  # a static cache is filled by one prefill per row
        prompt_ids = prompt_ids.repeat_interleave(k, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(k, dim=0)
        k = 1

    sampler = make_sampler(sampling, generator, return_logprobs, return_entropy)
    rng = None
    if sync_every > 1 and sampling.stop_token_ids and not sampling.greedy:
        rng = generator if generator is not None else _default_generator(device)
    keep_kwargs = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
    n = prompt_ids.size(0) * k
    step = n if batch_size is None else batch_size
    if step < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    # Chunks hold whole groups of rows that repeat a prompt (RLOO's and GRPO's k blocks); the rows come back
    # in the caller's order.
    order = grouped_rows(prompt_ids, prompt_mask, step) if k == 1 else None
    if order is not None:
        prompt_ids, prompt_mask = prompt_ids[order], prompt_mask[order]
    chunks = []
    # Layers that posttrain.cpu_linear switched to oneDNN decode on weights packed once for this call,
    # where that pays within its max_new_tokens steps (the weights do not change during the call); under
    # CPU bf16 autocast, the layers' bf16 decode calls on bf16 weights packed once for this call.
    with (
        cpu_linear.packed_weights(bare_module(model), sampling.max_new_tokens),
        cpu_linear.autocast_packed_weights(bare_module(model), sampling.max_new_tokens),
    ):
        traced = None
        if trace and not static and device.type == "cpu" and bare_module(model) is model:
            from posttrain import decode_trace

            if decode_trace.traceable(model):
                cache_name = compat.cache_argument(model.forward)
                traced = decode_trace.TracedDecode(model, cache_name, keep_kwargs)
        for s in range(0, n, step):
            e = min(s + step, n)
            first, last = s // k, (e - 1) // k + 1  # the prompts of rows s .. e-1
            chunk_ids, chunk_mask, row_prompt = prompt_ids[first:last], prompt_mask[first:last], None
            if last - first != e - s:
                row_prompt = torch.arange(s, e, device=device) // k - first
            elif k == 1 and share_prefill and not static:
                chunk_ids, chunk_mask, row_prompt = _distinct_prompts(chunk_ids, chunk_mask)
            chunks.append(
                _generate_chunk(
                    model,
                    chunk_ids,
                    chunk_mask,
                    row_prompt,
                    sampling,
                    pad_token_id,
                    sampler,
                    keep_kwargs,
                    return_logprobs,
                    return_entropy,
                    compact,
                    sync_every,
                    rng,
                    static,
                    None if compile_mode is None else compiled_decode_step(model, compile_mode),
                    traced,
                )
            )
    rollout = chunks[0] if len(chunks) == 1 else Rollout.cat(chunks)
    return rollout if order is None else rollout.select(torch.argsort(order))


def decode_prompts(tokenizer: Any, rollout: Rollout, skip_special_tokens: bool = True) -> list[str]:
    """Prompt texts, from the real (mask True) prompt tokens of each row."""
    return [
        tokenizer.decode(ids[mask].tolist(), skip_special_tokens=skip_special_tokens)
        for ids, mask in zip(rollout.prompt_ids.cpu(), rollout.prompt_mask.cpu())
    ]


def decode_completions(tokenizer: Any, rollout: Rollout, skip_special_tokens: bool = True) -> list[str]:
    """Completion texts, cut at each row's length (so pad == eos never truncates early or leaks pads)."""
    return [
        tokenizer.decode(ids[:n].tolist(), skip_special_tokens=skip_special_tokens)
        for ids, n in zip(rollout.completion_ids.cpu(), rollout.completion_lengths.cpu().tolist())
    ]
