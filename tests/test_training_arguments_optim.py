"""transformers.TrainingArguments fields of optimisation and the run's environment, through the
trainers: optim / optim_args, lr_scheduler_kwargs, gradient_checkpointing_kwargs, torch_compile,
dataloader_*, data_seed, full_determinism, disable_tqdm, log_level*, model_init_kwargs (online)."""

from __future__ import annotations

import copy
import importlib.util
import logging
import math
import sys
import types

import pytest
import torch
import transformers
from datasets import Dataset

import helpers
import posttrain.trainers.online as online
from helpers import SENTENCES, letter_fraction, prompt_dataset, reference_loss_sum, sft_config
from posttrain import runtime
from posttrain.configs import ConfigError, TrainingConfig
from posttrain.models import is_compiled, load_policy
from posttrain.optim import build_optimizer, build_scheduler
from posttrain.testing import build_tiny_causal_lm
from posttrain.trainers.rloo import RLOOTrainer
from posttrain.trainers.rloo_config import RLOOConfig
from posttrain.trainers.sft import SFTTrainer

pytestmark = pytest.mark.usefixtures("one_thread")


def sft_trainer(tmp_path, tokenizer, n=4, name="run", **fields) -> SFTTrainer:
    """SFT on the first n SENTENCES, into tmp_path / name."""
    return helpers.sft_trainer(tmp_path, tokenizer, [{"text": s} for s in SENTENCES[:n]], name=name, **fields)


def rloo_config(tmp_path, **overrides) -> RLOOConfig:
    return helpers.rloo_config(tmp_path, "rloo", **{"response_length": 4, **overrides})


def rloo_trainer(tmp_path, tokenizer, **overrides) -> RLOOTrainer:
    return RLOOTrainer(
        config=rloo_config(tmp_path, **overrides),
        processing_class=copy.deepcopy(tokenizer),
        policy=build_tiny_causal_lm(tokenizer, seed=0),
        reward_model=letter_fraction,
        train_dataset=prompt_dataset(16),
    )


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


# -- optim / optim_args ------------------------------------------------------------------------------------


def test_each_optimizer_gets_the_config_hyperparameters():
    layer = torch.nn.Linear(3, 2)
    common = dict(learning_rate=0.02, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6)

    def group(optim, optim_args=None):
        opt = build_optimizer(layer.parameters(), TrainingConfig(optim=optim, optim_args=optim_args, **common))
        return opt, opt.param_groups[0]

    for name in ("adamw_torch", "adamw_torch_fused"):
        opt, g = group(name)
        assert type(opt) is torch.optim.AdamW
        assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (0.02, (0.8, 0.95), 1e-6, 0.1)
        assert bool(g["fused"]) is (name == "adamw_torch_fused")
    opt, g = group("adafactor")
    assert type(opt) is transformers.optimization.Adafactor
    # transformers.Trainer's Adafactor: an external lr, no parameter scaling, no relative step.
    assert (g["lr"], g["scale_parameter"], g["relative_step"], g["weight_decay"]) == (0.02, False, False, 0.1)
    opt, g = group("sgd", "momentum=0.9, nesterov=true")
    assert type(opt) is torch.optim.SGD
    assert (g["lr"], g["momentum"], g["nesterov"], g["weight_decay"]) == (0.02, 0.9, True, 0.1)
    opt, g = group("adagrad", "lr_decay=0.5")
    assert type(opt) is torch.optim.Adagrad
    assert (g["lr"], g["lr_decay"], g["weight_decay"]) == (0.02, 0.5, 0.1)
    opt, g = group("rmsprop", "alpha=0.95,centered=True")
    assert type(opt) is torch.optim.RMSprop
    assert (g["lr"], g["alpha"], g["centered"], g["weight_decay"]) == (0.02, 0.95, True, 0.1)
    # optim_args override the config's values (here AdamW's betas come from the config, eps from optim_args).
    _, g = group("adamw_torch", "eps=1e-3,amsgrad=true")
    assert (g["eps"], g["amsgrad"], g["betas"]) == (1e-3, True, (0.8, 0.95))
    # Frozen parameters are not handed to the optimizer.
    frozen = torch.nn.Linear(2, 2)
    frozen.bias.requires_grad_(False)
    (only,) = build_optimizer(frozen.parameters(), TrainingConfig(optim="sgd")).param_groups[0]["params"]
    assert only is frozen.weight


