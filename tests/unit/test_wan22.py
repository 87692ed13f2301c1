"""Wan 2.2: T2V A14B's two experts (one trains per run on its own timesteps, the other frozen and used for samples,
the LoRA loading into the right expert in diffusers' WanPipeline) and TI2V 5B (48-channel latents, per-token
timesteps), on tiny folders `make_random_model.py --type wan --variant a14b|ti2v-5b` writes (built here at a tiny
size through the same code). The training runs are marked slow."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from modules.config import TrainConfig, apply_overrides, validate
from modules.config.train_config import ModelConfig, SamplePromptConfig
from modules.model import load_model
from modules.model.families import detect_folder, family
from modules.model.families.wan import WanObjective
from modules.model.families.wan_experts import ExpertPlan
from modules.util.batch_slice import BatchSlice

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = {"transformer": {"num_attention_heads": 2, "attention_head_dim": 12, "ffn_dim": 32, "num_layers": 1,
                        "text_dim": 16, "freq_dim": 16},
        "vae": {"base_dim": 8, "num_res_blocks": 1},
        "text_encoder": {"d_model": 16, "d_ff": 32, "d_kv": 4, "num_heads": 4, "num_layers": 1}}
TINY_VAE22 = {"base_dim": 8, "decoder_base_dim": 8, "num_res_blocks": 1}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny Wan 2.1, Wan 2.2 A14B and TI2V 5B folders (fp32, ~1 s each)."""
    root = tmp_path_factory.mktemp("wan22")
    wan = family("wan")
    return {"2.1": wan.write_random_model(root / "wan21", torch.float32, configs=TINY),
            "a14b": wan.write_random_model(root / "a14b", torch.float32, variant="a14b", configs=TINY),
            "ti2v": wan.write_random_model(root / "ti2v", torch.float32, variant="ti2v-5b",
                                           configs={**TINY, "vae": TINY_VAE22})}


def load(folder, expert=""):
    return load_model(ModelConfig(base_model=str(folder), wan_expert=expert))


def test_the_releases_are_told_apart_from_their_folders(folders):
    index = {name: json.loads((folder / "model_index.json").read_text()) for name, folder in folders.items()}
    assert index["a14b"]["boundary_ratio"] == 0.875 and index["a14b"]["transformer_2"][1] == "WanTransformer3DModel"
    assert index["ti2v"]["expand_timesteps"] is True and index["ti2v"]["transformer_2"] == [None, None]
    assert [detect_folder(folders[n])[1] for n in ("2.1", "a14b", "ti2v")] == [
        f"its model_index.json names WanPipeline ({release})"
        for release in ("Wan 2.1 T2V", "Wan 2.2 T2V A14B", "Wan 2.2 TI2V 5B")]


def test_the_expert_field_is_required_for_two_experts_and_refused_otherwise(folders):
    with pytest.raises(ValueError, match="set model.wan_expert to high_noise or low_noise"):
        load(folders["a14b"])
    for name in ("2.1", "ti2v"):
        with pytest.raises(ValueError, match="model.wan_expert is 'low_noise'.*has one transformer; leave"):
            load(folders[name], "low_noise")
    cfg = apply_overrides(TrainConfig(), ["model.base_model=builtin:demo-flux", "model.wan_expert=high_noise"])
    assert any("model.wan_expert: 'high_noise' picks an expert of Wan 2.2 A14B" in p for p in validate(cfg))
    bad = apply_overrides(TrainConfig(), ["model.model_type=wan", "model.base_model=x.safetensors"])
    bad.model.wan_expert = "both"
    assert any("model.wan_expert" in p and "both" in p for p in validate(bad))


