"""Compare the newest backups of several runs in one folder (sharded or not): one JSON line with the
relative L2 distance of every run's trained weights to the first run's.

    python3 scripts/gpu/compare_backups.py /tmp/fsdp-e2e two four one
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from modules.benchmark.equivalence import compare_backups  # noqa: E402

if __name__ == "__main__":
    print(json.dumps(compare_backups(*sys.argv[1:])))
