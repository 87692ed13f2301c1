"""The layering docs/Architecture.md shows: imports point one way, and rank duties are decided once."""
from __future__ import annotations

import ast
from pathlib import Path

from modules.trainer.callbacks import RecordingCallbacks, TrainingCallbacks
from modules.trainer.rank_duties import rank_duties

MODULES = Path(__file__).resolve().parents[1] / "modules"
LAYERS = ["util", "config", "data", "model", "trainer", "distributed", "remote"]
"""Each package may import those before it, never one after it."""


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
    from modules.config.launch_spec import lr_scale_factor
    from modules.config.validation import CHOICES
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
