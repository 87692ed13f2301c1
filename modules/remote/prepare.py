"""The set-up check of a remote machine and the install or update of Tandem there.

`check` asks everything in one ssh call (system, Python, tar, GPUs through nvidia-smi, the folder and its
free space, whether this desktop's Tandem version is installed) and returns a `Report` whose `message()`
says in one text what is missing and how to get it. `install` ships the desktop's source (`source.py`) and
runs the README's install.sh there, into Tandem's own environment `<folder>/venv` (or, with
`RemoteHost.python`, checks that Python has Tandem's packages instead). `ensure_ready` does what a start
needs: check, install when this version is missing, and refuse with the report when something blocks.
"""
from __future__ import annotations

import queue
import shlex
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .machine import CURRENT, RemoteMachine
from .source import Source, archive
from .private import make_private_script
from .ssh import last_lines, say
from .torch_build import TorchBuild, choose

MIN_PYTHON = (3, 10)
MIN_FREE_GIB = 10.0
"""Less free space than this in the remote folder is named in the report (torch alone takes ~5 GB)."""
PACKAGES = ("torch", "diffusers", "transformers", "safetensors", "peft", "yaml", "tensorboard")
INSTALLED_MARK = ".installed"
QUIET_S = 20.0
"""While an install prints nothing for this long (pip downloading gigabytes), a line says it is still going."""


class SetupError(RuntimeError):
    """The remote cannot run Tandem yet; the message lists everything that is missing."""


@dataclass
class Report:
    label: str
    values: dict[str, str] = field(default_factory=dict)
    gpus: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """What stops a run there, each with its fix."""
    notes: list[str] = field(default_factory=list)
    """What a user should know but that does not stop a run (no GPU: CPU processes still train)."""

    @property
    def installed(self) -> bool:
        return self.values.get("installed") == "yes"

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def message(self) -> str:
        gpus = (f"{len(self.gpus)} GPU(s): " + "; ".join(self.gpus)) if self.gpus else "no NVIDIA GPU"
        lines = [f"{self.label}: connected · {self.values.get('os', '?')} {self.values.get('arch', '')} · "
                 f"Python {self.values.get('python_version') or 'missing'} · {gpus}"]
        if self.values.get("free_kib"):
            lines.append(f"folder {self.values.get('folder_abs') or '?'}: {int(self.values['free_kib']) / 2**20:.1f} GiB free")
        lines.append("Tandem " + ("installed at this desktop's version" if self.installed
                                  else "not yet installed at this desktop's version (a start installs it)"))
        if self.problems:
            lines.append("Missing:")
            lines += [f"  - {p}" for p in self.problems]
        lines += [f"Note: {n}" for n in self.notes]
        return "\n".join(lines)


def _check_script(machine: RemoteMachine, source: Source) -> str:
    folder, version = machine.path(), shlex.quote(source.version)
    given = machine.python if machine.host.python else ""
    probe = ("import importlib.util as u, sys; print(','.join(n for n in %r if u.find_spec(n) is None))" % (PACKAGES,))
    return f"""
echo "os=$(uname -s 2>/dev/null)"; echo "arch=$(uname -m 2>/dev/null)"
PY=python3; command -v python3 >/dev/null 2>&1 || PY=python
if command -v "$PY" >/dev/null 2>&1; then
  echo "python_version=$("$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null)"
  "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1 && echo venv=yes || echo venv=no
fi
command -v tar >/dev/null 2>&1 && echo tar=yes || echo tar=no
if command -v nvidia-smi >/dev/null 2>&1; then
  echo nvidia_smi=yes
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu=/'
else echo nvidia_smi=no; fi
mkdir -p {folder} 2>/dev/null && [ -w {folder} ] && echo folder=writable || echo folder=unwritable
{make_private_script(machine)}echo "folder_abs=$(cd {folder} 2>/dev/null && pwd)"
df -Pk {folder} 2>/dev/null | awk 'NR==2 {{print "free_kib=" $4}}'
[ -f {folder}/source/{version}/{INSTALLED_MARK} ] && [ -e {folder}/source/{CURRENT} ] && echo installed=yes
for d in {folder}/venv/lib/python3*/site-packages/torch-*.dist-info; do [ -d "$d" ] && echo "venv_torch=${{d##*/torch-}}"; done
GIVEN={given or '""'}
if [ -n "$GIVEN" ]; then
  if [ -x "$GIVEN" ] || command -v "$GIVEN" >/dev/null 2>&1; then
    echo "given_version=$("$GIVEN" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null)"
    echo "given_missing=$("$GIVEN" -c {shlex.quote(probe)} 2>&1 | tail -n 1)"
  else echo given=absent; fi
fi
"""


