"""LoRA: adapters only where asked, zero start, and saved files that diffusers loads to the same model."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from modules.config.train_config import ModelConfig, SamplePromptConfig, TrainingConfig
from modules.model import add_lora, ensure_demo_model, load_model, render_samples, save_lora
from modules.model.lora import TEXT_ENCODER_TARGETS

CAPTIONS = ["a red circle", "a blue square on a white background"]
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


# The tiny models are far slower with several threads on a busy 2-core machine.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(2, 4, 8, 8, generator=generator), torch.tensor([10, 700])


def _forward(unet, text_encoder, tokenizer):
    latents, timesteps = _inputs()
    ids = tokenizer(CAPTIONS, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = text_encoder(ids)[0]
        return hidden, unet(latents, timesteps, hidden).sample


def _perturb(params):
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in params:
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)


@pytest.fixture(scope="module")
def trained(tandem_home):
    """The demo model with rank-4, alpha-8 LoRA on UNet and text encoder, weights moved off zero."""
    bundle = load_model(ModelConfig())
    base = _forward(bundle.unet, bundle.text_encoders[0], bundle.tokenizers[0])
    params = add_lora(bundle, TrainingConfig(lora_rank=4, lora_alpha=8.0, lora_target_modules=TARGETS,
                                             train_text_encoder=True))
    initial = _forward(bundle.unet, bundle.text_encoders[0], bundle.tokenizers[0])
    _perturb(params)
    return bundle, params, base, initial


def test_lora_starts_as_identity_and_touches_only_targets(trained):
    bundle, params, base, initial = trained
    assert torch.equal(base[0], initial[0]) and torch.equal(base[1], initial[1]), "zero-initialised B must not change outputs"

    plain = load_model(ModelConfig()).unet
    unet_targets = [name for name, module in plain.named_modules()
                    if isinstance(module, torch.nn.Linear) and name.endswith(tuple("." + t for t in TARGETS))]
    lora_names = [name for name, p in bundle.unet.named_parameters() if p.requires_grad]
    assert len(lora_names) == 2 * len(unet_targets) > 0
    for name in lora_names:
        owner = name.split(".lora_")[0]
        assert owner.endswith(tuple(TARGETS)) and (".lora_A." in name or ".lora_B." in name), name
    text_lora = [name for name, p in bundle.text_encoders[0].named_parameters() if p.requires_grad]
    assert text_lora and all(name.split(".lora_")[0].endswith(tuple(TEXT_ENCODER_TARGETS)) for name in text_lora)
    assert not any(p.requires_grad for p in bundle.vae.parameters())
    assert set(bundle.trainable_modules()) == {"unet", "text_encoder"}
    assert len(params) == len(lora_names) + len(text_lora)


def test_lora_weights_stay_fp32_on_a_bf16_base(tandem_home):
    bundle = load_model(ModelConfig(unet_dtype="bf16"), training_cfg=TrainingConfig(method="lora"))
    params = add_lora(bundle, TrainingConfig(lora_rank=2))
    assert params and {p.dtype for p in params} == {torch.float32}
    assert bundle.unet.conv_in.weight.dtype == torch.bfloat16
    latents, timesteps = _inputs()
    hidden = torch.randn(2, 77, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = bundle.unet(latents, timesteps, hidden).sample
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None for p in params)


def test_unknown_target_module_names_the_field(tandem_home):
    bundle = load_model(ModelConfig())
    with pytest.raises(ValueError, match="training.lora_target_modules"):
        add_lora(bundle, TrainingConfig(lora_target_modules=["no_such_layer"]))


@pytest.mark.parametrize("fmt", ["peft", "kohya"])
def test_saved_lora_loads_in_diffusers_to_the_same_model(trained, tmp_path, fmt):
    from diffusers import StableDiffusionPipeline

    bundle, _, base, _ = trained
    expected_hidden, expected_out = _forward(bundle.unet, bundle.text_encoders[0], bundle.tokenizers[0])
    assert not torch.allclose(expected_out, base[1]), "the perturbed LoRA must change the output"
    path = save_lora(bundle, tmp_path / f"lora_{fmt}.safetensors", fmt, "fp32", {"tandem_training": {"steps": 3}})

    pipeline = StableDiffusionPipeline.from_pretrained(ensure_demo_model(), local_files_only=True, safety_checker=None)
    pipeline.load_lora_weights(str(path))
    hidden, out = _forward(pipeline.unet, pipeline.text_encoder, pipeline.tokenizer)
    torch.testing.assert_close(hidden, expected_hidden, rtol=0, atol=1e-5)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-5)

    with safe_open(path, "pt") as file:
        metadata, keys = file.metadata(), list(file.keys())
    if fmt == "peft":  # today's diffusers layout: peft's lora_A / lora_B under the component's prefix
        assert all(k.startswith(("unet.", "text_encoder.")) and k.endswith((".lora_A.weight", ".lora_B.weight"))
                   for k in keys)
        assert "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight" in keys
        assert "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight" in keys
    assert (metadata["ss_network_dim"], metadata["ss_network_alpha"], metadata["ss_network_module"]) == ("4", "8.0", "networks.lora")
    assert metadata["tandem_base_model"] == "builtin:demo" and metadata["ss_base_model_version"] == "sd_v1"
    assert json.loads(metadata["tandem_training"]) == {"steps": 3}


def test_kohya_keys_cover_every_lora_module(trained, tmp_path):
    bundle, _, _, _ = trained
    path = save_lora(bundle, tmp_path / "k.safetensors", "kohya", "fp16")
    with safe_open(path, "pt") as file:
        tensors = {key: file.get_tensor(key) for key in file.keys()}

    def kohya_names(module, prefix, wrap=""):
        return {f"{prefix}_{(wrap + name).replace('.', '_')}" for name, child in module.named_modules()
                if hasattr(child, "lora_A") and child.lora_A}

    expected = kohya_names(bundle.unet, "lora_unet") | kohya_names(bundle.text_encoders[0], "lora_te", "text_model.")
    assert {key.rsplit(".", 2)[0] if key.endswith(".weight") else key.rsplit(".", 1)[0] for key in tensors} == expected
    for name in expected:
        down, up = tensors[f"{name}.lora_down.weight"], tensors[f"{name}.lora_up.weight"]
        assert down.shape[0] == up.shape[1] == 4 and down.dtype == torch.float16
        assert tensors[f"{name}.alpha"].item() == 8.0
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q" in expected
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj" in expected


def test_save_rejects_bad_requests_and_replaces_atomically(trained, tmp_path):
    bundle, _, _, _ = trained
    with pytest.raises(ValueError, match="LoRA format 'a1111'"):
        save_lora(bundle, tmp_path / "x.safetensors", "a1111")
    with pytest.raises(ValueError, match="must end in .safetensors"):
        save_lora(bundle, tmp_path / "x.pt", "kohya")
    target = tmp_path / "out.safetensors"
    target.write_bytes(b"old")
    save_lora(bundle, target, "peft", "bf16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors"]
    with safe_open(target, "pt") as file:
        assert all(file.get_tensor(key).dtype == torch.bfloat16 for key in file.keys())
    plain = load_model(ModelConfig())
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_lora(plain, tmp_path / "none.safetensors")


def test_sampling_works_with_lora_attached(trained):
    bundle, _, _, _ = trained
    images = render_samples(bundle, [SamplePromptConfig(prompt="a red circle", seed=1)], 64, 2, 3.0)
    assert images[0].size == (64, 64)


def test_adapters_under_autocast_skip_the_cast_round_trip(tandem_home):
    """Same output and gradients with peft's fp32 input casts as without them, with fewer copies."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCopies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.copies += func is torch.ops.aten._to_copy.default
            return func(*args, **(kwargs or {}))

    bundle = load_model(ModelConfig(unet_dtype="bf16"), training_cfg=TrainingConfig(method="lora"))
    params = add_lora(bundle, TrainingConfig(lora_rank=2, lora_target_modules=TARGETS))
    _perturb(params)
    layers = [m for m in bundle.unet.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert layers and not any(m.cast_input_dtype_enabled for m in layers)
    latents, timesteps = _inputs()
    hidden = torch.randn(2, 77, 64, generator=torch.Generator().manual_seed(2))

    def step(cast: bool):
        for m in layers:
            m.cast_input_dtype_enabled = cast
        for p in params:
            p.grad = None
        counter = CountCopies()
        with counter, torch.autocast("cpu", dtype=torch.bfloat16):
            out = bundle.unet(latents, timesteps, hidden).sample
            out.float().pow(2).mean().backward()
        return out.detach(), [p.grad.clone() for p in params], counter.copies

    with_casts, without = step(True), step(False)
    assert torch.equal(with_casts[0], without[0])
    assert all(torch.equal(a, b) for a, b in zip(with_casts[1], without[1]))
    # Per adapted layer at least the input cast and autocast's cast back (backward saves more).
    assert with_casts[2] - without[2] >= 2 * len(layers), (with_casts[2], without[2], len(layers))


def test_adapters_keep_peft_casts_without_autocast(tandem_home):
    bundle = load_model(ModelConfig())
    add_lora(bundle, TrainingConfig(lora_rank=2, precision="fp32"))
    assert all(m.cast_input_dtype_enabled for m in bundle.unet.modules() if hasattr(m, "cast_input_dtype_enabled"))
