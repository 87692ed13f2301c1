"""Kill trainings at random moments (a rank, or everything mid-backup) and check nothing was lost.

    python scripts/fault_trials.py --trials 10            # 10 of each kind, CPU processes over gloo

See modules/benchmark/fault_trials.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modules.benchmark.fault_trials import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
