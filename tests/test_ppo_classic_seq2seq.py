"""The classic PPO API (generate() / step()) on encoder-decoder models: tiny T5 and BART built
offline from their configs, a word-level tokenizer. Queries feed the encoder, responses are
decoder sequences (decoder start token first); expected log-probs come from an independent
unpadded forward of each (query, response) pair."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from helpers import VOCAB
from helpers import tiny_bart as bart
from helpers import tiny_t5 as t5
from posttrain.configs import ConfigError
from posttrain.trainers.ppo import PPOTrainer
from posttrain.trainers.ppo_classic import STEP_STATS
from posttrain.trainers.ppo_config import PPOConfig
from posttrain.value_head import AutoModelForSeq2SeqLMWithValueHead

QUERIES = [torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([10, 11, 12, 13]), torch.tensor([14])]
SCORES = [torch.tensor(1.0), torch.tensor(-1.0), torch.tensor(0.5), torch.tensor(0.0)]
# Every stat step() returns for a causal LM: the classic names plus the derived ones.
STAT_NAMES = set(STEP_STATS) | {
    "ppo/std_scores",
    "ppo/val/var_explained",
    "objective/kl_coef",
    "ppo/learning_rate",
    "time/ppo/total",
    "time/ppo/forward_pass",
    "time/ppo/compute_rewards",
    "time/ppo/compute_advantages",
    "time/ppo/optimize_step",
    "time/ppo/calc_stats",
    "tokens/queries_len_std",
    "tokens/responses_len_std",
    # TRL's distributions (arrays)
    "objective/kl_dist",
    "tokens/queries_dist",
    "tokens/responses_dist",
    "ppo/policy/ratio",
    "ppo/policy/advantages",
}


def word_tokenizer(pad: int, eos: int) -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(VOCAB)}
    for i, name in ((pad, "<pad>"), (eos, "</s>")):
        del vocab[f"w{i}"]
        vocab[name] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="w3")


ARCHS = {"t5": (t5, 0, 1), "bart": (bart, 1, 2)}  # builder, pad id, eos id


def trainer_for(arch: str, ref_seed: int | None = None, **config):
    build, pad, eos = ARCHS[arch]
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLMWithValueHead(build(0))
    ref = None if ref_seed is None else build(ref_seed).eval()
    cfg = PPOConfig(
        **{"batch_size": 4, "mini_batch_size": 4, "learning_rate": 1e-2, "report_to": "none", "seed": 0, **config}
    )
    return PPOTrainer(config=cfg, model=model, ref_model=ref, tokenizer=word_tokenizer(pad, eos)), model


def responses_for(arch: str) -> list[torch.Tensor]:
    start = ARCHS[arch][0]().config.decoder_start_token_id
    return [torch.tensor([start, *r]) for r in ([20, 21, 22], [23, 24], [25, 26, 27, 28], [29])]


@torch.no_grad()
def token_logprobs(model: torch.nn.Module, q: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """log π(r[t] | q, r[:t]) for t = 1 … len(r)−1 from ONE unpadded pair: the ground truth."""
    lm = getattr(model, "pretrained_model", model)
    logits = lm(input_ids=q[None], decoder_input_ids=r[None]).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, r[1:, None]).squeeze(-1)


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_generate_returns_decoder_sequences_without_the_query(arch):
    trainer, model = trainer_for(arch)
    assert trainer.is_encoder_decoder
    eos, start = ARCHS[arch][2], model.config.decoder_start_token_id
    out = trainer.generate(QUERIES, max_new_tokens=5, return_prompt=True)
    assert len(out) == 4
    for r in out:
        assert r.dim() == 1 and 2 <= len(r) <= 6  # start token + 1..5 new tokens
        assert int(r[0]) == start
        assert (r[1:-1] != eos).all()  # cut right after its first EOS, if any
        assert len(r) == 6 or int(r[-1]) == eos
    policy, reference = trainer.generate(QUERIES, max_new_tokens=3, generate_ref_response=True)
    assert len(policy) == len(reference) == 4
    assert all(int(r[0]) == start and 2 <= len(r) <= 4 for r in policy + reference)
    single = trainer.generate(QUERIES[0], max_new_tokens=3)
    assert single.dim() == 2 and single.size(0) == 1 and int(single[0, 0]) == start
    # greedy decoding is the argmax of an independent forward at each step
    greedy = trainer.generate([QUERIES[2]], max_new_tokens=4, do_sample=False, eos_token_id=None)[0]
    assert len(greedy) == 5
    with torch.no_grad():
        logits = model.pretrained_model.eval()(input_ids=QUERIES[2][None], decoder_input_ids=greedy[None]).logits[0]
    assert torch.equal(logits[:-1].argmax(-1), greedy[1:])


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_three_steps_train_encoder_decoder_and_value_head(arch):
    trainer, model = trainer_for(arch, mini_batch_size=2, ppo_epochs=2)
    ref = trainer.ref_model
    assert ref is not model.pretrained_model and type(ref) is type(model.pretrained_model)
    assert not any(p.requires_grad for p in ref.parameters())
    lm = model.pretrained_model
    encoder = next(p for n, p in lm.named_parameters() if "encoder" in n and p.dim() == 2)
    decoder = next(p for n, p in lm.named_parameters() if "decoder" in n and p.dim() == 2)
    before = [t.detach().clone() for t in (encoder, decoder, model.v_head.summary.weight)]
    ref_before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    responses = trainer.generate(QUERIES, max_new_tokens=4)
    responses = [r if len(r) > 1 else torch.cat([r, r]) for r in responses]
    for _ in range(3):
        stats = trainer.step(QUERIES, responses, SCORES)
        assert set(stats) == STAT_NAMES
        assert all(np.isfinite(v).all() for v in stats.values()), stats
    for old, new in zip(before, (encoder, decoder, model.v_head.summary.weight)):
        assert not torch.equal(old, new)
    assert all(torch.equal(ref_before[n], p) for n, p in ref.named_parameters())  # the reference stays put


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_step_logprobs_are_the_decoder_log_softmax_at_response_positions(arch):
    """One epoch over one minibatch: objective/logprobs, ref_logprobs and kl are exactly the
    hand-computed per-token values (start token excluded, padded batch = unpadded pairs), and the
    update's ratio is exactly 1."""
    trainer, model = trainer_for(arch, ref_seed=3, ppo_epochs=1, kl_coef=0.1, disable_dropout=True)
    responses = responses_for(arch)
    lp = [token_logprobs(model.eval(), q, r) for q, r in zip(QUERIES, responses)]
    ref_lp = [token_logprobs(trainer.ref_model, q, r) for q, r in zip(QUERIES, responses)]
    stats = trainer.step(QUERIES, responses, SCORES)
    tokens = torch.cat(lp)
    assert len(tokens) == sum(len(r) - 1 for r in responses) == 10
    assert stats["objective/logprobs"] == pytest.approx(float(tokens.mean()), abs=1e-5)
    assert stats["objective/ref_logprobs"] == pytest.approx(float(torch.cat(ref_lp).mean()), abs=1e-5)
    kl = [float((a - b).sum()) for a, b in zip(lp, ref_lp)]
    assert stats["objective/kl"] == pytest.approx(sum(kl) / 4, abs=1e-5)
    # TRL's definition: the mean of −β·kl_t over the 10 response tokens (not over the 4 rows).
    assert stats["ppo/mean_non_score_reward"] == pytest.approx(-0.1 * sum(kl) / 10, abs=1e-5)
    assert stats["ppo/policy/ratio_mean"] == 1.0
    assert stats["ppo/policy/approxkl"] == 0.0
    assert stats["tokens/responses_len_mean"] == pytest.approx(sum(len(r) for r in responses) / 4)


