"""The helper that runs ON the remote machine: `python -m modules.remote.remote_side --root F <verb> ...`.

The desktop ships it with the rest of Tandem and calls it over ssh for everything that would otherwise be
fragile shell: starting a run detached, the run registry, following a log, commands, the upload manifest,
packing outputs, TensorBoard. Standard library only (and run_protocol), so each call starts in a fraction of
a second. Every verb prints JSON or a stream on stdout;
errors go to stderr with exit code 2.

A run lives in `F/runs/<id>/`: `run.json` (what started it - the names of its environment variables, never
their values -, the supervisor's and the training's process ids),
`output.log` (the training's stdout and stderr: its log and `@tandem` event lines) and `exit.json` once it
ended. `start` spawns `supervise` in a session of its own (setsid), with no terminal and no stdio tied to
the ssh connection, so the run goes on when the desktop closes or the network drops; the supervisor waits
for the training and writes its exit code. The run's variables (`spec["env"]`, which may hold tokens) come on
stdin with the spec and reach the supervisor and the training only through their environments, which only
their user can read (/proc/<pid>/environ). Everything here is made under umask 077 (set again in `main`).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

END_MARKER = "@tandem-remote "
"""The line `follow` ends with: `@tandem-remote {"exit_code": ..., "offset": ...}` (not an @tandem event)."""
RUN_FILE, LOG_FILE, EXIT_FILE = "run.json", "output.log", "exit.json"
MANIFEST = "files/manifest.json"
OUTPUT_PARTS = ("output", "samples", "tensorboard")
FOLLOW_POLL_S = 0.2
KILL_GRACE_S = 10


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def _read_json(path: Path, default=None):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return default


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return 2


def _alive(pid: int | None, marker: str) -> bool:
    """Whether process `pid` exists and is the one we started (its command line names `marker`)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return True  # no /proc (not Linux): the pid exists, trust it


class Runs:
    def __init__(self, root: Path):
        self.root = root
        self.folder = root / "runs"

    def dir(self, run_id: str) -> Path:
        if not run_id or "/" in run_id or run_id.startswith("."):
            raise ValueError(f"not a run id: {run_id!r}")
        return self.folder / run_id

    def status(self, run_id: str) -> dict:
        folder = self.dir(run_id)
        entry = _read_json(folder / RUN_FILE, {}) or {}
        ended = _read_json(folder / EXIT_FILE)
        if ended is not None:
            state = "ended"
        elif _alive(entry.get("pid"), run_id):
            state = "running"
        elif entry.get("pid") is None and time.time() - entry.get("created", 0) < 30:
            state = "starting"
        else:
            state = "lost"  # the supervisor is gone without an exit code: the machine rebooted, or it was killed
        log = folder / LOG_FILE
        return {**entry, "id": run_id, "state": state, "exit_code": (ended or {}).get("exit_code"),
                "ended": (ended or {}).get("ended"), "log_bytes": log.stat().st_size if log.exists() else 0}

    def all(self) -> list[dict]:
        if not self.folder.is_dir():
            return []
        return [self.status(p.name) for p in sorted(self.folder.iterdir()) if (p / RUN_FILE).is_file()]


