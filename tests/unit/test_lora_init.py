"""`training.lora_init`: training starts from the weights of a LoRA file in any layout Tandem reads; a file
that does not fit the configured adapters stops the start with a message naming the file and what differs."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from modules.config import TrainConfig, validate
from modules.config.train_config import ModelConfig, TrainingConfig
from modules.model import add_lora, load_model, save_lora
from modules.model.lora import lora_modules
from tests.trainer_helpers import demo_config, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _random_adapters(bundle, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in bundle.modules().values():
            for name, param in module.named_parameters():
                if param.requires_grad:
                    param.copy_(torch.randn(param.shape, generator=generator).abs() * 0.1 + ("magnitude" in name))


def _settings(**changes) -> TrainingConfig:
    base = dict(lora_rank=4, lora_alpha=8.0, precision="fp32", train_text_encoder=True)
    return TrainingConfig(**{**base, **changes})


@pytest.fixture(scope="module")
def files(tandem_home, tmp_path_factory):
    """One trained-looking LoRA (UNet and text encoder) in both layouts, and a DoRA in the kohya layout."""
    folder = tmp_path_factory.mktemp("lora_init")
    found = {}
    for lora_type in ("lora", "dora"):
        bundle = load_model(ModelConfig())
        add_lora(bundle, _settings(lora_type=lora_type))
        _random_adapters(bundle, 1)
        found[lora_type] = (bundle, {fmt: save_lora(bundle, folder / f"{lora_type}-{fmt}.safetensors", fmt, "fp32")
                                     for fmt in ("kohya", "peft")})
    return found


@pytest.mark.parametrize("lora_type", ["lora", "dora"])
@pytest.mark.parametrize("fmt", ["kohya", "peft"])
def test_adapters_start_from_the_file(files, lora_type, fmt):
    original, paths = files[lora_type]
    bundle = load_model(ModelConfig())
    add_lora(bundle, _settings(lora_type=lora_type, lora_init=str(paths[fmt])))
    mine, theirs = lora_modules(bundle), lora_modules(original)
    assert mine.keys() == theirs.keys() == {"unet", "text_encoder"}
    for component in theirs:
        for key, value in theirs[component].items():
            torch.testing.assert_close(mine[component][key], value, atol=1e-6 if lora_type == "dora" else 0,
                                       rtol=1e-5 if lora_type == "dora" else 0)


@pytest.mark.parametrize("changes, expected", [
    (dict(lora_rank=8), r"rank 8 \(training.lora_rank\) and the file rank 4; set training.lora_rank to 4"),
    (dict(lora_alpha=4.0), r"alpha 4 \(training.lora_alpha\) and the file alpha 8; set training.lora_alpha to 8"),
    (dict(lora_type="loha"), r"holds LoRA weights and the adapters are LoHa .*set training.lora_type to lora"),
    (dict(lora_target_modules=["to_q", "to_k"]),
     r"the file adapts 16 unet module\(s\) the adapters do not, e.g. \['down_blocks.0.attentions.0.transformer_blocks"
     r".0.attn1.to_out.0'.*training.lora_target_modules"),
    (dict(lora_target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_in"]),
     r"4 adapted unet module\(s\) have no weights in the file, e.g. \['down_blocks.0.attentions.0.proj_in'"),
    (dict(train_text_encoder=False), r"the file has text_encoder weights and the text_encoder has no adapter"),
])
def test_a_file_that_does_not_fit_names_the_file_and_what_differs(files, changes, expected):
    path = files["lora"][1]["kohya"]
    bundle = load_model(ModelConfig())
    with pytest.raises(ValueError, match=rf"training.lora_init '{path}': .*{expected}"):
        add_lora(bundle, _settings(lora_init=str(path), **changes))


def test_a_lora_of_another_family_is_refused(files, tandem_home, tmp_path):
    flux = load_model(ModelConfig(base_model="builtin:demo-flux"))
    add_lora(flux, TrainingConfig(lora_rank=4, lora_alpha=8.0, precision="fp32"))
    flux_file = save_lora(flux, tmp_path / "flux.safetensors", "peft", "fp32")
    bundle = load_model(ModelConfig())
    with pytest.raises(ValueError, match=rf"training.lora_init '{flux_file}': 'transformer\.[^']*' is neither a kohya key"):
        add_lora(bundle, _settings(lora_init=str(flux_file), train_text_encoder=False))
    with pytest.raises(FileNotFoundError, match="training.lora_init: '.*missing.safetensors' does not exist"):
        add_lora(load_model(ModelConfig()), _settings(lora_init=str(tmp_path / "missing.safetensors")))


def test_the_config_check_names_a_missing_file_and_a_full_fine_tune(tmp_path):
    cfg = TrainConfig()
    cfg.training.lora_init = str(tmp_path / "nowhere.safetensors")
    assert any(p.startswith("training.lora_init:") and "is not a file" in p for p in validate(cfg))
    assert not any(p.startswith("training.lora_init") for p in validate(cfg, check_paths=False))
    cfg.training.method = "full"
    assert any("set training.method to lora or clear training.lora_init" in p for p in validate(cfg, check_paths=False))
    cfg.training.method, cfg.training.lora_init = "lora", "style.ckpt"
    assert any("is not a .safetensors file" in p for p in validate(cfg, check_paths=False))


@pytest.mark.slow
def test_a_run_continues_the_lora_another_run_trained(tmp_path, tandem_home):
    cache = tmp_path / "cache"
    first = train(demo_config(tmp_path / "a", cache, "training.max_steps=3", "save.lora_format=kohya"))
    assert first.completed
    (trained,) = (tmp_path / "a" / "output").glob("*.safetensors")
    # A learning rate so small that one step cannot move the weights: the second run's model is the file's.
    second = train(demo_config(tmp_path / "b", cache, "training.max_steps=1", "training.learning_rate=1e-12",
                               f"training.lora_init={trained}", "save.lora_format=kohya"))
    (continued,) = (tmp_path / "b" / "output").glob("*.safetensors")
    before, after = load_file(str(trained)), load_file(str(continued))
    assert before.keys() == after.keys()
    assert any(before[k].abs().max() > 0 for k in before if k.endswith("lora_up.weight"))  # not a fresh adapter
    for key in before:
        torch.testing.assert_close(after[key], before[key], atol=1e-7, rtol=1e-6)
    assert second.completed
