"""GUI controllers without a display: binding, validation mapping, commands, events, runs."""
from __future__ import annotations

import json
import os
import sys
import textwrap
import types
import time
from pathlib import Path

import pytest
import torch

from modules.config import TrainConfig, config_to_dict, read_json
from modules.config.field_paths import leaf_paths
from modules.launch.spec import resolve_launch
from ui.binding import FieldError, field_doc, field_type, get_value, set_value
from ui.config_model import ConfigModel, problem_field, problems_by_field
from ui.events import LogLine, TrainingEvent, format_duration, parse_line
from ui.launch_command import MULTI_SCRIPT, SINGLE_SCRIPT, build_command, run_config
from ui.multi_gpu_settings import cpu_process_values, cpu_processes, gpu_selection_values, selected_gpus
from ui.multi_gpu_summary import format_lr, summarize
from ui.run_controller import RunController
from ui.settings import RecentConfigs
from tests.trainer_helpers import hold_lock
from tests.patience import patience


# --- binding -----------------------------------------------------------------------------------
def test_binding_converts_text_to_the_field_type():
    cfg = TrainConfig()
    assert set_value(cfg, "training.batch_size", "8") == 8
    assert set_value(cfg, "training.learning_rate", "1e-4") == pytest.approx(1e-4)
    assert set_value(cfg, "training.gradient_checkpointing", "on") is True
    assert set_value(cfg, "training.lora_target_modules", "to_q, to_v ,") == ["to_q", "to_v"]
    assert set_value(cfg, "training.epochs", "3.0") == 3
    assert cfg.training.batch_size == 8 and get_value(cfg, "training.epochs") == 3


def test_binding_rejects_bad_text_and_keeps_the_old_value():
    cfg = TrainConfig()
    with pytest.raises(FieldError, match="whole number"):
        set_value(cfg, "training.batch_size", "eight")
    with pytest.raises(FieldError, match="whole number"):
        set_value(cfg, "training.batch_size", "2.5")
    with pytest.raises(FieldError, match="number"):
        set_value(cfg, "training.learning_rate", "1e-")
    with pytest.raises(FieldError, match="on or off"):
        set_value(cfg, "data.random_flip", "maybe")
    assert cfg.training.batch_size == 1 and cfg.training.learning_rate == 1e-4


def test_binding_reaches_list_items_and_names_bad_paths():
    cfg = TrainConfig()
    set_value(cfg, "data.concepts[0].repeats", "5")
    assert cfg.data.concepts[0].repeats == 5
    assert field_type("data.concepts[3].enabled") is bool
    with pytest.raises(KeyError, match="no item 2"):
        get_value(cfg, "data.concepts[2].path")
    with pytest.raises(KeyError, match="has no field 'batch_sise'"):
        get_value(cfg, "training.batch_sise")
    assert "data.concepts[0].caption_extension" in leaf_paths(cfg)


def test_tooltips_come_from_the_field_docstrings():
    assert field_doc("training.batch_size").startswith("Images per GPU per micro-batch")
    assert field_doc("sampling.prompts[0].seed").startswith("Seed of the sample")
    every = [field_doc(path) for path in leaf_paths(TrainConfig())]
    assert all(every), "every field shown in the GUI needs a docstring"


# --- model and validation ----------------------------------------------------------------------
def test_validation_messages_map_to_their_fields():
    assert problem_field("training.batch_size: 0 is not allowed; set it to 1 or more.") == "training.batch_size"
    assert problem_field("data.concepts[1].repeats: 0 is not allowed") == "data.concepts[1].repeats"
    assert problem_field("the top level must be an object") is None
    model = ConfigModel()
    model.set("training.batch_size", "0")
    model.set("data.resolution", "500")
    grouped = problems_by_field(model.problems())
    assert "training.batch_size" in grouped and "data.resolution" in grouped
    assert "set it to 512" in grouped["data.resolution"][0]


def test_model_tracks_unsaved_changes_and_round_trips_json(tmp_path):
    model = ConfigModel()
    heard = []
    model.subscribe(heard.append)
    assert not model.dirty
    model.set("training.batch_size", "4")
    model.set("training.batch_size", 4)  # same value: no second notification
    assert model.dirty and heard == ["training.batch_size"]
    saved = model.save(tmp_path / "mine.json")
    assert not model.dirty and read_json(saved)["training"]["batch_size"] == 4
    other = ConfigModel()
    other.load_file(saved)
    assert config_to_dict(other.cfg) == config_to_dict(model.cfg) and other.source_name == "mine"


def test_model_update_is_all_or_nothing():
    model = ConfigModel()
    with pytest.raises(FieldError):
        model.update({"multi_gpu.num_gpus": 2, "training.batch_size": "x"})
    assert model.cfg.multi_gpu.num_gpus == 0


def test_recent_configs_survive_restarts_and_damage(tmp_path):
    recent = RecentConfigs(tmp_path)
    (tmp_path / "a.json").write_text("{}")
    recent.remember(tmp_path / "a.json")
    again = RecentConfigs(tmp_path)
    assert again.last == str((tmp_path / "a.json").resolve()) and again.existing() == [again.last]
    (tmp_path / "recent.json").write_text("not json")
    assert RecentConfigs(tmp_path).last is None


