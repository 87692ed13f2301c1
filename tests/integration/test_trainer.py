"""The single-process trainer on the demo model: learning, both methods, outputs, backups, exact resume."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from modules.config import CONFIG_VERSION
from modules.trainer import backup as backups
from modules.trainer.callbacks import RecordingCallbacks
from modules.trainer.commands import CommandInbox
from tests.trainer_helpers import assert_weights_close, demo_config, latest_backup_weights, train
from tests.patience import patience


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "full"])
def test_loss_goes_down_and_model_is_saved(tmp_path, cache_dir, method):
    cb = RecordingCallbacks()
    lr = "training.learning_rate=0.01" if method == "lora" else "training.learning_rate=0.0005"
    cfg = demo_config(tmp_path / "ws", cache_dir, "training.max_steps=24", lr, method=method)
    trainer = train(cfg, cb)
    losses = [e["loss"] for e in cb.of_type("loss")]
    assert len(losses) == 24
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.9 * first, f"loss did not go down: {first:.4f} -> {last:.4f}"
    done = cb.of_type("done")[-1]
    assert done["completed"] and done["step"] == 24
    out = Path(done["output"])
    if method == "lora":
        tensors = load_file(str(out))
        assert any(k.startswith("lora_unet_") and k.endswith(".lora_up.weight") for k in tensors)
    else:
        assert (out / "unet" / "config.json").is_file() and (out / "model_index.json").is_file()
    # The resolved config is written beside the run for reproducibility, named by the run.
    (config_file,) = (tmp_path / "ws" / "config").iterdir()
    assert config_file.name == f"{trainer.run_id}.json"
    saved = json.loads(config_file.read_text())
    assert saved["training"]["max_steps"] == 24 and saved["__version"] == CONFIG_VERSION
    assert trainer.numbers.global_batch == 8


def test_items_left_out_count_bucket_remainders_and_short_accumulation():
    from modules.trainer.run_numbers import derive_run_numbers
    cfg = demo_config(Path("ws"), Path("cache"), "training.batch_size=4", "training.gradient_accumulation_steps=2")
    # 3 global micro-batches of 8 fit the buckets, but only one step of 2: 1 micro-batch and the
    # 30 - 24 bucket remainder are left out.
    numbers = derive_run_numbers(cfg, world_size=2, micro_batches_per_epoch=3, items_per_epoch=30)
    assert numbers.steps_per_epoch == 1 and numbers.items_left_out == 30 - 16
    assert "30 items/epoch, 14 left out per epoch" in numbers.describe()
    assert "left out" not in derive_run_numbers(cfg, 2, 3).describe()  # unknown without the item count


@pytest.mark.slow
def test_stop_and_resume_equals_uninterrupted(tmp_path, cache_dir):
    """Stop after 5 steps (backup on stop), continue to 10: same weights as 10 steps in one go."""
    common = ("training.max_steps=10", "save.backup_on_stop=true", "training.lr_scheduler=cosine",
              "training.lr_warmup_steps=2", "training.ema=true")
    straight = demo_config(tmp_path / "a", cache_dir, *common, "save.backup_every_n_steps=10")
    train(straight)
    reference = latest_backup_weights(tmp_path / "a")

    class StopAt(RecordingCallbacks):
        def __init__(self, inbox, step):
            super().__init__()
            self.inbox, self.step = inbox, step

        def on_event(self, type_, **fields):
            super().on_event(type_, **fields)
            if type_ == "progress" and fields["step"] == self.step:
                self.inbox.request("stop")

    interrupted = demo_config(tmp_path / "b", cache_dir, *common, "save.backup_every_n_steps=10")
    inbox = CommandInbox()
    # Step 4 is reported while step 5 runs (trainer.step_exchange); a command arriving then is sent
    # with step 5 and acted on when step 5's report comes back, after step 6.
    first = train(interrupted, StopAt(inbox, 4), inbox)
    assert not first.completed and first.global_step == 6
    assert [b.path.name for b in backups.list_backups(tmp_path / "b" / "backups")] == ["step-00000006"]
    assert not (tmp_path / "b" / "output").exists()  # an unfinished run never writes the final model

    resumed_cfg = demo_config(tmp_path / "b", cache_dir, *common, "save.backup_every_n_steps=10")
    second = train(resumed_cfg, resume="latest")
    assert second.completed and second.global_step == 10
    assert_weights_close(latest_backup_weights(tmp_path / "b"), reference, atol=1e-6)


@pytest.mark.slow
def test_interrupted_backup_keeps_previous_and_the_derived_numbers_are_announced(tmp_path, cache_dir, monkeypatch):
    """A backup that fails half-written leaves the previous one; and (checked on the same run) the `config` event
    gives the numbers derived from batch size and accumulation."""
    cfg = demo_config(tmp_path / "ws", cache_dir, "training.max_steps=4", "save.backup_every_n_steps=2",
                      "training.batch_size=4", "training.gradient_accumulation_steps=2")
    calls = {"n": 0}
    real_save = torch.save

    def crash_on_second_backup(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            real_save({"half": "written"}, f)
            raise OSError("disk full (simulated)")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(backups.torch, "save", crash_on_second_backup)
    cb = RecordingCallbacks()
    with pytest.raises(OSError, match="simulated"):
        train(cfg, cb)
    (config_event,) = cb.of_type("config")
    assert config_event["global_batch"] == 8 and config_event["per_gpu_batch"] == 4
    assert config_event["accumulation"] == 2 and config_event["world_size"] == 1
    assert config_event["steps_per_epoch"] == 64 // 4 // 2  # 16 micro-batches of 4, two per step
    bdir = tmp_path / "ws" / "backups"
    assert [b.path.name for b in backups.list_backups(bdir)] == ["step-00000002"]
    newest = backups.latest_backup(bdir)
    assert newest.path.name == "step-00000002" and newest.step == 2
    weights, state, manifest = backups.read_backup(newest.path)
    assert state["global_step"] == 2 and manifest["step"] == 2
    # The next start cleans up the half-written temporary folder.
    run_dir = newest.path.parent
    backups.remove_interrupted(bdir)
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-00000002"]


@pytest.mark.slow
def test_rolling_backups_keep_newest_an_existing_output_stays_and_the_text_encoder_lora_trains(tmp_path, cache_dir):
    """One run of 5 steps checks three things (each was a run of its own): rolling backups keep the newest 2;
    an earlier run's model in output/ is not overwritten (the new one gets a name of its own); the text
    encoder's LoRA trains (its up-weights leave zero)."""
    cfg = demo_config(tmp_path / "ws", cache_dir, "training.max_steps=5", "save.backup_every_n_steps=1",
                      "save.rolling_backup_count=2", "training.train_text_encoder=true")
    out = tmp_path / "ws" / "output" / "demo.safetensors"
    out.parent.mkdir(parents=True)
    out.write_bytes(b"an earlier run's model")
    cb = RecordingCallbacks()
    train(cfg, cb)
    names = [b.path.name for b in backups.list_backups(tmp_path / "ws" / "backups")]
    assert names == ["step-00000004", "step-00000005"], "rolling backups did not keep the newest 2"
    assert out.read_bytes() == b"an earlier run's model", "an existing output was overwritten"
    new = Path(cb.of_type("done")[-1]["output"])
    assert new != out and new.name.startswith("demo-") and new.is_file(), "the new output has no name of its own"
    weights = latest_backup_weights(tmp_path / "ws")
    te_ups = [v for k, v in weights.items() if k.startswith("text_encoder_0.") and "lora_B" in k]
    assert te_ups and any(v.abs().max() > 0 for v in te_ups), "the text encoder's LoRA did not train"


