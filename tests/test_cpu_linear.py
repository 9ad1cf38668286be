"""oneDNN linear layers on CPU (posttrain.cpu_linear): same values and gradients as nn.Linear,
switched only where eligible, restored on exit, and used by the online trainers' train()."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from posttrain import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no oneDNN linear kernel")


def test_hand_derived_values_and_gradients():
    # y = x Wᵀ + b with x = [1, 2], W = [[1, 0], [0, 1], [1, 1]], b = [0.5, 0, -1] → [1.5, 2, 2].
    # loss = Σ y: dx = Σ_rows W = [2, 2]; dW = each row x = [1, 2]; db = [1, 1, 1].
    x = torch.tensor([[1.0, 2.0]], requires_grad=True)
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], requires_grad=True)
    b = torch.tensor([0.5, 0.0, -1.0], requires_grad=True)
    y = cpu_linear.linear(x, w, b)
    assert y.tolist() == [[1.5, 2.0, 2.0]]
    y.sum().backward()
    assert x.grad.tolist() == [[2.0, 2.0]]
    assert w.grad.tolist() == [[1.0, 2.0]] * 3
    assert b.grad.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("bias", [True, False])
def test_matches_nn_linear_forward_and_backward_on_3d_inputs(bias):
    torch.manual_seed(0)
    layer = nn.Linear(64, 96, bias=bias)
    x = torch.randn(3, 7, 64, requires_grad=True)
    upstream = torch.randn(3, 7, 96)
    ours = cpu_linear.linear(x, layer.weight, layer.bias)
    (ours * upstream).sum().backward()
    mine = (x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone() if bias else None)
    x.grad = None
    layer.zero_grad(set_to_none=True)
    reference = layer(x)
    (reference * upstream).sum().backward()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine[0], x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine[1], layer.weight.grad, rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(mine[2], layer.bias.grad, rtol=1e-5, atol=1e-5)


def test_frozen_weight_gets_no_gradient_and_no_grad_mode_builds_no_graph():
    layer = nn.Linear(8, 4).requires_grad_(False)
    x = torch.randn(5, 8, requires_grad=True)
    cpu_linear.linear(x, layer.weight, layer.bias).sum().backward()
    assert layer.weight.grad is None and x.grad is not None
    with torch.no_grad():
        assert cpu_linear.linear(x, layer.weight, layer.bias).grad_fn is None
    assert cpu_linear.linear(torch.randn(0, 8), layer.weight, layer.bias).shape == (0, 4)


class _Subclass(nn.Linear):
    pass


def test_switches_only_plain_float32_linear_layers_and_restores_them():
    plain = nn.Linear(8, 8)
    model = nn.Sequential(plain, _Subclass(8, 8), nn.Linear(8, 8).double(), nn.ReLU())
    hooked = nn.Linear(8, 8)
    hooked.forward = lambda x: x  # e.g. accelerate's hooks replace forward on the instance
    x = torch.randn(2, 8)
    before = model[:2](x)
    with cpu_linear.linear_kernels([model, nn.Sequential(hooked), model], mode="onednn") as switched:
        assert switched == [plain]  # listed once although the model was passed twice
        assert "forward" in plain.__dict__
        torch.testing.assert_close(model[:2](x), before, rtol=1e-5, atol=1e-6)
    assert "forward" not in plain.__dict__
    assert hooked(x) is x  # someone else's forward is left alone
    with pytest.raises(RuntimeError, match="boom"), cpu_linear.linear_kernels([model], mode="onednn"):
        raise RuntimeError("boom")
    assert "forward" not in plain.__dict__
    with cpu_linear.linear_kernels([model], mode="off") as switched:
        assert switched == []


def test_auto_follows_the_timing_per_row_count_and_the_environment_is_checked(monkeypatch):
    # Decisions per weight shape: (16 → 8) oneDNN for small calls only, (8 → 24) for large calls
    # only, (24 → 8) for neither. Each layer's calls then go to oneDNN only at the sizes decided.
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 24), nn.Linear(24, 8))
    decisions = {16: cpu_linear.Decision(True, True), 8: cpu_linear.Decision(False, False)}
    decisions[24] = cpu_linear.Decision(False, True)
    monkeypatch.setattr(
        cpu_linear,
        "onednn_faster",
        lambda out, inp, bias: cpu_linear.Decision(True, False) if inp == 16 else decisions[out],
    )
    routed = []
    real = cpu_linear.linear
    monkeypatch.setattr(
        cpu_linear, "linear", lambda x, w, b=None: routed.append((w.shape[0], x.shape[0])) or real(x, w, b)
    )
    small, large = cpu_linear.SMALL_ROWS, cpu_linear.SMALL_ROWS + 1
    with cpu_linear.linear_kernels([model], mode="auto") as switched:
        assert switched == [model[0], model[1], model[2]]
        for rows in (small, large):
            out = model[3](model[2](model[1](model[0](torch.randn(rows, 8)))))
            assert out.shape == (rows, 8)
    # model[0] always, model[1] (16 → 8) only at SMALL_ROWS rows, model[2] only above; model[3] never.
    assert routed == [(16, small), (8, small), (16, large), (24, large)]
    monkeypatch.setenv(cpu_linear.ENV, "fast")
    with pytest.raises(ValueError, match="POSTTRAIN_CPU_LINEAR='fast'.*auto, onednn, off"):
        cpu_linear.mode_from_env()
    monkeypatch.setenv(cpu_linear.ENV, "OFF")
    assert cpu_linear.mode_from_env() == "off"


@pytest.mark.parametrize("config", ["rloo_config:RLOOConfig", "sft_config:SFTConfig"])
def test_a_bad_environment_value_fails_when_the_config_is_built(config, monkeypatch):
    import importlib

    from posttrain.configs import ConfigError

    module, name = config.split(":")
    config_cls = getattr(importlib.import_module(f"posttrain.trainers.{module}"), name)
    monkeypatch.setenv(cpu_linear.ENV, "mkl")
    with pytest.raises(ConfigError, match="POSTTRAIN_CPU_LINEAR='mkl': expected one of auto, onednn, off"):
        config_cls(output_dir="unused", report_to="none")


def test_calibration_decides_once_per_shape(monkeypatch):
    calls = []
    real = cpu_linear._best_time

    def counted(fn, *args, repeats=5):
        calls.append(1)
        return real(fn, *args, repeats=repeats)

    monkeypatch.setattr(cpu_linear, "_best_time", counted)
    cpu_linear._DECISIONS.clear()
    first = cpu_linear.onednn_faster(24, 40, True)
    timed = len(calls)
    # both kernels at each row count, the packed weight's call at 16 rows, and the packing where that call won
    packed_timed = 1 if cpu_linear.can_pack() else 0
    assert timed - 2 * len(cpu_linear.CALIBRATION_ROWS) in {packed_timed, 2 * packed_timed}
    assert cpu_linear.onednn_faster(24, 40, True) == first and len(calls) == timed
    assert isinstance(first, cpu_linear.Decision)
    shapes = []
    monkeypatch.setattr(cpu_linear, "linear", lambda x, w, b=None: shapes.append(tuple(w.shape)) or x)
    cpu_linear.onednn_faster(151_936, 896, False)  # a 151k-vocabulary LM head: timed on its first outputs
    assert set(shapes) == {(cpu_linear.MAX_CALIBRATED_ELEMENTS // 896, 896)}
    assert len(calls) > timed


@pytest.mark.skipif(not cpu_linear.can_pack(), reason="this torch build cannot pack oneDNN weights")
@pytest.mark.parametrize(
    ("times", "expected"),
    [
        # default 1.0, oneDNN 0.5 (≤ 0.85: small calls go to oneDNN), packed 0.3 (≤ 0.85 × 0.5), packing
        # 4.0: it pays after 4.0 / (0.5 − 0.3) = 20 small calls.
        ({"default": 1.0, "onednn": 0.5, "packed": 0.3, "pack": 4.0}, cpu_linear.Decision(True, True, 20.0)),
        # default 1.0 and oneDNN 0.9 (> 0.85: small calls keep the default); packed 0.5: 3.0 / (1.0 − 0.5) = 6
        ({"default": 1.0, "onednn": 0.9, "packed": 0.5, "pack": 3.0}, cpu_linear.Decision(False, False, 6.0)),
        # packed 0.45 against oneDNN's 0.5: no margin is asked of the packed call (its lead grows when the weight
        # is out of cache, as in a decode step), so it pays after 0.1 / (0.5 − 0.45) = 2 small calls
        ({"default": 1.0, "onednn": 0.5, "packed": 0.45, "pack": 0.1}, cpu_linear.Decision(True, True, 2.0)),
        # packed 0.5, as fast as oneDNN's plain call: never packed
        ({"default": 1.0, "onednn": 0.5, "packed": 0.5, "pack": 0.1}, cpu_linear.Decision(True, True)),
    ],
)
def test_calibration_weighs_packing_against_the_small_calls_it_saves(times, expected, monkeypatch):
    def fake(fn, *args, repeats=5):
        if fn is cpu_linear._pack:
            return times["pack"]
        if fn is cpu_linear.linear:
            return times["packed" if args[1].is_mkldnn else "onednn"]
        return times["default"]

    monkeypatch.setattr(cpu_linear, "_best_time", fake)
    cpu_linear._DECISIONS.clear()
    decision = cpu_linear.onednn_faster(24, 40, True)
    cpu_linear._DECISIONS.clear()
    assert decision.small == expected.small and decision.large == expected.large
    assert decision.pack_calls == pytest.approx(expected.pack_calls)


def test_a_weight_timed_on_its_first_outputs_takes_onednn_at_any_lead(monkeypatch):
    # oneDNN at 0.9 of the default's time: short of the 0.85 margin for a weight timed whole, but a
    # 151k-vocabulary LM head is timed on its first outputs (in cache, where oneDNN's lead is smaller than
    # on the whole head), so there it wins at both row counts; at 1.0 (a tie) it does not.
    def timer(onednn):
        def fake(fn, *args, repeats=5):
            if fn is cpu_linear._pack:
                return 1.0
            if fn is cpu_linear.linear:
                return 0.95 if args[1].is_mkldnn else onednn
            return 1.0

        return fake

    decided = {}
    for onednn in (0.9, 1.0):
        monkeypatch.setattr(cpu_linear, "_best_time", timer(onednn))
        for shape in ((24, 40, True), (151_936, 896, False)):
            cpu_linear._DECISIONS.clear()
            d = cpu_linear.onednn_faster(*shape)
            decided[onednn, shape[0]] = (d.small, d.large)
    cpu_linear._DECISIONS.clear()
    assert decided == {
        (0.9, 24): (False, False),
        (0.9, 151_936): (True, True),
        (1.0, 24): (False, False),
        (1.0, 151_936): (False, False),
    }


def test_online_trainer_learns_through_onednn_layers_and_restores_them(tmp_path, tiny_tokenizer, monkeypatch):
    # The RLOO learning check of tests/test_rloo.py with every linear layer forced through oneDNN:
    # the custom backward must carry the policy gradient, and the layers get their forward back.
    from helpers import learning_rloo_config, letter_fraction, prompt_dataset
    from posttrain.testing import build_tiny_causal_lm
    from posttrain.trainers.rloo import RLOOTrainer

    monkeypatch.setenv(cpu_linear.ENV, "onednn")
    calls = _recording_linear(monkeypatch)
    cfg = learning_rloo_config(tmp_path)
    policy = build_tiny_causal_lm(tiny_tokenizer)
    trainer = RLOOTrainer(cfg, tiny_tokenizer, policy, None, letter_fraction, prompt_dataset())
    trainer.train()
    assert True in calls and False in calls  # the update (with grad) and generation / reference (without)
    assert not any("forward" in m.__dict__ for m in policy.modules())
    scores = [h["objective/scores"] for h in trainer.state.log_history[:-1]]
    assert sum(scores[-5:]) / 5 > sum(scores[:5]) / 5 + 0.08, scores


def _recording_linear(monkeypatch) -> list[bool]:
    """Record, for every call that goes through oneDNN, whether autograd was on."""
    calls: list[bool] = []
    real = cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda *a: calls.append(torch.is_grad_enabled()) or real(*a))
    return calls


def test_sft_trains_through_onednn_layers_and_restores_them(tmp_path, tiny_tokenizer, monkeypatch):
    # SFT with every linear layer forced through oneDNN: the held-out loss falls as on torch's path.
    from helpers import sft_trainer

    monkeypatch.setenv(cpu_linear.ENV, "onednn")
    calls = _recording_linear(monkeypatch)
    rows = [{"text": f"the sea is blue and the dog is {w}."} for w in ["good", "calm", "wide", "true"] * 4]
    held_out = [{"text": f"the sea is blue and the dog is {w}."} for w in ["blue", "little"]]
    trainer = sft_trainer(tmp_path, tiny_tokenizer, rows, held_out, max_steps=20, learning_rate=3e-3)
    before = trainer.evaluate()["eval_loss"]
    assert calls == []  # only train() switches the layers
    trainer.train()
    assert True in calls
    assert not any("forward" in m.__dict__ for m in trainer.model.modules())
    assert trainer.evaluate()["eval_loss"] < before - 1.0


@pytest.mark.parametrize("bf16, compiled, switched", [(False, False, True), (True, False, False), (False, True, False)])
def test_for_training_keeps_torch_path_under_autocast_and_compile(bf16, compiled, switched, monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "onednn")
    model = nn.Sequential(nn.Linear(4, 4))
    mixed_precision = "bf16" if bf16 else "no"
    with cpu_linear.for_training([model], mixed_precision=mixed_precision, compiled=compiled) as layers:
        assert ("forward" in model[0].__dict__) is switched
        assert layers == ([model[0]] if switched else [])


def test_reward_training_runs_through_onednn_layers(tmp_path, tiny_tokenizer, monkeypatch):
    from helpers import reward_trainer

    monkeypatch.setenv(cpu_linear.ENV, "onednn")
    calls = _recording_linear(monkeypatch)
    pairs = [{"chosen": "Q: sea? A: The sea is blue.", "rejected": "Q: sea? A: dog."}] * 8
    trainer = reward_trainer(tmp_path, tiny_tokenizer, pairs, max_steps=2)
    trainer.train()
    assert True in calls
    assert not any("forward" in m.__dict__ for m in trainer.model.modules())


@pytest.mark.skipif(not cpu_linear.can_pack_bf16(), reason="oneDNN cannot pack bf16 weights on this CPU")
def test_bf16_autocast_decode_calls_run_on_packed_bf16_weights_and_nothing_else_changes(monkeypatch):
    """Inside autocast_packed_weights under CPU bf16 autocast, a plain float32 layer's small calls without
    gradients cast their input to bf16 and run on a bf16 copy of its weight packed once: bf16 results
    within bf16 rounding of autocast's F.linear (the same bf16 operands). Larger calls and calls with
    gradients are autocast's F.linear itself. Outside bf16 autocast, and with POSTTRAIN_CPU_LINEAR=off,
    no layer is switched; forwards and copies are dropped on exit, also after an error."""
    monkeypatch.setattr(cpu_linear, "bf16_pack_calls", lambda *shape: 0.0)
    torch.manual_seed(0)
    layer, unbiased, other = nn.Linear(48, 40), nn.Linear(40, 24, bias=False), _Subclass(24, 8)
    model = nn.Sequential(layer, unbiased, other)
    small, large = torch.randn(3, 5, 48), torch.randn(cpu_linear.SMALL_ROWS + 1, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = {"small": model(small), "large": model(large)}
        with torch.no_grad(), cpu_linear.autocast_packed_weights(model, calls=53) as switched:
            assert switched == [layer, unbiased]  # plain nn.Linear only
            assert cpu_linear.packed_inputs(model) == [  # (index in model.modules(), tensor)
                (1, layer.__dict__[cpu_linear.PACKED]),
                (1, layer.__dict__[cpu_linear.PACKED_BIAS]),
                (2, unbiased.__dict__[cpu_linear.PACKED]),
            ]
            assert layer.__dict__[cpu_linear.PACKED_BIAS].dtype == torch.bfloat16
            out = model(small)
            assert out.dtype == torch.bfloat16 and out.shape == (3, 5, 8)
            torch.testing.assert_close(out.float(), expected["small"].float(), rtol=2e-2, atol=2e-2)
            assert torch.equal(model(large), expected["large"])  # > SMALL_ROWS rows: F.linear
            routed = []
            real = cpu_linear._onednn
            monkeypatch.setattr(cpu_linear, "_onednn", lambda *a: routed.append(a[0].shape) or real(*a))
            with torch.enable_grad():
                assert torch.equal(model(small), expected["small"])  # with gradients: F.linear
            assert routed == []
            model(small)
            assert routed == [(15, 48), (15, 40)]
        assert not any(name in layer.__dict__ for name in ("forward", cpu_linear.PACKED, cpu_linear.PACKED_BIAS))
        with pytest.raises(RuntimeError, match="boom"), cpu_linear.autocast_packed_weights(model, calls=53):
            raise RuntimeError("boom")
        assert "forward" not in layer.__dict__
        monkeypatch.setenv(cpu_linear.ENV, "off")
        with cpu_linear.autocast_packed_weights(model, calls=53) as switched:
            assert switched == []
    monkeypatch.delenv(cpu_linear.ENV)
    with cpu_linear.autocast_packed_weights(model, calls=53) as switched:
        assert switched == []  # float32: cpu_linear.packed_weights' business
    with torch.autocast("cpu", dtype=torch.float16), cpu_linear.autocast_packed_weights(model, calls=53) as switched:
        assert switched == []


def _fake_bf16_packing(monkeypatch):
    """oneDNN's bf16 reorder and kernel replaced by a copy and F.linear: the decision's arithmetic and the
    layers it switches are the same on a CPU that cannot pack bf16 (can_pack_bf16 False) as on one that can."""
    monkeypatch.setattr(cpu_linear, "can_pack_bf16", lambda: True)
    monkeypatch.setattr(cpu_linear, "_pack", lambda w: w.detach().clone())
    monkeypatch.setattr(cpu_linear, "_onednn", lambda x, w, b: torch.nn.functional.linear(x, w, b))


def test_bf16_weights_are_packed_only_where_a_pass_over_the_model_says_it_pays(monkeypatch):
    """bf16_pack_calls times one pass over all of the model's layers on bf16 copies (autocast's kernel) and
    one on packed copies, and the packing, once per model: with passes of 1.0 and 0.5 and packing 10.0 the
    copies pay after 10.0 / (1.0 - 0.5) = 20 decode steps, so a rollout of 19 steps keeps F.linear and one
    of 20 packs every layer; a packed pass not below 0.85 of the plain one never packs."""
    _fake_bf16_packing(monkeypatch)
    times = {}

    def best_time(fn, *args, repeats=5):
        return times["packed" if "packed" in fn.__name__ else "plain"]

    monkeypatch.setattr(cpu_linear, "_best_time", best_time)
    monkeypatch.setattr(cpu_linear, "_timed", lambda fn: (fn(), times["pack"]))  # packing every layer
    for plain, packed, expected in [(1.0, 0.5, 20.0), (1.0, 0.9, math.inf)]:
        times.update(plain=plain, packed=packed, pack=10.0)
        model = nn.Sequential(nn.Linear(16, 12), nn.Linear(12, 16))
        layers = list(model)
        assert cpu_linear.bf16_pack_calls(model, layers) == pytest.approx(expected)
        times.update(plain=0.0)  # decided once per model: not timed again
        assert cpu_linear.bf16_pack_calls(model, layers) == pytest.approx(expected)
    times.update(plain=1.0, packed=0.5, pack=10.0)
    model = nn.Sequential(nn.Linear(16, 12), nn.Linear(12, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for calls, switched_layers in [(19, 0), (20, 2)]:
            with cpu_linear.autocast_packed_weights(model, calls=calls) as switched:
                assert len(switched) == switched_layers


@pytest.mark.parametrize(("budget", "timed"), [(2 * 16 * 12 + 2 * 12 * 16, 2), (2 * 16 * 12, 1), (1, 1)])
def test_the_bf16_decision_times_the_first_layers_up_to_its_byte_budget(monkeypatch, budget, timed):
    """The pass holds two bf16 copies of what it times, so it covers the model's first layers up to
    MAX_CALIBRATED_BF16_BYTES of bf16 weight (2 bytes an element), and at least one layer."""
    _fake_bf16_packing(monkeypatch)
    monkeypatch.setattr(cpu_linear, "MAX_CALIBRATED_BF16_BYTES", budget)
    packed = []
    real_pack = cpu_linear._pack
    monkeypatch.setattr(cpu_linear, "_pack", lambda w: packed.append(tuple(w.shape)) or real_pack(w))
    model = nn.Sequential(nn.Linear(16, 12), nn.Linear(12, 16))
    cpu_linear.bf16_pack_calls(model, list(model))
    assert packed == [(12, 16), (16, 12)][:timed]


def test_a_cpu_whose_onednn_cannot_pack_bf16_decodes_bf16_on_autocasts_own_kernel(monkeypatch):
    """On an AVX2-only CPU torch's oneDNN raises at the bf16 reorder ("bf16 path needs the cpu support
    avx_ne_convert or avx512bw, avx512vl and avx512dq"). can_pack_bf16 asks the op once and says no, the
    decision never times a pass (inf), and under bf16 autocast no layer is switched: the rollout runs on
    autocast's own F.linear instead of failing at its first decode step."""

    def unsupported(weight):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")
        return real_pack(weight)

    real_pack = cpu_linear._pack
    monkeypatch.setattr(cpu_linear, "_pack", unsupported)
    cpu_linear.can_pack_bf16.cache_clear()
    try:
        assert not cpu_linear.can_pack_bf16()
        model = nn.Sequential(nn.Linear(16, 12), nn.Linear(12, 16))
        assert cpu_linear.bf16_pack_calls(model, list(model)) == math.inf
        x = torch.randn(2, 16)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(x)
            with cpu_linear.autocast_packed_weights(model, calls=10**9) as switched:
                assert switched == []
                assert torch.equal(model(x), expected)
    finally:
        cpu_linear.can_pack_bf16.cache_clear()
    assert not any("forward" in m.__dict__ or cpu_linear.PACKED in m.__dict__ for m in model)
