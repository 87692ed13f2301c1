"""Where a rank's samples sit in the global batch, and how a global batch is split over unequal GPUs.

The global (micro-)batch is one list of samples; rank r trains the contiguous part
`[offset, offset + size)` of it. With equal GPUs every part has `training.batch_size` samples; with
`multi_gpu.batch_split` they differ (a 24 GB card beside a 12 GB one), but the global batch, the noise
each sample gets and the gradient (the mean over the whole global batch) stay what one big GPU would
train, because everything random is drawn for the global batch and each rank's loss is weighted by
its share.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSlice:
    offset: int
    """Index of this rank's first sample in the global batch."""
    size: int
    """Samples this rank trains per micro-batch."""
    total: int
    """Samples in the global micro-batch (all ranks)."""

    @staticmethod
    def of(split: list[int], rank: int) -> "BatchSlice":
        return BatchSlice(sum(split[:rank]), split[rank], sum(split))

    def loss_weight(self, world_size: int) -> float:
        """Factor on this rank's mean loss so that DDP's average over ranks is the mean over the global batch."""
        return self.size * world_size / self.total


def equal_split(batch_size: int, world_size: int) -> list[int]:
    return [batch_size] * world_size


def parse_split(text: str, world_size: int, batch_size: int) -> list[int] | str | None:
    """`equal` -> None, `auto` -> "auto", `6,2` -> [6, 2]; raises ValueError with the reason and the fix."""
    text = text.strip().lower()
    if text in ("", "equal"):
        return None
    if text == "auto":
        return "auto"
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{text!r} is not equal, auto or a comma-separated list of per-GPU batch sizes "
                         "such as 6,2") from None
    if any(size < 1 for size in sizes):
        raise ValueError(f"{text!r}: every GPU needs at least 1 sample per batch")
    if len(sizes) != world_size:
        raise ValueError(f"{text!r} gives {len(sizes)} batch size(s) for {world_size} GPU(s); give one per GPU")
    if sum(sizes) != batch_size * world_size:
        raise ValueError(f"{text!r} adds up to {sum(sizes)}, but the global batch is training.batch_size "
                         f"{batch_size} x {world_size} GPUs = {batch_size * world_size}; the split only moves "
                         "samples between GPUs, so the sizes must add up to that")
    return sizes


@dataclass(frozen=True)
class RankCapacity:
    """What one rank measured at start-up (see modules/trainer/split_probe.py)."""

    free_bytes: float
    """Device memory it may still fill (`inf` where it is not limited, e.g. CPU processes)."""
    bytes_per_sample: float
    """Extra memory one more sample per micro-batch takes (activations)."""
    seconds_per_sample: float
    """Time a forward and backward pass takes per sample."""

    def most_samples(self) -> int | None:
        if self.free_bytes == float("inf") or self.bytes_per_sample <= 0:
            return None
        return int(self.free_bytes // self.bytes_per_sample)


class SplitDoesNotFit(ValueError):
    pass


def choose_split(total: int, ranks: list[RankCapacity]) -> list[int]:
    """Per-rank batch sizes adding up to `total` that finish a step soonest: each sample in turn goes to the
    rank that would finish its part first with it, among the ranks with memory left for it. Every rank
    gets at least one sample."""
    if total < len(ranks):
        raise SplitDoesNotFit(f"a global batch of {total} cannot give each of {len(ranks)} GPUs a sample")
    caps = [r.most_samples() for r in ranks]
    for rank, cap in enumerate(caps):
        if cap is not None and cap < 1:
            raise SplitDoesNotFit(f"GPU {rank} has no memory left for even one sample")
    sizes = [1] * len(ranks)
    for _ in range(total - len(ranks)):
        open_ranks = [r for r in range(len(ranks)) if caps[r] is None or sizes[r] < caps[r]]
        if not open_ranks:
            room = ", ".join(f"GPU {r}: {c}" for r, c in enumerate(caps))
            raise SplitDoesNotFit(f"the global batch of {total} does not fit: the GPUs hold at most {room} "
                                  "samples per micro-batch")
        best = min(open_ranks, key=lambda r: ((sizes[r] + 1) * ranks[r].seconds_per_sample, r))
        sizes[best] += 1
    return sizes


def describe_split(sizes: list[int], devices: list[str] | None = None) -> str:
    """`global batch 8 = 6 on GPU 0 + 2 on GPU 1`."""
    names = devices or [f"GPU {r}" for r in range(len(sizes))]
    return f"global batch {sum(sizes)} = " + " + ".join(f"{s} on {n}" for s, n in zip(sizes, names))
