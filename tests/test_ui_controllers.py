"""GUI controllers without a display: binding, validation mapping, commands, events, runs."""
from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from modules.config import TrainConfig, config_to_dict, read_json
from ui.binding import FieldError, field_doc, field_type, get_value, leaf_paths, set_value
from ui.config_model import ConfigModel, problem_field, problems_by_field
from ui.events import LogLine, TrainingEvent, format_duration, parse_line
from ui.launch_command import MULTI_SCRIPT, SINGLE_SCRIPT, build_command
from ui.multi_gpu_settings import cpu_process_values, cpu_processes, gpu_selection_values, selected_gpus
from ui.multi_gpu_summary import format_lr, summarize
from ui.run_controller import RunController
from ui.settings import RecentConfigs
from tests.trainer_helpers import hold_lock


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


def test_multi_gpu_torchrun_and_spawn_commands():
    cfg = TrainConfig()
    cfg.multi_gpu.enabled = True
    cfg.multi_gpu.distributed_data_loading = False
    command = build_command(cfg, "c.json", 4, python="py")
    assert command == ["py", str(MULTI_SCRIPT), "--config-path", "c.json", "--num-gpus", "4"]
    cfg.multi_gpu.launcher = "spawn"
    cfg.multi_gpu.device_indexes = "1,3"
    cfg.multi_gpu.backend = "gloo"
    cfg.multi_gpu.master_port = 29511
    cfg.multi_gpu.distributed_data_loading = True
    command = build_command(cfg, "c.json", 4, python="py")
    assert command[4:] == ["--num-gpus", "2", "--spawn", "--port", "29511", "--distributed-backend", "gloo",
                           "--distributed-data-loading"]


def test_cpu_process_command():
    cfg = TrainConfig()
    for path, value in cpu_process_values("3").items():
        set_value(cfg, path, value)
    command = build_command(cfg, "c.json", 0, python="py")
    assert command[1] == str(MULTI_SCRIPT)
    assert command[4:6] == ["--num-gpus", "3"] and command[-3:-1] == ["--device", "cpu"]
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
    deadline = time.monotonic() + 20
    while controller.state.step < 3 and time.monotonic() < deadline:
        controller.poll()
        time.sleep(0.02)
    state = controller.state
    assert state.status == "running" and state.step >= 3 and state.total_steps == 100
    assert state.run_info["world_size"] == 2 and state.losses[0] == (1, 1.0)
    controller.send("sample")
    controller.stop()
    assert commands.read_text() == "sample\nstop\n"
    assert controller.wait(20)
    assert controller.state.status == "stopped" and controller.state.backups
    assert controller.state.step < 100 and any(line.startswith("plain log line") for line in controller.log)
    with pytest.raises(RuntimeError, match="no training is running"):
        controller.send("save")


def test_run_controller_reports_a_crash_with_its_last_lines(tmp_path):
    controller = RunController()
    controller.start(_workspace_config(tmp_path), 0, command=[sys.executable, "-c", CRASHING_TRAINER])
    assert controller.wait(20)
    state = controller.state
    assert state.status == "failed"
    assert "ran out of memory" in state.error and "exit code 1" in state.error
    assert "line 39" in state.error and "line 0\n" not in state.error  # only the tail


def test_run_controller_ends_a_run_that_ignores_stop(tmp_path):
    controller = RunController(stop_timeout_s=0.5)
    stubborn = "import time\nprint('working', flush=True)\ntime.sleep(60)"
    controller.start(_workspace_config(tmp_path), 0, command=[sys.executable, "-c", stubborn])
    deadline = time.monotonic() + 20
    while controller.log_count <= 1 and time.monotonic() < deadline:
        controller.poll()
        time.sleep(0.02)
    controller.stop()
    assert controller.wait(15)
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
