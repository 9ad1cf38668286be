"""`posttrain demo`: the three steps of RLHF on an embedded task, offline.

The steps are DeepSpeed-Chat's (Yao et al. 2023, arXiv:2308.01320):

1. SFT: a tiny Llama learns, from scratch, to write the task's short reviews (task.py).
2. Reward model: the SFT model writes two reviews per prompt; the gold sentiment rule (the
   stand-in for a human labeller) picks the better one; a reward model initialised from the SFT
   weights learns those preferences (Bradley–Terry). Its held-out accuracy is printed as
   DeepSpeed-Chat prints it.
3. RL: PPO (default) or RLOO / GRPO / Online DPO / XPO maximise the learned (proxy) reward under a
   KL penalty to the SFT model. A zero-valued observer rides along with the reward model and
   records the gold score of every completion the trainer scores (`gold/score` over training).

Then both policies answer the same held-out prompts and report.py writes report.md: proxy and gold
scores before and after, the gold win rate of the RL policy over the SFT policy, KL to the
reference, a before/after table and plots. Sizes are tuned to finish in a few minutes on 2 CPU
cores; `--quick` shrinks everything to well under a minute (a smoke test; numbers meaningless).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from posttrain.configs import ConfigError
from posttrain.demo import task as demo_task

ALGOS = ("ppo", "rloo", "grpo", "online-dpo", "xpo")


@dataclass
class DemoConfig:
    output_dir: str = field(
        default="outputs/demo", metadata={"help": "Where sft/, reward_model/, rl/, plots/ and report.md go."}
    )
    algo: str = field(default="ppo", metadata={"help": f"RL algorithm of step 3: {', '.join(ALGOS)}."})
    quick: bool = field(
        default=False,
        metadata={"help": "Tiny sizes and few steps (under a minute): every artifact, meaningless numbers."},
    )
    seed: int = field(default=42, metadata={"help": "Seed of the task, the models, sampling and training."})
    bf16: bool = field(
        default=False,
        metadata={
            "help": "bf16 autocast. Off by default: on CPUs without AMX (measured on AVX-512-BF16 EPYC) the tiny "
            "demo model runs 1.5x slower in bf16 than in float32."
        },
    )
    sft_steps: int | None = field(default=None, metadata={"help": "SFT optimizer steps (default 400; quick 30)."})
    rm_steps: int | None = field(
        default=None, metadata={"help": "Reward-model optimizer steps (default 250; quick 20)."}
    )
    rl_episodes: int | None = field(
        default=None, metadata={"help": "RL completions to train on (total_episodes; default 4096; quick 128)."}
    )
    num_threads: int = field(
        default=1,
        metadata={
            "help": "torch intra-op threads. 1 by default: the demo's matrices are too small to gain from more, "
            "and shared cores make extra threads much slower."
        },
    )

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise ConfigError(f"algo={self.algo!r} must be one of {', '.join(ALGOS)}.")
        for name in ("sft_steps", "rm_steps", "rl_episodes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value} must be >= 1.")
        if self.num_threads < 1:
            raise ConfigError(f"num_threads={self.num_threads} must be >= 1.")


@dataclass(frozen=True)
class Sizes:
    """Everything the time budget decides."""

    num_reviews: int  # SFT corpus size
    hidden_size: int
    num_layers: int
    sft_steps: int
    sft_batch: int
    rm_prompts: int  # prompts sampled twice for preference pairs (ties are dropped)
    rm_eval_prompts: int
    rm_steps: int
    rl_episodes: dict[str, int]
    eval_prompts: int  # held-out prompts answered by both policies
    response_length: int


FULL = Sizes(
    num_reviews=4000,
    hidden_size=128,
    num_layers=2,
    sft_steps=400,
    sft_batch=32,
    rm_prompts=3000,
    rm_eval_prompts=300,
    rm_steps=250,
    rl_episodes=dict.fromkeys(ALGOS, 4096),
    eval_prompts=211,
    response_length=32,
)
QUICK = Sizes(
    num_reviews=400,
    hidden_size=32,
    num_layers=1,
    sft_steps=30,
    sft_batch=16,
    rm_prompts=96,
    rm_eval_prompts=32,
    rm_steps=20,
    rl_episodes=dict.fromkeys(ALGOS, 128),
    eval_prompts=16,
    response_length=16,
)


def sizes_for(config: DemoConfig) -> Sizes:
    base = QUICK if config.quick else FULL
    episodes = dict(base.rl_episodes)
    if config.rl_episodes is not None:
        episodes[config.algo] = config.rl_episodes
    return Sizes(
        **{
            **asdict(base),
            "sft_steps": config.sft_steps or base.sft_steps,
            "rm_steps": config.rm_steps or base.rm_steps,
            "rl_episodes": episodes,
        }
    )


# ---------------------------------------------------------------------------------------------
# the gold observer
# ---------------------------------------------------------------------------------------------
class GoldMonitor:
    """Records the gold score of the completions an RL trainer scores, without changing the reward.

    Passed to the trainer as a reward function next to the reward model, it returns 0.0 for every
    completion (so the trainer optimises the proxy alone) and keeps the gold scores; at each logging
    step (`on_log` of the `transformers.TrainerCallback` from `as_callback()`, passed in the
    trainer's callbacks) the mean since the last one becomes a `gold/score` row. `stride=2` keeps
    every other row: XPO scores (policy, reference) pairs and only the policy's completions are its own.
    """

    __name__ = "gold_monitor"

    def __init__(self, stride: int = 1) -> None:
        self.stride = stride
        self.pending: list[float] = []
        self.rows: list[dict[str, float]] = []

    def __call__(self, prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
        self.pending.extend(demo_task.gold_score(c) for c in completions[:: self.stride])
        return [0.0] * len(completions)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **_: Any) -> None:
        """transformers' on_log(args, state, control, logs=...): at a training logging step (logs with
        `episode`; not the end-of-training summary or an evaluation) the pending gold scores become a row."""
        if not self.pending or not logs or "episode" not in logs:
            return
        row = {
            "step": len(self.rows) + 1,
            "gold/score": sum(self.pending) / len(self.pending),
            "episode": logs["episode"],
        }
        self.rows.append(row)
        self.pending = []

    def as_callback(self) -> Any:
        """A `transformers.TrainerCallback` whose on_log is this monitor's (built here, so importing the
        demo does not import transformers)."""
        from transformers import TrainerCallback

        monitor = self

        class GoldCallback(TrainerCallback):
            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
                monitor.on_log(args, state, control, logs=logs)

        return GoldCallback()

    def save(self, path: Path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for row in self.rows:
                f.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _say(message: str) -> None:
    from rich.console import Console

    Console(highlight=False).print(message)


def _prepare_output_dir(path: Path) -> None:
    """A demo may rerun into its own folder (`make demo` twice); anything else non-empty is refused."""
    if path.exists() and any(path.iterdir()):
        if not (path / "demo_config.json").is_file():
            raise ConfigError(
                f"output_dir={str(path)!r} is not empty and does not hold a previous demo; choose another --output_dir."
            )
        for name in ("sft", "reward_model", "rl", "plots"):
            shutil.rmtree(path / name, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)


def _prompt_batch(tokenizer: Any, prompts: list[str]) -> dict:
    from posttrain.data import PromptCollator

    return PromptCollator(tokenizer.pad_token_id)([{"input_ids": tokenizer(p)["input_ids"]} for p in prompts])


def sample_rollout(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    *,
    num_samples: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    batch_size: int = 256,
) -> Any:
    """num_samples completions per prompt (prompt-major) from the shared rollout engine, as a Rollout."""
    import torch

    from posttrain.rollout import SamplingConfig, generate, generation_mode

    batch = _prompt_batch(tokenizer, prompts)
    sampling = SamplingConfig(
        max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=(tokenizer.eos_token_id,)
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad(), generation_mode(model) as m:
        return generate(
            m,
            batch["input_ids"],
            batch["attention_mask"],
            sampling,
            pad_token_id=tokenizer.pad_token_id,
            num_samples=num_samples,
            batch_size=batch_size,
            generator=generator,
            return_logprobs=False,
        )


def sample_completions(model: Any, tokenizer: Any, prompts: list[str], **kwargs: Any) -> list[str]:
    from posttrain.rollout import decode_completions

    return decode_completions(tokenizer, sample_rollout(model, tokenizer, prompts, **kwargs))


def _last_with(records: list[dict], key: str) -> dict:
    return next((r for r in reversed(records) if key in r), {})


# ---------------------------------------------------------------------------------------------
# the three steps
# ---------------------------------------------------------------------------------------------
def train_sft(config: DemoConfig, sizes: Sizes, task: demo_task.Task, tokenizer: Any, out: Path) -> Any:
    from datasets import Dataset

    from posttrain.testing import build_tiny_causal_lm
    from posttrain.trainers.sft import SFTTrainer
    from posttrain.trainers.sft_config import SFTConfig

    model = build_tiny_causal_lm(
        tokenizer, hidden_size=sizes.hidden_size, num_layers=sizes.num_layers, num_heads=4, seed=config.seed
    )
    args = SFTConfig(
        output_dir=str(out),
        overwrite_output_dir=True,
        max_steps=sizes.sft_steps,
        per_device_train_batch_size=sizes.sft_batch,
        per_device_eval_batch_size=64,
        # A from-scratch model on a tiny language: a large learning rate with warmup and cosine
        # decay reaches the grammar's entropy floor in a few hundred steps.
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_ratio=0.05,
        weight_decay=0.0,
        logging_steps=max(1, sizes.sft_steps // 8),
        save_steps=0,
        max_length=64,
        seed=config.seed,
        bf16=config.bf16,
    )
    trainer = SFTTrainer(
        model,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"text": task.sft_train}),
        eval_dataset=Dataset.from_dict({"text": task.sft_eval}),
    )
    trainer.train()
    return trainer.run.unwrapped().eval()


def preference_pairs(model: Any, tokenizer: Any, prompts: list[str], sizes: Sizes, seed: int) -> tuple[list[dict], int]:
    """Two SFT samples per prompt, ordered by the gold rule; ties dropped. Returns (pairs, ties)."""
    completions = sample_completions(
        model, tokenizer, prompts, num_samples=2, max_new_tokens=sizes.response_length, temperature=1.0, seed=seed
    )
    pairs, ties = [], 0
    for i, prompt in enumerate(prompts):
        a, b = completions[2 * i], completions[2 * i + 1]
        better = demo_task.gold_preference(a, b)
        if better is None:
            ties += 1
            continue
        chosen, rejected = (a, b) if better == 0 else (b, a)
        # Implicit prompt (TRL's recommended format): both texts start with the same prompt.
        pairs.append({"chosen": f"{prompt} {chosen}", "rejected": f"{prompt} {rejected}"})
    return pairs, ties


def train_reward_model(
    config: DemoConfig, sizes: Sizes, task: demo_task.Task, tokenizer: Any, sft_dir: Path, sft_model: Any, out: Path
) -> tuple[Any, dict]:
    from datasets import Dataset

    from posttrain.models import load_reward_model
    from posttrain.trainers.reward import RewardTrainer
    from posttrain.trainers.reward_config import RewardConfig

    rng = random.Random(config.seed)
    train_prompts = [rng.choice(task.train_prompts) for _ in range(sizes.rm_prompts)]
    # The RM is evaluated on pairs of held-out prompts: its accuracy is about unseen reviews.
    eval_prompts = [rng.choice(task.heldout_prompts) for _ in range(sizes.rm_eval_prompts)]
    train_pairs, train_ties = preference_pairs(sft_model, tokenizer, train_prompts, sizes, config.seed + 1)
    eval_pairs, _ = preference_pairs(sft_model, tokenizer, eval_prompts, sizes, config.seed + 2)
    _say(
        f"Gold-labelled {len(train_pairs)} training pairs ({train_ties} ties dropped) "
        f"and {len(eval_pairs)} held-out pairs."
    )
    model = load_reward_model(sft_dir, tokenizer=tokenizer, allow_new_head=True)  # the head is trained next
    args = RewardConfig(
        output_dir=str(out),
        overwrite_output_dir=True,
        max_steps=sizes.rm_steps,
        per_device_train_batch_size=32,
        per_device_eval_batch_size=64,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_ratio=0.05,
        logging_steps=max(1, sizes.rm_steps // 5),
        save_steps=0,
        max_length=64,
        seed=config.seed,
        bf16=config.bf16,
        # Centred scores keep the PPO critic (initialised from this model) on a small scale.
        center_rewards_coefficient=0.01,
        num_print_samples=2,
    )
    trainer = RewardTrainer(
        model,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list(train_pairs),
        eval_dataset=Dataset.from_list(eval_pairs),
    )
    trainer.train()
    from posttrain.plots import read_metrics

    final_eval = _last_with(read_metrics(out), "eval_accuracy")
    stats = {
        "train_pairs": len(train_pairs),
        "eval_pairs": len(eval_pairs),
        "ties_dropped": train_ties,
        "accuracy": final_eval.get("eval_accuracy", float("nan")),
        "chosen_score": final_eval.get("eval_chosen_scores", float("nan")),
        "rejected_score": final_eval.get("eval_rejected_scores", float("nan")),
    }
    return trainer.run.unwrapped().eval(), stats


def rl_config(config: DemoConfig, sizes: Sizes, out: Path) -> Any:
    """The RL step's config; per-algorithm learning rates and KL weights tuned for this task and budget."""
    episodes = sizes.rl_episodes[config.algo]
    batch = 16 if config.quick else 64
    common = dict(
        output_dir=str(out),
        overwrite_output_dir=True,
        total_episodes=episodes,
        response_length=sizes.response_length,
        seed=config.seed,
        bf16=config.bf16,
        save_steps=0,
        # About 32 logging steps per run: enough points for the curves, few console lines.
        logging_steps=max(1, episodes // batch // 32),
        # The demo prints its own before/after table on held-out prompts; mid-training tables would
        # also be scored by the gold observer and blur its per-step numbers.
        num_sample_generations=0,
        stop_token="eos",
        missing_eos_penalty=1.0,
        local_rollout_forward_batch_size=256,
        per_device_train_batch_size=batch,
        lr_scheduler_type="constant",
    )
    if config.algo == "ppo":
        from posttrain.trainers.ppo_config import PPOConfig

        return PPOConfig(
            **common, learning_rate=5e-4, kl_coef=0.05, num_ppo_epochs=4, num_mini_batches=1, temperature=0.7
        )
    if config.algo == "rloo":
        from posttrain.trainers.rloo_config import RLOOConfig

        return RLOOConfig(
            **common,
            learning_rate=5e-4,
            kl_coef=0.05,
            rloo_k=2,
            num_ppo_epochs=2,
            temperature=0.7,
            normalize_advantage=True,
        )
    if config.algo == "grpo":
        from posttrain.trainers.grpo_config import GRPOConfig

        return GRPOConfig(**common, learning_rate=5e-4, beta=0.05, num_generations=4, num_iterations=2, temperature=0.7)
    if config.algo == "online-dpo":
        from posttrain.trainers.online_dpo_config import OnlineDPOConfig

        return OnlineDPOConfig(
            **{**common, "response_length": None},
            max_new_tokens=sizes.response_length,
            learning_rate=5e-4,
            beta=[0.1],
            temperature=0.7,
        )
    from posttrain.trainers.xpo_config import XPOConfig

    return XPOConfig(
        **{**common, "response_length": None},
        max_new_tokens=sizes.response_length,
        learning_rate=5e-4,
        beta=[0.1],
        alpha=[1e-5],
        temperature=0.7,
    )


def train_rl(
    config: DemoConfig,
    task: demo_task.Task,
    tokenizer: Any,
    sft_dir: Path,
    rm_dir: Path,
    rl_args: Any,
    monitor: GoldMonitor,
) -> Any:
    from datasets import Dataset

    from posttrain.models import load_policy, load_reward_model, load_value_model

    policy = load_policy(sft_dir, tokenizer=tokenizer)
    reward_model = load_reward_model(rm_dir, tokenizer=tokenizer)
    prompts = Dataset.from_dict({"prompt": task.train_prompts})
    heldout = Dataset.from_dict({"prompt": task.heldout_prompts})
    rewards = [reward_model, monitor]
    # Each trainer is called as TRL documents it; these arguments are the same for all.
    common = dict(
        train_dataset=prompts, eval_dataset=heldout, processing_class=tokenizer, callbacks=[monitor.as_callback()]
    )
    if config.algo == "ppo":
        from posttrain.trainers.ppo import PPOTrainer

        # DeepSpeed-Chat initialises the critic from the reward model.
        critic = load_value_model(rm_dir, tokenizer=tokenizer)
        reference = load_policy(sft_dir, tokenizer=tokenizer)
        trainer = PPOTrainer(
            args=rl_args, model=policy, ref_model=reference, reward_model=rewards, value_model=critic, **common
        )
    elif config.algo == "rloo":
        from posttrain.trainers.rloo import RLOOTrainer

        reference = load_policy(sft_dir, tokenizer=tokenizer)
        trainer = RLOOTrainer(rl_args, policy=policy, ref_policy=reference, reward_model=rewards, **common)
    elif config.algo == "grpo":
        from posttrain.trainers.grpo import GRPOTrainer

        trainer = GRPOTrainer(policy, reward_funcs=rewards, args=rl_args, **common)
    elif config.algo == "online-dpo":
        from posttrain.trainers.online_dpo import OnlineDPOTrainer

        trainer = OnlineDPOTrainer(policy, reward_model=rewards, args=rl_args, **common)
    else:
        from posttrain.trainers.xpo import XPOTrainer

        trainer = XPOTrainer(policy, reward_model=rewards, args=rl_args, **common)
    trainer.train()
    return trainer.policy_model


# ---------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------
def evaluate(
    sft_model: Any,
    rl_model: Any,
    reward_model: Any,
    tokenizer: Any,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> dict:
    """Both policies answer the same held-out prompts (same sampling seed); gold, proxy, win rate, KL."""
    from posttrain.rollout import decode_completions
    from posttrain.scoring import batched_completion_logprobs, reward_model_scores

    kwargs = dict(num_samples=1, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    rollouts = {
        "before": sample_rollout(sft_model, tokenizer, prompts, **kwargs),
        "after": sample_rollout(rl_model, tokenizer, prompts, **kwargs),
    }
    results: dict[str, Any] = {"prompts": prompts}
    for when, rollout in rollouts.items():
        texts = decode_completions(tokenizer, rollout)
        results[when] = texts
        results[f"gold_{when}"] = [demo_task.gold_score(c) for c in texts]
        # The proxy exactly as the RL trainer reads it: on the rollout's tokens, at the last real token.
        results[f"proxy_{when}"] = reward_model_scores(reward_model, rollout, batch_size=256).tolist()
        results[f"length_{when}"] = float(rollout.completion_lengths.float().mean())
    # k1 estimate of KL(RL || SFT) per completion, on the RL policy's samples at the sampling
    # temperature: what objective/kl measures during training.
    after = rollouts["after"]
    logprobs, _ = batched_completion_logprobs(rl_model, after, batch_size=256, temperature=temperature)
    ref_logprobs, _ = batched_completion_logprobs(sft_model, after, batch_size=256, temperature=temperature)
    results["kl"] = float(((logprobs - ref_logprobs) * after.completion_mask).sum(-1).mean())
    wins = sum(a > b for a, b in zip(results["gold_after"], results["gold_before"]))
    ties = sum(a == b for a, b in zip(results["gold_after"], results["gold_before"]))
    n = len(prompts)
    # Ties count half, the usual convention of pairwise win rates.
    results.update(win_rate=(wins + 0.5 * ties) / n, wins=wins, ties=ties, losses=n - wins - ties)
    return results


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------
def main(config: DemoConfig) -> int:
    import torch
    import transformers

    from posttrain.demo import report

    torch.set_num_threads(config.num_threads)
    # New score heads and tied-weight notes are expected here; the demo explains its own steps.
    transformers.logging.set_verbosity_error()
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    import datasets

    datasets.disable_progress_bars()
    out = Path(config.output_dir)
    try:
        _prepare_output_dir(out)
    except ConfigError as err:
        print(f"posttrain demo: {err}", file=sys.stderr)
        return 2
    (out / "demo_config.json").write_text(json.dumps(asdict(config), indent=2) + "\n", encoding="utf-8")
    sizes = sizes_for(config)
    timings: dict[str, float] = {}
    start = time.time()

    _say(
        f"[bold]posttrain demo[/bold] ({config.algo}{', quick' if config.quick else ''}): SFT -> reward model -> RL, "
        f"writing to {out}/"
    )
    task = demo_task.build_task(config.seed, num_reviews=sizes.num_reviews)
    tokenizer = demo_task.build_tokenizer(task.sft_train)
    _say(
        f"Task: {len(task.sft_train)} generated reviews, {len(tokenizer)} tokens of vocabulary, "
        f"{len(task.train_prompts)} training prompts, {len(task.heldout_prompts)} held-out prompts."
    )
    for text in task.sft_train[:3]:
        _say(f"  e.g. [italic]{text}[/italic]  (gold {demo_task.gold_score(text):+.0f})")

    _say("\n[bold]Step 1/3: supervised fine-tuning[/bold] of a tiny Llama from scratch")
    t = time.time()
    sft_model = train_sft(config, sizes, task, tokenizer, out / "sft")
    from posttrain.plots import read_metrics

    sft_eval = _last_with(read_metrics(out / "sft"), "eval_loss")
    samples = sample_completions(
        sft_model,
        tokenizer,
        task.heldout_prompts[:4],
        num_samples=1,
        max_new_tokens=sizes.response_length,
        temperature=0.7,
        seed=config.seed,
    )
    _say(
        f"SFT eval loss {sft_eval.get('eval_loss', float('nan')):.3f} "
        f"(perplexity {math.exp(sft_eval.get('eval_loss', float('nan'))):.2f}); samples on held-out prompts:"
    )
    for p, c in zip(task.heldout_prompts[:4], samples):
        _say(f"  {p} [cyan]{c}[/cyan]")
    timings["sft"] = time.time() - t

    _say("\n[bold]Step 2/3: reward model[/bold] from gold-labelled pairs of SFT samples")
    t = time.time()
    reward_model, rm_stats = train_reward_model(
        config, sizes, task, tokenizer, out / "sft", sft_model, out / "reward_model"
    )
    _say(
        f"chosen_last_scores (higher is better) : {rm_stats['chosen_score']}, "
        f"reject_last_scores (lower is better) : {rm_stats['rejected_score']}, "
        f"acc (higher is better) : {rm_stats['accuracy']}"
    )
    timings["reward_model"] = time.time() - t

    _say(f"\n[bold]Step 3/3: RL[/bold] ({config.algo}) on the proxy reward, KL-penalised towards the SFT model")
    t = time.time()
    rl_args = rl_config(config, sizes, out / "rl")
    monitor = GoldMonitor(stride=2 if config.algo == "xpo" else 1)
    rl_model = train_rl(config, task, tokenizer, out / "sft", out / "reward_model", rl_args, monitor).eval()
    monitor.save(out / "rl" / "gold_metrics.jsonl")
    timings["rl"] = time.time() - t

    _say("\n[bold]Evaluation[/bold] on held-out prompts")
    t = time.time()
    results = evaluate(
        sft_model,
        rl_model,
        reward_model,
        tokenizer,
        task.heldout_prompts[: sizes.eval_prompts],
        max_new_tokens=sizes.response_length,
        temperature=rl_args.temperature,
        seed=config.seed + 3,
    )
    timings["evaluation"] = time.time() - t
    timings["total"] = time.time() - start
    n_params = sum(p.numel() for p in sft_model.parameters())
    described = {
        **asdict(config),
        "model": f"Llama (hidden {sizes.hidden_size}, {sizes.num_layers} layers, {n_params / 1e6:.2f}M parameters)",
    }
    path = report.write_report(
        out,
        config=described,
        rm_stats=rm_stats,
        sft_eval=sft_eval,
        results=results,
        timings=timings,
        rl_args=rl_args.to_dict(),
    )
    summary = report.summarize(results)
    _say(
        f"Gold score {summary['gold_before']:+.2f} -> {summary['gold_after']:+.2f}, "
        f"proxy {summary['proxy_before']:+.2f} -> {summary['proxy_after']:+.2f}, "
        f"gold win rate of the RL policy over SFT {summary['win_rate']:.0%}, KL {summary['kl']:.2f}."
    )
    _say(f"Report: {path} (total {timings['total']:.0f} s)")
    return 0
