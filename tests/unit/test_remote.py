"""Remote training without a network: settings, the ssh command lines and the meaning of ssh's errors, what is
shipped, the remote config, uploads planning, the remote side's run lifecycle (start detached, follow, commands,
kill, manifest, outputs) run here as it runs there, and the GUI's remote controller over a local stand-in for
ssh. tests/integration/test_remote_ssh.py does it all through a real sshd."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from modules.config import load_config
from modules.remote import remote_side
from modules.remote.cli import hosts_from, overrides, parser
from modules.remote.fetch import extract
from modules.remote.host import RemoteHost, environment_pairs, parse_destination
from modules.remote.known_hosts import KnownHosts, host_pattern
from modules.remote.remote_config import remote_plan, workspace_of
from modules.remote.runs import Follower, RunInfo, node_run_id, pick_run
from modules.remote.session import node_configs, training_command
from modules.remote.source import archive, local_source
from modules.remote.ssh import Ssh, remote_path
from modules.remote.uploads import HashCache, UploadPlan, local_files
from tests.patience import patience

REPO = Path(__file__).resolve().parents[2]

CHANGED = """@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@
@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @
@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@
The fingerprint for the ED25519 key sent by the remote host is
SHA256:TRuj6y3cXaSvyj4lBks/8mQMw/pG9mNR0pEaaPl/ozI.
Offending ED25519 key in /home/me/.config/tandem/known_hosts:1
  remove with:
  ssh-keygen -f "/home/me/.config/tandem/known_hosts" -R "[10.0.0.5]:2222"
