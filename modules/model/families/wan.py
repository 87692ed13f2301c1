"""Wan 2.1 and 2.2 text-to-video (T2V 1.3B, 14B, A14B; TI2V 5B): a 3-D transformer on video latents, UMT5-XXL
as text encoder, rectified flow.

Everything follows diffusers' `WanPipeline`:

- **Latents**: Wan's causal 3-D VAE (`AutoencoderKLWan`): 16 channels, 1/8 of each side, one latent frame
  for the first video frame and one for each 4 after it (so a clip has 4k + 1 frames; an image is one
  frame), normalised per channel by the VAE's `latents_mean` / `latents_std`. Latents keep the VAE's
  5-D shape [B, C, frames, H/8, W/8] everywhere (cache, batches, objective), images included.
- **Text**: each caption through UMT5's encoder, padded to `max_sequence_length` (512) tokens, the hidden
  states past the caption's own tokens set to 0, as `WanPipeline._get_t5_prompt_embeds` does. UMT5
  never trains.
- **Transformer**: 1x2x2 patches (so image sides are multiples of 16 px), the timestep as t x 1000.
- **Timesteps**: logit-normal t shifted by the scheduler's fixed shift (`flow_shift`, 3.0 in the 480p
  releases' UniPC scheduler; `shift` of a flow-match Euler scheduler, the demo's), as sampling shifts it.
- **Sampling**: the stock `WanPipeline`, `sampling.video_frames` frames per sample prompt (a clip; 1: a still
  image).
- **Wan 2.2** (`wan_experts.py`): T2V A14B's two experts train one per run (`model.wan_expert`), each on its
  own timestep range, the other kept frozen in host memory and used for samples; TI2V 5B trains text-to-video
  on the Wan 2.2 VAE's 48-channel latents (sides a multiple of 32 px).

The image-to-video pipelines are not recognised (their folders name other pipeline classes). Single files use
diffusers' names (the identity layout, as Qwen-Image's); original-layout files (`blocks.N.self_attn.q`) are not
read. LoRAs in the kohya layout use the original
names under `diffusion_model.` with `lora_down` / `lora_up` / `alpha` (diffusion-pipe's; ComfyUI and
diffusers' `WanPipeline.load_lora_weights` read it).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from modules.model.objective import NoiseDraw, draw_flow_noise, flow_per_sample, flow_shift, shift_times

from .flow_base import (CONFIG_DIR, FLOW_MATCHING, ChannelNormalizedLatents, FlowFamily, FlowMatching, _device_of,
                        shipped)
from .llm_flow import block_count, identity_entries
from .wan_experts import BOUNDARY_RATIO, ExpertPlan, expert_plan, release, truncated_times

IMPLEMENTATION = "https://github.com/Wan-Video/Wan2.1"
TEXT_TOKENS = 512
"""`max_sequence_length` of `WanPipeline` (its default): captions are padded to this many tokens."""
TEMPORAL_FACTOR = 4
"""Video frames per latent frame after the first: clips have `TEMPORAL_FACTOR * k + 1` frames."""
LORA_PREFIX = "diffusion_model."
_ORIGINAL_NAMES = (
    (r"attn1\.to_q", "self_attn.q"), (r"attn1\.to_k", "self_attn.k"), (r"attn1\.to_v", "self_attn.v"),
    (r"attn1\.to_out\.0", "self_attn.o"), (r"attn2\.to_q", "cross_attn.q"), (r"attn2\.to_k", "cross_attn.k"),
    (r"attn2\.to_v", "cross_attn.v"), (r"attn2\.to_out\.0", "cross_attn.o"), (r"ffn\.net\.0\.proj", "ffn.0"),
    (r"ffn\.net\.2", "ffn.2"))
"""Diffusers' names of a block's linear layers -> the original Wan release's (what ComfyUI's loras use)."""


def latent_frames(frames: int) -> int:
    """Latent frames of a clip of `frames` video frames (1 for an image)."""
    return (frames - 1) // TEMPORAL_FACTOR + 1


def original_module_name(module_path: str) -> str:
    """`blocks.3.attn1.to_q` -> `blocks.3.self_attn.q`; a ValueError for a module outside the blocks' linears."""
    match = re.fullmatch(r"(blocks\.\d+)\.(.+)", module_path)
    if match:
        for diffusers_name, original in _ORIGINAL_NAMES:
            if re.fullmatch(diffusers_name, match[2]):
                return f"{match[1]}.{original}"
    raise ValueError(f"the Wan LoRA adapts {module_path}, which ComfyUI's and diffusers' Wan LoRA loaders do not "
                     "read in the kohya layout (they take the blocks' attention and feed-forward layers); keep "
                     "training.lora_target_modules to those (the wan_lora preset's) or set save.lora_format to peft")


