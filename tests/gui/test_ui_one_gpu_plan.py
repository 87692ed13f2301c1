"""The GUI shows the memory plan of one GPU as it shows several's: with Multi-GPU off, the plan of the one
process on the first GPU - layer offload of n blocks, an fp8 base, checkpointing - with the fields it sets and why
(the faster plans that do not fit), from the same planner as the trainer's start (Xvfb)."""
from __future__ import annotations

import pytest

from tests.gui.test_ui_widgets import app_factory, pump  # noqa: F401 - the fixture, shared
from ui.gpu_info import GpuInfo


@pytest.mark.slow
def test_one_gpu_gets_its_plan_with_the_fields_it_sets_and_why(app_factory):  # noqa: F811
    app, _ = app_factory(gpus=[GpuInfo(0, "Fake GPU", 24 * 1024)])
    frame = app.multi_gpu
    assert app.model.cfg.multi_gpu.enabled is False
    for field, value in (("training.method", "lora"), ("training.batch_size", "1"), ("model.model_type", "qwen"),
                         ("model.base_model", "models/Qwen-Image"), ("data.resolution", "1024")):
        app.binder.fields[field].var.set(value)
    assert pump(app, lambda: "GiB per GPU · sets" in frame.memory.cget("text"), timeout=60), frame.memory.cget("text")
    text = frame.memory.cget("text")
    assert text.startswith("Memory plan for one GPU of 24 GiB (card): one process + "), text
    assert "· faster plans do not fit: one process ~" in text, text  # why: the plain one does not fit
    sets = text.split("· sets ", 1)[1].split(" · ")[0]
    # The fields it sets, named as the window names them (tab › label), with their values.
    assert "multi_gpu.layer_offload" not in sets and "Layer offload" in sets, sets
    assert app.model.cfg.multi_gpu.layer_offload == "auto", "showing a plan changes no field"
    # A smaller card: more of the base swaps, or an fp8 base.
    app.binder.fields["multi_gpu.memory_limit_gib"].var.set("12")
    assert pump(app, lambda: "one GPU of 12 GiB (limit)" in frame.memory.cget("text"), timeout=60), \
        frame.memory.cget("text")
    assert "layer offload (" in frame.memory.cget("text")
    # Training on the CPU: no GPU plan.
    app.binder.fields["general.device"].var.set("cpu")
    assert pump(app, lambda: frame.memory.cget("text") == "", timeout=10), frame.memory.cget("text")
