"""Load a base model into a `ModelBundle`, build the demo model, add LoRA, save outputs, render samples.

Heavy libraries (diffusers, transformers, peft) are imported inside the functions that need them,
so importing this package stays cheap for the GUI and the launchers.
"""
from .bundle import MODEL_TYPES, ModelBundle
from .demo import default_demo_root, ensure_demo_model
from .loading import frozen_dtypes, load_model, load_vae
from .lora import add_lora, lora_state_dict, save_lora
from .sampling import render_samples
from .saving import save_full_diffusers, save_full_single_file

__all__ = [
    "MODEL_TYPES", "ModelBundle", "add_lora", "default_demo_root", "ensure_demo_model", "frozen_dtypes",
    "load_model", "load_vae", "lora_state_dict", "render_samples", "save_full_diffusers",
    "save_full_single_file", "save_lora",
]
