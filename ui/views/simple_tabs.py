"""The tabs that are plain forms: General, Model, Data, Sampling, Backup & Save."""
from __future__ import annotations

from pathlib import Path
from typing import Callable
import customtkinter as ctk

from modules.config import ConceptConfig, SamplePromptConfig

from ..applicability import takes_controls
from .caption_editor import CaptionsRow
from .dialogs import start_folder
from .fields import Binder
from .form import Form
from .list_editor import ListEditor
from .model_picker import ModelPicker
from .tooltip import Tooltip



def _scrolling(parent) -> ctk.CTkScrollableFrame:
    frame = ctk.CTkScrollableFrame(parent, fg_color="transparent")
    frame.pack(fill="both", expand=True)
    return frame


def build_general_tab(parent, binder: Binder, hint: Callable | None = None):
    """The General tab; `hint(master)` makes the getting-started box at its top (None: no box). Returns the box."""
    frame = _scrolling(parent)
    form = Form(frame, binder, tab="General")
    box = None
    if hint is not None:
        box = hint(frame)
        box.grid(row=form.row, column=0, columnspan=4, sticky="we", padx=10, pady=(8, 0))
        form.row += 1
    form.section("Run")
    form.field("general.workspace_dir", browse_kind="folder")
    form.field("general.cache_dir", browse_kind="folder")
    form.fields("general.seed", "general.device")
    form.section("Logging")
    form.fields("general.tensorboard")
    return box


def build_model_tab(parent, binder: Binder) -> ModelPicker:
    frame = _scrolling(parent)
    form = Form(frame, binder, tab="Model")
    picker = ModelPicker(frame, binder)
    picker.grid(row=form.row, column=0, columnspan=4, sticky="we", padx=10, pady=(8, 0))
    form.row += 1
    picker.sync()
    form.section("Base model")
    form.field("model.base_model", browse_kind="any", width=380)
    form.fields("model.model_type", "model.prediction_type")
    form.field("model.vae_path", browse_kind="any", width=380)
    # The transformer families' own (hidden for the other families, see ui/field_visibility.py).
    form.field("model.components_folder", browse_kind="folder", width=380)
    form.fields("model.t5_max_length", "model.text_max_length")
    form.field("model.wan_expert")  # Wan 2.2 A14B: which of its two experts trains
    form.section("Weight storage (frozen parts)")
    form.fields("model.unet_dtype", "model.text_encoder_dtype", "model.vae_dtype")
    # Qwen-Image and Z-Image: where their text encoder runs while it fills the text cache.
    form.field("model.text_encoder_placement")
    form.section("Advanced")
    form.field("model.config_overrides", width=380)
    return picker


def _ask_concept(binder: Binder) -> ConceptConfig | None:
    """A new concept from a folder dialog, opened beside the last concept's folder."""
    concepts = binder.model.cfg.data.concepts
    last = concepts[-1].path if concepts else ""
    near = "" if not last or last.startswith("builtin:") else str(Path(last).expanduser().absolute().parent)
    folder = binder.dialogs.ask_folder("Folder of training images", start_folder(near))
    return ConceptConfig(path=folder, name=Path(folder).name) if folder else None


def build_data_tab(parent, binder: Binder, gpu_count: Callable[[], int] = lambda: 0) -> ListEditor:
    """`gpu_count`: the GPUs auto-captioning may share its images over."""
    frame = _scrolling(parent)
    form = Form(frame, binder, tab="Data")
    form.section("Concepts")
    concepts = ListEditor(frame, binder, "data.concepts", "Data", "Concepts",
                          # A row fits the default window (1100 px); in a narrower one the rows scroll sideways.
                          [("path", "Folder", 170), ("name", "Name", 90), ("enabled", "On", 40),
                           ("repeats", "Repeats", 56), ("caption_extension", "Captions", 56),
                           ("recursive", "Sub-folders", 76), ("role", "Role", 104), ("loss_weight", "Loss weight", 76),
                           ("masks", "Masks", 44), ("unmasked_weight", "Unmasked", 64), ("control", "Control", 90)],
                          lambda: _ask_concept(binder), "Add concept folder",
                          pickers={"path": ("Folder...", "folder"), "control": ("Control...", "folder")},
                          # Control images: edit models only (and while the model is not known yet).
                          shown_when={"control": takes_controls})
    concepts.grid(row=form.row, column=0, columnspan=4, sticky="we", padx=6)
    form.row += 1
    concepts.pairs_line = _pairs_line(frame, binder, form.row)
    form.row += 1
    concepts.captions = CaptionsRow(frame, binder, gpu_count)
    concepts.captions.grid(row=form.row, column=0, columnspan=4, sticky="w", padx=6, pady=(0, 6))
    form.row += 1
    form.section("Images")
    form.fields("data.resolution", "data.aspect_bucketing", "data.bucket_step", "data.min_bucket_size",
                "data.max_bucket_size", "data.random_flip", "data.random_crop",
                # Clips' window: shown for video families only (their own fields, ui/field_visibility.py).
                "data.video_frames", "data.video_fps")
    form.section("Validation")
    form.fields("data.validation_fraction", "training.validation_every_n_steps")
    form.section("Captions")
    form.fields("data.caption_prefix", "data.caption_suffix", "data.caption_dropout", "data.shuffle_tags",
                "data.keep_tags", "data.tag_separator")
    form.section("Caching and loading")
    form.fields("data.cache_latents", "data.cache_text_embeddings", "data.num_workers",
                "data.pin_memory", "data.prefetch_factor")
    return concepts


