"""Qwen-Image and Z-Image through the real trainer (the built-in tiny models, CPU, gloo): the text encoder loaded
apart - before the transformer, sharded over the processes when asked, and not at all when the cache holds
every text. N processes x B == 1 process x N*B (LoRA under FSDP, resumed; full fine-tunes under DDP) and the
outputs loading back are tests/integration/test_family_training.py's, as for every family. The runs train on the demo's first
images (`demo_data_subset`): the whole dataset's latents and texts would be most of each run."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from modules.distributed.launch import launch
from modules.model import text_apart
from modules.trainer.callbacks import RecordingCallbacks
from modules.trainer.generic_trainer import GenericTrainer
from tests.trainer_helpers import demo_config, demo_data_subset

# The tests train the tiny models once or twice, on 1 and 2 processes: minutes on a shared 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.usefixtures("one_torch_thread", "tandem_home")]

COMMON = ("training.precision=fp32", "optimizer.name=sgd", "training.learning_rate=0.05", "training.min_snr_gamma=0")


def config(workspace: Path, cache: Path, name: str, *overrides: str, method: str, items: int = 8):
    """The demo preset on `name`'s built-in model and the first `items` of the demo's data."""
    return demo_config(workspace, cache, f"model.base_model=builtin:demo-{name}", *COMMON,
                       *demo_data_subset(cache.with_name(cache.name + "-data"), "#demo", items), *overrides,
                       method=method)


def run(cfg) -> GenericTrainer:
    callbacks = RecordingCallbacks()
    trainer = GenericTrainer(cfg, callbacks)
    trainer.run()
    trainer.events = callbacks
    return trainer


def test_the_text_encoder_is_loaded_apart_and_not_at_all_with_a_complete_cache(tmp_path, caplog):
    """The first run loads the encoder once (before the transformer, then frees it) and caches every text -
    captions, the dropped caption, sample prompts and their negatives; a second run with that cache never
    constructs the encoder, and still renders its samples."""
    caplog.set_level(logging.INFO, logger="tandem")
    cache = tmp_path / "cache"
    overrides = ("training.max_steps=1", "sampling.every_n_steps=1", "sampling.inference_steps=2",
                 "sampling.guidance_scale=4.0", "data.caption_dropout=0.1", "save.output_name=tiny")
    before = text_apart.LOADS
    first = run(config(tmp_path / "first", cache, "qwen", *overrides, method="lora"))
    assert text_apart.LOADS == before + 1
    assert first.bundle.extra["text_side"].encoder is None, "the encoder is freed after caching"
    report = first.text_apart
    assert report.placement == "cpu" and report.encoded == report.texts
    assert {"a red triangle on a blue background", " ", ""} <= set(report.samples) | {""}
    assert "Text encoder (Qwen2_5_VLForConditionalGeneration, fp32" in caplog.text
    second = run(config(tmp_path / "second", cache, "qwen", *overrides, method="lora"))
    assert text_apart.LOADS == before + 1, "a run with a complete cache loaded the text encoder"
    assert second.text_apart.placement == "not loaded" and second.text_apart.encoded == 0
    assert "Text encoder: not loaded - the text cache holds all" in caplog.text
    assert len(second.events.of_type("sample")) == len(first.events.of_type("sample")) > 0


def test_a_sharded_text_encoder_fills_the_cache_as_one_process_does(tmp_path):
    """model.text_encoder_placement sharded on 2 processes (FSDP2 over gloo; the ranks' shares are uneven - an odd
    number of texts - so one rank runs throw-away forwards until the other is done): the entries one process
    encodes on the CPU."""
    from modules.data import build_dataset
    from modules.data.cache import text_entry
    from modules.model.loading import load_text_side

    overrides = ("training.max_steps=1", "training.batch_size=1", "data.caption_dropout=0.1")
    cfg = config(tmp_path / "two", tmp_path / "cache", "zimage", *overrides, "multi_gpu.enabled=true",
                 "multi_gpu.num_gpus=2", "multi_gpu.launcher=spawn", "model.text_encoder_placement=sharded",
                 method="lora", items=7)  # 7 captions, the dropped one and the sample prompts: 11 texts
    assert launch(cfg) == 0
    light = load_text_side(cfg.model, cfg.training)
    side, fingerprint = light.extra["text_side"], light.fingerprint()
    entries = sorted((tmp_path / "cache" / "text").glob("*.safetensors"))
    dataset = build_dataset(cfg.data, tmp_path / "cache", cfg.general.seed)
    texts = {text_entry(t, fingerprint, tmp_path / "cache").name: t
             for t in dataset.texts_to_cache() + light.family.sample_texts(cfg.sampling)}
    assert sorted(p.name for p in entries) == sorted(texts) and len(entries) > 8 and len(entries) % 2 == 1
    for path in entries[:12]:
        written = load_file(str(path))
        expected = side.encode([texts[path.name]])
        length = int(written[text_apart.MASK].sum())
        torch.testing.assert_close(written[text_apart.HIDDEN][:length], expected[text_apart.HIDDEN][0, :length],
                                   rtol=1e-5, atol=1e-5)
