"""Train on remote machines over SSH: `python scripts/train_remote.py --host user@host --config-path X.json`.

Starts the run detached on the remote (it survives this terminal closing), follows its log, and fetches
the model, samples and TensorBoard logs when it ends; `--attach`, `--stop`, `--fetch`, `--list`,
`--check`, `--tensorboard` act on runs already there. See docs/Remote.md.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modules.remote.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