def check(machine: RemoteMachine, source: Source) -> Report:
    """Connect and look; raises SshError when the connection itself fails (host key, login, network)."""
    result = machine.run(_check_script(machine, source), timeout=90, check=False)
    report = Report(machine.label)
    for line in result.text.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        if key == "gpu":
            report.gpus.append(value.strip())
        else:
            report.values[key] = value.strip()
    _judge(report, machine)
    return report


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(".")[:2])
    except ValueError:
        return ()


def _judge(report: Report, machine: RemoteMachine) -> None:
    v, host = report.values, machine.host
    if v.get("os") and v["os"] != "Linux":
        report.problems.append(f"a Linux machine: this one runs {v['os']} (Tandem's remote runs use Linux's "
                               "sessions and /proc)")
    if v.get("tar") != "yes":
        report.problems.append("tar (install it: apt install tar)")
    if v.get("folder") != "writable":
        report.problems.append(f"a writable folder {host.folder} (choose another remote folder, or create it "
                               "and give your user write access)")
    if v.get("folder_private") == "no":
        report.notes.append(f"others on that machine may look into {host.folder}: Tandem could not make it private "
                            "(chmod 700; is the folder another user's?). What Tandem writes in it is private still")
    if host.python:
        if v.get("given") == "absent":
            report.problems.append(f"the Python {host.python} given for this remote does not exist there "
                                   "(give its full path, or leave it empty to let Tandem install its own)")
        elif _version(v.get("given_version", "")) < MIN_PYTHON:
            report.problems.append(f"Python 3.10 or later at {host.python} (found {v.get('given_version') or 'none'})")
        elif v.get("given_missing"):
            report.problems.append(f"the packages {v['given_missing']} in {host.python} (pip install them there, "
                                   "or leave the Python empty to let Tandem install its own environment)")
    else:
        if _version(v.get("python_version", "")) < MIN_PYTHON:
            report.problems.append(f"Python 3.10 or later as python3 (found {v.get('python_version') or 'none'}; "
                                   "apt install python3)")
        elif v.get("venv") != "yes":
            report.problems.append("Python's venv module (apt install python3-venv), to install Tandem's own "
                                   "environment")
    if v.get("nvidia_smi") != "yes":
        report.notes.append("no NVIDIA driver found (nvidia-smi is missing): only CPU processes can train there")
    elif not report.gpus or any("failed" in g.lower() or "error" in g.lower() for g in report.gpus):
        report.notes.append("nvidia-smi found no working GPU: " + "; ".join(report.gpus or ["no GPU listed"]))
        report.gpus = []
    if not host.python and not report.installed and not report.problems:
        report.notes.append(_install_note(host.torch_spec, v))
    free = v.get("free_kib")
    if free and free.isdigit() and int(free) / 2**20 < MIN_FREE_GIB and not report.installed:
        report.notes.append(f"only {int(free) / 2**20:.1f} GiB free in {host.folder}: Tandem's environment "
                            "(PyTorch) takes about 5-10 GiB, plus models and data")


def _install_note(torch_spec: str, values: dict[str, str]) -> str:
    """What a start will install in Tandem's environment there, and roughly how much it downloads."""
    try:
        build = choose(torch_spec, values)
    except ValueError as e:
        return str(e)
    have = values.get("venv_torch", "").removesuffix(".dist-info")
    if have:
        return (f"a start updates Tandem there; its environment has torch {have}, kept unless it does not "
                f"satisfy {build.requirement}")
    return "a start installs Tandem's environment there with " + build.describe()


