"""The loss curve of each run, kept on disk so that the plot continues when a run is resumed.

Every loss the GUI receives is appended to its run's own file, `<workspace>/.tandem/losses/<run id>.csv`
(`step,loss` lines; the validation curve beside it, `<run id>-validation.csv`): continuing an older run
shows that run's curve, never the one of a run trained since (one file for the workspace did). When a run
starts, its first reported step decides what the earlier lines mean: step 1 is a fresh run (the file
starts over); a later step is a resume from a backup, so the points before it are the history of the
same training and stay in the plot (points at or after it were trained again and are dropped). The files
outlive the GUI, so a run resumed the next day still shows its whole curve. A trainer that does not say
its run id (an older one) keeps the one file of before, `gui-losses.csv`.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from modules.util.no_follow import make_private_folder, open_text_no_follow


def run_histories(folder: Path, run_id: str) -> tuple[LossHistory, LossHistory]:
    """The loss and validation-loss files of run `run_id` in `folder` (`.tandem/losses`)."""
    return LossHistory(Path(folder) / f"{run_id}.csv"), LossHistory(Path(folder) / f"{run_id}-validation.csv")


class LossHistory:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._file: TextIO | None = None

    def read(self) -> list[tuple[int, float]]:
        """The points on disk; unreadable lines (a half-written last line after a crash) are skipped."""
        points = []
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError:
            return []
        for line in text.splitlines():
            step, _, loss = line.partition(",")
            try:
                points.append((int(step), float(loss)))
            except ValueError:
                continue
        return points

    def begin(self, first_step: int) -> list[tuple[int, float]]:
        """A run reported its first loss at `first_step`: return the earlier points that belong to it and
        keep only those on disk."""
        earlier = [(s, v) for s, v in self.read() if s < first_step] if first_step > 1 else []
        self.close()
        try:
            make_private_folder(self.path.parent)  # `.tandem/losses` the first time
            self._file = open_text_no_follow(self.path, "w")  # never through a link planted in `.tandem`
        except OSError as error:  # the plot goes on from memory; the run itself refuses such a link, naming it
            print(f"The loss curve is not kept on disk: {error}", file=sys.stderr)
            return earlier
        self._file.writelines(f"{s},{v!r}\n" for s, v in earlier)
        self._file.flush()
        return earlier

    def append(self, step: int, loss: float) -> None:
        if self._file is None:
            return
        self._file.write(f"{step},{loss!r}\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