Host key for [10.0.0.5]:2222 has changed and you have requested strict checking.
Host key verification failed.
"""
UNKNOWN = ("No ED25519 host key is known for [10.0.0.5]:2222 and you have requested strict checking.\n"
           "Host key verification failed.\n")


def test_destinations_settings_and_their_problems(tmp_path):
    assert parse_destination("me@gpu-box") == ("me", "gpu-box", None)
    assert parse_destination("gpu-box:2222") == ("", "gpu-box", 2222)
    assert parse_destination("me@[::1]:2200") == ("me", "::1", 2200)
    with pytest.raises(ValueError, match="port number"):
        parse_destination("me@box:ssh")
    host = RemoteHost("10.0.0.5", "me", 2222)
    assert host.label == "me@10.0.0.5:2222" and host.destination == "me@10.0.0.5"
    assert RemoteHost.from_dict({**host.to_dict(), "unknown": 1}) == host  # a newer settings file still loads
    assert host.key == RemoteHost("10.0.0.5", "me", 2222).key != RemoteHost("10.0.0.5", "me", 2222, folder="/x").key
    problems = RemoteHost("", port=0, identity=str(tmp_path / "nokey"), folder=" ", environment="A").problems()
    text = "\n".join(problems)
    for part in ("remote host: empty", "port 0", "nokey: no such file", "remote folder: empty", "'A' is not KEY=VALUE"):
        assert part in text, (part, text)
    assert RemoteHost("-oProxyCommand=x").problems()  # never an option smuggled in as a host
    assert environment_pairs('NCCL_SOCKET_IFNAME=eth0 NOTE="two words"') == {"NCCL_SOCKET_IFNAME": "eth0",
                                                                            "NOTE": "two words"}


def test_ssh_runs_with_keys_only_and_strict_host_keys(tmp_path):
    known = KnownHosts((tmp_path / "a b" / "known_hosts", tmp_path / "user"), tmp_path / "a b" / "known_hosts")
    ssh = Ssh(RemoteHost("box", "me", 2222, identity="~/.ssh/key"), known)
    command = ssh.command("echo hi")
    text = " ".join(command)
    for option in ("BatchMode=yes", "StrictHostKeyChecking=yes", "ServerAliveInterval=", "IdentitiesOnly=yes",
                   f'UserKnownHostsFile="{(tmp_path / "a b" / "known_hosts").as_posix()}" {(tmp_path / "user").as_posix()}'):
        assert option in text, option
    # every remote command makes what it creates private to the user (docs/Remote.md, Security)
    assert command[-2:] == ["me@box", "sh -c 'umask 077; echo hi'"] and "-p" in command and "2222" in command
    assert remote_path("~/tandem remote") == '"$HOME"/\'tandem remote\'' and remote_path("/a b") == "'/a b'"
    assert host_pattern("box", 22) == "box" and host_pattern("box", 2222) == "[box]:2222"


def test_what_ssh_failures_mean(tmp_path):
    ssh = Ssh(RemoteHost("10.0.0.5", "me", 2222), KnownHosts((tmp_path / "k",), tmp_path / "k"))
    changed = ssh.error(CHANGED)
    assert changed.kind == "host_key_changed"
    assert "CHANGED" in str(changed) and "SHA256:TRuj6y3cXaSvyj4lBks/8mQMw/pG9mNR0pEaaPl/ozI" in str(changed)
    assert 'ssh-keygen -f "/home/me/.config/tandem/known_hosts" -R "[10.0.0.5]:2222"' in str(changed)
    assert "known_hosts, line 1" in str(changed)
    assert ssh.error(UNKNOWN).kind == "host_key_unknown"
    denied = ssh.error("me@10.0.0.5: Permission denied (publickey).")
    assert denied.kind == "auth" and "keys only" in str(denied)
    refused = ssh.error("ssh: connect to host 10.0.0.5 port 2222: Connection refused")
    assert refused.kind == "unreachable" and "Connection refused" in str(refused)


def test_the_shipped_source_and_its_version(tmp_path):
    source = local_source()
    assert "install.sh" in source.files and "modules/remote/remote_side.py" in source.files
    assert not [f for f in source.files if f.startswith((".venv/", ".git/")) or "__pycache__" in f]
    assert local_source().version == source.version  # the same tree, the same version
    # A tree without git: walked, the folders .gitignore names left out; shell scripts ship runnable with LF.
    (tmp_path / "modules").mkdir()
    (tmp_path / "modules" / "a.py").write_text("x = 1\n")
    (tmp_path / "install.sh").write_bytes(b"#!/bin/sh\r\necho hi\r\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "big").write_text("no")
    plain = local_source(tmp_path)
    assert plain.files == ("install.sh", "modules/a.py") and plain.commit == ""
    with tarfile.open(fileobj=io.BytesIO(archive(plain))) as tar:
        script = tar.getmember("install.sh")
        assert script.mode == 0o755 and tar.extractfile(script).read() == b"#!/bin/sh\necho hi\n"
    (tmp_path / "modules" / "a.py").write_text("x = 2\n")
    assert local_source(tmp_path).version != plain.version


def test_the_remote_config_names_uploaded_copies_relative_to_the_remote_folder(tmp_path):
    data = tmp_path / "my data"
    data.mkdir()
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"0")
    cfg = load_config("#demo", [f"general.workspace_dir={tmp_path / 'ws'}", f"general.cache_dir={tmp_path / 'c'}",
                                f"save.output_dir={tmp_path / 'out'}", f"model.base_model={model}"])
    cfg.data.concepts[0].path = str(data)
    plan = remote_plan(cfg, RemoteHost("box"))
    concept = plan.config.data.concepts[0].path
    assert concept.startswith("files/data/my-data-") and plan.config.model.base_model.startswith("files/models/model-")
    assert plan.config.model.base_model.endswith("/model.safetensors")
    assert plan.workspace == workspace_of(cfg) == plan.config.general.workspace_dir and plan.workspace.startswith("work/ws-")
    assert plan.config.general.cache_dir == "" and plan.config.save.output_dir == ""
    assert [u.label for u in plan.uploads] == ["concept 'demo shapes'", "base model"]
    assert cfg.data.concepts[0].path == str(data)  # the desktop's config is left as it was
    # a base model already on the remote is not uploaded; built-in models and data need nothing
    assert remote_plan(cfg, RemoteHost("box", base_model="/models/sd15")).config.model.base_model == "/models/sd15"
    demo = remote_plan(load_config("#demo"), RemoteHost("box"))
    assert demo.uploads == () and demo.config.model.base_model == "builtin:demo"
    # several machines: the same config but for the node number, node 0's address as the rendezvous
    nodes = node_configs(cfg, 2, "10.0.0.1", 0)
    assert [(n.multi_gpu.nnodes, n.multi_gpu.node_rank, n.multi_gpu.master_addr, n.multi_gpu.master_port)
            for n in nodes] == [(2, 0, "10.0.0.1", 29500), (2, 1, "10.0.0.1", 29500)]
    plans = [remote_plan(n, RemoteHost(h, folder=f)) for n, h, f in ((nodes[0], "a", "/x"), (nodes[1], "b", "~/y"))]
    one, two = (p.config for p in plans)
    two.multi_gpu.node_rank = 0
    assert one == two


def test_the_remote_command_is_the_one_the_gui_would_start():
    source = local_source()
    one = load_config("#demo")
    assert training_command(one, 0, source, "r1", None)[0].endswith("scripts/train.py")
    cpu = load_config("#demo", ["multi_gpu.enabled=true", "general.device=cpu", "multi_gpu.num_gpus=2"])
    command = training_command(cpu, 0, source, "r1", "latest")
    assert command == [f"source/{source.version}/scripts/train_multi_gpu.py", "--config-path",
                       "runs/r1/config.json", "--resume", "latest"]
    assert training_command(load_config("#demo", ["multi_gpu.enabled=true"]), 1, source, "r", None)[0].endswith("train.py")
    assert node_run_id("r1", 0) == "r1" and node_run_id("r1", 2) == "r1-node2"


def test_upload_listing_hashes_and_message(tmp_path):
    from modules.remote.remote_config import Upload
    folder = tmp_path / "cats"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.png").write_bytes(b"a" * 10)
    (folder / "sub" / "b.png").write_bytes(b"b" * 20)
    (folder / ".thumbs").write_bytes(b"x")
    upload = Upload("concept 'cats'", folder, "data/cats")
    assert [r for _, r in local_files(upload)] == ["data/cats/a.png", "data/cats/sub/b.png"]
    flat = Upload("concept 'cats'", folder, "data/cats", recursive=False)
    assert [r for _, r in local_files(flat)] == ["data/cats/a.png"]
    hashes = HashCache(tmp_path / "hashes.json")
    first = hashes.digest(folder / "a.png")
    hashes.save()
    again = HashCache(tmp_path / "hashes.json")
    assert again.digest(folder / "a.png") == first and not again.changed  # unchanged files are not read again
    from modules.remote.uploads import FileEntry
    entries = [FileEntry(p, r, p.stat().st_size, "h") for p, r in local_files(upload)]
    plan = UploadPlan((upload,), entries, entries[1:])
    assert plan.message("me@box") == "Upload 20 bytes to me@box: concept 'cats' 20 bytes (1 of 2 files changed)"


def test_an_edit_that_keeps_size_and_modification_time_is_uploaded_again(tmp_path, monkeypatch):
    """A caption and an image edited in place to the same size with their modification time put back (cp -p,
    rsync -t, an unzip do that), and an image replaced by a same-size file with the old time: each is sent
    again; unchanged files are not, and a large unchanged one is not even read again."""
    import os
    from modules.remote import uploads
    from modules.remote.remote_config import Upload
    folder = tmp_path / "cats"
    folder.mkdir()
    caption, image, other = folder / "a.txt", folder / "a.png", folder / "b.png"
    caption.write_bytes(b"a red cat")
    image.write_bytes(b"\x89PNG" + b"x" * 100_000)
    other.write_bytes(b"\x89PNG" + b"y" * 100_000)
    read: list[str] = []
    real_sha256 = uploads.file_sha256
    monkeypatch.setattr(uploads, "file_sha256", lambda path: read.append(path.name) or real_sha256(path))

    class Remote:
        """What plan_uploads asks of a machine: its manifest, here the files of the last upload."""
        manifest: dict = {}

        def side(self, verb):
            assert verb == "manifest"
            return self.manifest
    remote, upload = Remote(), Upload("concept 'cats'", folder, "data/cats")
    later = lambda: time.time_ns() + 10 * 10**9  # hashed well after the files were written

    def plan() -> list[str]:
        read.clear()
        done = uploads.plan_uploads(remote, (upload,), HashCache(tmp_path / "hashes.json", clock=later))
        remote.manifest = {f.remote: [f.digest, f.size] for f in done.files}  # the remote has them now
        return sorted(f.local.name for f in done.missing)

    def keep_times(path: Path, edit) -> None:
        before = path.stat()
        edit()
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns
    assert plan() == ["a.png", "a.txt", "b.png"]
    assert plan() == [] and read == ["a.txt"]  # unchanged: nothing sent; the small caption alone read again
    keep_times(caption, lambda: caption.write_bytes(b"a big cat"))
    with open(image, "r+b") as f:
        keep_times(image, lambda: (f.seek(50), f.write(b"z"), f.flush()))
    replacement = folder / ".b.png.tmp"
    replacement.write_bytes(b"\x89PNG" + b"w" * 100_000)
    os.utime(replacement, ns=(other.stat().st_atime_ns, other.stat().st_mtime_ns))
    os.replace(replacement, other)  # what rsync -t does: a new file with the old time renamed over it
    assert plan() == ["a.png", "a.txt", "b.png"]
    assert plan() == []
    # A file hashed right after it changed (the real clock: the image was written a moment ago) is not
    # remembered: a change within the same tick of a coarse clock could go unseen.
    fresh = HashCache(tmp_path / "fresh.json")
    fresh.digest(image)
    assert fresh.entries == {}


def test_pick_run_prefers_what_is_still_going():
    runs = [RunInfo("a", "ended", 0, "work/x", created=1), RunInfo("b", "running", workspace="work/x", created=2),
            RunInfo("c", "ended", 0, "work/y", created=3)]
    assert pick_run(runs).id == "b" and pick_run(runs, workspace="work/y").id == "c"
    assert pick_run(runs, "c").id == "c" and pick_run(runs, "zz") is None
    two = [*runs, RunInfo("d", "running", workspace="work/y", created=4)]
    assert pick_run(two).id == "d"  # to follow: the newest going
    with pytest.raises(ValueError, match=r"2 runs are going \(b, d\)"):
        pick_run(two, unique=True)  # to stop: never a guess
    assert pick_run(two, workspace="work/y", unique=True).id == "d"


def test_cli_hosts_and_flags(tmp_path):
    args = parser().parse_args(["--host", "me@a:2200", "--host", "b", "--port", "2222", "--remote-folder", "/x",
                                "--remote-folder", "/y", "--num-gpus", "2", "--device", "cpu", "--max-restarts", "1"])
    a, b = hosts_from(args)
    assert (a.user, a.host, a.port, a.folder, b.host, b.port, b.folder) == ("me", "a", 2200, "/x", "b", 2222, "/y")
    assert overrides(args) == ["multi_gpu.enabled=true", "multi_gpu.num_gpus=2", "general.device=cpu",
                               "multi_gpu.max_restarts=1"]
    with pytest.raises(ValueError, match="once per --host"):
        hosts_from(parser().parse_args(["--host", "a", "--host", "b", "--host", "c", "--remote-folder", "/x",
                                        "--remote-folder", "/y"]))


# --- the remote side, run here ---------------------------------------------------------------------------
def side(root: Path, *args: str, input: object = None):
    done = subprocess.run([sys.executable, "-m", "modules.remote.remote_side", "--root", str(root), *args],
                          cwd=REPO, capture_output=True, text=True,
                          input=json.dumps(input) if input is not None else "", timeout=patience(120))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout) if done.stdout.strip() else None


def start_spec(run_id: str, code: str, workspace: str = "work/ws") -> dict:
    return {"id": run_id, "workspace": workspace, "command": ["-c", code], "env": {"GREETING": "hello"},
            "config_name": "test", "config": {"x": 1}}


def follow_lines(root: Path, run_id: str, offset: int = 0) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "modules.remote.remote_side", "--root", str(root), "follow", run_id,
                           "--offset", str(offset)], cwd=REPO, capture_output=True, text=True, timeout=120)
    return done.stdout.splitlines()


def test_a_run_starts_detached_and_its_output_is_followed_to_its_exit_code(tmp_path):
    code = ("import os, sys, time; print('@tandem ' + '{\"type\": \"status\", \"text\": \"hi\"}'); "
            "print(os.environ['GREETING'], os.environ['TANDEM_EVENTS'], os.getcwd()); sys.stdout.flush(); "
            "time.sleep(0.5); print('last', end=''); sys.exit(3)")
    entry = side(tmp_path, "start", input=start_spec("r1", code))
    assert entry["state"] in ("running", "ended") and entry["training_pid"]
    assert json.loads((tmp_path / "runs" / "r1" / "config.json").read_text()) == {"x": 1}
    assert (tmp_path / "work" / "ws" / ".tandem" / "commands").read_text() == ""
    lines = follow_lines(tmp_path, "r1")
    assert lines[0].startswith("@tandem ") and lines[1] == f"hello 1 {tmp_path}" and lines[2] == "last"
    end = json.loads(lines[-1][len(remote_side.END_MARKER):])
    assert end["exit_code"] == 3 and end["state"] == "ended"
    # from an offset: only what follows it (a reconnect sees no line twice)
    offset = len((lines[0] + "\n").encode())
    assert follow_lines(tmp_path, "r1", offset)[0] == lines[1]
    (status,) = side(tmp_path, "runs")
    assert status["id"] == "r1" and status["state"] == "ended" and status["exit_code"] == 3
    assert status["config_name"] == "test" and status["log_bytes"] > 0


def test_commands_reach_the_runs_commands_file_and_kill_ends_it(tmp_path):
    side(tmp_path, "start", input=start_spec("r2", "import time; time.sleep(300)"))
    side(tmp_path, "command", "r2", "sample")
    side(tmp_path, "command", "r2", "stop")
    assert (tmp_path / "work" / "ws" / ".tandem" / "commands").read_text() == "sample\nstop\n"
    assert side(tmp_path, "status", "r2")["state"] == "running"
    started = time.monotonic()
    ended = side(tmp_path, "kill", "r2")
    assert ended["state"] == "ended" and ended["exit_code"] == -15 and time.monotonic() - started < patience(30)
    with pytest.raises(AssertionError, match="unknown command"):
        side(tmp_path, "command", "r2", "format-disk")


def test_the_manifest_drops_vanished_files_and_commit_prunes_what_the_desktop_no_longer_has(tmp_path):
    files = tmp_path / "files" / "data" / "cats"
    files.mkdir(parents=True)
    for name in ("a.png", "b.png", "old.png"):
        (files / name).write_bytes(name.encode())
    side(tmp_path, "commit", input={"added": {"data/cats/a.png": ["ha", 5], "data/cats/b.png": ["hb", 99]},
                                    "items": ["data/cats"], "listing": ["data/cats/a.png", "data/cats/b.png"]})
    assert not (files / "old.png").exists() and (files / "a.png").exists()
    assert side(tmp_path, "manifest") == {"data/cats/a.png": ["ha", 5]}  # b's size differs from the record


def test_outputs_are_listed_packed_and_extracted_inside_the_workspace_only(tmp_path):
    remote, local = tmp_path / "remote", tmp_path / "local"
    out = remote / "work" / "ws" / "output"
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"m" * 100)
    (remote / "work" / "ws" / "samples").mkdir()
    (remote / "work" / "ws" / "samples" / "s.png").write_bytes(b"png")
    (remote / "secret").write_text("no")
    listing = side(remote, "outputs", "work/ws")
    assert [name for name, _, _ in listing] == ["work/ws/output/model.safetensors", "work/ws/samples/s.png"]
    packed = subprocess.run([sys.executable, "-m", "modules.remote.remote_side", "--root", str(remote), "pack"],
                            cwd=REPO, capture_output=True, timeout=patience(60),
                            input=json.dumps([n for n, _, _ in listing] + ["secret", "work/ws/../../../etc/passwd"]).encode())
    assert extract(io.BytesIO(packed.stdout), "work/ws", local) == (2, 103)
    assert (local / "output" / "model.safetensors").read_bytes() == b"m" * 100 and not (local / "secret").exists()
    # A doctored stream: paths outside the workspace and links are never written.
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as tar:
        for name in ("work/ws/../../escape", "/etc/cron.d/x", "work/other/x"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
        link = tarfile.TarInfo("work/ws/output/link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    evil.seek(0)
    assert extract(evil, "work/ws", local / "evil") == (0, 0)
    assert not (local / "evil").exists() and not (tmp_path / "escape").exists()


# --- the GUI's remote controller over a local stand-in for ssh ----------------------------------------------
class LocalMachine:
    """Runs remote_side here instead of through ssh: the controller's logic without a network."""

    def __init__(self, root: Path, host: RemoteHost):
        self.root, self.host, self.label = root, host, host.label
        self.ssh = Ssh(host, KnownHosts((root / "k",), root / "k"))

    def _command(self, verb, *args):
        return [sys.executable, "-m", "modules.remote.remote_side", "--root", str(self.root), verb, *args]

    def side(self, verb, *args, input=None, timeout=120):
        done = subprocess.run(self._command(verb, *args), cwd=REPO, capture_output=True, timeout=patience(timeout),
                              input=json.dumps(input).encode() if input is not None else b"")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def side_stream(self, verb, *args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE):
        return subprocess.Popen(self._command(verb, *args), cwd=REPO, stdin=stdin, stdout=stdout,
                                stderr=subprocess.PIPE)


