"""modules/util/import_structure.py: transformers' scan of its model folders, kept between starts."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from modules.util.import_structure import KeptStructure, decode, encode, installation_key

REPO = Path(__file__).resolve().parents[1]


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


@pytest.mark.slow
def test_transformers_gets_its_own_answer_from_the_kept_file(tmp_path):
    """The real transformers in fresh interpreters: the first start scans and keeps, the second is served, and
    what it is served is what transformers' own scan finds; a model class imports on top of it."""
    code = textwrap.dedent("""
        import json, sys
        from modules.util.import_structure import decode, remember_import_structure
        remember_import_structure()
        from transformers import CLIPTextModel
        import transformers.utils.import_utils as iu
        kept = iu.define_import_structure
        # What was kept against transformers' own scan now (what it was served, transformers has since
        # added its top-level names to, as it does to its own scan's answer).
        same = all(decode(kept.kept[name]) == kept.scan(*json.loads(name)) for name in kept.served)
        print(json.dumps({"scanned": len(kept.scanned), "served": len(kept.served), "same": same}))
    """)
    env = {**os.environ, "TANDEM_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    env.pop("TANDEM_PACKAGE_MAP_CACHE", None)
    runs = []
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    assert runs[0]["scanned"] == 2 and runs[0]["served"] == 0
    assert runs[1] == {"scanned": 0, "served": 2, "same": True}


def test_off_leaves_transformers_alone(monkeypatch, tmp_path):
    from modules.util import import_structure
    monkeypatch.setenv("TANDEM_PACKAGE_MAP_CACHE", "off")
    hooks = [finder for finder in sys.meta_path if isinstance(finder, import_structure._Hook)]
    kept_before = getattr(sys.modules.get(import_structure.MODULE), "define_import_structure", None)
    import_structure.remember_import_structure(tmp_path)
    assert [finder for finder in sys.meta_path if isinstance(finder, import_structure._Hook)] == hooks
    assert getattr(sys.modules.get(import_structure.MODULE), "define_import_structure", None) is kept_before
