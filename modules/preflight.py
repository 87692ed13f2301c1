"""Checks made once, before any training process starts.

A run that cannot work should fail in seconds with one message saying what to change, not after
every rank has loaded the model and each printed its own traceback. Both entry points run these
(`single_run.run_single` and `distributed/launch.launch`); the multi-process launcher adds what needs the world size
(the machine's GPUs, the port, whether the data fills a global batch).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from modules.config import RunPaths, TrainConfig


class PreflightError(RuntimeError):
    """A problem found before any training process started; the message says what to change. `in_window`: the
    same in the window's words where they differ (fields by their labels alone; the command line's message
    adds the path that `--config-value` takes)."""

    def __init__(self, message: str, in_window: str | None = None):
        super().__init__(message)
        self.in_window = in_window or message

    @classmethod
    def in_config_words(cls, template: str) -> "PreflightError":
        """The error of a message that names fields as `{training.batch_size}` (`field_labels.in_config_words`)."""
        from modules.config.field_labels import in_config_words
        return cls(in_config_words(template, with_paths=True), in_config_words(template, with_paths=False))


def check_writable(folder: Path, field: str) -> None:
    """Create `folder` if needed and make sure a file can be written in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise PreflightError(f"{field}: cannot write to {folder} ({e.strerror or e}); choose a folder you can "
                             "write to, or fix its permissions.") from None


