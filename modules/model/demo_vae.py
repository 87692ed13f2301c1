"""The demo model's VAE: a tiny `AutoencoderKL` whose weights are set by hand to a thumbnail codec.

Why: the demo exists so that a person can watch training work. With random VAE weights every
decoded sample is coloured noise whatever the UNet learns. This VAE encodes a 64 px image into its
8x8 thumbnail (the average colour of each 8x8 block, as latent channels 0-2 = R, G, B; channel 3 is
unused and always 0) and decodes a latent back into that thumbnail drawn with 8x8 px blocks. The
flat-coloured demo shapes therefore come back with their exact colours and blocky edges, and the
latents the UNet learns are small pictures, so samples show the prompted colours early on and the
shapes as the UNet improves.

Why by hand and not trained: training even this 81k-parameter autoencoder to good reconstructions
takes tens of minutes of CPU (its GroupNorms remove each image's absolute colour level, which the
network can only win back slowly), and a committed weights file would need its own generator and
checks. The construction below is exact, instant, and byte-identical on every build:

- Every residual branch (ResNet blocks, the mid-block attention) ends in a zeroed layer, so each
  block passes its input through unchanged; all other convolutions are set to plain linear maps:
  2x2 averaging in the stride-2 downsamplers, the identity after each nearest-neighbour upsampling.
- The only non-residual non-linear step is `GroupNorm -> SiLU` before each `conv_out`. Two facts make
  it linear. Each colour travels as a pair of channels (+x, -x) in one norm group, so the group mean
  is exactly 0. And the signal is scaled to ~1e-5, so the group variance (<= 1e-10) is negligible
  next to the norm's eps (1e-6): the norm becomes a fixed gain of 1/sqrt(eps). Then
  SiLU(a) - SiLU(-a) = a exactly, which `conv_out` takes and scales back up.
- The posterior log-variance is a constant -12 (std 0.0025, like real VAEs), so sampled latents stay
  close to the mean.

Decoder groups must hold two channels for the pairs, so the channels are (16, 16, 16, 16) with 8
norm groups (with 8 channels at full resolution, each group would be one channel and the norm would
subtract each image's mean colour).
"""
from __future__ import annotations

import torch

VAE_CONFIG = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "layers_per_block": 1, "norm_num_groups": 8,
    "block_out_channels": (16, 16, 16, 16), "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4, "sample_size": 64,
}
"""4 levels (8x downsampling, like SD), 4 latent channels: a 64 px image gives an 8x8x4 latent."""

COLOUR_CHANNELS = 3
"""Latent channels 0-2 carry R, G, B; the other latent channels are always 0."""
LOG_VARIANCE = -12.0
"""Posterior log-variance: std exp(-6) = 0.0025 in latent units (before `scaling_factor`)."""
SIGNAL_SCALE = 1e-5
"""Size of the signal inside the network, chosen so that GroupNorm's eps (1e-6) dwarfs its variance."""
_NORM_EPS = 1e-6  # diffusers' Encoder/Decoder conv_norm_out eps; the tests check that it still holds


def build_demo_vae(scaling_factor: float = 1.0, latent_channels: int = 4, shift_factor: float | None = None,
                   vae_class: str = "AutoencoderKL"):
    """The thumbnail-codec `AutoencoderKL` described above, in eval mode, with no gradients.

    `latent_channels` 16 gives the latent shape of SD3's and Flux's VAEs, 32 Flux.2's (channels 3 and up
    stay 0); `shift_factor` is subtracted from latents before scaling, as those VAEs do. `vae_class`
    `AutoencoderKLFlux2`: the same encoder and decoder in Flux.2's class, which normalises latents with its
    own batch-norm statistics instead of a scaling factor (the caller sets them)."""
    import diffusers

    config = {**VAE_CONFIG, "latent_channels": latent_channels}
    if vae_class == "AutoencoderKL":
        config.update(scaling_factor=scaling_factor, shift_factor=shift_factor)
    vae = getattr(diffusers, vae_class)(**config)
    for norm in (vae.encoder.conv_norm_out, vae.decoder.conv_norm_out):
        if norm.eps != _NORM_EPS or norm.num_channels // norm.num_groups != 2:
            raise RuntimeError(
                f"The demo VAE needs conv_norm_out = GroupNorm with 2 channels per group and eps {_NORM_EPS}; "
                f"this diffusers version has {norm}. Update modules/model/demo_vae.py."
            )
    return set_by_hand(vae, (torch.nn.Conv2d, torch.nn.Linear), _set_encoder, _set_decoder)


def set_by_hand(vae, layer_types: tuple[type, ...], *setters):
    """`vae` with every weight and bias of its `layer_types` layers zeroed and then `setters` applied
    (each takes the VAE), frozen and in eval mode: the frame of every hand-set demo codec."""
    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, layer_types):
                module.weight.zero_()
                if module.bias is not None:
                    module.bias.zero_()
        for set_part in setters:
            set_part(vae)
    vae.requires_grad_(False)
    return vae.eval()


def set_quant_convs(vae, latent_channels: int) -> None:
    """`quant_conv` passes the posterior mean through and replaces its log-variance with `LOG_VARIANCE`;
    `post_quant_conv` passes the latent through."""
    for channel in range(latent_channels):
        vae.quant_conv.weight[channel, channel] = 1.0
        vae.post_quant_conv.weight[channel, channel] = 1.0
    vae.quant_conv.bias[latent_channels:] = LOG_VARIANCE


def _set_encoder(vae) -> None:
    encoder = vae.encoder
    _split_into_pairs(encoder.conv_in)
    for block in encoder.down_blocks:
        for downsampler in block.downsamplers or ():
            # After diffusers' (0, 1, 0, 1) padding, output (i, j) sees input rows/cols 2i..2i+2:
            # weighting only the top-left 2x2 taps makes each stride-2 step an exact 2x2 average.
            for channel in range(downsampler.conv.out_channels):
                downsampler.conv.weight[channel, channel, :2, :2] = 0.25
    # conv_out gives the posterior mean (first half) and log-variance (second half); quant_conv
    # passes the mean through and replaces the log-variance with a constant.
    _join_pairs(encoder.conv_out)
    set_quant_convs(vae, vae.config.latent_channels)


def _set_decoder(vae) -> None:
    decoder = vae.decoder
    _split_into_pairs(decoder.conv_in)
    for block in decoder.up_blocks:
        for upsampler in block.upsamplers or ():
            # Nearest-neighbour upsampling, then the identity: each latent pixel becomes an 8x8 block.
            for channel in range(upsampler.conv.out_channels):
                upsampler.conv.weight[channel, channel, 1, 1] = 1.0
    _join_pairs(decoder.conv_out)


def _split_into_pairs(conv: torch.nn.Conv2d) -> None:
    """Colour c becomes channels (2c, 2c+1) = (+x, -x) * SIGNAL_SCALE: one norm group, mean 0."""
    for colour in range(COLOUR_CHANNELS):
        conv.weight[2 * colour, colour, 1, 1] = SIGNAL_SCALE
        conv.weight[2 * colour + 1, colour, 1, 1] = -SIGNAL_SCALE


def _join_pairs(conv: torch.nn.Conv2d) -> None:
    """Undo the split after GroupNorm (gain 1/sqrt(eps)) and SiLU: SiLU(a) - SiLU(-a) = a."""
    gain = SIGNAL_SCALE / _NORM_EPS ** 0.5
    for colour in range(COLOUR_CHANNELS):
        conv.weight[colour, 2 * colour, 1, 1] = 1.0 / gain
        conv.weight[colour, 2 * colour + 1, 1, 1] = -1.0 / gain
