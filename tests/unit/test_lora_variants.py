"""DoRA, LoHa and LoKr: attached through peft on any family, saved in the layouts ComfyUI and diffusers
read, read back, trained on one process and two, and resumed.

What ComfyUI computes from a file is checked with `comfy_weight`, written here from ComfyUI's
`comfy/weight_adapter` (lora.py, loha.py, lokr.py, base.py `weight_decompose`): the weight the program
that loads the file would use must be the weight Tandem trained.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from modules.config import TrainConfig, validate
from modules.config.train_config import ModelConfig, TrainingConfig
from modules.model import add_lora, load_model, save_lora
from modules.model.lora import lora_modules
from modules.model.lora_reading import apply_lora, read_lora
from modules.model.lora_variants import adapted_layers
from modules.trainer.generic_trainer import GenericTrainer
from tests.trainer_helpers import demo_config, latest_backup_weights, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VARIANTS = ("dora", "loha", "lokr")
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in"]  # proj_in: a 1x1 convolution in the demo UNet


def _adapted(base_model: str, lora_type: str, seed: int = 0, rank: int = 4, **extra):
    """A bundle with `lora_type` adapters whose tensors are random (a fresh adapter's delta is zero)."""
    bundle = load_model(ModelConfig(base_model=base_model))
    targets = TARGETS if base_model == "builtin:demo" else ["to_q", "to_k", "to_v", "to_out.0"]
    add_lora(bundle, TrainingConfig(lora_type=lora_type, lora_rank=rank, lora_alpha=8.0, precision="fp32",
                                    lora_target_modules=targets, **extra))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in bundle.modules().values():
            for name, param in module.named_parameters():
                if param.requires_grad:
                    noise = torch.randn(param.shape, generator=generator) * 0.2
                    param.copy_(param.abs() + noise.abs() if "magnitude" in name else noise)
    return bundle


def peft_weight(layer) -> torch.Tensor:
    """The weight an adapted peft layer computes with."""
    base = layer.get_base_layer().weight.detach().float()
    with torch.no_grad():
        weight = base + layer.get_delta_weight("default").float().reshape(base.shape)
        if hasattr(layer, "lora_magnitude_vector") and "default" in layer.lora_magnitude_vector:
            magnitude = layer.lora_magnitude_vector["default"].weight.float().reshape(-1)
            norms = weight.reshape(weight.shape[0], -1).norm(dim=1)
            weight = weight * (magnitude / norms).reshape(-1, *[1] * (weight.dim() - 1))
    return weight


def comfy_weight(weight: torch.Tensor, tensors: dict, name: str) -> torch.Tensor:
    """ComfyUI's patched weight for module `name` of a kohya/LyCORIS file (strength 1)."""
    t = {k[len(name) + 1:]: v.float() for k, v in tensors.items() if k.startswith(name + ".")}
    alpha = float(t["alpha"]) if "alpha" in t else None
    if "lora_up.weight" in t:
        up, down = t["lora_up.weight"], t["lora_down.weight"]
        diff = torch.mm(up.flatten(1), down.flatten(1)).reshape(weight.shape)
        scale = alpha / down.shape[0] if alpha is not None else 1.0
    elif "hada_w1_a" in t:
        diff = ((t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])).reshape(weight.shape)
        scale = alpha / t["hada_w1_b"].shape[0] if alpha is not None else 1.0
    else:
        dim = None
        w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
        if "lokr_w1_b" in t:
            dim = t["lokr_w1_b"].shape[0]
        if "lokr_w2" in t:
            w2 = t["lokr_w2"]
        else:
            dim = t["lokr_w2_b"].shape[0]
            w2 = t["lokr_w2_a"] @ t["lokr_w2_b"]
        if w2.dim() == 4:
            w1 = w1.unsqueeze(2).unsqueeze(2)
        diff = torch.kron(w1, w2).reshape(weight.shape)
        scale = alpha / dim if alpha is not None and dim is not None else 1.0
    if "dora_scale" not in t:
        return weight + scale * diff
    calc = weight + scale * diff
    dora_scale = t["dora_scale"]
    assert dora_scale.shape[0] == weight.shape[0]  # the output axis, which today's ComfyUI reads
    norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True).reshape(
        weight.shape[0], *[1] * (weight.dim() - 1)) + torch.finfo(weight.dtype).eps
    return calc * (dora_scale / norm)


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request, tandem_home, tmp_path_factory):
    lora_type = request.param
    folder = tmp_path_factory.mktemp(lora_type)
    bundle = _adapted("builtin:demo", lora_type)
    files = {fmt: save_lora(bundle, folder / f"{fmt}.safetensors", fmt, "fp32") for fmt in ("kohya", "peft")}
    return lora_type, bundle, files


