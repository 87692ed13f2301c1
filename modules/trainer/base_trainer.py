"""The training loop, written once for one process and for N.

`start()` builds everything, `train()` runs epochs of optimizer steps, `end()` saves and reports.
Every step is a small method. How the model is spread over the processes is one object, the run's
`Parallelism` (`parallelism.py`: one process here; DDP or FSDP, chosen by `DistributedTrainer` when it
joins the process group): the loop asks it for placement, wrapping, gradient sync and how outputs are
written, and never which strategy trains. The helpers in `modules.util.dist_utils` are no-ops in a
single process. What rank 0 does besides training is decided once, in `rank_duties`: the loop never
asks which rank it is.
"""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import math
import os
import time
from abc import ABC, abstractmethod

import torch

from modules.config import RunPaths, TrainConfig, save_config
from modules.config.validation import BUILTIN_PREFIX
from modules.util import dist_utils as du
from modules.trainer import backup as backups
from modules.trainer import sharded_backup
from modules.trainer.callbacks import TrainingCallbacks
from modules.trainer.commands import CommandInbox
from modules.trainer.ema import EMA
from modules.trainer.optim import build_optimizer, build_scheduler, effective_lr, is_schedule_free, match_param_layouts
from modules.trainer.outputs import OutputWriter, RunParts
from modules.trainer.parallelism import Parallelism, SingleProcess
from modules.trainer.progress import PhaseTimes, ProgressReporter
from modules.trainer.rank_duties import RankDuties, rank_duties
from modules.trainer.run_numbers import RunNumbers, derive_run_numbers
from modules.trainer.step_exchange import StepExchange, StepReport
from modules.trainer.training_model import TrainingModel
from modules.trainer.validation_loss import ValidationLoss
from modules.util.atomic import unique_path
from modules.util.batch_slice import BatchSlice, SplitDoesNotFit, choose_split, describe_split, equal_split, parse_split
from modules.util.launch_clock import launch_split
from modules.util.rng import rng_state, seed_everything, set_rng_state

log = logging.getLogger("tandem")

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class NonFiniteTrainingError(RuntimeError):
    """The loss or the trained weights stopped being finite numbers: the run cannot continue."""


FP16_SKIPS_TOLERATED = 10
"""fp16 loss scaling skips a step whose values overflowed (weights unchanged); this many in a row is a failure."""


