"""tests/patience.py: how long a test waits before it calls something a hang, on a busy machine too."""
import os

from tests import patience


def test_a_hand_set_factor_wins(monkeypatch):
    monkeypatch.setenv("TANDEM_TEST_SLOWNESS", "7")
    assert patience.patience(10) == 70


def test_the_load_per_core_scales_limits_up_to_a_stuck_machines(monkeypatch):
    monkeypatch.delenv("TANDEM_TEST_SLOWNESS", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0, 0))
    assert patience.slowness() == 1.0  # idle: never below the quiet machine's limit
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 0, 0))
    assert patience.slowness() == 4.5
    monkeypatch.setattr(os, "getloadavg", lambda: (400.0, 0, 0))
    assert patience.slowness() == patience.MOST


def test_the_suites_own_workers_count_before_the_load_average_shows_them(monkeypatch):
    """A run's first tests start on a quiet machine that its xdist workers are about to fill."""
    monkeypatch.delenv("TANDEM_TEST_SLOWNESS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0, 0))
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    assert patience.slowness() == 3.0
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
    assert patience.slowness() == 1.0