@pytest.mark.slow
def test_commands_file_sample_and_save(tmp_path, cache_dir):
    """`sample` and `save` written to the commands file: sent with the next step, acted on one step later."""
    from modules.config import RunPaths
    from modules.util.run_protocol import write_command

    # every_n_steps=3 makes a scheduled sample due at the very step the command acts: one sample, not two.
    cfg = demo_config(tmp_path / "ws", cache_dir, "training.max_steps=4", "sampling.inference_steps=2",
                      "training.method=lora", "sampling.every_n_steps=3")
    cfg.sampling.prompts = cfg.sampling.prompts[:1]
    commands = RunPaths(cfg).commands_file
    inbox = CommandInbox(commands)

    class Commander(RecordingCallbacks):
        def on_event(self, type_, **fields):
            super().on_event(type_, **fields)
            if type_ == "progress" and fields["step"] == 1:
                write_command(commands, "sample")
                write_command(commands, "save")

    cb = Commander()
    trainer = train(cfg, cb, inbox)
    samples = cb.of_type("sample")
    # Step 1 is reported while step 2 runs; the commands go out with step 2 and act after step 3.
    assert [s["step"] for s in samples] == [3, 4] and Path(samples[0]["path"]).is_file()  # 4: end of training
    # Each run's samples in a folder of their own: a later run in this workspace cannot overwrite them.
    assert Path(samples[0]["path"]).parent == RunPaths(cfg).samples / trainer.run_id
    saved = [Path(s["path"]).name for s in cb.of_type("saved")]
    assert saved == ["demo-step0000003.safetensors", "demo.safetensors"]


