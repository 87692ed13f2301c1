"""The known-slowest tests start first, spread evenly over the pytest-xdist workers.

run-tests.sh runs the suite with `--dist worksteal`, which hands each worker one contiguous slice of the
collection (equal numbers of tests) and later lets an idle worker take the back half of a busy one's queue.
In file order a 5-minute test could start in the suite's last minutes and leave the other workers idle
while it ran; here each worker's slice starts with its share of the slow tests (the longest first, each
given to the slice with the fewest seconds so far), so they all run early and the quick tests, taken from
the back of the queues, fill the gaps at the end. A slow test takes along the tests of its module that share
a module-scoped fixture of that module with it (a model trained once for several checks), so that fixture is
still built once per worker; the rest keep their collection order, so a module's tests stay together.

The seconds come from `slowest_tests.txt`: lines as pytest's `--durations` prints them. A test missing from
it (new, or renamed) only loses its head start.
"""
from __future__ import annotations

from pathlib import Path

DURATIONS = Path(__file__).with_name("slowest_tests.txt")


def known_seconds(path: Path = DURATIONS) -> dict[str, float]:
    """Each listed test's seconds (its call, setup and teardown lines added up)."""
    seconds: dict[str, float] = {}
    if not path.exists():
        return seconds
    for line in path.read_text().splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) == 3 and parts[0].endswith("s") and parts[1] in ("call", "setup", "teardown"):
            try:
                took = float(parts[0][:-1])
            except ValueError:
                continue
            seconds[parts[2]] = seconds.get(parts[2], 0.0) + took
    return seconds


def slice_sizes(count: int, workers: int) -> list[int]:
    """How many tests worksteal's first hand-out gives each worker: what is left, divided by the workers
    still waiting (xdist.scheduler.worksteal.check_schedule)."""
    sizes = []
    for waiting in range(workers, 0, -1):
        sizes.append((count - sum(sizes)) // waiting)
    return sizes


def _module_fixtures(item) -> set:
    """The module- or class-scoped fixtures defined in `item`'s own file that it uses (with their parameter)."""
    module = item.nodeid.split("::")[0]
    info = getattr(item, "_fixtureinfo", None)
    params = getattr(getattr(item, "callspec", None), "params", {})
    found = set()
    for name, definitions in (info.name2fixturedefs.items() if info else ()):
        definition = definitions[-1]
        if definition.scope in ("module", "class") and definition.baseid.split("::")[0] == module:
            found.add((module, name, repr(params.get(name))))
    return found


def slowest_first(items: list, seconds: dict[str, float], workers: int) -> list:
    """`items` reordered: `workers` slices of worksteal's sizes, each led by its share of the known-slow
    tests (longest first, each followed by the tests sharing its module fixtures), then the other tests
    in their order."""
    slow = sorted((item for item in items if item.nodeid in seconds), key=lambda item: -seconds[item.nodeid])
    if not slow:
        return list(items)
    fixtures = {id(item): _module_fixtures(item) for item in items}
    taken = {id(item) for item in slow}
    units = []
    for item in slow:
        shared = fixtures[id(item)]
        companions = [other for other in items if id(other) not in taken and shared & fixtures[id(other)]]
        taken.update(id(other) for other in companions)
        units.append(([item, *companions], seconds[item.nodeid]))
    rest = [item for item in items if id(item) not in taken]
    sizes = slice_sizes(len(items), max(1, workers))
    shares: list[list] = [[] for _ in sizes]
    loads = [0.0 for _ in sizes]
    for unit, took in units:
        open_slices = [k for k, share in enumerate(shares) if len(share) + len(unit) <= sizes[k]] or [len(sizes) - 1]
        k = min(open_slices, key=lambda k: (loads[k], k))
        shares[k] += unit
        loads[k] += took
    ordered = []
    start = 0
    for share, size in zip(shares, sizes):
        fill = max(0, size - len(share))
        ordered += share + rest[start:start + fill]
        start += fill
    return ordered + rest[start:]


def worker_count(config) -> int:
    """The number of pytest-xdist workers this run has (1 in a plain pytest run)."""
    workerinput = getattr(config, "workerinput", None)
    return int(workerinput.get("workercount", 1)) if workerinput else 1
