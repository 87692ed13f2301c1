"""Reading `.ckpt`/`.pt`/`.pth` checkpoints without ever running code from their pickle.

A `.ckpt` is a pickle, and unpickling arbitrary objects can run arbitrary code; torch's weights-only
unpickler accepts tensors and plain containers only. Zip-format files (torch >= 1.6) are
memory-mapped, so reading one costs little until its tensors are used.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch


def load_pickled_state(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of tensors in a pickled checkpoint (also one nested under 'state_dict')."""
    try:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            loaded = torch.load(path, map_location="cpu", weights_only=True)  # pre-zipfile format
    except Exception as error:  # noqa: BLE001 - any unpickling failure gets the same explanation
        raise ValueError(
            f"{path}: could not be read as a weights-only .ckpt ({type(error).__name__}: {str(error)[:300]}). "
            "Tandem never unpickles arbitrary objects; convert the file to .safetensors and use that."
        ) from error
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ValueError(f"{path}: does not contain a state dict of tensors (nor one under 'state_dict').")
    return dict(loaded)
