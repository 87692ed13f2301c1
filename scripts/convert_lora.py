"""Rewrite a LoRA file that Tandem wrote (any version) in today's layout.

    python scripts/convert_lora.py OLD.safetensors NEW.safetensors --base-model MODEL [--format kohya|peft]

SDXL LoRAs from earlier Tandem versions name UNet modules the diffusers way; A1111/Forge expect the
original names that kohya sd-scripts writes. The base model is the one the LoRA was trained on.
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
    p.add_argument("--format", choices=["kohya", "peft"], default="kohya")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    a = p.parse_args()
    from modules.model.lora_convert import convert_lora_file
    print(convert_lora_file(a.source, a.target, a.base_model, a.format, a.dtype))
