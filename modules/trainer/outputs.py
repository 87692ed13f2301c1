"""Everything a run writes: samples, backups, the trained model.

Only rank 0 writes files (no duplicate files, ever), and every rank learns whether the write worked:
all ranks leave together, or all raise together, so no rank waits for a rank 0 that failed. Work that
takes every rank happens before: gathering RNG states for a backup, and rendering samples (each rank
renders its share of the prompts).

How the weights are read and who takes part is the run's parallelism's (`RunParts.parallelism`,
`parallelism.py`): with the whole model on rank 0 (one process, DDP), rank 0 writes a model alone and
its backups on a background thread (`backup_writer.py`); under sharded training (FSDP) every rank
gathers the model one block at a time while rank 0 writes (`streamed_save.py`), and every rank writes
its shards of a backup. Under FSDP every rank also renders samples equally often, since each call of a
sharded denoiser gathers its weights from all ranks.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol

import torch

from modules.config import RunPaths, TrainConfig
from modules.trainer.ema import EMA
from modules.trainer.optim import evaluation_weights
from modules.trainer.parallelism import Parallelism, SingleProcess
from modules.trainer.progress import PhaseTimes
from modules.trainer.run_numbers import RunNumbers
from modules.util import dist_utils as du
from modules.util.animation import SUFFIX as CLIP_SUFFIX, Clip
from modules.util.atomic import atomic_path, unique_path

log = logging.getLogger("tandem")


class TrainingRun(Protocol):
    """The live state of a run that outputs are written from (`BaseTrainer` is one)."""
    global_step: int
    epoch: int
    model: Any
    """The wrapped trained module (`TrainingModel` under DDP or FSDP); a sharded backup reads its state. Live
    state, not a part: the run lets go of it at its end (the wrapper holds the process group)."""

    def training_state(self) -> dict:
        """Everything but the weights a backup holds (collective: every rank calls it)."""

    def progress_state(self) -> dict:
        """The plain values of `training_state` without the optimizer state and EMA (a sharded backup keeps
        those in its shards; collective)."""

    def trainable_state(self) -> dict:
        """The trained weights by name."""

    def sampling_calls(self) -> ContextManager:
        """Inside the block the sampling pipeline may call the trained parts (through the sharded root
        under FSDP)."""

    def stop_abandons(self) -> ContextManager:
        """Inside the block a stop may abandon the rendering at once (`StopRequested`; in one process)."""


@dataclass(frozen=True)
class RunParts:
    """What outputs are made of besides the live state: fixed for the run once the model is wrapped."""
    cfg: TrainConfig
    paths: RunPaths
    bundle: Any
    """The `ModelBundle` (saved, and rendered for samples)."""
    device: torch.device
    ema: EMA | None
    numbers: RunNumbers
    dataset: Any
    """The `TrainDataset` (described in a LoRA's metadata)."""
    emit: Callable[..., None]
    """`emit(type, **fields)`: an event (`sample`, `backup`, `saved`, `status`)."""
    log_image: Callable[[str, Any, int], None]
    """`log_image(tag, image, step)`: a sample (an image or a `Clip`) to TensorBoard."""
    optimizer: Any = None
    """The optimizer: schedule-free AdamW's averaged weights are the ones sampled and saved
    (`optim.evaluation_weights`); None where none is needed (a backup alone)."""
    parallelism: Parallelism = field(default_factory=SingleProcess)
    """How the trained model is spread over the processes: who takes part in writing it, how its weights are
    read, what writes the backups."""


def sample_suffix(sample) -> str:
    """A clip is an animated WebP, an image a PNG."""
    return CLIP_SUFFIX if isinstance(sample, Clip) else ".png"


def write_sample(sample, path: Path) -> None:
    """Written whole (the gallery never shows half a picture) and never through a link (`atomic_path`)."""
    with atomic_path(path) as tmp:
        if isinstance(sample, Clip):
            sample.save_webp(tmp)
        else:
            sample.save(tmp, format="PNG")


def run_stamp(run_id: str) -> str:
    """What tells a run's outputs apart when their name is taken: its id's time (`run-20261201-223909` ->
    `20261201-223909`), the id itself for one made otherwise."""
    return run_id.removeprefix("run-")


class OutputWriter:
    def __init__(self, run: TrainingRun, parts: RunParts, run_id: str) -> None:
        self.run = run
        self.parts = parts
        save = parts.cfg.save
        # An output whose name is taken is told apart by the run's id, as its samples, backups and config are:
        # a stamp of its own (the time the model loaded) named a 2-process run's model after no run at all.
        self.stamp = run_stamp(run_id)
        self.started_at = time.time()  # ss_training_started_at of the saved LoRAs
        self.output_dir = Path(parts.paths.output_dir)
        self.last_sample_step: int | None = None
        self.run_id = run_id
        self.last_backup_started = time.monotonic()
        """When the last backup was taken (or the run started): `save.backup_every_n_minutes` counts from it."""
        self.backups = parts.parallelism.backups(parts, run_id)
        self.backup_pauses: dict[int, tuple[float, float]] = {}
        """Seconds the loop spent on each backup not yet announced (snapshot and hand-over; all of a sharded
        write) and how many of them went to growing the pinned host memory pool, so its announcement says
        what it cost the training and why."""
        # Decided at start so a later run never overwrites an earlier run's model.
        self.final_path = unique_path(self.output_dir / (save.output_name + self._suffix()), self.stamp)

    def _suffix(self) -> str:
        s = self.parts.cfg.save
        if self.parts.cfg.training.method == "lora" or s.full_format == "single_file":
            return ".safetensors"
        return ""  # a diffusers folder

    # -- samples
    def sample(self) -> None:
        """Every rank renders its share of the prompts (prompt i on rank i mod N; a context-parallel group's
        ranks together, prompt i on group i mod N / C); rank 0 writes them all.

        Each prompt is rendered alone from its own seed, so its pixels do not depend on which rank renders it."""
        parts = self.parts
        prompts = parts.cfg.sampling.prompts
        self.last_sample_step = self.run.global_step
        if not prompts:
            return
        parallel = parts.parallelism
        # The processes of a context-parallel group render their group's prompts together; the first keeps them.
        mine = [i for i in range(len(prompts)) if i % parallel.data_world == parallel.data_rank]
        # As many renders on every rank where each denoiser call is collective; the extra ones are dropped.
        renders = mine + [(mine or [0])[0]] * parallel.extra_calls(len(mine), len(prompts))
        images = []
        started = time.monotonic()
        shared = f" ({parallel.data_world} processes render them together)" if parallel.data_world > 1 else ""

        def rendering(k: int) -> None:  # this rank's k-th render; rank 0 tells the GUI which prompt it is at
            if k < len(mine):
                parts.emit("status", text=f"sampling - prompt {mine[k] + 1} of {len(prompts)}{shared}")
        times = PhaseTimes()  # where a sampling's time goes: each rank's own parts, the slowest rank's logged
        if renders:
            from modules.model.sample_texts import texts_ready
            from modules.model.sampling import render_samples
            samp = parts.cfg.sampling
            move_text = not texts_ready(parts.bundle, [prompts[i] for i in renders], samp.guidance_scale)
            with contextlib.ExitStack() as stack:
                with times.time("models to the device"):
                    for context in (self._weights_for_samples(), self._encoders_on_device(move_text),
                                    self.run.sampling_calls()):
                        stack.enter_context(context)
                # Only the rendering may be cut short: the moves around it restore the trained weights.
                with times.time("rendering"), self.run.stop_abandons():
                    images = render_samples(parts.bundle, [prompts[i] for i in renders], parts.cfg.data.resolution,
                                            samp.inference_steps, samp.guidance_scale, parts.device,
                                            frames=samp.video_frames, fps=parts.cfg.data.video_fps,
                                            graphs=samp.cuda_graphs and parallel.sampling_replays_graphs,
                                            on_prompt=rendering)[:len(mine)]
                with times.time("models back"):
                    stack.close()
        kept = zip(mine, images) if parallel.context_rank == 0 else ()
        with times.time("gathering"):  # on rank 0: waiting for the slowest rank, then its images
            gathered = du.gather_objects(([(i, du.rank(), image) for i, image in kept], times.seconds))
        du.on_main(lambda: self._write_and_report(gathered, times, started))

    def _write_and_report(self, gathered: list, times: PhaseTimes, started: float) -> None:
        """Rank 0: write every rank's samples, then log what the sampling cost the run (it stops training on every
        rank) and where that went - the slowest rank's moves and rendering - for the log and the benchmarks."""
        with times.time("writing"):
            self._write_samples({i: (rank, image) for part, _ in gathered for i, rank, image in part})
        for name in ("models to the device", "rendering", "models back"):
            times.seconds[name] = max(seconds.get(name, 0.0) for _, seconds in gathered)
        shared = f" ({du.world_size()} processes, each rendered its share)" if du.world_size() > 1 else ""
        log.info("Samples at step %d: %d sample(s) in %.1f s%s; parts: %s.", self.run.global_step,
                 len(self.parts.cfg.sampling.prompts), time.monotonic() - started, shared, times.describe())

    def _write_samples(self, rendered: dict) -> None:
        """Every image to its PNG (a video family's clip to its animated WebP) and to TensorBoard, each on its
        own thread, then one event per sample in prompt order. Written one after another, a sampling's 4 images
        took ~1 s of every rank's waiting on H100 hosts (0.25 s each: two PNG encodings); Pillow's encoder lets
        the threads run at once."""
        parts, step = self.parts, self.run.global_step
        folder = Path(parts.paths.samples) / self.run_id  # each run its own folder: a new run overwrote the last's
        folder.mkdir(parents=True, exist_ok=True)
        prompts = parts.cfg.sampling.prompts
        paths = [folder / f"step-{step:07d}-{i}{sample_suffix(rendered[i][1])}" for i in range(len(prompts))]

        def write(i: int) -> None:
            write_sample(rendered[i][1], paths[i])
            parts.log_image(f"sample/{i}", rendered[i][1], step)

        with ThreadPoolExecutor(min(len(prompts), 8), thread_name_prefix="sample-writer") as pool:
            list(pool.map(write, range(len(prompts))))  # raises the first failed write here
        for i, prompt in enumerate(prompts):
            parts.emit("sample", step=step, path=str(paths[i]), prompt=prompt.prompt, rank=rendered[i][0])

    # -- backups
    def backup(self) -> None:
        """Snapshot the training state of this step and hand it to the background writer (rank 0)."""
        run = self.run
        self.last_backup_started = time.monotonic()
        manifest = {"config_version": 1, "global_step": run.global_step, "epoch": run.epoch,
                    "world_size": du.world_size()}
        done, pinning = self.backups.take(run, manifest)  # collective
        if du.is_main():  # the rank that announces backups
            self.backup_pauses[run.global_step] = (time.monotonic() - self.last_backup_started, pinning)
        self._announce(done)

    def poll_backups(self) -> None:
        """Report backups the writer finished (rank 0); a failed write raises here."""
        self._announce(self.backups.finished())

    def finish_backups(self) -> None:
        """Wait until every backup is on disk; every rank learns whether the last write worked."""
        du.on_main(lambda: self._announce(self.backups.wait()))

    def no_more_backups(self) -> None:
        """The run takes no more backups (it finished): the writer frees their host memory when the last is
        written. A backup taken after all (a failed final save keeps the weights) pins memory again."""
        self.backups.release_host_memory()

    def close(self) -> None:
        """End the writer thread (after a failure too: a backup in flight is completed, not abandoned)."""
        self.backups.close()

    def _announce(self, done: list[tuple[int, Path]]) -> None:
        for step, path in done:
            # The loop's own time; the snapshot's copies queued on the GPU delay the next steps a little more.
            paused, pinning = self.backup_pauses.pop(step, (None, 0.0))
            cost = {} if paused is None else {"paused_s": round(paused, 3), "pinned_alloc_s": round(pinning, 3)}
            why = f", {pinning:.2f} s of it allocating pinned host memory (reused by later backups)" if pinning >= 0.05 else ""
            log.info("Backup written: %s%s", path, "" if paused is None else f" (training paused {paused:.2f} s for it{why})")
            self.parts.emit("backup", path=str(path), step=step, **cost)

    @property
    def last_backup(self) -> Path | None:
        return self.backups.last_written

    # -- model
    def save_final(self) -> None:
        self._save(self.final_path)

    def save_intermediate(self) -> None:
        name = self.parts.cfg.save.output_name + f"-step{self.run.global_step:07d}" + self._suffix()
        self._save(unique_path(self.output_dir / name, self.stamp))

    def _save(self, path: Path) -> None:
        self.parts.parallelism.write_model(lambda: self._write_models(path))

    def _write_models(self, path: Path) -> None:
        ema = self.parts.ema
        which = self.parts.cfg.save.ema_weights if ema is not None else "raw"
        if which in ("raw", "both"):
            with evaluation_weights(self.parts.optimizer):  # schedule-free AdamW: its averaged weights (optim.py)
                self._write_model(path)
        if which in ("ema", "both"):
            ema_path = path if which == "ema" else path.with_name(path.name.replace(self._suffix(), "") + "-ema" + self._suffix())
            with ema.swapped_in():
                self._write_model(ema_path)

    def _write_model(self, path: Path) -> None:
        parts, step = self.parts, self.run.global_step
        s = parts.cfg.save
        dtype = s.save_dtype
        source = self.parts.parallelism.tensor_source(self.parts.device)
        if source.writes:
            path.parent.mkdir(parents=True, exist_ok=True)
        if not sys.stderr.isatty():
            import diffusers.utils.logging
            diffusers.utils.logging.disable_progress_bar()  # its shard-writing bar is noise in a log file
        log.info("Saving the model to %s ...", path)
        parts.emit("status", text=f"saving {path.name}")
        if parts.cfg.training.method == "lora":
            from modules.model.lora import save_lora
            from modules.model.lora_metadata import training_metadata
            metadata = training_metadata(parts.cfg, parts.numbers, parts.dataset, step, self.started_at)
            metadata["tandem_step"] = str(step)
            files = {}
            if s.lora_format in ("kohya", "both"):
                files["kohya"] = save_lora(parts.bundle, path, "kohya", dtype, metadata, source)
            if s.lora_format in ("peft", "both"):
                peft_path = path.with_name(path.name.replace(".safetensors", ".peft.safetensors")) \
                    if s.lora_format == "both" else path
                files["peft"] = save_lora(parts.bundle, peft_path, "peft", dtype, metadata, source)
            if source.writes:
                self._say_who_reads(files)
        else:
            if s.full_format in ("diffusers", "both"):
                from modules.model.saving import save_full_diffusers
                folder = path if s.full_format == "diffusers" else path.with_suffix("")
                save_full_diffusers(parts.bundle, folder, dtype, source=source)
            if s.full_format in ("single_file", "both"):
                from modules.model.saving import save_full_single_file
                file = path if s.full_format == "single_file" else path.with_name(path.name + ".safetensors")
                resolution = parts.cfg.data.resolution
                save_full_single_file(parts.bundle, file, dtype, source=source, metadata={
                    "modelspec.title": s.output_name, "modelspec.resolution": f"{resolution}x{resolution}",
                    "tandem_step": str(step)})
        log.info("Model saved: %s", path)
        parts.emit("saved", path=str(path), step=step)

    def _say_who_reads(self, files: dict) -> None:
        """One log line per LoRA file: which programs apply it exactly, and for those that do not, the other
        file of the run or the conversion to use (`lora_clients.save_note`)."""
        from modules.model.lora import lora_alpha_and_rank, lora_type
        from modules.families.lora_clients import save_note

        bundle = self.parts.bundle
        alpha, rank = lora_alpha_and_rank(bundle)
        for fmt, file in files.items():
            others = {other: f for other, f in files.items() if other != fmt}
            log.info("%s", save_note(file, bundle.model_type, lora_type(bundle), fmt, alpha, rank,
                                     self.parts.cfg.model.base_model, others))

    @contextlib.contextmanager
    def _encoders_on_device(self, text: bool = True):
        """The VAE and (`text`) the text encoders on the training device for the block: with a cache they wait
        elsewhere. Without `text` the pipeline gets the texts' embeddings kept from the start."""
        from modules.model.host_copies import move_home
        bundle = self.parts.bundle
        parts = [bundle.vae, *(bundle.text_encoders if text else [])]
        homes = [next(m.parameters()).device for m in parts]
        for m in parts:
            m.to(self.parts.device)
        try:
            yield
        finally:
            for m, home in zip(parts, homes):
                move_home(bundle, m, home)

    @contextlib.contextmanager
    def _weights_for_samples(self):
        """Samples show the weights that are saved: the EMA weights when EMA is on and chosen for saving,
        schedule-free AdamW's averaged weights with that optimizer (the config never has both)."""
        ema = self.parts.ema
        if ema is not None and self.parts.cfg.save.ema_weights == "ema":
            with ema.swapped_in():
                yield
        else:
            with evaluation_weights(self.parts.optimizer):
                yield
