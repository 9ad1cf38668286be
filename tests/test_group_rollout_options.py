"""TRL 1.x GRPO / RLOO settings that shape the rollout and the reference model (configs.GroupRolloutOptions):
steps_per_generation / generation_batch_size, sync_ref_model, mask_truncated_completions (RLOO),
min_p / repetition_penalty / generation_kwargs, log_completions, chat_template_kwargs, pad_to_multiple_of."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from datasets import Dataset
from torch import nn

from helpers import flat, grpo_config, length_reward, prompt_dataset, rloo_config
from posttrain import cli
from posttrain.configs import ConfigError, transformers_generation_kwargs
from posttrain.data.prompts import prompt_dataset as prepared_prompts
from posttrain.models import mix_into
from posttrain.rollout import Rollout
from posttrain.testing import build_tiny_causal_lm, build_tiny_tokenizer
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.grpo_config import GRPOConfig
from posttrain.trainers.online_dpo_config import OnlineDPOConfig
from posttrain.trainers.rloo import RLOOTrainer
from posttrain.trainers.rloo_config import RLOOConfig
from posttrain.trainers.xpo_config import XPOConfig

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:min_p="),
    pytest.mark.filterwarnings("ignore:top_k="),
]

CONFIGS = [pytest.param(GRPOConfig, id="grpo"), pytest.param(RLOOConfig, id="rloo")]


# -- configuration ---------------------------------------------------------------------------------


@pytest.mark.parametrize("config_cls", CONFIGS)
def test_steps_per_generation_sets_the_minibatches(config_cls, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # 4 micro-batches per generation batch, 2 per optimizer step: 2 optimizer steps per pass
    c = config_cls(per_device_train_batch_size=2, gradient_accumulation_steps=2, steps_per_generation=4)
    assert c.num_mini_batches == 2
    # 16 completions over 1 process = 8 micro-batches of 2 = 4 optimizer steps of 2 micro-batches
    c = config_cls(per_device_train_batch_size=2, gradient_accumulation_steps=2, generation_batch_size=16)
    assert c.num_mini_batches == 4
    c.derive_sizes(world_size=1, dataset_size=64)
    assert c.batch_size == 16
    # sized for 2 processes by the launcher's WORLD_SIZE: 16 = 2 per device × 2 processes × 4
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert config_cls(per_device_train_batch_size=2, generation_batch_size=16).num_mini_batches == 4
    # TRL's default (steps_per_generation = gradient_accumulation_steps) is num_mini_batches = 1
    assert config_cls(gradient_accumulation_steps=4, steps_per_generation=4).num_mini_batches == 1
    assert config_cls(steps_per_generation=6, gradient_accumulation_steps=3, num_mini_batches=2).num_mini_batches == 2


@pytest.mark.parametrize("config_cls", CONFIGS)
@pytest.mark.parametrize(
    "values, message",
    [
        (dict(steps_per_generation=2, generation_batch_size=8), "both size the generation batch"),
        (dict(steps_per_generation=3, gradient_accumulation_steps=2), r"steps_per_generation=3 .* not a multiple"),
        (dict(steps_per_generation=4, gradient_accumulation_steps=2, num_mini_batches=3), "num_mini_batches=3 was"),
        (dict(generation_batch_size=10, per_device_train_batch_size=4), "generation_batch_size=10 must be a"),
        (dict(steps_per_generation=0), "steps_per_generation=0 must be >= 1"),
        (dict(generation_kwargs={"num_return_sequences": 2}), "which the run sets itself: use num_generations"),
        (dict(generation_kwargs={"stop_strings": ["\n"]}), "'stop_strings', which the run sets itself: .*stop_token"),
        (dict(generation_kwargs={"num_beam": 4}), "'num_beam', which is not a setting of transformers' Generation"),
        (dict(generation_kwargs='{"max_new_tokens": 4}'), "use max_completion_length"),
        (dict(generation_kwargs={"do_sample": False}), "do_sample=False"),
        (dict(min_p=1.5), r"min_p=1.5 must be in \[0, 1\]"),
        (dict(repetition_penalty=0.0), "repetition_penalty=0.0 must be > 0"),
        (dict(pad_to_multiple_of=0), "pad_to_multiple_of=0 must be >= 1"),
        (dict(pad_to_multiple_of="eight"), "pad_to_multiple_of='eight' must be a whole number"),
        (dict(ref_model_mixup_alpha=1.5), r"ref_model_mixup_alpha=1.5 must be in \[0, 1\]"),
        (dict(ref_model_sync_steps=0), "ref_model_sync_steps=0 must be >= 1"),
        (dict(sync_ref_model=True, use_peft=True, beta=0.1), "sync_ref_model=True with use_peft"),
        (dict(num_completions_to_print=0), "num_completions_to_print=0 must be >= 1"),
        (dict(num_generations_eval=2), "num_generations_eval=2: .*one greedy completion per eval prompt"),
    ],
)
def test_bad_values_name_the_field(config_cls, values, message, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=message):
        config_cls(**values)


def test_sync_ref_model_needs_a_reference_model():
    # GRPO's default beta = 0 loads no reference model (TRL raises the same)
    with pytest.raises(ConfigError, match="sync_ref_model=True with beta=0"):
        GRPOConfig(sync_ref_model=True)
    with pytest.raises(ConfigError, match="sync_ref_model=True with kl_coef=0"):
        RLOOConfig(sync_ref_model=True, kl_coef=0.0)
    with pytest.raises(ConfigError, match="sync_ref_model=True with beta=0"):
        RLOOConfig(sync_ref_model=True, beta=0.0)
    assert RLOOConfig(sync_ref_model=True).kl_coef == 0.05


@pytest.mark.parametrize("config_cls", CONFIGS)
def test_num_generations_eval_names_the_greedy_evaluation(config_cls):
    # TRL 1.x scripts set num_generations_eval=1 with eval_strategy: evaluation is one greedy completion
    # per eval prompt, which is what 1 asks for
    assert config_cls(num_generations_eval=1).num_generations_eval == 1
    assert config_cls().num_generations_eval is None


@pytest.mark.parametrize("config_cls", CONFIGS)
def test_generation_kwargs_override_the_sampling_fields(config_cls):
    c = config_cls(top_k=5, generation_kwargs={"top_k": 3, "min_p": 0.1, "repetition_penalty": 1.2, "do_sample": True})
    assert (c.top_k, c.min_p, c.repetition_penalty) == (3, 0.1, 1.2)
    assert config_cls(pad_to_multiple_of="auto").pad_to_multiple_of is None
    assert config_cls(pad_to_multiple_of="8").pad_to_multiple_of == 8


@pytest.mark.parametrize("config_cls", CONFIGS)
def test_beam_search_kwargs_without_beams_are_accepted_with_a_warning(config_cls):
    """TRL's GRPO test passes length_penalty with sampling; transformers' generate ignores it without beams,
    and so does posttrain's engine, saying so. num_beams=1 is the default; with more beams see below."""
    with pytest.warns(UserWarning, match=r"length_penalty=-0.1 has no effect: it applies to beam search"):
        c = config_cls(generation_kwargs={"do_sample": True, "top_k": 50, "length_penalty": -0.1, "num_beams": 1})
    assert c.top_k == 50
    with pytest.warns(UserWarning, match=r"early_stopping=True has no effect"):
        config_cls(generation_kwargs={"early_stopping": True})


