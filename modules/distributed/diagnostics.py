"""`check_multi_gpu`: the report a user runs before the first multi-GPU training.

It answers "will multi-GPU training work here, and with which settings?": software versions, every
GPU with its free memory, peer-to-peer access and NVLink topology, a real all-reduce across all GPUs
(NCCL, one process per GPU, the sum checked exactly, bus bandwidth measured), a 2-process gloo
all-reduce on the CPU, and, given a config, an estimate of memory per GPU against the free memory.
Every finding that would make training fail is a problem and makes the exit status 1.

One report, so one module (~560 lines) in three layers: measuring (versions, GPUs, topology, the
all-reduces), judging (memory, strategy, batch split, network: `*_findings`) and formatting; the next
check that grows it should take one layer into a module of its own.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from modules.config import load_config
from modules.config.backends import backend_problem

from . import memory_estimate, rendezvous

GIB = 1024 ** 3
GPU_ALLREDUCE_MIB = 256
CPU_ALLREDUCE_MIB = 8
TIMED_ITERATIONS = 5
ENV_VARS = ("CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "NCCL_DEBUG", "NCCL_P2P_DISABLE",
            "NCCL_IB_DISABLE", "TANDEM_FORCE_SINGLE_GPU")
# Free memory kept back when sizing the batch: the allocator rounds up and fragments.
SAFETY_FRACTION = 0.9


UNEQUAL_SPEED = 1.5
"""A GPU this much slower (or with this much less free memory) than another gets the batch_split advice."""


def versions() -> dict:
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError):
            nccl = None
    dist = torch.distributed
    return {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": nccl,
        "distributed_available": dist.is_available(),
        "nccl_backend": dist.is_available() and dist.is_nccl_available(),
        "gloo_backend": dist.is_available() and dist.is_gloo_available(),
    }


def gpus() -> list[dict]:
    found = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        found.append({
            "index": i, "name": props.name,
            "total_gib": total / GIB, "free_gib": free / GIB,
            "compute_capability": f"{props.major}.{props.minor}",
            "bf16": props.major >= 8,  # Ampere and newer compute bf16 natively
        })
    return found


def gpu_speeds(count: int, size: int = 4096, repeats: int = 20) -> list[float]:
    """bf16 matrix-multiply rate of each GPU in TFLOP/s (fp32 where bf16 is missing): the speed of unequal cards."""
    rates = []
    for i in range(count):
        device = torch.device("cuda", i)
        dtype = torch.bfloat16 if torch.cuda.get_device_properties(i).major >= 8 else torch.float32
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(repeats):
            a @ b
        torch.cuda.synchronize(device)
        rates.append(2 * size ** 3 * repeats / (time.perf_counter() - started) / 1e12)
        del a, b
    return rates


def _unequal_gpu_findings(cards: list[dict], speeds: list[float], advice: list) -> None:
    """Advice for a machine whose GPUs differ in speed or free memory (multi_gpu.batch_split)."""
    if len(cards) < 2:
        return
    fastest, slowest = max(speeds), min(speeds)
    if slowest > 0 and fastest > UNEQUAL_SPEED * slowest:
        slow = [c["index"] for c, s in zip(cards, speeds) if s == slowest][0]
        advice.append(f"GPU {slow} computes {fastest / slowest:.1f}x slower than the fastest GPU: with equal "
                      "batches it sets the pace of every step; multi_gpu.batch_split=auto gives it fewer samples.")
    frees = [c["free_gib"] for c in cards]
    if min(frees) < max(frees) / UNEQUAL_SPEED:
        listed = ", ".join(f"GPU {c['index']}: {c['free_gib']:.1f} GiB" for c in cards)
        advice.append(f"The GPUs have unequal free memory ({listed}): "
                      "with equal batches the smallest sets the batch size; multi_gpu.batch_split=auto (or a list "
                      "such as 6,2) lets each GPU carry what fits.")


def p2p_matrix(count: int) -> list[list[bool | None]]:
    """`m[i][j]`: can GPU i read GPU j's memory directly (None on the diagonal)."""
    return [[None if i == j else bool(torch.cuda.can_device_access_peer(i, j)) for j in range(count)]
            for i in range(count)]


