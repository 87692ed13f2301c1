"""Sharded training with PyTorch's FSDP2 (`fully_shard`): what `multi_gpu.strategy = fsdp` changes,
as the run's parallelism (`FSDPParallelism`).

Each of the model family's repeated blocks (`family.repeated_blocks`; the layers of a text encoder that
trains) becomes one FSDP unit, and the trained module (`TrainingModel`) the root unit holding the rest.
Every rank then keeps 1/N of every parameter, gradient and optimizer state: a unit's parameters are
gathered just before it runs and freed after, and its gradients are reduce-scattered as soon as they
exist. Parameters become DTensors (`p.to_local()` is this rank's shard, `p.full_tensor()` gathers the
whole one - a collective every rank must join).

Precision: master weights, optimizer state and gradient reduction stay fp32; with `training.precision
= bf16` the gathered weights are bf16, so the forward and backward compute in bf16. Inputs are not cast
(`cast_forward_inputs=False`): timesteps and rotary embeddings keep fp32 and autocast decides per op,
as under DDP.

Gradient checkpointing: PyTorch's composable `checkpoint` on each block *before* it is sharded.
diffusers' own checkpointing inside a sharded block fails in the recompute on Flux ("Recomputed values
... have different metadata"), see shared/ANCHORS.md.

Outputs: no rank holds the whole model, so a model is saved by every rank gathering one block at a time
while rank 0 writes (`streamed_save.gathering_source`), a backup by every rank writing its shards
(`ShardedBackups`, `sharded_backup.py`'s format), and a backup of whole tensors loads into the shards
(`FSDPParallelism.load_whole_backup`). Samples and the validation loss call the sharded model equally
often on every rank, through the root (`calls_through_root`).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from pathlib import Path

import torch
from torch import nn

from modules.trainer.parallelism import Parallelism
from modules.util import dist_utils as du

log = logging.getLogger("tandem")

RUN_PART = "run_part"
"""The trained module's method that runs one of its parts alone (`TrainingModel.run_part`), registered
with FSDP so that its hooks run around it as around a training forward."""


class FSDPUnavailable(RuntimeError):
    pass


def _api():
    try:
        from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                                            fully_shard, register_fsdp_forward_method)
    except ImportError:
        raise FSDPUnavailable(
            f"multi_gpu.strategy fsdp needs PyTorch 2.6 or newer (FSDP2's fully_shard); this is {torch.__version__}. "
            "Update torch, or set multi_gpu.strategy to ddp.") from None
    return CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard, register_fsdp_forward_method


def mixed_precision(precision: str):
    """bf16 compute with fp32 master weights and fp32 gradient reduction; fp32 throughout for fp32."""
    MixedPrecisionPolicy = _api()[2]
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    if precision == "fp32":
        return MixedPrecisionPolicy(cast_forward_inputs=False)
    raise ValueError(f"training.precision {precision!r} with multi_gpu.strategy fsdp: use bf16 or fp32 (fp16 loss "
                     "scaling is not supported with sharded gradients), or set multi_gpu.strategy to ddp.")


def offload_policy(cpu_offload: bool, device: torch.device):
    """FSDP2's `CPUOffloadPolicy` with `multi_gpu.fsdp_cpu_offload`: the shards, their gradients and the
    optimizer step live in host memory (pinned, for a GPU's copies in and out). CPU processes run the same
    code with nothing to move, which is how the tests cover it. Without it, no offload."""
    CPUOffloadPolicy, OffloadPolicy = _api()[0], _api()[3]
    if cpu_offload:
        return CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return OffloadPolicy()


def shard(model: nn.Module, blocks: list[nn.Module], device: torch.device, mesh, precision: str, checkpointing: bool,
          cpu_offload: bool) -> nn.Module:
    """Shard `model` in place over `mesh` (one dimension: every process): each block a unit (checkpointed first
    when `checkpointing`), `model` the root.

    `model` may still be on the CPU: each unit's shard moves to `device` as it is sharded, so no GPU
    ever holds more than one whole block. Returns `model` (now also an `FSDPModule`).
    """
    fully_shard, register_method = _api()[4:]
    options = dict(mesh=mesh, mp_policy=mixed_precision(precision), offload_policy=offload_policy(cpu_offload, device))
    if checkpointing:
        from torch.distributed._composable import checkpoint
    for block in blocks:
        if checkpointing:
            checkpoint(block)
        fully_shard(block, **options)
    fully_shard(model, **options)
    register_method(model, RUN_PART)
    return model


@contextlib.contextmanager
def calls_through_root(root: nn.Module, parts: list[str], autocast=contextlib.nullcontext()):
    """Inside the block, a call of one of the root's parts (a diffusers pipeline calling the denoiser or a
    text encoder that trains) enters through the root, so FSDP gathers the root's own weights and then
    each block's, as in training. Every rank must make the same calls (each gather is collective).
    `autocast`: the training autocast, for weights gathered in bf16."""
    modules = [root.get_submodule(name) for name in parts]
    run = getattr(root, RUN_PART)
    for name, module in zip(parts, modules):
        call = functools.partial(run, name)
        # Its own parameters, for a pipeline that passes the denoiser only what its forward names (diffusers'
        # modular pipelines: Flux.3's).
        call.__signature__ = inspect.signature(module.forward)
        module.forward = call
    try:
        with autocast:
            yield
    finally:
        for module in modules:
            del module.forward


def gradient_sync(model: nn.Module, sync: bool):
    """Reduce-scatter gradients after this backward (`sync`), or keep accumulating them unsharded on every
    rank until the last micro-batch (FSDP's equivalent of DDP's `no_sync`)."""
    model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------ the parallelism

def _trained_parts(model: nn.Module) -> list[str]:
    """The trained module's parts by name: `unet` (the denoiser, for every family) and each text encoder
    that trains (`text_encoders.0`, ...)."""
    encoders = getattr(model, "text_encoders", None)
    return ["unet"] + [f"text_encoders.{i}" for i in range(len(encoders) if encoders is not None else 0)]


class FSDPParallelism(Parallelism):
    """Every process holds 1/N of the trained module (`multi_gpu.strategy = fsdp`): see the module's doc."""
    name = "fsdp"
    holds_whole_model = False
    forward_is_collective = True

    def __init__(self, training, cpu_offload: bool, device: torch.device, mesh,
                 planned_split: list[int] | None = None) -> None:
        """`training`: the run's `TrainingConfig` (precision, gradient checkpointing, method);
        `cpu_offload`: `multi_gpu.fsdp_cpu_offload`; `mesh`: the run's `LayoutMesh` (`mesh.py`), whose layout
        shards the weights over every process; `planned_split`: the memory plan's split of each global
        batch over unequal GPUs (`multi_gpu.batch_split = auto`). Activation offloading: `offload_activations`."""
        if mesh.layout.shard != mesh.layout.processes:
            raise ValueError(f"multi_gpu.strategy fsdp shards the weights over every process: a layout of "
                             f"{mesh.layout.describe()} with shard {mesh.layout.shard}")
        self.training = training
        self.cpu_offload = cpu_offload
        self.device = device
        self.mesh = mesh
        self.layout = mesh.layout
        self.planned_split = planned_split

    @classmethod
    def for_run(cls, cfg, device: torch.device, mesh, plan) -> FSDPParallelism:
        """The parallelism of a run of `cfg` (as its memory plan `plan` set it, None: as configured)."""
        from modules.config.validation import fsdp_blockers

        blockers = fsdp_blockers(cfg)
        if blockers:  # validation refuses them with strategy fsdp; a config edited since cannot slip through
            raise ValueError(f"multi_gpu.strategy fsdp: {'; '.join(blockers)}.")
        return cls(cfg.training, cfg.multi_gpu.fsdp_cpu_offload, device, mesh,
                   plan.planned_split if plan is not None else None)

    def load_device(self, device: torch.device) -> torch.device:
        """Host memory: sharding moves each rank's part of the trained module to its GPU, so no GPU ever holds
        the whole (Qwen-Image's 20 B transformer in fp32, 82 GB, fits none)."""
        return torch.device("cpu")

    def checkpoint_activations(self, bundle) -> None:
        """Nothing here: each block is checkpointed as it is sharded (`shard`)."""

    def place(self, bundle, trained: list[nn.Module], device: torch.device) -> None:
        """The frozen parts onto the device; the trained module stays where it was loaded, and sharding moves
        each rank's part of it to the GPU block by block, so no GPU ever holds the whole of it."""
        for module in bundle.modules().values():
            if not any(module is t for t in trained):
                module.to(device)

    def compile_splits_at_buckets(self, trainable: list[nn.Parameter]) -> bool:
        return True  # DDP's setting; validation refuses training.compile under FSDP

    def wrap(self, model: nn.Module, trainable: list[nn.Parameter]):
        """FSDP over the family's blocks (and the layers of text encoders that train); the trained parameters
        become sharded ones, so the list the optimizer and EMA take is made anew."""
        t = self.training
        if t.method == "lora":  # randomly initialised adapters must start alike on every rank
            du.broadcast_parameters(model)
        names = {id(p): name for name, p in model.named_parameters()}
        trained = [names[id(p)] for p in trainable]
        bundle = model.bundle
        from modules.model.float8 import shardable
        layers = shardable(bundle.denoiser)  # an fp8 base (`model.unet_dtype = fp8`) is sharded in float8
        if layers:
            log.info("fp8 base: %d Linear layers sharded in float8, gathered in bf16.", layers)
        blocks = bundle.family.repeated_blocks(bundle)
        for part in _trained_parts(model)[1:]:
            blocks += bundle.family.text_encoder_blocks(model.get_submodule(part))
        shard(model, blocks, self.device, self.mesh.shards(), t.precision, t.gradient_checkpointing, self.cpu_offload)
        params = dict(model.named_parameters())
        return model, [params[name] for name in trained]

    def gradient_sync(self, model: nn.Module, last_micro_batch: bool):
        """FSDP's gradient sync for this micro-batch, and with activation offloading the saved-tensor hooks
        that keep what its forward saves in host memory until its backward."""
        gradient_sync(model, last_micro_batch)
        return self.with_offloaded_activations(contextlib.nullcontext())

    def sampling_calls(self, model: nn.Module, autocast):
        return calls_through_root(model, _trained_parts(model), autocast)

    def write_model(self, work):
        """Every rank gathers each block (a collective), rank 0 writes; all learn whether it worked."""
        return du.on_every_rank(work)

    def tensor_source(self, device: torch.device):
        from modules.model.streamed_save import gathering_source
        return gathering_source(device)

    def backups(self, parts, run_id: str):
        return ShardedBackups(parts, run_id)

    def load_whole_backup(self, model: nn.Module, optimizer, ema, own: dict[str, torch.Tensor],
                          weights: dict[str, torch.Tensor], state: dict) -> None:
        """A backup of whole tensors (one process or DDP: `weights.safetensors`, the optimizer's state dict by
        parameter index) into the sharded model: each rank keeps its part."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        from modules.trainer.sharded_backup import parameter_names

        names = dict(zip(own, parameter_names(model, own.values())))  # backup name -> parameter name
        # The saved optimizer state names parameters by their index in the optimizer; FSDP's loader by name.
        order = parameter_names(model, [p for g in optimizer.param_groups for p in g["params"]])
        saved = state["optimizer"]
        optimizer_state = {"state": {order[index]: value for index, value in saved["state"].items()},
                           "param_groups": [{**group, "params": [order[index] for index in group["params"]]}
                                            for group in saved["param_groups"]]}
        model_state = {names[key]: value for key, value in weights.items() if key in names}
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                       options=StateDictOptions(ignore_frozen_params=True, full_state_dict=True, strict=False))
        if ema is not None and state.get("ema") is not None:
            for shadow, full in zip(ema.shadow, state["ema"]["shadow"]):
                du.copy_full_into(shadow, full)


class ShardedBackups:
    """No rank holds the whole state, so every rank writes its shards through DCP (`sharded_backup.py`'s
    format), and training waits while they do: DCP's `async_save` would need a copy of every rank's
    shards in host memory (a Flux full fine-tune's 190 GB of weights and Adam state) and a second
    process group for its background collectives."""

    def __init__(self, parts, run_id: str) -> None:
        """`parts`: the run's `outputs.RunParts`."""
        self.parts = parts
        self.run_id = run_id
        self.last_written: Path | None = None

    def take(self, run, manifest: dict) -> tuple[list[tuple[int, Path]], float]:
        """Write the current step of `run` (an `outputs.TrainingRun`; every rank calls this): the trained
        weights, optimizer state and EMA as shards, rank 0 the plain state. Rank 0 returns the backup as
        done; nothing is pinned."""
        from modules.trainer import sharded_backup

        tensors, optimizer_entries = sharded_backup.checkpoint_state(run.model, self.parts.optimizer, self.parts.ema)
        own = run.trainable_state()
        state = {**run.progress_state(), "optimizer_entries": optimizer_entries,
                 "trained_parameters": sorted(tensors["model"]),
                 # parameter name -> the name `weights.safetensors` of other backups uses (`transformer.…`)
                 "weight_names": dict(zip(sharded_backup.parameter_names(run.model, own.values()), own))}
        path = sharded_backup.write_sharded_backup(self.parts.paths.backups, self.run_id, run.global_step, tensors,
                                                   state, manifest, self.parts.cfg.save.rolling_backup_count)
        if not du.is_main():
            return [], 0.0
        self.last_written = path
        return [(run.global_step, path)], 0.0

    def finished(self) -> list[tuple[int, Path]]:
        return []  # written at once

    def wait(self) -> list[tuple[int, Path]]:
        return []

    def release_host_memory(self) -> None:
        """Nothing to release: no snapshot in host memory."""

    def close(self) -> None:
        """No thread to end."""
