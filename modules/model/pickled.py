"""Reading `.ckpt`/`.pt`/`.pth` checkpoints without ever running code from their pickle.

A `.ckpt` is a pickle, and unpickling arbitrary objects can run arbitrary code; torch's weights-only
unpickler accepts tensors and plain containers only. Zip-format files (torch >= 1.6) are
memory-mapped, so reading one costs little until its tensors are used.
"""
from __future__ import annotations

import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch


def load_pickled_state(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of tensors in a pickled checkpoint (also one nested under 'state_dict')."""
    try:
        # torch's warnings about the file's format say nothing the refusal below does not say better.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:
                if "mmap" not in str(error):
                    raise
                loaded = torch.load(path, map_location="cpu", weights_only=True)  # pre-zipfile format
    except Exception as error:  # noqa: BLE001 - any unpickling failure gets one of two explanations
        found = forbidden_global(error) if isinstance(error, pickle.UnpicklingError) else ""
        if found:
            raise ValueError(f"{path}: could not be read as a weights-only .ckpt: it holds Python objects besides "
                             f"tensors ({found}), and loading those could run code, so Tandem does not load it. "
                             "Convert the file to .safetensors with a tool you trust, or use the model's diffusers "
                             "folder.") from None
        raise ValueError(f"{path}: could not be read as a weights-only .ckpt ({type(error).__name__}: "
                         f"{first_sentence(error)}). Is the file complete? Convert it to .safetensors, or use the "
                         "model's diffusers folder.") from None
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ValueError(f"{path}: does not contain a state dict of tensors (nor one under 'state_dict').")
    return dict(loaded)


def forbidden_global(error: BaseException) -> str:
    """The line of a weights-only refusal that names what was refused ("Trying to load unsupported GLOBAL
    posix.system ..."), without PyTorch's paragraph about its changed default; empty when there is none."""
    return next((line.strip().rstrip(".") for line in str(error).splitlines() if "GLOBAL" in line), "")


def first_sentence(error: BaseException, limit: int = 300) -> str:
    """What an error says about the file, in one line cut at a word: for a weights-only refusal the line that
    names the problem ("Unsupported operand 144"), not PyTorch's paragraphs around it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if lines and lines[0].startswith("Weights only load failed"):
        lines = [line for line in lines[1:] if not line.startswith(("Please file an issue", "Check the documentation"))]
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."
