"""`training.compile` and `training.cuda_graphs` auto: compile where it pays for the run, from the compile cache or
cold, said in one line at start; on, off and older configs' switches as before."""
from __future__ import annotations

import logging

import pytest
import torch

from modules.config import TrainConfig, config_from_dict, validate
from modules.config.validation import fsdp_blockers
from modules.trainer.compile_choice import FIGURES, CompileChoice, RunForCompile, choose
from modules.trainer.compiled_unet import graph_signature, served_from_cache
from modules.util import compile_ledger

SD15_JOB = dict(family="sd1", images_per_step=8, pixels_per_image=512 * 512, shapes=1)
"""The 5,120-image SD1.5 LoRA job of docs/Performance.md on one GPU: 640 steps of 8 images at 512 px, one shape."""


def sd15(steps: int, cached: int = 0, **changes) -> RunForCompile:
    return RunForCompile(**{**SD15_JOB, "steps": steps, "cached_shapes": cached, **changes})


def test_the_sd15_job_compiles_from_a_filled_cache_and_not_cold():
    """640 steps save about a minute with CUDA graphs: more than a compile from the cache, less than a cold one."""
    cold = choose("auto", "auto", True, sd15(640))
    assert cold == CompileChoice(False, False, cold.line)
    assert cold.line.startswith("training.compile auto: not compiling - 640 steps would save ~67 s, a cold compile "
                                "costs ~190 s; training.compile on compiles anyway and fills the cache")
    assert cold.line.endswith("(estimated from an SD1.5 LoRA at 8 images of 512 px a step on an H200).")
    warm = choose("auto", "auto", True, sd15(640, cached=1))
    assert warm.compile and warm.graphs
    assert warm.line.startswith("training.compile auto: compiling with CUDA graphs - the compile cache holds this "
                                "model's graph; 640 steps should save ~67 s, compiling from it costs ~17 s")


def test_a_long_run_pays_a_cold_compile_back_and_a_short_one_not_even_a_cached_one():
    long = choose("auto", "auto", True, sd15(3000))
    assert long.compile and "3,000 steps should save ~312 s, more than a cold compile costs ~190 s" in long.line
    short = choose("auto", "auto", True, sd15(20, cached=1))
    assert not short.compile
    assert "holds this model's graph, but 20 steps would save ~2 s, compiling from it costs ~17 s" in short.line


def test_what_the_estimate_weighs():
    """Time measured here for a compile from the cache replaces the family's figure; each shape not in the cache
    costs a cold compile; bigger images and batches save more a step; without graphs a step saves less."""
    assert choose("auto", "auto", True, sd15(100, cached=1, measured_cached_s=5.0)).compile
    assert not choose("auto", "auto", True, sd15(100, cached=1)).compile
    mixed = choose("auto", "auto", True, sd15(3000, cached=1, shapes=2))
    assert "holds 1 of the 2 batch shapes' graphs" in mixed.line and "compiling costs ~207 s" in mixed.line
    assert choose("auto", "auto", True, sd15(1000, pixels_per_image=1024 * 1024)).compile
    assert not choose("auto", "auto", True, sd15(1000)).compile
    without_graphs = choose("auto", "off", True, sd15(640, cached=1))
    assert without_graphs == CompileChoice(True, False, without_graphs.line)
    assert "compiling -" in without_graphs.line and "should save ~26 s" in without_graphs.line
    split = choose("auto", "auto", True, sd15(640, cached=1, split_at_buckets=True))
    assert "compiling from it costs ~54 s" in split.line


@pytest.mark.parametrize("on_gpu, blocked, family, words", [
    (False, None, "sd1", "on the CPU a compiled denoiser runs the same kernels, so compiling saves nothing"),
    (True, "layer offload moves the denoiser's weights at every call", "sd1",
     "layer offload moves the denoiser's weights at every call"),
    (True, None, "flux", "no measured figures for Flux.1 (dev, schnell) to weigh a compile against; "
                         "training.compile on compiles it"),
])
def test_auto_leaves_out_what_it_cannot_weigh_or_compile_and_says_why(on_gpu, blocked, family, words):
    choice = choose("auto", "auto", on_gpu, sd15(100_000, cached=1, family=family), blocked)
    assert not choice.compile and not choice.graphs
    assert choice.line == f"training.compile auto: not compiling - {words}."


def test_on_and_off_are_as_before_and_say_nothing():
    """`on` with graphs `on` keeps the gradient buffers even on a CPU (which captures nothing), as before."""
    assert choose("off", "on", True, sd15(10**6, cached=1)) == CompileChoice(False, False)
    assert choose("on", "on", False, None) == CompileChoice(True, True)
    assert choose("on", "auto", False, None) == CompileChoice(True, False)
    assert choose("on", "auto", True, None) == CompileChoice(True, True)
    assert choose("on", "auto", True, None, graphs_unavailable="torch 2.11") == CompileChoice(True, False)
    assert choose("on", "off", True, None) == CompileChoice(True, False)


def test_every_figure_saves_a_share_of_the_step_and_costs_less_from_the_cache():
    for family, figures in FIGURES.items():
        assert 0 < figures.saving(False) <= figures.saving(True) < 1, family
        assert 0 < figures.cached_compile_s < figures.cold_compile_s, family


def test_older_configs_switches_read_as_auto_and_on():
    """Every saved config wrote the old default false: it reads as auto, which compiles only where it pays."""
    training = config_from_dict({"__version": 4, "training": {"compile": False, "cuda_graphs": False}}).training
    assert (training.compile, training.cuda_graphs) == ("auto", "auto")
    training = config_from_dict({"__version": 4, "training": {"compile": True, "cuda_graphs": True}}).training
    assert (training.compile, training.cuda_graphs) == ("on", "on")
    assert (TrainConfig().training.compile, TrainConfig().training.cuda_graphs) == ("auto", "auto")


