"""`check_multi_gpu`: the report a user runs before the first multi-GPU training.

It answers "will multi-GPU training work here, and with which settings?": software versions, every
GPU with its free memory, peer-to-peer access and NVLink topology, a real all-reduce across all GPUs
(NCCL, one process per GPU, the sum checked exactly, bus bandwidth measured), a 2-process gloo
all-reduce on the CPU, and, given a config, the memory plan for these GPUs (`--plan-for 2x24`: for
GPUs this machine need not have, and nothing else). Every finding that would make training fail is a
problem and makes the exit status 1.

One report, so one module (~520 lines) in three layers: measuring (versions, GPUs, topology, the
all-reduces), judging (memory, strategy, batch split, network: `*_findings`) and formatting; the next
check that grows it should take one layer into a module of its own.
"""
from __future__ import annotations

import contextlib
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
from modules.launch.backends import backend_problem

from modules.planning.memory_need import facts, largest_batch
from modules.planning.memory_plan import SAFETY_FRACTION

from . import memory_estimate, rendezvous
from .check_cli import GPU_ALLREDUCE_MIB, parse_args, plan_for  # the command line, torch-free

GIB = 1024 ** 3
CPU_ALLREDUCE_MIB = 8
TIMED_ITERATIONS = 5
ENV_VARS = ("CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "NCCL_DEBUG", "NCCL_P2P_DISABLE",
            "NCCL_IB_DISABLE", "TANDEM_FORCE_SINGLE_GPU")


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


def _memory_findings(cfg, model, cards: list[dict], assume_free_gib: float | None, problems: list,
                     advice: list) -> dict | None:
    """The memory plan for this machine's GPUs (their free memory, `--assume-free-gib`, or
    `multi_gpu.memory_limit_gib`): a problem when nothing fits, advice when it is tight."""
    from modules.planning.memory_plan import NoPlanFits, plan_for_cards
    from modules.distributed.strategy import planned_world_size

    world = planned_world_size(cfg, len(cards)) if cfg.multi_gpu.enabled else 1
    world = max(world, 2) if cfg.multi_gpu.enabled else 1
    free = [assume_free_gib] * world if assume_free_gib is not None else (
        [c["free_gib"] for c in cards][:world] if len(cards) >= world else None)
    try:
        plan = plan_for_cards(cfg, model, free, world)
    except NoPlanFits as e:
        problems.append(f"Memory: {e}")
        return {"world_size": world, "plan": None, "refused": str(e)}
    if plan is None:
        advice.append("No GPU to compare the memory estimate against: each GPU needs the memory estimated above.")
        return None
    over = [r for r, (p, c) in enumerate(zip(plan.peaks, plan.capacities)) if p > c * SAFETY_FRACTION]
    if over:
        worst = max(over, key=lambda r: plan.peaks[r] - plan.capacities[r])
        problems.append(f"Estimated memory per GPU ({plan.peaks[worst]:.1f} GiB, {plan.name}) exceeds "
                        f"{SAFETY_FRACTION:.0%} of GPU {worst}'s {plan.capacities[worst]:.1f} GiB with "
                        f"training.batch_size={cfg.training.batch_size}.")
        f, usable, setup = facts(model, cfg), min(plan.capacities) * SAFETY_FRACTION, plan.candidate.setup
        largest = largest_batch(f, cfg, setup, usable)
        if 0 < largest < cfg.training.batch_size:
            advice.append(f"Lower training.batch_size to {largest}.")
        if not setup.checkpointing:
            checkpointed = largest_batch(f, cfg, dataclasses.replace(setup, checkpointing=True), usable)
            if checkpointed > 0:
                advice.append(f"Or set training.gradient_checkpointing=true: then batch size up to {checkpointed} fits.")
        advice.append("scripts/check_multi_gpu.py --config-path <config> --plan-for <GPUs>x<GiB> shows the plans "
                      "for several GPUs (FSDP, an fp8 base, offloading).")
    else:
        advice.append(f"Memory: {plan.describe()}")
    return {"world_size": world, "plan": plan.name, "strategy": plan.strategy, "changes": plan.changes,
            "peaks": plan.peaks, "capacities": plan.capacities, "tight": plan.tight, "rejected": plan.rejected,
            "parts": [n.parts for n in plan.needs]}


def build_report(config_path: str | None, skip_gloo: bool, assume_free_gib: float | None,
                 overrides: list[str] = ()) -> dict:
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
            cfg = load_config(config_path, overrides)
            model = memory_estimate.sizes(cfg)
            est = memory_estimate.estimate(cfg, model=model)
        except (ValueError, OSError) as e:  # ConfigError and EstimateError are ValueErrors
            problems.append(f"Config {config_path}: {e}")
        else:
            report["memory"] = est
            backend = backend_problem(cfg, len(cards))
            if backend:
                problems.append(backend)
            if cards and cfg.training.precision == "bf16" and not all(c["bf16"] for c in cards):
                problems.append("training.precision=bf16 but not every GPU supports bf16; set training.precision=fp16.")
            report["plan"] = _memory_findings(cfg, model, cards, assume_free_gib, problems, advice)
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
        out += ["", f"Memory per GPU holding the whole model ({m['model_type']}, {m['method']}, {m['optimizer']}, batch "
                    f"{m['batch_size']} at {m['resolution']}px; shapes from {m['architecture_source']}):",
                "  parameters: " + ", ".join(f"{k} {n / 1e6:.1f}M" for k, n in p.items())]
        for key, value in m["parts"].items():
            out.append(f"  {key:<28}{value:8.2f} GiB")
        out.append(f"  {'training peak':<28}{m['training']:8.2f} GiB")
        out.append(f"  {'while caching':<28}{m['caching']:8.2f} GiB")
        if not m["activations_known"]:
            out.append("  (activations not estimated for this model: leave room for them)")
    out.append("")
    out += [f"Recommendation: {a}" for a in report["recommendations"]]
    out += [f"PROBLEM: {p}" for p in report["problems"]]
    out.append("Result: " + ("all checks passed." if not report["problems"] else
                             f"{len(report['problems'])} problem(s) found."))
    return "\n".join(out)


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


def main(argv: list[str] | None = None) -> int:
    """Print the report; 0 when every check passed, 1 when a problem was found."""
    args = parse_args(argv)
    if args.plan_for:
        return plan_for(args.config_path, args.plan_for, args.json, args.config_value)
    if args.nnodes > 1:
        if not 0 <= args.node_rank < args.nnodes:
            print(f"error: --node-rank {args.node_rank} is not a node of --nnodes {args.nnodes} (0 to {args.nnodes - 1}).",
                  file=sys.stderr)
            return 2
        result = run_node_check(Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port), args.size_mib)
        print(json.dumps(result, indent=2) if args.json else format_node_check(result), flush=True)
        return 0 if result.get("ok") else 1
    report = build_report(args.config_path, args.skip_gloo, args.assume_free_gib, args.config_value)
    print(json.dumps(report, indent=2) if args.json else format_report(report), flush=True)
    return 1 if report["problems"] else 0
