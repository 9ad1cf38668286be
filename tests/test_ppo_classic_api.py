"""The classic PPO API as TRL 0.7's documentation and gpt2-sentiment notebook use it, with `trl`
renamed to `posttrain`: the notebook loop, the constructor's argument orders, the classic defaults,
every classic PPOConfig field, and the public building blocks with hand-derived numbers. Tiny
offline models, CPU."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch

from helpers import tensorboard_scalars
from posttrain.configs import ConfigError
from posttrain.testing import build_tiny_causal_lm

# TRL 0.7's PPOConfig signature: every field and its documented default ("exp_name" is the script's name).
SEED_DEFAULTS = {
    "seed": 0,
    "log_with": None,
    "task_name": None,
    "model_name": None,
    "query_dataset": None,
    "reward_model": None,
    "remove_unused_columns": True,
    "tracker_kwargs": {},
    "accelerator_kwargs": {},
    "project_kwargs": {},
    "tracker_project_name": "trl",
    "push_to_hub_if_best_kwargs": {},
    "steps": 20000,
    "learning_rate": 1e-05,
    "adap_kl_ctrl": True,
    "init_kl_coef": 0.2,
    "kl_penalty": "kl",
    "target": 6,
    "horizon": 10000,
    "gamma": 1,
    "lam": 0.95,
    "cliprange": 0.2,
    "cliprange_value": 0.2,
    "vf_coef": 0.1,
    "batch_size": 256,
    "forward_batch_size": None,
    "mini_batch_size": 1,
    "gradient_accumulation_steps": 1,
    "world_size": None,
    "ppo_epochs": 4,
    "max_grad_norm": None,
    "optimize_cuda_cache": False,
    "early_stopping": False,
    "target_kl": 1,
    "compare_steps": 1,
    "ratio_threshold": 10.0,
    "use_score_scaling": False,
    "use_score_norm": False,
    "score_clip": None,
    "is_encoder_decoder": None,
    "is_peft_model": None,
    "backward_batch_size": None,
    "global_backward_batch_size": None,
    "global_batch_size": None,
}
RUNTIME = {
    "world_size",
    "is_encoder_decoder",
    "is_peft_model",
    "backward_batch_size",
    "global_backward_batch_size",
    "global_batch_size",
}

REVIEWS = [
    f"Review {i}: this film was {word}, and the acting, the music and the long final scene left me thinking "
    "about it for days afterwards; the story is simple, the camera work careful, the dialogue sharp enough. "
    "I would watch it again with friends on a quiet evening."
    for i, word in enumerate(["good", "bad", "great", "dull", "fine", "odd"] * 4)
] + ["too short to keep"]


def test_the_gpt2_sentiment_notebook_loop_runs_as_written(tmp_path):
    """The notebook's cells with `trl` renamed, a local tiny model / tokenizer / dataset and a Python
    reward instead of the sentiment pipeline: three batches through the dataloader, generate, step,
    log_stats; the KL coefficient adapts from 0.2 by Ziegler et al.'s formula after every step."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from posttrain import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
    from posttrain.core import LengthSampler
    from posttrain.testing import build_tiny_tokenizer

    build_tiny_causal_lm(build_tiny_tokenizer(), save_dir=tmp_path / "gpt2-imdb")
    np.random.seed(0)

    config = PPOConfig(
        model_name=str(tmp_path / "gpt2-imdb"),
        learning_rate=1.41e-5,
        log_with="tensorboard",
        batch_size=8,  # the notebook keeps the default 256; 3 batches of 8 keep the test fast
        output_dir=str(tmp_path / "out"),
        project_kwargs={"logging_dir": str(tmp_path / "tb")},
    )

    def build_dataset(config, dataset_name="imdb", input_min_text_length=2, input_max_text_length=8):
        tokenizer = AutoTokenizer.from_pretrained(config.model_name)
        tokenizer.pad_token = tokenizer.eos_token
        ds = Dataset.from_dict({"text": REVIEWS, "label": [i % 2 for i in range(len(REVIEWS))]})
        ds = ds.rename_columns({"text": "review"})
        ds = ds.filter(lambda x: len(x["review"]) > 200, batched=False)
        input_size = LengthSampler(input_min_text_length, input_max_text_length)

        def tokenize(sample):
            sample["input_ids"] = tokenizer.encode(sample["review"])[: input_size()]
            sample["query"] = tokenizer.decode(sample["input_ids"])
            return sample

        ds = ds.map(tokenize, batched=False)
        ds.set_format(type="torch")
        return ds

    dataset = build_dataset(config)

    def collator(data):
        return dict((key, [d[key] for d in data]) for key in data[0])  # noqa: C402 (as written)

    model = AutoModelForCausalLMWithValueHead.from_pretrained(config.model_name)
    ref_model = AutoModelForCausalLMWithValueHead.from_pretrained(config.model_name)
    tokenizer = AutoTokenizer.from_pretrained(config.model_name)
    tokenizer.pad_token = tokenizer.eos_token

    ppo_trainer = PPOTrainer(config, model, ref_model, tokenizer, dataset=dataset, data_collator=collator)
    assert ppo_trainer.accelerator.num_processes == 1 and ppo_trainer.current_device == torch.device("cpu")
    before = [p.detach().clone() for p in model.parameters()]

    output_min_length = 4
    output_max_length = 16
    output_length_sampler = LengthSampler(output_min_length, output_max_length)
    generation_kwargs = {
        "min_length": -1,
        "top_k": 0.0,
        "top_p": 1.0,
        "do_sample": True,
        "pad_token_id": tokenizer.eos_token_id,
    }

    kl_coef, batches, logged_rewards = 0.2, 0, []
    for epoch, batch in enumerate(ppo_trainer.dataloader):  # noqa: B007 (as written)
        query_tensors = batch["input_ids"]

        #### Get response from gpt2
        response_tensors = []
        for query in query_tensors:
            gen_len = output_length_sampler()
            generation_kwargs["max_new_tokens"] = gen_len
            response = ppo_trainer.generate(query, **generation_kwargs)
            response_tensors.append(response.squeeze()[-gen_len:])
        batch["response"] = [tokenizer.decode(r.squeeze()) for r in response_tensors]

        #### Compute the reward (the notebook asks a sentiment pipeline)
        texts = [q + r for q, r in zip(batch["query"], batch["response"])]
        rewards = [torch.tensor(float(len(t) % 7) / 7) for t in texts]

        #### Run PPO step
        stats = ppo_trainer.step(query_tensors, response_tensors, rewards)
        ppo_trainer.log_stats(stats, batch, rewards)

        # The coefficient that shaped this step's rewards, then Ziegler et al.'s update with n = 8:
        # β ← β·(1 + clip(KL/6 − 1, −0.2, 0.2)·8/10000).
        assert stats["objective/kl_coef"] == pytest.approx(kl_coef, rel=1e-12)
        kl_coef *= 1 + min(max(stats["objective/kl"] / 6 - 1, -0.2), 0.2) * 8 / 10000
        assert ppo_trainer.kl_ctl.value == pytest.approx(kl_coef, rel=1e-12)
        assert set(batch) == {"input_ids", "query", "label", "response"}  # "review" removed, as TRL does
        logged_rewards.append([float(r) for r in rewards])
        batches += 1

    assert batches == 3  # 24 long reviews, batches of 8, the short one filtered out
    assert kl_coef < 0.2  # KL far below target 6: the penalty relaxes
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    for line, rewards in zip(lines, logged_rewards):
        assert line["env/reward_mean"] == pytest.approx(float(np.mean(rewards)))
        assert line["env/reward_std"] == pytest.approx(float(np.std(rewards, ddof=1)))
        assert line["env/reward_dist"] == pytest.approx(rewards)
        assert math.isfinite(line["ppo/loss/total"]) and math.isfinite(line["objective/kl"])
    assert list((tmp_path / "tb" / "trl").glob("events.out.tfevents.*"))  # log_with="tensorboard"


