"""Writing a run's backups whole, in the background: one process or DDP, where rank 0 holds every weight.

At the step, rank 0 copies the state to host memory (queued on the GPU, see modules/util/host_copy.py)
and hands it to a writer thread, which writes it while training goes on. One backup is in flight at a
time: the next one first waits for it, and the end of the run waits for the last (`wait`). Sharded
training writes its backups otherwise (every rank its shards: `modules/distributed/fsdp.py`); both
serve `OutputWriter` through the same calls (`take`, `finished`, `wait`, `release_host_memory`, `close`,
`last_written`).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from modules.trainer import backup as backups
from modules.util import dist_utils as du
from modules.util.host_copy import HostSnapshot, pinned_alloc_seconds, release_pinned_pool, snapshot_to_host

log = logging.getLogger("tandem")


class BackupWriter:
    """Writes backups on one background thread, one at a time, and reports those that are done."""

    def __init__(self, backups_dir: Path, run_id: str, keep: int) -> None:
        self.backups_dir = Path(backups_dir)
        self.run_id = run_id
        self.keep = keep
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="backup-writer")
        self._pending: tuple[int, Future] | None = None
        self.last_written: Path | None = None

    def submit(self, step: int, weights: HostSnapshot, state: HostSnapshot, manifest: dict) -> list[tuple[int, Path]]:
        """Queue a backup; first waits for the one in flight (returned, with any other finished one)."""
        done = self.wait()

        def write() -> Path:
            return backups.write_backup(self.backups_dir, self.run_id, step, weights.ready(), state.ready(),
                                        manifest, self.keep)

        self._pending = (step, self._executor.submit(write))
        return done

    def finished(self) -> list[tuple[int, Path]]:
        """(step, path) of the backup that finished since the last call, if any; raises if its write failed."""
        if self._pending is None or not self._pending[1].done():
            return []
        return self.wait()

    def wait(self) -> list[tuple[int, Path]]:
        """Wait for the backup in flight; raises if its write failed."""
        if self._pending is None:
            return []
        step, future = self._pending
        self._pending = None
        path = future.result()
        self.last_written = path
        return [(step, path)]

    def release_host_memory(self) -> None:
        """Once the backup in flight is written, give its pinned host memory back (see
        host_copy.release_pinned_pool), on the writer's thread, so the run goes on meanwhile."""
        def release() -> None:
            started = time.perf_counter()
            try:
                released = release_pinned_pool()
            except Exception as error:  # the exit frees the memory all the same
                log.warning("Could not release the backups' pinned host memory early: %s", error)
                return
            if released:
                log.info("Released the backups' %.1f GB of pinned host memory in %.2f s (in the background).",
                         released / 1e9, time.perf_counter() - started)

        self._executor.submit(release)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)


class BackgroundBackups:
    """Rank 0's backups of whole tensors on its writer thread; the other ranks only contribute their RNG."""

    def __init__(self, backups_dir: Path, run_id: str, keep: int) -> None:
        # Only rank 0 writes, so only rank 0 has a writer thread.
        self.writer = du.on_main(lambda: BackupWriter(backups_dir, run_id, keep))

    def take(self, run, manifest: dict) -> tuple[list[tuple[int, Path]], float]:
        """Snapshot the state of `run` (an `outputs.TrainingRun`; every rank calls this) and hand it to the
        writer. Returns the backups that finished meanwhile, (step, path), and the seconds spent growing
        the pinned host memory for the snapshot."""
        state = run.training_state()  # collective: every rank contributes its RNG state
        if self.writer is None:
            return [], 0.0
        pinning_before = pinned_alloc_seconds()
        done = self.writer.submit(run.global_step, snapshot_to_host(run.trainable_state()), snapshot_to_host(state),
                                  manifest)
        return done, pinned_alloc_seconds() - pinning_before

    def finished(self) -> list[tuple[int, Path]]:
        return self.writer.finished() if self.writer is not None else []

    def wait(self) -> list[tuple[int, Path]]:
        return self.writer.wait() if self.writer is not None else []

    def release_host_memory(self) -> None:
        if self.writer is not None:
            self.writer.release_host_memory()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    @property
    def last_written(self) -> Path | None:
        return self.writer.last_written if self.writer is not None else None
