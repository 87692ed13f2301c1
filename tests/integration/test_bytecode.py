"""The bytecode cache for environments whose packages have no bytecode and may not get any (modules/util/bytecode.py).

Each case runs in a fresh interpreter: whether Python writes bytecode is fixed per process."""
import os
import py_compile
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tests.patience import patience

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def place(tmp_path):
    """A package without bytecode (`probe_pkg`), a module only a spawned child imports, and an empty home."""
    packages = tmp_path / "site"
    (packages / "probe_pkg").mkdir(parents=True)
    (packages / "probe_pkg" / "__init__.py").write_text("VALUE = 1\n")
    (packages / "child_only.py").write_text("VALUE = 2\n")
    home = tmp_path / "home"
    home.mkdir()
    return packages, home


def run(code: str, packages: Path, home: Path, **env_changes) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX", "TANDEM_BYTECODE_CACHE")}
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join([str(ROOT), str(packages)]))
    env.update({k: v for k, v in env_changes.items() if v is not None})
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                            timeout=patience(120))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


TURN_ON = """
    from modules.util.bytecode import keep_bytecode
    print(keep_bytecode(probes=("probe_pkg",)))
    import probe_pkg
"""


def cached_files(home: Path) -> list[str]:
    return sorted(p.name for p in (home / ".cache" / "tandem" / "bytecode").rglob("*.pyc"))


def test_told_not_to_write_bytecode_the_cache_keeps_it_outside_the_packages(place):
    packages, home = place
    printed = run(TURN_ON, packages, home, PYTHONDONTWRITEBYTECODE="1")
    assert printed == str(home / ".cache" / "tandem" / "bytecode")
    assert any(name.startswith("__init__.") for name in cached_files(home))
    assert not (packages / "probe_pkg" / "__pycache__").exists()  # the installed packages are left as they were
    # A second start reads it: the same file, not rewritten.
    pyc = next((home / ".cache" / "tandem" / "bytecode").rglob("__init__.*.pyc"))
    written = pyc.stat().st_mtime_ns
    run(TURN_ON, packages, home, PYTHONDONTWRITEBYTECODE="1")
    assert pyc.stat().st_mtime_ns == written


def test_nothing_changes_where_python_writes_bytecode_itself(place):
    packages, home = place
    assert run(TURN_ON, packages, home) == "None"
    assert (packages / "probe_pkg" / "__pycache__").is_dir()  # Python's own place
    assert cached_files(home) == []


def test_nothing_changes_where_the_packages_have_bytecode(place):
    packages, home = place
    source = packages / "probe_pkg" / "__init__.py"
    # Written next to the source even where this test process has a bytecode prefix (conftest's keep_bytecode).
    beside = source.parent / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc"
    py_compile.compile(str(source), cfile=str(beside), doraise=True)
    assert run(TURN_ON, packages, home, PYTHONDONTWRITEBYTECODE="1") == "None"
    assert cached_files(home) == []


def test_a_packages_folder_the_user_cannot_write_counts_as_lacking_bytecode(place, monkeypatch):
    """Python writes nothing there either (silently): every start compiles from source."""
    from modules.util import bytecode

    packages, _ = place
    monkeypatch.syspath_prepend(str(packages))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert not bytecode._lacks_bytecode("probe_pkg")  # writable: Python will write its own
    monkeypatch.setattr(bytecode.os, "access", lambda path, mode: Path(path) != packages / "probe_pkg")
    assert bytecode._lacks_bytecode("probe_pkg")


@pytest.mark.parametrize("setting", [{"PYTHONPYCACHEPREFIX": "USER"}, {"TANDEM_BYTECODE_CACHE": "off"}],
                         ids=["user's own prefix", "turned off"])
def test_the_users_choice_wins(place, setting):
    packages, home = place
    if "PYTHONPYCACHEPREFIX" in setting:
        setting = {"PYTHONPYCACHEPREFIX": str(home / "mine")}
    assert run(TURN_ON, packages, home, PYTHONDONTWRITEBYTECODE="1", **setting) == "None"
    assert cached_files(home) == []


def test_a_spawned_worker_adds_what_only_it_imports(place):
    """spawn passes the parent's `-B` on, so a worker reads the cache but would add nothing to it; it re-runs the
    script's top level (as `__mp_main__`), where Tandem's scripts call keep_bytecode, which turns writing back on."""
    packages, home = place
    script = textwrap.dedent("""
        import multiprocessing as mp
        import sys

        from modules.util.bytecode import keep_bytecode

        def work(queue):
            import child_only
            queue.put((sys.flags.dont_write_bytecode, sys.dont_write_bytecode))

        {top_level_call}
        if __name__ == "__main__":
            {main_call}
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            child = ctx.Process(target=work, args=(queue,))
            child.start()
            print(queue.get(timeout=600))
            child.join()
    """)
    call = 'keep_bytecode(probes=("probe_pkg",))'
    (packages / "as_tandem_scripts.py").write_text(script.format(top_level_call=call, main_call="pass"))
    (packages / "main_only.py").write_text(script.format(top_level_call="", main_call=call))

    def run_script(name: str) -> str:
        return run(f"import runpy; runpy.run_path({str(packages / name)!r}, run_name='__main__')", packages, home,
                   PYTHONDONTWRITEBYTECODE="1")

    assert run_script("main_only.py") == "(1, True)"  # started with -B: reads, does not write
    assert not any(name.startswith("child_only.") for name in cached_files(home))
    assert run_script("as_tandem_scripts.py") == "(1, False)"
    assert any(name.startswith("child_only.") for name in cached_files(home))
