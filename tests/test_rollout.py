"""The generation engine: stop/EOS contract, layout, seeding, chunking, and logprobs that match a
recomputation by scoring.completion_logprobs (TRL bugs fixed on purpose: docs/internals.md)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, StaticCache

from helpers import left_pad, tiny_llama, tiny_neox
from posttrain.rollout import (
    Rollout,
    SamplingConfig,
    decode_completions,
    decode_prompts,
    generate,
    generation_mode,
    sample_from_probs,
)
from posttrain.scoring import completion_logprobs

V = 16


class ScriptedLM(nn.Module):
    """Next-token logits depend only on the last input token: token `table[v]` gets +20 (greedy and
    near-certain sampling follow the table). Records every call's inputs to check the decode loop.
    Its KV cache is a tuple of one (key, value) pair holding each row's ids so far, so the engine can
    index its rows (prefill sharing, compaction) and a test can check they stay aligned;
    opaque=True returns an int cache the engine cannot index. Given a transformers StaticCache (the
    static engines), it writes each row's ids into it as its one layer's keys and values."""

    # What StaticCache sizes its buffers from: one layer, one head of 4 dims.
    config = LlamaConfig(hidden_size=4, num_attention_heads=1, num_key_value_heads=1, num_hidden_layers=1, vocab_size=V)

    def __init__(self, table: list[int] | None = None, uniform: bool = False, opaque: bool = False):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))
        self.table = torch.tensor(table if table is not None else [(v + 1) % V for v in range(V)])
        self.uniform = uniform
        self.opaque = opaque
        self.calls: list[dict] = []

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=False,
        cache_position=None,
    ):
        self.calls.append(
            {
                "ids": input_ids.clone(),
                "mask": attention_mask.clone(),
                "pos": position_ids.clone(),
                "past": past_key_values,
            }
        )
        logits = torch.zeros(*input_ids.shape, V)
        if not self.uniform:
            logits.scatter_(-1, self.table[input_ids][..., None], 20.0)
        if self.opaque:
            return SimpleNamespace(logits=logits, past_key_values=(past_key_values or 0) + input_ids.size(1))
        history = input_ids[:, None, :, None].float()
        if isinstance(past_key_values, StaticCache):
            new = history.expand(-1, -1, -1, 4)
            keys, _ = past_key_values.update(new, new, 0, {"cache_position": cache_position})
            assert keys.size(0) == input_ids.size(0), "cache rows out of step with the batch"
            assert attention_mask.size(1) == keys.size(2), "a static cache takes the mask of all its positions"
            return SimpleNamespace(logits=logits, past_key_values=past_key_values)
        if past_key_values is not None:
            assert past_key_values[0][0].size(0) == input_ids.size(0), "cache rows out of step with the batch"
            history = torch.cat([past_key_values[0][0], history], dim=2)
        return SimpleNamespace(logits=logits, past_key_values=((history, history),))


# Engine options: today's engine (one prefill per row, full batch to the end) first, then every
# variant; all must give the same tokens for the same generator state.
LEGACY = {"share_prefill": False, "compact": False, "sync_every": 1}
ENGINES = [
    pytest.param(LEGACY, id="legacy"),
    pytest.param({}, id="default"),
    pytest.param({"compact": False}, id="shared-prefill"),
    pytest.param({"share_prefill": False, "compact": True}, id="compact"),
    pytest.param({"sync_every": 3}, id="sync3"),
    pytest.param({"compact": False, "sync_every": 4}, id="sync4-nocompact"),
    pytest.param({"cache_implementation": "static"}, id="static"),
    pytest.param({"cache_implementation": "static", "compact": False, "sync_every": 3}, id="static-sync3-nocompact"),
]


@pytest.mark.parametrize("engine", ENGINES)
def test_eos_mid_batch_lengths_masks_and_no_extra_decode_step(engine):
    model = ScriptedLM()
    ids, mask = left_pad([[1, 5], [2, 3, 1], [7]], pad=0)
    r = generate(
        model,
        ids,
        mask,
        SamplingConfig(max_new_tokens=12, do_sample=False, stop_token_ids=(9,)),
        pad_token_id=0,
        **engine,
    )
    # Rows continue 6,7,8,9 / 2..9 / 8,9 and stop at 9 (kept).
    assert r.completion_lengths.tolist() == [4, 8, 2]
    assert r.ended.tolist() == [True, True, True]
    assert r.completion_ids.shape == (3, 8)  # loop ended with the longest row, not at max_new_tokens
    assert r.completion_ids[0].tolist() == [6, 7, 8, 9, 0, 0, 0, 0]
    assert r.completion_ids[1].tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
    assert r.completion_ids[2].tolist() == [8, 9, 0, 0, 0, 0, 0, 0]
    assert r.completion_mask.tolist()[0] == [True] * 4 + [False] * 4
    sync_every = engine.get("sync_every", 1)
    # One prefill + 7 decode steps: none after the last row stopped (the check every `sync_every`
    # steps may add up to sync_every - 1 discarded steps: checks after steps 3, 6, 9 -> 9 calls; 4, 8 -> 8).
    assert len(model.calls) == {1: 8, 3: 9, 4: 8}[sync_every]
    # Compaction (default on) drops rows 0 and 2 once both stopped: the check after step 4 (every
    # step) or after step 6 (sync_every=3) sees 2 of 3 rows stopped; the decode calls after it run
    # on row 1 alone.
    compact = engine.get("compact", True)
    first_compacted = {1: 4, 3: 6}[sync_every] if compact else len(model.calls)
    # Attention mask grows by one column a step; positions continue after each real prompt length.
    static = engine.get("cache_implementation") == "static"
    for t, call in enumerate(model.calls):
        rows = [0, 1, 2] if t < first_compacted else [1]
        # A dynamic cache sees the mask of the positions so far, a static one all P + max_new_tokens.
        assert call["mask"].shape == (len(rows), ids.size(1) + (12 if static else t))
        if t > 0:
            assert call["pos"][:, 0].tolist() == [[2, 3, 1][i] + t - 1 for i in rows]
            # Each row is fed its own last token (a stopped row's later feeds are discarded).
            fed = [tok for tok, i in zip(call["ids"][:, 0].tolist(), rows) if t <= r.completion_lengths[i]]
            assert fed == [r.completion_ids[i, t - 1].item() for i in rows if t <= r.completion_lengths[i]]
    assert model.calls[0]["pos"].tolist() == [[0, 0, 1], [0, 1, 2], [0, 0, 0]]
    assert r.logprobs is not None and (r.logprobs[~r.completion_mask] == 0).all()
    assert r.entropy is None


@pytest.mark.parametrize("engine", ENGINES)
def test_rows_that_never_stop_run_to_max_new_tokens(engine):
    model = ScriptedLM(table=list(range(V)))  # repeats its last token forever
    ids, mask = left_pad([[3], [9]], pad=0)
    r = generate(
        model,
        ids,
        mask,
        SamplingConfig(max_new_tokens=5, do_sample=False, stop_token_ids=(9,)),
        pad_token_id=0,
        **engine,
    )
    assert r.completion_lengths.tolist() == [5, 1]
    assert r.ended.tolist() == [False, True]
    assert r.completion_ids.tolist() == [[3, 3, 3, 3, 3], [9, 0, 0, 0, 0]]


@pytest.mark.parametrize("engine", ENGINES)
def test_pad_equal_to_eos_keeps_real_eos_tokens(engine):
    model = ScriptedLM()
    eos = 9
    # A real eos inside the prompt must stay in the mask, and the stop token in the completion too.
    ids, mask = left_pad([[eos, 6], [4]], pad=eos)
    r = generate(
        model,
        ids,
        mask,
        SamplingConfig(max_new_tokens=10, do_sample=False, stop_token_ids=(eos,)),
        pad_token_id=eos,
        **engine,
    )
    assert r.completion_lengths.tolist() == [3, 5]
    assert r.completion_mask.sum().item() == 8
    assert r.completion_ids[0].tolist() == [7, 8, 9, 9, 9]
    assert r.sequence_mask[0].tolist() == [True, True, True, True, True, False, False]
    assert r.position_ids[0, :5].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("engine", ENGINES)
def test_stop_token_other_than_eos_and_several_stop_ids(engine):
    model = ScriptedLM()
    ids, mask = left_pad([[1], [4]], pad=0)
    r = generate(
        model,
        ids,
        mask,
        SamplingConfig(max_new_tokens=10, do_sample=False, stop_token_ids=(3, 6)),
        pad_token_id=15,
        **engine,
    )
    assert r.completion_ids.tolist() == [[2, 3], [5, 6]]
    assert r.ended.all()


@pytest.mark.parametrize("engine", ENGINES)
def test_num_samples_are_prompt_major(engine):
    model = ScriptedLM(uniform=True)
    ids, mask = left_pad([[1, 2], [3]], pad=0)
    g = torch.Generator().manual_seed(0)
    r = generate(
        model, ids, mask, SamplingConfig(max_new_tokens=4), pad_token_id=0, num_samples=3, generator=g, **engine
    )
    assert len(r) == 6
    assert r.prompt_ids[:3].tolist() == [[1, 2]] * 3 and r.prompt_ids[3:].tolist() == [[0, 3]] * 3
    assert r.prompt_mask[3:].tolist() == [[False, True]] * 3
    assert len({tuple(row) for row in r.completion_ids.tolist()}) > 1


@pytest.mark.parametrize("engine", ENGINES)
def test_same_seed_same_tokens_different_seed_different(engine):
    model = ScriptedLM(uniform=True)
    ids, mask = left_pad([[1, 2], [3]] * 4, pad=0)
    cfg = SamplingConfig(max_new_tokens=8)

    def run(seed: int) -> torch.Tensor:
        return generate(
            model, ids, mask, cfg, pad_token_id=0, generator=torch.Generator().manual_seed(seed), **engine
        ).completion_ids

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


@pytest.mark.parametrize("engine", ENGINES)
def test_top_k_and_top_p_restrict_the_candidates(engine):
    class Fixed(ScriptedLM):
        def forward(self, input_ids, **kw):
            out = super().forward(input_ids, **kw)
            out.logits = torch.linspace(4.0, 0.0, V).expand(*input_ids.shape, V).clone()
            return out

    model = Fixed()
    ids, mask = left_pad([[1]] * 64, pad=0)
    g = torch.Generator().manual_seed(0)
    r = generate(model, ids, mask, SamplingConfig(max_new_tokens=3, top_k=2), pad_token_id=0, generator=g, **engine)
    assert set(r.completion_ids.unique().tolist()) == {0, 1}
    # softmax(linspace(4, 0, 16)) puts 0.24 on token 0: top_p = 0.2 keeps only it.
    r = generate(model, ids, mask, SamplingConfig(max_new_tokens=3, top_p=0.2), pad_token_id=0, generator=g, **engine)
    assert set(r.completion_ids.unique().tolist()) == {0}
    # Recorded logprobs are under the full (unfiltered) temperature-scaled distribution.
    full = torch.log_softmax(torch.linspace(4.0, 0.0, V), -1)[0]
    assert torch.allclose(r.logprobs, full.expand_as(r.logprobs))


def test_sample_from_probs_matches_distribution_and_skips_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.1, 0.0, 0.9, 0.0]]).repeat(2000, 1)
    tok = sample_from_probs(probs, torch.Generator().manual_seed(0))
    assert set(tok[0::2].tolist()) == {1, 3} and set(tok[1::2].tolist()) == {0, 2}
    assert abs((tok[1::2] == 2).float().mean().item() - 0.9) < 0.03


@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_top_k1_and_chunking_agree_on_real_model(engine):
    model = tiny_llama()
    ids, mask = left_pad([[5, 6, 7, 8, 9], [11, 12], [20, 21, 22], [30]], pad=0)
    greedy = SamplingConfig(max_new_tokens=12, do_sample=False, stop_token_ids=(1, 2, 3, 4))
    a = generate(model, ids, mask, greedy, pad_token_id=0, **engine)
    b = generate(
        model,
        ids,
        mask,
        SamplingConfig(max_new_tokens=12, top_k=1, stop_token_ids=(1, 2, 3, 4)),
        pad_token_id=0,
        generator=torch.Generator().manual_seed(3),
        **engine,
    )
    c = generate(model, ids, mask, greedy, pad_token_id=0, batch_size=3, **engine)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_ids, c.completion_ids)
    assert torch.equal(a.completion_lengths, c.completion_lengths)
    assert torch.allclose(a.logprobs, c.logprobs, atol=1e-5)
    # Unpadded single-row generation gives the same tokens as the left-padded batch.
    for i in range(len(ids)):
        real = ids[i : i + 1][:, mask[i]]
        solo = generate(model, real, torch.ones_like(real, dtype=torch.bool), greedy, pad_token_id=0, **engine)
        n = int(a.completion_lengths[i])
        assert solo.completion_ids[0, :n].tolist() == a.completion_ids[i, :n].tolist()


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(max_new_tokens=16, temperature=0.7, stop_token_ids=(1, 2, 3)),
        SamplingConfig(max_new_tokens=16, temperature=1.3, top_k=8, top_p=0.9, stop_token_ids=(1, 2, 3)),
        SamplingConfig(max_new_tokens=16, temperature=0.0, stop_token_ids=(1, 2, 3)),
    ],
)
def test_rollout_logprobs_match_recomputation(cfg):
    model = tiny_llama()
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10, 11], [11, 12], [20, 21, 22, 23], [30]], pad=0)
    r = generate(
        model,
        ids,
        mask,
        cfg,
        pad_token_id=0,
        num_samples=3,
        batch_size=5,
        generator=torch.Generator().manual_seed(0),
        return_entropy=True,
    )
    assert r.completion_mask.sum() > 0
    with torch.no_grad():
        lp, ent = completion_logprobs(model, r, temperature=cfg.logprob_temperature, with_entropy=True)
    assert torch.allclose(lp, r.logprobs, atol=1e-5)
    assert torch.allclose(ent, r.entropy, atol=1e-5)
    assert (lp[~r.completion_mask] == 0).all()


def test_rollout_select_cat_to_and_decode():
    model = ScriptedLM()
    ids, mask = left_pad([[1, 5], [7]], pad=0)
    cfg = SamplingConfig(max_new_tokens=10, do_sample=False, stop_token_ids=(9,))
    a = generate(model, ids, mask, cfg, pad_token_id=0)
    b = generate(model, *left_pad([[2, 3, 1]], pad=0), cfg, pad_token_id=0)
    both = Rollout.cat([a, b])
    assert both.prompt_ids.shape == (3, 3) and both.completion_ids.shape == (3, 8)
    assert both.prompt_mask[0].tolist() == [False, True, True]
    assert both.completion_lengths.tolist() == [4, 2, 8]
    assert both.completion_ids[1].tolist() == [8, 9, 0, 0, 0, 0, 0, 0]
    assert (both.logprobs[~both.completion_mask] == 0).all()
    sel = both.select([2, 0])
    assert sel.completion_lengths.tolist() == [8, 4] and sel.completion_ids.size(1) == 8
    assert both.to("cpu").completion_ids.data_ptr() == both.completion_ids.data_ptr()

    class CharTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(
                "<eos>" if i == 9 and not skip_special_tokens else ("" if i == 9 else chr(ord("a") + i)) for i in ids
            )

    assert decode_completions(CharTokenizer(), both) == ["ghi", "i", "cdefghi"]
    assert decode_completions(CharTokenizer(), both, skip_special_tokens=False)[1] == "i<eos>"
    assert decode_prompts(CharTokenizer(), both) == ["bf", "h", "cdb"]


def test_generation_mode_restores_training_and_checkpointing():
    model = tiny_llama()
    model.gradient_checkpointing_enable()
    model.train()
    model.model.layers[0].eval()
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    assert flagged
    with generation_mode(model):
        assert not model.training
        assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert model.training and not model.model.layers[0].training
    assert all(m.gradient_checkpointing for m in flagged)


def test_input_validation():
    model = ScriptedLM()
    ids = torch.tensor([[1, 0]])
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, ids, torch.tensor([[True, False]]), SamplingConfig(max_new_tokens=2), pad_token_id=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(max_new_tokens=2, top_p=0.0)


def record_batch_sizes(model: nn.Module) -> list[int]:
    sizes: list[int] = []
    model.register_forward_pre_hook(
        lambda mod, args, kwargs: sizes.append(kwargs["input_ids"].size(0)), with_kwargs=True
    )
    return sizes


@pytest.mark.parametrize("engine", ENGINES[1:])
@pytest.mark.parametrize("num_samples", [2, 4])
@pytest.mark.parametrize("batch_size", [None, 5])
@pytest.mark.parametrize("builder", [tiny_llama, tiny_neox])
@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(max_new_tokens=20, stop_token_ids=(2, 3, 5, 7)),
        SamplingConfig(max_new_tokens=20, temperature=0.8, top_k=10, top_p=0.9, stop_token_ids=(2, 3, 5, 7)),
    ],
    ids=["plain", "top-k-p"],
)
def test_every_engine_variant_samples_the_legacy_tokens(engine, num_samples, batch_size, builder, cfg):
    # pad == eos (2) and four stop ids: on a random 64-token model rows stop at scattered steps, so
    # prefill sharing, compaction and the sync interval all meet rows stopping mid-batch.
    model = builder()
    ids, mask = left_pad([[5, 6, 7, 8, 9], [11, 12], [20, 21, 22], [30], [40, 41, 42, 43]], pad=2)

    def run(**options):
        g = torch.Generator().manual_seed(11)
        r = generate(
            model,
            ids,
            mask,
            cfg,
            pad_token_id=2,
            num_samples=num_samples,
            batch_size=batch_size,
            generator=g,
            return_entropy=True,
            **options,
        )
        return r, torch.rand(1, generator=g)  # the generator must also end in the same state

    (old, old_next), (new, new_next) = run(**LEGACY), run(**engine)
    assert 0 < old.ended.sum() < len(old)  # some rows stopped mid-batch, some ran to the end
    assert len(set(old.completion_lengths.tolist())) > 3
    assert torch.equal(new.completion_ids, old.completion_ids)
    assert torch.equal(new.completion_lengths, old.completion_lengths)
    assert torch.equal(new.completion_mask, old.completion_mask)
    assert torch.equal(new.ended, old.ended)
    assert torch.equal(new.prompt_ids, old.prompt_ids) and torch.equal(new.prompt_mask, old.prompt_mask)
    assert torch.allclose(new.logprobs, old.logprobs, atol=1e-5)
    assert torch.allclose(new.entropy, old.entropy, atol=1e-5)
    assert torch.equal(new_next, old_next)


@pytest.mark.parametrize("engine", [e for e in ENGINES[1:] if "static" not in e.id])
@pytest.mark.parametrize("builder", [tiny_llama, tiny_neox])
def test_every_engine_variant_under_bf16_autocast_samples_the_legacy_tokens(engine, builder, monkeypatch):
    """bf16=True on CPU: the dynamic engines decode under autocast on packed bf16 linear weights with a
    traced step (cpu_linear.autocast_packed_weights, decode_trace; on a CPU whose oneDNN cannot pack bf16,
    on autocast's kernel, eager). With pad == eos and four stop ids,
    rows stop mid-batch; every variant samples the tokens of the legacy engine (one prefill per row, no
    compaction, eager) under the same autocast, with masks from the same lengths."""
    from posttrain import cpu_linear

    monkeypatch.setattr(cpu_linear, "bf16_pack_calls", lambda *shape: 0.0)
    model = builder()
    ids, mask = left_pad([[5, 6, 7, 8, 9], [11, 12], [20, 21, 22], [30], [40, 41, 42, 43]], pad=2)
    cfg = SamplingConfig(max_new_tokens=20, stop_token_ids=(2, 3, 5, 7))

    def run(**options):
        g = torch.Generator().manual_seed(11)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            r = generate(model, ids, mask, cfg, pad_token_id=2, num_samples=2, generator=g, **options)
        return r, torch.rand(1, generator=g)

    (old, old_next), (new, new_next) = run(**LEGACY, trace=False), run(**engine)
    assert 0 < old.ended.sum() < len(old)
    assert torch.equal(new.completion_ids, old.completion_ids)
    assert torch.equal(new.completion_lengths, old.completion_lengths) and torch.equal(new.ended, old.ended)
    positions = torch.arange(new.completion_ids.size(1))
    assert torch.equal(new.completion_mask, positions[None] < new.completion_lengths[:, None])
    assert new.logprobs.dtype == torch.float32 and torch.allclose(new.logprobs, old.logprobs, atol=1e-2)
    assert torch.equal(new_next, old_next)


def test_shared_prefill_runs_each_prompt_once_and_compaction_shrinks_the_batch():
    model = tiny_llama()
    sizes = record_batch_sizes(model)
    ids, mask = left_pad([[5, 6, 7, 8, 9], [11, 12], [20, 21, 22]], pad=0)
    cfg = SamplingConfig(max_new_tokens=20, stop_token_ids=(2, 3, 5, 7))

    def run(**options):
        sizes.clear()
        g = torch.Generator().manual_seed(11)
        r = generate(model, ids, mask, cfg, pad_token_id=0, num_samples=4, generator=g, **options)
        return r, list(sizes)

    legacy, legacy_sizes = run(**LEGACY)
    assert legacy_sizes == [12] * len(legacy_sizes)  # 3 prompts x 4 samples, prefilled 12 times
    shared, shared_sizes = run(compact=False)
    assert shared_sizes == [3] + [12] * (len(shared_sizes) - 1)  # 3 prefills, then 12 rows decode
    _, compact_sizes = run()
    assert compact_sizes[0] == 3 and compact_sizes[1:] == sorted(compact_sizes[1:], reverse=True)
    # Each decode batch holds the rows not yet stopped at its step, once half the batch had stopped.
    lengths = legacy.completion_lengths
    assert min(compact_sizes) < 12 and min(compact_sizes) >= 1
    for step, rows in enumerate(compact_sizes[1:], start=1):
        assert rows >= int((lengths > step).sum())  # never drops a live row
    assert len(compact_sizes) == len(legacy_sizes) == shared.completion_ids.size(1)


def test_repeated_prompt_rows_are_prefilled_once():
    # RLOO's and GRPO's layout: k = 3 copies of each prompt as blocks of rows, pad id 9 (a real token
    # elsewhere); the copies share one prefill, and every row samples what a prefill per row gives.
    model = tiny_llama()
    sizes = record_batch_sizes(model)
    ids, mask = left_pad([[5, 6, 7, 8, 9], [11, 12], [20, 21, 22]] * 3, pad=9)
    cfg = SamplingConfig(max_new_tokens=12, stop_token_ids=(2, 3, 5, 7))

    def run(**options):
        sizes.clear()
        g = torch.Generator().manual_seed(5)
        return generate(model, ids, mask, cfg, pad_token_id=0, generator=g, compact=False, **options), list(sizes)

    (each, each_sizes), (shared, shared_sizes) = run(share_prefill=False), run()
    assert each_sizes[0] == 9 and shared_sizes[0] == 3  # 3 distinct prompts prefilled, then 9 rows decode
    assert shared_sizes[1:] == each_sizes[1:] == [9] * (len(each_sizes) - 1)
    assert torch.equal(shared.completion_ids, each.completion_ids)
    torch.testing.assert_close(shared.logprobs, each.logprobs, atol=1e-5, rtol=1e-5)
    # The rollout reports each row's own prompt, padding ids included.
    assert torch.equal(shared.prompt_ids, ids) and torch.equal(shared.prompt_mask, mask)
    # In chunks of 4 rows the copies of a prompt are taken together: rows (0, 3, 6, 1 | 4, 7, 2, 5 | 8), that
    # is (p0, p0, p0, p1) -> 2 prefills, (p1, p1, p2, p2) -> 2, (p2) -> 1 (the blocks as they are would need
    # 3, 3 and 1); the tokens are still those of a prefill per row, and the rows come back in their order.
    (each, _), (chunked, chunked_sizes) = run(share_prefill=False, batch_size=4), run(batch_size=4)
    not_four = [n for n in chunked_sizes if n != 4]  # the prefills of 2, then the last chunk's single row
    assert chunked_sizes[0] == 2 and not_four[:2] == [2, 2] and set(not_four[2:]) == {1}
    assert torch.equal(chunked.completion_ids, each.completion_ids) and torch.equal(chunked.prompt_ids, ids)
    order = torch.tensor([0, 3, 6, 1, 4, 7, 2, 5, 8])
    g = torch.Generator().manual_seed(5)
    grouped = generate(model, ids[order], mask[order], cfg, pad_token_id=0, generator=g, compact=False, batch_size=4)
    assert torch.equal(chunked.completion_ids[order], grouped.completion_ids)
    assert torch.equal(chunked.completion_lengths[order], grouped.completion_lengths)


def test_unindexable_cache_falls_back_to_one_prefill_per_row():
    ids, mask = left_pad([[1, 2], [3]], pad=0)
    cfg = SamplingConfig(max_new_tokens=6, stop_token_ids=(4,))
    runs = []
    for options in (LEGACY, {}):
        model = ScriptedLM(uniform=True, opaque=True)
        g = torch.Generator().manual_seed(0)
        runs.append(generate(model, ids, mask, cfg, pad_token_id=0, num_samples=3, generator=g, **options))
        batch = [call["ids"].size(0) for call in model.calls]
        # The shared prefill (2 prompts) is attempted, then every row is prefilled; no compaction.
        assert batch == ([6] * 6 if options == LEGACY else [2] + [6] * 6)[: len(batch)]
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)


def test_sync_every_must_be_positive():
    ids, mask = left_pad([[1]], pad=0)
    with pytest.raises(ValueError, match="sync_every"):
        generate(ScriptedLM(), ids, mask, SamplingConfig(max_new_tokens=2), pad_token_id=0, sync_every=0)


# torch.compile of the decode step takes seconds per model class and shape on 2 CPU cores, so the
# compiled engine runs one contract test (EOS mid-batch, compaction, pad == eos on a real model)
# rather than every parametrized one; the eager static engine runs them all.
@pytest.mark.parametrize("builder", [tiny_llama, tiny_neox])
def test_compiled_static_step_samples_the_legacy_tokens(builder):
    from torch._dynamo.utils import counters

    model = builder()
    ids, mask = left_pad([[5, 6, 7, 8, 9], [11, 12], [20, 21, 22], [30], [40, 41, 42, 43]], pad=2)
    cfg = SamplingConfig(max_new_tokens=20, stop_token_ids=(2, 3, 5, 7))

    def run(**options):
        g = torch.Generator().manual_seed(11)
        r = generate(model, ids, mask, cfg, pad_token_id=2, num_samples=2, generator=g, **options)
        return r, torch.rand(1, generator=g)

    compiled_before = counters["stats"]["unique_graphs"]
    (old, old_next), (new, new_next) = run(**LEGACY), run(compile_mode="default", sync_every=4)
    assert counters["stats"]["unique_graphs"] > compiled_before  # the decode step did compile
    assert 0 < old.ended.sum() < len(old) and len(set(old.completion_lengths.tolist())) > 3
    assert torch.equal(new.completion_ids, old.completion_ids)
    assert torch.equal(new.completion_lengths, old.completion_lengths)
    assert torch.equal(new.completion_mask, old.completion_mask) and torch.equal(new.ended, old.ended)
    assert torch.allclose(new.logprobs, old.logprobs, atol=1e-5)
    assert torch.equal(new_next, old_next)
    # Completions after a stop hold pad (== eos here) and are masked out.
    assert (new.completion_ids[~new.completion_mask] == 2).all()


def test_compiled_step_compiles_once_for_rollouts_of_different_prompt_widths():
    """A training run's rollouts differ in prompt width and in when rows stop; the compiled decode
    step must not compile again for each (on a GPU every compilation costs seconds, and the compiler's
    recompile limit would silently fall back to eager). Prompts are padded to the same bucket width
    and rows are not compacted, so the second and third rollouts reuse the first one's compilation,
    and each samples the eager engine's tokens for the same seed."""
    from torch._dynamo.utils import counters

    model = tiny_llama()
    cfg = SamplingConfig(max_new_tokens=12, stop_token_ids=(2, 3, 5, 7))
    batches = [
        [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22], [30]],  # width 5
        [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14], [15, 16], [17, 18, 19]],  # width 9
        [[40, 41], [42], [43, 44, 45], [46]],  # width 3
    ]
    graphs = []
    for rows in batches:
        ids, mask = left_pad(rows, pad=2)

        def run(ids, mask, **options):
            g = torch.Generator().manual_seed(3)
            return generate(model, ids, mask, cfg, pad_token_id=2, num_samples=2, generator=g, **options)

        eager, compiled = run(ids, mask, **LEGACY), run(ids, mask, compile_mode="default")
        graphs.append(counters["stats"]["unique_graphs"])
        assert torch.equal(compiled.completion_ids, eager.completion_ids)
        assert torch.equal(compiled.completion_lengths, eager.completion_lengths)
        assert torch.allclose(compiled.logprobs, eager.logprobs, atol=1e-5)
        # The Rollout keeps the caller's prompt width: the bucket padding is internal.
        assert torch.equal(compiled.prompt_ids, eager.prompt_ids)
        assert torch.equal(compiled.prompt_mask, eager.prompt_mask)
    assert graphs[1] == graphs[0] and graphs[2] == graphs[0]


