"""The queue as people see it - one row per job: status, GPUs, progress, ETA, the model or the reason it
failed, and its log - the same for `scripts/train_queue.py list`, the GUI's Queue view and a remote queue's answer
(plain JSON: a remote sends its rows, the desktop shows them).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from modules.util.durations import format_seconds

from .jobs import Job
from .log_summary import summarize
from .store import QueueState, QueueStore


@dataclass(frozen=True)
class JobRow:
    id: int
    name: str
    state: str
    status: str
    """As shown: `running`, `interrupted - continue from backup`, `cancelling`."""
    gpus: str
    """The GPUs it runs (or ran) on, else what it needs: `0,1`, `2 GPUs`."""
    step: int = 0
    total_steps: int = 0
    eta_s: float | None = None
    output: str | None = None
    message: str = ""
    log: str | None = None
    """Its current or last run's log file (on the machine that runs the queue)."""
    source: str = ""

    @property
    def fraction(self) -> float:
        if self.state == "done":
            return 1.0
        return min(self.step / self.total_steps, 1.0) if self.total_steps else 0.0

    def progress_text(self) -> str:
        return f"step {self.step}/{self.total_steps}" if self.total_steps else ""

    def eta_text(self) -> str:
        return format_seconds(self.eta_s) if self.state == "running" and self.eta_s is not None else ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> JobRow:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def job_row(job: Job, runs_root: Path, unit: str = "GPU") -> JobRow:
    log = runs_root / "runs" / job.run_id / "output.log" if job.run_id else None
    summary = summarize(log) if log is not None and job.state != "queued" else None
    devices = ",".join(str(d) for d in job.devices)
    gpus = devices if devices and job.state not in ("queued",) else job.gpu_need.describe(unit)
    output = job.output or (summary.output if summary and job.state == "done" else None)
    if output:
        output = str(Path(job.cwd) / output)  # a relative one is the run's: from where it ran
    return JobRow(id=job.id, name=job.name, state=job.state, status=job.status_text(), gpus=gpus,
                  step=summary.step if summary else 0, total_steps=summary.total_steps if summary else 0,
                  eta_s=summary.eta_s if summary and job.on_gpus else None,
                  output=output,
                  message=job.message, log=str(log) if log is not None and log.exists() else None,
                  source=job.source)


def rows(store: QueueStore, state: QueueState | None = None) -> list[JobRow]:
    state = state or store.read()
    runs_root = Path(state.runs_root).expanduser() if state.runs_root else store.folder
    unit = "CPU slot" if state.slots else state.runner.get("unit", "GPU")
    return [job_row(job, runs_root, unit) for job in state.jobs]


def log_tail(path: str | Path, limit: int | None = None) -> str:
    """A job's log, or its last `limit` bytes (a long run's log is large; the GUI shows its end). OSError when
    it cannot be read."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(max(size - limit, 0) if limit is not None else 0)
        return f.read().decode("utf-8", errors="replace")


def describe_queue(store: QueueStore, state: QueueState, runner_alive: bool) -> str:
    """The line above the table: where it is, what it runs on, whether it runs."""
    runner = state.runner
    offers = f"{runner.get('capacity')} {runner.get('unit', 'GPU')}(s)" if runner.get("capacity") else \
        (f"{state.slots} CPU slot(s)" if state.slots else "GPUs counted when it runs")
    going = f"runner going (process {runner.get('pid')})" if runner_alive else "runner not going"
    paused = " · paused: no new job starts" if state.paused else ""
    return f"Queue {store.folder} · {offers} · {going}{paused}"


def table(found: list[JobRow]) -> str:
    """`list`'s table."""
    if not found:
        return "The queue is empty."
    header = ("#", "name", "status", "GPUs", "progress", "ETA", "")
    lines = [header]
    for row in found:
        detail = f"model: {row.output}" if row.output else row.message.splitlines()[0] if row.message else ""
        lines.append((str(row.id), row.name, row.status, row.gpus, row.progress_text(), row.eta_text(), detail))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1]
                     for line in lines).rstrip()
