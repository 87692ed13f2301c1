#!/usr/bin/env bash
# Start a multi-GPU training run: installs Tandem into .venv on first use, then asks for the config, the
# number of GPUs, the backend and the launcher (or takes them as flags), prints the command and runs it.
# The questions and checks are scripts/start_multi_gpu.py (modules/start_multi_gpu.py), the same as
# start-multi-gpu.bat's; this file only installs. Run with --help for the options.
set -euo pipefail
cd "$(dirname "$0")"

for arg in "$@"; do
    if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
        # Only the standard library is needed for the help text: any Python will do, before .venv exists.
        python="${TANDEM_PYTHON:-}"
        [ -n "$python" ] || { [ -x .venv/bin/python ] && python=.venv/bin/python; } || python=python3
        exec "$python" scripts/start_multi_gpu.py --help
    fi
done

if [ "${TANDEM_SKIP_INSTALL:-0}" != "1" ]; then
    ./install.sh
fi
if [ -n "${TANDEM_PYTHON:-}" ]; then
    python="$TANDEM_PYTHON"
elif [ -x .venv/bin/python ]; then
    python=.venv/bin/python
else
    echo "start-multi-gpu.sh: no .venv/bin/python: run ./install.sh, or set TANDEM_PYTHON to a Python with Tandem installed" >&2
    exit 2
fi
# The helper runs the training command as a process of its own: that command's start-up report then
# counts its own imports, not the install above.
exec "$python" scripts/start_multi_gpu.py "$@"
