"""Which config fields the GUI shows: a field that does nothing for the edited config is hidden.

Tk-free, so the rule is tested without a display. Today the rule is the model family's: SD-only
settings (prediction type, min-SNR) disappear for SD3 and Flux, their settings (T5 length, timestep
distribution, Flux guidance, the components folder) for the SD families. The family comes from the
config without loading anything (`families.registry.guess_family`); while it is unknown, every field shows.
"""
from __future__ import annotations

from modules.config import TrainConfig
from modules.families.registry import family_fields, field_applies, guess_family


def hidden_fields(cfg: TrainConfig) -> set[str]:
    """Field paths that do not apply to `cfg` (a field with a validation problem is shown regardless:
    the view keeps those visible so the problem can be fixed)."""
    family = guess_family(cfg.model.base_model, cfg.model.model_type)
    return {path for path in family_fields() if not field_applies(path, family)}
