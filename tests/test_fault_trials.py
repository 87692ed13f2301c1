"""One trial of each kind of scripts/fault_trials.py (the full set, 10 of each, is run by hand: see its doc)."""
import json

import pytest

from tests.trainer_helpers import run_script


@pytest.mark.slow
def test_a_killed_rank_and_a_kill_during_a_backup_lose_nothing(tmp_path, tandem_home):
    result = run_script("fault_trials.py", "--trials", "1", "--work", str(tmp_path), timeout=900)
    trials = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [t["kind"] for t in trials] == ["rank", "backup"], result.stdout + result.stderr
    for trial in trials:
        assert trial["ok"], trial
        assert not trial["hung"] and not trial["orphans"] and not trial["corrupt"] and trial["resumed"], trial
    assert result.returncode == 0


@pytest.mark.slow
def test_a_killed_loader_worker_and_a_killed_torchrun_agent_end_the_job_naming_whom_they_belonged_to(tmp_path,
                                                                                                    tandem_home):
    """scripts/fault_trials.py's loader and agent kinds (the GPU check runs every kind: scripts/gpu/faults.sh)."""
    result = run_script("fault_trials.py", "--trials", "1", "--kind", "loader", "--kind", "agent", "--table",
                        "--work", str(tmp_path), timeout=1200)
    trials = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(t["kind"], t["launcher"]) for t in trials] == [("loader", "torchrun"), ("agent", "torchrun")], \
        result.stdout + result.stderr
    loader, agent = trials
    assert loader["named"] == f"rank {loader['expected_rank']}" and loader["seconds_to_end"] < 60, loader
    assert agent["named"] == "agent" and agent["seconds_to_end"] < 60, agent
    for trial in trials:
        assert trial["ok"] and trial["resumed"] and not trial["orphans"] and not trial["hung"], trial
    assert result.stdout.rstrip().splitlines()[-1].startswith("| agent | torchrun | ")  # the table comes last
    assert "Traceback" not in result.stdout + result.stderr
    assert result.returncode == 0


def test_a_process_of_the_job_alive_after_the_grace_time_is_an_orphan_and_none_ends_the_wait_early():
    """The trials look for orphans until the grace time ends or nothing of the job is left: one that lives on is
    reported after the whole grace time (what a single look at its end saw), an ended job costs no waiting."""
    import subprocess
    import time

    from modules.benchmark.fault_trials import Job, _orphans_after

    job = Job(["sleep", "30"])
    left_behind = subprocess.Popen(["sleep", "30"])
    try:
        job.family.add(left_behind.pid)
        job.proc.kill()
        job.proc.wait()
        started = time.monotonic()
        assert _orphans_after(job, "rank", 1.0) == [left_behind.pid]
        assert time.monotonic() - started >= 1.0
        left_behind.kill()
        left_behind.wait()
        started = time.monotonic()
        assert _orphans_after(job, "rank", 30.0) == []
        assert time.monotonic() - started < 5
    finally:
        left_behind.kill()
        job.end()
