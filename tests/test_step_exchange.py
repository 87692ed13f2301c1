"""The per-step report: sent with a step, received one step later, never lost or doubled."""
import pytest
import torch

from modules.trainer.step_exchange import StepExchange


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