@pytest.mark.parametrize("config_cls", CONFIGS)
def test_settings_the_engine_lacks_go_to_transformers_generate(config_cls):
    """Beam search and the other GenerationConfig settings posttrain's engine does not implement are
    handed to the model's generate() (with a warning that it is slower); the engine's own still set fields."""
    kwargs = {"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1, "no_repeat_ngram_size": 3}
    with pytest.warns(UserWarning, match=r"length_penalty, no_repeat_ngram_size, num_beams: posttrain's rollout"):
        c = config_cls(generation_kwargs=kwargs)
    assert c.top_k == 50
    assert transformers_generation_kwargs(c) == {"num_beams": 2, "length_penalty": -0.1, "no_repeat_ngram_size": 3}
    assert transformers_generation_kwargs(config_cls(generation_kwargs={"top_p": 0.9})) == {}


def test_options_on_the_command_line():
    argv = [
        "--steps_per_generation", "2", "--generation_kwargs", '{"top_p": 0.9}', "--min_p", "0.05",
        "--repetition_penalty", "1.1", "--sync_ref_model", "--beta", "0.1", "--ref_model_mixup_alpha", "0.9",
        "--ref_model_sync_steps", "64", "--log_completions", "--num_completions_to_print", "3",
        "--chat_template_kwargs", '{"enable_thinking": false}', "--mask_truncated_completions",
        "--num_generations_eval", "1",
    ]  # fmt: skip
    for name in ("grpo", "rloo"):
        c = cli.parse_config(name, argv)
        assert (c.num_mini_batches, c.top_p, c.min_p, c.repetition_penalty) == (2, 0.9, 0.05, 1.1)
        assert (c.sync_ref_model, c.ref_model_mixup_alpha, c.ref_model_sync_steps) == (True, 0.9, 64)
        assert (c.log_completions, c.num_completions_to_print, c.mask_truncated_completions) == (True, 3, True)
        assert c.num_generations_eval == 1
        assert c.chat_template_kwargs == {"enable_thinking": False}


# -- mechanisms --------------------------------------------------------------------------------------


def test_mix_into_is_the_tr_dpo_update():
    ref, policy = nn.Linear(1, 1), nn.Linear(1, 1)
    with torch.no_grad():
        ref.weight.fill_(2.0), ref.bias.fill_(4.0), policy.weight.fill_(6.0), policy.bias.fill_(0.0)
    mix_into(ref, policy, 0.25)
    # 0.25·6 + 0.75·2 = 3 and 0.25·0 + 0.75·4 = 3; the policy is untouched
    assert (ref.weight.item(), ref.bias.item()) == (3.0, 3.0)
    assert (policy.weight.item(), policy.bias.item()) == (6.0, 0.0)


def test_rollout_padded_to_a_multiple():
    r = Rollout(
        prompt_ids=torch.tensor([[9, 5, 6], [4, 5, 6]]),
        prompt_mask=torch.tensor([[False, True, True], [True, True, True]]),
        completion_ids=torch.tensor([[7, 9], [7, 8]]),
        completion_mask=torch.tensor([[True, False], [True, True]]),
        completion_lengths=torch.tensor([1, 2]),
        ended=torch.tensor([True, False]),
        logprobs=torch.tensor([[-0.5, 0.0], [-0.25, -0.125]]),
        entropy=None,
        pad_token_id=9,
    )
    p = r.padded_to_multiple(4)
    assert p.prompt_ids.tolist() == [[9, 9, 5, 6], [9, 4, 5, 6]]
    assert p.prompt_mask.sum().item() == 5 and not p.prompt_mask[:, 0].any()
    assert p.completion_ids.tolist() == [[7, 9, 9, 9], [7, 8, 9, 9]]
    assert p.completion_mask.tolist() == [[True, False, False, False], [True, True, False, False]]
    assert p.logprobs.tolist() == [[-0.5, 0.0, 0.0, 0.0], [-0.25, -0.125, 0.0, 0.0]]
    # the real tokens keep their positions
    assert torch.equal(p.position_ids[p.sequence_mask], r.position_ids[r.sequence_mask])
    assert r.padded_to_multiple(None) is r and r.padded_to_multiple(1) is r


def test_chat_template_kwargs_reach_the_prompt_template():
    tok = build_tiny_tokenizer()  # a copy: the session's tiny_tokenizer keeps its template
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if thinking is defined and not thinking %}{{ 'no-think ' }}{% endif %}"
        "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
    )
    rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]]})
    plain = prepared_prompts(RLOOConfig(), tok, rows, source="train_dataset")
    assert plain["prompt"][0] == "user: hi\nassistant:"
    for config in (
        RLOOConfig(chat_template_kwargs={"thinking": False}),
        GRPOConfig(chat_template_kwargs='{"thinking": false}'),
    ):
        assert (
            prepared_prompts(config, tok, rows, source="train_dataset")["prompt"][0] == "user: hi\nno-think assistant:"
        )


