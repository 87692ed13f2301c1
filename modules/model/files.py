"""Write model outputs so that a crash or a reader never sees half a file or half a folder."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_save_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`fp16`/`bf16`/`fp32` (as in `save.save_dtype`) or a torch dtype -> the torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save dtype {dtype!r} is not one of {', '.join(SAVE_DTYPES)}")
    return SAVE_DTYPES[dtype]


def save_safetensors_atomically(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> Path:
    """Write a .safetensors file through a temporary file in the same folder and rename it into place."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        # safetensors refuses non-contiguous or shared-storage tensors; give it clean copies.
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, temp_name, metadata=metadata)
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    return path


@contextmanager
def folder_written_atomically(folder: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder to write into; on success it replaces `folder` whole.

    An existing `folder` is first renamed aside and only deleted once the new one is in place, so
    at every moment either the complete old or the complete new output exists.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        yield temp
        old = None
        if folder.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".old", dir=folder.parent))
            old.rmdir()
            os.replace(folder, old)
        os.replace(temp, folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
