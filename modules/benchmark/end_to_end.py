"""The whole job as a user waits for it: from the command to the process exiting with the model saved.

Builds (once) a real-size random model folder and a folder of JPEGs with captions, then runs the real
entry points - `scripts/train.py` for 1 GPU, `scripts/train_multi_gpu.py --num-gpus N` for N - of one
or more source trees (e.g. this one and a checkout of an earlier commit, for a before/after in the
same call), each with a fresh workspace and cache. Every output line is time-stamped as it arrives, so
each run splits into: before step 1 (launch to the `config` event, which the trainer emits when its
start-up is done), training (`config` to `done`: every step, sample, backup and the final save) and
done to exit; the training splits further, from the steps' `progress` events, into the steps, what the
epoch ends added, the samplings and the final save (`split_training`); the run's GPUs' clocks, power and
temperature are sampled meanwhile (`gpu_clocks`). One JSON line per run; a table at the end.

    python scripts/end_to_end.py --job sd15 --base-model /tmp/sd15 --make-model --data /tmp/e2e-data --make-data \\
        --run new@.:1 --run baseline@.bench/baseline:1 --run new@.:2 ...

`--job` picks one of the jobs people run (`JOBS`: the preset, the model to build, the images, resolution,
batch, epochs and samplings); each of its values can still be changed by its own option.

A run spec is `LABEL@TREE:GPUS[:DEVICES]`; specs joined with `+` in one `--run` run at the same time on
different GPUs (DEVICES, e.g. `0` and `1`), which halves a before/after comparison's time on a
machine with spare GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from modules.benchmark.gpu_monitor import GpuMonitor
from modules.families.registry import MODEL_TYPES

PROMPTS = ("a red circle on a blue background", "a green square in a field", "a yellow triangle at night",
           "two shapes on a white table")


@dataclass(frozen=True)
class Job:
    """A training job as a user starts it from a preset: on `images` pictures of `image_size` px, trained
    at `resolution` with `batch` per GPU for `epochs`, sampling `prompts` prompts every `sample_every` epochs."""
    preset: str
    make_model: str
    images: int
    image_size: int
    resolution: int
    batch: int
    epochs: int
    prompts: int = 4
    sample_every: int = 5
    sample_steps: int = 20


# The jobs of docs/Performance.md, "From the command to the saved model", each on a real-size random model.
JOBS = {
    "sd15": Job("sd15_lora", "sd1", images=512, image_size=512, resolution=512, batch=8, epochs=10),
    "sdxl": Job("sdxl_lora", "sdxl", images=1000, image_size=1024, resolution=1024, batch=4, epochs=4,
                sample_every=2),
    "flux": Job("flux_lora", "flux", images=512, image_size=1024, resolution=1024, batch=1, epochs=2,
                sample_every=2),
}


@dataclass(frozen=True)
class RunSpec:
    label: str
    tree: Path
    gpus: int
    devices: str | None

    @staticmethod
    def parse(text: str) -> "RunSpec":
        match = re.fullmatch(r"([\w.-]+)@([^:]+):(\d+)(?::([\d,]+))?", text.strip())
        if not match:
            raise ValueError(f"--run {text!r}: expected LABEL@TREE:GPUS[:DEVICES], e.g. new@.:2:0,1")
        label, tree, gpus, devices = match.groups()
        return RunSpec(label, Path(tree).resolve(), int(gpus), devices)


def make_images(folder: Path, count: int, size: int, seed: int = 0) -> Path:
    """`count` JPEGs of coloured shapes with `.txt` captions (kept if already there)."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    if len(list(folder.glob("*.jpg"))) >= count:
        return folder
    rng = random.Random(seed)
    shapes = ("circle", "square", "triangle")
    for i in range(count):
        background = tuple(rng.randrange(256) for _ in range(3))
        image = Image.new("RGB", (size, size), background)
        draw = ImageDraw.Draw(image)
        names = []
        for _ in range(rng.randint(1, 3)):
            shape = rng.choice(shapes)
            names.append(shape)
            x0, y0 = rng.randrange(size // 2), rng.randrange(size // 2)
            x1, y1 = x0 + rng.randrange(size // 8, size // 2), y0 + rng.randrange(size // 8, size // 2)
            colour = tuple(rng.randrange(256) for _ in range(3))
            if shape == "circle":
                draw.ellipse((x0, y0, x1, y1), fill=colour)
            elif shape == "square":
                draw.rectangle((x0, y0, x1, y1), fill=colour)
            else:
                draw.polygon([(x0, y1), ((x0 + x1) // 2, y0), (x1, y1)], fill=colour)
        image.save(folder / f"{i:05d}.jpg", quality=90)
        (folder / f"{i:05d}.txt").write_text(", ".join(f"a {n}" for n in names), encoding="utf-8")
    return folder


def job_overrides(args, workspace: Path, label: str) -> list[str]:
    """The job: the sd15_lora preset as a user would start from it, on the given model and images."""
    cache = args.shared_cache or workspace / "cache"
    values = [f"general.workspace_dir={workspace}", f"general.cache_dir={cache}",
              f"model.base_model={args.base_model}", f"data.concepts[0].path={args.data}",
              "data.concepts[0].repeats=1", f"data.resolution={args.resolution}",
              f"training.batch_size={args.batch}", f"training.epochs={args.epochs}",
              f"sampling.every_n_epochs={args.sample_every}", f"sampling.inference_steps={args.sample_steps}"]
    for i, prompt in enumerate(PROMPTS[:args.prompts]):
        values += [f"sampling.prompts[{i}].prompt={prompt}", f"sampling.prompts[{i}].seed={i}"]
    own = [value.split(":", 1)[1] for value in args.label_config if value.split(":", 1)[0] == label]
    return values + list(args.config_value) + own


def command_for(spec: RunSpec, args, workspace: Path) -> list[str]:
    overrides = [x for value in job_overrides(args, workspace, spec.label) for x in ("--config-value", value)]
    python = sys.executable
    if spec.gpus == 1:
        command = [python, str(spec.tree / "scripts" / "train.py"), "--config-path", args.preset, *overrides]
        return command + (["--device", "cpu"] if args.cpu else [])
    command = [python, str(spec.tree / "scripts" / "train_multi_gpu.py"), "--config-path", args.preset,
               "--num-gpus", str(spec.gpus), *overrides]
    return command + (["--device", "cpu"] if args.cpu else [])


def run_one(spec: RunSpec, args, work: Path) -> dict:
    workspace = work / f"{spec.label}-{spec.gpus}gpu-{time.strftime('%H%M%S')}-{os.getpid() % 1000}"
    workspace.mkdir(parents=True)
    env = dict(os.environ, TANDEM_EVENTS="1", PYTHONUNBUFFERED="1")
    if spec.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = spec.devices
    command = command_for(spec, args, workspace)
    marks: dict[str, float] = {}
    phases: dict[str, float] = {}
    samplings: list[float] = []
    monitor = GpuMonitor(spec.devices).start()
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=spec.tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace")
    # Written as the lines come: a run stopped at a time limit still leaves what it printed.
    with open(work / f"{workspace.name}.log", "w", encoding="utf-8") as log_file:
        for line in proc.stdout:
            at = time.monotonic() - started
            log_file.write(f"{at:8.2f} {line}")
            log_file.flush()
            _read_line(line, at, marks, phases, samplings)
    code = proc.wait()
    wall = time.monotonic() - started
    monitor.stop()
    done = marks.get("done")
    result = {"label": spec.label, "tree": str(spec.tree), "gpus": spec.gpus, "devices": spec.devices,
              "exit_code": code, "wall_s": round(wall, 1),
              "before_step1_s": round(marks["config"], 1) if "config" in marks else None,
              "train_s": round(done - marks["config"], 1) if done is not None and "config" in marks else None,
              "done_to_exit_s": round(wall - done, 2) if done is not None else None,
              "first_step_s": marks.get("first_step_s"), "summary_to_step1_s": marks.get("summary_to_step1_s"),
              "loader_workers_s": marks.get("loader_workers_s"), "startup_phases_s": phases,
              "startup_parts_s": marks.get("startup_parts", {}), "sampling_s": samplings,
              "log": f"{workspace.name}.log",
              "job": {"name": args.job, "preset": args.preset, "images": args.images, "resolution": args.resolution,
                      "batch_per_gpu": args.batch, "epochs": args.epochs, "prompts": args.prompts,
                      "sample_every": args.sample_every,
                      "extra": list(args.config_value) + [v for v in args.label_config
                                                          if v.split(":", 1)[0] == spec.label]}}
    spans = list(marks.get("sample_spans", {}).values())
    result["gpu_clocks"] = monitor.summary()
    result["sampling_from_events_s"] = [round(end - start, 2) for start, end in spans]
    result["training_split_s"] = split_training(marks.get("steps_reported", []), spans, result["first_step_s"],
                                                result["train_s"])
    done_event = marks.get("done_event") or {}
    if "images_per_s" in done_event:
        result["run_images_per_s"] = done_event["images_per_s"]
    if "profile" in marks:
        result["profile"] = marks["profile"]
    if "sampling_parts" in marks:
        result["sampling_parts_s"] = marks["sampling_parts"]
    if "compiles" in marks:
        result["compiles"] = marks["compiles"]
    if "compile_choice" in marks:
        result["compile_choice"] = marks["compile_choice"]
    if args.keep is not None:
        keep_run_files(workspace, work / f"{workspace.name}.log", args.keep)
    return result


def keep_run_files(workspace: Path, log_file: Path, keep: Path) -> None:
    """A run's log and its profile reports (`TANDEM_PROFILE_STEPS`) into `keep/<run>/`, e.g. what a device call
    brings back. The reports lie beside the log, not in a folder of their own: the device tool leaves out
    folders nested deeper than that (a run's reports did not come back from `$OUT/runs/<run>/profiles/`)."""
    target = keep / workspace.name
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy2(log_file, target / log_file.name)
    for report in sorted((workspace / "profiles").glob("*.txt")):
        shutil.copy2(report, target / report.name)


COMPILE_LINE = re.compile(r"Denoiser compiled and checked for batch shape \[(?P<shape>[\d, ]+)\] in (?P<s>[\d.]+) s"
                          r"(?P<graphs> \(its CUDA graphs are recorded at its next steps\))?: (?P<parts>.*)")
"""The trainer's line for each compiled batch shape (`compiled_unet.CompileCheck`)."""
COMPILE_CHOICE = "training.compile auto: "
"""The start of the trainer's line on what `training.compile` auto chose (`compile_choice.choose`)."""


def _read_line(line: str, at: float, marks: dict, phases: dict, samplings: list) -> None:
    """Note what one output line of a run tells (events, start-up phases, first step, samplings)."""
    if line.startswith("@tandem "):
        try:
            event = json.loads(line[len("@tandem "):])
        except json.JSONDecodeError:
            return
        kind = event.get("type", "?")
        marks.setdefault(kind, at)
        if kind == "done":
            marks["done_event"] = event
        elif kind == "profile":  # TANDEM_PROFILE_STEPS: each rank's summary of the profiled steps
            marks["profile"] = {key: event.get(key) for key in ("first", "last", "ranks")}
        elif kind == "progress":
            marks["last_progress"] = at
            marks.setdefault("steps_reported", []).append((at, event.get("epoch")))
        elif kind == "sample":
            # From the step's report to its last image written: what a sampling cost, for any tree (older
            # ones print no "Samples at step" line).
            spans, step = marks.setdefault("sample_spans", {}), event.get("step")
            start = spans[step][0] if step in spans else marks.get("last_progress", at)
            spans[step] = (start, at)
    elif line.startswith("Start-up: "):
        phases.update({name.strip(): float(sec)
                       for name, sec in re.findall(r"([\w -]+?) ([\d.]+) s", line[len("Start-up: "):])})
    elif line.startswith("Start-up parts: "):
        for phase_parts in line[len("Start-up parts: "):].strip().split("; "):
            phase, _, listed = phase_parts.partition(" = ")
            marks.setdefault("startup_parts", {})[phase] = {name.strip(): float(sec)
                                                           for name, sec in re.findall(r"(.+?) ([\d.]+) s(?: \+ |$)", listed)}
    elif line.startswith(COMPILE_CHOICE):  # training.compile auto: what it chose, and the estimate
        marks["compile_choice"] = line[len(COMPILE_CHOICE):].strip()
    elif compiled := COMPILE_LINE.search(line):  # training.compile: each batch shape's compile and check
        marks.setdefault("compiles", []).append({
            "shape": [int(n) for n in compiled["shape"].split(",")], "s": float(compiled["s"]),
            "cuda_graphs": compiled["graphs"] is not None,
            **{name: float(sec) for name, sec in re.findall(r"(tracing|compiling|loading kernels|backward) ([\d.]+) s",
                                                           compiled["parts"])},
            **{f"{cache} cache {what}": int(n) for cache, n, what in
               re.findall(r"(autograd|kernels) (\d+) (hits)", compiled["parts"])}})
    elif line.startswith("First step: "):
        marks["first_step_s"] = float(line.split()[2])
        if gap := re.search(r"; ([\d.]+) s before it since the start-up summary \(starting the loader's workers ([\d.]+) s\)", line):
            marks["summary_to_step1_s"], marks["loader_workers_s"] = float(gap.group(1)), float(gap.group(2))
    elif match := re.match(r"Samples at step \d+: \d+ (?:sample|image)\(s\) in ([\d.]+) s", line):  # older trees: image(s)
        samplings.append(float(match.group(1)))
        if "; parts: " in line:  # where the sampling's time went (the slowest rank's moves and rendering)
            listed = line.split("; parts: ", 1)[1].strip().rstrip(".")
            marks.setdefault("sampling_parts", []).append(
                {name.strip(): float(sec) for name, sec in re.findall(r"([^,]+?) ([\d.]+) s(?:, |$)", listed)})


def split_training(progress: list[tuple[float, int | None]], sample_spans: list[tuple[float, float]],
                   first_step_s: float | None, train_s: float | None) -> dict[str, float]:
    """Where the training time (`config` to `done`) went, from the times of the steps' `progress` events:
    `steps` every step's own time (an epoch's first step counted at the mean of the others), `epoch_ends`
    what the epoch boundaries (backups, the next epoch's first batch) added beyond a step, `samplings`,
    and `final_save` from the last step to `done` less a sampling there. The parts that do not shrink
    with more GPUs are all but `steps`. Empty where the run made fewer than 2 steps."""
    if len(progress) < 2 or first_step_s is None or train_s is None:
        return {}
    times = [at for at, _ in progress]

    def sampling_within(start: float, end: float) -> float:
        return sum(min(b, end) - max(a, start) for a, b in sample_spans if b > start and a < end)

    ordinary, boundary = [], []
    for (a, epoch_a), (b, epoch_b) in zip(progress, progress[1:]):
        (boundary if epoch_a != epoch_b else ordinary).append(b - a - sampling_within(a, b))
    mean = sum(ordinary) / len(ordinary) if ordinary else sum(boundary) / len(boundary)
    after_last = sampling_within(times[-1], float("inf"))
    split = {"steps": sum(ordinary) + mean * len(boundary),
             "epoch_ends": sum(boundary) - mean * len(boundary),
             "samplings": sampling_within(float("-inf"), float("inf")),
             "final_save": train_s - (times[-1] - times[0]) - first_step_s - after_last}
    return {name: round(value, 1) for name, value in split.items()}


def report(result: dict, json_path: Path | None) -> None:
    print(json.dumps(result), flush=True)
    if json_path:
        with open(json_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")


def run_group(specs: list[RunSpec], args, work: Path) -> list[dict]:
    """Run specs at the same time (each on its own GPUs) and return their results in order. Each run's
    line is reported when it ends, not when the group does: a group stopped at a time limit keeps the
    lines of the runs that finished."""
    results: list[dict | None] = [None] * len(specs)
    reporting = threading.Lock()

    def go(i: int) -> None:
        results[i] = run_one(specs[i], args, work)
        with reporting:
            report(results[i], args.json)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


def table(results: list[dict]) -> str:
    one = {r["label"]: r["wall_s"] for r in results if r["gpus"] == 1 and r["exit_code"] == 0}
    rows = ["| run | GPUs | wall s | vs 1 GPU | before step 1 s | first step s | training s | of it: steps, epoch ends, "
            "samplings, final save s | done to exit s | exit |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = one.get(r["label"])
        ratio = f"{base / r['wall_s']:.2f}x" if base and r["gpus"] > 1 else "-"
        split = ", ".join(str(value) for value in r.get("training_split_s", {}).values()) or "-"
        rows.append(f"| {r['label']} | {r['gpus']} | {r['wall_s']} | {ratio} | {r['before_step1_s']} | {r['first_step_s']} | "
                    f"{r['train_s']} | {split} | {r['done_to_exit_s']} | {r['exit_code']} |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the job's values where no option gave one."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", choices=sorted(JOBS), default="sd15",
                   help="the job's defaults (preset, model type, images, resolution, batch, epochs, samplings)")
    p.add_argument("--base-model", required=True, help="diffusers folder or file (built with --make-model if missing)")
    p.add_argument("--make-model", nargs="?", const="", choices=["", *MODEL_TYPES], metavar="TYPE",
                   help="write a random real-size model of TYPE (default: the job's) at --base-model first if it "
                        "is missing")
    p.add_argument("--make-device", help="where to initialise the random model's weights (default: cuda where there "
                                         "is one: much faster for the big models)")
    p.add_argument("--data", required=True, type=Path, help="image folder (built with --make-data if short)")
    p.add_argument("--make-data", type=int, nargs="?", const=-1, default=0, metavar="N",
                   help="make N JPEGs with captions there (without N: the job's number of images)")
    p.add_argument("--image-size", type=int)
    p.add_argument("--preset")
    p.add_argument("--resolution", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--epochs", type=int)
    p.add_argument("--prompts", type=int)
    p.add_argument("--sample-every", type=int, help="sampling.every_n_epochs")
    p.add_argument("--sample-steps", type=int)
    p.add_argument("--config-value", action="append", default=[], help="extra override for every run")
    p.add_argument("--label-config", action="append", default=[], metavar="LABEL:KEY=VALUE",
                   help="extra override for the runs labelled LABEL")
    p.add_argument("--run", action="append", required=True, help="LABEL@TREE:GPUS[:DEVICES], '+' = at once")
    p.add_argument("--work", type=Path, default=Path("/tmp/tandem-e2e"))
    p.add_argument("--shared-cache", type=Path, help="one latent/text cache for every run (complete after the first "
                                                         "run: start-up with a complete cache); default: a fresh one each")
    p.add_argument("--json", type=Path, help="append one JSON line per run")
    p.add_argument("--keep", type=Path, help="copy each run's log and profile reports into a folder of its own here")
    p.add_argument("--cpu", action="store_true", help="CPU processes (for testing the harness)")
    args = p.parse_args(argv)
    job = JOBS[args.job]
    for name in ("image_size", "preset", "resolution", "batch", "epochs", "prompts", "sample_every", "sample_steps"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(job, name))
    if args.make_model == "":
        args.make_model = job.make_model
    if args.make_data == -1:
        args.make_data = job.images
    args.images = args.make_data or len(list(Path(args.data).glob("*.jpg")))
    args.data = Path(args.data).resolve()  # each tree's runs start in that tree
    if not args.base_model.startswith("builtin:"):
        args.base_model = str(Path(args.base_model).resolve())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.make_model and not args.base_model.startswith("builtin:") and not Path(args.base_model).exists():
        import torch

        from modules.benchmark.synthetic import write_random_model
        device = args.make_device or ("cuda" if torch.cuda.is_available() else "cpu")
        write_random_model(args.make_model, args.base_model, device=device)
    if args.make_data:
        make_images(args.data, args.make_data, args.image_size)
    args.work.mkdir(parents=True, exist_ok=True)
    results = []
    for group in args.run:
        results += run_group([RunSpec.parse(s) for s in group.split("+")], args, args.work)
    print(table(results))
    return 0 if all(r["exit_code"] == 0 for r in results) else 1
