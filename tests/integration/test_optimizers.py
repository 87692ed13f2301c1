"""Prodigy and schedule-free AdamW: they train, report the rate they train with, resume exactly, and
train on 2 processes as on 1; schedule-free samples and saves show its averaged weights."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from modules.config import OptimizerConfig
from modules.trainer import backup as backups
from modules.trainer.callbacks import RecordingCallbacks
from modules.trainer.commands import CommandInbox
from modules.trainer.generic_trainer import GenericTrainer
from modules.trainer.optim import build_optimizer, effective_lr, evaluation_weights
from tests.trainer_helpers import demo_config, latest_backup_weights, train

# Prodigy grows its step size from d0 over the first steps; bias correction keeps its early steps from
# overshooting while its second moment still holds the small early gradients (without it the demo's loss
# fell, then rose again within 40 steps).
PRODIGY = ("optimizer.name=prodigy", "training.learning_rate=1.0", "optimizer.prodigy_d0=1e-4",
           "optimizer.prodigy_use_bias_correction=true", "optimizer.beta2=0.99")
SCHEDULE_FREE = ("optimizer.name=adamw_schedule_free", "training.learning_rate=0.01")
OPTIMIZERS = {"prodigy": PRODIGY, "adamw_schedule_free": SCHEDULE_FREE}


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def peft_names(tensors: dict) -> dict:
    """A peft-layout LoRA file's keys as the trainer names the parameters (`.default` adapter name)."""
    return {k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"): v
            for k, v in tensors.items()}


@pytest.mark.slow
def test_prodigy_trains_and_reports_d_times_lr(tmp_path, cache_dir):
    cb = RecordingCallbacks()
    trainer = train(demo_config(tmp_path / "ws", cache_dir, *PRODIGY, "training.max_steps=40"), cb)
    events = cb.of_type("loss")
    losses, lrs = [e["loss"] for e in events], [e["lr"] for e in events]
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    # The untrained model's loss over these batches: 0.97 over the first 8 steps, 0.97 over the last 8.
    assert last < 0.9 * first, f"loss did not go down: {first:.4f} -> {last:.4f}"
    group = trainer.optimizer.param_groups[0]
    assert group["lr"] == 1.0 and group["d"] > 100 * group["d0"]  # the estimate grew from d0
    k = group["k"]
    correction = (1 - 0.99 ** (k + 1)) ** 0.5 / (1 - 0.9 ** (k + 1))
    # The last report is of the last step, after which d no longer changed: it is d x lr x bias correction.
    assert lrs[-1] == pytest.approx(group["d"] * 1.0 * correction, rel=1e-12)
    assert lrs[0] < 1e-3 and lrs[-1] > 10 * lrs[0]  # not the configured 1.0: the rate Prodigy steps with


