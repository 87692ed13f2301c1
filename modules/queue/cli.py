"""scripts/train_queue.py: a queue of training jobs over a machine's GPUs, from the shell.

    python scripts/train_queue.py add my.json --gpus 2            queue a config (it starts when 2 GPUs are free)
    python scripts/train_queue.py add '#demo' --config-value training.max_steps=100 --gpus 1 --name quick
    python scripts/train_queue.py list                            status, GPUs, progress, ETA, model or error
    python scripts/train_queue.py move 3 top | up | down | bottom | 2
    python scripts/train_queue.py cancel 3 | pause 3 | resume 3   one job (resume continues from its backup)
    python scripts/train_queue.py pause | resume                  the whole queue: nothing new starts / starts again
    python scripts/train_queue.py log 3 [--tail BYTES]            the job's log (or its end)
    python scripts/train_queue.py run                             start the runner (add and resume start it too)
    python scripts/train_queue.py --host user@box add my.json     the same on a remote machine: its jobs run there

GPUs: a count (`2`), GPU numbers with commas (`0,2`; `3,` for GPU 3 alone) or `all`; by default what the
config's Multi-GPU settings ask for. On a machine without GPUs, `--slots N` lets N CPU processes stand in.
Exit status 2 with one line when a job is refused or a word is wrong.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

from modules.config import ConfigError, check, config_from_dict, load_config

from . import actions
from .actions import home_variable
from .jobs import GpuNeed, NeedError
from .log_summary import summarize
from .runner import Runner, ensure_runner, refresh
from .store import QueueFileError, QueueStore
from .view import describe_queue, log_tail, rows, table

EXIT_USAGE = 2
VERBS = ("add", "list", "cancel", "move", "pause", "resume", "log", "run")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train_queue.py", description="A queue of training jobs over a machine's GPUs.",
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", help="the queue's folder (default: <Tandem's home>/queue)")
    p.add_argument("--slots", type=int, help="on a machine without GPUs: how many CPU processes stand in for GPUs "
                                             "(kept in the queue)")
    p.add_argument("--json", action="store_true", help="answer in JSON (list, add)")
    remote = p.add_argument_group("a remote machine's queue (see docs/Remote.md for these options)")
    remote.add_argument("--host", action="append", metavar="[USER@]HOST[:PORT]", help="the machine whose queue it is")
    remote.add_argument("--port", type=int)
    remote.add_argument("--identity", "-i")
    remote.add_argument("--remote-folder", action="append", metavar="FOLDER")
    remote.add_argument("--remote-python")
    remote.add_argument("--torch-spec", metavar="SPEC")
    remote.add_argument("--remote-model")
    remote.add_argument("--remote-env", action="append", default=[], metavar="KEY=VALUE")
    remote.add_argument("--accept-host-key", action="append", default=[], metavar="SHA256:...")
    remote.add_argument("--yes", "-y", action="store_true", help="upload without asking, however large")
    sub = p.add_subparsers(dest="verb", required=True, metavar="|".join(VERBS))
    add = sub.add_parser("add", help="queue a config (a file or a preset such as '#demo')")
    add.add_argument("config", help="training config JSON, or a preset name such as '#demo'")
    add.add_argument("--config-value", action="append", default=[], metavar="KEY=VALUE",
                     help="override one config field (repeatable)")
    add.add_argument("--gpus", help="a count (2), GPU numbers (0,2 - or 3, for GPU 3 alone) or all; default: the "
                                    "config's Multi-GPU settings")
    add.add_argument("--name", default="", help="the job's name in the queue (default: the config's output name)")
    sub.add_parser("list", help="the jobs, their status, GPUs, progress and ETA")
    for verb, what in (("cancel", "end a job (a running one stops at its next step)"),
                       ("log", "print a job's log")):
        sub.add_parser(verb, help=what).add_argument("job", help="its number (#3 or 3) or name")
    sub.choices["log"].add_argument("--tail", type=int, metavar="BYTES", help="only the log's last BYTES")
    mv = sub.add_parser("move", help="change a job's place in the queue")
    mv.add_argument("job")
    mv.add_argument("where", help="up, down, top, bottom or a position (1 is the top)")
    for verb, what in (("pause", "pause a job (a running one stops with a backup), or the whole queue"),
                       ("resume", "resume a paused or interrupted job, or the whole queue")):
        sub.add_parser(verb, help=what).add_argument("job", nargs="?", help="without one: the whole queue")
    sub.add_parser("add-spec", help=argparse.SUPPRESS)  # a remote's queue: the job the desktop prepared, on stdin
    run = sub.add_parser("run", help="start the queue's runner (detached) unless one serves it")
    run.add_argument("--here", action="store_true", help="run it in this terminal until the queue is empty")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.host:
        from .remote import main_remote
        return main_remote(args)
    store = QueueStore(args.folder)
    try:
        return _local(store, args)
    except (actions.Refused, NeedError, KeyError, ValueError, ConfigError, QueueFileError) as e:
        text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"error: {text}", file=sys.stderr)
        return EXIT_USAGE


def config_source(config: str, overrides: list[str]) -> str:
    return config + "".join(f" + {o}" for o in overrides)


def _local(store: QueueStore, args) -> int:
    if args.slots is not None:
        actions.set_slots(store, args.slots)
    if args.verb == "add":
        cfg = load_config(args.config, args.config_value)
        need = GpuNeed.parse(args.gpus) if args.gpus else actions.need_of_config(cfg)
        capacity = actions.capacity_of(store.read())
        env = home_variable()
        job = actions.add(store, cfg, need, capacity, name=args.name, source=config_source(args.config, args.config_value),
                          env=env)
        ensure_runner(store)
        print(json.dumps(job.to_dict()) if args.json else
              f"Queued {job.label()} ({GpuNeed.parse(job.need).describe(capacity.unit)} of {capacity.describe()}).")
        return 0
    if args.verb == "add-spec":
        return _add_prepared(store, json.load(sys.stdin), args.json)
    if args.verb == "list":
        if store.file.exists():
            refresh(store)
        state = store.read()
        found = rows(store, state)
        if args.json:
            alive = store.runner_alive()
            print(json.dumps({"queue": str(store.folder), "paused": state.paused, "runner": state.runner,
                              "runner_alive": alive, "header": describe_queue(store, state, alive),
                              "jobs": [r.to_dict() for r in found]}))
        else:
            print(describe_queue(store, state, store.runner_alive()))
            print(table(found))
        return 0
    if args.verb == "cancel":
        job = actions.cancel(store, args.job)
        print(f"{job.label()}: " + ("cancelling - it stops at its next step" if job.request else "cancelled"))
        return 0
    if args.verb == "move":
        job = actions.move(store, args.job, args.where)
        place = [j.id for j in store.read().jobs].index(job.id) + 1
        print(f"{job.label()} is now number {place} in the queue.")
        return 0
    if args.verb == "pause":
        job = actions.pause(store, args.job)
        print("The queue is paused: no new job starts; running jobs go on." if job is None else
              f"{job.label()}: " + ("pausing - it stops with a backup at its next step" if job.request else "paused"))
        return 0
    if args.verb == "resume":
        job = actions.resume(store, args.job)
        ensure_runner(store)
        print("The queue starts jobs again." if job is None else f"{job.label()} is queued again"
              + (f" ({job.message})." if job.message else "."))
        return 0
    if args.verb == "log":
        job = store.read().find(args.job)
        if not job.run_id:
            print(f"{job.label()} has not run yet.", file=sys.stderr)
            return 1
        log = store.runs_root / "runs" / job.run_id / "output.log"
        sys.stdout.write(log_tail(log, args.tail) if log.exists() else "")
        summary = summarize(log)
        if job.state == "failed":
            print(f"\n{job.label()} failed: {job.message or summary.failure()}", file=sys.stderr)
        return 0
    if args.verb == "run":
        if args.here:
            return Runner(store).run()
        started = ensure_runner(store)
        print("The queue's runner started." if started else "A runner already serves this queue.")
        return 0
    raise ValueError(f"unknown verb {args.verb}")


def _add_prepared(store: QueueStore, spec: dict, as_json: bool) -> int:
    """On a remote machine: queue the job the desktop prepared (modules/queue/remote.py) - its config names the
    uploaded copies relative to the remote folder, where it runs and where its runs are kept."""
    root = Path(spec["root"]).expanduser()
    root = root if root.is_absolute() else Path.home() / root
    cfg = check(config_from_dict(spec["config"], "the queued job's config"), check_paths=False)
    with store.change() as state:
        state.runs_root = state.runs_root or str(root)
    capacity = actions.capacity_of(store.read())
    need = GpuNeed.parse(spec["need"]) if spec.get("need") else actions.need_of_config(cfg)
    env = {"TANDEM_HOME": str(root / "home"), **(spec.get("env") or {})}  # as a remote start's run has it
    job = actions.add(store, cfg, need, capacity, name=spec.get("name", ""), source=spec.get("source", ""), cwd=root,
                      env=env)
    ensure_runner(store)
    print(json.dumps(job.to_dict()) if as_json else
          f"Queued {job.label()} ({need.describe(capacity.unit)} of {capacity.describe()}) on {socket.gethostname()}.")
    return 0


def script_main() -> int:
    try:
        return main()
    except BrokenPipeError:  # `list | head`
        return 0

