#!/usr/bin/env bash
# Creates .venv and installs Tandem into it; run again any time, it only installs what is missing.
# Usage: ./install.sh [dev]   ("dev" adds the test tools)
# TANDEM_TORCH_SPEC picks the torch build: the default takes PyPI's (CUDA on Linux);
# CI sets TANDEM_TORCH_SPEC="torch==2.13.0" to take the CPU wheel.
# A working install is never redone because the variable differs: unset, the torch .venv was installed
# with stays; only a set TANDEM_TORCH_SPEC other than that one installs torch again. A changed
# pyproject.toml installs Tandem again (keeping torch); `./install.sh` after `./install.sh dev` does nothing.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
DEFAULT_TORCH_SPEC="torch>=2.4"
extras="${1:-}"
# One stamp per extras set (the dev install includes the base one), written after a successful install:
# line 1 "torch: <the spec torch was installed with>", then pyproject.toml as it was.
# (Stamps before 2026-12 held "<pyproject.toml> <spec>"; they are read too.)
project="$(cat pyproject.toml)"
stamp() { echo ".venv/.tandem-installed-${1:-base}"; }
stamp_spec=""
stamp_project=""
read_stamp() {  # sets stamp_spec and stamp_project; returns 1 when there is no stamp it can read
    stamp_spec="" stamp_project=""
    local file content first
    file="$(stamp "$1")"
    [ -f "$file" ] || return 1
    content="$(cat "$file")"
    first="${content%%$'\n'*}"
    if [ "${first#torch: }" != "$first" ]; then
        stamp_spec="${first#torch: }"
        if [ "$first" != "$content" ]; then stamp_project="${content#*$'\n'}"; fi
    elif [ "${content#"$project "}" != "$content" ]; then
        stamp_spec="${content#"$project "}" stamp_project="$project"
    else
        return 1
    fi
}
# Up to date: a stamp for these extras (or dev's, for the base) with this pyproject.toml and, when
# TANDEM_TORCH_SPEC is set, that spec.
candidates=("${extras:-base}")
[ -n "$extras" ] || candidates+=(dev)
for candidate in "${candidates[@]}"; do
    if read_stamp "$candidate" && [ "$stamp_project" = "$project" ] \
        && { [ -z "${TANDEM_TORCH_SPEC:-}" ] || [ "$TANDEM_TORCH_SPEC" = "$stamp_spec" ]; }; then
        exit 0
    fi
done
# What torch was installed with: the newest stamp's spec.
newest=""
for candidate in base dev; do
    if [ -f "$(stamp "$candidate")" ] && { [ -z "$newest" ] || [ "$(stamp "$candidate")" -nt "$(stamp "$newest")" ]; }; then
        newest="$candidate"
    fi
done
installed_spec="" previous_project="" have_stamp=0
if [ -n "$newest" ] && read_stamp "$newest"; then
    installed_spec="$stamp_spec" previous_project="$stamp_project" have_stamp=1
fi
# (this extras set's own stamp says best whether pyproject.toml changed since it was installed)
if read_stamp "${extras:-base}"; then previous_project="$stamp_project"; fi
if [ ! -x .venv/bin/python ]; then
    echo "Creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
    have_stamp=0
fi
# torch: installed unless a stamp says which spec it came with and that is the one wanted.
torch_spec="${TANDEM_TORCH_SPEC:-${installed_spec:-$DEFAULT_TORCH_SPEC}}"
install_torch=1
[ "$have_stamp" = 1 ] && [ "$torch_spec" = "$installed_spec" ] && install_torch=0
what=".${extras:+[$extras]}"
if [ "$have_stamp" = 0 ]; then
    echo "Installing Tandem into .venv (torch: $torch_spec)"
else
    # one line: what changes and why
    line=""
    because() { line="${line:+$line; }$1"; }
    [ "$install_torch" = 0 ] || because "installing torch again: $installed_spec -> $torch_spec, as TANDEM_TORCH_SPEC asks"
    if [ "$previous_project" != "$project" ]; then because "pyproject.toml changed since the last install"
    elif [ -n "$extras" ] && ! read_stamp "$extras"; then because "the $extras extras are not installed yet"
    elif [ "$install_torch" = 0 ]; then because "the ${extras:-base} install was recorded with another torch spec"
    fi
    [ "$install_torch" = 1 ] || because "torch kept ($torch_spec)"
    echo "Updating Tandem in .venv: $line"
fi
# --no-compile: pip would write bytecode for every file of every package (transformers alone has 2,600 model
# files, of which a run imports a few); Python writes it for the files a run imports, on first import. On 2
# cores: the install 82 -> 36 s, the first start 7 -> 20 s once (2026-11-29, CPU torch 2.13).
.venv/bin/python -m pip install -q --no-compile --upgrade pip
if [ "$install_torch" = 1 ]; then
    .venv/bin/python -m pip install -q --no-compile "$torch_spec"
fi
.venv/bin/python -m pip install -q --no-compile -e "$what"
printf 'torch: %s\n%s' "$torch_spec" "$project" > "$(stamp "$extras")"