class BaseTrainer(ABC):
    def __init__(self, cfg: TrainConfig, callbacks: TrainingCallbacks | None = None,
                 inbox: CommandInbox | None = None, resume: str | None = None, run_id: str | None = None) -> None:
        """`resume`: None (a new run), `latest` (the newest backup in the workspace), a run id or a backup path;
        `run_id`: the id of a new run when its launcher decided it (restarted workers find its backups by it)."""
        self.cfg = cfg
        self.paths = RunPaths(cfg)
        self.callbacks = callbacks or TrainingCallbacks()
        self.parallel: Parallelism = SingleProcess()
        """How the model is spread over the processes, chosen once by `setup_environment`."""
        self.duties: RankDuties | None = None
        """This rank's duties besides training, decided once the rank is known (`start`)."""
        self.inbox = inbox
        self.resume = resume
        self.given_run_id = run_id
        self.outputs: OutputWriter | None = None
        self.non_finite_in_a_row = 0
        self.first_step_done = False
        self.split: list[int] = []
        """Samples of each global micro-batch per rank (`multi_gpu.batch_split`), decided at start."""
        self.batch_part: BatchSlice | None = None
        """This rank's place in the global micro-batch."""
        self.global_step = 0
        self.epoch = 0
        self.step_in_epoch = 0
        self.stop_requested = False
        self.completed = False
        self.ended = False
        """Whether `end()` ran to its last line: the outputs are written and the process may end at once."""
        self.start_phases = PhaseTimes()
        # training.compile: each new batch shape compiles new kernels, so each is checked once (shape -> difference).
        self.compiled_shapes_checked: dict[tuple[int, ...], float] = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        launched, parts = launch_split(time.time())
        if launched is not None:  # processes starting, libraries importing, the launcher's checks
            self.start_phases.seconds["launch"] = launched
            self.start_phases.parts["launch"] = parts
        phase = self.start_phases.time
        with phase("set-up"):
            self.setup_environment()
            self.duties = rank_duties(du.rank(), self.callbacks)
        with phase("data scan"):
            self.dataset = self.create_dataset()  # scanned before any model loads: bad data fails fast
            self.validation_set = self.dataset.validation_set()  # held-out images, or None
        with phase("model"):
            self.bundle = self.create_model()
            # One seed for what creates weights (LoRA init), set after loading (which may build and seed
            # the demo model): every rank and every world size starts alike.
            seed_everything(self.cfg.general.seed)
            self.trainable = self.prepare_trainable()
            self.objective = self.bundle.family.objective(self.bundle, self.cfg.training)
        with phase("cache"):
            self.fill_cache()
            self.offload_cached_encoders()
        with phase("wrap"):
            self.decide_cudnn_autotuning()
            self.split = self.decide_split()
            self.batch_part = BatchSlice.of(self.split, self.parallel.data_rank)
            self.sampler, self.loader = self.create_loader()
            self.numbers = self.compute_numbers()
            self.model = self.wrap_model(self.training_model())
            self.seed_this_process()
            self.optimizer, self.lr_schedule = self.create_optimizer()
            self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.cfg.training.precision == "fp16")
            self.ema = EMA(self.trainable_params(), self.cfg.training.ema_decay) if self.cfg.training.ema else None
            self.exchange = StepExchange()
            self.validation = (ValidationLoss(self.validation_set, self.cfg.general.seed, self.parallel)
                               if self.validation_set is not None else None)
        with phase("resume"):
            self.maybe_resume()
        self.announce()
        self.announced_at = time.perf_counter()
        self.progress = ProgressReporter(self.numbers, self.emit, self.global_step,
                                         self.paths.tensorboard if self.cfg.general.tensorboard else None,
                                         reports=self.duties.leads)
        # Keep the model's many long-lived Python objects out of later full garbage collections, which
        # would otherwise rescan all of them at random steps (a pause the other ranks wait for).
        gc.collect()
        gc.freeze()

    def train(self) -> None:
        trace = os.environ.get("TANDEM_TRACE_FIRST_STEP")
        if trace:  # diagnosing a slow first step: every rank's stacks to stderr every `trace` seconds
            faulthandler.dump_traceback_later(float(trace), repeat=True)
        if self.cfg.sampling.sample_at_start and self.global_step == 0:
            self.outputs.sample()  # the baseline every later sample is compared with
        if self.validation is not None and self.global_step == 0:
            self.validate()  # where the curve starts: the untrained weights' validation loss
        while self.global_step < self.numbers.total_steps and not self.stop_requested:
            self.run_epoch()
        requested = self.act_on(self.exchange.receive())  # the last step's loss (and any command sent with it)
        self.write_outputs("sample" in requested, "backup" in requested, "save" in requested)
        self.completed = self.global_step >= self.numbers.total_steps
        if self.completed and self.validation is not None and self.validation.last_step != self.global_step:
            self.validate()  # where the finished model stands, whatever the cadence

    def end(self) -> None:
        self.check_weights_finite()
        if self.completed:
            self.outputs.no_more_backups()
        if self.completed and self.outputs.last_sample_step != self.global_step and self.sampling_scheduled():
            self.outputs.sample()  # what the finished model does, whatever the cadence
        if self.completed:
            try:
                self.outputs.save_final()  # raises on every rank when rank 0's write failed
            except Exception:
                # A failed final save must not lose the trained weights: keep them as a backup to resume from.
                log.error("Saving the model failed; writing a backup of the trained state first.")
                self.outputs.backup()
                self.outputs.finish_backups()
                raise
        elif self.cfg.save.backup_on_stop and self.global_step > 0:
            self.outputs.backup()
        self.outputs.finish_backups()
        self.progress.close()
        trained = self.progress.summary()
        log.info("Trained %d images in %.1f s: %.1f images/s over the whole run (start-up before it: %.1f s).",
                 trained["images"], trained["train_s"], trained["images_per_s"], sum(self.start_phases.seconds.values()))
        self.emit("done", output=str(self.outputs.final_path) if self.completed else None,
                  step=self.global_step, completed=self.completed, **trained)
        du.barrier()
        self.ended = True

    def run(self) -> None:
        """start, train, end - with the environment torn down whatever happens."""
        try:
            self.start()
            self.train()
            self.end()
        finally:
            gc.unfreeze()  # start() froze the run's objects; after the run they may be collected again
            self.stop_loader_workers()
            if self.outputs is not None:
                self.outputs.close()  # a backup being written when training failed is completed, not cut off
            self.teardown()

    def stop_loader_workers(self) -> None:
        """End the DataLoader's worker processes now.

        They hold nothing to keep, but shut down politely they finish their prefetching and are joined one
        by one, which kept finished runs alive for seconds (8 s with 4 workers on an H100 host)."""
        iterator = getattr(getattr(self, "loader", None), "_iterator", None)  # persistent workers live here
        if iterator is None:
            return
        for worker in getattr(iterator, "_workers", []):
            if worker.is_alive():
                worker.terminate()
        iterator._shutdown_workers()  # joins the (now ended) workers, closes the queues and the pinning thread
        self.loader._iterator = None

    # ------------------------------------------------------------------ set-up steps
    @abstractmethod
    def setup_environment(self) -> None:
        """Choose `self.device` and the run's parallelism (`self.parallel`), set up processes/seeds/backends."""

    def teardown(self) -> None:
        """Release what `setup_environment` acquired."""

    def seed_this_process(self) -> None:
        # Only what is not keyed elsewhere uses this stream (LoRA dropout, VAE sampling without a cache):
        # noise/timesteps are keyed per global batch (objective.draw_noise), augmentation and cached
        # latents' samples per item (data.dataset), so none of them depends on the number of ranks.
        seed_everything(self.cfg.general.seed * du.world_size() + du.rank())

    def configure_backends(self) -> None:
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.cfg.training.tf32
            torch.backends.cudnn.allow_tf32 = self.cfg.training.tf32
            # `auto` decides once it is known what trains (decide_cudnn_autotuning): caching runs untuned.
            torch.backends.cudnn.benchmark = self.cfg.training.cudnn_benchmark == "on"
            # cuDNN's attention backward fails at Flux-size shapes on H100 with torch 2.11
            # ("mha_graph.execute ... is_good()"); flash and memory-efficient attention serve every shape we train.
            torch.backends.cuda.enable_cudnn_sdp(False)
            from modules.trainer.split_probe import cap_device_memory
            cap_device_memory(self.device)
            from modules.trainer.memory_limit import hold_to_memory_limit
            hold_to_memory_limit(self.cfg, self.device)
            from modules.util.host_copy import use_fast_pinning
            use_fast_pinning()  # a full fine-tune's first backup: 2.4-3.7 s instead of 7.7-8.5 s on H100 hosts

    def decide_cudnn_autotuning(self) -> None:
        if self.device.type != "cuda" or self.cfg.training.cudnn_benchmark != "auto":
            return
        tuning = trains_convolutions(self.bundle.modules().values())
        torch.backends.cudnn.benchmark = tuning
        log.info("cuDNN autotuning (training.cudnn_benchmark=auto): %s.",
                 "on for the training steps: convolution weights train" if tuning else
                 "off: no convolution weight trains, so it would only lengthen the start")

    def create_dataset(self):
        from modules.data import build_dataset
        dataset = build_dataset(self.cfg.data, self.paths.cache, self.cfg.general.seed)
        log.info("Data: %s", dataset.describe_roles())  # rank 0's INFO only (rank_duties.py)
        return dataset

    def create_model(self):
        from modules.model.loading import load_model
        # A built-in model is built into shared files on first use: rank 0 builds them, the others then read
        # them. A model on disk is only read, so every rank loads it at once (in turn, N ranks took N loads'
        # time: ~10 s more per start on 4 GPUs with an SD1.5 folder).
        builds_files = self.cfg.model.base_model.strip().startswith(BUILTIN_PREFIX)
        with du.main_first() if builds_files else contextlib.nullcontext():
            bundle = load_model(self.cfg.model, self.device, self.cfg.training)
        # Validation checks the image sizes of a family the config names; one found by `auto` is checked here.
        bundle.family.check_image_sizes(self.dataset.bucket_sizes)
        return bundle

    def prepare_trainable(self) -> list[torch.nn.Parameter]:
        """Choose what trains (LoRA adapters or the whole UNet/transformer) and move the model to the device."""
        t = self.cfg.training
        bundle = self.bundle
        for m in bundle.modules().values():
            m.requires_grad_(False)
        trained_encoders = bundle.trainable_text_encoders() if t.train_text_encoder else []
        if t.method == "lora":
            from modules.model.lora import add_lora
            params = add_lora(bundle, t)
        else:
            bundle.denoiser.requires_grad_(True)
            # Full fine-tune keeps fp32 master weights; autocast does the rest. (load_model already gave
            # fp32; a no-op cast would only make diffusers warn about transformers' fp32 modules.)
            if next(bundle.denoiser.parameters()).dtype != torch.float32:
                bundle.denoiser.to(torch.float32)
            params = [p for p in bundle.denoiser.parameters()]
            for te in trained_encoders:
                te.requires_grad_(True)
                te.to(torch.float32)
                params += list(te.parameters())
        for dead_end in bundle.unused_text_encoder_modules():
            dead_end.requires_grad_(False)  # no gradient ever reaches them (see the bundle's docstring)
        if t.gradient_checkpointing:
            self.parallel.checkpoint_activations(bundle)
        self.parallel.place(bundle, [bundle.denoiser, *trained_encoders], self.device)
        if t.channels_last:
            # NHWC convolution weights (4-D tensors only); a convolution then runs in NHWC and so do its
            # outputs, whatever the layout of the latents fed in. Parameters keep their identity (their
            # `.data` is replaced), so `params` stays valid; DDP, the optimizer and EMA, built later,
            # see the new layout. Every writer of weights (backups, full saves, LoRA files) stores
            # contiguous copies, which safetensors requires.
            bundle.denoiser.to(memory_format=torch.channels_last)
        bundle.denoiser.train()
        for te in bundle.text_encoders:
            te.train(any(te is trained for trained in trained_encoders))
        return params

    def trainable_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.trainable if p.requires_grad]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Name -> tensor of every trained weight (what a backup stores)."""
        wanted = {id(p) for p in self.trainable_params()}
        modules = {self.bundle.denoiser_name: self.bundle.denoiser,
                   **{f"text_encoder_{i}": te for i, te in enumerate(self.bundle.text_encoders)}}
        return {f"{prefix}.{name}": p for prefix, m in modules.items()
                for name, p in m.named_parameters() if id(p) in wanted}

    def cache_text(self) -> bool:
        from modules.data import text_cache_allowed
        return text_cache_allowed(self.cfg.data, self.cfg.training.train_text_encoder)

    def fill_cache(self) -> None:
        """Encode latents (and text) once. Each rank encodes its share, then all read the whole cache."""
        if not (self.cfg.data.cache_latents or self.cache_text()):
            return
        share_work = self.cfg.multi_gpu.distributed_data_loading
        waiting = time.perf_counter()
        # Ranks finish loading the model at different times: the caching is timed once all have (this
        # collective is also the barrier), and which rank was slowest is said.
        model_seconds = du.all_gather_objects(self.start_phases.seconds.get("model", 0.0))
        started = time.perf_counter()
        if du.world_size() > 1:
            slowest = max(range(len(model_seconds)), key=model_seconds.__getitem__)
            log.info("Model loaded in %.1f-%.1f s on the %d ranks (slowest: rank %d).", min(model_seconds),
                     model_seconds[slowest], len(model_seconds), slowest)
        datasets = [d for d in (self.dataset, self.validation_set) if d is not None]
        encoders = (self.bundle.encode_latent_distribution, self.bundle.encode_text, self.bundle.fingerprint())
        with torch.no_grad(), (contextlib.nullcontext() if share_work else du.main_first()):
            for dataset in datasets:
                dataset.cache(*encoders, rank=du.rank() if share_work else 0,
                              world_size=du.world_size() if share_work else 1, cache_text=self.cache_text())
        du.barrier()
        if du.local_world_size() < du.world_size():
            # Several machines: a cache folder on each machine's own disk lacks what the other machines'
            # ranks encoded. This machine's ranks encode what is missing here (nothing, with a shared folder).
            with torch.no_grad():
                for dataset in datasets:
                    dataset.cache(*encoders, rank=du.local_rank(), world_size=du.local_world_size(),
                                  cache_text=self.cache_text(), progress=False)
            du.barrier()
        seconds = time.perf_counter() - started
        if du.world_size() > 1:  # where a 4-GPU start's `cache` phase went (6 s of 8.5 on H100s, session 12)
            self.start_phases.parts["cache"] = {"waiting for the slowest rank's model": started - waiting,
                                                "encoding": seconds}
        log.info("Cache ready in %.1f s (%d processes, %s)", seconds, du.world_size(),
                 "each encoded its share" if share_work else "rank 0 encoded, the others reused it")
        self.emit("cache", seconds=round(seconds, 2), world_size=du.world_size(), shared=share_work)

    def offload_cached_encoders(self) -> None:
        """With latents (text) cached, the VAE (frozen text encoders) only serve samples: keep them off the GPU."""
        if self.device.type != "cuda":
            return
        if self.cfg.data.cache_latents:
            self.bundle.vae.to("cpu")
        if self.cache_text():
            for te in self.bundle.text_encoders:
                te.to("cpu")

    @contextlib.contextmanager
    def encoders_on_device(self):
        """Every part of the model on the training device for the duration of the block (sampling)."""
        parts = [self.bundle.vae, *self.bundle.text_encoders]
        homes = [next(m.parameters()).device for m in parts]
        for m in parts:
            m.to(self.device)
        try:
            yield
        finally:
            for m, home in zip(parts, homes):
                m.to(home)

    def sampling_calls(self):
        """Inside the block the sampling pipeline calls the trained parts (sharded training routes the
        calls through the wrapper)."""
        return self.parallel.sampling_calls(self.model, self.autocast())

    def create_loader(self):
        from modules.data import BucketBatchSampler, make_dataloader
        sampler = BucketBatchSampler(self.dataset.buckets, self.cfg.training.batch_size,
                                     world_size=self.parallel.data_world, rank=self.parallel.data_rank,
                                     seed=self.cfg.general.seed,
                                     split=self.split, groups=self.dataset.item_groups())
        loader = make_dataloader(self.dataset, sampler, self.cfg.data, self.device.type == "cuda")
        return sampler, loader

    def decide_split(self) -> list[int]:
        """How many samples of each global micro-batch each rank trains (`multi_gpu.batch_split`)."""
        world, batch = self.parallel.data_world, self.cfg.training.batch_size
        if not self.parallel.holds_whole_model and self.cfg.multi_gpu.batch_split.strip().lower() == "auto":
            if self.parallel.planned_split:  # the memory plan split it by the cards' room
                log.info("Batch split (auto, from the memory plan): %s.", describe_split(self.parallel.planned_split,
                                                                                        self.device_names()))
                return list(self.parallel.planned_split)
            # The probe trains the whole model on each GPU, which a sharded run may not fit on one.
            log.info("Batch split: equal (multi_gpu.batch_split auto measures each GPU with the whole model, "
                     "which FSDP does not hold on one GPU; give an explicit split such as 6,2 for unequal GPUs).")
            return equal_split(batch, world)
        # batch_split is per machine, like device_indexes: a list names this machine's GPUs only.
        choice = parse_split(self.cfg.multi_gpu.batch_split, du.local_world_size(), batch)
        if world == 1:
            return equal_split(batch, world)
        if du.local_world_size() != world:
            choice = self._split_of_all_machines(choice)
        if choice is None:
            return equal_split(batch, world)
        if choice != "auto":
            log.info("Batch split: %s.", describe_split(choice, self.device_names()))
            return choice
        from modules.trainer.split_probe import measure_capacity
        mine = measure_capacity(self, TrainingModel(self.bundle, self.cfg.training.train_text_encoder, self.objective))
        everyone = du.all_gather_objects(mine)
        try:
            split = choose_split(batch * world, everyone)
        except SplitDoesNotFit as e:
            raise RuntimeError(f"multi_gpu.batch_split auto: {e}. Lower training.batch_size (and raise "
                               "training.gradient_accumulation_steps to keep the global batch), or turn on "
                               "training.gradient_checkpointing.") from None
        names = self.device_names()
        details = "; ".join(f"{name}: {1000 * c.seconds_per_sample:.1f} ms/sample, room for "
                            f"{c.most_samples() if c.most_samples() is not None else 'any number of'} samples"
                            for name, c in zip(names, everyone))
        log.info("Batch split (auto, measured): %s (%s).", describe_split(split, names), details)
        slowest, fastest = max(c.seconds_per_sample for c in everyone), min(c.seconds_per_sample for c in everyone)
        if slowest > 1.5 * fastest:
            log.warning("One GPU is %.1fx slower than the fastest: the split gives it fewer samples, but every step "
                        "still waits for it.", slowest / fastest)
        return split

    def _split_of_all_machines(self, mine: list[int] | str | None) -> list[int] | str | None:
        """Several machines: every rank's size from its own machine's `batch_split` (global ranks follow
        machines, node 0's processes first); `auto` only when every machine chose it."""
        batch = self.cfg.training.batch_size
        sizes = du.all_gather_objects("auto" if mine == "auto" else mine[du.local_rank()] if mine else batch)
        if "auto" in sizes:
            if any(size != "auto" for size in sizes):
                raise RuntimeError("multi_gpu.batch_split is auto on some machines and not on others: the "
                                   "measurement is made by every GPU together. Set auto on every machine, or "
                                   "equal / a list of this machine's sizes on each.")
            return "auto"
        return None if all(size == batch for size in sizes) else sizes

    def device_names(self) -> list[str]:
        """Each rank's device, for messages (`GPU 1`, `CPU process 0`)."""
        index = du.gpu_number(self.device) if self.device.type == "cuda" else du.rank()
        kinds = du.all_gather_objects((self.device.type, index))
        return [f"GPU {i}" if kind == "cuda" else f"CPU process {i}" for kind, i in kinds]

    def training_model(self) -> TrainingModel:
        model = TrainingModel(self.bundle, self.cfg.training.train_text_encoder, self.objective)
        t = self.cfg.training
        if t.compile:
            from modules.trainer.compiled_unet import compile_unet
            dropout = t.method == "lora" and t.lora_dropout > 0
            model.use_compiled_unet(compile_unet(self.bundle.denoiser, self.device, len(set(self.dataset.buckets)),
                                                 dropout, self.parallel.compile_splits_at_buckets(self.trainable_params())))
        return model

    def compute_numbers(self) -> RunNumbers:
        return derive_run_numbers(self.cfg, self.parallel.data_world, len(self.sampler), self.split,
                                  items_per_epoch=len(self.dataset))

    def wrap_model(self, model: TrainingModel) -> torch.nn.Module:
        """The trained module as the parallelism runs it; the trained parameters as it holds them."""
        wrapped, self.trainable = self.parallel.wrap(model, self.trainable)
        return wrapped

    def create_optimizer(self):
        t = self.cfg.training
        factor = self.numbers.lr_factor()
        unet_ids = {id(p) for p in self.bundle.denoiser.parameters()}
        unet_params = [p for p in self.trainable_params() if id(p) in unet_ids]
        te_params = [p for p in self.trainable_params() if id(p) not in unet_ids]
        groups = [{"params": unet_params, "lr": t.learning_rate * factor}]
        if te_params:
            groups.append({"params": te_params, "lr": (t.text_encoder_learning_rate or t.learning_rate) * factor})
        optimizer = build_optimizer(groups, self.cfg.optimizer, self.device)
        return optimizer, build_scheduler(optimizer, t, self.numbers.total_steps)

    def announce(self) -> None:
        log.info("Tandem: %s", self.numbers.describe())
        log.info("Start-up: %s", self.start_phases.describe())
        parts = self.start_phases.describe_parts()
        if parts:
            log.info("Start-up parts: %s", parts)
        self.emit("config", **self.numbers.as_dict())
        du.on_main(self.save_run_config)

    def save_run_config(self) -> None:
        name = self.run_id if self.resume is None else f"{self.run_id}-resumed-at-step-{self.global_step}"
        path = unique_path(self.paths.configs / f"{name}.json", time.strftime("%Y%m%d-%H%M%S"))
        save_config(self.cfg, path)
        log.info("The resolved config of this run: %s", path)

    # ------------------------------------------------------------------ the loop
    def run_epoch(self) -> None:
        self.sampler.set_epoch(self.epoch)  # keeps a resumed position within the same epoch
        accumulation = self.numbers.accumulation
        iterating = time.perf_counter()
        batches = iter(self.loader)  # the first call starts the loader's (persistent) worker processes
        workers_s = time.perf_counter() - iterating
        while self.sampler.batches_remaining() >= accumulation:
            first = not self.first_step_done
            started = time.perf_counter()
            micro_batches = [next(batches) for _ in range(accumulation)]
            loaded = time.perf_counter()
            loss = self.optimizer_step(micro_batches)
            if first:
                self.report_first_step(started, loaded, workers_s)
            # Told after training, not when handed out: prefetching workers run ahead of the trained position.
            self.sampler.mark_consumed(accumulation)
            self.global_step += 1
            self.step_in_epoch += 1
            self.after_step(loss)
            if self.stop_requested or self.global_step >= self.numbers.total_steps:
                return
        self.epoch += 1
        self.step_in_epoch = 0
        self.after_epoch()

    def report_first_step(self, started: float, loaded: float, workers_s: float) -> None:
        """Log where the first step's time goes (it is start-up time the user waits through: loader
        workers starting, kernel selection, first allocations) and what ran between the start-up summary
        and it (10 s under the spawn launcher on H100s, session 11: its ranks spawned their loader workers).
        The one synchronisation the loop makes."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        done = time.perf_counter()
        faulthandler.cancel_dump_traceback_later()
        self.first_step_done = True
        log.info("First step: %.1f s (first batch from the loader %.1f s, the step itself %.1f s); %.1f s before it "
                 "since the start-up summary (starting the loader's workers %.1f s).",
                 done - started, loaded - started, done - loaded, started - self.announced_at, workers_s)

    def optimizer_step(self, micro_batches: list[dict]) -> torch.Tensor:
        if self.cfg.training.compile:
            self.check_compiled_unet(micro_batches[0])
        total = torch.zeros((), device=self.device)
        # With unequal GPUs each rank's mean loss is weighted by its share, so that DDP's average over the
        # ranks is the mean over the global batch (1.0 with equal GPUs).
        weight = self.batch_part.loss_weight(self.parallel.data_world) / len(micro_batches)
        for i, batch in enumerate(micro_batches):
            with self.gradient_sync(i == len(micro_batches) - 1):
                loss = self.compute_loss(batch, micro=i)
                self.scaler.scale(loss * weight).backward()
            total += loss.detach()
        self.apply_gradients()
        return total / len(micro_batches)

    def check_compiled_unet(self, batch: dict) -> None:
        """On the first batch of each shape: compile, and compare the gradients with the uncompiled UNet's
        (compiled_unet.py) before the step trains on them."""
        from modules.trainer.compiled_unet import compare_with_eager, compile_readings, describe_compile
        shape = tuple((batch["latents"] if "latents" in batch else batch["pixels"]).shape)
        if shape in self.compiled_shapes_checked:
            return
        inner = self.parallel.unwrap(self.model)  # the TrainingModel itself: its forward synchronises nothing

        def backward_pass(context, model):
            def run():
                with context:
                    loss = self.compute_loss(batch, micro=0, model=model)
                    self.scaler.scale(loss).backward()
                return loss.detach()
            return run

        # The compiled pass goes through the DDP wrapper (where the compiler may split the backward at DDP's
        # buckets), without synchronising, so no rank's gradients leave it yet.
        started, readings = time.perf_counter(), compile_readings()
        self.compiled_shapes_checked[shape] = compare_with_eager(
            backward_pass(inner.eager_unet(), inner), backward_pass(self.gradient_sync(last_micro_batch=False), None),
            self.trainable_params(), self.device, what=f"batch shape {list(shape)}")
        log.info("Denoiser compiled and checked for batch shape %s in %.1f s: %s.", list(shape),
                 time.perf_counter() - started, describe_compile(readings, compile_readings()))

    def gradient_sync(self, last_micro_batch: bool):
        """Context for one micro-batch's backward: gradients are exchanged after the last (`Parallelism`)."""
        return self.parallel.gradient_sync(self.model, last_micro_batch)

    def compute_loss(self, batch: dict, micro: int, model: torch.nn.Module | None = None) -> torch.Tensor:
        bundle, dev = self.bundle, self.device
        if "latents" in batch:
            latents = batch["latents"].to(dev, non_blocking=True).float()
        else:
            with torch.no_grad():
                latents = bundle.encode_images(batch["pixels"].to(dev, non_blocking=True)).float()
        text = batch.get("text")
        if text is not None:
            text = {k: v.to(dev, non_blocking=True) for k, v in text.items()}
        objective = self.objective  # the family's: noise and timesteps keyed by (seed, step, micro)
        draw = objective.draw(tuple(latents.shape), self.cfg.general.seed, self.global_step, micro, self.batch_part,
                              dev, self.cfg.training.offset_noise)
        noisy = objective.noisy(latents, draw)
        target = objective.target(latents, draw)
        with self.autocast():
            pred = (self.model if model is None else model)(noisy, draw.timesteps, text, batch.get("captions"),
                              batch.get("original_sizes"), batch.get("crop_coords"), batch.get("target_sizes"))
        masks, weights = batch.get("masks"), batch.get("loss_weights")
        return objective.loss(pred, target, draw, mask=None if masks is None else masks.to(dev, non_blocking=True),
                              weights=None if weights is None else weights.to(dev, non_blocking=True))

    def autocast(self):
        dtype = AUTOCAST_DTYPES.get(self.cfg.training.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def apply_gradients(self) -> None:
        params = self.trainable_params()
        if self.cfg.training.max_grad_norm > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(params, self.cfg.training.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_schedule.step()
        if self.ema is not None:
            self.ema.update()

    def after_step(self, loss: torch.Tensor) -> None:
        requested = self.act_on(self.exchange.receive())  # the previous step's report: its GPU work is done
        self.exchange.send(self.global_step, self.epoch, loss, effective_lr(self.optimizer), self.take_commands(),
                           weight=self.batch_part.loss_weight(self.parallel.data_world))
        self.outputs.poll_backups()
        s = self.cfg.save
        due = lambda every: every > 0 and self.global_step % every == 0  # noqa: E731
        self.write_outputs(sample="sample" in requested or due(self.cfg.sampling.every_n_steps),
                           backup="backup" in requested or due(s.backup_every_n_steps),
                           save="save" in requested or due(s.save_every_n_steps))
        if self.validation is not None and due(self.cfg.training.validation_every_n_steps):
            self.validate()

    def take_commands(self) -> set[str]:
        """Commands this rank saw since the last step: from the commands file if its inbox reads one (rank 0;
        with several machines the first process of each), from a signal on any rank. Rank 0's clock decides
        time-based backups, so that every rank backs up at the same step."""
        commands = set()
        if self.inbox is not None:
            self.inbox.poll()
            commands = self.inbox.take()
        minutes = self.cfg.save.backup_every_n_minutes
        if minutes > 0 and self.duties.leads and time.monotonic() - self.outputs.last_backup_started >= 60 * minutes:
            commands.add("backup")
        return commands

    def act_on(self, report: StepReport | None) -> set[str]:
        """Log a finished step's mean loss, stop if asked; return the other commands merged with it.

        Every rank gets the same report at the same step, so all of them stop, sample or save together.
        """
        if report is None:
            return set()
        self.check_loss_finite(report)
        self.progress.step(report)
        if "stop" in report.commands:
            log.info("Stop requested: stopping at step %d", self.global_step)
            self.stop_requested = True
        return report.commands - {"stop"}

    def write_outputs(self, sample: bool, backup: bool, save: bool) -> None:
        if not (sample or backup or save):
            return
        # Outputs only of a state known to be sound: this step's loss (waiting for it here, which the loop
        # otherwise avoids) and the weights the step produced must be finite.
        requested = self.act_on(self.exchange.receive())
        sample, backup, save = sample or "sample" in requested, backup or "backup" in requested, save or "save" in requested
        self.check_weights_finite()
        if sample:
            self.outputs.sample()
        if backup:
            self.outputs.backup()
        if save:
            self.outputs.save_intermediate()

    def validate(self) -> None:
        """The held-out images' loss (every rank scores its share: call it on every rank at the same step)."""
        started = time.perf_counter()
        loss = self.validation.evaluate(self)
        log.info("Validation loss at step %d: %.6f (%d images, %.1f s)", self.global_step, loss, len(self.validation),
                 time.perf_counter() - started)
        self.progress.validation(self.global_step, loss)
        self.emit("validation", step=self.global_step, loss=loss, images=len(self.validation))

    def check_loss_finite(self, report: StepReport) -> None:
        """Stop at the first non-finite loss; with fp16 loss scaling, skipped steps are normal unless they persist."""
        if math.isfinite(report.loss):
            self.non_finite_in_a_row = 0
            return
        self.non_finite_in_a_row += 1
        if self.cfg.training.precision == "fp16" and self.non_finite_in_a_row < FP16_SKIPS_TOLERATED:
            log.warning("Step %d: the loss overflowed in fp16; loss scaling skips this step.", report.step)
            return
        self.fail_non_finite(f"the loss of step {report.step} is {report.loss}")

    def check_weights_finite(self) -> None:
        """Before anything is written from the weights: every trained weight must be a finite number."""
        params = self.trainable_params()
        if params and not du.all_finite(params):
            self.fail_non_finite(f"the trained weights hold NaN or infinite values after step {self.global_step}")

    def fail_non_finite(self, what: str) -> None:
        last = self.outputs.last_backup if self.outputs is not None else None
        kept = f"the newest good backup is {last}" if last else "no backup of this run was written before it"
        raise NonFiniteTrainingError(
            f"Training stopped: {what}. Nothing was saved as the final model ({kept}). Lower "
            f"training.learning_rate (now {self.cfg.training.learning_rate:g}), keep training.max_grad_norm on, "
            "or train in bf16 instead of fp16.")

    def sampling_scheduled(self) -> bool:
        s = self.cfg.sampling
        return bool(s.prompts) and (s.every_n_epochs > 0 or s.every_n_steps > 0)

    def after_epoch(self) -> None:
        if self.global_step >= self.numbers.total_steps:
            return  # the end-of-training save covers the last epoch
        every = lambda n: n > 0 and self.epoch % n == 0  # noqa: E731
        if self.validation is not None and self.cfg.training.validation_every_n_steps == 0:
            self.validate()
        self.write_outputs(every(self.cfg.sampling.every_n_epochs), every(self.cfg.save.backup_every_n_epochs),
                           every(self.cfg.save.save_every_n_epochs))

    # ------------------------------------------------------------------ state
    def training_state(self) -> dict:
        # A schedule-free optimizer is always in train mode here (OutputWriter's evaluation_weights restores
        # it): the backup holds the training weights y with the optimizer's state, which resumes exactly.
        return {**self.progress_state(), "optimizer": self.optimizer.state_dict(),
                "ema": self.ema.state_dict() if self.ema else None}

    def progress_state(self) -> dict:
        """Where the run stands, in plain values: step, sampler, schedule, loss scaler, every rank's RNG
        (a collective: every rank calls it), and which optimizer the state belongs to."""
        return {
            "global_step": self.global_step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
            "optimizer_name": self.cfg.optimizer.name,
            "lr_schedule": self.lr_schedule.state_dict(), "scaler": self.scaler.state_dict(),
            "sampler": self.sampler.state_dict(), "accumulation": self.numbers.accumulation,
            "rng": du.gather_objects(rng_state()),
            "world_size": du.world_size(),
        }

    def maybe_resume(self) -> None:
        """Continue the backup `resume` names (same run id), or start a new run with a new id."""
        du.on_main(lambda: backups.remove_interrupted(self.paths.backups))
        chosen = du.on_main(lambda: backups.find_backup(self.paths.backups, self.resume) if self.resume else None)
        chosen = du.broadcast_object(chosen)
        if chosen is not None and chosen.run_id != backups.LEGACY_RUN:
            self.run_id = chosen.run_id
        else:
            self.run_id = du.broadcast_object(du.on_main(lambda: self.given_run_id or backups.new_run_id(self.paths.backups)))
        self.outputs = OutputWriter(self, RunParts(
            cfg=self.cfg, paths=self.paths, bundle=self.bundle, device=self.device, ema=self.ema,
            numbers=self.numbers, dataset=self.dataset, emit=self.emit, log_image=self.log_image,
            optimizer=self.optimizer, parallelism=self.parallel), self.run_id)
        if chosen is None:
            others = du.on_main(lambda: backups.describe_other_runs(self.paths.backups, self.run_id))
            if others:
                log.info(others)
            return
        fresh_base_lrs = [g["initial_lr"] for g in self.optimizer.param_groups]
        if sharded_backup.is_sharded(chosen.path):
            state, _ = sharded_backup.load_sharded_backup(chosen.path, self.model, self.optimizer, self.ema,
                                                          self.cfg.optimizer.name)
        else:
            weights, state, _ = backups.read_backup(chosen.path)
            self.load_trained_tensors(weights, state)
        self.restore_progress(state, fresh_base_lrs)
        log.info("Continuing %s from %s (now at step %d, epoch %d)", chosen.describe(), chosen.path,
                 self.global_step, self.epoch + 1)

    def load_trained_tensors(self, weights: dict, state: dict) -> None:
        """A backup's trained weights, optimizer state and EMA (whole tensors) into this run's."""
        own = self.trainable_state()
        missing = sorted(set(own) - set(weights))
        if missing:
            raise ValueError(f"the backup does not match this model/training method (missing {missing[:3]}...); "
                             "start fresh or use the config the backup was made with.")
        backups.check_optimizer(state, self.cfg.optimizer.name)
        self.parallel.load_whole_backup(self.model, self.optimizer, self.ema, own, weights, state)

    def restore_progress(self, state: dict, fresh_base_lrs: list[float]) -> None:
        """Step, sampler position, schedule, loss scaler and RNG from a backup's `progress_state`."""
        self.global_step, self.epoch = state["global_step"], state["epoch"]
        self.step_in_epoch = state["step_in_epoch"]
        self.sampler.load_state_dict(state["sampler"])  # regroups the epoch's rest if the global batch changed
        match_param_layouts(self.optimizer)  # a backup from a run with another training.channels_last
        if is_schedule_free(self.optimizer):
            self.optimizer.train()  # a no-op for Tandem's backups (taken in train mode); converts any other
        self.lr_schedule.load_state_dict(state["lr_schedule"])
        self.adapt_to_new_global_batch(state, fresh_base_lrs)
        self.scaler.load_state_dict(state["scaler"])
        rngs = state["rng"]
        if du.rank() < len(rngs):
            set_rng_state(rngs[du.rank()])

    def adapt_to_new_global_batch(self, state: dict, fresh_base_lrs: list[float]) -> None:
        """Resuming with another GPU count: count progress in images, and use this run's (scaled) LR.

        Steps are counted in global batches, so the step reached is rescaled to the same number of
        images, which keeps the end of training and the position on the LR curve where they were.
        """
        old_global = self.backup_global_batch(state)
        if old_global != self.numbers.global_batch:
            step = state["global_step"] * old_global // self.numbers.global_batch
            log.warning("Global batch changed from %d to %d: step %d continues as step %d (same images seen).",
                        old_global, self.numbers.global_batch, state["global_step"], step)
            self.global_step = step
            self.lr_schedule.last_epoch = step
        self.lr_schedule.base_lrs = list(fresh_base_lrs)
        for group, base, lr in zip(self.optimizer.param_groups, fresh_base_lrs,
                                   [b * self.lr_schedule.lr_lambdas[0](self.lr_schedule.last_epoch) for b in fresh_base_lrs]):
            group["initial_lr"], group["lr"] = base, lr

    @staticmethod
    def backup_global_batch(state: dict) -> int:
        return state["sampler"]["global_batch_size"] * state.get("accumulation", 1)

    def log_image(self, tag: str, image, step: int) -> None:
        self.progress.log_image(tag, image, step)

    def emit(self, type_: str, **fields) -> None:
        self.duties.callbacks.on_event(type_, **fields)


def trains_convolutions(modules) -> bool:
    """Whether any convolution's own weight trains: cuDNN's autotuning pays back its trials there
    (the weight-gradient kernels), not where frozen convolutions only pass gradients through."""
    return any(isinstance(m, torch.nn.modules.conv._ConvNd) and any(p.requires_grad for p in m.parameters(recurse=False))
               for root in modules for m in root.modules())
