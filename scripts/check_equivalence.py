"""Check that N GPUs x batch B train what 1 GPU x batch N*B trains (any N, real launch paths).

    python scripts/check_equivalence.py --config-path '#demo' --num-gpus 2 --batch 4
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modules.util.compile_cache import keep_compile_cache  # noqa: E402

keep_compile_cache()  # before diffusers is imported; the training processes inherit it

from modules.benchmark.equivalence import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
