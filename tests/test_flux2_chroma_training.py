"""Flux.2 and Chroma through the real trainer (the built-in tiny models, CPU, gloo): 2 processes x B train
what 1 process x 2B trains - LoRA and full fine-tune, DDP and FSDP (one of each per family) - a sharded
run resumed from a one-process backup ends where the one process ends, and the outputs load where other
tools load them. Lean: four short runs per family."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modules.config.model_families import FAMILIES
from modules.config.train_config import ModelConfig
from modules.distributed.launch import launch
from modules.model import load_model
from tests.test_flux2_chroma import pipeline_class
from tests.test_flux2_chroma_lora import prediction
from tests.test_fsdp import backup_path, backup_weights
from tests.trainer_helpers import demo_config, relative_l2, train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.usefixtures("one_torch_thread")]

COMMON = ("training.precision=fp32", "optimizer.name=sgd", "training.learning_rate=0.05", "model.t5_max_length=24",
          "save.lora_format=both", "save.full_format=both", "save.output_name=tiny")
# Which strategy each family's LoRA and full fine-tune run with on 2 processes: every family both ways.
STRATEGIES = {("chroma", "lora"): "ddp", ("chroma", "full"): "fsdp", ("flux2", "lora"): "fsdp", ("flux2", "full"): "ddp"}


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def config(workspace: Path, cache: Path, name: str, method: str, *overrides: str):
    targets = ",".join(f'"{t}"' for t in FAMILIES[name].lora_targets)
    return demo_config(workspace, cache, *COMMON, f"training.lora_target_modules=[{targets}]", *overrides,
                       method=method, preset=f"#demo_{name}")


def two_processes(workspace: Path, cache: Path, name: str, method: str, *overrides: str, resume=None):
    cfg = config(workspace, cache, name, method, "training.batch_size=4", "multi_gpu.enabled=true",
                 "multi_gpu.num_gpus=2", "multi_gpu.launcher=spawn",
                 f"multi_gpu.strategy={STRATEGIES[(name, method)]}", *overrides)
    assert launch(cfg, resume=resume) == 0


@pytest.mark.parametrize("name", ["chroma", "flux2"])
def test_lora_on_two_processes_equals_one_and_loads_in_diffusers(tmp_path, cache_dir, name):
    steps = ("training.max_steps=3", "save.backup_every_n_steps=3")
    one = train(config(tmp_path / "one", cache_dir, name, "lora", *steps, "training.batch_size=8"))
    two_processes(tmp_path / "two", cache_dir, name, "lora", *steps)
    single, double = backup_weights(tmp_path / "one"), backup_weights(tmp_path / "two")
    assert single and all(k.startswith("transformer.") and "lora" in k for k in single)
    assert relative_l2(double, single) <= 1e-5

    output = Path(one.callbacks.of_type("done")[-1]["output"])
    peft_file = output.with_name(output.name.replace(".safetensors", ".peft.safetensors"))
    assert output.is_file() and peft_file.is_file()
    bundle = one.bundle
    for module in bundle.modules().values():
        module.eval()
    pipeline = pipeline_class(name).from_pretrained(bundle.family.build_demo(), local_files_only=True)
    pipeline.load_lora_weights(str(peft_file))
    torch.testing.assert_close(prediction(bundle, pipeline.transformer), prediction(bundle, bundle.denoiser),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["chroma", "flux2"])
def test_full_fine_tune_on_two_processes_resumed_from_one_equals_one(tmp_path, cache_dir, name):
    """One process trains 4 steps (backups at 2 and 4); two processes continue its step-2 backup to step 4:
    the same weights, and the same files in the diffusers folder and the single file."""
    steps = ("training.max_steps=4", "save.backup_every_n_steps=2")
    one = train(config(tmp_path / "one", cache_dir, name, "full", *steps, "training.batch_size=8"))
    two_processes(tmp_path / "two", cache_dir, name, "full", *steps, resume=str(backup_path(tmp_path / "one", 2)))
    assert relative_l2(backup_weights(tmp_path / "two"), backup_weights(tmp_path / "one")) <= 1e-5

    folder = Path(one.callbacks.of_type("done")[-1]["output"])
    trained = one.bundle.denoiser.state_dict()
    for workspace in (tmp_path / "one", tmp_path / "two"):
        out = workspace / "output" / folder.name
        for base in (ModelConfig(base_model=str(out), t5_max_length=24),
                     ModelConfig(base_model=str(out.with_name(out.name + ".safetensors")), components_folder=str(out),
                                 t5_max_length=24)):
            loaded = load_model(base).denoiser.state_dict()
            assert relative_l2(loaded, trained) <= 1e-5, base.base_model
