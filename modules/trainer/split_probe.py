"""`multi_gpu.batch_split = auto`: each rank measures what it can carry, then all agree on one split.

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

import torch

from modules.util import dist_utils as du
from modules.util.batch_slice import RankCapacity

log = logging.getLogger("tandem")

SIMULATE_ROOM = "TANDEM_SIMULATE_SAMPLE_ROOM"
SIMULATE_SECONDS = "TANDEM_SIMULATE_SAMPLE_SECONDS"
MEMORY_FRACTION = "TANDEM_CUDA_MEMORY_FRACTION"
MEMORY_MARGIN = 0.9
"""Of the memory free after training's own allocations, the part the split may fill with activations."""
TRAINING_STATE_BYTES_PER_PARAMETER = {"adamw": 12, "adamw_8bit": 6, "adafactor": 8, "sgd": 8}
"""Bytes per trained parameter that training allocates after the probe: the fp32 gradient, plus the
optimizer's state (AdamW: two fp32 moments)."""


def _one_pass(trainer, sample: dict, n: int, model) -> tuple[float, int]:
    """Seconds and activation bytes of a forward and backward pass on `n` copies of `sample`."""
    from modules.data.dataset import collate
    from modules.util.batch_slice import BatchSlice

    batch = collate([sample] * n)
    saved = [0]

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(trainer.device)
        torch.cuda.reset_peak_memory_stats(trainer.device)
        before = torch.cuda.memory_allocated(trainer.device)
    started = time.perf_counter()
    previous_part = trainer.batch_part
    trainer.batch_part = BatchSlice(0, n, n)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = trainer.compute_loss(batch, micro=0, model=model)
        loss.backward()
    finally:
        trainer.batch_part = previous_part
    if cuda:
        torch.cuda.synchronize(trainer.device)
        used = torch.cuda.max_memory_allocated(trainer.device) - before
    else:
        used = saved[0]
    seconds = time.perf_counter() - started
    for p in trainer.trainable_params():
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


def measure_capacity(trainer, model) -> RankCapacity:
    """What this rank can carry: see the module's docstring. `model` is the unwrapped training model."""
    sample = trainer.dataset[0]
    _one_pass(trainer, sample, 1, model)  # warm-up: kernel selection, first allocations
    one_s, one_bytes = _one_pass(trainer, sample, 1, model)
    two_s, two_bytes = _one_pass(trainer, sample, 2, model)
    per_sample_bytes = max(two_bytes - one_bytes, one_bytes // 2, 1)
    seconds_per_sample = max(two_s / 2, 1e-6)
    simulated_seconds = _simulated(SIMULATE_SECONDS)
    if simulated_seconds is not None:
        seconds_per_sample = simulated_seconds
    simulated_room = _simulated(SIMULATE_ROOM)
    if simulated_room is not None:
        return RankCapacity(free_bytes=simulated_room * per_sample_bytes, bytes_per_sample=per_sample_bytes,
                            seconds_per_sample=seconds_per_sample)
    if trainer.device.type != "cuda":
        return RankCapacity(float("inf"), per_sample_bytes, seconds_per_sample)
    free, total = torch.cuda.mem_get_info(trainer.device)
    free = free_for_tensors(free, total, torch.cuda.memory_reserved(trainer.device),
                            torch.cuda.memory_allocated(trainer.device),
                            torch.cuda.get_per_process_memory_fraction(trainer.device))
    trained = sum(p.numel() for p in trainer.trainable_params())
    later = trained * TRAINING_STATE_BYTES_PER_PARAMETER.get(trainer.cfg.optimizer.name, 12)
    later += trained * 4 if trainer.cfg.training.ema else 0
    return RankCapacity(free_bytes=max(0.0, (free - later) * MEMORY_MARGIN), bytes_per_sample=per_sample_bytes,
                        seconds_per_sample=seconds_per_sample)
