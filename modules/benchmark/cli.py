"""scripts/benchmark.py: images/s, scaling and peak memory of the real trainer, 1 vs N GPUs."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from modules.benchmark import DEMO
from modules.planning.memory_plan import NoPlanFits
from modules.families.registry import FAMILIES, MODEL_TYPES

MODEL_ALIASES = {**{name: name for name in MODEL_TYPES}, "sd15": "sd1", "sd35m": "sd3", DEMO: "sd1",
                 **{f"{name}-{variant}": name for name, info in FAMILIES.items() for variant in info.variants}}
"""--model names (those of `shared/bench/raw_ddp_reference.py` among them) -> the model family; sd35m
and sd3 mean SD3.5 Medium's transformer, flux Flux.1-dev's, each other family its published size (its
first variant), `<family>-<variant>` another of its sizes (flux2-klein-4b); demo the built-in tiny SD 1.x
model (`builtin:demo`), a quick check of the benchmark itself."""


def model_variant(name: str) -> str:
    """The variant a --model name picks ('' for the family's default size)."""
    if name == DEMO:
        return DEMO
    family = MODEL_ALIASES[name]
    return name.removeprefix(f"{family}-") if name.startswith(f"{family}-") else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Benchmark the Tandem trainer on synthetic cached latents.")
    p.add_argument("--model", default="sd15", choices=sorted(MODEL_ALIASES), help="model size (random weights): sd15, sd2, sdxl UNets; sd35m, flux and the newer families' transformers; "
                        "demo: the built-in tiny SD 1.x model, a check of the benchmark itself in seconds (also with --device cpu)")
    p.add_argument("--mode", default="full", choices=["full", "lora"])
    p.add_argument("--batch", type=int, default=8, help="images per GPU")
    p.add_argument("--res", type=int, default=512, help="resolution in pixels")
    p.add_argument("--gpus", default="1,2", help="comma-separated GPU counts to run, e.g. 1,2,4,8")
    p.add_argument("--steps", type=int, default=30, help="measured optimizer steps")
    p.add_argument("--warmup", type=int, default=8, help="steps before measuring")
    p.add_argument("--gc", action="store_true", help="gradient checkpointing")
    p.add_argument("--repeat", type=int, default=1, help="runs per case; the median is reported")
    p.add_argument("--config-value", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every case, e.g. multi_gpu.bucket_cap_mb=100")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: smoke-test the benchmark with CPU processes (numbers mean nothing)")
    p.add_argument("--controls", type=int, default=None, metavar="N",
                   help="an edit model's control (reference) images per item, each of the target's size: their tokens "
                        "join the target's (default: 1 where the family needs controls, else none; Flux.2's "
                        "reference images are optional: --controls 1)")
    p.add_argument("--json", type=Path, help="append one JSON line per case to this file")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="after the measured steps, profile a few more on every rank and write the op tables "
                        "and the GPU-busy fraction (GPU-bound or host-bound?) to DIR")
    p.add_argument("--profile-steps", type=int, default=3, help="steps --profile records (default 3)")
    args = p.parse_args(argv)

    from modules.benchmark.synthetic import control_count
    try:
        control_count(MODEL_ALIASES[args.model], args.controls)
    except ValueError as e:
        p.error(str(e))
    if args.warmup < 1 or args.steps < 1 or args.profile_steps < 1:
        p.error("--warmup, --steps and --profile-steps must be at least 1 (the first step includes one-off set-up work)")
    import torch
    from modules.benchmark.runner import Case, case_problems, run_case, scaling_table

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: the benchmark needs CUDA GPUs; torch sees none (--device cpu smoke-tests it).", file=sys.stderr)
        return 2
    worlds = [int(w) for w in args.gpus.split(",") if w.strip()]
    too_many = [w for w in worlds if args.device == "cuda" and w > torch.cuda.device_count()]
    if too_many:
        print(f"error: --gpus asks for {too_many} GPUs but {torch.cuda.device_count()} are visible.", file=sys.stderr)
        return 2
    cases = [Case(MODEL_ALIASES[args.model], args.mode, args.batch, args.res, world, args.gc, args.steps,
                  args.warmup, tuple(args.config_value), args.device, str(args.profile or ""), args.profile_steps,
                  model_variant(args.model), args.controls) for world in worlds]
    for case in cases:
        problems = case_problems(case)
        if problems:
            print(f"error: the {case.name()} case's config (the benchmark's settings with --config-value):\n"
                  + "\n".join(f"  - {problem}" for problem in problems), file=sys.stderr)
            return 2
    results = []
    for case in cases:
        try:
            runs = [run_case(case) for _ in range(args.repeat)]
        except NoPlanFits as refusal:
            print(f"error: the {case.name()} case on {case.world} GPU(s): {refusal}", file=sys.stderr)
            return 1
        result = sorted(runs, key=lambda r: r["samples_per_s"])[len(runs) // 2]
        result["runs_samples_per_s"] = [r["samples_per_s"] for r in runs]
        result["median_of"] = len(runs)
        results.append(result)
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")
    print(scaling_table(results))
    for r in results:
        for rank, prof in enumerate(r.get("profile_per_rank") or []):
            print(f"profile {r['case']} GPUs {r['world']} rank {rank}: GPU busy {prof['gpu_busy_fraction']}, "
                  f"compute {prof['compute_busy_fraction']}, NCCL {prof['nccl_fraction']} of {prof['wall_s']} s, "
                  f"{prof['gpu_activities_per_step']} GPU kernels/copies per step ({prof['report']})")
    return 0
