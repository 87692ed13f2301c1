"""The training loop, written once for one process and for N.

`start()` builds everything, `train()` runs epochs of optimizer steps, `end()` saves and reports.
Every step is a small method. How the model is spread over the processes is one object, the run's
`Parallelism` (`parallelism.py`: one process here; DDP or FSDP, chosen by `DistributedTrainer` when it
joins the process group): the loop asks it for placement, wrapping, gradient sync and how outputs are
written, and never which strategy trains. The helpers in `modules.util.dist_utils` are no-ops in a
single process. What rank 0 does besides training is decided once, in `rank_duties`: the loop never
asks which rank it is.

The trainer is made of parts, each given only what it uses: outputs (`outputs.py`: the run's live state
as a `TrainingRun`, its fixed `RunParts`), the start-up's timing (`startup.py`), the caches (`caching.py`),
the batch split and its probe (`split_probe.py`), the compiled denoiser's check (`compiled_unet.py`),
resuming (`resume.py`), the validation loss (`validation_loss.py`), the finite-numbers guard
(`finite.py`), what trains and the CUDA settings (`trainable.py`), progress, commands and the per-step
exchange. What stays here (~650 lines) is the run's order of things and the step itself, as methods of
one class because subclasses replace single steps: the benchmark its data, model and the step's timing,
`DistributedTrainer` the environment.
"""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import os
import time
from abc import ABC, abstractmethod

import torch

from modules.config import RunPaths, TrainConfig, save_config
from modules.launch.spec import LaunchSpec
from modules.trainer import backup as backups
from modules.trainer import resume as resuming
from modules.trainer.caching import fill_caches, offload_cached_encoders
from modules.trainer.callbacks import TrainingCallbacks
from modules.trainer.commands import CommandInbox, StopRequested
from modules.trainer.compile_choice import CompileChoice, RunForCompile, choose
from modules.trainer.compiled_unet import CompileCheck, keep_gradient_buffers
from modules.trainer.controls import control_latents, text_sees_controls
from modules.trainer.ema import EMA
from modules.trainer.finite import FiniteGuard
from modules.trainer.hand_ins import HandIns
from modules.trainer.optim import build_optimizer, build_scheduler, effective_lr
from modules.trainer.outputs import OutputWriter, RunParts
from modules.trainer.parallelism import Parallelism, SingleProcess
from modules.trainer.progress import ProgressReporter
from modules.trainer.rank_duties import RankDuties, rank_duties
from modules.trainer.run_numbers import RunNumbers, derive_run_numbers
from modules.trainer.split_probe import decide_split, measure_capacity
from modules.trainer.startup import StartupTimes
from modules.trainer.step_exchange import StepExchange, StepReport
from modules.trainer.step_profile import RunProfiler
from modules.trainer.trainable import configure_cuda, decide_cudnn_autotuning, prepare_trainable, trained_weights
from modules.trainer.training_model import TrainingModel
from modules.trainer.validation_loss import Scoring, ValidationLoss
from modules.util import dist_utils as du
from modules.util.atomic import unique_path
from modules.util.batch_slice import BatchSlice
from modules.util.heartbeat import Heartbeat
from modules.util.rng import rng_state, seed_everything

