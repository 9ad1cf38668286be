"""Tokens/s of posttrain.rollout.generate vs transformers' model.generate() on the same model and batch.

Default model: a randomly initialised GPTNeoX shaped like pythia-14m (hidden 128, 6 layers, 4 heads),
vocab 6815, batch 16, ~15-token left-padded prompts, 53 new tokens, no stop token (random weights
would stop at random places, and both engines must do the same amount of work), fp32, 2 threads.
Both engines sample with temperature 1 and the KV cache; ours also records per-token logprobs.
Built from a config, so nothing touches the network.

    PYTHONPATH=src python benchmarks/bench_rollout.py [--bf16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from posttrain.rollout import SamplingConfig, generate, generation_mode


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    config = GPTNeoXConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        vocab_size=args.vocab,
        max_position_embeddings=2048,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    model = GPTNeoXForCausalLM(config).to(torch.bfloat16 if args.bf16 else torch.float32).eval()
    lengths = torch.randint(args.prompt_len - 4, args.prompt_len + 1, (args.batch,))
    P = int(lengths.max())
    mask = torch.arange(P)[None, :] >= (P - lengths)[:, None]  # left padding
    ids = torch.randint(1, args.vocab, (args.batch, P)).masked_fill(~mask, 0)
    return model, ids, mask


def time_it(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=15)
    parser.add_argument("--new-tokens", type=int, default=53)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=6815)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, ids, mask = build(args)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0)
    generator = torch.Generator().manual_seed(0)

    def ours() -> None:
        with generation_mode(model):
            r = generate(model, ids, mask, sampling, pad_token_id=0, generator=generator)
        assert r.completion_ids.size(1) == args.new_tokens

    def hf() -> None:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask.long(),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=0,
                eos_token_id=None,
            )
        assert out.size(1) == ids.size(1) + args.new_tokens

    tokens = args.batch * args.new_tokens
    t_ours = time_it(ours, args.repeats)
    t_hf = time_it(hf, args.repeats)
    dtype = "bf16" if args.bf16 else "fp32"
    print(
        f"model hidden={args.hidden} layers={args.layers} vocab={args.vocab} {dtype}, batch={args.batch}, "
        f"prompt~{args.prompt_len}, new={args.new_tokens}, threads={args.threads}"
    )
    print(f"posttrain.generate : {tokens / t_ours:9.0f} tok/s  ({t_ours * 1e3:.1f} ms)")
    print(f"model.generate()   : {tokens / t_hf:9.0f} tok/s  ({t_hf * 1e3:.1f} ms)")
    print(f"speed-up           : {t_hf / t_ours:.2f}x")


if __name__ == "__main__":
    main()
