"""training.channels_last: NHWC convolution weights train the same model, and every output and resume works.

Safetensors refuses non-contiguous tensors, and a channels-last weight is one; a save that skipped the
conversion would fail, and one that wrote the raw storage would scramble the weights. So the saved
tensors are compared with the live parameters, not only opened.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from modules.model.ldm_layout import unet_to_ldm
from modules.model.single_file import read_checkpoint
from modules.trainer.callbacks import RecordingCallbacks
from modules.trainer.generic_trainer import GenericTrainer
from modules.trainer.optim import match_param_layouts
from tests.trainer_helpers import assert_weights_close, demo_config, latest_backup_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHANNELS_LAST = "training.channels_last=true"


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def train(cfg, resume=None) -> GenericTrainer:
    trainer = GenericTrainer(cfg, RecordingCallbacks(), resume=resume)
    trainer.run()
    return trainer


def nhwc(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last)


def unet_convs(trainer) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in trainer.bundle.unet.named_parameters() if p.dim() == 4}


def assert_nhwc(tensors) -> None:
    tensors = list(tensors)
    assert tensors and all(nhwc(t) for t in tensors)
    assert any(not t.is_contiguous() for t in tensors), "no 3x3 weight is in NHWC (1x1 ones are both layouts)"


def same_values(saved: dict, live: dict) -> None:
    assert saved.keys() == live.keys()
    for k, v in live.items():
        assert torch.equal(saved[k], v.detach().cpu()), k


def copy_backup(source_workspace: Path, step: int, workspace: Path) -> None:
    from modules.trainer.backup import list_backups
    (found,) = [b for b in list_backups(source_workspace / "backups") if b.step == step]
    shutil.copytree(found.path, workspace / "backups" / found.run_id / found.path.name)


# A few fp32 steps of a full fine-tune, batch 8. SGD, as in the multi-GPU equivalence test: Adam turns
# gradients that are pure rounding noise (biases before a GroupNorm) into full-size steps, so another
# convolution algorithm alone moves those weights by ~lr. The optimizer is the same code for either layout.
EQUIVALENCE = ("training.max_steps=3", "save.backup_every_n_steps=3", "training.precision=fp32",
               "optimizer.name=sgd", "training.learning_rate=0.05")


@pytest.fixture(scope="module")
def nchw_weights(cache_dir, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The trained weights of the EQUIVALENCE run in the default layout, one process."""
    workspace = tmp_path_factory.mktemp("nchw")
    trainer = train(demo_config(workspace, cache_dir, *EQUIVALENCE, method="full"))
    assert all(p.is_contiguous() for p in unet_convs(trainer).values())
    return latest_backup_weights(workspace)


@pytest.mark.slow
def test_full_fine_tune_trains_the_same_weights(tmp_path, nchw_weights, cache_dir):
    """A few fp32 steps with NHWC weights end where the default layout ends, up to rounding."""
    on = train(demo_config(tmp_path / "on", cache_dir, *EQUIVALENCE, CHANNELS_LAST, method="full"))
    convs = unet_convs(on)
    assert_nhwc(convs.values())
    assert all(p.requires_grad for p in convs.values())
    # The optimizer steps the model's own (converted) parameters, with real gradients; its momentum
    # buffers are clones of the gradients, so the backward produced NHWC gradients too.
    stepped = {id(p) for group in on.optimizer.param_groups for p in group["params"]}
    momenta = [on.optimizer.state[p]["momentum_buffer"] for p in convs.values() if id(p) in stepped]
    assert len(momenta) == len(convs) and all(m.abs().max() > 0 for m in momenta)
    assert_nhwc(momenta)
    assert_weights_close(latest_backup_weights(tmp_path / "on"), nchw_weights, atol=1e-6, rtol=1e-4)


