"""A long-prompt copy of ../shared/bench's artifacts: TL;DR-shaped prompts (about 400 tokens) for short
completions, the setting of TRL's RLOO / PPO documentation (a Reddit post, then a 53-token summary).

The policies, reward models and tokenizer are linked from the bench's artifacts unchanged; only the
prompt set is new: each prompt joins consecutive short prompts of the bench's own set until it reaches
`--tokens` tokens, then ends with "TL;DR:". Deterministic, offline.

    ART=~/.cache/posttrain-bench/artifacts
    PYTHONPATH=src python benchmarks/build_long_prompts.py --art $ART --out $ART-long
    ART=$ART-long OUT=... N=3 bash benchmarks/compare_all.sh rloo:14m online_dpo:14m grpo:14m
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_art = os.path.expanduser("~/.cache/posttrain-bench/artifacts")
    parser.add_argument("--art", default=default_art, help="../shared/bench's artifacts")
    parser.add_argument("--out", default=default_art + "-long", help="the long-prompt artifacts")
    parser.add_argument("--tokens", type=int, default=400, help="prompt length to reach, in tokens")
    args = parser.parse_args()

    from datasets import Dataset, DatasetDict, load_from_disk
    from transformers import AutoTokenizer

    os.makedirs(args.out, exist_ok=True)
    for name in sorted(os.listdir(args.art)):
        if name.startswith(("policy-", "reward-")) and not os.path.exists(os.path.join(args.out, name)):
            os.symlink(os.path.join(args.art, name), os.path.join(args.out, name))
    tok = AutoTokenizer.from_pretrained(os.path.join(args.art, "policy-14m"))
    short = load_from_disk(os.path.join(args.art, "prompts"))
    pool = list(short["train"]["prompt"]) + list(short["test"]["prompt"])
    longs, lengths, i = [], [], 0
    while len(longs) < 1100:
        parts: list[str] = []
        while len(tok(" ".join(parts + ["TL;DR:"])).input_ids) < args.tokens:
            parts.append(pool[i % len(pool)])
            i += 1
        text = " ".join(parts + ["TL;DR:"])
        longs.append(text)
        lengths.append(len(tok(text).input_ids))
    DatasetDict(
        train=Dataset.from_dict({"prompt": longs[:1000]}), test=Dataset.from_dict({"prompt": longs[1000:]})
    ).save_to_disk(os.path.join(args.out, "prompts"))
    print("prompts", len(longs), "tokens/prompt min/mean/max", min(lengths), sum(lengths) / len(lengths), max(lengths))


if __name__ == "__main__":
    main()
