"""The static facts about each model family, for the places that must not load torch.

Validation, the GUI and the launchers need to know which model types exist, which config fields
apply to which family and what image sizes a family accepts; none of them may import the training
code. So those facts live here, as data. Everything a family *does* (loading, text encoding, the
objective, sampling, saving) lives in `modules/model/families/`, one module per family, which reads
its facts from this table. Adding a family is one entry here (appended to `FAMILIES`, whose order is
the GUI's) plus the module its `implementation` names there, its configs and presets (docs/AddingAFamily.md);
nothing else lists the families: the code reads this table, and the tests are parametrised over it.

Models are recognised newest family first (`DETECTION_ORDER`): a newer family's files may carry an
older one's names (Chroma's and Flux.2's single files have Flux.1's `double_blocks.*`, SDXL's folders
SD's pipeline pieces), never the other way round.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Activations:
    """What the memory plan (`memory_need.py`) counts of one sample's activations in a family: measured numbers,
    kept with the family so that a new family brings its own."""
    block_bytes: tuple[tuple[str, float], ...] = ()
    """(a `block_groups` name, bytes each such block keeps for its backward per token and hidden channel) in bf16
    autocast: the saved tensors (parameters excluded, each storage once) of one forward of its diffusers block
    class, counted with saved-tensor hooks on CPU processes (torch 2.13, diffusers 0.42.1, SDPA; the same at 720
    and 2,880 tokens), or fitted to GPU peaks. The GPU peak adds attention's working memory and the allocator's
    rounding: docs/MultiGPUTraining.md compares the estimate with measured peaks. A block kind not here counts as
    the largest measured (`memory_need.DEFAULT_BLOCK_BYTES`)."""
    text_tokens: int = 512
    """Text tokens each image attends to beside its own: the pipeline's default (a language model's captions take
    as many as they have, up to 512: 256 stands for a caption)."""
    t5_offset: int | None = 0
    """Where `model.t5_max_length` sets the text length, the tokens before T5's (SD3: CLIP's 77); None: that field
    does not change it."""
    text_tokens_unguided: int = 0
    """The text tokens of a model without a guidance input (Flux.1 schnell: 256); 0: `text_tokens`."""
    frames_per_latent_frame: int = 0
    """A video family's VAE keeps a clip's first frame and one in this many after it."""
    coarse_vae_channels: int = 0
    """Latent channels of a variant whose VAE shrinks each side 16x instead of 8x (Wan 2.2 TI2V 5B: 48), whose
    tokens each span twice the pixels."""
    unet_gib: tuple[int, float, float] = ()
    """A UNet's activations: (reference resolution, GiB per sample without, with gradient checkpointing) in bf16
    autocast with SDPA attention, measured on an H200 (torch 2.11+cu130, diffusers 0.42.1, randomly initialised
    fp32 UNet, full backward) as the growth of peak allocated memory from batch 1 to batch 3, divided by 2 (raw
    numbers in docs/MultiGPUTraining.md); scaled linearly with the pixel count, x2 for fp32."""


@dataclass(frozen=True)
class FamilyInfo:
    name: str
    """The `model.model_type` value."""
    title: str
    """What users call it."""
    denoiser: str
    """The diffusers component name of the trained network: `unet` or `transformer`."""
    pipeline_class: str
    """The diffusers pipeline that loads this family's folders and renders its samples."""
    pixel_multiple: int
    """Image sides must be multiples of this many pixels (VAE downscale x patch size)."""
    flow_matching: bool
    """Trained with rectified flow (noisy = (1-t) x0 + t noise, target noise - x0) instead of DDPM noise."""
    demo: str
    """The built-in tiny random model of this family (`model.base_model`), or empty."""
    implementation: str
    """`module:Class` of the family's `ModelFamily` in `modules/model/families/`."""
    denoiser_class: str
    """The diffusers class of the trained network (built on `meta` to size it without loading)."""
    own_fields: tuple[str, ...] = ()
    """Config fields (section.name) that only this family uses; other families ignore them."""
    key_markers: tuple[str, ...] = ()
    """Tensor-name prefixes that only this family's single files have (checked in `DETECTION_ORDER`)."""
    other_pipelines: tuple[str, ...] = ()
    """Further diffusers pipelines whose folders hold this family's models (Flux.2 Klein's own pipeline)."""
    variants: tuple[str, ...] = ()
    """Named published sizes (`scripts/benchmark.py --model <family>-<variant>`, `make_random_model.py
    --variant`), the default first; empty: one size."""
    lora_targets: tuple[str, ...] = ()
    """`training.lora_target_modules` the family's LoRA presets use (every attention projection and the fused
    projections where the family has them); empty: the config's default suits it."""
    text_apart: bool = False
    """Its text encoder is a large language model (Qwen2.5-VL 7B, Qwen3 4B) that never trains: it is loaded
    only to fill the text cache, before the denoiser loads, and freed after (`modules/trainer/text_encoding.py`);
    captions are always cached, and a run whose cache is complete never loads it."""
    context_parallel: bool = False
    """Its denoiser can split a sample's token sequence over several GPUs (`multi_gpu.context_parallel`): the
    diffusers class has a context-parallel plan (`_cp_plan`: where the sequence is split and gathered) and
    Tandem's tests train it so. Flux.1, Flux.2 and Qwen-Image have plans too, but they split the text tokens
    as well, whose count varies with the caption (Qwen-Image) - not tried yet."""
    block_groups: tuple[str, ...] = ("transformer_blocks", "single_transformer_blocks")
    """A transformer's module lists whose elements are its repeated blocks, in the order they run (those it
    lacks are skipped): the units FSDP shards and checkpoints (`ModelFamily.repeated_blocks`), which the
    memory estimate finds by these names in the weights (`model_sizes.units`). UNets: their ResNet and
    transformer blocks, by the UNet's own rule."""
    video: bool = False
    """It trains on clips as well as images (latents [C, frames, H/8, W/8]); `data.video_frames` frames per clip."""
    text_encoders: tuple[str, ...] = ()
    """The kinds of its text encoders (`text_encoders.TEXT_ENCODER_KINDS`), in the pipeline's order; a family
    whose releases differ lists each (Flux.2 dev's Mistral, Klein's Qwen3)."""
    presets: str = ""
    """The stem of its presets in `training_presets/`: `<stem>_lora` and `<stem>_finetune`; empty: none."""
    controls: str = ""
    """An edit model's control images (`data.concepts[].control`): `latents` - their latents join the image's tokens
    with positions of their own -, `latents+text` - and its text encoder reads them with the caption
    (Qwen-Image-Edit's Qwen2.5-VL); empty: it trains on plain images."""
    controls_optional: bool = False
    """It trains on plain images too, and on pairs when the concepts name controls (Flux.2's reference images); its
    sample prompts may leave `control` empty. False: an edit model needs a control everywhere."""
    max_controls: int = 0
    """The most control images an image may have (Flux.1 Kontext: 1); 0: any number."""
    activations: Activations = Activations()
    """What the memory plan counts of its activations."""

    @property
    def demo_preset(self) -> str:
        """The preset that trains its built-in model (`#demo` for `builtin:demo`, `#demo_flux` for
        `builtin:demo-flux`), or empty."""
        return "#" + self.demo.removeprefix("builtin:").replace("-", "_") if self.demo else ""

    @property
    def demo_folder(self) -> str:
        """The folder name its built-in model is built into (`modules.model.demo.default_demo_root`)."""
        return "demo-model" if self.demo == "builtin:demo" else self.demo.removeprefix("builtin:")

    @property
    def pipelines(self) -> tuple[str, ...]:
        """Every pipeline class whose folders this family loads, its own first."""
        return (self.pipeline_class, *self.other_pipelines)


