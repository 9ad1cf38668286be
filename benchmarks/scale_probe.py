"""Run one posttrain command or one TRL script in this process with phase timers; write a JSON.

    python benchmarks/scale_probe.py OUT.json posttrain rloo --model_name_or_path ... (the CLI's argv)
    python benchmarks/scale_probe.py OUT.json script ../shared/bench/run_rloo.py

benchmarks/scale.py launches it under /usr/bin/time -v, one process per run. The same instruments are
installed for both libraries, at the torch / transformers level, so the phases mean the same thing:

- generate: inside `posttrain.rollout.generate` or transformers' `GenerationMixin.generate`;
- forward_nograd / forward_grad: the outermost module call (a whole model forward) outside generation
  and backward, with gradients off (reference, reward, value, old log-probs) or on (the update forward);
- backward: inside `torch.autograd.backward` (with gradient checkpointing this includes the recompute);
- optimizer: between the optimizer-step pre and post hooks;
- step: from one optimizer step's end to the next's (the first step starts at the first phase event,
  i.e. after the models loaded), split into those phases plus "other" (Python, scoring glue, logging).

Tokens: generated tokens (rows × new positions) per generate call; trained tokens (the input_ids of each
forward_grad call). RSS: /proc/self/statm sampled every 10 ms and read at each phase boundary, so each
phase records its peak and its rise over the RSS at its start.

Environment: PROBE_GC=1 enables gradient checkpointing (non-reentrant) on every model loaded with
`from_pretrained` (TRL 0.19's classic trainers ignore the gradient_checkpointing field; TRL's GRPO
script sets it False). PROBE_AUDIT=N records every tensor an op creates with at least N elements whose
last dimension is the vocabulary (config.vocab_size of the loaded model): op, shape, dtype, phase and the
innermost posttrain / trl / transformers source lines that created it (`audit` in the JSON).
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import threading
import time
import traceback

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 1024 * 1024


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / MB


def hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Probe:
    def __init__(self) -> None:
        self.events: list[dict] = []  # phase, start, end, tokens, rss_start, rss_peak
        self.steps: list[float] = []  # optimizer step end times
        self.phase: str | None = None
        self.peak = 0.0
        self.lock = threading.Lock()
        self.depth = 0
        self.vocab: int | None = None
        self.audit: dict[tuple, dict] = {}
        self.stop = threading.Event()
        threading.Thread(target=self.sample, daemon=True).start()

    def sample(self) -> None:
        while not self.stop.wait(0.01):
            value = rss_mb()
            with self.lock:
                self.peak = max(self.peak, value)

    def enter(self, phase: str) -> dict | None:
        if self.phase is not None:
            return None  # nested: charged to the outer phase
        now = rss_mb()
        with self.lock:
            self.peak = now
        self.phase = phase
        return {"phase": phase, "start": time.perf_counter(), "rss_start": now, "hwm_start": hwm_mb(), "tokens": 0}

    def leave(self, event: dict | None, tokens: int = 0) -> None:
        if event is None:
            return
        event["end"] = time.perf_counter()
        now = rss_mb()
        with self.lock:
            event["rss_peak"] = max(self.peak, now)
        event["rss_end"] = now
        event["hwm_end"] = hwm_mb()
        event["tokens"] = tokens
        self.events.append(event)
        self.phase = None

    def summary(self) -> dict:
        events = self.events
        start = events[0]["start"] if events else 0.0
        bounds = [start, *self.steps]
        steps = []
        for i in range(1, len(bounds)):
            lo, hi = bounds[i - 1], bounds[i]
            inside = [e for e in events if lo <= e["start"] < hi]
            phases: dict[str, dict] = {}
            for e in inside:
                p = phases.setdefault(e["phase"], {"s": 0.0, "tokens": 0, "rss_rise_mb": 0.0, "rss_peak_mb": 0.0})
                p["s"] += e["end"] - e["start"]
                p["tokens"] += e["tokens"]
                p["rss_rise_mb"] = max(p["rss_rise_mb"], e["rss_peak"] - e["rss_start"])
                p["rss_peak_mb"] = max(p["rss_peak_mb"], e["rss_peak"])
            total = hi - lo
            phases["other"] = {"s": total - sum(p["s"] for p in phases.values())}
            for p in phases.values():
                p["s"] = round(p["s"], 3)
                for k in ("rss_rise_mb", "rss_peak_mb"):
                    if k in p:
                        p[k] = round(p[k], 1)
            steps.append({"s": round(total, 3), "phases": phases})
        hwm_raised = [e for e in events if e["hwm_end"] > e["hwm_start"] + 1]
        return {
            "first_event_rss_mb": round(events[0]["rss_start"], 1) if events else None,
            "steps": steps,
            "peak_set_in": hwm_raised[-1]["phase"] if hwm_raised else "loading",
            "hwm_mb": round(hwm_mb(), 1),
            "audit": sorted(self.audit.values(), key=lambda a: -a["numel"]),
        }


PROBE = Probe()


def timed(phase: str, count_tokens=None):
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            event = PROBE.enter(phase)
            try:
                out = fn(*args, **kwargs)
            except BaseException:
                PROBE.leave(event)
                raise
            PROBE.leave(event, count_tokens(args, kwargs, out) if (event and count_tokens) else 0)
            return out

        return inner

    return wrap


def _input_ids(args, kwargs):
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], torch.Tensor):
        ids = args[0]
    return ids


def hf_generated(args, kwargs, out) -> int:
    seq = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
    ids = kwargs.get("input_ids")
    if ids is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
        ids = args[1]  # generate(self, inputs, ...)
    if ids is None:
        ids = kwargs.get("inputs")
    if seq is None or ids is None:
        return 0
    return int(seq.shape[0] * (seq.shape[1] - ids.shape[1]))


def ours_generated(args, kwargs, out) -> int:
    return int(out.completion_ids.numel())


def install() -> None:
    import transformers
    from transformers.generation.utils import GenerationMixin

    GenerationMixin.generate = timed("generate", hf_generated)(GenerationMixin.generate)

    original_backward = torch.autograd.backward
    torch.autograd.backward = timed("backward")(original_backward)

    pending: dict[int, dict | None] = {}

    def pre(optimizer, args, kwargs):
        pending[id(optimizer)] = PROBE.enter("optimizer")

    def post(optimizer, args, kwargs):
        PROBE.leave(pending.pop(id(optimizer), None))
        PROBE.steps.append(time.perf_counter())

    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)

    call = nn.Module.__call__

    def module_call(self, *args, **kwargs):
        if PROBE.phase is not None or PROBE.depth:
            PROBE.depth += 1
            try:
                return call(self, *args, **kwargs)
            finally:
                PROBE.depth -= 1
        event = PROBE.enter("forward_grad" if torch.is_grad_enabled() else "forward_nograd")
        PROBE.depth += 1
        try:
            out = call(self, *args, **kwargs)
        finally:
            PROBE.depth -= 1
            ids = _input_ids(args, kwargs)
            token_ids = isinstance(ids, torch.Tensor) and not ids.is_floating_point()
            PROBE.leave(event, int(ids.numel()) if token_ids and event else 0)
        return out

    nn.Module.__call__ = module_call

    load = transformers.PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        loaded = load(cls, *args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True
        PROBE.vocab = PROBE.vocab or getattr(model.config, "vocab_size", None)
        if os.environ.get("PROBE_GC") == "1" and getattr(model, "supports_gradient_checkpointing", False):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        return loaded

    transformers.PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def patch_posttrain() -> None:
    """Time posttrain.rollout.generate under every name a posttrain module imported it as."""
    import importlib
    import pkgutil

    import posttrain.rollout as rollout
    import posttrain.trainers

    for info in pkgutil.iter_modules(posttrain.trainers.__path__):
        importlib.import_module(f"posttrain.trainers.{info.name}")
    original = rollout.generate
    wrapped = timed("generate", ours_generated)(original)
    for name, module in list(sys.modules.items()):
        if name.startswith("posttrain") and module is not None:
            for attr, value in list(vars(module).items()):
                if value is original:
                    setattr(module, attr, wrapped)


def install_audit(threshold: int) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    roots = ("posttrain", "trl", "transformers", "peft")

    class Audit(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            vocab = PROBE.vocab
            if vocab:
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == vocab and t.numel() >= threshold:
                        frames = [
                            f"{f.filename.split('site-packages/')[-1].split('/src/')[-1]}:{f.lineno} {f.name}"
                            for f in traceback.extract_stack()[:-1]
                            if any(f"/{r}/" in f.filename for r in roots)
                        ][-4:]
                        key = (str(func), tuple(t.shape), str(t.dtype), PROBE.phase, tuple(frames))
                        entry = PROBE.audit.setdefault(
                            key,
                            {
                                "op": str(func),
                                "shape": list(t.shape),
                                "dtype": str(t.dtype),
                                "mb": round(t.numel() * t.element_size() / MB, 1),
                                "numel": t.numel(),
                                "phase": PROBE.phase or "between model calls",
                                "where": list(frames),
                                "count": 0,
                            },
                        )
                        entry["count"] += 1
            return out

    mode = Audit()
    mode.__enter__()


def main() -> None:
    out_path, kind, *rest = sys.argv[1:]
    install()
    audit = int(os.environ.get("PROBE_AUDIT", "0"))
    if audit:
        install_audit(audit)
    started = time.perf_counter()
    if kind == "posttrain":
        patch_posttrain()
        from posttrain.cli import main as cli

        sys.argv = ["posttrain", *rest]
        code = cli(rest)
        if code:
            raise SystemExit(code)
    elif kind == "script":
        script = rest[0]
        sys.argv = [script, *rest[1:]]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
    else:
        raise SystemExit(f"unknown kind {kind!r}: posttrain | script")
    PROBE.stop.set()
    result = {"argv": [kind, *rest], "wall_s": round(time.perf_counter() - started, 2), **PROBE.summary()}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
