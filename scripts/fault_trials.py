"""Kill trainings at random moments - a rank, a DataLoader worker, torchrun's agent, the launcher, everything
mid-backup - or freeze a rank, and check that the job ends (or restarts) naming the right rank and loses nothing.

    python scripts/fault_trials.py --trials 10            # rank and backup kinds, 10 each, CPU processes over gloo
    python scripts/fault_trials.py --trials 1 --kind loader --kind stuck --kind agent --kind launcher --table

See modules/benchmark/fault_trials.py; scripts/gpu/faults.sh runs every kind on GPUs.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modules.util.compile_cache import keep_compile_cache  # noqa: E402

keep_compile_cache()  # before diffusers is imported; the training processes inherit it

from modules.benchmark.fault_trials import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
