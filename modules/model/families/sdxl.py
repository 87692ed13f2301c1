"""SDXL: the SD UNet recipe with two CLIP text encoders and size/crop conditioning.

Conditioning follows `StableDiffusionXLPipeline` exactly: the penultimate hidden states of both
encoders side by side, the second encoder's pooled projection, and the (original size, crop, target
size) "time ids" SDXL was trained with.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .sd import SDFamily, _device_of


class SDXLFamily(SDFamily):
    text_encoder_names = ("text_encoder", "text_encoder_2")

    def encode_text(self, bundle, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        """`encoder_hidden_states` [B, 77, 768 + 1280] and `pooled` [B, 1280]."""
        hidden, pooled = [], None
        for encoder, ids in zip(bundle.text_encoders, bundle.tokenize(captions)):
            output = encoder(ids.to(_device_of(encoder)), output_hidden_states=True)
            # SDXL conditions on the penultimate layer of both encoders; the pooled vector comes
            # from the last one (the projection model), as in StableDiffusionXLPipeline.encode_prompt.
            hidden.append(output.hidden_states[-2])
            pooled = output[0]
        device = hidden[-1].device
        return {
            "encoder_hidden_states": torch.cat([h.to(device) for h in hidden], dim=-1),
            "pooled": pooled,
        }

    def unused_text_encoder_modules(self, bundle):
        """The first encoder's last layer and final norm: SDXL reads its penultimate hidden states only.
        Training must freeze them, or DistributedDataParallel waits for their gradients."""
        inner = getattr(bundle.text_encoders[0], "text_model", bundle.text_encoders[0])
        return [inner.encoder.layers[-1], inner.final_layer_norm]

    def added_cond(self, bundle, text, original_sizes, crop_coords, target_sizes):
        """`added_cond_kwargs` for the UNet: `text_embeds` (pooled) and `time_ids` [B, 6].

        Sizes and crop coordinates are (height, width) and (top, left), one per sample, as SDXL
        was trained with.
        """
        pooled = text["pooled"]
        rows = [
            [*map(int, original), *map(int, crop), *map(int, target)]
            for original, crop, target in zip(original_sizes, crop_coords, target_sizes, strict=True)
        ]
        if len(rows) != pooled.shape[0]:
            raise ValueError(f"added_cond got {len(rows)} size entries for a batch of {pooled.shape[0]}")
        time_ids = torch.tensor(rows, dtype=pooled.dtype)
        if pooled.is_cuda:  # a copy from pageable memory would make the CPU wait for the GPU
            time_ids = time_ids.pin_memory()
        time_ids = time_ids.to(pooled.device, non_blocking=True)
        return {"text_embeds": pooled, "time_ids": time_ids}

    def pipeline(self, bundle):
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline(
            vae=bundle.vae, text_encoder=bundle.text_encoders[0], text_encoder_2=bundle.text_encoders[1],
            tokenizer=bundle.tokenizers[0], tokenizer_2=bundle.tokenizers[1], unet=bundle.unet,
            scheduler=self.sampling_scheduler(bundle), add_watermarker=False,
        )

    def model_index_extras(self, bundle):
        return {"feature_extractor": [None, None], "image_encoder": [None, None],
                "force_zeros_for_empty_prompt": True}

