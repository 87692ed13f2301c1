"""Frozen parts that wait in host memory after the cache go back onto the host tensors they were loaded
from (modules/model/host_copies.py). Copies of every tensor stand in for the GPU's (no GPU here): after
`move_to_host` the module holds the very tensors it was loaded with again."""
from __future__ import annotations

import pytest
import torch

from modules.config.train_config import ModelConfig
from modules.model import load_model
from modules.model.host_copies import KEY, keep_host_copies, move_to_host

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture()
def bundle(tandem_home):
    return load_model(ModelConfig(base_model="builtin:demo"))


def _elsewhere(module) -> None:
    """Every parameter and buffer replaced by a copy, as `module.to(gpu)` would."""
    for p in module.parameters():
        p.data = p.data.clone()
    for owner in module.modules():
        for leaf, b in owner._buffers.items():
            if b is not None:
                owner._buffers[leaf] = b.clone()


def _pointers(module) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in [*module.named_parameters(), *module.named_buffers()]}


def test_the_text_encoder_and_the_vae_go_back_onto_their_host_tensors(bundle):
    encoder, vae = bundle.text_encoders[0], bundle.vae
    ids = bundle.tokenize(["a red circle"])[0]
    pixels = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        text, latents = encoder(ids)[0], vae.encode(pixels).latent_dist.mean
    pointers = {"text": _pointers(encoder), "vae": _pointers(vae)}
    keep_host_copies(bundle, {"vae", "text_encoders"})
    for module in (encoder, vae):
        _elsewhere(module)  # "on the GPU": the loaded host tensors are held by the kept copies only
        moved = _pointers(module)
        assert all(moved[name] != at for name, at in pointers["text" if module is encoder else "vae"].items())
        assert move_to_host(bundle, module) is True
    assert _pointers(encoder) == pointers["text"] and _pointers(vae) == pointers["vae"]  # no copy was made
    with torch.no_grad():
        assert torch.equal(encoder(ids)[0], text)
        assert torch.equal(vae.encode(pixels).latent_dist.mean, latents)


def test_only_the_parts_asked_for_are_kept(bundle):
    keep_host_copies(bundle, {"vae"})
    assert list(bundle.extra[KEY]) == ["vae"]
    assert move_to_host(bundle, bundle.text_encoders[0]) is False  # copied (here: already on the CPU)


@pytest.mark.parametrize("change", ["trained", "reshaped", "cast"])
def test_a_module_that_no_longer_matches_its_copy_is_copied(bundle, change):
    encoder = bundle.text_encoders[0]
    keep_host_copies(bundle, {"text_encoders"})
    weight = encoder.get_input_embeddings().weight
    if change == "trained":
        weight.requires_grad_(True)
    elif change == "reshaped":
        weight.data = weight.data[:-1]
    else:
        encoder.to(torch.float64)
    before = weight.data
    assert move_to_host(bundle, encoder) is False
    assert weight.data is before or weight.data.data_ptr() == before.data_ptr()  # left as it was: on the CPU


def test_the_loader_keeps_host_copies_for_a_gpu_only(tandem_home):
    cpu = load_model(ModelConfig(base_model="builtin:demo"), "cpu", keep_on_host=frozenset({"vae", "text_encoders"}))
    assert KEY not in cpu.extra  # on the CPU there is nothing to go back onto
