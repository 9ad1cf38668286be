"""PPO with LoRA: actor, critic and reference on ONE frozen base.

The policy is adapter "default", the critic adapter "critic" plus a value head, the reference the base
with adapters off; only the reward model is a second copy. Tiny Llama (hidden 32, 2 layers).
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from torch import nn

from helpers import online_trainer

peft = pytest.importorskip("peft")

from posttrain.cli import main  # noqa: E402
from posttrain.critic import CRITIC_ADAPTER, LoraCritic  # noqa: E402
from posttrain.scoring import completion_logprobs  # noqa: E402
from posttrain.testing import build_tiny_causal_lm, build_tiny_reward_model  # noqa: E402
from posttrain.trainers import online  # noqa: E402
from posttrain.trainers.ppo import PPOTrainer  # noqa: E402
from posttrain.trainers.ppo_config import PPOConfig  # noqa: E402


def lora_trainer(tmp_path, tokenizer, **overrides):
    values = dict(
        output_dir=str(tmp_path / "ppo"),
        per_device_train_batch_size=4,
        total_episodes=8,
        response_length=4,
        learning_rate=1e-2,
        report_to="none",
        num_sample_generations=0,
        save_steps=0,
        seed=0,
    )
    values.update(overrides)
    dataset = Dataset.from_dict({"prompt": ["Hello world", "The quick brown fox", "Once upon a time", "Thank you"]})
    return PPOTrainer(
        args=PPOConfig(**values),
        processing_class=tokenizer,
        model=build_tiny_causal_lm(tokenizer),
        reward_model=build_tiny_reward_model(tokenizer, seed=1),
        train_dataset=dataset,
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )


def adapter_params(model, name):
    return {n: p for n, p in model.named_parameters() if f".{name}." in n and "lora_" in n}


def storage_bytes(params) -> int:
    seen = {}
    for p in params:
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def rollout_of(trainer):
    batch = trainer.run.next_batch()
    return online.sample(trainer.run, trainer.generation_model, batch["input_ids"], batch["attention_mask"])


def randomize_lora_b(model) -> None:
    """LoRA B starts at zero (adapter = identity); give both adapters weight so they change the forward."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def test_one_base_holds_policy_critic_and_reference(tmp_path, tiny_tokenizer):
    trainer = lora_trainer(tmp_path, tiny_tokenizer)
    policy, critic = trainer.policy_model, trainer.value_model
    assert isinstance(critic, LoraCritic) and trainer.ref_model is None
    assert set(policy.peft_config) == {"default", CRITIC_ADAPTER}
    # The memory: one base + both adapters + the head + the reward model, every base weight held once.
    reward = trainer.reward.models[0]
    base = build_tiny_causal_lm(tiny_tokenizer)
    base_bytes = storage_bytes(base.parameters())  # tied embeddings counted once
    # Each adapter: r × (in + out) fp32 weights per adapted Linear (q_proj, v_proj of every layer).
    adapted = [m for n, m in base.named_modules() if n.endswith(("q_proj", "v_proj"))]
    lora_bytes = sum(4 * (m.in_features + m.out_features) * 4 for m in adapted)
    head_bytes = 32 * 4  # the reward model's score: Linear(32, 1, bias=False)
    everything = [*trainer.wrapped.parameters(), *critic.parameters(), *reward.parameters()]
    assert storage_bytes(everything) == base_bytes + 2 * lora_bytes + head_bytes + storage_bytes(reward.parameters())
    # The critic owns no base weight: its parameters are its adapter and its head.
    own = {id(p) for p in adapter_params(policy, CRITIC_ADAPTER).values()} | {id(critic.score.weight)}
    assert {id(p) for p in critic.parameters()} == own
    # Only the adapters and the head train; the head starts as the reward model's score head.
    trained = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    expected = {id(p) for p in adapter_params(policy, "default").values()}
    expected |= {id(p) for p in adapter_params(policy, CRITIC_ADAPTER).values()}
    expected |= {id(critic.score.weight)}
    assert trained == expected and len(adapter_params(policy, CRITIC_ADAPTER)) == 8
    assert torch.equal(critic.score.weight, reward.score.weight)
    assert critic.state_dict().keys() == {"score.weight"} | {
        f"adapter.{k.rsplit('.lora_', 1)[0].replace('.', '-')}.lora_{k.rsplit('.lora_', 1)[1].split('.')[0]}.weight"
        for k in adapter_params(policy, CRITIC_ADAPTER)
    }


