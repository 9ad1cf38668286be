"""Atomic checkpoints, exact resume and the final model export.

A checkpoint is `output_dir/checkpoint-<step>/`:

    <model key>/            one folder per model ("policy", "value_model", ...): `save_pretrained`
                            output (safetensors), or `model.safetensors` for plain modules; what a
                            user loads with `from_pretrained` (a resume does not read it)
    dcp/                    torch.distributed.checkpoint: the trainable weights and buffers of every
                            model and the optimizer's tensor state, each rank writing its own shard
    optimizer_groups.pt     the optimizer's param groups and non-tensor state (main process)
    tokenizer/              the tokenizer, when given
    posttrain_config.json   the run's config
    scheduler.pt
    trainer_state.json      counters that JSON represents exactly (step, episode, data position,
                            KL coefficient, ...); trainer_state.pt holds the entries it cannot
                            (tensors, e.g. a torch.Generator state)
    rng_state_<rank>.pt     python / numpy / torch / CUDA generator states of each rank, and the
                            rank's own trainer state (`rank_state`, e.g. its sampling generator)
    checkpoint_complete.json  written last: step, models, world size and batch sizes of the run

`dcp/` is one format for one process, DDP and FSDP2-sharded models alike: it is written with
`get_model_state_dict` / `get_optimizer_state_dict` (keys are parameter names, so a shard is found
by name, not by position) and `dcp.save`, and read back with `dcp.load`, which reshards: a run
saved by 2 processes resumes with 1 and the other way round (see `load_checkpoint` for the RNG
rule, and `check_resume_batch` for the batch that must stay the same).

Under DeepSpeed the engine owns the training state, so `dcp/` is replaced by

    deepspeed/              the engine's own checkpoint (`engine.save_checkpoint`, called on every
                            rank): `global_step<step>/` holds each rank's ZeRO partition of the
                            optimizer state and fp32 master weights and the module states, beside
                            DeepSpeed's `latest` and `zero_to_fp32.py`

and the marker records the ZeRO stage. Every rank's engine loads its own partition back, so a
DeepSpeed checkpoint resumes only under DeepSpeed at the ZeRO stage and world size that saved it
(`check_resume_deepspeed`). Checkpoints of older posttrain versions keep the optimizer state in
`optimizer.pt` (a plain torch optimizer's state dict) and still load.

Everything is written into `output_dir/.tmp-checkpoint-<step>-<random>/`, fsynced, and renamed
into place in one `os.replace`, so a crash mid-save leaves the previous checkpoint as the newest
complete one and no half-written `checkpoint-*` directory (DESIGN.md, principle 10). The marker
file guards the cases rename cannot (a copied or hand-edited directory).

Every `torch.load` here uses `weights_only=True`: resuming from a downloaded checkpoint must not
execute pickled code, so RNG states are stored as tensors and plain containers only. For the same
reason `dcp/` holds tensors only (DCP unpickles any other value) and its `.metadata` is read with
an unpickler that admits only DCP's own metadata classes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from posttrain import distributed
from posttrain.tracking import to_jsonable

if TYPE_CHECKING:
    from accelerate import Accelerator

CHECKPOINT_PREFIX = "checkpoint-"
COMPLETE_MARKER = "checkpoint_complete.json"
CONFIG_NAME = "posttrain_config.json"
TMP_PREFIX = ".tmp-"
_CHECKPOINT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")
# Top-level files of a saved model: replaced as a set by save_final so shards of an older,
# differently-sharded save never mix with the new weights.
# adapter_config.json belongs to the set: transformers loads any folder holding one as PEFT.
_WEIGHT_FILE_RE = re.compile(
    r"^((model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?"
    r"|adapter_config\.json)$"
)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match the models it is loaded into, or it
    could not be written (a full disk, a read-only folder)."""


# Write failures a user fixes outside the program: a full disk or quota, a read-only or forbidden folder.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
# Below this much free space, a writer error that names no OS error is taken to be a full disk.
_NEARLY_FULL = 16 * 2**20


def _write_errno(err: BaseException, directory: Path) -> int | None:
    """The OS error number behind a failed write, or None when it is not a disk-side failure.

    Call before removing what the failed save wrote (that frees the space again). Python's own
    writes raise OSError. safetensors' writer raises SafetensorError with the OS error only in its
    text ("I/O error: ... (os error 28)" or "IoError(Os { code: 28, ... })"). torch.save's zip
    writer raises a RuntimeError naming no cause ("unexpected pos ..."), so then a nearly full
    disk is taken as the cause.
    """
    if isinstance(err, OSError):
        return err.errno
    match = re.search(r"(?:os error|code:) (\d+)", str(err)) if type(err).__name__ == "SafetensorError" else None
    if match:
        return int(match.group(1))
    if isinstance(err, RuntimeError) and not isinstance(err, CheckpointError):
        try:
            free = shutil.disk_usage(directory).free
        except OSError:
            return None
        return errno.ENOSPC if free < _NEARLY_FULL else None
    return None


def _save_failed(code: int | None, what: str, output_dir: Path, previous: Path | None) -> CheckpointError | None:
    """The one-line CheckpointError for a save that failed with OS error `code` on the disk side,
    or None for other errors (which are bugs, and keep their traceback)."""
    if code in _NO_SPACE:
        cause = f"no space left on device (or disk quota exceeded) while saving {what} in {output_dir}"
        fix = "free space, write to another --output_dir, or keep fewer checkpoints with --save_total_limit"
    elif code in _NOT_WRITABLE:
        cause = f"could not write {what} in {output_dir} ({os.strerror(code)})"
        fix = "make the folder writable or choose another --output_dir"
    else:
        return None
    if previous is not None:
        kept = f"the previous checkpoint {previous} is intact (resume with --resume_from_checkpoint latest)"
    else:
        kept = "no earlier checkpoint exists"
    return CheckpointError(f"{cause}; nothing half-written was left behind and {kept}. Fix: {fix}.")


