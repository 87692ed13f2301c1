"""How the trained model is spread over the processes: one object, chosen once at start.

The loop never asks which strategy trains. It holds one `Parallelism`, chosen where the run starts
(`GenericTrainer`: `SingleProcess`; `DistributedTrainer`: DDP or FSDP, found by the name `multi_gpu.strategy`
or the memory plan gives, in `STRATEGIES`: `modules/distributed/ddp.py` and `fsdp.py`), and asks it for
everything that differs between them:

| concern | one process | DDP | FSDP |
| --- | --- | --- | --- |
| loading (`load_device`) | onto the device | the same | into host memory: no GPU ever holds the whole trained module |
| placement (`place`) | the whole model on the device | the same | frozen parts on the device; the trained module's shards move there as it is sharded |
| activation checkpointing | diffusers' own | the same | PyTorch's composable checkpoint on each block, before sharding it |
| wrapping (`wrap`, `unwrap`) | none | DDP around the trained module, rank 0's weights broadcast first | `fully_shard` per block and the root: trained parameters become sharded ones |
| a step's micro-batches (`forward_backward`) | forward, backward, add up | the same, `no_sync` on all but the last | the same, gradient sync off until the last |
| forward calls outside a step | as they come; a sampling's replayed from CUDA graphs (`sampling_replays_graphs`) | the same | collective: every rank calls as often (`extra_calls`), through the root (`sampling_calls`), no graphs |
| writing a model | rank 0 alone | the same | every rank gathers one block at a time, rank 0 writes |
| backups (`backups`) | rank 0, in the background, whole tensors | the same | every rank its shards (DCP), synchronously |
| a backup of whole tensors (`load_whole_backup`) | copied in | the same | each rank keeps its part |
| the memory plan's savers | an fp8 base whole; layer offload (`place`: swapped blocks in host memory); activation offloading (hooks in `gradient_sync`'s context) | the same, one host copy shared by the ranks of a machine | an fp8 base sharded in float8 (`wrap`); activation offloading as in one process; CPU offload of the shards; the plan's batch split (`planned_split`) |

The collectives every strategy needs alike (barriers, the step's report, broadcasts, gathering RNG
states) stay in `modules.util.dist_utils`, no-ops in one process; the parallelism owns those that differ
between strategies: DDP's gradient all-reduce, FSDP's gathers in every forward and for a save, equal
forward calls on every rank. This class is the one-process parallelism, and its defaults are the
whole-model behaviour one process and DDP share. Memory pooling (`modules/planning/memory_plan.py`)
chooses among them and sets what they read: FSDP over a LoRA's frozen base, an fp8 base sharded in
float8 (`wrap`), activation checkpointing, activation offloading (saved-tensor hooks in
`gradient_sync`'s context, for every strategy: `offload_activations`) and CPU offload of the shards, and for unequal GPUs under FSDP the split of
each batch (`planned_split`).

How the processes split the work is the run's `layout` (`modules/launch/layout.py`: data-parallel
groups x processes per group, and over how many processes the weights are sharded), which the launch
resolved and the strategy completed. With context parallelism (`multi_gpu.context_parallel`: groups of
several processes) the parallelism holds a `ContextParallel` (`sequences`,
`modules/distributed/context_parallel.py`) that splits each sample's sequence over its group;
`data_rank` / `data_world` say which slice of the global batch the process's group trains, the loss is
scaled so that the gradient exchange's average is the groups' average, and only a group's first
process (`context_rank` 0) keeps what the group computed together (samples, validation losses). In one
process they are 0, 1 and 0.
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import Callable, ContextManager, TypeVar

import torch
from torch import nn

from modules.launch.layout import ParallelLayout
from modules.model.streamed_save import LOCAL, TensorSource
from modules.trainer.backup_writer import BackgroundBackups
from modules.util import dist_utils as du

log = logging.getLogger(__name__)

T = TypeVar("T")


class Parallelism:
    name = "single"
    """As the log and the benchmark's results name it: `single`, `ddp` or `fsdp`."""
    holds_whole_model = True
    """Whether every process holds every trained weight, so that measuring one GPU with the whole model
    means something (`multi_gpu.batch_split = auto`) and a benchmark's set-up peak is the training one."""
    forward_is_collective = False
    """Whether each forward of the trained model is a collective (FSDP gathers its weights from every rank):
    forward calls outside a training step (samples, the validation loss) must then be as many on every rank."""
    planned_split: list[int] | None = None
    """Samples of each global micro-batch per rank as the memory plan split it over unequal GPUs, where the
    start-up measurement of `multi_gpu.batch_split = auto` cannot run (it needs the whole model on each GPU)."""
    layer_offload_blocks = 0
    """Layer offload (`multi_gpu.layer_offload` as the plan set it; one process and DDP): how many of the
    denoiser's repeated blocks keep their frozen weights in host memory (`modules/model/layer_offload.py`)."""
    offload = None
    """The `LayerOffload` of this run once `place` swapped the blocks, else None."""
    activations = None
    """The `ActivationOffload` (`modules/model/activation_offload.py`) whose saved-tensor hooks keep what each
    micro-batch's forward saves for its backward in host memory (`offload_activations`), else None."""
    layout = ParallelLayout()
    """How the processes split the training (one process: one group of one, nothing sharded)."""
    sequences = None
    """The `ContextParallel` that splits each sample's sequence over its group where the layout's groups have
    several processes (`modules/distributed/context_parallel.py`), else None."""

    # ---------------------------------------------------------------- which part of the global batch
    @property
    def data_rank(self) -> int:
        """Which slice of each global micro-batch this process trains."""
        return self.layout.data_rank(du.rank())

    @property
    def data_world(self) -> int:
        """Into how many slices each global micro-batch is cut."""
        return self.layout.data

    @property
    def context_rank(self) -> int:
        """This process's place in its context-parallel group (0: the one whose results are kept)."""
        return self.layout.context_rank(du.rank())

    def split_sequences(self, bundle, device: torch.device, sizes: list[tuple[int, int]]) -> None:
        """Split each sample's sequence over the processes of its group (context parallelism; a collective),
        `sizes`: the (width, height) of every bucket the run trains or scores."""
        if self.sequences is not None:
            self.sequences.split(bundle, device, sizes)

    # ---------------------------------------------------------------- before wrapping
    def load_device(self, device: torch.device) -> torch.device:
        """Where the model is loaded (`device`: the training device); `place` then puts each part where it
        trains. With layer offload, host memory: the GPU never holds the whole base."""
        return torch.device("cpu") if self.layer_offload_blocks and device.type == "cuda" else device

    def checkpoint_activations(self, bundle) -> None:
        """Turn on activation (gradient) checkpointing of the denoiser."""
        bundle.denoiser.enable_gradient_checkpointing()

    def place(self, bundle, trained: list[nn.Module], device: torch.device) -> None:
        """Every part of the model onto the training device (`trained`: the modules that train) - but the frozen
        weights of the blocks layer offload swaps, which wait in host memory."""
        if self.layer_offload_blocks and self.offload is None:
            from modules.model.layer_offload import offload_blocks
            from modules.model.shared_host_copy import machine_share
            # Several processes (DDP): the ranks of a machine hold one host copy together.
            self.offload = offload_blocks(bundle, self.layer_offload_blocks, device, machine_share())
        with self.offload.held_back() if self.offload is not None else contextlib.nullcontext():
            bundle.to(device)

    def compile_splits_at_buckets(self, trainable: list[nn.Parameter]) -> bool:
        """Whether `training.compile` splits the denoiser's graph where gradients are synchronised in
        buckets (DDP's): not without a gradient exchange."""
        return False

    # ---------------------------------------------------------------- wrapping and the step
    def wrap(self, model: nn.Module, trainable: list[nn.Parameter]) -> tuple[nn.Module, list[nn.Parameter]]:
        """The trained module (`TrainingModel`) as the step runs it, and the trained parameters as the optimizer
        and EMA take them (a wrapper that shards them makes new ones)."""
        return model, trainable

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The trained module itself, whose forward synchronises no gradients (the compile check, the
        validation loss)."""
        return model

    def forward_backward(self, model: nn.Module, micro_batches: list[dict],
                         loss_of: Callable[[dict, int], torch.Tensor], scaler, share: float = 1.0) -> torch.Tensor:
        """One optimizer step's forward and backward passes (the micro-batch schedule): every micro-batch's loss
        (`loss_of(batch, index)`) backward through `scaler` (`GradScaler`), its gradients added up on each
        process and exchanged after the last (`gradient_sync`); the mean loss of the micro-batches.

        Each loss is weighted so that the exchange's average over the processes is the mean over the global batch:
        `share` is this process's part of it against an equal one (unequal GPUs: `BatchSlice.loss_weight`), times
        the layout's loss scale (context parallelism), over the micro-batches accumulated."""
        weight = share * self.layout.loss_scale / len(micro_batches)
        total = None
        for i, batch in enumerate(micro_batches):
            with self.gradient_sync(model, i == len(micro_batches) - 1):
                loss = loss_of(batch, i)
                scaler.scale(loss * weight).backward()
            total = torch.zeros((), device=loss.device) if total is None else total
            total += loss.detach()
        return total / len(micro_batches)

    def gradient_sync(self, model: nn.Module, last_micro_batch: bool) -> ContextManager:
        """Context for one micro-batch's forward and backward: gradients are exchanged after the last one
        (nothing to exchange here), and with activation offloading what the forward saves waits in host memory."""
        return self.with_offloaded_activations(contextlib.nullcontext())

    def offload_activations(self, training, enabled: bool, device: torch.device) -> None:
        """Activation offloading (`multi_gpu.activation_offload`, as the plan set it) for this run: it moves what
        checkpointed blocks keep, so only with `training.gradient_checkpointing` (validation says so)."""
        if enabled and training.gradient_checkpointing:
            from modules.model.activation_offload import ActivationOffload
            self.activations = ActivationOffload(device)

    def with_offloaded_activations(self, sync: ContextManager) -> ContextManager:
        """`sync` (a strategy's gradient-sync context), inside activation offloading's hooks where it is on."""
        return sync if self.activations is None else _both(self.activations.hooks(), sync)

    # ---------------------------------------------------------------- forward calls outside a step
    def extra_calls(self, mine: int, total: int) -> int:
        """How many calls beyond its own `mine` this rank makes when `total` calls of the model are shared
        out over the ranks in turn (their results dropped): none, unless each forward is a collective."""
        if not self.forward_is_collective:
            return 0
        return math.ceil(total / self.data_world) - mine

    def sampling_calls(self, model: nn.Module, autocast: ContextManager) -> ContextManager:
        """Inside the block the sampling pipeline calls the trained parts (`model` is the wrapped module)."""
        return contextlib.nullcontext()

    @property
    def sampling_replays_graphs(self) -> bool:
        """Whether a sampling's denoiser calls may replay from CUDA graphs (`modules/model/sample_graphs.py`):
        where each call is this process's alone, not a collective."""
        # Swapped weights move at every call; a group's processes exchange sequence parts inside each call.
        return not self.forward_is_collective and self.offload is None and self.layout.context == 1

    # ---------------------------------------------------------------- outputs
    def write_model(self, work: Callable[[], T]) -> T | None:
        """Run `work`, writing a model from the trained weights, where the weights are: rank 0 alone when it
        holds them all; every rank learns whether it worked (`du.on_main`)."""
        return du.on_main(work)

    def tensor_source(self, device: torch.device) -> TensorSource:
        """How the weights are read for a save (`streamed_save`): whole, from this process."""
        return LOCAL

    def backups(self, parts, run_id: str):
        """What writes this run's backups (`outputs.RunParts` of the run): rank 0, on a background thread,
        from a snapshot of the whole state in host memory."""
        return BackgroundBackups(parts.paths.backups, run_id, parts.cfg.save.rolling_backup_count)

    def load_whole_backup(self, model: nn.Module, optimizer, ema, own: dict[str, torch.Tensor],
                          weights: dict[str, torch.Tensor], state: dict) -> None:
        """A backup of whole tensors (`backup.py`'s format) into this run: `own` are this run's trained
        weights by the backup's names (`weights`), `state` the backup's optimizer state and EMA."""
        with torch.no_grad():
            for name, p in own.items():
                p.copy_(weights[name].to(p.dtype))
        optimizer.load_state_dict(state["optimizer"])
        if ema is not None and state["ema"] is not None:
            ema.load_state_dict(state["ema"])


class SingleProcess(Parallelism):
    """One process holding the whole model: nothing is wrapped, synchronised or gathered."""

    def __init__(self, layer_offload_blocks: int = 0) -> None:
        """`layer_offload_blocks`: how many blocks swap (the plan's `multi_gpu.layer_offload`)."""
        self.layer_offload_blocks = layer_offload_blocks
        prepare_allocator_for_layer_offload(layer_offload_blocks)


@contextlib.contextmanager
def _both(outer: ContextManager, inner: ContextManager):
    with outer, inner:
        yield


def prepare_allocator_for_layer_offload(blocks: int) -> None:
    """With blocks to swap, GPU segments that grow in place, asked for before the run allocates anything: the
    swapped blocks' copies come and go at every step, and the segments the text cache and the model's
    placement left behind were 9 GiB of holes, set later (`modules/util/host_copy.py`)."""
    if blocks:
        from modules.util.host_copy import use_expandable_segments
        if use_expandable_segments():
            log.info("Layer offload: the GPU allocator grows its segments in place (expandable_segments), so the "
                     "swapped blocks' copies leave no holes.")
