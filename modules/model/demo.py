"""The built-in demo model: a tiny Stable-Diffusion-1-shaped diffusers folder, built locally.

It lets every part of Tandem (training loop, multi-GPU, saving, sampling, GUI) run end to end on a
laptop CPU in seconds and without downloading anything. It is built from a fixed seed, so every
build is byte-for-byte the same, and written once into a cache folder that `load_model` then reads
like any other diffusers model.

The UNet and text encoder have random weights (training starts from scratch). The VAE is a real,
if crude, autoencoder set up by hand (`demo_vae.py`): latents are 8x8 colour thumbnails and decode
back to them, so the samples show what the UNet has learned - the prompted colours and shapes.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch

from modules.model.tokenizer import bytes_to_unicode
from modules.util.atomic import build_folder_once

DEMO_MODEL_VERSION = 3
"""Bump when the demo model's architecture or weights change; the marker file records it."""

_MARKER_FILE = "tandem_demo.json"
_SEED = 1234
_REPO_ROOT = Path(__file__).resolve().parents[2]

# Words of the demo captions ("a red circle on a blue background", ...). Each gets whole-word BPE
# merges so that captions tokenize to one token per word; any other text still tokenizes, byte by byte.
DEMO_WORDS = (
    "a", "an", "the", "on", "in", "of", "and", "with", "at", "to", "photo", "picture", "image",
    "background", "shape", "shapes", "small", "large", "big", "tiny", "left", "right", "top",
    "bottom", "center", "centre", "middle", "corner", "red", "green", "blue", "yellow", "orange",
    "purple", "pink", "white", "black", "gray", "grey", "brown", "cyan", "magenta", "teal",
    "circle", "square", "triangle", "rectangle", "star", "ellipse", "diamond", "hexagon", "cross",
    "ring", "dot", "line", "stripe", "stripes", "bright", "dark", "light", "plain", "simple",
)


def default_demo_root(name: str = "demo-model") -> Path:
    """Where a built-in model lives: `$TANDEM_HOME/<name>`, else `<repo>/.cache/<name>`
    (`demo-model` for `builtin:demo`)."""
    home = os.environ.get("TANDEM_HOME")
    return Path(home) / name if home else _REPO_ROOT / ".cache" / name


def ensure_demo_model(root: Path | None = None) -> Path:
    """Return the demo model folder, building it first if it does not exist yet.

    Safe to call from several processes at once (e.g. every rank of a multi-GPU run): each builds
    into its own temporary folder and renames it into place; a caller that loses the race deletes
    its copy and uses the finished one, so nobody ever reads a half-written folder.
    """
    return ensure_built_model(Path(root) if root is not None else default_demo_root(), _build_into)


def ensure_built_model(root: Path, build_into: Callable[[Path], None]) -> Path:
    """A built-in model folder at `root`, built by `build_into(folder)` unless a complete one of this
    `DEMO_MODEL_VERSION` is there (the marker file says). A folder there that is no built-in model is
    refused, never deleted."""
    if _is_complete(root):
        return root
    if root.exists() and not (root / _MARKER_FILE).is_file():
        raise RuntimeError(
            f"{root} exists but is not a Tandem demo model (it has no {_MARKER_FILE}). "
            "Delete that folder or point TANDEM_HOME elsewhere; the demo model is rebuilt automatically."
        )

    def build_and_mark(folder: Path) -> None:
        build_into(folder)
        # transformers writes a model only on rank 0 of a process group: a build elsewhere would leave empty parts.
        empty = sorted(p.name for p in folder.iterdir() if p.is_dir() and not any(p.iterdir()))
        if empty:
            raise RuntimeError(f"building the built-in model at {root} left {', '.join(empty)} empty (a process other "
                               "than rank 0 of a running process group cannot write it); build it in one process "
                               "first: any one-process run with this base model builds it")
        # Written last: its presence (after the atomic rename) means the folder is complete.
        (folder / _MARKER_FILE).write_text(json.dumps({"version": DEMO_MODEL_VERSION, "seed": _SEED}, indent=2))

    return build_folder_once(root, build_and_mark, _is_complete)


def _is_complete(root: Path) -> bool:
    marker = root / _MARKER_FILE
    if not marker.is_file():
        return False
    return json.loads(marker.read_text()).get("version") == DEMO_MODEL_VERSION


def _build_into(folder: Path) -> None:
    from diffusers import StableDiffusionPipeline

    tokenizer_dir = folder / "_tokenizer_source"
    tokenizer = _write_and_load_tokenizer(tokenizer_dir)
    text_encoder = _text_encoder(tokenizer)
    unet = _unet()
    vae = _vae()
    pipeline = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=_scheduler(),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipeline.save_pretrained(folder, safe_serialization=True)
    # Keep the classic vocab.json + merges.txt beside tokenizer.json so that older transformers
    # versions (whose slow CLIPTokenizer reads only those) load the folder too.
    for name in ("vocab.json", "merges.txt"):
        shutil.move(tokenizer_dir / name, folder / "tokenizer" / name)
    shutil.rmtree(tokenizer_dir)


def _write_and_load_tokenizer(folder: Path):
    """Write a CLIP BPE vocabulary of our own (no download) and load it with `CLIPTokenizer`."""
    from transformers import CLIPTokenizer

    vocab, merges = _demo_bpe()
    folder.mkdir(parents=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=0), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    # local_files_only is written into tokenizer_config.json; fixing it keeps builds byte-identical.
    return CLIPTokenizer.from_pretrained(folder, model_max_length=77, local_files_only=True)


def _demo_bpe() -> tuple[dict[str, int], list[str]]:
    """Base alphabet (each byte alone and as word end) + left-to-right merges for each demo word."""
    alphabet = list(bytes_to_unicode().values())
    tokens = alphabet + [c + "</w>" for c in alphabet]
    merges: list[str] = []
    for word in DEMO_WORDS:
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        while len(parts) > 1:
            merged = parts[0] + parts[1]
            pair = f"{parts[0]} {parts[1]}"
            if pair not in merges:
                merges.append(pair)
            if merged not in tokens:
                tokens.append(merged)
            parts = [merged] + parts[2:]
    # Special tokens last, so that end-of-text has the highest id (CLIP pools at argmax(input_ids)).
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {token: index for index, token in enumerate(tokens)}, merges


def _text_encoder(tokenizer):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(_SEED)
    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=64,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModel(config).eval()


def _unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(_SEED + 1)
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=64,
        attention_head_dim=4, norm_num_groups=32,
    )


def _vae():
    """The thumbnail-codec VAE, its `scaling_factor` giving the colour latents unit variance.

    SD scales latents to roughly unit variance (0.18215). Our latent channels are block-average
    colours, and a demo image is mostly flat palette colour, so the spread of the palette's colour
    components (as pixels in [-1, 1]) is the spread of the latents.
    """
    from modules.data.demo_dataset import COLOURS

    from .demo_vae import build_demo_vae

    palette = torch.tensor(list(COLOURS.values()), dtype=torch.float64) / 127.5 - 1.0
    return build_demo_vae(scaling_factor=round(1.0 / palette.std().item(), 5))


def _scheduler():
    from diffusers import DDPMScheduler

    return DDPMScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type="epsilon", clip_sample=False, steps_offset=1,
    )
