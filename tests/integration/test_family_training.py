"""Every registered family with a built-in model, through the real trainer on CPU (gloo): parametrised over the
registry (`modules/families/registry.py`), so a family gets these checks by being registered.

For each family, on its demo preset (`#demo_<family>`) with the first 8 items of its data (`demo_data_subset`:
the whole demo dataset's scan and cache would be most of each run), tiny and few steps:
- every trained parameter reaches the loss, LoRA (the family's own targets) and full fine-tune - what
  DistributedDataParallel needs, or it stops at step 2 (`ModelFamily.unused_modules` names what cannot);
- LoRA: 1 process x batch 4 trains 2 steps; 2 processes x batch 2 under FSDP (the family's blocks sharded) resume
  its step-1 backup and end on its step-2 weights (N x B == 1 x NB, and an exact resume), rendering samples (clips
  for a video family) from both processes; the saved peft LoRA, loaded by the family's diffusers pipeline
  (`load_lora_weights`), gives the trainer's prediction;
- full fine-tune, the trainable text encoders too: the saved diffusers folder (and the single file, with the folder
  as its components) load back with the trained weights.

The rule for 2 processes (CI's time): every family gets one 2-process run, the LoRA one above (one step, cheap).
The full fine-tune's 2-process equivalence under DDP (2 x batch 2 == 1 x 4, two steps) runs only for the families
in DDP_FAMILIES, one per code path that differs under DDP; for the others the gradient check above is what DDP
needs (a trained parameter without a gradient is what stops DDP at step 2). A new family whose text encoders or
denoiser take a path none of those take belongs in DDP_FAMILIES.

Three trainer runs per family, one of them on 2 processes (four and two for DDP_FAMILIES). Family-specific
behaviour (text encoding, packing, layouts) is tested in each family's own test file; these are what every family
must do alike."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modules.families.registry import FAMILIES, field_applies
from modules.families.text_encoders import TEXT_ENCODER_KINDS
from modules.config.train_config import ModelConfig, TrainingConfig
from modules.distributed.launch import launch
from modules.model import load_model
from modules.trainer.backup import latest_backup
from modules.trainer.sharded_backup import read_trained_weights
from modules.util.batch_slice import BatchSlice
from tests.trainer_helpers import demo_config, demo_data_subset, relative_l2, train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.usefixtures("one_torch_thread")]

DEMO_FAMILIES = [name for name, info in FAMILIES.items() if info.demo]
CAPTIONS = ["a red circle on a blue background", "a white triangle"]
TWO_PROCESSES = ("multi_gpu.enabled=true", "multi_gpu.num_gpus=2", "multi_gpu.launcher=spawn")
# One family per code path of a full fine-tune under DDP: a UNet with CLIP encoders that train (sd1), a DiT with a
# T5-class encoder (flux), an LLM text encoder loaded apart from its model (qwen), a video family (wan).
DDP_FAMILIES = ("sd1", "flux", "qwen", "wan")
ITEMS = 8
"""Items of each family's demo data the runs train on: 2 steps of batch 4 (wan: 4 clips and 4 images)."""


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def lora_targets(name: str) -> tuple[str, ...]:
    """The family's LoRA targets as its presets set them (`training.lora_target_modules`), or none to override."""
    targets = FAMILIES[name].lora_targets
    return (f"training.lora_target_modules={json.dumps(list(targets))}",) if targets else ()


def trains_text_encoders(name: str) -> bool:
    """Whether the family has a text encoder `training.train_text_encoder` trains (CLIP)."""
    return any(TEXT_ENCODER_KINDS[kind].trains for kind in FAMILIES[name].text_encoders)


def config(workspace: Path, cache: Path, name: str, method: str, *overrides: str):
    """The family's demo preset on the first ITEMS of its data (copied beside the module's cache), fp32 and SGD (the
    comparisons need exact arithmetic), a short T5 where it has one."""
    short_text = ("model.t5_max_length=24",) if field_applies("model.t5_max_length", name) else ()
    preset = FAMILIES[name].demo_preset
    data = demo_data_subset(cache.with_name(cache.name + "-data"), preset, ITEMS)
    return demo_config(workspace, cache, "training.precision=fp32", "optimizer.name=sgd", "training.learning_rate=0.05",
                       "save.output_name=tiny", *data, *short_text, *overrides, method=method, preset=preset)