def tiny_parts(tiny_tokenizer, n: int = 8):
    from datasets import Dataset

    ids = [tiny_tokenizer(f"Query number {i} says hello")["input_ids"] for i in range(n)]
    dataset = Dataset.from_dict({"input_ids": ids, "query": [f"q{i}" for i in range(n)], "extra": list(range(n))})
    dataset.set_format(type="torch", columns=["input_ids"], output_all_columns=True)
    return build_tiny_causal_lm(tiny_tokenizer), build_tiny_causal_lm(tiny_tokenizer, seed=3), dataset


@pytest.mark.parametrize("form", ["positional", "documented", "keywords", "config_positional", "everything"])
def test_positional_and_keyword_arguments_in_the_documented_order(tiny_tokenizer, form):
    from posttrain import PPOConfig, PPOTrainer
    from posttrain.trainers.ppo_classic import ClassicPPOTrainer

    model, ref, dataset = tiny_parts(tiny_tokenizer)
    calls = []

    def collator(rows):
        calls.append(len(rows))
        return {key: [row[key] for row in rows] for key in rows[0]}

    cfg = PPOConfig(batch_size=4, report_to="none")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    trainer = {
        "positional": lambda: PPOTrainer(cfg, model, ref, tiny_tokenizer, dataset, None, collator),
        "documented": lambda: PPOTrainer(cfg, model, ref, tiny_tokenizer, dataset=dataset, data_collator=collator),
        "keywords": lambda: PPOTrainer(
            config=cfg, model=model, ref_model=ref, tokenizer=tiny_tokenizer, dataset=dataset, data_collator=collator
        ),
        "config_positional": lambda: PPOTrainer(
            cfg, model=model, ref_model=ref, tokenizer=tiny_tokenizer, dataset=dataset, data_collator=collator
        ),
        "everything": lambda: PPOTrainer(cfg, model, None, tiny_tokenizer, dataset, opt, collator, 1, sched),
    }[form]()
    assert isinstance(trainer, ClassicPPOTrainer) and trainer.config is cfg
    assert trainer.dataset is dataset and trainer.data_collator is collator
    batch = next(iter(trainer.dataloader))
    assert calls and set(calls) == {4} and len(batch["input_ids"]) == 4  # the loader may read ahead
    assert set(batch) == {"input_ids", "query"}  # "extra" is not a forward argument: removed
    assert trainer.accelerator.device == trainer.current_device
    if form == "everything":
        # TRL hands both to accelerate: its wrappers hold the user's objects
        assert trainer.optimizer.optimizer is opt and trainer.lr_scheduler.scheduler is sched
        # num_shared_layers=1: the reference holds the policy's very first block
        layer = trainer.model.pretrained_model.model.layers[0]
        assert trainer.ref_model.model.layers[0] is layer and trainer.ref_model.model.layers[1] is not layer
    else:
        assert trainer.ref_model is ref


