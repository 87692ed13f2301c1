"""OneTrainer's config (`.json`, as its Save / export writes it) -> Tandem (`config_import.py` reports).

OneTrainer keeps enums in upper case (`"training_method": "LORA"`, `"model_type":
"STABLE_DIFFUSION_XL_10_BASE"`), per-part settings in objects (`unet`, `transformer`, `text_encoder`,
`vae`: `train`, `learning_rate`, `weight_dtype`), the optimizer in `optimizer`, and concepts and sample
prompts inline (`concepts`, `samples`) or in the files `concept_file_name` / `sample_definition_file_name`
name. Those files are read only when the user names them too (`--concepts`, `--samples`): a config from
elsewhere could name any file. Otherwise the report says which file it names and how to include it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from modules.config.errors import ConfigError

from .files import read_file
from .result import ImportResult, number, resolution, whole

MARKERS = ("training_method", "base_model_name", "output_model_destination", "concept_file_name")
FAMILIES = {"STABLE_DIFFUSION_15": "sd1", "STABLE_DIFFUSION_20": "sd2", "STABLE_DIFFUSION_20_BASE": "sd2",
            "STABLE_DIFFUSION_21": "sd2", "STABLE_DIFFUSION_21_BASE": "sd2", "STABLE_DIFFUSION_XL_10_BASE": "sdxl",
            "STABLE_DIFFUSION_3": "sd3", "STABLE_DIFFUSION_35": "sd3", "FLUX_DEV_1": "flux"}
DTYPES = {"FLOAT_32": "fp32", "FLOAT_16": "fp16", "BFLOAT_16": "bf16"}
SCHEDULERS = {"CONSTANT": "constant", "LINEAR": "linear", "COSINE": "cosine",
              "COSINE_WITH_RESTARTS": "cosine_with_restarts", "COSINE_WITH_HARD_RESTARTS": "cosine_with_restarts"}
OPTIMIZERS = {"ADAMW": "adamw", "ADAMW_8BIT": "adamw_8bit", "ADAFACTOR": "adafactor", "SGD": "sgd",
              "PRODIGY": "prodigy", "SCHEDULE_FREE_ADAMW": "adamw_schedule_free"}
OPTIMIZER_FIELDS = {"weight_decay": "weight_decay", "beta1": "beta1", "beta2": "beta2", "eps": "eps",
                    "momentum": "momentum", "fused": "fused", "d_coef": "prodigy_d_coef", "d0": "prodigy_d0",
                    "growth_rate": "prodigy_growth_rate", "use_bias_correction": "prodigy_use_bias_correction",
                    "safeguard_warmup": "prodigy_safeguard_warmup", "slice_p": "prodigy_slice_p",
                    "r": "schedule_free_r", "weight_lr_power": "schedule_free_weight_lr_power"}
ROLES = {"STANDARD": "train", "VALIDATION": "validation", "PRIOR_PREDICTION": "regularisation"}
DENOISER_PARTS = ("unet", "transformer", "prior")
TEXT_PARTS = ("text_encoder", "text_encoder_2", "text_encoder_3")
IGNORED = {"__version", "debug_mode", "debug_dir", "optimizer_defaults", "concept_file_name",
           "sample_definition_file_name", "train_device", "temp_device", "secrets", "cloud", "concept_stats"}
"""Keys about OneTrainer itself (its own version, debug output, devices, cloud): nothing to map or report."""
AS_TANDEM_DOES = {"mse_strength": 1.0, "attention_mechanism": "SDP", "vb_loss_strength": 1.0}
"""Settings whose value is what Tandem does (a mean-squared-error loss, PyTorch's attention): not reported."""


def looks_like(data: dict) -> bool:
    return "__version" in data or sum(key in data for key in MARKERS) >= 2 or str(
        data.get("model_type", "")).isupper()


def from_onetrainer(path: Path, data: dict, named: dict[str, Path] | None = None) -> ImportResult:
    """`named`: the files the user named for the concepts and samples (`concepts`, `samples`)."""
    named = named or {}
    result = ImportResult(path, "OneTrainer")
    data = {k: v for k, v in data.items() if k not in IGNORED or k in ("concept_file_name",
                                                                         "sample_definition_file_name")}
    _method(result, data)
    _parts(result, data)
    _concepts(result, data, path, named)
    _samples(result, data, path, named)
    _schedule(result, data)
    _optimizer(result, data.pop("optimizer", None))
    _every(result, data, "backup_after", {"EPOCH": "save.backup_every_n_epochs", "STEP": "save.backup_every_n_steps",
                                          "MINUTE": "save.backup_every_n_minutes"})
    _every(result, data, "save_every", {"EPOCH": "save.save_every_n_epochs", "STEP": "save.save_every_n_steps"})
    _every(result, data, "sample_after", {"EPOCH": "sampling.every_n_epochs", "STEP": "sampling.every_n_steps"})
    _output(result, data)
    simple = {"workspace_dir": "general.workspace_dir", "cache_dir": "general.cache_dir",
              "tensorboard": "general.tensorboard", "base_model_name": "model.base_model",
              "epochs": "training.epochs", "batch_size": "training.batch_size",
              "gradient_accumulation_steps": "training.gradient_accumulation_steps",
              "learning_rate": "training.learning_rate", "ema_decay": "training.ema_decay",
              "dataloader_threads": "data.num_workers", "aspect_ratio_bucketing": "data.aspect_bucketing",
              "latent_caching": "data.cache_latents", "lora_rank": "training.lora_rank",
              "lora_alpha": "training.lora_alpha", "dropout_probability": "training.lora_dropout",
              "offset_noise_weight": "training.offset_noise", "rolling_backup_count": "save.rolling_backup_count",
              "multi_gpu": "multi_gpu.enabled",
              "device_indexes": "multi_gpu.device_indexes", "lora_model_name": "training.lora_init",
              "lokr_decompose_factor": "training.lokr_factor"}
    for key, value in data.items():
        if key in IGNORED or AS_TANDEM_DOES.get(key, object()) == value:
            continue
        if key in simple:
            if value is None or (key == "lora_model_name" and not value):
                continue
            result.set(simple[key], value)
        elif key == "clip_grad_norm":
            result.set("training.max_grad_norm", _float(result, key, value or 0.0))
        elif key == "ema":
            result.set("training.ema", str(value).upper() != "OFF")
        elif key == "compile":
            result.set("training.compile", "on" if value else "off")
        elif key == "train_dtype":
            _choice(result, key, value, DTYPES, "training.precision")
        elif key == "output_dtype":
            _choice(result, key, value, DTYPES, "save.save_dtype")
        elif key == "resolution":
            found = resolution(value)
            if found and not found[1]:
                result.set("data.resolution", found[0])
            else:
                result.skip(key, value, "Tandem trains one resolution")
        elif key == "text_encoder_layer_skip":
            if whole(value):
                result.set("training.clip_skip", whole(value) + 1)  # OneTrainer counts skipped layers
        elif key == "loss_weight_fn":
            if str(value).upper() == "MIN_SNR_GAMMA":
                result.set("training.min_snr_gamma",
                           _float(result, "loss_weight_strength", data.get("loss_weight_strength", 5.0)))
            elif str(value).upper() != "CONSTANT":
                result.skip(key, value, "Tandem weights the loss by min-SNR only")
        elif key == "loss_weight_strength":
            continue  # read with loss_weight_fn
        elif key == "masked_training":
            if value:
                for concept in result.get("data.concepts", []):
                    concept["masks"] = True
        elif key == "unmasked_weight":
            if data.get("masked_training"):
                for concept in result.get("data.concepts", []):
                    concept["unmasked_weight"] = _float(result, key, value)
        elif key == "gradient_checkpointing":
            result.set("training.gradient_checkpointing", str(value).upper() != "OFF" and value is not False)
        else:
            result.skip(key, value)
    return result


def _float(result: ImportResult, key: str, value: Any) -> float:
    """The number `key` must hold; refused, naming it, when it holds none."""
    found = number(value)
    if found is None:
        result.refuse(key, value, "not a number")
    return found


def _choice(result: ImportResult, key: str, value: Any, table: dict, target: str) -> None:
    if str(value) in table:
        result.set(target, table[str(value)])
    else:
        result.skip(key, value)


def _method(result: ImportResult, data: dict) -> None:
    method = str(data.pop("training_method", "FINE_TUNE"))
    if method == "LORA":
        result.set("training.method", "lora")
    elif method == "FINE_TUNE":
        result.set("training.method", "full")
    else:
        result.skip("training_method", method, "Tandem trains LoRAs and full fine-tunes")
    family = str(data.pop("model_type", ""))
    if family in FAMILIES:
        result.set("model.model_type", FAMILIES[family])
    elif family:
        result.skip("model_type", family, "not a family Tandem trains (sd1, sd2, sdxl, sd3, flux)")
    peft = str(data.pop("peft_type", "LORA"))
    decompose = bool(data.pop("lora_decompose", False))
    kind = {"LORA": "dora" if decompose else "lora", "LOHA": "loha", "LOKR": "lokr"}.get(peft)
    if kind:
        if method == "LORA":
            result.set("training.lora_type", kind)
    else:
        result.skip("peft_type", peft, "Tandem trains LoRA, DoRA, LoHa and LoKr")
    if decompose and data.get("lora_decompose_output_axis") is False:
        result.notes.append("lora_decompose: DoRA in Tandem (peft) normalises per output channel; OneTrainer's "
                            "default is per input channel.")
    data.pop("lora_decompose_output_axis", None)


PART_KEYS = {"train", "learning_rate", "weight_dtype", "model_name", "include", "uuid", "stop_training_after_unit",
             "gradient_checkpointing", "offload_fraction", "activation_offloading", "attention_mask",
             "guidance_scale", "train_embedding", "dropout_probability"}
"""Part settings read below, or at values that need no counterpart (reported otherwise by `_part_rest`)."""


def _part_rest(result: ImportResult, name: str, part: dict) -> None:
    """Report what a part sets that Tandem does not take over (training stopped early, offloading)."""
    if number(part.get("stop_training_after")) and str(part.get("stop_training_after_unit", "NEVER")) != "NEVER":
        result.skip(f"{name}.stop_training_after", f"{part['stop_training_after']} {part['stop_training_after_unit']}",
                    "a part trains for the whole run in Tandem")
    for key in ("offload_fraction", "activation_offloading", "dropout_probability"):
        result.skip(f"{name}.{key}", part.get(key))
    if part.get("model_name") and name != "vae":
        result.skip(f"{name}.model_name", part["model_name"], "parts come from model.base_model")
    for key, value in part.items():
        if key not in PART_KEYS and key != "stop_training_after":
            result.skip(f"{name}.{key}", value)


def _parts(result: ImportResult, data: dict) -> None:
    """`unet` / `transformer`, `text_encoder*`, `vae`: what trains, its learning rate, its storage dtype."""
    for name in DENOISER_PARTS:
        part = data.pop(name, None)
        if not isinstance(part, dict):
            continue
        _part_rest(result, name, part)
        if number(part.get("learning_rate")):
            result.set("training.learning_rate", float(part["learning_rate"]))
        dtype = str(part.get("weight_dtype", ""))
        if dtype in DTYPES or dtype == "FLOAT_8":
            result.set("model.unet_dtype", DTYPES.get(dtype, "fp8"))
    trains = None
    for name in TEXT_PARTS:
        part = data.pop(name, None)
        if not isinstance(part, dict):
            continue
        _part_rest(result, name, part)
        if name != "text_encoder_3":  # T5 never trains in Tandem
            trains = bool(part.get("train", True)) if trains is None else trains or bool(part.get("train", True))
        if number(part.get("learning_rate")):
            result.set("training.text_encoder_learning_rate", float(part["learning_rate"]))
        if str(part.get("weight_dtype", "")) in DTYPES:
            result.set("model.text_encoder_dtype", DTYPES[str(part["weight_dtype"])])
    if trains is not None:
        result.set("training.train_text_encoder", trains)
    vae = data.pop("vae", None)
    if isinstance(vae, dict):
        if vae.get("model_name"):
            result.set("model.vae_path", str(vae["model_name"]))
        if str(vae.get("weight_dtype", "")) in DTYPES:
            result.set("model.vae_dtype", DTYPES[str(vae["weight_dtype"])])


def _linked_list(result: ImportResult, data: dict, inline_key: str, file_key: str, option: str,
                 named: dict[str, Path], config_path: Path) -> list | None:
    """The list in the file the user named (`named[option]`), else the list given inline. A file the config
    names (`file_key`) is not read: it goes to `result.unread` under `option`, for the report."""
    inline = data.pop(inline_key, None)
    name = data.pop(file_key, None)
    if option in named:
        found = read_file(named[option], f"the --{option} file")
        if not isinstance(found, list):
            raise ConfigError([f"the --{option} file must hold a list, as OneTrainer's {file_key} file does; name "
                               "that file."], str(named[option]))
        return found
    if isinstance(inline, list):
        return inline
    if name:
        result.unread[option] = _where(str(name), config_path)
    return None


def _where(name: str, config_path: Path) -> Path:
    """The file OneTrainer would read for `name` (relative to the config's folder or OneTrainer's own):
    found by looking, never by reading."""
    for candidate in (Path(name).expanduser(), config_path.parent / name, config_path.parent.parent / name):
        if candidate.is_file():
            return candidate.absolute()
    return (config_path.parent / name).absolute()


def _concepts(result: ImportResult, data: dict, config_path: Path, named: dict[str, Path]) -> None:
    concepts = _linked_list(result, data, "concepts", "concept_file_name", "concepts", named, config_path)
    if concepts is None:
        return
    mapped = []
    for index, concept in enumerate(concepts):
        if not isinstance(concept, dict):
            result.skip(f"concepts[{index}]", concept, "not a concept (an object with a path)")
            continue
        text, image = _table(concept.get("text")), _table(concept.get("image"))
        strategy = str(concept.get("balancing_strategy", "REPEATS"))
        balancing = number(concept.get("balancing", 1.0)) or 1.0
        if strategy != "REPEATS" or balancing != int(balancing):
            result.notes.append(f"concepts[{index}] balancing {balancing:g} ({strategy}): Tandem repeats whole images; "
                                f"repeats {max(1, round(balancing))}.")
        role = ROLES.get(str(concept.get("type", "STANDARD")), "train")
        if str(concept.get("type")) == "PRIOR_PREDICTION":
            result.notes.append(f"concepts[{index}] PRIOR_PREDICTION: imported as a regularisation concept (trained on "
                                "its images and captions, not on the base model's prediction).")
        source = str(text.get("prompt_source", "sample"))
        mapped.append({"path": str(concept.get("path", "")), "name": str(concept.get("name", "")),
                       "enabled": bool(concept.get("enabled", True)), "repeats": max(1, round(balancing)),
                       "recursive": bool(concept.get("include_subdirectories", False)), "role": role,
                       "loss_weight": _float(result, f"concepts[{index}].loss_weight", concept.get("loss_weight", 1.0)),
                       "caption_extension": ".txt" if source == "sample" else ""})  # "": the file name
        if source not in ("sample", "filename"):
            result.skip(f"concepts[{index}].text.prompt_source", source, "captions come from .txt files or file names")
        if text.get("enable_tag_shuffling"):
            result.set("data.shuffle_tags", True)
            result.set("data.keep_tags", whole(text.get("keep_tags_count", 1)) or 0)
            result.set("data.tag_separator", str(text.get("tag_delimiter", ",")))
        if image.get("enable_random_flip"):
            result.set("data.random_flip", True)
        if image.get("enable_crop_jitter") is False:
            result.set("data.random_crop", False)
    if mapped:
        result.set("data.concepts", mapped)


def _table(value: Any) -> dict:
    """A part of a concept or sample that should be an object (`text`, `image`); {} when it is not."""
    return value if isinstance(value, dict) else {}


def _samples(result: ImportResult, data: dict, config_path: Path, named: dict[str, Path]) -> None:
    samples = _linked_list(result, data, "samples", "sample_definition_file_name", "samples", named, config_path)
    if not samples:
        return
    samples = [s for s in samples if isinstance(s, dict)]
    prompts = [{"prompt": str(s.get("prompt", "")), "negative_prompt": str(s.get("negative_prompt", "")),
                "seed": whole(s.get("seed")) or 0, "width": whole(s.get("width")) or 0,
                "height": whole(s.get("height")) or 0}
               for s in samples if s.get("enabled", True)]
    result.set("sampling.prompts", prompts)
    first = next((s for s in samples if s.get("enabled", True)), None)
    if first and whole(first.get("diffusion_steps")):
        result.set("sampling.inference_steps", whole(first["diffusion_steps"]))
    if first and number(first.get("cfg_scale")) is not None:
        result.set("sampling.guidance_scale", float(first["cfg_scale"]))


def _schedule(result: ImportResult, data: dict) -> None:
    scheduler = str(data.pop("learning_rate_scheduler", "CONSTANT"))
    if scheduler in SCHEDULERS:
        result.set("training.lr_scheduler", SCHEDULERS[scheduler])
        if scheduler == "COSINE_WITH_RESTARTS":
            result.notes.append("COSINE_WITH_RESTARTS: Tandem's cosine_with_restarts restarts at the full rate "
                                "(OneTrainer's hard restarts); OneTrainer's soft version rises back smoothly.")
    else:
        result.skip("learning_rate_scheduler", scheduler, "not one of Tandem's schedules")
    warmup = number(data.pop("learning_rate_warmup_steps", 0)) or 0
    if 0 < warmup < 1:
        result.skip("learning_rate_warmup_steps", warmup, "a share of the steps; set training.lr_warmup_steps")
    elif warmup:
        result.set("training.lr_warmup_steps", int(warmup))
    cycles = number(data.pop("learning_rate_cycles", 1)) or 1
    if cycles > 1:
        result.set("training.lr_cycles", int(round(cycles)))
    minimum = number(data.pop("learning_rate_min_factor", 0))
    if minimum:
        result.skip("learning_rate_min_factor", minimum, "Tandem's schedules decay to 0")


def _optimizer(result: ImportResult, optimizer: Any) -> None:
    if not isinstance(optimizer, dict):
        return
    name = str(optimizer.get("optimizer", "ADAMW"))
    if name in OPTIMIZERS:
        result.set("optimizer.name", OPTIMIZERS[name])
    else:
        result.skip("optimizer.optimizer", name, "Tandem has adamw, adamw_8bit, adafactor, sgd, prodigy, "
                                                 "adamw_schedule_free")
    for key, value in optimizer.items():
        if key == "optimizer" or value is None:
            continue
        if key in OPTIMIZER_FIELDS:
            result.set(f"optimizer.{OPTIMIZER_FIELDS[key]}", value)
        else:
            result.skip(f"optimizer.{key}", value)


def _every(result: ImportResult, data: dict, key: str, targets: dict[str, str]) -> None:
    """OneTrainer's `<key>` + `<key>_unit` (EPOCH, STEP, MINUTE, HOUR, NEVER, ALWAYS)."""
    amount = number(data.pop(key, None))
    unit = str(data.pop(f"{key}_unit", "NEVER")).upper()
    if unit == "NEVER" or not amount:
        return
    if unit == "HOUR" and "MINUTE" in targets:
        unit, amount = "MINUTE", amount * 60
    if unit in targets:
        target = targets[unit]
        result.set(target, float(amount) if target.endswith("minutes") else int(amount))
    else:
        result.skip(f"{key} / {key}_unit", f"{amount:g} {unit}", f"Tandem counts this in {', '.join(targets).lower()}")


def _output(result: ImportResult, data: dict) -> None:
    destination = str(data.pop("output_model_destination", "") or "")
    model_format = str(data.pop("output_model_format", "SAFETENSORS"))
    if destination:
        path = Path(destination)
        result.set("save.output_dir", str(path.parent))
        result.set("save.output_name", path.stem if path.suffix else path.name)
    if model_format == "DIFFUSERS_LORA":
        result.set("save.lora_format", "peft")
    elif model_format == "DIFFUSERS":
        result.set("save.full_format", "diffusers")
    elif model_format in ("SAFETENSORS", "KOHYA_LORA", "COMFY_LORA", "ORIGINAL_LORA", "LEGACY_LORA",
                          "ORIGINAL_SINGLE_FILE", "LEGACY_SAFETENSORS"):
        if result.get("training.method") == "full":
            result.set("save.full_format", "single_file")
        else:
            result.set("save.lora_format", "kohya")
    else:
        result.skip("output_model_format", model_format)
