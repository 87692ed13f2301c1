"""Rewrite a LoRA file in the layout a program applies exactly, or in today's layout of a format.

    python scripts/convert_lora.py OLD.safetensors NEW.safetensors --base-model MODEL --for comfyui|diffusers
    python scripts/convert_lora.py OLD.safetensors NEW.safetensors --base-model MODEL --format kohya|peft

`--for comfyui` writes kohya's/LyCORIS's names with an `.alpha` tensor per module (ComfyUI takes alpha from
there only: a diffusers/peft file, whose alpha is in its header, loads there at alpha / rank = 1) and DoRA's
magnitudes as `dora_scale`; `--for diffusers` writes peft's layout, alpha in the header. SDXL LoRAs from earlier
Tandem versions name UNet modules the diffusers way; `--format kohya` gives the original names A1111/Forge
expect. The base model is the one the LoRA was trained on. docs/Models.md has the table of who reads what.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source")
    p.add_argument("target")
    p.add_argument("--base-model", required=True, help="diffusers folder, single file or builtin:demo")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--for", dest="client", choices=["comfyui", "diffusers"],
                       help="write the layout this program applies exactly")
    which.add_argument("--format", choices=["kohya", "peft"], help="write this layout (default: kohya)")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    a = p.parse_args()
    from modules.model.lora_convert import convert_and_describe
    try:
        path, note = convert_and_describe(a.source, a.target, a.base_model,
                                          None if a.client else a.format or "kohya", a.dtype, a.client)
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"convert_lora.py: {error}")
    print(path)
    print(note)