def test_classic_defaults_apply_to_unset_fields_only(tmp_path, tiny_tokenizer):
    from posttrain import PPOConfig, PPOTrainer
    from posttrain.advantages import AdaptiveKLController
    from posttrain.trainers.ppo_config import script_name

    cfg = PPOConfig(report_to="none")
    assert (cfg.learning_rate, cfg.kl_coef, cfg.seed, cfg.adap_kl_ctrl, cfg.max_grad_norm) == (
        3e-6,
        0.05,
        42,
        False,
        1.0,
    )
    trainer = PPOTrainer(config=cfg, model=build_tiny_causal_lm(tiny_tokenizer), tokenizer=tiny_tokenizer)
    c = trainer.config
    assert (c.seed, c.learning_rate, c.adap_kl_ctrl, c.init_kl_coef, c.kl_coef) == (0, 1e-5, True, 0.2, 0.2)
    assert (c.batch_size, c.mini_batch_size, c.max_grad_norm, c.steps, c.exp_name) == (
        256,
        1,
        None,
        20000,
        script_name(),
    )
    assert (c.backward_batch_size, c.world_size, c.global_batch_size, c.global_backward_batch_size) == (1, 1, 256, 1)
    assert (c.is_encoder_decoder, c.is_peft_model, c.total_ppo_epochs) == (False, False, 79)  # ceil(20000 / 256)
    assert trainer.optimizer.param_groups[0]["lr"] == 1e-5
    assert isinstance(trainer.kl_ctl, AdaptiveKLController) and trainer.kl_ctl.value == 0.2
    # A field set explicitly keeps its value, even when it equals the on-policy default.
    mine = PPOConfig(report_to="none", learning_rate=3e-6, seed=42, kl_coef=0.05, adap_kl_ctrl=False, batch_size=8)
    trainer = PPOTrainer(mine, build_tiny_causal_lm(tiny_tokenizer), None, tiny_tokenizer)
    assert (mine.learning_rate, mine.seed, mine.kl_coef, mine.adap_kl_ctrl, mine.batch_size) == (
        3e-6,
        42,
        0.05,
        False,
        8,
    )
    assert (mine.mini_batch_size, mine.max_grad_norm) == (1, None)  # unset: classic
    # train() keeps the on-policy defaults.
    from datasets import Dataset

    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, total_episodes=4, report_to="none")
    on_policy = PPOTrainer(
        args=args,
        processing_class=tiny_tokenizer,
        model=build_tiny_causal_lm(tiny_tokenizer),
        reward_model=lambda prompts, completions: [1.0] * len(completions),
        train_dataset=Dataset.from_dict({"prompt": ["Hello", "World"]}),
    )
    a = on_policy.args
    assert (a.learning_rate, a.kl_coef, a.seed, a.adap_kl_ctrl, a.max_grad_norm) == (3e-6, 0.05, 42, False, 1.0)
    assert (a.batch_size, a.mini_batch_size) == (2, 2)  # derived


@pytest.mark.parametrize("name", sorted(SEED_DEFAULTS))
def test_every_classic_config_field_takes_its_documented_default(name, tiny_tokenizer):
    from posttrain import PPOConfig
    from posttrain.trainers.ppo_config import script_name

    value = SEED_DEFAULTS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warning for a default
        cfg = PPOConfig(**{name: value})
    assert name in cfg.explicit_fields
    unset = PPOConfig().apply_classic_defaults()
    if name not in RUNTIME:
        assert getattr(cfg.apply_classic_defaults(), name) == value == getattr(unset, name)
    assert PPOConfig().apply_classic_defaults().exp_name == script_name()


def test_all_classic_fields_at_once_build_a_trainer(tiny_tokenizer):
    from posttrain import PPOConfig, PPOTrainer

    cfg = PPOConfig(**{**SEED_DEFAULTS, "batch_size": 4}, report_to="none")
    trainer = PPOTrainer(cfg, build_tiny_causal_lm(tiny_tokenizer), None, tiny_tokenizer)
    assert (trainer.config.world_size, trainer.config.global_batch_size, trainer.config.backward_batch_size) == (
        1,
        4,
        1,
    )
    assert trainer.config.total_ppo_epochs == 5000


def test_fields_that_cannot_apply_are_refused_by_name(tmp_path, tiny_tokenizer):
    from posttrain import PPOConfig, PPOTrainer

    for kw, field in (
        ({"push_to_hub_if_best_kwargs": {"repo_id": "me/model"}}, "push_to_hub_if_best_kwargs"),
        ({"compare_steps": 2}, "compare_steps"),
        ({"tracker_kwargs": {"comet": {}}}, "tracker_kwargs"),
        ({"forward_batch_size": 2, "mini_batch_size": 4}, "mini_batch_size"),
        ({"backward_batch_size": 3, "mini_batch_size": 2}, "backward_batch_size"),
    ):
        with pytest.raises(ConfigError, match=field):
            PPOConfig(**kw)
    with pytest.warns(FutureWarning, match="forward_batch_size"):
        assert PPOConfig(forward_batch_size=2).mini_batch_size == 2
    model = build_tiny_causal_lm(tiny_tokenizer)
    for kw, field in (
        ({"world_size": 2}, "world_size"),
        ({"batch_size": 6, "mini_batch_size": 4}, "batch_size=6"),
        ({"is_peft_model": True}, "is_peft_model"),
        ({"accelerator_kwargs": {"mixed_precision": "no"}}, "accelerator_kwargs"),
        ({"project_kwargs": {"no_such_field": 1}}, "project_kwargs"),
        ({"tracker_kwargs": {"wandb": {}}}, "tracker_kwargs"),  # no W&B in log_with
    ):
        with pytest.raises(ConfigError, match=field):
            PPOTrainer(PPOConfig(report_to="none", **kw), model, None, tiny_tokenizer)
    # train() refuses the classic-only settings before any model loads.
    for kw in ({"accelerator_kwargs": {"cpu": True}}, {"tracker_project_name": "x"}, {"optimize_cuda_cache": True}):
        with pytest.raises(ConfigError, match=f"{next(iter(kw))}.*classic"):
            PPOConfig(per_device_train_batch_size=2, total_episodes=4, **kw).derive_sizes(1)


