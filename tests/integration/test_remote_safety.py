"""Hostile and awkward remote settings run nothing on either side, and Tandem's remote files are private.

Quick tests: the settings that cannot work are refused in one line naming the setting; `--remote-env` values keep
their quotes; the scripts Tandem sends, run by a local sh, treat a folder full of quotes, `$()` and backticks as a
name; a run's variables reach it without being written to its files, and its files are 0600 in 0700 folders.
Slow tests, through a real OpenSSH server on 127.0.0.1 (modules/remote/local_sshd.py) whose sessions get a home of
their own (sshd's SetEnv HOME), so that `~/` folders and `touch ~/marker` payloads stay in the test's folder:
hostile folders for --list, --check and --attach; `Bob's runs` with `$()`, backticks and double quotes installed
into with install.sh and trained in; a folder an older Tandem left readable closed by the next check.
"""
from __future__ import annotations

import getpass
import json
import os
import stat
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from modules.remote.cli import hosts_from, parser
from modules.remote.host import RemoteHost, environment_pairs
from modules.remote.local_sshd import SshServer
from modules.remote.machine import NOT_INSTALLED, RemoteMachine
from modules.remote.prepare import _check_script
from modules.remote.source import local_source
from tests.integration.test_remote_ssh import fingerprint, sshd_ready  # noqa: F401 - sshd_ready is a fixture used here
from tests.patience import patience

REPO = Path(__file__).resolve().parents[2]
MARKERS = ("m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8", "m9")
HOSTILE_FOLDERS = (
    "~/nf'$(touch ~/m1)'",              # closes echo '...' (issue 54's first example)
    "~/tr-$(touch ~/m2; kill $$)",      # inside echo "..." during an install (its second)
    '~/q"`touch ~/m3`"x',               # a double quote and backticks
    "~/Bob's runs",                     # a legitimate name with a quote and a space
)
SECRET = "-".join(("tandem", "test", "secret", "54"))
"""Joined here: the shipped source holds this file, and the secret must be in no file there."""


def private(path: Path) -> bool:
    return stat.S_IMODE(path.lstat().st_mode) & 0o077 == 0


def markers_in(*folders: Path) -> list[str]:
    return [str(folder / name) for folder in folders for name in MARKERS if (folder / name).exists()]


# --- quick ---------------------------------------------------------------------------------------------------
def test_settings_that_cannot_work_are_refused_in_one_line_naming_the_setting():
    for folder, expected in (("~/a\nb", "remote folder '~/a"), ("~bob/tandem", "only '~/'"), ("~", "folder of its own"),
                             ("/", "folder of its own"), ("~/", "folder of its own")):
        problems = RemoteHost("box", folder=folder).problems()
        assert len(problems) == 1 and "\n" not in problems[0] and expected in problems[0], (folder, problems)
    assert "line break" in RemoteHost("box", folder="~/a\nb").problems()[0]
    for folder in HOSTILE_FOLDERS + ("relative/folder", "/srv/tandem runs"):
        assert RemoteHost("box", folder=folder).problems() == [], folder
    for name, value in (("python", "/opt/py\nthon"), ("base_model", "/m\n"), ("environment", "A=1\nB=2")):
        problems = RemoteHost("box", **{name: value}).problems()
        assert len(problems) == 1 and "control character" in problems[0], (name, problems)
    assert "not a program" in RemoteHost("box", python="-c").problems()[0]
    unbalanced = RemoteHost("box", environment="NOTE=Bob's").problems()
    assert len(unbalanced) == 1 and "remote environment" in unbalanced[0] and "quote" in unbalanced[0], unbalanced


