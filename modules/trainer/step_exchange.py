"""Each step's loss and commands, shared over ranks without making the CPU wait for the GPU.

Reading a step's loss right away (`loss.item()`) stops the CPU until the GPU has finished that step,
so the next step cannot be queued meanwhile and the GPU idles while Python prepares it; on N GPUs the
slowest rank's pause each step becomes everyone's. Instead each step *sends* its loss and the commands
this rank saw (one all-reduce queued on the GPU, then a copy into pinned memory), and the next step
*receives* that result, which the GPU finished long before. Every rank receives the same reduced values
at the same step, so a command still acts on one step everywhere: the step after the one it was sent with.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from modules.distributed import dist_utils as du
from modules.trainer.commands import COMMANDS


@dataclass
class StepReport:
    step: int
    epoch: int  # 0-based, the epoch the step belongs to
    loss: float  # mean over ranks
    lr: float
    commands: set[str]  # union over ranks


class StepExchange:
    def __init__(self) -> None:
        self._pending: tuple[int, int, float, torch.Tensor, torch.cuda.Event | None] | None = None

    def send(self, step: int, epoch: int, loss: torch.Tensor, lr: float, commands: set[str]) -> None:
        if self._pending is not None:
            raise RuntimeError("StepExchange.send called twice without receive: a step's report would be lost")
        on_gpu = loss.is_cuda
        flags = torch.tensor([float(c in commands) for c in COMMANDS], pin_memory=on_gpu)
        values = torch.cat([loss.detach().float().reshape(1), flags.to(loss.device, non_blocking=True)])
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
        commands = {c for c, v in zip(COMMANDS, values[1:]) if v > 0}
        return StepReport(step, epoch, values[0] / du.world_size(), lr, commands)