# --- launch command lines ----------------------------------------------------------------------
def test_single_process_command():
    cfg = TrainConfig()
    assert build_command(cfg, "c.json", 4, python="py") == ["py", str(SINGLE_SCRIPT), "--config-path", "c.json"]
    cfg.multi_gpu.enabled = True  # enabled but only one GPU visible: still one process
    assert build_command(cfg, "c.json", 1, python="py")[1] == str(SINGLE_SCRIPT)


def test_multi_gpu_command_names_only_the_config():
    """The launcher resolves the config file as the GUI does: no option repeats a value of it."""
    cfg = TrainConfig()
    cfg.multi_gpu.enabled = True
    assert build_command(cfg, "c.json", 4, python="py") == ["py", str(MULTI_SCRIPT), "--config-path", "c.json"]
    cfg.multi_gpu.launcher = "spawn"
    cfg.multi_gpu.device_indexes = "1,3"
    cfg.multi_gpu.backend = "gloo"
    cfg.multi_gpu.master_port = 29511
    assert build_command(cfg, "c.json", 4, python="py") == ["py", str(MULTI_SCRIPT), "--config-path", "c.json"]
    launch = resolve_launch(cfg, 4)
    assert (launch.launcher, launch.world_size, launch.gpus, launch.backend) == ("spawn", 2, (1, 3), "gloo")


def test_cpu_process_command():
    cfg = TrainConfig()
    for path, value in cpu_process_values("3").items():
        set_value(cfg, path, value)
    command = build_command(cfg, "c.json", 0, python="py")
    assert command == ["py", str(MULTI_SCRIPT), "--config-path", "c.json"]
    launch = resolve_launch(cfg, 0)
    assert (launch.world_size, launch.device_type, launch.backend, launch.problem) == (3, "cpu", "gloo", None)
    assert cpu_processes(cfg) == "3"
    for path, value in cpu_process_values("off").items():
        set_value(cfg, path, value)
    assert cpu_processes(cfg) == "off" and cfg.general.device == "auto"


# --- multi-GPU frame maths ---------------------------------------------------------------------
def test_summary_line_follows_batch_accumulation_gpus_and_scaling():
    cfg = TrainConfig()
    cfg.multi_gpu.enabled = True
    cfg.training.batch_size = 8
    cfg.multi_gpu.lr_scaling = "linear"
    assert summarize(cfg, 2).line() == "World size 2 · global batch 16 (8 x 1 x 2) · LR 1e-4 -> 2e-4 (linear)"
    cfg.training.gradient_accumulation_steps = 3
    cfg.multi_gpu.lr_scaling = "sqrt"
    cfg.multi_gpu.device_indexes = "0,1,2,3"
    summary = summarize(cfg, 8)
    assert summary.global_batch == 96 and summary.lr == pytest.approx(2e-4)
    assert summary.line().endswith("LR 1e-4 -> 2e-4 (sqrt)")
    cfg.multi_gpu.enabled = False
    assert summarize(cfg, 8).line() == "World size 1 · global batch 24 (8 x 3 x 1) · LR 1e-4"
    assert format_lr(3.16e-5) == "3.16e-5" and format_lr(0.5) == "0.5"
    cfg.multi_gpu.enabled, cfg.multi_gpu.context_parallel, cfg.multi_gpu.lr_scaling = True, 2, "linear"
    assert summarize(cfg, 8).line() == ("World size 4 · global batch 48 (8 x 3 x 2 group(s) of 2, each sample split "
                                        "over its group) · LR 1e-4 -> 2e-4 (linear)")


def test_gpu_selection_writes_indexes_or_all():
    cfg = TrainConfig()
    assert gpu_selection_values([0, 1, 2], [0, 1, 2]) == {"multi_gpu.device_indexes": "", "multi_gpu.num_gpus": 0}
    values = gpu_selection_values([2, 0], [0, 1, 2])
    assert values == {"multi_gpu.device_indexes": "0,2", "multi_gpu.num_gpus": 2}
    for path, value in values.items():
        set_value(cfg, path, value)
    assert selected_gpus(cfg, [0, 1, 2]) == [0, 2]


# --- events ------------------------------------------------------------------------------------
def test_event_lines_parse_and_other_lines_are_log():
    event = parse_line('@tandem {"type": "progress", "epoch": 1, "epochs": 2, "step": 3, "total_steps": 10}\n')
    assert event == TrainingEvent("progress", {"epoch": 1, "epochs": 2, "step": 3, "total_steps": 10})
    assert parse_line("loading model...\n") == LogLine("loading model...")
    broken = parse_line("@tandem {not json")
    assert isinstance(broken, LogLine) and "unreadable event" in broken.text
    unknown = parse_line('@tandem {"type": "party"}')
    assert isinstance(unknown, LogLine) and "unknown event type 'party'" in unknown.text
    assert format_duration(3725) == "1:02:05" and format_duration(65) == "1:05" and format_duration(None) == "-"


# --- the run controller with a fake trainer ----------------------------------------------------
FAKE_TRAINER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    commands = Path(sys.argv[1])
    def emit(**event):
        print("@tandem " + json.dumps(event), flush=True)
    emit(type="config", world_size=2, per_gpu_batch=1, accumulation=1, global_batch=2,
         steps_per_epoch=50, total_steps=100, base_lr=1e-4, lr=2e-4)
    for step in range(1, 101):
        print(f"plain log line {step}", flush=True)
        emit(type="progress", epoch=1, epochs=2, step=step, total_steps=100, images_per_s=3.5, eta_s=10)
        emit(type="loss", step=step, loss=1.0 / step, lr=2e-4)
        if "stop" in commands.read_text().split():
            emit(type="backup", path="backups/step-%d" % step)
            emit(type="status", text="stopped")
            sys.exit(0)
        time.sleep(0.05)
    emit(type="done", output="out.safetensors")
