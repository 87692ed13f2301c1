"""Compare the newest backups of several runs in one folder (sharded or not): one JSON line with the
relative L2 distance of every run's trained weights to the first run's.

    python3 scripts/gpu/compare_backups.py /tmp/fsdp-e2e two four one
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from modules.trainer.backup import latest_backup  # noqa: E402
from modules.trainer.sharded_backup import read_trained_weights  # noqa: E402


def relative_l2(a: dict, b: dict) -> float:
    diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    return (diff / sum(float(b[k].double().pow(2).sum()) for k in b)) ** 0.5


def main(root: str, first: str, *others: str) -> None:
    newest = {run: latest_backup(Path(root) / run / "backups") for run in (first, *others)}
    weights = {run: read_trained_weights(info.path) for run, info in newest.items()}
    print(json.dumps({"check": "backups_compared", "reference": first,
                      "steps": {run: info.step for run, info in newest.items()},
                      "relative_l2": {run: relative_l2(weights[run], weights[first]) for run in others}}))


if __name__ == "__main__":
    main(*sys.argv[1:])
