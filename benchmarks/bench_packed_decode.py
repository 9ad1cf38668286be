"""Packed decode weights (posttrain.cpu_linear.packed_weights): a rollout with and without them.

Loads a saved causal LM (default: the TRL-comparison artifacts' policy), switches its linear layers as the
online trainers do (`cpu_linear.linear_kernels`, POSTTRAIN_CPU_LINEAR's mode), and times
`rollout.generate` on the bench prompts with packing on and off in interleaved rounds. Prints each
layer shape's calibration (`Decision`), the median wall time per rollout, and whether both sampled the
same tokens. Run it alone on the machine (two torch processes on 2 cores slow each other down).

    A=~/.cache/posttrain-bench/artifacts
    PYTHONPATH=src python benchmarks/bench_packed_decode.py --model $A/policy-70m --prompts $A/prompts
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a saved causal LM folder")
    parser.add_argument("--prompts", required=True, help="a save_to_disk prompt dataset (column 'prompt')")
    parser.add_argument("--batch", type=int, default=8, help="prompts per rollout")
    parser.add_argument("--k", type=int, default=2, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=53)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--mode", default="auto", choices=["auto", "onednn"])
    args = parser.parse_args()

    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain import cpu_linear
    from posttrain.rollout import SamplingConfig, generate

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model).float().eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    prompts = load_from_disk(args.prompts)
    prompts = prompts["train"] if hasattr(prompts, "keys") else prompts
    texts = list(prompts["prompt"][: args.batch])
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"].bool()
    sampling = SamplingConfig(max_new_tokens=args.new_tokens)
    can_pack = cpu_linear.can_pack

    def rollout(packed: bool) -> tuple[float, torch.Tensor]:
        cpu_linear.can_pack = can_pack if packed else (lambda: False)
        try:
            generator = torch.Generator().manual_seed(1)
            start = time.perf_counter()
            out = generate(model, ids, mask, sampling, pad_token_id=tokenizer.pad_token_id, num_samples=args.k,
                           generator=generator)  # fmt: skip
            return time.perf_counter() - start, out.completion_ids
        finally:
            cpu_linear.can_pack = can_pack

    times: dict[bool, list[float]] = {True: [], False: []}
    with cpu_linear.linear_kernels([model], mode=args.mode) as switched:
        decisions = {}
        for layer in switched:
            decisions.setdefault(tuple(layer.weight.shape), layer.__dict__[cpu_linear.KERNELS])
        for shape, decision in decisions.items():
            print(f"{shape[1]} -> {shape[0]}: {decision}")
        tokens = {packed: rollout(packed)[1] for packed in (True, False)}  # warm: traces, first touches
        for _ in range(args.repeats):
            for packed in (True, False):
                times[packed].append(rollout(packed)[0])
    rows = ids.size(0) * args.k
    for packed in (True, False):
        median = statistics.median(times[packed])
        print(
            f"{'packed' if packed else 'unpacked'}: {median * 1e3:.1f} ms per rollout of {rows} rows x "
            f"{args.new_tokens} tokens (median of {args.repeats})"
        )
    print("same tokens:", torch.equal(tokens[True], tokens[False]))


if __name__ == "__main__":
    main()
