"""Decode steps under bf16 autocast: one autocast context around the whole loop (posttrain's rollout)
against one per forward call (what a model whose `forward` accelerate wrapped in autocast does inside
`generate()`). Leaving the outermost autocast context empties autocast's weight-cast cache, so the
second form casts every weight to bf16 again at every token.

    PYTHONPATH=src python benchmarks/bench_autocast_decode.py [--size 70m] [--rows 16] [--tokens 53]

Uses ../shared/bench's policy-<size> artifact; prints ms per decode step, two interleaved rounds.
"""

import argparse
import contextlib
import os
import time

import torch
from transformers import AutoModelForCausalLM

ART = os.environ.get("ART", os.path.expanduser("~/.cache/posttrain-bench/artifacts"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="70m")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=14)
    parser.add_argument("--tokens", type=int, default=53)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(f"{ART}/policy-{args.size}")
    n, p, t = args.rows, args.prompt, args.tokens
    ids = torch.randint(0, model.config.vocab_size, (n, p))
    mask = torch.ones(n, p + t, dtype=torch.long)
    pos = torch.arange(p + t)[None].expand(n, -1)

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    def decode(outer: bool) -> None:
        with torch.no_grad(), autocast() if outer else contextlib.nullcontext():
            with autocast():
                out = model(input_ids=ids, attention_mask=mask[:, :p], position_ids=pos[:, :p], use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1)
            for i in range(t):
                with autocast():
                    out = model(
                        input_ids=tok[:, None],
                        attention_mask=mask[:, : p + i + 1],
                        position_ids=pos[:, p + i : p + i + 1],
                        past_key_values=cache,
                        use_cache=True,
                    )
                cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1)

    for outer in (True, False, True, False):
        decode(outer)  # warm-up
        start = time.perf_counter()
        for _ in range(args.repeats):
            decode(outer)
        ms = (time.perf_counter() - start) / args.repeats / t * 1000
        where = "one autocast context around the loop" if outer else "one autocast context per forward"
        print(f"{args.size} bf16, {where}: {ms:.2f} ms per decode step")


if __name__ == "__main__":
    main()
