"""Paired data for edit models: control folders and manifests, what is skipped or refused, control latents cached
over ranks like the targets, items and batches with their controls. Fake encoders: no model is loaded."""
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from modules.config.train_config import ConceptConfig, DataConfig, SamplePromptConfig, TrainConfig
from modules.config.validation import validate
from modules.data import EmptyDatasetError, build_dataset, collate, scan_concepts
from modules.data.concepts import ScanResult
from modules.data.controls import PairingError, split_text
from modules.data.demo_pairs import CONTROL_FOLDER, DEMO_PAIRS_SCHEME, ensure_demo_pairs
from modules.families.registry import FAMILIES


def picture(path: Path, colour, size=(64, 64), caption: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", size, colour)
    img.putpixel((1, 1), (0, 0, 0))  # not mirror-symmetric
    img.save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")


def encode_images(pixels):
    pooled = F.avg_pool2d(pixels, 8)
    return pooled, torch.full_like(pooled, 0.5)  # a distribution: controls must take its mean


def encode_text(captions):
    return {"hidden": torch.tensor([[float(len(c))] for c in captions])}


@pytest.fixture
def pairs(tmp_path):
    """Three targets: two with a control (one a .jpg), one without; a control folder two deep."""
    root = tmp_path / "pairs"
    picture(root / "a.png", (200, 0, 0), caption="make it red")
    picture(root / "sub" / "b.png", (0, 0, 200), caption="make it blue")
    picture(root / "lonely.png", (0, 200, 0), caption="no control")
    picture(root / "control" / "a.jpg", (90, 90, 90))
    picture(root / "control" / "sub" / "b.png", (10, 10, 10))
    return root


def test_a_control_folder_pairs_by_file_name_and_its_images_are_no_targets(pairs, caplog):
    with caplog.at_level(logging.WARNING):
        scan = scan_concepts([ConceptConfig(path=str(pairs), control="control")])
    by_name = {r.path.name: r for r in scan.images}
    assert sorted(by_name) == ["a.png", "b.png"]
    assert [c.path for c in by_name["a.png"].controls] == [pairs / "control" / "a.jpg"]
    assert [c.path for c in by_name["b.png"].controls] == [pairs / "control" / "sub" / "b.png"]
    assert by_name["a.png"].controls[0].width == 64 and len(by_name["a.png"].controls[0].content_hash) == 64
    skipped = [r.getMessage() for r in caplog.records if "without a control image" in r.getMessage()]
    assert len(skipped) == 1 and "lonely.png" in skipped[0]
    # The scan travels to workers as JSON with its controls.
    assert ScanResult.from_dict(json.loads(json.dumps(scan.to_dict()))) == scan


def test_several_control_folders_and_an_unreadable_control_is_named_and_its_pair_skipped(pairs, caplog):
    picture(pairs / "control_2" / "a.png", (1, 2, 3))
    (pairs / "control_2" / "sub").mkdir()
    (pairs / "control_2" / "sub" / "b.png").write_bytes(b"not a picture")
    with caplog.at_level(logging.WARNING):
        scan = scan_concepts([ConceptConfig(path=str(pairs), control="control, control_2")])
    assert [r.path.name for r in scan.images] == ["a.png"]
    assert [c.path.parent.name for c in scan.images[0].controls] == ["control", "control_2"]
    text = caplog.text
    assert "b.png" in text and "unreadable" in text


def test_a_manifest_gives_pairs_captions_and_names_the_bad_line(tmp_path, caplog):
    picture(tmp_path / "after" / "1.png", (200, 0, 0), caption="from the file")
    picture(tmp_path / "after" / "2.png", (0, 200, 0))
    picture(tmp_path / "before" / "1.png", (9, 9, 9))
    picture(tmp_path / "before" / "2.png", (8, 8, 8))
    manifest = tmp_path / "pairs.jsonl"
    manifest.write_text("\n".join(json.dumps(line) for line in (
        {"target": "after/1.png", "control": "before/1.png"},
        {"target": "after/2.png", "control": ["before/2.png"], "caption": "make it green"},
        {"target": "after/3.png", "control": ["before/3.png"]})) + "\n\n")
    with caplog.at_level(logging.WARNING):
        scan = scan_concepts([ConceptConfig(path=str(tmp_path), control="pairs.jsonl")])
    assert [(r.path.name, r.caption) for r in scan.images] == [("1.png", "from the file"), ("2.png", "make it green")]
    assert "3.png" in caplog.text
    manifest.write_text('{"target": "after/1.png"}\n')
    with pytest.raises(PairingError, match=r"pairs.jsonl, line 1: \"control\" is missing"):
        scan_concepts([ConceptConfig(path=str(tmp_path), control="pairs.jsonl")])
    manifest.write_text('{"target": "after/1.png", "control": "before/1.png"}\n{oops\n')
    with pytest.raises(PairingError, match="line 2: not JSON"):
        scan_concepts([ConceptConfig(path=str(tmp_path), control="pairs.jsonl")])


def test_a_concept_without_pairs_and_mixed_or_uneven_pairing_are_refused(pairs, tmp_path):
    picture(tmp_path / "nopairs" / "x.png", (1, 1, 1))
    (tmp_path / "nopairs" / "control").mkdir()
    with pytest.raises(EmptyDatasetError, match="no image paired with a readable control"):
        scan_concepts([ConceptConfig(path=str(tmp_path / "nopairs"), control="control")])
    picture(tmp_path / "plain" / "y.png", (1, 1, 1))
    with pytest.raises(ValueError, match="has no control images .* an edit model trains on pairs only"):
        scan_concepts([ConceptConfig(path=str(pairs), control="control"), ConceptConfig(path=str(tmp_path / "plain"))])
    picture(pairs / "control_2" / "a.png", (1, 2, 3))
    picture(tmp_path / "other" / "a.png", (5, 5, 5))
    picture(tmp_path / "other" / "c1" / "a.png", (5, 5, 5))
    with pytest.raises(ValueError, match="different numbers of control images"):
        scan_concepts([ConceptConfig(path=str(pairs), control="control, control_2"),
                       ConceptConfig(path=str(tmp_path / "other"), control="c1")])


def test_validation_names_a_missing_control_folder_or_manifest(pairs):
    cfg = TrainConfig()
    cfg.model.base_model = "builtin:demo-qwen_edit"
    cfg.data.concepts = [ConceptConfig(path=str(pairs), control="control, before"),
                         ConceptConfig(path=str(pairs), control="pairs.jsonl")]
    problems = validate(cfg)
    assert any(p.startswith("data.concepts[0].control: the control folder") and "before" in p for p in problems)
    assert any(p.startswith("data.concepts[1].control: the manifest 'pairs.jsonl' does not exist") for p in problems)
    cfg.data.concepts = [ConceptConfig(path=str(pairs), control="control")]
    assert not [p for p in validate(cfg) if "control" in p]


def dataset_of(root, tmp_path, **data):
    cfg = DataConfig(concepts=[ConceptConfig(path=str(root), control="control")], resolution=64,
                     num_workers=0, **data)
    return build_dataset(cfg, tmp_path / "cache", seed=3)


def test_control_latents_are_cached_over_ranks_like_the_targets_and_served_as_the_mode(pairs, tmp_path):
    one = dataset_of(pairs, tmp_path / "one")
    one.cache(encode_images, None, "fp", batch_size=1, progress=False)
    two = [dataset_of(pairs, tmp_path / "two") for _ in range(2)]
    for rank, dataset in enumerate(two):
        index = dataset.cache(encode_images, None, "fp", rank=rank, world_size=2, batch_size=1, progress=False)
    assert not index.missing()
    # Two targets and two controls: each rank encodes two of the four.
    assert [d._cache.encoded_images for d in two] == [2, 2] and one._cache.encoded_images == 4
    for dataset in (one, two[0]):
        item = dataset[0]
        assert item["control_latents"].shape == (1, 3, 8, 8)
        # The mode (the mean), not a sample: the same at every use.
        assert torch.equal(item["control_latents"], dataset[(5, 0)]["control_latents"])
    control = Image.open(one.images[0].controls[0].path).convert("RGB")
    expected = F.avg_pool2d(torch.from_numpy(np.array(control)).permute(2, 0, 1)[None].float()
                            / 127.5 - 1, 8)[0]
    assert torch.allclose(one[0]["control_latents"][0], expected, atol=1e-4)
    assert torch.equal(one[0]["control_latents"], two[1][0]["control_latents"])
    batch = collate([one[0], one[1]])
    assert batch["control_latents"].shape == (2, 1, 3, 8, 8)


def test_uncached_controls_take_their_targets_crop_and_flip(tmp_path):
    root = tmp_path / "wide"
    for name in ("a", "b"):
        picture(root / f"{name}.png", (200, 0, 0), size=(96, 64), caption="edit")
        picture(root / "control" / f"{name}.png", (0, 0, 200), size=(96, 64))
        # A marker column at x=70 in both: the pair must keep it in the same place after a random crop.
        for path in (root / f"{name}.png", root / "control" / f"{name}.png"):
            img = Image.open(path).convert("RGB")
            for y in range(64):
                img.putpixel((70, y), (255, 255, 255))
            img.save(path)
    dataset = dataset_of(root, tmp_path, cache_latents=False, random_crop=True, random_flip=True,
                         aspect_bucketing=False)
    for epoch in range(4):
        item = dataset[(epoch, 0)]
        target_column = item["pixels"].mean(dim=(0, 1)).argmax()
        control_column = item["control_pixels"][0].mean(dim=(0, 1)).argmax()
        assert target_column == control_column


def test_a_text_encoder_that_sees_the_controls_gets_them_with_each_caption(pairs, tmp_path):
    dataset = dataset_of(pairs, tmp_path)
    dataset.text_sees_controls = True
    texts = dataset.texts_to_cache()
    assert [split_text(t) for t in texts] == [("make it red", [pairs / "control" / "a.jpg"]),
                                             ("make it blue", [pairs / "control" / "sub" / "b.png"])]
    dataset.cache(encode_images, encode_text, "fp", cache_text=True, progress=False)
    item = dataset[0]
    assert item["text"]["hidden"].item() == len(texts[0])  # the entry of the text with its controls
    assert split_text(item["caption"])[0] == "make it red"


def test_the_built_in_pairs_recolour_the_shape_in_place():
    root = ensure_demo_pairs()
    scan = scan_concepts([ConceptConfig(path=DEMO_PAIRS_SCHEME, control=CONTROL_FOLDER)])
    assert len(scan.images) == 24
    record = scan.images[0]
    target = torch.from_numpy(np.array(Image.open(record.path).convert("RGB"))).int()
    control = torch.from_numpy(np.array(Image.open(record.controls[0].path).convert("RGB"))).int()
    changed = (target - control).abs().sum(-1) > 0
    assert 0 < changed.float().mean() < 0.6  # the shape changed, the background did not
    assert record.caption.startswith("make the ") and root in record.path.parents


def test_an_edit_model_trains_on_pairs_only_and_other_models_on_none(pairs):
    cfg = TrainConfig()
    cfg.data.concepts = [ConceptConfig(path=str(pairs), control="control")]
    assert any(p.startswith("data.concepts[0].control: 'control' names control images, but Stable Diffusion 1.x")
               for p in validate(cfg))
    cfg.model.base_model = "builtin:demo-qwen_edit"
    cfg.data.concepts.append(ConceptConfig(path=str(pairs)))
    cfg.data.caption_dropout = 0.1
    cfg.sampling.prompts = [SamplePromptConfig(prompt="make it red")]
    problems = validate(cfg)
    assert any(p.startswith("data.concepts[1].control: empty, but Qwen-Image-Edit") for p in problems)
    assert any(p.startswith("data.caption_dropout: 0.1, but Qwen-Image-Edit (2509, 2511)'s text encoder reads") for p in problems)
    assert any(p.startswith("sampling.prompts[0].control: empty") for p in problems)


def test_the_memory_plan_counts_the_tokens_each_control_adds():
    from modules.planning.memory_need import Setup, facts, sequence_tokens
    from tests.unit.test_memory_plan import config, model_sizes

    def tokens(*overrides):
        cfg = config("qwen_edit", "lora", *overrides)
        return sequence_tokens(facts(model_sizes(cfg), cfg), cfg, Setup())

    text = 256
    one = tokens('data.concepts=[{"path": "pairs", "control": "control"}]')
    two = tokens('data.concepts=[{"path": "pairs", "control": "control_1, control_2"}]')
    image = (1024 // 16) ** 2
    assert (one, two) == (2 * image + text, 3 * image + text)


def test_the_data_tab_counts_each_concepts_pairs_before_anything_is_read(pairs, tmp_path):
    """ui/pair_count.py: the line under the GUI's concepts."""
    from ui.pair_count import pairs_text

    cfg = TrainConfig()
    cfg.data.concepts = [ConceptConfig(path=str(pairs), name="edits", control="control", recursive=True)]
    assert pairs_text(cfg) == "Pairs - edits: 2 pairs, 1 without a control image (skipped)"
    cfg.data.concepts[0].recursive = False
    assert pairs_text(cfg) == "Pairs - edits: 1 pair, 1 without a control image (skipped)"
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"target": str(pairs / "a.png"), "control": str(pairs / "control" / "a.jpg")})
                                         + "\n" + json.dumps({"target": "gone.png", "control": "x.png"}) + "\n")
    cfg.data.concepts.append(ConceptConfig(path=str(pairs), name="listed", control=str(tmp_path / "pairs.jsonl")))
    assert pairs_text(cfg).endswith("; listed: 1 pair, 1 without a control image (skipped)")
    cfg.data.concepts = [ConceptConfig(path=str(pairs), name="typo", control="controls"),
                         ConceptConfig(path=str(pairs), name="plain")]
    assert pairs_text(cfg) == "Pairs - typo: the control folder or manifest does not exist"
    cfg.data.concepts = [ConceptConfig(path=str(pairs))]
    assert pairs_text(cfg) == ""  # no edit concept: no line


def test_control_images_are_unused_by_models_that_take_none():
    from ui.applicability import unused_fields

    cfg = TrainConfig()
    cfg.data.concepts = [ConceptConfig(path="a", control="control")]
    cfg.sampling.prompts = [SamplePromptConfig(prompt="p", control="c.png")]
    cfg.model.model_type = "flux"
    unused = unused_fields(cfg)
    reason = unused["data.concepts[0].control"]
    assert reason.startswith("used only by edit models (")
    assert all(FAMILIES[name].title in reason for name in ("qwen_edit", "flux_kontext", "flux2"))
    assert "this model is Flux.1" in unused["sampling.prompts[0].control"]
    for edit_model in ("qwen_edit", "flux_kontext", "flux2"):
        cfg.model.model_type = edit_model
        assert not {"data.concepts[0].control", "sampling.prompts[0].control"} & set(unused_fields(cfg))
