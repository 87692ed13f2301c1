#!/usr/bin/env bash
# Installs (first use) and runs the whole test suite on CPU. Extra arguments go to pytest.
#   ./run-tests.sh           everything (what CI runs, about 10 minutes on 2 cores)
#   ./run-tests.sh --fast    the quick set: no training runs, no launched processes (about a minute)
set -euo pipefail
cd "$(dirname "$0")"
./install.sh dev
if ! command -v Xvfb >/dev/null 2>&1; then
    echo "Installing Xvfb for the GUI tests"
    (apt-get update -qq && apt-get install -y -qq xvfb >/dev/null) || echo "warning: could not install xvfb; GUI widget tests will fail"
fi
args=()
for arg in "$@"; do
    if [ "$arg" = "--fast" ]; then args+=(-m "not slow"); else args+=("$arg"); fi
done
exec .venv/bin/python -m pytest -q "${args[@]}"