""")

CRASHING_TRAINER = textwrap.dedent("""
    import sys
    for i in range(40):
        print(f"line {i}", flush=True)
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
    sys.exit(1)
""")


def _workspace_config(tmp_path: Path) -> TrainConfig:
    cfg = TrainConfig()
    cfg.general.workspace_dir = str(tmp_path / "run")
    return cfg


def test_run_controller_follows_progress_and_stop_lands_in_the_commands_file(tmp_path):
    controller = RunController()
    cfg = _workspace_config(tmp_path)
    commands = tmp_path / "run" / ".tandem" / "commands"
    commands.parent.mkdir(parents=True)
    commands.write_text("stop\n")  # left over from an earlier run: must not stop this one
    controller.start(cfg, 0, command=[sys.executable, "-c", FAKE_TRAINER, str(commands)])
    assert commands.read_text() == ""
    assert json.loads((commands.parent / "gui-config.json").read_text())["general"]["workspace_dir"] == str(tmp_path / "run")
    deadline = time.monotonic() + patience(180)  # a busy machine: the loop ends as soon as it is done
    while controller.state.step < 3 and time.monotonic() < deadline:
        controller.poll()
        time.sleep(0.02)
    state = controller.state
    assert state.status == "running" and state.step >= 3 and state.total_steps == 100
    assert state.run_info["world_size"] == 2 and state.losses[0] == (1, 1.0)
    controller.send("sample")
    controller.stop()
    assert commands.read_text() == "sample\nstop\n"
    assert controller.wait(patience(20))
    assert controller.state.status == "stopped" and controller.state.backups
    assert controller.state.step < 100 and any(line.startswith("plain log line") for line in controller.log)
    with pytest.raises(RuntimeError, match="no training is running"):
        controller.send("save")


def test_run_controller_reports_a_crash_with_its_last_lines(tmp_path):
    controller = RunController()
    controller.start(_workspace_config(tmp_path), 0, command=[sys.executable, "-c", CRASHING_TRAINER])
    assert controller.wait(patience(20))
    state = controller.state
    assert state.status == "failed"
    assert "ran out of memory" in state.error and "exit code 1" in state.error
    assert "line 39" in state.error and "line 0\n" not in state.error  # only the tail


def test_run_controller_ends_a_run_that_ignores_stop(tmp_path):
    controller = RunController(stop_timeout_s=0.5)
    stubborn = "import time\nprint('working', flush=True)\ntime.sleep(60)"
    controller.start(_workspace_config(tmp_path), 0, command=[sys.executable, "-c", stubborn])
    deadline = time.monotonic() + patience(180)  # a busy machine: the loop ends as soon as it is done
    while controller.log_count <= 1 and time.monotonic() < deadline:
        controller.poll()
        time.sleep(0.02)
    controller.stop()
    assert controller.wait(patience(15))
    assert controller.state.status == "stopped" and "did not stop" in "\n".join(controller.log)


def test_unknown_command_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown command 'pause'"):
        RunController().send("pause")


def test_summary_world_size_matches_the_launcher_for_cpu_processes():
    """The live line must show the number of processes the launcher will actually start."""
    from modules.config import TrainConfig, apply_overrides
    from modules.distributed.launch import plan_launch
    from ui.multi_gpu_summary import summarize
    for count in (0, 3):
        cfg = apply_overrides(TrainConfig(), ["general.device=cpu", "multi_gpu.enabled=true",
                                              f"multi_gpu.num_gpus={count}"])
        assert summarize(cfg, visible_gpus=0).world_size == plan_launch(cfg).world_size


def test_the_gui_and_the_launcher_resolve_a_launch_alike(monkeypatch):
    """One function resolves a launch: what the GUI shows and chooses is what the launcher starts."""
    from modules.config import apply_overrides
    from modules.distributed.launch import plan_launch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    for values in ([], ["multi_gpu.num_gpus=2"], ["multi_gpu.device_indexes=1,3"], ["multi_gpu.launcher=spawn"],
                   ["multi_gpu.lr_scaling=sqrt", "training.gradient_accumulation_steps=2"]):
        cfg = apply_overrides(TrainConfig(), ["multi_gpu.enabled=true", *values])
        plan = plan_launch(cfg)
        assert plan.spec == resolve_launch(cfg, 4, cuda_visible="4,5,6,7")
        summary = summarize(cfg, 4)
        assert (summary.world_size, summary.global_batch, summary.lr) == (plan.world_size, plan.spec.global_batch,
                                                                          plan.spec.lr)
    cfg = apply_overrides(TrainConfig(), ["multi_gpu.enabled=true", "multi_gpu.device_indexes=1,3"])
    assert plan_launch(cfg).visible_devices == "5,7"  # indexes count among the GPUs the user made visible


def test_continue_passes_resume_on_either_launcher():
    cfg = TrainConfig()
    assert build_command(cfg, "c.json", 1, python="py", resume="latest")[-2:] == ["--resume", "latest"]
    cfg.multi_gpu.enabled = True
    command = build_command(cfg, "c.json", 4, python="py", resume="latest")
    assert command[1] == str(MULTI_SCRIPT) and command[-2:] == ["--resume", "latest"]
    assert "--resume" not in build_command(cfg, "c.json", 4, python="py")


def test_start_is_refused_while_another_run_holds_the_workspace(tmp_path):
    cfg = _workspace_config(tmp_path)
    commands = tmp_path / "run" / ".tandem" / "commands"
    holder = hold_lock(tmp_path / "run")
    try:
        commands.write_text("sample\n")  # the other run's pending command must survive
        controller = RunController()
        with pytest.raises(RuntimeError, match=rf"in use by another run \(process {holder.pid}"):
            controller.start(cfg, 0, command=[sys.executable, "-c", "pass"])
        assert controller.state.status == "idle" and commands.read_text() == "sample\n"
    finally:
        holder.kill()
        holder.wait()


def test_newest_backup_is_what_continue_resumes(tmp_path):
    from modules.trainer.backup import write_backup

    cfg = _workspace_config(tmp_path)
    controller = RunController()
    assert controller.newest_backup(cfg) is None
    write_backup(tmp_path / "run" / "backups", "run-a", 12, {"w": torch.zeros(1)}, {}, {}, keep=2)
    assert controller.newest_backup(cfg).step == 12


# --- issue 20: what a run shows, and what Start does ---------------------------------------------
def test_status_headline_never_repeats_the_status():
    from ui.run_controller import RunState
    assert RunState(status="failed", message="").headline == "Failed"
    assert RunState(status="failed", message="Failed").headline == "Failed"
    assert RunState(status="running", message="loading the model").headline == "Running - loading the model"


def test_a_failed_or_finished_run_says_so_once(tmp_path):
    controller = RunController()
    controller.start(_workspace_config(tmp_path), 0, command=[sys.executable, "-c", CRASHING_TRAINER])
    assert controller.wait(patience(20))
    assert controller.state.headline == "Failed"
    controller.start(_workspace_config(tmp_path), 0, command=[sys.executable, "-c", "print('ok')"])
    assert controller.wait(patience(20))
    assert controller.state.headline == "Finished"


RESUMABLE_TRAINER = textwrap.dedent("""
    import json, sys
    first, last = int(sys.argv[1]), int(sys.argv[2])
    for step in range(first, last + 1):
        print("@tandem " + json.dumps({"type": "loss", "step": step, "loss": float(sys.argv[3]) / step,
                                       "rank_losses": [0.1 * step, 0.2 * step]}), flush=True)
        print("@tandem " + json.dumps({"type": "progress", "epoch": 1, "epochs": 1, "step": step,
                                       "total_steps": last, "images_per_s": 2.0, "eta_s": 1,
                                       "rank_images_per_s": [1.0, 1.5]}), flush=True)
