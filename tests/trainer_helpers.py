"""Helpers for tests that run the real trainer on the demo model."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from modules.config import load_config
from tests.patience import patience

REPO = Path(__file__).resolve().parents[1]


def demo_config(workspace: Path, cache: Path, *overrides: str, method: str = "lora", preset: str = "#demo"):
    """The demo preset (or another demo's: `#demo_sd3`, `#demo_flux`), made small and fast: no samples, no
    TensorBoard, a shared cache."""
    return load_config(preset, [
        f"general.workspace_dir={workspace}", f"general.cache_dir={cache}", "general.tensorboard=false",
        "general.device=cpu", "sampling.every_n_epochs=0", "save.backup_every_n_epochs=0",
        "save.save_dtype=fp32", f"training.method={method}", "training.learning_rate=0.001",
        "training.lr_warmup_steps=0", "data.num_workers=0", *overrides])


def multi(workspace, cache, *overrides, method="lora", launcher="spawn", world=2):
    cfg = demo_config(workspace, cache, *overrides, "multi_gpu.enabled=true", f"multi_gpu.num_gpus={world}",
                      f"multi_gpu.launcher={launcher}", method=method)
    from modules.distributed.launch import launch
    assert launch(cfg) == 0


@contextlib.contextmanager
def tandem_log():
    """The messages logged to "tandem" inside the block. A handler of its own: `setup_logging` (run by any
    earlier test in this process) stops "tandem" records from reaching the root logger, where caplog listens."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("tandem")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def overrides_for(workspace: Path, cache: Path, *extra: str, method: str = "lora") -> list[str]:
    """The same settings as `demo_config`, as --config-value arguments for the scripts."""
    base = [f"general.workspace_dir={workspace}", f"general.cache_dir={cache}", "general.tensorboard=false",
            "sampling.every_n_epochs=0", "save.backup_every_n_epochs=0", "save.save_dtype=fp32",
            f"training.method={method}", "training.learning_rate=0.001", "training.lr_warmup_steps=0",
            "data.num_workers=0", *extra]
    args = []
    for o in base:
        args += ["--config-value", o]
    return args


def train(cfg, callbacks=None, inbox=None, resume=None):
    """Run a `GenericTrainer` in this process; returns it (its callbacks hold the events)."""
    from modules.trainer.callbacks import RecordingCallbacks
    from modules.trainer.generic_trainer import GenericTrainer
    trainer = GenericTrainer(cfg, callbacks or RecordingCallbacks(), inbox, resume)
    trainer.run()
    return trainer


def launcher_flag(launcher: str) -> list[str]:
    """scripts/train_multi_gpu.py's flag for a launcher by name (the default, auto, would pick spawn)."""
    return ["--launcher", launcher]


def run_script(script: str, *args: str, timeout: float = 600, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """`timeout`: enough on an idle machine, scaled by `patience`."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TANDEM_EVENTS="1", **(env_extra or {}))
    return subprocess.run([sys.executable, str(REPO / "scripts" / script), *args], capture_output=True, text=True,
                          timeout=patience(timeout), env=env, cwd=REPO)


def _answer_ctrl_c() -> None:
    # A shell starting the tests in the background (`pytest &`) leaves SIGINT ignored, children inherit
    # that, and Python then never turns Ctrl-C into KeyboardInterrupt: the Ctrl-C tests would wait forever.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_script(script: str, *args: str, **popen_kwargs) -> subprocess.Popen:
    """A script running in the background with stdout+stderr in one text pipe and event lines on (in the
    repository unless `cwd=` says where)."""
    if os.name == "posix":
        popen_kwargs.setdefault("preexec_fn", _answer_ctrl_c)
    popen_kwargs.setdefault("cwd", REPO)
    return subprocess.Popen([sys.executable, str(REPO / "scripts" / script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, TANDEM_EVENTS="1", PYTHONUNBUFFERED="1"), **popen_kwargs)


def relative_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all tensors of two state dicts with the same keys: scripts/check_equivalence.py's
    measure (`equivalence.compare`)."""
    from modules.benchmark.equivalence import compare

    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return compare(a, b)["relative_l2"]


def latest_backup_weights(workspace: Path) -> dict[str, torch.Tensor]:
    from modules.trainer.backup import latest_backup
    newest = latest_backup(Path(workspace) / "backups")
    assert newest is not None, f"no backup in {workspace}"
    return load_file(str(newest.path / "weights.safetensors"))


def assert_weights_close(a: dict, b: dict, atol: float, rtol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    worst = max((x - b[k]).abs().max().item() for k, x in a.items())
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m: f"{k}: {m} (worst {worst})")


def files_under(root: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Relative file paths, with run-specific names (timestamps) kept - layout comparison."""
    root = Path(root)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and not any(str(p.relative_to(root)).startswith(s) for s in skip))


HOLD_LOCK = """
import sys, time
sys.path.insert(0, {repo!r})
from modules.util.workspace_lock import WorkspaceLock
WorkspaceLock({ws!r}).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def hold_lock(workspace: Path) -> subprocess.Popen:
    """Another process holding the workspace lock (a run in progress) until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK.format(repo=str(REPO), ws=str(workspace))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def launch_spec(world: int, device_type: str, backend: str, launcher: str, visible_devices: str | None):
    """A resolved launch for tests that plan one by hand (batch 1, LR 1e-4)."""
    from modules.launch.spec import LaunchSpec
    gpus = tuple(range(world)) if device_type == "cuda" else ()
    return LaunchSpec(launcher=launcher, world_size=world, device_type=device_type, gpus=gpus,
                      visible_devices=visible_devices, backend=backend, per_gpu_batch=1, accumulation=1,
                      base_lr=1e-4, lr_scaling="none")


def demo_data_subset(folder: Path, preset: str, count: int) -> list[str]:
    """Overrides pointing each concept of a demo preset at a copy of its first items, `count` in all shared equally
    among the concepts (captions and control images with them): a test that trains a few steps then scans and caches
    those, not the whole demo dataset (64 images: most of a short run's start-up). The first items of each built-in
    dataset share one size (one bucket)."""
    import shutil

    from modules.data.builtin_datasets import resolve_concept_path

    overrides = []
    concepts = load_config(preset).data.concepts
    count //= len(concepts)
    for i, concept in enumerate(concepts):
        source = resolve_concept_path(concept.path)
        target = Path(folder) / f"{source.name}-{count}"
        if not target.exists():
            items = sorted(p for p in source.iterdir() if p.suffix in (".png", ".mp4"))[:count]
            assert len(items) == count, f"{source} holds fewer than {count} items"
            staging = target.with_name(target.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            for item in items:
                for extra in (item, item.with_suffix(".txt"), *([source / concept.control / item.name]
                                                                  if concept.control else [])):
                    if extra.exists():
                        (staging / extra.parent.relative_to(source)).mkdir(parents=True, exist_ok=True)
                        shutil.copy(extra, staging / extra.relative_to(source))
            staging.rename(target)
        overrides.append(f"data.concepts[{i}].path={target}")
    return overrides
