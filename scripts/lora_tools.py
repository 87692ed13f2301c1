"""Merge a LoRA into its base model, resize a LoRA's rank, extract a LoRA from a fine-tune and its base.

    python scripts/lora_tools.py merge --base-model MODEL --lora LORA.safetensors --out MERGED[.safetensors]
    python scripts/lora_tools.py resize --lora LORA.safetensors --out SMALLER.safetensors --rank 8
    python scripts/lora_tools.py extract --base-model BASE --tuned-model TUNED --out LORA.safetensors --rank 32

`--help` after a command lists its options (modules/model/lora_tools_cli.py). Exit status 2 with one line
when the input is wrong.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from modules.model.lora_tools_cli import main
    sys.exit(main())
