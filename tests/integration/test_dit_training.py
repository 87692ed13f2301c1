"""SD3 and Flux through the real trainer (the built-in tiny models, CPU): Flux.1-dev's guidance input, and samples
rendered from cached text without the text encoders. What every family does alike - N processes x B == 1 x N*B
for LoRA (FSDP, resumed) and full fine-tunes (DDP, the CLIP encoders training), outputs loading back in Tandem
and diffusers - is tests/integration/test_family_training.py's, parametrised over the registry."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modules.util.batch_slice import BatchSlice
from modules.config.train_config import ModelConfig, TrainingConfig
from modules.model import load_model
from modules.trainer.callbacks import RecordingCallbacks
from modules.trainer.generic_trainer import GenericTrainer
from tests.trainer_helpers import demo_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.usefixtures("one_torch_thread")]

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
