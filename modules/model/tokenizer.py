"""CLIP tokenizers built offline from the BPE table shipped in `configs/tokenizer/`.

SD 1.x, SD 2.x and both SDXL encoders share one vocabulary (OpenAI CLIP's byte-level BPE). The hub
stores it as `vocab.json` + `merges.txt`; both are derived mechanically from the original
`bpe_simple_vocab_16e6.txt.gz`, so we ship that one file and derive them here, the way OpenAI's
`simple_tokenizer.py` does. The result is the standard ViT-L/14 tokenizer: 49408 tokens,
`<|startoftext|>` = 49406, `<|endoftext|>` = 49407.
"""

from __future__ import annotations

import functools
import gzip
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import CLIPTokenizer

BPE_FILE = Path(__file__).parent / "configs" / "tokenizer" / "bpe_simple_vocab_16e6.txt.gz"
BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
# OpenCLIP (SD 2.x, SDXL's second encoder) pads with "!" (id 0) instead of the end token; the diffusers
# folders of those models record it the same way in their tokenizer config.
OPEN_CLIP_PAD_TOKEN = "!"
MAX_LENGTH = 77
# 49152 lines minus the header, the 256 byte tokens and the 2 special tokens: the merges CLIP trained with.
_MERGE_COUNT = 49152 - 256 - 2


def bytes_to_unicode() -> dict[int, str]:
    """CLIP's reversible byte -> printable character table (byte-level BPE never sees whitespace/control bytes)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shift)
            shift += 1
    return dict(zip(printable, (chr(c) for c in chars)))


@functools.lru_cache(maxsize=1)
def _vocab_and_merges() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    if not BPE_FILE.is_file():
        raise FileNotFoundError(
            f"CLIP vocabulary {BPE_FILE} is missing; it ships with Tandem - reinstall or restore the file from git."
        )
    lines = gzip.decompress(BPE_FILE.read_bytes()).decode("utf-8").split("\n")
    merges = tuple(tuple(line.split()) for line in lines[1 : 1 + _MERGE_COUNT])
    byte_chars = list(bytes_to_unicode().values())
    tokens = byte_chars + [c + "</w>" for c in byte_chars] + ["".join(m) for m in merges] + [BOS_TOKEN, EOS_TOKEN]
    return {token: index for index, token in enumerate(tokens)}, merges


def clip_tokenizer(pad_token: str = EOS_TOKEN) -> CLIPTokenizer:
    """The standard CLIP tokenizer (max length 77). `pad_token`: `<|endoftext|>` for OpenAI CLIP (SD 1.x,
    SDXL's first encoder), `"!"` (`OPEN_CLIP_PAD_TOKEN`) for OpenCLIP (SD 2.x, SDXL's second encoder)."""
    vocab, merges = _vocab_and_merges()
    if pad_token not in vocab:
        raise ValueError(
            f"pad_token {pad_token!r} is not in the CLIP vocabulary; use {EOS_TOKEN!r} or {OPEN_CLIP_PAD_TOKEN!r}."
        )
    # Imported here: the launcher's model check reaches this module (through the demo model's byte table)
    # and had no use for transformers, whose import took 1-2.5 s on H100 hosts (2026-11-27).
    from transformers import CLIPTokenizer

    return CLIPTokenizer(
        vocab=dict(vocab),
        merges=list(merges),
        unk_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=pad_token,
        model_max_length=MAX_LENGTH,
    )
