"""Layer offload (block swap, `multi_gpu.layer_offload`): the schedule that brings a frozen base's blocks to the
device ahead of their use - which blocks, in which order, how many at once, the next one issued before the
current one computes - and that training with it trains what training without it trains (CPU processes: each
"copy to the device" is a real copy of the host bytes, so a stale or missing weight would show)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from modules.planning.memory_need import swapped_positions as spread
from modules.model.layer_offload import LayerOffload


class Block(nn.Module):
    """A frozen Linear with a trained low-rank pair beside it (a LoRA layer's shape), noting when it computes."""

    def __init__(self, width: int, log: list) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.down = nn.Parameter(torch.randn(2, width) * 0.1)
        self.up = nn.Parameter(torch.randn(width, 2) * 0.1)
        self.log = log
        self.offload: LayerOffload | None = None
        """When set: the block checks that it computes with a device copy of its frozen weights."""

    def forward(self, x):
        self.log.append(("compute", self.position))
        if self.offload is not None and self.position in [b.position for b in self.offload.blocks]:
            assert not self.offload.is_swapped(self.base.weight), f"block {self.position} computes with host weights"
        return torch.tanh(self.base(x) + x @ self.down.t() @ self.up.t())


class Stack(nn.Module):
    """Blocks run in `run_order` (not the list's order, as a UNet's), each checkpointed like diffusers' blocks."""

    def __init__(self, count: int, width: int, run_order: list[int], checkpointing: bool = True) -> None:
        super().__init__()
        self.log: list = []
        self.blocks = nn.ModuleList(Block(width, self.log) for _ in range(count))
        for i, block in enumerate(self.blocks):
            block.position = i
        self.run_order = run_order
        self.checkpointing = checkpointing

    def forward(self, x):
        for i in self.run_order:
            block = self.blocks[i]
            x = checkpoint(block.__call__, x, use_reentrant=False) if self.checkpointing and torch.is_grad_enabled() \
                else block(x)
        return x


def trained(model: Stack) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def train_steps(model: Stack, steps: int = 3) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 8)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return trained(model)


def test_the_blocks_that_swap_are_spread_over_the_run():
    assert spread(8, 4) == [1, 3, 5, 7] and spread(8, 8) == list(range(8)) and spread(8, 0) == []
    assert spread(60, 30) == list(range(1, 60, 2)) and len(spread(7, 3)) == 3 and spread(3, 9) == [0, 1, 2]


def test_each_block_comes_before_it_computes_and_the_next_is_copied_meanwhile():
    torch.manual_seed(0)
    order = [0, 2, 1, 3, 5, 4]  # the run order differs from the list's: learned from the first forward
    model = Stack(6, 8, order)
    offload = LayerOffload(list(model.blocks), 6, torch.device("cpu"), record=True)
    for block in model.blocks:
        block.log, block.offload = offload.trace, offload  # the blocks note their computes among the moves
    x = torch.randn(4, 8)
    model(x).sum().backward()  # the first pass teaches the order (its copies wait where the list's guess was wrong)
    offload.trace.clear()
    model(x).sum().backward()
    events = trace = offload.trace
    forward, backward = order, order[::-1]
    # Every block is in use before it computes, and the next in the run (the previous, in the backward) was
    # issued before this one computes, so its copy overlaps the compute.
    computes = [i for i, e in enumerate(events) if e[0] == "compute"]
    assert [events[i][1] for i in computes] == forward + backward
    for n, at in enumerate(computes):
        block = events[at][1]
        sequence = forward + backward
        if n + 1 < len(sequence) and sequence[n + 1] != block:
            nxt = sequence[n + 1]
            last_copy = max(i for i, e in enumerate(events[:computes[n + 1]]) if e == ("copy", nxt))
            assert last_copy < at, f"block {nxt} was not issued before block {block} computed: {events}"
    # No copy waited: after the first pass every copy was issued ahead (none issued by its own block's hook).
    assert offload.most_loaded <= 2
    # The last block of the forward stays for the backward, the first of the backward for the next forward.
    assert trace.count(("copy", order[-1])) == 1 and trace.count(("copy", order[0])) == 1
    assert sum(1 for e in trace if e[0] == "copy") == 2 * len(order) - 2


