"""Qwen-Image-Edit (the 2509 and 2511 "Plus" releases, and the first): Qwen-Image's transformer trained on pairs - an
image, its control images and an instruction - as diffusers' `QwenImageEditPlusPipeline` runs it.

- **Control latents**: each control image through the VAE (the mode of its distribution, as the pipeline's
  `argmax`), packed into 2x2 patches like the target's and appended after the target's tokens; `img_shapes` lists
  the target's grid, then each control's, so every control has positions of its own (and 2511's `zero_cond_t`
  modulates them as clean). The prediction is the target's tokens only. Controls are cached with the latents,
  cropped to their target's bucket (`modules/data/dataset.py`): at 1024 px that is the pipeline's rule (a control
  at about 1 megapixel, in its own shape) for a pair of one shape.
- **Text**: Qwen2.5-VL reads the instruction with the control images - each resized to about 384 x 384 px
  (the pipeline's `CONDITION_IMAGE_SIZE`), labelled `Picture N:` (the first release: unlabelled) - inside the edit
  prompt template, whose first 64 tokens are dropped; the vision tower is kept (`qwen2.5-vl-vision`). A caption and
  its controls travel as one text (`modules/data/controls.text_with_controls`), so the text cache holds each pair's
  own embedding, filled before the transformer loads as for Qwen-Image.
- **Everything else** is Qwen-Image's (`qwen_image.py`): latents, timesteps shifted by the target's size, true
  classifier-free guidance in samples, single files and LoRA layouts (ComfyUI and diffusers read a Qwen-Image-Edit
  LoRA by Qwen-Image's names).
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from modules.data.controls import sample_controls, split_text, text_with_controls
from modules.model.text_apart import padded

from .flux import pack_latents, unpack_latents
from .qwen_edit_demo import EDIT_DROP, EDIT_TEMPLATE
from .qwen_image import QwenImageFamily, QwenImageObjective

CONDITION_AREA = 384 * 384
"""The pixels of a control image as the text encoder reads it (`CONDITION_IMAGE_SIZE` of the edit pipelines)."""
PICTURE_LABEL = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
"""How `QwenImageEditPlusPipeline` puts each control image before the instruction."""
UNLABELLED = "<|vision_start|><|image_pad|><|vision_end|>"
"""How the first `QwenImageEditPipeline` puts its one control image."""
IMAGE_PAD = "<|image_pad|>"


class QwenImageEditObjective(QwenImageObjective):
    def predict(self, denoiser, noisy, timesteps, text, original_sizes=None, crop_coords=None, target_sizes=None,
                controls=None):
        """The target's prediction with its controls' latents [B, K, C, h, w] after its own tokens; without controls,
        Qwen-Image's (an edit model makes a picture from the text alone then)."""
        if controls is None:
            return super().predict(denoiser, noisy, timesteps, text)
        from modules.model.text_apart import trimmed

        batch, _, height, width = noisy.shape
        hidden, mask, _ = trimmed(text)
        controls = controls.to(noisy.dtype)
        shapes = [(1, height // 2, width // 2)] + [(1, c.shape[-2] // 2, c.shape[-1] // 2) for c in controls.unbind(1)]
        tokens = torch.cat([pack_latents(noisy), *(pack_latents(c) for c in controls.unbind(1))], dim=1)
        out = denoiser(hidden_states=tokens, timestep=timesteps, encoder_hidden_states=hidden,
                       encoder_hidden_states_mask=mask, img_shapes=[shapes] * batch, return_dict=False)[0]
        return unpack_latents(out[:, :(height // 2) * (width // 2)], height, width)


def condition_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) the edit pipelines give a control image for the text encoder: about 384 x 384 px in its own
    shape, sides multiples of 32 (their `calculate_dimensions`)."""
    ratio = width / height
    new_width = math.sqrt(CONDITION_AREA * ratio)
    return round(new_width / 32) * 32, round(new_width / ratio / 32) * 32


class QwenImageEditFamily(QwenImageFamily):
    modelspec_name = "qwen-image-edit"

    def recognise_folder(self, folder, index):
        """By the edit pipelines alone: its transformer's class is Qwen-Image's, whose folders are not edit models."""
        name = index.get("_class_name")
        return f"its model_index.json names {name}" if name in self.info.pipelines else None

    # ------------------------------------------------------------------ text

    def text_side(self, folder, storage, tokenizer):
        """Qwen-Image's text side, encoding with the folder's image processor too (`processor/`, read as the PIL
        Qwen2-VL image processor: the processor class itself needs torchvision)."""
        side = super().text_side(folder, storage, tokenizer)
        side.encode_fn = functools.partial(self.encode_edit, _image_processor(Path(folder)), self._labels(folder))
        return side

    def _labels(self, folder) -> bool:
        """Whether the folder's pipeline labels its control images `Picture N:` (the Plus releases do)."""
        import json

        index = Path(folder) / "model_index.json"
        name = json.loads(index.read_text(encoding="utf-8")).get("_class_name") if index.is_file() else None
        return name != "QwenImageEditPipeline"

    def encode_edit(self, image_processor, labelled, encoder, tokenizer, texts, device):
        """{HIDDEN, MASK} of each text (a caption with its controls, `controls.text_with_controls`) as the edit
        pipelines' `_get_qwen_prompt_embeds` makes them, one text at a time (each has images of its own)."""
        from diffusers.image_processor import VaeImageProcessor
        from PIL import Image

        resizer = VaeImageProcessor(vae_scale_factor=16)
        rows = []
        for text in texts:
            caption, paths = split_text(text)
            images = []
            for path in paths:
                with Image.open(path) as img:
                    img = img.convert("RGB")
                width, height = condition_size(*img.size)
                images.append(resizer.resize(img, height, width))
            labels = ("".join(PICTURE_LABEL.format(i + 1) for i in range(len(images))) if labelled
                      else UNLABELLED * len(images))
            prompt = EDIT_TEMPLATE.format(labels + caption)
            extra = {}
            if images:
                vision = image_processor(images=images, return_tensors="pt")
                merge = image_processor.merge_size ** 2
                for grid in vision["image_grid_thw"]:  # the processor's `replace_image_token`
                    prompt = prompt.replace(IMAGE_PAD, "\0" * (int(grid.prod()) // merge), 1)
                prompt = prompt.replace("\0", IMAGE_PAD)
                dtype = next(encoder.parameters()).dtype
                extra = {"pixel_values": vision["pixel_values"].to(device, dtype),
                         "image_grid_thw": vision["image_grid_thw"].to(device)}
            tokens = tokenizer([prompt], return_tensors="pt")
            hidden = encoder(input_ids=tokens.input_ids.to(device), attention_mask=tokens.attention_mask.to(device),
                             **extra).last_hidden_state
            rows.append(hidden[0, EDIT_DROP:])
        return padded(rows)

    def write_tokenizer(self, side, folder):
        """The tokenizer, and `processor/` as the releases have it (the tokenizer and the image processor's config)."""
        entries = super().write_tokenizer(side, folder)
        side.tokenizer.save_pretrained(folder / "processor")
        source = side.folder / "processor"
        if not (source / "preprocessor_config.json").is_file():  # a random model's: the image processor's defaults
            from transformers import Qwen2VLImageProcessorPil
            Qwen2VLImageProcessorPil().save_pretrained(folder / "processor")
        for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
            if (source / name).is_file():
                (folder / "processor" / name).write_bytes((source / name).read_bytes())
        return {**entries, "processor": ["transformers", "Qwen2VLProcessor"]}

    # ------------------------------------------------------------------ training, sampling

    def objective(self, bundle, training_cfg=None):
        return QwenImageEditObjective(bundle, training_cfg)

    def pipeline(self, bundle):
        side = bundle.extra.get("text_side")
        return _sized_pipeline_class()(scheduler=self.sampling_scheduler(bundle), vae=bundle.vae, text_encoder=None,
                                       tokenizer=side.tokenizer if side is not None else None, processor=None,
                                       transformer=bundle.denoiser)

    def pipeline_arguments(self, bundle, prompt, guidance_scale):
        """Qwen-Image's, the prompt's embeddings those of its text with its controls, and the control images."""
        controls = sample_controls(prompt.control)
        if not controls:
            raise ValueError(f"sampling.prompts[].control: the prompt {prompt.prompt!r} has no control image, but "
                             f"{self.info.title} edits one; give the path of the image it edits.")
        embeds, mask = self.prompt_embeddings(bundle, text_with_controls(prompt.prompt, controls))
        arguments = {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "true_cfg_scale": guidance_scale,
                     "image": [_rgb(c.path) for c in controls]}
        if self.guides(guidance_scale):
            negative, negative_mask = self.prompt_embeddings(
                bundle, text_with_controls(self.negative_prompt(prompt), controls))
            arguments.update(negative_prompt_embeds=negative, negative_prompt_embeds_mask=negative_mask)
        return arguments

    def sample_texts(self, sampling_cfg) -> list[str]:
        """Each prompt's text with its controls (and its negative prompt's, when the scale guides): the edit pipelines
        encode both with the control images."""
        texts = []
        for prompt in sampling_cfg.prompts:
            controls = sample_controls(prompt.control)
            texts.append(text_with_controls(prompt.prompt, controls))
            if self.guides(sampling_cfg.guidance_scale):
                texts.append(text_with_controls(self.negative_prompt(prompt), controls))
        return list(dict.fromkeys(texts))

    def stock_pipeline(self, folder):
        """`from_pretrained(folder)` without the processor (its class needs torchvision); prompts go in as
        embeddings."""
        import diffusers

        return getattr(diffusers, self.info.pipeline_class).from_pretrained(folder, processor=None,
                                                                             local_files_only=True)

    def random_model_tokenizer(self):
        """The edit demo's tokenizer: the Qwen-style one with the vision tokens and the edit template's words."""
        from .qwen_edit_demo import demo_edit_tokenizer

        return demo_edit_tokenizer()

    def write_random_model(self, folder, dtype=None, device="cpu", configs: dict | None = None):
        """Qwen-Image's random model, its text encoder told the random tokenizer's vision tokens (so it reads the
        control images: the shipped config names the real vocabulary's)."""
        from .qwen_edit_demo import VISION_TOKENS

        start, pad, end = self.random_model_tokenizer().convert_tokens_to_ids(list(VISION_TOKENS))
        configs = dict(configs or {})
        configs["text_encoder"] = {"image_token_id": pad, "video_token_id": pad, "vision_start_token_id": start,
                                   "vision_end_token_id": end, **configs.get("text_encoder", {})}
        return super().write_random_model(folder, dtype, device, configs)

    def build_demo(self, root=None):
        from .qwen_edit_demo import ensure_qwen_edit_demo

        return ensure_qwen_edit_demo(root)


def _rgb(path: Path):
    from PIL import Image

    with Image.open(path) as img:
        return img.convert("RGB")


@functools.cache
def _sized_pipeline_class():
    """`QwenImageEditPlusPipeline` that encodes each control at the sample's size: the stock one sizes it to about
    1 megapixel (its `VAE_IMAGE_SIZE`), Tandem's training to its image's bucket - the same at 1024 px, and a sample
    at another resolution then shows what training learned."""
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as stock

    class SizedQwenImageEditPlusPipeline(QwenImageEditPlusPipeline):
        def __call__(self, *args, height=None, width=None, **kwargs):
            stock_area = stock.VAE_IMAGE_SIZE
            stock.VAE_IMAGE_SIZE = height * width if height and width else stock_area
            try:
                return super().__call__(*args, height=height, width=width, **kwargs)
            finally:
                stock.VAE_IMAGE_SIZE = stock_area

    return SizedQwenImageEditPlusPipeline


def _image_processor(folder: Path):
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(folder, subfolder="processor", local_files_only=True)