def test_bad_optim_values_are_refused_at_config_time():
    with pytest.raises(ConfigError, match=r"optim='adamw_foo' is not a known optimizer; choose one of .*'sgd'"):
        TrainingConfig(optim="adamw_foo")
    with pytest.raises(ConfigError, match="optim_args='momentum': 'momentum' is not key=value"):
        TrainingConfig(optim="sgd", optim_args="momentum")
    with pytest.raises(ConfigError, match=r"optim_args='betas2=0.5': SGD \(optim='sgd'\) takes no \['betas2'\]"):
        build_optimizer(torch.nn.Linear(2, 2).parameters(), TrainingConfig(optim="sgd", optim_args="betas2=0.5"))
    assert TrainingConfig(adafactor=True).optim == "adafactor"


def test_bitsandbytes_optimizers_need_bitsandbytes(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name))
    with pytest.raises(ConfigError, match=r"optim='paged_adamw_8bit' needs bitsandbytes: pip install bitsandbytes"):
        TrainingConfig(optim="paged_adamw_8bit")


def test_bitsandbytes_optimizers_get_bits_paging_and_betas(monkeypatch):
    """With bitsandbytes installed, each name maps to its class, optim_bits and is_paged as transformers maps it
    (checked against a stand-in bitsandbytes.optim that records its arguments)."""

    def recorder(name):
        class Optimizer(torch.optim.Optimizer):
            def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **kw):
                self.kwargs = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kw)
                super().__init__(params, dict(lr=lr))

        Optimizer.__name__ = name
        return Optimizer

    bnb = types.ModuleType("bitsandbytes")
    bnb.optim = types.ModuleType("bitsandbytes.optim")
    for name in ("AdamW", "Lion", "RMSprop"):
        setattr(bnb.optim, name, recorder(name))
    monkeypatch.setitem(sys.modules, "bitsandbytes", bnb)
    monkeypatch.setitem(sys.modules, "bitsandbytes.optim", bnb.optim)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "bitsandbytes" else real(name)
    )
    layer = torch.nn.Linear(2, 2)
    common = dict(learning_rate=0.01, adam_beta1=0.8, adam_beta2=0.9, adam_epsilon=1e-7, weight_decay=0.05)
    cases = {
        "adamw_bnb_8bit": ("AdamW", dict(optim_bits=8, is_paged=False, eps=1e-7)),
        "paged_adamw_8bit": ("AdamW", dict(optim_bits=8, is_paged=True, eps=1e-7)),
        "paged_adamw_32bit": ("AdamW", dict(optim_bits=32, is_paged=True, eps=1e-7)),
        "lion_8bit": ("Lion", dict(optim_bits=8, is_paged=False)),
        "paged_lion_32bit": ("Lion", dict(optim_bits=32, is_paged=True)),
        "rmsprop_bnb_8bit": ("RMSprop", dict(optim_bits=8)),
    }
    for optim, (cls, expected) in cases.items():
        opt = build_optimizer(layer.parameters(), TrainingConfig(optim=optim, **common))
        assert type(opt).__name__ == cls, optim
        for key, value in {"lr": 0.01, "weight_decay": 0.05, **expected}.items():
            assert opt.kwargs[key] == value, (optim, key)
        if cls != "RMSprop":
            assert opt.kwargs["betas"] == (0.8, 0.9)
        else:
            assert "is_paged" not in opt.kwargs


def test_sgd_takes_exactly_one_plain_gradient_step(tmp_path, tiny_tokenizer):
    """optim=sgd through SFTTrainer: after one step every weight moved by -lr × the gradient of the
    mean token loss over the whole batch (no momentum, no clipping)."""
    trainer = sft_trainer(
        tmp_path, tiny_tokenizer, n=4, optim="sgd", learning_rate=0.5, max_steps=1, per_device_train_batch_size=4,
        max_grad_norm=None,
    )  # fmt: skip
    optimizer = trainer.run.optimizer
    assert type(getattr(optimizer, "optimizer", optimizer)) is torch.optim.SGD  # inside accelerate's wrapper
    model = trainer.model
    reference = copy.deepcopy(model)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    loss = reference_loss_sum(reference, batch) / (batch["labels"][:, 1:] != -100).sum()
    loss.backward()
    before = params(model)
    trainer.train()
    for name, p in model.named_parameters():
        grad = dict(reference.named_parameters())[name].grad
        torch.testing.assert_close(p.detach(), before[name] - 0.5 * grad, atol=2e-6, rtol=1e-4)