# --- starting -----------------------------------------------------------------------------------------
def start(root: Path, spec: dict) -> dict:
    """Create the run's folder and spawn its supervisor detached; returns its registry entry."""
    runs = Runs(root)
    folder = runs.dir(spec["id"])
    runs.folder.mkdir(parents=True, exist_ok=True)
    folder.mkdir()  # fails when the id exists: a run is never started twice into one folder
    commands = root / spec["workspace"] / ".tandem" / "commands"
    commands.parent.mkdir(parents=True, exist_ok=True)
    commands.write_text("", encoding="utf-8")  # a stop left by an earlier run would stop this one at once
    config = spec.pop("config", None)
    if config is not None:
        _write_json(folder / "config.json", config)
    variables = {str(name): str(value) for name, value in (spec.pop("env", None) or {}).items()}
    _write_json(folder / RUN_FILE, {**spec, "env_names": sorted(variables), "created": time.time(), "pid": None,
                                    "training_pid": None})
    here = Path(__file__).resolve().parents[2]
    subprocess.Popen([sys.executable, "-m", "modules.remote.remote_side", "--root", str(root), "supervise", spec["id"]],
                     cwd=here, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     env={**os.environ, **variables}, start_new_session=True, close_fds=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        entry = runs.status(spec["id"])
        if entry.get("training_pid") or entry["state"] == "ended":
            return entry
        time.sleep(0.05)
    raise RuntimeError(f"the run's supervisor did not start within 30 s (see {folder})")


def supervise(root: Path, run_id: str) -> int:
    runs = Runs(root)
    folder = runs.dir(run_id)
    entry = _read_json(folder / RUN_FILE)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    env = dict(os.environ)  # with the run's variables: `start` gave them to this process
    env.update({"PYTHONUNBUFFERED": "1", "TANDEM_EVENTS": "1"})
    if not entry.get("inherit_home"):  # a queued job keeps the home of whoever queued it (modules/queue)
        env.setdefault("TANDEM_HOME", str(root / "home"))
    with open(folder / LOG_FILE, "ab", buffering=0) as log:
        try:
            # The run's Python is the one running this (the remote's Tandem environment).
            # A queued job on this machine runs where it was queued (`cwd`): its config's relative paths mean that.
            child = subprocess.Popen([sys.executable, *entry["command"]], cwd=entry.get("cwd") or root, env=env,
                                     stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            log.write(f"could not start the training command: {e}\n".encode())
            _write_json(folder / EXIT_FILE, {"exit_code": 127, "ended": time.time()})
            return 127

        def forward(signum, _frame):
            try:
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                pass
        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        _write_json(folder / RUN_FILE, {**entry, "pid": os.getpid(), "training_pid": child.pid})
        code = child.wait()
    _write_json(folder / EXIT_FILE, {"exit_code": code, "ended": time.time()})
    return 0


def kill(root: Path, run_id: str) -> dict:
    """End a run's whole training process group now (SIGTERM, then SIGKILL after a grace)."""
    entry = Runs(root).status(run_id)
    pid = entry.get("training_pid")
    if entry["state"] != "running" or not pid:
        return entry
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + KILL_GRACE_S
        while time.monotonic() < deadline and Runs(root).status(run_id)["state"] == "running":
            time.sleep(0.1)
        if Runs(root).status(run_id)["state"] != "running":
            break
    return Runs(root).status(run_id)


# --- following ----------------------------------------------------------------------------------------
def follow(root: Path, run_id: str, offset: int) -> int:
    """Print the run's output from byte `offset` as it grows; when the run has ended and everything was
    printed, one END_MARKER line with its exit code (None when its supervisor vanished)."""
    runs = Runs(root)
    log = runs.dir(run_id) / LOG_FILE
    out = sys.stdout.buffer

    def pump(final: bool) -> None:
        nonlocal offset
        try:
            with open(log, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return
        if not final:
            data = data[:data.rfind(b"\n") + 1]  # whole lines only; the rest comes with its newline
        if data:
            out.write(data if data.endswith(b"\n") else data + b"\n")
            out.flush()
            offset += len(data)

    try:
        while True:
            status = runs.status(run_id)
            if status["state"] in ("ended", "lost"):
                pump(final=True)
                out.write((END_MARKER + json.dumps({"exit_code": status["exit_code"], "offset": offset,
                                                    "state": status["state"]}) + "\n").encode())
                out.flush()
                return 0
            pump(final=False)
            time.sleep(FOLLOW_POLL_S)
    except BrokenPipeError:  # the desktop went away; the run does not care
        return 0


def command(root: Path, run_id: str, word: str) -> dict:
    from modules.util.run_protocol import write_command
    entry = Runs(root).status(run_id)
    write_command(root / entry["workspace"] / ".tandem" / "commands", word)
    return entry


# --- files ---------------------------------------------------------------------------------------------
def manifest(root: Path) -> dict:
    """The upload manifest, less the entries whose file is gone or has another size than recorded."""
    entries = _read_json(root / MANIFEST, {}) or {}
    kept = {}
    for name, (digest, size) in entries.items():
        try:
            if (root / "files" / name).stat().st_size == size:
                kept[name] = [digest, size]
        except OSError:
            continue
    return kept


def commit(root: Path, change: dict) -> dict:
    """Record uploaded files, and delete files under `change["items"]` that the desktop no longer has
    (a picture removed from a dataset must not stay in the remote copy)."""
    entries = manifest(root)
    entries.update(change.get("added", {}))
    listed = set(change.get("listing", []))
    removed = 0
    for item in change.get("items", []):
        base = root / "files" / item
        if not base.exists():
            continue
        for path in sorted(base.rglob("*")) if base.is_dir() else [base]:
            name = path.relative_to(root / "files").as_posix()
            if path.is_file() and name not in listed:
                path.unlink()
                entries.pop(name, None)
                removed += 1
    (root / "files").mkdir(parents=True, exist_ok=True)
    _write_json(root / MANIFEST, entries)
    return {"files": len(entries), "removed": removed}


def outputs(root: Path, workspace: str) -> list[list]:
    """[path (relative to the root), size, mtime] of every file in the workspace's outputs, samples and logs."""
    found = []
    for part in OUTPUT_PARTS:
        base = root / workspace / part
        if base.is_dir():
            for path in sorted(base.rglob("*")):
                if path.is_file() and not path.name.startswith("."):
                    stat = path.stat()
                    found.append([path.relative_to(root).as_posix(), stat.st_size, int(stat.st_mtime)])
    return found


def pack(root: Path, names: list[str]) -> None:
    """A tar stream of `names` (paths relative to the root, inside it) on stdout."""
    resolved_root = root.resolve()
    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
        for name in names:
            path = (root / name).resolve()
            if resolved_root not in path.parents or not path.is_file():
                continue
            tar.add(path, arcname=name, recursive=False)


def backups(root: Path, workspace: str) -> list[dict]:
    """Every complete backup of the workspace, newest first, as the Run tab lists them (ui/backup_choices.py):
    {step, run_id, written, path, finished_step}, `finished_step` set when the backup's run finished after it
    was written. Read without importing torch, as modules.trainer.backup reads them (newest by the time it was
    written; `backups/<run>/step-N/backup.json` marks a complete one; `backups/<run>/finished.json` a finished
    run): the Run tab asks after every run (tests/unit/test_remote.py checks both agree)."""
    folder = root / workspace / "backups"
    found = []
    for manifest in [*folder.glob("step-*/backup.json"), *folder.glob("*/step-*/backup.json")]:
        if manifest.parent.parent.name.startswith("."):
            continue
        info = _read_json(manifest)
        try:
            found.append({"written": float(info["time"]), "step": int(info["step"]),
                          "run_id": info.get("run_id", manifest.parent.parent.name),
                          "path": manifest.parent.relative_to(root).as_posix(), "finished_step": None,
                          "run_dir": manifest.parent.parent})
        except (TypeError, KeyError, ValueError):
            continue  # not a backup Tandem can read
    for entry in found:
        note = _read_json(entry.pop("run_dir") / "finished.json")
        try:
            if float(note["time"]) >= entry["written"]:
                entry["finished_step"] = int(note["step"])
        except (TypeError, KeyError, ValueError):
            pass  # no note (or an unreadable one): the run has not finished
    return sorted(found, key=lambda f: (f["written"], f["step"]), reverse=True)


def backup(root: Path, workspace: str) -> dict | None:
    """The newest complete backup of the workspace, as modules.trainer.backup.latest_backup picks it."""
    found = backups(root, workspace)
    if not found:
        return None
    newest = found[0]
    return {key: newest[key] for key in ("step", "run_id", "written", "path")}


def prune_sources(root: Path, keep: str) -> list[str]:
    """Delete source versions no running run uses, except `keep`; returns the deleted ones."""
    import shutil
    used = {keep} | {entry.get("source") for entry in Runs(root).all() if entry["state"] in ("running", "starting")}
    runner = (_read_json(root / "queue" / "queue.json", {}) or {}).get("runner") or {}
    if _alive(runner.get("pid"), "train_queue"):
        used.add(runner.get("source"))  # the machine's job queue runs from it (modules/queue/runner.py)
    deleted = []
    folder = root / "source"
    for version in sorted(folder.iterdir()) if folder.is_dir() else []:
        if version.is_dir() and version.name not in used:
            shutil.rmtree(version, ignore_errors=True)
            deleted.append(version.name)
    return deleted


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tensorboard(root: Path, logdir: str, port: int) -> int:
    """TensorBoard on 127.0.0.1:`port` of this machine (reached through the desktop's ssh tunnel only), for as
    long as the ssh connection that started it lasts: it ends when stdin closes."""
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(root / logdir),
                               "--host", "127.0.0.1", "--port", str(port)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), server.terminate()), daemon=True).start()
    return server.wait()


