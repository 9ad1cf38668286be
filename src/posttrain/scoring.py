"""Forward passes over a `Rollout`: completion log-probs, values, reward-model scores, text reward
functions (`import_reward_function` resolves the command line's `--reward_funcs module:function`), and
`RewardSource`, which combines reward models and functions into one score per row.

Index conventions (sequence = prompt (P, left-padded) + completion (T, right-padded)):
- logits at sequence position P−1+t predict completion token t; `completion_forward` keeps the
  last hidden states of positions P−1 … P+T−2 and runs the LM head on them in blocks of rows, so
  neither the prompt's logits nor the completion's whole (B, T, V) float32 logits are built (small
  batches: an index tensor `logits_to_keep` returns exactly those positions' logits); the hidden
  states there are also where a value head reads;
- the value of the state before completion token t is read at position P−1+t;
- a reward model's score is read at the last real token, P + length − 1: the stop token when the
  row ended. TRL put the PPO score one slot after EOS (TRL#1893, #3750) and DeepSpeed-Chat's
  `ends` pointed one past EOS (DeepSpeed-Chat PR#672). We index from lengths, never from
  `ids == pad`, because pad may equal eos.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import logging
import math
import numbers
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.advantages import full_kl
from posttrain.configs import ConfigError
from posttrain.ops import (
    DEFAULT_CHUNK_TOKENS,
    head_chunk_rows,
    head_full_kl,
    head_logprobs_and_entropy,
    lengths_to_mask,
    logprobs_and_entropy,
    selective_log_softmax,
)
from posttrain.rollout import (
    Rollout,
    accepts_logits_to_keep,
    bare_module,
    decode_completions,
    decode_prompts,
    grouped_rows,
    position_ids_from_mask,
    prompt_groups,
)

logger = logging.getLogger(__name__)

RewardFunction = Callable[..., Sequence[float]]


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _trimmed_inputs(rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Sequence ids/mask/positions with all-pad prompt columns and all-pad completion columns cut.

    Returns (ids, mask, positions, P', T') with P' + T' columns. Dropping columns that are padding
    in every row changes no real token's attention or position (positions come from the mask), and
    a micro-batch of short answers no longer pays for the batch's longest one. Masked ids are
    replaced by 0 so an out-of-vocabulary pad never reaches an embedding.
    """
    P = rollout.prompt_ids.size(1)
    T = rollout.completion_ids.size(1)
    longest_prompt = int(rollout.prompt_mask.sum(-1).max()) if len(rollout) else 0
    longest_completion = int(rollout.completion_lengths.max()) if len(rollout) else 0
    start = P - max(longest_prompt, 1)
    end = P + min(longest_completion, T)
    ids = rollout.sequence_ids[:, start:end]
    mask = rollout.sequence_mask[:, start:end]
    return ids.masked_fill(~mask, 0), mask, position_ids_from_mask(mask), P - start, end - P


# ---------------------------------------------------------------------------------------------
# completions of one prompt share one pass over it
# ---------------------------------------------------------------------------------------------
# Estimated operations of the packed forward, as a fraction of the row-per-completion forward, at or
# under which the packed one runs (benchmarks/README.md, "Completions of one prompt in one row").
SHARED_PROMPT_MAX_COST = 0.85
# The packed rows' (groups, 1, L, L) mask stays at or under this many elements (16 MiB of bool; SDPA may
# expand it to a float bias of 4× that); a larger forward keeps one row per completion.
SHARED_PROMPT_MAX_MASK = 1 << 24
# Per model: (parameters outside the embeddings, layers, hidden size, vocabulary), or None.
_MODEL_SHAPE: weakref.WeakKeyDictionary[nn.Module, tuple[int, int, int, int] | None] = weakref.WeakKeyDictionary()