@pytest.mark.slow
def test_schedule_free_trains_and_saves_its_averaged_weights(tmp_path, cache_dir):
    cb = RecordingCallbacks()
    cfg = demo_config(tmp_path / "ws", cache_dir, *SCHEDULE_FREE, "training.max_steps=24", "training.lr_warmup_steps=4",
                      "save.lora_format=peft", "save.backup_every_n_steps=24")
    trainer = train(cfg, cb)
    events = cb.of_type("loss")
    losses = [e["loss"] for e in events]
    assert sum(losses[-4:]) / 4 < 0.9 * sum(losses[:4]) / 4
    # The warm-up reaches the optimizer's steps as the schedule's: lr x (k + 1) / 4 at step k + 1.
    assert [e["lr"] for e in events[:4]] == pytest.approx([0.01 * min(1.0, (k + 1) / 4) for k in range(1, 5)])
    assert trainer.optimizer.param_groups[0]["train_mode"]  # back in train mode after the final save
    training_weights = dict(trainer.trainable_state())
    with evaluation_weights(trainer.optimizer):
        averaged = {name: p.detach().clone() for name, p in trainer.trainable_state().items()}
    saved = peft_names(load_file(cb.of_type("done")[-1]["output"]))
    assert saved.keys() == averaged.keys()
    for name, value in saved.items():
        assert torch.equal(value, averaged[name]), name  # the model file holds x ...
    moved = [n for n in saved if "lora_B" in n]
    assert any(not torch.equal(saved[n], training_weights[n]) for n in moved)  # ... which is not y
    # The backup holds y with the optimizer's state (in train mode): what a resumed run continues from.
    backup = latest_backup_weights(tmp_path / "ws")
    assert all(torch.equal(backup[n], training_weights[n]) for n in training_weights)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_stop_and_resume_equals_uninterrupted(tmp_path, cache_dir, name):
    """Stopped at step 4 (backup on stop) and continued to 6: the same weights, bit for bit, as 6 steps in
    one go that also sampled and saved on the way (which must not disturb schedule-free's training weights)."""
    common = (*OPTIMIZERS[name], "training.max_steps=6", "save.backup_on_stop=true", "save.backup_every_n_steps=6",
              "training.lr_warmup_steps=3")
    straight = demo_config(tmp_path / "a", cache_dir, *common, "save.save_every_n_steps=2",
                           "sampling.every_n_steps=3", "sampling.inference_steps=2")
    straight.sampling.prompts = straight.sampling.prompts[:1]
    cb = RecordingCallbacks()
    train(straight, cb)
    assert [e["step"] for e in cb.of_type("sample")] == [3, 6] and len(cb.of_type("saved")) == 4  # 2, 4, 6, final
    reference = latest_backup_weights(tmp_path / "a")

    inbox = CommandInbox()

    class StopAt(RecordingCallbacks):
        def on_event(self, type_, **fields):
            super().on_event(type_, **fields)
            if type_ == "progress" and fields["step"] == 2:  # acted on after step 4 (see test_trainer)
                inbox.request("stop")

    first = train(demo_config(tmp_path / "b", cache_dir, *common), StopAt(), inbox)
    assert first.global_step == 4 and not first.completed
    (stopped,) = backups.list_backups(tmp_path / "b" / "backups")
    weights, state, _ = backups.read_backup(stopped.path)  # state.pt read with weights_only=True
    assert state["optimizer_name"] == name and state["optimizer"]["state"]  # the optimizer's own state is in it
    second = train(demo_config(tmp_path / "b", cache_dir, *common), resume="latest")
    assert second.completed and second.global_step == 6
    resumed = latest_backup_weights(tmp_path / "b")
    assert resumed.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(resumed[key], value), key


@pytest.mark.slow
def test_resuming_with_another_optimizer_is_refused(tmp_path, cache_dir):
    train(demo_config(tmp_path / "ws", cache_dir, *SCHEDULE_FREE, "training.max_steps=2", "save.backup_every_n_steps=2"))
    with pytest.raises(ValueError, match="optimizer.name: the backup was trained with 'adamw_schedule_free'"):
        train(demo_config(tmp_path / "ws", cache_dir, *PRODIGY, "training.max_steps=4"), resume="latest")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_two_processes_equal_one_with_double_batch(tmp_path, cache_dir, name):
    from modules.distributed.launch import launch
    # Adam-like steps divide each gradient element by its own size: an element that is almost zero (0.1% of
    # the demo's LoRA gradients are below 2e-8) becomes a full step, and rounding differences of the
    # summation order (1 x 8 vs the mean of 2 x 4) then move it by a visible fraction of the learning rate
    # (1.3e-4 with eps 1e-8). An eps of 1e-6 (the median element is 2e-5) stops that amplification of
    # noise; everything Prodigy and schedule-free compute over the ranks (d, the averaged weights) is unchanged.
    common = (*OPTIMIZERS[name], "training.max_steps=8", "save.backup_every_n_steps=8", "training.precision=fp32",
              "save.save_every_n_steps=4", "optimizer.eps=1e-6")
    GenericTrainer(demo_config(tmp_path / "one", cache_dir, *common, "training.batch_size=8")).run()
    two = demo_config(tmp_path / "two", cache_dir, *common, "training.batch_size=4", "multi_gpu.enabled=true",
                      "multi_gpu.num_gpus=2", "multi_gpu.launcher=spawn")
    assert launch(two) == 0
    one, two = latest_backup_weights(tmp_path / "one"), latest_backup_weights(tmp_path / "two")
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=2e-5, rtol=1e-4, msg=lambda m: f"{key}: {m}")
    groups = [backups.read_backup(backups.latest_backup(tmp_path / run / "backups").path)[1]["optimizer"]["param_groups"][0]
              for run in ("one", "two")]
    if name == "prodigy":  # the step size Prodigy estimated from all weights and gradients
        assert groups[0]["d"] > groups[0]["d0"] and groups[1]["d"] == pytest.approx(groups[0]["d"], rel=1e-5)
    else:  # the weights of schedule-free's average
        assert groups[1]["weight_sum"] == pytest.approx(groups[0]["weight_sum"], rel=1e-12)
    # and the models each saved after every step (schedule-free: the averaged weights) agree too
    saved_one = sorted((tmp_path / "one" / "output").iterdir())
    saved_two = sorted((tmp_path / "two" / "output").iterdir())
    assert [p.name for p in saved_one] == [p.name for p in saved_two] and len(saved_one) == 3  # steps 4 and 8, and the final model
    for a, b in zip(saved_one, saved_two):
        fa, fb = load_file(str(a)), load_file(str(b))
        for key in fa:
            torch.testing.assert_close(fb[key], fa[key], atol=2e-5, rtol=1e-4)


