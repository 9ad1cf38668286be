"""On one CUDA GPU (`pytest -m gpu`; skipped, with the reason, where torch sees no CUDA device, as in CI):
PPO and GRPO train a few bf16 steps with every model on the GPU, the rollout contract holds on CUDA
tensors, and each test records its peak GPU memory (`record_property`, in the JUnit XML report with
--junitxml, and printed with -s). The checks are plain functions of the device type, so they can be
read (and were run) against CPU as well."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import online_trainer, tiny_llama
from posttrain.rollout import SamplingConfig, generate
from posttrain.scoring import completion_logprobs
from posttrain.testing import build_tiny_reward_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]


def devices(module: torch.nn.Module) -> set[str]:
    return {p.device.type for p in module.parameters()}


def check_bf16_training(algo: str, out, tokenizer, device_type: str, **config) -> dict:
    """A few bf16 steps of `algo` with a reward model (`config`: more config fields); every model on
    `device_type`; the logged losses and KL are finite. Returns the last log."""
    reward = build_tiny_reward_model(tokenizer, seed=1)
    trainer = online_trainer(algo, out, tokenizer, reward=reward, bf16=True, save_strategy="no", **config)
    assert trainer.accelerator.device.type == device_type
    assert trainer.accelerator.mixed_precision == "bf16"
    trainer.train()
    for name, model in [("policy", trainer.model), ("reference", trainer.ref_model), ("reward model", reward)]:
        assert devices(model) == {device_type}, name
    assert trainer.state.global_step == 2
    last = [entry for entry in trainer.state.log_history if "objective/kl" in entry][-1]
    losses = [value for key, value in last.items() if key.startswith(("loss/", "objective/"))]
    assert losses and all(math.isfinite(v) for v in losses), last
    return last


def check_rollout_contract(device_type: str) -> None:
    """Masks, lengths, stop tokens, padding, seeding and log-probs of `generate` on `device_type`."""
    model = tiny_llama().to(device_type)
    ids = torch.tensor([[0, 0, 5, 6, 7], [0, 0, 0, 11, 12], [20, 21, 22, 23, 24]], device=device_type)
    mask = ids != 0
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, stop_token_ids=(1, 2, 3))

    def run(seed: int):
        generator = torch.Generator(device=device_type).manual_seed(seed)
        return generate(model, ids, mask, sampling, pad_token_id=0, num_samples=2, generator=generator)

    r = run(0)
    for name in ("completion_ids", "completion_mask", "completion_lengths", "ended", "logprobs"):
        assert getattr(r, name).device.type == device_type, name
    assert r.completion_ids.shape[0] == 6 and r.logprobs.dtype == torch.float32
    steps = torch.arange(r.completion_ids.shape[1], device=device_type)
    assert torch.equal(r.completion_mask, steps[None] < r.completion_lengths[:, None])
    assert (r.completion_ids[~r.completion_mask] == 0).all()  # padding after the stop
    last = r.completion_ids.gather(1, (r.completion_lengths - 1).clamp(min=0)[:, None])[:, 0]
    assert torch.equal(r.ended, torch.isin(last, torch.tensor([1, 2, 3], device=device_type)))
    assert torch.equal(r.ended | (r.completion_lengths == 12), torch.ones_like(r.ended))
    assert torch.equal(run(0).completion_ids, r.completion_ids)  # same seed, same tokens
    with torch.no_grad():
        recomputed, _ = completion_logprobs(model, r)
    assert torch.allclose(recomputed, r.logprobs, atol=1e-4)
    # bf16 weights: the log-probs stay float32 and finite, and match a bf16 recomputation.
    model.to(torch.bfloat16)
    r16 = run(1)
    assert r16.logprobs.dtype == torch.float32 and torch.isfinite(r16.logprobs).all()
    with torch.no_grad():
        recomputed16, _ = completion_logprobs(model, r16)
    assert torch.allclose(recomputed16, r16.logprobs, atol=5e-2)


@pytest.fixture
def peak_memory(record_property):
    """Peak GPU memory of the test (torch.cuda.max_memory_allocated), recorded as a test property."""
    torch.cuda.reset_peak_memory_stats()
    yield
    peak = torch.cuda.max_memory_allocated()
    record_property("peak_gpu_memory_bytes", peak)
    print(f"peak GPU memory: {peak / 2**20:.1f} MiB")
    assert peak > 0


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_bf16_training_on_the_gpu(algo, tmp_path, tiny_tokenizer, peak_memory):
    check_bf16_training(algo, tmp_path, tiny_tokenizer, "cuda")


def test_bf16_training_with_the_compiled_static_engine_on_the_gpu(tmp_path, tiny_tokenizer, peak_memory):
    """cache_implementation="static" on CUDA: a StaticCache and the decode step compiled with CUDA
    graphs, under bf16 autocast over float32 weights (the keys and values reach the cache in different
    dtypes; transformers 5.17's cache failed on that before compat.static_cache cast them)."""
    check_bf16_training("grpo", tmp_path, tiny_tokenizer, "cuda", cache_implementation="static")


def test_rollout_contract_on_the_gpu(peak_memory):
    check_rollout_contract("cuda")
