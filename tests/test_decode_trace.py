"""The traced decode step (posttrain.decode_trace): the default CPU engine replays each one-token decode
forward from a torch.jit.trace of the model. It must sample exactly the eager engine's tokens, see every
weight update, be made again for new parameter objects, and never be used where a trace could differ."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from transformers import DynamicCache, GPTNeoXForCausalLM

from helpers import left_pad, tiny_llama, tiny_neox
from posttrain import RLOOConfig, compat, cpu_linear, decode_trace
from posttrain.configs import ConfigError
from posttrain.rollout import SamplingConfig, generate

ROWS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22], [30, 31], [40, 41, 42, 43]]
STOPS = SamplingConfig(max_new_tokens=20, stop_token_ids=(2, 3, 5, 7))


def count_forwards(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the model's eager forwards (a wrapper on the class, not a hook: hooks switch tracing off)."""
    calls = [0]
    forward = type(model).forward

    @functools.wraps(forward)  # the same signature: the engine reads it
    def counted(self, *args, **kwargs):
        calls[0] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", counted)
    return calls


def sample(model, rows=ROWS, cfg=STOPS, **options):
    ids, mask = left_pad(rows, pad=2)
    g = torch.Generator().manual_seed(11)
    rollout = generate(
        model, ids, mask, cfg, pad_token_id=2, num_samples=2, generator=g, return_entropy=True, **options
    )
    return rollout, torch.rand(1, generator=g)


def assert_same(a, b) -> None:
    (ra, next_a), (rb, next_b) = a, b
    for field in ("completion_ids", "completion_mask", "completion_lengths", "ended", "logprobs", "entropy"):
        assert torch.equal(getattr(ra, field), getattr(rb, field)), field
    assert torch.equal(next_a, next_b)  # the generator ends in the same state


