"""`posttrain judge`: the win rate of a model against reference completions, decided by a judge.

Like TRL's `examples/scripts/evals/judge_tldr.py`: generate greedily (temperature
0) for a prompt set, compare each completion with a reference completion using any pairwise judge,
and print the model's win rate. Here the win rate comes with a Wilson 95% interval and the number of
judge failures (-1 answers, left out of the rate), and the pieces are interchangeable:

- model completions: generated with --model_name_or_path, or read from --completions_file (.jsonl
  with a "completion" field, and "prompt" when no dataset is given);
- references: a dataset column (--reference_column), a .jsonl file (--reference_file), or another
  model's generations (--reference_model, same settings);
- judge: any spec of judges.judge_from_spec (pair_rm, openai[:model], http:<url>#<model>,
  reward_model:<path>, python:<module>:<function>, random[:seed]), or, as judge_tldr.py takes it,
  a judge LLM by name (--judge_model: a "gpt" name is an OpenAI model, any other a model hosted by
  Hugging Face; judges.judge_from_model_name). HTTP judges take --timeout, --max_retries and
  --max_concurrency. A progress bar counts the pairs judged.

    posttrain judge --model_name_or_path out/ppo --judge openai:gpt-4o-mini \\
        --dataset_name trl-lib/tldr --dataset_split validation --reference_column completion \\
        --num_examples 1000 --output_file judged.jsonl
    # judge_tldr.py's command, as written: trl-lib/tldr's validation split against its "completion"
    posttrain judge --model_name_or_path out/ppo --judge_model gpt-4o-mini --num_examples 1000

The judge sees the pair (model, reference) and its answer 0 means the model won; judges flip pair
order internally against position bias (judges.BasePairwiseJudge).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from posttrain.configs import ConfigError, flag

# judge_tldr.py's data: with --judge_model and no prompts given, the model is judged on these.
TLDR_DATASET, TLDR_SPLIT, TLDR_REFERENCE = "trl-lib/tldr", "validation", "completion"
DEFAULT_SPLIT = "test"


@dataclass
class JudgeConfig:
    """Flags of `posttrain judge` (names as judge_tldr.py where it has them)."""

    model_name_or_path: str | None = flag("Model whose completions are judged (a folder or hub name).", default=None)
    judge: str | None = flag(
        "Judge spec: pair_rm, openai[:model], http:<base_url>#<model>, reward_model:<path>, "
        "python:<module>:<function>, random[:seed].",
        default=None,
    )
    judge_model: str | None = flag(
        "Judge LLM by name, as TRL's judge_tldr.py takes it (instead of --judge): a name containing 'gpt' is "
        "an OpenAI model ($OPENAI_API_KEY), any other a model hosted by Hugging Face "
        "(https://router.huggingface.co/v1, $HF_TOKEN). Without --dataset_name / --completions_file the "
        f"prompts are {TLDR_DATASET}'s {TLDR_SPLIT} split and the references its {TLDR_REFERENCE!r} column, "
        "as in judge_tldr.py.",
        default=None,
    )
    timeout: float | None = flag(
        "HTTP judges (openai, http, --judge_model): seconds per socket operation of a request (default 30).",
        default=None,
    )
    max_retries: int | None = flag(
        "HTTP judges: retries of a request after HTTP 429 / 5xx, a timeout or a connection error (default 3).",
        default=None,
    )
    max_concurrency: int | None = flag("HTTP judges: requests in flight at once (default 8).", default=None)
    dataset_name: str | None = flag(
        "Prompt set: hub name, saved folder, or .jsonl/.json/.parquet/.csv file.", default=None
    )
    dataset_config: str | None = flag("Configuration name of a hub dataset.", default=None)
    dataset_split: str | None = flag(
        f"Split to evaluate on (default {DEFAULT_SPLIT!r}; {TLDR_SPLIT!r} for judge_tldr.py's {TLDR_DATASET}).",
        default=None,
    )
    prompt_column: str = flag("Column holding the prompts (text or chat messages).", default="prompt")
    reference_column: str | None = flag("Column holding the reference completions.", default=None)
    reference_file: str | None = flag(
        '.jsonl file of reference completions (field "completion"), in prompt order.', default=None
    )
    reference_model: str | None = flag("Compare against this model's generations instead.", default=None)
    completions_file: str | None = flag(
        '.jsonl file of the model\'s completions (field "completion"; "prompt" too when no dataset is given), '
        "instead of generating.",
        default=None,
    )
    num_examples: int | None = flag("Judge only the first N examples.", default=None)
    max_new_tokens: int = flag("Maximum new tokens per generated completion.", default=200)
    temperature: float = flag("Sampling temperature for generation; 0 = greedy (judge_tldr.py).", default=0.0)
    batch_size: int = flag("Prompts per generation batch.", default=16)
    seed: int = flag("Seed for sampling (temperature > 0) and for the judge's order flips.", default=42)
    output_file: str | None = flag(
        "Write one JSON line per example (prompt, completion, reference, winner) to this file.", default=None
    )
    torch_dtype: str | None = flag("dtype to load models in: float32, bfloat16, float16 or auto.", default=None)
    trust_remote_code: bool = flag("Allow model code from the hub.", default=False)

    def __post_init__(self) -> None:
        if not self.judge and not self.judge_model:
            raise ConfigError(
                "judge is not set: pass --judge (e.g. openai:gpt-4o-mini, reward_model:<path>, random) "
                "or --judge_model (e.g. gpt-4o-mini)."
            )
        if self.judge and self.judge_model:
            raise ConfigError(
                f"--judge {self.judge} and --judge_model {self.judge_model} both name the judge; give one of them."
            )
        http_flags = [
            f"--{name}" for name in ("timeout", "max_retries", "max_concurrency") if getattr(self, name) is not None
        ]
        if http_flags and self.judge:
            from posttrain.judges.spec import is_http_spec

            if not is_http_spec(self.judge):
                raise ConfigError(
                    f"{', '.join(http_flags)} apply to HTTP judges (openai, http:<url>#<model>, --judge_model) only, "
                    f"not to --judge {self.judge}; drop them."
                )
        for name, low in (("timeout", 0.0), ("max_retries", 0), ("max_concurrency", 1)):
            value = getattr(self, name)
            if value is not None and (value <= low if name == "timeout" else value < low):
                raise ConfigError(f"{name}={value} must be {'>' if name == 'timeout' else '>='} {low}.")
        if self.judge_model and self.dataset_name is None and self.completions_file is None:
            # judge_tldr.py's data (its command line names no dataset).
            self.dataset_name = TLDR_DATASET
            self.dataset_split = self.dataset_split or TLDR_SPLIT
            if not (self.reference_column or self.reference_file or self.reference_model):
                self.reference_column = TLDR_REFERENCE
        self.dataset_split = self.dataset_split or DEFAULT_SPLIT
        if (self.model_name_or_path is None) == (self.completions_file is None):
            raise ConfigError("give exactly one of --model_name_or_path (generate) and --completions_file (read).")
        sources = [s for s in ("reference_column", "reference_file", "reference_model") if getattr(self, s)]
        if len(sources) != 1:
            raise ConfigError(
                "give exactly one reference: --reference_column, --reference_file or --reference_model"
                + (f" (got {', '.join(sources)})." if sources else ".")
            )
        if self.dataset_name is None and self.completions_file is None:
            raise ConfigError("dataset_name is not set: pass --dataset_name (the prompts).")
        if self.reference_column and self.dataset_name is None:
            raise ConfigError("--reference_column needs --dataset_name (the dataset holding that column).")
        for name in ("num_examples", "max_new_tokens", "batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value} must be >= 1.")
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 (0 = greedy).")


def as_text(value: Any) -> str:
    """A completion as text: strings as is; chat messages -> the content of the last message."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], dict) and "content" in value[-1]:
        return str(value[-1]["content"])
    raise ConfigError(
        f"a completion must be text or a list of chat messages, got {type(value).__name__}: {value!r:.80}"
    )


