"""Decode tokens/s of posttrain.rollout.generate (each engine variant, and the engine before the
variants existed) vs transformers' model.generate() on the same model and batch.

Default model: a randomly initialised GPTNeoX shaped like pythia-14m (hidden 128, 6 layers, 4 heads),
vocab 6815, batch 16 prompts × k=2 samples, ~15-token left-padded prompts, 53 new tokens, fp32.
Random weights almost never emit a given token, so two settings are timed:
- `no-stop`: no stop token, every row decodes all 53 tokens (all engines do the same work);
- `stop`: a frequent stop set (the first `--stop-frac` of the vocabulary, ≈5% chance a step), so
  rows stop at scattered steps as trained policies do — this exercises compaction.
All engines sample with temperature 1 and the KV cache; ours also records per-token logprobs.
The runs are interleaved (every variant once per round, in a fresh random order each round) and the
medians reported, so a load change on a shared machine hits every variant alike; ratios are against
the previous engine (`baseline`, loaded from git at `--baseline-rev`). Both wall time and process
CPU time are reported: with one thread, CPU time is less disturbed by other jobs on the machine.
Each variant's tokens are checked equal to the baseline's for the same seed.
Built from a config, so nothing touches the network.

--autocast runs every engine (and model.generate()) under CPU bf16 autocast over float32 weights, as the
trainers' --bf16 does, and adds the default engine with autocast's own F.linear (POSTTRAIN_CPU_LINEAR=off:
no packed bf16 weights, so no traced step either); --bf16 instead casts the weights to bf16.

    PYTHONPATH=src python benchmarks/bench_rollout.py [--threads 1] [--repeats 7] [--bf16 | --autocast] [--compile]
    PYTHONPATH=src python benchmarks/bench_rollout.py --model ARTIFACTS/policy-70m --prompts ARTIFACTS/prompts \
        --batch 32 --k 1 --compile
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from posttrain.rollout import SamplingConfig, generate, generation_mode

VARIANTS = {
    "legacy options": {"share_prefill": False, "compact": False, "sync_every": 1},
    "shared prefill": {"share_prefill": True, "compact": False},
    "compaction": {"share_prefill": False, "compact": True},
    "default (both)": {},
    "default with an eager step": {"trace": False},
    "default + sync_every=4": {"sync_every": 4},
    "static cache": {"cache_implementation": "static"},
    "static no-compaction": {"cache_implementation": "static", "compact": False},
}
# --autocast adds this one.
AUTOCAST = {"default on autocast's F.linear": {"env": {"POSTTRAIN_CPU_LINEAR": "off"}}}
# --compile adds these (the first call, which compiles, is timed separately).
COMPILED = {
    "static + compiled step": {"compile_mode": "default"},
    "static + compiled step sync_every=8": {"compile_mode": "default", "sync_every": 8},
    "static + compiled step no-compaction": {"compile_mode": "default", "compact": False},
}


def load_baseline(rev: str):
    """rollout.py as of git revision `rev`, imported as its own module."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(
        ["git", "show", f"{rev}:src/posttrain/rollout.py"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    path = Path("/tmp") / f"posttrain_rollout_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"rollout_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A saved model (`--model DIR`, e.g. the TRL-comparison artifacts' policy-14m) and the first
    `--batch` prompts of `--prompts` (a datasets.save_to_disk folder with a "prompt" column),
    tokenized with the model folder's tokenizer and left-padded."""
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    if args.bf16:
        model = model.to(torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    data = load_from_disk(args.prompts)
    texts = (data["train"] if "train" in data else data)["prompt"][: args.batch]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return model, enc["input_ids"], enc["attention_mask"].bool()


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    if args.model:
        return load(args)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a saved causal LM folder (default: a random pythia-14m shape)")
    parser.add_argument("--prompts", default=None, help="with --model: a save_to_disk prompt dataset")
    parser.add_argument("--variants", default=None, help="comma-separated engine names to time (default: all)")
    parser.add_argument("--bf16", action="store_true", help="bf16 weights")
    parser.add_argument(
        "--autocast", action="store_true", help="float32 weights under CPU bf16 autocast (--bf16 of the trainers)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--k", type=int, default=2, help="completions per prompt (num_samples)")
    parser.add_argument("--prompt-len", type=int, default=15)
    parser.add_argument("--new-tokens", type=int, default=53)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=6815)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--stop-frac", type=float, default=0.05)
    parser.add_argument("--baseline-rev", default="89581c8", help="git revision of the engine to compare against")
    parser.add_argument("--settings", default="no-stop,stop")
    parser.add_argument("--no-hf", action="store_true", help="skip model.generate()")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time the compiled decode step and the default engine on torch.compile(model)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, ids, mask = build(args)
    baseline = load_baseline(args.baseline_rev)
    c = model.config
    print(
        f"model {args.model or 'random'} hidden={c.hidden_size} layers={c.num_hidden_layers} vocab={c.vocab_size} "
        f"{'bf16' if args.bf16 else 'fp32 under bf16 autocast' if args.autocast else 'fp32'}, "
        f"prompt length {ids.size(1)} (padded), "
        f"batch={args.batch} prompts x k={args.k}, prompt~{args.prompt_len}, new={args.new_tokens}, "
        f"threads={args.threads}, repeats={args.repeats} (interleaved, medians)"
    )
    for setting in args.settings.split(","):
        bench_setting(args, setting, model, ids, mask, baseline)


def bench_setting(args, setting, model, ids, mask, baseline) -> None:
    vocab = model.config.vocab_size
    stop_ids = tuple(range(2, 2 + int(args.stop_frac * vocab))) if setting == "stop" else ()
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0, stop_token_ids=stop_ids)

    def precision():
        return torch.autocast("cpu", dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext()

    @contextlib.contextmanager
    def environment(values):
        saved = {name: os.environ.get(name) for name in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name)
                else:
                    os.environ[name] = value

    def ours(fn, options, m=model):
        options = dict(options)
        env = options.pop("env", {})

        def run():
            with generation_mode(m), precision(), environment(env):
                return fn(
                    m,
                    ids,
                    mask,
                    sampling,
                    pad_token_id=0,
                    num_samples=args.k,
                    generator=torch.Generator().manual_seed(0),
                    **options,
                )

        return run

    def hf(**extra):
        with torch.no_grad(), precision():
            return model.generate(
                **extra,
                input_ids=ids,
                attention_mask=mask.long(),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=0 if stop_ids else args.new_tokens,
                num_return_sequences=args.k,
                pad_token_id=0,
                eos_token_id=list(stop_ids) or None,
            )

    engines = {"baseline": ours(baseline.generate, {})}
    engines.update({name: ours(generate, options) for name, options in VARIANTS.items()})
    if args.autocast:
        engines.update({name: ours(generate, options) for name, options in AUTOCAST.items()})
    if args.compile:
        # The compilation happens in its first call (the token check below), timed separately.
        engines.update({name: ours(generate, options) for name, options in COMPILED.items()})
        engines["default, torch.compile(model)"] = ours(generate, {}, torch.compile(model, dynamic=True))
    if not args.no_hf:
        engines["model.generate()"] = hf
        engines["model.generate() static cache"] = lambda: hf(cache_implementation="static")
    if args.variants:
        wanted = {"baseline", *args.variants.split(",")}
        engines = {name: fn for name, fn in engines.items() if name in wanted}
    # Same tokens as the baseline for the same seed; tokens decoded = sum of completion lengths.
    reference = engines["baseline"]()
    tokens = int(reference.completion_lengths.sum())
    for name, fn in engines.items():
        if name == "baseline" or name.startswith("model.generate()"):
            continue
        start = time.perf_counter()
        r = fn()
        if "compile" in name:
            first = time.perf_counter() - start
            start = time.perf_counter()
            fn()
            second = time.perf_counter() - start
            print(f"{name}: first call (compilation included) {first:.1f} s, second call {second:.2f} s")
        same = torch.equal(r.completion_ids, reference.completion_ids) and torch.equal(
            r.completion_lengths, reference.completion_lengths
        )
        if ("compile" in name or args.autocast) and not same:
            # Compiled kernels round differently (fused reductions), and bf16 matmuls of another row count
            # (one prefill per row against one per prompt) block differently, so a draw that falls within
            # float error of a CDF boundary can pick the neighbouring token and the row diverges from there.
            logit_gap = (r.logprobs - reference.logprobs)[:, :1].abs().max().item()
            differ = (r.completion_ids != reference.completion_ids).any(-1)
            first = (r.completion_ids != reference.completion_ids).float().argmax(-1)[differ]
            print(
                f"{name}: {int(differ.sum())}/{len(differ)} rows differ from the baseline's tokens, from steps "
                f"{sorted(first.tolist())}; max first-step logprob difference {logit_gap:.2e}"
            )
            continue
        assert same, f"{name}: tokens differ from the baseline engine"
    wall: dict[str, list[float]] = {name: [] for name in engines}
    cpu: dict[str, list[float]] = {name: [] for name in engines}
    for fn in engines.values():
        fn()  # warm-up
    order = list(engines)
    rng = random.Random(0)
    for _ in range(args.repeats):
        rng.shuffle(order)  # a fresh order each round: no variant always runs after the same one
        for name in order:
            start, start_cpu = time.perf_counter(), time.process_time()
            engines[name]()
            cpu[name].append(time.process_time() - start_cpu)
            wall[name].append(time.perf_counter() - start)
    base, base_cpu = statistics.median(wall["baseline"]), statistics.median(cpu["baseline"])
    mean_len = tokens / (args.batch * args.k)
    print(f"\n[{setting}] mean completion length {mean_len:.1f} tokens (baseline tokens; HF's may differ)")
    print(f"{'engine':30s} {'wall ms':>8s} {'tok/s':>7s} {'ratio':>6s} {'cpu ms':>8s} {'cpu ratio':>9s}")
    for name in engines:
        t, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(f"{name:30s} {t * 1e3:8.1f} {tokens / t:7.0f} {base / t:5.2f}x {c * 1e3:8.1f} {base_cpu / c:8.2f}x")


if __name__ == "__main__":
    main()