def step_in_place(model) -> None:
    """What an optimizer step does to the weights: changes them in place."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def traces(model) -> dict:
    return decode_trace._TRACES[model][1]


@pytest.mark.parametrize("builder", [tiny_neox, tiny_llama])
def test_traced_steps_sample_the_eager_tokens_bitwise(builder, monkeypatch):
    """Prefill sharing (k = 2), rows stopping mid-batch and compaction (the batch shrinks, so the trace
    runs at several row counts and cache lengths): tokens, masks, log-probabilities, entropies and the
    generator's final state are bitwise those of the eager forward, and the eager forward runs for the
    prefill, the trace and its check only."""
    model = builder()
    rows = ROWS  # left-padded: the step takes the prepared (rows, 1, 1, keys) mask
    calls = count_forwards(model, monkeypatch)
    eager = sample(model, rows, trace=False)
    eager_calls, calls[0] = calls[0], 0
    traced = sample(model, rows)
    assert_same(traced, eager)
    rollout = eager[0]
    assert 0 < rollout.ended.sum() < len(rollout) and rollout.completion_ids.size(1) == 20  # compaction ran
    kinds = [masked for (masked, *_), step in traces(model).items() if step is not None]
    assert True in kinds  # traced with the prepared mask (and, once compaction drops every padded row, none)
    # eager: 1 prefill + 19 decode forwards; traced: the prefill, then per kind of step the trace and
    # its two checks (compaction can drop every padded row: the mask-free step is traced then too)
    assert eager_calls == 20 and calls[0] == 1 + 3 * len(kinds)
    calls[0] = 0
    assert_same(sample(model, rows), eager)  # the next rollout reuses the traces: the prefill only
    assert calls[0] == 1


@pytest.mark.parametrize("builder", [tiny_neox, tiny_llama])
def test_a_trace_the_check_refuses_keeps_the_eager_forward(builder):
    """Without padding the step gets no mask. Tracing that step is refused by the check where it would
    differ: on transformers 4.x the mask-free step builds its causal mask with the cache length in
    Python (the shorter check then fails), and transformers' SDPA path for grouped-query attention
    differs under tracing (this Llama's logits move by ~1e-8). Either way the tokens, log-probabilities
    and entropies are bitwise the eager engine's; GPTNeoX on transformers 5 is traced."""
    model = builder()
    rows = [row[:2] for row in ROWS]
    assert_same(sample(model, rows), sample(model, rows, trace=False))
    traced = [masked for (masked, *_), step in traces(model).items() if step is not None]
    assert traced == ([False] if builder is tiny_neox and compat.transformers_version() >= (5,) else [])


def test_weight_updates_reach_the_trace_and_new_parameters_retrace():
    model = tiny_neox()
    sample(model)
    (key, step), *_ = traces(model).items()
    step_in_place(model)
    assert_same(sample(model), sample(model, trace=False))
    assert traces(model)[key] is step  # the same trace, new values
    # a new Parameter object (what a stale trace would not see): the model is traced again
    head = model.get_output_embeddings()  # embed_out on transformers 4, lm_head on 5
    head.weight = torch.nn.Parameter(torch.randn_like(head.weight))
    assert_same(sample(model), sample(model, trace=False))
    assert traces(model)[key] is not step


def test_a_tied_embedding_is_one_input_of_the_trace_and_its_updates_reach_both_uses():
    model = tiny_llama(tie_word_embeddings=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    sample(model)
    step = next(step for step in traces(model).values() if step is not None)
    tied = model.get_input_embeddings().weight
    assert sum(t is tied for t in decode_trace.state_tensors(model)) == 1
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(3.0)  # the head reads the same tensor: both change
    assert_same(sample(model), sample(model, trace=False))
    assert next(step for step in traces(model).values() if step is not None) is step


@pytest.mark.parametrize("builder", [tiny_neox, tiny_llama])
def test_trace_is_used_after_a_forward_that_asked_for_hidden_states(builder):
    # transformers 5 installs its output-capturing hooks on the layers at the first forward that asks for
    # hidden states (the packed forwards, the chunked LM head, a value head) and keeps them: the rollouts
    # after the first update must still replay the trace.
    model = builder()
    ids, mask = left_pad(ROWS, pad=2)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hooked = [m for m in model.modules() if m._forward_hooks]
    if compat.transformers_version() >= (5, 0):
        assert hooked  # the case this test is about
    assert all(decode_trace._inactive_output_capture(h) for m in hooked for h in m._forward_hooks.values())
    assert decode_trace.traceable(model)
    assert_same(sample(model), sample(model, trace=False))
    assert any(step is not None for step in traces(model).values())  # the rollout replayed a trace
    other = model.model.layers[0] if hasattr(model, "model") else model.gpt_neox.layers[0]
    handle = other.register_forward_hook(lambda module, args, out: None)
    assert not decode_trace.traceable(model)  # any other hook still keeps the eager step
    handle.remove()


def test_trace_is_not_used_with_hooks_train_mode_fp16_autocast_or_when_switched_off(monkeypatch, tmp_path):
    model = tiny_neox()
    assert decode_trace.traceable(model)
    handle = model.gpt_neox.layers[0].register_forward_hook(lambda module, args, out: None)
    assert not decode_trace.traceable(model)  # a hook's Python would not run in a trace
    handle.remove()
    model.train()
    assert not decode_trace.traceable(model)  # dropout would be frozen out of the trace
    model.eval()
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(tiny_neox(), LoraConfig(r=2, target_modules=["query_key_value"]))
    assert not decode_trace.traceable(lora.get_base_model())  # adapters can be switched off: never frozen
    with torch.autocast("cpu", dtype=torch.float16):
        assert not decode_trace.traceable(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert decode_trace.traceable(model)  # bf16 autocast: traced where no weight is cast (tests below)
    monkeypatch.setenv(decode_trace.ENV, "off")
    assert not decode_trace.traceable(model)
    sample(model)
    assert model not in decode_trace._TRACES
    monkeypatch.setenv(decode_trace.ENV, "sometimes")
    with pytest.raises(ConfigError, match="POSTTRAIN_TRACE_DECODE='sometimes': expected one of auto, off"):
        RLOOConfig(output_dir=str(tmp_path / "run"))  # a bad value stops the run before any model loads
    assert not (tmp_path / "run").exists()


class CountingNeoX(GPTNeoXForCausalLM):
    """Adds its own call count to the logits: Python state a trace would freeze at its first call."""

    calls = 0

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        self.calls += 1
        out.logits = out.logits + self.calls
        return out


def test_a_trace_that_differs_from_the_eager_forward_is_never_used():
    torch.manual_seed(1)
    model = CountingNeoX(tiny_neox().config).eval()
    rollout, _ = sample(model, cfg=SamplingConfig(max_new_tokens=6))
    assert list(traces(model).values()) == [None]  # the check caught it: eager forwards throughout
    # prefill (1) + trace (1) + its check's eager run (1) + 5 decode steps, all eager
    assert model.calls == 8 and rollout.completion_ids.shape == (10, 6)


def test_a_cache_too_short_to_check_is_traced_one_step_later(monkeypatch):
    """One-token prompts leave one cached position and the check needs a shorter one: the first decode
    step runs eagerly and the trace is made at the second."""
    model = tiny_neox()
    rows = [[row[0]] for row in ROWS]
    calls = count_forwards(model, monkeypatch)
    eager = sample(model, rows, trace=False)
    calls[0] = 0
    assert_same(sample(model, rows), eager)
    if compat.transformers_version() >= (5,):  # the mask-free step (no padding) is traced there, see above
        assert [masked for (masked, *_), step in traces(model).items() if step is not None] == [False]
        assert calls[0] == 1 + 1 + 3  # prefill, the first decode step, the trace and its two checks
    else:
        # 1 prefill + 19 eager decode forwards, plus the trace and the first check's eager run: the
        # shorter check raises (the traced mask has the traced cache length), so the trace is refused
        assert calls[0] == 1 + 19 + 2


def test_the_traced_step_returns_none_for_caches_it_does_not_replay():
    model = tiny_neox()
    step = decode_trace.TracedDecode(model, "past_key_values", {})
    ids = torch.tensor([[3], [4]])
    positions = torch.tensor([[5], [5]])
    assert step(ids, torch.ones(2, 6, dtype=torch.long), positions, DynamicCache()) is None  # a 2-D mask
    assert step(ids, None, positions, ((torch.zeros(2, 4, 5, 8),) * 2,)) is None  # a legacy tuple cache


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "longrope",
            "factor": 2.0,
            "original_max_position_embeddings": 8,
            "short_factor": [1.0] * 4,
            "long_factor": [4.0] * 4,
        },
    ],  # fmt: skip
    ids=["dynamic", "longrope"],
)
def test_rotary_embeddings_that_change_with_the_length_keep_the_eager_forward(rope_scaling):
    """Dynamic NTK and longrope frequencies change once a position passes the original context (in
    Python, on 4.x and for dynamic on 5.x), which a trace made before that point would never see:
    such models decode eagerly, and 20 new tokens after 5-token prompts (past 8 and 16 positions) give
    exactly the eager engine's log-probabilities on a twin model (a traced step was 2e-4 off)."""
    # original context 8 positions (16 with the scaling)
    traced_model, eager_model = (
        tiny_llama(num_key_value_heads=4, max_position_embeddings=16, rope_scaling=rope_scaling) for _ in range(2)
    )
    cfg = SamplingConfig(max_new_tokens=20)
    assert_same(sample(traced_model, cfg=cfg), sample(eager_model, cfg=cfg, trace=False))
    assert not decode_trace.traceable(traced_model) and traced_model not in decode_trace._TRACES
    assert decode_trace.traceable(tiny_llama())  # the default rotary embedding is traced