def test_an_expert_draws_timesteps_only_from_its_range_in_the_shape_of_the_whole():
    """High noise: t >= 0.875 (the pipeline's `t >= boundary_ratio x 1000` picks `transformer`); low noise: t below
    it. Inside its range an expert's t follow the shifted logit-normal distribution cut to the range (compared with
    the whole draw's samples that land there), and 2 ranks x 1024 draw what 1 rank x 2048 does."""
    bundle = SimpleNamespace(noise_scheduler=SimpleNamespace(config={"flow_shift": 3.0}), extra={})
    whole = WanObjective(bundle).draw((20000, 1, 1, 1, 1), 3, 0, 0, BatchSlice(0, 20000, 20000), torch.device("cpu"))
    for expert in ("high_noise", "low_noise"):
        bundle.extra = {"wan_experts": ExpertPlan(expert, 0.875)}
        objective = WanObjective(bundle)
        t = objective.draw((20000, 1, 1, 1, 1), 5, 0, 0, BatchSlice(0, 20000, 20000), torch.device("cpu")).timesteps
        high = t * 1000 >= 875
        assert bool(high.all()) if expert == "high_noise" else not bool(high.any())
        inside = whole.timesteps[(whole.timesteps * 1000 >= 875) == (expert == "high_noise")]
        quantiles = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9])
        assert torch.allclose(torch.quantile(t, quantiles), torch.quantile(inside, quantiles), atol=0.02), expert
        one = objective.draw((2048, 2, 1, 2, 2), 9, 4, 1, BatchSlice(0, 2048, 2048), torch.device("cpu"))
        halves = [objective.draw((1024, 2, 1, 2, 2), 9, 4, 1, BatchSlice(o, 1024, 2048), torch.device("cpu"))
                  for o in (0, 1024)]
        assert torch.equal(torch.cat([h.timesteps for h in halves]), one.timesteps)


def test_the_trained_expert_trains_and_the_frozen_one_joins_the_samples(folders):
    """low_noise: the bundle's denoiser is transformer_2; transformer waits frozen outside the trained modules, and
    sampling's WanPipeline holds both in their places (the high-noise one for t >= 875) and runs each."""
    from diffusers import WanPipeline

    from modules.model.sampling import render_samples

    reference = WanPipeline.from_pretrained(folders["a14b"])
    bundle = load(folders["a14b"], "low_noise")
    frozen = bundle.extra["frozen_modules"]["transformer"]
    assert torch.equal(bundle.denoiser.proj_out.weight, reference.transformer_2.proj_out.weight)
    assert torch.equal(frozen.proj_out.weight, reference.transformer.proj_out.weight)
    assert not any(p.requires_grad for p in frozen.parameters())
    assert all(m is not frozen for m in bundle.modules().values()) and "frozen transformer" in bundle.sampling_modules()
    pipeline = bundle.family.pipeline(bundle)
    assert pipeline.transformer is frozen and pipeline.transformer_2 is bundle.denoiser
    assert pipeline.config.boundary_ratio == 0.875
    calls = {"transformer": 0, "transformer_2": 0}
    hooks = [module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
             for name, module in (("transformer", frozen), ("transformer_2", bundle.denoiser))]
    images = render_samples(bundle, [SamplePromptConfig(prompt="a cat", seed=1)], 32, inference_steps=4,
                            guidance_scale=1.0)
    for hook in hooks:
        hook.remove()
    assert images[0].size == (32, 32) and calls["transformer"] > 0 and calls["transformer_2"] > 0, calls
    assert bundle.family.modelspec_architecture(bundle) == "wan2.2-t2v-a14b-low-noise"