def test_the_remote_controller_follows_events_sends_commands_and_replays_on_attach(tmp_path):
    from ui.remote_controller import RemoteRunController
    host = RemoteHost("box", folder=str(tmp_path / "remote"))
    controller = RemoteRunController(host, KnownHosts((tmp_path / "k",), tmp_path / "k"))
    controller.machine = LocalMachine(tmp_path / "remote", host)
    events = [{"type": "config", "world_size": 1, "per_gpu_batch": 1, "accumulation": 1, "global_batch": 1,
               "micro_batches_per_epoch": 1, "steps_per_epoch": 1, "epochs": 1, "total_steps": 3, "base_lr": 1,
               "lr_scaling": "none", "lr": 1, "split": [1], "items_per_epoch": 1, "items_left_out": 0}]
    events += [{"type": "loss", "step": s, "loss": 1.0 / s, "lr": 0.1} for s in (1, 2)]
    events += [{"type": "saved", "path": "work/ws/output/m", "step": 2}]
    # the fake training: its events, then it waits for a command in its commands file and says which came
    code = ("import json, time, pathlib; " + "; ".join(f"print('@tandem ' + json.dumps({e!r}), flush=True)" for e in events)
            + "; f = pathlib.Path('work/ws/.tandem/commands')\nwhile not f.read_text(): time.sleep(0.05)\n"
            "print('got', f.read_text().strip(), flush=True)")
    info = RunInfo.from_json(controller.machine.side("start", input={**start_spec("r3", code), "local_workspace": str(tmp_path / "ws")}))
    controller.attach(info)
    deadline = time.monotonic() + patience(60)
    while controller.state.step < 2 and len(controller.state.losses) < 2 and time.monotonic() < deadline:
        controller.poll()
        time.sleep(0.05)
    assert controller.state.losses == [(1, 1.0), (2, 0.5)] and controller.state.total_steps == 3
    controller.stop()  # the Stop button
    assert controller.state.status == "stopping"
    while controller.state.active and time.monotonic() < deadline:
        controller.poll()
        time.sleep(0.05)
    assert controller.state.status == "stopped", (controller.state.error, list(controller.log))
    assert "got stop" in controller.log
    assert controller.state.saved == [f"{host.label}:{host.folder}/work/ws/output/m"]
    # Reopening: a fresh controller attaches to the ended run and gets the whole curve again.
    again = RemoteRunController(host, KnownHosts((tmp_path / "k",), tmp_path / "k"))
    again.machine = controller.machine
    again.attach(info)
    while again.state.active and time.monotonic() < deadline:
        again.poll()
        time.sleep(0.05)
    assert again.state.losses == [(1, 1.0), (2, 0.5)]