def _pairs_line(frame, binder: Binder, row: int) -> ctk.CTkLabel:
    """Under the concepts: each edit concept's pairs counted, kept current as folders and control settings change."""
    from ..pair_count import pairs_text

    line = ctk.CTkLabel(frame, text="", anchor="w", justify="left", wraplength=700, text_color="gray60")
    line.grid(row=row, column=0, columnspan=4, sticky="w", padx=14, pady=(0, 4))
    Tooltip(line, "Edit models train on pairs: each image with its control image(s) of the same file name in the "
                  "concept's Control folder. Images without one are skipped; the count comes from the file names, "
                  "the run also checks that each image reads.")

    def show(path=None) -> None:
        if path is None or path.startswith("data.concepts"):
            text = pairs_text(binder.model.cfg)
            line.configure(text=text)
            line.grid() if text else line.grid_remove()

    binder.on_change.append(show)
    show()
    return line


def build_sampling_tab(parent, binder: Binder) -> ListEditor:
    frame = _scrolling(parent)
    form = Form(frame, binder, tab="Sampling")
    form.section("Prompts")
    prompts = ListEditor(frame, binder, "sampling.prompts", "Sampling", "Prompts",
                         [("prompt", "Prompt", 300), ("negative_prompt", "Negative prompt", 160),
                          ("seed", "Seed", 60), ("width", "Width", 60), ("height", "Height", 60),
                          ("control", "Control image", 160)],
                         lambda: SamplePromptConfig(prompt=""), "Add prompt", pickers={"control": ("Image...", "image")})
    prompts.grid(row=form.row, column=0, columnspan=4, sticky="we", padx=6)
    form.row += 1
    form.section("When")
    form.fields("sampling.every_n_steps", "sampling.every_n_epochs", "sampling.sample_at_start")
    form.section("How")
    form.fields("sampling.inference_steps", "sampling.guidance_scale", "sampling.video_frames", "sampling.cuda_graphs")
    return prompts


def _lora_readers_line(form: Form, binder: Binder) -> None:
    """Under the LoRA format: which programs apply the files the config writes (`ui/lora_readers.py`), kept
    current as the family, LoRA type, alpha, rank or format change."""
    from ..lora_readers import lora_readers_text

    line = ctk.CTkLabel(form.master, text="", anchor="w", justify="left", wraplength=560, text_color="gray60")
    line.grid(row=form.row, column=0, columnspan=4, sticky="w", padx=14, pady=(0, 4))
    form.row += 1
    binder.lora_readers_line = line

    def show(_path=None) -> None:
        text = lora_readers_text(binder.model.cfg)
        line.configure(text=text)
        if text:
            line.grid()
        else:
            line.grid_remove()
    binder.on_change.append(show)
    show()


def build_save_tab(parent, binder: Binder) -> None:
    form = Form(_scrolling(parent), binder, tab="Backup & Save")
    form.section("Output model")
    form.field("save.output_dir", browse_kind="folder")
    form.fields("save.output_name", "save.lora_format")
    _lora_readers_line(form, binder)
    form.fields("save.full_format", "save.save_dtype",
                "save.ema_weights", "save.save_every_n_epochs", "save.save_every_n_steps")
    form.section("Training-state backups")
    form.fields("save.backup_every_n_steps", "save.backup_every_n_epochs", "save.backup_every_n_minutes",
                "save.rolling_backup_count",
                "save.backup_on_stop")
