"""The multi-process trainer: the same loop as `GenericTrainer`, with DDP or FSDP around the trained module.

What changes with N processes, and nothing else, lives here: joining the process group, choosing the
strategy (`multi_gpu.strategy`, `strategy.py`), identical initial weights on every rank, the wrapper
(DistributedDataParallel with its bucket, graph and compression settings, or FSDP2's sharding,
`fsdp.py`) and skipping the gradient exchange on all micro-batches but the last.
The sampler, rank-0-only writing, LR scaling and the loss/command exchange use the rank/world helpers
in `dist_utils`, which the base loop already calls; outputs of a sharded run are written by all ranks
together (`BaseTrainer.sharded`).
"""
from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from modules.config.validation import fsdp_blockers
from modules.distributed import failures, fsdp
from modules.distributed.process_group import destroy, init_worker
from modules.distributed.strategy import choose_strategy
from modules.distributed.watchdog import Watchdog
from modules.trainer.base_trainer import BaseTrainer
from modules.util import dist_utils as du
from modules.util.batch_slice import equal_split

log = logging.getLogger("tandem")


def register_compression(ddp: DDP, mode: str) -> None:
    if mode == "none":
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    hooks = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}
    if mode not in hooks:
        raise ValueError(f"multi_gpu.gradient_compression: unknown mode {mode!r}; use none, bf16 or fp16")
    ddp.register_comm_hook(None, hooks[mode])


def _no_buffer_sync_per_forward() -> dict:
    """Frozen buffers never change, so re-sending them every forward is wasted time (the name changed in torch 2.13)."""
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