def test_accelerator_project_and_tracker_settings_are_honoured(tmp_path, tiny_tokenizer):
    from posttrain import PPOConfig, PPOTrainer

    cfg = PPOConfig(
        batch_size=2,
        mini_batch_size=2,
        output_dir=str(tmp_path / "out"),
        log_with="tensorboard",
        tracker_project_name="sentiment",
        tracker_kwargs={"tensorboard": {"flush_secs": 1}},
        accelerator_kwargs={"step_scheduler_with_optimizer": False},
        project_kwargs={"project_dir": str(tmp_path / "project"), "logging_dir": str(tmp_path / "tb")},
        optimize_cuda_cache=True,
    )
    trainer = PPOTrainer(cfg, build_tiny_causal_lm(tiny_tokenizer), None, tiny_tokenizer)
    assert trainer.accelerator.step_scheduler_with_optimizer is False
    assert trainer.accelerator.project_dir == str(tmp_path / "project")
    q = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    stats = trainer.step(q, [torch.tensor([10, 11]), torch.tensor([12])], [torch.tensor(1.0), torch.tensor(0.0)])
    trainer.log_stats(stats, {"query": ["a", "b"], "response": ["c", "d"]}, [1.0, 0.0])
    # TRL 0.7 logged through accelerate's trackers: TensorBoard tags as log_stats names them, unprefixed.
    tags = tensorboard_scalars(tmp_path / "tb" / "sentiment")
    assert {"env/reward_mean", "env/reward_std", "ppo/loss/total"} <= set(tags), sorted(tags)
    assert not any(tag.startswith("train/") for tag in tags)
    rows = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [(r["table"], r["query"], r["reward"]) for r in rows] == [("game_log", "a", 1.0), ("game_log", "b", 0.0)]
    with pytest.raises(ValueError, match="label"):
        trainer.log_stats(stats, {"query": ["a", "b"], "response": ["c", "d"]}, [1.0, 0.0], ["query", "label"])


# -- the building blocks, by hand ------------------------------------------------------------------
def classic_trainer(tiny_tokenizer, config=None, **kw):
    from posttrain import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

    cfg = config or PPOConfig(report_to="none", batch_size=2, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLMWithValueHead(build_tiny_causal_lm(tiny_tokenizer))
    return PPOTrainer(cfg, model, build_tiny_causal_lm(tiny_tokenizer, seed=4), tiny_tokenizer)


def test_compute_rewards_and_advantages_by_hand(tiny_tokenizer):
    trainer = classic_trainer(tiny_tokenizer)
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, -1.5, -1.0]])
    masks = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rewards, non_score, kl = trainer.compute_rewards(
        [torch.tensor(1.0), torch.tensor(-2.0)], logprobs, ref_logprobs, masks
    )
    # kl = lp − ref = [[0.5, −1, ·], [0, 1, 0.5]]; β = 0.2 (the classic init_kl_coef); the score on the last real token
    torch.testing.assert_close(non_score, torch.tensor([[-0.1, 0.2, 0.0], [0.0, -0.2, -0.1]]))
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 1.2, 0.0], [0.0, -0.2, -2.1]]))
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0, 0.0], [0.0, 1.0, 0.5]]))  # 0 off the mask

    trainer.config.whiten_advantages = False
    values, advantages, returns = trainer.compute_advantages(
        torch.tensor([[0.5, 0.25, 9.0]]), torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[1, 1, 0]])
    )
    # γ = 1, λ = 0.95: δ1 = 1 − 0.25 = 0.75, A1 = 0.75; δ0 = 0.25 − 0.5, A0 = −0.25 + 0.95·0.75 = 0.4625
    torch.testing.assert_close(values, torch.tensor([[0.5, 0.25, 0.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.4625, 0.75, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.9625, 1.0, 0.0]]))
    trainer.config.whiten_advantages = True
    _, whitened, _ = trainer.compute_advantages(values, torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[1, 1, 0]]))
    # mean 0.60625, unbiased std of (0.4625, 0.75) = 0.2875/√2
    torch.testing.assert_close(whitened, torch.tensor([[-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0]]), atol=1e-4, rtol=0)

    # loss at ratio 1 and V = V_old: policy loss = mean(−A), value loss = ½·mean((V − R)²)
    adv = torch.tensor([[0.4625, 0.75, 0.0]])
    lp = torch.tensor([[-1.0, -2.0, 0.0]])
    logits = torch.zeros(1, 3, 5)
    pg, vf, stats = trainer.loss(lp, values, logits, values, lp, torch.tensor([[1, 1, 0]]), adv, returns)
    assert float(pg) == pytest.approx(-(0.4625 + 0.75) / 2)
    assert float(vf) == pytest.approx(0.1 * 0.5 * (0.4625**2 + 0.75**2) / 2)  # vf_coef 0.1
    assert float(stats["policy/entropy"]) == pytest.approx(math.log(5))  # uniform logits
    assert float(stats["policy/clipfrac"]) == 0.0 and float(stats["policy/approxkl"]) == 0.0
    assert float(stats["loss/total"]) == pytest.approx(float(pg + vf))


def test_batched_forward_pass_matches_unpadded_forwards(tiny_tokenizer):
    trainer = classic_trainer(tiny_tokenizer)
    queries = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    responses = [torch.tensor([10, 11]), torch.tensor([12, 13, 14])]
    with torch.no_grad():
        lp, logits, values, masks = trainer.batched_forward_pass(
            trainer.model, queries, responses, trainer.prepare_model_inputs(queries, responses), return_logits=True
        )
        ref_lp, _, ref_values, _ = trainer.batched_forward_pass(trainer.ref_model, queries, responses, None)
    assert lp.shape == values.shape == (2, 3) and logits.shape[:2] == (2, 3)
    assert masks.tolist() == [[1, 1, 0], [1, 1, 1]] and not ref_values.any()
    lm, head = trainer.model.pretrained_model.eval(), trainer.model.score
    for i, (q, r) in enumerate(zip(queries, responses)):
        with torch.no_grad():
            out = lm(torch.cat([q, r])[None], output_hidden_states=True)
            ref_out = trainer.ref_model(torch.cat([q, r])[None])
        want = out.logits[0, len(q) - 1 : -1].log_softmax(-1).gather(-1, r[:, None])[:, 0]
        torch.testing.assert_close(lp[i, : len(r)], want, atol=1e-5, rtol=0)
        ref_want = ref_out.logits[0, len(q) - 1 : -1].log_softmax(-1).gather(-1, r[:, None])[:, 0]
        torch.testing.assert_close(ref_lp[i, : len(r)], ref_want, atol=1e-5, rtol=0)
        v = head(out.hidden_states[-1][0, len(q) - 1 : -1]).squeeze(-1)
        torch.testing.assert_close(values[i, : len(r)], v, atol=1e-5, rtol=0)
    # train_minibatch: one optimizer step on those tensors
    before = [p.detach().clone() for p in trainer.model.parameters()]
    lp2, logits2, vpreds, _ = trainer.batched_forward_pass(trainer.model, queries, responses, None, return_logits=True)
    rewards, _, _ = trainer.compute_rewards([torch.tensor(1.0), torch.tensor(-1.0)], lp, ref_lp, masks)
    old_values, advantages, returns = trainer.compute_advantages(values, rewards, masks)
    stats = trainer.train_minibatch(lp, old_values, lp2, logits2, vpreds, masks, advantages, returns)
    assert stats["policy/approxkl"] == 0.0 and "val/var" in stats
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    # record_step_stats / gather_stats: TRL's names, from the same tensors
    recorded = trainer.record_step_stats(
        kl_coef=0.2,
        scores=torch.tensor([1.0, -1.0]),
        logprobs=lp,
        ref_logprobs=ref_lp,
        non_score_reward=rewards,
        masks=masks,
        queries=queries,
        responses=responses,
        train_stats={k: v[None] for k, v in stats.items() if v.dim() == 0},
    )
    kl = ((lp - ref_lp) * masks).sum(-1)
    torch.testing.assert_close(recorded["objective/kl_dist"], kl)
    assert float(recorded["ppo/std_scores"]) == pytest.approx(math.sqrt(2))
    assert recorded["tokens/responses_len_mean"] == 2.5 and list(recorded["tokens/queries_dist"]) == [3.0, 2.0]
    assert float(recorded["ppo/val/var_explained"]) == pytest.approx(
        1 - float(stats["val/error"] / stats["returns/var"])
    )
    assert trainer.gather_stats({"a": torch.tensor(2.0), "b": "x"}) == {"a": torch.tensor(2.0), "b": "x"}


