"""SD3 and Flux through the real trainer (the built-in tiny models, CPU, gloo): N processes x B == 1 process
x N*B for LoRA and full fine-tunes, exact resume, and every output loads back where other tools load it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modules.util.batch_slice import BatchSlice
from modules.config.train_config import ModelConfig, TrainingConfig
from modules.distributed.launch import launch
from modules.model import load_model
from modules.trainer.callbacks import RecordingCallbacks
from modules.trainer.generic_trainer import GenericTrainer
from tests.test_dit_lora import pipeline_text, prediction
from tests.trainer_helpers import assert_weights_close, demo_config, latest_backup_weights

# Each test trains the tiny models 2-3 times, on 1 and 2 processes: minutes on a shared 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.usefixtures("one_torch_thread")]

STEPS = 3


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def dit_config(workspace: Path, cache: Path, name: str, *overrides: str, method: str):
    """The demo preset on `builtin:demo-<name>` (min-SNR is an SD setting; a short T5 keeps it quick)."""
    return demo_config(workspace, cache, f"model.base_model=builtin:demo-{name}", "training.min_snr_gamma=0",
                       "model.t5_max_length=24", *overrides, method=method)


def run(cfg) -> GenericTrainer:
    callbacks = RecordingCallbacks()
    trainer = GenericTrainer(cfg, callbacks)
    trainer.run()
    trainer.events = callbacks
    return trainer


@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_two_processes_equal_one_with_double_batch_and_outputs_load_back(tmp_path, cache_dir, name, method):
    common = (f"training.max_steps={STEPS}", f"save.backup_every_n_steps={STEPS}", "training.precision=fp32",
              "optimizer.name=sgd", "training.learning_rate=0.05", "training.train_text_encoder=true",
              "save.lora_format=both", "save.full_format=both", "save.output_name=tiny")
    one = run(dit_config(tmp_path / "one", cache_dir, name, *common, "training.batch_size=8", method=method))
    cfg = dit_config(tmp_path / "two", cache_dir, name, *common, "training.batch_size=4", "multi_gpu.enabled=true",
                     "multi_gpu.num_gpus=2", "multi_gpu.launcher=spawn", method=method)
    assert launch(cfg) == 0
    single, double = latest_backup_weights(tmp_path / "one"), latest_backup_weights(tmp_path / "two")
    assert any(k.startswith("transformer.") for k in single)
    assert any(k.startswith("text_encoder_0.") for k in single), "the CLIP encoder did not train"
    assert not any(k.startswith(f"text_encoder_{2 if name == 'sd3' else 1}.") for k in single), "T5 must stay frozen"
    assert_weights_close(double, single, atol=2e-5, rtol=1e-4)

    output = Path(one.events.of_type("done")[-1]["output"])
    if method == "full":
        _full_outputs_hold_the_trained_weights(one, output)
    else:
        _lora_outputs_load_in_diffusers(one, output)


def _full_outputs_hold_the_trained_weights(trainer: GenericTrainer, folder: Path) -> None:
    single_file = folder.with_name(folder.name + ".safetensors")
    trained = trainer.bundle.modules()
    for base in (ModelConfig(base_model=str(folder)),
                 ModelConfig(base_model=str(single_file), components_folder=str(folder))):
        loaded = load_model(base)
        assert loaded.model_type == trainer.bundle.model_type
        for part in ("transformer", "text_encoder"):
            expected, actual = trained[part].state_dict(), loaded.modules()[part].state_dict()
            assert actual.keys() == expected.keys()
            assert all(torch.equal(actual[k], expected[k]) for k in expected), f"{part} of {base.base_model}"


def _lora_outputs_load_in_diffusers(trainer: GenericTrainer, kohya_file: Path) -> None:
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    name = trainer.bundle.model_type
    peft_file = kohya_file.with_name(kohya_file.name.replace(".safetensors", ".peft.safetensors"))
    assert kohya_file.is_file() and peft_file.is_file()
    bundle = trainer.bundle
    for module in bundle.modules().values():
        module.eval()
    expected_text, expected = prediction(bundle, bundle.denoiser)
    cls = {"sd3": StableDiffusion3Pipeline, "flux": FluxPipeline}[name]
    pipeline = cls.from_pretrained(bundle.family.build_demo(), local_files_only=True)
    pipeline.load_lora_weights(str(peft_file))
    text, out = prediction(bundle, pipeline.transformer, pipeline_text(name, pipeline))
    torch.testing.assert_close(text, expected_text, rtol=0, atol=1e-5)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_resume_equals_uninterrupted(tmp_path, cache_dir, name):
    """2 steps, backup, resume to 4 (on 2 processes): the same weights as 4 steps in one go."""
    common = ("training.max_steps=4", "save.backup_every_n_steps=2", "training.precision=fp32",
              "optimizer.name=sgd", "training.learning_rate=0.05", "training.batch_size=8")
    run(dit_config(tmp_path / "ref", cache_dir, name, *common, method="lora"))
    reference = latest_backup_weights(tmp_path / "ref")
    run(dit_config(tmp_path / "run", cache_dir, name, *common, "training.max_steps=2", method="lora"))
    cfg = dit_config(tmp_path / "run", cache_dir, name, *common, "training.batch_size=4", "multi_gpu.enabled=true",
                     "multi_gpu.num_gpus=2", "multi_gpu.launcher=spawn", method="lora")
    assert launch(cfg, resume="latest") == 0
    assert_weights_close(latest_backup_weights(tmp_path / "run"), reference, atol=2e-5, rtol=1e-4)


def test_flux_guidance_reaches_the_transformer(tandem_home):
    """Flux.1-dev's guidance input is training.flux_guidance: another value, another prediction."""
    bundle = load_model(ModelConfig(base_model="builtin:demo-flux", t5_max_length=24))
    latents = torch.randn(1, 16, 8, 8)
    outputs = []
    for guidance in (1.0, 4.0):
        objective = bundle.family.objective(bundle, TrainingConfig(flux_guidance=guidance))
        draw = objective.draw(tuple(latents.shape), 0, 0, 0, BatchSlice(0, latents.shape[0], latents.shape[0]),
                              torch.device("cpu"))
        with torch.no_grad():
            text = bundle.encode_text(["a red circle"])
            outputs.append(objective.predict(bundle.denoiser, objective.noisy(latents, draw), draw.timesteps, text))
    assert not torch.allclose(outputs[0], outputs[1])


