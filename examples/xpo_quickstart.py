"""The XPO quickstart of the TRL docs, on posttrain: same objects, same keywords.

    # as in the docs (needs the hub, and `pip install llm-blender` for PairRM):
    accelerate launch examples/xpo_quickstart.py
    # the docs' tip: a reward model instead of the judge
    python examples/xpo_quickstart.py --reward_model trl-lib/Qwen2-0.5B-Reward
    # offline, with local models and prompts (any judge spec of posttrain.judges.judge_from_spec):
    python examples/xpo_quickstart.py --model ./my-sft-model --dataset prompts.jsonl --judge random \\
        --output_dir xpo-out --total_episodes 64 --max_new_tokens 32

Afterwards: `posttrain chat <output_dir>` to talk to the trained model, and
`posttrain judge --model_name_or_path <output_dir> ...` for a win rate.
"""

import argparse

from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from posttrain import XPOConfig, XPOTrainer
from posttrain.data import load_any_dataset
from posttrain.judges import judge_from_spec

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default="Qwen/Qwen2-0.5B-Instruct", help="policy: hub name or local folder")
parser.add_argument(
    "--dataset", default="trl-lib/ultrafeedback-prompt", help="prompt-only dataset: hub name, folder or file"
)
parser.add_argument("--judge", default="pair_rm", help="judge spec (pair_rm, openai, random, reward_model:<path>, ...)")
parser.add_argument("--reward_model", default=None, help="use this reward model instead of the judge (the docs' tip)")
parser.add_argument("--output_dir", default="Qwen2-0.5B-XPO")
parser.add_argument(
    "--total_episodes", type=int, default=None, help="default: num_train_epochs passes over the prompts"
)
parser.add_argument("--max_new_tokens", type=int, default=64)
args = parser.parse_args()

model = AutoModelForCausalLM.from_pretrained(args.model)
tokenizer = AutoTokenizer.from_pretrained(args.model)
train_dataset = load_any_dataset(args.dataset, split="train")
training_args = XPOConfig(
    output_dir=args.output_dir, total_episodes=args.total_episodes, max_new_tokens=args.max_new_tokens
)

if args.reward_model is None:
    judge = judge_from_spec(args.judge)
    trainer = XPOTrainer(
        model=model, judge=judge, args=training_args, processing_class=tokenizer, train_dataset=train_dataset
    )
else:
    # The SFT model and the reward model must share the chat template and tokenizer (as the TRL docs say).
    reward_model = AutoModelForSequenceClassification.from_pretrained(args.reward_model, num_labels=1)
    trainer = XPOTrainer(
        model=model,
        reward_model=reward_model,
        args=training_args,
        processing_class=tokenizer,
        train_dataset=train_dataset,
    )
trainer.train()