# --- command line ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="remote_side")
    p.add_argument("--root", required=True)
    sub = p.add_subparsers(dest="verb", required=True)
    sub.add_parser("start")  # the spec as JSON on stdin
    for verb in ("supervise", "status", "kill"):
        sub.add_parser(verb).add_argument("run")
    sub.add_parser("runs")
    f = sub.add_parser("follow")
    f.add_argument("run")
    f.add_argument("--offset", type=int, default=0)
    c = sub.add_parser("command")
    c.add_argument("run")
    c.add_argument("word")
    sub.add_parser("manifest")
    sub.add_parser("commit")  # JSON on stdin
    for verb in ("outputs", "backup", "backups"):
        sub.add_parser(verb).add_argument("workspace")
    sub.add_parser("pack")  # JSON list on stdin
    sub.add_parser("prune-sources").add_argument("keep")
    sub.add_parser("free-port")
    t = sub.add_parser("tensorboard")
    t.add_argument("logdir")
    t.add_argument("port", type=int)
    args = p.parse_args(argv)
    root = Path(args.root).expanduser()
    os.umask(0o077)  # the desktop's commands set it too; a call by hand makes nothing others can read either

    def answer(value) -> int:
        print(json.dumps(value))
        return 0

    try:
        if args.verb == "start":
            return answer(start(root, json.load(sys.stdin)))
        if args.verb == "supervise":
            return supervise(root, args.run)
        if args.verb == "status":
            return answer(Runs(root).status(args.run))
        if args.verb == "kill":
            return answer(kill(root, args.run))
        if args.verb == "runs":
            return answer(Runs(root).all())
        if args.verb == "follow":
            return follow(root, args.run, args.offset)
        if args.verb == "command":
            return answer(command(root, args.run, args.word))
        if args.verb == "manifest":
            return answer(manifest(root))
        if args.verb == "commit":
            return answer(commit(root, json.load(sys.stdin)))
        if args.verb == "outputs":
            return answer(outputs(root, args.workspace))
        if args.verb == "backup":
            return answer(backup(root, args.workspace))
        if args.verb == "backups":
            return answer(backups(root, args.workspace))
        if args.verb == "pack":
            pack(root, json.load(sys.stdin))
            return 0
        if args.verb == "prune-sources":
            return answer(prune_sources(root, args.keep))
        if args.verb == "free-port":
            return answer(free_port())
        if args.verb == "tensorboard":
            return tensorboard(root, args.logdir, args.port)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        return _fail(f"{args.verb}: {e}")
    return _fail(f"unknown verb {args.verb}")


if __name__ == "__main__":
    sys.exit(main())