def test_each_loss_moves_only_its_own_adapter_and_checkpointing_recomputes_under_it(tmp_path, tiny_tokenizer):
    trainer = lora_trainer(tmp_path, tiny_tokenizer, gradient_checkpointing=True)
    policy, critic, wrapper = trainer.policy_model, trainer.value_model, trainer.wrapped
    randomize_lora_b(policy)
    rollout = rollout_of(trainer)
    wrapper.train()  # checkpointing runs in training mode only
    assert policy.get_base_model().is_gradient_checkpointing
    mine, theirs = adapter_params(policy, "default"), adapter_params(policy, CRITIC_ADAPTER)

    def grads(loss_of) -> dict:
        trainer.optimizer.zero_grad(set_to_none=True)
        loss_of(wrapper(rollout, 1.0)).backward()
        named = {**{f"p.{n}": p for n, p in mine.items()}, **{f"c.{n}": p for n, p in theirs.items()}}
        named["head"] = critic.score.weight
        return {n: None if p.grad is None else p.grad.clone() for n, p in named.items()}

    value_grads = grads(lambda out: out[2].sum())
    assert all(g is None for n, g in value_grads.items() if n.startswith("p."))
    assert all(g is not None and g.abs().sum() > 0 for n, g in value_grads.items() if not n.startswith("p."))
    policy_grads = grads(lambda out: out[0].sum())
    assert all(g is None for n, g in policy_grads.items() if not n.startswith("p."))
    assert all(g is not None and g.abs().sum() > 0 for n, g in policy_grads.items() if n.startswith("p."))

    # A value-only optimizer step leaves the policy adapter bitwise unchanged, and the reverse.
    before = {n: p.detach().clone() for n, p in {**mine, **theirs}.items()}
    trainer.optimizer.zero_grad(set_to_none=True)
    wrapper(rollout, 1.0)[2].sum().backward()
    trainer.optimizer.step()
    assert all(torch.equal(mine[n], before[n]) for n in mine)
    assert all(not torch.equal(theirs[n], before[n]) for n in theirs if "lora_B" in n)
    before = {n: p.detach().clone() for n, p in theirs.items()}
    trainer.optimizer.zero_grad(set_to_none=True)
    wrapper(rollout, 1.0)[0].sum().backward()
    trainer.optimizer.step()
    assert all(torch.equal(theirs[n], before[n]) for n in theirs)

    # Gradient checkpointing re-runs each block under the adapter its forward used: the gradients of
    # the joint loss equal those without checkpointing; plain checkpointing (no recompute context)
    # would recompute the critic's blocks under the adapter active at backward time and differ.
    joint = lambda out: out[0].sum() + out[2].sum()  # noqa: E731
    checkpointed = grads(joint)
    lm = policy.get_base_model()
    lm.gradient_checkpointing_disable()
    plain = grads(joint)
    for n in plain:
        torch.testing.assert_close(checkpointed[n], plain[n], rtol=1e-5, atol=1e-6)
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    naive = grads(joint)  # the critic's blocks are recomputed under the policy adapter
    assert any(not torch.allclose(naive[n], plain[n], rtol=1e-3) for n in plain if n.startswith("c."))


def test_reference_is_the_base_with_adapters_off(tmp_path, tiny_tokenizer):
    trainer = lora_trainer(tmp_path, tiny_tokenizer)
    policy = trainer.policy_model
    randomize_lora_b(policy)
    rollout = rollout_of(trainer)
    ref = online.reference_logprobs(trainer.run, trainer.generation_model, trainer.ref_model, rollout, 1.0)
    base = build_tiny_causal_lm(tiny_tokenizer).eval()
    with torch.no_grad():
        expected, _ = completion_logprobs(base, rollout, temperature=1.0)
        actor, _ = completion_logprobs(policy, rollout, temperature=1.0)
    torch.testing.assert_close(ref, expected, rtol=0, atol=1e-5)
    assert not torch.allclose(actor, expected, atol=1e-3)  # the adapter does change the policy
    # peft's disable_adapter() re-enables only the active adapter; the critic's must still train.
    assert all(p.requires_grad for p in adapter_params(policy, CRITIC_ADAPTER).values())
    assert all(p.requires_grad for p in adapter_params(policy, "default").values())


