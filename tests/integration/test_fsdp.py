"""Sharded training (multi_gpu.strategy = fsdp, FSDP2) on 2 CPU processes over gloo, through the launcher.

The property is the same as DDP's: 2 processes x batch 2 train what 1 process x batch 4 trains (fp32,
relative L2 distance of all trained weights <= 1e-5), on the first 16 items of the demo's data
(`demo_data_subset`: 4 steps of 4; the whole dataset's scan and cache would cost more than the steps).
DDP == 1 process is tests/integration/test_distributed.py's; here FSDP is held to the 1-process run. Three launched runs
(CI time), each serving several assertions:
- the SD demo's full fine-tune with everything around it (text encoder trained, accumulation, per-block
  checkpointing, a sharded EMA, samples, CPU offload), continuing a 1-process backup (whole tensors into
  shards); its sharded backups, streamed final models (raw and EMA, folder and single file) and resumes;
- its sharded backup resumed on 2 processes (exactly) and on 1;
- a Flux LoRA from scratch through torchrun (a transformer family: SD3's blocks are sharded by the same
  `flow_base.repeated_blocks`), its text encoder's adapters too, with the validation loss.
That sharded backups leave buffers out (SD3's position embedding) is tests/unit/test_backups.py's.
"""
from __future__ import annotations

from pathlib import Path

import numpy
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from modules.distributed.launch import launch
from modules.trainer.backup import latest_backup
from modules.trainer.sharded_backup import SHARDS, read_trained_weights
from modules.util.run_protocol import parse_event_line
from tests.trainer_helpers import demo_config, demo_data_subset, relative_l2, train

# Adam turns gradients that are pure rounding noise (biases before a GroupNorm) into full-size steps, so
# the order of a sum alone moves those weights by ~lr (measured: rel. L2 7e-5 after 10 steps, all of it
# in such biases); SGD with momentum (optimizer state that is sharded and resumed too) keeps it tight.
COMMON = ("training.max_steps=4", "save.backup_every_n_steps=2", "training.precision=fp32",
          "save.full_format=both", "optimizer.name=sgd", "training.learning_rate=0.05")
OFFLOAD = "multi_gpu.fsdp_cpu_offload=true"
"""FSDP2's CPUOffloadPolicy: on CPU processes nothing moves, but the offloading code paths run."""
AROUND = ("training.train_text_encoder=true", "training.ema=true", "save.ema_weights=both",
          "sampling.every_n_steps=2", "sampling.inference_steps=2")
"""What the SD full fine-tune trains with: the text encoder's layers sharded too, a sharded EMA, samples
(3 prompts on 2 ranks, each rendering as often, the trained parts called through the sharded root).
Accumulation and checkpointing are the Flux LoRA's."""


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def few_items(cache: Path, preset: str) -> list[str]:
    """The first 16 items of the preset's data, copied beside the module's cache: 4 steps of 4."""
    return demo_data_subset(cache.with_name(cache.name + "-data"), preset, 16)


def one_process(workspace, cache, *overrides, method="full", resume=None, preset="#demo"):
    """Returns the trainer (its callbacks hold the events)."""
    return train(demo_config(workspace, cache, *COMMON, *few_items(cache, preset), "training.batch_size=4", *overrides,
                             method=method, preset=preset), resume=resume)


def sharded(workspace, cache, *overrides, method="full", resume=None, preset="#demo", launcher="spawn"):
    cfg = demo_config(workspace, cache, *COMMON, *few_items(cache, preset), "training.batch_size=2",
                      "multi_gpu.enabled=true", "multi_gpu.num_gpus=2", f"multi_gpu.launcher={launcher}",
                      "multi_gpu.strategy=fsdp", *overrides, method=method, preset=preset)
    assert launch(cfg, resume=resume) == 0


def backup_weights(workspace: Path, step: int | None = None) -> dict[str, torch.Tensor]:
    """The trained weights of a backup (newest, or of `step`), sharded or not, by the names of
    `weights.safetensors` (`unet.…`, `transformer.…`)."""
    return read_trained_weights(backup_path(workspace, step))


def backup_path(workspace: Path, step: int | None = None) -> Path:
    newest = latest_backup(Path(workspace) / "backups").path
    return newest if step is None else newest.parent / f"step-{step:08d}"


def output(workspace: Path, name: str) -> dict[str, torch.Tensor]:
    """A saved model's tensors: a single file, or a diffusers folder's UNet and text encoder."""
    path = Path(workspace) / "output" / name
    if path.suffix == ".safetensors":
        return load_file(path)
    return {f"{part}/{k}": v for part, file in (("unet", "unet/diffusion_pytorch_model.safetensors"),
                                                ("text_encoder", "text_encoder/model.safetensors"))
            for k, v in load_file(path / file).items()}