def test_remote_env_values_keep_their_quotes_and_a_bare_name_takes_the_desktops_value(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    args = parser().parse_args(["--host", "box", "--remote-env", "NOTE=Bob's \"runs\" $(x)", "--remote-env",
                                "A=two words", "--remote-env", "HF_TOKEN"])
    host, = hosts_from(args)
    assert environment_pairs(host.environment) == {"NOTE": "Bob's \"runs\" $(x)", "A": "two words", "HF_TOKEN": SECRET}


def test_the_saved_machines_with_their_environment_are_the_users_alone(tmp_path):
    from ui.settings import SavedRemotes
    saved = SavedRemotes(tmp_path)
    saved.save(RemoteHost("box", environment=f"HF_TOKEN={SECRET}"))
    assert stat.S_IMODE((tmp_path / "remotes.json").stat().st_mode) == 0o600
    assert SavedRemotes(tmp_path).hosts[0].environment == f"HF_TOKEN={SECRET}"


def test_the_scripts_sent_treat_a_hostile_folder_as_a_name(tmp_path):
    """The remote side of --list and of the check, run by this machine's sh as sshd would run them."""
    home = tmp_path / "home"
    home.mkdir()
    source = local_source()
    for folder in HOSTILE_FOLDERS:
        machine = RemoteMachine(RemoteHost("box", folder=folder, python=sys.executable))
        for script in (machine.side_script("runs"), _check_script(machine, source)):
            command = machine.ssh.command(script)[-1]  # "sh -c '<umask; script>'", as ssh hands it to the login shell
            done = subprocess.run(["sh", "-c", command], cwd=home, env={"HOME": str(home), "PATH": os.environ["PATH"]},
                                  capture_output=True, text=True, timeout=patience(120))
            assert markers_in(home) == [], (folder, script, done.stdout, done.stderr)
        listed = subprocess.run(["sh", "-c", machine.ssh.command(machine.side_script("runs"))[-1]], cwd=home,
                                env={"HOME": str(home), "PATH": os.environ["PATH"]}, capture_output=True, text=True,
                                timeout=patience(120))
        assert listed.returncode == NOT_INSTALLED, (folder, listed.stderr)
        assert f"Tandem is not installed in {folder} on this machine" in listed.stderr, (folder, listed.stderr)
        made = Path(str(home) + "/" + folder[2:])
        assert made.is_dir() and stat.S_IMODE(made.stat().st_mode) == 0o700, (folder, sorted(home.rglob("*")))


def _side(root: Path, *args: str, input: object = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "modules.remote.remote_side", "--root", str(root), *args], cwd=REPO,
                          capture_output=True, text=True, input=json.dumps(input) if input is not None else "",
                          timeout=patience(120))


def test_a_runs_variables_reach_it_but_not_its_files_and_its_files_are_private(tmp_path):
    code = "import os; print('token length', len(os.environ['HF_TOKEN']), os.environ['NOTE'], flush=True)"
    spec = {"id": "r1", "workspace": "work/ws", "command": ["-c", code], "config_name": "test", "config": {"x": 1},
            "env": {"HF_TOKEN": SECRET, "NOTE": "Bob's runs"}}
    started = _side(tmp_path, "start", input=spec)
    assert started.returncode == 0, started.stderr
    run = tmp_path / "runs" / "r1"
    deadline = time.monotonic() + patience(120)  # a hang detector: the run prints one line and ends
    while not (run / "exit.json").is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (run / "exit.json").is_file(), f"no exit.json after 120 s; the run folder holds {sorted(os.listdir(run))}"
    assert f"token length {len(SECRET)} Bob's runs" in (run / "output.log").read_text()
    entry = json.loads((run / "run.json").read_text())
    assert entry["env_names"] == ["HF_TOKEN", "NOTE"] and "env" not in entry, entry
    written = {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert not [name for name, data in written.items() if SECRET.encode() in data], list(written)
    opened = [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if not private(p)]
    assert opened == [], opened  # runs/, the run's folder, run.json, output.log, exit.json, the commands file


# --- through a real sshd --------------------------------------------------------------------------------------
def isolated_server(tmp_path: Path, path_first: Path | None = None) -> tuple[SshServer, Path]:
    """An sshd whose sessions have $HOME in the test's folder (and `path_first` first on PATH)."""
    home = tmp_path / "home"
    home.mkdir()
    server = SshServer(tmp_path / "sshd")
    path = f"{path_first}:{os.environ['PATH']}" if path_first else os.environ["PATH"]
    with open(server.config, "a") as config:
        config.write(f"SetEnv HOME={home} PATH={path}\n")
    return server.start(), home


def cli(server: SshServer, *args: str, tandem_home: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "scripts" / "train_remote.py"), "--host",
               f"{getpass.getuser()}@127.0.0.1:{server.port}", "--identity", str(server.user_key), "--accept-host-key",
               fingerprint(server), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=patience(timeout), cwd=REPO, stdin=subprocess.DEVNULL,
                          env=dict(os.environ, TANDEM_HOME=str(tandem_home), PYTHONUNBUFFERED="1"))


