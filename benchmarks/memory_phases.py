"""Resident memory phase by phase for one of ../shared/bench's run_<trainer>.py scripts, TRL or posttrain.

    python benchmarks/memory_phases.py BENCH_DIR run_rloo.py              # TRL (run with TRL's venv)
    python benchmarks/memory_phases.py --posttrain BENCH_DIR run_rloo.py  # posttrain through the bench's trl shim

The same hooks time both libraries: the script's helpers in BENCH_DIR/common.py (tokenizer, prompts, policy,
reward_model) are wrapped, and inside train() the first grad-enabled module call (end of rollout + scoring),
the first backward, and every optimizer step (torch's global step hooks) mark the phases. At each mark
it prints RSS now and the peak RSS since the previous mark (the kernel's VmHWM, reset through
/proc/self/clear_refs), in MB; the largest of these peaks is what /usr/bin/time reports as maximum RSS.
The RESULT line adds train()'s user/sys CPU seconds and minor page faults (allocator settings show there).

Experiment knobs (environment; glibc only): PROBE_SMAPS=1 prints resident MB per mapping at each mark;
PROBE_TRIM=1 calls malloc_trim(0) after every optimizer step; PROBE_TRIM_BEFORE_UPDATE=1 (posttrain RLOO)
before each update; PROBE_ARENA_MAX=N sets mallopt(M_ARENA_MAX, N). benchmarks/README.md, "Memory", has
what they measured.
"""

import os
import resource
import sys
import time

T0 = time.perf_counter()


def _status() -> tuple[float, float]:
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                vals[key] = int(value.split()[0]) / 1024
    return vals["VmRSS"], vals["VmHWM"]


_PEAKS: list[float] = []


def _smaps(top: int = 8) -> str:
    """Resident MB per mapping name (heap, anonymous, each file), largest first."""
    agg: dict[str, list[float]] = {}
    name = "?"
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                name = head[5].rsplit("/", 1)[-1] if len(head) > 5 else "[anon]"
            elif head[0] in ("Rss:", "Anonymous:"):
                agg.setdefault(name, [0.0, 0.0])[head[0] == "Anonymous:"] += int(head[1]) / 1024
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]
    return "  ".join(f"{k} {v[0]:.0f}/{v[1]:.0f}" for k, v in rows)


def mark(name: str) -> None:
    rss, hwm = _status()
    _PEAKS.append(hwm)
    print(
        f"PHASE {name:32s} rss {rss:7.1f}  peak-since-last {hwm:7.1f}  t {time.perf_counter() - T0:6.1f}s", flush=True
    )
    if os.environ.get("PROBE_SMAPS"):
        print("  SMAPS (rss/anon MB)", _smaps(), flush=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


args = sys.argv[1:]
posttrain_run = args[0] == "--posttrain"
if posttrain_run:
    args = args[1:]
bench, script = os.path.abspath(args[0]), args[1]
here = os.path.dirname(os.path.abspath(__file__))
mark("interpreter")
if posttrain_run:
    sys.path[:0] = [os.path.join(bench, "posttrain_shim"), bench]
else:
    sys.path[:0] = [bench]
import common  # noqa: E402

if posttrain_run:
    import posttrain  # noqa: E402

    print("posttrain from", posttrain.__file__, flush=True)
mark("imports (torch, transformers, trl)")

import torch  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook  # noqa: E402


def _wrap(name: str, label: str) -> None:
    fn = getattr(common, name)
    count = [0]

    def wrapped(*a, **k):
        out = fn(*a, **k)
        count[0] += 1
        mark(f"{label} #{count[0]}" if name in ("policy", "reward_model") else label)
        return out

    setattr(common, name, wrapped)


_wrap("tokenizer", "tokenizer")
_wrap("prompts", "dataset (load_from_disk/map)")
_wrap("policy", "policy model")
_wrap("reward_model", "reward model")

_state = {"step": 0, "grad_forward": None, "backward": False}


def _grad_forward(module, inputs):
    if torch.is_grad_enabled() and _state["grad_forward"] is not None:
        _state["grad_forward"].remove()
        _state["grad_forward"] = None
        mark("rollout + scoring (1st batch)")


_orig_backward = torch.autograd.backward


def _backward(*a, **k):
    if not _state["backward"]:
        _state["backward"] = True
        mark("update forward (1st)")
    return _orig_backward(*a, **k)


torch.autograd.backward = _backward


def _pre_step(opt, a, k):
    if _state["step"] == 0:
        mark("backward (1st)")


_LIBC = None
if os.environ.get("PROBE_TRIM") or os.environ.get("PROBE_ARENA_MAX"):  # experiment knobs (glibc only)
    import ctypes

    _LIBC = ctypes.CDLL("libc.so.6")
    if os.environ.get("PROBE_ARENA_MAX"):
        _LIBC.mallopt(-8, int(os.environ["PROBE_ARENA_MAX"]))  # M_ARENA_MAX


if os.environ.get("PROBE_TRIM_BEFORE_UPDATE") and posttrain_run:  # experiment: trim between rollout and update
    import ctypes

    import posttrain.trainers.rloo as _rloo

    _update, _trim = _rloo.policy_update, ctypes.CDLL("libc.so.6").malloc_trim

    def _trimmed_update(*a, **k):
        _trim(0)
        return _update(*a, **k)

    _rloo.policy_update = _trimmed_update


def _post_step(opt, a, k):
    _state["step"] += 1
    if os.environ.get("PROBE_TRIM"):
        _LIBC.malloc_trim(0)
    if _state["step"] <= 3:
        mark(f"optimizer step {_state['step']}")


register_optimizer_step_pre_hook(_pre_step)
register_optimizer_step_post_hook(_post_step)

_timed = common.timed_train


def timed_train(trainer, name, per_prompt):
    mark("trainer constructed (prepare)")
    _state["grad_forward"] = torch.nn.modules.module.register_module_forward_pre_hook(_grad_forward)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    trainer.train()
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    mark(f"rest of train() ({_state['step']} steps)")
    print(
        f"RESULT peak_rss_mb {max(_PEAKS):.1f} train_wall_s {wall:.2f} eps {common.EPISODES / wall:.2f} "
        f"user_s {r1.ru_utime - r0.ru_utime:.2f} sys_s {r1.ru_stime - r0.ru_stime:.2f} "
        f"minor_faults {r1.ru_minflt - r0.ru_minflt}",
        flush=True,
    )


common.timed_train = timed_train
import runpy  # noqa: E402

runpy.run_path(os.path.join(bench, script), run_name="__main__")
