"""Command-line entry points behind scripts/train.py and scripts/train_multi_gpu.py."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from modules.config import ConfigError, TrainConfig, load_config
from modules.util.launch_clock import note_checks_start, note_launch_time

log = logging.getLogger("tandem")


def _add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--config-path", "--config", dest="config_path", required=required,
                   help="training config JSON, or a preset name such as '#demo'")
    p.add_argument("--config-value", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config field, e.g. training.learning_rate=1e-4 (repeatable)")
    p.add_argument("--resume", nargs="?", const="latest", metavar="latest|RUN|PATH",
                   help="continue from a backup instead of starting a new run: the newest one in the workspace "
                        "(no value, or 'latest'), the newest of a run id, or a backup folder's path")


def _load(args, extra_overrides: list[str]) -> TrainConfig:
    return load_config(args.config_path, [*args.config_value, *extra_overrides])


def _fail(message: str, in_window: str | None = None) -> int:
    """One line for the user (no traceback: the message says what to change), and the `error` event
    whose text the GUI shows as its headline (`in_window`: the same in the window's words, where they differ:
    `PreflightError.in_window`)."""
    from modules.trainer.callbacks import default_callbacks
    default_callbacks().on_event("error", text=in_window or message)
    print(f"error: {message}", file=sys.stderr)
    return 2


def _check_resume(cfg: TrainConfig, resume: str | None) -> str | None:
    """The problem with `--resume`, found before any model loads (None when it names a backup or is unset)."""
    if resume is None:
        return None
    from modules.config import RunPaths
    from modules.trainer import sharded_backup
    from modules.trainer.backup import UnsafeBackupError, check_backup, find_backup
    try:
        chosen = find_backup(RunPaths(cfg).backups, resume)
        # A doctored or damaged backup is refused here, not after every worker has loaded the model.
        check_backup(chosen.path)
        if sharded_backup.is_sharded(chosen.path):
            sharded_backup.check_index(chosen.path)
    except (FileNotFoundError, ValueError, UnsafeBackupError) as e:
        return str(e)
    return None


def train_main(argv: list[str] | None = None) -> int:
    """scripts/train.py: one process, or one worker when started by torchrun."""
    note_launch_time()
    p = argparse.ArgumentParser(description="Train with a Tandem config (single process; under torchrun one worker).")
    _add_config_args(p, required=False)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], help="override general.device")
    p.add_argument("--launch-file", help="a worker's job as Tandem's launcher wrote it (config, launch, --resume); "
                                         "instead of --config-path")
    args = p.parse_args(argv)
    from modules.distributed.job import read_job
    from modules.distributed.worker import external_worker_job, run_worker, under_torchrun
    from modules.util.logs import setup_logging

    note_checks_start()
    setup_logging()
    if args.launch_file:  # a worker of Tandem's launcher: the config was loaded, checked and resolved there
        from modules.distributed.supervision import end_with_parent
        end_with_parent()  # torchrun's agent: killed with the launcher, it takes its workers along
        try:
            run_worker(read_job(args.launch_file))
        except BaseException:  # noqa: BLE001 - noted with its traceback for the launcher, which names it
            return 1
        return 0
    if not args.config_path:
        p.error("--config-path is required")
    try:
        cfg = _load(args, [f"general.device={args.device}"] if args.device else [])
    except ConfigError as e:
        return _fail(str(e))
    if under_torchrun():
        run_worker(external_worker_job(cfg, args.resume))
        return 0
    problem = _check_resume(cfg, args.resume)
    if problem:
        return _fail(problem)
    if cfg.multi_gpu.enabled:
        log.info("Note: multi_gpu.enabled is set, but scripts/train.py trains in one process. "
                 "Use scripts/train_multi_gpu.py or start-multi-gpu.sh for several GPUs.")
    return _run_single(cfg, args.resume)


def _run_single(cfg: TrainConfig, resume: str | None) -> int:
    from modules.data import EmptyDatasetError, MaskError
    from modules.single_run import run_single
    from modules.preflight import PreflightError
    try:
        return run_single(cfg, resume)
    except PreflightError as e:  # the message says what to change; a traceback would bury it
        return _fail(str(e), e.in_window)
    except (EmptyDatasetError, MaskError) as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        print("Training aborted by a second stop signal.", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, as the launchers give; the traceback in the file it names
        from modules.config import RunPaths
        from modules.distributed import failures
        folder = failures.failures_folder(RunPaths(cfg).workspace)
        failures.record_error(folder, 0, e)
        text = " ".join(str(e).split())
        print(f"error: {type(e).__name__}: {text} (details: {failures.details_file(folder, 0)})", file=sys.stderr)
        return 1


def train_multi_gpu_main(argv: list[str] | None = None) -> int:
    """scripts/train_multi_gpu.py: start N workers (torchrun or spawn); flags override the config."""
    note_launch_time()
    p = argparse.ArgumentParser(description="Train on several GPUs (or CPU processes) with a Tandem config.")
    _add_config_args(p)
    p.add_argument("--num-gpus", type=int, help="number of GPUs / processes (0 = all visible GPUs)")
    p.add_argument("--launcher", choices=["auto", "torchrun", "spawn"],
                   help="how workers start (multi_gpu.launcher): auto = torchrun where restarts or several "
                        "machines need its agent, else spawn (sooner to the first step)")
    p.add_argument("--spawn", action="store_const", const="spawn", dest="launcher",
                   help="the same as --launcher spawn (torch.multiprocessing.spawn)")
    p.add_argument("--torchrun", action="store_const", const="torchrun", dest="launcher",
                   help="the same as --launcher torchrun")
    p.add_argument("--port", "--master-port", dest="port", type=int,
                   help="rendezvous port (0 = pick a free one; several machines: the same fixed port on each)")
    p.add_argument("--master-addr", help="address of node 0, where the rendezvous listens (several machines: "
                                         "its address on the network the others reach it by)")
    p.add_argument("--nnodes", type=int, help="number of machines training together (each runs this script)")
    p.add_argument("--node-rank", type=int, help="this machine's number, 0 to nnodes-1 (0 serves the rendezvous)")
    p.add_argument("--max-restarts", type=int, help="restart all workers this many times after a failure; they "
                                                    "continue from the newest backup")
    p.add_argument("--min-gpus", type=int, help="several machines: continue on at least this many GPUs after a "
                                                "machine is lost (global batch kept)")
    p.add_argument("--distributed-backend", choices=["nccl", "gloo"], help="communication backend")
    p.add_argument("--distributed-data-loading", action=argparse.BooleanOptionalAction, default=None,
                   help="each rank caches and loads only its share of the data")
    p.add_argument("--device", choices=["cuda", "cpu"], help="cpu = N CPU processes over gloo, for trying things")
    args = p.parse_args(argv)
    from modules.util.logs import setup_logging

    setup_logging()
    flags = ["multi_gpu.enabled=true"]
    if args.num_gpus is not None:
        flags.append(f"multi_gpu.num_gpus={args.num_gpus}")
    if args.launcher:
        flags.append(f"multi_gpu.launcher={args.launcher}")
    if args.port is not None:
        flags.append(f"multi_gpu.master_port={args.port}")
    for flag, field in (("master_addr", "master_addr"), ("nnodes", "nnodes"), ("node_rank", "node_rank"),
                        ("max_restarts", "max_restarts"), ("min_gpus", "min_gpus")):
        if getattr(args, flag) is not None:
            flags.append(f"multi_gpu.{field}={getattr(args, flag)}")
    if args.distributed_backend:
        flags.append(f"multi_gpu.backend={args.distributed_backend}")
    if args.distributed_data_loading is not None:
        flags.append(f"multi_gpu.distributed_data_loading={str(args.distributed_data_loading).lower()}")
    if args.device:
        flags.append(f"general.device={args.device}")
    try:
        cfg = _load(args, flags)
    except ConfigError as e:
        return _fail(str(e))
    forced_single = os.environ.get("TANDEM_FORCE_SINGLE_GPU") == "1"
    if not forced_single:
        # The workers' forkserver imports PyTorch and the model libraries while this process does the same
        # and checks the job (modules/distributed/forkserver.py); nothing here has imported PyTorch yet.
        from modules.distributed.forkserver import start_before_imports
        start_before_imports(cfg)
    from modules.distributed.launch import LaunchError, launch

    note_checks_start()
    problem = _check_resume(cfg, args.resume)
    if problem:
        return _fail(problem)
    if forced_single:
        log.info("TANDEM_FORCE_SINGLE_GPU=1: training in a single process.")
        return _run_single(cfg, args.resume)
    try:
        return launch(cfg, resume=args.resume)
    except LaunchError as e:
        return _fail(str(e), e.in_window)