@pytest.mark.slow
def test_hostile_remote_folders_run_nothing_and_work_or_are_refused(tmp_path, sshd_ready):
    server, home = isolated_server(tmp_path)
    desktop = tmp_path / "desktop"
    try:
        for folder in HOSTILE_FOLDERS:
            listed = cli(server, "--remote-folder", folder, "--list", tandem_home=desktop)
            assert listed.returncode == 0 and "no runs" in listed.stdout, (folder, listed.stdout, listed.stderr)
            assert markers_in(home, REPO, Path.cwd()) == [], (folder, listed.stderr)
            checked = cli(server, "--remote-folder", folder, "--remote-python", sys.executable, "--check",
                          tandem_home=desktop)
            assert checked.returncode == 0 and "connected" in checked.stdout, (folder, checked.stdout, checked.stderr)
            made = Path(str(home) + "/" + folder[2:])
            assert made.is_dir() and stat.S_IMODE(made.stat().st_mode) == 0o700, (folder, sorted(home.rglob("*")))
            attached = cli(server, "--remote-folder", folder, "--attach", "x'$(touch ~/m4)'`touch ~/m5`",
                           tandem_home=desktop)
            assert attached.returncode == 2 and "no run" in attached.stderr, (folder, attached.stderr)
            assert markers_in(home, REPO, Path.cwd()) == [], (folder, checked.stderr, attached.stderr)
        python = cli(server, "--remote-folder", "~/ok", "--remote-python", "~/py'$(touch ~/m6)'/bin/python", "--check",
                     tandem_home=desktop)
        assert python.returncode == 2 and "does not exist there" in python.stdout, (python.stdout, python.stderr)
        for folder in ("~/a\n$(touch ~/m7)", "~root/$(touch ~/m8)"):
            refused = cli(server, "--remote-folder", folder, "--list", tandem_home=desktop)
            lines = refused.stderr.strip().splitlines()
            assert refused.returncode == 2 and len(lines) == 1 and "remote folder" in lines[0], (folder, lines)
        assert markers_in(home, REPO, Path.cwd()) == []
    finally:
        server.stop()


def _python3_making_test_venvs(folder: Path) -> Path:
    """A `python3` for the sshd's sessions: this environment's Python, except that `-m venv DIR` makes a venv that
    sees this environment's packages (as the session's installed remote does), so that install.sh finds PyTorch
    installed instead of downloading it. Tandem's own install then runs as on a fresh machine."""
    folder.mkdir()
    wrapper = folder / "python3"
    wrapper.write_text(f"""#!/bin/sh
if [ "$1" = -m ] && [ "$2" = venv ]; then
  for venv in "$@"; do :; done
  "{sys.executable}" -m venv --without-pip "$venv" || exit
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || exit
  printf '%s\\n' '{sysconfig.get_paths()["purelib"]}' > "$site/tandem-test-packages.pth"
  exit
fi
exec "{sys.executable}" "$@"
""")
    wrapper.chmod(0o755)
    return folder


