"""The streamed writer of final models (`modules/model/streamed_save.py`): a file written piece by piece
reads back as the whole state written at once would, and no piece it gathers and converts is larger
than one of the family's blocks (or one module's own tensors outside them)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from modules.model.single_file import single_file_parts, unet_to_ldm, vae_to_ldm
from modules.model.streamed_save import LOCAL, FilePart, TensorSource, plan, stream_file
from tests.unit.test_single_file import tiny_bundle


def test_streamed_file_equals_the_whole_conversion_and_gathers_one_block_at_a_time(tmp_path):
    bundle, _ = tiny_bundle("sd1")
    parts, metadata = single_file_parts(bundle)
    gathered: dict[int, list[int]] = {}
    whole_calls = []

    def counting(index: int, part: FilePart) -> FilePart:
        def convert(piece):
            gathered.setdefault(index, []).append(sum(v.numel() for v in piece.values()))
            return part.convert(piece)
        return FilePart(part.module, part.state, convert, part.blocks)

    source = TensorSource(whole=lambda t: whole_calls.append(t.shape) or t, writes=True)
    path = stream_file(tmp_path / "model.safetensors", [counting(i, p) for i, p in enumerate(parts)], torch.float16, metadata, source)

    written = load_file(path)
    expected = {**unet_to_ldm(bundle.unet.state_dict(), bundle.unet.config),
                **vae_to_ldm(bundle.vae.state_dict(), bundle.vae.config)}
    for key, value in expected.items():
        assert written[key].dtype == torch.float16 and torch.equal(written[key], value.half()), key
    assert len(written) == len(plan(parts, torch.float16)) > len(expected)  # the text encoder too
    with safe_open(path, "pt") as f:
        assert f.metadata() == metadata
    assert len(whole_calls) == sum(len(p.state()) for p in parts)  # every tensor read once

    # The largest piece is one UNet block (or a text encoder layer), never a whole model.
    unet_blocks = parts[0].blocks
    largest_block = max(sum(p.numel() for p in b.parameters()) for b in unet_blocks)
    largest_module = max(sum(p.numel() for p in m.parameters(recurse=False))
                         for part in parts for m in part.module.modules())
    assert unet_blocks and max(max(sizes) for sizes in gathered.values()) <= max(largest_block, largest_module)
    assert max(gathered[0]) < sum(p.numel() for p in bundle.unet.parameters()) / 4


def test_a_rank_that_does_not_write_gathers_the_same_tensors_and_touches_no_file(tmp_path):
    bundle, _ = tiny_bundle("sd1")
    parts, metadata = single_file_parts(bundle)
    order = {True: [], False: []}
    for writes in (True, False):
        source = TensorSource(whole=lambda t, w=writes: order[w].append(tuple(t.shape)) or t, writes=writes)
        stream_file(tmp_path / f"{writes}.safetensors", parts, torch.float32, metadata, source)
    assert order[True] == order[False]  # a collective gather needs the same order on every rank
    assert sorted(p.name for p in tmp_path.iterdir()) == ["True.safetensors"]


def test_a_failed_write_still_gathers_everything_then_raises(tmp_path):
    bundle, _ = tiny_bundle("sd1")
    parts, metadata = single_file_parts(bundle)
    calls = []

    def failing(piece):
        if any(not v.is_meta for v in piece.values()):  # the header plan (meta tensors) works; the write fails
            raise OSError("disk full")
        return parts[0].convert(piece)

    broken = [FilePart(parts[0].module, parts[0].state, failing, parts[0].blocks), *parts[1:]]
    source = TensorSource(whole=lambda t: calls.append(1) or t, writes=True)
    try:
        stream_file(tmp_path / "m.safetensors", broken, torch.float32, metadata, source)
    except OSError as e:
        assert "disk full" in str(e)
    else:
        raise AssertionError("the failed write was not raised")
    assert len(calls) == sum(len(p.state()) for p in parts)  # the other ranks are never left waiting
    assert not list(tmp_path.iterdir())  # no partial file
