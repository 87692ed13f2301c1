"""The suite's order for pytest-xdist's worksteal: the known-slow tests lead every worker's slice."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from tests.slowest_first import known_seconds, slice_sizes, slowest_first


@dataclass
class Item:
    nodeid: str
    module_fixtures: tuple = ()
    _fixtureinfo: object = field(init=False)

    def __post_init__(self):
        module = self.nodeid.split("::")[0]
        defined = {name: [SimpleNamespace(scope=scope, baseid=module if here else "tests")]
                   for name, scope, here in self.module_fixtures}
        self._fixtureinfo = SimpleNamespace(name2fixturedefs=defined)


def test_slices_are_worksteals_first_hand_out():
    assert slice_sizes(1426, 3) == [475, 475, 476]
    assert slice_sizes(5, 1) == [5] and slice_sizes(2, 3) == [0, 1, 1]


def test_each_slice_starts_with_its_share_of_the_slow_tests_and_the_rest_keep_their_order():
    items = [Item(f"t{i}") for i in range(12)]
    seconds = {"t3": 300.0, "t7": 120.0, "t8": 110.0, "t10": 100.0, "t11": 5.0}
    ordered = slowest_first(items, seconds, workers=3)
    assert sorted(i.nodeid for i in ordered) == sorted(i.nodeid for i in items)
    slices = [ordered[0:4], ordered[4:8], ordered[8:12]]
    # the longest alone, then each next to the slice with the fewest seconds so far
    assert [[i.nodeid for i in s if i.nodeid in seconds] for s in slices] == [["t3"], ["t7", "t11"], ["t8", "t10"]]
    rest = [i.nodeid for i in ordered if i.nodeid not in seconds]
    assert rest == ["t0", "t1", "t2", "t4", "t5", "t6", "t9"]


def test_without_workers_or_known_tests_the_order_is_the_collections():
    items = [Item(f"t{i}") for i in range(4)]
    assert [i.nodeid for i in slowest_first(items, {}, workers=3)] == ["t0", "t1", "t2", "t3"]
    assert [i.nodeid for i in slowest_first(items, {"t2": 9.0}, workers=1)] == ["t2", "t0", "t1", "t3"]


def test_durations_lines_are_read_as_pytest_prints_them(tmp_path):
    listing = tmp_path / "slowest.txt"
    listing.write_text("# a comment\n293.03s call     tests/test_a.py::test_x[a b]\n2.50s setup    tests/test_a.py::test_x[a b]\n"
                       "not a line\n1.00s call\n")
    assert known_seconds(listing) == {"tests/test_a.py::test_x[a b]": 295.53}
    assert known_seconds(tmp_path / "missing.txt") == {}


def test_the_shipped_list_names_tests_by_their_ids():
    """Each line names a test of a file that exists (a moved or renamed file loses its tests' head start)."""
    repo = Path(__file__).resolve().parents[2]
    files = {name.split("::")[0] for name in known_seconds()}
    assert files and all(name.startswith("tests/") and "::" in name for name in known_seconds())
    assert sorted(name for name in files if not (repo / name).is_file()) == []


def test_a_slow_test_takes_along_the_tests_that_share_its_modules_trained_fixture():
    """A fixture built once per module for several tests (a trained model) stays built once per worker; a
    module-scoped fixture from conftest, used by every module alike, ties nothing together."""
    trained = ("trained", "module", True)
    everywhere = ("one_torch_thread", "module", False)
    items = [Item("a.py::quick"), Item("b.py::uses", (trained,)), Item("b.py::other", (everywhere,)),
             Item("b.py::slow", (trained, everywhere)), Item("c.py::slow"), Item("c.py::quick", (everywhere,))]
    ordered = [i.nodeid for i in slowest_first(items, {"b.py::slow": 100.0, "c.py::slow": 90.0}, workers=2)]
    assert ordered == ["b.py::slow", "b.py::uses", "a.py::quick", "c.py::slow", "b.py::other", "c.py::quick"]
