"""The default engine's one-token decode forward, replayed from a `torch.jit.trace` on CPU.

A decode step of a small model is almost all per-operator overhead: at pythia-14m's shape, 16 rows,
transformers' GPTNeoX forward costs about 4 ms where its arithmetic is under 1 ms, spent in Python
(module calls, the cache object, output classes) around about 200 tensor operations. `torch.jit.trace`
records those operations once (about 0.15 s) and replays them from TorchScript's interpreter: the same
kernels in the same order, so the logits and the cache are bitwise those of the eager forward, at about
two thirds of its time (benchmarks/README.md, "A traced decode step").

A trace is only right where the step's Python decisions do not depend on the inputs' values, so it is
used only where every decision is the same at every decode step of the engine's default path:

- a CPU model in eval mode (as `generation_mode` puts it; a trace would freeze dropout out) of torch's
  own tensors (no DTensor or DeepSpeed-partitioned parameters), with no module hooks (accelerate's
  offload hooks, ZeRO-3, FSDP, PEFT adapters that can be switched off: none of their Python runs in a
  trace; transformers' own output-capturing hooks, which do nothing in a decode step, aside) and no
  autocast but CPU bf16 autocast (`--bf16` on CPU; see below);
- a transformers DynamicCache of plain layers, fed with the prepared (rows, 1, 1, keys) bool mask or no
  mask (`compat.takes_prepared_decode_mask`: plain causal attention through SDPA);
- no rotary embedding whose frequencies depend on the sequence length reached (transformers' "dynamic"
  NTK scaling and "longrope": they switch frequencies in Python once a position passes the original
  context length, a decision a trace made before that point would never take again);
- no tracing already in progress, and POSTTRAIN_TRACE_DECODE not `off`.

Each trace is checked when it is made, on the step it was traced from and on one row fewer and one
cached position fewer (the shapes change from step to step and when stopped rows are compacted out):
its logits and cache must equal the eager forward's exactly, or the model keeps the eager forward for
the rest of the process. Traces are kept per model object and per kind of step (mask or none; at most
or more than cpu_linear.SMALL_ROWS rows, where posttrain's oneDNN layers change kernel; which layers run on
packed weights, which every replay takes as inputs: they are made anew for each rollout), and made again
when the model's parameters, buffers or layer forwards are not the ones traced (a deep copy, a replaced
Parameter, posttrain's oneDNN linear layers switched on or off or their kernels decided otherwise);
in-place updates (optimizer steps, `load_state_dict`) reach the trace, which is handed the same tensors at every replay.

Under CPU bf16 autocast the tracer records the casts autocast makes, so a trace is made with autocast's
cast cache off (a weight's bf16 copy from the cache would otherwise be frozen into the trace as a
constant, stale after the next optimizer step) and kept only where it casts no parameter or buffer to
bf16: the linear layers then run on the rollout's packed bf16 weights (cpu_linear.autocast_packed_weights),
inputs of every replay, and only activations are cast, as in the eager step. A trace that would cast a
weight at every step (a layer left on F.linear, a model multiplying by its weights in its own code) is
not used: the eager step casts each weight once per rollout from the cache. Such a trace holds autocast's
casts, so it replays with autocast off (a model's own `torch.autocast(enabled=False)` block, which the
tracer does not record, would otherwise run in bf16 at replay). Traces made under autocast and without it
are kept apart.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from posttrain import compat, cpu_linear
from posttrain.configs import TRACE_DECODE_ENV as ENV  # noqa: F401 (re-exported: the variable's name)
from posttrain.configs import trace_decode_mode as mode_from_env
from posttrain.cpu_linear import KERNELS, SMALL_ROWS, autocast_bf16, autocast_forward

logger = logging.getLogger(__name__)
_NO_CONTEXT = contextlib.nullcontext()


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu" and not hasattr(t, "ds_id")


def _length_dependent_rope(module: nn.Module) -> bool:
    """Whether `module` is a rotary embedding that recomputes its frequencies from the positions it sees
    (`rope_type` "dynamic" / "longrope"; a dict per layer type in some transformers 5.x models)."""
    kind = getattr(module, "rope_type", None)
    kinds = kind.values() if isinstance(kind, dict) else (kind,)
    return any(isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds)


def traceable(model: nn.Module) -> bool:
    """Whether `model`'s decode forward may be traced (the module-level rules, before any cache is seen)."""
    if mode_from_env() == "off" or not hasattr(torch.jit, "trace") or torch.jit.is_tracing():
        return False
    if torch.is_autocast_enabled("cpu") and not autocast_bf16():
        return False
    if getattr(model, "_compiled_call_impl", None) is not None:
        return False
    module_hooks = torch.nn.modules.module
    if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
        return False
    for module in model.modules():
        if module.training:  # a trace freezes eval-mode behaviour: dropout would be lost
            return False
        hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
        if any(not _inactive_output_capture(hook) for hook in hooks) or hasattr(module, "_hf_hook"):
            return False
        if type(module).__module__.split(".")[0] == "peft" or _length_dependent_rope(module):
            return False
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and all(_plain(t) for t in tensors)