def check_creatable(folder: Path, field: str) -> None:
    """`folder` exists and is writable, or could be created: its nearest existing ancestor is a writable
    folder. Nothing is created (a folder made for a run that then fails would be litter)."""
    folder = Path(folder).absolute()
    existing = folder
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise PreflightError(f"{field}: cannot create {folder}: {existing} is a file, not a folder; choose another "
                             "folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "write to" if existing == folder else f"create {folder} in"
        raise PreflightError(f"{field}: cannot {what} {existing} (permission denied); choose a folder you can "
                             "write to, or fix its permissions.")


def check_folders(cfg: TrainConfig) -> None:
    """The run folder (backups, samples, logs) and the cache must be writable before training starts, and
    the output folder must be one that can be made: it is written at the end, where a full disk still fails
    (a failed final save keeps the weights as a backup), but a path that can never work is said now."""
    paths = RunPaths(cfg)
    check_writable(paths.workspace, "general.workspace_dir")
    if cfg.data.cache_latents or cfg.data.cache_text_embeddings:
        field = "general.cache_dir" if cfg.general.cache_dir.strip() else "general.workspace_dir (its cache folder)"
        check_writable(paths.cache, field)
    field = "save.output_dir" if cfg.save.output_dir.strip() else "general.workspace_dir (its output folder)"
    check_creatable(paths.output_dir, field)


def check_model(cfg: TrainConfig) -> tuple[str, ...]:
    """The base model is readable; returns the families it may be (one, or SD 1.x and 2.x, whose folders
    look alike: only loading tells them apart)."""
    from modules.families.registry import BUILTIN_MODELS
    requested = cfg.model.model_type
    if cfg.model.base_model.strip() in BUILTIN_MODELS and not cfg.model.vae_path.strip():
        if cfg.multi_gpu.enabled and cfg.multi_gpu.nnodes > 1 and cfg.multi_gpu.node_rank > 0:
            build_builtin_model(cfg.model.base_model.strip())
        # built by rank 0 on first use, nothing on disk to check (and no need to import the model package)
        return (BUILTIN_MODELS[cfg.model.base_model.strip()],)
    from modules.model.probe import probe_families
    try:
        families = probe_families(cfg.model)
    except (ValueError, OSError) as e:
        raise PreflightError(str(e)) from None
    return (requested,) if requested in families else families


def check_lora_init(cfg: TrainConfig) -> None:
    """A `training.lora_init` file whose header is damaged is named now, not by every worker after the model
    loaded (58-122 s later, as safetensors' "header too large", naming neither the field nor the file)."""
    init = cfg.training.lora_init.strip()
    if cfg.training.method != "lora" or not init:
        return  # validation refuses the file with another method
    from modules.model.probe import probe_lora_file
    try:
        probe_lora_file(Path(init).expanduser())
    except ValueError as e:
        raise PreflightError(str(e)) from None


def check_family(cfg: TrainConfig, families: tuple[str, ...], context_parallel: int = 1) -> None:
    """What the model's family rules out, found before any worker loads the model: splitting each sample over
    `context_parallel` processes, and video clips in the data of a family that trains images only. Where
    `families` holds several (SD 1.x or 2.x), a problem all of them share."""
    from modules.config.validation import context_parallel_family_problem
    if not families:
        return
    unable = [context_parallel_family_problem(context_parallel, family) for family in families]
    if all(unable):
        raise PreflightError(unable[0])
    check_no_clips(cfg, families)


def check_no_clips(cfg: TrainConfig, families: tuple[str, ...]) -> None:
    """Clips in the concepts of an image family are refused (as the loaded family would, `check_clips`), each
    concept named: the scan would otherwise judge them by `data.video_frames`, a setting such a model never
    uses, and skip the short ones with a warning about it."""
    from modules.families.registry import FAMILIES
    if any(FAMILIES[family].video for family in families if family in FAMILIES):
        return
    from modules.data.concepts import clip_files
    for index, concept in enumerate(cfg.data.concepts):
        if not concept.enabled:
            continue
        try:
            clips = clip_files(concept)
        except ValueError:
            continue  # an unknown built-in dataset or an empty path: the scan names it
        if clips:
            names = ", ".join(c.name for c in clips[:3]) + (f" and {len(clips) - 3} more" if len(clips) > 3 else "")
            title = " or ".join(FAMILIES[family].title for family in families if family in FAMILIES)
            video = ", ".join(info.title for info in FAMILIES.values() if info.video)
            raise PreflightError(
                f"data.concepts[{index}].path: {concept.path!r} holds {len(clips)} video clip(s) ({names}), but "
                f"{cfg.model.base_model.strip()!r} is {title}, which trains images only; move the clips out of "
                f"the folder, or train a video model ({video}).")


def check_data(cfg: TrainConfig, data_world: int = 1, scan=None):
    """The scanned dataset (`modules.data.TrainDataset`, whose `scan()` the trainer takes instead of scanning
    again); refuses data that does not fill one training step of `data_world` processes' global batch, in the
    window's words, before any model loads (the sampler would refuse it only after loading: 48 s in on a CPU).
    `scan`: a scan made already. The scan's warnings (what it skipped, resized or ignored) are given here."""
    from modules.data import EmptyDatasetError, MaskError, build_dataset
    try:
        dataset = build_dataset(cfg.data, RunPaths(cfg).cache, cfg.general.seed, scan=scan)
    except (EmptyDatasetError, MaskError, FileNotFoundError) as e:
        raise PreflightError(str(e)) from None
    problem = batch_shortfall(cfg, dataset.buckets, dataset.bucket_sizes, data_world)
    if problem:
        raise PreflightError.in_config_words(problem)
    too_many = controls_beyond_the_model(cfg, dataset.control_count)
    if too_many:
        raise PreflightError(too_many)
    return dataset


def controls_beyond_the_model(cfg: TrainConfig, control_count: int) -> str | None:
    """Why the pairs have more control images per image than the model takes (Flux.1 Kontext: one), or None. A
    manifest's lines say how many it has, which validation does not read."""
    from modules.families.registry import FAMILIES, guess_family

    info = FAMILIES.get(guess_family(cfg.model.base_model, cfg.model.model_type))
    if info is None or not info.max_controls or control_count <= info.max_controls:
        return None
    return (f"data.concepts[].control: each image has {control_count} control images, but {info.title} takes at most "
            f"{info.max_controls}; give each image {info.max_controls} (in a manifest, one path as its \"control\").")


def batch_shortfall(cfg: TrainConfig, buckets: list[int], bucket_sizes: list[tuple[int, int]],
                    data_world: int) -> str | None:
    """Why the items (each one's bucket in `buckets`) give no training step, with fields as `{path}`
    (`PreflightError.in_config_words`); None when they give one. A step takes `gradient_accumulation_steps`
    global batches of `batch_size` x `data_world` items, each batch from one bucket (`full_global_batches`: as
    the sampler cuts them); only the changes that would help are offered."""
    from collections import Counter

    from modules.data.sampler import full_global_batches
    t = cfg.training
    global_batch = t.batch_size * data_world
    per_bucket = Counter(buckets)
    batches = full_global_batches(per_bucket.values(), global_batch)
    if batches >= t.gradient_accumulation_steps:
        return None
    wanted = [f"{{training.batch_size}} {t.batch_size}"]
    if data_world > 1:
        wanted.append(f"{data_world} processes")
    if t.gradient_accumulation_steps > 1:
        wanted.append(f"{{training.gradient_accumulation_steps}} {t.gradient_accumulation_steps}")
    items = len(buckets)
    sizes = ", ".join(f"{count} at {_bucket_name(bucket, bucket_sizes)}" for bucket, count in sorted(per_bucket.items()))
    several = len(per_bucket) > 1
    accumulation = t.gradient_accumulation_steps
    step = f"{global_batch} images" if accumulation == 1 else f"{accumulation} batches of {global_batch}"
    what = (f"The {items} training images (repeats counted) give {batches or 'no'} full batch"
            + ("" if batches == 1 else "es") + f" of {global_batch}"
            + (f" (with {{data.aspect_bucketing}} on, a batch comes from one bucket: {sizes})" if several else "")
            + f", and one step takes {step}: {' x '.join(wanted)}.")
    fixes = []
    if t.batch_size > 1:
        fixes.append("lower {training.batch_size}")
    if accumulation > 1:
        fixes.append("lower {training.gradient_accumulation_steps}")
    if data_world > 1:
        fixes.append("train on fewer GPUs (processes)")
    fixes += ["raise a concept's {data.concepts[].repeats}", "add images"]
    if several and cfg.data.aspect_bucketing and items >= accumulation * global_batch:
        fixes.append("turn off {data.aspect_bucketing} to put all images in one bucket")
    return f"{what} To train, {', '.join(fixes[:-1])} or {fixes[-1]}."


def _bucket_name(bucket: int, bucket_sizes: list[tuple[int, int]]) -> str:
    """A bucket as the message names it: its size (a clip's bucket, numbered after the images', says so)."""
    width, height = bucket_sizes[bucket % len(bucket_sizes)]
    return f"{width}x{height}" + (" (clips)" if bucket >= len(bucket_sizes) else "")


def build_builtin_model(name: str) -> None:
    """Build a built-in model on this machine now, in the launcher. Rank 0 builds it for the workers of its own
    machine; every other machine needs its own copy on its own disk, and a worker there cannot write it:
    transformers saves a text encoder only on rank 0 of a process group."""
    from modules.families.registry import family_of_builtin
    from modules.model.families import family
    family(family_of_builtin(name)).build_demo()


def preflight(cfg: TrainConfig, context_parallel: int = 1) -> None:
    """Every check that needs neither the world size nor a GPU; raises `PreflightError`. `context_parallel`:
    the processes that split each sample, as the launch resolved it (1 in one process)."""
    check_folders(cfg)
    families = check_model(cfg)
    check_lora_init(cfg)
    check_family(cfg, families, context_parallel)