def parse_topology(text: str) -> dict:
    """The GPU-to-GPU part of `nvidia-smi topo -m`: link kind per pair (`NV12`, `PIX`, `SYS`, ...)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # nvidia-smi underlines the header on a terminal
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    # The header is the first line of GPU names; a row starts with a GPU name followed by its "X" cell.
    header = next((ln for ln in lines if ln.split()[0] == "GPU0" and ln.split()[1:2] != ["X"]), None)
    if header is None:
        return {"available": False, "reason": "no GPU header in nvidia-smi topo -m output"}
    columns = [c for c in header.split() if re.fullmatch(r"GPU\d+", c)]
    links: dict[str, dict[str, str]] = {}
    for ln in lines:
        cells = ln.split()
        if ln == header or not cells or cells[0] not in columns:
            continue
        links[cells[0]] = dict(zip(columns, cells[1:1 + len(columns)]))
    nvlink = sorted({tuple(sorted((a, b))) for a, row in links.items() for b, kind in row.items()
                     if kind.startswith("NV")})
    return {"available": True, "links": links, "nvlink_pairs": [list(p) for p in nvlink]}


def topology() -> dict:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"available": False, "reason": "nvidia-smi not found"}
    try:
        out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"available": False, "reason": f"nvidia-smi topo -m failed: {e}"}
    if out.returncode != 0:
        return {"available": False, "reason": f"nvidia-smi topo -m exited {out.returncode}: {out.stderr.strip()}"}
    return parse_topology(out.stdout)


def _allreduce_worker(local_rank: int, world: int, backend: str, rendezvous_at: str, numel: int, results,
                      first_rank: int = 0) -> None:
    """One rank: all-reduce known values, check the sum exactly, then time the same size."""
    rank = first_rank + local_rank
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=120)
    torch.distributed.init_process_group(backend, store=rendezvous.connect(rendezvous_at, timeout), rank=rank,
                                         world_size=world, timeout=timeout,
                                         device_id=device if device.type == "cuda" else None)
    try:
        # Small integers are exact in fp32, so any deviation from the sum is a real fault.
        tensor = torch.full((numel,), float(rank + 1), device=device)
        torch.distributed.all_reduce(tensor)
        expected = world * (world + 1) / 2
        wrong = int((tensor != expected).sum())
        seconds = _time_allreduce(tensor, device)
        results.put({"rank": rank, "wrong_elements": wrong, "expected": expected,
                     "got_first": float(tensor[0]) if wrong else expected, "seconds": seconds})
    finally:
        torch.distributed.destroy_process_group()


def _time_allreduce(tensor: torch.Tensor, device: torch.device) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    torch.distributed.all_reduce(tensor)  # warm-up: NCCL builds its rings on first use
    sync()
    torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(TIMED_ITERATIONS):
        torch.distributed.all_reduce(tensor)
    sync()
    return (time.perf_counter() - start) / TIMED_ITERATIONS


@dataclasses.dataclass(frozen=True)
class Nodes:
    """This machine's place in a check over several machines (the same options as the training launcher's)."""
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int


@contextlib.contextmanager
def _rendezvous_of(nodes: Nodes | None):
    """One machine: served on loopback only, as the training launcher does. Several: node 0 serves it on
    master_addr, the others connect there."""
    timeout = datetime.timedelta(seconds=120)
    if nodes is None:
        with rendezvous.serve("127.0.0.1", 0, timeout) as rendezvous_at:
            yield rendezvous_at
    elif nodes.node_rank == 0:
        with rendezvous.serve(nodes.master_addr, nodes.master_port, timeout) as rendezvous_at:
            yield rendezvous_at
    else:
        yield rendezvous.endpoint(nodes.master_addr, nodes.master_port)


def run_allreduce(backend: str, world: int, size_mib: int, nodes: Nodes | None = None) -> dict:
    """Spawn `world` processes (on each machine, with `nodes`) that all-reduce `size_mib` MiB of fp32; a dict
    with ok, error, bandwidth."""
    import torch.multiprocessing as mp
    numel = size_mib * 1024 * 1024 // 4
    local = world
    total = world * (nodes.nnodes if nodes else 1)
    first = local * nodes.node_rank if nodes else 0
    result = {"backend": backend, "device": "cuda" if backend == "nccl" else "cpu",
              "world_size": total, "size_mib": size_mib}
    if nodes:
        result.update(nnodes=nodes.nnodes, node_rank=nodes.node_rank)
    queue = mp.get_context("spawn").SimpleQueue()
    started = time.perf_counter()
    try:
        with _rendezvous_of(nodes) as rendezvous_at:
            mp.spawn(_allreduce_worker, args=(total, backend, rendezvous_at, numel, queue, first), nprocs=local,
                     join=True)
    except Exception as e:  # a rank died: report it as a failed check, with the rank's message
        result.update(ok=False, error=f"{type(e).__name__}: {e}".strip())
        return result
    world = total
    ranks = sorted((queue.get() for _ in range(local)), key=lambda r: r["rank"])
    bad = [r for r in ranks if r["wrong_elements"]]
    seconds = max(r["seconds"] for r in ranks)
    algbw = size_mib * 1024 * 1024 / seconds / 1e9
    result.update(
        ok=not bad,
        error=None if not bad else "; ".join(
            f"rank {r['rank']}: {r['wrong_elements']} elements wrong (expected {r['expected']}, "
            f"got {r['got_first']})" for r in bad),
        expected_sum=ranks[0]["expected"], seconds_per_allreduce=seconds,
        total_seconds=time.perf_counter() - started,
        algbw_gbps=algbw, busbw_gbps=algbw * 2 * (world - 1) / world)
    return result


def _memory_findings(est: dict, cfg, free_gib: float, problems: list, advice: list) -> None:
    usable = free_gib * SAFETY_FRACTION
    plain = memory_estimate.largest_batch_that_fits(est, usable, checkpointing=False)
    ckpt = memory_estimate.largest_batch_that_fits(est, usable, checkpointing=True)
    est["compared_free_gib"] = free_gib
    est["largest_batch"] = plain
    est["largest_batch_checkpointed"] = ckpt
    if est["total"] <= usable:
        advice.append(f"Memory: about {est['total']:.1f} GiB of {free_gib:.1f} GiB free per GPU; batch size up to "
                      f"{plain} fits without gradient checkpointing ({ckpt} with it).")
        return
    problems.append(f"Estimated memory per GPU ({est['total']:.1f} GiB) exceeds {SAFETY_FRACTION:.0%} of the "
                    f"free memory ({free_gib:.1f} GiB) with training.batch_size={cfg.training.batch_size}.")
    fits_as_set = ckpt if cfg.training.gradient_checkpointing else plain
    if fits_as_set >= 1:
        advice.append(f"Lower training.batch_size to {fits_as_set}.")
    if not cfg.training.gradient_checkpointing and ckpt >= 1:
        advice.append(f"Or set training.gradient_checkpointing=true: then batch size up to {ckpt} fits.")
    if ckpt == 0:
        advice.append("Even batch size 1 with gradient checkpointing does not fit: use training.method=lora, "
                      "optimizer.name=adamw_8bit or adafactor, and model.unet_dtype=bf16 (or fp8, with "
                      "training.precision=bf16).")


def _strategy_estimates(cfg, est: dict, visible_gpus: int, free_gib: float | None) -> dict:
    """Per-GPU memory with DDP and with FSDP over the planned number of GPUs (2 when fewer are visible, to
    plan), whether each fits `free_gib`, and what `multi_gpu.strategy` makes of it."""
    from modules.distributed.strategy import choose_strategy, planned_world_size

    world = max(2, planned_world_size(cfg, visible_gpus))
    fsdp = memory_estimate.estimate_fsdp(est, world, cfg.multi_gpu.fsdp_cpu_offload)
    usable = None if free_gib is None else free_gib * SAFETY_FRACTION
    if cfg.multi_gpu.enabled:
        choice = choose_strategy(cfg, world, "cuda", free_gib, {"ddp": est, "fsdp": fsdp})
        chosen, reason = choice.strategy, choice.reason
    else:
        chosen, reason = None, "multi_gpu.enabled is false: one GPU holds the whole model, as with DDP"
    return {"world_size": world, "free_gib": free_gib, "activations_measured": est["activations_measured"],
            "ddp": {"total": est["total"], "fits": None if usable is None else est["total"] <= usable},
            "fsdp": {**fsdp, "fits": None if usable is None else fsdp["total"] <= usable},
            "choice": chosen, "reason": reason}


def _fsdp_findings(strategies: dict, cfg, free_gib: float, problems: list, advice: list) -> None:
    fsdp, world = strategies["fsdp"], strategies["world_size"]
    if fsdp["fits"]:
        advice.append(f"Memory: DDP would need about {strategies['ddp']['total']:.1f} GiB per GPU, more than the "
                      f"{free_gib:.1f} GiB free; FSDP over {world} GPUs needs about {fsdp['total']:.1f} GiB per GPU "
                      "and fits (multi_gpu.strategy auto or fsdp).")
        return
    problems.append(f"Estimated memory per GPU with FSDP over {world} GPUs ({fsdp['total']:.1f} GiB) exceeds "
                    f"{SAFETY_FRACTION:.0%} of the free memory ({free_gib:.1f} GiB).")
    if not cfg.multi_gpu.fsdp_cpu_offload:
        advice.append("Set multi_gpu.fsdp_cpu_offload=true (the sharded weights, gradients and optimizer state "
                      "then live in CPU memory), use more GPUs, or lower training.batch_size.")
    elif not cfg.training.gradient_checkpointing:
        advice.append("Set training.gradient_checkpointing=true, or lower training.batch_size.")


def _per_gpu_batches(cfg, cards: list[dict], assume_free_gib: float | None, problems: list) -> list[dict] | None:
    """With an explicit multi_gpu.batch_split: each GPU's batch and estimated memory against its free memory."""
    from modules.util.batch_slice import parse_split

    try:
        split = parse_split(cfg.multi_gpu.batch_split, len(cfg.multi_gpu.batch_split.split(",")), cfg.training.batch_size)
    except ValueError:
        return None
    if not isinstance(split, list):
        return None
    rows = []
    for rank, batch in enumerate(split):
        part = copy.deepcopy(cfg)
        part.training.batch_size = batch
        need = memory_estimate.estimate(part)["total"]
        free = assume_free_gib if assume_free_gib is not None else (
            cards[rank]["free_gib"] if rank < len(cards) else None)
        rows.append({"rank": rank, "batch": batch, "estimate_gib": need, "free_gib": free})
        if free is not None and need > free * SAFETY_FRACTION:
            problems.append(f"multi_gpu.batch_split gives GPU {rank} a batch of {batch}, estimated at {need:.1f} GiB, "
                            f"more than {SAFETY_FRACTION:.0%} of its {free:.1f} GiB free; move samples to another GPU.")
    return rows