def _inactive_output_capture(hook: Any) -> bool:
    """Whether a forward hook is transformers' output-capturing hook (transformers 5: installed on the
    layers by the first forward that asks for hidden states or attentions, e.g. `completion_forward`'s
    hidden states, and kept). It records outputs only while such a forward runs, never in the decode
    step, which asks for neither: a trace that leaves it out computes the same step."""
    return getattr(hook, "__name__", None) == "output_capturing_hook" and str(
        getattr(hook, "__module__", "")
    ).startswith("transformers.")


def _fingerprint(model: nn.Module) -> tuple:
    """What a trace of `model` depends on besides tensor values: which parameter and buffer objects,
    which forward each module runs and, for posttrain.cpu_linear's switched layers, the kernels decided
    (cpu_linear swaps nn.Linear forwards in place; a trace records the kernel each call took)."""
    forwards = []
    for module in model.modules():
        forward = module.__dict__.get("forward")
        forward = getattr(forward, "__func__", forward)
        if forward is autocast_forward:
            # set exactly where a packed bf16 weight is (cpu_linear.autocast_packed_weights), which the traces'
            # keys record: left out here, a model whose rollouts alternate between packed bf16 weights and
            # none (a float32 evaluation between bf16 rollouts) keeps the traces of both
            forward = None
        forwards.append((id(forward) if forward is not None else None, module.__dict__.get(KERNELS)))
    return (tuple(id(p) for p in model.parameters()), tuple(id(b) for b in model.buffers()), tuple(forwards))


class _DecodeForward:
    """(input_ids, position_ids, [mask], k_0, v_0, k_1, v_1, ..., *fixed) -> (logits, k_0', v_0', ...): one
    decode forward of `model` over a DynamicCache built around the given tensors, flattened to tensors in
    and out as `torch.jit.trace` needs. `fixed`: the rollout's packed linear weights
    (cpu_linear.packed_weights), then the model's parameters and buffers (`state_tensors`); the layers read
    them themselves. They are passed in so that the trace records them as inputs (the tracer knows a
    tensor by its identity), not as constants, and so that the trace is of a plain function: tracing the
    module would also build a TorchScript copy of every submodule, two thirds of the time a trace takes at
    pythia-14m's shape, and each replay would look every weight up through those copies."""

    def __init__(
        self, model: nn.Module, cache_name: str, keep_kwargs: dict[str, int], masked: bool, fixed: int
    ) -> None:
        self.model, self.cache_name, self.keep_kwargs = model, cache_name, dict(keep_kwargs)
        self.masked, self.fixed = masked, fixed

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *tensors: torch.Tensor) -> tuple:
        tensors = tensors[: len(tensors) - self.fixed]
        mask, flat = (tensors[0], tensors[1:]) if self.masked else (None, tensors)
        cache = compat.dynamic_cache_of([(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)])
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            **{self.cache_name: cache},
            use_cache=True,
            **self.keep_kwargs,
        )
        pairs = compat.dynamic_cache_tensors(compat.output_cache(out))
        if pairs is None:
            raise TypeError("the model did not return the DynamicCache it was given")
        return (out.logits, *(t for pair in pairs for t in pair))


