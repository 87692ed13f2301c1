"""Flux.1 Kontext (`flux_kontext`) and Flux.2 with reference images (`flux2` on pairs), without a model: which folders
are Kontext, what each accepts of control images, the sequence the memory plan counts, Flux.2's reference position
ids as diffusers makes them, and a sample's control cropped as training crops it. The pipelines themselves:
tests/integration/test_flux_edit.py."""
from __future__ import annotations

import json

import numpy as np
import torch
from PIL import Image

from modules.families.registry import guess_family
from modules.config.train_config import ConceptConfig, SamplePromptConfig, TrainConfig
from modules.config.validation import validate


def test_a_kontext_folder_is_kontext_and_a_flux_folder_stays_flux(tmp_path):
    for pipeline, family in (("FluxKontextPipeline", "flux_kontext"), ("FluxPipeline", "flux")):
        folder = tmp_path / pipeline
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps(
            {"_class_name": pipeline, "transformer": ["diffusers", "FluxTransformer2DModel"]}))
        assert guess_family(str(folder)) == family


def edit_config(model_type: str, *controls: str, prompts: tuple[str, ...] = ("",)) -> TrainConfig:
    cfg = TrainConfig()
    cfg.model.model_type = model_type
    cfg.data.concepts = [ConceptConfig(path=f"concept{i}", control=c) for i, c in enumerate(controls)]
    cfg.sampling.prompts = [SamplePromptConfig(prompt="make it red", control=c) for c in prompts]
    return cfg


def control_problems(cfg: TrainConfig) -> list[str]:
    return [p for p in validate(cfg, check_paths=False) if ".control:" in p]


def test_kontext_takes_one_control_per_image_and_per_sample():
    assert control_problems(edit_config("flux_kontext", "control", prompts=("before.png",))) == []
    problems = control_problems(edit_config("flux_kontext", "control_1, control_2", "", prompts=("a.png, b.png", "")))
    assert problems == [
        "data.concepts[1].control: empty, but Flux.1 Kontext (dev) learns edits from pairs; name the folder of each "
        "image's control image (`control`), or a manifest.",
        "sampling.prompts[1].control: empty, but Flux.1 Kontext (dev) edits an image; give the path of the image the "
        "prompt edits.",
        "data.concepts[0].control: 'control_1, control_2' names 2 control images, but Flux.1 Kontext (dev) takes at "
        "most 1; name at most 1.",
        "sampling.prompts[0].control: 'a.png, b.png' names 2 control images, but Flux.1 Kontext (dev) takes at most "
        "1; name at most 1."]


def test_flux2_trains_on_plain_images_or_on_pairs_with_any_sample_prompts_but_not_both():
    assert control_problems(edit_config("flux2", "", "")) == []
    assert control_problems(edit_config("flux2", "control_1, control_2", prompts=("", "a.png, b.png"))) == []
    cfg = edit_config("flux2", "control", "")
    cfg.data.caption_dropout = 0.1  # its text encoder does not read the references: a dropped caption loses nothing
    assert control_problems(cfg) == [
        "data.concepts[1].control: empty, but data.concepts[0] names control images; Flux.2 (dev, Klein) trains on "
        "pairs or on plain images in one run, not both: name this concept's controls too, or disable it."]
    cfg.data.concepts[1].enabled = False
    assert control_problems(cfg) == []


def test_the_memory_plan_counts_the_tokens_each_control_adds():
    from modules.planning.memory_need import Setup, facts, sequence_tokens
    from tests.unit.test_memory_plan import config, model_sizes

    def tokens(family, *overrides):
        cfg = config(family, "lora", *overrides)
        return sequence_tokens(facts(model_sizes(cfg), cfg), cfg, Setup())

    image, text = (1024 // 16) ** 2, 512
    paired = 'data.concepts=[{"path": "pairs", "control": "control"}]'
    assert tokens("flux_kontext", paired) == 2 * image + text
    assert tokens("flux2") == image + text
    assert tokens("flux2", paired) == 2 * image + text
    assert tokens("flux2", 'data.concepts=[{"path": "pairs", "control": "control_1, control_2"}]') == 3 * image + text


def test_flux2_reference_ids_are_the_pipelines():
    from diffusers import Flux2Pipeline

    from modules.model.families.flux2 import reference_ids

    references = [torch.zeros(2, 128, 3, 4), torch.zeros(2, 128, 2, 5)]  # patchified latents of two sizes
    expected = Flux2Pipeline._prepare_image_ids([r[:1] for r in references])[0]
    ours = reference_ids([torch.zeros(2, 32, 6, 8), torch.zeros(2, 32, 4, 10)], torch.device("cpu"))  # Tandem's
    assert torch.equal(ours, expected) and set(ours[:, 0].tolist()) == {10, 20}


def test_a_samples_control_is_cropped_as_training_crops_it(tmp_path):
    from modules.data.buckets import load_pixels, plan_crop
    from modules.data.controls import control_picture

    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((48, 96, 3)) * 255).astype(np.uint8)).save(tmp_path / "before.png")
    picture = control_picture(tmp_path / "before.png", 64, 32)
    trained = load_pixels(tmp_path / "before.png", plan_crop(96, 48, (64, 32)))
    assert picture.size == (64, 32)
    assert torch.equal(torch.from_numpy(np.array(picture)).permute(2, 0, 1).float() / 127.5 - 1.0, trained)


def test_a_manifest_with_two_controls_per_image_is_refused_for_kontext_before_the_model_loads(tmp_path):
    import pytest

    from modules.preflight import PreflightError, check_data

    lines = []
    for name in ("a", "b"):
        for part in ("after", "before", "style"):
            (tmp_path / part).mkdir(exist_ok=True)
            Image.new("RGB", (64, 64), (200, 0, 0)).save(tmp_path / part / f"{name}.png")
        lines.append(json.dumps({"target": f"after/{name}.png", "control": [f"before/{name}.png", f"style/{name}.png"],
                                 "caption": "make it red"}))
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    cfg = edit_config("flux_kontext", "pairs.jsonl", prompts=())
    cfg.data.concepts[0].path = str(tmp_path)
    cfg.data.resolution, cfg.training.batch_size, cfg.general.workspace_dir = 64, 1, str(tmp_path / "ws")
    assert control_problems(cfg) == []  # validation cannot count a manifest's controls
    with pytest.raises(PreflightError, match=r"each image has 2 control images, but Flux.1 Kontext \(dev\) takes at "
                                             r"most 1; give each image 1 \(in a manifest"):
        check_data(cfg)
    cfg.model.model_type = "flux2"  # any number of references
    assert check_data(cfg).control_count == 2
