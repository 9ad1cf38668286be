"""Helpers shared by several test files (not collected: no test_ prefix)."""

import copy
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from datasets import Dataset

from posttrain.rollout import Rollout, generate
from posttrain.testing import build_tiny_causal_lm, build_tiny_reward_model, build_tiny_tokenizer
from posttrain.trainers.grpo_config import GRPOConfig
from posttrain.trainers.ppo_config import PPOConfig
from posttrain.trainers.reward import RewardTrainer
from posttrain.trainers.reward_config import RewardConfig
from posttrain.trainers.rloo_config import RLOOConfig
from posttrain.trainers.sft import SFTTrainer
from posttrain.trainers.sft_config import SFTConfig
from posttrain.trainers.supervised import IGNORE_INDEX

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Good morning.",
    "Once upon a time there was a little robot who loved to read books.",
    "The sea is wide and blue.",
    "Thank you very much.",
    "Question: how many legs does a spider have? Answer: eight legs.",
    "I think this answer is good.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9.",
]


# ChatML, for the chat-template tests: one block per message, and the assistant header on request.
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def conv(*pairs):
    """Messages from (role, content) pairs."""
    return [{"role": r, "content": c} for r, c in pairs]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and when other processes share the cores
    OpenMP's barriers make two threads 10-20x slower than one; restored after the module. A module
    takes it with `pytestmark = pytest.mark.usefixtures("one_thread")` (conftest.py provides it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def flat(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter of `model`, detached, in one 1-D tensor (a copy)."""
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def read_metrics(out: Path) -> list[dict]:
    """The records of a run's metrics.jsonl, in order."""
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]


# -- supervised trainers (SFT, reward) ---------------------------------------------------------------------


def _rows(data):
    """A list of rows as a Dataset (an empty list: None); a Dataset or None as it is."""
    if isinstance(data, list):
        return Dataset.from_list(data) if data else None
    return data


def supervised_config(config_cls, tmp_path, name="run", **overrides):
    """A 2-step run of batch 2 into tmp_path / name, logging every step, no checkpoints; `overrides` win."""
    values = dict(
        output_dir=str(tmp_path / name),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_steps=0,
        report_to="none",
        max_length=64,
    )
    values.update(overrides)
    return config_cls(**values)


def sft_config(tmp_path, name="run", **overrides) -> SFTConfig:
    return supervised_config(SFTConfig, tmp_path, name, **overrides)


def reward_config(tmp_path, name="run", **overrides) -> RewardConfig:
    return supervised_config(RewardConfig, tmp_path, name, **overrides)


def sft_trainer(
    tmp_path, tokenizer, train, eval_dataset=None, name="run", model_seed=0, model_kwargs=None, callbacks=None, **fields
) -> SFTTrainer:
    """An SFTTrainer of a fresh tiny causal LM (initialised from `model_seed`, `model_kwargs` to its config) on
    `train` / `eval_dataset` (datasets or lists of rows), with `sft_config(tmp_path, name, **fields)`."""
    return SFTTrainer(
        build_tiny_causal_lm(tokenizer, seed=model_seed, **(model_kwargs or {})),
        args=sft_config(tmp_path, name, **fields),
        train_dataset=_rows(train),
        eval_dataset=_rows(eval_dataset),
        processing_class=copy.deepcopy(tokenizer),
        callbacks=callbacks,
    )


def reward_trainer(
    tmp_path, tokenizer, train, eval_dataset=None, name="run", model_seed=0, callbacks=None, **fields
) -> RewardTrainer:
    """A RewardTrainer of a fresh tiny reward model, as `sft_trainer`."""
    return RewardTrainer(
        build_tiny_reward_model(tokenizer, seed=model_seed),
        args=reward_config(tmp_path, name, **fields),
        train_dataset=_rows(train),
        eval_dataset=_rows(eval_dataset),
        processing_class=copy.deepcopy(tokenizer),
        callbacks=callbacks,
    )


def reference_loss_sum(model, batch) -> torch.Tensor:
    """Full-vocabulary float32 cross-entropy summed over the trained next-token targets."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


# -- online trainers ---------------------------------------------------------------------------------------


def prompt_dataset(n: int = 64, numbered: bool = False) -> Dataset:
    """n prompts "Prompt number {i} says"; numbered: with a "number" column (i) for reward functions."""
    rows = {"prompt": [f"Prompt number {i} says" for i in range(n)]}
    if numbered:
        rows["number"] = list(range(n))
    return Dataset.from_dict(rows)


def letter_fraction(prompts, completions, **columns):
    """Learnable toy reward: the fraction of the completion's characters that are 'e'."""
    return [c.count("e") / len(c) if c else 0.0 for c in completions]


def count_e(prompts, completions, **columns):
    return [float(c.count("e")) for c in completions]


# What TRL's RLOOTrainer and PPOTrainer log at every step (PPO adds loss/value_avg).
RL_METRICS = (
    "eps",
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/scores",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "loss/policy_avg",
    "val/clipfrac_avg",
    "policy/entropy_avg",
    "val/ratio",
    "val/ratio_var",
    "val/num_eos_tokens",
    "lr",
    "episode",
)


def online_config(config_cls, tmp_path, name="out", **overrides):
    """A PPO / RLOO / GRPO config (`config_cls`): rollout batches of 4 completions of 6 tokens at
    temperature 1, 8 episodes, lr 1e-3, no checkpoints, into tmp_path / name; `overrides` win."""
    values = dict(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=4,
        total_episodes=8,
        response_length=6,
        learning_rate=1e-3,
        report_to="none",
        num_sample_generations=0,
        save_steps=0,
        temperature=1.0,
    )
    values.update(overrides)
    return config_cls(**values)


def ppo_config(tmp_path, **overrides) -> PPOConfig:
    return online_config(PPOConfig, tmp_path, **overrides)


def rloo_config(tmp_path, name="out", **overrides) -> RLOOConfig:
    """online_config with 2 samples per prompt and one PPO epoch."""
    one_epoch = dict(gradient_accumulation_steps=1, rloo_k=2, num_ppo_epochs=1)
    return online_config(RLOOConfig, tmp_path, name, **{**one_epoch, **overrides})


def learning_rloo_config(tmp_path, name="out") -> RLOOConfig:
    """The RLOO learning check's settings: 30 rollout batches of 4 prompts × k = 4 at lr 1e-2, no KL,
    on which `letter_fraction` rises by more than 0.08 from the first 5 batches to the last 5."""
    return rloo_config(
        tmp_path,
        name,
        per_device_train_batch_size=16,
        rloo_k=4,
        total_episodes=16 * 30,
        response_length=8,
        learning_rate=1e-2,
        kl_coef=0.0,
        lr_scheduler_type="constant",
    )


def grpo_config(tmp_path, name="out", **overrides) -> GRPOConfig:
    """online_config with one group of 4 per rollout batch."""
    return online_config(GRPOConfig, tmp_path, name, **{"num_generations": 4, **overrides})


def per_row_generate(
    model, prompt_ids, prompt_mask, sampling, *, pad_token_id, batch_size=None, generator=None, first_index=0, **kw
):
    """`rollout.generate` whose tokens for a row depend only on that row's prompt and its sample index
    (how many times the prompt was seen in this call, counted from `first_index`): each rank of a
    data-parallel run samples from its own stream, so the 2-process == 1-process tests patch the
    trainers' `generate` with this."""
    seen: dict[tuple, int] = {}
    rows = []
    for ids, mask in zip(prompt_ids, prompt_mask):
        key = tuple(ids[mask.bool()].tolist())
        seen[key] = seen.get(key, first_index - 1) + 1
        seed = (sum((i + 1) * t for i, t in enumerate(key)) * 1009 + seen[key]) % (2**31)
        g = torch.Generator(device=ids.device).manual_seed(seed)
        rows.append(
            generate(
                model,
                ids[mask.bool()][None],
                mask[mask.bool()][None],
                sampling,
                pad_token_id=pad_token_id,
                generator=g,
                **kw,
            )
        )
    return Rollout.cat(rows)


def train_and_last_log(trainer) -> dict:
    """Train an online trainer; the entry of its last logging step in trainer.state.log_history: the
    entry before the end-of-training summary, or the summary itself when the last rollout batch was
    not a logging step (its metrics then join the summary, as in transformers.Trainer and TRL)."""
    trainer.train()
    return last_metrics(trainer.state.log_history)


def last_metrics(history: list[dict]) -> dict:
    """The entry of log_history holding the metrics of the last rollout batch (see train_and_last_log)."""
    assert "train_runtime" in history[-1]
    if "lr" in history[-1]:  # the last rollout batch was not a logging step: the summary's own keys dropped
        return {k: v for k, v in history[-1].items() if not k.startswith("train_") and k != "total_flos"}
    assert "train_runtime" not in history[-2] and "lr" in history[-2]
    return history[-2]


def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


# -- Online DPO / XPO ------------------------------------------------------------------------------------

WORDS = [
    "Hello world",
    "The quick brown fox",
    "What is the capital",
    "Once upon a time",
    "Write a poem",
    "Numbers 1 2 3",
    "Thank you",
    "Good morning",
]


def word_prompts(n: int = 8, conversational: bool = False) -> Dataset:
    """n prompts cycling through WORDS; conversational: each as a one-message user turn."""
    rows = [WORDS[i % len(WORDS)] for i in range(n)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": r}] for r in rows] if conversational else rows})


def pair_config(config_cls, tmp_path, **overrides):
    """An Online DPO / XPO config (`config_cls`): micro-batches of 2 prompts (4 completions) accumulated
    twice, 16 episodes, completions of up to 6 tokens, logging every step, no checkpoints, into
    tmp_path / "out"; `overrides` win."""
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,  # prompts: 4 completions per micro-batch
        gradient_accumulation_steps=2,
        total_episodes=16,
        max_new_tokens=6,
        logging_steps=1,
        learning_rate=1e-3,
        report_to="none",
        save_steps=0,
        num_sample_generations=0,
        seed=0,
    )
    values.update(overrides)
    return config_cls(**values)


def assert_resumed_as_uninterrupted(full, resumed, restored: int = 2) -> None:
    """A pair trainer resumed from a checkpoint ends where the uninterrupted run ends: the checkpoint's
    first `restored` log_history entries kept as they were, the same policy weights, and the same last
    rollout-batch log (its wall-clock `eps` aside)."""
    assert resumed.state.log_history[:restored] == full.state.log_history[:restored]  # restored from the checkpoint
    for (k, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), k
    last, full_last = last_metrics(resumed.state.log_history), last_metrics(full.state.log_history)
    assert last == {**full_last, "eps": last["eps"]}


def online_prompts(n: int) -> Dataset:
    """The prompts of `online_trainer`: n short phrases, each numbered."""
    words = ["Hello world", "The quick brown fox", "Once upon a time", "Thank you", "Good morning", "Blue sea"]
    return Dataset.from_dict({"prompt": [words[i % len(words)] + f" {i}" for i in range(n)]})


def online_trainer(
    algo, out, tokenizer, callbacks=None, prompts=4, reward=length_reward, peft_config=None, **overrides
):
    """A tiny online trainer whose rollout batch is 4 completions (2 prompts × 2 samples; PPO: 4
    prompts × 1), over `prompts` prompts per pass, with 2 rollout batches (8 episodes) by default.
    peft_config: a peft.LoraConfig for the policy (the trainer's `peft_config=`)."""
    from posttrain.trainers.grpo import GRPOTrainer
    from posttrain.trainers.grpo_config import GRPOConfig
    from posttrain.trainers.online_dpo import OnlineDPOTrainer
    from posttrain.trainers.online_dpo_config import OnlineDPOConfig
    from posttrain.trainers.ppo import PPOTrainer
    from posttrain.trainers.ppo_config import PPOConfig
    from posttrain.trainers.rloo import RLOOTrainer
    from posttrain.trainers.rloo_config import RLOOConfig
    from posttrain.trainers.xpo import XPOTrainer
    from posttrain.trainers.xpo_config import XPOConfig

    values = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        total_episodes=8,
        learning_rate=1e-3,
        logging_steps=1,
        save_steps=1,
        report_to="none",
        num_sample_generations=0,
        seed=0,
    )
    eval_dataset = overrides.pop("eval_dataset", None)
    dataset = overrides.pop("train_dataset", None)
    values.update(overrides)
    dataset = online_prompts(prompts) if dataset is None else dataset
    policy = build_tiny_causal_lm(tokenizer)
    common = dict(train_dataset=dataset, eval_dataset=eval_dataset, callbacks=callbacks, peft_config=peft_config)
    if algo == "rloo":
        args = RLOOConfig(**{"rloo_k": 2, "response_length": 4, **values})
        return RLOOTrainer(args, tokenizer, policy, None, reward, **common)
    if algo == "grpo":
        # beta > 0: a KL term and a reference (TRL 1.16's default beta is 0.0, no reference)
        args = GRPOConfig(**{"num_generations": 2, "response_length": 4, "beta": 0.05, **values})
        return GRPOTrainer(policy, reward, args, processing_class=tokenizer, **common)
    if algo == "ppo":
        args = PPOConfig(response_length=4, value_model_init="policy", **values)
        return PPOTrainer(args=args, processing_class=tokenizer, model=policy, reward_model=reward, **common)
    config_cls, trainer_cls = (OnlineDPOConfig, OnlineDPOTrainer) if algo == "online_dpo" else (XPOConfig, XPOTrainer)
    # Online DPO / XPO count per_device_train_batch_size in prompts (TRL): 2 prompts = 4 completions.
    values["per_device_train_batch_size"] = overrides.get("per_device_train_batch_size", 2)
    args = config_cls(max_new_tokens=4, **values)
    return trainer_cls(policy, reward_model=[reward], args=args, processing_class=tokenizer, **common)


