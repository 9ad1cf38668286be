"""Decode tokens/s of each rollout-engine variant against `model.generate()` on one GPU, bf16, on the
0.5B-shaped model (Qwen2.5-0.5B's config, random weights), with the decode roofline next to each.

    python benchmarks/gpu_decode.py [--prompts 8 --k 4 --prompt_len 64 --new_tokens 128] [--out result.json]
    python benchmarks/gpu_decode.py --dry-run     # tiny model on CPU or GPU: checks the script runs

Variants (`posttrain.rollout.generate` options; `decode_engine` maps a trainer's `cache_implementation`):
- dynamic: the default engine (transformers' DynamicCache, shared prompt prefill, compaction);
- dynamic, sync_every=8: the stop check (a device-to-host sync) every 8 tokens instead of every token;
- static: a preallocated StaticCache, eager;
- static + compiled (reduce-overhead): the one-token decode forward under torch.compile's
  "reduce-overhead" mode (CUDA graphs) — what `cache_implementation="static"` selects on CUDA;
- model.generate(): transformers' own sampler, dynamic cache, and with cache_implementation="static"
  (which compiles its decode step itself on CUDA).

By default no stop token is set, so every row decodes all `new_tokens` tokens and every variant does
the same work. `--stop_frac F` makes the first F of the vocabulary stop tokens (random weights draw one
with probability ≈ F per step), so rows end at scattered steps as trained policies' do: compaction then
changes the batch size mid-decode, which a compiled step meets as new shapes. model.generate() is left
out of that setting (its token count would differ).
Each variant's first call (compilation included for the compiled ones) is timed on its own; then the
variants run `--repeats` rounds, interleaved, and the median is reported. Tokens/s = rows × new_tokens /
seconds (prefill included), with CUDA synchronisation. Roofline tokens/s = rows × HBM bandwidth / bytes of
the weights (every decode step reads all weights once; KV-cache reads left out: an upper bound). The
results are printed and written as JSON after every variant, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any

for _var, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_var, _value)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_smoke import QWEN2_05B, TINY, device_peaks  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {
    "posttrain dynamic (default)": {},
    "posttrain dynamic, sync_every=8": {"sync_every": 8},
    "posttrain static, eager": {"cache_implementation": "static"},
    "posttrain static + compiled (reduce-overhead)": {
        "cache_implementation": "static",
        "compile_mode": "reduce-overhead",
    },
}
HF_VARIANTS: dict[str, dict[str, Any]] = {
    "model.generate() dynamic": {},
    "model.generate() static (compiled by transformers)": {"cache_implementation": "static"},
}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = dict(TINY, vocab_size=512) if args.dry_run else dict(QWEN2_05B)
    torch.manual_seed(0)
    config = Qwen2Config(**shape, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    model = Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.prompts,))
    P = int(lengths.max())
    mask = torch.arange(P)[None, :] >= (P - lengths)[:, None]  # left padding
    ids = torch.randint(1, config.vocab_size, (args.prompts, P)).masked_fill(~mask, 0)
    return model, ids.to(device), mask.to(device)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--k", type=int, default=4, help="completions per prompt (rows = prompts × k)")
    parser.add_argument("--prompt_len", type=int, default=64)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stop_frac", type=float, default=0.0, help="fraction of the vocabulary that stops a row")
    parser.add_argument("--variants", default=None, help="comma-separated variant names (default: all)")
    parser.add_argument("--hbm_gbps", type=float, default=None)
    parser.add_argument("--peak_tflops", type=float, default=None)
    parser.add_argument("--dry-run", dest="dry_run", action="store_true", help="tiny model, short decode")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.prompts, args.k, args.prompt_len, args.new_tokens, args.repeats = 2, 2, 8, 8, 1
    warnings.filterwarnings("ignore")
    from posttrain.rollout import SamplingConfig, generate, generation_mode

    peaks = device_peaks(args)
    model, ids, mask = build(args)
    rows, device = args.prompts * args.k, ids.device
    stop_ids = tuple(range(1, 1 + int(args.stop_frac * model.config.vocab_size)))
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0, stop_token_ids=stop_ids)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def ours(options: dict[str, Any]):
        def run() -> int:
            with generation_mode(model):
                generator = torch.Generator(device=device).manual_seed(0)
                r = generate(
                    model, ids, mask, sampling, pad_token_id=0, num_samples=args.k, generator=generator, **options
                )
            return int(r.completion_mask.sum())

        return run

    def hf(options: dict[str, Any]):
        def run() -> int:
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
                    num_return_sequences=args.k,
                    pad_token_id=0,
                    **options,
                )
            return int(out.shape[0] * (out.shape[1] - ids.shape[1]))

        return run

    engines = {name: ours(o) for name, o in VARIANTS.items()}
    if not stop_ids:
        engines.update({name: hf(o) for name, o in HF_VARIANTS.items()})
    if args.variants:
        engines = {n: f for n, f in engines.items() if n in args.variants.split(",")}
    results: dict[str, Any] = {
        "device": peaks,
        "torch": torch.__version__,
        "model": "tiny Qwen2 (dry run)" if args.dry_run else "Qwen2.5-0.5B shape, random weights",
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "weight_bytes": weight_bytes,
        "rows": rows,
        "prompt_len_padded": ids.shape[1],
        "new_tokens": args.new_tokens,
        "stop_tokens": len(stop_ids),
        "variants": {},
    }
    if peaks["hbm_gbps"]:
        results["decode_roofline_tokens_per_s"] = round(rows * peaks["hbm_gbps"] * 1e9 / weight_bytes, 1)

    def save() -> None:
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(results, f, indent=2)

    for name, fn in list(engines.items()):  # first calls: compilation, autotuning, allocator warm-up
        try:
            sync()
            start = time.perf_counter()
            tokens = fn()
            sync()
            first = time.perf_counter() - start
            start = time.perf_counter()
            fn()
            sync()
            second = time.perf_counter() - start
        except Exception as err:  # a variant that cannot run here is reported, the others still run
            results["variants"][name] = {"error": f"{type(err).__name__}: {err}"[:500]}
            engines.pop(name)
            print(f"{name}: FAILED {results['variants'][name]['error']}", flush=True)
            save()
            continue
        results["variants"][name] = {
            "tokens": tokens,
            "first_call_s": round(first, 3),
            "second_call_s": round(second, 3),
        }
        print(f"{name}: first call {first:.2f} s (compilation included), second {second:.3f} s", flush=True)
        save()
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, fn in engines.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    for name in engines:
        entry = results["variants"][name]
        seconds = statistics.median(times[name])
        entry["median_s"] = round(seconds, 4)
        entry["tokens_per_s"] = round(entry["tokens"] / seconds, 1)
        entry["ms_per_decode_step"] = round(seconds / args.new_tokens * 1e3, 3)  # of the longest row
        if "decode_roofline_tokens_per_s" in results:
            entry["fraction_of_roofline"] = round(entry["tokens_per_s"] / results["decode_roofline_tokens_per_s"], 4)
        print(f"{name:52s} {seconds * 1e3:9.1f} ms {entry['tokens_per_s']:9.0f} tok/s", flush=True)
    save()
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
