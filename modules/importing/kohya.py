"""kohya's configs -> Tandem (`config_import.py` says how results are reported).

Two spellings of the same settings:
- sd-scripts `.toml` (`--config_file`): the script's argument names (`network_dim`, `optimizer_type`,
  `max_train_epochs`, ...), optionally grouped in tables, which sd-scripts flattens; a dataset config's
  `[[datasets]]` / `[[datasets.subsets]]` (`image_dir`, `num_repeats`, `is_reg`, ...) is read too.
- the kohya_ss GUI's `.json`: mostly the same names, some its own (`LoRA_type`, `epoch`, `optimizer`,
  `max_resolution`, `lr_warmup` in percent), numbers often as strings.
Image folders follow kohya's `<repeats>_<name>` sub-folders of `train_data_dir` / `reg_data_dir` (listed,
not read). A prompt file that `sample_prompts` names is read only when the user names it too (`--samples`).
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any, Callable

from modules.config.errors import ConfigError

from .files import read_lines
from .result import ImportResult, is_off, number, resolution, whole

GUI_MARKERS = ("LoRA_type", "pretrained_model_name_or_path", "train_data_dir", "max_resolution")

OPTIMIZERS = {"adamw": "adamw", "adamw8bit": "adamw_8bit", "adafactor": "adafactor", "sgdnesterov": "sgd",
              "sgd": "sgd", "prodigy": "prodigy", "adamwschedulefree": "adamw_schedule_free",
              "schedulefree.adamwschedulefree": "adamw_schedule_free", "bitsandbytes.optim.adamw8bit": "adamw_8bit"}
"""kohya optimizer name (lower case) -> optimizer.name."""
SCHEDULERS = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear", "cosine": "cosine",
              "cosine_with_restarts": "cosine_with_restarts", "polynomial": "polynomial",
              "warmup_stable_decay": "warmup_stable_decay"}
PRECISIONS = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}
SAVE_DTYPES = {"float": "fp32", "fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}
OPTIMIZER_ARGS = {"weight_decay": ("optimizer.weight_decay", float), "eps": ("optimizer.eps", float),
                  "momentum": ("optimizer.momentum", float), "d_coef": ("optimizer.prodigy_d_coef", float),
                  "d0": ("optimizer.prodigy_d0", float), "growth_rate": ("optimizer.prodigy_growth_rate", float),
                  "slice_p": ("optimizer.prodigy_slice_p", int), "r": ("optimizer.schedule_free_r", float),
                  "weight_lr_power": ("optimizer.schedule_free_weight_lr_power", float)}
OPTIMIZER_FLAGS = {"use_bias_correction": "optimizer.prodigy_use_bias_correction",
                   "safeguard_warmup": "optimizer.prodigy_safeguard_warmup"}


def _flag(value: Any) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes") if isinstance(value, str) else bool(value)


def _text(value: Any) -> str:
    return str(value).strip()


Simple = tuple[str, Callable[[Any], Any]]
SIMPLE: dict[str, Simple] = {
    "pretrained_model_name_or_path": ("model.base_model", _text),
    "vae": ("model.vae_path", _text),
    "output_dir": ("save.output_dir", _text),
    "output_name": ("save.output_name", _text),
    "seed": ("general.seed", whole),
    "enable_bucket": ("data.aspect_bucketing", _flag),
    "bucket_reso_steps": ("data.bucket_step", whole),
    "min_bucket_reso": ("data.min_bucket_size", whole),
    "max_bucket_reso": ("data.max_bucket_size", whole),
    "flip_aug": ("data.random_flip", _flag),
    "random_crop": ("data.random_crop", _flag),
    "caption_dropout_rate": ("data.caption_dropout", number),
    "shuffle_caption": ("data.shuffle_tags", _flag),
    "keep_tokens": ("data.keep_tags", whole),
    "caption_separator": ("data.tag_separator", str),
    "caption_prefix": ("data.caption_prefix", str),
    "caption_suffix": ("data.caption_suffix", str),
    "cache_latents": ("data.cache_latents", _flag),
    "cache_text_encoder_outputs": ("data.cache_text_embeddings", _flag),
    "max_data_loader_n_workers": ("data.num_workers", whole),
    "network_dim": ("training.lora_rank", whole),
    "network_alpha": ("training.lora_alpha", number),
    "network_dropout": ("training.lora_dropout", number),
    "factor": ("training.lokr_factor", whole),
    "network_weights": ("training.lora_init", _text),
    "lora_network_weights": ("training.lora_init", _text),
    "learning_rate": ("training.learning_rate", number),
    "lr_scheduler_num_cycles": ("training.lr_cycles", whole),
    "lr_scheduler_power": ("training.lr_power", number),
    "max_train_epochs": ("training.epochs", whole),
    "epoch": ("training.epochs", whole),
    "max_train_steps": ("training.max_steps", whole),
    "train_batch_size": ("training.batch_size", whole),
    "gradient_accumulation_steps": ("training.gradient_accumulation_steps", whole),
    "gradient_checkpointing": ("training.gradient_checkpointing", _flag),
    "max_grad_norm": ("training.max_grad_norm", number),
    "noise_offset": ("training.offset_noise", number),
    "min_snr_gamma": ("training.min_snr_gamma", number),
    "sample_every_n_epochs": ("sampling.every_n_epochs", whole),
    "sample_every_n_steps": ("sampling.every_n_steps", whole),
    "save_every_n_epochs": ("save.save_every_n_epochs", whole),
    "save_every_n_steps": ("save.save_every_n_steps", whole),
}
"""kohya key -> (Tandem field, converter) where the meaning is the same."""

AS_TANDEM_DOES = {"cache_latents_to_disk": True, "persistent_data_loader_workers": True, "sdpa": True,
                  "save_model_as": "safetensors"}
"""Settings whose value is what Tandem always does (the latent cache is on disk, loader workers persist,
attention is PyTorch's SDPA): nothing to report."""
REASONS = {"xformers": "Tandem uses PyTorch's scaled-dot-product attention",
           "mem_eff_attn": "Tandem uses PyTorch's scaled-dot-product attention",
           "save_state": "Tandem writes backups: save.backup_every_n_epochs or save.backup_every_n_steps",
           "logging_dir": "TensorBoard logs go to the workspace folder",
           "log_with": "TensorBoard logs go to the workspace folder: general.tensorboard",
           "full_fp16": "Tandem keeps trained weights in fp32", "full_bf16": "Tandem keeps trained weights in fp32",
           "rank_dropout": "peft's LoRA has input dropout only: training.lora_dropout",
           "module_dropout": "peft's LoRA has input dropout only: training.lora_dropout",
           "conv_dim": "adapters on convolutions take training.lora_rank",
           "conv_alpha": "adapters on convolutions take training.lora_alpha"}
"""Why some common kohya settings have no counterpart."""

KNOWN_DEFAULTS = {"max_timestep": 1000, "min_timestep": 0, "num_cpu_threads_per_process": 2,
                  "max_token_length": 75, "prior_loss_weight": 1.0, "caption_extension": ".txt", "unit": 1,
                  "save_model_as": "safetensors", "train_on_input": True, "noise_offset_type": "Original",
                  "lr_scheduler_num_cycles": 1, "lr_scheduler_power": 1, "vae_batch_size": 0}
"""Settings whose value here is what Tandem does anyway: not worth listing as unmapped."""


def looks_like_gui(data: dict) -> bool:
    return any(key in data for key in GUI_MARKERS)


def from_sd_scripts(path: Path, data: dict, named: dict[str, Path] | None = None) -> ImportResult:
    """An sd-scripts `.toml`: tables are flattened as sd-scripts does (one level), `[[datasets]]` read.
    `named`: the files the user named (`samples`: the prompt file)."""
    _refuse_concepts_file(path, named or {})
    flat: dict[str, Any] = {}
    datasets = data.pop("datasets", None)
    general = data.pop("general", None)  # dataset configs keep shared subset settings here
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    result = ImportResult(path, "kohya sd-scripts")
    if isinstance(general, dict):
        flat = {**general, **flat}
    if isinstance(datasets, list):
        _datasets(result, datasets, flat, general if isinstance(general, dict) else {})
    _map(result, flat, path, gui=False, named=named or {})
    return result


def from_gui(path: Path, data: dict, named: dict[str, Path] | None = None) -> ImportResult:
    _refuse_concepts_file(path, named or {})
    result = ImportResult(path, "kohya_ss GUI")
    _map(result, dict(data), path, gui=True, named=named or {})
    return result


def _refuse_concepts_file(path: Path, named: dict[str, Path]) -> None:
    if "concepts" in named:
        raise ConfigError(["--concepts reads OneTrainer's concepts file; a kohya config names its image folders "
                           "itself (train_data_dir, [[datasets]]): leave --concepts out."], str(path))


def _map(result: ImportResult, data: dict, path: Path, gui: bool, named: dict[str, Path]) -> None:
    data = {k: v for k, v in data.items() if not (k in KNOWN_DEFAULTS and _same(v, KNOWN_DEFAULTS[k]))
            and not (k in AS_TANDEM_DOES and _same(v, AS_TANDEM_DOES[k]))}
    _family(result, data)  # before _network, which takes network_module (a Flux or SD3 module says the family)
    _network(result, data, gui)
    _folders(result, data, path)
    for key in ("resolution", "max_resolution"):
        if key in data:
            value = data.pop(key)
            found = resolution(value)
            if found is None:
                result.skip(key, value, "not a resolution")
                continue
            result.set("data.resolution", found[0])
            if found[1]:
                result.notes.append(f"{key} {value!r}: Tandem trains buckets of about that area; data.resolution "
                                    f"{found[0]} is the side of the square of the same area.")
    if whole(data.get("max_train_steps")):  # before the schedule: a warm-up share needs the step count
        result.set("training.max_steps", whole(data.pop("max_train_steps")))
    _schedule(result, data, gui)
    _optimizer(result, data, gui)
    _precision(result, data)
    _clip_skip(result, data)
    _samples(result, data, path, gui, named)
    if "unet_lr" in data:
        value = data.pop("unet_lr")
        if number(value):
            result.set("training.learning_rate", number(value))  # the UNet's own rate wins over learning_rate
            data.pop("learning_rate", None)
    _text_encoder(result, data, gui)  # after the optimizer and the rates: Prodigy takes one rate
    for key, value in data.items():
        if key in SIMPLE:
            target, convert = SIMPLE[key]
            converted = convert(value)
            if converted is None or (converted == "" and key not in ("caption_prefix", "caption_suffix")):
                if not is_off(value):
                    result.skip(key, value, "not a value Tandem can read")
                continue
            if key in ("network_weights", "lora_network_weights") and not converted:
                continue
            if target == "training.learning_rate" and result.get(target) is not None:
                continue  # unet_lr was set
            result.set(target, converted)
        else:
            result.skip(key, value, REASONS.get(key, ""))


def _same(value: Any, default: Any) -> bool:
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return number(value) == default
    return value == default or str(value).lower() == str(default).lower()


def _network(result: ImportResult, data: dict, gui: bool) -> None:
    """Method and LoRA type from network_module / network_args (sd-scripts) or LoRA_type (GUI)."""
    args = _args(data.pop("network_args", None))
    module = str(data.pop("network_module", "") or "")
    lora_type = data.pop("LoRA_type", None) if gui else None
    if gui and lora_type is None:
        result.set("training.method", "full")  # the GUI's Dreambooth / Fine-tune tabs save no LoRA_type
    elif not gui and not module:
        result.set("training.method", "full")
        result.notes.append("no network_module: read as a full fine-tune (sd-scripts' train_db.py / fine_tune.py).")
    else:
        result.set("training.method", "lora")
    algo = args.pop("algo", "")
    kind = {"standard": "lora", "lyCORIS/LoHa".lower(): "loha", "lycoris/lokr": "lokr", "lycoris/locon": "locon"}.get(
        str(lora_type).lower()) if lora_type else None
    if module == "networks.lora":
        kind = "lora"
    elif module == "lycoris.kohya":
        kind = {"lora": "lora", "locon": "locon", "loha": "loha", "lokr": "lokr"}.get(algo, algo or "lora")
    elif module and module != "networks.lora":
        result.skip("network_module", module, "Tandem trains LoRA, DoRA, LoHa and LoKr through peft")
    if kind == "locon":
        result.notes.append("LoCon (LoRA on convolutions too): imported as LoRA; add conv layers such as "
                            "proj_in, conv1, conv2 to training.lora_target_modules to train them.")
        kind = "lora"
    dora = _flag(data.pop("dora_wd", False)) or _flag(args.pop("dora_wd", False))
    if dora and kind in ("lora", None):
        kind = "dora"
    if kind in ("lora", "dora", "loha", "lokr"):
        result.set("training.lora_type", kind)
    elif lora_type is not None and kind is None:
        result.skip("LoRA_type", lora_type, "Tandem trains LoRA, DoRA, LoHa and LoKr")
    if "factor" in args:
        data["factor"] = args.pop("factor")
    for name, value in (("conv_dim", args.pop("conv_dim", None)), ("conv_alpha", args.pop("conv_alpha", None))):
        if value is not None:
            result.skip(f"network_args {name}", value, "adapters on convolutions take training.lora_rank")
    for name, value in args.items():
        result.skip(f"network_args {name}", value)


def _text_encoder(result: ImportResult, data: dict, gui: bool) -> None:
    """Whether the text encoder trains, and at which rate. kohya's LoRA scripts train it unless told not to
    (`network_train_unet_only`; cached text-encoder outputs require that), and sd-scripts leaves out a part
    whose rate is 0, while the kohya_ss GUI passes no rate for 0 (the learning rate applies); Tandem trains
    it only when `training.train_text_encoder` says so, so a LoRA import always sets that. A full fine-tune
    trains it as the config says (`train_text_encoder`). `text_encoder_lr` is mapped where the text encoder
    trains and listed as not imported, with the reason, where it does not."""
    unet_only = _flag(data.pop("network_train_unet_only", False))
    explicit = _flag(data.pop("train_text_encoder")) if "train_text_encoder" in data else None
    rate_given = "text_encoder_lr" in data and str(data["text_encoder_lr"]).strip() != ""
    rate = number(data.pop("text_encoder_lr", None))
    if result.get("training.method") == "lora":
        cached = _flag(data.get("cache_text_encoder_outputs", False))
        zero_rate = rate_given and rate == 0 and not gui
        trains = not (unet_only or cached or zero_rate)
        result.set("training.train_text_encoder", trains)
        if trains and explicit is None:
            result.notes.append("the text encoder trains (kohya's LoRA scripts train it unless "
                                "network_train_unet_only is set): training.train_text_encoder is on.")
        why_not = ("network_train_unet_only is set" if unet_only else
                   "cache_text_encoder_outputs needs it frozen" if cached else "its rate is 0")
    else:
        trains = bool(explicit)
        result.set("training.train_text_encoder", trains)
        why_not = "train_text_encoder is off"
    if rate is None:
        if rate_given and not is_off(rate):
            result.skip("text_encoder_lr", rate, "not a value Tandem can read")
        return
    learning_rate = result.get("training.learning_rate", number(data.get("learning_rate")))
    if trains and rate and result.get("optimizer.name") == "prodigy" and rate != learning_rate:
        result.skip("text_encoder_lr", rate, "Prodigy estimates one step size for all weights in Tandem: the text "
                                             "encoder trains at training.learning_rate")
    elif trains:
        if rate:  # 0 in Tandem is the learning rate, as a GUI's 0 is; sd-scripts' 0 does not train
            result.set("training.text_encoder_learning_rate", rate)
    elif rate:
        result.skip("text_encoder_lr", rate, f"the text encoder does not train: {why_not}")


def _args(raw: Any) -> dict[str, str]:
    """kohya's `key=value` argument lists (a list, or one string with spaces) as a dict."""
    if raw is None or raw == "":
        return {}
    try:
        items = raw if isinstance(raw, list) else shlex.split(str(raw))
    except ValueError:  # an unclosed quote: kohya would refuse it; read it word by word
        items = str(raw).split()
    found = {}
    for item in items:
        key, _, value = str(item).partition("=")
        found[key.strip()] = value.strip()
    return found


OTHER_FAMILY_MARKERS = ("flux1_checkbox", "sd3_checkbox", "ae", "clip_l", "clip_g", "t5xxl")
"""Settings of kohya's Flux.1 and SD3 scripts (and the kohya_ss GUI's boxes for them): a config with one of
these set is not SD 1.x, and its family is left to the model (`auto`)."""


def _family(result: ImportResult, data: dict) -> None:
    """kohya's scripts know the family from their flags, not from the model: `sdxl`, `v2`, else SD 1.x - unless
    the config is one of the Flux.1 or SD3 scripts'. The window then shows the family's own settings only."""
    if _flag(data.pop("sdxl", False)):
        result.set("model.model_type", "sdxl")
    if _flag(data.pop("v2", False)):
        result.set("model.model_type", "sd2")
    module = str(data.get("network_module", "") or "")
    other = any(not is_off(data.get(key)) for key in OTHER_FAMILY_MARKERS) or "flux" in module or "sd3" in module
    if result.get("model.model_type") is None and not other:
        result.set("model.model_type", "sd1")
    if _flag(data.pop("v_parameterization", False)):
        result.set("model.prediction_type", "v_prediction")


def _folders(result: ImportResult, data: dict, config_path: Path) -> None:
    concepts = list(result.get("data.concepts", []))
    extension = str(data.pop("caption_extension", ".txt") or ".txt")
    if result.get("data.concepts"):  # a dataset config's subsets name their own extension
        data.pop("caption_extension", None)
    prior_weight = number(data.pop("prior_loss_weight", 1.0)) or 1.0
    for key, role in (("train_data_dir", "train"), ("reg_data_dir", "regularisation")):
        folder = str(data.pop(key, "") or "").strip()
        if folder:
            concepts += _kohya_folder(folder, role, extension, prior_weight if role == "regularisation" else 1.0, result)
    for concept in concepts:
        concept.setdefault("caption_extension", extension)
    if concepts:
        result.set("data.concepts", concepts)


def _kohya_folder(folder: str, role: str, extension: str, loss_weight: float, result: ImportResult) -> list[dict]:
    """kohya's `<repeats>_<name>` sub-folders as concepts; the folder itself when it has none (or is absent)."""
    root = Path(folder).expanduser()
    try:
        subfolders = sorted(p for p in root.iterdir() if p.is_dir() and re.match(r"^\d+_", p.name)) if root.is_dir() else []
    except OSError:  # not readable here: imported as the folder itself, as when it is absent
        subfolders = []
    if not subfolders:
        if not root.is_dir():
            result.notes.append(f"{folder}: not found here, so its <repeats>_<name> sub-folders could not be read; "
                                "imported as one concept with 1 repeat (set the concepts in the Data tab).")
        return [{"path": folder, "name": root.name, "role": role, "repeats": 1, "caption_extension": extension,
                 "loss_weight": loss_weight}]
    concepts = []
    for sub in subfolders:
        repeats, _, name = sub.name.partition("_")
        concepts.append({"path": str(sub), "name": name, "role": role, "repeats": max(1, int(repeats)),
                         "caption_extension": extension, "loss_weight": loss_weight})
    return concepts


def _datasets(result: ImportResult, datasets: list, flat: dict, general: dict) -> None:
    """A dataset config's `[[datasets]]` / `[[datasets.subsets]]` (`[general]` holds their shared settings).
    Caption settings are global in Tandem: the first subset's count, a difference is said."""
    concepts = []
    for dataset in datasets:
        if not isinstance(dataset, dict):
            continue
        shared = {k: v for k, v in dataset.items() if k != "subsets"}
        for key in ("resolution", "enable_bucket", "min_bucket_reso", "max_bucket_reso", "bucket_reso_steps",
                    "batch_size"):
            if key in shared:
                flat.setdefault("train_batch_size" if key == "batch_size" else key, shared[key])
        subsets = dataset.get("subsets", [])
        for subset in subsets if isinstance(subsets, list) else [subsets]:
            if not isinstance(subset, dict):
                result.skip("datasets.subsets", subset, "not a subset (a table with image_dir)")
                continue
            merged = {**general, **shared, **subset}
            folder = str(merged.get("image_dir", "")).strip()
            if not folder:
                result.skip("datasets.subsets", subset, "no image_dir (fine-tuning metadata files are not read)")
                continue
            concepts.append({"path": folder, "name": Path(folder).name,
                             "role": "regularisation" if _flag(merged.get("is_reg", False)) else "train",
                             "repeats": max(1, whole(merged.get("num_repeats", 1)) or 1),
                             "caption_extension": str(merged.get("caption_extension", ".txt"))})
            for key in ("shuffle_caption", "keep_tokens", "caption_prefix", "caption_suffix", "flip_aug",
                        "random_crop", "caption_dropout_rate", "caption_separator"):
                if key not in merged:
                    continue
                if key in flat and flat[key] != merged[key]:
                    result.notes.append(f"{key}: the subsets differ ({flat[key]!r}, {merged[key]!r}) and Tandem has one "
                                        f"setting for all concepts; {flat[key]!r} was taken.")
                flat.setdefault(key, merged[key])
            if "caption_prefix" in subset and len(datasets[0].get("subsets", [])) > 1:
                result.notes.append(f"caption_prefix {subset['caption_prefix']!r} of {folder}: Tandem puts the prefix "
                                    "before the captions of every concept.")
            if "class_tokens" in merged:
                result.skip("datasets.subsets class_tokens", merged["class_tokens"],
                            "captions come from the caption files; use data.caption_prefix for a trigger word")
    if concepts:
        result.set("data.concepts", concepts)


def _schedule(result: ImportResult, data: dict, gui: bool) -> None:
    if "lr_scheduler" in data:
        value = str(data.pop("lr_scheduler")).strip()
        if value.lower() in SCHEDULERS:
            result.set("training.lr_scheduler", SCHEDULERS[value.lower()])
        else:
            result.skip("lr_scheduler", value, "not one of Tandem's schedules")
    if "lr_warmup_steps" in data:
        steps = number(data.pop("lr_warmup_steps"))
        if steps is not None and 0 < steps < 1:
            _warmup_share(result, steps, "lr_warmup_steps")
        elif steps:
            result.set("training.lr_warmup_steps", int(steps))
    if gui and "lr_warmup" in data:
        percent = number(data.pop("lr_warmup"))
        if percent:
            _warmup_share(result, percent / 100, "lr_warmup")


def _warmup_share(result: ImportResult, share: float, key: str) -> None:
    total = whole(result.get("training.max_steps"))
    if total:
        result.set("training.lr_warmup_steps", int(round(share * total)))
        result.notes.append(f"{key}: {share:.0%} of the steps became training.lr_warmup_steps "
                            f"{int(round(share * total))}.")
    else:
        result.skip(key, f"{share:.0%} of the steps", "Tandem's warm-up is in steps; set training.lr_warmup_steps")


def _optimizer(result: ImportResult, data: dict, gui: bool) -> None:
    for key in ("optimizer_type", "optimizer"):
        if key in data:
            value = str(data.pop(key)).strip()
            name = OPTIMIZERS.get(value.lower())
            if name:
                result.set("optimizer.name", name)
            elif value:
                result.skip(key, value, "Tandem has adamw, adamw_8bit, adafactor, sgd, prodigy, adamw_schedule_free")
    for name, value in _args(data.pop("optimizer_args", None)).items():
        if name == "betas":
            betas = [number(b) for b in value.replace("(", "").replace(")", "").split(",")]
            if len(betas) == 2 and None not in betas:
                result.set("optimizer.beta1", betas[0])
                result.set("optimizer.beta2", betas[1])
                continue
        if name in OPTIMIZER_ARGS and number(value) is not None:
            target, kind = OPTIMIZER_ARGS[name]
            result.set(target, kind(number(value)))
        elif name in OPTIMIZER_FLAGS:
            result.set(OPTIMIZER_FLAGS[name], _flag(value))
        elif name == "decouple" and _flag(value):
            continue  # Tandem's Prodigy always decouples weight decay
        else:
            result.skip(f"optimizer_args {name}", value)


def _precision(result: ImportResult, data: dict) -> None:
    if "mixed_precision" in data:
        value = str(data.pop("mixed_precision")).lower()
        if value in PRECISIONS:
            result.set("training.precision", PRECISIONS[value])
        else:
            result.skip("mixed_precision", value)
    if "save_precision" in data:
        value = str(data.pop("save_precision")).lower()
        if value in SAVE_DTYPES:
            result.set("save.save_dtype", SAVE_DTYPES[value])
        else:
            result.skip("save_precision", value)


def _clip_skip(result: ImportResult, data: dict) -> None:
    if "clip_skip" not in data:
        return
    value = whole(data.pop("clip_skip")) or 0
    if value >= 2 and result.get("model.model_type") == "sdxl":
        result.notes.append(f"clip_skip {value}: sd-scripts ignores clip skip for SDXL, so training.clip_skip "
                            "stays 0 (SDXL's own penultimate layer).")
    elif value >= 2:
        result.set("training.clip_skip", value)


def _prompt_file(value: str, config_path: Path) -> Path | None:
    """The prompt file `sample_prompts` names, if there is one (found by looking, never by reading)."""
    if "\n" in value or " --" in value:
        return None
    for candidate in (Path(value).expanduser(), config_path.parent / value):
        if candidate.is_file():
            return candidate.absolute()
    return None


def _samples(result: ImportResult, data: dict, config_path: Path, gui: bool, named: dict[str, Path]) -> None:
    """sd-scripts' prompt file: one prompt per line with `--n` negative, `--w`/`--h` size, `--d` seed
    (`--l` scale and `--s` steps apply to all samples in Tandem: the first line's are taken). The file the
    config names is read only when the user names it (`named["samples"]`); the GUI keeps the text itself."""
    value = str(data.pop("sample_prompts", "") or "").strip()
    if "samples" in named:
        lines = read_lines(named["samples"], "the --samples file")
    elif not value:
        return
    elif _prompt_file(value, config_path) is not None:
        result.unread["samples"] = _prompt_file(value, config_path)  # the report says how to read it
        return
    elif gui or "\n" in value or " --" in value:  # the kohya_ss GUI keeps the prompts' text itself
        lines = value.splitlines()
    else:
        result.skip("sample_prompts", value, "a .txt prompt file that is not here")
        return
    prompts = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        text, *options = re.split(r"\s+--(?=[a-z]\s)", " " + line)
        prompt: dict[str, Any] = {"prompt": text.strip()}
        for option in options:
            flag, _, argument = option.partition(" ")
            argument = argument.strip()
            if flag == "n":
                prompt["negative_prompt"] = argument
            elif flag in ("w", "h", "d") and whole(argument) is not None:
                prompt[{"w": "width", "h": "height", "d": "seed"}[flag]] = whole(argument)
            elif flag == "l" and number(argument) is not None:
                result.set("sampling.guidance_scale", number(argument))
            elif flag == "s" and whole(argument):
                result.set("sampling.inference_steps", whole(argument))
        prompts.append(prompt)
    if prompts:
        result.set("sampling.prompts", prompts)
