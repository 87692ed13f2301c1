"""The per-step report: sent with a step, received one step later, never lost or doubled."""
import pytest
import torch

from modules.trainer.step_exchange import StepExchange
from tests.patience import patience


def test_report_comes_back_one_step_later_with_loss_lr_and_commands():
    exchange = StepExchange()
    assert exchange.receive() is None  # nothing sent yet: the first step has no previous report
    exchange.send(step=7, epoch=2, loss=torch.tensor(0.25), lr=1e-4, commands={"sample", "stop"})
    report = exchange.receive()
    assert (report.step, report.epoch, report.lr, report.commands) == (7, 2, 1e-4, {"sample", "stop"})
    assert report.loss == pytest.approx(0.25)
    assert exchange.receive() is None  # received once only


def test_a_second_send_before_receive_is_refused():
    exchange = StepExchange()
    exchange.send(1, 0, torch.tensor(1.0), 0.1, set())
    with pytest.raises(RuntimeError, match="twice"):
        exchange.send(2, 0, torch.tensor(1.0), 0.1, set())


def test_sending_does_not_keep_a_reference_to_the_loss_graph():
    exchange = StepExchange()
    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()
    exchange.send(1, 0, loss, 0.1, set())
    loss.backward()  # the exchange detached its copy, so the graph is the trainer's alone
    assert exchange.receive().loss == pytest.approx(6.0)


def _two_ranks(rank: int, init_file: str, results) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        exchange = StepExchange()
        exchange.send(1, 0, torch.tensor(float("nan") if rank == 1 else 0.5), 0.1, {"sample"} if rank else set())
        first = exchange.receive()
        exchange.send(2, 0, torch.tensor(1.0 + rank), 0.1, set())
        second = exchange.receive()
        results.put((rank, first.rank_losses, first.commands, second.loss, second.rank_losses, second.rank_step_s))
    finally:
        dist.destroy_process_group()

@pytest.mark.slow

def test_every_rank_receives_each_ranks_loss_and_step_time(tmp_path):
    """One all-reduce carries each rank's own loss and step time in its slot; a NaN stays in its rank's slot."""
    import math

    import torch.multiprocessing as mp
    context = mp.get_context("spawn")
    results = context.Queue()
    mp.start_processes(_two_ranks, args=(str(tmp_path / "init"), results), nprocs=2, join=True,
                       start_method="spawn")
    reports = dict((r[0], r[1:]) for r in (results.get(timeout=patience(60)) for _ in range(2)))
    assert str(reports[0]) == str(reports[1])  # every rank got the same numbers (as text: NaN != NaN)
    first_losses, first_commands, mean, losses, step_s = reports[0]
    assert first_losses[0] == 0.5 and math.isnan(first_losses[1]) and first_commands == {"sample"}
    assert losses == [1.0, 2.0] and mean == pytest.approx(1.5)
    assert len(step_s) == 2 and all(s > 0 for s in step_s)  # seconds since each rank's previous step


def test_one_process_reports_itself_as_rank_0():
    exchange = StepExchange()
    exchange.send(1, 0, torch.tensor(0.25), 0.1, set())
    first = exchange.receive()
    exchange.send(2, 0, torch.tensor(0.75), 0.1, set())
    second = exchange.receive()
    assert first.rank_losses == [0.25] and first.rank_step_s == [0.0]
    assert second.rank_losses == [0.75] and second.rank_step_s[0] > 0


def test_rank_0_reports_each_ranks_loss_and_images_per_second():
    """The progress events carry the per-rank numbers with several processes (not with one)."""
    from types import SimpleNamespace

    from modules.trainer.progress import ProgressReporter
    from modules.trainer.step_exchange import StepReport

    events = []
    numbers = SimpleNamespace(total_steps=10, global_batch=16, epochs=1, per_gpu_batch=4, accumulation=2)
    reporter = ProgressReporter(numbers, lambda type_, **fields: events.append((type_, fields)), 0, None, True)
    for step, times in ((1, [0.0, 0.0]), (2, [2.0, 4.0]), (3, [2.0, 4.0])):
        reporter.step(StepReport(step, 0, 0.5, 1e-4, set(), rank_losses=[0.4, 0.6], rank_step_s=times))
    loss = [f for t, f in events if t == "loss"][-1]
    progress = [f for t, f in events if t == "progress"]
    assert loss["rank_losses"] == [0.4, 0.6]
    assert progress[0]["rank_images_per_s"] == [0.0, 0.0]  # the warm-up step is left out
    assert progress[-1]["rank_images_per_s"] == [4.0, 2.0]  # 4 x 2 local images per 2 s and per 4 s
    reporter.step(StepReport(4, 0, 0.5, 1e-4, set(), rank_losses=[0.5], rank_step_s=[1.0]))
    assert "rank_losses" not in events[-2][1] and "rank_images_per_s" not in events[-1][1]
