"""modules/util/package_map.py: the installed packages' map is scanned once per installation, not per import."""
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modules.util import package_map
from modules.util.package_map import KeptPackageMap, remember_package_map
from tests.patience import patience

REPO = Path(__file__).resolve().parents[2]


class CountedScan:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return importlib.metadata.packages_distributions()


def add_distribution(folder: Path, name: str) -> None:
    """What pip leaves: a `*.dist-info` folder; the folder's modification time moves on with it."""
    before = folder.stat().st_mtime_ns
    info = folder / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text(f"{name}\n")
    (info / "RECORD").write_text("")
    os.utime(folder, ns=(before + 10**9, before + 10**9))  # coarse file systems: a second later, as in life


@pytest.fixture
def site(tmp_path, monkeypatch):
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    return folder


def test_the_map_is_the_scans_and_a_later_start_reads_it_without_scanning(tmp_path, site):
    add_distribution(site, "tandem_probe_one")
    scan = CountedScan()
    first = KeptPackageMap(scan, tmp_path / "maps")
    assert first() == importlib.metadata.packages_distributions()
    assert first()["tandem_probe_one"] == ["tandem_probe_one"]
    assert scan.calls == 1, "the second call in one process is answered from memory"
    later = KeptPackageMap(scan, tmp_path / "maps")  # the next process start
    assert later() == first() and scan.calls == 1


def test_installing_a_package_scans_again(tmp_path, site):
    scan = CountedScan()
    kept = KeptPackageMap(scan, tmp_path / "maps")
    assert "tandem_probe_two" not in kept()
    add_distribution(site, "tandem_probe_two")
    assert kept()["tandem_probe_two"] == ["tandem_probe_two"] and scan.calls == 2
    assert KeptPackageMap(scan, tmp_path / "maps")()["tandem_probe_two"] == ["tandem_probe_two"] and scan.calls == 2


def test_a_caller_changing_its_answer_does_not_change_the_next_callers(tmp_path, site):
    add_distribution(site, "tandem_probe_three")
    kept = KeptPackageMap(CountedScan(), tmp_path / "maps")
    kept()["tandem_probe_three"].append("something else")
    kept().pop("tandem_probe_three")
    assert kept()["tandem_probe_three"] == ["tandem_probe_three"]


@pytest.mark.parametrize("content", ["{not json", '["a list"]', '{"torch": "not a list"}'])
def test_a_damaged_file_is_scanned_again_and_rewritten(tmp_path, site, content):
    maps = tmp_path / "maps"
    scan = CountedScan()
    expected = KeptPackageMap(scan, maps)()
    (written,) = maps.glob("*.json")
    written.write_text(content)
    assert KeptPackageMap(scan, maps)() == expected and scan.calls == 2
    assert json.loads(written.read_text()) == expected


def test_an_unwritable_folder_costs_only_the_scan(tmp_path, site):
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    scan = CountedScan()
    assert KeptPackageMap(scan, blocked / "maps")() == importlib.metadata.packages_distributions()
    assert KeptPackageMap(scan, blocked / "maps")() and scan.calls == 2


def test_only_the_latest_installations_maps_are_kept(tmp_path, site, monkeypatch):
    monkeypatch.setattr(package_map, "KEPT_FILES", 2)
    maps = tmp_path / "maps"
    for name in ("tandem_probe_a", "tandem_probe_b", "tandem_probe_c"):
        add_distribution(site, name)
        KeptPackageMap(CountedScan(), maps)()
    assert len(list(maps.glob("*.json"))) == 2
    assert not list(maps.glob(".*.tmp"))


def test_off_leaves_the_scan_as_it_is(monkeypatch):
    monkeypatch.setenv("TANDEM_PACKAGE_MAP_CACHE", "off")
    before = importlib.metadata.packages_distributions
    assert remember_package_map() is None and importlib.metadata.packages_distributions is before


# The real imports (diffusers and transformers in two fresh interpreters: every scan they ask for on the first
# start comes from one scan, the next start has none, and diffusers gets the installation's map) are checked
# with transformers' kept models scan on the same two starts: tests/unit/test_import_structure.py::
# test_real_imports_scan_on_the_first_start_only_and_get_their_own_answers.


def test_the_forkserver_keeps_the_map_before_it_imports_the_packages():
    """The process that starts the workers on N GPUs imports diffusers and transformers for them."""
    code = ("import importlib.metadata, modules.distributed.forkserver_setup; "
            "print(type(importlib.metadata.packages_distributions).__name__)")
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_PACKAGE_MAP_CACHE"}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=patience(60))
    assert run.stdout.strip() == "KeptPackageMap", run.stderr
