"""Text encoders too large to keep beside the transformer: read only to fill the text cache, then let go.

Qwen-Image's text encoder is Qwen2.5-VL 7B (16.6 GB in bf16), Z-Image's Qwen3 4B (8 GB). They never train,
and in training their one use is to turn captions into embeddings, which the text cache keeps. So the
families marked `text_apart` (modules/families/registry.py) load no text encoder with the model: the
bundle holds a `TextSide` instead - where the encoder's weights are, in which dtype it runs, the tokenizer,
and how the family encodes with it - and

- the trainer fills the text cache with it before the transformer loads, placing it as
  `model.text_encoder_placement` says (`modules/trainer/text_encoding.py`), then frees it;
- everything after that reads the cache: training steps, the validation loss, and samples (the sample
  prompts are cached too, `TextSide.cached`, and reach the pipeline as `prompt_embeds`);
- `encode` of a caption that is not cached (a script, a test) loads the encoder on the CPU on first use.

A run whose cache is complete never calls `load`: `LOADS` counts the calls (the test of that property).

Embeddings are variable-length: each caption keeps its own tokens (`encoder_hidden_states` [B, L, D]) with
`encoder_attention_mask` [B, L] (1 = a token, 0 = padding), padded with zeros to the longest of the batch -
the layout of the pipelines' `prompt_embeds` / `prompt_embeds_mask`. Batches of cached entries are padded
the same way (`modules.data.dataset.pad_and_stack`).
"""
from __future__ import annotations

import gc
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from modules.families.text_encoders import kept_weight

log = logging.getLogger("tandem")

HIDDEN, MASK = "encoder_hidden_states", "encoder_attention_mask"
"""The names of a caption's embedding and its token mask in the text cache and in `text` batches."""

LOADS = 0
"""How many times any `TextSide` has read its text encoder's weights in this process."""

FLOAT8 = "fp8"

EncodeFn = Callable[[nn.Module, Any, Sequence[str], torch.device], dict[str, torch.Tensor]]
"""(the runnable encoder, tokenizer, captions, device to run on) -> {HIDDEN, MASK}, as the family's pipeline."""


