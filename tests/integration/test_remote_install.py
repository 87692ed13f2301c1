"""The remote install's PyTorch: the setting's syntax (`[REQUIREMENT] [--index-url URL]`), the build chosen for
a machine without a GPU, and the install script as it runs there - executed here by `sh` in a temporary
"remote folder" whose venv Python and install.sh are stand-ins that record what they were given (no network:
what pip would be asked, not a download)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from modules.remote import prepare
from modules.remote.cli import hosts_from, parser
from modules.remote.host import RemoteHost
from modules.remote.known_hosts import KnownHosts
from modules.remote.machine import RemoteMachine
from modules.remote.source import Source
from modules.remote.ssh import Result, SshError
from modules.remote.torch_build import CPU_INDEX, choose, parse_spec, spec_problems

HOSTILE = ["torch==2.13.0; touch {p}", "torch==2.13.0 --index-url https://x/$(touch {p})",
           "torch==2.13.0 --index-url 'https://x/'`touch {p}`", "torch==2.13.0 && touch {p}",
           "torch==2.13.0 --index-url https://x\ntouch {p}", "$(touch {p})", "-r {p}", "torch==2.13.0 | touch {p}"]


def test_the_pytorch_setting_names_a_requirement_and_an_index():
    assert parse_spec("") == ("", "")
    assert parse_spec("torch==2.13.0") == ("torch==2.13.0", "")
    assert parse_spec(f"torch>=2.4,<2.15 --index-url {CPU_INDEX}") == ("torch>=2.4,<2.15", CPU_INDEX)
    assert parse_spec(f"--index-url={CPU_INDEX}") == ("", CPU_INDEX)
    # the GUI's field names the index by its address alone (its tooltip shows no command-line flag)
    assert parse_spec(f"torch==2.13.0 {CPU_INDEX}") == ("torch==2.13.0", CPU_INDEX)
    assert parse_spec(CPU_INDEX) == ("", CPU_INDEX)
    for bad in ("numpy", "torch --index-url", "torch --extra-index-url https://x", "torch >= 2.4", "-e .",
                "torch --index-url ftp://x", "torch --index-url https://a --index-url https://b",
                "torch https://a https://b", "torch ftp://x", "torch https://a;touch"):
        assert spec_problems(bad), bad
    assert "not a torch requirement" in spec_problems("numpy")[0]


def test_a_machine_without_a_gpu_gets_the_cpu_build_unless_the_setting_names_one():
    no_driver, gpus = {"nvidia_smi": "no"}, {"nvidia_smi": "yes"}
    cpu = choose("", no_driver)
    assert (cpu.requirement, cpu.index_url, cpu.cpu) == ("torch>=2.4", CPU_INDEX, True)
    assert "about 200 MB" in cpu.describe() and "no NVIDIA driver" in cpu.describe()
    cuda = choose("", gpus)
    assert (cuda.index_url, cuda.cpu) == ("", False) and "about 3 GB" in cuda.describe()
    assert choose("", {}).index_url == ""  # not checked: as before, install.sh's default
    named = choose("torch==2.13.0", no_driver)  # the user's choice stands, with a word on what it costs
    assert named.index_url == "" and CPU_INDEX in named.why
    assert choose(f"torch==2.13.0 --index-url {CPU_INDEX}", gpus).index_url == CPU_INDEX


def test_a_hostile_pytorch_setting_is_refused_before_anything_runs(tmp_path):
    for text in HOSTILE:
        value = text.format(p=tmp_path / "pwned")
        assert RemoteHost("box", torch_spec=value).problems(), value
        with pytest.raises(ValueError):
            hosts_from(parser().parse_args(["--host", "box", "--torch-spec", value]))


# --- the install script, run by sh here ------------------------------------------------------------------------
RECORD_ARGUMENTS = """#!/bin/sh
# a stand-in for the venv's Python: one argument per line, as pip would receive them
for a in "$@"; do printf '%s\\n' "$a"; done >> "{log}"
echo "--" >> "{log}"
sleep {pause}
"""
RECORD_SPEC = """#!/bin/sh
printf '%s\\n' "$TANDEM_TORCH_SPEC" > "{log}"
"""


class LocalShell:
    """`Ssh` running each script with sh on this machine, recording the scripts it was given."""

    def __init__(self, host: RemoteHost, known: KnownHosts):
        self.host, self.known, self.scripts = host, known, []

    def run(self, script, input=None, timeout=None, check=True):
        self.scripts.append(script)
        done = subprocess.run(["sh", "-c", script], input=input or b"", capture_output=True, timeout=timeout)
        assert not check or done.returncode == 0, done.stderr
        return Result(done.returncode, done.stdout, done.stderr.decode())

    def popen(self, script, *extra, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
        self.scripts.append(script)
        return subprocess.Popen(["sh", "-c", script], stdin=stdin, stdout=stdout, stderr=stderr)

    def error(self, text):
        return SshError("unreachable", text)


def local_remote(tmp_path: Path, torch_spec: str, gpus: bool, pause: float = 0) -> tuple[RemoteMachine, Source]:
    """A 'remote folder' under tmp_path whose venv exists with a recording Python, and a source of one file,
    a recording install.sh; the check's answer is given (GPUs or none), not asked."""
    folder = tmp_path / "remote folder"
    python = folder / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(RECORD_ARGUMENTS.format(log=tmp_path / "pip-arguments", pause=pause))
    python.chmod(0o755)
    shipped = tmp_path / "desktop"
    shipped.mkdir()
    (shipped / "install.sh").write_text(RECORD_SPEC.format(log=tmp_path / "install-spec"))
    known = KnownHosts((tmp_path / "k",), tmp_path / "k")
    machine = RemoteMachine(RemoteHost("box", folder=str(folder), torch_spec=torch_spec), known)
    machine.ssh = LocalShell(machine.host, known)
    machine.side = lambda *args, **kwargs: []  # prune-sources
    return machine, Source(shipped, ("install.sh",), "v1", "")