log = logging.getLogger("tandem")

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class BaseTrainer(ABC):
    step_profile: RunProfiler | None = None
    """Set in `setup` where TANDEM_PROFILE_STEPS asks for a profile of some steps."""

    def __init__(self, cfg: TrainConfig, callbacks: TrainingCallbacks | None = None,
                 inbox: CommandInbox | None = None, resume: str | None = None, run_id: str | None = None,
                 launch: LaunchSpec | None = None, scan=None, hand_ins: HandIns | None = None) -> None:
        """`resume`: None (a new run), `latest` (the newest backup in the workspace), a run id or a backup path;
        `run_id`: the id of a new run when its launcher decided it (restarted workers find its backups by it);
        `launch`: the launch as its launcher resolved it (its global batch and scaled LR are the run's);
        `scan`: the launcher's scan of the data (`modules.data.ScanResult`; None: scan here);
        `hand_ins`: what a caller varies without subclassing (`hand_ins.py`: data and model source, step
        observer, final outputs); None: a user's run."""
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
        self.launch = launch
        self.scan = scan
        self.hand_ins = hand_ins or HandIns()
        self.outputs: OutputWriter | None = None
        self.finite = FiniteGuard(cfg.training.precision, cfg.training.learning_rate)
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
        self.startup = StartupTimes()
        self.text_apart = None
        """What `encode_text_first` did (`text_encoding.TextEncodingReport`), None for most families."""
        self.heartbeat = Heartbeat()
        """Where this rank is (step, phase): a distributed run's watchdog reads it (`util/heartbeat.py`)."""
        self.compile_check: CompileCheck | None = None
        """training.compile: each new batch shape compiles new kernels, so each is checked once (`start`)."""
        self.gradient_buffers = False
        """training.cuda_graphs: the gradients keep buffers of their own between steps (`keep_gradient_buffers`)."""
        self.compiling = CompileChoice(False, False)
        """Whether the denoiser is compiled and replayed as CUDA graphs, `training.compile` auto decided (`start`)."""
        self.compile_split = False
        """Whether the compiled denoiser is split at DDP's gradient buckets (`compile_splits_at_buckets`)."""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.startup.launched(time.time())
        phase = self.startup.time
        with phase("set-up"):
            self.setup_environment()
            self.duties = rank_duties(du.rank(), self.callbacks)
        with phase("data scan"):
            self.dataset = self.create_dataset()  # scanned before any model loads: bad data fails fast
            self.validation_set = self.dataset.validation_set()  # held-out images, or None
        self.encode_text_first()
        with phase("model"):
            self.bundle = self.create_model()
            # One seed for what creates weights (LoRA init), set after loading (which may build and seed
            # the demo model): every rank and every world size starts alike.
            seed_everything(self.cfg.general.seed)
            self.trainable = self.prepare_trainable()
            self.parallel.split_sequences(self.bundle, self.device, self.bucket_sizes())  # multi_gpu.context_parallel
            self.objective = self.bundle.family.objective(self.bundle, self.cfg.training)
        with phase("cache"):
            self.fill_cache()
            self.encode_sample_texts()
            moved = offload_cached_encoders(self.bundle, self.device, self.cfg.data.cache_latents, self.cache_text())
            if moved is not None:
                self.startup.parts.setdefault("cache", {})["the VAE and text encoders to host memory"] = moved
        with phase("wrap"):
            self.decide_cudnn_autotuning()
            self.split = self.decide_split()
            self.batch_part = BatchSlice.of(self.split, self.parallel.data_rank)
            self.sampler, self.loader = self.create_loader()
            self.numbers = self.compute_numbers()
            self.compiling, signature = self.choose_compile()
            self.model = self.wrap_model(self.training_model())
            self.compile_check = CompileCheck(self.device, self.compiling.graphs, signature) \
                if self.compiling.compile else None
            self.gradient_buffers = self.compiling.compile and self.compiling.graphs
            self.seed_this_process()
            self.optimizer, self.lr_schedule = self.create_optimizer()
            self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.cfg.training.precision == "fp16")
            self.ema = EMA(self.trainable_params(), self.cfg.training.ema_decay) if self.cfg.training.ema else None
            self.exchange = StepExchange()
            self.validation = None if self.validation_set is None else ValidationLoss(
                self.validation_set, self.cfg.general.seed, Scoring(
                    self.bundle, self.objective, self.device, self.cfg.training.offset_noise, self.autocast,
                    self.optimizer), self.parallel)
        with phase("resume"):
            self.maybe_resume()
        self.announce()
        self.startup.over()
        self.progress = ProgressReporter(self.numbers, self.emit, self.global_step,
                                         # a folder per run id: TensorBoard shows each run as one (a continued one goes on)
                                         self.paths.tensorboard / self.run_id if self.cfg.general.tensorboard else None,
                                         reports=self.duties.leads)
        # TANDEM_PROFILE_STEPS: where a real run's steps wait (modules/trainer/step_profile.py)
        self.step_profile = RunProfiler.from_environment(self.device, self.paths.workspace / "profiles", self.run_id,
                                                         self.emit)
        # Keep the model's many long-lived Python objects out of later full garbage collections, which
        # would otherwise rescan all of them at random steps (a pause the other ranks wait for).
        gc.collect()
        gc.freeze()
        self.hand_ins.observer.started(self)

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
        self.heartbeat.at("ending", long=True)
        self.finite.check_weights(self.trainable_params(), self.global_step)
        if self.hand_ins.final_outputs:
            self.write_final_outputs()
        self.progress.close()
        trained = self.progress.summary()
        log.info("Trained %d images in %.1f s: %.1f images/s over the whole run (start-up before it: %.1f s).",
                 trained["images"], trained["train_s"], trained["images_per_s"], sum(self.startup.seconds.values()))
        written = self.completed and self.hand_ins.final_outputs
        self.emit("done", output=str(self.outputs.final_path) if written else None,
                  step=self.global_step, completed=self.completed, **trained)
        self.hand_ins.observer.ended(self)
        du.barrier()
        self.heartbeat.finished()
        self.ended = True

    def write_final_outputs(self) -> None:
        """What the end leaves: a finished run's model and last samples, a stopped run's backup."""
        if self.completed:
            self.outputs.no_more_backups()
        if self.completed and self.outputs.last_sample_step != self.global_step and self.sampling_scheduled():
            # what the finished model does, whatever the cadence; said first, as on a busy CPU it took minutes
            self.sample_unless_stopped(f"Rendering the finished model's {len(self.cfg.sampling.prompts)} sample(s) "
                                       "(a stop leaves them out).")
        with self.stop_noted("stopping once the trained state is written (a write cut short would leave nothing "
                             "to continue from); send it again to abandon the write."):
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
        if self.completed:  # its backups hold nothing left to train: Continue does not offer them
            du.on_main(lambda: backups.mark_finished(self.paths.backups, self.run_id, self.global_step,
                                                     self.outputs.final_path))

    def run(self) -> None:
        """start, train, end - with the environment torn down whatever happens."""
        try:
            self.start()
            self.train()
            self.end()
        except BaseException as error:
            from modules.trainer.memory_limit import explained
            failure = explained(error, self)  # out of memory: the figures and what to change, not CUDA's message
            self.heartbeat.failed(failure)  # before the clean-up below, which may wait for the other ranks
            if failure is not error:
                raise failure from error
            raise
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
        # The processes of a context-parallel group run one sample together: they share one stream.
        seed_everything(self.cfg.general.seed * self.parallel.data_world + self.parallel.data_rank)

    def configure_backends(self) -> None:
        configure_cuda(self.device, self.cfg.training)
        if self.device.type == "cuda":
            from modules.trainer.memory_limit import hold_to_memory_limit
            hold_to_memory_limit(self.cfg, self.device)  # multi_gpu.memory_limit_gib: the card the run was planned for

    def decide_cudnn_autotuning(self) -> None:
        decide_cudnn_autotuning(self.device, self.cfg.training.cudnn_benchmark, self.bundle.modules().values())

    def create_dataset(self):
        handed = self.hand_ins.source.dataset(self)
        if handed is not None:
            return handed
        from modules.data import build_dataset
        dataset = build_dataset(self.cfg.data, self.paths.cache, self.cfg.general.seed, scan=self.scan)
        dataset.text_sees_controls = text_sees_controls(self.cfg.model)
        log.info("Data: %s", dataset.describe_roles())  # rank 0's INFO only (rank_duties.py)
        return dataset

    def create_model(self):
        handed = self.hand_ins.source.model(self)
        if handed is not None:
            return handed
        from modules.model.loading import build_builtin_first, load_model
        # Every rank loads at once (in turn, N ranks took N loads' time: ~10 s more per start on 4 GPUs with an
        # SD1.5 folder, 4-5 s of a 2-process demo start on 2 CPU cores).
        build_builtin_first(self.cfg.model)
        loading: dict[str, float] = {}
        bundle = load_model(self.cfg.model, self.load_device(), self.cfg.training, self.parts_waiting_on_host(), loading)
        self.startup.parts["model"] = loading
        # Validation checks the image sizes of a family the config names; one found by `auto` is checked here.
        bundle.family.check_image_sizes(self.dataset.bucket_sizes, bundle)
        bundle.family.check_clips(self.dataset.clip_paths(), self.cfg.data.video_frames)
        if self.text_apart is not None:  # samples read their prompts' embeddings from the text cache
            bundle.extra["text_side"].cached.update(self.text_apart.samples)
        return bundle

    def parts_waiting_on_host(self) -> frozenset[str]:
        """What `offload_cached_encoders` will send to host memory after the cache (the loader keeps their host
        tensors to go back onto)."""
        return frozenset((["vae"] if self.cfg.data.cache_latents else []) +
                         (["text_encoders"] if self.cache_text() else []))

    def encode_text_first(self) -> None:
        """A family whose text encoder is loaded apart (Qwen-Image, Z-Image) fills the text cache now, before
        its transformer loads, and frees the encoder (modules/trainer/text_encoding.py); the others cache text
        with the latents (`fill_cache`)."""
        if self.hand_ins.source.ready_made:
            return
        from modules.trainer.text_encoding import encode_text_apart
        started = time.perf_counter()
        datasets = [d for d in (self.dataset, self.validation_set) if d is not None]
        self.text_apart = encode_text_apart(self.cfg, datasets, self.device, self.paths.cache)
        if self.text_apart is not None:
            self.startup.seconds["text"] = time.perf_counter() - started
            self.startup.parts["text"] = {"loading the text encoder": self.text_apart.load_seconds,
                                          "encoding": self.text_apart.encode_seconds}

    def load_device(self) -> torch.device:
        """Where the model is loaded (the parallelism's choice); `prepare_trainable` then places each part."""
        return self.parallel.load_device(self.device)

    def prepare_trainable(self) -> list[torch.nn.Parameter]:
        """Choose what trains (LoRA adapters or the whole UNet/transformer) and move the model to the device."""
        return prepare_trainable(self.bundle, self.cfg.training, self.parallel, self.device)

    def trainable_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.trainable if p.requires_grad]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Name -> tensor of every trained weight (what a backup stores)."""
        return trained_weights(self.bundle, self.trainable_params())

    def cache_text(self) -> bool:
        from modules.data import text_cache_allowed
        return text_cache_allowed(self.cfg.data, self.cfg.training.train_text_encoder)

    def fill_cache(self) -> None:
        """Encode latents (and text) once. Each rank encodes its share, then all read the whole cache."""
        if self.hand_ins.source.ready_made:
            return
        from modules.data import text_cache_refusal
        refusal = text_cache_refusal(self.cfg.data, self.cfg.training.train_text_encoder)
        if refusal:
            log.warning(refusal)
        if not (self.cfg.data.cache_latents or self.cache_text()):
            return
        datasets = [d for d in (self.dataset, self.validation_set) if d is not None]
        parts = fill_caches(datasets, self.bundle, self.cache_text(), self.cfg.multi_gpu.distributed_data_loading,
                            self.startup.seconds.get("model", 0.0), self.emit)
        if parts:
            self.startup.parts["cache"] = parts

    def encode_sample_texts(self) -> None:
        """With the text cached, frozen text encoders leave the GPU after the cache: the sample prompts are
        encoded now, while they are still there, so that no sampling brings them back
        (`modules/model/sample_texts.py`)."""
        if not self.cache_text():
            return
        from modules.model.sample_texts import encode_sample_texts
        started = time.perf_counter()
        count = encode_sample_texts(self.bundle, self.cfg.sampling)
        if count:
            log.info("Sample prompts: %d text(s) encoded in %.1f s; samples run without the text encoders.",
                     count, time.perf_counter() - started)

    def bucket_sizes(self) -> list[tuple[int, int]]:
        """(width, height) of every bucket the run trains or scores, and of its samples."""
        sets = [d for d in (self.dataset, self.validation_set) if d is not None]
        sizes = [d.bucket_sizes[b % len(d.bucket_sizes)] for d in sets for b in set(d.buckets)]
        return sizes + ([(self.cfg.data.resolution,) * 2] if self.cfg.sampling.prompts else [])

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
        def measure():  # multi_gpu.batch_split auto: this rank's probe, through the unwrapped training model
            model = TrainingModel(self.bundle, self.cfg.training.train_text_encoder, self.objective)
            return measure_capacity(self.dataset[0], lambda batch, part: self.compute_loss(batch, 0, model, part),
                                    self.trainable_params(), self.device, self.cfg.optimizer.name,
                                    self.cfg.training.ema)
        return decide_split(self.cfg.multi_gpu.batch_split, self.cfg.training.batch_size, self.parallel.data_world,
                            self.parallel.holds_whole_model, self.device_names, measure, self.parallel.planned_split)

    def device_names(self) -> list[str]:
        """Each rank's device, for messages (`GPU 1`, `CPU process 0`)."""
        index = du.gpu_number(self.device) if self.device.type == "cuda" else du.rank()
        kinds = du.all_gather_objects((self.device.type, index))
        return [f"GPU {i}" if kind == "cuda" else f"CPU process {i}" for kind, i in kinds]

    def training_model(self) -> TrainingModel:
        model = TrainingModel(self.bundle, self.cfg.training.train_text_encoder, self.objective)
        t = self.cfg.training
        if self.compiling.compile:
            from modules.trainer.compiled_unet import compile_unet
            dropout = t.method == "lora" and t.lora_dropout > 0
            model.use_compiled_unet(compile_unet(self.bundle.denoiser, self.device, len(set(self.dataset.buckets)),
                                                 dropout, self.compile_split, cuda_graphs=self.compiling.graphs,
                                                 checkpointing=t.gradient_checkpointing))
        return model

    def choose_compile(self) -> tuple[CompileChoice, str | None]:
        """`training.compile` and `training.cuda_graphs` as this run takes them (`compile_choice.choose`: `auto`
        weighed, said in one line), with the graph signature its compiles are noted under (`compile_ledger`). Every
        rank takes rank 0's choice."""
        from modules.trainer.compiled_unet import graph_safe_randomness_cacheable, graph_signature
        t = self.cfg.training
        if t.compile == "off":
            return CompileChoice(False, False), None
        on_gpu = self.device.type == "cuda"
        if t.compile == "auto" and not on_gpu:
            choice = choose(t.compile, t.cuda_graphs, on_gpu, None)
            log.info(choice.line)
            return choice, None
        unavailable = None
        if t.gradient_checkpointing and not graph_safe_randomness_cacheable():
            unavailable = f"PyTorch {torch.__version__} would compile afresh at every start"
        split = self.compile_split = self.parallel.compile_splits_at_buckets(self.trainable_params())
        graphs_if_compiled = choose("on", t.cuda_graphs, on_gpu, None, graphs_unavailable=unavailable).graphs
        signature = graph_signature(self.bundle.denoiser, self.device, precision=t.precision,
                                    checkpointing=t.gradient_checkpointing, graphs=graphs_if_compiled and on_gpu,
                                    dropout=t.method == "lora" and t.lora_dropout > 0, split=split)
        run = None
        blocked = self.compile_blocked() if t.compile == "auto" and on_gpu else None
        if t.compile == "auto" and on_gpu and blocked is None and du.is_main():
            run = self.run_for_compile(signature, split)
        choice = du.broadcast_object(choose(t.compile, t.cuda_graphs, on_gpu, run, blocked, unavailable))
        if choice.line:
            log.info(choice.line)
        # Noted by one process per machine: each machine's compile cache is its own.
        return choice, signature if du.local_rank() == 0 and not (choice.graphs and unavailable) else None

    def compile_blocked(self) -> str | None:
        """Why this run cannot compile its denoiser (what validation refuses with `training.compile` on), or None."""
        m = self.cfg.multi_gpu
        if not self.parallel.holds_whole_model:
            return "FSDP shards the denoiser's weights, and the compiled denoiser is checked on whole ones"
        if self.parallel.layer_offload_blocks:
            return "layer offload moves the denoiser's weights at every call"
        if self.parallel.layout.context > 1:
            return "context parallelism splits each sample, and the compiled denoiser is checked on whole ones"
        if du.world_size() > 1 and m.static_graph:
            return "PyTorch's DDP fails on a static graph's unsynchronised first backward (multi_gpu.static_graph)"
        from torch.utils._triton import has_triton
        if not has_triton():
            return "this PyTorch has no Triton to compile for the GPU"
        return None

    def run_for_compile(self, signature: str, split: bool) -> RunForCompile:
        """This run as `auto` weighs a compile: its steps, the images and pixels of each, and the batch shapes it
        trains (one per aspect bucket that fills a global batch), with those the compile cache holds."""
        from modules.util.compile_ledger import noted
        counts: dict[int, int] = {}
        first: dict[int, int] = {}
        for index, bucket in enumerate(self.dataset.buckets):
            counts[bucket] = counts.get(bucket, 0) + 1
            first.setdefault(bucket, index)
        trained = [b for b in counts if counts[b] >= self.batch_part.total] or list(counts)
        notes = []
        for bucket in trained:
            item = self.dataset[first[bucket]]
            notes.append(noted(signature, (self.batch_part.size, *(item["latents"] if "latents" in item
                                                                   else item["pixels"]).shape)))
        sizes = self.dataset.bucket_sizes
        pixels = sum(counts[b] * sizes[b % len(sizes)][0] * sizes[b % len(sizes)][1] for b in trained) \
            / sum(counts[b] for b in trained)
        cached = [n["cached_s"] for n in notes if n is not None and n.get("cached_s")]
        return RunForCompile(self.bundle.model_type, self.numbers.total_steps - self.global_step,
                             self.batch_part.size * self.numbers.accumulation, pixels, len(trained),
                             sum(n is not None for n in notes), max(cached) if cached else None, split)

    def compute_numbers(self) -> RunNumbers:
        return derive_run_numbers(self.cfg, self.parallel.data_world, len(self.sampler), self.split,
                                  items_per_epoch=len(self.dataset), launch=self.launch)

    def wrap_model(self, model: TrainingModel) -> torch.nn.Module:
        """The trained module as the parallelism runs it; the trained parameters as it holds them."""
        wrapped, self.trainable = self.parallel.wrap(model, self.trainable)
        return wrapped

    def create_optimizer(self):
        t = self.cfg.training
        unet_ids = {id(p) for p in self.bundle.denoiser.parameters()}
        unet_params = [p for p in self.trainable_params() if id(p) in unet_ids]
        te_params = [p for p in self.trainable_params() if id(p) not in unet_ids]
        # The learning rates as the launch scaled them, once (`RunNumbers.group_lrs`).
        groups = [{"params": params, "lr": lr} for params, lr in
                  zip([unet_params, te_params], self.numbers.group_lrs(text_encoders=bool(te_params)))]
        optimizer = build_optimizer(groups, self.cfg.optimizer, self.device)
        return optimizer, build_scheduler(optimizer, t, self.numbers.total_steps)

    def announce(self) -> None:
        log.info("Tandem: %s", self.numbers.describe())
        self.startup.summarise()
        self.emit("config", run_id=self.run_id, **self.numbers.as_dict())  # the GUI keeps the loss curve by it
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
        # Said before `iter`: for a later epoch it waits for every (persistent) worker to restart its order, so a
        # stuck worker is named while loading, not after the epoch's last step.
        self.heartbeat.at("loading a batch", self.global_step + 1, long=not self.first_step_done)
        from modules.data.dataset import start_iteration
        batches = start_iteration(self.loader)  # the first call starts the loader's (persistent) worker processes
        workers_s = time.perf_counter() - iterating
        while self.sampler.batches_remaining() >= accumulation:
            first = not self.first_step_done
            started = time.perf_counter()
            self.heartbeat.at("loading a batch", self.global_step + 1, long=first)  # the first: workers start
            micro_batches = self.take_batches(batches, accumulation)
            loaded = time.perf_counter()
            self.heartbeat.at("training step", long=first)  # the first: kernels chosen, memory allocated
            self.hand_ins.observer.step_begins(self)
            loss = self.optimizer_step(micro_batches)
            self.hand_ins.observer.step_queued(self)
            if first:
                self.report_first_step(started, loaded, workers_s)
            # Told after training, not when handed out: prefetching workers run ahead of the trained position.
            self.sampler.mark_consumed(accumulation)
            self.global_step += 1
            self.step_in_epoch += 1
            self.after_step(loss)
            self.hand_ins.observer.step_ended(self)
            if self.stop_requested or self.global_step >= self.numbers.total_steps:
                return
        self.epoch += 1
        self.step_in_epoch = 0
        self.after_epoch()

    def take_batches(self, batches, count: int) -> list[dict]:
        """The next `count` batches; a failure of the loader is named as one (a dead worker, not a pipe reset)."""
        try:
            return [next(batches) for _ in range(count)]
        except (StopIteration, KeyboardInterrupt):
            raise
        except Exception as error:
            from modules.data.dataset import loading_failure
            raise loading_failure(self.loader, error) from error

    def report_first_step(self, started: float, loaded: float, workers_s: float) -> None:
        """Where the first step's time went (`startup.StartupTimes.first_step`: it waits for the device)."""
        self.startup.first_step(self.device, started, loaded, workers_s)
        self.first_step_done = True

    def optimizer_step(self, micro_batches: list[dict]) -> torch.Tensor:
        if self.compile_check is not None and self.compile_check.needed(micro_batches[0]):
            self.check_compiled_unet(micro_batches[0])
        if self.gradient_buffers:
            keep_gradient_buffers(self.trainable_params())
        # With unequal GPUs each rank's mean loss is weighted by its share (1.0 with equal GPUs).
        loss = self.parallel.forward_backward(self.model, micro_batches, self.compute_loss, self.scaler,
                                              share=self.batch_part.loss_weight(self.parallel.data_world))
        self.apply_gradients()
        return loss

    def check_compiled_unet(self, batch: dict) -> None:
        """Compile for this batch's shape and compare the gradients with the uncompiled UNet's
        (`compiled_unet.CompileCheck`) before the step trains on them."""
        inner = self.parallel.unwrap(self.model)  # the TrainingModel itself: its forward synchronises nothing

        def backward_pass(context, model):
            def run():
                with context:
                    loss = self.compute_loss(batch, micro=0, model=model)
                    self.scaler.scale(loss).backward()
                return loss.detach()
            return run

        # The compiled pass goes through the wrapper (where the compiler may split the backward at DDP's
        # buckets), without synchronising, so no rank's gradients leave it yet.
        unsynchronised = self.parallel.gradient_sync(self.model, last_micro_batch=False)
        with self.heartbeat.during("compiling"):
            self.compile_check.check(batch, backward_pass(inner.eager_unet(), inner),
                                     backward_pass(unsynchronised, None), self.trainable_params())

    def compute_loss(self, batch: dict, micro: int, model: torch.nn.Module | None = None,
                     part: BatchSlice | None = None) -> torch.Tensor:
        """The training loss of `batch`, micro-batch `micro` of this step, through `model` (default: the wrapped
        model) as the part `part` of the global micro-batch (default: this rank's)."""
        bundle, dev = self.bundle, self.device
        if "latents" in batch:
            latents = batch["latents"].to(dev, non_blocking=True).float()
        else:
            with torch.no_grad():
                latents = bundle.encode_images(batch["pixels"].to(dev, non_blocking=True)).float()
        text = batch.get("text")
        if text is not None:
            text = {k: v.to(dev, non_blocking=True) for k, v in text.items()}
        controls = control_latents(bundle, batch, dev)
        objective = self.objective  # the family's: noise and timesteps keyed by (seed, step, micro)
        draw = objective.draw(tuple(latents.shape), self.cfg.general.seed, self.global_step, micro,
                              self.batch_part if part is None else part, dev, self.cfg.training.offset_noise)
        noisy = objective.noisy(latents, draw)
        target = objective.target(latents, draw)
        with self.autocast():
            pred = (self.model if model is None else model)(noisy, draw.timesteps, text, batch.get("captions"),
                              batch.get("original_sizes"), batch.get("crop_coords"), batch.get("target_sizes"),
                              controls=controls)
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
        self.optimizer.zero_grad(set_to_none=not self.gradient_buffers)
        self.lr_schedule.step()
        if self.ema is not None:
            self.ema.update()

    def after_step(self, loss: torch.Tensor) -> None:
        self.heartbeat.at("after the step", self.global_step)
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
        if self.step_profile is not None:
            self.step_profile.after_step(self.global_step)

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
        self.finite.check_loss(report.step, report.loss)
        self.progress.step(report)
        if "stop" in report.commands:
            log.info("Stop requested: stopping at step %d", self.global_step)
            self.stop_requested = True
        return report.commands - {"stop"}

    def write_outputs(self, sample: bool, backup: bool, save: bool) -> None:
        if not (sample or backup or save):
            return
        with self.heartbeat.during("writing outputs"):
            self._write_outputs(sample, backup, save)

    def _write_outputs(self, sample: bool, backup: bool, save: bool) -> None:
        # Outputs only of a state known to be sound: this step's loss (waiting for it here, which the loop
        # otherwise avoids) and the weights the step produced must be finite.
        requested = self.act_on(self.exchange.receive())
        sample, backup, save = sample or "sample" in requested, backup or "backup" in requested, save or "save" in requested
        self.finite.check_weights(self.trainable_params(), self.global_step)
        if sample:
            self.sample_unless_stopped()
            if self.stop_requested:
                return  # the run ends now; its end writes the backup of a stop
        if backup:
            self.outputs.backup()
        if save:
            self.outputs.save_intermediate()

    def sample_unless_stopped(self, announce: str | None = None) -> None:
        """Samples, left out once a stop was asked for, and in one process abandoned by a stop signal that comes
        while they render (`stop_abandons`): a stop ends the run in seconds, also in its last sampling.
        `announce`: a line logged before they start."""
        if self.stop_requested:
            log.info("Stop requested: no samples at step %d.", self.global_step)
            return
        if announce:
            log.info(announce)
        try:
            self.outputs.sample()
        except StopRequested:
            log.info("Stop requested: the samples of step %d were abandoned.", self.global_step)
            self.stop_requested = True

    def stop_abandons(self):
        """Inside the block a stop signal abandons the work at once (`CommandInbox.abandoning_on_stop`; the
        `TrainingRun` that `OutputWriter` renders samples with). Only in one process: with several, a render may
        be collective (a sharded or context-parallel denoiser) and a rank that left it would leave the others
        waiting, so every rank stops at the next step together, as always."""
        if self.inbox is None or du.world_size() > 1:
            return contextlib.nullcontext()
        return self.inbox.abandoning_on_stop()

    def stop_noted(self, note: str):
        """Inside the block a first stop signal is answered at once with `note` (`CommandInbox.noting_stop`)."""
        if self.inbox is None or du.world_size() > 1:  # with several processes the launcher answers signals
            return contextlib.nullcontext()
        return self.inbox.noting_stop(note)

    def validate(self) -> None:
        """The held-out images' loss (every rank scores its share: call it on every rank at the same step)."""
        started = time.perf_counter()
        with self.heartbeat.during("validation"):
            loss = self.validation.evaluate(self.parallel.unwrap(self.model), self.global_step)
        log.info("Validation loss at step %d: %.6f (%d images, %.1f s)", self.global_step, loss, len(self.validation),
                 time.perf_counter() - started)
        self.progress.validation(self.global_step, loss)
        self.emit("validation", step=self.global_step, loss=loss, images=len(self.validation))

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
        """Continue the backup `resume` names (same run id), or start a new run with a new id (`resume.py`)."""
        chosen, self.run_id = resuming.choose(self.paths.backups, self.resume, self.given_run_id)
        self.outputs = OutputWriter(self, RunParts(
            cfg=self.cfg, paths=self.paths, bundle=self.bundle, device=self.device, ema=self.ema,
            numbers=self.numbers, dataset=self.dataset, emit=self.emit, log_image=self.log_image,
            optimizer=self.optimizer, parallelism=self.parallel), self.run_id)
        self.finite.watch_backups(self.written_backups)
        if chosen is None:
            others = du.on_main(lambda: backups.describe_other_runs(self.paths.backups, self.run_id))
            if others:
                log.info(others)
            return
        fresh_base_lrs = [g["initial_lr"] for g in self.optimizer.param_groups]
        state = resuming.load_trained(chosen.path, resuming.TrainedState(
            self.model, self.optimizer, self.ema, self.trainable_state(), self.parallel), self.cfg.optimizer.name)
        position = resuming.restore_progress(
            state, resuming.LoopState(self.sampler, self.optimizer, self.lr_schedule, self.scaler),
            self.numbers.global_batch, fresh_base_lrs)
        self.global_step, self.epoch, self.step_in_epoch = position.global_step, position.epoch, position.step_in_epoch
        log.info("Continuing %s from %s (now at step %d, epoch %d)", chosen.describe(), chosen.path,
                 self.global_step, self.epoch + 1)

    def written_backups(self) -> list[backups.BackupInfo]:
        """This run's backups once the one being written is done (rank 0; the finite guard's word on them)."""
        with contextlib.suppress(Exception):  # a failed write is not a backup; the run is failing anyway
            self.outputs.backups.wait()
        return backups.list_backups(self.paths.backups, self.run_id)

    def log_image(self, tag: str, image, step: int) -> None:
        self.progress.log_image(tag, image, step)

    def emit(self, type_: str, **fields) -> None:
        self.duties.callbacks.on_event(type_, **fields)