# -- in training -------------------------------------------------------------------------------------


def test_grpo_sync_steps_per_generation_sampling_and_completion_table(tmp_path, tiny_tokenizer, capsys):
    config = grpo_config(
        tmp_path,
        per_device_train_batch_size=2,
        steps_per_generation=2,  # 2 optimizer steps per rollout batch of 4 completions (one group)
        total_episodes=4,
        beta=0.1,
        sync_ref_model=True,
        ref_model_sync_steps=2,  # after the 2nd optimizer step only
        ref_model_mixup_alpha=0.5,
        min_p=0.02,
        repetition_penalty=1.3,
        pad_to_multiple_of=8,
        log_completions=True,
        num_completions_to_print=3,
        logging_steps=1,
    )
    trainer = GRPOTrainer(
        build_tiny_causal_lm(tiny_tokenizer), length_reward, config, prompt_dataset(), processing_class=tiny_tokenizer
    )
    initial = flat(trainer.ref_model).clone()
    assert (trainer.run.sampling.min_p, trainer.run.sampling.repetition_penalty) == (0.02, 1.3)
    trainer.train()
    assert trainer.run.progress.optimizer_steps == 2
    # one mix after step 2: ref = ½·policy + ½·initial policy
    torch.testing.assert_close(flat(trainer.ref_model), 0.5 * flat(trainer.model) + 0.5 * initial)
    assert not torch.equal(flat(trainer.model), initial)
    rows = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [r["table"] for r in rows] == ["rollout_completions"] * 3
    assert set(rows[0]) == {"step", "table", "prompt", "completion", "length_reward", "advantage"}
    assert all(r["length_reward"] == len(r["completion"]) for r in rows)
    assert "rollout_completions (step 1)" in capsys.readouterr().out


