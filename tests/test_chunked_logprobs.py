"""The chunked LM head of the online trainers (scoring.completion_forward / forward_logprobs /
forward_full_kl): log-probs, entropy, the full-vocabulary KL and their gradients equal the
full-logits path; models that scale or softcap their logits; the fallback for a head we do not
reproduce; and no (batch, length, vocab) float32 tensor is ever built (recorded, not assumed)."""

from __future__ import annotations

import contextlib
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.advantages import full_kl
from posttrain.ops import chunk_rows, head_chunk_rows, logprobs_and_entropy
from posttrain.rollout import Rollout
from posttrain.scoring import (
    batched_completion_logprobs,
    completion_forward,
    completion_logprobs,
    forward_full_kl,
    forward_logprobs,
)

CHUNK = 3  # rows per block: every rollout below spans several blocks


def tiny_llama(vocab: int = 97, seed: int = 0, cls: type = LlamaForCausalLM, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **overrides,
    )
    return cls(config).float()


def random_rollout(B: int, P: int, T: int, vocab: int, seed: int = 0) -> Rollout:
    """Left-padded prompts of 2..P tokens, right-padded completions of 1..T tokens (ragged)."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(2, P + 1, (B,), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    prompt_mask = torch.arange(P)[None, :] >= (P - prompt_len)[:, None]
    completion_mask = torch.arange(T)[None, :] < lengths[:, None]
    prompt_ids = torch.randint(0, vocab, (B, P), generator=g).masked_fill(~prompt_mask, 0)
    completion_ids = torch.randint(0, vocab, (B, T), generator=g).masked_fill(~completion_mask, 0)
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        completion_lengths=lengths,
        ended=torch.zeros(B, dtype=torch.bool),
        logprobs=None,
        entropy=None,
        pad_token_id=0,
    )


def grads(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a: dict, b: dict, tol: float = 1e-6) -> None:
    """Equal within tol relative to each gradient's largest entry (float32 rounding of sums in another order)."""
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        scale = max(1.0, float(b[name].abs().max()))
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=tol * scale, msg=name)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_logprobs_entropy_and_gradients_equal_full_logits(entropy_grad):
    model = tiny_llama()
    rollout = random_rollout(B=4, P=5, T=6, vocab=97)
    weights = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))

    def run(full: bool):
        fwd = completion_forward(model, rollout, full_logits=full, chunk_tokens=CHUNK)
        assert fwd.chunked is not full
        lp, ent = forward_logprobs(fwd, temperature=0.7, with_entropy=True, entropy_grad=entropy_grad)
        return lp, ent, grads(model, (weights * lp).sum() + (weights * ent).sum())

    lp_full, ent_full, g_full = run(full=True)
    lp, ent, g = run(full=False)
    torch.testing.assert_close(lp, lp_full, rtol=0, atol=1e-6)
    # An entropy sums V terms; the chunk's and the whole block's reductions may vectorize differently (AVX2
    # against AVX-512), a few float32 ulps of a value near log V.
    torch.testing.assert_close(ent, ent_full, rtol=1e-6, atol=1e-6)
    assert_same_grads(g, g_full)
    # 0 off the completion mask, real values (log-probs < 0, entropy > 0) on it.
    assert bool((lp[~rollout.completion_mask] == 0).all()) and bool((lp[rollout.completion_mask] < 0).all())
    assert bool((ent[rollout.completion_mask] > 0).all())
    # Few positions × a small vocabulary: the default builds the logits whole (no recompute).
    assert not completion_forward(model, rollout).chunked
    # Without entropy, the same log-probs bitwise (one kernel for both).
    lp_only, none = completion_logprobs(model, rollout, temperature=0.7, chunk_tokens=CHUNK)
    assert none is None and torch.equal(lp_only.detach(), lp.detach())
    # The no-grad batched form (reference / old log-probs) too.
    batched, _ = batched_completion_logprobs(model, rollout, batch_size=3, temperature=0.7, chunk_tokens=CHUNK)
    torch.testing.assert_close(batched, lp_full.detach(), rtol=0, atol=1e-6)


