"""Write a real-size SD1/SD2/SDXL diffusers folder with random weights (offline GPU checks, benchmarks).

    python scripts/make_random_model.py --type sd1 --out /tmp/random-sd15
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--type", choices=["sd1", "sd2", "sdxl"], default="sd1")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    from modules.benchmark.synthetic import write_random_model
    print(write_random_model(a.type, a.out))