class WanObjective(FlowMatching):
    def __init__(self, bundle, training_cfg=None) -> None:
        super().__init__(bundle, training_cfg)
        plan = getattr(bundle, "extra", {}).get("wan_experts")
        self.time_range: tuple[float, float] | None = plan.time_range if plan is not None else None
        """A Wan 2.2 expert's flow-time range (`wan_experts.ExpertPlan`); None: every t."""

    def draw(self, latent_shape, seed, step, micro, part, device, offset_noise=0.0) -> NoiseDraw:
        # Drawn as [B, C, frames * H, W]: the same numbers, and the offset noise ([B, C, 1, 1]) is one value
        # per channel over every frame, as for an image.
        batch, channels, frames, height, width = latent_shape
        draw = draw_flow_noise((batch, channels, frames * height, width), seed, step, micro, part, device,
                               offset_noise, self.logit_mean, self.logit_std)
        shift = scheduler_shift(self.scheduler_config)
        if self.time_range is None:
            timesteps = shift_times(draw.timesteps, shift)
        else:
            timesteps = truncated_times(draw.timesteps, shift, *self.time_range, self.logit_mean, self.logit_std)
        return NoiseDraw(draw.noise.view(draw.noise.shape[0], channels, frames, height, width), timesteps)

    def per_sample_loss(self, prediction, target, draw, mask=None):
        # A mask [B, 1, H, W] weighs every frame alike.
        return flow_per_sample(prediction, target, mask.unsqueeze(2) if mask is not None else None)

    def predict(self, denoiser, noisy, timesteps, text, original_sizes=None, crop_coords=None, target_sizes=None):
        # TI2V 5B's pipeline (`expand_timesteps`) gives each latent token its own timestep, all the same t in
        # text-to-video: the transformer computes the same from the one t, without a [B, tokens, 6 x width]
        # modulation tensor per sample (tests/unit/test_wan22.py compares the two).
        return denoiser(hidden_states=noisy, timestep=timesteps * 1000,
                        encoder_hidden_states=text["encoder_hidden_states"], return_dict=False)[0]


def scheduler_shift(config) -> float:
    """The fixed time shift of a Wan scheduler: UniPC's `flow_shift` (the releases'), else a flow-match
    Euler scheduler's `shift`."""
    config = dict(config)
    return float(config["flow_shift"]) if config.get("flow_shift") else flow_shift(config, 0)


