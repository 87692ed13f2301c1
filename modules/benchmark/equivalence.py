"""N GPUs x batch B against 1 GPU x batch N*B, through the real scripts (scripts/check_equivalence.py).

Both runs train K steps from the same config and seed with SGD (Adam would turn rounding noise in
near-zero gradients into full steps and hide the comparison), write a backup at step K, and the
trained weights are compared: relative L2 error ||a - b|| / ||b||.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, args: list[str], environment: dict[str, str] | None = None) -> list[dict]:
    from modules.util.run_protocol import parse_event_line
    env = dict(os.environ, TANDEM_EVENTS="1", PYTHONUNBUFFERED="1", **(environment or {}))
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / script), *args], capture_output=True, text=True,
                          env=env, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [e for e in map(parse_event_line, proc.stdout.splitlines()) if e]


def compare(a: dict, b: dict) -> dict:
    import torch
    num = den = worst = 0.0
    for k in b:  # one pass per tensor: a real-size full fine-tune is ~10^9 values (tens of seconds a pass)
        reference = b[k].double()
        difference = a[k].double() - reference
        num += float(difference.pow(2).sum())
        den += float(reference.pow(2).sum())
        worst = max(worst, float(difference.abs().max()))
    return {"relative_l2": (num / den) ** 0.5 if den else float("nan"), "max_abs": worst, "tensors": len(b),
            "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Check that N GPUs x batch B train what 1 GPU x batch N*B trains.")
    p.add_argument("--config-path", default="#demo")
    p.add_argument("--num-gpus", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="per-GPU batch of the N-GPU run")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--launchers", default="torchrun", help="N-GPU launch paths to check against the one 1-GPU run: "
                   "torchrun, spawn or torchrun,spawn")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tolerance", type=float, default=1e-2, help="largest relative L2 error accepted")
    p.add_argument("--config-value", action="append", default=[])
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="tandem-equiv-") as tmp:
        common = [*args.config_value, f"general.cache_dir={tmp}/cache", "general.tensorboard=false",
                  f"training.max_steps={args.steps}", f"save.backup_every_n_steps={args.steps}",
                  "sampling.every_n_epochs=0", "save.backup_every_n_epochs=0", "optimizer.name=sgd",
                  "training.lr_warmup_steps=0", "training.max_grad_norm=0", f"general.device={args.device}"]
        flags = lambda extra: [x for o in [*common, *extra] for x in ("--config-value", o)]  # noqa: E731
        _run("train.py", ["--config-path", args.config_path,
                                *flags([f"general.workspace_dir={tmp}/one", f"training.batch_size={args.batch * args.num_gpus}"])])
        many = {}
        for launcher in [x.strip() for x in args.launchers.split(",") if x.strip()]:
            events = _run("train_multi_gpu.py", ["--config-path", args.config_path, "--num-gpus", str(args.num_gpus),
                                                 "--launcher", launcher, "--device", args.device,
                                                 *flags([f"general.workspace_dir={tmp}/{launcher}",
                                                         f"training.batch_size={args.batch}"])])
            many[launcher] = (events, _backup_weights(Path(tmp) / launcher))
        reference = _backup_weights(Path(tmp) / "one")
    ok = True
    for launcher, (events, weights) in many.items():
        world = next(e for e in events if e["type"] == "config")["world_size"]
        result = {"check": "equivalence", "config": args.config_path, "num_gpus": args.num_gpus,
                  "world_size_seen": world, "launcher": launcher, "batch_one": args.batch * args.num_gpus,
                  "batch_each": args.batch, "steps": args.steps, **compare(weights, reference)}
        result["ok"] = world == args.num_gpus and result["relative_l2"] <= args.tolerance
        ok &= result["ok"]
        print(json.dumps(result))
    return 0 if ok else 1


def _backup_weights(workspace: Path) -> dict:
    from modules.trainer.backup import latest_backup
    from modules.trainer.sharded_backup import read_trained_weights
    newest = latest_backup(workspace / "backups")  # backups are grouped by run: backups/<run id>/step-N
    if newest is None:
        raise FileNotFoundError(f"no backup under {workspace / 'backups'}; the run wrote none")
    return read_trained_weights(newest.path)  # sharded (FSDP) backups too


def compare_backups(root: Path, first: str, *others: str) -> dict:
    """The newest backups of several runs in one folder (`<root>/<run>/backups`, sharded or not) against
    the first run's: each run's step and the relative L2 distance of its trained weights."""
    from modules.trainer.backup import latest_backup
    newest = {run: latest_backup(Path(root) / run / "backups") for run in (first, *others)}
    missing = [run for run, info in newest.items() if info is None]
    if missing:
        raise FileNotFoundError(f"no backup under {', '.join(str(Path(root) / r / 'backups') for r in missing)}")
    reference = _backup_weights(Path(root) / first)
    return {"check": "backups_compared", "reference": first,
            "steps": {run: info.step for run, info in newest.items()},
            "relative_l2": {run: compare(_backup_weights(Path(root) / run), reference)["relative_l2"]
                            for run in others}}