_SD_FIELDS = ("model.prediction_type", "training.min_snr_gamma", "training.clip_skip")
_DOUBLE_STREAM_ATTENTION = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
"""The attention projections of both streams in the Flux-like double blocks (single blocks: their to_q/k/v)."""
_FLOW_FIELDS = ("model.t5_max_length", "model.components_folder", "training.timestep_logit_mean",
                "training.timestep_logit_std")
_VIDEO_FIELDS = ("data.video_frames", "data.video_fps", "sampling.video_frames")
_WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
"""Every linear layer of Wan's blocks (self- and cross-attention, feed-forward), as musubi-tuner and
diffusion-pipe train them: the layers ComfyUI's and diffusers' Wan LoRA loaders read."""


def _blocks(**bytes_per_kind: float) -> tuple[tuple[str, float], ...]:
    return tuple(bytes_per_kind.items())


_FLUX_BLOCK_BYTES = _blocks(transformer_blocks=46.3, single_transformer_blocks=36.2)
"""Flux.1's double- and single-stream blocks (Chroma's are the same classes)."""
_TEXT_APART_FIELDS = ("model.components_folder", "training.timestep_logit_mean", "training.timestep_logit_std",
                      "model.text_encoder_placement")

FAMILIES: dict[str, FamilyInfo] = {info.name: info for info in (
    FamilyInfo("sd1", "Stable Diffusion 1.x", "unet", "StableDiffusionPipeline", 8, False, "builtin:demo",
               "sd:SDFamily", "UNet2DConditionModel", _SD_FIELDS, ("cond_stage_model.transformer.",),
               text_encoders=("clip-l",), presets="sd15", activations=Activations(unet_gib=(512, 1.17, 0.22))),
    FamilyInfo("sd2", "Stable Diffusion 2.x", "unet", "StableDiffusionPipeline", 8, False, "",
               "sd:SDFamily", "UNet2DConditionModel", _SD_FIELDS, ("cond_stage_model.model.",),
               text_encoders=("openclip-h",), activations=Activations(unet_gib=(768, 2.63, 0.48))),
    FamilyInfo("sdxl", "Stable Diffusion XL", "unet", "StableDiffusionXLPipeline", 8, False, "",
               "sdxl:SDXLFamily", "UNet2DConditionModel", _SD_FIELDS, ("conditioner.embedders.1.model.",),
               text_encoders=("clip-l", "openclip-bigg"), presets="sdxl",
               activations=Activations(unet_gib=(1024, 8.28, 0.65))),
    FamilyInfo("sd3", "Stable Diffusion 3 / 3.5", "transformer", "StableDiffusion3Pipeline", 16, True,
               "builtin:demo-sd3", "sd3:SD3Family", "SD3Transformer2DModel", _FLOW_FIELDS,
               ("joint_blocks.", "model.diffusion_model.joint_blocks."),
               text_encoders=("clip-l", "clip-g", "t5-xxl"), presets="sd35",
               activations=Activations(_blocks(transformer_blocks=48.3), text_tokens=77 + 256, t5_offset=77)),
    FamilyInfo("flux", "Flux.1 (dev, schnell)", "transformer", "FluxPipeline", 16, True, "builtin:demo-flux",
               "flux:FluxFamily", "FluxTransformer2DModel", _FLOW_FIELDS + ("training.flux_guidance",),
               ("double_blocks.", "model.diffusion_model.double_blocks."),
               text_encoders=("clip-l", "t5-xxl"), presets="flux",
               activations=Activations(_FLUX_BLOCK_BYTES, text_tokens_unguided=256)),
    FamilyInfo("chroma", "Chroma", "transformer", "ChromaPipeline", 16, True, "builtin:demo-chroma",
               "chroma:ChromaFamily", "ChromaTransformer2DModel", _FLOW_FIELDS,
               ("distilled_guidance_layer.", "model.diffusion_model.distilled_guidance_layer."),
               lora_targets=_DOUBLE_STREAM_ATTENTION + ("proj_mlp", "proj_out"), text_encoders=("t5-xxl",),
               presets="chroma", activations=Activations(_FLUX_BLOCK_BYTES, t5_offset=None)),
    FamilyInfo("flux2", "Flux.2 (dev, Klein)", "transformer", "Flux2Pipeline", 16, True, "builtin:demo-flux2",
               "flux2:Flux2Family", "Flux2Transformer2DModel",
               ("model.text_max_length", "model.components_folder", "training.timestep_logit_mean",
                "training.timestep_logit_std", "training.flux_guidance"),
               ("double_stream_modulation_img.", "model.diffusion_model.double_stream_modulation_img."),
               other_pipelines=("Flux2KleinPipeline",), variants=("dev", "klein-4b", "klein-9b"),
               # `attn.to_out` is the single blocks' fused output (the double blocks' is `to_out.0`).
               lora_targets=_DOUBLE_STREAM_ATTENTION + ("to_qkv_mlp_proj", "attn.to_out"),
               text_encoders=("mistral-small-3.1", "qwen3"), presets="flux2",
               controls="latents", controls_optional=True,
               activations=Activations(_blocks(transformer_blocks=56.3, single_transformer_blocks=50.2),
                                       t5_offset=None)),
    # Qwen-Image and Z-Image: their text encoder is loaded apart (`text_apart`); their markers are names no
    # other family's files have.
    FamilyInfo("qwen", "Qwen-Image", "transformer", "QwenImagePipeline", 16, True, "builtin:demo-qwen",
               "qwen_image:QwenImageFamily", "QwenImageTransformer2DModel", _TEXT_APART_FIELDS,
               ("txt_norm.", "model.diffusion_model.txt_norm."), lora_targets=_DOUBLE_STREAM_ATTENTION,
               text_apart=True, text_encoders=("qwen2.5-vl",), presets="qwen",
               activations=Activations(_blocks(transformer_blocks=52.6), text_tokens=256, t5_offset=None)),
    # Lumina 2 before Z-Image: Z-Image's files carry Lumina 2's names (`cap_embedder.*`) besides its own markers.
    FamilyInfo("lumina2", "Lumina 2 (Lumina-Image 2.0)", "transformer", "Lumina2Pipeline", 16, True,
               "builtin:demo-lumina2", "lumina2:Lumina2Family", "Lumina2Transformer2DModel", _TEXT_APART_FIELDS,
               ("cap_embedder.", "model.diffusion_model.cap_embedder."),
               lora_targets=("to_q", "to_k", "to_v", "to_out.0", "feed_forward.linear_1", "feed_forward.linear_2",
                             "feed_forward.linear_3"),
               text_apart=True, block_groups=("context_refiner", "noise_refiner", "layers"), text_encoders=("gemma",),
               presets="lumina2", activations=Activations(text_tokens=256, t5_offset=None)),
    FamilyInfo("zimage", "Z-Image (base, Turbo)", "transformer", "ZImagePipeline", 16, True, "builtin:demo-zimage",
               "z_image:ZImageFamily", "ZImageTransformer2DModel", _TEXT_APART_FIELDS,
               ("cap_pad_token", "model.diffusion_model.cap_pad_token"), text_apart=True,
               # Refiners of the image and of the caption tokens, then the main layers (`cap_embedder` is a
               # module list too, but no block).
               block_groups=("noise_refiner", "context_refiner", "layers"), text_encoders=("qwen3",),
               presets="zimage", activations=Activations(text_tokens=256, t5_offset=None)),
    # Wan: video. Its single files use diffusers' names; `condition_embedder.time_proj` is Wan's alone.
    # Wan 2.2 TI2V 5B packs 2x2 latent pixels of a 16x VAE (32 px); `check_image_sizes` asks the loaded model.
    FamilyInfo("wan", "Wan 2.1 / 2.2 (T2V 1.3B, 14B, A14B; TI2V 5B)", "transformer", "WanPipeline", 16, True,
               "builtin:demo-wan", "wan:WanFamily", "WanTransformer3DModel",
               _FLOW_FIELDS + _VIDEO_FIELDS + ("model.wan_expert",),
               ("condition_embedder.time_proj.", "model.diffusion_model.condition_embedder.time_proj."),
               variants=("1.3b", "14b", "a14b", "ti2v-5b"), lora_targets=_WAN_LORA_TARGETS, video=True,
               block_groups=("blocks",), context_parallel=True, text_encoders=("umt5-xxl",), presets="wan",
               # Wan's block bytes: fitted to the GPU peaks of its 14B (81 frames, 512 px, checkpointing) on 1 GPU
               # and context-parallel over 2 and 4 (docs/MultiGPUTraining.md); its 1.3B is not measured.
               activations=Activations(_blocks(blocks=28.0), frames_per_latent_frame=4, coarse_vae_channels=48)),
    # Qwen-Image 2.1: no kin of Qwen-Image's files (`txt_in.text_norm` where those have `txt_norm`); its VAE shrinks
    # 16x and each image slot of the transformer spans 2x2 latent pixels, so sides are multiples of 32 px.
    FamilyInfo("qwen_image21", "Qwen-Image 2.1", "transformer", "QwenImage21Pipeline", 32, True,
               "builtin:demo-qwen_image21", "qwen_image21:QwenImage21Family", "QwenImage21Transformer2DModel",
               _TEXT_APART_FIELDS, ("txt_in.text_norm.", "model.diffusion_model.txt_in.text_norm."), text_apart=True,
               block_groups=("transformer_blocks",), text_encoders=("qwen3-vl",), presets="qwen_image21",
               activations=Activations(text_tokens=256, t5_offset=None)),
    # Flux.3: its files' per-mode modulations (`early_stream_modulations.`) are in no other family's.
    FamilyInfo("flux3", "Flux.3 (Klein)", "transformer", "Flux3ModularPipeline", 16, True, "builtin:demo-flux3",
               "flux3:Flux3Family", "Flux3Transformer2DModel", _TEXT_APART_FIELDS,
               ("early_stream_modulations.", "model.diffusion_model.early_stream_modulations."), text_apart=True,
               other_pipelines=("Flux3DistilledModularPipeline",),
               lora_targets=("to_q", "to_k", "to_v", "to_out.0", "linear_in", "linear_out"),
               block_groups=("txt_mode_blocks", "mode_blocks.image", "mode_blocks.image_cond",
                             "single_transformer_blocks"),
               text_encoders=("qwen3-vl",), presets="flux3", activations=Activations(text_tokens=240, t5_offset=None)),
    # Qwen-Image-Edit: Qwen-Image's transformer, trained on pairs; its files are Qwen-Image's (no marker of its own:
    # a single file needs model.model_type), its folders name the edit pipelines.
    FamilyInfo("qwen_edit", "Qwen-Image-Edit (2509, 2511)", "transformer", "QwenImageEditPlusPipeline", 16, True,
               "builtin:demo-qwen_edit", "qwen_image_edit:QwenImageEditFamily", "QwenImageTransformer2DModel",
               _TEXT_APART_FIELDS, other_pipelines=("QwenImageEditPipeline",), lora_targets=_DOUBLE_STREAM_ATTENTION,
               text_apart=True, text_encoders=("qwen2.5-vl-vision",), presets="qwen_edit", controls="latents+text",
               activations=Activations(_blocks(transformer_blocks=52.6), text_tokens=256, t5_offset=None)),
    # Flux.1 Kontext: Flux.1-dev's transformer, trained on pairs; its files are Flux.1's (no marker of its own: a
    # single file needs model.model_type), its folders name FluxKontextPipeline.
    FamilyInfo("flux_kontext", "Flux.1 Kontext (dev)", "transformer", "FluxKontextPipeline", 16, True,
               "builtin:demo-flux_kontext", "flux_kontext:FluxKontextFamily", "FluxTransformer2DModel",
               _FLOW_FIELDS + ("training.flux_guidance",), text_encoders=("clip-l", "t5-xxl"), presets="flux_kontext",
               controls="latents", max_controls=1, activations=Activations(_FLUX_BLOCK_BYTES)),
)}
MODEL_TYPES = tuple(FAMILIES)
"""Every family Tandem trains, in the order the GUI lists them."""
DETECTION_ORDER = tuple(reversed(FAMILIES))
"""The order in which families are asked whether a model is theirs: newest first (see above)."""
BUILTIN_MODELS = {info.demo: info.name for info in FAMILIES.values() if info.demo}
"""Built-in model name -> its family."""