def read_jsonl(path: str, field_name: str) -> list[dict]:
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file.")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}:{line_no}: not valid JSON ({err.msg}).") from None
            if not isinstance(row, dict) or field_name not in row:
                raise ConfigError(f'{path}:{line_no}: each line must be a JSON object with a "{field_name}" field.')
            rows.append(row)
    return rows


def generate_completions(
    model: Any,
    tokenizer: Any,
    prompts: list[Any],
    *,
    max_new_tokens: int,
    batch_size: int = 16,
    temperature: float = 0.0,
    seed: int = 42,
    generator: Any = None,
) -> list[str]:
    """Completions for text or chat prompts (chat template applied), stopping at EOS, in prompt order.

    Sampling (temperature > 0) draws from `generator`, or from a fresh one seeded with `seed`."""
    import torch
    from datasets import Dataset

    from posttrain.data import PromptCollator, prepare_prompt_dataset
    from posttrain.rollout import SamplingConfig, decode_completions, generate, generation_mode

    dataset = prepare_prompt_dataset(Dataset.from_dict({"prompt": list(prompts)}), tokenizer, source="prompts")
    collate = PromptCollator(tokenizer.pad_token_id)
    device = next(model.parameters()).device
    stop = () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
    sampling = SamplingConfig(
        max_new_tokens=max_new_tokens, temperature=temperature, do_sample=temperature > 0, stop_token_ids=stop
    )
    if generator is None:
        generator = torch.Generator(device=device).manual_seed(seed)
    out: list[str] = []
    with generation_mode(model):
        for start in range(0, len(dataset), batch_size):
            batch = collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
            rollout = generate(
                model,
                batch["input_ids"].to(device),
                batch["attention_mask"].to(device),
                sampling,
                pad_token_id=tokenizer.pad_token_id,
                generator=generator,
                return_logprobs=False,
            )
            out.extend(decode_completions(tokenizer, rollout))
    return out


