"""oneDNN matrix multiplies for float32 `nn.Linear` layers on CPU, where they measure faster.

torch runs a float32 CPU `F.linear` through its BLAS (MKL in the official wheels). On some CPUs
oneDNN, which torch also ships, is much faster at the shapes RL post-training runs: on a 2-core AMD
EPYC, (16 × 512) @ (512 × 2048) took 770 µs through MKL and 380 µs through oneDNN, and a
(848 × 128) @ (128 × 6,815) LM head 17.8 ms against 10.3 ms (benchmarks/README.md, "oneDNN linear
layers"); on others the two are even. So nothing is assumed from the CPU's name: `linear_kernels`
times both on each distinct layer shape once per process (a few milliseconds), separately at a
decode step's row count and at a training forward's, and routes a layer's calls of that size through
oneDNN only where it is clearly faster there.

The forward is oneDNN's `_linear_pointwise` (the kernel `torch.compile` emits for CPU linears); the
backward is two plain matrix multiplies, as autograd's own. Results differ from the BLAS path by
float32 rounding only (a different summation order), never in the math.

Packed weights for decoding (`packed_weights`): given a plain weight, oneDNN reorders it into its blocked
layout at every call, which is most of a decode-size call's cost. During a rollout the weights do not
change, so the rollout engine reorders each switched layer's weight once and its small calls use that
copy: on the 2-core EPYC above, the linear layers of a 70m decode step took 6.4 ms against 10.1 ms
(benchmarks/README.md, "Packed decode weights"). The copy is dropped when the rollout ends.

bf16 autocast decoding (`autocast_packed_weights`): under CPU bf16 autocast, each decode-size call of an
`nn.Linear` casts its input to bf16 and runs oneDNN's bf16 kernel on the autocast-cached bf16 weight, which
oneDNN again reorders at every call. Within a rollout under bf16 autocast, the plain float32 layers get one
each, made once from the weight cast to bf16: the same
input cast, the same bf16 arithmetic in a layout made ahead of time, the same bf16 output as autocast's
`F.linear` (on a 2-core Xeon with AMX, a 70m decode step's MLP layer took 56 µs against 112 µs;
benchmarks/README.md, "bf16 autocast decoding on a CPU with AMX"). Whether that pays is measured on the
model itself, a pass over all its layers as a decode step makes it: where every call reads its weight
from memory (a 0.5B model), the reorder is not what costs, and nothing is packed.

Control: the environment variable POSTTRAIN_CPU_LINEAR — `auto` (default: measure, use where
faster), `onednn` (every eligible layer), `off` (torch's default path). The trainers' configs check
it when they are built (`posttrain.configs.cpu_linear_mode`), before any model loads.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import types
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.configs import CPU_LINEAR_ENV as ENV  # noqa: F401 (re-exported: the variable's name)
from posttrain.configs import CPU_LINEAR_MODES as MODES
from posttrain.configs import cpu_linear_mode as mode_from_env

# `auto` keeps the default path unless oneDNN takes at most this share of its time.
FASTER = 0.85
# Calls with at most SMALL_ROWS rows (decode steps) and calls with more (prefill, scoring and training
# forwards) are decided apart, each timed at its own row count: oneDNN's lead differs between them.
SMALL_ROWS = 64
CALIBRATION_ROWS = (16, 256)
# `packed_weights` reorders weights for this many rows (oneDNN's layout hint; any row count runs on it).
PACK_ROWS = CALIBRATION_ROWS[0]
# Larger weights (a 151k-vocabulary LM head: 136M elements) are timed on their first rows of outputs
# up to this many elements: timing the whole one would cost seconds, and both kernels' time per output
# column is flat at these widths (a 16,384-column slice of Qwen2.5-0.5B's LM head gave the same ratio as
# the whole head, 2.2–2.7×, at 4, 16 and 80 rows, on a 2-core EPYC; benchmarks/README.md, "oneDNN linear
# layers"); on a 2-core Xeon the slice understated oneDNN's lead (`onednn_faster`).
MAX_CALIBRATED_ELEMENTS = 1 << 24
# The bf16 decision (`bf16_pack_calls`) times a pass over a model's first layers up to this many bytes of
# bf16 weights: 512 MiB, more than this Xeon's 300 MiB L3, and a transient 1 GiB for its two copies.
MAX_CALIBRATED_BF16_BYTES = 512 << 20


class Decision(NamedTuple):
    """Whether oneDNN runs this weight shape's calls of ≤ SMALL_ROWS rows, and of more; and after how
    many small calls a packed copy of the weight (`packed_weights`) has paid for its making (inf: never)."""

    small: bool
    large: bool
    pack_calls: float = math.inf

    @property
    def switched(self) -> bool:
        return self.small or self.large or self.pack_calls < math.inf


# A switched layer's Decision and, inside `packed_weights`, its packed weight, in the module's __dict__;
# inside `autocast_packed_weights`, the packed bf16 weight (under PACKED) and the bias cast to bf16.
KERNELS = "_posttrain_linear_kernels"
PACKED = "_posttrain_packed_weight"
PACKED_BIAS = "_posttrain_packed_bias"


_DECISIONS: dict[tuple[int, int, bool, int], Decision] = {}
# model -> {(its eligible layers' shapes, threads): after how many decode steps packed bf16 copies of those
# layers have paid for their making (inf: never)}.
_BF16_PACK_CALLS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, float]] = weakref.WeakKeyDictionary()


def available() -> bool:
    """Whether this torch build has oneDNN's linear kernel on CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def can_pack() -> bool:
    """Whether this torch build can reorder a weight into oneDNN's layout ahead of the calls."""
    try:
        return available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def can_pack_bf16() -> bool:
    """Whether oneDNN can reorder a bf16 weight on this CPU. torch's oneDNN build needs avx512bw, avx512vl
    and avx512dq or avx_ne_convert for it (an AVX2-only CPU raises "bf16 path needs the cpu support ..."),
    and there is no public query, so this asks the op itself once, on an 8 x 8 weight."""
    if not can_pack():
        return False
    try:
        _pack(torch.zeros(8, 8, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def _onednn(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if torch.jit.is_tracing():
        return _scripted_onednn()(x2, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")


@functools.cache
def _scripted_onednn() -> Any:
    """The same call compiled by TorchScript, for `torch.jit.trace` (posttrain.decode_trace): the tracer
    cannot record the op's empty `Scalar?[]` argument from Python, but records a call to this function."""
    unit = torch.jit.CompilationUnit(
        """
def onednn_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    scalars = torch.jit.annotate(List[Optional[number]], [])
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", scalars, "")
"""
    )
    return unit.onednn_linear


class _LinearFunction(torch.autograd.Function):
    """y = x Wᵀ + b through oneDNN; backward: dx = dy W, dW = dyᵀ x, db = Σ dy (over rows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.size(-1)).contiguous()
        ctx.save_for_backward(x2 if weight.requires_grad else None, weight if x.requires_grad else None)
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        return _onednn(x2, weight, bias).view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.size(-1))
        dx = g2.mm(weight).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        dw = g2.t().mm(x2) if ctx.needs_input_grad[1] else None
        db = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear through oneDNN (float32 CPU tensors; empty inputs and anything else: F.linear)."""
    if x.dim() < 2 or x.numel() == 0 or x.dtype != torch.float32 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    grads = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if grads:
        return _LinearFunction.apply(x, weight, bias)
    return _onednn(x.reshape(-1, x.size(-1)).contiguous(), weight, bias).view(*x.shape[:-1], weight.size(0))


def _runs_on_packed(input: torch.Tensor) -> bool:
    return (
        input.dim() >= 2
        and input.numel() > 0
        and input.dtype == torch.float32
        and input.device.type == "cpu"
        and not torch.is_grad_enabled()
    )


def _forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """A switched layer's forward: each call to the kernel decided for its size; small calls without
    gradients to the packed weight while `packed_weights` holds one."""
    decision: Decision = self.__dict__[KERNELS]
    if input.numel() <= SMALL_ROWS * self.in_features:
        packed = self.__dict__.get(PACKED)
        if packed is not None and _runs_on_packed(input):
            return _onednn(input.reshape(-1, self.in_features).contiguous(), packed, self.bias).view(
                *input.shape[:-1], self.out_features
            )
        onednn = decision.small
    else:
        onednn = decision.large
    return linear(input, self.weight, self.bias) if onednn else F.linear(input, self.weight, self.bias)


def _plain(t: torch.Tensor | None) -> bool:
    """A float32 CPU tensor or Parameter of torch's own classes (no DTensor, no DeepSpeed-partitioned
    or quantized parameter)."""
    return (
        t is None
        or (type(t) in (torch.Tensor, nn.Parameter) and t.dtype == torch.float32 and t.device.type == "cpu")
        and not hasattr(t, "ds_id")
    )


def eligible(module: nn.Module) -> bool:
    """A plain float32 CPU `nn.Linear` (its exact class, whose forward nobody replaced)."""
    return (
        type(module) is nn.Linear
        and "forward" not in module.__dict__
        and _plain(module.weight)
        and module.weight.dim() == 2
        and _plain(module.bias)
    )


def _best_time(fn: Any, *args: Any, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


def _timed(fn: Any) -> tuple[Any, float]:
    """fn()'s result and the seconds it took."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def onednn_faster(out_features: int, in_features: int, bias: bool) -> Decision:
    """Time F.linear and oneDNN on random float32 inputs of this weight shape (its first outputs up to
    MAX_CALIBRATED_ELEMENTS weights), at 16 rows for calls of ≤ SMALL_ROWS rows and at 256 for larger
    ones (once per shape and thread count per process); each field is True when oneDNN takes ≤ FASTER
    of the default path's time at that size, or takes less time at all where only the weight's first outputs
    were timed: that prefix sits in cache and the whole weight does not, and out of cache oneDNN's lead is
    larger (Qwen2.5-0.5B's LM head: 0.59–0.64 of the default's time whole against 0.69–0.83 on the prefix;
    docs/internals.md, "cpu_linear.py"). At 16 rows it also times oneDNN on a packed weight and the
    packing: `pack_calls` is the packing's time over what each small call then saves, where the packed
    call is faster than the small calls' kernel at all. No FASTER margin there: these timings find the weight
    in cache, and inside a decode step it is not, where the packed call's lead is larger (the 14m LM head at 16
    rows, under torch.profiler: 0.64 ms packed against 1.27 ms on torch's path inside rollouts; warm, 0.34–0.53
    against 0.47–0.67 ms). With the margin, warm noise left that head unpacked in 2 of 5 fresh processes
    (benchmarks/README.md, "The LM head's packing decision")."""
    key = (out_features, in_features, bias, torch.get_num_threads())
    if key not in _DECISIONS:
        timed_out = min(out_features, max(1, MAX_CALIBRATED_ELEMENTS // in_features))
        prefix = timed_out < out_features  # timed on its first outputs: any lead counts (see above)
        faster, pack_calls = [], math.inf
        with torch.no_grad():
            w = torch.randn(timed_out, in_features)
            b = torch.randn(timed_out) if bias else None
            for rows in CALIBRATION_ROWS:
                x = torch.randn(rows, in_features)
                F.linear(x, w, b), linear(x, w, b)  # warm both
                onednn, default = _best_time(linear, x, w, b), _best_time(F.linear, x, w, b)
                faster.append(onednn < default if prefix else onednn <= FASTER * default)
                if rows == PACK_ROWS and can_pack():
                    packed = _pack(w)
                    linear(x, packed, b)
                    kernel, with_packed = onednn if faster[-1] else default, _best_time(linear, x, packed, b)
                    if with_packed < kernel:
                        pack_calls = _best_time(_pack, w, repeats=3) / (kernel - with_packed)
        _DECISIONS[key] = Decision(*faster, pack_calls)
    return _DECISIONS[key]


def for_training(
    models: Iterable[nn.Module], *, mixed_precision: str, compiled: bool
) -> contextlib.AbstractContextManager:
    """`linear_kernels(models)` for a training run in eager float32: mixed precision (autocast picks the
    kernels) and compiled runs (`torch.compile` emits its own) keep torch's path."""
    if mixed_precision != "no" or compiled:
        return contextlib.nullcontext([])
    return linear_kernels(models)


@contextlib.contextmanager
def linear_kernels(models: Iterable[nn.Module], mode: str | None = None) -> Iterator[list[nn.Linear]]:
    """Within the block, each eligible `nn.Linear` of `models` runs through oneDNN where `mode` says
    so (None: POSTTRAIN_CPU_LINEAR); yields the layers switched. Their own forward comes back on exit,
    also after an error."""
    mode = mode_from_env() if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"cpu linear mode {mode!r}: expected one of {', '.join(MODES)}.")
    switched: list[nn.Linear] = []
    if mode != "off" and available():
        seen: set[int] = set()
        for model in models:
            for module in model.modules():
                if id(module) in seen or not eligible(module):
                    continue
                seen.add(id(module))
                shape = (module.out_features, module.in_features, module.bias is not None)
                decision = Decision(True, True, 0.0) if mode == "onednn" else onednn_faster(*shape)
                if decision.switched:
                    module.__dict__[KERNELS] = decision
                    module.forward = types.MethodType(_forward, module)
                    switched.append(module)
    try:
        yield switched
    finally:
        for module in switched:
            for name in ("forward", KERNELS, PACKED):
                module.__dict__.pop(name, None)


@contextlib.contextmanager
def packed_weights(model: nn.Module, calls: int) -> Iterator[list[torch.Tensor]]:
    """Within the block, each layer of `model` switched by `linear_kernels` whose packed weight pays for
    itself within `calls` small calls (a rollout's decode steps) runs its small calls without gradients on
    a copy of its weight in oneDNN's blocked layout, made here once instead of by oneDNN at every call;
    bitwise the same values as the plain weight's oneDNN call. Yields the copies in module order (the
    decode trace takes them as inputs) and drops them on exit. The weights must not change inside the
    block: an optimizer step in it would leave the copies stale."""
    layers: list[nn.Module] = []
    try:
        if can_pack():
            with torch.no_grad():
                for module in model.modules():
                    decision = module.__dict__.get(KERNELS)
                    if decision is not None and "forward" in module.__dict__ and decision.pack_calls <= calls:
                        module.__dict__[PACKED] = _pack(module.weight)
                        layers.append(module)
        yield [module.__dict__[PACKED] for module in layers]
    finally:
        for module in layers:
            module.__dict__.pop(PACKED, None)


def autocast_bf16() -> bool:
    """Whether CPU autocast is on with bfloat16 (the mixed precision of `--bf16` on CPU)."""
    if not torch.is_autocast_enabled("cpu"):
        return False
    get_dtype = getattr(torch, "get_autocast_dtype", None)
    dtype = get_dtype("cpu") if get_dtype is not None else torch.get_autocast_cpu_dtype()
    return dtype == torch.bfloat16


def bf16_pack_calls(model: nn.Module, layers: list[nn.Linear]) -> float:
    """After how many decode steps packed bf16 copies of `layers` (the eligible linear layers of `model`)
    pay for their making under bf16 autocast (inf: never), measured on the model's own weights as a
    decode step meets them: one call of every layer at PACK_ROWS rows in module order, so each weight has
    left the caches the model's other weights passed through (at 70m the bf16 weights fit in this Xeon's
    L3 and packing pays; at 0.5B every call reads its weight from memory, reordered or not, and it does
    not: benchmarks/README.md, "bf16 autocast decoding on a CPU with AMX"). Autocast's kernel (F.linear on
    bf16 copies, as its cache holds them) and oneDNN's on packed copies, the best of 3 passes each; the
    packed pass must take ≤ FASTER of the plain one. Once per model, set of layer shapes and thread count.
    The pass runs over the first layers up to MAX_CALIBRATED_BF16_BYTES of bf16 weights (at least one): the
    timing holds two bf16 copies of what it covers, and a prefix larger than the caches meets its weights
    as the whole model's pass does (a ratio of times, the number does not grow with the model)."""
    if not can_pack_bf16():
        return math.inf
    key = (tuple((m.out_features, m.in_features, m.bias is not None) for m in layers), torch.get_num_threads())
    decided = _BF16_PACK_CALLS.setdefault(model, {})
    if key not in decided:
        covered, size = [], 0
        for m in layers:
            if covered and size + 2 * m.weight.numel() > MAX_CALIBRATED_BF16_BYTES:
                break
            covered.append(m)
            size += 2 * m.weight.numel()
        layers = covered
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            inputs = {m.in_features: torch.randn(PACK_ROWS, m.in_features).to(torch.bfloat16) for m in layers}
            biases = [None if m.bias is None else m.bias.detach().to(torch.bfloat16) for m in layers]
            weights = [m.weight.detach().to(torch.bfloat16) for m in layers]

            def plain_pass() -> None:
                for m, w, b in zip(layers, weights, biases):
                    F.linear(inputs[m.in_features], w, b)

            plain_pass()
            plain = _best_time(plain_pass, repeats=3)
            del weights
            packed, packing = _timed(lambda: [_pack(m.weight.detach().to(torch.bfloat16)) for m in layers])

            def packed_pass() -> None:
                for m, w, b in zip(layers, packed, biases):
                    _onednn(inputs[m.in_features], w, b)

            packed_pass()
            with_packed = _best_time(packed_pass, repeats=3)
        decided[key] = packing / (plain - with_packed) if with_packed <= FASTER * plain else math.inf
    return decided[key]


def autocast_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """A layer's forward inside `autocast_packed_weights`: small calls without gradients under bf16 autocast
    on its packed bf16 weight (input cast to bf16, as autocast casts it); every other call: F.linear."""
    if (
        input.numel() <= SMALL_ROWS * self.in_features
        and input.dim() >= 2
        and input.numel() > 0
        and input.dtype in (torch.float32, torch.bfloat16)
        and not torch.is_grad_enabled()
        and autocast_bf16()
    ):
        x2 = input.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        return _onednn(x2, self.__dict__[PACKED], self.__dict__[PACKED_BIAS]).view(*input.shape[:-1], self.out_features)
    return F.linear(input, self.weight, self.bias)


@contextlib.contextmanager
def autocast_packed_weights(model: nn.Module, calls: int) -> Iterator[list[nn.Linear]]:
    """Within the block, under CPU bf16 autocast, where packed bf16 copies of the plain float32 `nn.Linear`
    layers of `model` (`eligible`) pay for their making within `calls` decode steps (`bf16_pack_calls`,
    measured once per model), each of those layers runs its small calls without gradients on a bf16 copy
    of its weight in oneDNN's blocked layout, and its bias cast to bf16, both made here once; the values
    are those of autocast's F.linear up to the kernels' rounding (the same bf16 inputs, weights and bias).
    Outside bf16 autocast, with POSTTRAIN_CPU_LINEAR=off, or where oneDNN cannot pack bf16 weights
    (`can_pack_bf16`: a CPU without AVX-512 or AVX-NE-CONVERT), nothing changes.
    Yields the layers switched; the copies (`packed_inputs`, the decode trace's inputs) and the
    layers' forwards are dropped on exit. The weights must not change inside the block."""
    layers: list[nn.Module] = []
    try:
        if mode_from_env() != "off" and can_pack_bf16() and autocast_bf16():
            candidates = [m for m in model.modules() if eligible(m) and PACKED not in m.__dict__]
            if not candidates or bf16_pack_calls(model, candidates) > calls:
                candidates = []
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                for module in candidates:
                    bias = None if module.bias is None else module.bias.detach().to(torch.bfloat16)
                    module.__dict__[PACKED] = _pack(module.weight.detach().to(torch.bfloat16))
                    module.__dict__[PACKED_BIAS] = bias
                    module.forward = types.MethodType(autocast_forward, module)
                    layers.append(module)
        yield layers
    finally:
        for module in layers:
            for name in ("forward", PACKED, PACKED_BIAS):
                module.__dict__.pop(name, None)


def packed_inputs(model: nn.Module) -> list[tuple[int, torch.Tensor]]:
    """The tensors that `packed_weights` and `autocast_packed_weights` made for `model`'s layers, each with
    the index (in `model.modules()`) of the layer that reads it, in module order: a layer's packed weight,
    then its bf16 bias where it has one. What the decode trace takes as inputs (a tensor a layer reads that
    is not an input would be frozen into the trace), and which layer each feeds."""
    tensors = []
    for index, module in enumerate(model.modules()):
        if PACKED in module.__dict__:
            tensors.append((index, module.__dict__[PACKED]))
            if module.__dict__.get(PACKED_BIAS) is not None:
                tensors.append((index, module.__dict__[PACKED_BIAS]))
    return tensors
