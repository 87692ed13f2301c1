"""Continuing a run from a backup: which backup and run id, loading it, and where the run then stands.

Three steps, each with only what it needs (`BaseTrainer.maybe_resume` calls them in turn, after the
model is wrapped and the optimizer built):
- `choose`: the backup `--resume` names (or none: a new run with a new id); a collective, decided on
  rank 0 and shared, so every rank continues the same backup.
- `load_trained`: its weights, optimizer state and EMA into this run, whatever layout either holds them
  in: a sharded (DCP) backup reshards into any run; a backup of whole tensors goes through the run's
  parallelism (copied in, or each rank keeping its part under FSDP).
- `restore_progress`: step, epoch, sampler position, LR schedule, loss scaler and this rank's RNG. A run
  with another global batch (another GPU count) counts progress in images: the step reached is rescaled
  so that the end of training and the position on the LR curve stay where they were.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from modules.trainer import backup as backups
from modules.trainer import sharded_backup
from modules.trainer.optim import is_schedule_free, match_param_layouts
from modules.trainer.parallelism import Parallelism
from modules.util import dist_utils as du
from modules.util.rng import set_rng_state

log = logging.getLogger("tandem")


@dataclass(frozen=True)
class TrainedState:
    """What a backup's tensors load into."""
    model: torch.nn.Module
    """The trained module as the parallelism wraps it."""
    optimizer: Any
    ema: Any
    """The run's `EMA`, or None."""
    own: dict[str, torch.Tensor]
    """This run's trained weights by the names a backup of whole tensors uses (`trainable_state()`)."""
    parallelism: Parallelism


@dataclass(frozen=True)
class LoopState:
    """What a backup's plain values are restored into."""
    sampler: Any
    """The `BucketBatchSampler`."""
    optimizer: Any
    lr_schedule: Any
    scaler: torch.amp.GradScaler


@dataclass(frozen=True)
class Position:
    """Where the run stands after the restore."""
    global_step: int
    epoch: int
    step_in_epoch: int


def choose(backups_dir: Path, resume: str | None, given_run_id: str | None) -> tuple[backups.BackupInfo | None, str]:
    """(the backup to continue, or None; this run's id): the backup's run id when continuing one, else the
    id the launcher decided (`given_run_id`, which restarted workers find their backups by) or a new one.
    Every rank calls this; rank 0 removes interrupted backup folders and decides."""
    du.on_main(lambda: backups.remove_interrupted(backups_dir))
    chosen = du.on_main(lambda: backups.find_backup(backups_dir, resume) if resume else None)
    chosen = du.broadcast_object(chosen)
    if chosen is not None and chosen.run_id != backups.LEGACY_RUN:
        return chosen, chosen.run_id
    return chosen, du.broadcast_object(du.on_main(lambda: given_run_id or backups.new_run_id(backups_dir)))


def load_trained(path: Path, into: TrainedState, optimizer_name: str) -> dict:
    """Load a backup's trained weights, optimizer state and EMA into `into`; returns its plain state. A backup
    of another model, training method or optimizer is refused before anything is loaded."""
    if sharded_backup.is_sharded(path):
        state, _ = sharded_backup.load_sharded_backup(path, into.model, into.optimizer, into.ema, optimizer_name)
        return state
    weights, state, _ = backups.read_backup(path)
    missing = sorted(set(into.own) - set(weights))
    if missing:
        raise ValueError(f"the backup does not match this model/training method (missing {missing[:3]}...); "
                         "start fresh or use the config the backup was made with.")
    backups.check_optimizer(state, optimizer_name)
    into.parallelism.load_whole_backup(into.model, into.optimizer, into.ema, into.own, weights, state)
    return state


def restore_progress(state: dict, loop: LoopState, global_batch: int, fresh_base_lrs: list[float]) -> Position:
    """Sampler position, schedule, loss scaler and this rank's RNG from a backup's `progress_state`; the
    step rescaled to this run's `global_batch`, with this run's (scaled) learning rates `fresh_base_lrs`."""
    loop.sampler.load_state_dict(state["sampler"])  # regroups the epoch's rest if the global batch changed
    match_param_layouts(loop.optimizer)  # a backup from a run with another training.channels_last
    if is_schedule_free(loop.optimizer):
        loop.optimizer.train()  # a no-op for Tandem's backups (taken in train mode); converts any other
    loop.lr_schedule.load_state_dict(state["lr_schedule"])
    step = _adapt_to_global_batch(state, loop, global_batch, fresh_base_lrs)
    loop.scaler.load_state_dict(state["scaler"])
    rngs = state["rng"]
    if du.rank() < len(rngs):
        set_rng_state(rngs[du.rank()])
    return Position(step, state["epoch"], state["step_in_epoch"])


def backup_global_batch(state: dict) -> int:
    """The global batch (per optimizer step) the backup was trained with."""
    return state["sampler"]["global_batch_size"] * state.get("accumulation", 1)


def _adapt_to_global_batch(state: dict, loop: LoopState, global_batch: int, fresh_base_lrs: list[float]) -> int:
    """The step this run continues from, and this run's LRs on the schedule at that step.

    Steps are counted in global batches, so with another global batch the step reached is rescaled to the
    same number of images, which keeps the end of training and the position on the LR curve where they were.
    """
    step = state["global_step"]
    old_global = backup_global_batch(state)
    if old_global != global_batch:
        step = state["global_step"] * old_global // global_batch
        log.warning("Global batch changed from %d to %d: step %d continues as step %d (same images seen).",
                    old_global, global_batch, state["global_step"], step)
        loop.lr_schedule.last_epoch = step
    schedule = loop.lr_schedule
    schedule.base_lrs = list(fresh_base_lrs)
    for group, base, lr in zip(loop.optimizer.param_groups, fresh_base_lrs,
                               [b * schedule.lr_lambdas[0](schedule.last_epoch) for b in fresh_base_lrs]):
        group["initial_lr"], group["lr"] = base, lr
    return step
