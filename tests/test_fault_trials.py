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