def test_repetition_penalty_is_transformers_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    from posttrain.rollout import apply_repetition_penalty, seen_tokens

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    # tokens 0 and 1 are in the row (token 2 only in its left padding, masked out): θ = 2 halves
    # the positive logit of token 0 and doubles the negative one of token 1.
    seen = seen_tokens(torch.tensor([[2, 0, 1]]), torch.tensor([[False, True, True]]), 4)
    assert seen.tolist() == [[True, True, False, False]]
    assert apply_repetition_penalty(logits, seen, 2.0).tolist() == [[1.0, -2.0, 0.5, 3.0]]
    assert apply_repetition_penalty(logits, seen, 0.5).tolist() == [[4.0, -0.5, 0.5, 3.0]]
    hf = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([[0, 1]]), logits.clone())
    assert torch.equal(apply_repetition_penalty(logits, seen, 2.0), hf)


class TwoFavourites(ScriptedLM):
    """Every position's logits: 3.0 on token 5, 2.0 on token 6, 0 elsewhere."""

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=False,
        cache_position=None,
    ):
        # ScriptedLM's signature: the static engines read it (cache_position, on transformers 4.x)
        out = super().forward(input_ids, attention_mask, position_ids, past_key_values, use_cache, cache_position)
        out.logits = torch.zeros(*input_ids.shape, V)
        out.logits[..., 5], out.logits[..., 6] = 3.0, 2.0
        return out


