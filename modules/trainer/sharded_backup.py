"""Backups of a sharded (FSDP) run, through `torch.distributed.checkpoint` (DCP).

No rank holds the whole model, so no rank can write `weights.safetensors`: every rank writes its own
shards of the trained weights, the optimizer state and the EMA into `shards/` (DCP's format: one
`.distcp` file per rank and a `.metadata` index). Rank 0 adds `state.pt` - the plain values: step,
sampler position, schedule, RNG of every rank, and the optimizer's per-parameter hyper-parameters -
and `backup.json`, and renames the folder into place, as for every backup (`backup.py`).

Written by sharded training (`modules/distributed/fsdp.py`: `ShardedBackups`); read by any run. Reading
reshards: DCP loads each tensor into whatever shape this run holds it in, so a backup of N processes
resumes on M processes, sharded or not (one process, DDP); a one-process or DDP backup resumes under FSDP
through the parallelism (`FSDPParallelism.load_whole_backup`). Keys are the trained module's own
parameter names (`unet.…`, `text_encoders.0.…`), the same in every strategy.

Safety: `state.pt` is read with `weights_only=True` and DCP's `.metadata` index (a pickle) with an
unpickler that allows DCP's own metadata classes only, so a doctored backup cannot run code. Only
tensors go through DCP (its non-tensor entries would be unpickled freely).

Written synchronously: every rank writes its 1/N at once, and training waits. DCP's `async_save` would
let training go on, but it needs a copy of every rank's shards in host memory (for a Flux full
fine-tune the whole 190 GB of weights and Adam state, on the host, next to the CPU copy training may
already keep) and a second process group for its background collectives.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

from modules.util import dist_utils as du
from modules.trainer import backup as backups
from modules.util.atomic import begin_directory, commit_directory, discard_directory

SHARDS = "shards"
FORMAT = "sharded"


def is_sharded(path: Path) -> bool:
    return (Path(path) / SHARDS).is_dir()


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    # Frozen weights (a LoRA's base) come from the base model, never from a backup.
    return StateDictOptions(ignore_frozen_params=True, flatten_optimizer_state_dict=True, strict=False)


def _module(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)  # the TrainingModel (DDP wraps it)


def parameter_names(model: torch.nn.Module, params) -> list[str]:
    """The names of `params` in the trained module `model` (wrapped or not)."""
    names = {id(p): name for name, p in _module(model).named_parameters()}
    return [names[id(p)] for p in params]


def _state_dicts(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """(trained weights, flattened optimizer state) by parameter name; buffers (SD3's fixed position
    embedding) are not backed up, as in `backup.py`'s backups: the model rebuilds them."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    weights, optimizer_state = get_state_dict(model, optimizer, options=_options())
    trained = {name for name, p in _module(model).named_parameters() if p.requires_grad}
    return {k: v for k, v in weights.items() if k in trained}, optimizer_state


def checkpoint_state(model: torch.nn.Module, optimizer, ema) -> tuple[dict, dict]:
    """(tensors through DCP, the optimizer's non-tensor entries) of this step; the tensors are the live
    sharded ones, so the backup must be written before the next step changes them."""
    weights, optimizer_state = _state_dicts(model, optimizer)
    tensors = {"model": weights,
               "optimizer": {k: v for k, v in optimizer_state.items() if isinstance(v, torch.Tensor)}}
    if ema is not None:
        tensors["ema"] = dict(zip(parameter_names(model, ema.params), ema.shadow))
    return tensors, {k: v for k, v in optimizer_state.items() if not isinstance(v, torch.Tensor)}


def write_sharded_backup(backups_dir: Path, run_id: str, step: int, tensors: dict, state: dict, manifest: dict,
                         keep: int) -> Path:
    """Write one backup with every rank (a collective); returns its path. All ranks raise together if
    any part fails; a half-written folder never becomes a backup."""
    import torch.distributed.checkpoint as dcp

    target = Path(backups_dir) / run_id / backups.backup_name(step)
    if du.broadcast_object(target.exists() if du.is_main() else None):
        return target  # this very step was backed up already ("backup now" twice)
    tmp = du.broadcast_object(du.on_main(lambda: begin_directory(target)))
    try:
        dcp.save(tensors, checkpoint_id=str(tmp / SHARDS))

        def finish() -> None:
            backups.write_state_and_manifest(tmp, run_id, step, state, {**manifest, "format": FORMAT})
            backups.refuse_if_orphaned(target)
            commit_directory(tmp, target)
            backups.rotate(target.parent, keep)
        du.on_main(finish)
    finally:
        if du.is_main():
            discard_directory(tmp)
    return target


