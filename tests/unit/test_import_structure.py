"""modules/util/import_structure.py: transformers' scan of its model folders, kept between starts."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from modules.util.import_structure import KeptStructure, decode, encode, installation_key
from tests.patience import patience

REPO = Path(__file__).resolve().parents[2]


def fake_transformers(root: Path) -> Path:
    package = root / "transformers"
    (package / "models").mkdir(parents=True)
    (package / "utils").mkdir()
    for part in ("__init__.py", "models/__init__.py", "utils/import_utils.py"):
        (package / part).write_text("")
    return package


class CountedScan:
    def __init__(self):
        self.calls = []

    def __call__(self, module_path, prefix=None):
        self.calls.append((str(module_path), prefix))
        return {frozenset(): {f"{prefix or ''}.bert.configuration_bert": {"BertConfig"}},
                frozenset({"torch"}): {"bert.modeling_bert": {"BertModel", "BertForMaskedLM"}}}


def test_the_models_scan_is_kept_and_a_later_start_reads_it(tmp_path):
    package = fake_transformers(tmp_path)
    scan = CountedScan()
    first = KeptStructure(scan, package, tmp_path / "kept")
    answer = first(package / "models", prefix="models")
    assert answer == scan(package / "models", "models") and len(scan.calls) == 2
    assert first(str(package / "models" / "__init__.py")) == scan(str(package / "models" / "__init__.py"))
    assert first(package / "models", prefix="models") is answer, "the process's second call: from memory"
    assert len(first.scanned) == 2 and first.served == []

    calls = len(scan.calls)
    later = KeptStructure(scan, package, tmp_path / "kept")  # the next process start
    assert later(package / "models", prefix="models") == answer
    assert later(str(package / "models" / "__init__.py")) == scan(str(package / "models" / "__init__.py"))
    assert len(scan.calls) == calls + 1 and later.scanned == [] and len(later.served) == 2


def test_a_single_models_folder_is_scanned_as_transformers_does(tmp_path):
    package = fake_transformers(tmp_path)
    scan = CountedScan()
    kept = KeptStructure(scan, package, tmp_path / "kept")
    kept(package / "models" / "bert" / "__init__.py")
    kept(package / "models" / "bert" / "__init__.py")
    assert len(scan.calls) == 2 and not (tmp_path / "kept").exists()


def test_reinstalling_transformers_scans_again(tmp_path):
    package = fake_transformers(tmp_path)
    scan = CountedScan()
    KeptStructure(scan, package, tmp_path / "kept")(package / "models", "models")
    key = installation_key(package)
    stamp = (package / "models").stat().st_mtime_ns + 10**9
    os.utime(package / "models", ns=(stamp, stamp))  # what pip's reinstall leaves
    assert installation_key(package) != key
    later = KeptStructure(scan, package, tmp_path / "kept")
    later(package / "models", "models")
    assert later.scanned and len(scan.calls) == 2


def test_a_damaged_file_is_scanned_again_and_rewritten(tmp_path):
    package = fake_transformers(tmp_path)
    folder = tmp_path / "kept"
    folder.mkdir()
    name = json.dumps([str(package / "models"), "models"])
    for damage in ("not json", json.dumps({name: [[["torch"], {"x": [1, 2]}]]}), json.dumps([1, 2]),
                   json.dumps({name: [["torch", {"x": ["X"]}]]}), json.dumps({name: {"torch": {"x": ["X"]}}})):
        (folder / f"{installation_key(package)}.json").write_text(damage)
        scan = CountedScan()
        kept = KeptStructure(scan, package, folder)
        assert kept(package / "models", "models") == scan(package / "models", "models")
        assert kept.scanned and decode(json.loads((folder / f"{installation_key(package)}.json").read_text())[name])


def test_encoding_round_trips():
    structure = CountedScan()("x", "models")
    assert decode(json.loads(json.dumps(encode(structure)))) == structure


REAL_IMPORTS = textwrap.dedent("""
    import importlib.metadata, json, sys
    from pathlib import Path
    package_scans = []
    scan = importlib.metadata.packages_distributions
    importlib.metadata.packages_distributions = lambda: package_scans.append(1) or scan()
    from modules.util.import_structure import decode, remember_import_structure
    from modules.util.package_map import remember_package_map
    remember_package_map(Path(sys.argv[1]))  # as the scripts and the forkserver start: the map, then the scan
    remember_import_structure()
    import diffusers.utils.import_utils as diffusers_imports
    from transformers import CLIPTextModel
    import transformers.utils.import_utils as iu
    package_scans = len(package_scans)  # before the comparisons below, which may scan again
    kept = iu.define_import_structure
    # What was kept against transformers' own scan now (what it was served, transformers has since
    # added its top-level names to, as it does to its own scan's answer).
    same = all(decode(kept.kept[name]) == kept.scan(*json.loads(name)) for name in kept.served)
    print(json.dumps({"scanned": len(kept.scanned), "served": len(kept.served), "same": same,
                      "package_scans": package_scans, "diffusers_map": diffusers_imports._package_map == scan()}))
""")


@pytest.mark.slow
def test_real_imports_scan_on_the_first_start_only_and_get_their_own_answers(tmp_path):
    """The real diffusers and transformers in two fresh interpreters, started as the scripts start (the
    package map, then transformers' models scan, both kept: modules/util/package_map.py and this module).
    The first start scans the models folders and keeps them, and every package-map scan the imports ask for
    comes from one scan; the second start is served both, with no scan at all, and what transformers is
    served is what its own scan finds; a model class imports on top of it, and diffusers gets the
    installation's map. (Also the real-imports test of tests/unit/test_package_map.py: one pair of interpreter
    starts for both caches, each start importing the libraries that cost ~5 s of CPU.)"""
    env = {**os.environ, "TANDEM_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    env.pop("TANDEM_PACKAGE_MAP_CACHE", None)
    runs = []
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", REAL_IMPORTS, str(tmp_path / "maps")], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=patience(300))
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    assert runs[0]["scanned"] == 2 and runs[0]["served"] == 0, f"the first start scans the models folders: {runs[0]}"
    assert runs[0]["package_scans"] == 1, f"the first start's package-map scans come from one scan: {runs[0]}"
    assert runs[1]["scanned"] == 0 and runs[1]["served"] == 2, f"the second start is served the models scan: {runs[1]}"
    assert runs[1]["same"], "what transformers is served is what its own scan finds"
    assert runs[1]["package_scans"] == 0, f"the second start reads the kept package map without scanning: {runs[1]}"
    assert runs[0]["diffusers_map"] and runs[1]["diffusers_map"], "diffusers got the installation's map"


def test_off_leaves_transformers_alone(monkeypatch, tmp_path):
    from modules.util import import_structure
    monkeypatch.setenv("TANDEM_PACKAGE_MAP_CACHE", "off")
    hooks = [finder for finder in sys.meta_path if isinstance(finder, import_structure._Hook)]
    kept_before = getattr(sys.modules.get(import_structure.MODULE), "define_import_structure", None)
    import_structure.remember_import_structure(tmp_path)
    assert [finder for finder in sys.meta_path if isinstance(finder, import_structure._Hook)] == hooks
    assert getattr(sys.modules.get(import_structure.MODULE), "define_import_structure", None) is kept_before
