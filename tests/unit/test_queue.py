"""The job queue's logic without processes (modules/queue): GPU needs and their refusal, which jobs start on
which GPUs, what an ended run makes of its job, reordering, the queue file, a job's run config and its log.
The queue running real jobs is tests/integration/test_queue_runs.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from modules.config import load_config
from modules.queue import actions
from modules.queue.jobs import GpuNeed, Job, NeedError
from modules.queue.launch import run_config, run_spec
from modules.queue.log_summary import summarize
from modules.queue.scheduler import RunOutcome, after_run, has_work, impossible_jobs, move, plan_starts
from modules.queue.store import QueueFileError, QueueStore
from modules.queue.view import JobRow, table


def job(id: int, need: str = "1", state: str = "queued", devices=(), workspace: str | None = None, **kw) -> Job:
    return Job(id=id, name=f"j{id}", need=need, config="", cwd="/", workspace=workspace or f"/ws/{id}", state=state,
               devices=list(devices), **kw)


def starts(jobs, capacity, paused=False) -> dict[int, tuple[int, ...]]:
    return {s.job_id: s.devices for s in plan_starts(jobs, capacity, paused)}


# --- what a job needs ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, need, back", [("2", GpuNeed(count=2), "2"), ("0,2", GpuNeed(2, (0, 2)), "0,2"),
                                              ("3,", GpuNeed(1, (3,)), "3,"), ("ALL", GpuNeed(all=True), "all"),
                                              (" 1 ", GpuNeed(count=1), "1")])
def test_a_need_is_read_as_a_count_named_gpus_or_all_and_written_back_alike(text, need, back):
    assert GpuNeed.parse(text) == need and need.text() == back and GpuNeed.parse(back) == need


@pytest.mark.parametrize("text, says", [("0", "at least 1 GPU"), ("two", "give a count"), ("0,x", "GPU numbers"),
                                        ("-1,", "start at 0")])
def test_a_need_that_cannot_be_read_says_what_to_write(text, says):
    with pytest.raises(NeedError, match=says):
        GpuNeed.parse(text)


def test_a_need_larger_than_the_machine_is_named_with_what_it_has():
    assert GpuNeed(count=3).problem(2) == "it needs 3 GPUs, but this machine has 2 GPUs"
    assert GpuNeed(2, (1, 4)).problem(2) == "it asks for GPU 4, but this machine has 2 GPUs (numbered 0-1)"
    assert GpuNeed(all=True).problem(1) is None and GpuNeed(count=2).problem(2) is None


def test_adding_a_job_larger_than_the_machine_is_refused_with_the_fix_and_queues_nothing(tmp_path):
    store = QueueStore(tmp_path / "q")
    cfg = load_config("#demo", [f"general.workspace_dir={tmp_path / 'ws'}"])
    with pytest.raises(actions.Refused) as refused:
        actions.add(store, cfg, GpuNeed(count=4), actions.Capacity(2, cpu=True), name="big")
    assert str(refused.value) == ("'big' was not queued: it needs 4 CPU slots, but this machine has 2 CPU slots. "
                                  "Ask for at most 2 CPU slots (--gpus 2 or all), or queue it on a machine with more.")
    assert store.read().jobs == []
    added = actions.add(store, cfg, GpuNeed(count=2), actions.Capacity(2, cpu=True), name="fits", cwd=tmp_path)
    assert [j.name for j in store.read().jobs] == ["fits"] and added.workspace == str(tmp_path / "ws")
    assert json.loads(Path(added.config).read_text())["general"]["workspace_dir"] == str(tmp_path / "ws")


def test_a_configs_multi_gpu_settings_are_what_its_job_needs():
    def need(*overrides):
        return actions.need_of_config(load_config("#demo", list(overrides)))
    assert need() == GpuNeed(count=1)
    assert need("multi_gpu.enabled=true") == GpuNeed(all=True)
    assert need("multi_gpu.enabled=true", "multi_gpu.num_gpus=3") == GpuNeed(count=3)
    assert need("multi_gpu.enabled=true", "multi_gpu.device_indexes=1,3") == GpuNeed(2, (1, 3))
    assert need("multi_gpu.enabled=true", "multi_gpu.device_indexes=2") == GpuNeed(1, (2,))
    assert need("multi_gpu.enabled=true", "general.device=cpu", "multi_gpu.num_gpus=2") == GpuNeed(count=2)


def test_the_machine_offers_slots_set_by_hand_else_its_gpus_else_one_cpu_slot():
    from modules.queue.store import QueueState
    assert actions.capacity_of(QueueState(slots=3), lambda: 8) == actions.Capacity(3, cpu=True)
    assert actions.capacity_of(QueueState(), lambda: 4) == actions.Capacity(4, cpu=False)
    assert actions.capacity_of(QueueState(), lambda: 0) == actions.Capacity(1, cpu=True)


# --- which jobs start --------------------------------------------------------------------------------------------
def test_jobs_start_side_by_side_on_separate_gpus_in_queue_order():
    jobs = [job(1, "1"), job(2, "2"), job(3, "1")]
    assert starts(jobs, 4) == {1: (0,), 2: (1, 2), 3: (3,)}
    assert starts(jobs, 2) == {1: (0,)}  # 2 waits for a second GPU and keeps GPU 1 from job 3


def test_a_waiting_job_keeps_the_free_gpus_it_needs_from_the_jobs_behind_it():
    running = job(1, "1", "running", devices=(0,))
    assert starts([running, job(2, "2"), job(3, "1")], 2) == {}  # 3 must not starve 2 of GPU 1
    assert starts([running, job(2, "2"), job(3, "2"), job(4, "1")], 4) == {2: (1, 2)}  # 3 keeps GPU 3 from 4
    assert starts([job(1, "2", "done", devices=(0, 1)), job(2, "2"), job(3, "1")], 2) == {2: (0, 1)}


def test_named_gpus_wait_for_those_gpus_and_all_takes_every_one():
    running = job(1, "1", "running", devices=(0,))
    assert starts([running, job(2, "0,"), job(3, "1")], 2) == {3: (1,)}  # 2 waits for GPU 0 alone: 3 delays it not
    assert starts([running, job(2, "1,2"), job(3, "1")], 4) == {2: (1, 2), 3: (3,)}
    assert starts([job(1, "all"), job(2, "1")], 3) == {1: (0, 1, 2)}
    assert starts([running, job(2, "all"), job(3, "1")], 3) == {}


def test_jobs_of_one_workspace_never_run_at_once_and_the_waiting_one_holds_no_gpu():
    running = job(1, "1", "running", devices=(0,), workspace="/ws/shared")
    assert starts([running, job(2, "1", workspace="/ws/shared"), job(3, "1")], 2) == {3: (1,)}


def test_a_paused_queue_paused_jobs_and_jobs_being_ended_start_nothing():
    jobs = [job(1, state="paused"), job(2, state="interrupted"), job(3, state="failed"), job(4, request="cancel")]
    assert starts(jobs, 2) == {}
    assert starts([job(5)], 2, paused=True) == {}
    assert has_work([job(5)], paused=True) is False and has_work([job(5)], paused=False) is True
    assert has_work([job(6, state="running", devices=(0,))], paused=True) is True
    assert has_work(jobs, paused=False) is False  # paused and interrupted jobs wait for a resume, not a runner


def test_a_queued_job_the_machine_can_never_run_is_named_and_blocks_no_one():
    jobs = [job(1, "3"), job(2, "1")]
    assert impossible_jobs(jobs, 2) == [(1, "cannot run here: it needs 3 GPUs, but this machine has 2 GPUs")]
    assert starts(jobs, 2) == {2: (0,)}


# --- what an ended run makes of its job --------------------------------------------------------------------------
def test_an_ended_run_makes_its_job_done_or_failed_with_the_reason():
    done = after_run(job(1, state="running", devices=(0,)), RunOutcome("ended", 0, output="/ws/out/demo",
                                                                      completed=True, train_run_id="r1"), 5.0)
    assert (done.state, done.output, done.ended, done.train_run_id) == ("done", "/ws/out/demo", 5.0, "r1")
    failed = after_run(job(2, state="running"), RunOutcome("ended", 1, error="PreflightError: no images"), 6.0)
    assert (failed.state, failed.message, failed.exit_code) == ("failed", "PreflightError: no images", 1)
    silent = after_run(job(3, state="running"), RunOutcome("ended", -9), 6.0)
    assert (silent.state, silent.message) == ("failed", "exit code -9")
    going = after_run(job(4, state="starting"), RunOutcome("running", train_run_id="r4"), 7.0)
    assert (going.state, going.train_run_id, going.ended) == ("running", "r4", None)


def test_a_run_gone_without_an_exit_code_leaves_its_job_interrupted_to_continue_from_its_backup():
    lost = after_run(job(1, state="running", train_run_id="r1"), RunOutcome("lost"), 9.0)
    assert (lost.state, lost.resume, lost.status_text()) == ("interrupted", "r1", "interrupted - continue from backup")
    early = after_run(job(2, state="running"), RunOutcome("lost"), 9.0)  # before its log named a run
    assert early.status_text() == "interrupted - start again"


def test_requests_end_as_cancelled_or_paused_with_the_backup_to_continue():
    cancelled = after_run(job(1, state="running", request="cancel"), RunOutcome("ended", -15), 1.0)
    assert (cancelled.state, cancelled.request) == ("cancelled", None)
    paused = after_run(job(2, state="running", request="pause", train_run_id="r2"), RunOutcome("ended", 0), 1.0)
    assert (paused.state, paused.resume, paused.request) == ("paused", "r2", None)
    pausing = job(3, state="running", request="pause")
    assert pausing.status_text() == "pausing" and job(4, state="running", request="cancel").status_text() == "cancelling"


def test_move_changes_only_the_order():
    jobs = [job(1), job(2), job(3)]
    assert [j.id for j in move(jobs, 3, "top")] == [3, 1, 2]
    assert [j.id for j in move(jobs, 1, "down")] == [2, 1, 3]
    assert [j.id for j in move(jobs, 1, "up")] == [1, 2, 3]
    assert [j.id for j in move(jobs, 1, "bottom")] == [2, 3, 1]
    assert [j.id for j in move(jobs, 3, "2")] == [1, 3, 2]
    with pytest.raises(ValueError, match="positions 1 to 3"):
        move(jobs, 1, "7")
    with pytest.raises(ValueError, match="up, down, top, bottom"):
        move(jobs, 1, "sideways")


# --- the queue file ----------------------------------------------------------------------------------------------
def test_the_queue_file_keeps_jobs_in_order_private_and_finds_them_by_number_or_name(tmp_path):
    store = QueueStore(tmp_path / "q")
    with store.change() as state:
        state.jobs = [job(1), job(2, state="done")]
        state.next_id = 3
    assert oct(store.file.stat().st_mode & 0o777) == "0o600" and oct(store.folder.stat().st_mode & 0o777) == "0o700"
    state = store.read()
    assert [j.id for j in state.jobs] == [1, 2] and state.find("#2").state == "done" and state.find("j1").id == 1
    with pytest.raises(KeyError, match="no job 9 in the queue \\(#1 j1, #2 j2\\)"):
        state.find(9)
    with pytest.raises(RuntimeError):
        with store.change() as state:
            state.jobs = []
            raise RuntimeError("a change that fails is not written")
    assert len(store.read().jobs) == 2


def test_a_damaged_queue_file_is_named_and_kept(tmp_path):
    store = QueueStore(tmp_path)
    store.file.write_text("{not json")
    with pytest.raises(QueueFileError, match="is damaged .*move it aside"):
        store.read()
    assert store.file.read_text() == "{not json"


def test_queue_actions_say_what_cannot_be_done(tmp_path):
    store = QueueStore(tmp_path)
    with store.change() as state:
        state.jobs = [job(1), job(2, state="done"), job(3, state="running", devices=(0,))]
    assert actions.cancel(store, 1).state == "cancelled"
    with pytest.raises(actions.Refused, match="#2 j2 has already ended"):
        actions.cancel(store, 2)
    assert actions.cancel(store, 3).request == "cancel" and store.read().find(3).state == "running"
    with pytest.raises(actions.Refused, match="only a paused or interrupted job can be resumed"):
        actions.resume(store, 3)
    actions.pause(store)
    assert store.read().paused
    actions.resume(store)
    assert not store.read().paused


# --- a job's run -------------------------------------------------------------------------------------------------
def test_a_job_trains_on_exactly_its_gpus_on_a_free_port(tmp_path):
    cfg = load_config("#demo", ["multi_gpu.enabled=true", "multi_gpu.device_indexes=2,3", "multi_gpu.master_port=29500"])
    two = run_config(cfg, (1, 3), cpu_slots=False)
    assert (two.multi_gpu.enabled, two.multi_gpu.num_gpus, two.multi_gpu.device_indexes, two.multi_gpu.master_port) == \
        (True, 2, "", 0)
    assert run_config(cfg, (0,), cpu_slots=False).multi_gpu.enabled is False
    assert run_config(load_config("#demo"), (0, 1), cpu_slots=True).general.device == "cpu"  # slots: CPU processes
    store = QueueStore(tmp_path / "q")
    added = actions.add(store, cfg, GpuNeed(count=2), actions.Capacity(4, cpu=False), env={"TANDEM_HOME": "/h"})
    spec, note = run_spec(added, "run-1", (1, 3), tmp_path / "q", cpu_slots=False)
    assert spec["env"] == {"TANDEM_HOME": "/h", "CUDA_VISIBLE_DEVICES": "1,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert spec["command"][0].endswith("train_multi_gpu.py") and note == ""
    assert spec["command"][1:] == ["--config-path", str(tmp_path / "q" / "runs" / "run-1" / "config.json")]
    added.resume = "20260101-run"
    spec, note = run_spec(added, "run-2", (0,), tmp_path / "q", cpu_slots=False)
    assert spec["command"][0].endswith("train.py") and "--resume" not in spec["command"]
    assert note == f"no backup of 20260101-run in {added.workspace}: it starts from the beginning"


def test_a_runs_log_gives_its_progress_model_and_error(tmp_path):
    log = tmp_path / "output.log"
    events = [{"type": "config", "world_size": 1, "total_steps": 10, "run_id": "r7"},
              {"type": "progress", "epoch": 1, "epochs": 2, "step": 4, "total_steps": 10, "images_per_s": 3.0,
               "eta_s": 12.0}]
    log.write_text("starting\n" + "".join(f"@tandem {json.dumps(e)}\n" for e in events) + "Traceback\nBoom\n")
    summary = summarize(log)
    assert (summary.step, summary.total_steps, summary.eta_s, summary.train_run_id) == (4, 10, 12.0, "r7")
    assert summary.fraction == 0.4 and summary.failure() == "starting\nTraceback\nBoom"
    with open(log, "a") as f:
        f.write('@tandem {"type": "error", "text": "ValueError: bad", "rank": 0}\n')
        f.write('@tandem {"type": "done", "output": "/o", "step": 10, "completed": true, "images": 1, "train_s": 1,'
                ' "images_per_s": 1}\n')
    summary = summarize(log)
    assert (summary.error, summary.output, summary.completed, summary.step) == ("ValueError: bad", "/o", True, 10)
    assert summarize(tmp_path / "missing.log") == summarize(tmp_path / "missing.log")


def test_list_shows_each_jobs_status_gpus_progress_eta_and_model_or_reason():
    text = table([JobRow(1, "cats", "done", "done", "0", 10, 10, output="/ws/cats"),
                  JobRow(2, "dogs", "running", "running", "1", 4, 10, eta_s=75.0),
                  JobRow(3, "big", "failed", "failed", "0,1", message="PreflightError: no images\nmore")])
    lines = text.splitlines()
    assert lines[0].split() == ["#", "name", "status", "GPUs", "progress", "ETA"]
    assert lines[1].split() == ["1", "cats", "done", "0", "step", "10/10", "model:", "/ws/cats"]
    assert lines[2].split() == ["2", "dogs", "running", "1", "step", "4/10", "1m15s"]
    assert lines[3].split() == ["3", "big", "failed", "0,1", "PreflightError:", "no", "images"]


def test_log_tail_gives_the_end_of_a_jobs_log_and_a_remote_error_comes_back_as_one_line(tmp_path, capsys):
    """The Queue tab reads a remote job's log as `log N --tail BYTES` (a long run's log is large), and what a
    remote queue refuses comes back as its own error line, naming the machine."""
    from modules.queue import cli
    from modules.queue.remote import RemoteQueueError, answer
    from modules.remote.ssh import Result
    folder = tmp_path / "q"
    folder.mkdir()
    (folder / "queue.json").write_text(json.dumps({"next_id": 2, "jobs": [
        {"id": 1, "name": "cats", "need": "1", "config": "", "cwd": str(tmp_path), "workspace": str(tmp_path / "ws"),
         "state": "done", "runs": ["run-1"]}]}))
    log = folder / "runs" / "run-1" / "output.log"
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    assert cli.main(["--folder", str(folder), "log", "cats", "--tail", "18"]) == 0
    assert capsys.readouterr().out == "line 998\nline 999\n"
    assert cli.main(["--folder", str(folder), "log", "1"]) == 0
    assert capsys.readouterr().out == log.read_text()
    machine = type("Machine", (), {"label": "me@box"})()
    with pytest.raises(RemoteQueueError, match=r"^me@box: #1 cats has already ended \(done\)$"):
        answer(machine, Result(2, b"", "a warning first\nerror: #1 cats has already ended (done)\n"))
    assert answer(machine, Result(0, b"The queue starts jobs again.\n", "")) == "The queue starts jobs again.\n"