# -- lr_scheduler_kwargs ---------------------------------------------------------------------------------


def logged_lrs(trainer) -> list[float]:
    return [e["lr"] for e in trainer.state.log_history if "lr" in e]


def test_cosine_with_restarts_num_cycles_through_sft(tmp_path, tiny_tokenizer):
    """4 steps, 2 cycles: lr_t = lr0 · ½(1 + cos(π · ((2 · t / 4) mod 1))) = lr0 × [1, ½, 1, ½] before steps 1..4."""
    trainer = sft_trainer(
        tmp_path, tiny_tokenizer, max_steps=4, lr_scheduler_type="cosine_with_restarts",
        lr_scheduler_kwargs='{"num_cycles": 2}',
    )  # fmt: skip
    trainer.train()
    assert logged_lrs(trainer) == pytest.approx([1e-3, 5e-4, 1e-3, 5e-4], rel=1e-6)


def test_cosine_with_min_lr_schedule():
    """cosine_with_min_lr: lr_t = min_lr + (lr0 − min_lr) · ½(1 + cos(π t / T)); T = 4, lr0 = 1e-3, min_lr = 1e-4."""
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    config = TrainingConfig(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": 1e-4})
    scheduler = build_scheduler(opt, config, num_training_steps=4)
    lrs = []
    for _ in range(4):
        opt.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    expected = [1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * t / 4)) for t in (1, 2, 3, 4)]
    assert lrs == pytest.approx(expected, rel=1e-9)
    assert lrs[1] == pytest.approx(5.5e-4) and lrs[3] == pytest.approx(1e-4)


def test_lr_scheduler_kwargs_that_do_not_fit_are_refused():
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    with pytest.raises(ConfigError, match="lr_scheduler_type='constant' takes no arguments"):
        build_scheduler(opt, TrainingConfig(lr_scheduler_type="constant", lr_scheduler_kwargs={"x": 1}), 4)
    with pytest.raises(ConfigError, match=r"lr_scheduler_kwargs=\{'num_cycle': 2\} does not fit"):
        build_scheduler(opt, TrainingConfig(lr_scheduler_type="cosine", lr_scheduler_kwargs={"num_cycle": 2}), 4)


# -- gradient_checkpointing_kwargs --------------------------------------------------------------------------


def checkpoint_settings(model: torch.nn.Module) -> list[dict]:
    return [
        dict(m._gradient_checkpointing_func.keywords)
        for m in model.modules()
        if getattr(m, "_gradient_checkpointing_func", None) is not None
    ]


def test_gradient_checkpointing_kwargs_reach_every_trainer_path(tmp_path, tiny_tokenizer, tiny_policy_dir):
    # SFT: posttrain's default is non-reentrant; the config's kwargs replace it.
    trainer = sft_trainer(tmp_path, tiny_tokenizer, name="default", gradient_checkpointing=True)
    settings = checkpoint_settings(trainer.model)
    assert settings and all(s == {"use_reentrant": False} for s in settings)
    trainer = sft_trainer(
        tmp_path, tiny_tokenizer, name="reentrant", gradient_checkpointing=True,
        gradient_checkpointing_kwargs='{"use_reentrant": true}', max_steps=1,
    )  # fmt: skip
    assert all(s == {"use_reentrant": True} for s in checkpoint_settings(trainer.model))
    trainer.train()  # reentrant checkpointing still trains (inputs made to require grad)
    assert math.isfinite(trainer.state.log_history[0]["loss"])
    # Online trainers: loaded from a path, and given a model object.
    gc = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}
    config = rloo_config(tmp_path, **gc)
    policy = load_policy(tiny_policy_dir, **gc)
    assert all(s == {"use_reentrant": True} for s in checkpoint_settings(policy))
    policy, _ = online.prepare_policy(
        build_tiny_causal_lm(tiny_tokenizer), None, config, peft_config=None, needs_reference=False
    )
    assert all(s == {"use_reentrant": True} for s in checkpoint_settings(policy))


