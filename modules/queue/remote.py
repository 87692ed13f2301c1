"""A remote machine's queue from the desktop: `scripts/train_queue.py --host user@box <verb> ...`.

The queue lives on the machine whose GPUs it shares (`<remote folder>/queue/`), and so does its runner, so
jobs go on starting overnight with the desktop switched off; its jobs are ordinary remote runs
(`<remote folder>/runs/`), which `scripts/train_remote.py --list / --attach` and the GUI's "Run on" see too.
`add` does on the desktop what a remote start does (`RemoteSession.prepare_job`: Tandem installed there at
this version, the config made the remote's, its data and models uploaded), then hands the remote config to the
queue there; every other verb runs `scripts/train_queue.py` there, through ssh, and prints its answer.
The GUI's Queue tab (ui/remote_queue_controller.py) goes through the same functions: `words`, `add_job`, `call`
and `answer`.
"""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from modules.config import ConfigError, config_to_dict, load_config
from modules.remote.cli import hosts_from, trust
from modules.remote.host import environment_pairs
from modules.remote.known_hosts import KnownHosts, ScanError
from modules.remote.machine import CURRENT, NOT_INSTALLED, RemoteMachine
from modules.remote.prepare import SetupError
from modules.remote.session import RemoteSession, StartRefused
from modules.remote.ssh import Result, SshError

from .jobs import GpuNeed, NeedError

EXIT_USAGE = 2


def queue_script(machine: RemoteMachine, *args: str) -> str:
    """The sh command that runs `scripts/train_queue.py <args>` on the machine's queue (`<folder>/queue`)."""
    missing = f"Tandem is not installed in {machine.host.folder} there: add a job to install it"
    return (f"cd {machine.path('source', CURRENT)} 2>/dev/null || {{ echo {shlex.quote(missing)} >&2; "
            f"exit {NOT_INSTALLED}; }}; exec {machine.python} scripts/train_queue.py --folder {machine.path('queue')} "
            + " ".join(shlex.quote(a) for a in args))


def call(machine: RemoteMachine, *args: str, input: object = None, timeout: float | None = 300) -> Result:
    data = json.dumps(input).encode() if input is not None else None
    return machine.run(queue_script(machine, *args), input=data, timeout=timeout, check=False)


def words(verb: str, *args: str, slots: int | None = None, as_json: bool = False) -> list[str]:
    """A verb as the remote's train_queue.py takes it: its options first, then the verb and its arguments."""
    return (["--slots", str(slots)] if slots is not None else []) + (["--json"] if as_json else []) + [verb, *args]


class RemoteQueueError(RuntimeError):
    """The remote queue answered with an error (its own `error: ...` line), or Tandem is not installed there."""


def naming(label: str, text: str) -> str:
    """`text` naming the machine: prefixed with `label` unless it names it already."""
    return text if label in text else f"{label}: {text}"


def answer(machine: RemoteMachine, done: Result) -> str:
    """The remote's answer, or RemoteQueueError with the line it gave as its error."""
    if done.returncode == 0:
        return done.text
    lines = [line.strip() for line in done.stderr.strip().splitlines() if line.strip()]
    raise RemoteQueueError(naming(machine.label, (lines[-1] if lines else f"exit code {done.returncode}")
                                  .removeprefix("error: ")))


def add_job(machine: RemoteMachine, session: RemoteSession, cfg, need: GpuNeed | None, name: str, source: str,
            slots: int | None = None, as_json: bool = False) -> Result:
    """`add` on the machine's queue: prepared as a remote start is (`session.prepare_job`: installs Tandem there at
    this version, makes the config the remote's, uploads what it lacks - a large upload asks `session.confirm`),
    then handed to the queue there (`add-spec`), which checks the job against its GPUs."""
    plan, _report = session.prepare_job(cfg)
    payload = job_payload(config_to_dict(plan.config), need, name, source, machine.host.environment,
                          machine.host.folder)
    return call(machine, *words("add-spec", slots=slots, as_json=as_json), input=payload)


def job_payload(plan_config: dict, need: GpuNeed | None, name: str, source: str, environment: str,
                root: str) -> dict:
    """What `add-spec` on the remote queues: the remote config (its paths the uploaded copies, relative to the
    remote folder, where the job runs), the GPUs it needs (None: what the config asks), and its variables."""
    return {"config": plan_config, "need": need.text() if need else None, "name": name, "source": source,
            "env": environment_pairs(environment), "root": root}


def main_remote(args) -> int:
    try:
        hosts = hosts_from(args)
        if len(hosts) != 1:
            raise ValueError("a queue is one machine's: give one --host")
        need = GpuNeed.parse(args.gpus) if getattr(args, "gpus", None) else None
    except (ValueError, NeedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    known = KnownHosts.default()
    machine = RemoteMachine(hosts[0], known)
    try:
        trust(machine, args.accept_host_key, sys.stdin.isatty())
        return _act(args, machine, known, need)
    except (SshError, SetupError, StartRefused, ScanError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


def _passed_on(args) -> list[str]:
    """The verb and its words as the remote's train_queue.py takes them."""
    rest = []
    if args.verb in ("cancel", "log") or (args.verb in ("pause", "resume") and args.job):
        rest.append(args.job)
    if args.verb == "log" and args.tail is not None:
        rest += ["--tail", str(args.tail)]
    if args.verb == "move":
        rest += [args.job, args.where]
    if args.verb == "run" and args.here:
        rest.append("--here")
    return words(args.verb, *rest, slots=args.slots, as_json=args.json)


def _act(args, machine: RemoteMachine, known: KnownHosts, need: GpuNeed | None) -> int:
    if args.verb == "add":
        cfg = load_config(args.config, args.config_value)

        def confirm(text: str) -> bool:
            print(text, file=sys.stderr)
            return bool(args.yes) or (sys.stdin.isatty() and input("[y/N] ").strip().lower() in ("y", "yes"))
        session = RemoteSession([machine.host], known, progress=lambda text: print(text, file=sys.stderr),
                                confirm=confirm)
        done = add_job(machine, session, cfg, need, args.name or Path(args.config).stem.lstrip("#"),
                       args.config + "".join(f" + {o}" for o in args.config_value), args.slots, args.json)
    else:
        done = call(machine, *_passed_on(args), timeout=None if args.verb == "run" and args.here else 300)
    if done.returncode == NOT_INSTALLED:
        print(f"error: {done.stderr.strip()}", file=sys.stderr)
        return EXIT_USAGE
    sys.stdout.write(done.text)
    sys.stderr.write(done.stderr)
    return done.returncode