def state_tensors(model: nn.Module) -> tuple[torch.Tensor, ...]:
    """`model`'s parameters and buffers, each tensor once (a tied weight is one input of a trace)."""
    return (*model.parameters(), *model.buffers())


# model -> (fingerprint, {(masked, cache_name, keep_kwargs, rows <= SMALL_ROWS, bf16 autocast, layers on packed
# weights): traced step, or None where it is not used})
_TRACES: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, dict]] = weakref.WeakKeyDictionary()
# Held while _TRACES is read or written and while a trace is made: two models decoding at once on two threads
# (XPO's rollouts, runtime.side_by_side) never trace together (the warning filters a trace sets are global).
_LOCK = threading.Lock()


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def _smaller(args: tuple, masked: bool, fixed: int) -> tuple:
    """The same step with one row fewer (when there are two or more) and one cached position fewer
    (the packed weights and the model's state, the last `fixed` arguments, as they are)."""
    args, weights = args[: len(args) - fixed], args[len(args) - fixed :]
    rows = slice(1, None) if args[0].size(0) > 1 else slice(None)
    input_ids, position_ids, *rest = (a[rows] for a in args)
    if masked:
        rest[0] = rest[0][..., :-1]
    kv = [t[:, :, :-1] for t in rest[1:]] if masked else [t[:, :, :-1] for t in rest]
    return (input_ids, position_ids, *(rest[:1] if masked else []), *kv, *weights)


# Operators through which a value is still a parameter's or buffer's data (its dtype unchanged).
_VIEWS = frozenset(
    f"aten::{name}"
    for name in ("t", "transpose", "permute", "view", "reshape", "slice", "select", "expand", "contiguous", "detach")
)
_CASTS = frozenset(("aten::to", "aten::_to_copy", "aten::type_as"))
_REDUCED = frozenset(("BFloat16", "Half"))


def _casts_parameters(traced: Any, state: int) -> bool:
    """Whether the trace casts a parameter or buffer (one of its last `state` inputs, or a view of one) to
    bf16 or fp16: under autocast that cast would run again at every replay."""
    inputs = list(traced.graph.inputs())
    state_inputs = {value.unique() for value in inputs[len(inputs) - state :]} if state else set()
    for node in traced.graph.nodes():
        if node.kind() not in _CASTS:
            continue
        dtype = getattr(node.output().type(), "scalarType", lambda: None)()
        if dtype not in _REDUCED:
            continue
        source = node.inputsAt(0)
        while source.node().kind() in _VIEWS:
            source = source.node().inputsAt(0)
        if source.unique() in state_inputs:
            return True
    return False


def _simplify(graph: Any) -> None:
    """Removes from a trace's graph what repeats or does nothing, in place: common subexpressions (the
    rotary embedding's cos/sin views and the shape arithmetic every layer redoes), eval-mode dropout and
    what folds to constants. Every remaining kernel sees the values it saw before, so the logits are
    bitwise the same (`_trace` checks them). Without it, replayed with the optimizer off, rollouts of a
    pythia-14m-shaped policy took 1.5% longer (benchmarks/README.md, "The traced decode step, traced faster")."""
    torch._C._jit_pass_cse(graph)
    for node in list(graph.nodes()):
        if node.kind() == "aten::dropout" and node.inputsAt(2).toIValue() is False:
            node.output().replaceAllUsesWith(node.inputsAt(0))
            node.destroy()
    torch._C._jit_pass_peephole(graph, True)
    torch._C._jit_pass_constant_propagation(graph)
    torch._C._jit_pass_dce(graph)


def _replay(step: Any, args: tuple, autocast: bool) -> tuple:
    """A trace's outputs for `args`. One made under autocast holds the casts autocast made while it was
    recorded, and none inside the model's own `torch.autocast(enabled=False)` blocks (which the tracer does
    not record: transformers 4.x computes its rotary frequencies in one), so it replays with autocast off;
    replayed under autocast, those blocks' matmuls would run in bf16.

    TorchScript's graph executor is told not to optimize: for a trace it would first profile a run and then
    rewrite the graph, which took 60 and 27 ms at the first two replays of pythia-14m's step (against
    8 and 2 ms without) and made later replays no faster on a CPU, where it has no fuser to apply."""
    with torch.jit.optimized_execution(False), torch.autocast("cpu", enabled=False) if autocast else _NO_CONTEXT:
        return step(*args)


