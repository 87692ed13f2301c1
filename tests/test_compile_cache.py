"""torch.compile's kernel cache lives in Tandem's cache folder, not the temporary one (modules/util/compile_cache.py).

Importing diffusers settles the folder for the process, so the real sequence runs in a fresh interpreter."""
import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRY_SCRIPTS = ["train.py", "train_multi_gpu.py", "train_ui.py", "benchmark.py", "check_multi_gpu.py"]


@pytest.mark.slow
def test_the_cache_folder_is_tandems_when_chosen_before_diffusers_is_imported(tmp_path):
    """A fresh interpreter as the scripts start: the choice, then diffusers, whose import settles PyTorch's folder."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(ROOT))
    code = textwrap.dedent("""
        import os
        from modules.util.compile_cache import keep_compile_cache
        keep_compile_cache()
        import diffusers.models
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        print(cache_dir())
    """)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(tmp_path / ".cache" / "tandem" / "torchinductor")


def test_a_users_own_cache_folder_is_kept(tmp_path, monkeypatch):
    from modules.util.compile_cache import keep_compile_cache
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert keep_compile_cache() == str(tmp_path / "mine")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


@pytest.mark.parametrize("script", ENTRY_SCRIPTS)
def test_every_script_chooses_the_folder_before_importing_anything_that_imports_torch(script):
    """The scripts' top level: only os, sys, pathlib and modules.util's start-up helpers may come first."""
    tree = ast.parse((ROOT / "scripts" / script).read_text())
    harmless = {"os", "sys", "pathlib", "modules.util.bytecode", "modules.util.package_map",
                "modules.util.compile_cache", "__future__"}
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
                and getattr(node.value.func, "id", None) == "keep_compile_cache":
            return
        if isinstance(node, ast.Import):
            assert {a.name for a in node.names} <= harmless, f"{script} imports {ast.unparse(node)} first"
        if isinstance(node, ast.ImportFrom):
            assert node.module in harmless, f"{script} imports {ast.unparse(node)} first"
    pytest.fail(f"scripts/{script} never calls keep_compile_cache() at its top level")