@pytest.mark.slow
def test_two_processes_in_nhwc_equal_one_in_nchw(tmp_path, nchw_weights, cache_dir):
    """DDP is built after the conversion (`wrap_model` runs after `prepare_trainable`), so its gradient
    buckets take the NHWC strides: 2 x batch 4 in NHWC train what 1 x batch 8 trains in NCHW."""
    from modules.distributed.launch import launch

    assert launch(demo_config(tmp_path, cache_dir, *EQUIVALENCE, "training.batch_size=4", CHANNELS_LAST,
                              "multi_gpu.enabled=true", "multi_gpu.num_gpus=2", "multi_gpu.launcher=spawn",
                              method="full")) == 0
    assert_weights_close(latest_backup_weights(tmp_path), nchw_weights, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_full_fine_tune_saves_backs_up_and_resumes(tmp_path, cache_dir):
    """Both full formats, raw and EMA, and backups; resuming in NHWC (or back in NCHW) continues exactly."""
    common = ("training.max_steps=4", "save.backup_every_n_steps=2", "training.precision=fp32",
              "training.ema=true", "training.ema_decay=0.5", "save.full_format=both", "save.ema_weights=both")
    straight = train(demo_config(tmp_path / "a", cache_dir, *common, CHANNELS_LAST, "sampling.sample_at_start=true",
                                 "sampling.inference_steps=2", method="full"))
    assert len(straight.callbacks.of_type("sample")) == 3  # the demo's prompts, rendered by the NHWC UNet
    unet = straight.bundle.unet
    assert_nhwc(unet_convs(straight).values())
    raw = unet.state_dict()
    ema = dict(zip([n for n, _ in unet.named_parameters()], straight.ema.shadow))
    assert_nhwc(t for n, t in ema.items() if t.dim() == 4)
    out = tmp_path / "a" / "output"
    same_values(load_file(str(out / "demo" / "unet" / "diffusion_pytorch_model.safetensors")), raw)
    same_values(load_file(str(out / "demo-ema" / "unet" / "diffusion_pytorch_model.safetensors")), ema)
    for name, weights in (("demo.safetensors", raw), ("demo-ema.safetensors", ema)):
        state, _ = read_checkpoint(out / name, ("model.diffusion_model.",))
        same_values(state, unet_to_ldm(weights, unet.config))
    same_values(latest_backup_weights(tmp_path / "a"), {f"unet.{n}": p for n, p in unet.named_parameters()})

    # Continue from the step-2 backup: in NHWC again, and in the default layout (a backup from the
    # other setting; its optimizer moments and EMA arrive in the layout they were saved in).
    for name, layout in (("b", CHANNELS_LAST), ("c", "training.channels_last=false")):
        copy_backup(tmp_path / "a", 2, tmp_path / name)
        resumed = train(demo_config(tmp_path / name, cache_dir, *common, layout, method="full"), resume="latest")
        assert resumed.completed and resumed.global_step == 4
        params = resumed.trainable_params()
        assert all(resumed.optimizer.state[p][key].stride() == p.stride()
                   for p in params for key in ("exp_avg", "exp_avg_sq"))
        assert all(s.stride() == p.stride() for s, p in zip(resumed.ema.shadow, params))
        if layout == CHANNELS_LAST:
            assert_nhwc(unet_convs(resumed).values())
            assert_weights_close(latest_backup_weights(tmp_path / name), latest_backup_weights(tmp_path / "a"),
                                 atol=1e-6)
        else:  # other convolution algorithms: Adam moves noise-gradient weights by ~lr (see the test above)
            assert all(p.is_contiguous() for p in params)


@pytest.mark.slow
def test_lora_trains_and_saves(tmp_path, cache_dir):
    """LoRA on attention and convolutions under bf16 autocast: frozen and adapter convolutions in NHWC."""
    targets = '["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"]'
    trainer = train(demo_config(tmp_path / "ws", cache_dir, "training.max_steps=2", "training.precision=bf16",
                                "save.backup_every_n_steps=2", "save.lora_format=both", CHANNELS_LAST,
                                f"training.lora_target_modules={targets}"))
    convs = unet_convs(trainer)
    assert_nhwc(p for n, p in convs.items() if ".lora_" not in n)
    adapters = {n: p for n, p in convs.items() if ".lora_" in n}
    assert_nhwc(adapters.values())
    assert all(p.requires_grad for p in adapters.values())
    assert any(p.abs().max() > 0 for n, p in adapters.items() if "lora_B" in n)  # the up-weights trained
    same_values(latest_backup_weights(tmp_path / "ws"),
                {f"unet.{n}": p for n, p in trainer.bundle.unet.named_parameters() if ".lora_" in n})
    out = tmp_path / "ws" / "output"
    # The peft file keeps the convolution adapters' module paths (attention ones get diffusers' names).
    peft = load_file(str(out / "demo.peft.safetensors"))
    same_values({k: v for k, v in peft.items() if v.dim() == 4},
                {f"unet.{n.replace('.default.', '.')}": p for n, p in adapters.items()})
    kohya = load_file(str(out / "demo.safetensors"))
    assert sum(v.dim() == 4 for v in kohya.values()) == len(adapters)


def test_resumed_moments_take_the_layout_of_their_parameters():
    """Fused AdamW walks parameters, gradients and moments as flat memory: moments saved in one layout
    and loaded for parameters in the other pair the wrong elements unless they are converted."""
    torch.manual_seed(0)
    weight, grad = torch.randn(8, 4, 3, 3), torch.randn(8, 4, 3, 3)
    moments = {"step": torch.tensor(3.0), "exp_avg": torch.randn(8, 4, 3, 3), "exp_avg_sq": torch.rand(8, 4, 3, 3)}

    def one_step(channels_last: bool, match: bool) -> torch.Tensor:
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        p = torch.nn.Parameter(weight.clone().to(memory_format=fmt))
        p.grad = grad.clone().to(memory_format=fmt)
        opt = torch.optim.AdamW([p], lr=0.1, fused=True)
        opt.load_state_dict({"state": {0: {k: v.clone() for k, v in moments.items()}},
                             "param_groups": opt.state_dict()["param_groups"]})
        if match:
            match_param_layouts(opt)
            assert all(opt.state[p][k].stride() == p.stride() for k in ("exp_avg", "exp_avg_sq"))
        opt.step()
        return p.detach().contiguous()

    reference = one_step(channels_last=False, match=False)
    torch.testing.assert_close(one_step(channels_last=True, match=True), reference)