@pytest.mark.parametrize("engine", ENGINES)
def test_repetition_penalty_steers_decoding_but_not_the_recorded_logprobs(engine):
    ids, mask = left_pad([[5], [7, 6], [3]], pad=0)
    greedy = SamplingConfig(max_new_tokens=4, do_sample=False)
    plain = generate(TwoFavourites(), ids, mask, greedy, pad_token_id=0, **engine)
    assert plain.completion_ids.tolist() == [[5] * 4] * 3
    penalized = SamplingConfig(max_new_tokens=4, do_sample=False, repetition_penalty=2.0)
    r = generate(TwoFavourites(), ids, mask, penalized, pad_token_id=0, **engine)
    # Row 0 holds 5: 3/2 = 1.5 < 2 picks 6, then both are seen (1.5 > 1.0): 5, 5, ...
    # Row 1 holds 6: 3 > 2/2 picks 5, then 1.5 > 1.0: 5, ... Row 2 holds neither: 5 (3 > 2), then
    # 6 (1.5 < 2), then 5, 5 as row 0.
    assert r.completion_ids.tolist() == [[6, 5, 5, 5], [5, 5, 5, 5], [5, 6, 5, 5]]
    # The recorded logprobs are those of the raw logits (what training recomputes).
    raw = torch.log_softmax(
        torch.zeros(V).index_fill(0, torch.tensor([5]), 3.0).index_fill(0, torch.tensor([6]), 2.0), -1
    )
    assert torch.allclose(r.logprobs, raw[r.completion_ids])
    # Sampling draws from softmax(penalized logits): with θ = 100 the seen token 5 falls from
    # e^3 / (e^3 + e^2 + 14) = 0.48 to e^0.03 / (e^0.03 + e^2 + 14) = 0.05 of the draws.
    many, many_mask = left_pad([[5]] * 256, pad=0)
    for theta, low, high in ((1.0, 0.38, 0.58), (100.0, 0.0, 0.12)):
        g = torch.Generator().manual_seed(0)
        cfg = SamplingConfig(max_new_tokens=1, repetition_penalty=theta)
        r = generate(TwoFavourites(), many, many_mask, cfg, pad_token_id=0, generator=g, **engine)
        assert low < (r.completion_ids == 5).float().mean() < high