@pytest.mark.parametrize("expert", ["low_noise", "high_noise"])
def test_an_experts_lora_loads_into_its_expert_of_wan_pipeline(folders, tmp_path, expert):
    """The saved LoRA (kohya and peft layouts) loaded as diffusers documents it - `load_lora_weights(...,
    load_into_transformer_2=True)` for the low-noise expert, plainly for the high-noise one - makes that expert of
    WanPipeline compute what the trained expert computes; the other expert stays as it was."""
    from diffusers import WanPipeline

    from modules.config.train_config import TrainingConfig
    from modules.model.lora import add_lora, save_lora

    bundle = load(folders["a14b"], expert)
    torch.manual_seed(3)
    for parameter in add_lora(bundle, TrainingConfig(lora_rank=4, lora_alpha=4.0,
                                                      lora_target_modules=["to_q", "to_k", "to_v", "ffn.net.2"])):
        parameter.data.normal_(0, 0.5)
    x, text, t = torch.randn(1, 16, 2, 4, 4), torch.randn(1, 8, 16), torch.tensor([300.0])

    def output(transformer):
        with torch.no_grad():
            return transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

    trained = output(bundle.denoiser)
    low = expert == "low_noise"
    base = WanPipeline.from_pretrained(folders["a14b"])
    mine, other = ("transformer_2", "transformer") if low else ("transformer", "transformer_2")
    assert (output(getattr(base, mine)) - trained).abs().max() > 1e-3  # the adapters change the expert
    for fmt in ("kohya", "peft"):
        path = save_lora(bundle, tmp_path / f"{expert}-{fmt}.safetensors", fmt, torch.float32)
        pipe = WanPipeline.from_pretrained(folders["a14b"])
        pipe.load_lora_weights(path, **({"load_into_transformer_2": True} if low else {}))
        torch.testing.assert_close(output(getattr(pipe, mine)), trained, atol=1e-5, rtol=1e-5, msg=fmt)
        torch.testing.assert_close(output(getattr(pipe, other)), output(getattr(base, other)), msg=fmt)


def test_a_full_save_of_the_low_noise_expert_puts_each_expert_in_its_place(folders, tmp_path):
    from diffusers import WanPipeline

    from modules.model.saving import save_full_diffusers

    bundle = load(folders["a14b"], "low_noise")
    with torch.no_grad():
        bundle.denoiser.proj_out.weight.add_(1.0)  # "trained"
    saved = WanPipeline.from_pretrained(save_full_diffusers(bundle, tmp_path / "saved", torch.float32))
    assert saved.config.boundary_ratio == 0.875 and saved.config.expand_timesteps is False
    assert torch.equal(saved.transformer_2.proj_out.weight, bundle.denoiser.proj_out.weight)
    assert torch.equal(saved.transformer.proj_out.weight, bundle.extra["frozen_modules"]["transformer"].proj_out.weight)


def test_ti2v_trains_on_48_channels_with_the_timestep_its_pipeline_gives_every_token(folders):
    """TI2V 5B's latents have 48 channels at 1/16 of each side; `expand_timesteps` gives each latent token the same
    t in text-to-video, which the transformer turns into what the one t the objective passes gives."""
    bundle = load(folders["ti2v"])
    assert bundle.extra["pipeline_config"]["expand_timesteps"] is True
    assert bundle.family.sample_size_multiple(bundle) == 32
    with torch.no_grad():
        latents = bundle.encode_images(torch.zeros(1, 3, 5, 64, 64))
    assert latents.shape == (1, 48, 2, 4, 4)
    objective = bundle.family.objective(bundle)
    text = {"encoder_hidden_states": torch.randn(1, 8, 16)}
    with torch.no_grad():
        one_t = objective.predict(bundle.denoiser, latents, torch.tensor([0.4]), text)
        per_token = bundle.denoiser(hidden_states=latents, timestep=torch.full((1, 2 * 2 * 2), 400.0),
                                    encoder_hidden_states=text["encoder_hidden_states"], return_dict=False)[0]
    assert one_t.shape == latents.shape
    torch.testing.assert_close(one_t, per_token, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="multiples of 32 px"):
        bundle.family.check_image_sizes([(48, 64)], bundle)
    bundle.family.check_image_sizes([(48, 64)])  # without the model: the family's 16 px


