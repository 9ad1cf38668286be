"""Peak RSS of `posttrain ppo --use_peft` on a Qwen2.5-0.5B-shaped model (random weights, fp32, offline).

Builds, once, under --dir (default /tmp/qwen05b):
  policy/   a LlamaForCausalLM with Qwen2.5-0.5B's dimensions (hidden 896, 24 layers, 14 heads, 2 KV heads,
            intermediate 4864, vocabulary 151,936, tied embeddings; ~494M parameters, ~2 GB in fp32)
  reward/   a LlamaForSequenceClassification of the same shape (num_labels=1)
  prompts.jsonl  a few short prompts
The tokenizer is posttrain.testing's tiny byte-level BPE (512 entries, saved with both models); the
models embed 151,936 ids, so the embedding and logits cost what Qwen2.5-0.5B's do. (Llama shape rather
than Qwen2: transformers maps the `qwen2` model type to its own tokenizer class; the only difference is
Qwen2's q/k/v biases, < 0.1% of the weights.)

Then runs `posttrain ppo --use_peft` (batch 4, response 16, 2 rollout batches, gradient checkpointing,
fp32) under `/usr/bin/time -v` and prints the maximum resident set size. --use_peft gives LoRA roles on
one base (policy and critic adapters, reference = adapters off); --separate_critic passes
--value_model_path reward/ to get the separate full critic of the non-LoRA recipe instead.

    PYTHONPATH=src python benchmarks/ppo_peft_memory.py [--dir /tmp/qwen05b] [--separate_critic]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

QWEN05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151_936,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
)


def build(root: Path) -> None:
    """Write policy/, reward/ and prompts.jsonl under `root` unless they are there."""
    if (root / "reward" / "config.json").is_file():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from posttrain.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    torch.manual_seed(0)
    policy = LlamaForCausalLM(LlamaConfig(**QWEN05B, **ids))
    policy.save_pretrained(root / "policy")
    print("policy parameters", sum(p.numel() for p in policy.parameters()), flush=True)
    del policy
    torch.manual_seed(1)
    reward = LlamaForSequenceClassification(LlamaConfig(**QWEN05B, **ids, num_labels=1))
    reward.save_pretrained(root / "reward")
    del reward
    for name in ("policy", "reward"):
        tokenizer.save_pretrained(root / name)
    words = ["sea", "sky", "dog", "fox", "robot", "book", "poem", "tree"]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Write about the {w}."}) + "\n" for w in words))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/qwen05b")
    parser.add_argument("--separate_critic", action="store_true", help="a full critic loaded from reward/")
    args = parser.parse_args()
    root = Path(args.dir)
    build(root)
    out = root / ("run-separate" if args.separate_critic else "run-lora")
    command = [
        "/usr/bin/time",
        "-v",
        sys.executable,
        "-m",
        "posttrain",
        "ppo",
        "--model_name_or_path",
        str(root / "policy"),
        "--reward_model_path",
        str(root / "reward"),
        "--dataset_name",
        str(root / "prompts.jsonl"),
        "--output_dir",
        str(out),
        "--overwrite_output_dir",
        "--use_peft",
        "--lora_r",
        "16",
        "--lora_target_modules",
        "all-linear",
        "--per_device_train_batch_size",
        "4",
        "--total_episodes",
        "8",
        "--response_length",
        "16",
        "--gradient_checkpointing",
        "--torch_dtype",
        "float32",
        "--num_sample_generations",
        "0",
        "--save_steps",
        "0",
        "--report_to",
        "none",
        "--logging_steps",
        "1",
    ]
    if args.separate_critic:
        command += ["--value_model_path", str(root / "reward")]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr)
    if result.returncode != 0 or match is None:
        print(result.stdout[-3000:], result.stderr[-6000:], sep="\n")
        return 1
    rss_gb = int(match.group(1)) * 1024 / 1e9
    mode = "separate critic" if args.separate_critic else "LoRA roles on one base"
    print(f"RESULT ppo --use_peft ({mode}): peak RSS {rss_gb:.2f} GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