def test_a_follower_reconnects_after_the_connection_drops(tmp_path):
    """The stream breaking before the run's end (the ssh process killed) is a lost connection, not the end."""
    root = tmp_path / "remote"
    machine = LocalMachine(root, RemoteHost("box"))
    side(root, "start", input=start_spec("r4", "import time\nfor i in range(40): print(i, flush=True); time.sleep(0.05)"))
    follower = Follower(machine, "r4")
    seen, notes = [], []

    def on_line(text):
        seen.append(text.strip())
        if len(seen) == 3 and follower._process is not None:
            follower._process.kill()  # the connection drops mid-stream
    end = follower.follow(on_line, notes.append)
    assert end.exit_code == 0 and seen == [str(i) for i in range(40)]  # nothing lost, nothing twice
    assert len(notes) == 1 and "the run goes on there" in notes[0]


def test_the_reconnect_back_off_starts_again_once_a_connection_held():
    """After a long outage (every wait up to the longest), a connection that then held for a while and a later
    short outage: the first retry waits the first delay again, not the longest."""
    from modules.remote.runs import HELD_S, RECONNECT_DELAYS_S, Backoff
    now = [0.0]
    backoff = Backoff(clock=lambda: now[0])

    def attempt(up_for: float, lines: int = 0) -> float:
        backoff.connecting()
        now[0] += up_for
        for _ in range(lines):
            backoff.delivered()
        return backoff.next_delay()
    long_outage = [attempt(up_for=15) for _ in range(9)]  # each attempt times out connecting
    assert long_outage == [*RECONNECT_DELAYS_S, RECONNECT_DELAYS_S[-1], RECONNECT_DELAYS_S[-1], RECONNECT_DELAYS_S[-1]]
    assert attempt(up_for=HELD_S + 3600) == RECONNECT_DELAYS_S[0]  # held an hour (a quiet run: no line), then dropped
    assert attempt(up_for=1) == RECONNECT_DELAYS_S[1]  # the short outage grows from the start again
    assert attempt(up_for=1, lines=1) == RECONNECT_DELAYS_S[0]  # a connection that brought data held too
    assert attempt(up_for=HELD_S - 1) == RECONNECT_DELAYS_S[1]  # up, silent, shorter than HELD_S: not held