def build_report(config_path: str | None, skip_gloo: bool, assume_free_gib: float | None) -> dict:
    report: dict = {"versions": versions(), "env": {k: os.environ.get(k) for k in ENV_VARS}}
    problems: list[str] = []
    advice: list[str] = []
    v = report["versions"]
    cards = gpus() if torch.cuda.is_available() else []
    speeds = gpu_speeds(len(cards)) if cards else []
    for card, speed in zip(cards, speeds):
        card["tflops"] = speed
    report["gpus"] = cards
    report["p2p"] = p2p_matrix(len(cards)) if len(cards) > 1 else None
    report["topology"] = topology() if cards else {"available": False, "reason": "no GPUs"}
    report["allreduce"] = []
    if not v["distributed_available"]:
        problems.append("torch.distributed is not available in this PyTorch build: no process group is possible.")
    elif cards:
        backend = "nccl" if v["nccl_backend"] else "gloo"
        report["allreduce"].append(run_allreduce(backend, len(cards), GPU_ALLREDUCE_MIB) if backend == "nccl"
                                   else {"backend": "gloo", "device": "cuda", "ok": None,
                                         "error": "NCCL not available; GPU all-reduce skipped (training uses gloo)"})
    if v["distributed_available"] and not skip_gloo:
        if v["gloo_backend"]:
            report["allreduce"].append(run_allreduce("gloo", 2, CPU_ALLREDUCE_MIB))
        else:
            problems.append("The gloo backend is missing from this PyTorch build: CPU process groups are impossible.")
    for r in report["allreduce"]:
        if r.get("ok") is False:
            problems.append(f"{r['backend']} all-reduce over {r['world_size']} processes failed: {r['error']}")

    on_linux_cuda = platform.system() == "Linux" and bool(cards) and v["nccl_backend"]
    advice.append("Backend: nccl (Linux with CUDA)." if on_linux_cuda else
                  "Backend: gloo (no NCCL here: Windows, macOS or no CUDA GPU).")
    if len(cards) == 1:
        advice.append("Only one GPU is visible: multi-GPU training needs two or more (check CUDA_VISIBLE_DEVICES).")
    if report["p2p"] and any(ok is False for row in report["p2p"] for ok in row):
        advice.append("Some GPU pairs have no peer-to-peer access (typical of consumer cards): if training hangs "
                      "at start-up, set NCCL_P2P_DISABLE=1.")
    _unequal_gpu_findings(cards, speeds, advice)
    if cards:
        all_bf16 = all(c["bf16"] for c in cards)
        advice.append("Precision: bf16 (all GPUs support it)." if all_bf16 else
                      "Precision: fp16 (not every GPU supports bf16).")

    report["memory"] = None
    if config_path:
        try:
            cfg = load_config(config_path)
            est = memory_estimate.estimate(cfg)
        except (ValueError, OSError) as e:  # ConfigError and EstimateError are ValueErrors
            problems.append(f"Config {config_path}: {e}")
        else:
            report["memory"] = est
            backend = backend_problem(cfg, len(cards))
            if backend:
                problems.append(backend)
            if cards and cfg.training.precision == "bf16" and not all(c["bf16"] for c in cards):
                problems.append("training.precision=bf16 but not every GPU supports bf16; set training.precision=fp16.")
            free = assume_free_gib if assume_free_gib is not None else (
                min(c["free_gib"] for c in cards) if cards else None)
            report["strategies"] = strategies = _strategy_estimates(cfg, est, len(cards), free)
            if free is None:
                advice.append("No GPU to compare the memory estimate against: each GPU needs the memory estimated above.")
            elif strategies["choice"] == "fsdp":
                _fsdp_findings(strategies, cfg, free, problems, advice)
            else:
                _memory_findings(est, cfg, free, problems, advice)
            report["per_gpu"] = _per_gpu_batches(cfg, cards, assume_free_gib, problems)
    report["problems"] = problems
    report["recommendations"] = advice
    return report