# -- torch_compile ----------------------------------------------------------------------------------------


def test_torch_compile_sft_trains_compiled_and_saves_plain_weights(tmp_path, tiny_tokenizer):
    trainer = sft_trainer(tmp_path, tiny_tokenizer, torch_compile=True, torch_compile_backend="eager")
    assert is_compiled(trainer.run.unwrapped())
    trainer.train()
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    trained = trainer.run.unwrapped().state_dict()
    assert set(saved.state_dict()) == set(trained)  # no torch.compile prefixes (_orig_mod.)
    for name, value in saved.state_dict().items():
        torch.testing.assert_close(value, trained[name])


def test_torch_compile_config_follows_transformers():
    assert not TrainingConfig().torch_compile
    config = TrainingConfig(torch_compile=True)
    assert config.torch_compile_backend == "inductor"
    assert TrainingConfig(torch_compile_mode="reduce-overhead").torch_compile  # a mode turns compiling on
    with pytest.warns(FutureWarning, match="torchdynamo is deprecated"):
        config = TrainingConfig(torchdynamo="eager")
    assert (config.torch_compile, config.torch_compile_backend) == (True, "eager")
    with pytest.raises(ConfigError, match="torch_compile_mode='fast' must be one of"):
        TrainingConfig(torch_compile_mode="fast")


def record_generate_compiled(monkeypatch) -> list[bool]:
    """Spy on the online skeleton's `generate`: the list gets, per call, whether the sampling model is compiled."""
    generated_with: list[bool] = []
    real_generate = online.generate

    def spy(model, *args, **kwargs):
        generated_with.append(is_compiled(model))
        return real_generate(model, *args, **kwargs)

    monkeypatch.setattr(online, "generate", spy)
    return generated_with


def test_torch_compile_online_trains_compiled_and_generates_uncompiled(tmp_path, tiny_tokenizer, monkeypatch):
    """RLOO with torch_compile: the training forwards run the compiled policy; sampling runs it
    uncompiled (decoding changes shapes every token); the saved policy holds plain weights."""
    generated_with = record_generate_compiled(monkeypatch)
    trainer = rloo_trainer(tmp_path, tiny_tokenizer, torch_compile=True, torch_compile_backend="eager")
    assert is_compiled(trainer.model)
    trainer.train()
    assert generated_with and not any(generated_with)
    assert is_compiled(trainer.model)  # restored after sampling
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "rloo")
    assert set(saved.state_dict()) == set(trainer.model.state_dict())


# -- data loading ------------------------------------------------------------------------------------------


def test_dataloader_workers_give_the_same_losses(tmp_path, tiny_tokenizer):
    losses = {}
    for workers in (0, 1):
        extra = {"dataloader_prefetch_factor": 2, "dataloader_persistent_workers": True} if workers else {}
        trainer = sft_trainer(
            tmp_path, tiny_tokenizer, n=6, name=f"w{workers}", dataloader_num_workers=workers, max_steps=-1,
            num_train_epochs=2, **extra,
        )  # fmt: skip
        trainer.train()
        losses[workers] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses[0]) == 6  # 6 examples / batch 2 = 3 steps per epoch, 2 epochs
    assert losses[1] == losses[0]


def test_dataloader_drop_last_changes_the_steps_per_epoch(tmp_path, tiny_tokenizer):
    """7 examples, batches of 2: 4 steps per epoch (the last batch holds 1 example), 3 with drop_last."""
    for drop_last, steps in ((False, 4), (True, 3)):
        trainer = sft_trainer(
            tmp_path, tiny_tokenizer, n=7, name=f"drop{drop_last}", dataloader_drop_last=drop_last, max_steps=-1,
            num_train_epochs=1,
        )  # fmt: skip
        assert trainer.run.plan.steps_per_epoch == steps
        trainer.train()
        assert trainer.state.global_step == steps
        assert trainer.run.samples_seen == (2 * steps if drop_last else 7)
    with pytest.raises(ConfigError, match="dataloader_drop_last=True drops every batch"):
        sft_trainer(
            tmp_path, tiny_tokenizer, n=3, name="tiny", per_device_train_batch_size=4, dataloader_drop_last=True
        )


