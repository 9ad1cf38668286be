import warnings

import pytest
import torch

from posttrain import distributed
from posttrain.tracking import MetricAccumulator


@pytest.fixture
def accelerator():
    from accelerate.state import AcceleratorState, GradientState

    acc = distributed.build_accelerator(gradient_accumulation_steps=2, cpu=True, seed=3)
    yield acc
    # Accelerator state is a process-wide singleton; reset so other tests build their own.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_single_process_helpers(accelerator):
    assert distributed.world_size(accelerator) == 1
    assert distributed.process_index(accelerator) == 0
    assert distributed.is_main(accelerator)
    assert accelerator.gradient_accumulation_steps == 2
    t = torch.tensor([1.0, 2.0])
    summed = distributed.reduce_sum(t, accelerator)
    assert torch.equal(summed, t) and summed is not t
    assert torch.equal(distributed.gather(t, accelerator), t)
    assert distributed.broadcast_object({"a": 1}, accelerator) == {"a": 1}
    distributed.wait_for_everyone(accelerator)
    with distributed.main_process_first(accelerator):
        pass


def test_without_accelerator_is_one_process():
    assert distributed.world_size(None) == 1 and distributed.is_main(None)
    assert distributed.device(None) == torch.device("cpu")
    t = torch.tensor([3.0])
    assert torch.equal(distributed.reduce_sum(t, None), t)
    with distributed.main_process_first(None):
        pass


def test_unwrap_and_unwrap_for_generation(accelerator):
    model = torch.nn.Linear(2, 2)
    prepared = accelerator.prepare(model)
    assert distributed.unwrap(prepared, accelerator) is model
    with distributed.unwrap_for_generation(prepared, accelerator) as bare:
        assert bare is model
    assert distributed.unwrap(model, None) is model


def test_accumulator_reduce_through_accelerator(accelerator):
    acc = MetricAccumulator()
    acc.add_mean("m", torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 1, 0]))  # (1 + 2) / 2
    acc.add_sum("s", torch.tensor(4))
    assert acc.reduce(accelerator) == pytest.approx({"m": 1.5, "s": 4.0})


def test_set_seed_is_reproducible():
    distributed.set_seed(7)
    a = torch.rand(3)
    distributed.set_seed(7)
    assert torch.equal(a, torch.rand(3))


def test_bad_mixed_precision_is_a_clear_error():
    with pytest.raises(ValueError, match="mixed_precision='fp8'"):
        distributed.build_accelerator(mixed_precision="fp8", cpu=True)


def test_shutdown_without_a_process_group_is_a_no_op():
    import torch.distributed

    from posttrain.distributed import shutdown

    assert not torch.distributed.is_initialized()
    shutdown()
    assert not torch.distributed.is_initialized()


def test_global_moments_are_the_masked_mean_and_unbiased_variance(accelerator):
    # x = [1, 2, 3, 10], the 10 masked out: mean = 6/3 = 2, var = ((1−2)² + 0 + (3−2)²)/(3 − 1) = 1.
    x = torch.tensor([1.0, 2.0, 3.0, 10.0])
    mask = torch.tensor([True, True, True, False])
    mean, var = distributed.global_moments(x, mask, accelerator)
    assert (float(mean), float(var)) == (2.0, 1.0)
    # Moments given to the whitening formula replace the batch's own (here var 4, not 1): (x − 2)/sqrt(4 + 1e-8).
    from posttrain.advantages import whiten_advantages

    out = whiten_advantages(x, mask, moments=(torch.tensor(2.0), torch.tensor(4.0)))
    torch.testing.assert_close(out, torch.tensor([-0.5, 0.0, 0.5, 0.0]))
    # Without a mask every position counts: [1, 2, 3, 10] has mean 4 and var (9 + 4 + 1 + 36)/3 = 50/3.
    mean, var = distributed.global_moments(x, None, accelerator)
    assert float(mean) == 4.0 and float(var) == pytest.approx(50 / 3)


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "warns"), [(False, False, True), (True, False, False), (False, True, False)]
)
def test_bf16_on_a_cpu_that_emulates_it_warns_once_with_the_advice(monkeypatch, amx, avx512_bf16, warns):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    assert distributed.cpu_has_native_bf16() is (amx or avx512_bf16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distributed.build_accelerator(mixed_precision="bf16", cpu=True)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    messages = [str(w.message) for w in caught if "bf16" in str(w.message)]
    if warns:
        assert len(messages) == 1 and "float32 is faster here" in messages[0]
    else:
        assert messages == []


def test_early_device_is_this_process_gpu_only_when_models_will_sit_there_whole(tmp_path, monkeypatch):
    """Where a trainer may copy its reference policy before the Accelerator exists: this process's GPU
    in a one-process or DDP run; nowhere early on the CPU, under FSDP or DeepSpeed (sharded or placed
    by their engines), or when the user passed an accelerator (its device and plan rule)."""
    from helpers import rloo_config

    for env in ("LOCAL_RANK", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(env, raising=False)
    config = rloo_config(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.early_device(config) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert distributed.early_device(config) == torch.device("cuda")  # one process: the current GPU
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.early_device(config) == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "3")  # as accelerate: the local rank modulo the visible GPUs
    assert distributed.early_device(config) == torch.device("cuda", 1)
    assert distributed.early_device(config, accelerator=object()) is None
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert distributed.early_device(config) is None
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    for field, value in (("use_cpu", True), ("fsdp", "full_shard"), ("deepspeed", {"zero_optimization": {"stage": 2}})):
        changed = rloo_config(tmp_path)
        setattr(changed, field, value)
        assert distributed.early_device(changed) is None, field


def test_reference_copy_is_made_on_the_early_device(tmp_path, tiny_tokenizer, monkeypatch):
    """The reference copy is made where the policy will run, not in host memory first (on a GPU a
    0.5B float32 copy held 2 GB of extra RAM). The meta device stands in for the GPU here."""
    from helpers import build_tiny_causal_lm, rloo_config
    from posttrain.trainers import online

    monkeypatch.setattr(distributed, "early_device", lambda config, accelerator=None: torch.device("meta"))
    policy, reference = online.prepare_policy(
        build_tiny_causal_lm(tiny_tokenizer), None, rloo_config(tmp_path), peft_config=None, needs_reference=True
    )
    assert reference is not policy
    assert {p.device.type for p in reference.parameters()} == {"meta"}
    assert {p.device.type for p in policy.parameters()} == {"meta"}
    assert not any(p.requires_grad for p in reference.parameters())
    assert all(p.requires_grad for p in policy.parameters())
