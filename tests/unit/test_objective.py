"""The training objective and schedule: targets, weighting, noise keyed by global batch, LR curves."""
import math

import pytest
import torch
from diffusers import DDPMScheduler

from modules.util.batch_slice import BatchSlice
from modules.config import TrainingConfig
from modules.model.objective import diffusion_loss, draw_noise, snr, training_target
from modules.trainer.optim import lr_lambda


@pytest.fixture
def scheduler():
    return DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear")


def test_noise_slices_do_not_depend_on_world_size():
    whole = draw_noise((8, 4, 8, 8), 1000, seed=3, step=5, micro=1, part=BatchSlice(0, 8, 8), device=torch.device("cpu"))
    halves = [draw_noise((4, 4, 8, 8), 1000, 3, 5, 1, BatchSlice.of([4, 4], rank), torch.device("cpu"))
              for rank in range(2)]
    assert torch.equal(torch.cat([h.noise for h in halves]), whole.noise)
    assert torch.equal(torch.cat([h.timesteps for h in halves]), whole.timesteps)
    other_step = draw_noise((8, 4, 8, 8), 1000, 3, 6, 1, BatchSlice(0, 8, 8), torch.device("cpu"))
    assert not torch.equal(other_step.noise, whole.noise)


def test_offset_noise_shifts_channels():
    plain = draw_noise((64, 4, 8, 8), 1000, 0, 0, 0, BatchSlice(0, 64, 64), torch.device("cpu"))
    offset = draw_noise((64, 4, 8, 8), 1000, 0, 0, 0, BatchSlice(0, 64, 64), torch.device("cpu"), offset_noise=0.5)
    per_channel_mean = (offset.noise - plain.noise).mean(dim=(2, 3))
    assert per_channel_mean.std() > 0.3  # a constant per sample and channel, ~N(0, 0.5)


def test_targets(scheduler):
    latents, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    t = torch.tensor([10, 900])
    assert torch.equal(training_target(scheduler, latents, noise, t, "epsilon"), noise)
    v = training_target(scheduler, latents, noise, t, "v_prediction")
    a = scheduler.alphas_cumprod[t].sqrt().view(-1, 1, 1, 1)
    s = (1 - scheduler.alphas_cumprod[t]).sqrt().view(-1, 1, 1, 1)
    torch.testing.assert_close(v, a * noise - s * latents)
    with pytest.raises(ValueError, match="prediction type"):
        training_target(scheduler, latents, noise, t, "sample")


def test_min_snr_weighting(scheduler):
    pred, target = torch.ones(2, 4, 2, 2), torch.zeros(2, 4, 2, 2)
    t = torch.tensor([10, 900])  # low t: huge SNR, weight gamma/SNR; high t: SNR < gamma, weight 1
    plain = diffusion_loss(pred, target, scheduler, t, "epsilon", 0.0)
    weighted = diffusion_loss(pred, target, scheduler, t, "epsilon", 5.0)
    s = snr(scheduler, t)
    expected = ((torch.clamp(s, max=5.0) / s) * 1.0).mean()
    assert plain.item() == pytest.approx(1.0)
    assert weighted.item() == pytest.approx(expected.item(), rel=1e-5)
    assert weighted < plain


@pytest.mark.parametrize("name,at_end", [("constant", 1.0), ("linear", 0.0), ("cosine", 0.0)])
def test_schedules_with_warmup(name, at_end):
    f = lr_lambda(TrainingConfig(lr_scheduler=name, lr_warmup_steps=4), total_steps=104)
    assert [f(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(104) == pytest.approx(at_end, abs=1e-9)
    if name == "cosine":
        assert f(54) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_cosine_with_restarts_starts_each_cycle_at_the_full_rate():
    f = lr_lambda(TrainingConfig(lr_scheduler="cosine_with_restarts", lr_cycles=3, lr_warmup_steps=4), total_steps=94)
    assert [f(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # 90 steps after warm-up, 3 cycles of 30: full rate at 4, 34 and 64, half-way down in the middle of each.
    for start in (4, 34, 64):
        assert f(start) == pytest.approx(1.0)
        assert f(start + 15) == pytest.approx(0.5)
        assert f(start + 29) < 0.01
    assert f(94) == 0.0 and f(200) == 0.0
    plain = lr_lambda(TrainingConfig(lr_scheduler="cosine"), total_steps=90)
    one_cycle = lr_lambda(TrainingConfig(lr_scheduler="cosine_with_restarts", lr_cycles=1), total_steps=90)
    assert [one_cycle(i) for i in range(90)] == pytest.approx([plain(i) for i in range(90)])


@pytest.mark.parametrize("power", [0.5, 1.0, 2.0])
def test_polynomial_decays_with_its_power(power):
    f = lr_lambda(TrainingConfig(lr_scheduler="polynomial", lr_power=power, lr_warmup_steps=2), total_steps=102)
    assert f(0) == 0.5 and f(2) == pytest.approx(1.0)
    assert f(52) == pytest.approx(0.5 ** power)
    assert f(102) == pytest.approx(0.0)
    if power == 1.0:
        linear = lr_lambda(TrainingConfig(lr_scheduler="linear", lr_warmup_steps=2), total_steps=102)
        assert [f(i) for i in range(102)] == pytest.approx([linear(i) for i in range(102)])


def test_warmup_stable_decay_holds_the_rate_then_decays_over_its_fraction():
    f = lr_lambda(TrainingConfig(lr_scheduler="warmup_stable_decay", lr_decay_fraction=0.25, lr_warmup_steps=10),
                  total_steps=110)
    assert f(0) == pytest.approx(0.1)
    assert all(f(i) == 1.0 for i in range(10, 85))  # stable for the first 75 of the 100 steps after warm-up
    assert f(85 + 12.5) == pytest.approx(0.5)
    assert f(109) < 0.01 and f(110) == pytest.approx(0.0)
    decay = [f(i) for i in range(85, 111)]
    assert decay == sorted(decay, reverse=True)


def test_an_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="training.lr_scheduler: unknown schedule 'cosin'"):
        lr_lambda(TrainingConfig(lr_scheduler="cosin"), total_steps=10)


def test_decay_fraction_above_one_is_refused():
    from modules.config import TrainConfig, validate
    cfg = TrainConfig()
    cfg.training.lr_decay_fraction = 1.5
    assert any(p.startswith("training.lr_decay_fraction: 1.5") for p in validate(cfg, check_paths=False))
    cfg.training.lr_decay_fraction = 0.0
    assert any(p.startswith("training.lr_decay_fraction: 0.0") for p in validate(cfg, check_paths=False))
