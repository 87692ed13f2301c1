#!/usr/bin/env bash
# Start the Tandem GUI. First use creates .venv and installs Tandem (./install.sh); later starts
# skip that unless pyproject.toml changed. Extra arguments go to scripts/train_ui.py.
set -euo pipefail
cd "$(dirname "$0")"
./install.sh
exec .venv/bin/python scripts/train_ui.py "$@"
