"""Bucket-aware distributed batch sampler that resumes mid-epoch, also with another world size.

The unit is the GLOBAL batch: `batch_size x world_size` item indexes from one bucket. Rank r takes
the r-th contiguous slice of it (with `split`, unequal GPUs take unequal slices of the same global
batch: `split[r]` items starting after those of the ranks before it). The sequence of global batches depends only on the seed, the
epoch, the global batch size and the buckets, so 2 ranks x batch B see exactly what 1 rank x
batch 2B sees.

Epoch plan: each bucket's items are shuffled (seeded by seed and epoch only, so the per-bucket
order does not depend on the batch size), cut into global batches, and the batches are shuffled.
With item `groups` (training and regularisation items, `roles.py`), each group of a bucket is shuffled
on its own and the groups are interleaved in proportion to their sizes before the cut, so that every
global batch holds them in the bucket's proportion (half and half when the bucket holds as many of each).
Remainder rule: the last `len(bucket) % global_batch` items of each bucket's shuffled order are
left out of this epoch; the order reshuffles every epoch, so it is other items each time.

Position: the sampler does NOT count batches it hands out, because a prefetching DataLoader pulls
batches ahead of training. The trainer tells it with `mark_consumed(n)` once n global batches
have been trained on (per optimizer step: n = gradient accumulation steps), and `state_dict()`
then describes exactly the trained position. A new `__iter__` starts after the consumed batches.

Resume with another global batch size: the batches consumed so far are replayed from the saved
history, their items removed, and the rest of the epoch is regrouped into the new global batch
size (remainder rule per bucket again). No item consumed in this epoch comes back in it.
"""
from __future__ import annotations

import hashlib
import logging
import random
from collections import Counter

from modules.util.batch_slice import equal_split

log = logging.getLogger(__name__)