def test_the_remote_newest_backup_is_the_one_continue_resumes(tmp_path):
    """remote_side reads the backups without torch; it must pick what modules.trainer.backup.latest_backup picks."""
    import torch

    from modules.trainer.backup import latest_backup, write_backup
    backups = tmp_path / "work" / "ws" / "backups"
    assert side(tmp_path, "backup", "work/ws") is None
    write_backup(backups, "run-a", 40, {"w": torch.zeros(1)}, {}, {}, keep=2)
    time.sleep(0.05)
    write_backup(backups, "run-b", 10, {"w": torch.zeros(1)}, {}, {}, keep=2)  # newer, though at a lower step
    (backups / "run-b" / ".step-00000020.tmp").mkdir()  # an interrupted write is never picked
    found, expected = side(tmp_path, "backup", "work/ws"), latest_backup(backups)
    assert (found["step"], found["run_id"], tmp_path / found["path"]) == (expected.step, expected.run_id, expected.path)


def test_the_remote_backup_list_is_the_one_the_run_tab_lists_here(tmp_path):
    """The Run tab lists a remote workspace's backups as it lists this machine's (ui/backup_choices.py): newest
    first, a finished run's marked, interrupted writes left out - read there without torch."""
    import torch

    from modules.trainer.backup import mark_finished, write_backup
    from ui.backup_choices import backup_choices
    backups = tmp_path / "work" / "ws" / "backups"
    assert side(tmp_path, "backups", "work/ws") == []
    write_backup(backups, "run-a", 40, {"w": torch.zeros(1)}, {}, {}, keep=2)
    time.sleep(0.05)
    mark_finished(backups, "run-a", 50, "out.safetensors")  # run-a finished after its backup at step 40
    time.sleep(0.05)
    write_backup(backups, "run-b", 10, {"w": torch.zeros(1)}, {}, {}, keep=2)
    time.sleep(0.05)
    write_backup(backups, "run-b", 20, {"w": torch.zeros(1)}, {}, {}, keep=2)
    (backups / "run-b" / ".step-00000030.tmp").mkdir()  # an interrupted write is never listed
    found, expected = side(tmp_path, "backups", "work/ws"), backup_choices(backups)
    assert [(b["run_id"], b["step"], b["finished_step"], tmp_path / b["path"]) for b in found] == \
        [(c.info.run_id, c.step, c.finished_step, c.path) for c in expected]
    assert [(b["run_id"], b["step"], b["finished_step"]) for b in found] == \
        [("run-b", 20, None), ("run-b", 10, None), ("run-a", 40, 50)]


