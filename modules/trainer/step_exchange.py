"""Each step's loss and commands, shared over ranks without making the CPU wait for the GPU.

Reading a step's loss right away (`loss.item()`) stops the CPU until the GPU has finished that step,
so the next step cannot be queued meanwhile and the GPU idles while Python prepares it; on N GPUs the
slowest rank's pause each step becomes everyone's. Instead each step *sends* its loss and the commands
this rank saw (one all-reduce queued on the GPU, then a copy into pinned memory), and the next step
*receives* that result, which the GPU finished long before. Every rank receives the same reduced values
at the same step, so a command still acts on one step everywhere: the step after the one it was sent with.

The same all-reduce carries each rank's own loss and step time in that rank's slot (zeros elsewhere), so
every rank's numbers reach rank 0, which reports them, for the price of 2 x world-size more floats.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from modules.util import dist_utils as du
from modules.trainer.commands import COMMANDS


@dataclass
class StepReport:
    step: int
    epoch: int  # 0-based, the epoch the step belongs to
    loss: float  # mean over ranks
    lr: float
    commands: set[str]  # union over ranks
    rank_losses: list[float] = field(default_factory=list)  # each rank's own loss, by rank
    rank_step_s: list[float] = field(default_factory=list)
    """Each rank's wall-clock seconds since its previous step was sent (0 for its first)."""


class StepExchange:
    def __init__(self) -> None:
        self._pending: tuple[int, int, float, torch.Tensor, torch.cuda.Event | None] | None = None
        self._last_send: float | None = None

    def send(self, step: int, epoch: int, loss: torch.Tensor, lr: float, commands: set[str],
             weight: float = 1.0) -> None:
        """`weight`: this rank's share of the global batch times the world size (1 with equal GPUs), so that
        the reported mean is the mean over the global batch; the per-rank slot keeps the rank's own loss."""
        if self._pending is not None:
            raise RuntimeError("StepExchange.send called twice without receive: a step's report would be lost")
        now = time.perf_counter()
        step_s = now - self._last_send if self._last_send is not None else 0.0
        self._last_send = now
        on_gpu = loss.is_cuda
        world, rank = du.world_size(), du.rank()
        # [loss, commands..., step seconds by rank...] built on the host; each rank fills only its slot.
        host = torch.zeros(1 + len(COMMANDS) + world, pin_memory=on_gpu)
        host[1:1 + len(COMMANDS)] = torch.tensor([float(c in commands) for c in COMMANDS])
        host[1 + len(COMMANDS) + rank] = step_s
        loss = loss.detach().float().reshape(1)
        rank_losses = torch.zeros(world, device=loss.device)
        rank_losses[rank] = loss[0]  # assigned, not multiplied by a one-hot: a NaN stays in its own slot
        values = torch.cat([host.to(loss.device, non_blocking=True), rank_losses])
        values[0] = loss[0] * weight
        values = du.all_reduce_sum_tensor(values)
        event = None
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            values = host
        self._pending = (step, epoch, lr, values, event)

    def receive(self) -> StepReport | None:
        """The last sent step's report (waits for its GPU work only), or None if nothing is pending."""
        if self._pending is None:
            return None
        step, epoch, lr, host, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        values = host.tolist()
        world, times = du.world_size(), 1 + len(COMMANDS)  # where the per-rank step times start
        commands = {c for c, v in zip(COMMANDS, values[1:times]) if v > 0}
        return StepReport(step, epoch, values[0] / world, lr, commands, rank_losses=values[times + world:],
                          rank_step_s=values[times:times + world])