def test_step_returns_trl_statistics_and_saves_in_trl_layout(tmp_path, tiny_tokenizer):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from posttrain import AutoModelForCausalLMWithValueHead

    trainer = classic_trainer(tiny_tokenizer)
    q = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    stats = trainer.step(q, [torch.tensor([10, 11]), torch.tensor([12, 13, 14])], [1.0, -1.0])
    for name in (
        "objective/kl_dist",
        "objective/entropy",
        "ppo/mean_non_score_reward",
        "ppo/std_scores",
        "tokens/queries_len_std",
        "tokens/responses_dist",
        "ppo/policy/ratio",
        "ppo/policy/advantages",
        "ppo/val/var_explained",
        "ppo/learning_rate",
        "time/ppo/total",
    ):
        assert name in stats, name
    assert stats["ppo/std_scores"] == pytest.approx(math.sqrt(2)) and list(stats["tokens/responses_dist"]) == [2, 3]
    # 5 response tokens × 2 minibatches of 1 row × 4 epochs, each ratio of one trained token
    assert len(stats["ppo/policy/ratio"]) == 5 * 4
    trainer.save_pretrained(tmp_path / "saved")
    state = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert {"v_head.summary.weight", "v_head.summary.bias"} <= set(state)
    assert "TRL Model" in (tmp_path / "saved" / "README.md").read_text()
    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "saved"))
    assert torch.equal(loaded.v_head.summary.weight, trainer.model.score.summary.weight)
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))  # plain transformers reads the LM
    with pytest.raises(ValueError, match="push"):
        trainer.save_pretrained(tmp_path / "x", push_to_hub=True)


def test_a_trl_layout_checkpoint_is_the_classic_policy(tmp_path, tiny_tokenizer):
    """TRL 0.7 saves the LM's state dict plus `v_head.summary.weight` / `bias` in pytorch_model.bin;
    such a folder is the classic trainer's policy with that value head."""
    from posttrain import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

    lm = build_tiny_causal_lm(tiny_tokenizer)
    lm.config.save_pretrained(tmp_path)
    weight, bias = torch.linspace(-1, 1, lm.config.hidden_size)[None], torch.tensor([0.5])
    torch.save(
        {**lm.state_dict(), "v_head.summary.weight": weight, "v_head.summary.bias": bias},
        tmp_path / "pytorch_model.bin",
    )
    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path))
    trainer = PPOTrainer(PPOConfig(batch_size=2, report_to="none"), model, None, tiny_tokenizer)
    assert torch.equal(trainer.model.v_head.summary.weight, weight) and torch.equal(
        trainer.model.v_head.summary.bias, bias
    )
    _, _, values, masks = trainer.batched_forward_pass(
        trainer.model, [torch.tensor([5, 6])], [torch.tensor([7, 8])], None
    )
    with torch.no_grad():
        hidden = lm(torch.tensor([[5, 6, 7, 8]]), output_hidden_states=True).hidden_states[-1][0, 1:3]
    torch.testing.assert_close(values[0], hidden @ weight[0] + 0.5, atol=1e-5, rtol=0)


def test_the_readme_classic_loop_runs(tmp_path, monkeypatch):
    """README.md's "Classic PPO loop" snippet, with a local tiny model for the hub name, batches of 8
    instead of 256, a 16-row dataset and a length reward."""
    import re
    from pathlib import Path

    from datasets import Dataset

    from posttrain.testing import build_tiny_tokenizer

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("#### Classic PPO loop") :]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    tok = build_tiny_tokenizer()
    build_tiny_causal_lm(tok, save_dir=tmp_path / "gpt2")
    code = code.replace('"lvwerra/gpt2-imdb"', repr(str(tmp_path / "gpt2")))
    code = code.replace("learning_rate=1.41e-5,", "learning_rate=1.41e-5, batch_size=8,")
    queries = [f"Review {i}: the film was" for i in range(16)]
    dataset = Dataset.from_dict({"input_ids": [tok(q)["input_ids"] for q in queries], "query": queries})
    dataset.set_format(type="torch", columns=["input_ids"], output_all_columns=True)
    monkeypatch.chdir(tmp_path)
    namespace = {"dataset": dataset, "my_reward": lambda q, r: float(len(r)) / 10}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["ppo_trainer"].current_step == 2  # 16 rows, batches of 8
    assert (tmp_path / "gpt2-imdb-pos" / "README.md").is_file()
    assert list((tmp_path / "runs" / "trl").glob("events.out.tfevents.*"))


