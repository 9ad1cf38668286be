"""GRPO trainer: command line with reward functions by import path, learning, group layout, beta = 0,
global token-mean loss (micro-batching invariance), truncated-completion masking, config checks,
2 processes == 1 process. The rollout / update machinery it shares with RLOO is tested in test_rloo.py."""

from __future__ import annotations

import contextlib
import json
import math
import textwrap

import pytest
import torch
from datasets import DatasetDict

import posttrain.trainers.grpo as grpo
from helpers import flat, grpo_config, letter_fraction, prompt_dataset, train_and_last_log
from posttrain import cli
from posttrain.testing import build_tiny_causal_lm
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.grpo_config import GRPOConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def config(tmp_path, **overrides) -> GRPOConfig:
    """2 groups of 4 per rollout batch, 16 episodes."""
    return grpo_config(tmp_path, **{"per_device_train_batch_size": 8, "total_episodes": 16, **overrides})


def letter_trainer(cfg: GRPOConfig, tokenizer, prompts: int = 32, policy=None, **kwargs) -> GRPOTrainer:
    """GRPO on `prompts` numbered prompts rewarded by letter_fraction; a fresh tiny policy unless given."""
    if policy is None:
        policy = build_tiny_causal_lm(tokenizer)
    return GRPOTrainer(
        policy, letter_fraction, cfg, prompt_dataset(prompts, numbered=True), processing_class=tokenizer, **kwargs
    )