def test_grpo_refuses_sync_with_peft_before_loading(tiny_tokenizer, tmp_path):
    peft = pytest.importorskip("peft")
    config = grpo_config(tmp_path, beta=0.1, sync_ref_model=True)
    with pytest.raises(ConfigError, match="sync_ref_model=True with a peft_config"):
        GRPOTrainer("no/such/model", length_reward, config, prompt_dataset(), peft_config=peft.LoraConfig())


def test_rloo_mask_truncated_completions_and_steps_per_generation(tmp_path, tiny_tokenizer, monkeypatch):
    import posttrain.trainers.online as shared

    real_generate = shared.generate

    def never_ending(*args, **kwargs):  # every completion hits the length limit
        rollout = real_generate(*args, **kwargs)
        return dataclasses.replace(rollout, ended=torch.zeros_like(rollout.ended))

    monkeypatch.setattr(shared, "generate", never_ending)
    weights = {}
    for masked in (False, True):
        config = rloo_config(
            tmp_path,
            name=f"masked{masked}",
            per_device_train_batch_size=2,
            steps_per_generation=2,  # 2 optimizer steps per rollout batch of 4 completions
            total_episodes=4,
            mask_truncated_completions=masked,
        )
        policy = build_tiny_causal_lm(tiny_tokenizer)
        initial = flat(policy).clone()
        trainer = RLOOTrainer(config, tiny_tokenizer, policy, None, length_reward, prompt_dataset())
        trainer.train()
        assert trainer.run.progress.optimizer_steps == 2
        weights[masked] = (initial, flat(trainer.policy))
    # truncated completions carry no gradient: AdamW leaves the policy exactly as it was
    assert torch.equal(*weights[True])
    assert not torch.equal(*weights[False])


