"""DDP across model families with text-encoder training (2 CPU processes over gloo).

SDXL conditions on the penultimate layer of its first text encoder, so that encoder's last layer gets
no gradient; a naive DDP wrap then fails with "Expected to have finished reduction" (the
diffusers#5354 class of bug). Every family must train its text encoders on 2 ranks and give what 1
rank with the double batch gives.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from modules.distributed.launch import launch
from modules.trainer.generic_trainer import GenericTrainer
from tests.test_model_types_training import write_sources
from tests.trainer_helpers import assert_weights_close, demo_config, latest_backup_weights


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


@pytest.mark.slow
@pytest.mark.parametrize("model_type,method", [("sdxl", "lora"), ("sd2", "lora")])
def test_text_encoder_training_on_two_ranks(tmp_path, cache_dir, model_type, method):
    """SDXL's dead end (its first encoder's last layer and final norm) is frozen by one line for both methods
    (modules/trainer/trainable.py, after the adapters are added or the encoders made trainable): the dead
    end's adapters get no gradient as its weights would, so the LoRA case checks that line as a full one did.
    Fully fine-tuned text encoders under DDP are held to 1 process by tests/test_family_training.py's full cases (every family with a CLIP encoder); SDXL's full
    fine-tune from both sources by tests/test_model_types_training.py (1 process)."""
    folder = write_sources(model_type, tmp_path / "sources")["folder"]
    common = (f"model.base_model={folder}", "training.max_steps=2", "save.backup_every_n_steps=2",
              "training.train_text_encoder=true", "training.precision=fp32", "optimizer.name=sgd",
              "training.learning_rate=0.05", "save.full_format=diffusers")
    GenericTrainer(demo_config(tmp_path / "one", cache_dir, *common, "training.batch_size=4", method=method)).run()
    cfg = demo_config(tmp_path / "two", cache_dir, *common, "training.batch_size=2", "multi_gpu.enabled=true",
                      "multi_gpu.num_gpus=2", "multi_gpu.launcher=spawn", method=method)
    assert launch(cfg) == 0
    one, two = latest_backup_weights(tmp_path / "one"), latest_backup_weights(tmp_path / "two")
    assert any(k.startswith("text_encoder_") for k in one), "the text encoders did not train"
    assert_weights_close(two, one, atol=2e-5, rtol=1e-4)
