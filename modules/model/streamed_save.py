"""Writing a model whose weights no single process holds (sharded training), tensor by tensor.

The layouts are the ones `saving.py` and the families' single files write - the same parts and the same
renaming functions (`FilePart`) - but nothing is ever whole in one place: the `.safetensors` header is
planned from the shapes alone, then the weights are gathered one block at a time (each of the family's
repeated blocks; the weights outside them one module at a time), renamed into the file's layout, cast
to the save dtype, written and dropped. So rank 0's memory holds one block of the model at a time, and
a GPU one gathered tensor.

Every rank runs the same code, so every rank asks for the same tensors in the same order (gathering a
sharded tensor is a collective); only the writing rank (`source.writes`) touches files. A write that
fails there is remembered and raised after the last gather, so the other ranks are never left waiting.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from modules.util import dist_utils as du
from modules.util.atomic import atomic_path

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class FilePart:
    """One module's share of a file: its weights and how a piece of its state dict is named in the file."""

    module: nn.Module
    state: Callable[[], dict[str, torch.Tensor]]
    """The module's tensors by name (sharded ones as they are: nothing is gathered to list them)."""
    convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    """A piece of `state` (one block's tensors, or one module's) -> the file's names; what a layout fuses
    (q, k and v into one matrix) lies within one block."""
    blocks: tuple[nn.Module, ...] = ()
    """The module's repeated blocks: each is gathered and converted as one piece."""

    def pieces(self, state: dict[str, torch.Tensor]) -> list[list[str]]:
        """The names of `state` grouped into the pieces that are gathered and converted together."""
        prefixes = [name + "." for name, m in self.module.named_modules()
                    if name and any(m is b for b in self.blocks)]
        groups: dict[str, list[str]] = {}
        for key in state:
            block = next((p for p in prefixes if key.startswith(p)), None)
            groups.setdefault(block or key.rpartition(".")[0], []).append(key)
        return list(groups.values())


@dataclass(frozen=True)
class TensorSource:
    """How a process reads weights for a save: `whole(t)` gives the whole tensor of a sharded one (a
    collective: every rank calls it for the same tensors) or `t`; only `writes` writes files."""

    whole: Callable[[torch.Tensor], torch.Tensor]
    writes: bool


LOCAL = TensorSource(whole=lambda t: t, writes=True)
"""One process holding every weight."""


def gathering_source(device: torch.device) -> TensorSource:
    """The source of a sharded run: every rank gathers each tensor (to `device` first, as NCCL moves GPU
    tensors only - shards offloaded to the CPU included); rank 0 writes."""

    def whole(value: torch.Tensor) -> torch.Tensor:
        if hasattr(value, "full_tensor"):  # an FSDP (DTensor) parameter
            return value.to(device).full_tensor()
        return value

    return TensorSource(whole=whole, writes=du.is_main())


def _file_dtype(value: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    # Floating tensors take the save dtype; integer buffers (e.g. CLIP position ids) keep theirs.
    return dtype if value.is_floating_point() else value.dtype


def plan(parts: Iterable[FilePart], dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor of the file, in the order `stream_file` writes them, from the
    shapes alone (the pieces are converted as `meta` tensors: no memory, no communication)."""
    entries = []
    for part in parts:
        state = part.state()
        for piece in part.pieces(state):
            meta = {k: torch.empty(state[k].shape, dtype=_file_dtype(state[k], dtype), device="meta") for k in piece}
            entries += [(k, v.dtype, tuple(v.shape)) for k, v in part.convert(meta).items()]
    return entries


def stream_file(path: Path, parts: list[FilePart], dtype: torch.dtype, metadata: dict[str, str],
                source: TensorSource) -> Path:
    """Write one `.safetensors` file of `parts` piece by piece (see the module docstring); atomic."""
    entries = plan(parts, dtype)
    if not source.writes:
        _gather_all(parts, dtype, source, None)
        return Path(path)
    with atomic_path(path) as tmp, open(tmp, "wb") as file:
        writer = _Writer(file, path, entries, metadata)
        _gather_all(parts, dtype, source, writer)
        writer.finish()
    return Path(path)


def _gather_all(parts: list[FilePart], dtype: torch.dtype, source: TensorSource, writer: "_Writer | None") -> None:
    error: Exception | None = None
    for part in parts:
        state = part.state()
        for piece in part.pieces(state):
            gathered = {}
            for key in piece:
                value = source.whole(state[key].detach())
                if writer is not None:
                    gathered[key] = value.to("cpu", _file_dtype(value, dtype))
                del value
            if writer is None or error is not None:
                continue
            try:
                for name, tensor in part.convert(gathered).items():
                    writer.write(name, tensor)
            except Exception as e:  # noqa: BLE001 - raised once every rank has finished gathering
                error = e
    if error is not None:
        raise error


class _Writer:
    """A `.safetensors` file written in a planned order: the header first, then each tensor as it comes."""

    def __init__(self, file, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str]) -> None:
        self.file, self.path, self.entries, self.next = file, Path(path), entries, 0
        header, offset = {"__metadata__": dict(metadata)}, 0
        for name, dtype, shape in entries:
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        file.write(struct.pack("<Q", len(text)) + text)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.entries[self.next] if self.next < len(self.entries) else None
        if expected != (name, tensor.dtype, tuple(tensor.shape)):
            raise RuntimeError(f"{self.path}: tensor {name} {tensor.dtype} {tuple(tensor.shape)} came where the "
                               f"planned header has {expected}")
        self.file.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        self.next += 1

    def finish(self) -> None:
        if self.next != len(self.entries):
            raise RuntimeError(f"{self.path}: {len(self.entries) - self.next} planned tensors were never written")