def config_to_dict(config: Any) -> dict[str, Any]:
    """A dataclass or mapping config as a JSON-ready dict (paths and enums as strings)."""
    if config is None:
        return {}
    data = to_jsonable(config)
    if not isinstance(data, dict):
        raise TypeError(f"config must be a dataclass or a mapping, got {type(config).__name__}.")
    return data


# ---------------------------------------------------------------------------------------------
# Filesystem helpers


def _fsync_path(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        # Directories cannot be opened on some platforms (Windows); nothing to flush there.
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush file contents and directory entries so the rename publishes durable data."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def _replace_dir(src: Path, dst: Path) -> None:
    """Move directory `src` to `dst`; an existing `dst` (a re-save of the same step) is first
    renamed aside, because os.replace cannot overwrite a non-empty directory."""
    if not dst.exists():
        os.replace(src, dst)
        return
    aside = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}old-{dst.name}-", dir=dst.parent))
    aside.rmdir()
    os.replace(dst, aside)
    os.replace(src, dst)
    shutil.rmtree(aside, ignore_errors=True)


def _remove_tmp_dirs(output_dir: Path) -> None:
    """Remove temp dirs left by a save that was killed before it could clean up."""
    if not output_dir.is_dir():
        return
    for entry in output_dir.iterdir():
        if entry.is_dir() and entry.name.startswith(TMP_PREFIX):
            shutil.rmtree(entry, ignore_errors=True)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Models


