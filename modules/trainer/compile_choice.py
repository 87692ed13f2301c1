"""`training.compile` and `training.cuda_graphs` as a run takes them: `auto` weighed, said in one line at start.

A compile pays where the steps it shortens save more than it costs: a cold compile of a UNet takes minutes,
the same compile from PyTorch's compile cache seconds, and a step with CUDA graphs a third of the uncompiled
one's time on a host-paced model. `auto` weighs the two for this run - its steps, images a step and image
size, against the figures measured for its family (`FIGURES`, from docs/Performance.md) - and whether the
compile cache already holds the run's graphs (`compile_ledger.py`): compiling then costs the cached figure,
else the cold one. Families without measured figures are not compiled by `auto` (`on` compiles them).

`choose` is a pure function of what it is given, so the whole decision is tested without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

from modules.families.registry import FAMILIES


@dataclass(frozen=True)
class CompileFigures:
    """What one family's compile was measured to cost and save: the reference step (`images` of `pixels` each)
    uncompiled, compiled, compiled with CUDA graphs; a compile with an empty cache and one from the cache."""
    what: str
    images: int
    pixels: int
    uncompiled_step_s: float
    compiled_step_s: float
    graphs_step_s: float | None
    cold_compile_s: float
    cached_compile_s: float

    def saving(self, graphs: bool) -> float:
        """The share of an uncompiled step that compiling saves."""
        fast = self.graphs_step_s if graphs and self.graphs_step_s is not None else self.compiled_step_s
        return max(0.0, 1.0 - fast / self.uncompiled_step_s)


# Measured on one H200 (docs/Performance.md: "`training.compile`", "CUDA graphs", "From the command to the saved
# model", "The SDXL LoRA job") and on one H100 for SD3.5 Medium ("Flux.1 and SD3.5"). Each figure is the middle of
# the measured range; the compile times are the first step's.
SD15_LORA = CompileFigures("an SD1.5 LoRA at 8 images of 512 px a step on an H200", images=8, pixels=512 * 512,
                           uncompiled_step_s=0.172, compiled_step_s=0.131, graphs_step_s=0.068,
                           cold_compile_s=190.0, cached_compile_s=17.0)
SDXL_LORA = CompileFigures("an SDXL LoRA at 8 images of 1024 px a step on an H200", images=8, pixels=1024 * 1024,
                           uncompiled_step_s=1.79, compiled_step_s=0.77, graphs_step_s=None,
                           cold_compile_s=370.0, cached_compile_s=50.0)
SD35_LORA = CompileFigures("an SD3.5 Medium LoRA at 2 images of 1024 px a step on an H100", images=2,
                           pixels=1024 * 1024, uncompiled_step_s=0.457, compiled_step_s=0.249, graphs_step_s=None,
                           cold_compile_s=240.0, cached_compile_s=60.0)
FIGURES: dict[str, CompileFigures] = {"sd1": SD15_LORA, "sd2": SD15_LORA, "sdxl": SDXL_LORA, "sd3": SD35_LORA}
"""Per family (model type); SD 2.x has SD 1.x's UNet. The SD3.5 compile from the cache was not measured: its
figure is a quarter of its cold compile, above the share measured for SD1.5 and SDXL (9-16%)."""

SPLIT_CACHED_FACTOR = 3.2
"""A denoiser split at DDP's gradient buckets (a full fine-tune on several GPUs) traces its backward again at
every start: on 2 H100s its compile from the cache took 52-57 s against 17 s as one graph."""


@dataclass(frozen=True)
class RunForCompile:
    """What `auto` weighs of a run: its family, this process's steps and the images and pixels of each, the batch
    shapes it compiles and how many of them the compile cache holds."""
    family: str
    steps: int
    images_per_step: int
    pixels_per_image: float
    shapes: int
    cached_shapes: int
    measured_cached_s: float | None = None
    """What compiling from the cache took on this machine last time (the ledger's), if it was measured."""
    split_at_buckets: bool = False


@dataclass(frozen=True)
class CompileChoice:
    compile: bool
    graphs: bool
    """Whether the compiled denoiser is asked to replay CUDA graphs (`compile_unet` captures them on GPUs only)."""
    line: str = ""
    """What the run says at start about the choice; empty where the config said `on` or `off`."""


def graphs_wanted(setting: str, compiled: bool, on_gpu: bool, unavailable: str | None) -> bool:
    """`training.cuda_graphs` for a run that compiles (`compiled`): `on` always (a CPU run keeps the gradient
    buffers and says it captures nothing), `auto` on a GPU unless `unavailable` names why not, `off` never."""
    if not compiled or setting == "off":
        return False
    return setting == "on" or (on_gpu and unavailable is None)


def choose(compile_setting: str, graphs_setting: str, on_gpu: bool, run: RunForCompile | None,
           blocked: str | None = None, graphs_unavailable: str | None = None) -> CompileChoice:
    """Whether this run compiles its denoiser and replays it as CUDA graphs.

    `blocked`: why this run cannot compile (FSDP, layer offload, no Triton...), which `auto` says and `on` leaves
    to the checks that refuse it; `graphs_unavailable`: why `cuda_graphs` auto leaves the graphs out; `run`: the
    run as `auto` weighs it (None: not known, e.g. no steps)."""
    if compile_setting == "off":
        return CompileChoice(False, False)
    if compile_setting == "on":
        return CompileChoice(True, graphs_wanted(graphs_setting, True, on_gpu, graphs_unavailable))
    if not on_gpu:
        return _not("on the CPU a compiled denoiser runs the same kernels, so compiling saves nothing")
    if blocked:
        return _not(blocked)
    figures = FIGURES.get(run.family) if run is not None else None
    if figures is None or run is None or run.steps <= 0:
        title = FAMILIES[run.family].title if run is not None and run.family in FAMILIES else "this model"
        return _not(f"no measured figures for {title} to weigh a compile against; training.compile on compiles it")
    graphs = graphs_wanted(graphs_setting, True, on_gpu, graphs_unavailable)
    step_s = (figures.uncompiled_step_s * run.images_per_step / figures.images * run.pixels_per_image / figures.pixels)
    saving = run.steps * step_s * figures.saving(graphs)
    cached_s = run.measured_cached_s or figures.cached_compile_s * (SPLIT_CACHED_FACTOR if run.split_at_buckets else 1)
    cold = run.shapes - run.cached_shapes
    cost = run.cached_shapes * cached_s + cold * figures.cold_compile_s
    steps = f"{run.steps:,} step{'s' * (run.steps != 1)}"
    if cold == 0:
        held = ("the compile cache holds this model's graph" if run.shapes == 1
                else f"the compile cache holds this model's graphs for all {run.shapes} batch shapes")
        cost_text = f"compiling from it costs ~{_seconds(cost)}"
    elif run.cached_shapes == 0:
        held = None
        cost_text = f"a cold compile costs ~{_seconds(cost)}" + (
            f" ({run.shapes} batch shapes)" if run.shapes > 1 else "")
    else:
        held = f"the compile cache holds {run.cached_shapes} of the {run.shapes} batch shapes' graphs"
        cost_text = f"compiling costs ~{_seconds(cost)}"
    basis = f"estimated from {figures.what}"
    if saving > cost:
        how = " with CUDA graphs" if graphs else ""
        reason = f"{held}; {steps} should save ~{_seconds(saving)}, {cost_text}" if held else (
            f"{steps} should save ~{_seconds(saving)}, more than {cost_text}; later runs of this model and batch "
            "shape load it from the compile cache")
        return CompileChoice(True, graphs, f"training.compile auto: compiling{how} - {reason} ({basis}).")
    reason = f"{steps} would save ~{_seconds(saving)}, {cost_text}"
    if held:
        reason = f"{held}, but {reason}"
    elif run.cached_shapes == 0:
        reason += "; training.compile on compiles anyway and fills the cache for later runs"
    return _not(f"{reason} ({basis})")


def _not(reason: str) -> CompileChoice:
    return CompileChoice(False, False, f"training.compile auto: not compiling - {reason}.")


def _seconds(value: float) -> str:
    return f"{value:,.0f} s" if value >= 1 else f"{value:.1f} s"
