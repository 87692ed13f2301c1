"""The Qwen-Image 2.1 demo's VAE: a tiny `AutoencoderKLQwenImage21` set by hand to a thumbnail codec.

Like `demo_qwen_vae.py` (Qwen-Image's and Wan's codec, whose docstring says why by hand), but for 2.1's VAE: it
shrinks each side 16x (64 latent channels), reads RGBA and writes RGBA, and - as Wan 2.2's - carries a fixed
shortcut around every resampling stage. A 64 px image encodes to its 4x4 thumbnail - the average R, G, B of each
16x16 block, in latent channels 3j, 3j + 1, 3j + 2 for each of 21 copies j (the 64th channel 0; the alpha channel is
not read) - and decodes back to that thumbnail (the copies' mean) drawn in 16x16 px blocks, fully opaque. The copies
spread the picture over the latent channels as a real VAE's latents are spread: with one copy, 61 of 64 channels
would be constant and the colours a twentieth of the loss, which the tiny transformer then hardly learns.

- All its convolutions are 2-D (the class folds the single frame away). Every one is zeroed but `conv_in`,
  `conv_out`, the quant convolutions and one 1x1 shortcut of the decoder's last block, so the residual blocks and
  the mid-block attention pass their input through, and the resampling stages' main paths give 0: the signal
  travels through the parameter-free shortcuts alone.
- The encoder's shortcuts (`QwenImage21AvgDown3D`) are exact 2x2 averages that move channel c to channel 2c + 1
  where the stage also halves time (the one frame comes after a zero frame it pads in front; the even channel
  averages that zero frame), and keep it at c where it does not: so the signal sits at 8c + 7 after the four stages.
- The decoder's shortcuts (`QwenImage21DupUp3D`) are nearest-neighbour doublings that keep channel c where the
  width stays, take channel 2c + 1 where it halves with time, and draw the top row of each pair from channel 2c
  and the bottom row from 2c + 1 where it halves without: so `conv_in` writes each signal twice, to 4c + 1 and
  4c + 3.
- The only non-linear steps are `RMS norm -> SiLU` before each `conv_out`, made a fixed gain as in
  `demo_qwen_vae.py`: colours travel as (+x, -x) pairs at 1e-3 beside a constant channel of 1.
"""
from __future__ import annotations

import torch

from .demo_qwen_vae import CONSTANT, SIGNAL_SCALE
from .demo_vae import COLOUR_CHANNELS, set_by_hand, set_quant_convs

VAE_CONFIG = {"base_dim": 8, "decoder_base_dim": 8, "z_dim": 64, "dim_mult": [1, 2, 4, 8, 8], "num_res_blocks": 1,
              "attn_scales": [], "temperal_downsample": [False, True, True, True], "is_residual": True,
              "in_channels": 4, "out_channels": 4}
"""The real VAE's stages (four 2x downsamplings, the first without time; 64 latent channels; RGBA in and out) at
tiny widths: 8 to 64 channels."""
ALPHA = 3
"""The output channel of the alpha plane, decoded as 1 (opaque)."""
COPIES = VAE_CONFIG["z_dim"] // COLOUR_CHANNELS
"""Copies of the thumbnail in the latent channels (21)."""
_CENTRE = 1
"""The centre tap of a 3x3 convolution."""


def build_demo_qwen21_vae(latents_mean: list[float], latents_std: list[float]):
    """The thumbnail-codec `AutoencoderKLQwenImage21` described above, in eval mode, with no gradients."""
    from diffusers import AutoencoderKLQwenImage21

    vae = AutoencoderKLQwenImage21(**VAE_CONFIG, latents_mean=latents_mean, latents_std=latents_std)
    return set_by_hand(vae, (torch.nn.Conv2d, torch.nn.Linear), _set_encoder, _set_decoder)


def _set_encoder(vae) -> None:
    encoder = vae.encoder
    for colour in range(COLOUR_CHANNELS):
        encoder.conv_in.weight[2 * colour, colour, _CENTRE, _CENTRE] = SIGNAL_SCALE
        encoder.conv_in.weight[2 * colour + 1, colour, _CENTRE, _CENTRE] = -SIGNAL_SCALE
    encoder.conv_in.bias[CONSTANT] = 1.0
    # Each stage that halves time moves channel c to 2c + 1 (see the module docstring); the last stage keeps it.
    moves = sum(1 for halves_time in vae.config.temperal_downsample if halves_time)
    gain = SIGNAL_SCALE * encoder.conv_out.in_channels ** 0.5
    for colour in range(COLOUR_CHANNELS):
        plus, minus = (_moved(channel, moves) for channel in (2 * colour, 2 * colour + 1))
        for copy in range(COPIES):
            encoder.conv_out.weight[COLOUR_CHANNELS * copy + colour, plus, _CENTRE, _CENTRE] = 1.0 / gain
            encoder.conv_out.weight[COLOUR_CHANNELS * copy + colour, minus, _CENTRE, _CENTRE] = -1.0 / gain
    set_quant_convs(vae, vae.config.z_dim)


def _moved(channel: int, moves: int) -> int:
    for _ in range(moves):
        channel = 2 * channel + 1
    return channel


def _set_decoder(vae) -> None:
    decoder = vae.decoder
    for signal in range(CONSTANT + 1):
        for target in (4 * signal + 1, 4 * signal + 3):  # read back as one row each by the last resampling stage
            if signal == CONSTANT:
                decoder.conv_in.bias[target] = 1.0
            else:  # the mean of the colour's copies
                sign = 1.0 if signal % 2 == 0 else -1.0
                for copy in range(COPIES):
                    latent = COLOUR_CHANNELS * copy + signal // 2
                    decoder.conv_in.weight[target, latent, _CENTRE, _CENTRE] = sign * SIGNAL_SCALE / COPIES
        # The last block (no resampling) changes the width through its first residual block's 1x1 shortcut.
        decoder.up_blocks[-1].resnets[0].conv_shortcut.weight[signal, signal] = 1.0
    gain = SIGNAL_SCALE * decoder.conv_out.in_channels ** 0.5
    for colour in range(COLOUR_CHANNELS):
        decoder.conv_out.weight[colour, 2 * colour, _CENTRE, _CENTRE] = 1.0 / gain
        decoder.conv_out.weight[colour, 2 * colour + 1, _CENTRE, _CENTRE] = -1.0 / gain
    decoder.conv_out.bias[ALPHA] = 1.0
