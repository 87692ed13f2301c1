"""Time the placement and encoding of Qwen-Image's or Z-Image's text encoder at its real size (random weights).

    python scripts/benchmark_text_encoder.py --family qwen --placement gpu|fp8|offload
    torchrun --nproc_per_node=2 scripts/benchmark_text_encoder.py --family qwen --placement sharded
    python scripts/benchmark_text_encoder.py --family zimage --tiny --device cpu   # smoke test

See modules/benchmark/text_placement.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from modules.benchmark.text_placement import main

    raise SystemExit(main())
