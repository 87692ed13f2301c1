"""Everything a run writes: samples, backups, the trained model.

Only rank 0 writes (no duplicate files, ever); every rank then meets at a barrier so nobody runs
ahead while files are being written. Collectives that need every rank (gathering RNG states for a
backup) happen before the rank-0-only part.
"""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

from modules.distributed import dist_utils as du
from modules.trainer import backup as backups
from modules.util.atomic import unique_path

log = logging.getLogger("tandem")


class OutputWriter:
    def __init__(self, trainer) -> None:
        self.t = trainer
        save = trainer.cfg.save
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        self.output_dir = Path(trainer.paths.output_dir)
        self.last_sample_step: int | None = None
        # Decided at start so a later run never overwrites an earlier run's model.
        self.final_path = unique_path(self.output_dir / (save.output_name + self._suffix()), self.stamp)

    def _suffix(self) -> str:
        s = self.t.cfg.save
        if self.t.cfg.training.method == "lora" or s.full_format == "single_file":
            return ".safetensors"
        return ""  # a diffusers folder

    # -- samples
    def sample(self) -> None:
        t = self.t
        prompts = t.cfg.sampling.prompts
        self.last_sample_step = t.global_step
        if du.is_main() and prompts:
            from modules.model.sampling import render_samples
            samp = t.cfg.sampling
            with self._weights_for("sample"), t.encoders_on_device():
                images = render_samples(t.bundle, prompts, t.cfg.data.resolution, samp.inference_steps,
                                        samp.guidance_scale, t.device)
            folder = Path(t.paths.samples)
            folder.mkdir(parents=True, exist_ok=True)
            for i, (prompt, image) in enumerate(zip(prompts, images)):
                path = folder / f"step-{t.global_step:07d}-{i}.png"
                image.save(path)
                t.emit("sample", step=t.global_step, path=str(path), prompt=prompt.prompt)
                t.progress.log_image(f"sample/{i}", image, t.global_step)
        du.barrier()

    # -- backups
    def backup(self) -> None:
        t = self.t
        state = t.training_state()  # collective: every rank contributes its RNG state
        if du.is_main():
            manifest = {"config_version": 1, "global_step": t.global_step, "epoch": t.epoch,
                        "world_size": du.world_size()}
            path = backups.write_backup(t.paths.backups, t.global_step, t.trainable_state(), state, manifest,
                                        keep=t.cfg.save.rolling_backup_count)
            log.info("Backup written: %s", path)
            t.emit("backup", path=str(path), step=t.global_step)
        du.barrier()

    # -- model
    def save_final(self) -> None:
        self._save(self.final_path)

    def save_intermediate(self) -> None:
        name = self.t.cfg.save.output_name + f"-step{self.t.global_step:07d}" + self._suffix()
        self._save(unique_path(self.output_dir / name, self.stamp))

    def _save(self, path: Path) -> None:
        t = self.t
        if du.is_main():
            which = t.cfg.save.ema_weights if t.ema is not None else "raw"
            if which in ("raw", "both"):
                self._write_model(path)
            if which in ("ema", "both"):
                ema_path = path if which == "ema" else path.with_name(path.name.replace(self._suffix(), "") + "-ema" + self._suffix())
                with t.ema.swapped_in():
                    self._write_model(ema_path)
        du.barrier()

    def _write_model(self, path: Path) -> None:
        t = self.t
        s = t.cfg.save
        dtype = s.save_dtype
        path.parent.mkdir(parents=True, exist_ok=True)
        log.info("Saving the model to %s ...", path)
        t.emit("status", text=f"saving {path.name}")
        if t.cfg.training.method == "lora":
            from modules.model.lora import save_lora
            metadata = {"tandem_base_model": t.cfg.model.base_model, "tandem_step": str(t.global_step)}
            if s.lora_format in ("kohya", "both"):
                save_lora(t.bundle, path, "kohya", dtype, metadata)
            if s.lora_format in ("peft", "both"):
                peft_path = path.with_name(path.name.replace(".safetensors", ".peft.safetensors")) \
                    if s.lora_format == "both" else path
                save_lora(t.bundle, peft_path, "peft", dtype, metadata)
        else:
            if s.full_format in ("diffusers", "both"):
                from modules.model.saving import save_full_diffusers
                folder = path if s.full_format == "diffusers" else path.with_suffix("")
                save_full_diffusers(t.bundle, folder, dtype)
            if s.full_format in ("single_file", "both"):
                from modules.model.saving import save_full_single_file
                file = path if s.full_format == "single_file" else path.with_name(path.name + ".safetensors")
                save_full_single_file(t.bundle, file, dtype)
        log.info("Model saved: %s", path)
        t.emit("saved", path=str(path), step=t.global_step)

    @contextlib.contextmanager
    def _weights_for(self, purpose: str):
        """Samples show the EMA weights when EMA is on and chosen for saving."""
        t = self.t
        if t.ema is not None and t.cfg.save.ema_weights == "ema":
            with t.ema.swapped_in():
                yield
        else:
            yield