def test_the_memory_plan_counts_the_frozen_expert_and_ti2v_tokens(folders):
    from modules.planning.memory_need import Setup, activation_bytes_per_sample, facts, frozen_expert_bytes, need
    from modules.planning.model_sizes import model_sizes

    def planned(folder, *overrides):
        cfg = apply_overrides(TrainConfig(), [f"model.base_model={folder}", "training.method=lora",
                                              "model.unet_dtype=bf16", "data.resolution=512", *overrides])
        f = facts(model_sizes(cfg), cfg)
        return cfg, f, need(f, cfg, Setup("single", 1, False, True))

    cfg, f, quiet = planned(folders["a14b"], "model.wan_expert=high_noise", "sampling.every_n_epochs=0")
    expert = frozen_expert_bytes(f, cfg)
    assert "transformer_2" in f.sizes.components and expert == 2 * f.sizes.components["transformer_2"].params > 0
    assert quiet.host * 2 ** 30 == pytest.approx(expert) and quiet.parts["frozen expert (samples)"] == 0
    _, _, sampled = planned(folders["a14b"], "model.wan_expert=high_noise", 'sampling.prompts=[{"prompt": "a"}]')
    assert sampled.parts["frozen expert (samples)"] * 2 ** 30 == pytest.approx(expert)
    assert sampled.training == pytest.approx(quiet.training + expert / 2 ** 30)
    # TI2V 5B: a token per 32x32 px of each of a clip's 21 latent frames (81 frames), a quarter of Wan 2.1's at the
    # same size; both attend to 512 text tokens.
    tokens = {}
    for name in ("2.1", "ti2v"):
        cfg, f, _ = planned(folders[name], "training.gradient_checkpointing=true")
        tokens[name] = activation_bytes_per_sample(f, cfg, Setup("single", 1, False, True)) / f.sizes.denoiser_config[
            "num_attention_heads"] / f.sizes.denoiser_config["attention_head_dim"]
    assert tokens["ti2v"] / tokens["2.1"] == pytest.approx((21 * 16 * 16 + 512) / (21 * 32 * 32 + 512))


# ---------------------------------------------------------------------------------------------- training (slow)

def wan_config(workspace, folder, *overrides, method="lora"):
    from tests.trainer_helpers import demo_config

    return demo_config(workspace, workspace / "cache", "training.precision=fp32", f"model.base_model={folder}",
                       "sampling.inference_steps=2", "save.output_name=tiny", *overrides, method=method,
                       preset="#demo_wan")


@pytest.mark.slow
def test_the_low_noise_expert_trains_below_the_boundary_and_samples_with_both(folders, tmp_path, monkeypatch):
    """Through the trainer: every timestep drawn is below 0.875, the samples render, and the LoRA names its expert."""
    from safetensors import safe_open

    from tests.trainer_helpers import train

    drawn = []
    original = WanObjective.draw

    def recording(self, *args, **kwargs):
        draw = original(self, *args, **kwargs)
        drawn.append(draw.timesteps.clone())
        return draw

    monkeypatch.setattr(WanObjective, "draw", recording)
    train(wan_config(tmp_path, folders["a14b"], "model.wan_expert=low_noise", "training.max_steps=3",
                     "sampling.every_n_steps=3"))
    times = torch.cat(drawn)
    assert len(drawn) >= 3 and float(times.max()) < 0.875 and float(times.min()) > 0
    assert len(list((tmp_path / "samples").rglob("*.webp"))) == 2
    with safe_open(tmp_path / "output" / "tiny.safetensors", "pt") as lora:
        assert lora.metadata()["modelspec.architecture"] == "wan2.2-t2v-a14b-low-noise/lora"


@pytest.mark.slow
def test_ti2v_trains_a_full_fine_tune_on_48_channel_latents(folders, tmp_path):
    from safetensors.torch import load_file

    from modules.trainer.callbacks import RecordingCallbacks
    from tests.trainer_helpers import train

    callbacks = RecordingCallbacks()
    train(wan_config(tmp_path, folders["ti2v"], "training.max_steps=12", "training.learning_rate=0.002",
                     "sampling.every_n_steps=12", method="full"), callbacks)
    losses = [event["loss"] for event in callbacks.of_type("loss")]
    assert len(losses) == 12 and all(loss == loss for loss in losses)
    assert sum(losses[-4:]) < sum(losses[:4]), losses
    shapes = {tuple(load_file(path)["mean"].shape) for path in (tmp_path / "cache" / "latents").glob("*.safetensors")}
    assert shapes == {(48, 1, 4, 4), (48, 3, 4, 4)}  # images and 9-frame clips at 64 px: 1/16 of each side
    assert len(list((tmp_path / "samples").rglob("*.webp"))) == 2
