"""The Qwen-Image and Wan demos' VAE: a tiny `AutoencoderKLQwenImage` (or `AutoencoderKLWan`, the same network)
set by hand to the demo's thumbnail codec.

Like `demo_vae.py` (the AutoencoderKL codec of the other demos, whose docstring says why by hand): a 64 px
image encodes to its 8x8 thumbnail (latent channels 0-2 = the average R, G, B of each 8x8 block, the other
13 channels 0) and decodes back to that thumbnail drawn in 8x8 px blocks, so samples of the demo model
show what its transformer learned. Qwen-Image's VAE is Wan's causal 3-D one, which needs its own set-up:

- Every residual branch and the mid-block attention end in a zeroed layer, so each block passes its input
  through (a 1x1x1 shortcut convolution, where the width changes, copies the channels in use); the
  stride-2 downsamplers take 2x2 averages, the upsamplers copy after their nearest-neighbour step. An image
  is one frame, and the causal convolutions see it as the last of three (two zero frames before it): only
  their last time tap is used. The temporal convolutions run on later frames only, never for an image.
- The only non-linear steps are `RMS norm -> SiLU` before each `conv_out`. RMS norm divides each pixel's
  channel vector by its length; so the signal travels next to a constant channel of value 1 and is scaled
  to 1e-3 of it: the length is 1 up to 1e-6 and the norm becomes a fixed gain. Each colour travels as a
  pair (+x, -x), and SiLU(a) - SiLU(-a) = a exactly, which `conv_out` takes and scales back.
- The posterior log-variance is a constant -12, as in the AutoencoderKL codec.

`latents_mean` / `latents_std` (per channel, as the real model's) centre the colour channels on the demo
palette and scale them to about unit spread; the other channels keep mean 0 and std 1.
"""
from __future__ import annotations

import torch

from .demo_vae import COLOUR_CHANNELS, set_by_hand, set_quant_convs

VAE_CONFIG = {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1, "attn_scales": [],
              "temperal_downsample": [False, True, True]}
"""Three 2x downsamplings (8x, like the real VAE) at tiny widths: 8, 16, 32 channels."""

SIGNAL_SCALE = 1e-3
"""Size of the colour signal next to the constant channel (of value 1) inside the network."""
CONSTANT = 2 * COLOUR_CHANNELS
"""The channel that carries 1 everywhere (channels 0-5 carry the colour pairs)."""
_LAST = 2
"""The time tap of a causal 3x3x3 convolution that sees the current frame."""


def build_demo_qwen_vae(latents_mean: list[float], latents_std: list[float]):
    """The thumbnail-codec `AutoencoderKLQwenImage` described above, in eval mode, with no gradients."""
    from diffusers import AutoencoderKLQwenImage

    vae = AutoencoderKLQwenImage(**VAE_CONFIG, latents_mean=latents_mean, latents_std=latents_std)
    return set_by_hand(vae, (torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Linear), _set_encoder, _set_decoder)


def build_demo_wan_vae(latents_mean: list[float], latents_std: list[float]):
    """The same codec as an `AutoencoderKLWan` (the Wan demo's), for clips too: its temporal convolutions,
    which Qwen-Image's images never reach, pass the newest frame through, so every latent frame is the
    thumbnail of one video frame (frames 0, 4, 8, ...: the VAE keeps one frame in four)."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(**VAE_CONFIG, latents_mean=latents_mean, latents_std=latents_std)
    return set_by_hand(vae, (torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Linear), _set_encoder, _set_decoder,
                       _pass_frames)


def _pass_frames(vae) -> None:
    """Each temporal resampler's causal convolution takes the newest frame it sees (its last tap); the
    upsamplers' doubled output channels both copy it."""
    for module in vae.modules():
        conv = getattr(module, "time_conv", None)
        if conv is None:
            continue
        width = conv.in_channels
        for channel in range(CONSTANT + 1):
            conv.weight[channel, channel, _LAST, 0, 0] = 1.0
            if conv.out_channels == 2 * width:
                conv.weight[width + channel, channel, _LAST, 0, 0] = 1.0


def _set_encoder(vae) -> None:
    encoder = vae.encoder
    _split_into_pairs(encoder.conv_in, COLOUR_CHANNELS)
    _pass_through(encoder.down_blocks)
    _pass_through([encoder.mid_block])
    _join_pairs(encoder.conv_out, encoder.conv_out.in_channels)
    set_quant_convs(vae, vae.config.z_dim)


def _set_decoder(vae) -> None:
    decoder = vae.decoder
    _split_into_pairs(decoder.conv_in, COLOUR_CHANNELS)
    _pass_through([decoder.mid_block])
    _pass_through(decoder.up_blocks)
    _join_pairs(decoder.conv_out, decoder.conv_out.in_channels)


def _pass_through(blocks) -> None:
    """Residual blocks copy the channels in use through their shortcut; resamplers average or copy them."""
    from diffusers.models.autoencoders import autoencoder_kl_qwenimage as qwen, autoencoder_kl_wan as wan

    residual = (qwen.QwenImageResidualBlock, wan.WanResidualBlock)
    causal = (qwen.QwenImageCausalConv3d, wan.WanCausalConv3d)
    resample = (qwen.QwenImageResample, wan.WanResample)
    for block in blocks:
        for module in block.modules():
            if isinstance(module, residual) and isinstance(module.conv_shortcut, causal):
                for channel in range(CONSTANT + 1):
                    module.conv_shortcut.weight[channel, channel] = 1.0
            if isinstance(module, resample) and module.mode != "none":
                conv = module.resample[1]
                for channel in range(CONSTANT + 1):
                    if module.mode.startswith("down"):
                        # After the (0, 1, 0, 1) zero padding, output (i, j) sees rows/cols 2i..2i+2: the
                        # top-left 2x2 taps make each stride-2 step an exact 2x2 average.
                        conv.weight[channel, channel, :2, :2] = 0.25
                    else:
                        conv.weight[channel, channel, 1, 1] = 1.0


def _split_into_pairs(conv, colours: int) -> None:
    """Colour c becomes channels (2c, 2c+1) = (+x, -x) * SIGNAL_SCALE, beside the constant channel."""
    for colour in range(colours):
        conv.weight[2 * colour, colour, _LAST, 1, 1] = SIGNAL_SCALE
        conv.weight[2 * colour + 1, colour, _LAST, 1, 1] = -SIGNAL_SCALE
    conv.bias[CONSTANT] = 1.0


def _join_pairs(conv, width: int) -> None:
    """Undo the split after the RMS norm (gain sqrt(width): the vector's length is 1) and SiLU."""
    gain = SIGNAL_SCALE * width ** 0.5
    for colour in range(COLOUR_CHANNELS):
        conv.weight[colour, 2 * colour, _LAST, 1, 1] = 1.0 / gain
        conv.weight[colour, 2 * colour + 1, _LAST, 1, 1] = -1.0 / gain
