"""Write a real-size diffusers folder of any family with random weights (offline GPU checks).

    python scripts/make_random_model.py --type sd1 --out /tmp/random-sd15
    python scripts/make_random_model.py --type flux --out /tmp/random-flux --device cuda   # 12 B + T5-XXL: ~33 GB
    python scripts/make_random_model.py --type chroma --out /tmp/random-chroma --device cuda   # 8.9 B + T5-XXL: ~27 GB
    python scripts/make_random_model.py --type flux2 --variant klein-4b --out /tmp/random-klein4b --device cuda
    python scripts/make_random_model.py --type flux2 --out /tmp/random-flux2-dev --device cuda   # 32 B + 24 B: ~113 GB
    python scripts/make_random_model.py --type qwen --out /tmp/random-qwen --device cuda   # 20.4 B + Qwen2.5-VL 7B: ~58 GB
    python scripts/make_random_model.py --type zimage --out /tmp/random-zimage --device cuda   # 6.2 B + Qwen3 4B: ~21 GB
    python scripts/make_random_model.py --type wan --out /tmp/random-wan --device cuda   # 1.3B + UMT5-XXL 5.7 B: ~14 GB
    python scripts/make_random_model.py --type wan --variant 14b --out /tmp/random-wan14b --device cuda   # 14 B + 5.7 B: ~41 GB
    python scripts/make_random_model.py --type wan --variant a14b --out /tmp/random-wan22 --device cuda   # 2 x 14 B + 5.7 B: ~69 GB
    python scripts/make_random_model.py --type wan --variant ti2v-5b --out /tmp/random-ti2v --device cuda   # 5 B + 5.7 B: ~23 GB
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from modules.families.registry import FAMILIES, MODEL_TYPES
    p.add_argument("--type", choices=MODEL_TYPES, default="sd1")
    sizes = "; ".join(f"{name}: {', '.join(info.variants)}" for name, info in FAMILIES.items() if info.variants)
    p.add_argument("--variant", default="", help=f"a published size of the family ({sizes})")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], help="saved dtype (default: fp16; sd3/flux bf16)")
    p.add_argument("--device", default="cpu", help="where to initialise the weights (cuda is much faster for flux)")
    a = p.parse_args()
    from modules.benchmark.synthetic import write_random_model
    from modules.model.files import SAVE_DTYPES
    print(write_random_model(a.type, a.out, SAVE_DTYPES[a.dtype] if a.dtype else None, a.device, a.variant))
