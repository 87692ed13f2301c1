"""`multi_gpu.batch_split`: how many samples of each global micro-batch each rank trains.

`decide_split` reads the setting (`equal`, a list of this machine's sizes, or `auto`) and, for `auto`,
has each rank measure what it can carry; then all agree on one split.

At start-up, before the model is wrapped for DDP (so nothing is synchronised), every rank runs a few
forward and backward passes of its model on a real sample of the dataset: once with one sample and
once with two. The time per sample and the memory one more sample takes (the caching allocator's peak
on a GPU; on CPU processes the bytes autograd keeps for the backward) give a `RankCapacity`; the free
memory left for activations is the device's free memory minus what training will still allocate
(gradients, optimizer state, EMA) and a margin. Every rank gathers every rank's capacity and computes
the same split with `choose_split`.

`TANDEM_SIMULATE_SAMPLE_ROOM` (e.g. `3,1`) replaces the measured room by that many samples per rank:
to try an uneven split on one machine, and for the tests. `TANDEM_SIMULATE_SAMPLE_SECONDS` (e.g. `0.01,0.03`)
replaces the measured time per sample the same way: CPU processes sharing a loaded machine measure
speeds that differ by chance, and a test of the room alone must not depend on them. `TANDEM_CUDA_MEMORY_FRACTION` (e.g. `1,0.25`)
caps each GPU's memory for this run (`torch.cuda.set_per_process_memory_fraction`), so that one card
stands in for a smaller one: the probe counts the cap as the card's size.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch

from modules.util import dist_utils as du
from modules.util.batch_slice import (BatchSlice, RankCapacity, SplitDoesNotFit, choose_split, describe_split,
                                      equal_split, parse_split)

log = logging.getLogger("tandem")

SIMULATE_ROOM = "TANDEM_SIMULATE_SAMPLE_ROOM"
SIMULATE_SECONDS = "TANDEM_SIMULATE_SAMPLE_SECONDS"
MEMORY_FRACTION = "TANDEM_CUDA_MEMORY_FRACTION"
MEMORY_MARGIN = 0.9
"""Of the memory free after training's own allocations, the part the split may fill with activations."""
TRAINING_STATE_BYTES_PER_PARAMETER = {"adamw": 12, "adamw_8bit": 6, "adafactor": 8, "sgd": 8}
"""Bytes per trained parameter that training allocates after the probe: the fp32 gradient, plus the
optimizer's state (AdamW: two fp32 moments)."""


LossOf = Callable[[dict, BatchSlice], torch.Tensor]
"""`loss_of(batch, part)`: the training loss of `batch` as the part `part` of its global micro-batch,
through the unwrapped training model (nothing synchronised)."""


def decide_split(setting: str, batch: int, world: int, holds_whole_model: bool, device_names: Callable[[], list[str]],
                 measure: Callable[[], RankCapacity], planned_split: list[int] | None = None) -> list[int]:
    """The samples of each global micro-batch per rank: `setting` is `multi_gpu.batch_split`, `batch`
    `training.batch_size`, `world` the number of slices each global micro-batch is cut into.
    `device_names()` names every rank's device for messages and `measure()` is this rank's probe (both
    collectives, called on every rank alike). A parallelism that does not hold the whole model on each rank
    cannot be probed with it: `auto` then takes the memory plan's split by the cards' room (`planned_split`),
    or gives equal batches."""
    if not holds_whole_model and setting.strip().lower() == "auto":
        if planned_split:  # the memory plan split it by the cards' room (`modules/planning/memory_plan.py`)
            log.info("Batch split (auto, from the memory plan): %s.", describe_split(planned_split, device_names()))
            return list(planned_split)
        # The probe trains the whole model on each GPU, which a sharded run may not fit on one.
        log.info("Batch split: equal (multi_gpu.batch_split auto measures each GPU with the whole model, "
                 "which FSDP does not hold on one GPU; give an explicit split such as 6,2 for unequal GPUs).")
        return equal_split(batch, world)
    # batch_split is per machine, like device_indexes: a list names this machine's GPUs only.
    choice = parse_split(setting, du.local_world_size(), batch)
    if world == 1:
        return equal_split(batch, world)
    if du.local_world_size() != world:
        choice = _split_of_all_machines(choice, batch)
    if choice is None:
        return equal_split(batch, world)
    if choice != "auto":
        log.info("Batch split: %s.", describe_split(choice, device_names()))
        return choice
    everyone = du.all_gather_objects(measure())
    try:
        split = choose_split(batch * world, everyone)
    except SplitDoesNotFit as e:
        raise RuntimeError(f"multi_gpu.batch_split auto: {e}. Lower training.batch_size (and raise "
                           "training.gradient_accumulation_steps to keep the global batch), or turn on "
                           "training.gradient_checkpointing.") from None
    names = device_names()
    details = "; ".join(f"{name}: {1000 * c.seconds_per_sample:.1f} ms/sample, room for "
                        f"{c.most_samples() if c.most_samples() is not None else 'any number of'} samples"
                        for name, c in zip(names, everyone))
    log.info("Batch split (auto, measured): %s (%s).", describe_split(split, names), details)
    slowest, fastest = max(c.seconds_per_sample for c in everyone), min(c.seconds_per_sample for c in everyone)
    if slowest > 1.5 * fastest:
        log.warning("One GPU is %.1fx slower than the fastest: the split gives it fewer samples, but every step "
                    "still waits for it.", slowest / fastest)
    return split


