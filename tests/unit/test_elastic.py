"""#17: automatic restart and several machines, through the real launchers (torchrun's elastic agent) on
CPU processes over gloo; and the pieces they are made of, without processes."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from modules.config import TrainConfig, apply_overrides, validate
from modules.distributed import failures, nodes
from modules.distributed.job import WorkerJob, read_job, write_job
from modules.distributed.plan import LaunchPlan
from modules.distributed.processes import agent_arguments
from modules.distributed.worker import reads_commands, restart_point
from modules.launch.spec import resolve_launch
from modules.util.ports import find_free_port
from tests.trainer_helpers import demo_config, latest_backup_weights, overrides_for, relative_l2, start_script
from ui.events import parse_line
from tests.patience import patience


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def _events(lines: list[str]) -> list[dict]:
    found = []
    for line in lines:
        event = parse_line(line)
        if hasattr(event, "type"):
            found.append({"type": event.type, **event.data})
    return found


def _read_until(proc, predicate, lines: list[str], what: str) -> dict:
    for line in proc.stdout:
        lines.append(line)
        event = parse_line(line)
        if hasattr(event, "type") and predicate({"type": event.type, **event.data}):
            return {"type": event.type, **event.data}
    raise AssertionError(f"the run ended before {what}:\n" + "".join(lines)[-4000:])


def _finish(proc, lines: list[str], timeout: float) -> int:
    try:
        lines += proc.stdout.readlines()
        return proc.wait(timeout=patience(timeout))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------------- pieces
def test_restart_line_names_the_dead_rank_the_step_and_the_backup():
    exits = [failures.WorkerExit(1, -9, 100.0), failures.WorkerExit(0, 1, 101.0)]
    errors = {0: failures.WorkerError(0, 100.5, "RuntimeError", "Connection reset by peer", True, 0, 431)}
    cause = failures.round_cause(exits, errors, 2, 10)
    assert cause == "rank 1 died (SIGKILL)"
    assert failures.restart_line(1, 3, cause, 431, 400) == \
        "restart 1 of 3: rank 1 died (SIGKILL) at step 431; resuming from the backup at step 400"
    assert "starting again from the beginning" in failures.restart_line(1, 3, cause, None, None)
    # A rank that failed by itself (its DataLoader worker was killed) is named with its error, not its peer's
    # complaint: the launched restart test below kills ranks, the loader worker's death is noted by its rank
    # whichever launcher runs it (tests/integration/test_faults.py).
    loader = "DataLoader worker (pid 4242) is killed by signal: Killed. "
    errors = {1: failures.WorkerError(1, 100.0, "RuntimeError", loader, False, 0, 7),
              0: failures.WorkerError(0, 100.4, "RuntimeError", "Connection closed by peer", True, 0, 7)}
    exits = [failures.WorkerExit(1, 1, 100.5), failures.WorkerExit(0, 1, 100.6)]
    assert failures.round_cause(exits, errors, 2, 3) == f"rank 1 failed (RuntimeError: {loader})"
    long = {1: failures.WorkerError(1, 100.0, "ValueError", "x" * 300, False, 0, 7)}
    assert failures.round_cause([failures.WorkerExit(1, 1, 100.5)], long, 2, 3) == \
        f"rank 1 failed (ValueError: {'x' * 188}...)"


def test_a_hung_rank_is_named_when_the_others_timed_out():
    """The hung rank says nothing; torchrun's agent kills it after the others gave up waiting."""
    errors = {0: failures.WorkerError(0, 100.0, "RuntimeError", "Timed out waiting 12000ms for recv operation",
                                      True, 0, 7)}
    exits = [failures.WorkerExit(0, 1, 100.2), failures.WorkerExit(1, -9, 111.0)]
    assert failures.round_cause(exits, errors, 2, 0.2) == \
        "rank 1 stopped answering (a collective timed out after multi_gpu.timeout_minutes = 0.2)"
    # A rank that died before the others timed out (NCCL reports a dead peer as a timeout) died.
    exits = [failures.WorkerExit(1, -9, 90.0), failures.WorkerExit(0, 1, 100.2)]
    assert failures.round_cause(exits, errors, 2, 0.2) == "rank 1 died (SIGKILL)"
    # Ranks of another machine: this machine saw them neither fail nor end, only the connection close.
    closed = {r: failures.WorkerError(r, 100.0, "RuntimeError", "Connection closed by peer", True, 0, 2) for r in (0, 1)}
    assert failures.round_cause([failures.WorkerExit(1, 1, 101.0)], closed, 4, 1) == \
        "ranks 2, 3 were lost (the connection closed: their machine or processes ended)"


