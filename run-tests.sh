#!/usr/bin/env bash
# Installs (first use) and runs the whole test suite on CPU. Extra arguments go to pytest.
#   ./run-tests.sh           everything (what CI runs: 20:15 on CI's 2 cores with the install, 2026-12-02; on this
#                            project's 2-core development machine 18:53 that morning for 1,681 tests and 31:03
#                            that afternoon for 1,727, when the same machine ran the quick set 1.7x slower; README.md too)
#   ./run-tests.sh --fast    the quick set: no training runs, launched processes, compiles or real-size models, two
#                            window tests (1:43 for 1,270 tests and 2:57 for 1,308 on 2 cores, 2026-12-02)
# Tests run in TANDEM_TEST_WORKERS pytest processes (default: one more than the cores, at most 6 - many
# tests wait on the processes they launch, and with one worker a core the cores idled a quarter of the run;
# with two more than the cores they were 96% busy and the run took 23:31 instead of 21:33, 2026-11-29;
# 1 runs them in this process, e.g. for -x or pdb); an explicit -n wins.
set -euo pipefail
cd "$(dirname "$0")"
# System tools some tests need: Xvfb (GUI tests), OpenSSH (remote-training tests start their own sshd on
# 127.0.0.1; the package's own sshd service is kept from starting while it installs). Installed while
# install.sh installs the Python packages: both mostly wait on downloads.
missing=()
command -v Xvfb >/dev/null 2>&1 || missing+=(xvfb)
{ [ -x /usr/sbin/sshd ] && command -v ssh >/dev/null 2>&1; } || missing+=(openssh-server openssh-client)
system_tools() {
    echo "Installing ${missing[*]} for the GUI and remote-training tests"
    local no_services=0
    if [ ! -e /usr/sbin/policy-rc.d ] && [ -w /usr/sbin ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && no_services=1
    fi
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null) \
        || echo "warning: could not install ${missing[*]}; the GUI or remote-training tests will fail"
    [ "$no_services" = 0 ] || rm -f /usr/sbin/policy-rc.d
}
tools=""
if [ ${#missing[@]} -gt 0 ]; then system_tools & tools=$!; fi
./install.sh dev
[ -z "$tools" ] || wait "$tools"
args=()
cores="$(nproc 2>/dev/null || echo 2)"
workers="${TANDEM_TEST_WORKERS:-$(( cores + 1 < 6 ? cores + 1 : 6 ))}"
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