def test_evaluation_weights_show_the_average_and_restore_the_training_weights_exactly():
    pytest.importorskip("schedulefree")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    optimizer = build_optimizer([{"params": params, "lr": 0.1}], OptimizerConfig(name="adamw_schedule_free"),
                                torch.device("cpu"))
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    y = [p.detach().clone() for p in params]
    beta1 = optimizer.param_groups[0]["betas"][0]
    z = [optimizer.state[p]["z"] for p in params]
    with evaluation_weights(optimizer):
        assert not optimizer.param_groups[0]["train_mode"]
        for p, y_, z_ in zip(params, y, z):  # x = y + (1 - 1/beta1)(z - y): schedulefree's own eval()
            torch.testing.assert_close(p.detach(), torch.lerp(y_, z_, 1 - 1 / beta1))
            assert not torch.equal(p.detach(), y_)
    assert optimizer.param_groups[0]["train_mode"]
    assert all(torch.equal(p.detach(), y_) for p, y_ in zip(params, y))  # exactly, not up to rounding
    # Plain optimizers: nothing happens.
    sgd = torch.optim.SGD(params, lr=0.1)
    with evaluation_weights(sgd):
        assert all(torch.equal(p.detach(), y_) for p, y_ in zip(params, y))


@pytest.mark.parametrize("name", ["prodigy", "adamw_schedule_free"])
def test_state_is_tensors_and_plain_values(name, tmp_path):
    """What backups store: it loads with torch.load(weights_only=True)."""
    pytest.importorskip({"prodigy": "prodigyopt", "adamw_schedule_free": "schedulefree"}[name])
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.zeros(4))]
    optimizer = build_optimizer([{"params": params, "lr": 1.0}], OptimizerConfig(name=name), torch.device("cpu"))
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert loaded["param_groups"][0]["k"] == 2 and set(loaded["state"][0]) == set(optimizer.state[params[0]])


def test_effective_lr():
    pytest.importorskip("prodigyopt")
    params = [torch.nn.Parameter(torch.ones(3))]
    prodigy = build_optimizer([{"params": params, "lr": 0.5}], OptimizerConfig(name="prodigy", prodigy_d0=1e-3),
                              torch.device("cpu"))
    assert effective_lr(prodigy) == pytest.approx(0.5 * 1e-3)
    prodigy.param_groups[0]["d"] = 0.02
    assert effective_lr(prodigy) == pytest.approx(0.5 * 0.02)
    prodigy.param_groups[0]["use_bias_correction"] = True  # k = 0: sqrt(1 - 0.999) / (1 - 0.9)
    assert effective_lr(prodigy) == pytest.approx(0.5 * 0.02 * 0.001 ** 0.5 / 0.1)
    assert effective_lr(torch.optim.AdamW(params, lr=3e-4)) == 3e-4


@pytest.mark.parametrize("name, package", [("prodigy", "prodigyopt"), ("adamw_schedule_free", "schedulefree"),
                                           ("adamw_8bit", "bitsandbytes")])
def test_a_missing_package_is_named_with_its_pip_command(monkeypatch, name, package):
    monkeypatch.setitem(sys.modules, package, None)  # `import package` raises ImportError now
    params = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(RuntimeError, match=rf"optimizer.name: {name} needs the {package} package "
                                           rf"\(pip install {package}\), or choose adamw"):
        build_optimizer([{"params": params, "lr": 1.0}], OptimizerConfig(name=name), torch.device("cpu"))