def test_full_kl_is_the_exact_kl_of_the_decoder_distributions():
    """kl_penalty="full": objective/kl = mean over rows of Σ_t KL(π(·|q, r[:t]) ‖ π_ref(·|q, r[:t]))
    over the generated tokens, from unpadded forwards of each pair."""
    trainer, model = trainer_for("t5", ref_seed=3, ppo_epochs=1, kl_penalty="full", disable_dropout=True)
    responses = responses_for("t5")
    total = 0.0
    with torch.no_grad():
        for q, r in zip(QUERIES, responses):
            p = model.eval().pretrained_model(input_ids=q[None], decoder_input_ids=r[None]).logits[0, :-1]
            ref = trainer.ref_model(input_ids=q[None], decoder_input_ids=r[None]).logits[0, :-1]
            logp, logq = p.log_softmax(-1), ref.log_softmax(-1)
            total += float((logp.exp() * (logp - logq)).sum())
    stats = trainer.step(QUERIES, responses, SCORES)
    assert total > 0
    assert stats["objective/kl"] == pytest.approx(total / 4, rel=1e-5)


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_response_masks_leave_tokens_out_of_the_loss_not_out_of_the_context(arch):
    trainer, model = trainer_for(arch, ref_seed=3, ppo_epochs=1, disable_dropout=True)
    responses = responses_for(arch)
    # entry 0 (the decoder start token) is never trained on, whatever the mask says
    masks = [torch.tensor([1, 0, 1, 1]), torch.tensor([0, 1, 0]), torch.tensor([1, 1, 1, 0, 1]), torch.tensor([0, 1])]
    lp = [token_logprobs(model.eval(), q, r) for q, r in zip(QUERIES, responses)]
    kept = torch.cat([x[m[1:].bool()] for x, m in zip(lp, masks)])
    assert len(kept) == 7
    stats = trainer.step(QUERIES, responses, SCORES, response_masks=masks)
    assert stats["objective/logprobs"] == pytest.approx(float(kept.mean()), abs=1e-5)
    with pytest.raises(ValueError, match="at least one 1 after the decoder start token"):
        trainer.step(QUERIES, responses, SCORES, response_masks=[torch.tensor([1, 0, 0, 0]), *masks[1:]])


