"""What Qwen-Image and Z-Image share: one rectified-flow transformer conditioned by a large language model
whose text encoder is loaded apart (`modules/model/text_apart.py`).

- **Loading**: the transformer, the VAE, the tokenizer and the scheduler come from a diffusers folder (or,
  for a single file of the transformer, from `model.components_folder`); the text encoder is not read -
  the bundle's `extra["text_side"]` says where it is, and `bundle.text_encoders` is empty.
- **Text**: each caption keeps its own tokens, with a mask (`text_apart.HIDDEN` / `MASK`); the
  transformer sees each batch cut to its longest caption, masked as the pipeline masks it.
- **Objective**: `FlowMatching` (flow_base.py): logit-normal t, shifted as the model's scheduler shifts it
  (Qwen-Image: by image size; Z-Image: a fixed 3).
- **Saving**: a diffusers folder copies `text_encoder/` from where it was loaded (its weights were never in
  memory); single files hold the transformer in the original release layout (`layout`).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import torch

from modules.model.text_apart import HIDDEN, MASK, TextSide, decoder_layers, runnable_part, text_encoder_class

from . import original_layout as layout
from .flow_base import FLOW_MATCHING, FlowFamily, shipped

log = logging.getLogger("tandem")

BUNDLED_PARTS = ("vae.", "first_stage_model.", "text_encoders.")
"""Key prefixes of the VAE and text encoders that single files bundled with a transformer carry."""
NEXT_DIT_PARTS = BUNDLED_PARTS + ("norm_final.",)
"""Lumina 2's and Z-Image's (the same Next-DiT lineage): their original files also hold `norm_final`, which the
model does not use (diffusers drops it too)."""

MAX_TEXT_TOKENS = 512
"""Tokens per caption at most: the `max_sequence_length` both pipelines default to."""


class LLMFlowFamily(FlowFamily):
    """The parts of Qwen-Image and Z-Image that do not differ."""

    vae_class = "AutoencoderKL"
    """The diffusers VAE class."""
    clip_classes = ()
    tokenizer_folder = "tokenizer"
    """The folder of a diffusers model that holds the tokenizer (Qwen-Image 2.1: its processor's, `processor`)."""
    other_parts: tuple[str, ...] = ()
    """Key prefixes of a single file that are not the transformer's (its VAE, text encoders, leftovers the model
    does not use); empty: every key is the transformer's."""

    def owns_key(self, key):
        return not key.startswith(self.other_parts)

    def component_names(self) -> list[str]:
        return ["text_encoder"]

    # ------------------------------------------------------------------ loading

    def _assemble(self, transformer, folder: Path, model_cfg, dtypes, source_name: str, own_vae: bool):
        """The bundle around `transformer`: VAE, tokenizer, scheduler and the text side from `folder`."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from transformers import AutoTokenizer

        from modules.model.bundle import ModelBundle

        self._check_files(folder, ["scheduler/scheduler_config.json",
                                   f"{self.tokenizer_folder}/tokenizer_config.json"])
        vae = self._load_flow_vae(folder, model_cfg, dtypes, own_vae)
        common = {"local_files_only": True}
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler", **common)
        side = self.text_side(folder, model_cfg.text_encoder_dtype,
                              AutoTokenizer.from_pretrained(folder, subfolder=self.tokenizer_folder, **common))
        return ModelBundle(
            model_type=self.name, denoiser=transformer, vae=vae, text_encoders=[], tokenizers=[],
            noise_scheduler=scheduler, prediction_type=FLOW_MATCHING, source=source_name,
            extra={"scheduler": scheduler, "text_side": side})

    def load_text_side(self, where: Path, kind: str, model_cfg, dtypes, source_name: str, own_vae: bool):
        """The bundle without the transformer (`loading.load_text_side`): where a single file's text side
        comes from is its `model.components_folder`, as in `load_single_file`."""
        if kind != "file":
            return self._assemble(None, Path(where), model_cfg, dtypes, source_name, own_vae)
        folder = self._components_folder(where, model_cfg)
        bundle = self._assemble(None, folder, model_cfg, dtypes, source_name, own_vae)
        bundle.extra["components_source"] = str(folder.resolve())
        return bundle

    def text_side(self, folder: Path, storage: str, tokenizer) -> TextSide:
        """The text encoder of `folder`, not loaded (see text_apart.py)."""
        return TextSide(folder=Path(folder).resolve(), class_name=text_encoder_class(Path(folder)), storage=storage,
                        tokenizer=tokenizer, encode_fn=self.encode_with, runnable=self.runnable_text_encoder,
                        layers=self.text_encoder_layers)

    # ------------------------------------------------------------------ text (the family's pipeline's way)

    def encode_with(self, encoder, tokenizer, captions, device) -> dict[str, torch.Tensor]:
        """{HIDDEN, MASK} of `captions` through the loaded `encoder`, as the family's pipeline encodes."""
        raise NotImplementedError

    def text_encoder_kind(self):
        """The kind of its text encoder (`FamilyInfo.text_encoders`: one language model, loaded apart)."""
        from modules.families.text_encoders import TEXT_ENCODER_KINDS

        return TEXT_ENCODER_KINDS[self.info.text_encoders[0]]

    def runnable_text_encoder(self, model):
        """The part of the loaded text encoder that encodes: its decoder stack, without what its kind drops."""
        return runnable_part(model, self.text_encoder_kind())

    def text_encoder_layers(self, encoder) -> list:
        return decoder_layers(encoder)

    def encode_text(self, bundle, captions):
        side = bundle.extra.get("text_side")
        if side is None:
            raise ValueError(f"this {self.info.title} bundle has no text encoder to encode with (a benchmark's "
                             "random model: its text embeddings are synthetic)")
        return side.encode(captions)

    def sample_texts(self, sampling_cfg) -> list[str]:
        """Every text a sampling encodes: the prompts, and the negative prompts when the scale guides (cached
        with the captions, `modules/trainer/text_encoding.py`)."""
        texts = [prompt.prompt for prompt in sampling_cfg.prompts]
        if self.guides(sampling_cfg.guidance_scale):
            texts += [self.negative_prompt(prompt) for prompt in sampling_cfg.prompts]
        return list(dict.fromkeys(texts))

    def guides(self, guidance_scale: float) -> bool:
        """Whether the pipeline runs classifier-free guidance (with a negative prompt) at this scale."""
        return guidance_scale > 1

    def negative_prompt(self, prompt) -> str:
        """The negative prompt the pipeline uses for a sample without one."""
        return prompt.negative_prompt or ""

    def prompt_embeddings(self, bundle, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [1, L, D], bool mask [1, L]) of one prompt, on the denoiser's device: the sample prompts
        were cached with the captions, so a sampling needs no text encoder."""
        text = self.encode_text(bundle, [prompt])
        device = bundle.device
        return text[HIDDEN].to(device), text[MASK].to(device).bool()

    # ------------------------------------------------------------------ saving

    def write_extra_components(self, bundle, folder: Path) -> dict[str, list[str]]:
        """The text encoder copied from where it was loaded (its weights were never read) and the tokenizer."""
        side = bundle.extra.get("text_side")
        if side is None:
            return {}
        copy_component(side.folder / "text_encoder", folder / "text_encoder")
        return {"text_encoder": ["transformers", side.class_name], **self.write_tokenizer(side, folder)}

    def write_tokenizer(self, side: TextSide, folder: Path) -> dict[str, list[str]]:
        """The tokenizer's folder in a saved diffusers folder, and its `model_index.json` entry."""
        side.tokenizer.save_pretrained(folder / "tokenizer")
        return {"tokenizer": ["transformers", type(side.tokenizer).__name__]}

    # ------------------------------------------------------------------ LoRA

    def lycoris_module_name(self, bundle, component, module_path):
        """`lycoris_` + the diffusers module path with `_` (SimpleTuner's LyCORIS names): ComfyUI maps those for
        Qwen-Image and Z-Image (Z-Image's q/k/v onto the rows of its fused `qkv`), not `lora_transformer_`."""
        return f"lycoris_{module_path.replace('.', '_')}"

    def modelspec_architecture(self, bundle) -> str:
        return self.modelspec_name

    modelspec_name = ""

    # ------------------------------------------------------------------ real-size random models

    def random_model_tokenizer(self):
        """The tokenizer a random real-size model is saved with: a demo's, whose ids fit the real vocabulary."""
        from .llm_demo import demo_qwen_tokenizer

        return demo_qwen_tokenizer()

    def random_bundle(self, device, denoiser_dtype):
        """The real-size transformer (built on `device` in `denoiser_dtype`) and an uninitialised real-size
        VAE; no text side: the benchmark's cache holds real-size text embeddings (`cached_shapes`)."""
        import diffusers
        from diffusers import FlowMatchEulerDiscreteScheduler

        from modules.model.bundle import ModelBundle

        from .sd import uninitialised

        torch.manual_seed(0)
        transformer = _built(getattr(diffusers, self.transformer_class), self.shipped_transformer_config({}),
                             device, denoiser_dtype)
        transformer.requires_grad_(False)
        vae = uninitialised(lambda: getattr(diffusers, self.vae_class).from_config(shipped(self.name, "vae")))
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(shipped(self.name, "scheduler"))
        return ModelBundle(model_type=self.name, denoiser=transformer, vae=vae, text_encoders=[], tokenizers=[],
                           noise_scheduler=scheduler, prediction_type=FLOW_MATCHING,
                           source=f"benchmark:random-{self.name}", extra={"scheduler": scheduler})

    def write_random_model(self, folder, dtype=None, device="cpu", configs: dict | None = None):
        """Every part at its real size with random weights, built on `device` in `dtype` (bf16 by default), the
        text encoder included; the tokenizer is the demo's (its ids fit the real vocabulary). `configs`: fields
        per component (`transformer`, `vae`, `text_encoder`) over the shipped configs - a smaller model."""
        import diffusers
        import transformers
        from diffusers import FlowMatchEulerDiscreteScheduler

        from modules.model.bundle import ModelBundle
        from modules.model.saving import save_full_diffusers

        dtype, configs, folder = dtype or torch.bfloat16, configs or {}, Path(folder)
        torch.manual_seed(0)
        transformer = _built(getattr(diffusers, self.transformer_class),
                             {**self.shipped_transformer_config({}), **configs.get("transformer", {})}, device, dtype)
        vae = _built(getattr(diffusers, self.vae_class), {**shipped(self.name, "vae"), **configs.get("vae", {})},
                     device, dtype)
        text_config = {**shipped(self.name, "text_encoder"), **configs.get("text_encoder", {})}
        cls = getattr(transformers, text_config["architectures"][0])
        config = cls.config_class(**{k: v for k, v in text_config.items() if not k.startswith("_")})
        encoder = _built(lambda: cls(config), None, device, dtype)
        staging = folder.with_name(folder.name + ".text-encoder")
        encoder.save_pretrained(staging / "text_encoder")
        del encoder
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(shipped(self.name, "scheduler"))
        tokenizer = self.random_model_tokenizer()
        side = TextSide(folder=staging, class_name=cls.__name__, storage="bf16", tokenizer=tokenizer,
                        encode_fn=self.encode_with, runnable=self.runnable_text_encoder, layers=self.text_encoder_layers)
        bundle = ModelBundle(model_type=self.name, denoiser=transformer, vae=vae, text_encoders=[], tokenizers=[],
                             noise_scheduler=scheduler, prediction_type=FLOW_MATCHING, source=f"random-{self.name}",
                             extra={"scheduler": scheduler, "text_side": side})
        try:
            return save_full_diffusers(bundle, folder, dtype)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


WEIGHT_SUFFIXES = (".safetensors", ".bin")


def copy_component(source: Path, target: Path) -> None:
    """A component folder copied file by file. Weight files are hard-linked where the file system allows (a
    16 GB text encoder is then not written again; nothing ever writes into a weight file); every other file
    (configs, which a save may clean up afterwards) is a copy of its own, so the source is never touched."""
    target.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        if not file.is_file():
            continue
        if file.name.endswith(WEIGHT_SUFFIXES):
            try:
                os.link(file, target / file.name)
                continue
            except OSError:
                pass
        shutil.copy2(file, target / file.name)


def parameters_by_module(keys) -> dict[str, list[str]]:
    """Module path -> its parameter names, of weight names `keys` (a top-level parameter under "")."""
    modules: dict[str, list[str]] = {}
    for key in keys:
        module, _, parameter = key.rpartition(".")
        modules.setdefault(module, []).append(parameter)
    return modules


def identity_entries(keys) -> list[layout.Entry]:
    """An original layout equal to diffusers' (Qwen-Image's releases use diffusers' names): one entry per
    module of `keys`, each parameter under its own name."""
    entries = []
    for module, params in parameters_by_module(keys).items():
        if module:
            entries.append(layout.Entry(module, (module,), params=tuple((p, p) for p in params)))
        else:  # a parameter of the model itself
            entries += [layout.Entry(name, (name,), params=(("", ""),)) for name in params]
    return entries


def block_count(keys, pattern: str) -> int:
    """1 + the largest block index that `pattern` (a regex with one group) finds in `keys`, 0 for none."""
    return 1 + max((int(m[1]) for k in keys if (m := re.match(pattern, k))), default=-1)


def _built(cls, config, device, dtype):
    """`cls(config)` (or `cls()` when config is None) built directly on `device` in `dtype`."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls() if config is None else cls.from_config(config)
    finally:
        torch.set_default_dtype(default)