def _yes_no(value) -> str:
    return "-" if value is None else ("yes" if value else "no")


def format_report(report: dict) -> str:
    v = report["versions"]
    out = ["Tandem multi-GPU check", "",
           f"Python {v['python']} on {v['platform']}",
           f"torch {v['torch']}  CUDA {v['cuda'] or 'none (CPU build)'}  cuDNN {v['cudnn'] or '-'}  "
           f"NCCL {v['nccl'] or '-'}",
           f"backends: nccl {_yes_no(v['nccl_backend'])}, gloo {_yes_no(v['gloo_backend'])}",
           "environment: " + ", ".join(f"{k}={val}" for k, val in report["env"].items() if val is not None)
           if any(val is not None for val in report["env"].values()) else "environment: no relevant variables set",
           ""]
    cards = report["gpus"]
    if not cards:
        out.append("No CUDA GPUs found: training can only run on the CPU (gloo), e.g. for testing.")
    for c in cards:
        out.append(f"GPU {c['index']}: {c['name']}, {c['free_gib']:.1f} of {c['total_gib']:.1f} GiB free, "
                   f"compute capability {c['compute_capability']}, bf16 {_yes_no(c['bf16'])}"
                   + (f", {c['tflops']:.0f} TFLOP/s (matrix multiply)" if "tflops" in c else ""))
    if report["p2p"]:
        out.append("Peer-to-peer access (row reads column):")
        for i, row in enumerate(report["p2p"]):
            out.append(f"  GPU{i}: " + " ".join("  X" if ok is None else (" ok" if ok else " no") for ok in row))
    topo = report["topology"]
    if topo["available"]:
        pairs = ", ".join("-".join(p) for p in topo["nvlink_pairs"]) or "none"
        out.append(f"NVLink pairs: {pairs}")
    elif cards:
        out.append(f"NVLink topology unavailable ({topo['reason']}).")
    out.append("")
    for r in report["allreduce"]:
        head = f"All-reduce {r['backend']} on {r['device']}"
        if r.get("ok") is None:
            out.append(f"{head}: skipped ({r['error']})")
        elif not r["ok"]:
            out.append(f"{head}, {r['world_size']} processes: FAILED - {r['error']}")
        elif r["world_size"] == 1:
            out.append(f"{head}, 1 process: works (sum correct); bandwidth needs two or more GPUs")
        else:
            out.append(f"{head}, {r['world_size']} processes: sum correct ({r['expected_sum']:g}); "
                       f"{r['size_mib']} MiB in {r['seconds_per_allreduce'] * 1000:.1f} ms, "
                       f"algbw {r['algbw_gbps']:.2f} GB/s, busbw {r['busbw_gbps']:.2f} GB/s")
    m = report["memory"]
    if m:
        p = m["params"]
        out += ["", f"Memory per GPU for this config ({m['model_type']}, {m['method']}, {m['optimizer']}, batch "
                    f"{m['batch_size']} at {m['resolution']}px; shapes from {m['architecture_source']}):",
                "  parameters: " + ", ".join(f"{k} {n / 1e6:.1f}M" for k, n in p.items())]
        for key in ("weights", "gradients", "ddp_buckets", "optimizer_state", "ema", "autocast_cache",
                    "activations", "runtime_overhead", "total"):
            out.append(f"  {key.replace('_', ' '):<17}" + ("not measured" if m[key] is None else f"{m[key]:8.2f} GiB"))
        out.append(f"  ({m['note']})")
        out += format_strategies(report.get("strategies"))
    for row in report.get("per_gpu") or []:
        free = f"{row['free_gib']:.1f} GiB free" if row["free_gib"] is not None else "free memory unknown"
        out.append(f"  GPU {row['rank']}: batch {row['batch']}, about {row['estimate_gib']:.1f} GiB ({free})")
    out.append("")
    out += [f"Recommendation: {a}" for a in report["recommendations"]]
    out += [f"PROBLEM: {p}" for p in report["problems"]]
    out.append("Result: " + ("all checks passed." if not report["problems"] else
                             f"{len(report['problems'])} problem(s) found."))
    return "\n".join(out)


