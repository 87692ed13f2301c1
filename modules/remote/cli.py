"""scripts/train_remote.py: train on a remote machine (or several) over SSH from the command line.

    python scripts/train_remote.py --host user@gpu-box --config-path my.json            start, follow, fetch
    python scripts/train_remote.py --host user@gpu-box --attach                         follow the run again
    python scripts/train_remote.py --host user@gpu-box --stop | --fetch | --list | --check | --tensorboard
    python scripts/train_remote.py --host user@a --host user@b --config-path my.json    node 0 on a, node 1 on b

Ctrl-C while following detaches: the run goes on on the remote.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from modules.config import ConfigError, load_config

from .fetch import fetch_outputs
from .host import DEFAULT_FOLDER, RemoteHost, parse_destination
from .known_hosts import KnownHosts, ScanError, accept
from .machine import RemoteMachine
from .prepare import SetupError
from .remote_side import OUTPUT_PARTS
from .runs import Follower, RunInfo, list_runs, pick_run, send_command
from .session import RemoteSession, StartRefused, host_keys
from .ssh import SshError
from .tunnel import Tunnel
from .uploads import size_text

EXIT_USAGE = 2


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train_remote.py", description="Train on remote machines over SSH.",
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_argument_group("the remote machine(s)")
    where.add_argument("--host", action="append", required=True, metavar="[USER@]HOST[:PORT]",
                       help="the machine to train on; several machines: one --host each, node K trains on the K-th")
    where.add_argument("--port", type=int, help="ssh port for every --host without its own :PORT (default 22)")
    where.add_argument("--identity", "-i", help="private key file (default: ssh's own keys and agent)")
    where.add_argument("--remote-folder", action="append", metavar="FOLDER",
                       help=f"Tandem's folder on the remote (default {DEFAULT_FOLDER}); once for all machines, or "
                            "once per --host")
    where.add_argument("--remote-python", help="an existing Python on the remote with Tandem's packages (default: "
                                               "Tandem installs its own environment there)")
    where.add_argument("--torch-spec", metavar="SPEC",
                       help="the torch build of Tandem's install there, '[REQUIREMENT] [--index-url URL]': "
                            "e.g. 'torch==2.11.0' or 'torch==2.11.0 "
                            "--index-url https://download.pytorch.org/whl/cu126' (default: PyPI's, or the CPU build "
                            "from https://download.pytorch.org/whl/cpu on a machine without an NVIDIA driver)")
    where.add_argument("--remote-model", help="the base model already on the remote (a path there); not uploaded")
    where.add_argument("--remote-env", action="append", default=[], metavar="KEY=VALUE",
                       help="a variable for the run on the remote, e.g. NCCL_SOCKET_IFNAME=eth0 (repeatable); a bare "
                            "NAME passes this desktop's value of it, e.g. --remote-env HF_TOKEN")
    where.add_argument("--accept-host-key", action="append", default=[], metavar="SHA256:...",
                       help="trust a machine not known yet that offers this host key fingerprint (compare it with "
                            "`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` on the machine); without it you "
                            "are asked in a terminal")
    what = p.add_argument_group("the run")
    what.add_argument("--config-path", "--config", dest="config_path",
                      help="training config JSON, or a preset name such as '#demo'")
    what.add_argument("--config-value", action="append", default=[], metavar="KEY=VALUE",
                      help="override one config field (repeatable)")
    what.add_argument("--resume", nargs="?", const="latest", metavar="latest|RUN|PATH",
                      help="continue from a backup on the remote (the newest by default)")
    what.add_argument("--num-gpus", type=int, help="GPUs (or CPU processes with --device cpu) per machine; turns "
                                                   "multi-GPU on")
    what.add_argument("--device", choices=["cuda", "cpu"], help="cpu: CPU processes over gloo")
    what.add_argument("--max-restarts", type=int, help="restart every worker after a failure, up to N times")
    what.add_argument("--min-gpus", type=int, help="several machines: go on with at least N GPUs after one is lost")
    what.add_argument("--master-addr", help="several machines: node 0's address as the others reach it "
                                            "(default: the first --host's name)")
    what.add_argument("--master-port", type=int, help="several machines: the rendezvous port on node 0 (default 29500)")
    what.add_argument("--yes", "-y", action="store_true", help="upload without asking, however large")
    what.add_argument("--detach", action="store_true", help="start the run and return instead of following it")
    what.add_argument("--no-fetch", action="store_true", help="do not fetch the outputs when the run ends")
    actions = p.add_argument_group("instead of starting").add_mutually_exclusive_group()
    actions.add_argument("--check", action="store_true", help="check the machine(s): connection, GPUs, Python, Tandem")
    actions.add_argument("--list", action="store_true", help="list the runs on the machine(s)")
    actions.add_argument("--attach", nargs="?", const="", metavar="RUN",
                         help="follow a run from its beginning (default: the newest still running)")
    actions.add_argument("--stop", nargs="?", const="", metavar="RUN", help="stop a run at its next step (with a backup)")
    actions.add_argument("--fetch", nargs="?", const="", metavar="RUN", help="fetch a run's outputs now")
    actions.add_argument("--tensorboard", nargs="?", const="", metavar="RUN",
                         help="TensorBoard of a run through an ssh tunnel, until Ctrl-C")
    return p


def hosts_from(args) -> list[RemoteHost]:
    folders = args.remote_folder or [DEFAULT_FOLDER]
    if len(folders) not in (1, len(args.host)):
        raise ValueError(f"--remote-folder: give it once, or once per --host ({len(args.host)})")
    hosts = []
    for i, destination in enumerate(args.host):
        user, name, port = parse_destination(destination)
        host = RemoteHost(host=name, user=user, port=port or args.port or 22, identity=args.identity or "",
                          folder=folders[i if len(folders) > 1 else 0], python=args.remote_python or "",
                          torch_spec=args.torch_spec or "", base_model=args.remote_model or "",
                          environment=environment_text(args.remote_env))
        problems = host.problems()
        if problems:
            raise ValueError("; ".join(problems))
        hosts.append(host)
    return hosts


def environment_text(pairs: list[str]) -> str:
    """The `--remote-env` values as one setting, each quoted, so that a value with spaces or quotes stays whole.
    A bare NAME takes this desktop's value of that variable (a token then never shows in the command line)."""
    taken = []
    for pair in pairs:
        if "=" not in pair and pair in os.environ:
            pair = f"{pair}={os.environ[pair]}"
        taken.append(pair)
    return shlex.join(taken)


