"""Shared test set-up: hermetic demo files, no network, a shared latent cache for trainer tests."""
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tandem_home(tmp_path_factory) -> Path:
    """Demo model and dataset built once per test session, outside the repository."""
    home = tmp_path_factory.mktemp("tandem_home")
    os.environ["TANDEM_HOME"] = str(home)
    return home


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for the module's tests: tiny models run far faster that way on 2 busy cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