# ------------------------------------------------------------------------------------------ reading

_ALLOWED = {
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's index, unpickled with only the classes it is made of: a pickle naming anything else is refused."""

    def find_class(self, module: str, name: str):
        if module == "torch.distributed.checkpoint.metadata" or name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise backups.UnsafeBackupError(
            f"the sharded backup's index names {module}.{name}, which is not part of a checkpoint index and could "
            "run code when loaded, so it was not loaded. Resume only backups Tandem wrote.")


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            data = (Path(self.path) / ".metadata").read_bytes()
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
            from torch.distributed.checkpoint.metadata import StorageMeta
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(Path(path) / SHARDS))


def check_index(path: Path) -> None:
    """Read the backup's DCP index with the restricted unpickler (UnsafeBackupError for anything else)."""
    _saved_keys(path)


def _saved_keys(path: Path) -> set[str]:
    return set(_reader(path).read_metadata().state_dict_metadata)


def load_sharded_backup(path: Path, model: torch.nn.Module, optimizer, ema, optimizer_name: str) -> tuple[dict, dict]:
    """Load a sharded backup's tensors into `model` (the wrapped trained module), `optimizer` and `ema`, in
    whatever layout this run holds them (sharded or whole, any number of processes), after checking that
    it was trained with `optimizer_name`; returns (plain state, manifest)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    state, manifest = backups.read_state_and_manifest(path)
    backups.check_optimizer(state, optimizer_name)
    model_state, optimizer_state = _state_dicts(model, optimizer)  # templates in this run's layout
    tensors = {"model": model_state,
               "optimizer": {k: v for k, v in optimizer_state.items() if isinstance(v, torch.Tensor)}}
    saved = {key.split(".", 1)[0] for key in _saved_keys(path)}
    if ema is not None and "ema" in saved:
        tensors["ema"] = dict(zip(parameter_names(model, ema.params), ema.shadow))
    _check_same_parameters(path, set(model_state), state)
    dcp.load(tensors, storage_reader=_reader(path), no_dist=not du.is_distributed())
    optimizer_state = {**optimizer_state, **tensors["optimizer"], **state.pop("optimizer_entries")}
    set_state_dict(model, optimizer, model_state_dict=tensors["model"], optim_state_dict=optimizer_state,
                   options=_options())
    return state, manifest


def _check_same_parameters(path: Path, wanted: set[str], state: dict) -> None:
    have = set(state.get("trained_parameters", ()))
    missing = sorted(wanted - have)
    if missing:
        raise ValueError(f"the backup {path} does not match this model/training method (missing {missing[:3]}...); "
                         "start fresh or use the config the backup was made with.")


def read_trained_weights(path: Path) -> dict[str, torch.Tensor]:
    """The whole trained weights of any backup, in this process alone (tools, tests), by the names of
    `weights.safetensors` (`unet.conv_in.weight`, `transformer.…`, `text_encoder_0.…`) whatever its format."""
    path = Path(path)
    if not is_sharded(path):
        from safetensors.torch import load_file
        return load_file(str(path / backups.WEIGHTS))
    names = backups.read_state_and_manifest(path)[0].get("weight_names", {})
    return {names.get(k, k): v for k, v in read_sharded_weights(path).items()}


def read_sharded_weights(path: Path) -> dict[str, torch.Tensor]:
    """The whole trained weights of a sharded backup, by parameter name, read in this process alone (tools,
    tests): `{"unet.conv_in.weight": tensor, ...}`."""
    import torch.distributed.checkpoint as dcp

    reader = _reader(path)
    metadata = reader.read_metadata().state_dict_metadata
    model = {key.split(".", 1)[1]: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.items() if key.startswith("model.")}
    dcp.load({"model": model}, storage_reader=reader, no_dist=True)
    return model