def test_wandb_gets_the_tracker_project_name_and_tracker_kwargs(tmp_path, monkeypatch, tiny_tokenizer):
    """log_with="wandb": wandb.init receives project=tracker_project_name and tracker_kwargs["wandb"]
    (a stand-in wandb module records the calls), and every step's statistics are logged to the run."""
    import importlib.machinery
    import sys
    import types

    import accelerate  # noqa: F401  (imported before the stand-in exists)

    from posttrain import PPOConfig, PPOTrainer

    calls = {"init": [], "log": []}
    run = types.SimpleNamespace(log=lambda values, step: calls["log"].append((values, step)), finish=lambda: None)
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls["init"].append(kw) or run
    fake.Table = lambda columns, data: ("table", columns, data)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = PPOConfig(
        batch_size=2,
        output_dir=str(tmp_path),
        log_with="wandb",
        tracker_project_name="sentiment",
        tracker_kwargs={"wandb": {"entity": "me", "tags": ["ppo"]}},
    )
    trainer = PPOTrainer(cfg, build_tiny_causal_lm(tiny_tokenizer), None, tiny_tokenizer)
    q = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    stats = trainer.step(q, [torch.tensor([10, 11]), torch.tensor([12])], [torch.tensor(1.0), torch.tensor(3.0)])
    trainer.log_stats(stats, {"query": ["a", "b"], "response": ["c", "d"]}, [torch.tensor(1.0), torch.tensor(3.0)])
    (init,) = calls["init"]
    assert (init["project"], init["entity"], init["tags"]) == ("sentiment", "me", ["ppo"])
    assert init["config"]["tracker_project_name"] == "sentiment" and init["config"]["learning_rate"] == 1e-5
    values, step = calls["log"][0]
    assert step == 1 and values["env/reward_mean"] == 2.0 and values["env/reward_dist"] == [1.0, 3.0]
    assert values["objective/kl_coef"] == 0.2 and "ppo/loss/total" in values
    table = calls["log"][1][0]["game_log"]
    assert table == ("table", ["query", "response", "reward"], [["a", "c", 1.0], ["b", "d", 3.0]])


def test_generate_batches_length_sampler_and_padding(tiny_tokenizer):
    trainer = classic_trainer(tiny_tokenizer)
    eos = tiny_tokenizer.eos_token_id
    queries = [torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([10]), torch.tensor([11, 12])]
    drawn = []

    def length_sampler():
        drawn.append(len(drawn) + 3)
        return drawn[-1]

    # batch_size 3: two generation calls, max_new_tokens 3 then 4 (one draw per call)
    out = trainer.generate(queries, length_sampler=length_sampler, batch_size=3, return_prompt=False)
    assert drawn == [3, 4] and len(out) == 4
    assert all(1 <= len(r) <= 3 for r in out[:3]) and 1 <= len(out[3]) <= 4
    assert all(eos not in r[:-1].tolist() for r in out)  # cut after the first stop token
    with_prompt = trainer.generate(queries, max_new_tokens=3, return_prompt=True)
    assert all(torch.equal(r[: len(q)], q) for r, q in zip(with_prompt, queries))
    # remove_padding=False: each row keeps its batch's full width, padded after its stop token
    padded = trainer.generate(
        queries, max_new_tokens=8, batch_size=4, return_prompt=False, remove_padding=False, temperature=5.0
    )
    assert len({len(r) for r in padded}) == 1
    policy, reference = trainer.generate(queries, max_new_tokens=2, generate_ref_response=True)
    assert len(policy) == len(reference) == 4


def classic_flag_value(name, default):
    """A command-line value for a classic PPOConfig field: its default, or a value of the flag's type."""
    from posttrain.cli import build_parser
    from posttrain.trainers.ppo_config import PPOConfig

    if isinstance(default, dict):
        return '{"key": 1}'
    if default is not None:
        return str(default)
    (action,) = [a for a in build_parser("ppo", PPOConfig)._actions if a.dest == name]
    if action.choices:
        return str(list(action.choices)[-1])
    kind = getattr(action.type, "__name__", "")
    return {"int": "2", "float": "0.5", "string_to_bool": "true"}.get(
        kind, "tensorboard" if name == "log_with" else "x"
    )


@pytest.mark.parametrize("name", sorted(SEED_DEFAULTS))
def test_every_classic_field_parses_on_the_command_line(name, capsys):
    from posttrain.cli import parse_config

    value = classic_flag_value(name, SEED_DEFAULTS[name])
    try:
        config = parse_config("ppo", [f"--{name}", value])
    except SystemExit:
        err = capsys.readouterr().err
        # A refused value is refused by name, never as an unknown or unparsable argument.
        assert "unknown argument" not in err and "invalid" not in err and name in err, err
        return
    parsed = getattr(config, name)
    if isinstance(SEED_DEFAULTS[name], dict):
        assert parsed == {"key": 1}
    elif name == "kl_penalty":
        assert config.kl_estimator == "k1"  # "kl" is the classic spelling of the k1 estimator
    elif SEED_DEFAULTS[name] is not None and name != "exp_name":
        assert str(parsed).lower() == value.lower() or parsed == type(parsed)(value)


def test_trl_core_respond_to_batch_and_set_seed(tiny_tokenizer):
    """`from trl.core import respond_to_batch` / `from trl import set_seed`, renamed: exactly txt_len
    sampled tokens per row (EOS included), reproducible under set_seed; top_k=1 is the greedy loop."""
    from posttrain import AutoModelForCausalLMWithValueHead, set_seed
    from posttrain.core import respond_to_batch

    model = AutoModelForCausalLMWithValueHead.from_pretrained(build_tiny_causal_lm(tiny_tokenizer)).eval()
    queries = torch.tensor([[5, 6, 7], [8, 9, 10]])
    set_seed(3)
    first = respond_to_batch(model, queries, txt_len=6)
    set_seed(3)
    assert torch.equal(first, respond_to_batch(model, queries, txt_len=6)) and first.shape == (2, 6)
    ids = queries
    with torch.no_grad():
        for _ in range(4):
            ids = torch.cat([ids, model(ids)[0][:, -1].argmax(-1, keepdim=True)], dim=-1)
    assert torch.equal(respond_to_batch(model, queries, txt_len=4, top_k=1), ids[:, -4:])