def test_comfyui_computes_the_trained_weight_from_the_kohya_file(variant):
    lora_type, bundle, files = variant
    tensors = load_file(str(files["kohya"]))
    with safe_open(str(files["kohya"]), "pt") as f:
        metadata = f.metadata()
    assert metadata["ss_network_module"] == "lycoris.kohya" and metadata["tandem_lora_type"] == lora_type
    assert json.loads(metadata["ss_network_args"])["algo"] == ("lora" if lora_type == "dora" else lora_type)
    family = bundle.family
    layers = adapted_layers(bundle.unet)
    assert len(layers) > 20 and any(isinstance(layer.get_base_layer(), torch.nn.Conv2d) for layer in layers.values())
    for path, layer in layers.items():
        name = family.lycoris_module_name(bundle, "unet", path)
        assert name.startswith("lora_unet_") and "." not in name
        base = layer.get_base_layer().weight.detach().float()
        torch.testing.assert_close(comfy_weight(base, tensors, name), peft_weight(layer), atol=2e-5, rtol=1e-4)


def test_both_layouts_read_back_into_the_same_adapters(variant):
    lora_type, original, files = variant
    for fmt, path in files.items():
        fresh = _adapted("builtin:demo", lora_type, seed=5)
        weights = read_lora(path, fresh)
        assert (weights.layout, weights.lora_type, weights.rank["unet"], weights.alpha["unet"]) == (
            fmt, lora_type, 4, 8.0)
        apply_lora(fresh, weights)
        left, right = lora_modules(fresh)["unet"], lora_modules(original)["unet"]
        assert left.keys() == right.keys()
        for key in left:  # DoRA's magnitude goes through norms in the kohya layout: equal up to rounding
            torch.testing.assert_close(left[key], right[key], atol=1e-6 if fmt == "kohya" else 0,
                                       rtol=1e-5 if fmt == "kohya" else 0)


def test_diffusers_loads_dora_and_refuses_loha_and_lokr(variant):
    """diffusers' load_lora_weights reads the peft layout of LoRA and DoRA (it sets use_dora from the
    magnitude vectors); LoHa and LoKr it refuses, which docs/Models.md tells users."""
    from diffusers import StableDiffusionPipeline

    lora_type, original, files = variant
    fresh = load_model(ModelConfig())
    pipeline = StableDiffusionPipeline(vae=fresh.vae, text_encoder=fresh.text_encoders[0],
                                       tokenizer=fresh.tokenizers[0], unet=fresh.unet, scheduler=fresh.noise_scheduler,
                                       safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    if lora_type != "dora":
        with pytest.raises(ValueError, match="Invalid LoRA checkpoint"):
            pipeline.load_lora_weights(str(files["peft"]))
        return
    pipeline.load_lora_weights(str(files["peft"]))
    generator = torch.Generator().manual_seed(0)
    latents, text = torch.randn(1, 4, 8, 8, generator=generator), torch.randn(1, 77, 64, generator=generator)
    with torch.no_grad():
        theirs = pipeline.unet(latents, torch.tensor([10]), text).sample
        ours = original.unet(latents, torch.tensor([10]), text).sample
    assert not torch.allclose(ours, fresh_output(latents, text), atol=1e-4)  # the adapters do change the output
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-4)


def fresh_output(latents, text):
    with torch.no_grad():
        return load_model(ModelConfig()).unet(latents, torch.tensor([10]), text).sample


@pytest.mark.parametrize("base_model, lora_type", [*(("builtin:demo-flux", t) for t in VARIANTS),
                                                   ("builtin:demo-sd3", "loha")])
def test_transformer_families_get_the_variants_under_diffusers_module_names(base_model, lora_type, tandem_home,
                                                                             tmp_path):
    """Flux and SD3 (fused q/k/v in their original layouts): each diffusers module gets its own
    `lora_transformer_` name, which ComfyUI maps onto the right rows of its fused weights; the weights read
    back exactly."""
    bundle = _adapted(base_model, lora_type)
    path = save_lora(bundle, tmp_path / "flux.safetensors", "kohya", "fp32")
    tensors = load_file(str(path))
    layers = adapted_layers(bundle.denoiser)
    assert layers and all(k.startswith("lora_transformer_") for k in tensors)
    for module_path, layer in layers.items():
        name = "lora_transformer_" + module_path.replace(".", "_")
        base = layer.get_base_layer().weight.detach().float()
        torch.testing.assert_close(comfy_weight(base, tensors, name), peft_weight(layer), atol=2e-5, rtol=1e-4)
    fresh = _adapted(base_model, lora_type, seed=3)
    apply_lora(fresh, read_lora(path, fresh))
    for key, value in lora_modules(bundle)["transformer"].items():
        torch.testing.assert_close(lora_modules(fresh)["transformer"][key], value, atol=1e-6, rtol=1e-5)