""")


def _run_steps(controller, cfg, first, last, scale):
    controller.start(cfg, 0, command=[sys.executable, "-c", RESUMABLE_TRAINER, str(first), str(last), str(scale)])
    assert controller.wait(patience(20)) and controller.state.status == "finished", controller.state.error


def test_the_loss_curve_continues_across_a_resume_and_restarts_with_a_fresh_run(tmp_path):
    cfg = _workspace_config(tmp_path)
    controller = RunController()
    _run_steps(controller, cfg, 1, 6, 1.0)
    assert [s for s, _ in controller.state.losses] == [1, 2, 3, 4, 5, 6]
    # Resumed from the backup of step 4: steps 1-4 are its history, 5 and 6 are trained again.
    _run_steps(controller, cfg, 5, 8, 2.0)
    losses = controller.state.losses
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert losses[3] == (4, 1.0 / 4) and losses[4] == (5, 2.0 / 5)
    # A new GUI session resuming the same run folder gets the same history from disk.
    later = RunController()
    _run_steps(later, cfg, 9, 10, 3.0)
    assert [s for s, _ in later.state.losses] == list(range(1, 11))
    # A fresh run (its first step is 1) starts the curve over.
    _run_steps(later, cfg, 1, 2, 5.0)
    assert later.state.losses == [(1, 5.0), (2, 2.5)]
    assert later.state.rank_losses == [pytest.approx(0.2), pytest.approx(0.4)]
    assert later.state.rank_images_per_s == [1.0, 1.5]


def test_loss_history_skips_a_torn_line(tmp_path):
    from ui.loss_history import LossHistory
    path = tmp_path / "gui-losses.csv"
    path.write_text("1,0.5\n2,0.25\n3,")  # the GUI was killed mid-write
    assert LossHistory(path).begin(3) == [(1, 0.5), (2, 0.25)]


def test_training_sees_gpus_in_the_order_nvml_shows_them(tmp_path):
    controller = RunController(env={"PATH": os.environ.get("PATH", "")})
    controller.start(_workspace_config(tmp_path), 0, command=[
        sys.executable, "-c", "import os; print('order=' + os.environ.get('CUDA_DEVICE_ORDER', ''))"])
    assert controller.wait(patience(20))
    assert "order=PCI_BUS_ID" in controller.log


def test_start_refuses_multi_gpu_without_gpus_and_asks_with_one():
    from ui.launch_command import start_check
    cfg = TrainConfig()
    assert start_check(cfg, 0) == start_check(cfg, 1) == start_check(cfg, 2)  # multi-GPU off: just start
    cfg.multi_gpu.enabled = True
    refused = start_check(cfg, 0)
    assert refused.refuse and "no GPU is visible" in refused.refuse and "CPU processes" in refused.refuse
    asked = start_check(cfg, 1)
    assert asked.ask and "one GPU" in asked.ask and asked.refuse is None
    assert start_check(cfg, 2) == start_check(cfg, 8)  # two or more: multi-process, nothing to ask
    cfg.multi_gpu.device_indexes, cfg.multi_gpu.num_gpus = "1", 1
    assert "only one of its 4 GPUs is ticked" in start_check(cfg, 4).ask
    for path, value in cpu_process_values("2").items():
        set_value(cfg, path, value)
    assert start_check(cfg, 0).refuse is None and start_check(cfg, 0).ask is None
    # One process after all: the run's config says so, and the trainer's "use train_multi_gpu.py" note stays away.
    cfg = TrainConfig()
    cfg.multi_gpu.enabled = True
    assert run_config(cfg, 1).multi_gpu.enabled is False and cfg.multi_gpu.enabled is True
    assert run_config(cfg, 2) is cfg
    assert build_command(run_config(cfg, 1), "c.json", 1, python="py") == ["py", str(SINGLE_SCRIPT), "--config-path",
                                                                             "c.json"]


def test_rank_gpus_follow_the_selection():
    from ui.run_host import rank_gpus
    cfg = TrainConfig()
    assert rank_gpus(cfg, 0) is None and rank_gpus(cfg, 4) == [0]
    cfg.multi_gpu.enabled = True
    assert rank_gpus(cfg, 4) == [0, 1, 2, 3]
    cfg.multi_gpu.device_indexes, cfg.multi_gpu.num_gpus = "1,3", 2
    assert rank_gpus(cfg, 4) == [1, 3]
    for path, value in cpu_process_values("3").items():
        set_value(cfg, path, value)
    assert rank_gpus(cfg, 4) is None


def test_per_gpu_rows_join_rank_numbers_and_gpu_readings():
    from ui.gpu_info import GpuUsage
    from ui.per_gpu import per_gpu_rows
    from ui.run_controller import RunState
    usage = [GpuUsage(0, 97, 30 * 1024, 80 * 1024, 64), GpuUsage(1, 12, 1024, 80 * 1024, None),
             GpuUsage(2, 95, 29 * 1024, 80 * 1024, 70)]
    state = RunState(status="running", rank_losses=[0.1234567, 0.2], rank_images_per_s=[10.5, 9.25], rank_gpus=[0, 2])
    rows = [row.cells() for row in per_gpu_rows(state, usage)]
    assert rows == [("Rank 0 · GPU 0", "0.1235", "10.50", "97%", "30.0 / 80 GiB", "64 °C"),
                    ("Rank 1 · GPU 2", "0.2000", "9.25", "95%", "29.0 / 80 GiB", "70 °C"),
                    ("GPU 1", "", "", "12%", "1.0 / 80 GiB", "")]
    cpu = RunState(status="running", rank_losses=[0.5, 0.6], rank_images_per_s=[1.0, 1.0], rank_gpus=None)
    assert [r.name for r in per_gpu_rows(cpu, [])] == ["Rank 0 (CPU)", "Rank 1 (CPU)"]
    single = RunState(status="running", rank_gpus=[0])
    assert [r.name for r in per_gpu_rows(single, usage)] == ["GPU 0 (training)", "GPU 1", "GPU 2"]
    assert per_gpu_rows(RunState(), []) == []


class FakeNvml:
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, broken=()):
        self.broken = set(broken)

    def nvmlDeviceGetCount(self):
        return 3

    def nvmlDeviceGetHandleByIndex(self, i):
        if i in self.broken:
            raise RuntimeError("GPU is lost")
        return i

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=(handle + 1) * 2**30, total=80 * 2**30)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=10 * handle)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        if handle == 2:
            raise RuntimeError("Not Supported")
        return 50 + handle


def test_gpu_usage_has_temperature_and_survives_a_lost_gpu():
    from ui.gpu_info import GpuUsage, UsageMonitor
    usage = UsageMonitor(FakeNvml(broken={1})).read()
    assert usage == [GpuUsage(0, 0, 1024, 80 * 1024, 50), GpuUsage(2, 20, 3072, 80 * 1024, None)]
    assert usage[0].label().endswith("50 °C")


def test_nvml_is_installed_with_the_app_on_linux_and_windows():
    import tomllib
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    nvml = [d for d in project["dependencies"] if d.startswith("nvidia-ml-py")]
    assert nvml and "sys_platform == 'linux'" in nvml[0] and "sys_platform == 'win32'" in nvml[0]
    assert "gpu-monitor" not in project.get("optional-dependencies", {})


def test_opening_a_folder_without_a_file_manager_says_where_it_is(tmp_path, monkeypatch):
    from ui import external
    monkeypatch.setattr(external.sys, "platform", "linux")
    monkeypatch.setattr(external.shutil, "which", lambda name: None)
    result = external.open_folder(tmp_path / "out")
    assert not result.ok and str((tmp_path / "out").resolve()) in result.message
    assert "No file manager found" in result.message and (tmp_path / "out").is_dir()

    def failing_popen(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(external.shutil, "which", lambda name: "/usr/bin/xdg-open")
    monkeypatch.setattr(external.subprocess, "Popen", failing_popen)
    result = external.open_folder(tmp_path / "out")
    assert not result.ok and "Permission denied" in result.message and str((tmp_path / "out").resolve()) in result.message


def test_tensorboard_shows_its_address_when_no_browser_opens(tmp_path, monkeypatch):
    from ui import external

    class Server:
        def __init__(self, command, **kwargs):
            self.command = command

        def poll(self):
            return None

        def terminate(self):
            pass

    monkeypatch.setattr(external.subprocess, "Popen", Server)
    board = external.TensorBoard(open_browser=lambda url: "no web browser was found")
    board.answers = lambda port: True
    result = board.open(tmp_path / "tb")
    assert not result.ok and board.url in result.message and "open that address yourself" in result.message
    board.open_browser = lambda url: None
    result = board.open(tmp_path / "tb")
    assert result.ok and board.url in result.message


def test_field_places_name_tab_and_label():
    from ui.field_places import FieldPlaces
    places = FieldPlaces()
    places.add("training.batch_size", "Training", "Batch size per GPU")
    places.add("training.precision", "Training", "Precision")
    places.add("data.concepts", "Data", "Concepts")
    places.add("data.concepts[0].repeats", "Data", "Repeats")
    assert places.describe("training.batch_size: 0 is not allowed; set it to 1 or more.") == \
        "Training › Batch size per GPU: 0 is not allowed; set it to 1 or more."
    assert places.describe("model.unet_dtype: 'fp16' needs training.precision bf16 or fp16") == \
        "model.unet_dtype: 'fp16' needs Training › Precision bf16 or fp16"  # unplaced paths stay
    assert places.describe("data.concepts[2].repeats: 0 is not allowed") == \
        "Data › Concepts, row 3 › Repeats: 0 is not allowed"
    assert places.without_field("training.batch_size: 0 is not allowed", "training.batch_size") == "0 is not allowed"
    assert places.describe("e.g. model.safetensors stays") == "e.g. model.safetensors stays"


def test_unused_fields_follow_method_and_optimizer():
    from ui.applicability import unused_fields
    cfg = TrainConfig()
    unused = unused_fields(cfg)
    assert "training.lora_rank" not in unused and "save.full_format" in unused
    assert "optimizer.momentum" in unused and "optimizer.beta1" not in unused
    cfg.training.method, cfg.optimizer.name = "full", "sgd"
    unused = unused_fields(cfg)
    assert "Method is full" in unused["training.lora_rank"] and "save.lora_format" in unused
    assert "optimizer.momentum" not in unused and "Optimizer is sgd" in unused["optimizer.beta1"]
    assert all(path in leaf_paths(cfg) for path in unused)


def test_prodigy_and_schedule_free_fields_are_used_only_by_their_optimizer():
    from ui.applicability import unused_fields
    cfg = TrainConfig()
    prodigy = [p for p in leaf_paths(cfg) if p.startswith("optimizer.prodigy_")]
    schedule_free = [p for p in leaf_paths(cfg) if p.startswith("optimizer.schedule_free_")]
    assert len(prodigy) == 6 and len(schedule_free) == 2
    unused = unused_fields(cfg)  # AdamW
    assert all("used only by Prodigy (Optimizer is adamw)" == unused[p] for p in prodigy)
    assert all("used only by schedule-free AdamW" in unused[p] for p in schedule_free)
    for name, own, other in (("prodigy", prodigy, schedule_free), ("adamw_schedule_free", schedule_free, prodigy)):
        cfg.optimizer.name = name
        unused = unused_fields(cfg)
        assert not [p for p in own if p in unused] and all(p in unused for p in other)
        assert not {"optimizer.beta1", "optimizer.beta2", "optimizer.eps"} & set(unused)  # Adam's betas apply
        assert "optimizer.fused" in unused and "optimizer.momentum" in unused


def test_fsdp_and_ddp_settings_are_used_only_by_their_strategy():
    from ui.applicability import unused_fields
    cfg = TrainConfig()
    assert unused_fields(cfg)["multi_gpu.fsdp_cpu_offload"] == "used only with Multi-GPU on"
    cfg.multi_gpu.enabled = True  # strategy auto: either may run
    assert not {"multi_gpu.fsdp_cpu_offload", "multi_gpu.bucket_cap_mb", "multi_gpu.strategy"} & set(unused_fields(cfg))
    cfg.multi_gpu.strategy = "ddp"
    assert unused_fields(cfg)["multi_gpu.fsdp_cpu_offload"] == "used only by FSDP (Strategy is ddp)"
    cfg.multi_gpu.strategy = "fsdp"
    unused = unused_fields(cfg)
    assert "multi_gpu.fsdp_cpu_offload" not in unused
    assert all(unused[f"multi_gpu.{name}"] == "used only by DDP (Strategy is fsdp)" for name in
               ("bucket_cap_mb", "gradient_compression", "static_graph", "find_unused_parameters",
                "gradient_as_bucket_view"))


def test_tooltips_have_no_code_marks():
    from ui.binding import plain_text
    text = plain_text(field_doc("general.device"))
    assert "`" not in text and "auto" in text


def test_summary_line_shows_the_split_over_unequal_gpus():
    cfg = TrainConfig()
    cfg.multi_gpu.enabled = True
    cfg.training.batch_size = 4
    cfg.multi_gpu.batch_split = "6,2"
    assert summarize(cfg, 2).line() == "World size 2 · global batch 8 = 6 on GPU 0 + 2 on GPU 1 · LR 1e-4"
    cfg.multi_gpu.batch_split = "auto"
    assert "split at start by each GPU's memory and speed" in summarize(cfg, 2).line()
    cfg.multi_gpu.batch_split = "6,"  # mid-edit
    assert "global batch 8 (4 x 1 x 2)" in summarize(cfg, 2).line()
    # several machines: the list is this machine's GPUs
    cfg.multi_gpu.batch_split, cfg.multi_gpu.nnodes, cfg.multi_gpu.master_port = "6,2", 2, 29500
    assert summarize(cfg, 2).line() == \
        "World size 4 · global batch 16 (4 x 1 x 4), this machine's 8 = 6 on GPU 0 + 2 on GPU 1 · LR 1e-4"


def test_memory_line_gives_the_memory_plan():
    """The multi-GPU frame's memory line: the plan for the chosen GPUs (or Memory per GPU), its estimate, the
    faster plans that do not fit - or, when nothing fits, what would."""
    from ui.multi_gpu_summary import memory_line

    cfg = TrainConfig()
    cfg.model.base_model, cfg.model.model_type = "unused.safetensors", "flux"
    cfg.training.method, cfg.training.precision, cfg.training.gradient_checkpointing = "full", "bf16", True
    cfg.data.resolution = 1024
    cfg.multi_gpu.enabled = True
    line = memory_line(cfg, 4, [80.0] * 4)
    assert line.startswith("Memory plan for 4 GPU(s) of 80 GiB (card): FSDP, ~") and "faster plans do not fit: DDP ~" in line
    cfg.multi_gpu.memory_limit_gib = "24"
    assert memory_line(cfg, 4, [80.0] * 4).startswith("Memory plan for 4 GPU(s) of 24 GiB (limit): FSDP + CPU offload")
    cfg.multi_gpu.strategy = "ddp"
    refused = memory_line(cfg, 4, [80.0] * 4)
    assert "multi_gpu.strategy ddp (DDP + activation offloading) needs ~" in refused and "multi_gpu.strategy auto (plan: FSDP + CPU offload)" in refused
    cfg.multi_gpu.memory_limit_gib = ""
    assert "no GPU to compare with" in memory_line(cfg, 4, None)
    cfg.model.model_type, cfg.model.base_model = "auto", "/nonexistent/model.safetensors"
    assert memory_line(cfg, 2, [80.0, 80.0]).startswith("Memory estimate: none for this config (")


# --- issue 55: each run its own loss curve, Continue offers what a Stop wrote, Sample now says so at once ---------
RUN_TRAINER = textwrap.dedent("""
    import json, sys
    run_id, first, last, scale = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    def emit(**event):
        print("@tandem " + json.dumps(event), flush=True)
    emit(type="config", run_id=run_id, world_size=1, total_steps=last)
    for step in range(first, last + 1):
        emit(type="loss", step=step, loss=scale / step, lr=1e-4)
        if step % 2 == 0:
            emit(type="validation", step=step, loss=2 * scale / step, images=2)
