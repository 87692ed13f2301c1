"""torch.compile's kernel cache lives in Tandem's cache folder, not the temporary one (modules/util/compile_cache.py).

Importing diffusers settles the folder for the process, so the real sequence runs in a fresh interpreter."""
import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tests.patience import patience

ROOT = Path(__file__).resolve().parents[2]
# Scripts that need not choose: they start no training process here, or import nothing that imports
# diffusers before starting one. A new script is checked unless named here.
NEEDS_NO_CHOICE = {
    "start_multi_gpu.py": "standard library only (it runs before the install); train_multi_gpu.py chooses",
    "convert_lora.py": "converts files",
    "lora_tools.py": "merges, resizes and extracts LoRA files: nothing compiled",
    "caption.py": "captions images with a model's generate: nothing compiled",
    "import_config.py": "converts a config",
    "make_random_model.py": "writes a model folder",
    "render_screenshots.py": "draws the GUI's tabs",
    "benchmark_text_encoder.py": "encodes captions, compiles nothing",
    "train_remote.py": "trains on other machines, whose train.py chooses their folder",
    "train_queue.py": "starts each job as a fresh train.py / train_multi_gpu.py process, which chooses its folder",
}
# A process that imports diffusers first passes PyTorch's /tmp default on to every process it starts
# (the end-to-end benchmark did: its runs' compile caches went to /tmp and the next run missed them).
ENTRY_SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py") if p.name not in NEEDS_NO_CHOICE)


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
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=patience(180))
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
    harmless = {"os", "sys", "pathlib", "modules.util.bytecode", "modules.util.package_map", "modules.util.import_structure",
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


@pytest.mark.parametrize("cacheable", [False, True])
def test_checkpointed_randomness_takes_the_cacheable_form_where_the_graph_safe_one_is_not(cacheable, monkeypatch):
    """PyTorch 2.11 cannot cache `graphsafe_run_with_rng_state` (on an H200 every start of a checkpointed
    denoiser compiled afresh, "Can't cache HigherOrderOperator"); 2.13 can, and is then left alone. The GPU
    side (the cache serving the second start) is measured in docs/Performance.md."""
    import torch
    import torch._functorch.config as functorch_config
    from torch._prims import rng_prims

    from modules.trainer.compiled_unet import compile_unet

    monkeypatch.setattr(rng_prims.graphsafe_run_with_rng_state, "_cacheable", cacheable)
    with functorch_config.patch(graphsafe_rng_functionalization=True):
        compile_unet(torch.nn.Linear(2, 2), torch.device("cpu"), image_sizes=1, dropout=False)
        assert functorch_config.graphsafe_rng_functionalization is cacheable


@pytest.mark.parametrize("cacheable", [False, True])
def test_with_cuda_graphs_checkpointed_randomness_keeps_the_graph_safe_form(cacheable, monkeypatch, caplog):
    """A CUDA graph cannot capture the plain form (it reads the random state on the host), so with
    training.cuda_graphs the graph-safe form stays; where this PyTorch cannot cache it, the run says that every
    start compiles afresh. torch.compile only wraps here (nothing runs), so a GPU-less machine can ask for CUDA."""
    import torch
    import torch._functorch.config as functorch_config
    import torch.utils._triton
    from torch._prims import rng_prims

    from modules.trainer.compiled_unet import compile_unet

    caplog.set_level("INFO")
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: True)
    monkeypatch.setattr(rng_prims.graphsafe_run_with_rng_state, "_cacheable", cacheable)
    with functorch_config.patch(graphsafe_rng_functionalization=True):
        compile_unet(torch.nn.Linear(2, 2), torch.device("cuda"), image_sizes=1, dropout=False,
                     cuda_graphs=True, checkpointing=True)
        assert functorch_config.graphsafe_rng_functionalization is True
    assert ("compiles afresh at every start" in caplog.text) is (not cacheable)
