"""XPO's policy and reference rollouts side by side on two threads (runtime.side_by_side,
trainers.online.sample_with_reference): the thread split, errors, when it is used, and the same
tokens as one after the other."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from helpers import pair_config, word_prompts
from posttrain import decode_trace, runtime
from posttrain.configs import ConfigError
from posttrain.testing import build_tiny_causal_lm, build_tiny_reward_model
from posttrain.trainers import online
from posttrain.trainers.xpo import XPOTrainer
from posttrain.trainers.xpo_config import XPOConfig


@pytest.fixture(autouse=True)
def keep_thread_count():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("threads", "main_threads", "side_threads"), [(2, 1, 1), (3, 2, 1), (4, 2, 2), (1, 1, 1)])
def test_the_threads_are_split_and_restored(threads, main_threads, side_threads):
    torch.set_num_threads(threads)
    seen = {}

    def job(name, value):
        def run():
            seen[name] = (torch.get_num_threads(), threading.get_ident())
            return value

        return run

    assert runtime.side_by_side(job("main", "a"), job("side", "b")) == ("a", "b")
    assert seen["main"][0] == main_threads and seen["side"][0] == side_threads
    assert seen["main"][1] == threading.get_ident() != seen["side"][1]  # main on this thread, side on another
    assert torch.get_num_threads() == threads


def test_an_error_in_either_job_is_raised_once_both_have_finished():
    finished = []

    def slow(name):
        def run():
            time.sleep(0.2)
            finished.append(name)

        return run

    def fails(error):
        def run():
            raise error

        return run

    with pytest.raises(ValueError, match="side failed"):
        runtime.side_by_side(slow("main"), fails(ValueError("side failed")))
    assert finished == ["main"]
    with pytest.raises(RuntimeError, match="main failed"):
        runtime.side_by_side(fails(RuntimeError("main failed")), slow("side"))
    assert finished == ["main", "side"]  # the worker had finished before the error reached the caller
    assert runtime.side_by_side(lambda: 1, lambda: 2) == (1, 2)  # the worker thread still serves


@pytest.fixture
def xpo(tmp_path, tiny_tokenizer):
    cfg = pair_config(
        XPOConfig, tmp_path, total_episodes=8, gradient_accumulation_steps=1, per_device_train_batch_size=4
    )
    trainer = XPOTrainer(
        model=build_tiny_causal_lm(tiny_tokenizer),
        ref_model=build_tiny_causal_lm(tiny_tokenizer, seed=5),  # not the policy's weights: the two rollouts differ
        reward_model=build_tiny_reward_model(tiny_tokenizer, seed=1),
        args=cfg,
        processing_class=tiny_tokenizer,
        train_dataset=word_prompts(8),
    )
    run = trainer.run
    batch = run.collate([run.train_dataset[i] for i in range(4)])
    return trainer, batch["input_ids"].to(run.device), batch["attention_mask"].to(run.device)


def test_side_by_side_rollouts_are_the_sequential_ones(xpo, monkeypatch):
    trainer, ids, mask = xpo
    run = trainer.run
    calls = []
    real = runtime.side_by_side
    monkeypatch.setattr(runtime, "side_by_side", lambda *jobs: calls.append(1) or real(*jobs))
    start = run.generator.get_state()

    torch.set_num_threads(2)  # one thread for each rollout
    together = online.sample_with_reference(run, trainer.wrapped, trainer.ref_model, ids, mask)
    assert calls == [1]
    for model in (trainer.model, trainer.ref_model):  # each traced its decode step on its own thread
        assert any(step is not None for step in decode_trace._TRACES[model][1].values())
    after = run.generator.get_state()

    run.generator.set_state(start)
    torch.set_num_threads(1)  # one after the other, on the same one thread each
    apart = online.sample_with_reference(run, trainer.wrapped, trainer.ref_model, ids, mask)
    assert calls == [1]
    assert torch.equal(run.generator.get_state(), after)  # the run's stream advanced the same way
    for a, b in zip(together, apart):
        assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
    policy, reference = together
    assert not torch.equal(policy.completion_ids, reference.completion_ids)

    # The reference draws from one fork of the run's stream, whichever rollout runs first.
    run.generator.set_state(start)
    fork = online.forked_generator(run.generator)
    alone = online.sample(run, trainer.ref_model, ids, mask, generator=fork)
    assert torch.equal(alone.completion_ids, reference.completion_ids)


def test_rollouts_run_side_by_side_only_where_it_is_safe(xpo, monkeypatch, tiny_tokenizer):
    trainer, _, _ = xpo
    run, policy, ref = trainer.run, trainer.wrapped, trainer.ref_model
    torch.set_num_threads(2)
    assert online.decodes_side_by_side(run, policy, ref)
    assert not online.decodes_side_by_side(run, policy, None)  # the adapter-disabled policy is the reference
    assert not online.decodes_side_by_side(run, policy, trainer.model)  # the policy itself
    shares = build_tiny_causal_lm(tiny_tokenizer)
    shares.lm_head.weight = trainer.model.lm_head.weight
    assert not online.decodes_side_by_side(run, policy, shares)  # a parameter in common
    torch.set_num_threads(1)
    assert not online.decodes_side_by_side(run, policy, ref)
    torch.set_num_threads(2)
    monkeypatch.setattr(run.config, "bf16", True)
    assert run.config.mixed_precision == "bf16" and not online.decodes_side_by_side(run, policy, ref)
    monkeypatch.setattr(run.config, "bf16", False)
    size = sum(p.numel() for p in ref.parameters())
    monkeypatch.setattr(online, "SIDE_BY_SIDE_MAX_PARAMETERS", size)
    assert online.decodes_side_by_side(run, policy, ref)
    monkeypatch.setattr(online, "SIDE_BY_SIDE_MAX_PARAMETERS", size - 1)  # larger models decode one after the other
    assert not online.decodes_side_by_side(run, policy, ref)
    monkeypatch.setattr(online, "SIDE_BY_SIDE_MAX_PARAMETERS", size)
    monkeypatch.setenv("POSTTRAIN_CONCURRENT_DECODE", "off")
    assert not online.decodes_side_by_side(run, policy, ref)


def test_a_bad_mode_stops_the_run_when_its_config_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CONCURRENT_DECODE", "always")
    with pytest.raises(ConfigError, match="POSTTRAIN_CONCURRENT_DECODE='always': expected one of auto, off"):
        pair_config(XPOConfig, tmp_path)