@pytest.mark.parametrize("trainer_cls", [GRPOTrainer, RLOOTrainer])
def test_shuffle_dataset_false_draws_prompts_in_dataset_order(trainer_cls, tmp_path, tiny_tokenizer):
    """TRL 1.x's shuffle_dataset=False: each pass takes the prompts in dataset order (the default
    draws a seeded permutation per pass)."""
    make = grpo_config if trainer_cls is GRPOTrainer else rloo_config
    prompts = prompt_dataset(8, numbered=True)
    for shuffle in (False, True):
        config = make(tmp_path, name=f"out-{shuffle}", per_device_train_batch_size=4, total_episodes=4)
        config.shuffle_dataset = shuffle
        trainer = trainer_cls(
            build_tiny_causal_lm(tiny_tokenizer), length_reward, config, prompts, processing_class=tiny_tokenizer
        )
        order = trainer.run.prompts._order
        assert (order == list(range(8))) is not shuffle and sorted(order) == list(range(8))


# -- router_aux_loss_coef: a mixture-of-experts policy's load-balancing loss ------------------------


def tiny_moe(tokenizer):
    """A randomly initialised 2-layer Mixtral (4 experts, 2 per token) sized for `tokenizer`."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def trained_on_length(trainer_cls, policy, cfg, tokenizer):
    """A `trainer_cls` (RLOO or GRPO) of `policy` on length_reward over 8 prompts, trained."""
    trainer = trainer_cls(
        model=policy, reward_funcs=length_reward, args=cfg, train_dataset=prompt_dataset(8), processing_class=tokenizer
    )
    trainer.train()
    return trainer


def test_grpo_router_aux_loss_of_a_moe_policy(tmp_path, tiny_tokenizer):
    """TRL 1.9's router_aux_loss_coef: a mixture-of-experts policy's load-balancing loss joins the
    policy loss, coef · aux_loss (one micro-batch per optimizer step), logged as aux_loss; the same
    rollout without it (coef 0) has a loss smaller by exactly that. Dense models have no such loss."""
    assert GRPOConfig().router_aux_loss_coef == 0.001  # TRL's default

    def run(coef):
        cfg = grpo_config(tmp_path, name=f"c{coef}", router_aux_loss_coef=coef, total_episodes=4)
        trainer = GRPOTrainer(
            tiny_moe(tiny_tokenizer), length_reward, cfg, prompt_dataset(8), processing_class=tiny_tokenizer
        )
        trainer.train()
        return trainer, trainer.state.log_history[-1]

    with_aux, logged = run(0.5)
    without, plain = run(0.0)
    assert with_aux.aux_loss_enabled and not without.aux_loss_enabled
    assert "aux_loss" not in plain and logged["aux_loss"] > 0
    assert logged["loss/policy_avg"] - plain["loss/policy_avg"] == pytest.approx(0.5 * logged["aux_loss"], abs=1e-5)
    dense = GRPOTrainer(
        build_tiny_causal_lm(tiny_tokenizer),
        length_reward,
        grpo_config(tmp_path, name="dense"),
        prompt_dataset(8),
        processing_class=tiny_tokenizer,
    )
    assert not dense.aux_loss_enabled


def test_rloo_router_aux_loss_of_a_moe_policy(tmp_path, tiny_tokenizer):
    """RLOO (TRL 1.9) adds the same loss: logged as aux_loss, and it moves the parameters."""
    params = {}
    for coef in (0.0, 5.0):
        policy = tiny_moe(tiny_tokenizer)
        cfg = rloo_config(tmp_path, name=f"c{coef}", router_aux_loss_coef=coef, total_episodes=4)
        trainer = trained_on_length(RLOOTrainer, policy, cfg, tiny_tokenizer)
        assert trainer.aux_loss_enabled == (coef > 0)
        assert ("aux_loss" in trainer.state.log_history[-1]) == (coef > 0)
        params[coef] = flat(policy).clone()
    assert not torch.equal(params[0.0], params[5.0])
    with pytest.raises(ConfigError, match="router_aux_loss_coef=-1 must be >= 0"):
        RLOOConfig(router_aux_loss_coef=-1)


@pytest.mark.parametrize("trainer_cls", [RLOOTrainer, GRPOTrainer])
def test_router_aux_loss_keeps_the_shuffled_micro_batches(tmp_path, tiny_tokenizer, monkeypatch, trainer_cls):
    """The router aux loss is a mean per micro-batch, so with it the update's micro-batches stay as the shuffle
    drew them; without it a prompt's completions are put into the same micro-batches (online.prompt_grouped)."""
    from posttrain.trainers import online

    grouped = []
    regroup = online.prompt_grouped
    monkeypatch.setattr(online, "prompt_grouped", lambda *a: grouped.append(1) or regroup(*a))
    kwargs = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, total_episodes=4)
    for coef in (0.0, 0.5):
        grouped.clear()
        if trainer_cls is RLOOTrainer:
            cfg = rloo_config(tmp_path, name=f"c{coef}", router_aux_loss_coef=coef, **kwargs)
        else:
            cfg = grpo_config(tmp_path, name=f"c{coef}", router_aux_loss_coef=coef, num_generations=2, **kwargs)
        trainer = trained_on_length(trainer_cls, tiny_moe(tiny_tokenizer), cfg, tiny_tokenizer)
        assert trainer.aux_loss_enabled == (coef > 0)
        assert grouped == ([] if coef > 0 else [1])


