"""Plumbing of the classic PPO API (trainers/ppo_classic.py) that is not PPO: the step run
(accelerator, sampling stream, metrics), ragged queries to padded model input, the generation keywords,
encoder–decoder sampling, (query, response) lists to a Rollout, step() input checks, the dataloader,
the tracker and the model card. TRL 0.7's `PPOTrainer` does the same jobs in its constructor,
`_generate_batched`, `_step_safety_checker`, `prepare_dataloader` and `create_model_card`.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from posttrain import distributed as dist
from posttrain.configs import ConfigError
from posttrain.health import HealthMonitor
from posttrain.rollout import Rollout, SamplingConfig, make_sampler
from posttrain.tracking import MetricAccumulator, Tracker
from posttrain.trainers.online import OnlineRun, RunProgress
from posttrain.trainers.ppo_config import PPOConfig

# Keyword arguments of the classic generate() that the rollout engine understands.
GENERATION_KWARGS = {
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "do_sample",
    "eos_token_id",
    "pad_token_id",
    "min_length",
}
# Dataset columns the classic dataloader keeps besides the model's forward arguments (for logging).
LOGGED_COLUMNS = ("label", "query", "response")
# Accelerator keywords the config sets through its own fields.
_OWN_ACCELERATOR_KWARGS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "mixed_precision": "bf16 / fp16",
    "log_with": "log_with",
    "project_config": "project_kwargs",
}

MODEL_CARD = """---
license: apache-2.0
tags:
- posttrain
- transformers
- reinforcement-learning
---

# {model_name}