def test_the_launcher_script_starts_on_a_remote_with_remote(monkeypatch):
    """start-multi-gpu (.bat through modules/start_multi_gpu.py): --remote hands over to scripts/train_remote.py;
    the local GPUs are not asked (the remote's decide)."""
    from modules import start_multi_gpu

    def local_gpus(python):
        raise AssertionError("the local GPU count is not needed for a remote start")

    def plan(*args, stdin=""):
        return start_multi_gpu.plan(list(args), system="Linux", gpu_count=local_gpus, stdin=io.StringIO(stdin),
                                    stdout=io.StringIO(), stderr=io.StringIO(), environ={}).command
    command = plan("--yes", "--config", "#demo", "--remote", "me@gpu-box:2222", "--identity", "~/.ssh/k",
                   "--remote-folder", "/data/tandem", "--config-value", "training.max_steps=10")
    assert command[1:] == [str(Path("scripts") / "train_remote.py"), "--host", "me@gpu-box:2222", "--identity",
                           "~/.ssh/k", "--remote-folder", "/data/tandem", "--config-path", "#demo", "--num-gpus", "0",
                           "--config-value", "training.max_steps=10"]
    two = plan("--config", "#demo", "--remote", "a", "--remote", "b", "--device", "cpu", "--master-addr", "10.0.0.1",
               "--port", "29500", stdin="2\n1\n")  # the questions: processes per machine, restarts
    assert two[2:6] == ["--host", "a", "--host", "b"] and two[two.index("--num-gpus") + 1] == "2"
    assert ["--device", "cpu", "--max-restarts", "1", "--master-addr", "10.0.0.1", "--master-port", "29500"] == \
        two[two.index("--device"):two.index("--master-port") + 2]
    with pytest.raises(start_multi_gpu.UsageError, match="each --remote machine is one node"):
        plan("--yes", "--config", "#demo", "--remote", "a", "--node-rank", "1")