def sd_runs(root: Path, cache_dir: Path) -> Path:
    """The SD demo, full fine-tune, 4 steps of 4: 1 process (backups at 2 and 4), and FSDP 2 processes x 2
    with CPU offload continuing the 1-process backup of step 2 (sharded backups at 3 and 4)."""
    one_process(root / "one", cache_dir, *AROUND)
    sharded(root / "fsdp", cache_dir, *AROUND, OFFLOAD, "save.backup_every_n_steps=1",
            resume=str(backup_path(root / "one", 2)))
    return root


@pytest.mark.slow
def test_fsdp_full_fine_tune_equals_one_process_saves_streamed_and_resumes(tmp_path, cache_dir):
    """One test over the runs of sd_runs (a module fixture was re-run by every pytest-xdist worker that took
    one of its tests: CI time):
    - whole tensors (weights.safetensors, the optimizer state by index, the EMA) resumed into shards, 2 steps
      under FSDP: as the 1 process trains them - the UNet and the text encoder, raw and EMA, and the samples;
    - the file FSDP's ranks wrote together (gathering one block at a time) is the file one process writes
      from the same weights;
    - from the step-3 sharded backup, FSDP on 2 processes continues exactly as the uninterrupted run, and
      1 process (DCP reshards every tensor into a whole one) as the 1-process run."""
    runs = sd_runs(tmp_path / "runs", cache_dir)
    _check_fsdp_full_fine_tune_equals_one_process(runs)
    _check_streamed_save_of_a_sharded_run_equals_the_whole_model_save(runs, tmp_path)
    _check_resume_from_a_sharded_backup_on_two_and_on_one_process(runs, tmp_path / "resume", cache_dir)


def _check_fsdp_full_fine_tune_equals_one_process(sd_runs):
    """Whole tensors (weights.safetensors, the optimizer state by index, the EMA) resumed into shards, 2 steps
    under FSDP: as the 1 process trains them - the UNet and the text encoder, raw and EMA, and the samples."""
    one, fsdp = backup_weights(sd_runs / "one"), backup_weights(sd_runs / "fsdp")
    assert {k.split(".")[0] for k in fsdp} == {"unet", "text_encoder_0"}
    assert relative_l2(fsdp, one) <= 1e-5
    start = backup_weights(sd_runs / "one", 2)
    assert relative_l2(fsdp, start) > 1e-4, "the weights did not train (the comparison would be vacuous)"
    # The backups are DCP's: every rank wrote its own shards, rank 0 the plain state; no weights file.
    folder = latest_backup(sd_runs / "fsdp" / "backups").path
    assert sorted(p.name for p in (folder / SHARDS).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (folder / "weights.safetensors").exists()
    # The streamed final models (gathered block by block): raw and EMA, single file and diffusers folder.
    for name in ("demo.safetensors", "demo-ema.safetensors", "demo", "demo-ema"):
        assert relative_l2(output(sd_runs / "fsdp", name), output(sd_runs / "one", name)) <= 1e-5, name
    ema, raw = output(sd_runs / "fsdp", "demo-ema.safetensors"), output(sd_runs / "fsdp", "demo.safetensors")
    assert relative_l2(ema, raw) > 1e-7, "the EMA file holds the EMA weights"
    samples = {run: sorted((sd_runs / run / "samples").glob("*/step-0000004-*.png")) for run in ("one", "fsdp")}
    assert [p.name for p in samples["fsdp"]] == [p.name for p in samples["one"]] and len(samples["one"]) == 3
    for mine, theirs in zip(samples["fsdp"], samples["one"]):
        difference = torch.from_numpy(numpy.asarray(Image.open(mine), dtype=numpy.float32) -
                                      numpy.asarray(Image.open(theirs), dtype=numpy.float32))
        assert difference.abs().mean() < 1.0, mine.name  # of 255: the same weights render the same image


def _check_streamed_save_of_a_sharded_run_equals_the_whole_model_save(sd_runs, tmp_path):
    """The file FSDP's ranks wrote together (gathering one block at a time) is the file one process
    writes from the same weights: same names, order, metadata, bytes."""
    from modules.config import load_config
    from modules.model.loading import load_model
    from modules.model.saving import save_full_single_file

    cfg = load_config("#demo", ["general.device=cpu", "training.method=full", "training.train_text_encoder=true"])
    bundle = load_model(cfg.model, "cpu", cfg.training)
    weights = backup_weights(sd_runs / "fsdp")
    bundle.unet.load_state_dict({k.removeprefix("unet."): v for k, v in weights.items() if k.startswith("unet.")})
    encoder = {k.removeprefix("text_encoder_0."): v for k, v in weights.items() if k.startswith("text_encoder_0.")}
    bundle.text_encoders[0].load_state_dict(encoder, strict=False)  # its position ids are no trained weight
    streamed = sd_runs / "fsdp" / "output" / "demo.safetensors"
    with safe_open(streamed, "pt") as f:
        metadata = f.metadata()
    # The same ModelSpec as the run wrote (its title, resolution and step; the date is the save's).
    own = {k: metadata[k] for k in ("modelspec.title", "modelspec.resolution", "modelspec.date", "tandem_step")}
    reference = save_full_single_file(bundle, tmp_path / "whole.safetensors", "fp32", metadata=own)
    assert metadata["format"] == "pt" and metadata["modelspec.architecture"] == "stable-diffusion-v1"
    assert streamed.read_bytes() == reference.read_bytes()


def _check_resume_from_a_sharded_backup_on_two_and_on_one_process(sd_runs, tmp_path, cache_dir):
    """From the step-3 sharded backup (weights, optimizer state, EMA): FSDP on 2 processes continues exactly
    as the uninterrupted run; 1 process (DCP reshards every tensor into a whole one) as the 1-process run."""
    step3 = str(backup_path(sd_runs / "fsdp", 3))
    fewer_outputs = ("sampling.every_n_steps=0", "save.full_format=single_file")  # nothing that trains
    sharded(tmp_path / "two", cache_dir, *AROUND, OFFLOAD, *fewer_outputs, resume=step3)
    uninterrupted = backup_weights(sd_runs / "fsdp")
    resumed = backup_weights(tmp_path / "two")
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)
    # The EMA continued too: the EMA model saved at the end is the uninterrupted run's.
    ema = output(tmp_path / "two", "demo-ema.safetensors")
    assert all(torch.equal(v, output(sd_runs / "fsdp", "demo-ema.safetensors")[k]) for k, v in ema.items())

    one_process(tmp_path / "one", cache_dir, *AROUND, *fewer_outputs, resume=step3)
    assert relative_l2(backup_weights(tmp_path / "one"), backup_weights(sd_runs / "one")) <= 1e-5


