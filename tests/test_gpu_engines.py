"""On one CUDA GPU (`pytest -m gpu`; skipped where torch sees no CUDA device, as in CI): the rollout
contract holds for every decode-engine variant on CUDA — the default engine, the stop check every 8
tokens, the static KV cache, and the static cache with the decode step compiled in torch.compile's
"reduce-overhead" mode (CUDA graphs), which is what `cache_implementation="static"` selects on CUDA.

The contract: rows that stop mid-batch keep their stop token and are padded after it, the masks come
from the lengths, pad == eos is not mistaken for a stop, the same seed gives the same tokens, and the
recorded log-probabilities are the model's. `check_engine` is a plain function of the device and the
engine options, so it can be run (and was) against CPU with compile_mode="default"."""

from __future__ import annotations

import pytest
import torch

from posttrain.rollout import SamplingConfig, generate, generation_mode
from posttrain.scoring import completion_logprobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

STOP = (2, 3, 5, 7)  # 2 is also the pad token: pad == eos
ENGINES = {
    "default": {},
    "sync_every=8": {"sync_every": 8},
    "static": {"cache_implementation": "static"},
    "static + reduce-overhead": {"cache_implementation": "static", "compile_mode": "reduce-overhead"},
}


def tiny_model(device_type: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=48,
        max_position_embeddings=128,
        pad_token_id=2,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval().to(device_type)


def check_engine(device_type: str, options: dict, reference_options: dict | None = None) -> None:
    """The rollout contract for `generate(..., **options)` on `device_type`; with `reference_options`,
    also the same tokens as that engine for the same seed (eager engines only: compiled kernels round
    differently, so a draw within float error of a token boundary may differ)."""
    model = tiny_model(device_type)
    rows = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22], [30], [40, 41, 42, 43]]
    width = max(map(len, rows))
    ids = torch.tensor([[2] * (width - len(r)) + r for r in rows], device=device_type)
    mask = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows], device=device_type)
    sampling = SamplingConfig(max_new_tokens=20, temperature=1.0, stop_token_ids=STOP)

    def run(seed: int, engine: dict):
        generator = torch.Generator(device=device_type).manual_seed(seed)
        with generation_mode(model):
            return generate(model, ids, mask, sampling, pad_token_id=2, num_samples=2, generator=generator, **engine)

    r = run(0, options)
    assert r.completion_ids.shape[0] == 10 and r.completion_ids.device.type == device_type
    assert 0 < int(r.ended.sum()) < len(r)  # some rows stopped mid-batch, some ran to the limit
    steps = torch.arange(r.completion_ids.shape[1], device=device_type)
    assert torch.equal(r.completion_mask, steps[None] < r.completion_lengths[:, None])
    assert (r.completion_ids[~r.completion_mask] == 2).all()  # pad (== eos) after the stop
    last = r.completion_ids.gather(1, (r.completion_lengths - 1).clamp(min=0)[:, None])[:, 0]
    assert torch.equal(r.ended, torch.isin(last, torch.tensor(STOP, device=device_type)))
    assert torch.equal(r.ended | (r.completion_lengths == 20), torch.ones_like(r.ended))
    # A stop token appears only as a row's last real token.
    real_before_last = r.completion_mask & (steps[None] < (r.completion_lengths - 1)[:, None])
    assert not torch.isin(r.completion_ids[real_before_last], torch.tensor(STOP, device=device_type)).any()
    again = run(0, options)
    assert torch.equal(again.completion_ids, r.completion_ids)  # same seed, same tokens
    assert torch.equal(again.completion_lengths, r.completion_lengths)
    with torch.no_grad():
        recomputed, _ = completion_logprobs(model, r)
    assert torch.allclose(recomputed * r.completion_mask, r.logprobs * r.completion_mask, atol=1e-3)
    if reference_options is not None:
        reference = run(0, reference_options)
        assert torch.equal(reference.completion_ids, r.completion_ids)
        assert torch.equal(reference.completion_lengths, r.completion_lengths)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_rollout_contract_for_each_engine_on_the_gpu(engine):
    eager = "compile_mode" not in ENGINES[engine]
    check_engine("cuda", ENGINES[engine], reference_options={} if eager and engine != "default" else None)