def family_of_builtin(base_model: str) -> str | None:
    """The family of a built-in model name (`builtin:demo-flux` -> `flux`), None for anything else."""
    return BUILTIN_MODELS.get(base_model.strip())


def field_applies(path: str, family: str | None) -> bool:
    """Whether config field `path` means anything for `family` (None: not known yet - every field may)."""
    if family is None:
        return True
    owners = [info.name for info in FAMILIES.values() if path in info.own_fields]
    return not owners or family in owners


def family_fields() -> set[str]:
    """Every field that belongs to some families only."""
    return {path for info in FAMILIES.values() for path in info.own_fields}


def guess_family(base_model: str, model_type: str = "auto") -> str | None:
    """The family a config will train, found without loading anything (for the GUI): the explicit
    `model_type`, a built-in model's, a diffusers folder's pipeline class (SD 1.x and 2.x share one:
    `sd1` stands for both, their fields are the same), or a `.safetensors` file's tensor names.
    None when nothing says (an unreadable path, a `.ckpt`)."""
    if model_type in FAMILIES:
        return model_type
    builtin = family_of_builtin(base_model)
    if builtin or not base_model.strip():
        return builtin
    path = Path(base_model.strip()).expanduser()
    try:
        if (path / "model_index.json").is_file():
            return family_of_pipeline(json.loads((path / "model_index.json").read_text()).get("_class_name"))
        if path.suffix.lower() == ".safetensors" and path.is_file():
            stat = path.stat()
            return _family_of_weights(str(path), stat.st_ino, stat.st_mtime_ns, stat.st_size)
    except (OSError, ValueError):
        return None
    return None