def test_samples_run_without_the_text_encoders_once_the_cache_is_filled(tmp_path, cache_dir, monkeypatch, caplog):
    """With the text cached, the sample prompts are encoded with the cache and the samplings (at the start and
    at the end) neither run nor move the text encoders: from then on any use of them fails the run."""
    from modules.trainer.base_trainer import BaseTrainer

    encode = BaseTrainer.encode_sample_texts

    def encode_then_refuse_the_encoders(trainer):
        encode(trainer)
        for encoder in trainer.bundle.text_encoders:
            for name in ("forward", "to"):
                monkeypatch.setattr(encoder, name, lambda *a, **k: pytest.fail("a sampling used a text encoder"))

    monkeypatch.setattr(BaseTrainer, "encode_sample_texts", encode_then_refuse_the_encoders)
    cfg = dit_config(tmp_path / "ws", cache_dir, "flux", "training.max_steps=1", "sampling.sample_at_start=true",
                     "sampling.inference_steps=1", "sampling.every_n_epochs=5", "data.cache_text_embeddings=true",
                     method="lora")
    cfg.sampling.prompts = cfg.sampling.prompts[:2]
    with caplog.at_level("INFO", logger="tandem"):
        trainer = run(cfg)
    samples = trainer.events.of_type("sample")
    assert [s["step"] for s in samples] == [0, 0, 1, 1] and all(Path(s["path"]).is_file() for s in samples)
    assert "Sample prompts: 2 text(s) encoded" in caplog.text