def _recording_graph_requests(monkeypatch) -> list[bool]:
    """What the trainer's samplings ask `replayed_from_graphs` for (on a CPU nothing is captured either way)."""
    import modules.model.sampling as sampling
    asked: list[bool] = []
    real = sampling.replayed_from_graphs

    def recorded(module, device, wanted=True):
        asked.append(wanted)
        return real(module, device, wanted)

    monkeypatch.setattr(sampling, "replayed_from_graphs", recorded)
    return asked


@pytest.mark.slow
def test_samples_at_start_and_at_the_end(tmp_path, cache_dir, monkeypatch):
    """A baseline sample before step 1 and the finished model's sample, whatever the cadence; with
    `sampling.cuda_graphs` false both samplings ask for no graphs (true: the one-step run below)."""
    asked = _recording_graph_requests(monkeypatch)
    cfg = demo_config(tmp_path / "ws", cache_dir, "training.max_steps=2", "sampling.sample_at_start=true",
                      "sampling.every_n_epochs=5", "sampling.inference_steps=2", "sampling.cuda_graphs=false")
    cfg.sampling.prompts = cfg.sampling.prompts[:1]
    cb = RecordingCallbacks()
    train(cfg, cb)
    assert [s["step"] for s in cb.of_type("sample")] == [0, 2]
    assert all(Path(s["path"]).is_file() for s in cb.of_type("sample"))
    assert asked == [False, False]


@pytest.fixture(scope="module")
def one_sampling(tmp_path_factory, cache_dir):
    """One run of one step that samples before it, for the three tests below (each was a run of its own):
    every sample write made 0.5 s slower, and each waiting until every image's write has begun; the log
    records of the `tandem` logger; what the sampling asked `replayed_from_graphs` for."""
    import logging
    import threading
    import time

    from PIL import Image

    from modules.trainer import outputs
    workspace = tmp_path_factory.mktemp("one-sampling") / "ws"
    cfg = demo_config(workspace, cache_dir, "training.max_steps=1", "sampling.sample_at_start=true",
                      "sampling.every_n_epochs=0", "sampling.inference_steps=1", "sampling.cuda_graphs=true")
    all_begun = threading.Barrier(len(cfg.sampling.prompts), timeout=patience(20))
    real_write, real_save = outputs.write_sample, Image.Image.save

    def save(image, path, *args, **kwargs):
        if Path(str(path)).parent.parent.name == "samples":  # samples/<run>/: not the demo data's or TensorBoard's
            all_begun.wait()
        return real_save(image, path, *args, **kwargs)

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("tandem")
    level = logger.level
    cb = RecordingCallbacks()
    with pytest.MonkeyPatch.context() as patch:
        asked = _recording_graph_requests(patch)
        patch.setattr(outputs, "write_sample", lambda image, path: (time.sleep(0.5), real_write(image, path)))
        patch.setattr(Image.Image, "save", save)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            train(cfg, cb)
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
    return {"cfg": cfg, "events": cb.of_type("sample"), "lines": [r.getMessage() for r in records], "asked": asked}


@pytest.mark.slow
def test_a_samplings_log_line_says_where_its_time_went(one_sampling):
    """The parts the end-to-end harness reads: moving the models, rendering, moving them back, gathering, writing.
    A write made 0.5 s slower shows in `writing`, and the parts add up to the sampling's time."""
    from modules.benchmark.end_to_end import _read_line
    (line,) = [text for text in one_sampling["lines"] if text.startswith("Samples at step 0:")]
    marks, samplings = {}, []
    _read_line(line, 0.0, marks, {}, samplings)
    (parts,) = marks["sampling_parts"]
    assert list(parts) == ["models to the device", "rendering", "models back", "gathering", "writing"]
    assert parts["writing"] >= 0.5 and min(parts.values()) >= 0
    assert sum(parts.values()) == pytest.approx(samplings[0], abs=0.05 * (len(parts) + 1) + 0.05)


@pytest.mark.slow
def test_a_samplings_images_are_written_at_once_and_announced_in_prompt_order(one_sampling):
    """Written one after another, a sampling's 4 images kept every rank waiting ~1 s on H100 hosts. Each
    write there waits until every image's write has begun: written one at a time, the first would time out."""
    events, prompts = one_sampling["events"], one_sampling["cfg"].sampling.prompts
    assert len(prompts) > 1  # several images to write at once
    assert [Path(e["path"]).name for e in events] == [f"step-0000000-{i}.png" for i in range(len(prompts))]
    assert [e["prompt"] for e in events] == [p.prompt for p in prompts]
    assert all(Path(e["path"]).is_file() for e in events)