def test_onednn_linear_layers_are_traced(monkeypatch):
    """The trainers route float32 CPU linear layers through oneDNN where it measures faster
    (posttrain.cpu_linear); its op is recorded through a TorchScript function, so those models' decode
    steps are traced too (at 70m, where oneDNN wins at decode sizes, they were not), and still sample
    the eager engine's tokens bitwise."""
    model = tiny_neox()
    with cpu_linear.linear_kernels([model], mode="onednn") as switched:
        assert switched
        eager = sample(model, trace=False)
        calls = count_forwards(model, monkeypatch)
        traced = sample(model)
    assert_same(traced, eager)
    assert any(step is not None for step in traces(model).values())
    assert calls[0] < 20 - 5  # the trace replaced most of the 19 decode forwards


@pytest.mark.skipif(not cpu_linear.can_pack(), reason="this torch build cannot pack oneDNN weights")
def test_packed_decode_weights_follow_the_weights_from_one_rollout_to_the_next(monkeypatch):
    """Inside a rollout the switched layers decode on weights packed for it (cpu_linear.packed_weights).
    The trace takes them as inputs: after an in-place weight update (an optimizer step) the next rollout
    packs again and its traced steps sample what the eager forward on the new weights samples, bitwise; a
    trace that had kept the first rollout's packed weights as constants would not. The copies are dropped
    when the rollout ends."""
    model = tiny_neox()
    packs = []
    real_pack = cpu_linear._pack
    monkeypatch.setattr(cpu_linear, "_pack", lambda w: packs.append(w) or real_pack(w))
    with cpu_linear.linear_kernels([model], mode="onednn") as switched:
        first = sample(model)
        assert len(packs) == len(switched) > 0  # every switched layer packed, once per rollout
        (key, step), *_ = ((k, s) for k, s in traces(model).items() if s is not None)
        assert len(key[-1]) == len(switched)
        step_in_place(model)
        traced = sample(model)
        assert traces(model)[key] is step  # the same trace, replayed on the new packed weights
        assert_same(traced, sample(model, trace=False))
        assert not torch.equal(traced[0].logprobs, first[0].logprobs)
        assert all(cpu_linear.PACKED not in layer.__dict__ for layer in switched)
    # the packed call is oneDNN's on the plain weight, so the rollout is what the unpacked layers sample
    unpacked = cpu_linear.Decision(True, True)
    monkeypatch.setattr(cpu_linear, "onednn_faster", lambda *shape: unpacked)
    with cpu_linear.linear_kernels([model], mode="auto"):
        assert_same(sample(model, trace=False), traced)