def test_a_restart_after_a_kill_nobody_could_note_names_the_step_the_watchdogs_last_saw(tmp_path, monkeypatch,
                                                                                       cache_dir):
    """On GPUs the ranks that stayed wait in NCCL until torchrun's agent kills them: no rank notes an error, and
    the restart line said "before training started" for a rank killed at step 24+. The step comes from the
    beats the round's watchdogs published in the store."""
    from modules.distributed import worker
    from modules.trainer.callbacks import RecordingCallbacks
    exits = tmp_path / "worker-exits.json"
    exits.write_text(json.dumps([{"attempt": 0, "rank": 1, "exitcode": -9, "seen_at": 1.0},
                                 {"attempt": 0, "rank": 0, "exitcode": -9, "seen_at": 11.0}]))
    monkeypatch.setenv(failures.RESTART_COUNT_VARIABLE, "1")
    monkeypatch.setenv(failures.MAX_RESTARTS_VARIABLE, "1")
    monkeypatch.setattr(worker, "last_round_step", lambda job: 24)
    cfg = demo_config(tmp_path / "ws", cache_dir)
    callbacks = RecordingCallbacks()
    worker.announce_restart(WorkerJob(cfg, resolve_launch(cfg, 0), exits_file=str(exits)), None, callbacks, 2)
    (event,) = callbacks.of_type("restart")
    assert event["text"] == ("restart 1 of 1: rank 1 died (SIGKILL) at step 24; no backup of this run yet: starting "
                             "again from the beginning"), event


def test_errors_are_read_per_round(tmp_path, monkeypatch):
    monkeypatch.setenv(failures.RESTART_COUNT_VARIABLE, "0")
    failures.record_error(tmp_path, 1, ValueError("first round"), step=3)
    monkeypatch.setenv(failures.RESTART_COUNT_VARIABLE, "1")
    failures.record_error(tmp_path, 0, ValueError("second round"), step=9)
    assert set(failures.read_errors(tmp_path, 0)) == {1} and failures.read_errors(tmp_path, 0)[1].step == 3
    assert set(failures.read_errors(tmp_path, 1)) == {0}


def test_restart_and_node_settings_are_checked():
    def problems(*overrides):
        return " ".join(validate(apply_overrides(TrainConfig(), list(overrides)), check_paths=False))
    assert "needs torchrun" in problems("multi_gpu.launcher=spawn", "multi_gpu.max_restarts=2")
    assert "node_rank: 2 is not a node" in problems("multi_gpu.nnodes=2", "multi_gpu.node_rank=2",
                                                    "multi_gpu.master_port=29500")
    assert "same fixed port" in problems("multi_gpu.nnodes=2")
    assert "max_restarts" in problems("multi_gpu.nnodes=2", "multi_gpu.master_port=29500", "multi_gpu.min_gpus=2")
    assert problems("multi_gpu.nnodes=2", "multi_gpu.node_rank=1", "multi_gpu.master_port=29500",
                    "multi_gpu.max_restarts=1", "multi_gpu.min_gpus=2") == ""


def test_agent_arguments_for_restarts_and_several_machines():
    cfg = apply_overrides(TrainConfig(), ["multi_gpu.enabled=true", "general.device=cpu", "multi_gpu.num_gpus=2",
                          "multi_gpu.nnodes=3", "multi_gpu.node_rank=2", "multi_gpu.master_port=29500",
                          "multi_gpu.max_restarts=2", "multi_gpu.min_gpus=3", "multi_gpu.timeout_minutes=0.5"])
    spec = resolve_launch(cfg, 0)
    assert (spec.world_size, spec.processes_here, spec.nnodes, spec.node_rank, spec.min_nodes) == (6, 2, 3, 2, 2)
    assert spec.global_batch == 6 * cfg.training.batch_size * cfg.training.gradient_accumulation_steps
    arguments = agent_arguments(LaunchPlan(spec, "10.0.0.1", 29500, 0.5), "10.0.0.1:29500")
    assert "--nproc_per_node=2" in arguments and "--nnodes=2:3" in arguments and "--max_restarts=2" in arguments
    assert "--rdzv_conf=is_host=false,join_timeout=30,last_call_timeout=10" in arguments
    assert "--local_addr=tandem-node-0002" in arguments  # the rendezvous orders machines by it: rank 0 on node 0