def _model_shape(bare: nn.Module) -> tuple[int, int, int, int] | None:
    if bare in _MODEL_SHAPE:
        return _MODEL_SHAPE[bare]
    shape = None
    config = getattr(bare, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers, hidden = getattr(text, "num_hidden_layers", None), getattr(text, "hidden_size", None)
    if isinstance(layers, int) and isinstance(hidden, int) and layers > 0 and hidden > 0:
        embeddings = set()
        for get in ("get_input_embeddings", "get_output_embeddings"):
            try:
                module = getattr(bare, get)() if hasattr(bare, get) else None
            except (AttributeError, NotImplementedError):
                module = None
            if isinstance(module, nn.Module):
                embeddings.update(id(p) for p in module.parameters())
        # ZeRO-3 leaves an empty tensor in place and keeps the parameter's size in ds_numel.
        body = sum(int(getattr(p, "ds_numel", 0) or p.numel()) for p in bare.parameters() if id(p) not in embeddings)
        vocab = int(getattr(text, "vocab_size", 0) or 0)
        shape = (body, layers, hidden, vocab) if body > 0 else None
    _MODEL_SHAPE[bare] = shape
    return shape


class SharedPrompts:
    """A rollout's rows laid out with the completions of one prompt in one row: [prompt | c_0 | c_1 | …].

    Rows whose prompt (ids and padding) is the same form a group; a group's row holds the prompt's P'
    columns once, then one segment of T' columns per member completion, so the model runs over the
    prompt once instead of once per completion (k completions per prompt: RLOO, GRPO, Online DPO). A
    (groups, 1, L, L) bool mask lets each completion attend to the prompt's real tokens and causally to
    its own segment only, and each segment's position ids continue from the prompt's, so every real
    token sees exactly the keys, values and positions of its own row-per-completion forward (the values
    agree within float32 rounding: the matrix multiplies see other row counts). Padding queries attend
    to themselves only, so no softmax row is empty.

    `first` (G,) a row of each group (`rollout.prompt_groups`), `group` (B,) each row's group, `member`
    (B,) its segment. ids / mask / positions: the packed (G, L) inputs and the (G, 1, L, L) mask;
    `index` (B, T') the packed column whose last hidden state predicts each completion token (the
    prompt's last column for token 0).
    """

    def __init__(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        P: int,
        Tc: int,
        first: torch.Tensor,
        group: torch.Tensor,
        member: torch.Tensor,
    ):
        G, k = first.numel(), int(member.max()) + 1
        device = ids.device
        prompt_ids, prompt_mask = ids[first, :P], mask[first, :P]
        segments = ids.new_zeros(G, k, Tc)
        segments[group, member] = ids[:, P : P + Tc]
        segment_mask = mask.new_zeros(G, k, Tc)
        segment_mask[group, member] = mask[:, P : P + Tc]
        self.ids = torch.cat([prompt_ids, segments.view(G, k * Tc)], 1)
        keys = torch.cat([prompt_mask, segment_mask.view(G, k * Tc)], 1)
        length = P + k * Tc
        self.positions = torch.cat(
            [
                position_ids_from_mask(prompt_mask),
                (prompt_mask.sum(-1, keepdim=True) + torch.arange(Tc, device=device)).repeat(1, k),
            ],
            1,
        )
        segment = torch.cat([torch.full((P,), -1, device=device), torch.arange(k, device=device).repeat_interleave(Tc)])
        column = torch.arange(length, device=device)
        allowed = (column[None, :] <= column[:, None]) & (
            (segment[None, :] == -1) | (segment[None, :] == segment[:, None])
        )
        real = allowed[None] & keys[:, None, :] & keys[:, :, None]
        self.mask = (real | torch.eye(length, dtype=torch.bool, device=device))[:, None]
        self.group, self.member, self.P, self.Tc = group, member, P, Tc
        steps = torch.arange(Tc - 1, device=device)
        self.index = torch.cat(
            [torch.full((len(group), 1), P - 1, device=device), P + member[:, None] * Tc + steps[None, :]], 1
        )

    def states(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T', H) of the packed (G, L, H) last hidden states: those that predict each completion token."""
        return hidden[self.group[:, None], self.index]

    def last(self, lengths: torch.Tensor) -> torch.Tensor:
        """(B,) packed column of each row's last real token (its prompt's last for an empty completion)."""
        return torch.where(lengths > 0, self.P + self.member * self.Tc + lengths - 1, self.P - 1)


def share_prompts(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, P: int, Tc: int, *, lm_head: bool
) -> SharedPrompts | None:
    """The packed layout of `_trimmed_inputs`' (ids, mask, P', T') when it pays, else None.

    It pays when rows share prompts and the estimated multiply-adds of the packed forward, body
    (parameters outside the embeddings, per token) plus attention (2 · layers · hidden per query and
    key: a dense mask attends over the whole packed row) plus the LM head on the completion positions
    (`lm_head`, the same either way), are at most SHARED_PROMPT_MAX_COST of the row-per-completion
    forward's: long prompts with short completions (the TL;DR setting: 1.7× fewer seconds at 70m, k = 2).
    Long completions make the packed row's attention grow as (P' + k·T')² and keep the usual layout, as
    does a forward whose packed mask would exceed SHARED_PROMPT_MAX_MASK elements (fewer rows per
    forward, `local_rollout_forward_batch_size`, bring it back under).
    Only for models whose own mask is plain causal + padding and runs through SDPA
    (`compat.takes_prepared_decode_mask`, which also passes 4-D masks through unchanged); never
    inside torch.compile (`torch_compile=True`) or with POSTTRAIN_SHARED_PROMPTS=off.
    """
    from posttrain.compat import takes_prepared_decode_mask
    from posttrain.configs import shared_prompts_mode

    B = ids.size(0)
    if B < 2 or Tc < 1 or shared_prompts_mode() == "off" or torch.compiler.is_compiling():
        return None  # (under torch.compile: a data-dependent layout would break the graph at every call)
    bare = bare_module(model)
    shape = _model_shape(bare)
    if shape is None:
        return None
    first, group, counts = prompt_groups(ids[:, :P], mask[:, :P])
    G, k = counts.numel(), int(counts.max())
    if G == B:
        return None
    body, layers, hidden, vocab = shape
    attention = 2 * layers * hidden
    head = B * Tc * hidden * vocab if lm_head else 0
    usual = B * (P + Tc) * body + attention * B * (P + Tc) ** 2 + head
    packed = G * (P + k * Tc) * body + attention * G * (P + k * Tc) ** 2 + head
    if packed > SHARED_PROMPT_MAX_COST * usual or G * (P + k * Tc) ** 2 > SHARED_PROMPT_MAX_MASK:
        return None
    if not takes_prepared_decode_mask(bare, P + k * Tc):
        return None
    order = torch.argsort(group, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    member = torch.empty_like(group)
    member[order] = torch.arange(B, device=ids.device) - starts[group[order]]
    return SharedPrompts(ids, mask, P, Tc, first, group, member)


def chunk_order(rollout: Rollout, batch_size: int) -> tuple[Rollout, torch.Tensor | None]:
    """The rollout in the row order for forwards of `batch_size` rows, and the index that puts their
    results back in the rollout's order (None: the order is unchanged).

    Rows that repeat a prompt are taken group by group (`rollout.grouped_rows`), so each forward holds
    whole groups and `share_prompts` can pack them. RLOO's k blocks put a prompt's copies in different
    chunks otherwise. With POSTTRAIN_SHARED_PROMPTS=off the order is left as it is."""
    from posttrain.configs import shared_prompts_mode

    if shared_prompts_mode() == "off":
        return rollout, None
    order = grouped_rows(rollout.prompt_ids, rollout.prompt_mask, batch_size)
    if order is None:
        return rollout, None
    return rollout.select(order), torch.argsort(order)


def in_rollout_order(results: torch.Tensor, restore: torch.Tensor | None) -> torch.Tensor:
    """Per-row `results` of a `chunk_order`ed rollout, back in the rollout's row order."""
    return results if restore is None else results[restore.to(results.device)]


class CompletionForward:
    """One forward of a causal LM over a rollout, cut to the completion columns.

    The positions are P−1 … P+T'−2, the ones predicting completion tokens 0 … T'−1. targets / mask
    (B, T'): the completion ids and mask of those columns; T' ≤ T drops completion columns that are
    padding in every row; `pad` puts a (B, T') result back on the rollout's T columns, 0 off-mask.
    hidden (B, T', H): the last hidden states at those positions (the state before each completion
    token, where a value head reads V) when asked for, else None.

    Two forms. Full: the model's own logits (B, T', V) were built (`chunked` False). Chunked: the
    model returned the last hidden states `states` (B, T', H) and the logits at one position only;
    `head` maps (n, H) hidden states to the model's (n, V) logits, and `forward_logprobs` /
    `ops.head_logprobs_and_entropy` run it on blocks of rows, so no (B, T', V) tensor is built. Reading
    `.logits` of a chunked forward builds them whole (only for callers that want logits themselves).
    """

    def __init__(
        self,
        logits: torch.Tensor | None,
        hidden: torch.Tensor | None,
        targets: torch.Tensor,
        mask: torch.Tensor,
        width: int,
        *,
        states: torch.Tensor | None = None,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        vocab: int | None = None,
        keep: torch.Tensor | None = None,
        chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        if logits is None and (states is None or head is None or vocab is None):
            raise ValueError("CompletionForward needs logits, or states with their head and vocab size")
        self._logits, self.hidden, self.targets, self.mask, self.width = logits, hidden, targets, mask, width
        self.states, self.head, self.vocab, self.chunk_tokens = states, head, vocab, chunk_tokens
        # 0 · (the model's own one-position logits) in the differentiable outputs: every parameter
        # the forward used stays in the graph even with no completion token (DDP's hooks then fire).
        self.keep = keep
        # A mixture-of-experts model's router load-balancing loss (completion_forward(router_aux=True)), else None.
        self.aux_loss: torch.Tensor | None = None

    @property
    def chunked(self) -> bool:
        return self._logits is None

    @property
    def logits(self) -> torch.Tensor:
        """(B, T', V) logits; built whole from the hidden states for a chunked forward."""
        if self._logits is None:
            return self.head(self.states)
        return self._logits

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        return _pad_to(x.masked_fill(~self.mask, 0.0), self.width)


# Whether head(last hidden state) reproduces each model's own logits (checked once per model).
_HEAD_MATCHES: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _text_config_value(model: nn.Module, name: str) -> Any:
    config = getattr(model, "config", None)
    configs = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        configs.append(get_text())
    for c in configs:
        value = getattr(c, name, None)
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
    return None


def lm_head(model: nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
    """(head, vocab): `head` maps last hidden states (..., H) to the logits the model itself returns,
    the output embedding module (called as a module, so DDP / FSDP2 / DeepSpeed ZeRO-3 / LoRA hooks
    run) followed by the model's logit scaling: Cohere's `logit_scale` (multiplied), Granite's
    `logits_scaling` (divided), Gemma 2/3's `final_logit_softcapping` (tanh). None when the model
    (DDP / DeepSpeed `.module` and PEFT's base model unwrapped) has no output embeddings."""
    bare = bare_module(model)
    get = getattr(bare, "get_output_embeddings", None)
    try:
        module = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        module = None
    if not isinstance(module, nn.Module):
        return None
    vocab = getattr(module, "out_features", None) or _text_config_value(bare, "vocab_size")
    if not vocab:
        return None
    multiply = _text_config_value(bare, "logit_scale")
    divide = _text_config_value(bare, "logits_scaling")
    softcap = _text_config_value(bare, "final_logit_softcapping")

    def head(hidden: torch.Tensor) -> torch.Tensor:
        logits = module(hidden)
        if multiply is not None:
            logits = logits * multiply
        if divide is not None:
            logits = logits / divide
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    return head, int(vocab)


def _head_matches(
    model: nn.Module, head: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor, hidden: torch.Tensor
) -> bool:
    """Whether head(hidden) equals the model's own `logits` at the same position (within the
    rounding of the logits' dtype); checked on the first chunked forward of each model and cached.
    A model whose head we do not reproduce gets one warning and the full-logits path from then on."""
    bare = bare_module(model)
    known = _HEAD_MATCHES.get(bare)
    if known is not None:
        return known
    with torch.no_grad():
        mine = head(hidden).float()
        theirs = logits.float()
        tol = 1e-4 if logits.dtype == torch.float32 and hidden.dtype == torch.float32 else 2e-2
        same = mine.shape == theirs.shape and bool(
            ((mine - theirs).abs().nan_to_num(0.0).max() <= tol * (1.0 + theirs.abs().nan_to_num(0.0).max()))
            if mine.numel()
            else True
        )
    if not same:
        warnings.warn(
            f"{type(bare).__name__}: its LM head applied to the last hidden states does not reproduce the "
            "model's own logits, so completion log-probs use the full (batch, length, vocab) logits for this "
            "model (more memory). See docs/internals.md, chunked LM head.",
            stacklevel=3,
        )
    _HEAD_MATCHES[bare] = same
    return same


def completion_forward(
    model: torch.nn.Module,
    rollout: Rollout,
    *,
    output_hidden_states: bool = False,
    full_logits: bool = False,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    router_aux: bool = False,
) -> CompletionForward:
    """Differentiable forward of `model` over prompt + completion, cut to the positions that predict
    completion tokens; with output_hidden_states the last hidden states at those positions too.
    router_aux (a causal mixture-of-experts model, see `router_aux_loss_enabled`): the model is asked
    for its router logits and its load-balancing loss (`aux_loss`, over the whole sequence, prompt
    included, as transformers computes it) is kept as the result's `aux_loss`.

    Chunked (when batch × completion columns exceed one block of ops.head_chunk_rows(vocab,
    chunk_tokens) rows, 108 at a 151,936 vocabulary, and the model takes `logits_to_keep`): the model returns
    its last hidden states and the logits of one position only (`logits_to_keep=1`); the LM head runs
    later, block by block (`forward_logprobs`), so the float32 (B, T', V) logits and their gradient
    never exist. Otherwise, or with full_logits: the model's own logits of the completion positions
    (an index tensor `logits_to_keep`: the LM head never runs on prompt positions), at most 64 MiB of
    float32 (one block) without full_logits, with no recompute in backward. Completions that share a
    prompt (k per prompt: RLOO, GRPO, Online DPO) run as one row per prompt where `share_prompts` finds
    that it pays; the result has the same (B, T') layout either way."""
    if is_encoder_decoder(model):
        return seq2seq_completion_forward(model, rollout, output_hidden_states=output_hidden_states)
    rollout = rollout.to(_device(model))
    T = rollout.completion_ids.size(1)
    ids, mask, positions, P, Tc = _trimmed_inputs(rollout)
    targets, completion_mask = rollout.completion_ids[:, :Tc], rollout.completion_mask[:, :Tc]
    kwargs: dict[str, Any] = dict(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    if router_aux:
        kwargs["output_router_logits"] = True
    takes_keep = accepts_logits_to_keep(model)
    found = lm_head(model) if takes_keep and _HEAD_MATCHES.get(bare_module(model), True) else None
    shared = share_prompts(model, ids, mask, P, Tc, lm_head=True) if found and not router_aux else None
    chunked = found is not None and not full_logits and ids.size(0) * Tc > head_chunk_rows(found[1], chunk_tokens)
    if shared is not None or chunked:
        head, vocab = found
        if shared is not None:  # one row per prompt (`share_prompts`)
            kwargs.update(input_ids=shared.ids, attention_mask=shared.mask, position_ids=shared.positions)
        out = model(**kwargs, output_hidden_states=True, logits_to_keep=1)
        last = out.hidden_states[-1]
        if _head_matches(model, head, out.logits[:, -1], last[:, -1]):
            states = shared.states(last) if shared is not None else last[:, P - 1 : P - 1 + Tc]
            hidden = states if output_hidden_states else None
            if not chunked:  # one row per prompt, and the completion positions' logits fit one block
                return CompletionForward(head(states), hidden, targets, completion_mask, T)
            keep = out.logits.sum() * 0.0 if torch.is_grad_enabled() else None
            result = CompletionForward(
                None,
                hidden,
                targets,
                completion_mask,
                T,
                states=states,
                head=head,
                vocab=vocab,
                keep=keep,
                chunk_tokens=chunk_tokens,
            )
            result.aux_loss = _router_aux_loss(out, router_aux)
            return result
        del out, last  # the head does not reproduce this model's logits: one row per completion, full logits
        kwargs.update(input_ids=ids, attention_mask=mask, position_ids=positions)
    if output_hidden_states:
        kwargs["output_hidden_states"] = True
    if takes_keep:
        out = model(**kwargs, logits_to_keep=torch.arange(P - 1, P - 1 + Tc, device=ids.device))
        logits = out.logits
    else:
        out = model(**kwargs)
        logits = out.logits[:, P - 1 : P - 1 + Tc]
    hidden = out.hidden_states[-1][:, P - 1 : P - 1 + Tc] if output_hidden_states else None
    result = CompletionForward(logits, hidden, targets, completion_mask, T)
    result.aux_loss = _router_aux_loss(out, router_aux)
    return result


def resolve_router_aux_loss_coef(config: Any, model: torch.nn.Module) -> float:
    """config.router_aux_loss_coef, where None (TRL 1.16's default) becomes the coefficient the model's
    (text) config declares, 0.0 if none; written back to the config, which the trainers read."""
    coef = config.router_aux_loss_coef
    if coef is None:
        model_config = getattr(bare_module(model), "config", None)
        text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        coef = float(getattr(text, "router_aux_loss_coef", None) or 0.0)
        config.router_aux_loss_coef = coef
    return coef


def router_aux_loss_enabled(model: torch.nn.Module, coef: float) -> bool:
    """Whether the policy update adds a router load-balancing loss: a causal mixture-of-experts model
    (its text config has `output_router_logits`, as TRL detects one) and router_aux_loss_coef != 0."""
    config = getattr(model, "config", None)
    if config is None or not coef or is_encoder_decoder(model):
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "output_router_logits", None) is not None


def _router_aux_loss(out: Any, asked: bool) -> torch.Tensor | None:
    if not asked:
        return None
    aux = getattr(out, "aux_loss", None)
    if aux is None:  # e.g. GLM-4 MoE: its config has output_router_logits, its forward computes no aux_loss
        warnings.warn(
            f"router_aux_loss_coef: {type(out).__name__} of this model has no aux_loss even with "
            "output_router_logits=True, so no router load-balancing loss is added; set router_aux_loss_coef=0 "
            "to silence this.",
            stacklevel=2,
        )
    return aux


def is_encoder_decoder(model: torch.nn.Module) -> bool:
    """Whether `model` (or the transformers model it wraps) is an encoder–decoder LM (T5, BART)."""
    flag = getattr(model, "is_encoder_decoder", None)
    if isinstance(flag, bool):
        return flag
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def seq2seq_completion_forward(
    model: torch.nn.Module, rollout: Rollout, *, output_hidden_states: bool = False
) -> CompletionForward:
    """`completion_forward` of an encoder–decoder LM (T5, BART): the prompt is the ENCODER input
    (prompt_ids / prompt_mask, right-padded: BART numbers encoder positions from column 0 whatever
    the mask, so left padding would move them) and completion_ids are the decoder's input
    sequence, decoder start token first (the classic PPO API's responses):

        model(input_ids=prompt, attention_mask=prompt_mask,
              decoder_input_ids=completion, decoder_attention_mask=completion_mask)

    Decoder logits at position t−1 predict completion token t, so column t ≥ 1 gets logits[:, t−1]
    (and the decoder's last hidden state there, where a value head reads V); column 0, the decoder
    start token, is never predicted: its logits and hidden state are zeros and it is off the mask.
    Columns that are padding in every row are cut, as for causal LMs."""
    rollout = rollout.to(_device(model))
    T = rollout.completion_ids.size(1)
    Tc = max(int(rollout.completion_lengths.max()) if len(rollout) else 1, 1)
    real = rollout.prompt_mask.any(0).nonzero()
    first, last = (int(real[0]), int(real[-1]) + 1) if len(real) else (0, rollout.prompt_ids.size(1))
    prompt_mask = rollout.prompt_mask[:, first:last]
    decoder_mask = rollout.completion_mask[:, :Tc]
    kwargs: dict[str, Any] = dict(
        input_ids=rollout.prompt_ids[:, first:last].masked_fill(~prompt_mask, 0),
        attention_mask=prompt_mask.long(),
        decoder_input_ids=rollout.completion_ids[:, :Tc].masked_fill(~decoder_mask, 0),
        decoder_attention_mask=decoder_mask.long(),
        use_cache=False,
    )
    if output_hidden_states:
        kwargs["output_hidden_states"] = True
    out = model(**kwargs)
    # (B, Tc, ·) → shifted right by one column: column t holds what predicts completion token t.
    logits = F.pad(out.logits[:, :-1], (0, 0, 1, 0))
    hidden = F.pad(out.decoder_hidden_states[-1][:, :-1], (0, 0, 1, 0)) if output_hidden_states else None
    mask = decoder_mask.clone()
    mask[:, 0] = False
    return CompletionForward(logits, hidden, rollout.completion_ids[:, :Tc], mask, T)


def _pad_to(x: torch.Tensor, T: int) -> torch.Tensor:
    return F.pad(x, (0, T - x.size(1)))


def forward_logprobs(
    forward: CompletionForward, *, temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[completion token] (B, T) float32 and optionally the entropy
    (B, T) of a completion forward, both 0 off-mask (a chunked forward: the LM head block by block)."""
    if forward.chunked:
        logprobs, entropy = head_logprobs_and_entropy(
            forward.head,
            forward.states,
            forward.targets,
            forward.vocab,
            temperature,
            head_chunk_rows(forward.vocab, forward.chunk_tokens),
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )
        if forward.keep is not None:
            logprobs = logprobs + forward.keep
        return forward.pad(logprobs), (forward.pad(entropy) if with_entropy else None)
    if with_entropy:
        logprobs, entropy = logprobs_and_entropy(
            forward.logits, forward.targets, temperature, entropy_grad=entropy_grad
        )
        return forward.pad(logprobs), forward.pad(entropy)
    return forward.pad(selective_log_softmax(forward.logits, forward.targets, temperature)), None


def forward_full_kl(forward: CompletionForward, ref: CompletionForward, *, temperature: float = 1.0) -> torch.Tensor:
    """Exact per-token KL(π‖π_ref) over the vocabulary (advantages.full_kl), (B, T) float32, 0 off-mask,
    of two completion forwards over the same rollout. Two chunked forwards: both LM heads run on the
    same blocks of rows (ops.head_full_kl), so neither model's (B, T', V) logits exist whole."""
    if forward.chunked and ref.chunked and forward.vocab == ref.vocab:
        kl = head_full_kl(
            forward.head,
            forward.states,
            ref.head,
            ref.states,
            forward.vocab,
            temperature,
            head_chunk_rows(forward.vocab, forward.chunk_tokens),
        )
        if forward.keep is not None:
            kl = kl + forward.keep
        return forward.pad(kl)
    return forward.pad(full_kl(forward.logits, ref.logits, forward.mask, temperature=temperature))


def completion_logprobs(
    model: torch.nn.Module,
    rollout: Rollout,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[completion token], (B, T) float32, 0 off-mask; entropy too.

    Differentiable single forward (use it for the policy update). temperature must be the rollout's
    `SamplingConfig.logprob_temperature` so the result matches the recorded rollout logprobs.
    entropy_grad: let gradients flow through the entropy (only for an entropy bonus in the loss).
    The LM head runs on blocks of ops.head_chunk_rows(vocab, chunk_tokens) rows (`completion_forward`).
    """
    return forward_logprobs(
        completion_forward(model, rollout, chunk_tokens=chunk_tokens),
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )


@torch.no_grad()
def batched_completion_logprobs(
    model: torch.nn.Module,
    rollout: Rollout,
    *,
    batch_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`completion_logprobs` without grad, `batch_size` rows per forward (old / reference logprobs),
    rows that share a prompt in the same forward (`chunk_order`)."""
    ordered, restore = chunk_order(rollout, batch_size)
    parts = [
        completion_logprobs(
            model,
            ordered.select(slice(s, s + batch_size)),
            temperature=temperature,
            with_entropy=with_entropy,
            chunk_tokens=chunk_tokens,
        )
        for s in range(0, len(rollout), batch_size)
    ]
    logprobs = in_rollout_order(torch.cat([p[0] for p in parts]), restore)
    entropy = in_rollout_order(torch.cat([p[1] for p in parts]), restore) if with_entropy else None
    return logprobs, entropy


def _backbone_hidden(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Last hidden states (B, L, H) of a model exposing `base_model_prefix` + `score` (a transformers
    *ForSequenceClassification, or models.CausalLMWithValueHead): the backbone is called directly so
    the per-token scores are ours to index (HF's own pooling finds the last token via pad ids)."""
    prefix = getattr(model, "base_model_prefix", None)
    backbone = getattr(model, prefix, None) if prefix else None
    if backbone is None or not hasattr(model, "score"):
        raise TypeError(
            f"{type(model).__name__} must expose a backbone at `base_model_prefix` and a `score` head "
            "(a transformers *ForSequenceClassification model or models.CausalLMWithValueHead)"
        )
    out = backbone(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


_FIRST_LABEL_NOTED: set[int] = set()


def _score(model: torch.nn.Module, hidden: torch.Tensor, first_label: bool = False) -> torch.Tensor:
    """The score head's value per position. A head with several labels is refused, or with `first_label`
    (a reward model) read at its first label, as TRL's GRPOTrainer reads `logits[:, 0]`."""
    out = model.score(hidden)
    if out.size(-1) != 1:
        if not first_label:
            raise ValueError(
                f"{type(model).__name__}.score must output one value per token (num_labels=1), got {out.size(-1)}"
            )
        if id(model) not in _FIRST_LABEL_NOTED:
            _FIRST_LABEL_NOTED.add(id(model))
            logger.warning(
                "%s has num_labels=%d: its first logit is the reward (train it with num_labels=1 to avoid this)",
                type(model).__name__,
                out.size(-1),
            )
        out = out[..., :1]
    return out.squeeze(-1).float()


def completion_values(value_model: torch.nn.Module, rollout: Rollout) -> torch.Tensor:
    """V(state before completion token t), (B, T) float32, 0 off-mask; differentiable.

    Read at sequence position P−1+t (the last token the policy had seen when it chose token t); the
    score head runs only on those positions.
    """
    rollout = rollout.to(_device(value_model))
    T = rollout.completion_ids.size(1)
    ids, mask, positions, P, Tc = _trimmed_inputs(rollout)
    hidden = _backbone_hidden(value_model, ids, mask, positions)
    values = _score(value_model, hidden[:, P - 1 : P - 1 + Tc])
    return _pad_to(values.masked_fill(~rollout.completion_mask[:, :Tc], 0.0), T)


@torch.no_grad()
def batched_completion_values(value_model: torch.nn.Module, rollout: Rollout, *, batch_size: int) -> torch.Tensor:
    """`completion_values` without grad, `batch_size` rows per forward."""
    return torch.cat(
        [
            completion_values(value_model, rollout.select(slice(s, s + batch_size)))
            for s in range(0, len(rollout), batch_size)
        ]
    )


_SAME_TOKENIZER: dict[tuple[int, int], bool] = {}


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers encode identically (cached per pair: vocabularies can be 150k entries)."""
    if a is b:
        return True
    key = (id(a), id(b))
    if key not in _SAME_TOKENIZER:
        _SAME_TOKENIZER[key] = _compare_tokenizers(a, b)
    return _SAME_TOKENIZER[key]


def _compare_tokenizers(a: Any, b: Any) -> bool:
    return (
        a.get_vocab() == b.get_vocab()
        and a.all_special_tokens == b.all_special_tokens
        and getattr(a, "bos_token", None) == getattr(b, "bos_token", None)
    )


def last_token_scores(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, last: torch.Tensor
) -> torch.Tensor:
    """Score head at index `last` of each row (B,), backbone over the whole padded row."""
    hidden = _backbone_hidden(model, ids.masked_fill(~mask, 0), mask, position_ids_from_mask(mask))
    picked = hidden[torch.arange(ids.size(0), device=ids.device), last]
    return _score(model, picked[:, None], first_label=True).squeeze(-1)


@torch.no_grad()
def reward_model_scores(
    reward_model: torch.nn.Module,
    rollout: Rollout,
    *,
    batch_size: int,
    policy_tokenizer: Any = None,
    reward_tokenizer: Any = None,
    conversations: Sequence[list[dict[str, Any]] | None] | None = None,
) -> torch.Tensor:
    """One score per sequence, (B,) float32, read at the last real token (the stop token when present).

    Same tokenizer (or none given): the rollout's token ids are scored directly at index
    P + completion_length − 1 (P − 1, the last prompt token, for an empty completion). A different
    `reward_tokenizer`: prompt and completion are decoded with `policy_tokenizer`
    (skip_special_tokens=True, so the policy's EOS / pads do not leak into the text), concatenated,
    re-tokenized with the reward model's tokenizer (its own special tokens added), right-padded with 0
    and scored at the last real token of each row by length (TRL#1979 / #3595 wanted this). A row of
    `conversations` (the prompt's messages plus the assistant's completion) is rendered with the reward
    tokenizer's own chat template instead and tokenized without adding special tokens, as TRL 1.x's
    GRPO and RLOO score conversational rows (a reward tokenizer without a chat template reads the
    decoded text).
    """
    device = _device(reward_model)
    if reward_tokenizer is not None and (
        policy_tokenizer is None or not same_tokenizer(policy_tokenizer, reward_tokenizer)
    ):
        if policy_tokenizer is None:
            raise ValueError(
                "reward_model_scores needs policy_tokenizer to decode completions for a different reward_tokenizer"
            )
        texts = [
            p + c
            for p, c in zip(decode_prompts(policy_tokenizer, rollout), decode_completions(policy_tokenizer, rollout))
        ]
        encoded = reward_tokenizer(texts, add_special_tokens=True)["input_ids"]
        if conversations is not None and getattr(reward_tokenizer, "chat_template", None):
            for i, chat in enumerate(conversations):
                if chat is not None:
                    text = reward_tokenizer.apply_chat_template(chat, tokenize=False)
                    encoded[i] = reward_tokenizer(text, add_special_tokens=False)["input_ids"]
        scores = []
        for s in range(0, len(texts), batch_size):
            rows = [torch.tensor(r, dtype=torch.long) for r in encoded[s : s + batch_size]]
            lengths = torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)
            if bool((lengths == 0).any()):
                raise ValueError("reward_tokenizer produced an empty sequence; cannot score it")
            ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0).to(device)
            mask = lengths_to_mask(lengths, ids.size(1))
            scores.append(last_token_scores(reward_model, ids, mask, lengths - 1))
        return torch.cat(scores)

    scores = []
    ordered, restore = chunk_order(rollout, batch_size)
    for s in range(0, len(rollout), batch_size):
        chunk = ordered.select(slice(s, s + batch_size)).to(device)
        ids, mask, _, P, Tc = _trimmed_inputs(chunk)
        shared = share_prompts(reward_model, ids, mask, P, Tc, lm_head=False)
        if shared is None:
            scores.append(last_token_scores(reward_model, ids, mask, P + chunk.completion_lengths - 1))
            continue
        hidden = _backbone_hidden(reward_model, shared.ids, shared.mask, shared.positions)
        picked = hidden[shared.group, shared.last(chunk.completion_lengths)]
        scores.append(_score(reward_model, picked[:, None], first_label=True).squeeze(-1))
    return in_rollout_order(torch.cat(scores), restore)


class RewardFunctionError(ValueError):
    """A reward function returned something other than one finite number per completion.

    The message names the function, the row (1-based) and the value; the command line prints it
    as one line, since the fix is in the user's function.
    """


class RewardFunctionRaised(RewardFunctionError):
    """A reward function raised an exception; chained from it (`__cause__`).

    `.function` is the function's `module:qualname`, `.user_frames` the traceback lines of the frames
    in the user's own files (posttrain's, torch's and the standard library's left out), which the
    command line prints under the one-line message instead of a full traceback.
    """

    def __init__(self, function: str, error: BaseException) -> None:
        first = str(error).splitlines()[0] if str(error) else ""
        super().__init__(
            f"reward function {function!r} raised {type(error).__name__}"
            + (f": {first}" if first else "")
            + ". Fix the function (its frames are below on the command line)."
        )
        self.function = function
        self.user_frames = _user_frames(error)


def _library_dirs() -> tuple[str, ...]:
    """Folders whose frames are not the user's: posttrain itself, installed packages, the stdlib."""
    import sysconfig

    paths = {os.path.dirname(os.path.abspath(__file__))}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            paths.add(os.path.abspath(path))
    return tuple(p.rstrip(os.sep) + os.sep for p in paths)


def _user_frames(error: BaseException) -> str:
    """The formatted traceback frames of `error` that lie in the user's files."""
    import traceback

    library = _library_dirs()
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not os.path.abspath(f.filename).startswith(library) and not f.filename.startswith("<frozen")
    ]
    return "".join(traceback.format_list(frames)).rstrip()


def reward_function_path(func: Callable[..., Any]) -> str:
    """`module:qualname` of a reward function (its class for a callable object), as --reward_funcs takes it."""
    target = func if hasattr(func, "__qualname__") else type(func)
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', reward_function_name(func))}"


def reward_function_name(func: Callable[..., Any]) -> str:
    """Name used in errors and metrics (`rewards/<name>`): __name__, or the class name for callables."""
    return getattr(func, "__name__", None) or type(func).__name__


def import_reward_function(path: str) -> Callable[..., Any]:
    """Resolve a reward function given by import path, "package.module:function" or
    "package.module.function" (`--reward_funcs`), to the callable."""
    # The console script does not put the working directory on sys.path (python -m does); reward
    # modules next to the user's data are the common case, so look there too.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    if not module or not name:
        raise ConfigError(f"reward function {path!r} must be an import path like my_pkg.rewards:length_reward.")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"cannot import reward function {path!r}: {err}") from None
    if not callable(fn):
        raise ConfigError(f"reward function {path!r} is not callable.")
    return fn


def _call_reward_function(func: Callable, prompts: list, completions: list, kwargs: dict[str, Any]) -> Any:
    """Call a reward function the way TRL's GRPOTrainer does, or positionally.

    Keyword call, func(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns),
    when every parameter without a default is one of those names and the function names `prompts`,
    `completions` or `completion_ids` or takes **kwargs (`def f(completions, **kwargs)`,
    `def f(completion_ids, **kwargs)`, `def f(prompts, completions, answer)`). Otherwise positional:
    func(prompts, completions, **keywords). A function without **kwargs is given only the keywords it
    names, so extra dataset columns never break `def f(prompts, completions)`."""
    available = {"prompts": prompts, "completions": completions, **kwargs}
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return func(prompts, completions, **kwargs)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = {
        n: p
        for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    required = [n for n, p in named.items() if p.default is inspect.Parameter.empty]
    keyword_style = all(n in available for n in required) and (
        var_kw or bool({"prompts", "completions", "completion_ids"} & named.keys())
    )
    if keyword_style:
        return func(**{k: v for k, v in available.items() if var_kw or k in named})
    return func(prompts, completions, **{k: v for k, v in kwargs.items() if var_kw or k in named})


def _run_concurrently(awaitables: list[Any]) -> list[Any]:
    """Await `awaitables` together on one event loop and return their results (an exception in
    place of a result that raised). Inside a running loop (a notebook), on a fresh loop in a helper
    thread, since that loop cannot be blocked on."""

    async def gather() -> list[Any]:
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def reward_function_matrix(
    funcs: RewardFunction | Sequence[RewardFunction],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    *,
    columns: Mapping[str, Sequence[Any]] | None = None,
    extras: Mapping[str, Any] | None = None,
    scored_elsewhere: bool = False,
) -> torch.Tensor:
    """Each function's scores, (B, F) float32, validated.

    Every function gets the prompts, the completions and the dataset columns and must return B
    finite real numbers or None (TRL's multi-task rewards: the function does not apply to that row;
    NaN in its column, which the weighted sums skip). Anything else (wrong length, NaN, inf,
    non-number) raises ValueError naming the function and the first bad row. A row where every function
    returned None gets TRL's warning ("All reward functions returned None ...", naming the row) unless
    `scored_elsewhere` (a reward model also scores every row); its weighted sum is 0, as TRL's nansum.
    An exception raised inside a function becomes
    RewardFunctionRaised (chained from it). TRL's new PPO accepted only nn.Module reward models
    (TRL#2518). Functions written for TRL's GRPO (`def f(completions, **kwargs)`, prompts passed as a
    keyword) are called with keywords; others positionally as f(prompts, completions, **columns)
    (`_call_reward_function`). `extras`: keywords passed whole, not per row — the trainers pass
    `completion_ids` (each row's token ids up to and including its stop token) and `trainer_state`
    (the transformers.TrainerState), as TRL's GRPOTrainer does. `async def` functions are awaited
    together, concurrently.
    """
    funcs = [funcs] if callable(funcs) else list(funcs)
    if not funcs:
        raise ValueError("at least one reward function is required")
    B = len(prompts)
    if len(completions) != B:
        raise ValueError(f"got {B} prompts but {len(completions)} completions")
    columns = dict(columns or {})
    for key, values in columns.items():
        if len(values) != B:
            raise ValueError(f"column {key!r} has {len(values)} values for {B} completions (repeat it per sample)")
    out = torch.empty(B, len(funcs), dtype=torch.float32)
    results: list[Any] = []
    for func in funcs:
        try:
            results.append(_call_reward_function(func, list(prompts), list(completions), {**columns, **(extras or {})}))
        except Exception as err:
            for earlier in results:  # coroutines of async functions called before this one
                if inspect.iscoroutine(earlier):
                    earlier.close()
            raise RewardFunctionRaised(reward_function_path(func), err) from err
    pending = [j for j, result in enumerate(results) if inspect.isawaitable(result)]
    if pending:  # `async def` reward functions (e.g. calls to a remote grader) run concurrently
        awaited = _run_concurrently([results[j] for j in pending])
        for j, result in zip(pending, awaited):
            if isinstance(result, BaseException):
                raise RewardFunctionRaised(reward_function_path(funcs[j]), result) from result
            results[j] = result
    for j, (func, result) in enumerate(zip(funcs, results)):
        name = reward_function_name(func)
        if isinstance(result, torch.Tensor):
            result = result.detach().cpu().reshape(-1).tolist()
        try:
            n = len(result)
        except TypeError:
            raise RewardFunctionError(
                f"reward function {name!r} returned {type(result).__name__}, expected a list of {B} floats"
            ) from None
        if n != B:
            raise RewardFunctionError(f"reward function {name!r} returned {n} values for {B} completions")
        for i, value in enumerate(result):
            if value is None:
                out[i, j] = math.nan
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                raise RewardFunctionError(
                    f"reward function {name!r} returned {value!r} at row {i + 1} of {B} "
                    f"(completion {str(completions[i])[:80]!r}); every value must be a finite number, or None "
                    "where the function does not apply"
                )
            out[i, j] = float(value)
    unscored = torch.isnan(out).all(dim=1).nonzero()
    if len(unscored) and not scored_elsewhere:
        # TRL's behaviour: a warning naming the first such row, and the row's weighted sum is 0 (nansum)
        i = int(unscored[0])
        row = {key: values[i] for key, values in columns.items()}
        row.update(prompt=prompts[i], completion=completions[i])
        names = ", ".join(repr(reward_function_name(f)) for f in funcs)
        logger.warning(
            "All reward functions returned None for the following kwargs:\n%s\n"
            "Please ensure that at least one reward function returns a valid reward. (%d of %d completions got "
            "None from every reward function (%s); their reward is 0.)",
            row,
            len(unscored),
            B,
            names,
        )
    return out


def reward_function_scores(
    funcs: RewardFunction | Sequence[RewardFunction],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    *,
    weights: Sequence[float] | None = None,
    columns: Mapping[str, Sequence[Any]] | None = None,
    extras: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Σ_j weight_j · f_j(prompts, completions, **columns, **extras), (B,) float32 (weights default to 1);
    a function's None (NaN) is left out of its row's sum, as TRL's nansum."""
    matrix = reward_function_matrix(funcs, prompts, completions, columns=columns, extras=extras)
    if weights is None:
        return matrix.nansum(-1)
    if len(weights) != matrix.size(1):
        raise ValueError(f"got {len(weights)} reward weights for {matrix.size(1)} reward functions")
    return (matrix * torch.tensor([float(w) for w in weights], dtype=torch.float32)).nansum(-1)


def apply_missing_eos_penalty(scores: torch.Tensor, ended: torch.Tensor, penalty: float | None) -> torch.Tensor:
    """scores − penalty where the completion did not end on a stop token (new tensor).

    `ended` is Rollout.ended: judged on the completion only and on the configured stop tokens, not
    on eos_token_id over prompt + completion (TRL PR #5338, TRL#6805).
    """
    if penalty is None:
        return scores
    return scores - penalty * (~ended.to(scores.device, torch.bool)).to(scores.dtype)


class RewardSource:
    """Scores completions: a reward model, text reward functions, or both (summed with weights).

    `reward` may be an nn.Module (a sequence-classification reward model; scored at the last real
    token, re-tokenized when its tokenizer differs from the policy's), a callable
    `f(prompts, completions, **columns) -> list[float]`, or a list of those. The missing-EOS
    penalty looks at the completion only (`rollout.ended`, set by the configured stop tokens).
    Reward functions also get `completion_ids` and `trainer_state` (`self.trainer_state`, which the
    online trainers point at their transformers.TrainerState when training starts), as in TRL's GRPO.
    """

    def __init__(
        self,
        reward: Any,
        *,
        policy_tokenizer: Any,
        reward_tokenizer: Any = None,
        weights: Sequence[float] | None = None,
        batch_size: int = 64,
        missing_eos_penalty: float | None = None,
    ) -> None:
        items = list(reward) if isinstance(reward, (list, tuple)) else [reward]
        if not items or any(r is None for r in items):
            raise ConfigError(
                "No reward source provided: pass a reward model (reward_model_path) or reward functions (reward_funcs)."
            )
        self.models = [r for r in items if isinstance(r, nn.Module)]
        self.funcs = [r for r in items if not isinstance(r, nn.Module)]
        if weights is not None and len(weights) != len(items):
            raise ConfigError(
                f"reward_weights has {len(weights)} entries for {len(items)} rewards; give one weight per reward."
            )
        weights = list(weights) if weights is not None else [1.0] * len(items)
        self.items, self.weights = items, [float(w) for w in weights]
        self.model_weights = [w for r, w in zip(items, weights) if isinstance(r, nn.Module)]
        self.func_weights = [w for r, w in zip(items, weights) if not isinstance(r, nn.Module)]
        self.policy_tokenizer = policy_tokenizer
        if isinstance(reward_tokenizer, (list, tuple)):  # one per reward, aligned with `reward`
            if len(reward_tokenizer) != len(items):
                raise ConfigError(
                    f"got {len(reward_tokenizer)} reward tokenizers for {len(items)} rewards; give one per reward "
                    "(None for a reward function or a reward model that reads the policy's tokens)."
                )
            self.reward_tokenizers = [t for r, t in zip(items, reward_tokenizer) if isinstance(r, nn.Module)]
        else:
            self.reward_tokenizers = [reward_tokenizer] * len(self.models)
        self.batch_size, self.missing_eos_penalty = batch_size, missing_eos_penalty
        self.trainer_state: Any = None
        # What reward functions logged through their log_metric / log_extra keywords (TRL 1.x) since
        # the trainer last took them (`take_logs`); `_rows`: the rows of the scoring call in progress.
        self.logged_metrics: dict[str, list[float]] = {}
        self.logged_columns: dict[str, list[Any]] = {}
        self._rows = 0
        # TRL 1.x's form: reward functions get a conversational row's prompt as its messages and its
        # completion as [{"role": "assistant", "content": text}] (trainers/online.py, row_texts).
        self.messages = False

    def function_extras(self, rollout: Rollout) -> dict[str, Any]:
        """The keywords every reward function gets besides prompts, completions and the dataset
        columns (TRL 1.x GRPO's and RLOO's): each row's completion token ids (up to and including its
        stop token), the trainer's state, and the `log_metric` / `log_extra` callables."""
        ids = rollout.completion_ids.cpu().tolist()
        lengths = rollout.completion_lengths.cpu().tolist()
        return {
            "completion_ids": [row[:n] for row, n in zip(ids, lengths)],
            "trainer_state": self.trainer_state,
            "log_extra": self.log_extra,
            "log_metric": self.log_metric,
        }

    def log_metric(self, name: str, value: Any) -> None:
        """`log_metric(name, value)`, a reward function's keyword: one scalar for this rollout batch. The
        trainer logs metric `name` as the mean of the values of a rollout batch over all processes,
        averaged over the rollout batches of the logging step (TRL 1.x's `_log_metric`)."""
        if not isinstance(name, str) or not name:
            raise RewardFunctionError(f"log_metric got the name {name!r}; name the metric with a non-empty string.")
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise RewardFunctionError(f"log_metric({name!r}, {value!r}): the value must be one finite number.")
        self.logged_metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        """`log_extra(column, values)`, a reward function's keyword: one value per completion scored in
        this call, shown as column `column` of the sample table next to each completion (TRL 1.x's
        `_log_completion_extra`, which fills its completions table). A column logged twice in one
        call keeps the last values."""
        if not isinstance(column, str) or not column:
            raise RewardFunctionError(f"log_extra got the column {column!r}; name the column with a non-empty string.")
        values = values.detach().cpu().tolist() if isinstance(values, torch.Tensor) else list(values)
        if len(values) != self._rows:
            raise RewardFunctionError(
                f"log_extra({column!r}, ...) got {len(values)} values for {self._rows} completions; "
                "give one value per completion."
            )
        self.logged_columns[column] = values

    def take_logs(self) -> tuple[dict[str, list[float]], dict[str, list[Any]]]:
        """(metrics, columns) logged by reward functions since the last call, and forget them."""
        logs = self.logged_metrics, self.logged_columns
        self.logged_metrics, self.logged_columns = {}, {}
        return logs

    @property
    def needs_texts(self) -> bool:
        """Whether scoring needs each row's prompt and completion: reward functions read them, and a
        reward model with its own tokenizer renders conversational rows with its chat template."""
        return bool(self.funcs) or (self.messages and any(t is not None for t in self.reward_tokenizers))

    @property
    def reward_tokenizer(self) -> Any:
        """The first reward model's own tokenizer (None: it reads the policy's token ids)."""
        return next((t for t in self.reward_tokenizers if t is not None), None)

    @property
    def names(self) -> list[str]:
        """Each reward's name in metrics (`rewards/<name>/mean`, TRL's): a function's __name__, a reward
        model's folder or hub name."""
        names = []
        for r in self.items:
            if isinstance(r, nn.Module):
                path = str(getattr(getattr(r, "config", None), "_name_or_path", "") or "")
                names.append(path.rstrip("/").split("/")[-1] or "reward_model")
            else:
                names.append(reward_function_name(r))
        return names

    @torch.no_grad()
    def __call__(
        self, rollout: Rollout, prompts: list[str], completions: list[str], columns: dict[str, list] | None = None
    ) -> torch.Tensor:
        """The score of each row, (B,): `weighted_sum` of `per_reward`."""
        return self.weighted_sum(self.per_reward(rollout, prompts, completions, columns), rollout.ended)

    def weighted_sum(self, rewards: torch.Tensor, ended: torch.Tensor) -> torch.Tensor:
        """Σ_f weights_f · rewards[:, f] over the rewards each row has (a function's None, NaN, is left
        out, as TRL's nansum), minus missing_eos_penalty where the completion did not end. (B,)."""
        weights = torch.tensor(self.weights, dtype=torch.float32, device=rewards.device)
        return apply_missing_eos_penalty((rewards.float() * weights).nansum(-1), ended, self.missing_eos_penalty)

    def check_finite(self, rewards: torch.Tensor) -> None:
        """FloatingPointError unless every reward-model score is finite and every function score is finite
        or NaN (a function's None, validated by reward_function_matrix)."""
        skipped = torch.tensor([not isinstance(r, nn.Module) for r in self.items], device=rewards.device)
        skipped = torch.cat([skipped, skipped.new_zeros(rewards.size(1) - skipped.numel())])
        if not (torch.isfinite(rewards) | (torch.isnan(rewards) & skipped)).all():
            raise FloatingPointError(f"reward scores are not finite ({rewards.flatten()[:4].tolist()} ...).")

    @torch.no_grad()
    def per_reward(
        self, rollout: Rollout, prompts: list[str], completions: list[str], columns: dict[str, list] | None = None
    ) -> torch.Tensor:
        """Each reward's own scores, unweighted and without the missing-EOS penalty: (B, F) float32,
        one column per reward in the order given (`self.weights` holds their weights); NaN where a
        reward function returned None (it does not apply to that row). GRPO's multi-objective
        advantages combine them; `__call__` is `weighted_sum` of them."""
        device = rollout.completion_ids.device
        out = torch.zeros(len(rollout), len(self.items), dtype=torch.float32, device=device)
        model_columns = [j for j, r in enumerate(self.items) if isinstance(r, nn.Module)]
        func_columns = [j for j, r in enumerate(self.items) if not isinstance(r, nn.Module)]
        # conversational rows (messages, `self.messages`): the conversation a reward model with its own
        # tokenizer renders with its own chat template
        conversations = [
            p + c if isinstance(p, list) and isinstance(c, list) else None for p, c in zip(prompts, completions)
        ]
        for j, model, reward_tokenizer in zip(model_columns, self.models, self.reward_tokenizers):
            out[:, j] = reward_model_scores(
                model,
                rollout,
                batch_size=self.batch_size,
                policy_tokenizer=self.policy_tokenizer,
                reward_tokenizer=reward_tokenizer,
                conversations=conversations if any(c is not None for c in conversations) else None,
            ).to(device=device, dtype=torch.float32)
        if self.funcs:
            self._rows = len(rollout)
            matrix = reward_function_matrix(
                self.funcs,
                prompts,
                completions,
                columns=columns,
                extras=self.function_extras(rollout),
                scored_elsewhere=bool(self.models),
            )
            out[:, func_columns] = matrix.to(device=device, dtype=torch.float32)
        return out