def test_at_most_two_swapped_blocks_are_on_the_device_and_only_frozen_weights_move():
    torch.manual_seed(0)
    model = Stack(8, 8, list(range(8)))
    offload = LayerOffload(list(model.blocks), 4, torch.device("cpu"), record=True)
    assert [b.position for b in offload.blocks] == [1, 3, 5, 7]
    assert offload.host_bytes == 4 * 2 * 256  # weight (256 bytes) and bias (32, aligned to 256) of each swapped block
    for _ in range(2):
        model(torch.randn(2, 8)).sum().backward()
    assert offload.most_loaded <= 2
    assert {position for name, position in offload.trace if name == "copy"} == {1, 3, 5, 7}
    # The trained pair never moves and got gradients. Between steps the frozen weights are the host ones, but
    # for the first swapped block's: the next forward needs it first.
    assert all(b.down.grad is not None and b.down.device.type == "cpu" for b in model.blocks)
    assert all(offload.is_swapped(model.blocks[i].base.weight) for i in (3, 5, 7))
    assert list(offload.loaded) == [1] and not offload.is_swapped(model.blocks[1].base.weight)
    assert not offload.is_swapped(model.blocks[0].base.weight)  # a resident block's own weight


@pytest.mark.parametrize("checkpointing", [True, False])
def test_training_with_offload_trains_what_training_without_it_trains(checkpointing):
    torch.manual_seed(0)
    model = Stack(6, 8, [0, 1, 2, 3, 4, 5], checkpointing)
    twin = copy.deepcopy(model)
    twin.log = model.log  # (the blocks share the list; it only notes computes)
    offload = LayerOffload(list(twin.blocks), 3, torch.device("cpu"))
    plain, swapped = train_steps(model), train_steps(twin)
    assert plain.keys() == swapped.keys()
    for name in plain:
        assert torch.equal(plain[name], swapped[name]), name
    # Samples (no gradients) see the same weights too.
    with torch.no_grad():
        x = torch.randn(3, 8)
        assert torch.equal(model(x), twin(x))
    offload.close()
    with torch.no_grad():
        assert torch.equal(model(x), twin(x))


# ---------------------------------------------------------------------------- the real trainer on the demos
DEMO_RUN = ("training.max_steps=2", "save.backup_every_n_steps=2", "optimizer.name=sgd", "training.learning_rate=0.05",
            "training.gradient_checkpointing=true", "training.precision=fp32", "training.batch_size=2")


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


@pytest.mark.slow
@pytest.mark.parametrize("preset, blocks", [("#demo", 6), ("#demo_flux", 2)])
def test_layer_offload_on_or_off_trains_the_same_weights(tmp_path, cache_dir, caplog, preset, blocks):
    """The SD demo's UNet (its ResNet and transformer blocks, run in another order than listed) and the Flux demo's
    transformer: a LoRA trained with blocks swapping equals the one trained without (fp32, CPU: the same arithmetic
    on copies of the same bytes)."""
    from tests.trainer_helpers import demo_config, latest_backup_weights, train

    caplog.set_level("INFO", logger="tandem")
    off = train(demo_config(tmp_path / "off", cache_dir, *DEMO_RUN, "multi_gpu.layer_offload=off", preset=preset))
    on = train(demo_config(tmp_path / "on", cache_dir, *DEMO_RUN, f"multi_gpu.layer_offload={blocks}", preset=preset))
    assert off.parallel.offload is None and on.parallel.offload is not None
    assert len(on.parallel.offload.blocks) == blocks and on.parallel.offload.copied_bytes > 0
    assert "Layer offload (multi_gpu.layer_offload): %d of " % blocks in caplog.text
    a, b = latest_backup_weights(tmp_path / "off"), latest_backup_weights(tmp_path / "on")
    assert a.keys() == b.keys() and any("lora" in k for k in a)
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=0, atol=1e-6), key
    assert any(not torch.equal(a[k], torch.zeros_like(a[k])) for k in a if "lora_B" in k or "lora_up" in k)
