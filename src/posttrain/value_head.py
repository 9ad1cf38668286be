"""TRL's classic value-head models: `AutoModelForCausalLMWithValueHead`,
`AutoModelForSeq2SeqLMWithValueHead` and `create_reference_model`.

These are the classes of the classic PPO API (TRL ≤ 0.11's gpt2-sentiment notebook, still shipped
by TRL 0.19): a transformers LM (`pretrained_model`) plus a `v_head` whose `summary` is a
`Linear(hidden, 1)` on the last hidden state (the decoder's, for encoder–decoder models).

Checkpoints have TRL's layout: one state dict holding the LM's weights and the head under
`v_head.summary.weight` / `v_head.summary.bias`, in `model.safetensors` (or `pytorch_model.bin`,
sharded or not). So a folder saved here loads in TRL and the reverse, and plain
`transformers.AutoModelForCausalLM.from_pretrained` loads the LM from it (the `v_head.*` keys are
reported as unused and skipped).

`AutoModelForCausalLMWithValueHead` is a `models.CausalLMWithValueHead`, so posttrain's PPO takes
it wherever it takes a model with a value head: `score` is the `v_head` and `backbone` the
transformer trunk. Its `forward` returns TRL's tuple `(lm_logits, loss, value)`, not
`models.ValueHeadOutput`.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import warnings
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from posttrain import compat
from posttrain.compat import dtype_kwargs
from posttrain.models import CausalLMWithValueHead, WrapsPretrainedModel

logger = logging.getLogger(__name__)

# Where a layer index appears in parameter names, in the order TRL 0.19 tries them
# (GPT-2, OPT / BART decoders, GPT-NeoX, Llama-like models).
LAYER_PATTERNS = (
    "transformer.h.{layer}",
    "model.decoder.layers.{layer}",
    "gpt_neox.layers.{layer}",
    "model.layers.{layer}",
)

V_HEAD_PREFIX = "v_head."
# Checkpoint files transformers writes, in the order they are looked for.
_CHECKPOINT_FILES = (
    ("model.safetensors", False),
    ("model.safetensors.index.json", True),
    ("pytorch_model.bin", False),
    ("pytorch_model.bin.index.json", True),
    ("v_head.safetensors", False),  # beside a PEFT adapter, as posttrain < 2026-11-27 saved it
)
# `from_pretrained` keywords that say where and how to fetch files (passed on to the head's lookup).
_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")


class ValueHead(nn.Module):
    """TRL's value head: dropout, then `summary = Linear(hidden, 1)`; one scalar per token.

    The input is cast to the head's dtype (float32 unless converted), so values are computed in full
    precision on a half-precision trunk. Returns shape (..., 1).
    """

    def __init__(self, config: Any, summary_dropout_prob: float | None = None) -> None:
        super().__init__()
        if summary_dropout_prob is None:
            summary_dropout_prob = getattr(config, "summary_dropout_prob", None)
        if summary_dropout_prob is None:
            summary_dropout_prob = 0.1
        self.dropout = nn.Dropout(summary_dropout_prob) if summary_dropout_prob else nn.Identity()
        # Some models (OPT-350m) project the hidden states before the word embeddings.
        hidden_size = getattr(config, "word_embed_proj_dim", None)
        if hidden_size is None and getattr(config, "is_encoder_decoder", False) and hasattr(config, "decoder"):
            hidden_size = getattr(config.decoder, "hidden_size", None)  # EncoderDecoderModel: the decoder's width
        if hidden_size is None:
            text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
            hidden_size = text_config.hidden_size
        self.summary = nn.Linear(hidden_size, 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output = self.dropout(hidden_states)
        if output.dtype != self.summary.weight.dtype:
            output = output.to(self.summary.weight.dtype)
        return self.summary(output)


def _is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def _current_device() -> int | str:
    """The accelerator index of this process (its local rank), or "cpu", as TRL's `current_device`."""
    if torch.cuda.is_available():
        return int(os.environ.get("LOCAL_RANK", "0"))
    return "cpu"


def _head_keys(state_keys: Any, wanted: set[str]) -> dict[str, str]:
    """Checkpoint key -> v_head key, for keys naming a parameter of the head after a `v_head.` prefix."""
    found = {}
    for key in state_keys:
        if V_HEAD_PREFIX not in key:
            continue
        local = key.rsplit(V_HEAD_PREFIX, 1)[1]
        if local in wanted:
            found[key] = local
    return found


