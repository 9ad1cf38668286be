"""oneDNN linear layers on CPU (posttrain.cpu_linear): same values and gradients as nn.Linear,
switched only where eligible, restored on exit, and used by the online trainers' train()."""

from __future__ import annotations

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


def test_auto_follows_the_timing_and_the_environment_is_checked(monkeypatch):
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    monkeypatch.setattr(cpu_linear, "onednn_faster", lambda out, inp, bias: out == 16)
    with cpu_linear.linear_kernels([model], mode="auto") as switched:
        assert switched == [model[0]]
    monkeypatch.setenv(cpu_linear.ENV, "fast")
    with pytest.raises(ValueError, match="POSTTRAIN_CPU_LINEAR='fast'.*auto, onednn, off"):
        cpu_linear.mode_from_env()
    monkeypatch.setenv(cpu_linear.ENV, "OFF")
    assert cpu_linear.mode_from_env() == "off"


def test_calibration_decides_once_per_shape(monkeypatch):
    calls = []
    real = cpu_linear._best_time

    def counted(fn, *args, repeats=3):
        calls.append(1)
        return real(fn, *args, repeats=repeats)

    monkeypatch.setattr(cpu_linear, "_best_time", counted)
    cpu_linear._DECISIONS.clear()
    first = cpu_linear.onednn_faster(24, 40, True)
    timed = len(calls)
    assert timed == 2 * len(cpu_linear.CALIBRATION_ROWS)
    assert cpu_linear.onednn_faster(24, 40, True) == first and len(calls) == timed
    assert cpu_linear.onednn_faster(1 << 14, 1 << 13, False) is False  # too large to time: default path
    assert len(calls) == timed


def test_online_trainer_learns_through_onednn_layers_and_restores_them(tmp_path, tiny_tokenizer, monkeypatch):
    # The RLOO learning check of tests/test_rloo.py with every linear layer forced through oneDNN:
    # the custom backward must carry the policy gradient, and the layers get their forward back.
    from helpers import learning_rloo_config, letter_fraction, prompt_dataset
    from posttrain.testing import build_tiny_causal_lm
    from posttrain.trainers.rloo import RLOOTrainer

    monkeypatch.setenv(cpu_linear.ENV, "onednn")
    calls = []
    real = cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda *a: calls.append(torch.is_grad_enabled()) or real(*a))
    cfg = learning_rloo_config(tmp_path)
    policy = build_tiny_causal_lm(tiny_tokenizer)
    trainer = RLOOTrainer(cfg, tiny_tokenizer, policy, None, letter_fraction, prompt_dataset())
    trainer.train()
    assert True in calls and False in calls  # the update (with grad) and generation / reference (without)
    assert not any("forward" in m.__dict__ for m in policy.modules())
    scores = [h["objective/scores"] for h in trainer.state.log_history[:-1]]
    assert sum(scores[-5:]) / 5 > sum(scores[:5]) / 5 + 0.08, scores
