#!/usr/bin/env bash
# Installs (first use) and runs the whole test suite on CPU. Extra arguments go to pytest.
#   ./run-tests.sh           everything (what CI runs, about 10 minutes on 2 cores)
#   ./run-tests.sh --fast    the quick set: no training runs, launched processes or compiles (~105 CPU-s: under a minute on 2 cores)
# Tests run in TANDEM_TEST_WORKERS pytest processes (default 2; 1 runs them in this process, e.g. for -x
# or pdb); an explicit -n wins.
set -euo pipefail
cd "$(dirname "$0")"
./install.sh dev
if ! command -v Xvfb >/dev/null 2>&1; then
    echo "Installing Xvfb for the GUI tests"
    (apt-get update -qq && apt-get install -y -qq xvfb >/dev/null) || echo "warning: could not install xvfb; GUI widget tests will fail"
fi
args=()
workers="${TANDEM_TEST_WORKERS:-2}"
for arg in "$@"; do
    if [ "$arg" = "--fast" ]; then args+=(-m "not slow"); else args+=("$arg"); fi
    case "$arg" in -n|-n*|--numprocesses*) workers=1 ;; esac
done
# One torch thread per test process: the pytest workers already fill the cores, and two threads each
# oversubscribed them (the in-process training tests ran ~9% slower; launched workers set their own).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# worksteal: the slow tests differ in length by 100x; idle workers take queued tests from busy ones.
if [ "$workers" -gt 1 ]; then args=(-n "$workers" --dist worksteal "${args[@]}"); fi
# the slowest tests in the log: where CI time goes (CI must stay under 20 minutes)
exec .venv/bin/python -m pytest -q --durations=30 "${args[@]}"