def _lines(stream, quiet_s: float, on_quiet: Callable[[float], None]) -> Iterator[str]:
    """The stream's lines as they come; `on_quiet(seconds since the last line)` every `quiet_s` without one, so
    that pip's silent minutes (a 3 GB download, unpacking) do not look like a hang."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for raw in stream:
            lines.put(raw.decode("utf-8", errors="replace").rstrip())
        lines.put(None)
    threading.Thread(target=read, daemon=True).start()
    last = time.monotonic()
    while True:
        try:
            line = lines.get(timeout=quiet_s)
        except queue.Empty:
            on_quiet(time.monotonic() - last)
            continue
        if line is None:
            return
        last = time.monotonic()
        yield line


def install(machine: RemoteMachine, source: Source, progress: Callable[[str], None] = lambda line: None,
            build: TorchBuild | None = None) -> None:
    """Ship this desktop's source and install it (`install.sh` into `<folder>/venv`, torch as `build` says:
    default `choose(torch_spec, {})`); its output goes to `progress` line by line. Raises SetupError with the
    install's last lines when it fails, before anything runs there when the PyTorch setting is not valid."""
    if build is None and not machine.host.python:
        try:
            build = choose(machine.host.torch_spec, {})
        except ValueError as e:
            raise SetupError(str(e)) from None
    folder, version = machine.path(), shlex.quote(source.version)
    staging = machine.path("source", f".{source.version}.tmp")
    target = machine.path("source", source.version)
    progress(f"uploading Tandem {source.describe()} to {machine.label}")
    machine.run(f"mkdir -p {folder}/source && rm -rf {staging} && mkdir {staging} && tar -xzf - -C {staging} && "
                f"chmod -R go-rwx {staging} && "
                f"rm -rf {target} && mv {staging} {target}", input=archive(source), timeout=600)
    if machine.host.python:
        environment = ": the given Python is used as it is"
    else:
        assert build is not None
        progress(f"{machine.label}: installing " + build.describe())
        environment = f"""
if [ ! -x {folder}/venv/bin/python ]; then
  {say(f"creating Tandem's environment {machine.host.folder}/venv")}
  PY=python3; command -v python3 >/dev/null 2>&1 || PY=python
  "$PY" -m venv {folder}/venv
fi
ln -sfn ../../venv .venv
echo "installing PyTorch (pip's own lines follow; the first time takes minutes)"
{folder}/venv/bin/python -m pip install --no-compile --progress-bar off {build.shell_words()}
echo "installing Tandem's other packages"
TANDEM_TORCH_SPEC={shlex.quote(build.requirement)} ./install.sh"""
    script = f"""set -e
cd {target}
{environment}
# venv, pip and setuptools give some files modes of their own, past the umask: the user's alone all the same
chmod -R go-rwx .
if [ -d {folder}/venv ]; then chmod -R go-rwx {folder}/venv; fi
touch {INSTALLED_MARK}
ln -sfn {version} ../.{CURRENT}.tmp && mv -T ../.{CURRENT}.tmp ../{CURRENT}
echo "Tandem {source.version} is installed"
"""
    process = machine.ssh.popen(script, stderr=subprocess.STDOUT)
    lines = []
    assert process.stdout is not None
    for line in _lines(process.stdout, QUIET_S,
                       lambda quiet: progress(f"still installing on {machine.label} ({quiet:.0f} s since the last line)")):
        if line.startswith("WARNING: Location"):  # pip's noise about unreachable extra indexes
            continue
        lines.append(line)
        progress(line)
    code = process.wait()
    if code == 255:
        raise machine.ssh.error("\n".join(lines))
    if code != 0:
        raise SetupError(f"installing Tandem on {machine.label} failed (exit code {code}): "
                         + last_lines("\n".join(lines), 8))
    machine.side("prune-sources", source.version)


def ensure_ready(machine: RemoteMachine, source: Source,
                 progress: Callable[[str], None] = lambda line: None) -> Report:
    """What a start needs: the check, then the install when this version is missing. Raises SetupError with
    the whole report when something stops a run; SshError when the connection fails."""
    progress(f"checking {machine.label}")
    report = check(machine, source)
    if report.problems:
        raise SetupError(f"{machine.label} cannot run Tandem yet.\n" + report.message())
    if not report.installed:
        try:
            build = None if machine.host.python else choose(machine.host.torch_spec, report.values)
        except ValueError as e:
            raise SetupError(str(e)) from None
        install(machine, source, progress, build)
        report.values["installed"] = "yes"
    return report
