#!/usr/bin/env bash
# Creates .venv and installs Tandem into it; run again any time, it only installs what is missing.
# TANDEM_TORCH_SPEC picks the torch build: the default takes PyPI's (CUDA on Linux);
# CI sets TANDEM_TORCH_SPEC="torch==2.13.0" to take the CPU wheel.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TANDEM_TORCH_SPEC:-torch>=2.4}"
if [ ! -x .venv/bin/python ]; then
    echo "Creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
stamp=".venv/.tandem-installed"
want="$(cat pyproject.toml) $TORCH_SPEC ${1:-}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install "$TORCH_SPEC"
extras="${1:-}"
.venv/bin/python -m pip install -e ".${extras:+[$extras]}"
printf '%s' "$want" > "$stamp"