@pytest.mark.slow
def test_a_folder_with_quotes_dollars_and_backticks_installs_and_trains_privately(tmp_path, sshd_ready, tandem_home):
    """Bob's runs, with `$()`, backticks and double quotes too: the real install (a fresh venv, install.sh) and a
    demo run there; nothing of the name runs, every file there is its user's alone, and the token given with
    --remote-env is in no file there."""
    server, home = isolated_server(tmp_path, _python3_making_test_venvs(tmp_path / "bin"))
    folder = "~/Bob's \"runs\" $(touch ~/m1) `touch ~/m2`"
    try:
        started = cli(server, "--remote-folder", folder, "--torch-spec", "torch==2.13.0", "--config-path", "#demo",
                      "--yes", "--device", "cpu", "--remote-env", f"TANDEM_HOME={tandem_home}",
                      "--remote-env", "OMP_NUM_THREADS=1", "--remote-env", f"HF_TOKEN={SECRET}",
                      "--remote-env", "NOTE=it's $(touch ~/m3)",
                      "--config-value", f"general.workspace_dir={tmp_path / 'ws'}",
                      "--config-value", "training.max_steps=2", "--config-value", "training.batch_size=2",
                      "--config-value", "sampling.every_n_epochs=0", "--config-value", "save.backup_every_n_epochs=0",
                      tandem_home=tmp_path / "desktop", timeout=1200)
        assert started.returncode == 0, started.stderr[-4000:] + started.stdout[-2000:]
        assert markers_in(home, REPO, Path.cwd()) == [], started.stderr[-3000:]
        remote = Path(str(home) + "/" + folder[2:])
        assert "creating Tandem's environment " + folder in started.stderr  # the venv was made by this install
        assert (remote / "venv" / ".tandem-installed-base").is_file()  # install.sh ran to its end
        run, = (remote / "runs").iterdir()
        entry = json.loads((run / "run.json").read_text())
        assert entry["env_names"] == ["HF_TOKEN", "NOTE", "OMP_NUM_THREADS", "TANDEM_HOME"] and "env" not in entry
        assert json.loads((run / "exit.json").read_text())["exit_code"] == 0
        leaked = [p for p in remote.rglob("*") if p.is_file() and not p.is_symlink() and p.stat().st_size < 2**26
                  and SECRET.encode() in p.read_bytes()]
        assert leaked == [], leaked
        assert stat.S_IMODE(remote.stat().st_mode) == 0o700
        opened = [f"{oct(stat.S_IMODE(p.lstat().st_mode))} {p.relative_to(remote)}" for p in remote.rglob("*")
                  if not p.is_symlink() and not private(p)]
        assert opened == [], opened[:20]  # source, venv, uploads, runs, workspace: the user's alone
        assert list((tmp_path / "ws" / "remote").glob("*/output/*")), "the model was not fetched"
    finally:
        server.stop()


@pytest.mark.slow
def test_a_folder_left_readable_is_closed_by_the_next_check(tmp_path, sshd_ready):
    server, home = isolated_server(tmp_path)
    remote = home / "tandem-remote"
    run = remote / "runs" / "old-run"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"id": "old-run", "env": {"HF_TOKEN": SECRET}}))
    (remote / "files").mkdir()
    (remote / "files" / "cat.png").write_bytes(b"png")
    (remote / "notes.txt").write_text("not Tandem's")
    for path in (remote, remote / "runs", run, remote / "files"):
        path.chmod(0o755)
    for path in (run / "run.json", remote / "files" / "cat.png", remote / "notes.txt"):
        path.chmod(0o644)
    try:
        checked = cli(server, "--remote-python", sys.executable, "--check", tandem_home=tmp_path / "desktop")
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert stat.S_IMODE(remote.stat().st_mode) == 0o700
        modes = {p.relative_to(remote).as_posix(): oct(stat.S_IMODE(p.stat().st_mode)) for p in remote.rglob("*")}
        assert modes == {"runs": "0o700", "runs/old-run": "0o700", "runs/old-run/run.json": "0o600",
                         "files": "0o700", "files/cat.png": "0o600", "notes.txt": "0o644"}, modes  # not Tandem's: kept
    finally:
        server.stop()