def test_the_first_process_of_every_machine_reads_its_commands_file(monkeypatch):
    """A stop written on any machine (its launcher's Ctrl-C) reaches the step exchange, which unites all ranks'."""
    one = apply_overrides(TrainConfig(), ["multi_gpu.enabled=true", "general.device=cpu", "multi_gpu.num_gpus=2"])
    two = apply_overrides(one, ["multi_gpu.nnodes=2", "multi_gpu.node_rank=1", "multi_gpu.master_port=29500"])
    job_one, job_two = (WorkerJob(cfg, resolve_launch(cfg, 0)) for cfg in (one, two))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert [reads_commands(job_one, rank) for rank in range(2)] == [True, False]
    readers = []
    for rank in range(4):
        monkeypatch.setenv("LOCAL_RANK", str(rank % 2))
        readers.append(reads_commands(job_two, rank))
    assert readers == [True, False, True, False]


def test_a_restarted_round_continues_from_this_launchs_newest_backup(tmp_path, cache_dir):
    from modules.trainer import backup as backups
    cfg = demo_config(tmp_path / "ws", cache_dir)
    folder = tmp_path / "ws" / "backups"
    weights = {"w": torch.zeros(1)}
    backups.write_backup(folder, "run-a", 4, weights, {"global_step": 4}, {}, 3)
    job = WorkerJob(cfg, resolve_launch(cfg, 0), resume=None, run_id="run-b", launched_at=time.time())
    assert restart_point(job) == (None, None)  # nothing of this launch yet: what the user asked for
    backups.write_backup(folder, "run-b", 6, weights, {"global_step": 6}, {}, 3)
    resume, info = restart_point(job)
    assert info.step == 6 and resume == str(info.path)
    later = WorkerJob(cfg, job.spec, resume="latest", run_id="run-b", launched_at=time.time() + 60)
    assert restart_point(later) == ("latest", None)  # a backup older than the launch is not this launch's
    assert read_job(write_job(job)) == job


def test_a_job_carries_what_a_worker_needs_and_reads_back_as_written(tmp_path, cache_dir):
    """The launcher's scan, the store's address, where this run's commands start, the workspace held and the
    launch clocks travel in the job file, not in environment variables beside it."""
    from modules.data import build_dataset
    cfg = demo_config(tmp_path / "ws", cache_dir)
    scan = build_dataset(cfg.data, cache_dir, cfg.general.seed).scan()
    job = WorkerJob(cfg, resolve_launch(cfg, 0), "latest", "run-a", 12.5, scan=scan, rendezvous="127.0.0.1:29511",
                    commands_from=42, workspace_held=True, exits_file=str(tmp_path / "exits.json"),
                    clock={"launch": 1.0, "checks": 2.0, "workers": 3.0})
    back = read_job(write_job(job))
    assert back == job and back.scan.images[0].path == scan.images[0].path and len(back.scan.images) == 64


def test_nodes_that_differ_are_named_with_what_differs(tmp_path, cache_dir):
    from modules.data import build_dataset
    cfg = demo_config(tmp_path / "ws", cache_dir, "multi_gpu.nnodes=2", "multi_gpu.master_port=29500")
    dataset = build_dataset(cfg.data, cache_dir, cfg.general.seed)
    ours = nodes.node_job(cfg, dataset, 2)
    other_cfg = demo_config(tmp_path / "ws", tmp_path / "elsewhere", "multi_gpu.nnodes=2",
                            "multi_gpu.master_port=29500", "multi_gpu.node_rank=1", "training.learning_rate=0.002")
    theirs = nodes.node_job(other_cfg, dataset, 2)
    assert nodes.differences(ours, theirs) == ["training.learning_rate = 0.002 (node 0: 0.001)"]
    fewer = nodes.NodeJob(1, ours.config, ours.dataset[1:], 2)
    (found,) = nodes.differences(ours, fewer)
    assert "the dataset" in found and f"{ours.dataset[0][0]}/{ours.dataset[0][1]}: missing" in found

    store = torch.distributed.HashStore()
    store.set(f"{nodes.KEY_PREFIX}node-1", theirs.to_json())
    with pytest.raises(nodes.NodeMismatch, match="node 1 would train another job.*learning_rate"):
        nodes.agree(store, ours, 2, datetime.timedelta(seconds=5), "here")
    with pytest.raises(nodes.NodeMismatch, match=r"node\(s\) 2 of 3 did not join .* --node-rank 2"):
        nodes.agree(store, ours, 3, datetime.timedelta(seconds=1), "here")


