"""Caching progress: tqdm bars in a terminal; in a log file (a pipe, nohup, a scheduler) a plain line from
rank 0 every few seconds and at the end, with no bar redraws or cursor moves. No model is loaded."""
import logging

import pytest
import torch
from PIL import Image
from tqdm import tqdm

from modules.config.train_config import ConceptConfig, DataConfig
from modules.data import build_dataset
from modules.data import cache as cache_module


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def log_file(monkeypatch, caplog):
    """stderr is not a terminal, the clock is ours, and the `tandem` logger reaches caplog."""
    clock = Clock()
    monkeypatch.setattr(cache_module.time, "perf_counter", clock)
    monkeypatch.setattr(cache_module.sys.stderr, "isatty", lambda: False)
    monkeypatch.setattr(cache_module.log, "propagate", True)  # whatever set up logging before
    caplog.set_level(logging.INFO, logger="tandem")
    return clock


def caching_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tandem" and r.getMessage().startswith("Caching")]


def test_a_log_gets_a_line_every_few_seconds_and_one_at_the_end(log_file, caplog, capsys):
    clock = log_file
    with cache_module._caching_progress(144, rank=0, show=True) as progress:
        assert not isinstance(progress, tqdm)
        for _ in range(18):  # 8 entries every 0.75 s: 13.5 s in all
            clock.now += 0.75
            progress.update(8)
    lines = caching_lines(caplog)
    assert len(lines) == 3  # after 5.25 s and 10.5 s, and the end
    assert lines[0] == "Caching: 56/144 entries (38%) on this rank, 10.7 entries/s, ETA 8s"
    assert lines[-1] == "Caching: 144/144 entries (100%) on this rank, 10.7 entries/s, ETA 0s"
    err = capsys.readouterr().err
    assert "\x1b[" not in err and "Caching (rank" not in err and "|" not in err


def test_at_most_one_line_per_interval_however_many_updates(log_file, caplog):
    clock = log_file
    with cache_module._caching_progress(641, rank=0, show=True) as progress:
        for _ in range(640):
            clock.now += 1 / 64  # 10 s of small updates (a step a float adds up exactly)
            progress.update(1)
        progress.update(1)
    lines = caching_lines(caplog)
    assert len(lines) == 2 + 1  # 5 s, 10 s, the end
    assert lines[0].startswith("Caching: 320/641 entries (49%) on this rank, 64.0 entries/s")
    assert lines[-1].startswith("Caching: 641/641 entries (100%)")


def test_a_short_share_logs_its_end_only_and_a_failed_one_nothing(log_file, caplog):
    with cache_module._caching_progress(3, rank=0, show=True) as progress:
        progress.update(3)  # at once: no time has passed, so no rate either
    assert caching_lines(caplog) == ["Caching: 3/3 entries (100%) on this rank, measuring speed, ETA ?"]
    caplog.clear()
    with pytest.raises(OSError):
        with cache_module._caching_progress(3, rank=0, show=True) as progress:
            log_file.now += 6.0
            progress.update(1)
            raise OSError("disk full")
    assert caching_lines(caplog) == ["Caching: 1/3 entries (33%) on this rank, 0.2 entries/s, ETA 12s"]


@pytest.mark.parametrize("rank, show", [(1, True), (3, True), (0, False)])
def test_other_ranks_and_quiet_callers_log_nothing(log_file, caplog, capsys, rank, show):
    with cache_module._caching_progress(100, rank=rank, show=show) as progress:
        for _ in range(10):
            log_file.now += 2.0
            progress.update(10)
    assert caching_lines(caplog) == []
    assert capsys.readouterr().err == ""


def test_a_terminal_gets_a_bar_per_rank(monkeypatch):
    monkeypatch.setattr(cache_module.sys.stderr, "isatty", lambda: True)
    with cache_module._caching_progress(10, rank=1, show=True) as progress:
        assert isinstance(progress, tqdm)
        assert progress.desc == "Caching (rank 1)" and not progress.leave
        progress.update(10)
    with cache_module._caching_progress(10, rank=0, show=False) as quiet:
        assert isinstance(quiet, tqdm) and quiet.disable


def test_filling_the_cache_into_a_log_file_writes_lines_not_bars(tmp_path, log_file, caplog, capsys):
    """The real fill_cache through Dataset.cache, with fake encoders: latents and text both count."""
    root = tmp_path / "images"
    root.mkdir()
    for i in range(6):
        Image.new("RGB", (64, 64), (i * 40, 30, 200 - i * 30)).save(root / f"{i}.png")
        (root / f"{i}.txt").write_text(f"picture {i}", encoding="utf-8")
    cfg = DataConfig(concepts=[ConceptConfig(path=str(root))], resolution=64, bucket_step=16, num_workers=0)
    dataset = build_dataset(cfg, tmp_path / "cache", seed=0)

    def encode_images(pixels):
        log_file.now += 3.0  # a slow VAE: the log gets a line while caching, not only at the end
        return torch.nn.functional.avg_pool2d(pixels, 8)

    def encode_text(captions):
        return {"encoder_hidden_states": torch.zeros(len(captions), 2, 3)}

    dataset.cache(encode_images, encode_text, "fake", cache_text=True, batch_size=2)
    lines = caching_lines(caplog)
    assert len(lines) >= 2 and lines[-1].startswith("Caching: 12/12 entries (100%) on this rank")
    err = capsys.readouterr().err
    assert "\x1b[" not in err and "Caching" not in err
