"""FLOPs per episode of one of ../shared/bench's run_<trainer>.py scripts, TRL or posttrain, by phase.

    python benchmarks/flops_per_episode.py BENCH_DIR run_rloo.py              # TRL (run with TRL's venv)
    python benchmarks/flops_per_episode.py --posttrain BENCH_DIR run_rloo.py  # posttrain through the bench's trl shim

Counted, not estimated: while `trainer.train()` runs, a TorchDispatchMode adds up the FLOPs of every
matrix multiply and attention op that actually executes (torch.utils.flop_counter's formulas: 2·m·n·k per
(m, k) @ (k, n); CPU SDPA, which that registry lacks, with the formula of the other SDPA kernels; under
torch.inference_mode `linear` and `scaled_dot_product_attention` arrive undecomposed and are counted as such).
Element-wise ops are not counted (they are a few percent of a transformer's FLOPs and bound by memory).
Every FLOP lands in one phase:

- generation: inside transformers' `GenerationMixin.generate` (TRL) or `posttrain.rollout.generate`;
- no-grad forwards: other work with grad disabled (reference, reward, value, old-log-prob forwards);
- grad forward: the update's forward(s) with grad enabled;
- backward: run by the autograd engine.

Each phase is also split by the class of the outermost module running (policy, reward model, critic).

The same settings as the timed runs apply (environment knobs of BENCH_DIR/common.py: SIZE, EPISODES,
BATCH, K, RESP_LEN, PPO_EPOCHS, ART); GRADIENT_CHECKPOINTING=1 also enables non-reentrant gradient
checkpointing on every policy the script loads, as benchmarks/scale.py does. A smaller EPISODES gives
the same FLOPs per episode (random-weight policies almost never stop early, so every completion has
RESP_LEN tokens). Prints one RESULT line (JSON: GFLOPs per episode in total and by phase, and the
count of matmul calls per episode).
"""

import json
import os
import runpy
import sys
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten
PHASES = ("generation", "no-grad forwards", "grad forward", "backward")


def _cpu_sdpa_flops(query, key, value, *args, **kwargs) -> int:  # the registry's functions take shapes
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _linear_flops(input, weight, *args, **kwargs) -> int:
    return 2 * input.numel() // input.shape[-1] * weight.shape[0] * weight.shape[1]


def _cpu_sdpa_backward_flops(grad_out, query, key, value, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


class PhaseFlops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.flops: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.generating = 0
        self.by_model: dict[str, int] = defaultdict(int)
        self.outer: list[str] = []  # class names of the modules being called, outermost first
        self.extra = {}
        for name, fn in (
            ("_scaled_dot_product_flash_attention_for_cpu", _cpu_sdpa_flops),
            ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_sdpa_backward_flops),
            # Under torch.inference_mode composite ops reach this mode before they are decomposed.
            ("linear", _linear_flops),
            ("scaled_dot_product_attention", _cpu_sdpa_flops),
        ):
            if hasattr(aten, name):
                self.extra[getattr(aten, name).default] = fn

    def phase(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        if self.generating:
            return "generation"
        return "grad forward" if torch.is_grad_enabled() else "no-grad forwards"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        name = packet.__name__.split(".")[-1]
        if name.endswith("_") and hasattr(aten, name[:-1]):  # in-place variants (addmm_) count as their op
            packet = getattr(aten, name[:-1])
        if func in self.extra:
            n = self.extra[func](*args, **kwargs)
        elif packet in flop_registry:
            n = flop_registry[packet](*args, **kwargs, out_val=out)
        else:
            return out
        phase = self.phase()
        self.flops[phase] += n
        outer = self.outer[0] if self.outer else "(no module)"
        self.by_model[f"{phase}: {outer}"] += n
        self.calls[phase] += 1
        return out


MODE = PhaseFlops()


def _enter(module, args):
    MODE.outer.append(type(module).__name__)


def _leave(module, args, output):
    MODE.outer.pop()


torch.nn.modules.module.register_module_forward_pre_hook(_enter)
torch.nn.modules.module.register_module_forward_hook(_leave)


def _generating(fn):
    def wrapper(*args, **kwargs):
        MODE.generating += 1
        try:
            return fn(*args, **kwargs)
        finally:
            MODE.generating -= 1

    return wrapper


args = sys.argv[1:]
posttrain_run = args[0] == "--posttrain"
if posttrain_run:
    args = args[1:]
bench, script = os.path.abspath(args[0]), args[1]
if posttrain_run:
    sys.path[:0] = [os.path.join(bench, "posttrain_shim"), bench]
    import posttrain.rollout  # noqa: E402

    # Patched before any trainer module imports it by name.
    posttrain.rollout.generate = _generating(posttrain.rollout.generate)
else:
    sys.path[:0] = [bench]
import common  # noqa: E402
import transformers  # noqa: E402

transformers.GenerationMixin.generate = _generating(transformers.GenerationMixin.generate)

if os.environ.get("GRADIENT_CHECKPOINTING") == "1":  # on every policy the script loads, as scale.py's runs
    _load_policy = common.policy

    def _policy_with_checkpointing():
        model = _load_policy()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    common.policy = _policy_with_checkpointing


def counted_train(trainer, name, per_prompt):
    with MODE:
        trainer.train()
    episodes = common.EPISODES
    total = sum(MODE.flops.values())
    res = dict(
        trainer=name,
        library="posttrain" if posttrain_run else f"trl {common.trl.__version__}",
        size=common.SIZE,
        episodes=episodes,
        gflops_per_episode=round(total / episodes / 1e9, 3),
        by_phase={p: round(MODE.flops[p] / episodes / 1e9, 3) for p in PHASES},
        matmul_calls_per_episode={p: round(MODE.calls[p] / episodes, 1) for p in PHASES},
        by_phase_and_outermost_module={k: round(v / episodes / 1e9, 3) for k, v in sorted(MODE.by_model.items())},
    )
    print("RESULT", json.dumps(res), flush=True)
    return res


common.timed_train = counted_train
runpy.run_path(os.path.join(bench, script), run_name="__main__")
