#!/usr/bin/env bash
# Start the Tandem GUI. First use creates .venv and installs Tandem (./install.sh); later starts
# skip that unless pyproject.toml changed (or TANDEM_TORCH_SPEC is set to another torch than the one
# installed: unset, the installed torch stays). Without a display, train_ui.py says so in one line and
# names what works without a window. Extra arguments go to scripts/train_ui.py.
set -euo pipefail
cd "$(dirname "$0")"
./install.sh
exec .venv/bin/python scripts/train_ui.py "$@"