def tensorboard_scalars(folder) -> dict[str, list[int]]:
    """{tag: [steps]} of the scalars in a TensorBoard folder, read with tensorboard's EventAccumulator;
    on the oldest stack (tensorboard 2.15, whose readers need numpy < 2) the TFRecord framing (u64
    length, u32 crc, data, u32 crc) is read here and each record parsed as tensorboard's Event proto."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except AttributeError:  # tensorboard 2.15 + numpy 2: np.string_ at import
        from tensorboard.compat.proto.event_pb2 import Event

        scalars: dict[str, list[int]] = {}
        for path in sorted(folder.glob("events.out.tfevents.*")):
            data, pos = path.read_bytes(), 0
            while pos < len(data):
                (length,) = struct.unpack("<Q", data[pos : pos + 8])
                event = Event.FromString(data[pos + 12 : pos + 12 + length])
                pos += 12 + length + 4
                for value in event.summary.value:
                    scalars.setdefault(value.tag, []).append(event.step)
        return scalars
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


# -- a causal LM built from config (64-word vocabulary) -----------------------------------------------------


def tiny_llama(**overrides: Any) -> transformers.LlamaForCausalLM:
    """A 2-layer Llama (hidden 32, 4 query / 2 key-value heads) over 64 ids, seeded 0, in eval mode;
    `overrides` replace LlamaConfig fields."""
    torch.manual_seed(0)
    fields = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=128,
    )
    config = transformers.LlamaConfig(**{**fields, **overrides})
    return transformers.LlamaForCausalLM(config).eval()


def tiny_neox() -> transformers.GPTNeoXForCausalLM:
    """A 2-layer GPTNeoX (hidden 32, 4 heads) over 64 ids, seeded 1, in eval mode."""
    torch.manual_seed(1)
    config = transformers.GPTNeoXConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=64,
        max_position_embeddings=128,
    )
    return transformers.GPTNeoXForCausalLM(config).eval()


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of token rows left-padded with `pad` to the longest."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = True
    return ids, mask


# -- encoder-decoder models (64-word vocabulary) -------------------------------------------------------------

VOCAB = 64


def tiny_t5(seed: int = 0) -> transformers.PreTrainedModel:
    """A 1-layer T5 (d_model 16) over VOCAB ids, initialised from `seed` (pad 0, eos 1, decoder start 0)."""
    torch.manual_seed(seed)
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return transformers.T5ForConditionalGeneration(config)


def tiny_bart(seed: int = 0) -> transformers.PreTrainedModel:
    """A 1-layer BART (d_model 16) over VOCAB ids, initialised from `seed` (pad 1, eos 2, decoder start 2)."""
    torch.manual_seed(seed)
    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
    )
    return transformers.BartForConditionalGeneration(config)


# -- the command line in subprocesses ----------------------------------------------------------------------

CLI_PROMPTS = [f"Prompt number {i} says" for i in range(16)]


def train_argv(command: str, model, data, out, *flags) -> list[str]:
    """`posttrain <command> --model_name_or_path model --dataset_name data --output_dir out *flags`, as
    the argument list `cli.main` takes (every item a str)."""
    argv = [command, "--model_name_or_path", model, "--dataset_name", data, "--output_dir", out, *flags]
    return [str(a) for a in argv]


def write_cli_files(root: Path) -> Path:
    """What the command-line tests start from, in `root`: a saved tiny policy (policy/) and reward model
    (rm/) with their tokenizer, and the datasets prompts.jsonl (CLI_PROMPTS), text.jsonl (each prompt +
    " something nice.") and pairs.jsonl (chosen: prompt + " good.", rejected: prompt + " bad bad.")."""
    tok = build_tiny_tokenizer()
    build_tiny_causal_lm(tok, save_dir=root / "policy")
    build_tiny_reward_model(tok, save_dir=root / "rm")
    write_jsonl(root / "prompts.jsonl", [{"prompt": p} for p in CLI_PROMPTS])
    write_jsonl(root / "text.jsonl", [{"text": p + " something nice."} for p in CLI_PROMPTS])
    write_jsonl(root / "pairs.jsonl", [{"chosen": p + " good.", "rejected": p + " bad bad."} for p in CLI_PROMPTS])
    return root


def cli_command(name: str, root: Path, out: Path, steps: int) -> list[str]:
    """The command line (after `posttrain`) of trainer `name` over write_cli_files' `root`, running `steps`
    optimizer steps (one per rollout batch online) into `out`, saving a checkpoint at every step."""
    if name in ("sft", "reward"):
        data = "text.jsonl" if name == "sft" else "pairs.jsonl"
        model = "policy" if name == "sft" else "rm"
        args = ["--dataset_name", str(root / data), "--model_name_or_path", str(root / model)]
        args += ["--per_device_train_batch_size", "2", "--max_steps", str(steps)]
    else:
        args = ["--dataset_name", str(root / "prompts.jsonl"), "--model_name_or_path", str(root / "policy")]
        args += ["--reward_model_path", str(root / "rm"), "--response_length", "4"]
        args += ["--per_device_train_batch_size", "2", "--max_steps", str(steps)]
        if name == "rloo":
            args += ["--rloo_k", "2", "--num_ppo_epochs", "1"]
        if name == "grpo":
            args += ["--num_generations", "2"]
        if name == "ppo":
            args += ["--num_ppo_epochs", "1"]
    return [name, *args, "--output_dir", str(out), "--save_steps", "1", "--logging_steps", "1", "--report_to", "none"]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a posttrain subprocess: os.environ (conftest.py's per-worker PET_MASTER_PORT
    included) without the ACCELERATE_* switches a launcher may have set (FSDP, DeepSpeed), one thread per
    process, no tokenizer threads, no network; `extra` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", **extra)
    return env


def python_command(nproc: int = 1) -> list[str]:
    """This interpreter for one process; torchrun (`python -m torch.distributed.run --nproc_per_node N`,
    this interpreter's) for several. No --master_port: conftest.py's PET_MASTER_PORT reaches it."""
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]


def posttrain_command(nproc: int = 2) -> list[str]:
    """`python -m posttrain`, or `torchrun --nproc_per_node N -m posttrain`: how a user starts it."""
    return [*python_command(nproc), "-m", "posttrain"]


def run_processes(
    args: list[str], nproc: int = 2, timeout: int = 300, check: bool = False
) -> subprocess.CompletedProcess:
    """`python *args` in `nproc` CPU processes (torchrun and gloo for several) with child_env and
    ACCELERATE_USE_CPU; output captured as text. check: assert the exit code is 0, showing stderr's tail."""
    env = child_env(ACCELERATE_USE_CPU="true")
    proc = subprocess.run([*python_command(nproc), *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def one_and_two_processes(tmp_path: Path, script: str, *args: str, timeout: int = 150) -> tuple[dict, dict]:
    """Write `script` and run it as `python script *args OUT TESTS` in 1 process, then in 2 (torchrun and
    gloo: `accelerate launch --cpu --num_processes 2` starts a single process with accelerate 1.15, while
    torchrun with ACCELERATE_USE_CPU gives accelerate a real 2-rank group). Each run saves its results with
    torch.save to OUT; TESTS is this folder, for the script to import helpers. Returns (one, two)."""
    path = tmp_path / "script.py"
    path.write_text(script)
    here = str(Path(__file__).parent)
    for nproc, name in ((1, "one.pt"), (2, "two.pt")):
        run_processes([str(path), *args, str(tmp_path / name), here], nproc=nproc, timeout=timeout, check=True)
    return torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")


def launch(argv: list[str], nproc: int = 2, timeout: int = 300, check: bool = False) -> subprocess.CompletedProcess:
    """`posttrain *argv` in `nproc` CPU processes, as a user starts it (run_processes)."""
    return run_processes(["-m", "posttrain", *argv], nproc, timeout, check)


def checkpoint_steps(out: Path, complete_only: bool = False) -> list[int]:
    """The steps of the checkpoint-N folders in `out`, ascending; complete_only: those whose
    checkpoint_complete.json marker was written."""
    folders = Path(out).glob("checkpoint-*")
    done = [p for p in folders if not complete_only or (p / "checkpoint_complete.json").exists()]
    return sorted(int(p.name.split("-")[1]) for p in done)


def make_rollout(
    prompts: list[list[int]], completions: list[list[int]], T: int, pad: int, ended: list[bool] | None = None
) -> Rollout:
    """A Rollout of the given token ids: prompts left-padded, completions right-padded to T with `pad`;
    `ended` defaults to "shorter than T"."""
    from posttrain.ops import lengths_to_mask

    P = max(map(len, prompts))
    prompt_ids = torch.full((len(prompts), P), pad)
    prompt_mask = torch.zeros(len(prompts), P, dtype=torch.bool)
    completion_ids = torch.full((len(prompts), T), pad)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        prompt_ids[i, P - len(p) :] = torch.tensor(p)
        prompt_mask[i, P - len(p) :] = True
        if c:
            completion_ids[i, : len(c)] = torch.tensor(c)
    lengths = torch.tensor([len(c) for c in completions])
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=lengths_to_mask(lengths, T),
        completion_lengths=lengths,
        ended=torch.tensor(ended) if ended is not None else lengths < T,
        logprobs=None,
        entropy=None,
        pad_token_id=pad,
    )
