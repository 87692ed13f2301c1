"""The layering docs/Architecture.md shows: imports point one way, and rank duties are decided once."""
from __future__ import annotations

import ast
from pathlib import Path

from modules.trainer.callbacks import RecordingCallbacks, TrainingCallbacks
from modules.trainer.rank_duties import rank_duties

MODULES = Path(__file__).resolve().parents[2] / "modules"
LAYERS = ["util", "families", "config", "importing", "planning", "launch", "data", "model", "trainer", "distributed",
          "remote", "queue"]
"""Each package may import those before it, never one after it."""
TORCH_FREE = ["families", "config", "importing", "planning", "launch"]
"""The packages the GUI and the launcher's checks import before (or without) PyTorch: no module of theirs imports
torch or a library built on it, not even inside a function."""
TORCH_LIBRARIES = {"torch", "diffusers", "transformers", "peft", "safetensors", "accelerate", "torchvision"}


def _imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        found.update(name.split(".")[1] for name in names if name.startswith("modules.") and name.count(".") >= 1)
    return found


def test_no_import_runs_back_up_the_layers():
    upward = []
    for layer, package in enumerate(LAYERS):
        for path in sorted((MODULES / package).rglob("*.py")):
            for imported in _imported_packages(path) & set(LAYERS[layer + 1:]):
                upward.append(f"{path.relative_to(MODULES.parent)} imports modules.{imported}")
    assert not upward, "\n".join(upward)


def test_the_torch_free_packages_import_no_torch():
    found = []
    for package in TORCH_FREE:
        for path in sorted((MODULES / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                found += [f"{path.relative_to(MODULES.parent)} imports {name}" for name in names
                          if name.split(".")[0] in TORCH_LIBRARIES]
    assert not found, "\n".join(found)


def _module_imports() -> dict[str, set[str]]:
    """Every module of `modules/` (a package's `__init__` as the package) -> the modules of `modules/` it
    imports anywhere in its file: at the top, inside functions (lazy imports) and under TYPE_CHECKING alike,
    each resolved to the most specific module that exists (`from modules.model import bundle` names the
    module `modules.model.bundle`)."""
    files = {}
    for path in MODULES.rglob("*.py"):
        parts = list(path.relative_to(MODULES.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        files[".".join(parts)] = (path, parts if is_package else parts[:-1])  # the package relative imports start in
    graph = {}
    for name, (path, package) in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
                module = ".".join(filter(None, [base, node.module or ""]))
                candidates = [module] + [f"{module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            for candidate in candidates:
                while candidate and candidate not in files:
                    candidate = candidate.rpartition(".")[0]
                if candidate and candidate != name:
                    found.add(candidate)
        graph[name] = found
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or around a circle (Tarjan's strongly
    connected components of more than one module)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_module_imports_a_module_that_imports_it_back():
    """No circle of imports between modules, not even through a function-level import: each module can be
    read (and changed) knowing only what it imports."""
    graph = _module_imports()
    circles = _circles(graph)
    described = ["  " + " | ".join(f"{m} -> {', '.join(sorted(graph[m] & set(group)))}" for m in group)
                 for group in circles]
    assert not circles, "modules that import each other:\n" + "\n".join(described)


def test_the_circle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_only_rank_0_reports():
    given = RecordingCallbacks()
    lead = rank_duties(0, given)
    assert lead.leads and lead.callbacks is given
    other = rank_duties(1, given)
    assert not other.leads and type(other.callbacks) is TrainingCallbacks
    other.callbacks.on_event("loss", step=1, loss=0.5)
    assert given.events == []


def test_every_declared_choice_has_an_implementation():
    """The code that acts on a choice (LR scaling, optimizers, schedules) knows every choice the field declares."""
    import pytest
    import torch

    from modules.config import OptimizerConfig, TrainingConfig
    from modules.config.validation import CHOICES
    from modules.launch.spec import lr_scale_factor
    from modules.trainer.optim import build_optimizer, lr_lambda

    for mode in CHOICES[("multi_gpu", "lr_scaling")]:
        assert lr_scale_factor(mode, 4) >= 1.0
    with pytest.raises(ValueError, match="unknown mode"):
        lr_scale_factor("cubic", 4)
    params = [torch.nn.Parameter(torch.zeros(2))]
    for name in CHOICES[("optimizer", "name")]:
        try:
            build_optimizer([{"params": params, "lr": 1.0}], OptimizerConfig(name=name), torch.device("cpu"))
        except RuntimeError as e:  # an optional package that is not installed here: named, with the way out
            assert "pip install" in str(e), (name, e)
    shapes = {}
    for schedule in CHOICES[("training", "lr_scheduler")]:
        factor = lr_lambda(TrainingConfig(lr_scheduler=schedule), total_steps=10)
        shapes[schedule] = tuple(round(factor(step), 6) for step in range(10))
    assert len(set(shapes.values())) == len(shapes), "each schedule shapes the LR its own way"