@pytest.mark.parametrize("engine", ENGINES)
def test_min_p_keeps_tokens_within_a_ratio_of_the_most_likely(engine):
    class Fixed(ScriptedLM):
        def forward(self, input_ids, **kw):
            out = super().forward(input_ids, **kw)
            out.logits = torch.linspace(4.0, 0.0, V).expand(*input_ids.shape, V).clone()
            return out

    ids, mask = left_pad([[1]] * 64, pad=0)
    g = torch.Generator().manual_seed(0)
    # Logits step down by 4/15: p_i / p_0 = exp(-4i/15) >= 0.5 for i <= 2 (ln 2 = 0.69 > 0.53, < 0.8).
    r = generate(Fixed(), ids, mask, SamplingConfig(max_new_tokens=3, min_p=0.5), pad_token_id=0, generator=g, **engine)
    assert set(r.completion_ids.unique().tolist()) == {0, 1, 2}
    both = SamplingConfig(max_new_tokens=3, min_p=0.5, top_k=2)
    r = generate(Fixed(), ids, mask, both, pad_token_id=0, generator=g, **engine)
    assert set(r.completion_ids.unique().tolist()) == {0, 1}
    full = torch.log_softmax(torch.linspace(4.0, 0.0, V), -1)
    assert torch.allclose(r.logprobs, full[r.completion_ids])


