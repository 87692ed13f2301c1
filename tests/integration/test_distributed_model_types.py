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
from tests.integration.test_model_types_training import write_sources
from tests.trainer_helpers import assert_weights_close, demo_config, latest_backup_weights


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


@pytest.mark.slow
@pytest.mark.parametrize("model_type,method", [("sdxl", "lora")])
def test_text_encoder_training_on_two_ranks(tmp_path, cache_dir, model_type, method):
    """SDXL's dead end (its first encoder's last layer and final norm) is frozen by one line for both methods
    (modules/trainer/trainable.py, after the adapters are added or the encoders made trainable): the dead
    end's adapters get no gradient as its weights would, so the LoRA case checks that line as a full one did.
    Fully fine-tuned text encoders under DDP are held to 1 process by tests/integration/test_family_training.py's full cases (every family with a CLIP encoder); SDXL's full
    fine-tune from both sources by tests/integration/test_model_types_training.py (1 process). SD2 takes the same DDP path;
    what could stop it under DDP - a trained parameter no gradient reaches - is
    test_every_trained_parameter_reaches_the_loss's (1 process, no launch)."""
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


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["sd2"])
def test_every_trained_parameter_reaches_the_loss(tmp_path, tandem_home, model_type):
    """With text-encoder LoRA, one step's backward gives every parameter that trains a gradient: DDP waits for
    the gradients of every trained parameter and stops the run where one never comes ("Expected to have
    finished reduction"). What test_text_encoder_training_on_two_ranks shows for SDXL on 2 ranks, here for SD2
    without a launch (its DDP path is SDXL's)."""
    import torch

    from modules.config.train_config import ModelConfig, TrainingConfig
    from modules.model import load_model
    from modules.trainer.parallelism import SingleProcess
    from modules.trainer.trainable import prepare_trainable
    from modules.util.batch_slice import BatchSlice

    folder = write_sources(model_type, tmp_path / "sources")["folder"]
    bundle = load_model(ModelConfig(base_model=str(folder)))
    training = TrainingConfig(method="lora", train_text_encoder=True)
    params = prepare_trainable(bundle, training, SingleProcess(), torch.device("cpu"))
    objective = bundle.family.objective(bundle, training)
    with torch.no_grad():
        latents = bundle.encode_images(torch.rand(2, 3, 64, 64) * 2 - 1)
    text = bundle.encode_text(["a red circle on a blue background", "a white triangle"])
    draw = objective.draw(tuple(latents.shape), 1, 0, 0, BatchSlice(0, 2, 2), torch.device("cpu"))
    sizes = [(64, 64)] * 2  # SDXL's size conditioning; SD2 has none
    out = objective.predict(bundle.denoiser, objective.noisy(latents, draw), draw.timesteps, text, sizes,
                            [(0, 0)] * 2, sizes)
    objective.loss(out, objective.target(latents, draw), draw).backward()
    names = {id(p): f"{part}.{n}" for part, module in bundle.modules().items() for n, p in module.named_parameters()}
    trained = [p for p in params if p.requires_grad]
    text_encoder_ids = {id(p) for encoder in bundle.text_encoders for p in encoder.parameters()}
    assert any(id(p) in text_encoder_ids for p in trained), "the text encoders' adapters do not train"
    unused = [names[id(p)] for p in trained if p.grad is None]
    assert not unused, f"{model_type}: these train but no gradient reaches them: {unused}"
