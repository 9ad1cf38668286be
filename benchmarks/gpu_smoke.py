"""One-GPU smoke benchmark of PPO and GRPO on a 0.5B-shaped model: rollout tokens/s against the decode
roofline, update MFU and peak GPU memory.

    python benchmarks/gpu_smoke.py [--model_dir DIR] [--algos ppo grpo] [--steps 3] [--out result.json]
    python benchmarks/gpu_smoke.py --dry-run      # tiny model, CPU or GPU, a minute: checks the script runs

--model_dir: a folder `AutoModelForCausalLM.from_pretrained` loads (e.g. the random 0.5B model that
benchmarks/build_05b.py writes); its tokenizer is used if it has one, else the tiny offline test
tokenizer. Without it, the model is built here from a Qwen2 config dict with random weights (hidden 896,
24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151,936, tied embeddings: Qwen2.5-0.5B's
shape), no network needed.

The numbers (all printed and written as JSON):
- rollout tokens/s: completion tokens generated (rows × decode steps, the tokens the GPU produced)
  per second of `sample` (prefill included), timed with CUDA synchronisation.
- decode roofline tokens/s = rows × HBM bandwidth / bytes of the policy's weights: every decode step
  reads all weights once and yields one token per row (the KV cache reads are left out, so it is an
  upper bound for short sequences). Bandwidth: --hbm_gbps, else the table below by device name, else
  torch's memory clock × bus width.
- update MFU = model FLOPs / update time / peak bf16 FLOP/s, model FLOPs = 6 · N · tokens for forward
  + backward (Kaplan et al. 2020), N = the trained parameters without the input embedding (PPO: policy
  + critic), tokens = rows × (prompt + completion length) × epochs; attention's own FLOPs are left out.
  Peak: --peak_tflops, else the table below (dense bf16, no sparsity).
- peak GPU memory: torch.cuda.max_memory_allocated over each trainer's run (reset before each).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
import warnings
from typing import Any

for _var, _value in (
    ("HF_HUB_OFFLINE", "1"),
    ("HF_DATASETS_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
    ("TOKENIZERS_PARALLELISM", "false"),
):
    os.environ.setdefault(_var, _value)

import torch  # noqa: E402

# Vendor datasheet figures: HBM bandwidth (GB/s) and dense bf16 tensor-core peak (TFLOP/s), matched on
# the lower-case device name (first match wins, so the more specific names come first).
GPU_TABLE: list[tuple[str, float, float]] = [
    ("h200", 4800.0, 989.0),
    ("h100 nvl", 3900.0, 835.0),
    ("h100 pcie", 2000.0, 756.0),
    ("h100", 3350.0, 989.0),  # SXM5
    ("gh200", 4000.0, 989.0),
    ("a100-sxm4-80gb", 2039.0, 312.0),
    ("a100 80gb pcie", 1935.0, 312.0),
    ("a100", 1555.0, 312.0),  # 40 GB
    ("l40s", 864.0, 362.0),
    ("a10g", 600.0, 125.0),
    ("l4", 300.0, 121.0),
]

QWEN2_05B = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "tie_word_embeddings": True,
    "max_position_embeddings": 512,
}


def device_peaks(args: argparse.Namespace) -> dict[str, Any]:
    """HBM GB/s and bf16 TFLOP/s of this device, with where each number came from."""
    out: dict[str, Any] = {"device": "cpu", "hbm_gbps": args.hbm_gbps, "peak_tflops": args.peak_tflops}
    out["hbm_source"] = "--hbm_gbps" if args.hbm_gbps else None
    out["peak_source"] = "--peak_tflops" if args.peak_tflops else None
    if not torch.cuda.is_available():
        return out
    props = torch.cuda.get_device_properties(0)
    out["device"] = props.name
    name = props.name.lower()
    row = next((r for r in GPU_TABLE if r[0] in name), None)
    if out["hbm_gbps"] is None and row:
        out["hbm_gbps"], out["hbm_source"] = row[1], f"datasheet table ({row[0]})"
    if out["hbm_gbps"] is None:
        clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
        if clock_khz and bus_bits:  # double data rate
            out["hbm_gbps"] = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9
            out["hbm_source"] = "torch memory_clock_rate × memory_bus_width"
    if out["peak_tflops"] is None and row:
        out["peak_tflops"], out["peak_source"] = row[2], f"datasheet table ({row[0]})"
    return out


def build_model(args: argparse.Namespace, tokenizer: Any, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if args.model_dir:
        return AutoModelForCausalLM.from_pretrained(args.model_dir, torch_dtype=dtype)
    shape = dict(TINY, vocab_size=len(tokenizer)) if args.dry_run else dict(QWEN2_05B)
    config = Qwen2Config(
        **shape, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, torch_dtype=dtype
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(dtype)


def load_tokenizer(args: argparse.Namespace) -> Any:
    from posttrain.testing import build_tiny_tokenizer

    if args.model_dir and os.path.exists(os.path.join(args.model_dir, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer
    return build_tiny_tokenizer()


def trained_params(model: torch.nn.Module) -> int:
    """Parameters that cost matmul FLOPs: all trainable ones but the input embedding (a lookup); a tied
    LM head shares the embedding's tensor and is counted once, as the head's matmul."""
    embedding = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    tied = embedding is not None and any(
        p is embedding for n, p in model.named_parameters(remove_duplicate=False) if "lm_head" in n
    )
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if embedding is not None and not tied:
        total -= embedding.numel()
    return total


class Timer:
    """Wall time of a callable's calls, with CUDA synchronisation on both sides."""

    def __init__(self) -> None:
        self.seconds, self.calls, self.each = 0.0, 0, []

    def wrap(self, fn, on_result=None):
        def timed(*args, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.each.append(time.perf_counter() - start)
            self.seconds += self.each[-1]
            self.calls += 1
            if on_result is not None:
                on_result(args, kwargs, result)
            return result

        return timed


def run_algo(algo: str, args: argparse.Namespace, tokenizer: Any, peaks: dict[str, Any], out_dir: str) -> dict:
    from datasets import Dataset

    import posttrain.trainers.grpo as grpo_module
    import posttrain.trainers.ppo as ppo_module
    from posttrain.trainers.grpo import GRPOTrainer
    from posttrain.trainers.grpo_config import GRPOConfig
    from posttrain.trainers.ppo import PPOTrainer
    from posttrain.trainers.ppo_config import PPOConfig

    cuda = torch.cuda.is_available()
    bf16 = cuda if args.bf16 is None else args.bf16
    dtype = torch.bfloat16 if bf16 else torch.float32
    policy = build_model(args, tokenizer, dtype)
    words = ["Write a story about", "Explain why", "List three facts on", "Describe", "Summarise the history of"]
    topics = ["the sea", "bridges", "tea", "owls", "rain", "maps", "glass", "bees"]
    prompts = [f"{w} {t}." for w in words for t in topics]
    dataset = Dataset.from_dict({"prompt": prompts})
    batch = args.batch_size
    common = dict(
        output_dir=os.path.join(out_dir, algo),
        per_device_train_batch_size=batch,
        total_episodes=batch * args.steps,
        learning_rate=1e-6,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        num_sample_generations=0,
        seed=0,
        bf16=bf16,
        use_cpu=not cuda,
        response_length=args.response_length,
        cache_implementation=args.cache_implementation,
    )

    def length_reward(prompts, completions, **kwargs):
        return [float(len(c)) / 100 for c in completions]

    module = ppo_module if algo == "ppo" else grpo_module
    if algo == "ppo":
        config = PPOConfig(value_model_init="policy", num_ppo_epochs=1, **common)
        trainer = PPOTrainer(
            args=config, processing_class=tokenizer, model=policy, reward_model=length_reward, train_dataset=dataset
        )
        epochs = config.num_ppo_epochs
    else:
        config = GRPOConfig(num_generations=args.num_generations, beta=0.04, **common)
        trainer = GRPOTrainer(policy, length_reward, config, processing_class=tokenizer, train_dataset=dataset)
        epochs = config.num_iterations
    # The models the update trains: the policy (PPO: and its critic).
    n_params = trained_params(trainer.model if algo == "grpo" else trainer.unwrapped.lm)
    if algo == "ppo":
        n_params += trained_params(trainer.unwrapped.critic)  # its embedding too is a lookup
    policy_bytes = sum(
        p.numel() * p.element_size() for p in (trainer.model if algo == "grpo" else trainer.unwrapped.lm).parameters()
    )

    rollout_timer, update_timer = Timer(), Timer()
    stats = {"generated_tokens": 0, "real_tokens": 0, "rows": 0, "update_tokens": 0}

    def on_rollout(a, kw, rollout):
        stats["generated_tokens"] += rollout.completion_ids.numel()
        stats["real_tokens"] += int(rollout.completion_mask.sum())
        stats["rows"] = max(stats["rows"], len(rollout))

    def on_update(a, kw, result):
        rollout = a[0].rollout if algo == "ppo" else a[0]
        stats["update_tokens"] += len(rollout) * rollout.sequence_ids.shape[1] * epochs

    original_sample = module.sample
    module.sample = rollout_timer.wrap(original_sample, on_rollout)
    trainer.update = update_timer.wrap(trainer.update, on_update)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        trainer.train()
    finally:
        module.sample = original_sample
    total = time.perf_counter() - start

    rollout_tps = stats["generated_tokens"] / rollout_timer.seconds
    # Without the first rollout (where a compiled decode step compiles): the steady-state rate.
    later = rollout_timer.each[1:]
    steady_tps = stats["generated_tokens"] * len(later) / len(rollout_timer.each) / sum(later) if later else None
    result: dict[str, Any] = {
        "algo": algo,
        "dtype": str(dtype).replace("torch.", ""),
        "steps": trainer.state.global_step,
        "rows_per_rollout": stats["rows"],
        "response_length": args.response_length,
        "policy_params": sum(p.numel() for p in policy.parameters()),
        "policy_weight_bytes": policy_bytes,
        "trained_params_for_flops": n_params,
        "total_seconds": round(total, 3),
        "rollout_seconds": round(rollout_timer.seconds, 3),
        "generated_tokens": stats["generated_tokens"],
        "completion_tokens_before_stop": stats["real_tokens"],
        "cache_implementation": args.cache_implementation,
        "rollout_tokens_per_s": round(rollout_tps, 1),
        "first_rollout_seconds": round(rollout_timer.each[0], 3),
        "rollout_tokens_per_s_after_first": round(steady_tps, 1) if steady_tps else None,
        "update_seconds": round(update_timer.seconds, 3),
        "update_tokens": stats["update_tokens"],
    }
    if peaks["hbm_gbps"]:
        roofline = stats["rows"] * peaks["hbm_gbps"] * 1e9 / policy_bytes
        result["decode_roofline_tokens_per_s"] = round(roofline, 1)
        result["rollout_fraction_of_roofline"] = round(rollout_tps / roofline, 4)
    flops = 6 * n_params * stats["update_tokens"]
    result["update_model_tflop"] = round(flops / 1e12, 3)
    result["update_achieved_tflops"] = round(flops / update_timer.seconds / 1e12, 3)
    if peaks["peak_tflops"]:
        result["update_mfu"] = round(flops / update_timer.seconds / (peaks["peak_tflops"] * 1e12), 4)
    if cuda:
        result["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    del trainer, policy
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", default=None, help="a causal LM folder; default: build the 0.5B shape here")
    parser.add_argument("--algos", nargs="+", default=["ppo", "grpo"], choices=["ppo", "grpo"])
    parser.add_argument("--steps", type=int, default=3, help="rollout + update rounds per trainer")
    parser.add_argument("--batch_size", type=int, default=16, help="completions per rollout")
    parser.add_argument("--num_generations", type=int, default=4, help="GRPO completions per prompt")
    parser.add_argument("--response_length", type=int, default=128)
    parser.add_argument(
        "--cache_implementation",
        default=None,
        choices=["dynamic", "static"],
        help="the trainers' decode engine (static: preallocated cache + compiled decode step)",
    )
    parser.add_argument("--hbm_gbps", type=float, default=None, help="HBM bandwidth, GB/s (default: table)")
    parser.add_argument("--peak_tflops", type=float, default=None, help="peak bf16 TFLOP/s (default: table)")
    parser.add_argument("--bf16", default=None, type=lambda s: s.lower() in ("1", "true", "yes"))
    parser.add_argument("--dry-run", dest="dry_run", action="store_true", help="tiny model, 1 step, runs on CPU")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.steps, args.batch_size, args.num_generations, args.response_length = 1, 4, 2, 8
    warnings.filterwarnings("ignore")
    peaks = device_peaks(args)
    tokenizer = load_tokenizer(args)
    results = {
        "device": peaks,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": args.model_dir or ("tiny Qwen2 (dry run)" if args.dry_run else "Qwen2 0.5B shape, random weights"),
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as out_dir:
        for algo in args.algos:
            results["runs"].append(run_algo(algo, args, tokenizer, peaks, out_dir))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    results["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
