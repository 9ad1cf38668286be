"""Loading tokenizers and models for post-training: policies, reward and value models, LoRA, value heads.

Loaders wrap the `transformers` Auto classes with the settings RLHF needs: a pad token that never
breaks EOS handling, dropout disabled (so the logprobs of the rollout and of the update come from
the same function), `pad_token_id` written into reward/value model configs (TRL #937: without it a
sequence-classification head reads the score at the wrong position), and dtype given as a string.

Tiny offline tokenizers and models for tests, the demo and the benchmarks live in `posttrain.testing`.

`transformers` and `safetensors` are imported inside functions so that
`import posttrain.models` stays cheap; torch is needed for the `nn.Module` value-head wrapper.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from posttrain.compat import dtype_kwargs

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

VALUE_HEAD_FILE = "value_head.safetensors"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    """Map "float32" / "bfloat16" / "float16" / "auto" / a torch.dtype to what `from_pretrained` takes.

    None means float32: trainers keep full-precision master weights and use autocast for speed.
    "auto" keeps the dtype stored in the checkpoint.
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return "auto"
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of: auto, {', '.join(sorted(_DTYPES))}") from None


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _pick_pad_token(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """An existing token to pad with: a special token named like a pad token, else unk, else eos."""
    specials = {
        tok.content for tok in getattr(tokenizer, "added_tokens_decoder", {}).values() if getattr(tok, "special", False)
    }
    specials.update(getattr(tokenizer, "all_special_tokens", []))
    pad_like = sorted(t for t in specials if "pad" in t.lower())
    if pad_like:
        return pad_like[0]
    if tokenizer.unk_token is not None:
        return tokenizer.unk_token
    return tokenizer.eos_token


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give `tokenizer` a pad token when it has none, without adding a token to the vocabulary.

    Preference: an existing special token whose name contains "pad" (Llama 3's
    `<|finetune_right_pad_id|>`, Qwen's `<|endoftext|>` is already the pad), then `unk`, then `eos`.
    pad == eos is safe in posttrain because every attention / completion mask is built from
    sequence lengths, never from `ids == pad`, so a real EOS is never mistaken for padding.
    No new token is added, so the embedding matrix never needs resizing here.
    """
    if tokenizer.pad_token is not None:
        return tokenizer
    pad = _pick_pad_token(tokenizer)
    if pad is None:
        raise ValueError(
            "the tokenizer has no pad, unk or eos token to pad with; "
            "add one with tokenizer.add_special_tokens({'pad_token': '<|pad|>'}) "
            "and pass the tokenizer to the model loader so it resizes the embeddings"
        )
    tokenizer.pad_token = pad
    logger.info("tokenizer has no pad token; padding with existing token %r", pad)
    return tokenizer


class ModelNotFoundError(OSError):
    """A model or tokenizer location that is neither a local folder nor a reachable hub name."""


class ModelLoadError(ModelNotFoundError):
    """A model location that exists but cannot be used as asked: a truncated or corrupt weight file,
    or a reward / value model whose checkpoint holds no trained score head.

    A subclass of `ModelNotFoundError` so that every handler of user-fixable model errors (the
    command line prints them as one line and exits 2) treats it the same way.
    """


# Weight files `from_pretrained` reads from a folder (single or sharded, safetensors or pickle).
_WEIGHT_GLOBS = ("model*.safetensors", "pytorch_model*.bin", "adapter_model.safetensors", "adapter_model.bin")


def _weight_file_problem(file: Path) -> str | None:
    """Why `file` cannot be read as a weight file (first line of the reader's error), or None if it reads.

    Only headers are read: a safetensors header lists every tensor's byte range and the reader
    checks that they cover the file exactly, so truncation is caught without loading tensors; a
    torch .bin is a zip archive whose directory sits at its end, so truncation breaks the archive
    (a legacy bare-pickle .bin is not checked).
    """
    try:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                f.keys()
        else:
            import zipfile

            if not zipfile.is_zipfile(file):
                with open(file, "rb") as f:
                    if f.read(1) == b"\x80":
                        return None  # torch's legacy (pre-1.6) format: a bare pickle, not checkable cheaply
            with zipfile.ZipFile(file) as archive:
                archive.namelist()
    except Exception as err:  # the readers raise their own error types (SafetensorError, BadZipFile)
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    return None


def _corrupt_weight_file(folder: Path) -> tuple[Path, str] | None:
    """The first weight file in `folder` that cannot be read, with the reason; None if all read."""
    for pattern in _WEIGHT_GLOBS:
        for file in sorted(folder.glob(pattern)):
            problem = _weight_file_problem(file)
            if problem is not None:
                return file, problem
    return None


def _from_pretrained(loader: Any, name_or_path: str | os.PathLike, what: str, **kwargs: Any) -> Any:
    """`loader.from_pretrained` with one clear message when the location is wrong.

    A path that looks local (absolute, ./, ../, ~) and does not exist is reported as such instead of
    transformers' "Repo id must be in the form ..." error; a hub name that cannot be fetched (no
    network, private, misspelled) names the flag to fix; a local folder whose weight file is
    truncated or corrupt raises `ModelLoadError` naming the file.
    """
    location = str(name_or_path)
    looks_local = location.startswith(("/", "./", "../", "~"))
    if looks_local and not os.path.exists(os.path.expanduser(location)):
        raise ModelNotFoundError(
            f"{what} {location!r}: no such folder. Give a folder saved with save_pretrained or a hub model name."
        )
    folder = Path(os.path.expanduser(location))
    try:
        return loader.from_pretrained(str(folder), **kwargs)
    except Exception as err:
        if folder.is_dir():
            # A weight file that does not read (an interrupted download or copy, a full disk at
            # save time) fails deep in safetensors / torch with a message naming no file; name it.
            corrupt = _corrupt_weight_file(folder)
            if corrupt is None:
                raise
            file, problem = corrupt
            raise ModelLoadError(
                f"{what} {location!r}: {file} is truncated or corrupt ({problem}); re-save or re-download it."
            ) from err
        if not isinstance(err, OSError):
            raise
        raise ModelNotFoundError(
            f"{what} {location!r} could not be loaded: it is not a local folder and the hub did not provide it "
            f"({str(err).splitlines()[0]}). Check the name, your network (HF_HUB_OFFLINE) and access rights."
        ) from err


def load_tokenizer(
    name_or_path: str | os.PathLike,
    padding_side: str = "left",
    *,
    trust_remote_code: bool = False,
    revision: str | None = None,
) -> PreTrainedTokenizerBase:
    """Load a tokenizer (hub name or local folder) with a pad token and the given padding side.

    Left padding is the default because prompts are left-padded for generation.
    """
    from transformers import AutoTokenizer

    tokenizer = _from_pretrained(
        AutoTokenizer, name_or_path, "tokenizer", trust_remote_code=trust_remote_code, revision=revision
    )
    tokenizer.padding_side = padding_side
    return ensure_pad_token(tokenizer)


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def disable_dropout(model: nn.Module) -> nn.Module:
    """Turn every dropout off: `nn.Dropout` modules, float dropout attributes, config values.

    Attention layers often copy `config.attention_dropout` into a float attribute at init and pass
    it to a functional dropout, so editing the config alone is not enough; module attributes whose
    name contains "dropout" or "pdrop" are zeroed too. The config is edited so that a saved model
    reloads without dropout.
    """
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
                setattr(module, name, 0.0)
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            for name, value in config.to_dict().items():
                if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
                    setattr(config, name, 0.0)
    return model


def _sync_vocab(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> None:
    """Write the tokenizer's special ids into the config; resize embeddings only if tokens were added."""
    if tokenizer is None:
        return
    embeddings = model.get_input_embeddings()
    if embeddings is not None and len(tokenizer) > embeddings.num_embeddings:
        logger.warning(
            "tokenizer has %d tokens but the model embeds %d; resizing the embeddings "
            "(new rows are randomly initialised)",
            len(tokenizer),
            embeddings.num_embeddings,
        )
        model.resize_token_embeddings(len(tokenizer))
    if tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.pad_token_id = tokenizer.pad_token_id
    if tokenizer.eos_token_id is not None and getattr(model.config, "eos_token_id", None) is None:
        model.config.eos_token_id = tokenizer.eos_token_id


def enable_gradient_checkpointing(model: nn.Module, kwargs: dict[str, Any] | None = None) -> None:
    """`model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)` with the config's
    `gradient_checkpointing_kwargs` over posttrain's default {"use_reentrant": False} (non-reentrant
    checkpointing works with inputs that do not require grad, i.e. frozen embeddings and LoRA, and
    with torch.compile). With use_reentrant=True the input embeddings are made to require grad, as
    TRL does, so checkpointed blocks still receive gradients.

    The keys "every_n_layers" (checkpoint only every n-th decoder layer) and "offload" (saved
    activations in host memory) go to transformers' `activation_checkpointing_enable` (transformers
    >= 5.x; TrainingConfig refuses them earlier where it is missing), which also takes the rest; without
    those keys, a model that has it is switched on through it too (its older name is deprecated)."""
    settings = {"use_reentrant": False, **(kwargs or {})}
    layers = {key: settings.pop(key) for key in ("every_n_layers", "offload") if key in settings}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):
        enable(activation_checkpointing_kwargs=settings, **layers)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=settings, **layers)
    if settings["use_reentrant"] and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()


