"""One trial of each kind of scripts/fault_trials.py (the full set, 10 of each, is run by hand: see its doc)."""
import json

import pytest

from tests.trainer_helpers import run_script
from tests.patience import patience


@pytest.mark.slow
def test_a_kill_during_a_backup_loses_nothing_and_a_killed_torchrun_agent_ends_the_job_naming_it(tmp_path,
                                                                                               tandem_home):
    """scripts/fault_trials.py, one trial of each kind that no other test makes: the whole job killed while it
    writes a backup (`backup`) and torchrun's agent killed (`agent`); then each resumes from its newest backup.
    The GPU check runs every kind (scripts/gpu/faults.sh); a killed rank and a killed loader worker, the
    other kinds, end the job as tests/integration/test_faults.py and tests/integration/test_distributed.py check (and restart it,
    tests/unit/test_elastic.py), through the same helpers that find and kill them here."""
    # --launcher spawn: the backup trial under spawn (its workers are forked from one process that imported the
    # libraries once: cheaper than torchrun's, whose workers each import them); the agent trial is torchrun's
    # whatever is asked. A kill during a backup is the workers' writing, whichever launcher started them.
    result = run_script("fault_trials.py", "--trials", "1", "--kind", "backup", "--kind", "agent", "--table",
                        "--launcher", "spawn", "--work", str(tmp_path), timeout=1200)
    trials = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [t["kind"] for t in trials] == ["backup", "agent"], result.stdout + result.stderr
    backup, agent = trials
    assert backup["launcher"] == "spawn", backup
    assert agent["launcher"] == "torchrun" and agent["named"] == "agent" and agent["seconds_to_end"] < 60, agent
    for trial in trials:
        assert trial["ok"] and trial["resumed"], trial
        assert not trial["hung"] and not trial["orphans"] and not trial["corrupt"], trial
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
        assert time.monotonic() - started < patience(5)
    finally:
        left_behind.kill()
        job.end()


def test_the_headline_is_read_even_when_the_reading_thread_lags_behind_the_launchers_exit(monkeypatch, tmp_path):
    """A trial reads the job's output on a thread; on a busy machine the launcher can exit before its last line
    (the headline naming the failed rank) has been read. The verdict waits for the output's end, and no longer
    than a bound when something of the job keeps the pipe open (seen in CI: a killed agent named nobody)."""
    import sys
    import time

    from modules.benchmark import fault_trials
    from modules.benchmark.fault_trials import Job, Outcome, _watch_the_end

    real_parse = fault_trials.parse_event_line

    def slow_parse(line):
        time.sleep(0.3)  # a reading thread that falls behind
        return real_parse(line)

    monkeypatch.setattr(fault_trials, "parse_event_line", slow_parse)
    headline = '@tandem {"type": "error", "text": "rank 1 failed first (killed)", "failed_rank": 1}'
    job = Job([sys.executable, "-c", f"print('a\\nb\\nc\\nd'); print({headline!r})"])
    outcome = Outcome("rank", "spawn")
    try:
        _watch_the_end("rank", job, outcome, [], time.monotonic(), 30.0, tmp_path)
    finally:
        job.end()
    assert outcome.named == "rank 1" and outcome.headline == "rank 1 failed first (killed)", outcome

    monkeypatch.setattr(fault_trials, "parse_event_line", real_parse)
    holder = Job(["bash", "-c", "sleep 30 & echo started"])  # a child that keeps the pipe open
    try:
        holder.proc.wait(timeout=patience(30))
        started = time.monotonic()
        holder.wait_until_read(1.0)
        assert 1.0 <= time.monotonic() - started < patience(5)
    finally:
        holder.family.update(fault_trials._descendants(holder.proc.pid))
        holder.end()
