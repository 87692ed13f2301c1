"""The sample prompts' text embeddings, encoded once while the text encoders are on the GPU for the cache.

With the text cached, frozen text encoders wait in host memory (`trainer/caching.offload_cached_encoders`).
Bringing them to the GPU and back for a sampling is costly: Flux.1's and SD3's T5-XXL is 9.5 GB each way, part of
the 11-18 s a Flux.1 sampling spent besides rendering on H200s (2026-11-28, the Flux.1-size job in the git
history of docs/Performance.md). For a family whose pipeline takes embeddings instead of prompts
(`ModelFamily.samples_from_embeddings`) the trainer encodes every sample text - the prompts, and the negative
prompts where the family guides with them - at the end of the cache phase (`encode_sample_texts`) and keeps them
(a few MB) in host memory. A sampling whose texts are all there moves the VAE only; a text that is not (no text
cache, or a family that does not take embeddings) is encoded by the pipeline as before, with the encoders brought
to the GPU for it.
"""
from __future__ import annotations

from typing import Sequence

import torch

KEY = "sample_texts"
"""`bundle.extra[KEY]`: sample text -> the family's `encode_text` of it ([1, ...] tensors in host memory)."""


def encode_sample_texts(bundle, sampling_cfg) -> int:
    """Encode every text the run's samplings need (a family that samples from embeddings, frozen text encoders)
    and keep them in the bundle; returns how many texts were encoded."""
    family = bundle.family
    if not family.samples_from_embeddings or not sampling_cfg.prompts or not bundle.text_encoders:
        return 0
    if any(p.requires_grad for encoder in bundle.text_encoders for p in encoder.parameters()):
        return 0  # a trained encoder's embeddings change with every step: samples encode with it as it is then
    texts = family.texts_for_samples(sampling_cfg.prompts, sampling_cfg.guidance_scale)
    with torch.no_grad():
        # Kept in host memory (4 MB a text for T5-XXL's 512 tokens): a run with many prompts holds no GPU memory.
        bundle.extra[KEY] = {text: {key: value.cpu() for key, value in family.encode_text(bundle, [text]).items()}
                             for text in texts}
    return len(texts)


def texts_ready(bundle, prompts: Sequence, guidance_scale: float) -> bool:
    """Whether sampling `prompts` at `guidance_scale` needs no text encoder: the family takes embeddings and
    every text it would encode is kept."""
    family = bundle.family
    if not family.samples_from_embeddings:
        return False
    kept = bundle.extra.get(KEY, {})
    return all(text in kept for text in family.texts_for_samples(prompts, guidance_scale))


def sample_text(bundle, text: str) -> dict[str, torch.Tensor]:
    """The family's `encode_text` of `text`: kept from the start where it was encoded then, else encoded now
    (which needs the text encoders where they can run)."""
    kept = bundle.extra.get(KEY, {}).get(text)
    if kept is None:
        return bundle.family.encode_text(bundle, [text])
    return {key: value.to(bundle.device) for key, value in kept.items()}