class Float32LMHead(nn.Linear):
    """An LM head stored and computed in float32 whatever the model's dtype, autocast included
    (`cast_lm_head_to_fp32`, after the ScaleRL recipe, arXiv:2510.13786): the logits, and the
    log-probabilities taken from them, are not rounded to bf16 / fp16. `cast_lm_head_to_fp32` turns a
    model's own head into one in place, so state-dict keys, ties and hooks stay as they were."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # Autocast off here: under bf16 autocast F.linear would otherwise run in bf16 again.
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return nn.functional.linear(hidden.float(), self.weight.float(), bias)


def _output_dtype(dtype: torch.dtype) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return output.to(dtype)

    return hook


def cast_lm_head_to_fp32(model: nn.Module) -> None:
    """Make the output embedding of `model` (PEFT's base model unwrapped) a `Float32LMHead`, its weights
    cast to float32 in place. Tied input and output embeddings share one matrix, which then is float32
    for both: the input embeddings' output is cast back to the dtype it had, so the rest of the model
    runs as before. Refused (ConfigError): a head that carries a LoRA adapter or is not a plain
    nn.Linear. Idempotent."""
    from posttrain.configs import ConfigError

    bare = model.get_base_model() if is_peft_model(model) else model
    head = bare.get_output_embeddings() if hasattr(bare, "get_output_embeddings") else None
    if isinstance(head, Float32LMHead):
        return
    if type(head) is not nn.Linear:
        kind = "a LoRA layer" if hasattr(head, "base_layer") else type(head).__name__
        raise ConfigError(
            f"cast_lm_head_to_fp32=True: {type(bare).__name__}'s LM head is {kind}, not a plain nn.Linear (remove "
            "lm_head from the adapter's target modules), or set cast_lm_head_to_fp32=False."
        )
    embed = bare.get_input_embeddings() if hasattr(bare, "get_input_embeddings") else None
    original = head.weight.dtype
    head.float()  # in place: a tied matrix stays one Parameter, shared with the input embeddings
    head.__class__ = Float32LMHead
    if embed is not None and getattr(embed, "weight", None) is head.weight and original != torch.float32:
        embed.register_forward_hook(_output_dtype(original))


def model_init_kwargs(config: Any) -> dict[str, Any]:
    """The loaders' keyword arguments from a config: dtype (torch_dtype, or model_init_kwargs'
    dtype / torch_dtype), trust_remote_code, and the rest of model_init_kwargs for `from_pretrained`."""
    extra = dict(getattr(config, "model_init_kwargs", None) or {})
    dtype = extra.pop("dtype", extra.pop("torch_dtype", config.torch_dtype))
    trust = extra.pop("trust_remote_code", config.trust_remote_code)
    return {"dtype": dtype, "trust_remote_code": trust, **extra}


def compile_for_training(model: nn.Module, config: Any) -> nn.Module:
    """With config.torch_compile, compile `model`'s forward in place (`nn.Module.compile` with
    torch_compile_backend / torch_compile_mode): its parameters and state_dict keep their names, so
    checkpoints and the final save hold plain weights. Generation runs the module uncompiled (see
    `uncompiled`). Returns `model`."""
    if getattr(config, "torch_compile", False):
        model.compile(backend=config.torch_compile_backend or "inductor", mode=config.torch_compile_mode)
    return model


def is_compiled(model: nn.Module) -> bool:
    """Whether `compile_for_training` compiled this module's forward."""
    return getattr(model, "_compiled_call_impl", None) is not None