@dataclass
class TextSide:
    """A family's text encoder, not loaded: what `load` reads and how `encode` uses it."""

    folder: Path
    """The diffusers folder that holds `text_encoder/` (a single file's `model.components_folder`)."""
    class_name: str
    """The transformers class of `text_encoder/` (from the folder's model_index.json)."""
    storage: str
    """`model.text_encoder_dtype`: fp32, bf16, fp16, or fp8 (Linear weights in float8, computed in bf16)."""
    tokenizer: Any
    encode_fn: EncodeFn
    runnable: Callable[[nn.Module], nn.Module]
    """The part of the loaded model that encodes (Qwen2.5-VL: its language model without the vision tower
    and the LM head); the rest is dropped as soon as it is read."""
    layers: Callable[[nn.Module], list[nn.Module]]
    """The runnable's repeated decoder layers (what sharding and offloading place one by one)."""
    encoder: nn.Module | None = None
    """The runnable encoder while it is loaded (`load` / a placement), else None."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the loaded encoder computes (an offloaded encoder's weights live elsewhere)."""
    cached: dict[str, Path] = field(default_factory=dict)
    """Caption -> its text-cache entry, for captions `encode` reads instead of encoding (sample prompts)."""

    def describe(self) -> dict:
        """What the embeddings depend on besides the folder's files (part of the cache key)."""
        return {"class": self.class_name, "storage": self.storage}

    def compute_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "fp16": torch.float16}.get(self.storage, torch.bfloat16)

    def parameter_bytes(self) -> int:
        """The loaded runnable's size in `storage`, from the safetensors headers (no weight is read)."""
        per = {"fp32": 4, "fp16": 2, "bf16": 2, FLOAT8: 1}[self.storage]
        return sum(numel for name, numel in _tensor_sizes(self.folder / "text_encoder").items()
                   if kept_weight(self.class_name, name)) * per

    def load(self, device: torch.device | str = "cpu") -> nn.Module:
        """Read the encoder (counted in `LOADS`), keep its runnable part, in `storage`, on `device`, frozen."""
        global LOADS
        import transformers

        LOADS += 1
        cls = getattr(transformers, self.class_name)
        dtype = self.compute_dtype()
        model = cls.from_pretrained(self.folder, subfolder="text_encoder", dtype=dtype, local_files_only=True)
        runnable = self.runnable(model)
        del model
        runnable.requires_grad_(False).eval()
        if self.storage == FLOAT8:
            from modules.model.float8 import store_linear_weights_in_float8
            store_linear_weights_in_float8(runnable, "the text encoder")
        return runnable.to(device)

    def encode(self, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        """{HIDDEN [B, L, D], MASK [B, L]} for `captions`: from the cache where all are cached (samples),
        else from the encoder (loaded on the CPU on first use when no placement holds it)."""
        if captions and all(c in self.cached for c in captions):
            from safetensors.torch import load_file

            from modules.data.dataset import pad_and_stack
            entries = [load_file(str(self.cached[c])) for c in captions]
            return {key: pad_and_stack([e[key] for e in entries]) for key in entries[0]}
        if self.encoder is None:
            log.info("Loading the text encoder on the CPU to encode %d caption(s) that are not cached.", len(captions))
            self.encoder = self.load("cpu")
            self.device = torch.device("cpu")
        with torch.no_grad():
            return self.encode_fn(self.encoder, self.tokenizer, list(captions), self.device)

    def release(self) -> None:
        """Let go of the loaded encoder and its memory."""
        self.encoder = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def text_encoder_class(folder: Path) -> str:
    """The transformers class of a folder's `text_encoder`, as its model_index.json names it."""
    index = folder / "model_index.json"
    entry = json.loads(index.read_text(encoding="utf-8")).get("text_encoder") if index.is_file() else None
    if not entry or not entry[1]:
        config = json.loads((folder / "text_encoder" / "config.json").read_text(encoding="utf-8"))
        return (config.get("architectures") or [""])[0]
    return entry[1]


def output_of(layer: nn.Module, run: Callable[[], Any]) -> torch.Tensor:
    """The hidden states `layer` returns while `run()` runs the encoder. (transformers' `output_hidden_states`
    records them by the layers' classes, which FSDP's sharding replaces: no hidden states come back from a
    sharded encoder. A hook on the layer itself works under every placement.)"""
    found = []
    handle = layer.register_forward_hook(lambda module, args, output: found.append(
        output[0] if isinstance(output, tuple) else output))
    try:
        run()
    finally:
        handle.remove()
    return found[-1]


def masked_rows(hidden: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Each row's own tokens (where `mask` is set), as the pipelines select them."""
    return [row[keep.bool()] for row, keep in zip(hidden, mask)]


def padded(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """{HIDDEN, MASK} of variable-length rows [L_i, D], zero-padded to the longest."""
    longest = max(row.shape[0] for row in rows)
    hidden = rows[0].new_zeros(len(rows), longest, rows[0].shape[-1])
    mask = torch.zeros(len(rows), longest, dtype=torch.long, device=rows[0].device)
    for i, row in enumerate(rows):
        hidden[i, :row.shape[0]] = row
        mask[i, :row.shape[0]] = 1
    return {HIDDEN: hidden, MASK: mask}


def trimmed(text: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """(hidden states cut to the batch's longest caption, their bool mask - None where no caption is padded, as
    the pipelines pass it -, each caption's token count). A batch of cached entries is padded to its longest
    *entry*, which may hold padding of its own encoding batch. One host sync, for the counts."""
    lengths = [int(n) for n in text[MASK].sum(dim=1).tolist()]
    longest = max(1, max(lengths))
    mask = None if all(n == longest for n in lengths) else text[MASK][:, :longest].bool()
    return text[HIDDEN][:, :longest], mask, lengths


def _tensor_sizes(folder: Path) -> dict[str, int]:
    """Tensor name -> element count of every .safetensors file in `folder`, from the headers alone."""
    import math

    sizes = {}
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        sizes.update({name: math.prod(info["shape"]) for name, info in header.items() if name != "__metadata__"})
    return sizes


def runnable_part(model: nn.Module, kind) -> nn.Module:
    """The part of a loaded language model (a `text_encoders.TextEncoderKind`) that encodes: its decoder stack
    (the inner `.model` of a `...ForCausalLM`), without the parts the kind names as `dropped` (an LM head,
    Qwen2.5-VL's vision tower)."""
    inner = getattr(model, "model", model)
    for unused in kind.dropped:
        if hasattr(inner, unused):
            delattr(inner, unused)
    return inner


def decoder_layers(encoder: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers of a runnable language model (of a multimodal one: its language model's)."""
    return list(getattr(encoder, "language_model", encoder).layers)
