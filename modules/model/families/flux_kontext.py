"""Flux.1 Kontext (dev): Flux.1-dev's transformer trained on pairs - an image, the image it edits and an instruction -
as diffusers' `FluxKontextPipeline` runs it.

- **The control image**: through the VAE (the mode of its distribution, as the pipeline's `argmax`), scaled like the
  target's latents, packed into 2x2 patches and appended after the target's tokens. Its position ids are the
  target's rule (0, row, column) with the first coordinate 1 (`prepare_latents`: `image_ids[..., 0] = 1`), so the
  two pictures share rows and columns and differ in that axis. The prediction is the target's tokens only, and the
  timestep shift follows the target's token count, as the pipeline computes `mu` from it. One control per image.
- **Its size**: controls are cached cropped to their target's bucket (`modules/data/dataset.py`). The pipeline
  resizes a control to the `PREFERRED_KONTEXT_RESOLUTIONS` entry nearest its aspect ratio (about 1 megapixel) and
  renders at about 1 megapixel (`max_area`): at `data.resolution` 1024 the target's bucket is such a size, so
  training sees what the pipeline does. Samples render at the sample's size with the control cropped to it
  (`max_area` and `_auto_resize` set so), which is what training at another resolution learned.
- **Everything else** is Flux.1-dev's (`flux.py`): CLIP-L + T5-XXL text of 512 tokens, the guidance input
  (`training.flux_guidance`), single files and LoRA layouts - ComfyUI and diffusers read a Kontext LoRA by Flux.1's
  names. A Kontext single file has Flux.1-dev's tensor names: nothing in it tells the two apart, so a single file
  trains as Kontext when `model.model_type` is `flux_kontext` (or `model.components_folder` is a Kontext folder).
"""
from __future__ import annotations

import functools

import torch

from modules.data.controls import control_picture, sample_controls

from .flux import FluxFamily, FluxObjective, image_ids, pack_latents, unpack_latents

CONTROL_AXIS = 1
"""The first position-id coordinate of the control's tokens (the target's is 0)."""


class FluxKontextObjective(FluxObjective):
    def predict(self, denoiser, noisy, timesteps, text, original_sizes=None, crop_coords=None, target_sizes=None,
                controls=None):
        """The target's prediction with its control's latents [B, 1, C, h, w] after its own tokens; without controls,
        Flux.1's (Kontext makes a picture from the text alone then)."""
        if controls is None:
            return super().predict(denoiser, noisy, timesteps, text)
        if controls.shape[1] != 1:
            raise ValueError(f"Flux.1 Kontext edits one control image per image, but the data has {controls.shape[1]}; "
                             "give each image one control (data.concepts[].control: one folder, or one path per "
                             "manifest line).")
        _, _, height, width = noisy.shape
        control = controls[:, 0].to(noisy.dtype)
        control_ids = image_ids(control.shape[-2], control.shape[-1], noisy.device, noisy.dtype)
        control_ids[:, 0] = CONTROL_AXIS
        hidden = text["encoder_hidden_states"]
        target_ids = image_ids(height, width, noisy.device, noisy.dtype)
        out = denoiser(
            hidden_states=torch.cat([pack_latents(noisy), pack_latents(control)], dim=1), timestep=timesteps,
            guidance=self.guidance_input(noisy), pooled_projections=text["pooled"], encoder_hidden_states=hidden,
            txt_ids=torch.zeros(hidden.shape[1], 3, device=noisy.device, dtype=noisy.dtype),
            img_ids=torch.cat([target_ids, control_ids]), return_dict=False)[0]
        return unpack_latents(out[:, :target_ids.shape[0]], height, width)


class FluxKontextFamily(FluxFamily):
    def modelspec_architecture(self, bundle) -> str:
        return "flux-1-kontext-dev"

    def recognise_folder(self, folder, index):
        """By its pipeline alone: its transformer's class is Flux.1's, whose folders are no edit models."""
        name = index.get("_class_name")
        return f"its model_index.json names {name}" if name in self.info.pipelines else None

    def objective(self, bundle, training_cfg=None):
        return FluxKontextObjective(bundle, training_cfg)

    def pipeline(self, bundle):
        return _sized_pipeline_class()(
            scheduler=self.sampling_scheduler(bundle), vae=bundle.vae, text_encoder=bundle.text_encoders[0],
            tokenizer=bundle.tokenizers[0], text_encoder_2=bundle.text_encoders[1], tokenizer_2=bundle.tokenizers[1],
            transformer=bundle.denoiser)

    def pipeline_arguments(self, bundle, prompt, guidance_scale):
        """Flux.1's, and the prompt's control image (the pipeline crops it to the sample's size)."""
        controls = sample_controls(prompt.control)
        if len(controls) != 1:
            raise ValueError(f"sampling.prompts[].control: the prompt {prompt.prompt!r} has {len(controls)} control "
                             f"images, but {self.info.title} edits one; give the path of the image it edits.")
        return {**super().pipeline_arguments(bundle, prompt, guidance_scale), "image": controls[0].path}

    def build_demo(self, root=None):
        from modules.model.demo import default_demo_root, ensure_built_model

        root = root if root is not None else default_demo_root(self.info.demo_folder)
        return ensure_built_model(root, _build_demo)


def _build_demo(folder) -> None:
    """The demo Flux.1 (`dit_demo.py`: its tiny transformer, VAE, CLIP and T5) as a `FluxKontextPipeline` folder."""
    from diffusers import FluxKontextPipeline, FluxPipeline

    from .dit_demo import ensure_dit_demo

    flux = FluxPipeline.from_pretrained(ensure_dit_demo("flux"), local_files_only=True)
    FluxKontextPipeline(**flux.components).save_pretrained(folder, safe_serialization=True)


@functools.cache
def _sized_pipeline_class():
    """`FluxKontextPipeline` that renders at the asked size with the control cropped to it, as training crops a
    control to its image's bucket: the stock one renders about 1 megapixel (`max_area`) from a control resized to
    its preferred resolutions (`_auto_resize`). `image` is the control's path."""
    from diffusers import FluxKontextPipeline

    class SizedFluxKontextPipeline(FluxKontextPipeline):
        def __call__(self, *args, image=None, height=None, width=None, **kwargs):
            if image is not None:
                image = control_picture(image, width, height)
            return super().__call__(*args, image=image, height=height, width=width, max_area=height * width,
                                    _auto_resize=False, **kwargs)

    return SizedFluxKontextPipeline