def fits_text(fits: bool | None, total: float) -> str:
    """"fits, per GPU ~X GiB" - the GUI's multi-GPU frame says it the same way."""
    verdict = {True: "fits", False: "does not fit", None: "free memory unknown"}[fits]
    return f"{verdict}, per GPU ~{total:.1f} GiB"


def format_strategies(s: dict | None) -> list[str]:
    if not s:
        return []
    free = f" of {s['free_gib']:.1f} GiB free" if s["free_gib"] is not None else ""
    unmeasured = "" if s["activations_measured"] else " (activations not included)"
    f = s["fsdp"]
    offload = f"; {f['host_offload']:.1f} GiB per GPU in CPU memory (fsdp_cpu_offload)" if f["cpu_offload"] else ""
    return ["", f"Strategy per GPU{free}{unmeasured}:",
            f"  DDP:  {fits_text(s['ddp']['fits'], s['ddp']['total'])} (whole model, gradients, optimizer state)",
            f"  FSDP over {s['world_size']} GPUs: {fits_text(f['fits'], f['total'])} (sharded {f['sharded']:.1f}, "
            f"whole frozen parts {f['replicated_weights']:.1f}, gathered blocks {f['gathered_blocks']:.1f} GiB{offload})",
            f"  multi_gpu.strategy: {s['choice'].upper() + ', ' if s['choice'] else ''}{s['reason']}"]


