"""How far rounding carries in a real run: N processes against 1, beside controls (scripts/check_rounding.py).

N processes x batch B compute the gradients of 1 process x batch N*B up to the order of floating-point
sums, so their weights agree to rounding - and after many AdamW steps rounding alone moves them by about
as much as any other change of summation order. Each row compares two runs of the demo's full
fine-tune with its own settings (AdamW, fp32) on CPU processes, through the real scripts:

- the claim itself: 2 processes x 4 against 1 process x 8;
- the control: 1 process x 8 on 1 thread against the same on 2 threads (the CPU kernels sum in another
  order; nothing else differs);
- what the claim needs: the same global batch with another micro-batch (2 x 2 with accumulation 2 against
  1 x 8) is another training - the micro-batch over the processes and the accumulation must match;
- the same with matching micro-batches (2 x 2 against 1 x 4, both with accumulation 2);
- without a latent cache each rank samples the VAE's latent distribution with its own generator, which
  is another training by design.

A last row gives the scale of rounding itself: the reference's weights against the same weights each moved by one
float32 ulp. `--sgd` trains with the equivalence tests' optimizer (SGD, no warm-up or clipping), where differences
stay at that scale; AdamW turns gradients that are pure rounding noise into full-size steps and carries them further.

Every run uses 1 thread per process but the control's second; its workspace is kept under the given
folder, so a second call only compares (use another folder for other options).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from modules.benchmark.equivalence import _backup_weights, _run, compare


@dataclass(frozen=True)
class Run:
    processes: int
    batch: int
    accumulation: int = 1
    threads: int = 1
    cache_latents: bool = True

    @property
    def name(self) -> str:
        cache = "" if self.cache_latents else "-nocache"
        return f"{self.processes}x{self.batch}-acc{self.accumulation}-t{self.threads}{cache}"

    def global_batch(self) -> int:
        return self.processes * self.batch * self.accumulation


ROWS: list[tuple[str, Run, Run]] = [
    ("2 processes x 4 against 1 process x 8", Run(2, 4), Run(1, 8)),
    ("1 process x 8, 2 threads against 1 thread (control: summation order only)", Run(1, 8, threads=2), Run(1, 8)),
    ("2 processes x 2, accumulation 2 against 1 process x 8 (another micro-batch)", Run(2, 2, 2), Run(1, 8)),
    ("2 processes x 2, accumulation 2 against 1 process x 4, accumulation 2", Run(2, 2, 2), Run(1, 4, 2)),
    ("no latent cache: 2 processes x 4 against 1 process x 8", Run(2, 4, cache_latents=False),
     Run(1, 8, cache_latents=False)),
]
"""(what is compared, run, reference run); every pair trains the same global batch."""


SGD = ("optimizer.name=sgd", "training.lr_warmup_steps=0", "training.max_grad_norm=0")
"""The equivalence tests' and `scripts/check_equivalence.py`'s optimizer settings (`--sgd`)."""


def arguments(run: Run, root: Path, steps: int, extra: tuple[str, ...] = ()) -> tuple[str, list[str], dict]:
    """(script, its arguments, extra environment) of one run; `extra`: overrides every run takes."""
    overrides = [*extra, f"general.workspace_dir={root / run.name}", f"general.cache_dir={root / 'cache'}",
                 "general.tensorboard=false", "general.device=cpu", "sampling.every_n_epochs=0",
                 "save.backup_every_n_epochs=0", f"training.max_steps={steps}", f"save.backup_every_n_steps={steps}",
                 "data.num_workers=0", f"training.batch_size={run.batch}",
                 f"training.gradient_accumulation_steps={run.accumulation}",
                 f"data.cache_latents={str(run.cache_latents).lower()}"]
    flags = [x for o in overrides for x in ("--config-value", o)]
    environment = {"OMP_NUM_THREADS": str(run.threads)}
    if run.processes == 1:
        return "train.py", ["--config-path", "#demo", *flags], environment
    return "train_multi_gpu.py", ["--config-path", "#demo", "--num-gpus", str(run.processes), "--device", "cpu",
                                  "--launcher", "spawn", *flags], environment


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="How far rounding carries: N processes against 1, beside controls.")
    p.add_argument("folder", type=Path, help="where the runs' workspaces are kept (reused by a second call)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sgd", action="store_true", help="SGD without warm-up or clipping, as the equivalence tests "
                   "train (default: the demo's own AdamW)")
    p.add_argument("--method", choices=["full", "lora"], default="full")
    args = p.parse_args(argv)
    extra = (*(SGD if args.sgd else ()), f"training.method={args.method}")
    runs = {run.name: run for _, a, b in ROWS for run in (a, b)}
    for name, run in runs.items():
        if not (args.folder / name / "backups").is_dir():
            _run(*arguments(run, args.folder, args.steps, extra))
    weights = {name: _backup_weights(args.folder / name) for name in runs}
    lines = []
    print("| compared | relative L2 | max abs |\n|---|---|---|")
    for what, a, b in ROWS:
        result = compare(weights[a.name], weights[b.name])
        print(f"| {what} | {result['relative_l2']:.1e} | {result['max_abs']:.1e} |")
        lines.append(json.dumps({"check": "rounding", "compared": what, "run": a.name, "reference": b.name,
                                 "steps": args.steps, **result}))
    scale = compare(one_ulp_further(weights[ROWS[0][2].name]), weights[ROWS[0][2].name])
    print(f"| scale: every weight of {ROWS[0][2].name} moved by one float32 ulp | {scale['relative_l2']:.1e} | "
          f"{scale['max_abs']:.1e} |")
    lines.append(json.dumps({"check": "rounding", "compared": "one ulp", "reference": ROWS[0][2].name,
                             "steps": args.steps, **scale}))
    with open(args.folder / "results.jsonl", "a", encoding="utf-8") as results:
        results.write("".join(line + "\n" for line in lines))
    return 0


def one_ulp_further(weights: dict) -> dict:
    """Every value moved to the next float32 (or its own dtype's) number away from zero: the smallest change
    of every weight, the yardstick for differences that are rounding."""
    import torch
    return {k: torch.nextafter(v, torch.where(v < 0, -torch.inf, torch.inf).to(v.dtype)) for k, v in weights.items()}
