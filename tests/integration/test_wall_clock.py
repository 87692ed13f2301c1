"""What the user waits for beyond the steps: shut-down, samples on N ranks, backups that do not stall."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from modules.trainer import backup as backups
from modules.trainer.callbacks import RecordingCallbacks
from modules.util.run_protocol import parse_event_line
from modules.trainer.generic_trainer import GenericTrainer
from modules.util.host_copy import snapshot_to_host
from tests.trainer_helpers import REPO, demo_config, launcher_flag, overrides_for, run_script, start_script
from tests.patience import patience


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def rounding_slack(parts: int) -> float:
    """How far a phase and the sum of its parts may differ when the log prints each to 0.1 s: half a
    tenth per printed number (the parts and the phase itself), and a little for float addition."""
    return 0.05 * (parts + 1) + 1e-9


def seconds_from_done_to_exit(script: str, *args: str) -> tuple[float, str]:
    proc = start_script(script, *args, start_new_session=True)
    lines, done_at = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            event = parse_event_line(line)
            if event and event["type"] == "done":
                done_at = time.monotonic()
        proc.wait(timeout=patience(60))
        exited_at = time.monotonic()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    output = "".join(lines)
    assert proc.returncode == 0 and done_at is not None, output[-3000:]
    return exited_at - done_at, output


def exit_run_arguments(workspace: Path, cache_dir: Path, *extra: str) -> list[str]:
    """With DataLoader workers (2 per rank) alive until the end and a sampling at the start."""
    return ["--config-path", "#demo", "--device", "cpu",
            *overrides_for(workspace, cache_dir, "training.max_steps=6", "data.num_workers=2",
                           "sampling.sample_at_start=true", "sampling.inference_steps=2", *extra)]


def check_exit_and_startup_parts(launch: str, took: float, output: str) -> None:
    """The process exited within seconds of `done`, and the start-up's parts add up as the end-to-end
    harness reads them from the log."""
    # 0.3-1.9 s on GPUs (`done_to_exit_s` in docs/perf/*.jsonl), ~1 s here on idle cores; the bound leaves room for
    # a busy CI machine and still fails the 8-25 s exits this guards against (loader workers joined one by one).
    assert took <= patience(5.0), f"{took:.1f} s from done to exit:\n{output[-2000:]}"
    assert "leaked semaphore" not in output, "the spawn launcher's resource tracker found something to clean up"
    # Where the start went, as the end-to-end harness reads it from the log.
    from modules.benchmark.end_to_end import _read_line
    marks, phases = {}, {}
    for line in output.splitlines():
        _read_line(line + "\n", 0.0, marks, phases, [])
    parts = marks.get("startup_parts", {})
    # The model's load in parts: diffusers' import, reading the weights, moving them (docs/Performance.md).
    assert list(parts["model"]) == ["importing diffusers", "reading the weights", "to the CPU"], parts
    assert sum(parts["model"].values()) <= phases["model"] + rounding_slack(3), (parts, phases)
    if launch == "single":
        assert list(parts["launch"]) == ["imports", "config and checks"] and phases["launch"] > 0
        assert abs(sum(parts["launch"].values()) - phases["launch"]) <= rounding_slack(2), (parts, phases)
        return
    # Under spawn the workers are forked from a server that imported what they need once (Linux: forkserver),
    # started before the launcher's checks so that its imports ran beside them.
    starting = (["the forkserver's imports left"] if launch == "spawn" and sys.platform == "linux"
                else ["starting the worker processes"])
    assert list(parts["launch"]) == ["launcher's imports", "launcher's checks", *starting, "worker's imports"]
    assert abs(sum(parts["launch"].values()) - phases["launch"]) <= rounding_slack(len(parts["launch"])), (parts, phases)
    assert list(parts["set-up"]) == ["waiting for the last rank to start", "process group", "choosing the strategy"]
    assert sum(parts["set-up"].values()) <= phases["set-up"] + rounding_slack(3), (parts, phases)
    assert list(parts["cache"]) == ["waiting for the slowest rank's model", "encoding"]
    assert re.search(r"Model loaded in [\d.]+-[\d.]+ s on the 2 ranks \(slowest: rank [01]\)\.", output), output[-2000:]
    assert sum(parts["cache"].values()) <= phases["cache"] + rounding_slack(2), (parts, phases)


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["single", "torchrun"])
def test_the_process_exits_within_seconds_of_done(tmp_path, cache_dir, launch):
    """DataLoader workers are not joined one by one at the end. A sampling at the start creates tqdm's
    multiprocessing lock (diffusers' progress bar). The spawn launcher's case (whose resource tracker
    reported that lock's semaphore as leaked when the workers skipped their clean-up) is one of the checks
    of test_a_two_rank_spawn_run_samples_backs_up_profiles_and_exits_at_once, on the same arguments."""
    common = exit_run_arguments(tmp_path / "ws", cache_dir)
    if launch == "single":
        took, output = seconds_from_done_to_exit("train.py", *common)
    else:
        took, output = seconds_from_done_to_exit("train_multi_gpu.py", *common, "--num-gpus", "2",
                                                 *launcher_flag(launch))
    check_exit_and_startup_parts(launch, took, output)


@pytest.mark.slow
def test_a_two_rank_spawn_run_samples_backs_up_profiles_and_exits_at_once(tmp_path, cache_dir, monkeypatch):
    """One 2-rank spawn launch (each costs a launcher, a forkserver and two workers) checked for four things:

    - it exits within seconds of `done` with nothing leaked (see test_the_process_exits_within_seconds_of_done);
    - samples: each rank renders its share of the prompts (rank r: prompts r, r+2, ...); rank 0 writes them
      all. Same seeds, same weights (at the start) -> the same pixels as one process rendering every prompt;
    - time-based backups: rank 0's clock decides and the step exchange carries the decision, so both ranks
      back up together (were each rank to decide by its own clock, the backup's collective would hang);
    - TANDEM_PROFILE_STEPS: every rank profiles the same steps and the lead reports all of them (one process:
      tests/unit/test_profiling.py)."""
    sampling = ("sampling.sample_at_start=true", "sampling.inference_steps=2", "sampling.every_n_epochs=0")
    one_run = RecordingCallbacks()
    GenericTrainer(demo_config(tmp_path / "one", cache_dir, "training.max_steps=1", *sampling), one_run).run()
    prompts = len(demo_config(tmp_path, cache_dir).sampling.prompts)
    assert prompts >= 3  # so that both ranks render, and one of them more than one

    monkeypatch.setenv("TANDEM_PROFILE_STEPS", "2:2")
    args = exit_run_arguments(tmp_path / "two", cache_dir, "save.backup_every_n_minutes=0.001",
                              "save.rolling_backup_count=100", "multi_gpu.timeout_minutes=2")
    took, output = seconds_from_done_to_exit("train_multi_gpu.py", *args, "--num-gpus", "2", *launcher_flag("spawn"))
    check_exit_and_startup_parts("spawn", took, output)
    events = [e for e in map(parse_event_line, output.splitlines()) if e]

    # Samples rendered by two ranks equal those of one.
    samples = [e for e in events if e["type"] == "sample"]
    assert [(e["step"], e["rank"]) for e in samples] == [(0, i % 2) for i in range(prompts)], "each rank its share"
    assert f"Samples at step 0: {prompts} sample(s) in " in output, "what a sampling cost the run"
    assert "each rendered its share); parts: models to the device " in output, "the slowest rank's parts"
    assert {e["rank"] for e in one_run.of_type("sample")} == {0}
    one = sorted((tmp_path / "one" / "samples").glob("*/step-0000000-*.png"))
    two = sorted((tmp_path / "two" / "samples").glob("*/step-0000000-*.png"))
    assert [p.name for p in one] == [p.name for p in two] and len(one) == prompts, "rank 0 writes every sample"
    for a, b in zip(one, two):
        assert Image.open(a).tobytes() == Image.open(b).tobytes(), f"two ranks' pixels differ from one's: {a.name}"

    # Time-based backups on two ranks happen at the same step.
    steps = [e["step"] for e in events if e["type"] == "backup"]
    assert len(steps) >= 3 and steps == sorted(set(steps)), f"time-based backups, once per step: {steps}"
    assert [b.step for b in backups.list_backups(tmp_path / "two" / "backups")] == steps, "every backup announced"

    # Every rank profiles the same steps and the lead reports all of them.
    (profile,) = [e for e in events if e["type"] == "profile"]
    assert len(profile["ranks"]) == 2 and all(r["steps"] == 2 for r in profile["ranks"]), profile
    assert "Profile of steps 2-3: rank 0: " in output and "; rank 1: " in output, "the lead's line names each rank"
    reports = sorted(p.name[-9:] for p in (tmp_path / "two" / "profiles").glob("*-steps-2-3-rank*.txt"))
    assert reports == ["rank0.txt", "rank1.txt"], "one profile report per rank"


def test_a_snapshot_keeps_the_values_of_its_step():
    weights = {"w": torch.ones(3)}
    snap = snapshot_to_host({"weights": weights, "step": 4, "rng": (1, [2, 3])})
    weights["w"].add_(1)  # training goes on changing the live tensors
    value = snap.ready()
    assert torch.equal(value["weights"]["w"], torch.ones(3)) and value["step"] == 4 and value["rng"] == (1, [2, 3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
def test_a_gpu_snapshot_holds_its_steps_values_while_the_next_steps_change_them():
    """The copies are queued on the stream: the in-place updates queued after them (the next optimizer
    steps) must not reach the snapshot, however busy the GPU still is when it is read."""
    device = torch.device("cuda")
    live = {"weights": {"w": torch.randn(4096, 4096, device=device)}, "adam": [torch.randn(1024, device=device)],
            "step": torch.tensor(7)}
    expected = {"w": live["weights"]["w"].cpu(), "adam": live["adam"][0].cpu()}
    snap = snapshot_to_host(live)
    for _ in range(20):  # slow enough that the GPU is still busy when the snapshot is read
        live["weights"]["w"].mul_(1.01).add_(live["weights"]["w"] @ live["weights"]["w"] * 1e-6)
        live["adam"][0].add_(1)
    value = snap.ready()
    assert value["weights"]["w"].device.type == "cpu" and torch.equal(value["weights"]["w"], expected["w"])
    assert torch.equal(value["adam"][0], expected["adam"]) and int(value["step"]) == 7


@pytest.mark.slow
def test_backups_go_on_beside_training_report_their_pinning_free_it_and_the_first_step_line(tmp_path, cache_dir,
                                                                                            monkeypatch, caplog):
    """One in-process run (4 steps, a backup every 2, a loader worker) checked for four things, each a run
    of its own before:

    - backups are written while training goes on: the write of step 2's backup is held until the loop has
      reported step 2, which it does while running step 3. The run still ends with every backup complete
      and announced (the end of the run waits for the write in flight);
    - a backup says how much of its pause went to pinning host memory: on GPUs the first snapshot grows
      PyTorch's pinned host memory pool (seconds for a full fine-tune's first backup, a fraction of it for
      later ones); the log and the event say so;
    - a finished run frees the backups' pinned memory once the last is written: a full SD1.5 fine-tune's
      backups leave 10 GB of it, which freed at the exit would delay it by seconds after `done`. The writer
      frees it after the last backup, once, in the run;
    - the first step's line says what ran before it in words the harness reads (the wait between the
      start-up summary and step 1, seconds under spawn on GPUs): the line splits that wait, and the
      end-to-end harness (modules/benchmark/end_to_end.py) reads it from the real log."""
    from modules.benchmark.end_to_end import _read_line
    from modules.trainer import backup_writer

    release = threading.Event()
    real_write = backups.write_backup
    waited, order = [], []

    def held_write(*args, **kwargs):
        waited.append(release.wait(timeout=patience(60)))
        path = real_write(*args, **kwargs)
        order.append("backup")
        return path

    class ReleaseAtStep2(RecordingCallbacks):
        def on_event(self, type_, **fields):
            super().on_event(type_, **fields)
            if type_ == "progress" and fields["step"] == 2:
                self.steps_before_release = [e["step"] for e in self.of_type("backup")]
                release.set()

    monkeypatch.setattr(backups, "write_backup", held_write)
    pool_growth = iter([0.0, 2.5, 2.5, 2.5])  # seconds spent pinning so far: before/after each of two backups
    monkeypatch.setattr(backup_writer, "pinned_alloc_seconds", lambda: next(pool_growth))
    monkeypatch.setattr(backup_writer, "release_pinned_pool", lambda: order.append("release") or 10_000_000_000)
    cb = ReleaseAtStep2()
    with caplog.at_level("INFO"):
        GenericTrainer(demo_config(tmp_path / "ws", cache_dir, "training.max_steps=4", "save.backup_every_n_steps=2",
                                   "data.num_workers=1"), cb).run()
    messages = [r.getMessage() for r in caplog.records]

    # Backups are written while training goes on.
    assert waited == [True, True], "both writes were held, then released"
    assert cb.steps_before_release == [], "step 2's backup was not yet written when step 3 ran"
    assert [e["step"] for e in cb.of_type("backup")] == [2, 4], "every backup announced by the run's end"
    assert [b.step for b in backups.list_backups(tmp_path / "ws" / "backups")] == [2, 4], "every backup complete"
    # What each backup cost the loop is reported; the write held for a step did not count.
    assert all(0 <= e["paused_s"] < 5 for e in cb.of_type("backup")), cb.of_type("backup")

    # A backup says how much of its pause went to pinning host memory.
    assert [e["pinned_alloc_s"] for e in cb.of_type("backup")] == [2.5, 0.0], "the event's pinning seconds"
    written = [m for m in messages if m.startswith("Backup written")]
    assert len(written) == 2
    assert "2.50 s of it allocating pinned host memory" in written[0] and "pinned" not in written[1], written

    # A finished run frees the backups' pinned memory once the last is written.
    assert order == ["backup", "backup", "release"], "the pinned pool is freed once, after the last backup"
    assert any(m.startswith("Released the backups' 10.0 GB of pinned host memory") for m in messages)

    # The first step's line says what ran before it, in words the harness reads.
    (line,) = [m for m in messages if m.startswith("First step: ")]
    (cached,) = [m for m in messages if m.startswith("Cache ready in ")]
    assert re.fullmatch(r"Cache ready in [\d.]+ s", cached), cached  # one process: no "(1 processes, ...)"
    marks: dict = {}
    _read_line(line, 0.0, marks, {}, [])
    assert marks["first_step_s"] >= 0 and marks["summary_to_step1_s"] >= 0, line
    assert 0 <= marks["loader_workers_s"] <= marks["summary_to_step1_s"] + 0.05, line


KILL_DURING_WRITE = r"""
import os, sys, time
sys.path.insert(0, {repo!r})
import torch
from modules.trainer import backup as backups
real = torch.save
def slow_save(obj, f, *a, **k):
    real(obj, f, *a, **k)
    print("writing", flush=True)
    time.sleep(60)  # killed here, mid-write
backups.torch.save = slow_save
from modules.trainer.backup_writer import BackupWriter
from modules.util.host_copy import snapshot_to_host
w = BackupWriter({bdir!r}, "run-a", keep=3)
w.submit(2, snapshot_to_host({{"w": torch.full((4,), 2.0)}}), snapshot_to_host({{"global_step": 2}}), {{}})
"""


@pytest.mark.slow
def test_a_kill_during_a_background_write_leaves_the_previous_backup(tmp_path):
    bdir = tmp_path / "backups"
    backups.write_backup(bdir, "run-a", 1, {"w": torch.ones(4)}, {"global_step": 1}, {}, keep=3)
    proc = subprocess.Popen([sys.executable, "-c", KILL_DURING_WRITE.format(repo=str(REPO), bdir=str(bdir))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.kill()
    proc.wait()
    found = backups.list_backups(bdir)
    assert [b.step for b in found] == [1]
    weights, state, _ = backups.read_backup(found[0].path)
    assert torch.equal(weights["w"], torch.ones(4)) and state["global_step"] == 1


@pytest.mark.parametrize("base, builtin", [("builtin:demo", True), ("{folder}", False)])
def test_ranks_load_the_model_at_once_after_rank_0_built_a_builtin_ones_files(monkeypatch, tmp_path, base, builtin):
    """Every rank loads the model at the same time (in turn, 4 GPUs spent 4 loads' time before step 1, and a
    2-process demo start on 2 CPU cores 4-5 s): only building a built-in model's files on first use goes to
    rank 0 first, and a model on disk needs no turn at all."""
    import contextlib
    from types import SimpleNamespace

    from modules.config import TrainConfig
    from modules.trainer.base_trainer import BaseTrainer
    from modules.trainer.hand_ins import HandIns
    from modules.util import dist_utils as du

    turns = []

    @contextlib.contextmanager
    def main_first():
        turns.append("rank 0 first: begins")
        yield
        turns.append("rank 0 first: the others follow")

    bundle = SimpleNamespace(family=SimpleNamespace(check_image_sizes=lambda sizes, bundle=None: None,
                                                    check_clips=lambda clips, frames: None))
    monkeypatch.setattr(du, "main_first", main_first)
    monkeypatch.setattr("modules.model.loading.resolve_family", lambda model_cfg: turns.append("build"))
    monkeypatch.setattr("modules.model.loading.load_model", lambda *args: turns.append("load") or bundle)
    cfg = TrainConfig()
    cfg.model.base_model = base.format(folder=tmp_path)
    trainer = SimpleNamespace(cfg=cfg, device=torch.device("cpu"), dataset=SimpleNamespace(bucket_sizes=[], clip_paths=list),
                              load_device=lambda: torch.device("cpu"), text_apart=None, parts_waiting_on_host=frozenset,
                              startup=SimpleNamespace(parts={}), hand_ins=HandIns())
    assert BaseTrainer.create_model(trainer) is bundle
    assert turns == (["rank 0 first: begins", "build", "rank 0 first: the others follow", "load"] if builtin
                     else ["load"])


@pytest.mark.slow
def test_cached_text_with_caption_dropout_trains_as_the_text_encoder_does(tmp_path, cache_dir):
    """The demo preset has caption dropout (as the SD presets do): its text is now cached, with the empty
    caption beside the captions, so no step runs the text encoder - and the run trains as one that encodes
    every caption in its step (the same captions drawn, the same embeddings, the same losses). Both runs share
    one cache folder (the image latents encoded once): the run that encodes its captions goes first and must
    leave no text there."""
    losses = {}
    cache = tmp_path / "cache"
    for cached in (False, True):
        callbacks = RecordingCallbacks()
        cfg = demo_config(tmp_path / f"ws-{cached}", cache, "training.max_steps=4",
                          "data.caption_dropout=0.5", f"data.cache_text_embeddings={str(cached).lower()}")
        GenericTrainer(cfg, callbacks).run()
        losses[cached] = [event["loss"] for event in callbacks.of_type("loss")]
        if not cached:
            assert not list(cache.glob("text/*.safetensors")), "text cached by a run that encodes its captions"
    texts = list((cache / "text").glob("*.safetensors"))
    assert len(texts) == 65, "64 demo captions and the empty one"
    assert len(losses[True]) == 4 and losses[True] == pytest.approx(losses[False], rel=1e-5, abs=0)


def test_fast_pinning_is_added_to_the_users_allocator_settings_and_never_overrides_their_pinning(monkeypatch):
    """cudaHostRegister from 8 threads pins a full fine-tune's first backup several times faster than PyTorch's
    default pinning (docs/Performance.md): Tandem asks for it, keeping whatever else the user's allocator
    settings say, unless they chose how to pin."""
    import modules.util.host_copy as host_copy
    applied = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", applied.append, raising=False)
    monkeypatch.setattr(host_copy, "_applied", [])
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    assert host_copy.use_fast_pinning() and applied == [host_copy.FAST_PINNING]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert host_copy.use_fast_pinning() and applied[-1] == "expandable_segments:True," + host_copy.FAST_PINNING
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "pinned_use_cuda_host_register:False")
    assert not host_copy.use_fast_pinning() and len(applied) == 2


def test_layer_offload_asks_for_expandable_segments_keeping_every_other_setting(monkeypatch):
    """Layer offload frees and allocates a block's copy of each size at every step: with fixed segments a
    Flux.2-dev LoRA on an H200 held to 24 GiB ran out of memory before its first step, 9 GiB reserved but
    unused. Tandem's settings are restated together (each call replaces the last), the user's own kept, and a
    user who chose about expandable segments keeps their choice."""
    import modules.util.host_copy as host_copy
    applied = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", applied.append, raising=False)
    monkeypatch.setattr(host_copy, "_applied", [])
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    assert host_copy.use_fast_pinning() and host_copy.use_expandable_segments()
    assert applied[-1] == f"{host_copy.FAST_PINNING},{host_copy.EXPANDABLE_SEGMENTS}"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert host_copy.use_expandable_segments()
    assert applied[-1] == f"max_split_size_mb:512,{host_copy.FAST_PINNING},{host_copy.EXPANDABLE_SEGMENTS}"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    assert not host_copy.use_expandable_segments() and len(applied) == 3