def network_findings(nodes: Nodes, backend: str) -> list[str]:
    """Advice for an all-reduce between machines: which network NCCL/gloo will use, InfiniBand or not."""
    advice = []
    infiniband = sorted(p.name for p in Path("/sys/class/infiniband").glob("*")) if Path("/sys/class/infiniband").is_dir() else []
    if infiniband:
        advice.append(f"InfiniBand seen ({', '.join(infiniband)}): NCCL uses it unless NCCL_IB_DISABLE=1; "
                      "NCCL_DEBUG=INFO prints 'NET/IB' when it does.")
    elif backend == "nccl":
        advice.append("No InfiniBand seen: NCCL talks over TCP sockets between the machines (NCCL_DEBUG=INFO "
                      "prints 'NET/Socket'); expect a fraction of one machine's bandwidth.")
    variable = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    if not os.environ.get(variable):
        advice.append(f"{variable} is not set: if the machines have several networks, set it to the interface "
                      f"that reaches {nodes.master_addr} (e.g. {variable}=eth0) on every machine.")
    return advice


def run_node_check(nodes: Nodes, size_mib: int) -> dict:
    """The cross-machine part of the check: every machine runs it with its --node-rank."""
    cards = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if cards and torch.distributed.is_nccl_available() else "gloo"
    result = run_allreduce(backend, cards or 1, size_mib, nodes)
    result["advice"] = network_findings(nodes, backend)
    return result


