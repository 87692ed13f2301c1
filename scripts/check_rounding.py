"""How far rounding carries: N processes x B against 1 x N*B, beside a thread-count control, runs that train
something else (another micro-batch, no latent cache) and the scale of one float32 ulp, on CPU processes;
docs/Performance.md, "The same training on N GPUs".

    python scripts/check_rounding.py /tmp/rounding --steps 20             # the demo's own AdamW
    python scripts/check_rounding.py /tmp/rounding-sgd --steps 5 --sgd    # as the equivalence tests train
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modules.util.compile_cache import keep_compile_cache  # noqa: E402

keep_compile_cache()  # before diffusers is imported; the training processes inherit it

from modules.benchmark.rounding import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