def test_the_gui_shows_restarts_and_forgets_the_error_restarted_past():
    from ui.run_controller import RunController
    from ui.events import TrainingEvent
    controller = RunController.__new__(RunController)
    from ui.run_controller import RunState
    controller.state = RunState(status="running")
    controller.log = []
    controller._log = controller.log.append
    controller.history = None
    controller._apply(TrainingEvent("error", {"text": "RuntimeError: Connection reset by peer", "rank": 0}))
    line = "restart 1 of 3: rank 1 died (SIGKILL) at step 431; resuming from the backup at step 400"
    controller._apply(TrainingEvent("restart", {"text": line, "restart": 1, "max_restarts": 3}))
    assert controller.state.error is None and controller.state.restarts == [line]
    assert controller.state.headline == f"Running - {line}"


# ---------------------------------------------------------------------------- through the launchers
STALL_S = 10
RESTART_RUN = ("training.max_steps=16", "save.backup_every_n_steps=2", "data.num_workers=1",
               "multi_gpu.timeout_minutes=3", f"multi_gpu.stall_seconds={STALL_S}")
"""The collective timeout leaves a busy machine room (12 s timed out before the first backup); a stuck rank is
found by the watchdogs after STALL_S, not after the timeout. The watchdogs' beats come from a thread of their
own, whatever the training loop does, so a busy machine does not look stuck after 10 s (tests/integration/test_faults.py
names a stuck loader worker after 10 s too)."""


def _rank_pids(launcher: int) -> list[int]:
    """The training ranks (children of torchrun's agent, in rank order), not their loader workers."""
    from modules.benchmark.fault_trials import _ranks
    return sorted(_ranks(launcher))


@pytest.mark.slow
def test_killed_and_stuck_ranks_and_loader_workers_restart_resume_and_end_like_an_uninterrupted_run(tmp_path, cache_dir):
    """One launched run, max_restarts=2: kill -9 of a random rank at a random step -> restart 1, every rank resumes
    from the newest backup by itself; then rank 1 stops answering (SIGSTOP) -> the watchdogs name it after
    multi_gpu.stall_seconds -> restart 2. The job finishes and its weights equal an uninterrupted run's (fp32).
    A round that ends because a rank failed by itself (a killed DataLoader worker) restarts the same way; what
    differs is the cause its line names, test_restart_line_names_the_dead_rank_the_step_and_the_backup's, from
    the error the rank notes itself (tests/integration/test_faults.py, under torchrun)."""
    from tests.trainer_helpers import multi
    rng = random.Random()
    victim, at_step = rng.randrange(2), rng.choice((2, 4))
    ws = tmp_path / "restarted"
    proc = start_script("train_multi_gpu.py", "--config-path", "#demo", "--device", "cpu", "--num-gpus", "2",
                        "--max-restarts", "2", *overrides_for(ws, cache_dir, *RESTART_RUN), start_new_session=True)
    lines: list[str] = []
    stopped: list[int] = []
    try:
        # after a backup: killed before the first one, the round would start again from step 0 (tested in pieces)
        _read_until(proc, lambda e: e["type"] == "backup" and e["step"] >= at_step, lines, f"the backup at {at_step}")
        os.kill(_rank_pids(proc.pid)[victim], signal.SIGKILL)
        first = _read_until(proc, lambda e: e["type"] == "restart", lines, "the first restart")
        _read_until(proc, lambda e: e["type"] == "progress" and e["step"] > first["resumed_step"], lines, "a step")
        stopped.append(_rank_pids(proc.pid)[1])
        os.kill(stopped[0], signal.SIGSTOP)
        stuck = time.monotonic()
        second = _read_until(proc, lambda e: e["type"] == "restart", lines, "the second restart")
        took = time.monotonic() - stuck
    finally:
        code = _finish(proc, lines, 300)
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    output = "".join(lines)
    assert code == 0, output[-4000:]
    assert first["text"].startswith(f"restart 1 of 2: rank {victim} died (SIGKILL) at step "), first
    assert f"resuming from the backup at step {first['resumed_step']}" in first["text"]
    assert first["resumed_step"] >= 2 and first["resumed_step"] % 2 == 0
    assert second["text"].startswith(f"restart 2 of 2: rank 1 stopped answering (no sign of life for {STALL_S} s) at "
                                     "step "), second
    assert f"resuming from the backup at step {second['resumed_step']}" in second["text"]
    # the stall time, the ranks' exit, the agent's 3 s for the rest, then starting the new round
    assert took < STALL_S + 10 + 45, f"restarted {took:.0f} s after the rank got stuck"
    assert [e for e in _events(lines) if e["type"] == "done"][-1]["completed"]
    multi(tmp_path / "whole", cache_dir, *RESTART_RUN, launcher="spawn")
    restarted, whole = latest_backup_weights(ws), latest_backup_weights(tmp_path / "whole")
    assert restarted.keys() == whole.keys() and all(torch.equal(restarted[k], whole[k]) for k in whole)