def _is_fsdp2(model: nn.Module) -> bool:
    """A model sharded with torch's `fully_shard` (FSDP2): its parameters are DTensors."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _state_dict_for_saving(model: nn.Module, accelerator: Accelerator | None) -> dict | None:
    # Under DeepSpeed ZeRO-3 / FSDP the full weights exist only after a gather in which every
    # rank must take part, so this runs on all ranks; without an accelerator the model's own
    # state_dict is used by the save functions.
    bare = distributed.unwrap(model, accelerator)
    if _is_fsdp2(bare):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Full tensors on the main process's CPU (the other ranks get an empty dict).
        return get_model_state_dict(bare, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if accelerator is None:
        return None
    full = distributed.full_state_dict(model, accelerator)  # FSDP2: gathered by posttrain
    if full is not None:
        return full
    if distributed._is_deepspeed_zero3(accelerator):
        # accelerate gathers from the DeepSpeed engine, which `model` (unwrapped) is, or is a part of.
        return distributed.zero3_state_dict(model, accelerator)
    return accelerator.get_state_dict(model)


def _save_model(model: nn.Module, directory: Path, state_dict: dict | None, accelerator) -> None:
    bare = distributed.unwrap(model, accelerator)
    directory.mkdir(parents=True, exist_ok=True)
    if hasattr(bare, "save_pretrained"):
        # transformers (and PEFT) write safetensors by default; folders stay loadable with
        # plain `from_pretrained`.
        bare.save_pretrained(directory, state_dict=state_dict)
        _unshard_architecture_name(bare, directory)
        return
    from safetensors.torch import save_file

    state_dict = bare.state_dict() if state_dict is None else state_dict
    # Clones: safetensors refuses tensors that share storage (tied weights); loading copies
    # the same values into both names, so duplicating them on disk is harmless.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _unshard_architecture_name(model: nn.Module, directory: Path) -> None:
    """`fully_shard` swaps a model's class for `FSDP<Class>`, which save_pretrained writes into
    config.json's architectures; the saved folder names the model's own class."""
    from torch.distributed.fsdp import FSDPModule

    config_file = directory / "config.json"
    if not isinstance(model, FSDPModule) or not config_file.is_file():
        return
    own = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["architectures"] = [own.__name__]
    _write_json(config_file, config)


def _weight_files(directory: Path) -> list[Path]:
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    raise CheckpointError(
        f"{directory} holds no model.safetensors (or sharded index); it is not a model saved by "
        "posttrain. Check the checkpoint path and the model names passed to load_checkpoint."
    )


def _load_model(model: nn.Module, directory: Path, map_location: str, accelerator) -> None:
    from safetensors.torch import load_file

    bare = distributed.unwrap(model, accelerator)
    if not directory.is_dir():
        raise CheckpointError(
            f"{directory} is missing: the checkpoint has no weights for model {directory.name!r}. "
            "Pass the same model names to load_checkpoint as to save_checkpoint."
        )
    adapter = directory / "adapter_model.safetensors"
    if adapter.is_file() and hasattr(bare, "peft_config"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(bare, load_file(str(adapter), device=str(map_location)))
        return
    state_dict: dict[str, torch.Tensor] = {}
    for file in _weight_files(directory):
        state_dict.update(load_file(str(file), device=str(map_location)))
    missing, unexpected = bare.load_state_dict(state_dict, strict=False)
    # save_pretrained drops the second name of tied weights (e.g. lm_head.weight tied to the
    # embeddings); such a key is filled because it shares storage with a loaded one. Any other
    # missing or unexpected key is a real mismatch, as strict=True would report.
    own = bare.state_dict(keep_vars=True)
    loaded_storage = {own[k].data_ptr() for k in state_dict if k in own}
    missing = [k for k in missing if own[k].data_ptr() not in loaded_storage]
    if missing or unexpected:
        raise CheckpointError(
            f"weights in {directory} do not match model {directory.name!r}: "
            f"missing keys {missing[:10]}, unexpected keys {list(unexpected)[:10]}. "
            "Resume with the same model architecture (and PEFT settings) the checkpoint was saved with."
        )


# ---------------------------------------------------------------------------------------------
# Sharded training state (torch.distributed.checkpoint)

DCP_DIR = "dcp"
DEEPSPEED_DIR = "deepspeed"
OPTIMIZER_GROUPS = "optimizer_groups.pt"
_MODEL, _OPTIM = "model/", "optimizer/"
# DCP's note that it runs without a process group, which is how one process saves and loads.
_SINGLE_PROCESS = "torch.distributed is .*assuming the intent is to (save|load) in a single process"


def _bare_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's AcceleratedOptimizer: its step() may skip (gradient
    accumulation), which DCP's optimizer-state initialisation must not."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _container(models: Mapping[str, nn.Module], accelerator: Accelerator | None) -> nn.Module:
    """All checkpointed models under one module, so a parameter's name is `<model key>.<name>`
    and one optimizer may span several models (PPO's policy and critic)."""
    return nn.ModuleDict({key: distributed.unwrap(model, accelerator) for key, model in models.items()})


def _state_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen parameters (a LoRA base, a frozen backbone) are rebuilt identically by the run's model
    # loading, so they are not copied into every checkpoint; strict=False because of them (the
    # names that must be there are checked against the checkpoint's metadata first).
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _sharded_state(
    container: nn.Module, optimizer: torch.optim.Optimizer | None, template: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """(tensors for DCP, the optimizer's param groups and non-tensor state). Tensors are this
    rank's local views (DTensors for FSDP2-sharded parameters), keyed `model/<name>` and
    `optimizer/<name>/<state>`. An optimizer that has not stepped yet has no tensors when saved:
    get_optimizer_state_dict would create its state with a zero-gradient step, which a running
    optimizer must not take; a `template` (the tensors a load fills) is made that way."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = _state_options()
    tensors = {_MODEL + name: value for name, value in get_model_state_dict(container, options=options).items()}
    if optimizer is None:
        return tensors, None
    if not optimizer.state and not template:
        groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        return tensors, {"param_groups": groups, "state": {}, "stepped": False}
    state = get_optimizer_state_dict(container, optimizer, options=options)
    rest: dict[str, dict[str, Any]] = {}
    for name, entries in state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{_OPTIM}{name}/{key}"] = value
            else:
                rest.setdefault(name, {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "state": rest, "stepped": True}


# What a DCP .metadata file may name: DCP's own metadata records, torch sizes, dtypes and layouts.
_DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


def _read_dcp_metadata(directory: Path) -> Any:
    """The `.metadata` of a DCP folder, unpickled with only DCP's metadata classes admitted."""
    import importlib
    import pickle

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            allowed = name in _DCP_METADATA_CLASSES.get(module, ())
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                allowed = True
            if not allowed:
                raise CheckpointError(
                    f"{directory / '.metadata'} names {module}.{name}, which a torch.distributed.checkpoint "
                    "metadata file never holds; it was not written by posttrain and is not loaded."
                )
            return getattr(importlib.import_module(module), name)

    file = directory / ".metadata"
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: the checkpoint's sharded state is incomplete.")
    with open(file, "rb") as handle:
        return _Unpickler(handle).load()


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in value.shape)


def _check_against_metadata(path: Path, metadata: Any, tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """One CheckpointError naming the first differences between the checkpoint's tensors and this
    run's (`what` describes the models), before anything is loaded."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = metadata.state_dict_metadata
    prefix = _MODEL if what != "optimizer" else _OPTIM
    own = {k: v for k, v in tensors.items() if k.startswith(prefix)}
    theirs = {k for k in saved if k.startswith(prefix)}
    problems = []
    for key in sorted(theirs & set(own)):
        meta = saved[key]
        if not isinstance(meta, TensorStorageMetadata):
            problems.append(f"{key[len(prefix) :]}: the checkpoint holds a non-tensor value")
        elif tuple(meta.size) != _shape(own[key]):
            name, theirs_shape, own_shape = key[len(prefix) :], list(meta.size), list(_shape(own[key]))
            problems.append(f"{name}: shape {theirs_shape} in the checkpoint, {own_shape} in the model")
    missing = sorted(set(own) - theirs)
    unexpected = sorted(theirs - set(own))
    if missing:
        problems.append(f"missing keys (in the model, not in the checkpoint) {[k[len(prefix) :] for k in missing[:5]]}")
    if unexpected:
        names = [k[len(prefix) :] for k in unexpected[:5]]
        problems.append(f"unexpected keys (in the checkpoint, not in the model) {names}")
    if not problems:
        return
    if what == "optimizer":
        raise CheckpointError(
            f"the optimizer state in {path / DCP_DIR} does not match this run's optimizer: "
            f"{'; '.join(problems[:5])}. Resume with the optimizer (--optim) the checkpoint was saved with."
        )
    raise CheckpointError(
        f"the weights in {path / DCP_DIR} do not match {what}: {'; '.join(problems[:5])}"
        f"{f' (and {len(problems) - 5} more)' if len(problems) > 5 else ''}. "
        "Resume with the same model architecture (and PEFT settings, frozen parameters) the checkpoint was saved with."
    )


def _process_group() -> bool:
    """Whether DCP runs as a collective (a launched multi-process run); one process reads and writes alone."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _SafeReader(directory: Path, metadata: Any) -> Any:
    """A DCP FileSystemReader that returns `metadata` (read by `_read_dcp_metadata`) instead of
    unpickling `.metadata` itself."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(directory)


@contextlib.contextmanager
def _dcp_errors() -> Iterator[None]:
    """Re-raise the error behind a `torch.distributed.checkpoint` failure (this rank's, else the first
    rank's). DCP wraps them in a CheckpointException, which is a BaseException: `except Exception`
    would not see a full disk, and the message would name no cause."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        failures = err.failures
        rank = torch.distributed.get_rank() if _process_group() else 0
        wrapped = failures.get(rank) or next(iter(failures.values()), None)
        if wrapped is None:
            raise RuntimeError(str(err)) from err
        raise wrapped[0] from err  # (exception, traceback)


def _save_sharded(
    directory: Path, models: Mapping[str, nn.Module], optimizer: Any, accelerator: Accelerator | None, main: bool
) -> None:
    """Every rank: write its shard of the models' and the optimizer's tensors into `directory/dcp`;
    the main process writes the optimizer's param groups."""
    import torch.distributed.checkpoint as dcp

    container = _container(models, accelerator)
    tensors, groups = _sharded_state(container, None if optimizer is None else _bare_optimizer(optimizer))
    writer = dcp.FileSystemWriter(directory / DCP_DIR, overwrite=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        with _dcp_errors():
            dcp.save(tensors, storage_writer=writer, no_dist=not _process_group())
    if main and groups is not None:
        torch.save(groups, directory / OPTIMIZER_GROUPS)


def _load_sharded(path: Path, models: Mapping[str, nn.Module], optimizer: Any, accelerator: Accelerator | None) -> None:
    """Every rank: read the models' (and the optimizer's) tensors from `path/dcp` into this rank's
    shards, whatever the world size that wrote them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    container = _container(models, accelerator)
    metadata = _read_dcp_metadata(path / DCP_DIR)
    names = ", ".join(repr(k) for k in models)
    # Weights first: the template of an optimizer that has not stepped is made by a zero-gradient step.
    tensors, _ = _sharded_state(container, None)
    _check_against_metadata(path, metadata, tensors, f"the model{'s' if len(models) > 1 else ''} {names}")
    groups = None
    if optimizer is not None:
        groups_file = path / OPTIMIZER_GROUPS
        if not groups_file.is_file():
            raise CheckpointError(
                f"{groups_file} is missing: the checkpoint was saved without an optimizer, so this run's "
                "optimizer cannot resume exactly."
            )
        groups = torch.load(groups_file, map_location="cpu", weights_only=True)
    optimizer = None if optimizer is None else _bare_optimizer(optimizer)
    if groups is not None and groups.get("stepped"):
        tensors, _ = _sharded_state(container, optimizer, template=True)
        _check_against_metadata(path, metadata, tensors, "optimizer")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        with _dcp_errors():
            dcp.load(tensors, storage_reader=_SafeReader(path / DCP_DIR, metadata), no_dist=not _process_group())
    options = _state_options()
    set_model_state_dict(
        container, {k[len(_MODEL) :]: v for k, v in tensors.items() if k.startswith(_MODEL)}, options=options
    )
    if optimizer is None or groups is None:
        return
    if not groups.get("stepped"):
        # Saved before the optimizer's first step: only the hyperparameters (lr, ...) to restore.
        for group, saved in zip(optimizer.param_groups, groups["param_groups"]):
            group.update(saved)
        optimizer.state.clear()
        return
    state: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith(_OPTIM):
            name, entry = key[len(_OPTIM) :].rsplit("/", 1)
            state.setdefault(name, {})[entry] = value
    for name, entries in groups["state"].items():
        state.setdefault(name, {}).update(entries)
    set_optimizer_state_dict(
        container, optimizer, {"state": state, "param_groups": groups["param_groups"]}, options=options
    )


# ---------------------------------------------------------------------------------------------
# RNG and trainer state


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        keys = s["keys"].numpy().astype(np.uint32)
        np.random.set_state((s["name"], keys, s["pos"], s["has_gauss"], s["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        # A resume on fewer GPUs restores the devices that exist.
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)


def _is_exact_json(value: Any) -> bool:
    try:
        return json.loads(json.dumps(value, allow_nan=False)) == value
    except (TypeError, ValueError):
        return False


def _save_trainer_state(directory: Path, trainer_state: Mapping[str, Any]) -> None:
    as_json = {k: v for k, v in trainer_state.items() if _is_exact_json(v)}
    as_torch = {k: v for k, v in trainer_state.items() if k not in as_json}
    _write_json(directory / "trainer_state.json", as_json)
    if as_torch:
        torch.save(as_torch, directory / "trainer_state.pt")


def _load_trainer_state(directory: Path, map_location: str) -> dict[str, Any]:
    state: dict[str, Any] = {}
    json_path, torch_path = directory / "trainer_state.json", directory / "trainer_state.pt"
    if json_path.is_file():
        state.update(json.loads(json_path.read_text(encoding="utf-8")))
    if torch_path.is_file():
        state.update(torch.load(torch_path, map_location=map_location, weights_only=True))
    return state


# ---------------------------------------------------------------------------------------------
# Discovery


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step of a `checkpoint-<step>` directory name, else None."""
    match = _CHECKPOINT_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / COMPLETE_MARKER).is_file()


def is_model_only(path: str | os.PathLike) -> bool:
    """True for a checkpoint written with save_only_model (weights only: not resumable)."""
    marker = Path(path) / COMPLETE_MARKER
    try:
        return bool(json.loads(marker.read_text(encoding="utf-8")).get("model_only"))
    except (OSError, ValueError, AttributeError):
        return False


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first (temp and unfinished dirs skipped)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [
        (step, entry)
        for entry in root.iterdir()
        if entry.is_dir() and (step := checkpoint_step(entry)) is not None and is_complete(entry)
    ]
    return [entry for _, entry in sorted(found)]


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def resolve_checkpoint(
    output_dir: str | os.PathLike, resume_from_checkpoint: str | os.PathLike | bool | None
) -> Path | None:
    """Turn `resume_from_checkpoint` into a complete checkpoint directory or None.

    None / False / "false" -> None (fresh run). True / "latest" / "true" -> the newest complete
    checkpoint in `output_dir`. A path -> that checkpoint, or the newest one inside it when it
    is a run's output directory. Raises CheckpointError when asked to resume from nothing.
    """
    request = resume_from_checkpoint
    if request is None or request is False:
        return None
    if isinstance(request, str):
        lowered = request.strip().lower()
        if lowered in ("", "false", "none", "no"):
            return None
        if lowered in ("true", "latest", "last", "yes"):
            request = True
    if request is True:
        found = latest_checkpoint(output_dir)
        if found is None:
            raise CheckpointError(
                f"resume_from_checkpoint={resume_from_checkpoint!r} but {output_dir} holds no "
                f"complete {CHECKPOINT_PREFIX}<step> directory. Start without "
                "--resume_from_checkpoint, or pass the path of a checkpoint directory."
            )
        return found
    path = Path(request)
    if not path.exists():
        raise CheckpointError(
            f"resume_from_checkpoint={os.fspath(request)!r} does not exist. Pass an existing "
            f"{CHECKPOINT_PREFIX}<step> directory, or 'latest' to use the newest in output_dir."
        )
    if is_complete(path):
        return path
    inside = latest_checkpoint(path) if path.is_dir() else None
    if inside is not None:
        return inside
    raise CheckpointError(
        f"resume_from_checkpoint={os.fspath(request)!r} is not a complete posttrain checkpoint "
        f"(no {COMPLETE_MARKER}); it was interrupted while saving or written by another tool. "
        "Use an earlier checkpoint or 'latest'."
    )


def check_resume_batch(
    path: str | os.PathLike | None,
    *,
    world_size: int,
    sizes: Mapping[str, int],
    accumulation: int,
) -> None:
    """ConfigError, before any model step, when resuming `path` would change a batch size.

    `sizes` maps names to this run's sizes, the first being the global batch of one optimizer step
    (it grows linearly with `accumulation`, gradient_accumulation_steps); the checkpoint recorded
    its own (save_checkpoint's `batch`). A resume continues the same optimization, so the global
    batch stays the same when the number of processes changes: the error says which
    --gradient_accumulation_steps gives it, or that the new number of processes does not divide it.
    Checkpoints that recorded no sizes are not checked.
    """
    if path is None:
        return
    try:
        marker = json.loads((Path(path) / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    saved_sizes, saved_world = marker.get("batch") or {}, marker.get("world_size", world_size)
    for index, (name, current) in enumerate(sizes.items()):
        saved = saved_sizes.get(name)
        if saved is None or saved == current:
            continue
        from posttrain.configs import ConfigError

        head = (
            f"resume_from_checkpoint={os.fspath(path)!r} was saved by {saved_world} process(es) with a {name} of "
            f"{saved}; this run ({world_size} process(es), gradient_accumulation_steps {accumulation}) has {current}. "
            "A resume continues the same optimization, so the batch must stay the same"
        )
        unit = current // accumulation
        if index > 0:
            fix = "; set the options it is made of (e.g. --num_mini_batches) as the saved run did."
        elif saved % world_size:
            fix = (
                f", and {saved} is not divisible by {world_size} processes: no per-device batch size and "
                f"accumulation give it. Resume with a number of processes that divides {saved}."
            )
        elif saved % unit == 0:
            fix = f": pass --gradient_accumulation_steps {saved // unit}."
        else:
            fix = (
                f": choose --per_device_train_batch_size and --gradient_accumulation_steps whose product times "
                f"{world_size} processes is {saved}."
            )
        raise ConfigError(head + fix)


# ---------------------------------------------------------------------------------------------
# Save / load


def _rotate(output_dir: Path, save_total_limit: int, keep: Path, best: Path | None = None) -> None:
    """Delete the oldest checkpoints beyond save_total_limit, never `keep` (the newest) nor `best`
    (with save_total_limit=1 both then remain, as in transformers' rotate_checkpoints)."""
    kept = {keep} | ({best} if best is not None and best.is_dir() else set())
    checkpoints = [c for c in list_checkpoints(output_dir) if c not in kept]
    excess = len(checkpoints) + len(kept) - save_total_limit
    for old in checkpoints[: max(excess, 0)]:
        shutil.rmtree(old, ignore_errors=True)


def is_writer(accelerator: Accelerator | None, on_each_node: bool = False) -> bool:
    """Whether this process writes checkpoint files: the main process, or with save_on_each_node
    (nodes without a shared disk) the main process of every node."""
    if on_each_node and accelerator is not None:
        return bool(accelerator.is_local_main_process)
    return distributed.is_main(accelerator)


def save_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    *,
    models: Mapping[str, nn.Module],
    tokenizer: Any = None,
    config: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    trainer_state: Mapping[str, Any] | None = None,
    save_total_limit: int | None = None,
    accelerator: Accelerator | None = None,
    best: str | os.PathLike | None = None,
    model_only: bool = False,
    on_each_node: bool = False,
    rank_state: Mapping[str, Any] | None = None,
    batch: Mapping[str, int] | None = None,
) -> Path:
    """Atomically write `output_dir/checkpoint-<step>` and return its path.

    Call on every rank: weights are gathered collectively for the model folders, every rank writes
    its shard of the weights and the optimizer state into `dcp/` (under DeepSpeed: its engine's
    checkpoint, with its ZeRO partition, into `deepspeed/`) and its RNG state (with
    `rank_state`, this rank's own trainer state, e.g. its sampling generator), and the main process
    writes the rest. `trainer_state` is the main process's. `batch` (name -> size, e.g. the global
    batch) is recorded with the world size for `check_resume_batch`.
    `save_total_limit` keeps only that many newest checkpoints (None: keep all), and never deletes
    `best` (the best model's checkpoint). `model_only` (save_only_model) writes the weights, the
    tokenizer, the config and the trainer state but no optimizer, scheduler or RNG state; such a
    checkpoint cannot be resumed from. `on_each_node` (save_on_each_node): every node's main process
    writes its own copy, for nodes that share no disk (DCP's shards then stay on the node of the
    rank that wrote them: gather them into one folder before resuming on several nodes).
    """
    if save_total_limit is not None and save_total_limit < 1:
        raise ValueError(f"save_total_limit={save_total_limit} must be >= 1 or None.")
    for key in models:
        if not key or "/" in key or "." in key or key in ("tokenizer", DCP_DIR):
            raise ValueError(f"model name {key!r} cannot be used as a checkpoint folder name.")
    output_dir = Path(output_dir)
    main = is_writer(accelerator, on_each_node)
    final = output_dir / f"{CHECKPOINT_PREFIX}{step}"

    tmp_name = None
    previous = latest_checkpoint(output_dir) if main else None
    # With save_on_each_node every node's main process creates a temp dir of the name the first
    # process drew (broadcast), on its own disk.
    token = distributed.broadcast_object(os.urandom(6).hex(), accelerator) if on_each_node else None
    if main:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            _remove_tmp_dirs(output_dir)
            if token is not None:
                tmp_name = f"{TMP_PREFIX}{CHECKPOINT_PREFIX}{step}-{token}"
                (output_dir / tmp_name).mkdir()
            else:
                tmp_name = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{CHECKPOINT_PREFIX}{step}-", dir=output_dir)).name
        except OSError as err:
            raise (_save_failed(err.errno, final.name, output_dir, previous) or err) from err
    if token is not None:
        tmp = output_dir / f"{TMP_PREFIX}{CHECKPOINT_PREFIX}{step}-{token}"
        distributed.wait_for_everyone(accelerator)  # the node's temp dir exists before its ranks write
    else:
        # The other ranks write their RNG state into the same temp dir, so they need its name.
        tmp = output_dir / distributed.broadcast_object(tmp_name, accelerator)
    try:
        for key, model in models.items():
            state_dict = _state_dict_for_saving(model, accelerator)
            if main:
                _save_model(model, tmp / key, state_dict, accelerator)
        if main:
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / "tokenizer")
            if config is not None:
                _write_json(tmp / CONFIG_NAME, config_to_dict(config))
            if scheduler is not None and not model_only:
                torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            _save_trainer_state(tmp, {"step": step, **dict(trainer_state or {})})
        engine_record = None
        if not model_only:
            stage = distributed.deepspeed_stage(accelerator)
            if stage is None:
                _save_sharded(tmp, models, optimizer, accelerator, main)
            elif optimizer is not None:
                # Collective: every rank's engine writes its own ZeRO partition.
                saved = distributed.save_engine_state(tmp / DEEPSPEED_DIR, f"global_step{step}", optimizer, accelerator)
                engine_record = {"zero_stage": stage, **saved}
            rank = distributed.process_index(accelerator)
            rng = _rng_state()
            if rank_state is not None:
                rng["rank_state"] = dict(rank_state)
            torch.save(rng, tmp / f"rng_state_{rank}.pt")
        distributed.wait_for_everyone(accelerator)
        if main:
            marker = {
                "step": step,
                "models": list(models),
                "world_size": distributed.world_size(accelerator),
                **({"batch": dict(batch)} if batch else {}),
                **({"deepspeed": engine_record} if engine_record else {}),
                **({"model_only": True} if model_only else {}),
            }
            _write_json(tmp / COMPLETE_MARKER, marker)
            _fsync_tree(tmp)
            _replace_dir(tmp, final)
            _fsync_path(output_dir)
            if save_total_limit is not None:
                _rotate(output_dir, save_total_limit, keep=final, best=Path(best) if best else None)
    except Exception as err:
        failure = _save_failed(_write_errno(err, output_dir), final.name, output_dir, previous)
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        if failure is not None:
            raise failure from err
        raise
    except BaseException:
        # KeyboardInterrupt / SystemExit mid-save: leave no temp dir behind.
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    distributed.wait_for_everyone(accelerator)
    return final


def load_checkpoint(
    path: str | os.PathLike,
    *,
    models: Mapping[str, nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    restore_rng: bool = True,
    map_location: str = "cpu",
    accelerator: Accelerator | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into the given objects in place and return its trainer_state.

    Call on every rank. Weights and optimizer state come from `dcp/`, resharded to this run: the
    models may be plain, DDP-wrapped or FSDP2-sharded (`fully_shard`), before or after
    `accelerator.prepare`, and the world size may differ from the one that saved (a mismatch in
    parameter names or shapes is one CheckpointError naming both, before anything is loaded).
    Under DeepSpeed, with an `optimizer` (the one `accelerator.prepare` returned, so after it), every
    rank's engine loads its own ZeRO partition from `deepspeed/` and with it the weights of the
    models inside the engine; the checkpoint must come from a DeepSpeed run at the same ZeRO stage and
    world size (`check_resume_deepspeed`). A checkpoint without `dcp/` (save_only_model, older
    posttrain) is read from its model folders and `optimizer.pt`, a plain torch optimizer's state.

    RNG: each rank restores the python / numpy / torch / CUDA states it saved, and its own
    `rank_state` is returned under "rank_state". After a change in world size a rank that did not
    exist when the checkpoint was saved takes rank 0's global RNG states (a fresh run seeds every
    rank alike, so this is the state they would share) and gets no "rank_state": the trainer keeps
    that rank's freshly seeded per-rank streams.
    """
    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(
            f"{path} is not a complete posttrain checkpoint (no {COMPLETE_MARKER}); "
            "use resolve_checkpoint to find the newest complete one."
        )
    if (optimizer is not None or scheduler is not None) and is_model_only(path):
        raise CheckpointError(
            f"{path} was saved with save_only_model=True: it holds the model weights but no optimizer, "
            "scheduler or RNG state, so training cannot resume from it. Start a new run from its weights "
            f"(--model_name_or_path {path / next(iter(models), 'model')}), or resume from a checkpoint saved "
            "without --save_only_model."
        )
    if optimizer is not None:
        check_resume_deepspeed(path, accelerator)
    record = _read_marker(path).get("deepspeed") if optimizer is not None else None
    sharded = record is None and (path / DCP_DIR).is_dir()
    if record is not None:
        _load_engine_state(path, record, models, optimizer, map_location, accelerator)
    elif sharded:
        _load_sharded(path, models, optimizer, accelerator)
        # DCP leaves frozen parameters out (_state_options); a model with no trainable parameter that
        # still changes during training (GRPO / RLOO's reference with sync_ref_model) is read back
        # from the weights saved in its folder.
        for key, model in models.items():
            if not any(p.requires_grad for p in model.parameters()) and (path / key).is_dir():
                _load_model(model, path / key, map_location, accelerator)
    else:
        for key, model in models.items():
            _load_model(model, path / key, map_location, accelerator)
    in_files = None if sharded or record is not None else optimizer
    for name, target in (("optimizer.pt", in_files), ("scheduler.pt", scheduler)):
        if target is None:
            continue
        file = path / name
        if not file.is_file():
            raise CheckpointError(
                f"{file} is missing: the checkpoint was saved without it, so this run's "
                f"{name.removesuffix('.pt')} cannot resume exactly."
            )
        target.load_state_dict(_load_plain(file, map_location, path))
    state = _load_trainer_state(path, map_location)
    own = path / f"rng_state_{distributed.process_index(accelerator)}.pt"
    rng_file = own if own.is_file() else path / "rng_state_0.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, map_location="cpu", weights_only=True)
        if restore_rng:
            _set_rng_state(rng)
        if own.is_file() and "rank_state" in rng:
            state["rank_state"] = rng["rank_state"]
    return state


def _read_marker(path: Path) -> dict[str, Any]:
    try:
        marker = json.loads((path / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def _new_run_from(path: Path, marker: Mapping[str, Any]) -> str:
    """The advice to start a new run from a checkpoint's weights (the optimizer starting afresh)."""
    first = next(iter(marker.get("models") or []), "model")
    return f"start a new run from its weights (--model_name_or_path {path / first}; the optimizer starts afresh)"


def check_resume_deepspeed(path: str | os.PathLike | None, accelerator: Accelerator | None) -> None:
    """CheckpointError, before any step, when this run cannot load the optimizer state of checkpoint
    `path`. A DeepSpeed checkpoint holds each process's ZeRO partition (optimizer state and fp32
    master weights) as the saving run cut it; posttrain does not reshard it, so it resumes only under
    DeepSpeed at the ZeRO stage and number of processes that saved it. A checkpoint saved without
    DeepSpeed resumes only without it. Checkpoints saved with save_only_model are not checked (they
    resume nowhere; load_checkpoint says so)."""
    if path is None or is_model_only(path):
        return
    path = Path(path)
    marker = _read_marker(path)
    saved = marker.get("deepspeed")
    stage, world = distributed.deepspeed_stage(accelerator), distributed.world_size(accelerator)
    this = "without DeepSpeed" if stage is None else f"under DeepSpeed ZeRO-{stage}"
    if isinstance(saved, dict):
        saved_stage, saved_world = saved.get("zero_stage"), marker.get("world_size")
        if saved_stage == stage and saved_world == world:
            return
        raise CheckpointError(
            f"resume_from_checkpoint={os.fspath(path)!r} was saved under DeepSpeed ZeRO-{saved_stage} by "
            f"{saved_world} process(es); this run has {world} process(es) {this}. Each process's share "
            "of a DeepSpeed checkpoint (its ZeRO partition of the optimizer state and fp32 weights) is stored "
            "as the saving run cut it, and posttrain does not reshard it. Resume under ZeRO-"
            f"{saved_stage} with {saved_world} process(es), or {_new_run_from(path, marker)}; DeepSpeed's "
            f"{path / DEEPSPEED_DIR / 'zero_to_fp32.py'} consolidates the full fp32 weights."
        )
    if stage is None:
        return
    held = (
        "torch.distributed.checkpoint shards (dcp/)"
        if (path / DCP_DIR).is_dir()
        else "optimizer.pt, an older posttrain's layout (under DeepSpeed it held the main process's ZeRO "
        "partition only)"
    )
    raise CheckpointError(
        f"resume_from_checkpoint={os.fspath(path)!r} holds no DeepSpeed engine state: its optimizer state is "
        f"in {held}; this run is {this}, whose engine loads only its own checkpoints. Resume without "
        f"--deepspeed, or {_new_run_from(path, marker)}."
    )


def _load_engine_state(
    path: Path,
    record: Mapping[str, Any],
    models: Mapping[str, nn.Module],
    optimizer: Any,
    map_location: str,
    accelerator: Accelerator | None,
) -> None:
    """Every rank: the DeepSpeed engine loads its own partition; models outside the engine (none in
    posttrain's trainers) are read from their folders."""
    folder = path / DEEPSPEED_DIR
    if not (folder / str(record.get("tag"))).is_dir():
        raise CheckpointError(
            f"{folder / str(record.get('tag'))} is missing: the checkpoint's DeepSpeed engine state is "
            f"incomplete, so this run cannot resume from it; {_new_run_from(path, _read_marker(path))}."
        )
    inside = distributed.engine_modules(optimizer, accelerator)
    for key, model in models.items():
        bare = distributed.unwrap(model, accelerator)
        if not any(bare is module for module in inside):
            _load_model(model, path / key, map_location, accelerator)
    if not distributed.load_engine_state(folder, record, optimizer, accelerator):
        raise CheckpointError(
            f"DeepSpeed found no checkpoint to load in {folder} (tag {record.get('tag')!r}); "
            f"{_new_run_from(path, _read_marker(path))}."
        )


def _load_plain(file: Path, map_location: str, path: Path) -> Any:
    """`torch.load(weights_only=True)` of optimizer.pt / scheduler.pt, with the fix when the file
    holds other objects (an older posttrain wrote DeepSpeed's ZeRO optimizer state there)."""
    import pickle

    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{file} holds objects other than tensors and plain containers, which posttrain does not unpickle "
            "(an older posttrain saved DeepSpeed's ZeRO optimizer state there, the main process's partition "
            f"only); this run cannot resume from it: {_new_run_from(path, _read_marker(path))}."
        ) from err


def save_final(
    output_dir: str | os.PathLike,
    model: nn.Module,
    tokenizer: Any = None,
    config: Any = None,
    extra_models: Mapping[str, nn.Module] | None = None,
    accelerator: Accelerator | None = None,
    on_each_node: bool = False,
) -> Path:
    """Save the trained model at the top of `output_dir` (loadable with plain
    `AutoModel*.from_pretrained(output_dir)`), its tokenizer, `posttrain_config.json`, and
    `extra_models` (e.g. {"value_model": critic}) in subfolders.

    Files are written to a temp dir first and then moved in, config.json last, so a crash
    mid-save never leaves weights next to a config describing something else. `on_each_node`
    (save_on_each_node): every node's main process writes, for nodes that share no disk.
    """
    output_dir = Path(output_dir)
    main = is_writer(accelerator, on_each_node)
    all_models = {"": model, **dict(extra_models or {})}
    state_dicts = {key: _state_dict_for_saving(m, accelerator) for key, m in all_models.items()}
    if main:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}final-", dir=output_dir))
        except OSError as err:
            raise (
                _save_failed(err.errno, "the final model", output_dir, latest_checkpoint(output_dir)) or err
            ) from err
        try:
            for key, m in all_models.items():
                _save_model(m, tmp / key if key else tmp, state_dicts[key], accelerator)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            if config is not None:
                _write_json(tmp / CONFIG_NAME, config_to_dict(config))
            _fsync_tree(tmp)
            new_names = {entry.name for entry in tmp.iterdir()}
            for stale in output_dir.iterdir():
                if stale.is_file() and _WEIGHT_FILE_RE.match(stale.name) and stale.name not in new_names:
                    stale.unlink()
            entries = sorted(tmp.iterdir(), key=lambda e: (e.name == "config.json", e.name))
            for entry in entries:
                target = output_dir / entry.name
                if entry.is_dir():
                    _replace_dir(entry, target)
                else:
                    os.replace(entry, target)
            _fsync_path(output_dir)
        except Exception as err:
            code = _write_errno(err, output_dir)
            failure = _save_failed(code, "the final model", output_dir, latest_checkpoint(output_dir))
            if failure is None:
                raise
            raise failure from err
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    distributed.wait_for_everyone(accelerator)
    return output_dir


# ---------------------------------------------------------------------------------------------
# Output directory ownership


_IS_A_FILE = "output_dir={name!r} is a file; pass the path of a folder (new or existing)."


def has_output(output_dir: str | os.PathLike) -> bool:
    """True when `output_dir` holds something worth keeping: a complete checkpoint, saved
    weights, or logged metrics (kept so a crashed run can be diagnosed)."""
    root = Path(output_dir)
    if root.exists() and not root.is_dir():
        from posttrain.configs import ConfigError

        # Called before any model loads (the trainers' output-dir check): say so now, not after loading.
        raise ConfigError(_IS_A_FILE.format(name=os.fspath(output_dir)))
    if not root.is_dir():
        return False
    if list_checkpoints(root):
        return True
    for entry in root.iterdir():
        if entry.is_file() and _WEIGHT_FILE_RE.match(entry.name):
            return True
    metrics = root / "metrics.jsonl"
    return metrics.is_file() and metrics.stat().st_size > 0


def check_output_dir_writable(output_dir: str | os.PathLike) -> None:
    """Raise ConfigError unless `output_dir` is (or can be created as) a folder this process can write.

    Meant to run before any model loads, so a typo'd or read-only `--output_dir` costs nothing.
    Nothing is left behind: a folder that does not exist yet is not created; instead a temp folder
    is created and removed in its nearest existing parent. Permission bits are not trusted (root
    ignores them, read-only mounts and ACLs override them): the check really writes.
    """
    from posttrain.configs import ConfigError

    path = Path(output_dir).expanduser()
    name = os.fspath(output_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(_IS_A_FILE.format(name=name))
    probe_in = path
    while not probe_in.exists():
        probe_in = probe_in.parent
    if not probe_in.is_dir():
        raise ConfigError(
            f"output_dir={name!r} cannot be created: {os.fspath(probe_in)!r} is a file, not a folder; "
            "choose another --output_dir."
        )
    try:
        Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}write-test-", dir=probe_in)).rmdir()
    except OSError as err:
        target = "is not writable" if probe_in == path else f"cannot be created in {os.fspath(probe_in)!r}"
        raise ConfigError(
            f"output_dir={name!r} {target} ({err.strerror}); choose a writable --output_dir "
            "or fix the folder's permissions."
        ) from None


class OutputDirGuard:
    """Context manager around a training run: on entry it checks that `output_dir` is a writable
    folder (`check_output_dir_writable`, ConfigError otherwise); on failure it removes the temp
    dirs of an interrupted save, and removes `output_dir` entirely if this run created it and
    nothing worth keeping was written yet. A directory that existed before the run is never deleted.

        with OutputDirGuard(config.output_dir, is_main=distributed.is_main(accelerator)):
            trainer.train()
    """

    def __init__(self, output_dir: str | os.PathLike, is_main: bool = True) -> None:
        self.output_dir = Path(output_dir)
        self.is_main = is_main
        self.created = False

    def __enter__(self) -> OutputDirGuard:
        check_output_dir_writable(self.output_dir)
        self.created = not self.output_dir.exists()
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None or not self.is_main:
            return False
        _remove_tmp_dirs(self.output_dir)
        if self.created and self.output_dir.is_dir() and not has_output(self.output_dir):
            shutil.rmtree(self.output_dir, ignore_errors=True)
        return False
