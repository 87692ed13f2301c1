#!/usr/bin/env bash
# Creates .venv and installs Tandem into it; run again any time, it only installs what is missing.
# Usage: ./install.sh [dev]   ("dev" adds the test tools)
# TANDEM_TORCH_SPEC picks the torch build: the default takes PyPI's (CUDA on Linux);
# CI sets TANDEM_TORCH_SPEC="torch==2.13.0" to take the CPU wheel.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TANDEM_TORCH_SPEC:-torch>=2.4}"
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
    echo "Creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
# One stamp per extras set; the dev install includes the base one. A changed pyproject.toml or torch
# spec installs again.
want="$(cat pyproject.toml) $TORCH_SPEC"
stamp() { echo ".venv/.tandem-installed-${1:-base}"; }
installed() { [ -f "$(stamp "$1")" ] && [ "$(cat "$(stamp "$1")")" = "$want" ]; }
if installed "$extras" || { [ -z "$extras" ] && installed dev; }; then
    exit 0
fi
echo "Installing Tandem into .venv (torch: $TORCH_SPEC)"
# --no-compile: pip would write bytecode for every file of every package (transformers alone has 2,600 model
# files, of which a run imports a few); Python writes it for the files a run imports, on first import. On 2
# cores: the install 82 -> 36 s, the first start 7 -> 20 s once (2026-11-29, CPU torch 2.13).
.venv/bin/python -m pip install -q --no-compile --upgrade pip
.venv/bin/python -m pip install -q --no-compile "$TORCH_SPEC"
.venv/bin/python -m pip install -q --no-compile -e ".${extras:+[$extras]}"
printf '%s' "$want" > "$(stamp "$extras")"