def test_chunked_full_kl_and_its_gradient_equal_full_logits():
    policy, ref = tiny_llama(seed=0), tiny_llama(seed=1).requires_grad_(False)
    rollout = random_rollout(B=3, P=4, T=7, vocab=97, seed=2)

    def run(full: bool):
        cur = completion_forward(policy, rollout, full_logits=full, chunk_tokens=CHUNK)
        with torch.no_grad():
            other = completion_forward(ref, rollout, full_logits=full, chunk_tokens=CHUNK)
        kl = forward_full_kl(cur, other, temperature=1.3)
        return kl, grads(policy, kl.sum())

    kl_full, g_full = run(full=True)
    kl, g = run(full=False)
    # The full path is advantages.full_kl on the model's own logits.
    with torch.no_grad():
        logits = completion_forward(policy, rollout, full_logits=True)
        ref_logits = completion_forward(ref, rollout, full_logits=True)
        want = logits.pad(full_kl(logits.logits, ref_logits.logits, logits.mask, temperature=1.3))
    torch.testing.assert_close(kl_full.detach(), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(kl, kl_full, rtol=0, atol=1e-6)
    assert_same_grads(g, g_full)
    assert bool((kl[rollout.completion_mask] > 0).all())


def test_reference_full_kl_with_a_lora_adapted_lm_head_runs_the_reference_head_without_adapters():
    peft = pytest.importorskip("peft")
    from posttrain.trainers.online import reference_full_kl

    base = tiny_llama(seed=3)
    policy = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "lm_head"]))
    with torch.no_grad():  # LoRA B starts at 0 (no effect): move it so the adapter changes the logits
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    rollout = random_rollout(B=3, P=4, T=5, vocab=97, seed=4)
    run = SimpleNamespace(config=SimpleNamespace(local_rollout_forward_batch_size=2), autocast=contextlib.nullcontext)
    ops_rows = chunk_rows(97, None)
    assert 2 * 5 <= ops_rows  # default blocks: one block, so force several through the ops default below
    import posttrain.ops as ops

    saved = ops.DEFAULT_CHUNK_ELEMENTS
    ops.DEFAULT_CHUNK_ELEMENTS = 97 * 2  # 2 rows per block
    try:
        got = reference_full_kl(run, policy, None, rollout, temperature=1.0)
        assert completion_forward(policy, rollout).chunked
    finally:
        ops.DEFAULT_CHUNK_ELEMENTS = saved
    with torch.no_grad():
        cur = completion_forward(policy, rollout, full_logits=True)
        with policy.disable_adapter():
            ref = completion_forward(policy, rollout, full_logits=True)
        want = cur.pad(full_kl(cur.logits, ref.logits, cur.mask))
    assert float(want[rollout.completion_mask].min()) > 1e-4  # the adapter matters
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _scaled_models():
    from transformers import CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM

    small = dict(
        vocab_size=97,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    yield "gemma2 softcap", lambda: Gemma2ForCausalLM(Gemma2Config(**small, head_dim=8, final_logit_softcapping=0.5))
    yield "cohere logit_scale", lambda: CohereForCausalLM(CohereConfig(**small, logit_scale=3.0))
    try:
        from transformers import GraniteConfig, GraniteForCausalLM
    except ImportError:  # pragma: no cover - Granite is in every supported transformers
        return
    yield "granite logits_scaling", lambda: GraniteForCausalLM(GraniteConfig(**small, logits_scaling=0.25))


@pytest.mark.parametrize("name,build", list(_scaled_models()), ids=[n for n, _ in _scaled_models()])
def test_scaled_and_softcapped_heads_are_reproduced_without_fallback(name, build):
    torch.manual_seed(5)
    model = build().float()
    rollout = random_rollout(B=3, P=4, T=5, vocab=97, seed=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        fwd = completion_forward(model, rollout, chunk_tokens=CHUNK)
    assert fwd.chunked, name
    lp, ent = forward_logprobs(fwd, with_entropy=True)
    full = completion_forward(model, rollout, full_logits=True)
    lp_full, ent_full = forward_logprobs(full, with_entropy=True)
    torch.testing.assert_close(lp, lp_full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, ent_full, rtol=1e-6, atol=1e-6)
    # The scaling matters: without it the log-probs would differ.
    raw = torch.log_softmax(model.get_output_embeddings()(fwd.states).float(), -1)
    raw = raw.gather(-1, fwd.targets[..., None])[..., 0]
    assert float((fwd.pad(raw) - lp_full).detach().abs().max()) > 1e-2


class DoubledLogits(LlamaForCausalLM):
    """A model that changes its logits after the LM head in a way posttrain does not know about."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, logits_to_keep=0, **kwargs):
        out = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
        out.logits = out.logits * 2.0
        return out


def test_a_head_that_does_not_reproduce_the_logits_falls_back_with_one_warning():
    model = tiny_llama(cls=DoubledLogits)
    rollout = random_rollout(B=3, P=4, T=5, vocab=97, seed=7)
    with pytest.warns(UserWarning, match="DoubledLogits") as record:
        lp, _ = completion_logprobs(model, rollout, chunk_tokens=CHUNK)
    assert len([w for w in record if "DoubledLogits" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checked once per model: no second warning
        fwd = completion_forward(model, rollout, chunk_tokens=CHUNK)
    assert not fwd.chunked
    # The fallback gives the model's own (doubled) logits' log-probs.
    with torch.no_grad():
        seq = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
        mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=seq, attention_mask=mask, position_ids=positions).logits
        P = rollout.prompt_ids.size(1)
        want = torch.log_softmax(logits[:, P - 1 : -1].float(), -1).gather(-1, rollout.completion_ids[..., None])[
            ..., 0
        ]
    torch.testing.assert_close(lp, want.masked_fill(~rollout.completion_mask, 0.0), rtol=0, atol=1e-5)


class VocabTensors(TorchDispatchMode):
    """Records the row count (elements / vocab) of every float32 tensor an op creates whose last
    dimension is the vocabulary (forward and backward)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.size(-1) == self.vocab and t.dtype == torch.float32:
                if t.numel() // self.vocab > 1 or t.dim() > 1:
                    self.rows.append((t.numel() // self.vocab, str(func)))
        return out


def test_no_batch_by_length_by_vocab_float32_tensor_is_built():
    V, B, T = 50_000, 8, 64
    model = tiny_llama(vocab=V, seed=8)
    rollout = random_rollout(B=B, P=6, T=T, vocab=V, seed=9)
    n = int(rollout.completion_mask.sum())
    # A block of the LM head is head_chunk_rows(V) = 332 rows here (64 MiB of float32 logits).
    limit = head_chunk_rows(V, None)
    assert B * T > limit and n > limit
    with VocabTensors(V) as seen:
        with torch.no_grad():
            batched_completion_logprobs(model, rollout, batch_size=B, with_entropy=True)
        lp, ent = completion_logprobs(model, rollout, with_entropy=True)
        lp.sum().backward()
    assert seen.rows, "the recorder saw no vocabulary tensor at all"
    biggest = max(seen.rows)
    assert biggest[0] <= limit, f"a float32 tensor of {biggest[0]} × vocab rows was built by {biggest[1]}"
    # The recorder does catch the full-logits path: (B·T', V) float32 there.
    with VocabTensors(V) as full:
        with torch.no_grad():
            forward_logprobs(completion_forward(model, rollout, full_logits=True))
    assert max(full.rows)[0] >= B * T


class NewStorages(TorchDispatchMode):
    """Records the storages of the tensors of `shape` that ops create (views of one storage count once)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape, self.storages = torch.Size(shape), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.shape == self.shape:
                self.storages.setdefault(t.untyped_storage().data_ptr(), str(func))
        return out


def test_backward_of_the_chunked_log_softmax_builds_the_logits_gradient_once():
    """Whole (n, V) logits cut into row blocks (the plain path): backward assembles one (n, V)
    gradient, instead of one zero-filled (n, V) tensor per block summed together."""
    V, n = 40, 12
    logits = torch.randn(n, V, requires_grad=True)
    index = torch.randint(0, V, (n,))
    lp, _ = logprobs_and_entropy(logits, index, chunk_tokens=4)  # 3 blocks of 4 rows
    with NewStorages((n, V)) as seen:
        lp.sum().backward()
    assert len(seen.storages) == 1, seen.storages
    # d/dlogits of Σ_i log softmax(logits_i)[index_i] = onehot(index_i) − softmax(logits_i)
    want = torch.nn.functional.one_hot(index, V).float() - logits.detach().softmax(-1)
    torch.testing.assert_close(logits.grad, want)


class _VocabBuffers(TorchDispatchMode):
    """Counts the new buffers (not views, not in-place results) ops create whose last dimension is `vocab`."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.created = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        if (
            isinstance(out, torch.Tensor)
            and out.dim() == 2
            and out.size(-1) == self.vocab
            and out.untyped_storage().data_ptr() not in inputs
        ):
            self.created += 1
        return out


def test_entropy_is_ln_v_for_uniform_logits_and_the_detached_path_builds_one_vocab_buffer():
    from posttrain.ops import _entropy

    # Uniform over V = 4: H = −Σ ¼ ln ¼ = ln 4 on every row.
    uniform = torch.log_softmax(torch.zeros(3, 4), dim=-1)
    torch.testing.assert_close(_entropy(uniform, grad=False), torch.full((3,), 1.3862943611198906))
    # p = (½, ¼, ¼): H = ½ ln 2 + 2 · ¼ ln 4 = 1.5 ln 2.
    skewed = torch.tensor([[0.5, 0.25, 0.25]]).log()
    torch.testing.assert_close(_entropy(skewed, grad=False), torch.tensor([1.5 * 0.6931471805599453]))

    logp = torch.log_softmax(torch.randn(6, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    with_grad = _entropy(logp.clone().requires_grad_(), grad=True)
    leaf = logp.clone().requires_grad_()
    with _VocabBuffers(50) as mode:
        detached = _entropy(leaf, grad=False)
    assert mode.created == 1  # exp's output, then the product written into it
    with torch.no_grad(), _VocabBuffers(50) as mode:
        under_no_grad = _entropy(logp, grad=True)
    assert mode.created == 1
    assert torch.equal(with_grad.detach(), detached) and torch.equal(detached, under_no_grad)
    assert with_grad.requires_grad and not detached.requires_grad
