"""Sharing a trained model on the Hugging Face Hub: the model card and the uploads, written once.

Every trainer's `create_model_card` and `push_to_hub`, and the pushes `push_to_hub=True` makes during
training, come here (as transformers.Trainer / TRL behave):

- `write_model_card`: output_dir/README.md. YAML front matter (base_model, library_name: posttrain,
  model_name, tags with the algorithm and "posttrain", datasets, license when the base model's card
  names one), then the base model, the algorithm and its paper, the `posttrain` command line that
  trained the model (the config as YAML when it was trained from Python: a valid `--config` file),
  the final metrics (state.log_history) and the framework versions.
- `push`: creates the repository (`huggingface_hub.create_repo(..., exist_ok=True)`; a name without
  "/" gets the token owner's namespace) and the `hub_revision` branch, writes the card and uploads
  output_dir with `huggingface_hub.upload_folder`. Checkpoint folders (optimizer states included)
  are uploaded only where hub_strategy says so.
- `push_checkpoint`: after a checkpoint save, by hub_strategy: "every_save" pushes the model (saved
  at the top of output_dir first by the trainer) and card; "checkpoint" also the checkpoint as
  `last-checkpoint/` (resumable with `--resume_from_checkpoint` after a download); "all_checkpoints"
  every checkpoint under its own name; "end" nothing.

Uploads run on the main process only and are synchronous: training waits for each checkpoint push,
so every save is pushed (what `hub_always_push=True` asks for in transformers, where a push can be
skipped while the previous one is still running). Tokens never reach the card: `hub_token` is
left out of the config shown and masked in the command line.

Only the standard library is imported here; huggingface_hub, yaml and the version lookups are
imported inside the functions (`import posttrain` stays light).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HUB_STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")
CHECKPOINT_PATTERN = "checkpoint-*"
# Never uploaded: temp dirs of an interrupted save (checkpoint.TMP_PREFIX) and, as transformers,
# names starting with "_".
ALWAYS_IGNORED = (".tmp-*", "_*")
# Config fields that hold secrets: not shown in the card, masked in the command line.
SECRET_FIELDS = ("hub_token", "push_to_hub_token")


@dataclass(frozen=True)
class Paper:
    cite: str  # "Schulman et al., 2017"
    title: str
    url: str
    bibtex: str


@dataclass(frozen=True)
class Method:
    name: str  # as the card names it
    tag: str  # the Hub tag
    cli: str  # the `posttrain` command
    what: str  # one sentence: what the trainer optimises
    papers: tuple[Paper, ...]
    causal_lm: bool = True  # False: a sequence-classification (reward) model


_INSTRUCTGPT = Paper(
    "Ouyang et al., 2022",
    "Training language models to follow instructions with human feedback",
    "https://arxiv.org/abs/2203.02155",
    """@inproceedings{ouyang2022training,
  title = {{Training language models to follow instructions with human feedback}},
  author = {Long Ouyang and Jeff Wu and Xu Jiang and Diogo Almeida and Carroll L. Wainwright and others},
  year = 2022,
  booktitle = {Advances in Neural Information Processing Systems 35 (NeurIPS 2022)}
}""",
)

METHODS: dict[str, Method] = {
    "sft": Method(
        "SFT",
        "sft",
        "sft",
        "supervised fine-tuning: next-token cross-entropy on the demonstrations (the first step of RLHF)",
        (_INSTRUCTGPT,),
    ),
    "reward": Method(
        "Reward modelling",
        "reward-trainer",
        "reward",
        "a reward model trained on preference pairs with the Bradley–Terry loss −log σ(r_chosen − r_rejected)",
        (
            Paper(
                "Bradley and Terry, 1952",
                "Rank Analysis of Incomplete Block Designs: I. The Method of Paired Comparisons",
                "https://doi.org/10.2307/2334029",
                """@article{bradley1952rank,
  title = {{Rank Analysis of Incomplete Block Designs: I. The Method of Paired Comparisons}},
  author = {Ralph Allan Bradley and Milton E. Terry},
  year = 1952,
  journal = {Biometrika},
  volume = 39,
  number = {3/4},
  pages = {324--345}
}""",
            ),
            _INSTRUCTGPT,
        ),
        causal_lm=False,
    ),
    "ppo": Method(
        "PPO",
        "ppo",
        "ppo",
        "Proximal Policy Optimization with a learned value function and a KL penalty to the reference policy",
        (
            Paper(
                "Schulman et al., 2017",
                "Proximal Policy Optimization Algorithms",
                "https://arxiv.org/abs/1707.06347",
                """@article{schulman2017proximal,
  title = {{Proximal Policy Optimization Algorithms}},
  author = {John Schulman and Filip Wolski and Prafulla Dhariwal and Alec Radford and Oleg Klimov},
  year = 2017,
  journal = {arXiv preprint arXiv:1707.06347}
}""",
            ),
            _INSTRUCTGPT,
        ),
    ),
    "rloo": Method(
        "RLOO",
        "rloo",
        "rloo",
        "REINFORCE Leave-One-Out: each completion's baseline is the mean score of the prompt's other completions",
        (
            Paper(
                "Ahmadian et al., 2024",
                "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs",
                "https://arxiv.org/abs/2402.14740",
                """@inproceedings{ahmadian2024back,
  title = {{Back to Basics: Revisiting REINFORCE-Style Optimization for Learning from Human Feedback in LLMs}},
  author = {Arash Ahmadian and Chris Cremer and Matthias Gall{\\'e} and Marzieh Fadaee and Julia Kreutzer and others},
  year = 2024,
  booktitle = {Proceedings of the 62nd Annual Meeting of the Association for Computational Linguistics (ACL 2024)}
}""",
            ),
        ),
    ),
    "grpo": Method(
        "GRPO",
        "grpo",
        "grpo",
        "Group Relative Policy Optimization: advantages are scores normalised within each prompt's group",
        (
            Paper(
                "Shao et al., 2024",
                "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
                "https://arxiv.org/abs/2402.03300",
                """@article{shao2024deepseekmath,
  title = {{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models}},
  author = {Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and others},
  year = 2024,
  journal = {arXiv preprint arXiv:2402.03300}
}""",
            ),
        ),
    ),
    "online_dpo": Method(
        "Online DPO",
        "online-dpo",
        "online-dpo",
        "the DPO loss on pairs of the policy's own completions, ranked online by a judge or reward model",
        (
            Paper(
                "Guo et al., 2024",
                "Direct Language Model Alignment from Online AI Feedback",
                "https://arxiv.org/abs/2402.04792",
                """@article{guo2024direct,
  title = {{Direct Language Model Alignment from Online AI Feedback}},
  author = {Shangmin Guo and Biao Zhang and Tianlin Liu and Tianqi Liu and Misha Khalman and others},
  year = 2024,
  journal = {arXiv preprint arXiv:2402.04792}
}""",
            ),
        ),
    ),
    "xpo": Method(
        "XPO",
        "xpo",
        "xpo",
        "Exploratory Preference Optimization: online DPO plus an exploration bonus on reference completions",
        (
            Paper(
                "Xie et al., 2024",
                "Exploratory Preference Optimization: Harnessing Implicit Q*-Approximation for Sample-Efficient RLHF",
                "https://arxiv.org/abs/2405.21046",
                """@article{xie2024exploratory,
  title = {{Exploratory Preference Optimization: Harnessing Implicit Q*-Approximation for Sample-Efficient RLHF}},
  author = {Tengyang Xie and Dylan J. Foster and Akshay Krishnamurthy and Corby Rosset and others},
  year = 2024,
  journal = {arXiv preprint arXiv:2405.21046}
}""",
            ),
        ),
    ),
}

# Trainer and config class names → METHODS key (the most derived class that matches wins, so a
# user's subclass of RLOOTrainer is RLOO and XPOConfig, an OnlineDPOConfig subclass, is XPO).
_CLASS_METHODS = {
    **dict.fromkeys(("SFTTrainer", "SFTConfig"), "sft"),
    **dict.fromkeys(("RewardTrainer", "RewardConfig"), "reward"),
    **dict.fromkeys(("PPOTrainer", "PPOConfig"), "ppo"),
    **dict.fromkeys(("RLOOTrainer", "RLOOConfig"), "rloo"),
    **dict.fromkeys(("GRPOTrainer", "GRPOConfig"), "grpo"),
    **dict.fromkeys(("OnlineDPOTrainer", "OnlineDPOConfig"), "online_dpo"),
    **dict.fromkeys(("XPOTrainer", "XPOConfig"), "xpo"),
}


def method_of(*objects: Any) -> str:
    """The METHODS key of the first object (a trainer or a config) whose class is a known one."""
    for obj in objects:
        for cls in type(obj).__mro__:
            if cls.__name__ in _CLASS_METHODS:
                return _CLASS_METHODS[cls.__name__]
    raise ValueError(f"no posttrain algorithm is known for {[type(o).__name__ for o in objects]}.")


# ---------------------------------------------------------------------------------------------
# the model card
# ---------------------------------------------------------------------------------------------
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_hub_id(name: str | None) -> bool:
    """A Hub repository id ("org/name" or "name") rather than a local path."""
    return bool(name) and _HUB_ID.match(str(name)) is not None and not os.path.exists(str(name))


def repo_name(config: Any) -> str:
    """hub_model_id, else the output_dir's folder name (create_repo adds the namespace when no "/")."""
    return config.hub_model_id or Path(config.output_dir).absolute().name


def base_model_of(config: Any, model: Any) -> str | None:
    """The model training started from: model_name_or_path, else the model's `_name_or_path`."""
    name = getattr(config, "model_name_or_path", None)
    if not name:
        inner = getattr(model, "module", model)  # DDP / DeepSpeed wrappers
        name = getattr(getattr(inner, "config", None), "_name_or_path", None)
    return str(name) if name else None


def _front_matter(path: str | os.PathLike) -> dict:
    """The YAML front matter of a README.md ({} when there is none or it does not parse)."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", text, re.S)
    if not match:
        return {}
    try:
        data = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def base_model_license(base_model: str | None) -> str | None:
    """The license the base model's own card declares: its local folder's README.md, or the copy in
    the Hugging Face cache for a Hub id (never a network call). None when unknown."""
    if not base_model:
        return None
    readme: str | None = None
    if os.path.isdir(base_model):
        readme = os.path.join(base_model, "README.md")
    elif is_hub_id(base_model):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(base_model, "README.md")
        readme = cached if isinstance(cached, str) else None
    license_ = _front_matter(readme).get("license") if readme and os.path.isfile(readme) else None
    return str(license_) if license_ else None


def launch_command(argv: Sequence[str] | None = None) -> str | None:
    """The `posttrain ...` command line this process runs (the console script, `python -m posttrain`
    or `-m posttrain.cli`, also under accelerate / torchrun), tokens masked; None when not launched
    from the CLI."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return None
    program = Path(argv[0])
    as_module = program.name in ("__main__.py", "cli.py") and program.parent.name == "posttrain"  # -m posttrain(.cli)
    if not (program.name == "posttrain" or as_module):
        return None
    words, secret = [], False
    for word in argv[1:]:
        flag, eq, _ = word.partition("=")
        if secret:
            word, secret = "***", False
        elif flag.lstrip("-") in SECRET_FIELDS and flag.startswith("--"):
            word, secret = (f"{flag}=***", False) if eq else (word, True)
        words.append(word)
    return shlex.join(["posttrain", *words])


def config_yaml(config: Any) -> str:
    """The fields that differ from a default config's, as a `--config` YAML file (secrets and the
    batch sizes derived from the others left out). The default config is built the same way, so
    values its validation fills in (report_to, an alias mirroring its new name) are not shown."""
    import warnings

    import yaml

    from posttrain.configs import config_fields

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = type(config)(output_dir=config.output_dir)
    except Exception:  # a config that needs more than output_dir: compare with the declared defaults
        reference = None
    values = {}
    for f in config_fields(type(config)):
        if f.name in SECRET_FIELDS:
            continue
        if reference is not None:
            default = getattr(reference, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        value = getattr(config, f.name)
        if value != default:
            values[f.name] = (
                value if isinstance(value, (str, int, float, bool, type(None), list, dict)) else repr(value)
            )
    return yaml.safe_dump(values, sort_keys=False, allow_unicode=True, default_flow_style=False).rstrip()


def _versions() -> list[tuple[str, str]]:
    """(label, version) of posttrain and the libraries it trains with."""
    from importlib.metadata import PackageNotFoundError, version

    from posttrain import __version__

    rows = [("posttrain", __version__)]
    for label, package in (("Transformers", "transformers"), ("PyTorch", "torch"), ("Datasets", "datasets")):
        try:
            rows.append((label, version(package)))
        except PackageNotFoundError:
            rows.append((label, "not installed"))
    return rows


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _metrics_section(log_history: Sequence[dict]) -> str:
    """Tables of the end-of-training summary, the last training log and the last evaluation."""
    summary = next((e for e in reversed(log_history) if "train_runtime" in e), None)
    evaluation = next((e for e in reversed(log_history) if any(k.startswith("eval_") for k in e)), None)
    training = next(
        (e for e in reversed(log_history) if "train_runtime" not in e and not any(k.startswith("eval_") for k in e)),
        None,
    )
    parts = []
    for title, entry in (
        ("Training summary", summary),
        ("Last training log", training),
        ("Last evaluation", evaluation),
    ):
        if not entry:
            continue
        step = f" (step {entry['step']})" if "step" in entry else ""
        rows = "\n".join(f"| {k} | {_number(v)} |" for k, v in entry.items() if k != "step")
        parts.append(f"{title}{step}:\n\n| metric | value |\n|---|---|\n{rows}")
    return "\n\n".join(parts) if parts else "No metrics were logged."


def model_card(
    config: Any,
    *,
    method: str,
    log_history: Sequence[dict],
    base_model: str | None,
    model_name: str | None = None,
    dataset_name: str | None = None,
    tags: str | Sequence[str] | None = None,
    license: str | None = None,
    command: str | None = None,
) -> str:
    """The README.md text (see the module docstring). `command`: the CLI line that trained the
    model, or None to show the config as YAML."""
    import yaml

    m = METHODS[method]
    model_name = model_name or repo_name(config).split("/")[-1]
    repo_id = config.hub_model_id or model_name
    dataset_name = dataset_name if dataset_name is not None else getattr(config, "dataset_name", None)
    license = license or base_model_license(base_model)
    tag_list = ["posttrain", m.tag]
    for tag in [tags] if isinstance(tags, str) else list(tags or []):
        if tag not in tag_list:
            tag_list.append(tag)
    meta: dict[str, Any] = {}
    if is_hub_id(base_model):
        meta["base_model"] = base_model
    meta["library_name"] = "posttrain"
    meta["model_name"] = model_name
    meta["tags"] = tag_list
    if dataset_name and is_hub_id(dataset_name):
        meta["datasets"] = [dataset_name]
    if license:
        meta["license"] = license
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip()

    def link(name: str | None, kind: str = "") -> str:
        return f"[{name}](https://huggingface.co/{kind}{name})" if is_hub_id(name) else f"`{name}`"

    origin = f"a fine-tuned version of {link(base_model)}" if base_model else "a model"
    on_data = f" on the {link(dataset_name, 'datasets/')} dataset" if dataset_name else ""
    papers = " and ".join(f"[{p.title}]({p.url}) ({p.cite})" for p in m.papers)
    if m.causal_lm:
        quick = (
            "from transformers import pipeline\n\n"
            f'generator = pipeline("text-generation", model="{repo_id}")\n'
            'print(generator("Write a haiku about the sea.", max_new_tokens=64)[0]["generated_text"])'
        )
    else:
        quick = (
            "from transformers import AutoModelForSequenceClassification, AutoTokenizer\n\n"
            f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n'
            f'model = AutoModelForSequenceClassification.from_pretrained("{repo_id}")\n'
            'inputs = tokenizer("Question: ... Answer: ...", return_tensors="pt")\n'
            "score = model(**inputs).logits[0, 0].item()  # higher: preferred"
        )
    if command:
        how = f"Trained with this command:\n\n```bash\n{command}\n```"
    else:
        how = (
            "Trained from Python with this configuration (the fields set away from their defaults; "
            f"`posttrain {m.cli} --config <file>` reads it):\n\n```yaml\n{config_yaml(config)}\n```"
        )
    versions = "\n".join(f"- {label}: {v}" for label, v in _versions())
    citations = "\n\n".join(f"```bibtex\n{p.bibtex}\n```" for p in m.papers)
    return f"""---
{front}
---

# Model Card for {model_name}

This model is {origin}{on_data}. It was trained with posttrain's {m.name} trainer.

## Quick start

```python
{quick}
```

## Training procedure

{m.name}: {m.what}, as introduced in {papers}.

{how}

### Final metrics

{_metrics_section(log_history)}

### Framework versions

{versions}

## Citations

{citations}
"""


def write_model_card(
    config: Any,
    *,
    method: str,
    log_history: Sequence[dict],
    model: Any,
    model_name: str | None = None,
    dataset_name: str | None = None,
    tags: str | Sequence[str] | None = None,
    license: str | None = None,
) -> Path:
    """Write output_dir/README.md (call on the main process) and return its path."""
    text = model_card(
        config,
        method=method,
        log_history=log_history,
        base_model=base_model_of(config, model),
        model_name=model_name,
        dataset_name=dataset_name,
        tags=tags,
        license=license,
        command=launch_command(),
    )
    path = Path(config.output_dir) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".README.md.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------
# the uploads
# ---------------------------------------------------------------------------------------------
def ignore_patterns(include_checkpoints: bool) -> list[str]:
    """What an upload of output_dir leaves out: temp dirs, `_*`, and the checkpoint folders (with
    their optimizer states) unless they are to be pushed."""
    return [*ALWAYS_IGNORED, *([] if include_checkpoints else [CHECKPOINT_PATTERN])]


def create_repo(config: Any, *, token: str | None, revision: str | None, private: bool | None = None) -> str:
    """Create the repository (exist_ok) and the branch `revision` pushes go to; return the full repo id."""
    import huggingface_hub

    from posttrain.configs import ConfigError

    private = private if private is not None else config.hub_private_repo
    name = repo_name(config)
    try:
        repo_id = huggingface_hub.create_repo(name, token=token, private=private, exist_ok=True).repo_id
        if revision:
            huggingface_hub.create_branch(repo_id, branch=revision, token=token, exist_ok=True)
    except Exception as err:  # the first Hub call of a run: a token, name or network problem, said once
        first = str(err).strip().splitlines()[0].rstrip(".") if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"push_to_hub: cannot create the Hub repository hub_model_id={name!r}"
            f"{f' (branch hub_revision={revision!r})' if revision else ''}: {first}. Log in with `hf auth login` "
            "or pass hub_token with write access, check the name, and that the Hub is reachable "
            "(HF_HUB_OFFLINE unset)."
        ) from err
    return repo_id


def _latest_checkpoint(output_dir: str) -> Path | None:
    from posttrain.checkpoint import latest_checkpoint

    return latest_checkpoint(output_dir)


def push(
    config: Any,
    *,
    is_main: bool,
    write_card: Callable[[], Any],
    commit_message: str = "End of training",
    blocking: bool = True,
    token: str | None = None,
    revision: str | None = None,
    private: bool | None = None,
) -> Any:
    """Upload output_dir (the model saved there, its tokenizer, the card `write_card` writes, the
    metrics) to the Hub; on hub_strategy "all_checkpoints" with every checkpoint folder, on
    "checkpoint" followed by the newest checkpoint as `last-checkpoint/`. Returns upload_folder's
    result for output_dir (a CommitInfo, or a Future when blocking=False); None on other processes."""
    if not is_main:
        return None
    import huggingface_hub

    token = token if token is not None else config.hub_token
    revision = revision if revision is not None else config.hub_revision
    repo_id = create_repo(config, token=token, revision=revision, private=private)
    write_card()
    result = huggingface_hub.upload_folder(
        repo_id=repo_id,
        folder_path=config.output_dir,
        commit_message=commit_message,
        token=token,
        revision=revision,
        run_as_future=not blocking,
        ignore_patterns=ignore_patterns(config.hub_strategy == "all_checkpoints"),
    )
    latest = _latest_checkpoint(config.output_dir) if config.hub_strategy == "checkpoint" else None
    if latest is not None:
        _upload_checkpoint(
            config, repo_id, latest, "last-checkpoint", f"{commit_message}, checkpoint", token, revision, blocking
        )
    return result


def _upload_checkpoint(
    config: Any,
    repo_id: str,
    folder: Path,
    path_in_repo: str,
    message: str,
    token: str | None,
    revision: str | None,
    blocking: bool,
) -> Any:
    import huggingface_hub

    return huggingface_hub.upload_folder(
        repo_id=repo_id,
        folder_path=os.fspath(folder),
        path_in_repo=path_in_repo,
        commit_message=message,
        token=token,
        revision=revision,
        run_as_future=not blocking,
        ignore_patterns=list(ALWAYS_IGNORED),
        # last-checkpoint/ holds one checkpoint: files of the previous one that this one lacks go.
        delete_patterns=["*"] if path_in_repo == "last-checkpoint" else None,
    )


def pushes_at_save(config: Any) -> bool:
    """Whether a checkpoint save is followed by a push (push_to_hub and hub_strategy != "end")."""
    return bool(config.push_to_hub) and config.hub_strategy != "end"


def push_checkpoint(
    config: Any, checkpoint: str | os.PathLike, step: int, *, is_main: bool, write_card: Callable[[], Any]
) -> None:
    """After the checkpoint save of `step` (the trainer saved the model at the top of output_dir
    first): push model + card ("Training in progress, step N"), then by hub_strategy the checkpoint
    as `last-checkpoint/` or under its own name. Nothing on "end" or on other processes."""
    if not is_main or not pushes_at_save(config):
        return
    import huggingface_hub

    token, revision = config.hub_token, config.hub_revision
    repo_id = create_repo(config, token=token, revision=revision)
    write_card()
    message = f"Training in progress, step {step}"
    huggingface_hub.upload_folder(
        repo_id=repo_id,
        folder_path=config.output_dir,
        commit_message=message,
        token=token,
        revision=revision,
        ignore_patterns=ignore_patterns(False),
    )
    if config.hub_strategy in ("checkpoint", "all_checkpoints"):
        folder = Path(checkpoint)
        path_in_repo = "last-checkpoint" if config.hub_strategy == "checkpoint" else folder.name
        _upload_checkpoint(config, repo_id, folder, path_in_repo, f"{message}, checkpoint", token, revision, True)


class PushToHub:
    """`push_to_hub()` as `transformers.Trainer` has it, for every posttrain trainer: the trainer
    provides `args`, `run.is_main`, `save_model()` and `create_model_card(**kwargs)`."""

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """Save the model into output_dir (call on every process), write the model card (`kwargs`: those
        of create_model_card) and upload output_dir to hub_model_id (`push`). Returns the CommitInfo (a
        Future with blocking=False) on the main process, None on the others."""
        self.save_model()
        return push(
            self.args,
            is_main=self.run.is_main,
            write_card=lambda: self.create_model_card(**kwargs),
            commit_message=commit_message or "End of training",
            blocking=blocking,
            token=token,
            revision=revision,
            private=private,
        )