def test_dataloader_fields_are_checked():
    with pytest.raises(ConfigError, match="dataloader_prefetch_factor needs worker processes"):
        TrainingConfig(dataloader_prefetch_factor=2)
    with pytest.raises(ConfigError, match="dataloader_persistent_workers needs worker processes"):
        TrainingConfig(dataloader_persistent_workers=True)
    # TRL configs that ask for data-loader workers run: the online trainers have no DataLoader, so the
    # settings are ignored with one warning naming them (training is the same as without them).
    with pytest.warns(UserWarning, match=r"dataloader_num_workers=2, dataloader_persistent_workers=True: ignored"):
        config = RLOOConfig(dataloader_num_workers=2, dataloader_persistent_workers=True)
    assert config.dataloader_num_workers == 2
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RLOOConfig()  # nothing set: no warning
    # Every rollout batch is full (the prompt stream drops an epoch's incomplete batch), so drop_last holds.
    assert RLOOConfig(dataloader_drop_last=True).dataloader_drop_last


# -- seeds and determinism ---------------------------------------------------------------------------------


def test_data_seed_changes_the_data_order_only(tmp_path, tiny_tokenizer):
    runs = {}
    for data_seed in (None, 0, 1):
        trainer = sft_trainer(tmp_path, tiny_tokenizer, n=8, name=f"ds{data_seed}", seed=0, data_seed=data_seed)
        runs[data_seed] = (trainer.run.plan.order(0), torch.get_rng_state())
    assert runs[None][0] == runs[0][0]  # data_seed defaults to seed
    assert runs[1][0] != runs[0][0] and sorted(runs[1][0]) == list(range(8))
    # The global random state (dropout, new heads) is the seed's whatever data_seed says.
    assert torch.equal(runs[1][1], runs[0][1])
    orders = {}
    for data_seed in (None, 5):
        trainer = rloo_trainer(tmp_path, tiny_tokenizer, seed=0, data_seed=data_seed, output_dir=str(tmp_path / "o"))
        orders[data_seed] = (list(trainer.run.prompts._order), trainer.run.generator.get_state())
    assert orders[5][0] != orders[None][0]
    assert torch.equal(orders[5][1], orders[None][1])  # the sampling stream follows seed
    from posttrain.trainers.grpo import GRPOTrainer
    from posttrain.trainers.grpo_config import GRPOConfig

    grpo_orders = []
    for data_seed in (None, 5):
        args = GRPOConfig(
            output_dir=str(tmp_path / "g"), per_device_train_batch_size=4, num_generations=2, total_episodes=8,
            report_to=["none"], num_sample_generations=0, save_steps=0, seed=0, data_seed=data_seed,
        )  # fmt: skip
        trainer = GRPOTrainer(
            build_tiny_causal_lm(tiny_tokenizer),
            letter_fraction,
            args,
            prompt_dataset(16),
            processing_class=tiny_tokenizer,
        )
        grpo_orders.append(list(trainer.run.prompts._order))
    assert grpo_orders[1] != grpo_orders[0] and sorted(grpo_orders[1]) == list(range(16))
    # SFT's shuffle_dataset (one shuffle before preparation) follows data_seed too.
    firsts = []
    for data_seed in (0, 1):
        trainer = sft_trainer(
            tmp_path, tiny_tokenizer, n=8, name=f"shuffle{data_seed}", seed=0, data_seed=data_seed,
            shuffle_dataset=True,
        )  # fmt: skip
        firsts.append([trainer.train_dataset[i]["input_ids"] for i in range(8)])
    assert firsts[0] != firsts[1]


