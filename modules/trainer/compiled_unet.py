"""`training.compile`: the UNet through torch.compile, and the check that it trains like the eager UNet.

A compiler bug does not crash: it trains quietly on wrong gradients. One was met while building this
(torch 2.13 CPU inductor: the demo UNet's output matched eager to 2e-6 while its gradients were 60%
off, some layers getting none), and upstream has had others (pytorch/pytorch#193061). So a compiled
run compares the gradients of the first batch of each shape (each shape compiles its own kernels)
with the eager UNet's before that step changes any weight.

The gradients are compared through a fingerprint - each tensor's norm and its projection on a fixed
random direction - so the check holds two small vectors, not a second copy of every gradient.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Compiled and eager kernels round differently (fused reductions, other matmul tilings): with bf16 autocast a
# correct compile differed by 2e-3 to 4e-3 (SD1.5-size UNet on H100, docs/Performance.md,
# "`training.compile`"), the CPU miscompile by 60%.
GRADIENT_TOLERANCE = 0.05
LOSS_TOLERANCE = 0.01


class CompiledGradientError(RuntimeError):
    pass


class CompileUnavailable(RuntimeError):
    pass


def compile_unet(unet: torch.nn.Module, device: torch.device, image_sizes: int, dropout: bool,
                 split_at_ddp_buckets: bool = True, cuda_graphs: bool = False, checkpointing: bool = False):
    """The compiled callable for `unet`; its parameters stay the module's own (nothing is copied).

    `split_at_ddp_buckets`: under DDP, compile one graph per gradient bucket so each bucket's all-reduce
    overlaps the rest of the backward (PyTorch's default), or one graph for the whole denoiser.
    `cuda_graphs`: on a GPU, replay the compiled kernels as CUDA graphs (`training.cuda_graphs`); the
    trainer then keeps the gradients in buffers of their own (`keep_gradient_buffers`)."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    from torch.utils._triton import has_triton

    if device.type == "cuda" and not has_triton():
        raise CompileUnavailable(
            "training.compile: torch.compile needs Triton to compile for the GPU, and this PyTorch has none "
            "(the Windows builds of PyTorch ship without it; on Linux: pip install triton matching your "
            "torch). Set training.compile to false.")

    # The compiled kernels are cached on disk and reused by the next run of the same model and shapes
    # (PyTorch's FX-graph and autograd caches, on by default), in the folder the scripts chose at their
    # start (modules/util/compile_cache.py): by now diffusers' import has fixed it for this process.
    log_compile_workers_to_a_file(inductor_config)
    graphs = replays_cuda_graphs(cuda_graphs, device)
    if cuda_graphs and not graphs:
        log.info("training.cuda_graphs: CUDA graphs are captured on GPUs only; on %s the denoiser runs without them.",
                 device.type.upper())
    if not graphs:
        keep_checkpointed_randomness_cacheable()
    elif checkpointing and not graph_safe_randomness_cacheable():
        log.info("training.cuda_graphs with gradient checkpointing: PyTorch %s cannot keep a denoiser whose "
                 "checkpointed blocks draw random numbers in its compile cache when CUDA graphs replay it, so "
                 "such a run compiles afresh at every start (minutes; PyTorch 2.13 keeps it).", torch.__version__)
    # Each aspect bucket is one more static shape; without room for all of them dynamo would fall back
    # to eager for the later buckets and the run would change speed half-way.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 2 * image_sizes + 4)
    dynamo_config.optimize_ddp = "ddp_optimizer" if split_at_ddp_buckets else False
    if dropout:
        # Compiled dropout draws from its own random stream; with the eager one the check compares like
        # with like (same masks).
        inductor_config.fallback_random = True
    # On CPU the graph is captured and differentiated as on a GPU, but run by eager kernels: torch 2.13's
    # CPU inductor fuses the UNet's backward into kernels with wrong gradients (see the module doc), and
    # its C++ compiles take minutes per image size. CPU training is for trying things, not for speed.
    if device.type == "cpu":
        return torch.compile(unet, backend="aot_eager", dynamic=False)
    return torch.compile(unet, backend="inductor", dynamic=False, mode="reduce-overhead" if graphs else None)


def replays_cuda_graphs(cuda_graphs: bool, device: torch.device) -> bool:
    """Whether `training.cuda_graphs` captures graphs on `device` (a GPU's only)."""
    return cuda_graphs and device.type == "cuda"


def keep_gradient_buffers(params: list[torch.nn.Parameter]) -> None:
    """Give every trained weight without a gradient a zeroed one, before a step's first backward.

    With CUDA graphs (`training.cuda_graphs`) the backward's gradients come out in memory that the graph
    reuses at its next replay, and autograd keeps a fresh gradient as `.grad` without copying it: under
    gradient accumulation the next micro-batch's replay would overwrite the gradients gathered so far
    (pytorch/pytorch#96693: silently wrong sums; #169545: an error). A gradient that exists is added to in
    place, so the weights keep buffers of their own, which the step zeroes instead of freeing them."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def graph_safe_randomness_cacheable() -> bool:
    """Whether this PyTorch's compile cache keeps the random operator that CUDA graphs can capture
    (`keep_checkpointed_randomness_cacheable`)."""
    try:
        from torch._prims import rng_prims
    except ImportError:
        return True
    cacheable = getattr(getattr(rng_prims, "graphsafe_run_with_rng_state", None), "cacheable", None)
    return cacheable is None or bool(cacheable())


def keep_checkpointed_randomness_cacheable() -> None:
    """Let the compile cache serve a denoiser trained with gradient checkpointing on a GPU.

    A random op inside a checkpointed block must draw the same numbers when the backward recomputes it, so
    AOTAutograd wraps it in an operator that carries the random state. On CUDA its default form is the one CUDA
    graphs can capture (`graphsafe_run_with_rng_state`), which PyTorch 2.11 refuses to cache ("Can't cache
    HigherOrderOperator"; 2.13 caches it): every start compiled afresh - 6.2 min for the SDXL LoRA on an H200
    (docs/Performance.md, "The SDXL LoRA job"). Without CUDA graphs (`training.cuda_graphs`) the plain form
    (`run_with_rng_state`) replays the same random numbers and is cached; with them the graph-safe form stays,
    because the plain one reads the random state on the host, which a captured graph cannot."""
    try:
        import torch._functorch.config as functorch_config
    except ImportError:
        return
    if not graph_safe_randomness_cacheable() and getattr(functorch_config, "graphsafe_rng_functionalization", False):
        functorch_config.graphsafe_rng_functionalization = False


# torch.compile's own clocks and counters (torch._dynamo.utils): where a compile's seconds go, and whether
# the on-disk cache served it. Private to PyTorch, so read defensively: a renamed entry reads as zero.
_TIMERS = {"tracing": "bytecode_tracing", "compiling": "OutputGraph.call_user_compiler",
           "loading kernels": "PyCodeCache.load_by_key_path", "backward": "backward._backward_impl"}
_COUNTERS = {"graphs": ("stats", "unique_graphs"),
             "autograd cache hits": ("aot_autograd", "autograd_cache_hit"),
             "autograd cache misses": ("aot_autograd", "autograd_cache_miss"),
             "kernel cache hits": ("inductor", "fxgraph_cache_hit"),
             "kernel cache misses": ("inductor", "fxgraph_cache_miss"),
             "CUDA graphs skipped": ("inductor", "cudagraph_skips")}


def compile_readings() -> dict[str, float]:
    """torch.compile's seconds and counts so far in this process (they only grow)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics, counters
    except ImportError:
        return {}
    readings = {name: float(sum(compilation_time_metrics.get(key, ()))) for name, key in _TIMERS.items()}
    readings.update({name: float(counters[group][key]) for name, (group, key) in _COUNTERS.items()})
    return readings


def describe_compile(before: dict[str, float], after: dict[str, float]) -> str:
    """What one compile spent, from two `compile_readings`: 'tracing 3.1 s, compiling 20.4 s (loading
    kernels 9.0 s), backward 5.2 s; 3 graphs; cache: autograd 3 hits 0 misses, kernels 6 hits 0 misses'."""
    d = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    if not d:
        return "no compile readings in this torch"
    return (f"tracing {d['tracing']:.1f} s, compiling {d['compiling']:.1f} s (loading kernels "
            f"{d['loading kernels']:.1f} s), backward {d['backward']:.1f} s; {d['graphs']:.0f} graphs; cache: "
            f"autograd {d['autograd cache hits']:.0f} hits {d['autograd cache misses']:.0f} misses, kernels "
            f"{d['kernel cache hits']:.0f} hits {d['kernel cache misses']:.0f} misses"
            + (f"; CUDA graphs skipped for {d['CUDA graphs skipped']:.0f} graphs (their kernels run one by one; "
               "TORCH_LOGS=perf_hints says why)" if d.get("CUDA graphs skipped", 0) else ""))


def log_compile_workers_to_a_file(inductor_config) -> None:
    """Inductor's compile workers (a helper process and its pool: 32 processes on a 64-core host) end a
    moment after the trainer (modules/util/exit.py). Where their output is not suppressed (PyTorch's
    `worker_suppress_logging`, on by default in recent versions) they would hold the trainer's stdout
    open until then, and whoever reads it to its end (`| tee`, the GUI, a scheduler's log) would wait:
    their output goes to a file next to the compile cache instead. A user's TORCHINDUCTOR_WORKER_LOGPATH wins."""
    if (getattr(inductor_config, "worker_suppress_logging", False)
            or not hasattr(inductor_config, "torchinductor_worker_logpath")
            or inductor_config.torchinductor_worker_logpath):
        return
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    folder = Path(cache_dir())  # creates it
    inductor_config.torchinductor_worker_logpath = str(folder / f"compile-workers-rank{os.environ.get('RANK', '0')}.log")


def gradient_fingerprint(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """(norm, projection on a fixed random direction) of each parameter's gradient, in float64."""
    rows = []
    for i, p in enumerate(params):
        if p.grad is None:
            rows.append(torch.zeros(2, dtype=torch.float64))
            continue
        grad = p.grad.detach().float()
        gen = torch.Generator(device=grad.device).manual_seed(1234 + i)
        direction = torch.randn(grad.shape, generator=gen, device=grad.device)
        rows.append(torch.stack([grad.norm(), (grad * direction).sum()]).double().cpu())
    return torch.stack(rows).flatten()


def relative_difference(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value - reference).norm() / reference.norm().clamp_min(1e-30))


@contextlib.contextmanager
def same_random_stream(device: torch.device):
    """Run the body with the current random state and put it back afterwards, so both passes draw alike."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield


def compare_with_eager(eager_pass, compiled_pass, params: list[torch.nn.Parameter], device: torch.device,
                       what: str = "the first batch") -> float:
    """Run one batch eagerly and compiled (each a callable returning its loss after its backward) and
    raise CompiledGradientError when their gradients differ; returns the relative difference.

    Leaves every gradient unset, as before a step."""
    results = []
    for run in (eager_pass, compiled_pass):
        with same_random_stream(device):
            loss = float(run())
        results.append((loss, gradient_fingerprint(params)))
        for p in params:
            p.grad = None
    (eager_loss, eager), (compiled_loss, compiled) = results
    grad_diff = relative_difference(compiled, eager)
    loss_diff = abs(compiled_loss - eager_loss) / max(abs(eager_loss), 1e-30)
    if not (grad_diff <= GRADIENT_TOLERANCE and loss_diff <= LOSS_TOLERANCE):  # NaN fails too
        raise CompiledGradientError(
            f"training.compile: on {what} the compiled denoiser's gradients differ from the "
            f"uncompiled one's by {grad_diff:.1%} (allowed {GRADIENT_TOLERANCE:.0%}) and its loss by "
            f"{loss_diff:.2%} (allowed {LOSS_TOLERANCE:.0%}) - torch {torch.__version__} miscompiles this "
            f"model. Nothing was trained. Set training.compile to false (or try another torch version).")
    log.info("Compiled denoiser checked against the uncompiled one on %s: gradients differ by %.2e (allowed "
             "%.0e), loss by %.2e.", what, grad_diff, GRADIENT_TOLERANCE, loss_diff)
    return grad_diff


class CompileCheck:
    """The check of a compiled run: the first batch of each shape (each compiles its own kernels) is trained
    through the uncompiled and the compiled denoiser, and the gradients compared, before the step trains
    on it. `checked`: each shape checked so far, with the relative difference found."""

    def __init__(self, device: torch.device, cuda_graphs: bool = False, signature: str | None = None) -> None:
        """`signature`: the run's `graph_signature`, under which each compiled shape is noted as held by the compile
        cache (`compile_ledger`); None: not noted."""
        self.device = device
        self.cuda_graphs = replays_cuda_graphs(cuda_graphs, device)
        self.signature = signature
        self.checked: dict[tuple[int, ...], float] = {}

    @staticmethod
    def shape(batch: dict) -> tuple[int, ...]:
        return tuple((batch["latents"] if "latents" in batch else batch["pixels"]).shape)

    def needed(self, batch: dict) -> bool:
        return self.shape(batch) not in self.checked

    def check(self, batch: dict, eager_pass, compiled_pass, params: list[torch.nn.Parameter]) -> None:
        """Compile for `batch`'s shape and compare: `eager_pass()` and `compiled_pass()` each run the batch's
        forward and backward (the compiled one without synchronising gradients) and return the loss;
        `params` are the trained parameters whose gradients are compared."""
        shape = self.shape(batch)
        started, readings = time.perf_counter(), compile_readings()
        self.checked[shape] = compare_with_eager(eager_pass, compiled_pass, params, self.device,
                                                 what=f"batch shape {list(shape)}")
        seconds, after = time.perf_counter() - started, compile_readings()
        # On the run's log (the trainer's logger): how long the first step of each shape waits for the compiler.
        logging.getLogger("tandem").info("Denoiser compiled and checked for batch shape %s in %.1f s%s: %s.",
                                         list(shape), seconds,
                                         " (its CUDA graphs are recorded at its next steps)" if self.cuda_graphs else "",
                                         describe_compile(readings, after))
        if self.signature is not None:
            from modules.util.compile_ledger import note_compiled
            note_compiled(self.signature, shape, seconds, served_from_cache(readings, after))


def served_from_cache(before: dict[str, float], after: dict[str, float]) -> bool:
    """Whether a compile between two `compile_readings` came from the compile cache: hits and no misses."""
    hits = sum(after.get(k, 0.0) - before.get(k, 0.0) for k in ("autograd cache hits", "kernel cache hits"))
    misses = sum(after.get(k, 0.0) - before.get(k, 0.0) for k in ("autograd cache misses", "kernel cache misses"))
    return hits > 0 and misses == 0


def graph_signature(denoiser: torch.nn.Module, device: torch.device, **settings) -> str:
    """What decides whether PyTorch's compile cache serves a compile of `denoiser` on `device`, as one hash: torch's
    version, the GPU, the denoiser's class and every weight's name, shape, dtype and whether it trains (the
    architecture, the LoRA and its rank, fp8), and the run's `settings` that change the graph (precision,
    checkpointing, CUDA graphs, dropout, the split at DDP's buckets). Noted with each compiled batch shape
    (`compile_ledger`)."""
    import hashlib
    import json

    where = device.type
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    digest = hashlib.sha256(json.dumps({"torch": torch.__version__, "device": where, "class": type(denoiser).__name__,
                                        **settings}, sort_keys=True).encode())
    for name, p in denoiser.named_parameters():
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    return digest.hexdigest()