@contextlib.contextmanager
def uncompiled(model: nn.Module) -> Iterator[nn.Module]:
    """`model` running its plain forward inside the block: token-by-token decoding changes the input
    shapes every step, which a compiled forward would recompile for (or fall back from) each time."""
    compiled = getattr(model, "_compiled_call_impl", None)
    if compiled is None:
        yield model
        return
    model._compiled_call_impl = None
    try:
        yield model
    finally:
        model._compiled_call_impl = compiled


def _finish(
    model: PreTrainedModel,
    *,
    dropout_off: bool,
    gradient_checkpointing: bool,
    gradient_checkpointing_kwargs: dict[str, Any] | None = None,
) -> PreTrainedModel:
    if dropout_off:
        disable_dropout(model)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model, gradient_checkpointing_kwargs)
        model.config.use_cache = False
    return model


def load_policy(
    path: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
    disable_dropout: bool = True,
    gradient_checkpointing: bool = False,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    attn_implementation: str | None = None,
    revision: str | None = None,
    gradient_checkpointing_kwargs: dict[str, Any] | None = None,
    **model_init_kwargs: Any,
) -> PreTrainedModel:
    """Load a causal LM (hub name or folder). With `tokenizer`, pad/eos ids go into the config.
    `model_init_kwargs` (e.g. the config's model_init_kwargs) go to `from_pretrained` as they are."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {
        **dtype_kwargs(resolve_dtype(dtype)),
        "trust_remote_code": trust_remote_code,
        **model_init_kwargs,
    }
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if revision is not None:
        kwargs["revision"] = revision
    model = _from_pretrained(AutoModelForCausalLM, path, "model", **kwargs)
    _sync_vocab(model, tokenizer)
    return _finish(
        model,
        dropout_off=disable_dropout,
        gradient_checkpointing=gradient_checkpointing,
        gradient_checkpointing_kwargs=gradient_checkpointing_kwargs,
    )


SCALAR_MODEL_ROLES = ("reward", "value")


def _new_head_keys(model: PreTrainedModel, loading_info: dict[str, Any]) -> list[str]:
    """Weights outside the backbone (the score head) that the checkpoint did not provide."""
    prefix = f"{model.base_model_prefix}."
    return sorted(k for k in loading_info.get("missing_keys", ()) if not k.startswith(prefix))


def _no_head_message(what: str, path: str | os.PathLike, model: PreTrainedModel, new_head: list[str]) -> str:
    saved_as = ", ".join(getattr(model.config, "architectures", None) or []) or "a model without a score head"
    if what.startswith("value"):
        fix = (
            "Pass a reward model (the usual critic initialisation), or allow_new_head=True to initialise "
            "the critic's head from scratch on top of this model"
        )
    else:
        fix = (
            "That checks that training runs (TRL's getting-started commands use a causal LM so), but nothing "
            "learned from it means anything: train a reward model first with "
            "`posttrain reward --model_name_or_path <this model> ...` and pass its output_dir"
        )
    return (
        f"{what} {os.fspath(path)!r} has no trained score head: {', '.join(new_head)} is not in its checkpoint "
        f"(saved as {saved_as}), so its scores come from randomly initialised weights. {fix}."
    )


def load_scalar_model(
    path: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
    disable_dropout: bool = True,
    gradient_checkpointing: bool = False,
    *,
    role: str = "reward",
    tokenizer: PreTrainedTokenizerBase | None = None,
    pad_token_id: int | None = None,
    attn_implementation: str | None = None,
    revision: str | None = None,
    allow_new_head: bool = False,
    gradient_checkpointing_kwargs: dict[str, Any] | None = None,
    **model_init_kwargs: Any,
) -> PreTrainedModel:
    """Load a model that outputs one score per sequence: `AutoModelForSequenceClassification(num_labels=1)`.

    Reward models and value models (critics) are the same class, so `load_reward_model` and
    `load_value_model` are this function; `role` ("reward" or "value") only names the model in
    error messages. `config.pad_token_id` is always set: from `pad_token_id`, else `tokenizer`,
    else the config, else the tokenizer saved in `path` (TRL #937: an unset pad id makes the head
    score the wrong token).

    A `path` whose checkpoint holds no score head (a causal LM or base model) gets a randomly
    initialised head: for a value model that raises `ModelLoadError` unless `allow_new_head=True` (a
    critic initialised from a policy); for a reward model it is a UserWarning saying that RL against
    it optimises noise (TRL's getting-started commands use a causal LM as a dummy reward model to check
    that training runs). `allow_new_head=True` also silences that warning, for a model about to be
    trained (a reward model before reward training).
    """
    from transformers import AutoModelForSequenceClassification

    if role not in SCALAR_MODEL_ROLES:
        raise ValueError(f"role must be one of {SCALAR_MODEL_ROLES}, got {role!r}")
    what = f"{role} model"
    kwargs: dict[str, Any] = {
        **dtype_kwargs(resolve_dtype(dtype)),
        "trust_remote_code": trust_remote_code,
        **model_init_kwargs,
        "num_labels": 1,
    }
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if revision is not None:
        kwargs["revision"] = revision
    model, loading_info = _from_pretrained(
        AutoModelForSequenceClassification, path, what, output_loading_info=True, **kwargs
    )
    new_head = _new_head_keys(model, loading_info)
    if new_head and not allow_new_head:
        if role != "reward":
            raise ModelLoadError(_no_head_message(what, path, model, new_head))
        # A causal LM as a dummy reward model is how TRL's getting-started commands check that training
        # runs (`--reward_model_path EleutherAI/pythia-14m`): said loudly, not refused.
        warnings.warn(_no_head_message(what, path, model, new_head), stacklevel=2)
    elif new_head:
        logger.info("%s %s: the score head (%s) is freshly initialised", what, path, ", ".join(new_head))
    if model.config.num_labels != 1:
        if role != "reward":
            raise ValueError(f"{what} {path} has num_labels={model.config.num_labels}; it must output one score")
        logger.warning(
            "%s %s has num_labels=%d: its first logit is the reward (as TRL's GRPOTrainer reads it)",
            what,
            path,
            model.config.num_labels,
        )
    if tokenizer is None and pad_token_id is None and model.config.pad_token_id is None:
        # The tokenizer saved next to the weights is the one the head was trained with.
        try:
            tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code, revision=revision)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"{what} {path} has no pad_token_id in its config and no tokenizer could be loaded "
                f"from it ({err}); pass tokenizer= or pad_token_id="
            ) from err
    _sync_vocab(model, tokenizer)
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    if model.config.pad_token_id is None:
        raise ValueError(f"{what} {path}: could not determine pad_token_id; pass tokenizer= or pad_token_id=")
    return _finish(
        model,
        dropout_off=disable_dropout,
        gradient_checkpointing=gradient_checkpointing,
        gradient_checkpointing_kwargs=gradient_checkpointing_kwargs,
    )


def load_reward_model(path: str | os.PathLike, *args: Any, **kwargs: Any) -> PreTrainedModel:
    """Load a reward model: `load_scalar_model(path, ..., role="reward")`, same arguments."""
    return load_scalar_model(path, *args, role="reward", **kwargs)


def load_value_model(path: str | os.PathLike, *args: Any, **kwargs: Any) -> PreTrainedModel:
    """Load a value model (critic): `load_scalar_model(path, ..., role="value")`, same arguments.

    `path` may be a reward model (the usual PPO init), or a causal LM with `allow_new_head=True`,
    whose `score` head is then freshly initialised.
    """
    return load_scalar_model(path, *args, role="value", **kwargs)


# --------------------------------------------------------------------------------------------
# LoRA (PEFT)
# --------------------------------------------------------------------------------------------

PEFT_INSTALL_HINT = "LoRA training (--use_peft) needs the peft package: pip install posttrain[peft]"


class MissingDependencyError(ImportError):
    """An optional package a requested feature needs is not installed; the message says what to install."""


def _import_peft() -> Any:
    # peft is an optional extra; importing it lazily keeps `posttrain --help` and full fine-tuning
    # free of it, and turns a bare ModuleNotFoundError into the install command.
    try:
        import peft
    except ImportError as err:
        raise MissingDependencyError(PEFT_INSTALL_HINT) from err
    return peft


def peft_config_from(config: Any, *, task_type: str | None = None) -> Any:
    """A `peft.LoraConfig` from the TRL ModelConfig flags of `config` (use_peft, lora_*), or None
    when `use_peft` is off. `task_type` overrides `config.lora_task_type` (the reward trainer needs
    "SEQ_CLS")."""
    if not getattr(config, "use_peft", False):
        return None
    peft = _import_peft()
    targets = config.lora_target_modules
    if targets is not None and len(targets) == 1 and targets[0] == "all-linear":
        targets = "all-linear"  # peft recognises the shorthand only as a string, not inside a list
    return peft.LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        modules_to_save=config.lora_modules_to_save,
        task_type=task_type or config.lora_task_type,
        bias="none",
    )


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def apply_peft(model: nn.Module, peft_config: Any) -> nn.Module:
    """`peft.get_peft_model(model, peft_config)`: only the adapter (and modules_to_save) train.

    With a PEFT model the reference policy needs no copy: it is the same model with the adapter
    disabled (`trainers.online.reference_policy`). A model that already carries an adapter has it
    merged into its weights first (`merge_and_unload`, as TRL's trainers do), so only the new
    adapter trains and "the base" the reference runs as includes the old adapter.
    """
    if peft_config is None:
        return model
    if is_peft_model(model):
        model = model.merge_and_unload()
    return _import_peft().get_peft_model(model, peft_config)


def check_mixable(target: nn.Module, source: nn.Module, what: str) -> None:
    """ConfigError unless `target` and `source` have the same parameters (names and shapes), which
    `mix_into` pairs; `what` names the setting that needs it."""
    from posttrain.configs import ConfigError

    def shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in model.named_parameters()}

    mine, theirs = shapes(target), shapes(source)
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
        raise ConfigError(
            f"{what} mixes the policy's weights into the reference model, but their parameters differ "
            f"(e.g. {differ}); pass a reference model of the policy's architecture, or leave ref_model None "
            "(a copy of the initial policy)."
        )


@torch.no_grad()
def mix_into(target: nn.Module, source: nn.Module, alpha: float) -> None:
    """θ_target ← α·θ_source + (1 − α)·θ_target for every parameter, paired by name (TR-DPO's soft
    reference update, Gorbatovski et al. 2024, arXiv:2404.09656; TRL's SyncRefModelCallback pairs
    them by order). In place; buffers are left as they are, as TRL's."""
    sources = dict(source.named_parameters())
    for name, param in target.named_parameters():
        param.mul_(1.0 - alpha).add_(sources[name].detach().to(param.dtype), alpha=alpha)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """`model.disable_adapter()` (a PEFT model runs as its frozen base) that leaves every parameter's
    `requires_grad` as it found it: peft re-enables only the ACTIVE adapter on the way out and freezes
    any other (PPO's critic adapter, which would then silently stop training)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        with model.disable_adapter():
            yield model
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


class AdapterSwitch:
    """Which adapter of a multi-adapter PEFT model runs, switched without peft's `set_adapter`.

    `set_adapter` also flips `requires_grad` (the inactive adapter is frozen), but PPO's policy and
    critic adapters both train in the same forward/backward, so `use(name)` only sets the layers'
    active adapter and restores it afterwards. With gradient checkpointing a block's forward is re-run
    during backward, when the adapter in use may differ: `checkpoint_context` (torch.utils.checkpoint's
    `context_fn`, non-reentrant checkpointing only) re-runs each block under the adapter its forward
    used.
    """

    def __init__(self, model: nn.Module) -> None:
        # Tuner layers (LoRA) and modules_to_save wrappers: everything that reads an active adapter.
        self.layers = [m for m in model.modules() if hasattr(m, "_active_adapter")]
        self.current: str | None = None  # None: the model's own active adapter (the policy's)

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[None]:
        saved = [(m, m._active_adapter) for m in self.layers]
        previous, self.current = self.current, name
        for m in self.layers:
            m._active_adapter = name
        try:
            yield
        finally:
            for m, active in saved:
                m._active_adapter = active
            self.current = previous

    def checkpoint_context(self) -> tuple[Any, Any]:
        """(forward context, recompute context) for torch.utils.checkpoint.checkpoint(context_fn=...)."""
        if self.current is None:
            return contextlib.nullcontext(), contextlib.nullcontext()
        return contextlib.nullcontext(), self.use(self.current)


# --------------------------------------------------------------------------------------------
# Causal LM with a value head
# --------------------------------------------------------------------------------------------


class _ValueHead(nn.Linear):
    """Linear(hidden, 1) that casts its input to its own dtype, so a float32 head works on bf16 states."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden.to(self.weight.dtype))


@dataclass
class ValueHeadOutput:
    logits: torch.Tensor  # (B, T, V)
    values: torch.Tensor  # (B, T), float32 value head output
    hidden_states: torch.Tensor  # (B, T, H) last hidden state (after the final norm)


class WrapsPretrainedModel(nn.Module):
    """A module around a transformers model (`self.pretrained_model`) that answers for it: its `config`,
    `generation_config` and `device`."""

    @property
    def config(self):
        return self.pretrained_model.config

    @property
    def generation_config(self):
        return self.pretrained_model.generation_config

    @property
    def device(self) -> torch.device:
        return self.pretrained_model.device


class CausalLMWithValueHead(WrapsPretrainedModel):
    """A causal LM sharing its trunk with a scalar value head on the last hidden state.

    It looks like a sequence-classification value model to scoring code: `base_model_prefix`
    names the attribute holding the transformer backbone and `score` is the head, so
    `getattr(m, m.base_model_prefix)(...).last_hidden_state` followed by `m.score(...)` gives values.
    The head is float32 whatever the LM dtype (small values are not rounded away in bf16).
    """

    base_model_prefix = "backbone"

    def __init__(self, pretrained_model: PreTrainedModel):
        super().__init__()
        self.pretrained_model = pretrained_model
        hidden_size = pretrained_model.config.get_text_config().hidden_size
        self.score = _ValueHead(hidden_size, 1)
        nn.init.normal_(self.score.weight, std=1.0 / (hidden_size + 1) ** 0.5)
        nn.init.zeros_(self.score.bias)
        self.score.to(device=pretrained_model.device)

    @property
    def backbone(self) -> nn.Module:
        return getattr(self.pretrained_model, self.pretrained_model.base_model_prefix)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> ValueHeadOutput:
        out = self.pretrained_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=True,
            use_cache=False,
            **kwargs,
        )
        hidden = out.hidden_states[-1]
        values = self.score(hidden).squeeze(-1).float()
        return ValueHeadOutput(logits=out.logits, values=values, hidden_states=hidden)

    def generate(self, *args: Any, **kwargs: Any):
        return self.pretrained_model.generate(*args, **kwargs)

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        self.pretrained_model.gradient_checkpointing_enable(**kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Save the LM with `save_pretrained` and the head as `value_head.safetensors` beside it."""
        from safetensors.torch import save_file

        save_directory = Path(save_directory)
        self.pretrained_model.save_pretrained(save_directory, **kwargs)
        state = {f"score.{k}": v.detach().cpu().contiguous() for k, v in self.score.state_dict().items()}
        save_file(state, str(save_directory / VALUE_HEAD_FILE))

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        dtype: str | torch.dtype | None = None,
        trust_remote_code: bool = False,
        disable_dropout: bool = True,
        gradient_checkpointing: bool = False,
        **kwargs: Any,
    ) -> CausalLMWithValueHead:
        """Load the LM from `path`; load the head from `value_head.safetensors` if present, else init it."""
        from safetensors.torch import load_file

        lm = load_policy(
            path,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            disable_dropout=disable_dropout,
            gradient_checkpointing=gradient_checkpointing,
            **kwargs,
        )
        model = cls(lm)
        head_file = Path(path) / VALUE_HEAD_FILE
        if head_file.is_file():
            state = load_file(str(head_file))
            model.score.load_state_dict({k.removeprefix("score."): v for k, v in state.items()})
            model.score.to(device=lm.device)
        else:
            logger.info("no %s in %s; the value head is freshly initialised", VALUE_HEAD_FILE, path)
        return model
