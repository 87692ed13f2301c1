"""Exponential moving average of the trained weights."""
from __future__ import annotations

import contextlib

import torch

from modules.util.layout import in_layout_of


class EMA:
    def __init__(self, params: list[torch.nn.Parameter], decay: float) -> None:
        self.params = params
        self.decay = decay
        self.shadow = [p.detach().clone().float() for p in params]

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in self.params], 1.0 - self.decay)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": list(self.shadow)}  # live tensors: a backup snapshots them

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        # In the parameter's memory layout, whatever layout the backup holds (training.channels_last).
        self.shadow = [in_layout_of(p, t) for t, p in zip(state["shadow"], self.params)]

    @contextlib.contextmanager
    def swapped_in(self):
        """The model holds the EMA weights inside the block (for saving/sampling), its own weights after."""
        with torch.no_grad():
            backup = [p.detach().clone() for p in self.params]
            for p, s in zip(self.params, self.shadow):
                p.copy_(s.to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self.params, backup):
                    p.copy_(b)
