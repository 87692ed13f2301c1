"""Launch-to-exit timing of a whole training job on 1..N GPUs, for one or more source trees.

    python scripts/end_to_end.py --job sd15 --base-model /tmp/sd15 --make-model --data /tmp/e2e-data --make-data \
        --run new@.:1 --run new@.:2 --run new@.:4
    python scripts/end_to_end.py --job sdxl --base-model /tmp/sdxl --make-model --data /tmp/e2e-sdxl --make-data \
        --run new@.:1 --run new@.:2

See modules/benchmark/end_to_end.py and scripts/gpu/end_to_end.sh.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modules.util.compile_cache import keep_compile_cache  # noqa: E402

keep_compile_cache()  # before diffusers is imported; the training processes inherit it

from modules.benchmark.end_to_end import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