def _read_head(path: str, wanted: set[str], only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The head's tensors in one weights file (safetensors: only those keys are read), by head key."""
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            keys = _head_keys(f.keys() if only is None else only, wanted)
            return {local: f.get_tensor(key) for key, local in keys.items()}
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {local: state[key] for key, local in _head_keys(state if only is None else only, wanted).items()}


def _load_state_file(path: str, safe: bool) -> dict[str, torch.Tensor]:
    """Every tensor of one weights file (safetensors or a torch pickle, tensors only), on the CPU."""
    if safe:
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    return torch.load(path, map_location="cpu", weights_only=True)


def load_v_head_state(
    name_or_path: str | os.PathLike, wanted: set[str] | None = None, **hub_kwargs: Any
) -> dict[str, torch.Tensor] | None:
    """The value-head tensors (`summary.weight`, `summary.bias`) stored in a checkpoint, or None.

    Looks in a local folder or hub repo for `model.safetensors`, its sharded index, `pytorch_model.bin`
    or its index (the first present), and reads only the keys holding `v_head.` (from the shards that
    hold them, for a sharded checkpoint).
    """
    from transformers.utils import cached_file

    wanted = wanted or {"summary.weight", "summary.bias"}
    location = os.fspath(name_or_path)

    def fetch(filename: str) -> str | None:
        return cached_file(
            location,
            filename,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
            **hub_kwargs,
        )

    for filename, is_index in _CHECKPOINT_FILES:
        path = fetch(filename)
        if path is None:
            continue
        if not is_index:
            return _read_head(path, wanted) or None
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        keys = _head_keys(weight_map, wanted)
        if not keys:
            return None
        state: dict[str, torch.Tensor] = {}
        for shard in sorted({weight_map[key] for key in keys}):
            shard_path = fetch(shard)
            if shard_path is None:
                raise FileNotFoundError(f"{location}: shard {shard!r} named by {filename} is missing")
            state.update(_read_head(shard_path, wanted, only={k for k in keys if weight_map[k] == shard}))
        return state
    return None


class PreTrainedModelWrapper(WrapsPretrainedModel):
    """A transformers model (`pretrained_model`) with a TRL value head (`v_head`).

    Subclasses set `transformers_parent_class` (the Auto class `from_pretrained` loads with) and
    `hidden_states_field` (the model output whose last entry the values are read from).
    `supported_args` are the keywords that configure the head rather than the model:
    `summary_dropout_prob` (default: the config's `summary_dropout_prob`, else 0.1),
    `v_head_init_strategy` (None: PyTorch's default `Linear` init; "normal": weights from
    N(0, `v_head_initializer_range`²), bias 0) and `v_head_initializer_range` (default 0.2).
    """

    transformers_parent_class: Any = None
    supported_args = ("summary_dropout_prob", "v_head_initializer_range", "v_head_init_strategy")
    supported_modules = ("v_head",)
    lm_head_namings: tuple[str, ...] = ("lm_head", "embed_out")
    hidden_states_field = "hidden_states"

    def __init__(self, pretrained_model: nn.Module, **kwargs: Any) -> None:
        # nn.Module's init directly: CausalLMWithValueHead's would build posttrain's own head.
        nn.Module.__init__(self)
        head_kwargs, unknown = self._split_kwargs(kwargs)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}: unexpected keyword argument(s) {sorted(unknown)}; "
                f"the value head takes {list(self.supported_args)}."
            )
        self.pretrained_model = pretrained_model
        if not self._has_lm_head():
            raise ValueError("The model does not have a language model head, please use a model that has one.")
        self.v_head = ValueHead(pretrained_model.config, head_kwargs.get("summary_dropout_prob"))
        self._init_weights(**head_kwargs)
        self.v_head.to(self._lm_head_device())
        self.is_peft_model = _is_peft_model(pretrained_model)
        self.is_loaded_in_8bit = getattr(pretrained_model, "is_loaded_in_8bit", False)
        self.is_loaded_in_4bit = getattr(pretrained_model, "is_loaded_in_4bit", False)
        self.is_sequential_parallel = False
        self.supports_rm_adapter = False
        self.policy_adapter_name = "default"
        self.current_device = _current_device()

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def _split_kwargs(cls, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        head = {k: v for k, v in kwargs.items() if k in cls.supported_args}
        return head, {k: v for k, v in kwargs.items() if k not in cls.supported_args}

    def _has_lm_head(self) -> bool:
        model = self.pretrained_model
        if hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None:
            return True
        return any(any(n in name for n in self.lm_head_namings) for name, _ in model.named_modules())

    def _lm_head_device(self) -> torch.device:
        head = (
            self.pretrained_model.get_output_embeddings()
            if hasattr(self.pretrained_model, "get_output_embeddings")
            else None
        )
        param = getattr(head, "weight", None)
        if param is None:
            param = next(self.pretrained_model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def _init_weights(self, **kwargs: Any) -> None:
        strategy = kwargs.get("v_head_init_strategy")
        if strategy is None:
            return
        if strategy != "normal":
            raise ValueError(f"v_head_init_strategy={strategy!r}: use None (PyTorch's default) or 'normal'.")
        with torch.no_grad():
            self.v_head.summary.weight.normal_(mean=0.0, std=kwargs.get("v_head_initializer_range", 0.2))
            self.v_head.summary.bias.zero_()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any):
        """Load the LM with `transformers_parent_class.from_pretrained` (hub id or folder) or wrap a
        model object, then load the head from the checkpoint's `v_head.*` keys when it has them, else
        initialise it fresh (as TRL does when not resuming PPO training).

        Keywords: the head's `supported_args`; `peft_config` (a fresh adapter via
        `peft.get_peft_model`); everything else goes to the LM's `from_pretrained` (`torch_dtype`
        and `dtype` are both accepted, whatever the transformers version).
        """
        peft_config = kwargs.pop("peft_config", None)
        is_trainable = kwargs.pop("is_trainable", False)
        reward_adapter = kwargs.pop("reward_adapter", None)
        reward_adapter_name = kwargs.pop("reward_adapter_name", "reward_model_adapter")
        head_kwargs, load_kwargs = cls._split_kwargs(kwargs)
        if "torch_dtype" in load_kwargs or "dtype" in load_kwargs:
            dtype = load_kwargs.pop("dtype", None)
            dtype = load_kwargs.pop("torch_dtype", dtype)
            load_kwargs.update(dtype_kwargs(dtype))
        head_state = None
        if isinstance(pretrained_model_name_or_path, (str, os.PathLike)):
            location = os.fspath(pretrained_model_name_or_path)
            hub_kwargs = {k: load_kwargs[k] for k in _HUB_KWARGS if k in load_kwargs}
            if os.path.isfile(os.path.join(location, "adapter_config.json")):
                pretrained_model = cls._load_adapter(location, is_trainable, peft_config, model_args, load_kwargs)
            else:
                pretrained_model = cls.transformers_parent_class.from_pretrained(location, *model_args, **load_kwargs)
                pretrained_model = cls._maybe_apply_peft(pretrained_model, peft_config)
            head_state = load_v_head_state(location, **hub_kwargs)
        elif isinstance(pretrained_model_name_or_path, nn.Module):
            if model_args or load_kwargs:
                warnings.warn(
                    f"{cls.__name__}.from_pretrained got a model object; loading arguments "
                    f"{sorted(load_kwargs) or list(model_args)} do not apply and are not used.",
                    stacklevel=2,
                )
            pretrained_model = cls._maybe_apply_peft(pretrained_model_name_or_path, peft_config)
        else:
            raise ValueError(
                "pretrained_model_name_or_path should be a string or a PreTrainedModel, "
                f"but is {type(pretrained_model_name_or_path)}"
            )
        model = cls(pretrained_model, **head_kwargs)
        if reward_adapter is not None:
            model.add_reward_adapter(reward_adapter, reward_adapter_name)
        if head_state is not None:
            model.v_head.load_state_dict(head_state)
        elif isinstance(pretrained_model_name_or_path, (str, os.PathLike)):
            logger.info(
                "no v_head weights in %s: the value head is freshly initialised "
                "(expected unless you resume PPO training)",
                pretrained_model_name_or_path,
            )
        return model

    # -- a reward model inside the policy (TRL's reward_adapter) ---------------------------------------
    def add_reward_adapter(self, adapter_path: str | os.PathLike, adapter_name: str = "reward_model_adapter") -> None:
        """Load a reward model's LoRA adapter (a saved `peft` SEQ_CLS adapter with its `score` head)
        into this PEFT policy, frozen, beside the policy's adapter; `compute_reward_score` runs it.
        The head becomes `reward_score` (`score` is the value head here)."""
        if not self.is_peft_model or not hasattr(self.pretrained_model, "load_adapter"):
            raise ValueError(
                "reward_adapter needs a PEFT policy (a peft model, or from_pretrained(..., peft_config=...)) "
                "to hold the reward adapter beside the policy's."
            )
        location = os.fspath(adapter_path)
        state = None
        for name, safe in (("adapter_model.safetensors", True), ("adapter_model.bin", False)):
            path = os.path.join(location, name)
            if os.path.isfile(path):
                state = _load_state_file(path, safe)
                break
        if state is None:
            raise ValueError(f"reward_adapter={location!r} holds no adapter_model.safetensors / adapter_model.bin.")
        head = {k.rsplit(".", 1)[-1]: v for k, v in state.items() if ".score." in f".{k}"}
        if "weight" not in head:
            raise ValueError(
                f"reward_adapter={location!r} has no `score` head: save the reward model's adapter with its "
                'classification head (peft task_type="SEQ_CLS" keeps it).'
            )
        policy_adapter = self.pretrained_model.active_adapter
        self.pretrained_model.load_adapter(location, adapter_name, is_trainable=False)
        self.pretrained_model.set_adapter(policy_adapter)
        num_labels, hidden = head["weight"].shape
        score = nn.Linear(hidden, num_labels, bias="bias" in head)
        score.load_state_dict(head)
        self.reward_score = score.to(self._lm_head_device()).requires_grad_(False)
        self.supports_rm_adapter = True
        self.rm_adapter_name, self.policy_adapter_name = adapter_name, policy_adapter

    def compute_reward_score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        """The reward adapter's scores at every position, (batch, length, num_labels), without
        gradients; a sequence's score is at its last real token. The policy adapter is active again
        afterwards and the model is left in eval mode (as TRL)."""
        if not self.supports_rm_adapter:
            raise ValueError("compute_reward_score needs a reward adapter: from_pretrained(..., reward_adapter=path).")
        self.pretrained_model.set_adapter(self.rm_adapter_name)
        self.pretrained_model.eval()
        try:
            with torch.no_grad():
                out = self.pretrained_model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    output_hidden_states=True,
                    return_dict=True,
                    **kwargs,
                )
                scores = self.reward_score(out.hidden_states[-1])
        finally:
            self.pretrained_model.set_adapter(self.policy_adapter_name)
        return scores

    @staticmethod
    def _maybe_apply_peft(model: nn.Module, peft_config: Any) -> nn.Module:
        if peft_config is None:
            return model
        from posttrain.models import _import_peft

        if _is_peft_model(model):
            raise ValueError("the model already carries a PEFT adapter and peft_config is also given; pass one.")
        return _import_peft().get_peft_model(model, peft_config)

    @classmethod
    def _load_adapter(cls, location, is_trainable, peft_config, model_args, load_kwargs) -> nn.Module:
        from posttrain.models import _import_peft

        peft = _import_peft()
        if peft_config is not None:
            logger.warning("peft_config is ignored: %s already holds a trained adapter (adapter_config.json)", location)
        adapter_config = peft.PeftConfig.from_pretrained(location)
        base = cls.transformers_parent_class.from_pretrained(
            adapter_config.base_model_name_or_path, *model_args, **load_kwargs
        )
        return peft.PeftModel.from_pretrained(base, location, is_trainable=is_trainable)

    # -- saving and state dicts ----------------------------------------------------------------------
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False):
        """TRL's layout: the LM's own keys (no `pretrained_model.` prefix) plus `v_head.summary.*`."""
        if args:
            raise TypeError("state_dict() takes keyword arguments only (destination=, prefix=, keep_vars=)")
        destination = self.pretrained_model.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        self.v_head.state_dict(destination=destination, prefix=prefix + V_HEAD_PREFIX, keep_vars=keep_vars)
        return destination

    def _load_from_state_dict(self, state_dict, prefix, *args: Any, **kwargs: Any) -> None:
        # Accept the layout state_dict() writes: a key under `prefix` that is not the head's is the LM's.
        # Keys already under `pretrained_model.` (nn.Module's own layout) are accepted as they are.
        own = (prefix + "pretrained_model.", prefix + V_HEAD_PREFIX)
        for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(own)]:
            state_dict[prefix + "pretrained_model." + key[len(prefix) :]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        """`pretrained_model.save_pretrained` with `state_dict()` (the LM's weights and `v_head.summary.*`
        in one state dict, so TRL and transformers both read the folder). Takes the LM's
        `save_pretrained` keywords (`max_shard_size`, `safe_serialization`, ...).

        For a PEFT model the adapter is saved by peft and the head beside it in `pytorch_model.bin`, a
        state dict of the `v_head.*` tensors only: TRL's layout, so TRL loads the folder too (earlier
        posttrain versions wrote `v_head.safetensors`, which loading still reads).
        """
        if self.is_peft_model:
            out = self.pretrained_model.save_pretrained(save_directory, *args, **kwargs)
            head = {V_HEAD_PREFIX + k: v.detach().cpu().contiguous() for k, v in self.v_head.state_dict().items()}
            torch.save(head, os.path.join(os.fspath(save_directory), "pytorch_model.bin"))
            return out
        if kwargs.get("state_dict") is None:
            kwargs["state_dict"] = self.state_dict()
        return self.pretrained_model.save_pretrained(save_directory, *args, **kwargs)

    def push_to_hub(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__}.push_to_hub: call save_pretrained(folder) and upload the folder "
            "with huggingface_hub.upload_folder."
        )

    # -- delegation to the wrapped model (config, generation_config, device: WrapsPretrainedModel) -------
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """`pretrained_model.generate(...)`: the same arguments and outputs."""
        return self.pretrained_model.generate(*args, **kwargs)

    def prepare_inputs_for_generation(self, *args: Any, **kwargs: Any) -> Any:
        return self.pretrained_model.prepare_inputs_for_generation(*args, **kwargs)

    def gradient_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        self.pretrained_model.gradient_checkpointing_enable(*args, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        self.pretrained_model.gradient_checkpointing_disable()

    def enable_input_require_grads(self) -> None:
        self.pretrained_model.enable_input_require_grads()

    @property
    def score(self) -> nn.Module:
        """The `v_head`, under the name posttrain's PPO reads a value head by (critic.PolicyAndValue)."""
        return self.v_head

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        attention_mask: torch.Tensor | None = None,
        return_past_key_values: bool = False,
        **kwargs: Any,
    ):
        kwargs = self._forward_kwargs(past_key_values, kwargs)
        out = self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        return self._outputs(out, getattr(out, self.hidden_states_field)[-1], return_past_key_values)

    def _forward_kwargs(self, past_key_values: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs["output_hidden_states"] = True
        # Passed on only when given: recent transformers deprecate the keyword itself.
        if past_key_values is not None and not self._prefix_tuning():
            kwargs[compat.cache_argument(self._base_forward())] = past_key_values
        return kwargs

    def _base_forward(self) -> Any:
        """The forward of the transformers model under the wrapper (behind PEFT's get_base_model())."""
        get_base = getattr(self.pretrained_model, "get_base_model", None)
        return (get_base() if callable(get_base) else self.pretrained_model).forward

    def _prefix_tuning(self) -> bool:
        """A PEFT prefix-tuning adapter supplies its own past_key_values (TRL drops the caller's)."""
        if not self.is_peft_model:
            return False
        peft_type = getattr(getattr(self.pretrained_model, "active_peft_config", None), "peft_type", None)
        return str(getattr(peft_type, "value", peft_type)) == "PREFIX_TUNING"

    def _outputs(self, base_output: Any, last_hidden_state: torch.Tensor, return_past_key_values: bool):
        weight = self.v_head.summary.weight
        if last_hidden_state.device != weight.device:
            last_hidden_state = last_hidden_state.to(weight.device)
        value = self.v_head(last_hidden_state).squeeze(-1)
        lm_logits = base_output.logits
        if lm_logits.dtype != torch.float32:
            lm_logits = lm_logits.float()
        if return_past_key_values:
            return lm_logits, base_output.loss, value, compat.output_cache(base_output)
        return lm_logits, base_output.loss, value


class AutoModelForCausalLMWithValueHead(PreTrainedModelWrapper, CausalLMWithValueHead):
    """A causal LM with TRL's value head (TRL's class of the same name).

    `forward(input_ids, past_key_values=None, attention_mask=None, return_past_key_values=False,
    **kwargs)` returns `(lm_logits, loss, value)`: logits (B, T, V) in float32, the LM's loss (None
    without `labels`) and values (B, T) from the last hidden state.

    It is also a `models.CausalLMWithValueHead`: `score` (the `v_head`) and `backbone` serve
    posttrain's PPO and scoring code.
    """

    transformers_parent_class = AutoModelForCausalLM


class AutoModelForSeq2SeqLMWithValueHead(PreTrainedModelWrapper):
    """An encoder–decoder LM (T5, BART, ...) with TRL's value head (TRL's class of the same name).

    `forward(input_ids, past_key_values=None, attention_mask=None, return_past_key_values=False,
    **kwargs)` takes the decoder inputs in `kwargs` (`decoder_input_ids`, `decoder_attention_mask`,
    or `labels`) and returns `(lm_logits, loss, value)` with values (B, T_dec) from the DECODER's
    last hidden state.
    """

    transformers_parent_class = AutoModelForSeq2SeqLM
    lm_head_namings = ("lm_head", "embed_out", "output_projection")
    hidden_states_field = "decoder_hidden_states"

    def __init__(self, pretrained_model: nn.Module, **kwargs: Any) -> None:
        super().__init__(pretrained_model, **kwargs)
        self.is_encoder_decoder = True


# --------------------------------------------------------------------------------------------
# Reference model
# --------------------------------------------------------------------------------------------


def create_reference_model(
    model: nn.Module, num_shared_layers: int | None = None, pattern: str | None = None
) -> nn.Module:
    """A frozen copy of `model` in eval mode, the reference policy of the classic PPO loop.

    With `num_shared_layers=N`, every parameter that comes before layer N (the embeddings and layers
    0..N-1) is shared: the copy holds the very same parameter objects as `model`, and they are frozen
    in `model` too, so they cost no memory twice and stay equal. Layers are found by the first of
    `LAYER_PATTERNS` present in the parameter names, or by `pattern` (e.g. "transformer.h.{layer}").
    """
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        raise ValueError(
            "DeepSpeed ZeRO-3 is enabled and is not compatible with `create_reference_model()`. "
            "Please instantiate your reference model directly with `AutoModelForCausalLM.from_pretrained()`."
        )
    names = [name for name, _ in model.named_parameters()]
    ref_model = copy.deepcopy(model)
    ref_model.requires_grad_(False)
    if num_shared_layers is None:
        return ref_model.eval()

    candidates = [pattern] if pattern is not None else list(LAYER_PATTERNS)
    matcher = None
    for candidate in candidates:
        regex = re.compile(re.escape(candidate.format(layer=num_shared_layers)) + r"(\.|$)")
        if any(regex.search(name) for name in names):
            matcher = regex
            break
    if matcher is None:
        raise ValueError(
            f"Layer pattern could not be matched: no parameter name holds layer {num_shared_layers} under "
            f"{candidates} (a model has layers 0..L-1, so num_shared_layers must be below L); "
            "pass pattern='<prefix>.{layer}' for this architecture."
        )
    shared = []
    for name in names:
        if matcher.search(name):
            break
        shared.append(name)
    replacement = {}
    for name in shared:
        param = model.get_parameter(name)
        param.requires_grad_(False)
        replacement[id(ref_model.get_parameter(name))] = param
    # Every module holding a copied shared tensor (tied weights included) gets the original.
    for module in ref_model.modules():
        for key, param in list(module._parameters.items()):
            if param is not None and id(param) in replacement:
                module._parameters[key] = replacement[id(param)]
    return ref_model.eval()


def share_layers(model: nn.Module, ref: nn.Module, num_shared_layers: int) -> None:
    """Make the embeddings and first `num_shared_layers` blocks of `ref` (a copy of `model`) the very
    modules of `model`, frozen in both: held once, never trained. Blocks are the first ModuleList
    child of the base model (any causal architecture; `create_reference_model` matches by name)."""
    base, ref_base = model.base_model, ref.base_model
    blocks = next((name for name, m in base.named_children() if isinstance(m, nn.ModuleList)), None)
    if blocks is None or num_shared_layers > len(getattr(base, blocks)):
        from posttrain.configs import ConfigError

        raise ConfigError(
            f"num_shared_layers={num_shared_layers}: the model has no list of that many transformer blocks to share."
        )
    for name, module in base.named_children():
        if name == blocks:
            for i in range(num_shared_layers):
                getattr(base, blocks)[i].requires_grad_(False)
                getattr(ref_base, blocks)[i] = getattr(base, blocks)[i]
            break
        module.requires_grad_(False)  # embeddings come before the blocks
        setattr(ref_base, name, module)