A language model fine-tuned with reinforcement learning (PPO) by
[posttrain](https://github.com/posttrain/posttrain) to steer its outputs towards a reward.

## Usage

```python
from transformers import pipeline

generator = pipeline("text-generation", model="{model_id}")
outputs = generator("Hello, my llama is cute")
```

With its value head:

```python
from transformers import AutoTokenizer
from posttrain import AutoModelForCausalLMWithValueHead

tokenizer = AutoTokenizer.from_pretrained("{model_id}")
model = AutoModelForCausalLMWithValueHead.from_pretrained("{model_id}")
inputs = tokenizer("Hello, my llama is cute", return_tensors="pt")
logits, loss, values = model(**inputs, labels=inputs["input_ids"])
```
"""


class StepRun(OnlineRun):
    """What step() needs of an online run: the accelerator (with the config's accelerator_kwargs and
    project_kwargs), the sampling stream, metrics, the health monitor (the non-finite policy) and
    counters; no prompt stream or checkpoints."""

    def __init__(self, config: PPOConfig) -> None:
        from accelerate.utils import ProjectConfiguration

        self.config = config
        clash = sorted(set(config.accelerator_kwargs) & set(_OWN_ACCELERATOR_KWARGS))
        if clash:
            raise ConfigError(
                f"accelerator_kwargs sets {clash}; give {', '.join(_OWN_ACCELERATOR_KWARGS[k] for k in clash)} "
                "in PPOConfig instead."
            )
        try:
            project = ProjectConfiguration(**config.project_kwargs)
        except TypeError as err:
            raise ConfigError(f"project_kwargs: {err}; see accelerate.utils.ProjectConfiguration.") from None
        try:
            self.accelerator = dist.accelerator_for(config, project_config=project, **config.accelerator_kwargs)
        except TypeError as err:
            raise ConfigError(f"accelerator_kwargs: {err}; see accelerate.Accelerator.") from None
        dist.set_seed(config.seed)
        self.world_size = dist.world_size(self.accelerator)
        self.device = dist.device(self.accelerator)
        self.is_main = dist.is_main(self.accelerator)
        self.generator = torch.Generator(device=self.device).manual_seed(
            config.seed + 7919 * dist.process_index(self.accelerator)
        )
        self.progress = RunProgress()
        self.metrics = MetricAccumulator()
        self.health = HealthMonitor(enabled=self.is_main)


def build_tracker(config: PPOConfig, accelerator: Any) -> Tracker:
    """The log_stats() sinks: console and metrics.jsonl in output_dir, plus log_with (report_to).
    W&B gets project = tracker_project_name and tracker_kwargs["wandb"]; TensorBoard writes to
    project_kwargs["logging_dir"]/tracker_project_name (default output_dir/runs/tracker_project_name)
    with tracker_kwargs["tensorboard"], as accelerate's trackers do for TRL 0.7."""
    sinks = set(config.report_to) - {"none"}
    unused = sorted(set(config.tracker_kwargs) - sinks - ({"wandb", "tensorboard"} if "all" in sinks else set()))
    if unused:
        raise ConfigError(f"tracker_kwargs has settings for {unused}, which log_with / report_to does not use.")
    root = config.project_kwargs.get("logging_dir") or os.path.join(config.output_dir, "runs")
    return Tracker(
        config.output_dir,
        config.report_to,
        config=config.to_dict(),
        run_name=config.run_name or config.exp_name,
        is_main=dist.is_main(accelerator),
        project=config.tracker_project_name,
        init_kwargs=config.tracker_kwargs,
        logging_dir=os.path.join(root, config.tracker_project_name),
        transformers_keys=False,  # TRL 0.7 logged `env/reward_mean`, `ppo/...` through accelerate, unprefixed
    )


def dict_collator(rows: list[Any]) -> Any:
    """The classic example's collator: a dict of lists (ragged tensors stay a list). Rows that are not
    dicts (a torch Dataset of (query, response) tuples) go through torch's default_collate, what a
    DataLoader without a collator does."""
    if not isinstance(rows[0], Mapping):
        return torch.utils.data.default_collate(rows)
    return {key: [row[key] for row in rows] for key in rows[0]}


def signature_columns(model: nn.Module) -> list[str]:
    """The columns the classic dataloader keeps: the model's forward arguments plus LOGGED_COLUMNS."""
    names = list(inspect.signature(model.forward).parameters)
    lm = getattr(model, "pretrained_model", None)
    if lm is not None:  # a value-head wrapper forwards **kwargs to the LM
        names += list(inspect.signature(lm.forward).parameters)
    return list(dict.fromkeys(names + list(LOGGED_COLUMNS)))


def remove_unused_columns(dataset: Any, model: nn.Module) -> Any:
    """A `datasets.Dataset` without the columns signature_columns() does not list (TRL's
    `_remove_unused_columns`); other datasets are returned as they are."""
    names = getattr(dataset, "column_names", None)
    if names is None or not hasattr(dataset, "remove_columns"):
        return dataset
    keep = set(signature_columns(model))
    unused = [c for c in names if c not in keep]
    return dataset.remove_columns(unused) if unused else dataset


def sampling_from_kwargs(kwargs: dict, tokenizer: Any, default_max_new_tokens: int) -> SamplingConfig:
    """SamplingConfig of the classic generate()'s keyword arguments; unsupported ones are refused."""
    unknown = sorted(set(kwargs) - GENERATION_KWARGS)
    if unknown or (kwargs.get("min_length") or -1) > 0:
        raise ConfigError(
            f"generate() does not support {unknown or ['min_length > 0']}; supported generation kwargs: "
            f"{', '.join(sorted(GENERATION_KWARGS))} (min_length only as -1/0/None)."
        )
    eos = kwargs.get("eos_token_id", tokenizer.eos_token_id)
    stops = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    return SamplingConfig(
        max_new_tokens=kwargs.get("max_new_tokens") or default_max_new_tokens,
        temperature=float(kwargs.get("temperature", 1.0)),
        top_k=int(kwargs.get("top_k", 0) or 0),
        top_p=float(kwargs.get("top_p", 1.0)),
        do_sample=bool(kwargs.get("do_sample", True)),
        stop_token_ids=stops,
    )


def pad_queries(
    queries: Sequence[torch.Tensor], pad_id: int, device: torch.device, encoder_decoder: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of ragged 1-D queries: left-padded for a causal LM; right-padded encoder input for
    an encoder–decoder (models with absolute positions, e.g. BART, number encoder tokens from 0)."""
    width = max(len(q) for q in queries)
    ids = torch.full((len(queries), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(queries), width, dtype=torch.bool)
    for i, q in enumerate(queries):
        cols = slice(0, len(q)) if encoder_decoder else slice(width - len(q), width)
        ids[i, cols], mask[i, cols] = q.long().cpu(), True
    return ids.to(device), mask.to(device)


@torch.no_grad()
def seq2seq_sample(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, sampling: SamplingConfig, generator: Any
) -> list[torch.Tensor]:
    """Sample decoder sequences for right-padded encoder inputs: each starts with the model's
    decoder start token and ends after its first stop token (kept), or after max_new_tokens new
    tokens. The encoder runs once; the decoder step by step with its key/value cache."""
    config = model.config
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(getattr(model, "generation_config", None), "decoder_start_token_id", None)
    if start is None:
        raise ConfigError("the encoder-decoder model's config has no decoder_start_token_id.")
    B, device = ids.size(0), ids.device
    attention = mask.long()
    encoder_outputs = model.get_encoder()(input_ids=ids.masked_fill(~mask, 0), attention_mask=attention)
    sampler = make_sampler(sampling, generator, False, False)
    stops = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=device)
    tokens = torch.full((B, 1), int(start), dtype=torch.long, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    lengths = torch.ones(B, dtype=torch.long, device=device)
    step_input, past = tokens, None
    for _ in range(sampling.max_new_tokens):
        out = model(
            encoder_outputs=encoder_outputs,
            attention_mask=attention,
            decoder_input_ids=step_input,
            past_key_values=past,
            use_cache=True,
        )
        past = out.past_key_values
        logits = out.logits[:, -1, :]
        tok = sampler(logits, logits.size(0), None)[0]
        lengths += ~finished
        finished |= torch.isin(tok, stops)
        step_input = tok[:, None]  # a finished row's later tokens are cut off below
        tokens = torch.cat([tokens, step_input], dim=1)
        if bool(finished.all()):
            break
    return [tokens[i, :n] for i, n in enumerate(lengths.tolist())]


def check_step_inputs(
    queries: Any, responses: Any, scores: Any, response_masks: Any, batch_size: int | None, encoder_decoder: bool
) -> torch.Tensor:
    """TRL's `_step_safety_checker`, with messages naming the argument and row: lists of equal length
    (= batch_size when set), non-empty 1-D token tensors, one finite number per score. Returns the
    scores as a float32 (B,) tensor."""
    n = len(queries) if isinstance(queries, (list, tuple)) else -1
    named = [("queries", queries), ("responses", responses), ("scores", scores)]
    for name, value in named + ([("response_masks", response_masks)] if response_masks is not None else []):
        if not isinstance(value, (list, tuple)) or len(value) != n:
            raise ValueError(
                f"step(): {name} must be a list of {n} tensors (one per query), got {type(value).__name__} "
                f"of length {len(value) if hasattr(value, '__len__') else '?'}."
            )
    if batch_size is not None and n != batch_size:
        raise ValueError(f"step() got {n} queries but config.batch_size = {batch_size}; pass exactly batch_size rows.")
    skip = 1 if encoder_decoder else 0  # the decoder start token is never trained on
    for i, (q, r) in enumerate(zip(queries, responses)):
        ok = all(isinstance(t, torch.Tensor) and t.dim() == 1 and len(t) for t in (q, r))
        if not ok:
            raise ValueError(f"step(): queries[{i}] and responses[{i}] must be non-empty 1-D token tensors.")
        if encoder_decoder and len(r) < 2:
            raise ValueError(
                f"step(): responses[{i}] must hold the decoder start token and at least one generated token."
            )
        if response_masks is not None and (
            len(response_masks[i]) != len(r) or not bool(torch.as_tensor(response_masks[i])[skip:].any())
        ):
            raise ValueError(
                f"step(): response_masks[{i}] must have len(responses[{i}]) = {len(r)} entries, at least one 1"
                + (" after the decoder start token." if skip else ".")
            )
    for i, s in enumerate(scores):
        # One number per pair (classic TRL: 0-d or 1-element); taking element 0 of a longer
        # tensor would silently train on the wrong reward.
        t = torch.as_tensor(s)
        if t.numel() != 1 or t.dim() > 1:
            raise ValueError(
                f"step(): scores[{i}] must be a 0-d or 1-element tensor (one score per response), "
                f"got shape {tuple(t.shape)}."
            )
    score_t = torch.tensor([float(torch.as_tensor(s).reshape(-1)[0]) for s in scores], dtype=torch.float32)
    if not bool(torch.isfinite(score_t).all()):
        raise ValueError(f"step(): scores must be finite, got {score_t.tolist()}.")
    return score_t


def step_rollout(
    queries: Sequence[torch.Tensor],
    responses: Sequence[torch.Tensor],
    response_masks: Sequence[Any] | None,
    tokenizer: Any,
    device: torch.device,
    encoder_decoder: bool,
) -> tuple[Rollout, torch.Tensor | None]:
    """(rollout, loss_mask) of step()'s lists. The rollout's completion_mask covers every response
    token: it is also the attention mask, and a token left out of the loss (response_masks 0, e.g. a
    tool's output) is still context for the tokens after it (classic TRL multiplies response_masks
    into the loss mask only). loss_mask = completion_mask ∧ response_masks, None without masks; for an
    encoder–decoder the decoder start token (column 0) is input only, never in the loss."""
    pad = tokenizer.pad_token_id
    prompt_ids, prompt_mask = pad_queries(queries, pad, device, encoder_decoder)
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.long, device=device)
    T = int(lengths.max())
    ids = torch.full((len(responses), T), pad, dtype=torch.long, device=device)
    mask = torch.zeros(len(responses), T, dtype=torch.bool, device=device)
    loss_mask = None if response_masks is None else torch.zeros_like(mask)
    for i, r in enumerate(responses):
        ids[i, : len(r)] = r.long().to(device)
        mask[i, : len(r)] = True
        if loss_mask is not None:
            loss_mask[i, : len(r)] = torch.as_tensor(response_masks[i]).bool().to(device)
    if encoder_decoder:
        first = torch.zeros_like(mask)
        first[:, 0] = True
        loss_mask = (mask if loss_mask is None else loss_mask) & ~first
    eos = tokenizer.eos_token_id
    ended = torch.tensor([eos is not None and int(r[-1]) == eos for r in responses], device=device)
    return Rollout(prompt_ids, prompt_mask, ids, mask, lengths, ended, None, None, pad), loss_mask


def write_model_card(path: str, model_name: str = "TRL Model", model_id: str | None = None) -> str:
    """Write `path/README.md` (a Hub model card for the trained model); returns its path. TRL asks the Hub
    who the user is for the model id and writes nothing offline; here the id defaults to the folder's
    name and the card is always written."""
    os.makedirs(path, exist_ok=True)
    card = os.path.join(path, "README.md")
    with open(card, "w", encoding="utf-8") as f:
        f.write(MODEL_CARD.format(model_name=model_name, model_id=model_id or os.path.basename(os.path.abspath(path))))
    return card


def empty_device_cache() -> None:
    """optimize_cuda_cache: collect garbage and empty the CUDA cache (TRL's `PPODecorators`)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