@pytest.mark.slow
def test_samples_ask_for_graphs_as_sampling_cuda_graphs_says(one_sampling):
    """The trainer's samplings hand `sampling.cuda_graphs` to the sampling: true here, false in
    test_samples_at_start_and_at_the_end."""
    assert one_sampling["asked"] == [True]


@pytest.mark.slow
def test_train_script_runs_the_demo_and_names_the_items_left_out(tmp_path, cache_dir):
    """scripts/train.py with the demo preset, as the README shows it, in a subprocess; on 10 images at global
    batch 8, 2 are left out each epoch, and the start-up line says so. (One script run checks both.)"""
    from PIL import Image

    from modules.util.run_protocol import parse_event_line
    from tests.trainer_helpers import overrides_for, run_script
    data = tmp_path / "ten"
    data.mkdir()
    for i in range(10):
        Image.new("RGB", (64, 64), (25 * i, 40, 90)).save(data / f"{i}.png")
    result = run_script("train.py", "--config-path", "#demo", *overrides_for(
        tmp_path / "ws", cache_dir, f'data.concepts=[{{"path": "{data}"}}]', "training.max_steps=3"))
    assert result.returncode == 0, result.stderr[-3000:]
    events = [e for e in map(parse_event_line, result.stdout.splitlines()) if e]
    assert [e["step"] for e in events if e["type"] == "loss"] == [1, 2, 3]
    assert events[-1]["type"] == "done" and Path(events[-1]["output"]).is_file()
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("Tandem: ")]
    assert "global batch 8 | 1 steps/epoch" in line and "| 10 items/epoch, 2 left out per epoch |" in line, line
    config = next(e for e in events if e["type"] == "config")
    assert config["items_per_epoch"] == 10 and config["items_left_out"] == 2


@pytest.mark.slow
def test_bad_config_is_reported_by_the_script(tmp_path):
    from tests.trainer_helpers import run_script
    typo = tmp_path / "typo.json"
    typo.write_text('{"training": {"learning_rat": 1}}')
    result = run_script("train.py", "--config-path", str(typo))
    assert result.returncode == 2
    assert "training.learning_rat" in result.stderr and "learning_rate" in result.stderr and str(typo) in result.stderr
    # Values out of range: every one named at once. The script prints any ConfigError as the typo's above, so
    # the config is loaded here instead of in a second script start.
    from modules.config import ConfigError, load_config
    bad = tmp_path / "bad.json"
    bad.write_text('{"training": {"batch_size": 0, "learning_rate": -1}}')
    with pytest.raises(ConfigError) as refused:
        load_config(str(bad))
    assert "training.batch_size" in str(refused.value) and "training.learning_rate" in str(refused.value)


@pytest.mark.slow
def test_resume_with_another_global_batch_keeps_the_images_seen(tmp_path, cache_dir):
    """Stopped at step 4 of 8-image batches (32 images), resumed with 16-image batches: step 2 of 8."""
    common = ("training.epochs=2", "training.max_steps=0", "save.backup_on_stop=true")
    inbox = CommandInbox()

    class StopAt4(RecordingCallbacks):
        def on_event(self, type_, **fields):
            super().on_event(type_, **fields)
            if type_ == "progress" and fields["step"] == 2:  # reported during step 3, sent with it, acted on at 4
                inbox.request("stop")

    first = train(demo_config(tmp_path / "ws", cache_dir, *common, "training.batch_size=8"), StopAt4(), inbox)
    assert first.global_step == 4 and not first.completed
    cb = RecordingCallbacks()
    second = train(demo_config(tmp_path / "ws", cache_dir, *common, "training.batch_size=16",
                               "training.learning_rate=0.003"), cb, resume="latest")
    assert second.completed and second.global_step == 8
    assert [e["step"] for e in cb.of_type("loss")] == [3, 4, 5, 6, 7, 8]
    assert {e["lr"] for e in cb.of_type("loss")} == {0.003}  # this run's LR, not the backup's


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(tmp_path, cache_dir, precision):
    """bf16 autocast, and fp16 autocast with the gradient scaler, give finite, falling losses."""
    cb = RecordingCallbacks()
    trainer = train(demo_config(tmp_path / "ws", cache_dir, "training.max_steps=6", f"training.precision={precision}",
                                "training.learning_rate=0.01"), cb)
    losses = [e["loss"] for e in cb.of_type("loss")]
    assert all(math.isfinite(x) for x in losses) and len(losses) == 6
    assert trainer.scaler.is_enabled() == (precision == "fp16")
    assert all(p.dtype == torch.float32 for p in trainer.trainable_params())  # fp32 master weights