def _trace(model: nn.Module, key: tuple, args: tuple) -> Any:
    """A checked trace of the decode forward for `args`, or None (the eager forward is used instead)."""
    masked, cache_name, keep, _, autocast, packed_layers = key
    state = len(state_tensors(model))
    eager = _DecodeForward(model, cache_name, dict(keep), masked, len(packed_layers) + state)
    cache_enabled = torch.is_autocast_cache_enabled()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TracerWarnings, and torch's deprecation notice of jit.trace
            torch.set_autocast_cache_enabled(False)  # every cast autocast makes is recorded, none cached
            try:
                traced = torch.jit.trace(eager.__call__, args, check_trace=False)
            finally:
                torch.set_autocast_cache_enabled(cache_enabled)
            _simplify(traced.graph)
            if autocast and _casts_parameters(traced, state):
                logger.info("decode step of %s not traced under autocast: it casts weights", type(model).__name__)
                return None
            for check in (args, _smaller(args, masked, eager.fixed)):
                if not _same(_replay(traced, check, autocast), eager(*check)):
                    logger.info(
                        "decode step of %s not traced: the trace differs from the eager forward", type(model).__name__
                    )
                    return None
    except Exception as error:  # any model code the tracer cannot follow keeps the eager forward
        logger.info("decode step of %s not traced: %s", type(model).__name__, error)
        return None
    return traced


class TracedDecode:
    """The decode forwards of one `generate` call on `model`: `__call__` returns the step's logits and
    updates `cache` in place, or returns None when this step must run eagerly. The packed linear weights
    (and bf16 biases) the call's layers run on (cpu_linear.packed_weights, autocast_packed_weights) and the
    model's parameters and buffers are inputs of every replay, read from the model when this is built."""

    def __init__(self, model: nn.Module, cache_name: str, keep_kwargs: dict[str, int]) -> None:
        self.model, self.cache_name, self.keep = model, cache_name, tuple(sorted(keep_kwargs.items()))
        inputs = cpu_linear.packed_inputs(model)
        self.packed = tuple(tensor for _, tensor in inputs) + state_tensors(model)
        # which layer reads each of them (a trace feeds each input to the layer it was traced with)
        self.packed_layers = tuple(index for index, _ in inputs)
        fingerprint = _fingerprint(model)
        with _LOCK:
            entry = _TRACES.get(model)
            if entry is None or entry[0] != fingerprint:
                entry = (fingerprint, {})
                _TRACES[model] = entry
        self.steps = entry[1]

    def __call__(
        self, input_ids: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor, cache: Any
    ) -> torch.Tensor | None:
        if mask is not None and (mask.dim() != 4 or mask.dtype != torch.bool):
            return None
        pairs = compat.dynamic_cache_tensors(cache)
        if pairs is None or pairs[0][0].dim() != 4 or pairs[0][0].size(-2) < 2:
            return None  # a cache too short for the check (one-token prompts) decodes eagerly
        # posttrain's oneDNN linear layers pick their kernel by row count (cpu_linear.SMALL_ROWS), a
        # decision the trace records: steps on either side of it are traced apart.
        autocast = autocast_bf16()
        key = (
            mask is not None,
            self.cache_name,
            self.keep,
            input_ids.size(0) <= SMALL_ROWS,
            autocast,
            self.packed_layers,
        )
        args = (input_ids, position_ids, *([mask] if mask is not None else []), *(t for pair in pairs for t in pair))
        args += self.packed
        if key not in self.steps:
            with _LOCK:
                if key not in self.steps:
                    self.steps[key] = _trace(self.model, key, args)
        step = self.steps[key]
        if step is None:
            return None
        out = _replay(step, args, autocast)
        compat.set_dynamic_cache_tensors(cache, [(out[i], out[i + 1]) for i in range(1, len(out), 2)])
        return out[0][:, -1, :]