def test_lokr_with_split_factors_keeps_comfyuis_alpha_scale(tandem_home, tmp_path):
    """A small rank splits LoKr's second factor (w2_a @ w2_b), which ComfyUI scales by alpha / rank itself."""
    bundle = _adapted("builtin:demo", "lokr", rank=1, lokr_factor=2)
    path = save_lora(bundle, tmp_path / "lokr.safetensors", "kohya", "fp32")
    tensors = load_file(str(path))
    assert any(k.endswith(".lokr_w2_a") for k in tensors)
    for module_path, layer in adapted_layers(bundle.unet).items():
        name = bundle.family.lycoris_module_name(bundle, "unet", module_path)
        base = layer.get_base_layer().weight.detach().float()
        torch.testing.assert_close(comfy_weight(base, tensors, name), peft_weight(layer), atol=2e-5, rtol=1e-4)


def test_variant_settings_that_cannot_work_are_refused():
    cfg = TrainConfig()
    cfg.training.lora_type, cfg.training.lora_dropout = "loha", 0.1
    assert any(p.startswith("training.lora_dropout: 0.1 is LoRA's input dropout") for p in validate(cfg, False))
    cfg.training.lora_type, cfg.training.lora_dropout = "dora", 0.0
    cfg.model.unet_dtype = "fp8"
    assert any(p.startswith("training.lora_type: 'dora' measures") for p in validate(cfg, False))
    cfg.model.unet_dtype = "fp32"
    cfg.multi_gpu.enabled, cfg.multi_gpu.strategy = True, "fsdp"
    assert any(p.startswith("multi_gpu.strategy: 'fsdp' shards the adapters of plain LoRA") for p in validate(cfg, False))
    cfg.multi_gpu.strategy = "auto"
    cfg.training.lokr_factor = 0
    assert any(p.startswith("training.lokr_factor: 0") for p in validate(cfg, False))
    cfg.training.lokr_factor = 4
    assert validate(cfg, False) == []


# ------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory):
    return tmp_path_factory.mktemp("variant_cache")


@pytest.mark.slow
@pytest.mark.parametrize("lora_type", ["dora", "lokr"])  # LoHa trains in the two-process test below
def test_each_variant_trains_and_its_files_load(lora_type, tmp_path, cache_dir):
    cfg = demo_config(tmp_path / "ws", cache_dir, f"training.lora_type={lora_type}", "training.max_steps=2",
                      "save.lora_format=both", "training.precision=fp32")
    trainer = train(cfg)
    assert trainer.completed and trainer.global_step == 2
    outputs = sorted((tmp_path / "ws" / "output").glob("*.safetensors"))
    assert len(outputs) == 2
    for path in outputs:
        weights = read_lora(path, trainer.bundle)
        assert weights.lora_type == lora_type
        apply_lora(trainer.bundle, weights)  # the trained adapters' own shapes, names, rank and alpha


@pytest.mark.slow
def test_loha_on_two_processes_equals_one_with_double_batch_and_resumes(tmp_path, cache_dir):
    from modules.distributed.launch import launch
    from modules.trainer import backup as backups

    # Shuffled captions with a trigger word too: each caption's word order depends on (seed, epoch, item)
    # only, so both runs train on the same captions (encoded every step: shuffled text is not cached).
    common = ("training.lora_type=loha", "training.max_steps=4", "save.backup_every_n_steps=2",
              "training.precision=fp32", "optimizer.eps=1e-6", "data.shuffle_tags=true", "data.keep_tags=1",
              "data.caption_prefix=ohwx")

    def config(*extra):
        cfg = demo_config(*extra[:2], *common, *extra[2:])
        cfg.data.tag_separator = " "  # the demo's captions are sentences: shuffle their words
        return cfg

    GenericTrainer(config(tmp_path / "one", cache_dir, "training.batch_size=8")).run()
    two = config(tmp_path / "two", cache_dir, "training.batch_size=4", "multi_gpu.enabled=true",
                 "multi_gpu.num_gpus=2", "multi_gpu.launcher=spawn")
    assert launch(two) == 0
    one, both = latest_backup_weights(tmp_path / "one"), latest_backup_weights(tmp_path / "two")
    assert one.keys() == both.keys() and any(".hada_w1_a" in k for k in one)
    for key in one:
        torch.testing.assert_close(both[key], one[key], atol=2e-5, rtol=1e-4, msg=lambda m: f"{key}: {m}")
    # Resumed from the step-2 backup of the two-process run on one process: the weights of the straight run.
    assert [b for b in backups.list_backups(tmp_path / "two" / "backups") if b.step == 2]
    for backup in backups.list_backups(tmp_path / "two" / "backups"):
        if backup.step != 2:
            import shutil
            shutil.rmtree(backup.path)
    train(config(tmp_path / "two", cache_dir, "training.batch_size=8"), resume="latest")
    resumed = latest_backup_weights(tmp_path / "two")
    for key in one:
        torch.testing.assert_close(resumed[key], one[key], atol=2e-5, rtol=1e-4, msg=lambda m: f"{key}: {m}")