def test_the_default_collator_stacks_tuple_rows_as_a_dataloader_does():
    """A torch Dataset of (query, response) tuples (TRL 0.11's tests) is collated by torch's
    default_collate; dict rows keep ragged tensors as lists."""
    from posttrain.trainers.classic_io import dict_collator

    query, response = dict_collator(
        [(torch.tensor([1, 2]), torch.tensor([3])), (torch.tensor([4, 5]), torch.tensor([6]))]
    )
    assert torch.equal(query, torch.tensor([[1, 2], [4, 5]])) and torch.equal(response, torch.tensor([[3], [6]]))
    batch = dict_collator([{"q": torch.tensor([1])}, {"q": torch.tensor([2, 3])}])
    assert [t.tolist() for t in batch["q"]] == [[1], [2, 3]]


# -- TRL 0.11's observable behaviour (its tests/test_ppo_trainer.py) --------------------------------------
STEP_ROWS = ([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], [torch.tensor([10, 11]), torch.tensor([12, 13, 14])])


def test_a_patched_zero_grad_is_the_one_step_uses(tiny_tokenizer):
    """TRL's tests read every gradient after step() by making zero_grad keep zero tensors; the
    default (set_to_none) still frees them."""
    from functools import partial

    trainer = classic_trainer(tiny_tokenizer)
    trainer.step(*STEP_ROWS, [1.0, 0.0])
    assert all(p.grad is None for p in trainer.model.parameters())
    trainer.optimizer.zero_grad = partial(trainer.optimizer.zero_grad, set_to_none=False)
    trainer.step(*STEP_ROWS, [1.0, 0.0])
    grads = [p.grad for p in trainer.model.parameters()]
    assert all(g is not None and not g.any() for g in grads)  # kept, zeroed after the optimizer step
    assert all(p.grad is None for p in trainer.ref_model.parameters())


def test_lr_scheduler_is_wrapped_and_steps_once_per_step(tiny_tokenizer):
    from posttrain import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

    model = AutoModelForCausalLMWithValueHead(build_tiny_causal_lm(tiny_tokenizer))
    opt = torch.optim.SGD(model.parameters(), lr=0.4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    cfg = PPOConfig(batch_size=2, report_to="none")
    trainer = PPOTrainer(cfg, model, None, tiny_tokenizer, optimizer=opt, lr_scheduler=sched)
    assert trainer.lr_scheduler.scheduler is sched
    # ppo/learning_rate is the rate the step trained with; the scheduler steps after it: 0.4, 0.2, then 0.1
    rates = [trainer.step(*STEP_ROWS, [1.0, 0.0])["ppo/learning_rate"] for _ in range(2)]
    assert rates == pytest.approx([0.4, 0.2]) and opt.param_groups[0]["lr"] == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="lr_scheduler must be a torch.optim.lr_scheduler.LRScheduler"):
        PPOTrainer(PPOConfig(batch_size=2, report_to="none"), model, None, tiny_tokenizer, lr_scheduler=lambda: 1.0)


def test_num_shared_layers_with_a_given_ref_model_warns_and_shares_nothing(tiny_tokenizer):
    from posttrain import PPOConfig, PPOTrainer

    model, ref = build_tiny_causal_lm(tiny_tokenizer), build_tiny_causal_lm(tiny_tokenizer, seed=4)
    with pytest.warns(UserWarning, match="num_shared_layers=1 is ignored"):
        trainer = PPOTrainer(PPOConfig(batch_size=2, report_to="none"), model, ref, tiny_tokenizer, num_shared_layers=1)
    assert trainer.ref_model is ref
    shared = {id(p) for p in trainer.model.parameters()} & {id(p) for p in ref.parameters()}
    assert not shared


def test_no_dataset_warns_about_batch_size(tiny_tokenizer):
    from posttrain import PPOConfig, PPOTrainer

    with pytest.warns(UserWarning, match="config.batch_size = 3"):
        trainer = PPOTrainer(
            PPOConfig(batch_size=3, report_to="none"), build_tiny_causal_lm(tiny_tokenizer), None, tiny_tokenizer
        )
    assert trainer.dataloader is None


def test_step_safety_checker(tiny_tokenizer):
    trainer = classic_trainer(tiny_tokenizer)
    q, r = STEP_ROWS
    queries, responses, scores, masks = trainer._step_safety_checker(2, q, r, [torch.tensor([1.5]), torch.tensor(-1.0)])
    assert [t.tolist() for t in queries] == [[5, 6, 7], [8, 9]] and [t.tolist() for t in responses] == [
        [10, 11],
        [12, 13, 14],
    ]
    assert [s.shape for s in scores] == [(), ()] and [float(s) for s in scores] == [1.5, -1.0] and masks is None
    _, _, _, masks = trainer._step_safety_checker(2, q, r, [1.0, 2.0], [torch.tensor([1, 0]), torch.tensor([0, 1, 1])])
    assert [m.tolist() for m in masks] == [[1, 0], [0, 1, 1]]
    with pytest.raises(ValueError, match=r"scores\[0\] must be a 0-d or 1-element tensor"):
        trainer._step_safety_checker(2, q, r, [torch.tensor([[1.0]]), torch.tensor([[0.0]])])
    with pytest.raises(ValueError, match="config.batch_size = 3"):
        trainer._step_safety_checker(3, q, r, [1.0, 2.0])