ENGINE_CONFIGS = [*CONFIGS, pytest.param(OnlineDPOConfig, id="online_dpo"), pytest.param(XPOConfig, id="xpo")]


@pytest.mark.parametrize("config_cls", ENGINE_CONFIGS)
def test_trl_generation_engine_fields_construct_at_their_defaults_and_are_refused_when_set(config_cls):
    """A config written for TRL 1.16 names vLLM's settings (at their defaults when vLLM is off): it
    constructs; asking for vLLM or transformers' paged generation is one clear error naming the field."""
    defaults = dict(use_vllm=False, vllm_mode="colocate", vllm_server_host="0.0.0.0", vllm_server_port=8000)
    defaults.update(vllm_tensor_parallel_size=1, use_transformers_paged=False)
    config_cls(**defaults)
    for name, value in (("use_vllm", True), ("vllm_mode", "server"), ("vllm_gpu_memory_utilization", 0.9)):
        with pytest.raises(ConfigError, match=rf"{name}={value!r} is not supported by posttrain .*vLLM is not used"):
            config_cls(**{name: value})
    with pytest.raises(ConfigError, match="use_transformers_paged=True is not supported .*paged generation"):
        config_cls(use_transformers_paged=True)


def test_grpo_vllm_importance_sampling_fields_at_trl_defaults():
    config = GRPOConfig(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="sequence_mask")
    assert config.vllm_importance_sampling_clip_max == 3.0
    with pytest.raises(ConfigError, match="vllm_importance_sampling_correction=False is not supported"):
        GRPOConfig(vllm_importance_sampling_correction=False)


def test_moe_policy_whose_forward_has_no_aux_loss_trains_with_a_warning(tmp_path, tiny_tokenizer):
    """GLM-4 MoE's config has output_router_logits, but its forward returns aux_loss=None: TRL's rule
    enables the loss, and training goes on without it (one warning) instead of failing."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Glm4MoeConfig"):
        pytest.skip("this transformers has no GLM-4 MoE")
    config = transformers.Glm4MoeConfig(
        vocab_size=len(tiny_tokenizer),
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        max_position_embeddings=256,
        bos_token_id=tiny_tokenizer.bos_token_id,
        eos_token_id=tiny_tokenizer.eos_token_id,
        pad_token_id=tiny_tokenizer.pad_token_id,
    )
    policy = transformers.AutoModelForCausalLM.from_config(config)
    before = flat(policy).clone()
    cfg = grpo_config(tmp_path, name="glm", total_episodes=4)
    trainer = GRPOTrainer(policy, length_reward, cfg, prompt_dataset(8), processing_class=tiny_tokenizer)
    assert trainer.aux_loss_enabled
    with pytest.warns(UserWarning, match="has no aux_loss even with output_router_logits=True"):
        trainer.train()
    assert "aux_loss" not in trainer.state.log_history[-1]
    assert not torch.equal(before, flat(policy))
