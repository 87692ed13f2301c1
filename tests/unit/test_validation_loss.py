"""The validation loss: a held-out set scored with fixed noise, timesteps and VAE samples per image, reported
as an event and to TensorBoard; the same numbers on 1 and N processes (tests/integration/test_distributed.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from modules.config.train_config import ConceptConfig
from modules.data import scan_concepts
from modules.trainer.callbacks import RecordingCallbacks
from modules.trainer.validation_loss import evaluation_batches
from tests.unit.test_data import write_image


def test_a_fraction_is_held_out_by_content_whatever_the_order(tmp_path):
    for i in range(10):
        write_image(tmp_path / "a" / f"{i:02d}.png", colour=(20 * i, 10, 10), caption=f"image {i}")
        write_image(tmp_path / "b" / f"{9 - i:02d}.png", colour=(20 * i, 10, 10), caption=f"image {i}")
    held_a = scan_concepts([ConceptConfig(path=str(tmp_path / "a"))], validation_fraction=0.2)
    held_b = scan_concepts([ConceptConfig(path=str(tmp_path / "b"))], validation_fraction=0.2)
    assert len(held_a.validation) == 2 and len(held_a.images) == 8
    assert {im.content_hash for im in held_a.validation} == {im.content_hash for im in held_b.validation}
    assert not {im.content_hash for im in held_a.validation} & {im.content_hash for im in held_a.images}
    assert len(held_a.item_images) == 8, "held-out images are never trained"


def test_a_validation_concept_is_held_out_whole(tmp_path):
    for i in range(3):
        write_image(tmp_path / "train" / f"{i}.png", caption="t")
        write_image(tmp_path / "val" / f"{i}.png", colour=(1, 2, 3 + i), caption="v")
    scan = scan_concepts([ConceptConfig(path=str(tmp_path / "train")),
                          ConceptConfig(path=str(tmp_path / "val"), role="validation", repeats=4)])
    assert [im.role for im in scan.images] == ["train"] * 3 and len(scan.item_images) == 3
    assert [im.role for im in scan.validation] == ["validation"] * 3


def test_evaluation_batches_depend_on_the_data_only():
    assert evaluation_batches([0, 1, 0, 0, 1, 0], 2) == [[0, 2], [3, 5], [1, 4]]


def validation_folder(tmp_path: Path, count: int = 5) -> Path:
    from modules.data.demo_dataset import ensure_demo_dataset
    folder = tmp_path / "held-out"
    folder.mkdir()
    for path in sorted(ensure_demo_dataset().glob("*.png"))[-count:]:
        shutil.copy(path, folder / path.name)
        shutil.copy(path.with_suffix(".txt"), folder / f"{path.stem}.txt")
    return folder


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("model", ["builtin:demo", "builtin:demo-sd3", "builtin:demo-flux"])
def test_validation_loss_at_start_on_cadence_and_at_the_end_for_every_family(tmp_path, tandem_home, model):
    from tests.trainer_helpers import demo_config, train
    cfg = demo_config(tmp_path / "run", tmp_path / "cache", f"model.base_model={model}", "training.min_snr_gamma=0",
                      "model.t5_max_length=24", "training.batch_size=4", "training.max_steps=3",
                      "training.validation_every_n_steps=2", "training.lora_dropout=0.5", "general.tensorboard=true")
    cfg.data.concepts.append(ConceptConfig(path=str(validation_folder(tmp_path)), role="validation"))
    callbacks = RecordingCallbacks()
    trainer = train(cfg, callbacks)
    events = callbacks.of_type("validation")
    assert [e["step"] for e in events] == [0, 2, 3], "at the start, every 2 steps and at the end"
    assert all(e["images"] == 5 and e["loss"] > 0 for e in events)
    assert len(trainer.dataset) == 64, "validation images are not trained"
    # Fixed noise, timesteps and VAE samples (and no LoRA dropout): the same weights score the same, bitwise.
    again = trainer.validation.evaluate(trainer.parallel.unwrap(trainer.model), trainer.global_step)
    assert again == events[-1]["loss"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    logs = EventAccumulator(str(trainer.paths.tensorboard / trainer.run_id)).Reload()  # each run its own folder
    assert [(s.step, s.value) for s in logs.Scalars("validation_loss")] == \
        [(e["step"], pytest.approx(e["loss"], rel=1e-6)) for e in events]