def test_kl_penalty_by_hand_and_assigned_after_the_config_is_built(tiny_tokenizer):
    from posttrain import PPOConfig

    lp = torch.tensor([[0.5, 0.2, 0.1], [0.6, 0.2, 0.1]])
    ref = torch.tensor([[0.4, 0.3, 0.0], [0.7, 0.1, 0.3]])
    diff = torch.tensor([[0.1, -0.1, 0.1], [-0.1, 0.1, -0.2]])
    cfg = PPOConfig(report_to="none", batch_size=2)
    expected = {"kl": diff, "abs": diff.abs(), "mse": 0.5 * diff**2}
    for name, want in expected.items():
        cfg.kl_penalty = name  # assigned on the built config, as TRL's scripts do
        trainer = classic_trainer(tiny_tokenizer, config=cfg)
        assert cfg.kl_penalty == name and cfg.kl_estimator == {"kl": "k1", "mse": "k2"}.get(name, name)
        torch.testing.assert_close(trainer._kl_penalty(lp, ref), want)
    # full: Σ_v p_v (log p_v − log q_v); p = (0.5, 0.5), q = (0.25, 0.75): 0.5·ln 2 + 0.5·ln(2/3)
    cfg.kl_penalty = "full"
    trainer = classic_trainer(tiny_tokenizer, config=cfg)
    p, q = torch.tensor([[[0.5, 0.5]]]).log(), torch.tensor([[[0.25, 0.75]]]).log()
    kl = trainer._kl_penalty(p, q)
    assert kl.shape == (1, 1) and float(kl) == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), abs=1e-6)
    cfg.kl_penalty, cfg.kl_estimator = "abs", "k3"
    with pytest.raises(ConfigError, match="kl_estimator='k3' and kl_penalty='abs' were both changed"):
        classic_trainer(tiny_tokenizer, config=cfg)


def test_fields_assigned_on_a_built_config_survive_the_classic_defaults(tiny_tokenizer):
    from posttrain import PPOConfig

    cfg = PPOConfig(report_to="none", batch_size=2)
    cfg.max_grad_norm, cfg.ppo_epochs, cfg.init_kl_coef = 1e-5, 1, 0.3  # classic defaults: None, 4, 0.2
    trainer = classic_trainer(tiny_tokenizer, config=cfg)
    assert (cfg.max_grad_norm, cfg.num_ppo_epochs, cfg.ppo_epochs, cfg.kl_coef, trainer.kl_ctl.value) == (
        1e-5,
        1,
        1,
        0.3,
        0.3,
    )
    assert cfg.learning_rate == 1e-5  # not assigned: the classic default
    cfg.mini_batch_size, cfg.gradient_accumulation_steps = 1, 2  # between trainers, as TRL's tests do
    trainer = classic_trainer(tiny_tokenizer, config=cfg)
    assert (cfg.mini_batch_size, cfg.backward_batch_size) == (1, 2)
    # ppo_epochs assigned after the trainer was built: the next step() runs 2 epochs of 1 optimizer step
    cfg.ppo_epochs = 2
    stats = trainer.step(*STEP_ROWS, [1.0, 0.0])
    assert cfg.num_ppo_epochs == 2 and len(stats["ppo/policy/ratio"]) == 5 * 2


def test_batch_sizes_neither_api_accepts_are_refused_at_construction():
    from posttrain import PPOConfig

    with pytest.raises(ConfigError, match=r"batch_size=2 must be a multiple of .* = 2 × 2"):
        PPOConfig(batch_size=2, mini_batch_size=2, gradient_accumulation_steps=2)
    # train()'s derived sizes (per_device 8 × accumulation 2 = 16 per optimizer step) stay accepted
    assert PPOConfig(batch_size=16, mini_batch_size=16, gradient_accumulation_steps=2).batch_size == 16
    assert PPOConfig(batch_size=4, gradient_accumulation_steps=2).batch_size == 4  # mini_batch_size: default 1


def test_reward_adapter_scores_with_the_reward_lora_and_trains_only_the_policy(tmp_path, tiny_tokenizer):
    """TRL's reward_adapter: a reward model's LoRA adapter (saved with its score head) rides in the
    PEFT policy, frozen; compute_reward_score equals the reward model's own score."""
    peft = pytest.importorskip("peft")
    from functools import partial

    from posttrain import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
    from posttrain.testing import build_tiny_reward_model

    rm = build_tiny_reward_model(tiny_tokenizer)
    lm = build_tiny_causal_lm(tiny_tokenizer)
    lm.model.load_state_dict(rm.model.state_dict())  # the policy and the reward model share their base
    rm = peft.get_peft_model(rm, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="SEQ_CLS"))
    with torch.no_grad():  # a trained adapter and head: not the identity
        for name, p in rm.named_parameters():
            if "lora_B" in name or "score" in name:
                p.normal_(std=0.5)
    rm.save_pretrained(tmp_path / "rm")
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        want = rm.eval()(ids).logits
    policy = peft.get_peft_model(
        lm, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj"], task_type="CAUSAL_LM")
    )
    model = AutoModelForCausalLMWithValueHead.from_pretrained(policy, reward_adapter=str(tmp_path / "rm"))
    got = model.compute_reward_score(ids)
    assert got.shape == (2, 4, 1)
    torch.testing.assert_close(got[:, -1, :], want, atol=1e-5, rtol=0)
    assert model.pretrained_model.active_adapter == "default"

    trainer = PPOTrainer(PPOConfig(batch_size=2, report_to="none"), model, None, tiny_tokenizer)
    trainer.optimizer.zero_grad = partial(trainer.optimizer.zero_grad, set_to_none=False)
    trainer.step(*STEP_ROWS, [1.0, 0.0])
    for name, p in model.named_parameters():
        trained = ("lora" in name or "v_head" in name) and "reward" not in name
        assert (p.grad is not None) == trained, name
    torch.testing.assert_close(model.compute_reward_score(ids)[:, -1, :], want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="needs a PEFT policy"):
        AutoModelForCausalLMWithValueHead.from_pretrained(build_tiny_causal_lm(tiny_tokenizer), reward_adapter="x")