def test_a_response_needs_a_generated_token_after_the_start_token():
    trainer, _ = trainer_for("t5")
    responses = responses_for("t5")
    with pytest.raises(ValueError, match="decoder start token and at least one generated token"):
        trainer.step(QUERIES, [torch.tensor([0]), *responses[1:]], SCORES)


def test_is_encoder_decoder_is_detected_and_checked():
    tok = word_tokenizer(0, 1)
    cfg = PPOConfig(batch_size=4, report_to="none", is_encoder_decoder=True)
    # a bare seq2seq LM gets TRL's value head; the default reference is an equal frozen copy
    trainer = PPOTrainer(config=cfg, model=t5(), tokenizer=tok)
    assert isinstance(trainer.model, AutoModelForSeq2SeqLMWithValueHead) and trainer.is_encoder_decoder
    for (n, p), q in zip(trainer.model.pretrained_model.named_parameters(), trainer.ref_model.parameters()):
        assert torch.equal(p, q) and p is not q, n
    with pytest.raises(ConfigError, match="is_encoder_decoder=False"):
        PPOTrainer(
            config=PPOConfig(batch_size=4, report_to="none", is_encoder_decoder=False), model=t5(), tokenizer=tok
        )
    causal = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ConfigError, match="same architecture|policy's architecture"):
        PPOTrainer(config=PPOConfig(batch_size=4, report_to="none"), model=t5(), ref_model=causal, tokenizer=tok)


def test_num_shared_layers_shares_what_comes_before_that_decoder_layer():
    """BART, num_shared_layers=0: the embeddings and the whole encoder (named before
    model.decoder.layers.0) are the policy's own frozen tensors in the reference; decoder layer 0
    and the value head still train."""
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLMWithValueHead(bart())
    cfg = PPOConfig(batch_size=4, learning_rate=1e-2, report_to="none", ppo_epochs=1)
    trainer = PPOTrainer(cfg, model, None, word_tokenizer(1, 2), num_shared_layers=0)
    lm, ref = model.pretrained_model, trainer.ref_model
    assert lm.model.encoder.layers[0].fc1.weight is ref.model.encoder.layers[0].fc1.weight
    assert not lm.model.encoder.layers[0].fc1.weight.requires_grad
    assert lm.model.decoder.layers[0].fc1.weight is not ref.model.decoder.layers[0].fc1.weight
    encoder = lm.model.encoder.layers[0].fc1.weight.detach().clone()
    decoder = lm.model.decoder.layers[0].fc1.weight.detach().clone()
    trainer.step(QUERIES, responses_for("bart"), SCORES)
    assert torch.equal(encoder, lm.model.encoder.layers[0].fc1.weight)
    assert not torch.equal(decoder, lm.model.decoder.layers[0].fc1.weight)


def test_trained_model_saves_and_reloads_with_its_value_head(tmp_path):
    trainer, model = trainer_for("bart", ppo_epochs=1)
    trainer.step(QUERIES, responses_for("bart"), SCORES)
    trainer.save_pretrained(str(tmp_path))
    again = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(str(tmp_path))
    saved, loaded = model.state_dict(), again.state_dict()
    assert set(saved) == set(loaded) and "v_head.summary.weight" in loaded
    assert all(torch.equal(saved[k].cpu(), loaded[k]) for k in saved)
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path)).eos_token_id == 2
    q, r = QUERIES[0][None], responses_for("bart")[0][None]
    with torch.no_grad():
        assert torch.allclose(
            model.eval()(input_ids=q, decoder_input_ids=r)[2], again.eval()(q, decoder_input_ids=r)[2]
        )