def test_command_line_with_reward_functions_and_a_reward_model(
    tmp_path, monkeypatch, tiny_policy_dir, tiny_reward_model_dir
):
    module = tmp_path / "my_rewards.py"
    module.write_text(
        textwrap.dedent("""
        def letter_fraction(prompts, completions, number, **columns):
            assert len(number) == len(completions)  # dataset columns arrive repeated per completion
            return [c.count("e") / len(c) if c else 0.0 for c in completions]
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "prompts"
    DatasetDict({"train": prompt_dataset(32, numbered=True), "test": prompt_dataset(4, numbered=True)}).save_to_disk(
        data
    )
    out = tmp_path / "run"
    argv = [
        "grpo",
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--model_name_or_path",
        str(tiny_policy_dir),
        "--reward_model_path",
        str(tiny_reward_model_dir),
        "--reward_funcs",
        "my_rewards:letter_fraction",
        "--reward_weights",
        "0.5",
        "2.0",
        "--num_generations",
        "4",
        "--per_device_train_batch_size",
        "8",
        "--max_completion_length",
        "8",
        "--total_episodes",
        "16",
        "--learning_rate",
        "1e-3",
        "--report_to",
        "none",
        "--num_sample_generations",
        "1",
        "--beta",  # TRL 1.16's default is 0.0 (no KL term); the KL metrics below need one
        "0.05",
    ]
    assert cli.main(argv) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        for name in (
            "objective/scores",
            "objective/kl",
            "objective/entropy",
            "loss/policy_avg",
            "loss/kl_avg",
            "policy/entropy_avg",
            "val/ratio",
            "val/num_eos_tokens",
            "frac_reward_zero_std",
            "lr",
            "episode",
            "eps",
        ):
            assert name in record and math.isfinite(record[name]), name
        assert record["objective/entropy"] >= 0 and record["loss/kl_avg"] >= 0
    assert (out / "samples.jsonl").is_file() and (out / "model.safetensors").is_file()


def test_learnable_reward_raises_scores(tmp_path, tiny_tokenizer):
    cfg = config(
        tmp_path,
        per_device_train_batch_size=16,
        total_episodes=16 * 30,
        response_length=8,
        learning_rate=1e-2,
        beta=0.0,
        lr_scheduler_type="constant",
    )
    trainer = letter_trainer(cfg, tiny_tokenizer, prompts=64)
    assert trainer.ref_model is None  # beta = 0: no reference model
    trainer.train()
    scores = [h["objective/scores"] for h in trainer.state.log_history[:-1]]
    assert len(scores) == 30 and "loss/kl_avg" not in trainer.state.log_history[-2]
    assert sum(scores[-5:]) / 5 > sum(scores[:5]) / 5 + 0.08, scores


def test_groups_are_the_completions_of_one_prompt(tmp_path, tiny_tokenizer):
    """A reward that depends only on the prompt gives every group zero spread: the (P, G) grid built
    from the k-block rollout layout really groups completions by prompt, and nothing is learned."""

    def prompt_number(prompts, completions, number, **columns):
        return [float(n) for n in number]

    policy = build_tiny_causal_lm(tiny_tokenizer)
    before = flat(policy).clone()
    trainer = GRPOTrainer(
        policy,
        prompt_number,
        config(tmp_path, beta=0.0),
        prompt_dataset(32, numbered=True),
        processing_class=tiny_tokenizer,
    )
    last = train_and_last_log(trainer)
    assert last["frac_reward_zero_std"] == 1.0
    assert torch.equal(before, flat(trainer.model))


def test_loss_is_a_global_token_mean(tmp_path, tiny_tokenizer):
    """Micro-batch 8 × accumulation 1 and micro-batch 2 × accumulation 4 give the same update."""
    params = []
    for micro, accumulation in ((8, 1), (2, 4)):
        policy = build_tiny_causal_lm(tiny_tokenizer)
        cfg = config(
            tmp_path / str(micro),
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accumulation,
            total_episodes=8,
            num_iterations=2,
            response_length=8,
        )
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
        trainer = letter_trainer(
            cfg,
            tiny_tokenizer,
            policy=policy,
            ref_model=build_tiny_causal_lm(tiny_tokenizer, seed=3),
            optimizers=(optimizer, None),
        )
        trainer.train()
        params.append(flat(trainer.model))
    assert not torch.equal(params[0], flat(build_tiny_causal_lm(tiny_tokenizer)))
    torch.testing.assert_close(params[1], params[0], rtol=0, atol=1e-6)


def test_single_pass_reuses_the_update_forward_as_the_old_policy(tmp_path, tiny_tokenizer, monkeypatch):
    """num_iterations = 1 and one minibatch: no separate old-logprob pass runs, and the update forward's
    detached log-probs it uses as log π_old are bitwise what that pass would have computed (the same
    rows, before any optimizer step), so loss, gradient and metrics are those of the two-pass update."""
    import posttrain.trainers.online as online

    old_pass = online.old_policy_logprobs

    def fail(*args, **kwargs):
        raise AssertionError("num_iterations = 1 with one minibatch must reuse the update forward")

    monkeypatch.setattr(online, "old_policy_logprobs", fail)
    holder, compared = [], []
    original = grpo.completion_forward

    def spy(policy, mb, **kwargs):
        forward = original(policy, mb, **kwargs)
        trainer = holder[0]
        temperature = trainer.run.sampling.logprob_temperature
        logprobs, _ = grpo.forward_logprobs(forward, temperature=temperature, with_entropy=True)  # the update's
        rows = torch.arange(len(mb))  # one micro-batch of the same rows, as the removed pass ran it
        expected = old_pass(trainer.run, trainer.model, mb, rows, temperature)
        compared.append(torch.equal(logprobs.detach(), expected))
        return forward

    monkeypatch.setattr(grpo, "completion_forward", spy)
    # 2 rollout batches of 8 completions, each one minibatch of 2 micro-batches of 4 rows.
    cfg = config(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, response_length=6)
    policy = build_tiny_causal_lm(tiny_tokenizer)
    before = flat(policy).clone()
    trainer = GRPOTrainer(
        policy, letter_fraction, cfg, prompt_dataset(32, numbered=True), processing_class=tiny_tokenizer
    )
    holder.append(trainer)
    last = train_and_last_log(trainer)
    assert compared == [True] * 4
    assert last["val/ratio"] == 1.0 and last["policy/approxkl_avg"] == 0.0 and last["clip_ratio/region_mean"] == 0.0
    assert not torch.equal(before, flat(trainer.model))


def test_mask_truncated_completions(tmp_path, tiny_tokenizer, monkeypatch):
    masks = []
    original = grpo.grpo_policy_loss

    def spy(logprobs, old_logprobs, advantages, mask, *args, **kwargs):
        masks.append(mask.clone())
        return original(logprobs, old_logprobs, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(grpo, "grpo_policy_loss", spy)
    seen = []
    original_group = grpo.grpo_advantages
    monkeypatch.setattr(grpo, "grpo_advantages", lambda r, **kw: seen.append(r) or original_group(r, **kw))
    cfg = config(tmp_path, mask_truncated_completions=True, response_length=3, total_episodes=8)
    trainer = letter_trainer(cfg, tiny_tokenizer)
    last = train_and_last_log(trainer)
    (mask,) = masks
    # Random weights rarely emit EOS within 3 tokens: every completion is truncated, so no token is
    # in the loss; the number of unmasked rows equals the number of completions that ended.
    assert int(mask.any(-1).sum()) == int(last["val/num_eos_tokens"])
    assert len(seen) == 1 and seen[0].shape == (2, 4, 1)  # (prompts, generations, reward functions)


def test_static_cache_implementation_selects_the_compiled_static_engine(tmp_path, tiny_tokenizer, monkeypatch):
    """TRL's cache_implementation="static" reaches the decode loop as the static cache with a compiled
    decode step (torch.compile's default mode on CPU), and training runs on static-cache rollouts."""
    import posttrain.trainers.online as online

    options = []
    original = online.generate

    def spy(*args, **kwargs):
        options.append(dict(kwargs))
        # The compiled step itself is checked against the eager engine in test_rollout.py; here the
        # rollout runs eager on the static cache, sparing the suite a ~10 s compile.
        return original(*args, **{**kwargs, "compile_mode": None})

    monkeypatch.setattr(online, "generate", spy)
    cfg = config(tmp_path, cache_implementation="static", total_episodes=8, response_length=4)
    trainer = letter_trainer(cfg, tiny_tokenizer)
    last = train_and_last_log(trainer)
    assert options and all(o["cache_implementation"] == "static" for o in options)
    assert all(o["compile_mode"] == "default" for o in options)
    assert math.isfinite(last["objective/scores"]) and 0 < last["completions/mean_length"] <= 4
    assert abs(last["val/ratio"] - 1.0) < 1e-4  # static-cache rollout logprobs = the update's recomputation
    with pytest.raises(ValueError, match="cache_implementation='hybrid' is not supported"):
        GRPOConfig(cache_implementation="hybrid")


def test_bf16_on_cpu_decodes_traced_on_packed_bf16_weights_and_trains(tmp_path, tiny_tokenizer, monkeypatch):
    """bf16=True on CPU: rollouts run under bf16 autocast with the policy's linear layers on bf16 weights
    packed for each rollout (cpu_linear.autocast_packed_weights) and the decode step traced (decode_trace,
    where the model qualifies); the update recomputes the rollout's log-probabilities under the same
    autocast (ratio 1 within bf16 rounding) and the weights, float32 masters, move."""
    from accelerate.state import AcceleratorState, GradientState

    from posttrain import compat, cpu_linear, decode_trace

    def fresh_accelerate_state() -> None:  # a process-wide singleton: other tests' runs built it in float32
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    fresh_accelerate_state()
    monkeypatch.setattr(cpu_linear, "bf16_pack_calls", lambda *shape: 0.0)  # pack on any CPU
    switched = []
    original = cpu_linear.autocast_packed_weights

    def spy(model, calls):
        with original(model, calls) as layers:
            switched.append(len(layers))
            yield layers

    monkeypatch.setattr(cpu_linear, "autocast_packed_weights", contextlib.contextmanager(spy))
    cfg = config(tmp_path, bf16=True, total_episodes=16, response_length=8)
    try:
        trainer = letter_trainer(cfg, tiny_tokenizer)
        before = flat(trainer.model).clone()
        last = train_and_last_log(trainer)
    finally:
        fresh_accelerate_state()
    linears = sum(isinstance(m, torch.nn.Linear) for m in trainer.model.modules())
    steps = decode_trace._TRACES.get(trainer.model, (None, {}))[1]
    traced = {autocast for (*_, autocast, _), step in steps.items() if step is not None}
    if cpu_linear.can_pack_bf16():
        assert switched == [linears, linears]  # both rollout batches, every linear layer
        # transformers 4.x builds the mask-free step's causal mask from the cache length in Python: its trace
        # is refused by the check there, in float32 as in bf16 (tests/test_decode_trace.py)
        assert traced == ({True} if compat.transformers_version() >= (5,) else set())
    else:
        # an AVX2-only CPU: oneDNN cannot pack bf16, autocast casts the weights, and a step that casts
        # weights is never traced (tests/test_decode_trace.py)
        assert switched == [0, 0] and traced == set()
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert not torch.equal(before, flat(trainer.model))
    assert math.isfinite(last["loss"]) and abs(last["val/ratio"] - 1.0) < 2e-2


def test_config_checks():
    assert GRPOConfig(max_completion_length=17).response_length == 17
    assert GRPOConfig(response_length=9).max_completion_length == 9
    with pytest.raises(ValueError, match="max_completion_length"):
        GRPOConfig(response_length=9, max_completion_length=17)
    with pytest.raises(ValueError, match="num_generations"):
        GRPOConfig(num_generations=1)
    with pytest.raises(ValueError, match="reward_weights has 1 entries for 2 rewards"):
        GRPOConfig(reward_model_path="rm", reward_funcs=["m:f"], reward_weights=[1.0])
    with pytest.raises(ValueError, match="epsilon_high"):
        GRPOConfig(epsilon=0.2, epsilon_high=0.1)
    cfg = GRPOConfig()
    assert (cfg.num_generations, cfg.beta, cfg.epsilon, cfg.num_iterations, cfg.temperature, cfg.scale_rewards) == (
        8,
        0.0,
        0.2,
        1,
        1.0,
        "group",
    )
    with pytest.raises(ValueError, match="divisible"):
        GRPOConfig(per_device_train_batch_size=6, num_generations=4).derive_sizes(1, 10)


@pytest.mark.multiproc
def test_two_processes_equal_one_process(tmp_path):
    from test_rloo import run_dp_equivalence

    run_dp_equivalence(tmp_path, "grpo")
