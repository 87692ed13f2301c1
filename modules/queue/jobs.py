"""A queued job and the GPUs it needs, as the queue file keeps them (plain JSON, read by every version).

A job's status words are the ones the GUI, `scripts/train_queue.py list` and the docs use.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

QUEUED, STARTING, RUNNING, DONE, FAILED, CANCELLED, PAUSED, INTERRUPTED = (
    "queued", "starting", "running", "done", "failed", "cancelled", "paused", "interrupted")
ON_GPUS = (STARTING, RUNNING)
"""States in which a job holds its GPUs."""
WAITING = (QUEUED,)
ENDED = (DONE, FAILED, CANCELLED)
"""Nothing more happens to these; `paused` and `interrupted` wait for a `resume`."""
REQUESTS = ("cancel", "pause")
"""What a user asked of a running job; the runner carries it out (stop signal or stop command)."""


class NeedError(ValueError):
    """A GPU need that cannot be read, or that this machine cannot meet."""


@dataclass(frozen=True)
class GpuNeed:
    """What a job asks for: `count` GPUs (any free ones), the named `devices`, or every GPU (`all`)."""
    count: int = 1
    devices: tuple[int, ...] = ()
    all: bool = False

    @classmethod
    def parse(cls, text: str | int) -> GpuNeed:
        """`2` (two GPUs), `0,2` (GPUs 0 and 2: a comma, even for one - `3,`), `all`."""
        value = str(text).strip().lower()
        if value == "all":
            return cls(all=True)
        if "," in value:
            try:
                devices = tuple(sorted({int(part) for part in value.split(",") if part.strip()}))
            except ValueError:
                raise NeedError(f"GPUs {text!r}: give a count (2), GPU numbers with commas (0,2 - or 3, for GPU 3 "
                                "alone) or all") from None
            if not devices or min(devices) < 0:
                raise NeedError(f"GPUs {text!r}: GPU numbers start at 0")
            return cls(count=len(devices), devices=devices)
        try:
            count = int(value)
        except ValueError:
            raise NeedError(f"GPUs {text!r}: give a count (2), GPU numbers with commas (0,2) or all") from None
        if count < 1:
            raise NeedError(f"GPUs {text!r}: a job needs at least 1 GPU")
        return cls(count=count)

    def text(self) -> str:
        """As `parse` reads it back."""
        if self.all:
            return "all"
        if self.devices:
            return ",".join(str(d) for d in self.devices) + ("," if len(self.devices) == 1 else "")
        return str(self.count)

    def describe(self, unit: str = "GPU") -> str:
        """For people: `2 GPUs`, `GPUs 0,2`, `GPU 3`, `all GPUs` (or CPU slots, `unit`)."""
        if self.all:
            return f"all {unit}s"
        if self.devices:
            return f"{unit}{'s' if len(self.devices) > 1 else ''} " + ",".join(str(d) for d in self.devices)
        return f"{self.count} {unit}" + ("s" if self.count != 1 else "")

    def size(self, capacity: int) -> int:
        """How many GPUs it takes on a machine of `capacity`."""
        return capacity if self.all else len(self.devices) or self.count

    def problem(self, capacity: int, unit: str = "GPU") -> str | None:
        """Why a machine of `capacity` GPUs (or CPU slots: `unit`) can never run it, or None."""
        units = f"{capacity} {unit}" + ("s" if capacity != 1 else "")
        if self.devices:
            missing = [d for d in self.devices if d >= capacity]
            if missing:
                return (f"it asks for {unit} {','.join(str(d) for d in missing)}, but this machine has {units} "
                        f"(numbered 0-{capacity - 1})")
            return None
        if not self.all and self.count > capacity:
            return f"it needs {self.count} {unit}s, but this machine has {units}"
        return None


@dataclass
class Job:
    id: int
    name: str
    need: str
    """`GpuNeed.text()`."""
    config: str
    """The config snapshot the job trains (a file in the queue folder, or on the remote there)."""
    cwd: str
    """The folder the training runs in: relative paths of the config mean what they meant where it was added."""
    workspace: str
    """The config's workspace as the training sees it (from `cwd`): two jobs of one workspace never run at once."""
    source: str = ""
    """What it was made from, for people: `my.json`, `preset #demo + training.max_steps=3`."""
    state: str = QUEUED
    request: str | None = None
    """`cancel` or `pause` of a running job, until the runner has carried it out."""
    requested_at: float | None = None
    """When the runner sent the request's signal or command (None: not yet)."""
    env: dict = field(default_factory=dict)
    """Variables for its processes (Tandem's home; on a remote, the machine's Environment setting)."""
    devices: list[int] = field(default_factory=list)
    """The GPUs (or slots) of its current or last run."""
    runs: list[str] = field(default_factory=list)
    """Its runs' ids in the run registry (`<runs root>/runs/<id>/`), the current or last one last."""
    train_run_id: str | None = None
    """The trainer's own run id (its backups' folder), once its log said it: a resume continues that run."""
    resume: str | None = None
    """What the next start continues (a trainer run id, or `latest`); None: from the beginning."""
    added: float = 0.0
    started: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    output: str | None = None
    """The model its run saved."""
    message: str = ""
    """Why it failed, was cancelled or paused; what its start said."""
    history: list[dict] = field(default_factory=list)
    """Each run it had: {run, devices, started, ended, state} (the tests check assignments with it)."""

    @property
    def gpu_need(self) -> GpuNeed:
        return GpuNeed.parse(self.need)

    @property
    def run_id(self) -> str | None:
        return self.runs[-1] if self.runs else None

    @property
    def on_gpus(self) -> bool:
        return self.state in ON_GPUS

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Job:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def status_text(self) -> str:
        """The status as the GUI and `list` show it."""
        if self.state == INTERRUPTED:
            return "interrupted - continue from backup" if self.resume else "interrupted - start again"
        if self.request == "cancel" and self.on_gpus:
            return "cancelling"
        if self.request == "pause" and self.on_gpus:
            return "pausing"
        return self.state

    def label(self) -> str:
        return f"#{self.id} {self.name}"