def format_node_check(result: dict) -> str:
    lines = [f"All-reduce over {result['nnodes']} machines ({result['world_size']} processes, {result['backend']}, "
             f"this is node {result['node_rank']}):"]
    if result.get("ok"):
        lines.append(f"  correct; {result['size_mib']} MiB in {1000 * result['seconds_per_allreduce']:.1f} ms: "
                     f"bus bandwidth {result['busbw_gbps']:.2f} GB/s")
    else:
        lines.append(f"  FAILED: {result.get('error')}")
    lines += [f"Recommendation: {a}" for a in result["advice"]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="check_multi_gpu.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-path", help="config JSON or preset name (e.g. '#demo') to estimate memory for")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    parser.add_argument("--skip-gloo", action="store_true", help="skip the 2-process gloo all-reduce on the CPU")
    parser.add_argument("--assume-free-gib", type=float,
                        help="compare the memory estimate with this much free GPU memory instead of the GPUs'")
    parser.add_argument("--nnodes", type=int, default=1, help="check the all-reduce between this many machines "
                                                              "(run it on each, with its --node-rank)")
    parser.add_argument("--node-rank", type=int, default=0, help="this machine's number (0 serves the rendezvous)")
    parser.add_argument("--master-addr", default="127.0.0.1", help="node 0's address the others reach it by")
    parser.add_argument("--master-port", type=int, default=29500, help="the rendezvous port on node 0")
    parser.add_argument("--size-mib", type=int, default=GPU_ALLREDUCE_MIB, help="all-reduce size between machines")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Print the report; 0 when every check passed, 1 when a problem was found."""
    args = parse_args(argv)
    if args.nnodes > 1:
        if not 0 <= args.node_rank < args.nnodes:
            print(f"error: --node-rank {args.node_rank} is not a node of --nnodes {args.nnodes} (0 to {args.nnodes - 1}).",
                  file=sys.stderr)
            return 2
        result = run_node_check(Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port), args.size_mib)
        print(json.dumps(result, indent=2) if args.json else format_node_check(result), flush=True)
        return 0 if result.get("ok") else 1
    report = build_report(args.config_path, args.skip_gloo, args.assume_free_gib)
    print(json.dumps(report, indent=2) if args.json else format_report(report), flush=True)
    return 1 if report["problems"] else 0