class WanFamily(ChannelNormalizedLatents, FlowFamily):
    transformer_class = "WanTransformer3DModel"
    vae_class = "AutoencoderKLWan"
    clip_classes = ()
    file_prefix = ""
    default_t5_length = TEXT_TOKENS
    kohya_version = "wan21"
    kohya_implementation = IMPLEMENTATION

    # ------------------------------------------------------------------ detection, loading

    def recognise_folder(self, folder, index):
        if index.get("_class_name") in self.info.pipelines:
            return f"its model_index.json names {index['_class_name']} ({release(folder, index)})"
        return None  # other Wan pipelines (image-to-video, VACE) share the transformer class but are not trained

    def load_folder(self, folder, model_cfg, dtypes, source_name, own_vae):
        import diffusers

        from modules.model.files import SAVE_DTYPES
        from modules.model.variants import component_variant

        folder = Path(folder)
        index = json.loads((folder / "model_index.json").read_text())
        plan = expert_plan(folder, index, model_cfg.wan_expert)
        if plan is None:
            bundle = super().load_folder(folder, model_cfg, dtypes, source_name, own_vae)
        else:
            self._check_files(folder, [f"{plan.trained_folder}/config.json", f"{plan.frozen_folder}/config.json"])

            def expert(subfolder, dtype):
                return diffusers.WanTransformer3DModel.from_pretrained(
                    folder, subfolder=subfolder, torch_dtype=dtype, local_files_only=True,
                    variant=component_variant(folder / subfolder, subfolder, model_cfg.unet_dtype))

            bundle = self._assemble(expert(plan.trained_folder, dtypes["unet"]), folder, model_cfg, dtypes, source_name,
                                    own_vae)
            # The other expert never trains: outside the bundle's modules, so it stays in host memory (no device
            # move, no optimizer, no FSDP) until samples need it (`ModelBundle.sampling_modules`), stored in
            # model.unet_dtype even for a full fine-tune (fp8: the bf16 it computes in).
            frozen_dtype = SAVE_DTYPES.get(model_cfg.unet_dtype, torch.bfloat16)
            frozen = expert(plan.frozen_folder, frozen_dtype).requires_grad_(False).eval()
            bundle.extra.update(wan_experts=plan, frozen_modules={plan.frozen_folder: frozen})
        bundle.extra["pipeline_config"] = {"boundary_ratio": index.get("boundary_ratio"),
                                           "expand_timesteps": bool(index.get("expand_timesteps"))}
        return bundle

    def load_single_file(self, path, model_cfg, dtypes, own_vae):
        if model_cfg.wan_expert:
            raise ValueError(f"model.wan_expert is {model_cfg.wan_expert!r}, but {path} is a single file, which holds "
                             "one transformer; train a Wan 2.2 A14B expert from its diffusers folder (both experts and "
                             "boundary_ratio), or leave model.wan_expert empty")
        return super().load_single_file(path, model_cfg, dtypes, own_vae)

    def _assemble(self, transformer, folder: Path, model_cfg, dtypes, source_name: str, own_vae: bool):
        """The bundle around `transformer`: VAE, UMT5, tokenizer and the folder's own scheduler class (the
        releases' UniPC, whose `flow_shift` the objective reads)."""
        import diffusers
        from transformers import AutoTokenizer, UMT5EncoderModel

        from modules.model.bundle import ModelBundle
        from modules.model.files import SAVE_DTYPES
        from modules.model.variants import component_variant

        self._check_files(folder, ["scheduler/scheduler_config.json"])
        if model_cfg.prediction_type != "auto":
            raise ValueError(f"model.prediction_type is {model_cfg.prediction_type!r}, but {self.info.title} "
                             "trains rectified flow; set model.prediction_type to auto")
        common = {"local_files_only": True}
        vae = diffusers.AutoencoderKLWan.from_pretrained(
            folder, subfolder="vae", torch_dtype=dtypes["vae"], **common,
            variant=component_variant(folder / "vae", "vae", model_cfg.vae_dtype)) if own_vae else None
        # UMT5 never trains: it is stored in the configured dtype (UMT5-XXL is 23 GB in fp32).
        encoder = UMT5EncoderModel.from_pretrained(
            folder, subfolder="text_encoder", dtype=SAVE_DTYPES[model_cfg.text_encoder_dtype], **common,
            variant=component_variant(folder / "text_encoder", "text_encoder", model_cfg.text_encoder_dtype))
        tokenizer = AutoTokenizer.from_pretrained(folder, subfolder="tokenizer", **common)
        scheduler = _scheduler(folder / "scheduler")
        return ModelBundle(
            model_type=self.name, denoiser=transformer, vae=vae, text_encoders=[encoder], tokenizers=[tokenizer],
            noise_scheduler=scheduler, prediction_type=FLOW_MATCHING, source=source_name,
            extra={"scheduler": scheduler, "text_lengths": [model_cfg.t5_max_length or TEXT_TOKENS]})

    def load_vae(self, path, dtype, config=None):
        raise ValueError(f"model.vae_path {str(path)!r} is a single file; a Wan VAE is read from a diffusers folder "
                         "(one with config.json, or a model folder with vae/): point model.vae_path at one, or leave "
                         "it empty for the model's own VAE")

    # ------------------------------------------------------------------ latents (5-D)

    def _latent_distribution(self, bundle, pixels):
        """The VAE's posterior of images [B, 3, H, W] (one frame each) or clips [B, 3, F, H, W]."""
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        if pixels.ndim != 5 or pixels.shape[1] != 3:
            raise ValueError(f"encode_images expects pixels of shape [B, 3, H, W] or [B, 3, frames, H, W], got "
                             f"{tuple(pixels.shape)}")
        vae_param = next(bundle.vae.parameters())
        return bundle.vae.encode(pixels.to(device=vae_param.device, dtype=vae_param.dtype)).latent_dist

    def decode_latents(self, bundle, latents):
        """Latents [B, C, F, H, W] -> pixels: [B, 3, H, W] for one latent frame, else [B, 3, frames, H, W]."""
        vae_param = next(bundle.vae.parameters())
        latents = self.denormalize_latents(bundle, latents.to(device=vae_param.device, dtype=vae_param.dtype))
        pixels = bundle.vae.decode(latents).sample.clamp(-1, 1)
        return pixels[:, :, 0] if latents.shape[2] == 1 else pixels

    def latent_frames(self, frames):
        return latent_frames(frames)

    def check_clips(self, clips, video_frames):
        if video_frames % TEMPORAL_FACTOR != 1:
            raise ValueError(f"data.video_frames is {video_frames}, but {self.info.title} takes clips of 4k + 1 frames "
                             f"(17, 33, 49, 81); set it to {max(1, video_frames // 4 * 4 + 1)}, for example")

    # ------------------------------------------------------------------ text

    def encode_text(self, bundle, captions):
        """`encoder_hidden_states` [B, 512, 4096]: UMT5's last hidden states, 0 past each caption's tokens."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        encoder, tokenizer = bundle.text_encoders[0], bundle.tokenizers[0]
        tokens = tokenizer([prompt_clean(c) for c in captions], padding="max_length",
                           max_length=bundle.text_lengths()[0], truncation=True, add_special_tokens=True,
                           return_attention_mask=True, return_tensors="pt")
        device = _device_of(encoder)
        mask = tokens.attention_mask.to(device)
        hidden = encoder(tokens.input_ids.to(device), mask).last_hidden_state
        return {"encoder_hidden_states": hidden * mask.unsqueeze(-1).to(hidden.dtype)}

    def trainable_text_encoders(self, bundle):
        return []  # UMT5 never trains

    # ------------------------------------------------------------------ training, sampling

    def objective(self, bundle, training_cfg=None):
        return WanObjective(bundle, training_cfg)

    def text_encoder_blocks(self, encoder):
        return list(encoder.encoder.block)

    def pipeline(self, bundle):
        """`WanPipeline` as the folder's model_index.json sets it up: with a Wan 2.2 A14B expert, the trained one
        and the frozen one in their places, switching at `boundary_ratio`; TI2V 5B with `expand_timesteps`."""
        from diffusers import WanPipeline

        experts = self.experts(bundle)
        config = bundle.extra.get("pipeline_config", {})
        return WanPipeline(tokenizer=bundle.tokenizers[0], text_encoder=bundle.text_encoders[0],
                           transformer=experts["transformer"], transformer_2=experts.get("transformer_2"),
                           vae=bundle.vae, scheduler=self.sampling_scheduler(bundle),
                           boundary_ratio=config.get("boundary_ratio") if "transformer_2" in experts else None,
                           expand_timesteps=bool(config.get("expand_timesteps")))

    def experts(self, bundle) -> dict:
        """The transformers by their folder name: `transformer` alone, or a Wan 2.2 A14B expert's pair."""
        plan: ExpertPlan | None = bundle.extra.get("wan_experts")
        if plan is None:
            return {"transformer": bundle.denoiser}
        return {plan.trained_folder: bundle.denoiser, **bundle.extra["frozen_modules"]}

    def denoiser_folder(self, bundle):
        plan = bundle.extra.get("wan_experts")
        return plan.trained_folder if plan is not None else "transformer"

    def write_extra_components(self, bundle, folder):
        """A Wan 2.2 A14B expert's full save holds the frozen expert too (unchanged, in the dtype it was loaded in:
        `model.unet_dtype`), so the folder loads as a complete WanPipeline."""
        plan = bundle.extra.get("wan_experts")
        if plan is None:
            return {}
        frozen = bundle.extra["frozen_modules"][plan.frozen_folder]
        frozen.save_pretrained(Path(folder) / plan.frozen_folder, safe_serialization=True)
        return {plan.frozen_folder: ["diffusers", type(frozen).__name__]}

    def sample_size_multiple(self, bundle):
        return self.size_multiple(bundle)

    def size_multiple(self, bundle) -> int:
        """Pixels per patch side: the VAE's spatial factor (8; the Wan 2.2 VAE's 16) x the 2x2 patches."""
        if bundle is None or bundle.vae is None:
            return self.info.pixel_multiple
        return int(getattr(bundle.vae.config, "scale_factor_spatial", None) or 8) * 2

    def check_image_sizes(self, sizes, bundle=None):
        step = self.size_multiple(bundle)
        bad = [f"{w}x{h}" for w, h in sizes if w % step or h % step]
        if bad:
            raise ValueError(
                f"this Wan model takes images whose sides are multiples of {step} px, but the buckets include "
                f"{', '.join(bad[:4])}; set data.resolution and data.bucket_step to multiples of {step}")

    def sampling_scheduler(self, bundle):
        base = bundle.extra.get("scheduler", bundle.noise_scheduler)
        return type(base).from_config(base.config)

    def pipeline_arguments(self, bundle, prompt, guidance_scale):
        return {"prompt": prompt.prompt, "negative_prompt": prompt.negative_prompt or None,
                "guidance_scale": guidance_scale, "max_sequence_length": bundle.text_lengths()[0]}

    def video_arguments(self, frames):
        return {"num_frames": frames}

    def sample_frames(self, result):
        return list(result.frames[0])

    def model_index_extras(self, bundle):
        config = bundle.extra.get("pipeline_config", {})
        two = bundle.extra.get("wan_experts") is not None
        return {**({} if two else {"transformer_2": [None, None]}),
                "boundary_ratio": config.get("boundary_ratio") if two else None,
                "expand_timesteps": bool(config.get("expand_timesteps"))}

    def latent_scale(self, variant: str = ""):
        return 16 if variant == "ti2v-5b" else 8

    def cached_shapes(self, variant: str = "1.3b"):
        """512 UMT5-XXL tokens of 4096 features; 16 latent channels (TI2V 5B: 48)."""
        return 48 if variant == "ti2v-5b" else 16, {"encoder_hidden_states": (TEXT_TOKENS, 4096)}

    def build_demo(self, root=None):
        from .wan_demo import ensure_wan_demo

        return ensure_wan_demo(root)

    # ------------------------------------------------------------------ single files (diffusers' names)

    def recognise_checkpoint(self, keys):
        return super().recognise_checkpoint(keys)

    def layout(self, config, keys):
        return identity_entries(keys)

    def owns_key(self, key):
        return not key.startswith(("vae.", "first_stage_model.", "text_encoders.", "conditioner."))

    def shipped_transformer_config(self, state, variant: str = "1.3b"):
        """The variant's published config; for a file, the depth and widths its weights show."""
        config = shipped("wan", _variant_file(variant))
        if not state:
            return config
        inner, in_channels = state["patch_embedding.weight"].shape[:2]
        return {**config, "num_layers": block_count(state, r"blocks\.(\d+)\."), "in_channels": in_channels,
                "num_attention_heads": inner // config["attention_head_dim"],
                "ffn_dim": state["blocks.0.ffn.net.0.proj.weight"].shape[0],
                "text_dim": state["condition_embedder.text_embedder.linear_1.weight"].shape[1]}

    # ------------------------------------------------------------------ LoRA

    def modelspec_architecture(self, bundle) -> str:
        plan = bundle.extra.get("wan_experts")
        if plan is not None:  # the expert in the name: a LoRA of one loads into that one (transformer_2: low noise)
            return f"wan2.2-t2v-a14b-{plan.trained.replace('_', '-')}"
        if bundle.denoiser.config.in_channels == 48:
            return "wan2.2-ti2v-5b"
        return "wan2.1-t2v-14b" if bundle.denoiser.config.num_layers >= 40 else "wan2.1-t2v-1.3b"

    def lora_modelspec(self, bundle, fmt):
        return {**super().lora_modelspec(bundle, fmt), "modelspec.resolution": "832x480"}

    def kohya_lora_tensors(self, bundle, modules, alphas):
        """`diffusion_model.<original name>.lora_down.weight` / `.lora_up.weight` / `.alpha`."""
        from modules.model.lora import lora_alpha_and_rank, split_peft_key

        tensors = {}
        for component, state in modules.items():
            alpha, _ = lora_alpha_and_rank(bundle, component)
            for key, value in state.items():
                module_path, kind = split_peft_key(key)
                name = LORA_PREFIX + original_module_name(module_path)
                tensors[f"{name}.{'lora_down' if kind == 'lora_A' else 'lora_up'}.weight"] = value
                tensors[f"{name}.alpha"] = torch.tensor(float(alpha))
        return tensors

    def lycoris_module_name(self, bundle, component, module_path):
        """The plain LoRA's names (`diffusion_model.<original name>`): ComfyUI maps no diffusers names for Wan, so
        a variant on a module outside the blocks' linear layers has no name it reads (a ValueError says so)."""
        return LORA_PREFIX + original_module_name(module_path)

    def kohya_names(self, bundle):
        """Every block linear layer's kohya name (what `kohya_lora_tensors` writes), so `training.lora_init` and
        `scripts/convert_lora.py` read Wan's kohya files back."""
        names = {}
        for path, module in bundle.denoiser.named_modules():
            path = path.removesuffix(".base_layer")
            if isinstance(module, torch.nn.Linear) and ".lora_" not in path:
                try:
                    names[LORA_PREFIX + original_module_name(path)] = (bundle.denoiser_name, path)
                except ValueError:
                    continue  # outside the blocks' linear layers: no kohya name
        return names

    # ------------------------------------------------------------------ real-size random models

    def random_bundle(self, device, denoiser_dtype, variant: str = "1.3b"):
        """The variant's real-size transformer (built on `device` in `denoiser_dtype`), an uninitialised
        real-size VAE and a tiny UMT5: the benchmark's cache holds real-size text embeddings."""
        import diffusers

        from modules.model.bundle import ModelBundle

        from .dit_demo import demo_t5_tokenizer
        from .llm_flow import _built
        from .sd import uninitialised
        from .wan_demo import tiny_umt5

        torch.manual_seed(0)
        transformer = _built(diffusers.WanTransformer3DModel, self.shipped_transformer_config({}, variant), device,
                             denoiser_dtype)
        transformer.requires_grad_(False)
        vae_config = shipped("wan", _variant_part("vae", variant))
        vae = uninitialised(lambda: diffusers.AutoencoderKLWan.from_config(vae_config))
        tokenizer = demo_t5_tokenizer()
        scheduler = _scheduler_from(shipped("wan", _variant_part("scheduler", variant)))
        # A14B's trained expert is one 14B transformer; the frozen one is never on the GPU while training.
        return ModelBundle(model_type=self.name, denoiser=transformer, vae=vae, text_encoders=[tiny_umt5(tokenizer, 0)],
                           tokenizers=[tokenizer], noise_scheduler=scheduler, prediction_type=FLOW_MATCHING,
                           source=f"benchmark:random-wan-{variant}",
                           extra={"scheduler": scheduler, "text_lengths": [TEXT_TOKENS]})

    def write_random_model(self, folder, dtype=None, device="cpu", variant: str = "1.3b", configs: dict | None = None):
        """The variant at its real size with random weights (UMT5-XXL included, 5.7 B parameters), built on
        `device` in `dtype` (bf16 by default); the tokenizer is the demo's (its ids fit UMT5's vocabulary).
        `configs`: fields per component (`transformer`, `vae`, `text_encoder`) over the shipped configs - a
        smaller model of the same classes (the tests' tiny one). `a14b`: two experts (`transformer_2` from its own
        seed) and `boundary_ratio` 0.875, as Wan 2.2 T2V A14B; `ti2v-5b`: the Wan 2.2 VAE and `expand_timesteps`."""
        import diffusers
        from transformers import UMT5Config, UMT5EncoderModel

        from modules.model.bundle import ModelBundle
        from modules.model.saving import save_full_diffusers

        from .dit_demo import demo_t5_tokenizer
        from .llm_flow import _built

        dtype, configs = dtype or torch.bfloat16, configs or {}
        torch.manual_seed(0)
        transformer = _built(diffusers.WanTransformer3DModel,
                             {**self.shipped_transformer_config({}, variant), **configs.get("transformer", {})}, device,
                             dtype)
        extra = {"pipeline_config": {"boundary_ratio": None, "expand_timesteps": variant == "ti2v-5b"}}
        if variant == "a14b":
            torch.manual_seed(1)
            low_noise = _built(diffusers.WanTransformer3DModel, dict(transformer.config), device, dtype)
            extra = {"wan_experts": ExpertPlan("high_noise", BOUNDARY_RATIO),
                     "frozen_modules": {"transformer_2": low_noise},
                     "pipeline_config": {"boundary_ratio": BOUNDARY_RATIO, "expand_timesteps": False}}
        vae_config = {**shipped("wan", _variant_part("vae", variant)), **configs.get("vae", {})}
        vae = _built(diffusers.AutoencoderKLWan, vae_config, device, dtype)
        text_fields = {**shipped("wan", "text_encoder"), **configs.get("text_encoder", {})}
        text_config = UMT5Config(**{k: v for k, v in text_fields.items() if not k.startswith("_")})
        encoder = _built(lambda: UMT5EncoderModel(text_config), None, device, dtype)
        scheduler = _scheduler_from(shipped("wan", _variant_part("scheduler", variant)))
        bundle = ModelBundle(model_type=self.name, denoiser=transformer, vae=vae, text_encoders=[encoder],
                             tokenizers=[demo_t5_tokenizer()], noise_scheduler=scheduler, prediction_type=FLOW_MATCHING,
                             source=f"random-wan-{variant}", extra={"scheduler": scheduler, **extra})
        return save_full_diffusers(bundle, Path(folder), dtype)


def _variant_file(variant: str) -> str:
    variants = {"1.3b": "transformer", "14b": "transformer_14b", "a14b": "transformer_a14b",
                "ti2v-5b": "transformer_ti2v-5b"}
    if variant not in variants:
        raise ValueError(f"Wan has no variant {variant!r}; use one of {', '.join(variants)}")
    return variants[variant]


def _variant_part(part: str, variant: str) -> str:
    """The shipped config of `part` for `variant`: its own (`vae_ti2v-5b`) where it has one."""
    return f"{part}_{variant}" if (CONFIG_DIR / "wan" / f"{part}_{variant}.json").is_file() else part


def _scheduler(folder: Path):
    """The scheduler of a diffusers folder, of the class its config names."""
    import diffusers

    config = json.loads((folder / "scheduler_config.json").read_text())
    return getattr(diffusers, config["_class_name"]).from_pretrained(folder)


def _scheduler_from(config: dict):
    import diffusers

    return getattr(diffusers, config["_class_name"]).from_config(config)