def test_the_remote_package_and_the_gui_parts_import_no_torch():
    """The GUI and scripts/train_remote.py drive remote runs (and queues) without PyTorch on the desktop."""
    code = ("import sys; import modules.remote.cli, modules.remote.session, modules.remote.remote_side, "
            "ui.remote_controller, ui.remote_queue_controller, ui.settings; print(sorted(k for k in ('torch', 'diffusers', 'transformers') "
            "if k in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=patience(120))
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.slow
def test_a_machine_other_than_node_0_builds_the_built_in_model_in_its_launcher(tmp_path, monkeypatch):
    """Each machine of several has its own disk; a worker there cannot write the built-in model (transformers
    saves a text encoder only on rank 0 of a process group), so that machine's launcher builds it first."""
    from modules.preflight import check_model
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    node0 = load_config("#demo", ["multi_gpu.enabled=true", "multi_gpu.nnodes=2", "multi_gpu.master_port=29500"])
    check_model(node0)
    assert not (tmp_path / "demo-model").exists()  # node 0's rank 0 builds it as on one machine
    node0.multi_gpu.node_rank = 1
    check_model(node0)
    assert (tmp_path / "demo-model" / "text_encoder" / "config.json").is_file()


def test_a_built_in_model_with_an_empty_part_is_refused_not_marked_complete(tmp_path):
    from modules.model.demo import ensure_built_model
    with pytest.raises(RuntimeError, match="left text_encoder empty"):
        ensure_built_model(tmp_path / "model", lambda folder: (folder / "text_encoder").mkdir())
    assert not (tmp_path / "model").exists()


@pytest.mark.slow
def test_the_run_on_row_keeps_machines_and_refuses_a_start_it_cannot_make(display, tmp_path):
    """Under Xvfb, no network: a new machine without a host refuses Start (never trains here instead), a saved
    one is remembered for the next window, and one never checked refuses Start saying so."""
    from tests.gui.test_ui_widgets import make_app, pump
    from ui.settings import SavedRemotes
    from ui.views.remote_frame import NEW_REMOTE, THIS_MACHINE
    closed = socket_port_nobody_listens_on()
    app, _ = make_app(tmp_path)
    try:
        frame, view = app.remote, app.run_view
        assert frame.menu.get() == THIS_MACHINE and view.controller is app.controller
        frame.choose(NEW_REMOTE)
        view.start_button.invoke()
        assert "remote host: empty" in view.error_text() and not app.controller.state.active
        frame.vars["host"].set(f"me@127.0.0.1:{closed}")
        frame.vars["folder"].set("/data/tandem")
        host = frame.save_remote()
        assert (host.user, host.host, host.port, host.folder) == ("me", "127.0.0.1", closed, "/data/tandem")
        assert view.controller is frame.current and frame.current.host == host
        view.start_button.invoke()
        assert "has not been checked yet" in view.error_text() and not frame.current.state.active
        frame.choose(THIS_MACHINE)
        assert view.controller is app.controller
        frame.choose(frame._label(host))
        assert SavedRemotes(tmp_path / "home").chosen == host.key
    finally:
        app.destroy()
    again, _ = make_app(tmp_path)  # the next window comes back to that machine, and tries it at once
    try:
        assert again.remote.current is not None and again.remote.current.host == host
        assert pump(again, lambda: "Connection refused" in again.remote.notice_text(), timeout=60), \
            again.remote.notice_text()
    finally:
        again.destroy()


def socket_port_nobody_listens_on() -> int:
    from modules.util.ports import find_free_port
    return find_free_port()


def test_show_switches_to_another_run_and_the_first_goes_on(tmp_path):
    from ui.remote_controller import RemoteRunController
    host = RemoteHost("box", folder=str(tmp_path / "remote"))
    controller = RemoteRunController(host, KnownHosts((tmp_path / "k",), tmp_path / "k"))
    controller.machine = LocalMachine(tmp_path / "remote", host)
    long = RunInfo.from_json(controller.machine.side("start", input=start_spec(
        "long", "import time\nprint('long one', flush=True)\ntime.sleep(60)")))
    short = RunInfo.from_json(controller.machine.side(
        "start", input={**start_spec("short", "print('short one')"), "workspace": "work/other"}))
    controller.attach(long)
    deadline = time.monotonic() + patience(60)
    while "long one" not in controller.log and time.monotonic() < deadline:
        controller.poll()
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match="still going"):
        controller.attach(short)
    controller.attach(short, instead=True)
    while controller.state.active and time.monotonic() < deadline:
        controller.poll()
        time.sleep(0.05)
    assert "short one" in controller.log and "long one" not in controller.log
    assert side(tmp_path / "remote", "status", "long")["state"] == "running"  # not watched, still going
    side(tmp_path / "remote", "kill", "long")