def full_global_batches(bucket_sizes, global_batch: int) -> int:
    """How many global batches of `global_batch` items an epoch gives from buckets of `bucket_sizes` items: each
    batch is cut from one bucket, and a bucket's remainder is left out. The sampler's length, and what the
    check before training (`modules/preflight.check_data`) compares with the batches one step takes."""
    return sum(size // global_batch for size in bucket_sizes)


def _rng(*parts) -> random.Random:
    # String seeds go through sha512 in CPython, so streams are identical across processes and runs.
    return random.Random(":".join(str(p) for p in parts))


class BucketBatchSampler:
    """Yields this rank's list of dataset indexes for every global batch of the epoch."""

    def __init__(self, buckets: list[int], batch_size: int, world_size: int = 1, rank: int = 0,
                 seed: int = 0, shuffle: bool = True, split: list[int] | None = None,
                 groups: list[int] | None = None):
        """`split`: each rank's number of items per global batch (unequal GPUs); default `batch_size` each.
        `groups`: each item's group (0 training, 1 regularisation), mixed evenly into the global batches."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}; it must be 1 or more.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside 0..{world_size - 1} (world_size={world_size}).")
        self.split = list(split) if split is not None else equal_split(batch_size, world_size)
        if len(self.split) != world_size or min(self.split) < 1:
            raise ValueError(f"split={split} needs one size of 1 or more per rank ({world_size} ranks).")
        self.buckets = list(buckets)
        self.groups = list(groups) if groups is not None else None
        if self.groups is not None and len(self.groups) != len(self.buckets):
            raise ValueError(f"groups has {len(self.groups)} entries for {len(self.buckets)} items.")
        self.batch_size = self.split[rank]
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self._history: list[tuple[int, int]] = []
        """Earlier segments of this epoch as (global batch size, batches consumed)."""
        self._consumed = 0
        """Batches consumed in the current segment (which uses this run's global batch size)."""
        self._plan_memo: tuple | None = None
        self._members: dict[int, list[int]] = {}
        for index, bucket in enumerate(self.buckets):
            self._members.setdefault(bucket, []).append(index)
        if len(self) == 0:
            sizes = ", ".join(f"bucket {b}: {len(m)}" for b, m in sorted(self._members.items()))
            raise ValueError(
                f"The dataset gives no full global batch: {len(self.buckets)} items ({sizes}), global batch "
                f"= {' + '.join(map(str, self.split))} over {world_size} rank(s) = {self.global_batch_size}; every bucket "
                f"is smaller than that. {'Use fewer GPUs, a' if world_size > 1 else 'Use a'} smaller "
                "training.batch_size, more concept repeats or more images (or turn off data.aspect_bucketing to put "
                "all images in one bucket).")

    @property
    def global_batch_size(self) -> int:
        return sum(self.split)

    def __len__(self) -> int:
        """Global batches in a full epoch at this global batch size."""
        return full_global_batches((len(m) for m in self._members.values()), self.global_batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order (identical on every rank). A new epoch starts at its beginning;
        the epoch already set (e.g. by `load_state_dict`) keeps its position."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._history = []
            self._consumed = 0

    def mark_consumed(self, num_global_batches: int = 1) -> None:
        """Called by the trainer after training on `num_global_batches` more global batches."""
        if num_global_batches < 0:
            raise ValueError(f"num_global_batches={num_global_batches} must not be negative.")
        remaining = self.batches_remaining()
        if num_global_batches > remaining:
            raise ValueError(f"mark_consumed({num_global_batches}) but only {remaining} batches are left "
                             f"in epoch {self.epoch}; call set_epoch() when a new epoch starts.")
        self._consumed += num_global_batches

    @property
    def consumed_batches(self) -> int:
        """Global batches of the current global batch size consumed in this epoch."""
        return self._consumed

    def batches_remaining(self) -> int:
        return len(self._current_plan()) - self._consumed

    def global_batches(self) -> list[list[int]]:
        """The remaining global batches of this epoch, from the current position."""
        return self._current_plan()[self._consumed:]

    def __iter__(self):
        start = sum(self.split[:self.rank])
        stop = start + self.split[self.rank]
        for batch in self.global_batches():
            yield batch[start:stop]

    # -- epoch plan ---------------------------------------------------------------------------

    def _bucket_orders(self) -> dict[int, list[int]]:
        orders = {}
        for bucket, members in sorted(self._members.items()):
            if self.groups is not None:
                orders[bucket] = self._interleaved(bucket, members)
                continue
            order = list(members)
            if self.shuffle:
                _rng(self.seed, self.epoch, "bucket", bucket).shuffle(order)
            orders[bucket] = order
        return orders

    def _interleaved(self, bucket: int, members: list[int]) -> list[int]:
        """The bucket's groups, each shuffled on its own, merged in proportion: item k of a group of n sits
        at (k + 0.5) / n of the way through, so any run of consecutive items holds the groups' proportion."""
        by_group: dict[int, list[int]] = {}
        for index in members:
            by_group.setdefault(self.groups[index], []).append(index)
        placed = []
        for group, order in sorted(by_group.items()):
            if self.shuffle:
                _rng(self.seed, self.epoch, "bucket", bucket, "group", group).shuffle(order)
            placed += [((k + 0.5) / len(order), group, index) for k, index in enumerate(order)]
        return [index for _, _, index in sorted(placed)]

    def _plan(self, orders: dict[int, list[int]], global_batch: int, segment: int) -> list[list[int]]:
        batches = []
        for order in orders.values():
            usable = len(order) // global_batch * global_batch
            batches.extend(order[i:i + global_batch] for i in range(0, usable, global_batch))
        if self.shuffle:
            _rng(self.seed, self.epoch, "batches", segment).shuffle(batches)
        return batches

    def _current_plan(self) -> list[list[int]]:
        # Memoised: the trainer asks for the position every step, the plan only changes with these.
        key = (self.epoch, self.seed, self.shuffle, self.global_batch_size, tuple(self._history))
        if self._plan_memo is None or self._plan_memo[0] != key:
            self._plan_memo = (key, self._build_plan())
        return self._plan_memo[1]

    def _build_plan(self) -> list[list[int]]:
        orders = self._bucket_orders()
        for segment, (global_batch, consumed) in enumerate(self._history):
            used = {i for batch in self._plan(orders, global_batch, segment)[:consumed] for i in batch}
            orders = {b: [i for i in order if i not in used] for b, order in orders.items()}
        return self._plan(orders, self.global_batch_size, len(self._history))

    # -- resume -------------------------------------------------------------------------------

    def _buckets_digest(self) -> str:
        text = ",".join(map(str, self.buckets))
        if self.groups is not None:  # without groups the digest is what it always was (older backups match)
            text += ";groups:" + ",".join(map(str, self.groups))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "seed": self.seed, "shuffle": self.shuffle,
                "consumed_batches": self._consumed, "global_batch_size": self.global_batch_size,
                "history": [list(h) for h in self._history], "buckets_digest": self._buckets_digest()}

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` was taken; the saved seed wins (the consumed items depend on it)."""
        self.epoch = int(state["epoch"])
        self.seed = int(state["seed"])
        self.shuffle = bool(state.get("shuffle", True))
        self._history, self._consumed = [], 0
        if state.get("buckets_digest") != self._buckets_digest():
            log.warning("The dataset changed since the backup was written (other images or buckets); "
                        "epoch %d restarts from its beginning.", self.epoch)
            return
        history = [(int(g), int(c)) for g, c in state.get("history", [])]
        consumed, saved_global = int(state["consumed_batches"]), int(state["global_batch_size"])
        if saved_global == self.global_batch_size:
            self._history, self._consumed = history, consumed
        else:
            # Another global batch size: freeze what was consumed and regroup the rest.
            self._history = history + ([(saved_global, consumed)] if consumed else [])
            if consumed:
                log.info("Global batch size changed from %d to %d: the remaining items of epoch %d are "
                         "regrouped.", saved_global, self.global_batch_size, self.epoch)

    def describe(self) -> str:
        """One start-up line with the derived numbers."""
        sizes = Counter(self.buckets)
        per_rank = f"{self.split[0]} x {self.world_size} ranks" if len(set(self.split)) == 1 \
            else " + ".join(map(str, self.split))
        return (f"{len(self.buckets)} items in {len(sizes)} bucket(s), global batch {self.global_batch_size} "
                f"({per_rank}), {len(self)} batches per epoch, "
                f"{len(self.buckets) - len(self) * self.global_batch_size} items left out per epoch")