def _split_of_all_machines(mine: list[int] | str | None, batch: int) -> list[int] | str | None:
    """Several machines: every rank's size from its own machine's `batch_split` (global ranks follow
    machines, node 0's processes first); `auto` only when every machine chose it."""
    sizes = du.all_gather_objects("auto" if mine == "auto" else mine[du.local_rank()] if mine else batch)
    if "auto" in sizes:
        if any(size != "auto" for size in sizes):
            raise RuntimeError("multi_gpu.batch_split is auto on some machines and not on others: the "
                               "measurement is made by every GPU together. Set auto on every machine, or "
                               "equal / a list of this machine's sizes on each.")
        return "auto"
    return None if all(size == batch for size in sizes) else sizes


def _one_pass(sample: dict, n: int, loss_of: LossOf, trainable: list[torch.nn.Parameter],
              device: torch.device) -> tuple[float, int]:
    """Seconds and activation bytes of a forward and backward pass on `n` copies of `sample`."""
    from modules.data.dataset import collate

    batch = collate([sample] * n)
    saved = [0]

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    started = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_of(batch, BatchSlice(0, n, n))  # the whole batch is this rank's: no other rank's share
    loss.backward()
    if cuda:
        torch.cuda.synchronize(device)
        used = torch.cuda.max_memory_allocated(device) - before
    else:
        used = saved[0]
    seconds = time.perf_counter() - started
    for p in trainable:
        p.grad = None
    return seconds, used


def free_for_tensors(device_free: int, device_total: int, reserved: int, allocated: int, fraction: float) -> float:
    """Bytes this process may still allocate: what the device has free plus what the caching allocator holds
    unused, within the share of the card the process is allowed (`set_per_process_memory_fraction`)."""
    within_cap = fraction * device_total - reserved
    return max(0.0, min(device_free, within_cap) + reserved - allocated)


def cap_device_memory(device: torch.device) -> None:
    """Apply `TANDEM_CUDA_MEMORY_FRACTION` (one fraction per GPU index) to this process's GPU."""
    fractions = os.environ.get(MEMORY_FRACTION)
    if not fractions or device.type != "cuda":
        return
    values = [float(x) for x in fractions.split(",")]
    index = du.gpu_number(device)
    if index >= len(values):
        raise ValueError(f"{MEMORY_FRACTION}={fractions!r} names {len(values)} GPU(s); GPU {index} has none")
    torch.cuda.set_per_process_memory_fraction(values[index], device)
    log.info("GPU %d capped at %.0f%% of its memory (%s)", index, 100 * values[index], MEMORY_FRACTION)


def _simulated(variable: str) -> float | None:
    """This rank's entry of a per-rank list in environment variable `variable`, if it is set."""
    value = os.environ.get(variable)
    if not value:
        return None
    entries = [float(x) for x in value.split(",")]
    rank = int(os.environ.get("RANK", "0"))
    if rank >= len(entries):
        raise ValueError(f"{variable}={value!r} names {len(entries)} rank(s); rank {rank} has none")
    return entries[rank]


def measure_capacity(sample: dict, loss_of: LossOf, trainable: list[torch.nn.Parameter], device: torch.device,
                     optimizer_name: str, ema: bool) -> RankCapacity:
    """What this rank can carry (see the module's docstring): `sample` is an item of the dataset, `trainable`
    the trained parameters (before wrapping), `optimizer_name` and `ema` what training allocates later."""
    _one_pass(sample, 1, loss_of, trainable, device)  # warm-up: kernel selection, first allocations
    one_s, one_bytes = _one_pass(sample, 1, loss_of, trainable, device)
    two_s, two_bytes = _one_pass(sample, 2, loss_of, trainable, device)
    per_sample_bytes = max(two_bytes - one_bytes, one_bytes // 2, 1)
    seconds_per_sample = max(two_s / 2, 1e-6)
    simulated_seconds = _simulated(SIMULATE_SECONDS)
    if simulated_seconds is not None:
        seconds_per_sample = simulated_seconds
    simulated_room = _simulated(SIMULATE_ROOM)
    if simulated_room is not None:
        return RankCapacity(free_bytes=simulated_room * per_sample_bytes, bytes_per_sample=per_sample_bytes,
                            seconds_per_sample=seconds_per_sample)
    if device.type != "cuda":
        return RankCapacity(float("inf"), per_sample_bytes, seconds_per_sample)
    free, total = torch.cuda.mem_get_info(device)
    free = free_for_tensors(free, total, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device),
                            torch.cuda.get_per_process_memory_fraction(device))
    trained = sum(p.numel() for p in trainable)
    later = trained * TRAINING_STATE_BYTES_PER_PARAMETER.get(optimizer_name, 12)
    later += trained * 4 if ema else 0
    return RankCapacity(free_bytes=max(0.0, (free - later) * MEMORY_MARGIN), bytes_per_sample=per_sample_bytes,
                        seconds_per_sample=seconds_per_sample)