def checked(gpus: bool):
    def check(machine, source):
        report = prepare.Report(machine.label, {"nvidia_smi": "yes" if gpus else "no"}, ["0, GPU, 80 GiB"] if gpus else [])
        return report
    return check


def pip_calls(tmp_path: Path) -> list[list[str]]:
    text = (tmp_path / "pip-arguments").read_text()
    return [call.strip("\n").split("\n") for call in text.split("--\n") if call.strip()]


def test_a_remote_without_a_gpu_installs_the_cpu_build_and_says_so_first(tmp_path, monkeypatch):
    machine, source = local_remote(tmp_path, "", gpus=False)
    monkeypatch.setattr(prepare, "check", checked(gpus=False))
    lines: list[str] = []
    prepare.ensure_ready(machine, source, lines.append)
    assert pip_calls(tmp_path) == [["-m", "pip", "install", "--no-compile", "--progress-bar", "off",
                                    "--index-url", CPU_INDEX, "torch>=2.4"]]
    assert (tmp_path / "install-spec").read_text() == "torch>=2.4\n"  # install.sh then finds torch installed
    said = next(i for i, line in enumerate(lines) if "CPU build" in line)
    assert "about 200 MB" in lines[said] and said < next(i for i, line in enumerate(lines) if line.startswith("installing PyTorch (pip's"))


def test_a_setting_with_an_index_reaches_pip_as_separate_quoted_arguments(tmp_path, monkeypatch):
    index = "https://download.pytorch.org/whl/cu126"
    machine, source = local_remote(tmp_path, f"torch>=2.4,<2.15 --index-url {index}", gpus=True)
    monkeypatch.setattr(prepare, "check", checked(gpus=True))
    prepare.ensure_ready(machine, source, lambda line: None)
    # `<2.15` unquoted would have been a redirection from a file named 2.15
    assert pip_calls(tmp_path) == [["-m", "pip", "install", "--no-compile", "--progress-bar", "off",
                                    "--index-url", index, "torch>=2.4,<2.15"]]
    assert (tmp_path / "install-spec").read_text() == "torch>=2.4,<2.15\n"


def test_a_hostile_setting_saved_by_hand_runs_nothing_there(tmp_path, monkeypatch):
    """Settings read from remotes.json bypass the GUI's check of the field: the install refuses them too."""
    monkeypatch.setattr(prepare, "check", checked(gpus=False))
    for i, text in enumerate(HOSTILE):
        machine, source = local_remote(tmp_path / str(i), text.format(p=tmp_path / "pwned"), gpus=False)
        with pytest.raises(prepare.SetupError, match="PyTorch setting"):
            prepare.ensure_ready(machine, source, lambda line: None)
        with pytest.raises(prepare.SetupError, match="PyTorch setting"):
            prepare.install(machine, source)
        assert machine.ssh.scripts == [] and not (tmp_path / "pwned").exists(), text


def test_a_silent_install_still_says_it_is_going(tmp_path, monkeypatch):
    machine, source = local_remote(tmp_path, "", gpus=True, pause=1.0)
    monkeypatch.setattr(prepare, "check", checked(gpus=True))
    monkeypatch.setattr(prepare, "QUIET_S", 0.3)
    lines: list[str] = []
    prepare.ensure_ready(machine, source, lines.append)
    assert any(line.startswith("still installing on box (") for line in lines), lines


def test_the_check_names_the_torch_a_start_would_install_or_keep(tmp_path):
    """The check script itself, run by sh here: no GPU (a stand-in PATH without nvidia-smi) and no environment
    yet -> the note names the CPU build and its size; with a torch in the environment -> kept."""
    machine, source = local_remote(tmp_path, "", gpus=False)
    (tmp_path / "remote folder" / "venv").rename(tmp_path / "elsewhere")
    report = prepare.check(machine, source)
    if report.values.get("nvidia_smi") == "yes":
        pytest.skip("this machine has nvidia-smi")
    assert any("CPU build" in note and "about 200 MB" in note for note in report.notes), report.message()
    site = tmp_path / "remote folder" / "venv" / "lib" / f"python3.{sys.version_info[1]}" / "site-packages"
    (site / "torch-2.13.0+cpu.dist-info").mkdir(parents=True)
    again = prepare.check(machine, source)
    assert any("has torch 2.13.0+cpu" in note for note in again.notes), again.message()