def test_static_cache_under_bf16_autocast_samples_the_dynamic_engines_tokens(monkeypatch):
    """bf16=True over float32 weights runs the rollout under autocast: the keys reach the cache in
    float32 (rotary embeddings), the values in bf16. transformers 5.17 allocates a lazy StaticCache
    layer's values in the keys' dtype, so the static engine failed there on its first decode step
    (index_copy_ between float32 and bf16, seen on an H200 with cache_implementation="static"). The
    allocation of those releases is reproduced here on every release that allocates lazily."""
    from transformers import cache_utils

    layer_class = getattr(cache_utils, "StaticLayer", None)
    if layer_class is not None and hasattr(layer_class, "lazy_initialization"):
        allocate = layer_class.lazy_initialization

        def allocate_both_in_key_dtype(self, key_states, value_states):
            allocate(self, key_states, value_states.to(key_states.dtype))

        monkeypatch.setattr(layer_class, "lazy_initialization", allocate_both_in_key_dtype)

    model = tiny_llama()
    ids, mask = left_pad([[5, 6, 7, 8, 9], [11, 12], [20, 21, 22], [30]], pad=2)
    cfg = SamplingConfig(max_new_tokens=12, stop_token_ids=(2, 3, 5, 7))
    runs = []
    for options in ({}, {"cache_implementation": "static"}):
        g = torch.Generator().manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs.append(generate(model, ids, mask, cfg, pad_token_id=2, num_samples=2, generator=g, **options))
    dynamic, static = runs
    assert static.completion_ids.shape == (8, 12)
    assert torch.equal(static.completion_ids, dynamic.completion_ids)
    assert torch.equal(static.completion_lengths, dynamic.completion_lengths)
    assert torch.allclose(static.logprobs, dynamic.logprobs, atol=1e-2)


