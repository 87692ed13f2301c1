"""The questions and checks of `start-multi-gpu.sh` and `start-multi-gpu.bat`, in Python so that they run
(and are tested) anywhere.

Both scripts only install `.venv` and hand their arguments here (cmd.exe's quoting and delayed expansion
made an all-batch version impossible to test off Windows, and a bash copy of this logic had to be kept in
step by a test). The training command runs as a process of its own, so its start-up report counts its own
imports, not the install before it. Standard library only (the GPU count comes from a short `python -c`),
so `--help` works before anything is installed.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

NAME = "start-multi-gpu"
PRESET_DIR = Path("training_presets")
SHOWN_ENVIRONMENT = ("CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "NCCL_DEBUG", "NCCL_P2P_DISABLE",
                     "TANDEM_FORCE_SINGLE_GPU")
# The same as modules.distributed.worker_environment.STORE_ENVIRONMENT_WINDOWS (not imported: this file uses the
# standard library only, see above).
WINDOWS_STORE_ENVIRONMENT = {"USE_LIBUV": "0"}

HELP_EPILOG = """\
Without options it asks for each setting; press Enter to take the default shown in [brackets].

Environment:
  CUDA_VISIBLE_DEVICES   which GPUs are visible (e.g. 0,1); the GPU count default follows it
  MASTER_ADDR, MASTER_PORT  rendezvous address and port for the process group
  NCCL_DEBUG=INFO        NCCL logs its set-up (rings, NVLink/PCIe paths; Linux): for hangs and errors
  NCCL_P2P_DISABLE=1     work around consumer GPUs whose peer-to-peer transfers hang
  TANDEM_FORCE_SINGLE_GPU=1  ignore the GPU count and train in one process (scripts/train.py)
  TANDEM_SKIP_INSTALL=1  do not create or update .venv
  TANDEM_PYTHON          the Python to run training with (default: .venv's)
  TANDEM_TORCH_SPEC      the torch requirement the first install takes (default torch>=2.4)
  TANDEM_TORCH_INDEX     (Windows) PyTorch wheel index for the first install
On Windows the backend is gloo (PyTorch's Windows builds have no NCCL) and USE_LIBUV=0 is set for the
rendezvous store (the Windows builds have no libuv).

Check the machine first with: .venv/bin/python scripts/check_multi_gpu.py --config-path <config>
"""


class UsageError(Exception):
    """Bad input: printed as `start-multi-gpu: <message>`, exit code 2."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=NAME, description="Start a multi-GPU training run.", epilog=HELP_EPILOG,
                                allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--yes", "-y", action="store_true", help="take the defaults for everything not given, ask nothing")
    p.add_argument("--config", help="config JSON file or preset name (default: #demo); presets are the files "
                                    "in training_presets/")
    p.add_argument("--num-gpus", help="GPUs (or CPU processes with --device cpu) to use (default: all visible "
                                      "GPUs; 2 with --device cpu)")
    p.add_argument("--backend", help="communication backend nccl|gloo (default: nccl on Linux with CUDA, else gloo)")
    p.add_argument("--spawn", action="store_const", const="spawn", dest="launcher",
                   help="start workers with torch.multiprocessing (the same as --launcher spawn)")
    p.add_argument("--torchrun", action="store_const", const="torchrun", dest="launcher",
                   help="start workers with torchrun (the same as --launcher torchrun)")
    p.add_argument("--launcher", help="auto|torchrun|spawn: how workers start (default: auto = as the config's "
                                      "multi_gpu.launcher says, whose default picks torchrun where restarts or "
                                      "several machines need its agent, else spawn, which reaches the first "
                                      "step sooner)")
    p.add_argument("--port", help="rendezvous port (default: %%MASTER_PORT%%, else a free port)")
    p.add_argument("--device", metavar="cpu", help="cpu: train in CPU processes over gloo (no GPU needed; for trying "
                                                   "things out)")
    p.add_argument("--nnodes", help="machines training together (default: 1); run this on each of them")
    p.add_argument("--node-rank", help="this machine is node K of N (0: the one the others connect to)")
    p.add_argument("--master-addr", help="node 0's address, reachable from every machine (several machines)")
    p.add_argument("--max-restarts", help="restart every worker after a failure, up to N times; training "
                                          "continues from the newest backup (default: 0)")
    p.add_argument("--config-value", action="append", default=[], metavar="K=V",
                   help="override one config field, e.g. training.max_steps=100 (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    remote = p.add_argument_group("training on remote machines over SSH (scripts/train_remote.py, docs/Remote.md)")
    remote.add_argument("--remote", action="append", metavar="USER@HOST[:PORT]",
                        help="train there instead of here; several machines: one --remote each (node K on the K-th)")
    remote.add_argument("--identity", help="private key file for the remote machine(s) (default: ssh's own keys)")
    remote.add_argument("--remote-folder", help="Tandem's folder on the remote machine(s) (default ~/tandem-remote)")
    return p


def visible_gpu_count(python: str) -> int:
    """What torch in the training environment sees; 0 when it cannot tell (no torch, no driver)."""
    try:
        result = subprocess.run([python, "-c", "import torch; print(torch.cuda.device_count())"],
                                capture_output=True, text=True, timeout=300)
        return int(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else 0
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


class Questions:
    """Asks on stderr and reads stdin; with --yes (or at end of input) every answer is the default."""

    def __init__(self, assume_yes: bool, stdin: TextIO, stderr: TextIO):
        self.assume_yes, self.stdin, self.stderr = assume_yes, stdin, stderr

    def ask(self, prompt: str, default: str) -> str:
        if self.assume_yes:
            return default
        self.stderr.write(f"{prompt} [{default}]: ")
        self.stderr.flush()
        answer = self.stdin.readline().strip()
        return answer or default


@dataclass(frozen=True)
class Launch:
    command: list[str]
    env: dict[str, str]
    dry_run: bool


def plan(argv: list[str], *, system: str, gpu_count: Callable[[str], int], stdin: TextIO, stdout: TextIO,
         stderr: TextIO, environ: dict[str, str]) -> Launch:
    """The command line and environment to run; raises `UsageError` for bad input."""
    args, unknown = parser().parse_known_args(argv)
    if unknown:
        raise UsageError(f"unknown option '{unknown[0]}' (see --help)")
    windows = system == "Windows"
    python = environ.get("TANDEM_PYTHON") or sys.executable
    questions = Questions(args.yes, stdin, stderr)
    device = args.device or ""
    if device not in ("", "cpu"):
        raise UsageError(f"--device accepts only 'cpu' (GPUs are the default), got '{device}'")

    config = args.config
    if config is None:
        presets = sorted(str(p) for p in PRESET_DIR.glob("*.json"))
        if not args.yes and presets:
            stderr.write("Presets:\n" + "".join(f"  {i}) {p}\n" for i, p in enumerate(presets, 1)))
        config = questions.ask("Config file, preset name or number", "#demo")
        if re.fullmatch(r"[0-9]+", config):
            if not 1 <= int(config) <= len(presets):
                raise UsageError(f"no preset number {config} (1-{len(presets)})")
            config = presets[int(config) - 1]
    if not config.startswith("#") and not Path(config).is_file():
        if (PRESET_DIR / f"{config}.json").is_file():
            config = str(PRESET_DIR / f"{config}.json")
        else:
            raise UsageError(f"config '{config}' is neither a file nor a preset in training_presets/")

    if args.remote:
        return Launch(remote_command(args, config, device, python, questions), dict(environ), args.dry_run)

    gpus = 0
    if device != "cpu":
        gpus = gpu_count(python)
        if gpus == 0:
            visible = environ.get("CUDA_VISIBLE_DEVICES") or "unset"
            stderr.write(f"No CUDA GPU is visible (CUDA_VISIBLE_DEVICES={visible}): training in CPU processes "
                         "(--device cpu).\n")
            device = "cpu"
    num_gpus = args.num_gpus
    if num_gpus is None:
        label = "Number of CPU processes" if device == "cpu" else "Number of GPUs"
        num_gpus = questions.ask(label, "2" if device == "cpu" else str(gpus))
    if not re.fullmatch(r"[1-9][0-9]*", num_gpus):
        raise UsageError(f"--num-gpus must be a whole number of 1 or more, got '{num_gpus}'")
    if device != "cpu" and int(num_gpus) > gpus:
        raise UsageError(f"--num-gpus {num_gpus} but only {gpus} GPU(s) are visible; lower it or check "
                         "CUDA_VISIBLE_DEVICES")

    backend = args.backend
    if backend is None:
        default = "nccl" if device != "cpu" and system == "Linux" else "gloo"
        backend = questions.ask("Backend (nccl/gloo)", default)
    if backend not in ("nccl", "gloo"):
        raise UsageError(f"--backend must be nccl or gloo, got '{backend}'")
    if backend == "nccl" and device == "cpu":
        raise UsageError("--backend nccl needs GPUs; use gloo with --device cpu")
    if backend == "nccl" and windows:
        raise UsageError("--backend nccl: PyTorch's Windows builds have no NCCL; use gloo")

    launcher = args.launcher or questions.ask("Launcher (auto/torchrun/spawn)", "auto")
    if launcher not in ("auto", "torchrun", "spawn"):
        raise UsageError(f"--launcher must be auto, torchrun or spawn, got '{launcher}'")
    port = args.port if args.port is not None else environ.get("MASTER_PORT", "")
    if port and not re.fullmatch(r"[0-9]+", port):
        raise UsageError(f"--port must be a number, got '{port}'")

    # Several machines: each runs this with the same config and its own node number.
    nnodes = args.nnodes or questions.ask("Machines training together (nodes)", "1")
    if not re.fullmatch(r"[1-9][0-9]*", nnodes):
        raise UsageError(f"--nnodes must be a whole number of 1 or more, got '{nnodes}'")
    node_rank, master_addr = args.node_rank, args.master_addr
    if int(nnodes) > 1:
        node_rank = node_rank or questions.ask(f"This machine is node K of {nnodes}; K (0: the one the others "
                                               "connect to)", "0")
        if not re.fullmatch(r"[0-9]+", node_rank) or int(node_rank) >= int(nnodes):
            raise UsageError(f"--node-rank must be 0 to {int(nnodes) - 1}, got '{node_rank}'")
        master_addr = master_addr or questions.ask("Address of node 0 (reachable from every machine)",
                                                   environ.get("MASTER_ADDR") or "127.0.0.1")
        port = port or questions.ask("Rendezvous port (the same on every machine)", "29500")
        if not re.fullmatch(r"[0-9]+", port):
            raise UsageError(f"--port must be a number, got '{port}'")
    max_restarts = args.max_restarts or questions.ask("Restarts after a failure (0: none)", "0")
    if not re.fullmatch(r"[0-9]+", max_restarts):
        raise UsageError(f"--max-restarts must be a whole number, got '{max_restarts}'")

    for name in SHOWN_ENVIRONMENT:
        stdout.write(f"{name}={environ.get(name) or '(unset)'}\n")
    command = [python]
    if environ.get("TANDEM_FORCE_SINGLE_GPU") == "1":
        stdout.write("TANDEM_FORCE_SINGLE_GPU=1: training in a single process.\n")
        command += [os.path.join("scripts", "train.py"), "--config-path", config]
        if device == "cpu":
            command += ["--config-value", "general.device=cpu"]
    else:
        command += [os.path.join("scripts", "train_multi_gpu.py"), "--config-path", config, "--num-gpus", num_gpus,
                    "--distributed-backend", backend]
        if launcher != "auto":  # auto: as the config says (its own default is auto)
            command += ["--launcher", launcher]
        if port:
            command += ["--port", port]
        if device == "cpu":
            command += ["--device", "cpu"]
        if nnodes != "1":
            command += ["--nnodes", nnodes, "--node-rank", node_rank, "--master-addr", master_addr]
        if max_restarts != "0":
            command += ["--max-restarts", max_restarts]
    for value in args.config_value:
        command += ["--config-value", value]
    env = dict(environ)
    if windows:
        env.update(WINDOWS_STORE_ENVIRONMENT)
    return Launch(command, env, args.dry_run)


def remote_command(args, config: str, device: str, python: str, questions: Questions) -> list[str]:
    """`scripts/train_remote.py` for `--remote`: the GPUs and backend are the remote machines' (decided there, as
    the launcher decides them here), so only what the remote start needs is asked."""
    num_gpus = args.num_gpus or questions.ask("GPUs per machine (0: all it has)" if device != "cpu"
                                              else "CPU processes per machine", "0" if device != "cpu" else "2")
    if not re.fullmatch(r"[0-9]+", num_gpus) or (device == "cpu" and num_gpus == "0"):
        raise UsageError(f"--num-gpus must be a whole number (0: all the remote's GPUs), got '{num_gpus}'")
    max_restarts = args.max_restarts or questions.ask("Restarts after a failure (0: none)", "0")
    if not re.fullmatch(r"[0-9]+", max_restarts):
        raise UsageError(f"--max-restarts must be a whole number, got '{max_restarts}'")
    for name in ("nnodes", "node_rank"):
        if getattr(args, name):
            raise UsageError(f"--{name.replace('_', '-')} is not used with --remote: each --remote machine is one "
                             "node, numbered in the order given")
    if args.port and not re.fullmatch(r"[0-9]+", args.port):
        raise UsageError(f"--port must be a number, got '{args.port}'")
    command = [python, os.path.join("scripts", "train_remote.py")]
    for host in args.remote:
        command += ["--host", host]
    if args.identity:
        command += ["--identity", args.identity]
    if args.remote_folder:
        command += ["--remote-folder", args.remote_folder]
    command += ["--config-path", config, "--num-gpus", num_gpus]
    if device == "cpu":
        command += ["--device", "cpu"]
    if max_restarts != "0":
        command += ["--max-restarts", max_restarts]
    if args.master_addr:
        command += ["--master-addr", args.master_addr]
    if args.port:
        command += ["--master-port", args.port]
    if args.backend:
        command += ["--config-value", f"multi_gpu.backend={args.backend}"]
    if args.launcher and args.launcher != "auto":
        command += ["--config-value", f"multi_gpu.launcher={args.launcher}"]
    for value in args.config_value:
        command += ["--config-value", value]
    return command


def quoted(command: list[str], system: str) -> str:
    return subprocess.list2cmdline(command) if system == "Windows" else shlex.join(command)


def main(argv: list[str] | None = None) -> int:
    system = platform.system()
    try:
        launch = plan(list(sys.argv[1:] if argv is None else argv), system=system, gpu_count=visible_gpu_count,
                      stdin=sys.stdin, stdout=sys.stdout, stderr=sys.stderr, environ=dict(os.environ))
    except UsageError as error:
        print(f"{NAME}: {error}", file=sys.stderr)
        return 2
    print("Command: " + quoted(launch.command, system), flush=True)
    if launch.dry_run:
        return 0
    return subprocess.call(launch.command, env=launch.env)
