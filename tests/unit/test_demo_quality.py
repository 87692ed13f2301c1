"""The demo VAE is a real autoencoder for the demo images, so demo samples can show what was learned."""
import numpy as np
import pytest
import torch
from PIL import Image

from modules.data.demo_dataset import COLOURS, ensure_demo_dataset
from modules.model import demo_vae
from modules.model.demo import _vae

# A 64 px demo image reconstructs to its 8x8-block thumbnail: flat areas come back exactly and only
# blocks that a shape edge crosses are blended. On the demo images that averages about 8/255 per
# channel (the random VAE this replaced was off by ~80/255: noise); 12/255 leaves room for diffusers
# numerics while failing for any VAE that loses the colours.
MAX_MEAN_ABS_ERROR = 12 / 255


@pytest.fixture(scope="module")
def demo_images(tmp_path_factory) -> torch.Tensor:
    root = ensure_demo_dataset(tmp_path_factory.mktemp("shapes") / "demo-shapes")
    arrays = [np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) for path in sorted(root.glob("*.png"))]
    square = [a for a in arrays if a.shape[:2] == (64, 64)]
    return torch.from_numpy(np.stack(square)).permute(0, 3, 1, 2) / 127.5 - 1.0


@pytest.fixture(scope="module")
def vae():
    torch.set_num_threads(1)
    return _vae()


def test_demo_vae_reconstructs_the_demo_images(vae, demo_images):
    with torch.no_grad():
        posterior = vae.encode(demo_images).latent_dist
        decoded = vae.decode(posterior.sample(torch.Generator().manual_seed(0))).sample
    error = (decoded - demo_images).abs().mean().item() / 2  # pixels span 2 in [-1, 1]
    assert error < MAX_MEAN_ABS_ERROR, f"mean abs error {error * 255:.1f}/255"
    # Exactly the 8x8-block thumbnail, up to the posterior noise (std 0.0025, about 0.3/255).
    thumbnail = torch.nn.functional.avg_pool2d(demo_images, 8).repeat_interleave(8, 2).repeat_interleave(8, 3)
    assert (decoded - thumbnail).abs().max().item() < 4 / 255
    assert posterior.std.max().item() < 0.003, "sampled latents should stay close to the mean"


def test_latents_are_colour_thumbnails_with_unit_scale(vae, demo_images):
    with torch.no_grad():
        mean = vae.encode(demo_images).latent_dist.mean
    torch.testing.assert_close(mean[:, :3], torch.nn.functional.avg_pool2d(demo_images, 8), atol=1e-4, rtol=0)
    assert mean[:, 3].abs().max().item() == 0.0
    scaled = mean[:, :3] * vae.config.scaling_factor
    assert 0.8 < scaled.std().item() < 1.25, "scaling_factor should give the colour latents about unit variance"


def test_decoded_palette_colours_are_exact(vae):
    palette = torch.tensor(list(COLOURS.values()), dtype=torch.float32) / 127.5 - 1.0
    latents = torch.zeros(len(palette), 4, 8, 8)
    latents[:, :3] = palette[:, :, None, None]
    with torch.no_grad():
        decoded = vae.decode(latents).sample
    torch.testing.assert_close(decoded.mean((2, 3)), palette, atol=1 / 255, rtol=0)
    assert decoded.std((2, 3)).max().item() < 1 / 255, "a flat latent should decode to a flat image"


def test_large_latents_decode_linearly(vae):
    """The construction relies on GroupNorm's eps dominating; latents far outside [-1, 1] must still hold."""
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1)) * 4
    with torch.no_grad():
        decoded = vae.decode(latents).sample
    torch.testing.assert_close(decoded, latents[:, :3].repeat_interleave(8, 2).repeat_interleave(8, 3),
                               atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_vae_still_reconstructs(demo_images, dtype):
    vae = demo_vae.build_demo_vae().to(dtype)
    with torch.no_grad():
        decoded = vae.decode(vae.encode(demo_images[:4].to(dtype)).latent_dist.mean).sample.float()
    thumbnail = torch.nn.functional.avg_pool2d(demo_images[:4], 8).repeat_interleave(8, 2).repeat_interleave(8, 3)
    assert (decoded - thumbnail).abs().max().item() < 4 / 255