def test_a_slow_earlier_look_up_of_the_backups_does_not_replace_a_later_one(tmp_path, monkeypatch):
    """Two look-ups of the remote runs and backups in flight (one at a reattach, one after the run ended): the
    earlier one answering last must not bring back the list from before the run's last backup."""
    import threading

    import ui.remote_controller as remote_controller
    from ui.remote_controller import RemoteRunController
    first_asked, first_may_answer = threading.Event(), threading.Event()
    backup = {"step": 51, "run_id": "r1", "path": "work/ws/backups/r1/step-51", "written": 1.0}

    def backups(machine, workspace):
        if not first_asked.is_set():  # the first look-up: before the backup, and slow
            first_asked.set()
            assert first_may_answer.wait(patience(30))
            return []
        return [backup]
    monkeypatch.setattr(remote_controller, "list_runs", lambda machine: [])
    monkeypatch.setattr(remote_controller, "remote_backups", backups)
    controller = RemoteRunController(RemoteHost("box", folder=str(tmp_path / "remote")),
                                     KnownHosts((tmp_path / "k",), tmp_path / "k"))
    controller._cfg_workspace = "work/ws"

    def poll_until(condition) -> None:
        deadline = time.monotonic() + patience(30)
        while not condition() and time.monotonic() < deadline:
            controller.poll()
            time.sleep(0.01)
        assert condition()
    controller.refresh()
    assert first_asked.wait(patience(30))
    controller.refresh()  # the later look-up answers first
    poll_until(lambda: controller.listed == 1)
    assert [b.info.step for b in controller.backups] == [51]
    first_may_answer.set()
    poll_until(lambda: controller.changes == 2)  # the earlier answer arrived and was applied - or dropped
    assert [b.info.step for b in controller.backups] == [51]