def backup_weights(workspace: Path) -> dict[str, torch.Tensor]:
    """The trained weights of the newest backup, sharded (FSDP) or not."""
    return read_trained_weights(latest_backup(Path(workspace) / "backups").path)


def prediction(bundle, denoiser) -> torch.Tensor:
    """The denoiser's output for fixed latents, timesteps and captions, through the family's objective; an edit
    model's (`FamilyInfo.controls`, not optional) with a control image each, as it trained."""
    objective = bundle.family.objective(bundle, TrainingConfig())
    with torch.no_grad():
        pixels = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(3)) * 2 - 1
        latents = bundle.encode_images(pixels[:2], generator=torch.Generator().manual_seed(4))
        draw = objective.draw(tuple(latents.shape), 5, 0, 0, BatchSlice(0, 2, 2), torch.device("cpu"))
        text = bundle.encode_text(CAPTIONS)
        edits = {}
        info = FAMILIES[bundle.model_type]
        if info.controls and not info.controls_optional:
            edits["controls"] = bundle.encode_latent_distribution(pixels[1:])[0][:, None]
        return objective.predict(denoiser, objective.noisy(latents, draw), draw.timesteps, text, **edits)


@pytest.mark.parametrize("name", DEMO_FAMILIES)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_every_trained_parameter_reaches_the_loss(tandem_home, name, method):
    """One step's backward gives every parameter that trains a gradient; where one cannot get any, the family
    names it (`ModelFamily.unused_modules`) and training freezes it (Qwen-Image's last text-stream outputs)."""
    from modules.trainer.parallelism import SingleProcess
    from modules.trainer.trainable import prepare_trainable

    info = FAMILIES[name]
    bundle = load_model(ModelConfig(base_model=info.demo))
    training = TrainingConfig(method=method, train_text_encoder=method == "full" and trains_text_encoders(name),
                              **({"lora_target_modules": list(info.lora_targets)} if info.lora_targets else {}))
    params = prepare_trainable(bundle, training, SingleProcess(), torch.device("cpu"))
    objective = bundle.family.objective(bundle, training)
    with torch.no_grad():
        latents = bundle.encode_images(torch.rand(2, 3, 64, 64) * 2 - 1)
    text = bundle.encode_text(CAPTIONS)
    draw = objective.draw(tuple(latents.shape), 1, 0, 0, BatchSlice(0, 2, 2), torch.device("cpu"))
    out = objective.predict(bundle.denoiser, objective.noisy(latents, draw), draw.timesteps, text)
    objective.loss(out, objective.target(latents, draw), draw).backward()
    names = {id(p): f"{part}.{n}" for part, module in bundle.modules().items() for n, p in module.named_parameters()}
    trained = [p for p in params if p.requires_grad]
    assert trained, "nothing trains"
    unused = [names[id(p)] for p in trained if p.grad is None]
    assert not unused, f"{name}: these train but no gradient reaches them (name them in unused_modules): {unused}"