def record_mask_dims(model: nn.Module) -> list[int]:
    """The attention mask's number of dimensions at every forward (0: no mask)."""
    dims: list[int] = []

    def record(mod, args, kwargs):
        mask = kwargs["attention_mask"]
        dims.append(0 if mask is None else mask.dim())

    model.register_forward_pre_hook(record, with_kwargs=True)
    return dims


@pytest.mark.parametrize("builder", [tiny_llama, tiny_neox])
@pytest.mark.parametrize("padded", [True, False])
def test_prepared_decode_mask_gives_the_logits_of_the_padding_mask(builder, padded, monkeypatch):
    """The decode steps get the (rows, 1, 1, keys) bool mask transformers builds from the 2-D one
    (no mask when no row holds padding, as transformers does): with shared prefill, compaction and
    rows stopping mid-batch, tokens, masks, log-probabilities and entropies are bitwise those of the
    2-D mask, so the KL of a policy against its own copy stays exactly 0."""
    from posttrain import compat

    model = builder()
    dims = record_mask_dims(model)
    rows = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22], [30], [40, 41, 42, 43]]
    ids, mask = left_pad(rows if padded else [row[:1] for row in rows], pad=2)
    cfg = SamplingConfig(max_new_tokens=20, stop_token_ids=(2, 3, 5, 7))

    def run():
        dims.clear()
        g = torch.Generator().manual_seed(11)
        r = generate(model, ids, mask, cfg, pad_token_id=2, num_samples=2, generator=g, return_entropy=True)
        return r, list(dims)

    prepared, prepared_dims = run()
    monkeypatch.setattr(compat, "takes_prepared_decode_mask", lambda model, total_length: False)
    plain, plain_dims = run()
    assert prepared_dims[0] == 2 and set(plain_dims) == {2}  # the prefill keeps the 2-D mask
    assert set(prepared_dims[1:]) == ({4} if padded else {0}) and len(plain_dims) == len(prepared_dims)
    assert 0 < plain.ended.sum() < len(plain)  # rows stopped mid-batch (compaction ran)
    for field in ("completion_ids", "completion_mask", "logprobs", "entropy"):
        assert torch.equal(getattr(prepared, field), getattr(plain, field)), field