class DistributedTrainer(BaseTrainer):
    def __init__(self, cfg, callbacks=None, inbox=None, device_type: str = "cuda", resume: str | None = None,
                 run_id: str | None = None, launch=None, scan=None, rendezvous: str | None = None) -> None:
        """`rendezvous`: `host:port` of the store the launcher serves (None: MASTER_ADDR/MASTER_PORT)."""
        super().__init__(cfg, callbacks, inbox, resume, run_id, launch, scan)
        self.device_type = device_type
        self.rendezvous = rendezvous

    def setup_environment(self) -> None:
        m = self.cfg.multi_gpu
        parts = self.start_phases.parts.setdefault("set-up", {})
        arrived, started = time.time(), time.perf_counter()
        self.device = init_worker(m.backend, self.device_type, m.timeout_minutes, cpu_collectives=m.fsdp_cpu_offload,
                                  store_address=self.rendezvous)
        joined = time.perf_counter() - started
        # Every rank has joined: from here a rank that fails, freezes or stalls ends the job within seconds.
        self.watchdog = Watchdog.start(self.heartbeat, du.rank(), du.world_size(), m.stall_seconds,
                                       failures.failures_folder(self.paths.workspace), self.rendezvous)
        # Joining waits for the last rank to arrive: a slow start elsewhere, not a slow process group.
        # (Clocks of other machines may differ: the wait is bounded by the time the join took.)
        waited = min(joined, max(0.0, max(du.all_gather_objects(arrived)) - arrived))
        parts["waiting for the last rank to start"] = waited
        parts["process group"] = joined - waited
        self.configure_backends()
        started = time.perf_counter()
        self.strategy = self.choose_strategy()
        parts["choosing the strategy"] = time.perf_counter() - started
        self.sharded = self.strategy == "fsdp"

    def choose_strategy(self) -> str:
        """`multi_gpu.strategy`, or what `auto` makes of it from the smallest free GPU memory of all ranks;
        every rank takes rank 0's decision."""
        free = None
        if self.device.type == "cuda":
            free = du.all_gather_objects(torch.cuda.mem_get_info(self.device)[0] / 1024 ** 3)
        # Every rank sizes the model at the same time: the estimate imports diffusers and builds the model on
        # `meta` (~10 s the first time). Made on rank 0 alone, the other ranks first waited for it, then spent
        # that time again on their own imports while rank 0 waited for them (GPU runs: ~10 s per start).
        mine = choose_strategy(self.cfg, du.world_size(), self.device.type, min(free) if free else None)
        choice = du.broadcast_object(mine)
        log.info("Multi-GPU strategy: %s (%s).", choice.strategy.upper(), choice.reason)
        blockers = fsdp_blockers(self.cfg) if choice.strategy == "fsdp" else []
        if blockers:  # validation refuses them with strategy fsdp; a config edited since cannot slip through
            raise ValueError(f"multi_gpu.strategy fsdp: {'; '.join(blockers)}.")
        return choice.strategy

    def decide_split(self) -> list[int]:
        if self.sharded and self.cfg.multi_gpu.batch_split.strip().lower() == "auto":
            # The probe trains the whole model on each GPU, which a sharded run may not fit on one.
            log.info("Batch split: equal (multi_gpu.batch_split auto measures each GPU with the whole model, "
                     "which FSDP does not hold on one GPU; give an explicit split such as 6,2 for unequal GPUs).")
            return equal_split(self.cfg.training.batch_size, du.world_size())
        return super().decide_split()

    def enable_gradient_checkpointing(self) -> None:
        if not self.sharded:  # FSDP checkpoints each block itself, before sharding it (fsdp.shard)
            super().enable_gradient_checkpointing()

    def load_device(self) -> torch.device:
        # A sharded model is loaded into host memory and sharding moves each rank's part to its GPU: no GPU
        # ever holds the whole (Qwen-Image's 20 B transformer in fp32, 82 GB, fits none).
        return torch.device("cpu") if self.sharded else self.device

    def move_to_device(self) -> None:
        if not self.sharded:
            return super().move_to_device()
        # The trained module stays where it was loaded: sharding moves each rank's part to the GPU, block
        # by block, so no GPU ever holds the whole of it.
        trained = [self.bundle.denoiser, *self.trained_text_encoders()]
        for module in self.bundle.modules().values():
            if not any(module is t for t in trained):
                module.to(self.device)

    def trained_text_encoders(self) -> list[torch.nn.Module]:
        return self.bundle.trainable_text_encoders() if self.cfg.training.train_text_encoder else []

    def compile_split_at_ddp_buckets(self) -> bool:
        """Split the compiled denoiser at DDP's buckets only where there is an all-reduce worth overlapping.

        The split lets each bucket's all-reduce run during the rest of the backward, but its graphs miss
        PyTorch's compile cache for autograd: every start traces the backward again. On 2 H100s a warm
        compile of the SD1.5 UNet (LoRA) took 52-57 s split against 17 s as one graph, and the one graph
        was not slower per step (session 13, docs/Performance.md). Gradients in one or two buckets (a
        LoRA's) leave little to overlap; a full fine-tune's gigabytes keep the split."""
        if self.sharded:
            return True  # FSDP: the setting is DDP's alone
        gradient_bytes = sum(p.numel() * p.element_size() for p in self.trainable_params())
        split = gradient_bytes > 2 * self.cfg.multi_gpu.bucket_cap_mb * 2 ** 20
        log.info("training.compile: %s (%.0f MiB of gradients, multi_gpu.bucket_cap_mb %d).",
                 "one graph per DDP gradient bucket, so their all-reduces overlap the backward" if split else
                 "the denoiser compiles as one graph; its gradients are all-reduced after the backward",
                 gradient_bytes / 2 ** 20, self.cfg.multi_gpu.bucket_cap_mb)
        return split

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.sharded:
            return self.shard(model)
        m = self.cfg.multi_gpu
        # Randomly initialised LoRA weights differ per rank unless rank 0's are copied everywhere.
        du.broadcast_parameters(model)
        ddp = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                  bucket_cap_mb=m.bucket_cap_mb, find_unused_parameters=m.find_unused_parameters,
                  static_graph=m.static_graph, gradient_as_bucket_view=m.gradient_as_bucket_view,
                  **_no_buffer_sync_per_forward())
        register_compression(ddp, m.gradient_compression)
        return ddp

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """FSDP over the family's blocks (and the layers of text encoders that train); the trained
        parameters become sharded ones, so the list the optimizer and EMA take is made anew."""
        t = self.cfg.training
        if t.method == "lora":  # randomly initialised adapters must start alike on every rank
            du.broadcast_parameters(model)
        names = {id(p): name for name, p in model.named_parameters()}
        trained = [names[id(p)] for p in self.trainable]
        family = self.bundle.family
        blocks = family.repeated_blocks(self.bundle)
        for encoder in self.trained_text_encoders():
            blocks += family.text_encoder_blocks(encoder)
        fsdp.shard(model, blocks, self.device, t.precision, t.gradient_checkpointing,
                   self.cfg.multi_gpu.fsdp_cpu_offload)
        params = dict(model.named_parameters())
        self.trainable = [params[name] for name in trained]
        return model

    def sampling_calls(self):
        if not self.sharded:
            return super().sampling_calls()
        parts = ["unet"] + [f"text_encoders.{i}" for i in range(len(self.trained_text_encoders()))]
        return fsdp.calls_through_root(self.model, parts, self.autocast())

    def gradient_sync(self, last_micro_batch: bool):
        if self.sharded:
            return fsdp.gradient_sync(self.model, last_micro_batch)
        return contextlib.nullcontext() if last_micro_batch else self.model.no_sync()

    def teardown(self) -> None:
        # DDP holds the process group, and the trainer's reference cycles kept it alive until interpreter
        # exit, where freeing gloo's group has aborted finished workers ("terminate called without an
        # active exception", pytorch/pytorch#179291). Where the process may still go through that exit (a
        # failed run), free it now, while everything it needs is alive. A run that ended leaves through
        # `exit_now`, which skips it; there the full collection only cost time: 3-4 s from `done` to the
        # exit after a cold torch.compile (its millions of objects; H100 hosts, session 14), 0.57 s against
        # 0.09 s without it on a 2-core machine.
        self.model = None
        if not self.ended:
            gc.collect()
        elif getattr(self, "watchdog", None) is not None:
            self.watchdog.stop()  # a failed run keeps it: it ends the process if the clean-up below hangs
        destroy()