def test_full_determinism(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        trainer = sft_trainer(tmp_path, tiny_tokenizer, full_determinism=True, seed=3)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.initial_seed() == 3
        trainer.train()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False


# -- progress bars and log levels --------------------------------------------------------------------------


def test_disable_tqdm_hides_the_progress_bar(tmp_path, tiny_tokenizer, capsys):
    for disable, shown in ((None, True), (True, False)):
        sft_trainer(tmp_path, tiny_tokenizer, name=f"tqdm{disable}", disable_tqdm=disable, max_steps=1).train()
        assert ("steps:" in capsys.readouterr().err) is shown
    for disable, shown in ((None, True), (True, False)):
        trainer = rloo_trainer(tmp_path, tiny_tokenizer, disable_tqdm=disable, output_dir=str(tmp_path / f"r{disable}"))
        trainer.train()
        assert ("episodes:" in capsys.readouterr().err) is shown


def test_process_log_level_as_transformers():
    def level(is_main, is_local_main, **fields):
        config = TrainingConfig(**fields)
        return runtime.process_log_level(config, is_main=is_main, is_local_main=is_local_main)

    assert level(True, True) is None  # passive: left as it is
    assert level(False, False) == logging.WARNING  # replicas: log_level_replica (default warning)
    assert level(True, True, log_level="info") == logging.INFO
    assert level(True, True, log_level="detail") == logging.DEBUG
    # The main process of a second node: main with log_on_each_node (default), a replica otherwise.
    assert level(False, True, log_level="error") == logging.ERROR
    assert level(False, True, log_level="error", log_on_each_node=False, log_level_replica="critical") == (
        logging.CRITICAL
    )
    with pytest.raises(ConfigError, match="log_level='loud' must be one of"):
        TrainingConfig(log_level="loud")
    with pytest.raises(ConfigError, match="log_level_replica='x' must be one of"):
        TrainingConfig(log_level_replica="x")


def test_log_level_sets_transformers_and_posttrain_verbosity(tmp_path, tiny_tokenizer):
    before = transformers.logging.get_verbosity(), logging.getLogger("posttrain").level
    try:
        sft_trainer(tmp_path, tiny_tokenizer, log_level="error")
        assert transformers.logging.get_verbosity() == logging.ERROR
        assert logging.getLogger("posttrain").level == logging.ERROR
        rloo_trainer(tmp_path, tiny_tokenizer, log_level="info")
        assert transformers.logging.get_verbosity() == logging.INFO
        assert logging.getLogger("posttrain").level == logging.INFO
    finally:
        transformers.logging.set_verbosity(before[0])
        logging.getLogger("posttrain").setLevel(before[1])


# -- model_init_kwargs (online) ----------------------------------------------------------------------------


def test_online_model_init_kwargs_reach_every_loaded_model(tmp_path, tiny_policy_dir, tiny_reward_model_dir):
    from posttrain.critic import attach_critic
    from posttrain.models import load_tokenizer

    config = rloo_config(
        tmp_path,
        model_name_or_path=str(tiny_policy_dir),
        reward_model_path=str(tiny_reward_model_dir),
        model_init_kwargs='{"attn_implementation": "eager", "torch_dtype": "bfloat16"}',
    )
    assert config.model_init_kwargs == {"attn_implementation": "eager", "torch_dtype": "bfloat16"}
    parts = online.load_parts(
        config, ref_model=str(tiny_policy_dir), train_dataset=prompt_dataset(16), needs_reference=True
    )
    for model in (parts.policy, parts.reference, parts.rewards[0]):
        assert model.config._attn_implementation == "eager"
        assert next(model.parameters()).dtype == torch.bfloat16
    # PPO's critic loaded from value_model_path.
    config.value_model_path, config.value_model_init = str(tiny_reward_model_dir), None
    tokenizer = load_tokenizer(tiny_policy_dir)
    _, critic = attach_critic(parts.policy, None, config, [], tokenizer, tokenizer)
    assert critic.config._attn_implementation == "eager" and next(critic.parameters()).dtype == torch.bfloat16


ONLINE = ["ppo", "grpo", "online_dpo", "xpo"]


def online_trainer(kind, tmp_path, tokenizer, **fields):
    """A tiny trainer of each other online algorithm (RLOO: rloo_trainer) with `fields` in its config."""
    from posttrain.judges import CallableJudge
    from posttrain.testing import build_tiny_reward_model

    common = dict(output_dir=str(tmp_path / kind), report_to="none", num_sample_generations=0, save_steps=0)
    common.update(learning_rate=1e-3, per_device_train_batch_size=4, total_episodes=8, **fields)
    policy = build_tiny_causal_lm(tokenizer, seed=0)
    tok = copy.deepcopy(tokenizer)
    if kind == "ppo":
        from posttrain.trainers.ppo import PPOTrainer
        from posttrain.trainers.ppo_config import PPOConfig

        args = PPOConfig(response_length=4, temperature=1.0, **common)
        return PPOTrainer(
            args=args, processing_class=tok, model=policy, ref_model=None,
            reward_model=build_tiny_reward_model(tokenizer, seed=1), train_dataset=prompt_dataset(16),
        )  # fmt: skip
    if kind == "grpo":
        from posttrain.trainers.grpo import GRPOTrainer
        from posttrain.trainers.grpo_config import GRPOConfig

        args = GRPOConfig(num_generations=2, response_length=4, **common)
        return GRPOTrainer(policy, letter_fraction, args, prompt_dataset(16), processing_class=tok)
    if kind == "online_dpo":
        from posttrain.trainers.online_dpo import OnlineDPOTrainer
        from posttrain.trainers.online_dpo_config import OnlineDPOConfig

        args = OnlineDPOConfig(max_new_tokens=4, **common)
        judge = CallableJudge(lambda prompt, completion: -float(len(completion)))
        return OnlineDPOTrainer(policy, judge=judge, args=args, processing_class=tok, train_dataset=prompt_dataset(16))
    from posttrain.trainers.xpo import XPOTrainer
    from posttrain.trainers.xpo_config import XPOConfig

    args = XPOConfig(max_new_tokens=4, **common)
    return XPOTrainer(
        model=policy, reward_model=build_tiny_reward_model(tokenizer, seed=1), args=args, processing_class=tok,
        train_dataset=prompt_dataset(16),
    )  # fmt: skip


@pytest.mark.parametrize("kind", ONLINE)
def test_online_trainers_honour_optim_schedule_and_compile(kind, tmp_path, tiny_tokenizer, monkeypatch):
    """Every online trainer builds the optimizer optim names (with optim_args), the schedule with
    lr_scheduler_kwargs, trains the compiled module and samples with the uncompiled forward."""
    generated_with = record_generate_compiled(monkeypatch)
    trainer = online_trainer(
        kind, tmp_path, tiny_tokenizer, optim="sgd", optim_args="momentum=0.5", torch_compile_backend="eager",
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": 2e-4},
    )  # fmt: skip
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert type(optimizer) is torch.optim.SGD and optimizer.param_groups[0]["momentum"] == 0.5
    trained = online.dist.unwrap(trainer.wrapped, trainer.accelerator)
    assert is_compiled(trained)
    trainer.train()
    assert generated_with and not any(generated_with)
    # At the end of the schedule the cosine has reached min_lr.
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(2e-4)


def test_sft_model_init_kwargs_from_a_path(tmp_path, tiny_tokenizer, tiny_policy_dir):
    """SFT loads its model from a path with model_init_kwargs (a trust_remote_code key there wins over the flag)."""
    args = sft_config(tmp_path, model_init_kwargs={"attn_implementation": "eager", "trust_remote_code": False})
    trainer = SFTTrainer(
        str(tiny_policy_dir),
        args=args,
        train_dataset=Dataset.from_list([{"text": s} for s in SENTENCES[:4]]),
        processing_class=copy.deepcopy(tiny_tokenizer),
    )
    assert trainer.model.config._attn_implementation == "eager"


def test_default_optim_is_the_installed_transformers_default():
    """TrainingArguments defaults `optim` to adamw_torch_fused from transformers 4.54 with torch >= 2.8
    (huggingface/transformers#37358); a TRL user on the same install gets the same optimizer here, and
    `adafactor=True` still replaces that default."""
    from transformers import TrainingArguments

    assert TrainingConfig().optim == TrainingArguments(output_dir="unused").optim
    layer = torch.nn.Linear(2, 2)
    opt = build_optimizer(layer.parameters(), TrainingConfig())
    assert type(opt) is torch.optim.AdamW
    assert bool(opt.defaults["fused"]) == (TrainingConfig().optim == "adamw_torch_fused")
    assert TrainingConfig(adafactor=True).optim == "adafactor"
