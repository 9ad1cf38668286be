"""One 16-row decode step of the bench's 14m policy replayed at each cache length a rollout of 53 tokens
passes (15 to 67 cached positions; random keys and values), as four kinds of trace: the module traced (how
decode_trace traced before) with TorchScript's graph optimizer on and off, and a function with the model's
parameters and buffers as inputs (how it traces now) with the optimizer on, and simplified
(decode_trace._simplify) with it off (how it replays now). Best of 5 passes over the 53 steps, ms; two rounds.

    PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/results/session-2026-12-07-4/replay_variants.py
"""

import os
import time
import warnings

import torch
from transformers import AutoModelForCausalLM

from posttrain import decode_trace

warnings.simplefilter("ignore")
art = os.path.expanduser("~/.cache/posttrain-bench/artifacts")
model = AutoModelForCausalLM.from_pretrained(f"{art}/policy-14m").eval()
ROWS = 16


def step_inputs(cached: int) -> tuple:
    ids, positions = torch.randint(0, 100, (ROWS, 1)), torch.full((ROWS, 1), cached)
    mask = torch.ones(ROWS, 1, 1, cached + 1, dtype=torch.bool)
    mask[0, ..., :3] = False
    return (ids, positions, mask, *(torch.randn(ROWS, 4, cached, 32) for _ in range(12)))


steps = [step_inputs(cached) for cached in range(15, 68)]
state = decode_trace.state_tensors(model)


def best_pass_ms(traced, extra: tuple, optimize: bool) -> float:
    with torch.no_grad(), torch.jit.optimized_execution(optimize):
        for args in steps[:5]:
            traced(*args, *extra)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for args in steps:
                traced(*args, *extra)
            best = min(best, time.perf_counter() - start)
    return best * 1000


class _Module(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = model
        self.step = decode_trace._DecodeForward(model, "past_key_values", {"logits_to_keep": 1}, True, 0)

    def forward(self, *args):
        return self.step(*args)


with torch.no_grad():
    function = decode_trace._DecodeForward(model, "past_key_values", {"logits_to_keep": 1}, True, len(state))
    module_on = torch.jit.trace(_Module(), steps[0], check_trace=False)
    module_off = torch.jit.trace(_Module(), steps[0], check_trace=False)
    function_on = torch.jit.trace(function.__call__, (*steps[0], *state), check_trace=False)
    simplified_off = torch.jit.trace(function.__call__, (*steps[0], *state), check_trace=False)
    decode_trace._simplify(simplified_off.graph)
    for _ in range(2):
        print(
            f"module, optimizer on {best_pass_ms(module_on, (), True):.2f}  "
            f"module, off {best_pass_ms(module_off, (), False):.2f}  "
            f"function, on {best_pass_ms(function_on, state, True):.2f}  "
            f"function simplified, off {best_pass_ms(simplified_off, state, False):.2f}"
        )