def test_prepared_decode_mask_only_where_the_mask_is_plain_causal():
    import transformers

    from posttrain.compat import takes_prepared_decode_mask

    assert takes_prepared_decode_mask(tiny_llama(), 100)
    assert takes_prepared_decode_mask(tiny_neox(), 100)
    eager = tiny_llama()
    eager.config._attn_implementation = "eager"  # eager attention adds a float mask, not a bool one
    assert not takes_prepared_decode_mask(eager, 100)
    # A sliding window shorter than prompt + completion masks more than padding; one that is
    # switched off (Qwen2's use_sliding_window=False) or longer than the sequence does not.
    window = tiny_llama()
    window.config.sliding_window = 64
    assert takes_prepared_decode_mask(window, 64) and not takes_prepared_decode_mask(window, 65)
    window.config.use_sliding_window = False
    assert takes_prepared_decode_mask(window, 65)
    chunked = tiny_llama()
    chunked.config.attention_chunk_size = 32
    assert not takes_prepared_decode_mask(chunked, 33)
    hybrid = tiny_llama()
    hybrid.config.layer_types = ["full_attention", "linear_attention"]
    assert not takes_prepared_decode_mask(hybrid, 10)
    # Bloom builds its ALiBi biases from the 2-D mask.
    torch.manual_seed(0)
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(hidden_size=32, n_layer=1, n_head=4, vocab_size=64))
    bloom.config._attn_implementation = "sdpa"
    assert not takes_prepared_decode_mask(bloom, 10)
    assert not takes_prepared_decode_mask(ScriptedLM(), 10)  # a model outside transformers
    # FSDP2's fully_shard makes the model an instance of a subclass defined outside transformers.
    sharded = tiny_llama()
    sharded.__class__ = type("FSDPLlamaForCausalLM", (type(sharded),), {"__module__": "torch.distributed.fsdp"})
    assert takes_prepared_decode_mask(sharded, 100)