@pytest.mark.slow
def test_flux_lora_under_fsdp_through_torchrun_equals_one_process(tmp_path, cache_dir, capfd, monkeypatch):
    """LoRA from scratch (the adapters' random start broadcast from rank 0, the frozen base sharded too) on
    Flux's double- and single-stream blocks and its CLIP text encoder (its layers sharded), 2 micro-batches
    per step, checkpointing, a sharded EMA: as 1 process trains it, in the raw and EMA LoRA files gathered on
    rank 0 too. And the validation loss of 5 held-out images (3 on rank 0, 2 on rank 1, which runs one
    forward more to keep the gathers in step) as 1 process scores it."""
    from tests.unit.test_validation_loss import validation_folder
    common = ("training.train_text_encoder=true", "training.gradient_accumulation_steps=2",
              "training.gradient_checkpointing=true", "training.ema=true", "save.ema_weights=both",
              "training.max_steps=2", "save.backup_every_n_steps=2", "training.validation_every_n_steps=1",
              f"data.concepts[1].path={validation_folder(tmp_path)}", "data.concepts[1].role=validation")
    one = one_process(tmp_path / "one", cache_dir, *common, method="lora", preset="#demo_flux")
    monkeypatch.setenv("TANDEM_EVENTS", "1")
    capfd.readouterr()
    sharded(tmp_path / "fsdp", cache_dir, *common, method="lora", preset="#demo_flux", launcher="torchrun")
    events = [e for e in map(parse_event_line, capfd.readouterr().out.splitlines()) if e and e["type"] == "validation"]
    one_events = one.callbacks.of_type("validation")
    assert [e["step"] for e in events] == [e["step"] for e in one_events] == [0, 1, 2]
    assert all(e["images"] == 5 for e in events)
    for mine, theirs in zip(events, one_events):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=0)
    ones, fsdp = backup_weights(tmp_path / "one"), backup_weights(tmp_path / "fsdp")
    assert fsdp and all("lora" in k for k in fsdp)
    assert {k.split(".")[0] for k in fsdp} == {"transformer", "text_encoder_0"}
    assert relative_l2(fsdp, ones) <= 1e-5
    up = [k for k in fsdp if "lora_B" in k]
    assert up and any(float(fsdp[k].abs().max()) > 0 for k in up), "the adapters did not train"
    for name in ("demo_flux.safetensors", "demo_flux-ema.safetensors"):
        assert relative_l2(output(tmp_path / "fsdp", name), output(tmp_path / "one", name)) <= 1e-5, name


def test_a_part_called_through_the_root_keeps_its_own_signature():
    """A pipeline that passes the denoiser only what its forward names (diffusers' modular pipelines: Flux.3's)
    must see the part's parameters, not the root's `run_part(name, *args, **kwargs)`."""
    import inspect

    from modules.distributed.fsdp import calls_through_root

    class Part(torch.nn.Module):
        def forward(self, hidden_states, img_ids, scale=1.0):
            return hidden_states * scale + img_ids

    class Root(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.unet = Part()

        def run_part(self, name, *args, **kwargs):
            part = self.get_submodule(name)
            return type(part).forward(part, *args, **kwargs)

    root = Root()
    with calls_through_root(root, ["unet"]):
        assert list(inspect.signature(root.unet.forward).parameters) == ["hidden_states", "img_ids", "scale"]
        assert root.unet(torch.ones(1), img_ids=torch.ones(1), scale=2.0).item() == 3.0
    assert "forward" not in vars(root.unet)