@pytest.mark.parametrize("name", DEMO_FAMILIES)
def test_lora_on_two_processes_resumes_to_what_one_trains_and_loads_in_diffusers(tmp_path, cache_dir, name):
    info = FAMILIES[name]
    # A LoRA's B starts at zero: a high rate moves it far enough from the base for the diffusers check to tell.
    common = ("training.max_steps=2", "save.backup_every_n_steps=1", "training.learning_rate=1.0", *lora_targets(name))
    one = train(config(tmp_path / "one", cache_dir, name, "lora", *common, "training.batch_size=4",
                       "save.lora_format=both"))
    single = backup_weights(tmp_path / "one")
    assert single and all(k.startswith(f"{info.denoiser}.") and "lora" in k for k in single), sorted(single)[:4]
    step_one = latest_backup(tmp_path / "one" / "backups").path.parent / "step-00000001"
    video = ("sampling.video_frames=5",) if info.video else ()
    cfg = config(tmp_path / "two", cache_dir, name, "lora", *common, "training.batch_size=2", *TWO_PROCESSES,
                 "multi_gpu.strategy=fsdp", "sampling.every_n_steps=2", "sampling.inference_steps=1", *video)
    cfg.sampling.prompts = cfg.sampling.prompts[:2]  # one each
    assert launch(cfg, resume=str(step_one)) == 0
    assert relative_l2(backup_weights(tmp_path / "two"), single) <= 1e-5
    samples = sorted((tmp_path / "two" / "samples").rglob("step-*"))
    suffix = ".webp" if info.video else ".png"
    assert [p.name for p in samples] == [f"step-0000002-0{suffix}", f"step-0000002-1{suffix}"], samples
    if info.video:  # each a clip of sampling.video_frames frames at data.video_fps
        from modules.util.animation import read_frames
        assert all(sum(ms for _, ms in read_frames(p)) == round(5 * 1000 / cfg.data.video_fps) for p in samples)

    output = Path(one.callbacks.of_type("done")[-1]["output"])
    peft_file = output.with_name(output.name.replace(".safetensors", ".peft.safetensors"))
    assert output.is_file() and peft_file.is_file()
    bundle = one.bundle
    for module in bundle.modules().values():
        module.eval()
    expected = prediction(bundle, bundle.denoiser)
    pipeline = bundle.family.stock_pipeline(bundle.family.build_demo())
    denoiser = getattr(pipeline, bundle.denoiser_name)
    base = prediction(bundle, denoiser)
    pipeline.load_lora_weights(str(peft_file))
    torch.testing.assert_close(prediction(bundle, denoiser), expected, rtol=0, atol=1e-5)
    assert not torch.allclose(base, expected, atol=1e-4), "the LoRA changed nothing: the comparison is vacuous"


@pytest.mark.parametrize("name", DEMO_FAMILIES)
def test_full_fine_tune_under_ddp_equals_one_process_and_its_saves_load_back(tmp_path, cache_dir, name):
    """DDP (DDP_FAMILIES): a parameter that never reaches the loss would stop it at step 2. The other families
    train one step in one process, for their saves."""
    info = FAMILIES[name]
    text = ("training.train_text_encoder=true",) if trains_text_encoders(name) else ()
    ddp = name in DDP_FAMILIES
    steps = 2 if ddp else 1
    common = (f"training.max_steps={steps}", f"save.backup_every_n_steps={steps}", "save.full_format=both", *text)
    one = train(config(tmp_path / "one", cache_dir, name, "full", *common, f"training.batch_size={4 if ddp else 2}"))
    single = backup_weights(tmp_path / "one")
    assert any(k.startswith(f"{info.denoiser}.") for k in single)
    assert bool(text) == any(k.startswith("text_encoder_") for k in single), "the CLIP encoders train, nothing else"
    if ddp:
        assert launch(config(tmp_path / "two", cache_dir, name, "full", *common, "training.batch_size=2",
                             *TWO_PROCESSES, "multi_gpu.strategy=ddp")) == 0
        assert relative_l2(backup_weights(tmp_path / "two"), single) <= 1e-5

    folder = Path(one.callbacks.of_type("done")[-1]["output"])
    single_file = folder.with_name(folder.name + ".safetensors")
    assert (folder / "model_index.json").is_file() and single_file.is_file()
    trained = {part: module.state_dict() for part, module in one.bundle.modules().items() if part != "vae"}
    sources = [ModelConfig(base_model=str(folder))]
    if field_applies("model.components_folder", name):
        # A built-in SD model's single file holds a tokenizer-less text encoder of the demo's own vocabulary, which
        # only its folder reads (SD single files load on their own: tests/integration/test_model_types_training.py).
        sources.append(ModelConfig(base_model=str(single_file), components_folder=str(folder)))
    for base in sources:
        loaded = load_model(base)
        assert loaded.model_type == name, base.base_model
        for part, state in trained.items():
            assert relative_l2(loaded.modules()[part].state_dict(), state) <= 1e-6, f"{part} of {base.base_model}"