""")


def _run_as(controller, cfg, run_id: str, first: int, last: int, scale: float) -> None:
    controller.start(cfg, 0, command=[sys.executable, "-c", RUN_TRAINER, run_id, str(first), str(last), str(scale)])
    assert controller.wait(patience(20)) and controller.state.status == "finished", controller.state.error


def test_continuing_an_older_run_plots_its_own_losses(tmp_path):
    """Run A stopped at step 13, run B trained to 23, A continued: the plot showed B's losses as A's steps 1-13
    (one file for the workspace held B's). Each run's curve is its own, also in a later session."""
    cfg = _workspace_config(tmp_path)
    controller = RunController()
    _run_as(controller, cfg, "run-a", 1, 13, 1.0)
    _run_as(controller, cfg, "run-b", 1, 23, 5.0)
    assert controller.state.losses[0] == (1, 5.0)
    _run_as(controller, cfg, "run-a", 14, 16, 1.0)  # continued from A's backup at step 13
    losses = controller.state.losses
    assert [s for s, _ in losses] == list(range(1, 17)), losses
    assert losses[:13] == [(s, 1.0 / s) for s in range(1, 14)], f"steps 1-13 are not run A's own: {losses[:3]}"
    assert controller.state.validation_losses[:6] == [(s, 2.0 / s) for s in range(2, 14, 2)]
    assert controller.state.run_id == "run-a"
    later = RunController()  # the next day: B continued from its step 20
    _run_as(later, cfg, "run-b", 21, 24, 5.0)
    assert later.state.losses[:20] == [(s, 5.0 / s) for s in range(1, 21)]
    assert sorted(p.name for p in (tmp_path / "run" / ".tandem" / "losses").iterdir()) == \
        ["run-a-validation.csv", "run-a.csv", "run-b-validation.csv", "run-b.csv"]


def test_a_restarted_round_of_the_same_run_keeps_its_curve(tmp_path):
    """An automatic restart says the run's id again: the curve goes on in the same file, nothing is lost."""
    from ui.loss_history import run_histories
    from ui.run_host import Begun
    controller = RunController()
    config_path, losses = controller.run_host.prepare(_workspace_config(tmp_path))
    controller.begin(Begun("starting", "", losses), controller._queue)
    for event in (TrainingEvent("config", {"run_id": "run-r"}), TrainingEvent("loss", {"step": 1, "loss": 1.0}),
                  TrainingEvent("config", {"run_id": "run-r"}), TrainingEvent("loss", {"step": 2, "loss": 0.5}),
                  TrainingEvent("config", {"run_id": "../elsewhere"})):  # not a name: ignored
        controller._apply(event)
    controller._finish(0)
    history, _ = run_histories(tmp_path / "run" / ".tandem" / "losses", "run-r")
    assert history.read() == [(1, 1.0), (2, 0.5)] and controller.state.run_id == "run-r"


def test_after_a_run_continue_offers_the_backup_it_wrote():
    """A backup picked by hand stayed picked after a Stop: "Stopped · step 23" beside "Continue from step 13"."""
    from types import SimpleNamespace

    from ui.backup_choices import BackupChoice, backup_the_run_wrote

    def choice(run, step, finished=None):
        return BackupChoice(SimpleNamespace(path=Path(f"backups/{run}/step-{step:08d}"), run_id=run, step=step,
                                            written=0.0), finished)
    a13, a23, b5 = choice("run-a", 13), choice("run-a", 23), choice("run-b", 5)
    assert backup_the_run_wrote([a23, b5, a13], [("run-a", 20), ("run-a", 23)]) == a23
    assert backup_the_run_wrote([b5, a13], [("run-a", 23)]) is None, "not listed (deleted, or not read yet)"
    assert backup_the_run_wrote([choice("run-a", 23, finished=30), a13], [("run-a", 23)]) is None
    state = RunController().state
    assert state.written_backups == []
    controller = RunController()
    controller._apply(TrainingEvent("backup", {"path": "/ws/backups/run-a/step-00000023", "step": 23}))
    assert controller.state.written_backups == [("run-a", 23)]


def test_sample_now_says_so_at_once_and_then_which_prompt(tmp_path):
    """"Sample now" gave no sign for a minute: the click is answered at once, the steps trained before the
    sampling begins keep the note, and the sampling then says which prompt it renders."""
    controller = RunController()
    controller.state.status = "running"
    controller.run_host.commands_file = tmp_path / "commands"
    controller.send("sample")
    assert controller.state.headline == "Running - sampling at the next step"
    controller._apply(TrainingEvent("progress", {"step": 2, "total_steps": 9}))
    assert controller.state.headline == "Running - sampling at the next step", "a step before it began cleared it"
    controller._apply(TrainingEvent("status", {"text": "sampling - prompt 1 of 2"}))
    assert controller.state.headline == "Running - sampling - prompt 1 of 2"
    controller._apply(TrainingEvent("status", {"text": "sampling - prompt 2 of 2"}))
    controller._apply(TrainingEvent("sample", {"step": 3, "path": "s.png", "prompt": "p"}))
    controller._apply(TrainingEvent("progress", {"step": 4, "total_steps": 9}))
    assert controller.state.headline == "Running", "the sampling is over"
    # A trainer that does not say when it begins: its sample answers the click.
    controller.send("sample")
    controller._apply(TrainingEvent("sample", {"step": 5, "path": "s.png", "prompt": "p"}))
    controller._apply(TrainingEvent("progress", {"step": 6, "total_steps": 9}))
    assert controller.state.headline == "Running"
    assert tmp_path.joinpath("commands").read_text() == "sample\nsample\n"


def test_a_handed_in_host_runs_the_run_and_the_controller_keeps_its_state(tmp_path):
    """`RunController` shows a run wherever its `RunHost` runs it: the host starts it, says in the run's queue
    that a background start took (or failed, or stopped being followed), and answers where its files are; an
    uncompleted end shows as stopped only where others may stop the run (a remote machine)."""
    from ui.run_host import Begun, Detached, Exited, Failed, LossFiles, Started

    class Elsewhere:
        uses_local_gpus, where, others_may_stop = False, " on box", True

        def __init__(self):
            self.told: list = []

        def start(self, cfg, visible_gpus, command, resume, feed):
            self.feed = feed
            return Begun("connecting to box", "$ train on box", LossFiles(tmp_path / "l.csv", tmp_path / "v.csv",
                                                                           tmp_path / "losses"), started=["remote"])

        def send(self, command):
            self.told.append(command)
            return f"{command} -> box"

        def shown(self, item):
            self.told.append(("shown", item.run))

        def exited(self):
            self.told.append("exited")

        def terminate(self):
            return True

        def output_folder(self, cfg):
            return tmp_path / "mirror" / "output"

    host = Elsewhere()
    controller = RunController(run_host=host)
    assert controller.start(TrainConfig(), 0) == ["remote"] and not controller.uses_local_gpus
    assert controller.state.headline == "Running - connecting to box" and list(controller.log) == ["$ train on box"]
    assert controller.output_folder(TrainConfig()) == tmp_path / "mirror" / "output"
    host.feed.put(Started("started r1 on box", "[remote] started r1", run="r1"))
    host.feed.put(TrainingEvent("done", {"output": None, "step": 2, "completed": False}))
    controller.poll()
    assert controller.state.message == "started r1 on box" and host.told == [("shown", "r1")]
    controller.send("backup")
    assert host.told[-1] == "backup" and controller.log[-1] == "backup -> box"
    host.feed.put(Exited(0))
    controller.poll()
    assert controller.state.status == "stopped" and host.told[-1] == "exited"  # stopped from elsewhere
    for note, status in ((Failed("no route to box"), "failed"), (Detached("detached: it goes on"), "idle")):
        controller.start(TrainConfig(), 0)
        host.feed.put(note)
        controller.poll()
        assert controller.state.status == status
    assert controller.state.message == "detached: it goes on"
    local = RunController()
    local.state.status = "running"
    local._apply(TrainingEvent("done", {"output": None, "step": 2, "completed": False}))
    local._finish(0)
    assert local.state.status == "finished"  # only this window stops a local run
