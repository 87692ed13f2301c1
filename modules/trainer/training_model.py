"""The one module the optimizer trains through: text encoding + the denoiser's prediction in one forward.

Putting every trainable part (the UNet or transformer, and text encoders when they train) behind a
single forward lets the distributed layer wrap exactly this module in one DistributedDataParallel, so
gradients of every trained part are synchronised together and frozen parts never enter the all-reduce.
How the denoiser is called (conditioning, latent packing, guidance input) is the family's objective's
business (`objective.predict`), so this module is the same for every model family.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


class TrainingModel(nn.Module):
    def __init__(self, bundle, train_text_encoder: bool, objective=None) -> None:
        super().__init__()
        self.unet = bundle.denoiser  # registered under this name for every family (UNet or transformer)
        if train_text_encoder:  # frozen encoders stay out of the tree: DDP then never touches them
            self.text_encoders = nn.ModuleList(bundle.trainable_text_encoders())
        self.train_text_encoder = train_text_encoder
        # Kept outside the module tree: the bundle's methods use the same sub-modules registered above.
        self.__dict__["bundle"] = bundle
        self.__dict__["objective"] = objective if objective is not None else bundle.family.objective(bundle)
        self.__dict__["unet_call"] = bundle.denoiser  # or its compiled form (same parameters, see use_compiled_unet)

    def use_compiled_unet(self, compiled) -> None:
        """Predict through `compiled` (torch.compile of the denoiser) from now on."""
        self.__dict__["unet_call"] = compiled

    @contextlib.contextmanager
    def eager_unet(self):
        """Predict through the uncompiled denoiser inside the block (the compiled one's check against it)."""
        compiled = self.unet_call
        self.__dict__["unet_call"] = self.unet
        try:
            yield self
        finally:
            self.__dict__["unet_call"] = compiled

    def run_part(self, name: str, *args, **kwargs):
        """One part's own forward (`unet`, `text_encoders.0`), entered through this module: under sharded
        training the sampling pipeline calls the parts this way, so FSDP gathers their weights as in a
        training step (`fsdp.calls_through_root`)."""
        part = self.get_submodule(name)
        return type(part).forward(part, *args, **kwargs)

    def forward(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: dict | None,
                captions: list[str] | None, original_sizes=None, crop_coords=None, target_sizes=None,
                controls: torch.Tensor | None = None) -> torch.Tensor:
        if text is None:
            with torch.set_grad_enabled(self.train_text_encoder and torch.is_grad_enabled()):
                text = self.bundle.encode_text(captions)
        # An edit model's control latents [B, K, C, h, w] go to its objective; other families never get the argument.
        edits = {} if controls is None else {"controls": controls}
        return self.objective.predict(self.unet_call, noisy_latents, timesteps, text, original_sizes, crop_coords,
                                      target_sizes, **edits)
