"""Run benchmark cases through the real trainers and report images/s, scaling and memory.

Each case runs in fresh worker processes (1 GPU: `GenericTrainer`, N GPUs: `DistributedTrainer`
under the same spawn launcher users get), with only the model source and the data replaced by
`synthetic` and the steps timed - parts handed to the real trainer (`trainer/hand_ins.py`), whose own
code runs every step. The loop does not wait for the GPU each step (see trainer.step_exchange): the CPU queues
step k+1 while the GPU runs step k and waits only for step k-1, so in steady state the wall time
between consecutive steps on rank 0 is the GPU's step time. Reported: the median of those intervals
(the reference's statistic) and the mean over the whole measured window, which is bracketed by two
synchronisations (end of warm-up, end of run) and so counts every step's full cost.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from modules.benchmark import DEMO
from modules.benchmark.synthetic import control_count
from modules.config import TrainConfig, apply_overrides, config_from_dict, config_to_dict
from modules.planning.memory_plan import NoPlanFits
from modules.util import dist_utils as du
from modules.distributed import rendezvous
from modules.distributed.distributed_trainer import DistributedTrainer
from modules.distributed.plan import LaunchPlan, plan_launch
from modules.distributed.processes import start_workers, stop_forkserver, worker_variables
from modules.util.logs import setup_logging
from modules.trainer.generic_trainer import GenericTrainer
from modules.trainer.hand_ins import HandIns, RunSource, StepObserver
from modules.util.atomic import unique_path
from modules.util.exit import exit_now

RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)


PROFILE_STEPS = 3


@dataclasses.dataclass(frozen=True)
class Case:
    model: str  # sd1 | sdxl
    mode: str  # full | lora
    batch: int
    resolution: int
    world: int
    gradient_checkpointing: bool = False
    steps: int = 30
    warmup: int = 8
    extra: tuple[str, ...] = ()  # --config-value overrides, e.g. multi_gpu.bucket_cap_mb=100
    device: str = "cuda"  # cpu: a smoke test of the benchmark itself (gloo), not a measurement
    profile_dir: str = ""  # non-empty: profile `profile_steps` extra steps after the measured ones
    profile_steps: int = PROFILE_STEPS
    variant: str = ""  # one of the family's published sizes (FamilyInfo.variants); '' for its default
    controls: int | None = None  # control images per item of an edit model; None: what the family needs (synthetic.py)

    def name(self) -> str:
        extra = f" {' '.join(self.extra)}" if self.extra else ""
        gc = " gc" if self.gradient_checkpointing else ""
        model = f"{self.model}-{self.variant}" if self.variant else self.model
        controls = f" {self.controls} control(s)" if self.controls else ""
        return f"{model} {self.mode} {self.resolution}px b{self.batch}{gc}{controls}{extra}"

    def total_steps(self) -> int:
        return self.warmup + self.steps + (self.profile_steps if self.profile_dir else 0)


def write_placeholder(path: Path, family: str, variant: str) -> None:
    """The case's `model.base_model`: empty for a family's default size (sized as that); for another published
    size a .safetensors header without data, of one tensor with that size's parameter count, which the memory
    estimate reads as that size (`model_sizes._file_variant`) - so Wan 14B is planned as the 14B."""
    if not variant:
        path.write_bytes(b"")
        return
    from modules.planning.model_sizes import shipped_configs, stored_component
    configs = shipped_configs(family, variant)
    params = stored_component(configs.get("transformer") or configs["unet"]).params
    header = json.dumps({"denoiser": {"dtype": "BF16", "shape": [params], "data_offsets": [0, 2 * params]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header)


def case_config(case: Case, workspace: Path) -> TrainConfig:
    """The config a user would write for this case (bf16 autocast, fused AdamW, caching on).

    `model.base_model` is an empty placeholder file in the workspace and `model.model_type` the case's
    family: the model itself is built in memory (`SyntheticSource.model`), but whatever sizes the
    model from the config - `multi_gpu.strategy = auto`'s memory estimate - must see the real-size
    architecture (Tandem's shipped configs), not the built-in demo model a default config names."""
    if case.variant == DEMO:
        base_model = "builtin:demo"  # loaded as a user's run loads it (`create_model`)
    else:
        base_model = Path(workspace) / f"random-{case.model}.safetensors"
        base_model.parent.mkdir(parents=True, exist_ok=True)
        write_placeholder(base_model, case.model, case.variant)
    overrides = [
        f"model.base_model={base_model}", f"model.model_type={case.model}",
        f"general.workspace_dir={workspace}", "general.tensorboard=false", f"general.device={case.device}",
        f"training.method={case.mode}", f"training.batch_size={case.batch}", "training.precision=bf16",
        f"training.max_steps={case.total_steps()}", "training.max_grad_norm=0",
        "training.learning_rate=1e-5", "optimizer.weight_decay=0.01",
        f"training.gradient_checkpointing={str(case.gradient_checkpointing).lower()}",
        f"data.resolution={case.resolution}", "data.num_workers=2",
        "sampling.every_n_epochs=0", "save.backup_every_n_epochs=0", "save.backup_on_stop=false",
        f"multi_gpu.enabled={str(case.world > 1).lower()}", f"multi_gpu.num_gpus={case.world}",
        "multi_gpu.launcher=spawn",
        # LoRA keeps its frozen base in bf16 like the reference; full fine-tune keeps fp32 master weights.
        f"model.unet_dtype={'bf16' if case.mode == 'lora' else 'fp32'}",
        # An edit model's concept names its controls, as a user's must; the synthetic items carry their latents.
        *([f"data.concepts[0].control={Path(workspace) / 'control'}"]
          if control_count(case.model, case.controls) else []),
        *case.extra,
    ]
    return apply_overrides(TrainConfig(), overrides)


class SyntheticSource(RunSource):
    """The case's data and model: synthetic items that carry their latents and text embeddings (nothing to cache
    or encode first), and a random real-size model built in memory - or, for `--model demo`, the built-in
    model loaded as a user's run loads it."""

    ready_made = True

    def __init__(self, case: Case):
        self.case = case

    def dataset(self, trainer):
        from modules.benchmark.synthetic import SyntheticCachedLatents
        c = self.case
        length = c.batch * c.world * (c.total_steps() + 1)
        return SyntheticCachedLatents(c.model, c.resolution, length, variant=c.variant,
                                      frames=trainer.cfg.data.video_frames, controls=c.controls)

    def model(self, trainer):
        from modules.benchmark.synthetic import random_bundle
        from modules.model.loading import frozen_dtypes, store_base_in_float8
        if self.case.variant == DEMO:
            return None
        cfg, device = trainer.cfg, trainer.device
        if device.type == "cuda" and cfg.multi_gpu.memory_limit_gib.strip():
            # Built whole on the GPU (a user's run loads on the CPU): the GPU's limit holds from the sharded
            # state on (`StepTimer.started`), as it would for the user.
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        bundle = random_bundle(self.case.model, device, frozen_dtypes(cfg.model, cfg.training)["unet"],
                               self.case.variant)
        store_base_in_float8(bundle, cfg.model)  # model.unet_dtype=fp8 (float8.py)
        if device.type == "cuda" and cfg.model.unet_dtype == "fp8":
            # The random model is built on the GPU in bf16 (building 12 B weights on the CPU takes minutes);
            # load_model quantizes on the CPU, so a user's GPU never holds the bf16 copy: leave it out of the peak.
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        return bundle


class StepTimer(StepObserver):
    """Times every optimizer step of the real loop and writes the case's result at the run's end."""

    def __init__(self, case: Case, result_file: Path, process_start: float):
        self.case = case
        self.result_file = result_file
        self.process_start = process_start
        """When the parent started the workers (wall clock): the time to the first step counts from there."""
        self.step_times: list[float] = []
        self.phase_times: dict[str, list[float]] = {"data": [], "launch": [], "after": []}
        self.setup_peak_gib: float | None = None
        self.profile_summary = None

    def started(self, trainer) -> None:
        device, cfg = trainer.device, trainer.cfg
        if device.type == "cuda" and (not trainer.parallel.holds_whole_model or trainer.parallel.offload is not None):
            # The random model was built whole on every GPU (`SyntheticSource.model`); a user's sharded run loads
            # it on the CPU and moves only each rank's shard to the GPU: count the peak from the sharded state on.
            # The whole-run peak (what the raw reference reports: it also builds whole) is kept apart.
            self.setup_peak_gib = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        if device.type == "cuda" and cfg.multi_gpu.memory_limit_gib.strip():
            from modules.trainer.memory_limit import hold_to_memory_limit
            torch.cuda.empty_cache()  # what the whole model's build left reserved counts against the limit
            hold_to_memory_limit(cfg, device)
        self.synchronize(trainer)
        self.last_step_end = time.perf_counter()

    @staticmethod
    def synchronize(trainer) -> None:
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()

    # Where the host's time goes, to tell a GPU-bound loop from a host-bound one: waiting for the loader
    # (data), queueing the step's GPU work (launch; no waits unless something syncs) and the after-step work
    # (waiting for the previous step, reporting).
    def step_begins(self, trainer) -> None:
        self.launch_start = time.perf_counter()
        self.phase_times["data"].append(self.launch_start - self.last_step_end)

    def step_queued(self, trainer) -> None:
        self.launch_end = time.perf_counter()
        self.phase_times["launch"].append(self.launch_end - self.launch_start)

    def step_ended(self, trainer) -> None:
        self.phase_times["after"].append(time.perf_counter() - self.launch_end)
        c, step = self.case, trainer.global_step
        first, warm, measured_end = step == 1, step == c.warmup, step == c.warmup + c.steps
        if first or warm or measured_end:
            self.synchronize(trainer)  # only here: the GPU has really finished this step
        now = time.perf_counter()
        if first:
            self.first_step_s = time.time() - self.process_start  # wall clock: started in the parent
        if warm:
            self.window_start = now
        if measured_end:
            self.window_s = now - self.window_start
        if step <= c.warmup + c.steps:
            self.step_times.append(now - self.last_step_end)
        if c.profile_dir and measured_end:
            from modules.trainer.step_profile import StepProfiler
            self.profiler = StepProfiler(trainer.device)
            self.profiler.start()
        if c.profile_dir and step == c.total_steps():
            slug = re.sub(r"[^A-Za-z0-9._-]+", "-", c.name()).strip("-")
            # Repeats and other cases never overwrite an earlier report.
            report = unique_path(Path(c.profile_dir) / f"profile-{slug}-world{du.world_size()}-rank{du.rank()}.txt",
                                 time.strftime("%H%M%S"))
            self.profile_summary = self.profiler.stop(c.profile_steps, report)
        self.last_step_end = time.perf_counter()

    def ended(self, trainer) -> None:
        """The case's result, gathered from every rank and written by rank 0 (the run itself wrote nothing:
        `HandIns.final_outputs` is off)."""
        c, cfg, parallel, device = self.case, trainer.cfg, trainer.parallel, trainer.device
        measured = self.step_times[c.warmup:]
        step_s = statistics.median(measured)
        mean_step_s = self.window_s / len(measured)
        cuda = device.type == "cuda"
        from modules.util.host_memory import rank_figures
        memories = du.gather_objects({"rank": du.rank(), "device": str(device),
                                      "max_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                                      **rank_figures(parallel.offload)})  # host memory: PSS, RSS, peak
        profiles = du.gather_objects(self.profile_summary if c.profile_dir else None)
        if not du.is_main():
            return
        trainable = sum(p.numel() for p in trainer.trainable_params())
        # A step trains batch x accumulation images on each data-parallel rank.
        images_per_step = c.batch * cfg.training.gradient_accumulation_steps * parallel.data_world
        denoiser = trainer.bundle.denoiser
        result = dict(case=c.name(), model=c.model, mode=c.mode, resolution=c.resolution,
                      controls=control_count(c.model, c.controls),
                      batch_per_gpu=c.batch, world=du.world_size(), gc=c.gradient_checkpointing,
                      strategy=parallel.name,  # what multi_gpu.strategy gave (single: one process)
                      layer_offload_blocks=parallel.layer_offload_blocks,  # swapped (multi_gpu.layer_offload)
                      **plan_figures(getattr(trainer, "strategy", None) or trainer, cfg),
                      extra=list(c.extra), trainable=trainable, step_s=round(step_s, 4),
                      step_s_spread=[round(min(measured), 4), round(max(measured), 4)],
                      # A context-parallel group trains one slice of the batch: samples are per slice.
                      context_parallel=trainer.parallel.layout.context,
                      samples_per_s=round(images_per_step / step_s, 2),
                      mean_step_s=round(mean_step_s, 4),
                      host_median_s={k: round(statistics.median(v[c.warmup:c.warmup + c.steps]), 4)
                                     for k, v in self.phase_times.items()},
                      samples_per_s_mean=round(images_per_step / mean_step_s, 2),
                      max_mem_gib=round(max(m["max_mem_gib"] for m in memories), 2),
                      setup_peak_gib=self.setup_peak_gib,  # sharded: before the reset
                      denoiser_gib=round(sum(t.numel() * t.element_size() for t in
                                             [*denoiser.parameters(), *denoiser.buffers()]) / 2**30, 3),
                      per_rank=memories, time_to_first_step_s=round(self.first_step_s, 1),
                      start_phases_s={k: round(v, 2) for k, v in trainer.startup.seconds.items()},
                      compile_gradient_difference=max(trainer.compile_check.checked.values(), default=None)
                      if trainer.compile_check is not None else None,
                      gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__)
        if c.profile_dir:
            result["profile"] = profiles[0]
            result["profile_per_rank"] = profiles
        self.result_file.write_text(json.dumps(result))


def case_hand_ins(case: Case, result_file: Path, process_start: float) -> HandIns:
    """What the case hands the real trainer: its data and model, the step timer, and no outputs at the end (the
    benchmark measures training steps only)."""
    return HandIns(SyntheticSource(case), StepTimer(case, result_file, process_start), final_outputs=False)


def plan_figures(strategy, cfg) -> dict:
    """The memory plan a multi-GPU case trained with: its name, the limit it was made for, each GPU's
    estimate (beside `per_rank`'s measured peaks)."""
    plan = getattr(strategy, "plan", None) or getattr(strategy, "memory_plan", None)  # N processes, or one
    figures = {"memory_limit_gib": cfg.multi_gpu.memory_limit_gib or None}
    if plan is not None:
        figures.update(plan=plan.name, plan_changes=plan.changes, estimated_peak_gib=[round(p, 2) for p in plan.peaks],
                       plan_capacities_gib=[round(c, 2) for c in plan.capacities])
    return figures


def _entry(local_rank: int, case: Case, cfg_data: dict, plan: LaunchPlan | None, result_file: str,
           process_start: float, rendezvous_at: str | None) -> None:
    setup_logging()
    cfg = config_from_dict(cfg_data)
    hand_ins = case_hand_ins(case, Path(result_file), process_start)
    if plan is None:
        trainer = GenericTrainer(cfg, hand_ins=hand_ins)
    else:
        os.environ.update(worker_variables(plan, local_rank))
        trainer = DistributedTrainer(cfg, device_type=case.device, rendezvous=rendezvous_at, hand_ins=hand_ins)
    run_reporting_refusal(trainer, Path(result_file))
    # Finished, result written: leave as the product's spawned workers do. Under spawn the interpreter's
    # own exit runs, and there the trainer's reference cycles (DistributedTrainer.teardown) still held
    # gloo's process group; freeing it then aborted a finished rank now and then ("terminate called
    # without an active exception", SIGABRT) and failed the case. Errors raised above keep spawn's report.
    exit_now(0)


def case_problems(case: Case) -> list[str]:
    """What the config checks find wrong with a case's config (its --config-value settings), before any
    worker builds a real-size model only to fail at its first step."""
    from modules.config.validation import validate

    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        return validate(case_config(case, Path(tmp) / "ws"), check_paths=False)


def run_case(case: Case) -> dict:
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        cfg = case_config(case, Path(tmp) / "ws")
        plan = plan_launch(cfg) if case.world > 1 else None
        result_file = Path(tmp) / "result.json"
        # The workers start as the launcher starts them, and their rendezvous is served as the launcher serves it.
        with (rendezvous.serve(plan.master_addr, plan.master_port, RENDEZVOUS_TIMEOUT)
              if plan else contextlib.nullcontext()) as rendezvous_at:
            try:
                start_workers(_entry, (case, config_to_dict(cfg), plan, str(result_file), time.time(), rendezvous_at),
                              case.world, plan, join=True)
            finally:
                stop_forkserver()
        return read_result(result_file)


def run_reporting_refusal(trainer, result_file: Path) -> None:
    """Run the case's trainer; a memory plan that refuses the case is written to the result file. The product
    refuses such a config in one line; across spawn's process boundary it would reach the parent as a worker's
    traceback."""
    try:
        trainer.run()
    except NoPlanFits as refusal:
        result_file.write_text(json.dumps({"refused": str(refusal)}))


def read_result(result_file: Path) -> dict:
    """The case's result; raises `NoPlanFits` with the worker's message where the plan refused the case."""
    result = json.loads(result_file.read_text())
    if "refused" in result:
        raise NoPlanFits(result["refused"])
    return result


def scaling_table(results: list[dict]) -> str:
    """Markdown table; scaling = N-GPU img/s / (N x 1-GPU img/s of the same case)."""
    base = {(r["case"]): r["samples_per_s"] for r in results if r["world"] == 1}
    rows = ["| case | GPUs | img/s (median step) | scaling | img/s (window mean) | step s | peak GiB | first step s |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        one = base.get(r["case"])
        scaling = f"{100 * r['samples_per_s'] / (r['world'] * one):.1f}%" if one and r["world"] > 1 else "-"
        rows.append(f"| {r['case']} | {r['world']} | {r['samples_per_s']} | {scaling} | {r.get('samples_per_s_mean', '-')} | {r['step_s']} | "
                    f"{r['max_mem_gib']} | {r['time_to_first_step_s']} |")
    return "\n".join(rows)