def _node_command(ws: Path, cache: Path, node_rank: int, port: int, *extra: str) -> list[str]:
    return ["--config-path", "#demo", "--device", "cpu", "--num-gpus", "2", "--nnodes", "2",
            "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
            *overrides_for(ws, cache, *extra)]


@pytest.mark.slow
def test_two_machines_of_two_processes_train_like_one_of_four_and_ctrl_c_on_either_stops_both(tmp_path, cache_dir):
    """Two launchers on 127.0.0.1 as node 0 and node 1 (2 CPU processes each) == 1 node x 4 (rel L2 <= 1e-6);
    rank 0 (node 0) writes the outputs; node 1 may cache in a folder of its own; node 0 splits its part 5 + 3.
    Ctrl-C on the other machine, on the same launch (one 2-machine launch instead of two): each 'machine' has
    its own folder (the same relative workspace path, as machines have the same paths on their own disks):
    node 1's launcher gets SIGINT and writes `stop` into node 1's commands file, which node 0's rank 0 never
    reads - node 1's first worker does, and the step exchange stops all at one step, with a backup on node 0.
    That backup is what is compared with one machine of 4 processes trained as many steps (the demo's
    learning-rate schedule, a warm-up and then constant, does not depend on the steps a run was set to do)."""
    from tests.trainer_helpers import multi
    common = ("training.batch_size=4", "multi_gpu.timeout_minutes=2",
              "data.validation_fraction=0.1")  # held-out images are cached (and scored) on every machine too
    port = find_free_port()

    def machine(k: int, cache: Path, *extra: str):
        folder = tmp_path / f"machine{k}"
        folder.mkdir()
        return start_script("train_multi_gpu.py", *_node_command(Path("ws"), cache, k, port, "training.max_steps=200",
                                                                 *common, *extra), cwd=folder, start_new_session=True)
    # each machine splits its own part of the global batch (multi_gpu.batch_split is per machine)
    node0 = machine(0, cache_dir, "multi_gpu.batch_split=5,3")
    node1 = machine(1, tmp_path / "node1-cache")
    lines0: list[str] = []
    lines1: list[str] = []
    try:
        _read_until(node0, lambda e: e["type"] == "progress" and e["step"] >= 2, lines0, "step 2")
        os.kill(node1.pid, signal.SIGINT)
    finally:
        code1 = _finish(node1, lines1, 300)
        code0 = _finish(node0, lines0, 120)
    assert code0 == 0 and code1 == 0, "".join(lines0)[-3000:] + "\n----\n" + "".join(lines1)[-3000:]
    assert "All 2 machines joined with the same config and dataset." in "".join(lines0), "the machines did not agree"
    config = next(e for e in _events(lines0) if e["type"] == "config")
    assert config["world_size"] == 4 and config["global_batch"] == 16 and config["split"] == [5, 3, 4, 4], config
    assert [e["step"] for e in _events(lines0) if e["type"] == "validation"][:1] == [0], "no validation at the start"
    assert not [e for e in _events(lines1) if e["type"] in ("saved", "backup", "config")]  # rank 0 is on node 0
    # node 1's own cache folder holds every entry its ranks read, not only those they encoded
    assert sorted(os.listdir(tmp_path / "node1-cache" / "latents")) == sorted(os.listdir(cache_dir / "latents"))
    # Ctrl-C on node 1 stopped both machines at one step, with one backup (on node 0)
    assert "SIGINT: stopping every rank at the next step" in "".join(lines1), "node 1's launcher did not take SIGINT"
    done = [e for e in _events(lines0) if e["type"] == "done"][-1]
    assert not done["completed"] and done["step"] < 200, f"node 0 did not stop: {done}"
    (backup,) = [e for e in _events(lines0) if e["type"] == "backup"]
    assert backup["step"] == done["step"] and (tmp_path / "machine0" / backup["path"]).is_dir(), backup
    # ... and trained like one machine of 4 processes, the same steps
    steps = done["step"]
    multi(tmp_path / "one", cache_dir, *common, f"training.max_steps={steps}", f"save.backup_every_n_steps={steps}",
          launcher="spawn", world=4)
    two, one = latest_backup_weights(tmp_path / "machine0" / "ws"), latest_backup_weights(tmp_path / "one")
    assert two.keys() == one.keys()
    assert relative_l2(two, one) <= 1e-6  # the bound, over the weights (an uneven split rounds differently)
    ups = [v for k, v in one.items() if "lora_up" in k or "lora_B" in k]  # the LoRA halves that start at 0
    assert ups and any(v.abs().max() > 0 for v in ups), "not a comparison of zeros"


