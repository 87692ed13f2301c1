"""`training.cudnn_benchmark`: auto | on | off, and how older configs' switch is read."""
from __future__ import annotations

import types

import pytest
import torch

from modules.config import config_from_dict, migrate
from modules.trainer.base_trainer import BaseTrainer
from modules.trainer.trainable import trains_convolutions
from modules.trainer.callbacks import RecordingCallbacks
from modules.trainer.generic_trainer import GenericTrainer
from tests.trainer_helpers import demo_config


@pytest.mark.parametrize("old, new", [(True, "auto"), (False, "off")])
def test_a_version_2_switch_is_read_as_auto_or_off(old, new):
    data = migrate({"__version": 2, "training": {"cudnn_benchmark": old, "batch_size": 2}})
    assert data["training"] == {"cudnn_benchmark": new, "batch_size": 2}
    assert config_from_dict({"__version": 2, "training": {"cudnn_benchmark": old}}).training.cudnn_benchmark == new


def test_a_config_without_the_field_gets_the_default():
    assert migrate({"__version": 2, "training": {"epochs": 3}})["training"] == {"epochs": 3}
    assert config_from_dict({"__version": 2}).training.cudnn_benchmark == "auto"


def _prepared(workspace, method, *extra):
    """A demo trainer as far as choosing what trains (what `auto` decides from), without training."""
    trainer = GenericTrainer(demo_config(workspace, workspace / "cache", *extra, method=method), RecordingCallbacks())
    trainer.setup_environment()
    trainer.dataset = trainer.create_dataset()
    trainer.bundle = trainer.create_model()
    trainer.trainable = trainer.prepare_trainable()
    return trainer


@pytest.fixture(scope="module")
def trained(tandem_home, tmp_path_factory):
    root = tmp_path_factory.mktemp("autotune")
    return {"lora": _prepared(root / "lora", "lora"), "full": _prepared(root / "full", "full"),
            "lora_conv": _prepared(root / "lora_conv", "lora", 'training.lora_target_modules=["to_q", "conv1"]')}


def test_only_trained_convolution_weights_count(trained):
    assert not trains_convolutions(trained["lora"].bundle.modules().values())  # LoRA on attention
    assert trains_convolutions(trained["full"].bundle.modules().values())
    assert trains_convolutions(trained["lora_conv"].bundle.modules().values())  # LoRA's own convolutions train


@pytest.mark.parametrize("setting, run, expected", [
    ("auto", "lora", False), ("auto", "full", True), ("auto", "lora_conv", True),
    ("on", "lora", "unchanged"), ("off", "full", "unchanged")])
def test_auto_decides_on_cuda_and_leaves_explicit_settings(trained, monkeypatch, setting, run, expected):
    fake = types.SimpleNamespace(device=torch.device("cuda"), bundle=trained[run].bundle,
                                 cfg=types.SimpleNamespace(training=types.SimpleNamespace(cudnn_benchmark=setting)))
    for left_by_set_up in (True, False):
        monkeypatch.setattr(torch.backends.cudnn, "benchmark", left_by_set_up)
        BaseTrainer.decide_cudnn_autotuning(fake)
        assert torch.backends.cudnn.benchmark == (left_by_set_up if expected == "unchanged" else expected)


def test_nothing_is_decided_on_cpu(trained, monkeypatch):
    for left_by_set_up in (True, False):
        monkeypatch.setattr(torch.backends.cudnn, "benchmark", left_by_set_up)
        BaseTrainer.decide_cudnn_autotuning(trained["full"] if left_by_set_up else trained["lora"])  # real trainers, CPU
        assert torch.backends.cudnn.benchmark is left_by_set_up
