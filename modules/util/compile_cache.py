"""Where torch.compile keeps its compiled kernels between runs: Tandem's cache folder, not the temporary one.

PyTorch's default is a folder under the temporary directory (`/tmp/torchinductor_<user>`), which many
systems empty at every boot, so a compile that took minutes would be paid again after each restart. The
choice has to be made before diffusers is imported: importing it imports `torch._dynamo`, which fixes the
folder for the process (it writes PyTorch's default into TORCHINDUCTOR_CACHE_DIR), and every process it
starts inherits that. Hence every script that may import diffusers before starting training calls this
first (tests/unit/test_compile_cache.py checks them all), and the worker processes inherit Tandem's folder.

    TORCHINDUCTOR_CACHE_DIR=DIR   the user's own folder, always kept
"""
from __future__ import annotations

import os
from pathlib import Path

VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def default_folder() -> Path:
    return Path.home() / ".cache" / "tandem" / "torchinductor"


def keep_compile_cache() -> str:
    """Point PyTorch's compile cache at Tandem's folder unless the user chose one; the folder in use."""
    return os.environ.setdefault(VARIABLE, str(default_folder()))