@pytest.mark.slow
def test_a_machine_that_never_joins_ends_the_other_within_the_timeout(tmp_path, cache_dir):
    ws = tmp_path / "ws"
    started = time.monotonic()
    proc = start_script("train_multi_gpu.py", *_node_command(ws, cache_dir, 0, find_free_port(),
                                                              "multi_gpu.timeout_minutes=0.1"),
                        start_new_session=True)
    lines: list[str] = []
    code = _finish(proc, lines, 120)
    took = time.monotonic() - started
    output = "".join(lines)
    assert code == 2, output[-3000:]
    assert "node(s) 1 of 2 did not join the rendezvous at 127.0.0.1:" in output and "--node-rank 1" in output
    assert took < patience(6 + 30), f"took {took:.0f} s"  # the timeout, and the launcher's start-up
    assert not (ws / "backups").exists()


@pytest.mark.slow
def test_check_multi_gpu_measures_the_all_reduce_between_machines():
    """scripts/check_multi_gpu.py --nnodes 2 --node-rank K on two 'machines' (127.0.0.1): a correct cross-node
    all-reduce, its bandwidth, and the advice about the network."""
    import subprocess
    import sys
    port = str(find_free_port())
    command = [sys.executable, "scripts/check_multi_gpu.py", "--nnodes", "2", "--master-addr", "127.0.0.1",
               "--master-port", port, "--size-mib", "1", "--json"]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="")
    env.pop("GLOO_SOCKET_IFNAME")
    procs = [subprocess.Popen(command + ["--node-rank", str(k)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[2], env=env) for k in (0, 1)]
    outputs = [p.communicate(timeout=patience(120)) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    for k, (out, _) in enumerate(outputs):
        result = json.loads(out)
        assert result["ok"] and result["world_size"] == 2 and result["node_rank"] == k and result["busbw_gbps"] > 0
        assert any("GLOO_SOCKET_IFNAME is not set" in advice for advice in result["advice"])


def test_fewer_processes_keep_the_global_batch_by_accumulating(tmp_path, cache_dir):
    """multi_gpu.min_gpus: a round on 2 of 4 processes accumulates twice as many micro-batches."""
    from modules.distributed.plan import LaunchError
    from modules.distributed.worker import keep_global_batch
    cfg = demo_config(tmp_path / "ws", cache_dir, "multi_gpu.enabled=true", "multi_gpu.num_gpus=2",
                      "multi_gpu.nnodes=2", "multi_gpu.master_port=29500", "multi_gpu.max_restarts=1",
                      "multi_gpu.min_gpus=2", "training.batch_size=4")
    job = WorkerJob(cfg, resolve_launch(cfg, 0), run_id="run-x")
    assert keep_global_batch(job, 4) is job
    smaller = keep_global_batch(job, 2)
    assert (smaller.spec.world_size, smaller.spec.accumulation, smaller.cfg.training.gradient_accumulation_steps) == \
        (2, 2, 2)
    assert smaller.spec.global_batch == job.spec.global_batch == 16
    with pytest.raises(LaunchError, match="cannot keep the global batch of 16.*not divide by 3"):
        keep_global_batch(job, 3)


def test_a_round_on_fewer_processes_keeps_the_launchs_learning_rate(tmp_path, cache_dir):
    """Linear LR scaling, 8 processes launched, 4 left after a machine was lost: the global batch is kept by
    accumulating, so the LR must stay the launch's (it halved, 8e-4 -> 4e-4, and the result was another one)."""
    from modules.distributed.worker import keep_global_batch
    from modules.trainer.run_numbers import derive_run_numbers
    cfg = demo_config(tmp_path / "ws", cache_dir, "multi_gpu.enabled=true", "multi_gpu.num_gpus=4",
                      "multi_gpu.nnodes=2", "multi_gpu.master_port=29500", "multi_gpu.max_restarts=1",
                      "multi_gpu.min_gpus=4", "multi_gpu.lr_scaling=linear", "training.learning_rate=1e-4",
                      "training.batch_size=2")
    job = WorkerJob(cfg, resolve_launch(cfg, 0), run_id="run-x")
    assert (job.spec.world_size, job.spec.global_batch) == (8, 16) and job.spec.lr == pytest.approx(8e-4)
    smaller = keep_global_batch(job, 4)
    assert (smaller.spec.world_size, smaller.spec.accumulation) == (4, 2)
    assert smaller.spec.global_batch == 16 and smaller.spec.lr == pytest.approx(8e-4)
    numbers = derive_run_numbers(smaller.cfg, 4, 40, launch=smaller.spec)
    assert numbers.global_batch == 16 and numbers.lr == pytest.approx(8e-4), numbers.describe()
    assert "LR 0.0001 -> 0.0008 (linear scaling x8)" in numbers.describe()
    assert read_job(write_job(smaller)).spec == smaller.spec  # a restarted round reads it from the job file


@pytest.mark.slow
def test_a_lost_machine_is_left_behind_with_min_gpus_and_the_global_batch_kept(tmp_path, cache_dir):
    """Two machines of 2 processes, multi_gpu.min_gpus=2: machine 1 dies for good (its launcher, agent and
    workers killed); machine 0 restarts on its 2 processes, accumulates twice and finishes at global batch 16."""
    from modules.benchmark.fault_trials import _descendants
    common = ("training.max_steps=6", "training.batch_size=4", "save.backup_every_n_steps=2",
              "multi_gpu.timeout_minutes=0.75", "multi_gpu.max_restarts=1", "multi_gpu.min_gpus=2",
              "multi_gpu.lr_scaling=linear")
    port = find_free_port()
    ws = tmp_path / "ws"
    node0 = start_script("train_multi_gpu.py", *_node_command(ws, cache_dir, 0, port, *common), start_new_session=True)
    node1 = start_script("train_multi_gpu.py", *_node_command(ws, cache_dir, 1, port, *common), start_new_session=True)
    lines: list[str] = []
    try:
        _read_until(node0, lambda e: e["type"] == "progress" and e["step"] >= 2, lines, "step 2")
        for pid in [node1.pid, *_descendants(node1.pid)]:  # the machine is gone: nothing of it says goodbye
            os.kill(pid, signal.SIGKILL)
    finally:
        node1.wait(timeout=patience(60))
        code = _finish(node0, lines, 300)
    output = "".join(lines)
    assert code == 0, output[-4000:]
    assert "CONTINUING ON 2 OF 4 PROCESSES" in output and "accumulation 1 -> 2 keeps the global batch at 16" in output
    assert "restart 1 of 1: ranks 2, 3 were lost (the connection closed: their machine or processes ended)" in output
    configs = [e for e in _events(lines) if e["type"] == "config"]
    assert [(c["world_size"], c["accumulation"], c["global_batch"]) for c in configs] == [(4, 1, 16), (2, 2, 16)]
    assert [c["lr"] for c in configs] == pytest.approx([0.004, 0.004])  # the launch's: x4 (linear), kept
    assert [e for e in _events(lines) if e["type"] == "done"][-1]["completed"]