def _model_completions(path: str, prompts: list[Any], config: JudgeConfig) -> list[str]:
    import torch

    from posttrain.models import load_policy, load_tokenizer

    tokenizer = load_tokenizer(path, trust_remote_code=config.trust_remote_code)
    model = load_policy(path, dtype=config.torch_dtype, trust_remote_code=config.trust_remote_code, tokenizer=tokenizer)
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    return generate_completions(
        model,
        tokenizer,
        prompts,
        max_new_tokens=config.max_new_tokens,
        batch_size=config.batch_size,
        temperature=config.temperature,
        seed=config.seed,
    )


def build_judge(config: JudgeConfig) -> Any:
    """The judge of config.judge / config.judge_model, with the HTTP options given; a spec that
    cannot be built (unknown form, missing API key, ...) is a ConfigError, raised before any model loads."""
    from posttrain.judges import judge_from_model_name, judge_from_spec

    options: dict[str, Any] = {
        name: getattr(config, name)
        for name in ("timeout", "max_retries", "max_concurrency")
        if getattr(config, name) is not None
    }
    try:
        if config.judge_model:
            return judge_from_model_name(config.judge_model, seed=config.seed, **options)
        # Seed the judge's order flips, except where the spec carries its own seed (random:<seed>)
        # or names user code whose constructor may not take one (python:...).
        seeded = not (config.judge.startswith("python:") or config.judge.startswith("random:"))
        return judge_from_spec(config.judge, **({"seed": config.seed} if seeded else {}), **options)
    except ValueError as err:
        flag_name = "--judge_model" if config.judge_model else "--judge"
        raise ConfigError(f"{flag_name} {config.judge_model or config.judge}: {err}.") from None