def test_auto_is_no_blocker_where_on_is_refused():
    """FSDP, layer offload and context parallelism refuse `on`; `auto` leaves the compile out there itself."""
    cfg = TrainConfig()
    cfg.model.base_model = "builtin:demo"
    cfg.multi_gpu.layer_offload, cfg.training.gradient_checkpointing = "4", True
    assert not [p for p in validate(cfg, check_paths=False) if "compile" in p] and not fsdp_blockers(cfg)
    cfg.training.compile = "on"
    assert [p for p in validate(cfg, check_paths=False) if "training.compile to auto or off" in p]
    assert [b for b in fsdp_blockers(cfg) if "set training.compile to auto or off" in b]


def test_the_ledger_notes_cold_and_cached_compiles(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert compile_ledger.noted("sig", (8, 4, 64, 64)) is None
    compile_ledger.note_compiled("sig", (8, 4, 64, 64), 190.04, from_cache=False)
    compile_ledger.note_compiled("sig", (8, 4, 64, 64), 16.5, from_cache=True)
    assert compile_ledger.noted("sig", (8, 4, 64, 64)) | {"written": None} == {
        "shape": [8, 4, 64, 64], "written": None, "cold_s": 190.0, "cached_s": 16.5}
    assert compile_ledger.noted("sig", (8, 4, 64, 48)) is None and compile_ledger.noted("other", (8, 4, 64, 64)) is None
    assert list(tmp_path.iterdir()) == [tmp_path / "tandem-graphs"]


def test_a_compile_from_the_cache_is_told_from_a_cold_one():
    before = {"autograd cache hits": 2.0, "autograd cache misses": 1.0, "kernel cache hits": 0.0}
    assert served_from_cache(before, {**before, "autograd cache hits": 3.0, "kernel cache hits": 2.0})
    assert not served_from_cache(before, {**before, "autograd cache misses": 2.0})
    assert not served_from_cache(before, before)


def test_the_signature_changes_with_what_changes_the_graph():
    def model(rank: int, dtype=torch.float32, train=True):
        module = torch.nn.Sequential(torch.nn.Linear(4, rank), torch.nn.Linear(rank, 4)).to(dtype)
        module[0].weight.requires_grad_(train)
        return module

    cpu = torch.device("cpu")
    base = graph_signature(model(2), cpu, checkpointing=False)
    assert graph_signature(model(2), cpu, checkpointing=False) == base
    for other in (graph_signature(model(3), cpu, checkpointing=False),
                  graph_signature(model(2, torch.bfloat16), cpu, checkpointing=False),
                  graph_signature(model(2, train=False), cpu, checkpointing=False),
                  graph_signature(model(2), cpu, checkpointing=True)):
        assert other != base


@pytest.mark.slow
def test_a_run_weighs_its_own_steps_shapes_and_cache(tandem_home, tmp_path, monkeypatch, caplog):
    """On the CPU `auto` says it does not compile; what it would weigh on a GPU is the run's own: its steps, the
    per-process batch of each aspect bucket's latents, and which of them the compile cache holds."""
    from modules.trainer.generic_trainer import GenericTrainer
    from tests.trainer_helpers import demo_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    caplog.set_level(logging.INFO)
    trainer = GenericTrainer(demo_config(tmp_path / "ws", tmp_path / "cache", "training.max_steps=5",
                                         "training.batch_size=2", "training.gradient_accumulation_steps=2"))
    trainer.start()
    assert trainer.compiling == CompileChoice(False, False, "training.compile auto: not compiling - on the CPU a "
                                              "compiled denoiser runs the same kernels, so compiling saves nothing.")
    assert trainer.compiling.line in caplog.text and trainer.compile_check is None
    assert trainer.model.unet_call is trainer.bundle.unet
    signature = graph_signature(trainer.bundle.denoiser, trainer.device, precision="bf16")
    run = trainer.run_for_compile(signature, split=False)
    sizes = {trainer.dataset.bucket_sizes[b] for b in trainer.dataset.buckets}
    assert (run.family, run.steps, run.images_per_step, run.cached_shapes) == ("sd1", 5, 4, 0)
    assert run.shapes == len(sizes) >= 1 and min(w * h for w, h in sizes) <= run.pixels_per_image
    latents = trainer.dataset[0]["latents"]
    compile_ledger.note_compiled(signature, (2, *latents.shape), 12.0, from_cache=True)
    held = trainer.run_for_compile(signature, split=False)
    assert held.cached_shapes == 1 and held.measured_cached_s == 12.0


@pytest.mark.parametrize("value, setting", [(True, "on"), (False, "off")])
def test_a_onetrainer_compile_switch_reads_as_on_or_off(tmp_path, value, setting):
    import json

    from modules.importing.config_import import import_config
    config = tmp_path / "ot.json"
    config.write_text(json.dumps({"__version": 10, "training_method": "LORA", "model_type": "STABLE_DIFFUSION_15",
                                  "base_model_name": "/models/sd15.safetensors", "compile": value}))
    assert import_config(config).config().training.compile == setting


def test_the_end_to_end_harness_keeps_what_auto_chose():
    from modules.benchmark.end_to_end import _read_line
    line = choose("auto", "auto", True, sd15(640, cached=1)).line
    marks: dict = {}
    _read_line(line + "\n", 12.0, marks, {}, [])
    assert marks["compile_choice"] == line[len("training.compile auto: "):]
    assert marks["compile_choice"].startswith("compiling with CUDA graphs - the compile cache holds")