def overrides(args) -> list[str]:
    flags = list(args.config_value)
    if args.num_gpus is not None:
        flags += ["multi_gpu.enabled=true", f"multi_gpu.num_gpus={args.num_gpus}"]
    if args.device:
        flags.append(f"general.device={args.device}")
    for flag, field in (("max_restarts", "max_restarts"), ("min_gpus", "min_gpus")):
        if getattr(args, flag) is not None:
            flags.append(f"multi_gpu.{field}={getattr(args, flag)}")
    return flags


def trust(machine: RemoteMachine, fingerprints: list[str], interactive: bool) -> None:
    """Make sure ssh knows the machine's host key: accept an unknown one whose fingerprint was given on the
    command line or confirmed in the terminal. A changed key raises SshError (never accepted)."""
    try:
        machine.run("true", timeout=60)
        return
    except SshError as e:
        if e.kind != "host_key_unknown":
            raise
    keys = host_keys(machine)
    chosen = [k for k in keys if k.fingerprint in fingerprints]
    shown = "\n".join(f"  {k.describe()}" for k in keys)
    if not chosen and interactive:
        print(f"{machine.label} is not known yet. It offers these host keys:\n{shown}\nCompare with "
              "`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` on the machine.", file=sys.stderr)
        if input("Trust this machine from now on? [y/N] ").strip().lower() in ("y", "yes"):
            chosen = keys
    if not chosen:
        raise SshError("host_key_unknown", f"{machine.label} is not known yet; it offers:\n{shown}\nIf these are the "
                                           "machine's keys, pass --accept-host-key with one of these fingerprints "
                                           "(or run this in a terminal to be asked).")
    where = accept(machine.ssh.known, chosen)
    print(f"Trusting {machine.label} ({', '.join(k.describe() for k in chosen)}); saved in {where}", file=sys.stderr)
    machine.run("true", timeout=60)


def follow(machine: RemoteMachine, run: RunInfo) -> int | None:
    """Print the run's log from its beginning until it ends (its exit code) or Ctrl-C (None: detached)."""
    follower = Follower(machine, run.id)

    def line(text: str) -> None:
        if not text.startswith("@tandem "):  # the events are for the GUI; the log says the same in words
            sys.stdout.write(text)
            sys.stdout.flush()
    try:
        end = follower.follow(line, lambda note: print(note, file=sys.stderr))
    except KeyboardInterrupt:
        follower.close()
        print(f"\nDetached: the run goes on on {machine.label}. Follow it again with --attach {run.id}; "
              f"stop it with --stop {run.id}.", file=sys.stderr)
        return None
    if end is None:
        return None
    if end.state == "lost":
        print(f"The run {run.id} on {machine.label} ended without an exit code (the machine restarted, or its "
              "processes were killed).", file=sys.stderr)
        return 1
    return end.exit_code