@pytest.mark.skipif(not cpu_linear.can_pack(), reason="this torch build cannot pack oneDNN weights")
def test_a_trace_is_only_replayed_with_the_layers_it_packed(monkeypatch):
    """Two runs that switch the same layers and pack as many of them, but different ones (the attention
    output projections, then the query-key-value projections: one per layer each), must not share a trace:
    a replay feeds each packed weight to the layer it was traced with. Both sample what the eager forward
    samples."""
    model = tiny_neox()
    hidden = model.config.hidden_size

    def packing(shape):
        return lambda out, inp, bias: cpu_linear.Decision(True, False, 0.0 if (out, inp) == shape else math.inf)

    for shape in [(hidden, hidden), (3 * hidden, hidden)]:
        monkeypatch.setattr(cpu_linear, "onednn_faster", packing(shape))
        with cpu_linear.linear_kernels([model], mode="auto") as switched:
            assert len(switched) == 4 * model.config.num_hidden_layers + 1  # every linear layer, and the head
            assert_same(sample(model), sample(model, trace=False))
            packed = [key[-1] for key, step in traces(model).items() if step is not None]
            assert packed and all(len(layers) == model.config.num_hidden_layers for layers in packed)


def bf16_sample(model, **options):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return sample(model, **options)


@pytest.mark.skipif(not cpu_linear.can_pack_bf16(), reason="oneDNN cannot pack bf16 weights on this CPU")
@pytest.mark.parametrize("builder", [tiny_neox, tiny_llama])
def test_bf16_autocast_steps_are_traced_on_packed_bf16_weights(builder, monkeypatch):
    """Under CPU bf16 autocast (--bf16 on CPU) every linear layer decodes on bf16 weights packed for the
    rollout (cpu_linear.autocast_packed_weights), so the decode step casts no weight and is traced: it
    samples the eager step's tokens, log-probabilities and entropies bitwise, after an in-place weight
    update too (the packed copies are trace inputs, made anew for each rollout, never constants)."""
    monkeypatch.setattr(cpu_linear, "bf16_pack_calls", lambda *shape: 0.0)  # pack every layer
    model = builder()
    eager = bf16_sample(model, trace=False)
    calls = count_forwards(model, monkeypatch)
    traced = bf16_sample(model)
    assert_same(traced, eager)
    assert traced[0].logprobs.dtype == torch.float32 and 0 < traced[0].ended.sum() < len(traced[0])
    assert calls[0] < 20 - 5  # the trace replaced most of the 19 decode forwards
    (key, step), *_ = ((k, s) for k, s in traces(model).items() if s is not None and k[-2])
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    # every linear layer fed its packed bf16 weight, and its bf16 bias where it has one
    assert len(set(key[-1])) == len(linears)
    assert len(key[-1]) == len(linears) + sum(m.bias is not None for m in linears)
    step_in_place(model)
    updated = bf16_sample(model)
    assert traces(model)[key] is step  # the same trace, replayed on the new packed weights
    assert_same(updated, bf16_sample(model, trace=False))
    assert not torch.equal(updated[0].logprobs, traced[0].logprobs)
    assert all(cpu_linear.PACKED not in m.__dict__ and "forward" not in m.__dict__ for m in linears)
    # a trace made under autocast is never replayed without it: float32 decoding is traced anew, and
    # the bf16 trace is kept for the next bf16 rollout (a float32 evaluation between bf16 rollouts)
    assert_same(sample(model), sample(model, trace=False))
    assert sorted(k[-2] for k, s in traces(model).items() if s is not None) == [False, True]
    assert_same(bf16_sample(model), bf16_sample(model, trace=False))
    assert traces(model)[key] is step


def test_a_bf16_autocast_step_that_casts_weights_keeps_the_eager_forward(monkeypatch):
    """Without packed weights (POSTTRAIN_CPU_LINEAR=off) a bf16 autocast step casts every linear weight to
    bf16: eager, autocast casts each weight once per rollout from its cache; a trace would replay the casts
    at every step, or, had the cache been on while tracing, freeze the casts of the first rollout's
    weights into it. Such a trace is refused, and the eager forward samples as without tracing."""
    monkeypatch.setenv(cpu_linear.ENV, "off")
    model = tiny_neox()
    traced = bf16_sample(model)
    assert model in decode_trace._TRACES and all(step is None for step in traces(model).values())
    assert_same(traced, bf16_sample(model, trace=False))