@functools.lru_cache(maxsize=32)
def _family_of_weights(path: str, inode: int, mtime_ns: int, size: int) -> str | None:
    """The family a `.safetensors` file's tensor names say, read once per version of the file: the GUI asks on
    every edit (which fields show, which apply, which list columns), and a large model's header is hundreds of
    kilobytes of JSON."""
    return family_of_keys(_safetensors_keys(Path(path)))


def families_of_pipeline(pipeline: str | None) -> tuple[str, ...]:
    """The families whose folders name diffusers pipeline `pipeline` (SD 1.x and 2.x share one), in GUI order."""
    return tuple(info.name for info in FAMILIES.values() if pipeline in info.pipelines)


def family_of_pipeline(pipeline: str | None) -> str | None:
    """The first family of `families_of_pipeline` (`sd1` stands for SD 1.x and 2.x), or None."""
    return next(iter(families_of_pipeline(pipeline)), None)


def family_of_keys(keys) -> str | None:
    """The family whose single files alone have a tensor name among `keys` (`key_markers`, newest family
    first), or None: the SD families' files are told apart by `modules/model/detect.py`, not here."""
    for name in DETECTION_ORDER:
        markers = FAMILIES[name].key_markers
        if markers and any(key.startswith(markers) for key in keys):
            return name
    return None


def known_pipelines() -> str:
    """The pipeline classes Tandem trains, for messages."""
    return ", ".join(dict.fromkeys(p for info in FAMILIES.values() for p in info.pipelines))


def _safetensors_keys(path: Path) -> list[str]:
    """Tensor names from a .safetensors header (8-byte length, then JSON), without reading any tensor."""
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        if not 0 < length < 100_000_000:
            raise ValueError(f"{path}: not a .safetensors header")
        header = json.loads(file.read(length))
    return [key for key in header if key != "__metadata__"]