def judge_with_progress(judge: Any, prompts: list[Any], pairs: list[list[Any]], chunk_size: int = 64) -> list[int]:
    """judge.judge(prompts, pairs) with a progress bar (tqdm, on stderr) counting the pairs judged.

    An HTTP judge reports each answer as it arrives (its `progress` hook) within one call, so its
    concurrency and its one warning line per call are kept; any other judge is asked `chunk_size`
    pairs at a time, which gives the same answers (flips and random draws go pair by pair)."""
    from tqdm.auto import tqdm

    from posttrain.judges import HTTPPairwiseJudge

    with tqdm(total=len(pairs), desc="judging", unit="pair") as bar:
        if isinstance(judge, HTTPPairwiseJudge):
            previous, judge.progress = judge.progress, bar.update
            try:
                return list(judge.judge(prompts, pairs))
            finally:
                judge.progress = previous
        answers: list[int] = []
        for start in range(0, len(pairs), chunk_size):
            answers.extend(judge.judge(prompts[start : start + chunk_size], pairs[start : start + chunk_size]))
            bar.update(min(chunk_size, len(pairs) - start))
        return answers


def evaluate(config: JudgeConfig, judge: Any = None) -> tuple[Any, list[dict]]:
    """(WinRate, per-example rows). `judge` overrides config.judge / judge_model (a judge object)."""
    from posttrain.judges import win_rate

    if judge is None:
        judge = build_judge(config)
    n = config.num_examples
    dataset = None
    if config.dataset_name:
        from posttrain.data import load_any_dataset

        dataset = load_any_dataset(config.dataset_name, split=config.dataset_split, config_name=config.dataset_config)
        for column in (config.prompt_column, config.reference_column):
            if column and column not in dataset.column_names:
                raise ConfigError(
                    f"dataset {config.dataset_name!r} has no column {column!r}; columns: {dataset.column_names}."
                )
        if n is not None:
            dataset = dataset.select(range(min(n, len(dataset))))
        prompts = list(dataset[config.prompt_column])
    if config.completions_file:
        rows = read_jsonl(config.completions_file, "completion")
        if dataset is None:
            if not all("prompt" in r for r in rows):
                raise ConfigError(
                    f'{config.completions_file}: without --dataset_name every line needs a "prompt" field.'
                )
            rows = rows[:n] if n is not None else rows
            prompts = [r["prompt"] for r in rows]
        if len(rows) < len(prompts):
            raise ConfigError(f"{config.completions_file} has {len(rows)} completions for {len(prompts)} prompts.")
        completions = [as_text(r["completion"]) for r in rows[: len(prompts)]]
    else:
        completions = _model_completions(config.model_name_or_path, prompts, config)

    if config.reference_column:
        references = [as_text(v) for v in dataset[config.reference_column]]
    elif config.reference_file:
        ref_rows = read_jsonl(config.reference_file, "completion")
        if len(ref_rows) < len(prompts):
            raise ConfigError(f"{config.reference_file} has {len(ref_rows)} completions for {len(prompts)} prompts.")
        references = [as_text(r["completion"]) for r in ref_rows[: len(prompts)]]
    else:
        references = _model_completions(config.reference_model, prompts, config)

    judgements = judge_with_progress(judge, prompts, [[c, r] for c, r in zip(completions, references)])
    names = {0: "model", 1: "reference", -1: "failure"}
    rows = [
        {"prompt": p, "completion": c, "reference": r, "winner": names[j]}
        for p, c, r, j in zip(prompts, completions, references, judgements)
    ]
    return win_rate(judgements, index=0), rows


def main(config: JudgeConfig) -> int:
    result, rows = evaluate(config)
    if config.output_file:
        directory = os.path.dirname(os.path.abspath(config.output_file))
        os.makedirs(directory, exist_ok=True)
        with open(config.output_file, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    model = config.model_name_or_path or config.completions_file
    print(f"Model: {model}  judge: {config.judge or config.judge_model}  examples: {len(rows)}")
    if result.n == 0:
        print(f"Model win rate: undefined (every judgement failed); judge failures: {result.failures}")
        return 1
    print(
        f"Model win rate: {result.rate:.2%} (95% CI [{result.ci_low:.2%}, {result.ci_high:.2%}], "
        f"n={result.n}); judge failures: {result.failures}"
    )
    return 0