def fetch(machine: RemoteMachine, run: RunInfo) -> None:
    folder = Path(run.local_workspace or ".") / "remote" / machine.host.key
    done = fetch_outputs(machine, run.workspace, folder)
    print(f"Fetched {done.files} new file(s), {size_text(done.bytes)}, of the run's "
          f"{', '.join(OUTPUT_PARTS)} into {folder}")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        hosts = hosts_from(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    known = KnownHosts.default()
    machines = [RemoteMachine(h, known) for h in hosts]
    interactive = sys.stdin.isatty()
    try:
        for machine in machines:
            trust(machine, args.accept_host_key, interactive)
        return _act(args, machines, known)
    except (SshError, SetupError, StartRefused, ScanError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


def _act(args, machines: list[RemoteMachine], known: KnownHosts) -> int:
    lead = machines[0]
    cfg = load_config(args.config_path, overrides(args)) if args.config_path else None
    if args.check:
        session = RemoteSession([m.host for m in machines], known)
        reports = session.check()
        for report in reports:
            print(report.message())
        return EXIT_USAGE if any(r.problems for r in reports) else 0
    if args.list:
        for machine in machines:
            runs = list_runs(machine)
            print(f"{machine.label}: " + ("no runs" if not runs else f"{len(runs)} run(s)"))
            for run in runs:
                print("  " + run.describe())
        return 0
    chosen = next((v for v in (args.attach, args.stop, args.fetch, args.tensorboard) if v is not None), None)
    if chosen is not None:
        from .remote_config import workspace_of
        try:  # never stop a run the user did not mean: with several going, --stop needs its id
            run = pick_run(list_runs(lead), chosen or None, workspace_of(cfg) if cfg else None,
                           unique=args.stop is not None)
        except ValueError as e:
            print(f"error: on {lead.label}: {e}", file=sys.stderr)
            return EXIT_USAGE
        if run is None:
            print(f"error: no run {chosen!r} on {lead.label}" if chosen else f"error: no run on {lead.label}",
                  file=sys.stderr)
            return EXIT_USAGE
        if args.stop is not None:
            send_command(lead, run.id, "stop")
            print(f"Asked {run.id} on {lead.label} to stop at its next step (it writes a backup first).")
            return 0
        if args.fetch is not None:
            fetch(lead, run)
            return 0
        if args.tensorboard is not None:
            return _tensorboard(lead, run)
        print(f"Following {run.describe()} on {lead.label} from its beginning.", file=sys.stderr)
        return _finish(lead, run, args)
    if cfg is None:
        print("error: --config-path is needed to start a run", file=sys.stderr)
        return EXIT_USAGE

    def confirm(text: str) -> bool:
        print(text, file=sys.stderr)
        if args.yes:
            return True
        if not sys.stdin.isatty():
            print("Not uploading without --yes (no terminal to ask in).", file=sys.stderr)
            return False
        return input("[y/N] ").strip().lower() in ("y", "yes")

    session = RemoteSession([m.host for m in machines], known, progress=lambda text: print(text, file=sys.stderr),
                            confirm=confirm)
    started = session.start(cfg, args.resume, name=args.config_path, master_addr=args.master_addr,
                            master_port=args.master_port or 0)
    run = started.infos[0]
    print(f"Started {run.id} on " + ", ".join(m.label for m in started.machines)
          + f" (remote folder {lead.host.folder}).", file=sys.stderr)
    if args.detach:
        print(f"Follow it with --attach {run.id}, stop it with --stop {run.id}.", file=sys.stderr)
        return 0
    return _finish(lead, run, args)


def _finish(machine: RemoteMachine, run: RunInfo, args) -> int:
    code = follow(machine, run)
    if code is None:
        return 0
    if not args.no_fetch:
        fetch(machine, run)
    return code


def _tensorboard(machine: RemoteMachine, run: RunInfo) -> int:
    tunnel = Tunnel(machine)
    url = tunnel.open(f"{run.workspace}/tensorboard")
    print(f"TensorBoard of {run.id}: {url} (through ssh; Ctrl-C ends it)", flush=True)
    try:
        while tunnel.open_:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        tunnel.close()
    return 0