@pytest.mark.parametrize("algo", ["rloo", "grpo", "online_dpo", "xpo"])
def test_the_other_online_trainers_hold_one_copy_with_lora(algo, tmp_path, tiny_tokenizer, monkeypatch):
    """RLOO, GRPO (beta > 0), Online DPO and XPO with LoRA: no model is copied, the reference is the
    base with the adapter off, and the policy's parameters are one base plus one adapter."""
    copied, deepcopy = [], copy.deepcopy

    def recording_deepcopy(x, *args, **kwargs):
        if isinstance(x, nn.Module):
            copied.append(type(x).__name__)
        return deepcopy(x, *args, **kwargs)

    monkeypatch.setattr(copy, "deepcopy", recording_deepcopy)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = online_trainer(algo, tmp_path / algo, tiny_tokenizer, peft_config=lora)
    assert copied == [] and trainer.ref_model is None
    base = build_tiny_causal_lm(tiny_tokenizer)
    adapted = [m for n, m in base.named_modules() if n.endswith(("q_proj", "v_proj"))]
    lora_bytes = sum(4 * (m.in_features + m.out_features) * 4 for m in adapted)
    assert storage_bytes(trainer.policy_model.parameters()) == storage_bytes(base.parameters()) + lora_bytes


def test_use_reentrant_checkpointing_is_refused_before_loading(tmp_path, tiny_tokenizer):
    from posttrain.configs import ConfigError

    with pytest.raises(ConfigError, match="use_reentrant=True.*non-reentrant"):
        PPOTrainer(
            args=PPOConfig(
                output_dir=str(tmp_path / "x"),
                gradient_checkpointing=True,
                gradient_checkpointing_kwargs={"use_reentrant": True},
                use_peft=True,
                report_to="none",
            ),
            processing_class=tiny_tokenizer,
            model="/nonexistent/never-loaded",
        )


def test_cli_saves_resumes_and_the_adapter_loads(tmp_path, tiny_policy_dir, tiny_reward_model_dir):
    from transformers import AutoModelForCausalLM

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Write about the {w}."}) + "\n" for w in ["sea", "sky", "fox"]))

    def run(out, *extra):
        argv = ["ppo", "--model_name_or_path", str(tiny_policy_dir), "--reward_model_path", str(tiny_reward_model_dir)]
        argv += ["--dataset_name", str(prompts), "--output_dir", str(out), "--per_device_train_batch_size", "2"]
        argv += ["--total_episodes", "4", "--response_length", "4", "--num_sample_generations", "0"]
        argv += ["--report_to", "none", "--learning_rate", "1e-2", "--save_steps", "1", "--gradient_checkpointing"]
        argv += ["--use_peft", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj", *extra]
        assert main(argv) == 0

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run(full)
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-1", resumed / "checkpoint-1")
    # The checkpoint holds the critic's adapter and head, apart from the policy's adapter.
    critic_state = load_file(str(full / "checkpoint-1" / "value_model" / "model.safetensors"))
    assert "score.weight" in critic_state and sum("lora_B" in k for k in critic_state) == 4
    run(resumed, "--resume_from_checkpoint", "latest")
    for name in ("adapter_model.safetensors", "value_model/model.safetensors"):
        a, b = load_file(str(full / name)), load_file(str(resumed / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    # The final policy is a plain PEFT adapter folder: base + adapter loads with peft alone.
    base = AutoModelForCausalLM.from_pretrained(tiny_policy_dir)
    loaded = peft.PeftModel.from_pretrained(base, full)
    saved = load_file(str(full / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in saved.items())
    state = peft.get_peft_model_state_dict(loaded)
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    assert json.loads((full / "adapter_config.json").read_text())["r"] == 4
