"""Checks of a `TrainConfig`'s values, all reported together.

Reading a file (`serialization`) already guarantees the types; this module checks what the types
cannot: choices, ranges, relations between fields and paths on disk. Every problem is one sentence
that names the field path, the offending value and the fix.

Checks that need the machine (CUDA present, free ports, dataset size against the global batch)
belong to the distributed layer, which knows the world size; they are not done here.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
from pathlib import Path

from modules.families.registry import FAMILIES, field_applies, family_of_builtin
from modules.util.batch_slice import parse_split

from .docs import section_classes
from .field_paths import walk_types
from .control_setting import is_manifest, setting_problem
from .field_rules import FieldRule, rules_of
from .serialization import ConfigError
from .train_config import TrainConfig

BUILTIN_PREFIX = "builtin:"

def _rule_table(attribute: str) -> dict[tuple[str, str], object]:
    """(section, field) -> one kind of rule, for every field of a section that declares it (train_config.py)."""
    table = {}
    for section, cls in section_classes(TrainConfig).items():
        if section and "[" not in section:
            for name, field_rule in rules_of(cls).items():
                value = getattr(field_rule, attribute)
                if value not in ((), None):
                    table[(section, name)] = value
    return table


CHOICES: dict[tuple[str, str], tuple[str, ...]] = _rule_table("choices")
"""(section, field) -> allowed values, as the fields declare them (the GUI's drop-downs read the same
declarations through ui/binding.field_choices, list items' fields included)."""
MINIMUMS: dict[tuple[str, str], int | float] = _rule_table("minimum")
"""(section, field) -> smallest allowed value (inclusive)."""
ABOVE: dict[tuple[str, str], float] = _rule_table("above")
"""(section, field) -> values must be strictly greater than this."""


OUTPUT_NAME_FORBIDDEN = ("/", "\\", "\0")
"""Characters that would make save.output_name a path instead of a name (on any OS: configs travel)."""


def _one_of(path: str, value: str, choices: tuple[str, ...]) -> list[str]:
    if value in choices:
        return []
    close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return [f"{path}: {value!r} is not a valid choice; set it to one of {', '.join(choices)}{hint}."]


def _not_a_number(value) -> bool:
    """NaN and infinities are reported once, by `_finite_checks`, not again by each range check."""
    return isinstance(value, float) and not math.isfinite(value)


def _at_least(path: str, value, minimum) -> list[str]:
    if _not_a_number(value):
        return []
    return [] if value >= minimum else [f"{path}: {value!r} is not allowed; set it to {minimum} or more."]


def _above(path: str, value, bound) -> list[str]:
    if _not_a_number(value):
        return []
    return [] if value > bound else [f"{path}: {value!r} is not allowed; set it to a value above {bound:g}."]


def _between(path: str, value, low, high, *, open_ends: bool = False) -> list[str]:
    if _not_a_number(value):
        return []
    if open_ends:
        if low < value < high:
            return []
        return [f"{path}: {value!r} is not allowed; set it strictly between {low} and {high}."]
    if low <= value <= high:
        return []
    return [f"{path}: {value!r} is not allowed; set it between {low} and {high}."]


def _path_problem(path: str, value: str, what: str) -> list[str]:
    """A problem when `value` is not an existing file or folder; `builtin:` names are exempt."""
    if value.startswith(BUILTIN_PREFIX):
        return []
    if not value.strip():
        return [f"{path}: empty; set it to {what}."]
    resolved = Path(value).expanduser()
    if not resolved.is_absolute():
        resolved = Path.cwd() / resolved
    if resolved.exists():
        return []
    return [f"{path}: {value!r} does not exist (looked for {resolved}); set it to {what}."]


def parse_device_indexes(text: str) -> list[int]:
    """`"0,1,3"` -> `[0, 1, 3]`; raises ValueError with a user-facing reason on bad syntax."""
    if not text.strip():
        return []
    indexes = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(f"{part!r} is not a non-negative whole number")
        index = int(part)
        if index in indexes:
            raise ValueError(f"GPU {index} is listed twice")
        indexes.append(index)
    return indexes


def _value_checks(cfg: TrainConfig) -> list[str]:
    problems = []
    for (section, name), choices in CHOICES.items():
        problems += _one_of(f"{section}.{name}", getattr(getattr(cfg, section), name), choices)
    for (section, name), minimum in MINIMUMS.items():
        problems += _at_least(f"{section}.{name}", getattr(getattr(cfg, section), name), minimum)
    for (section, name), bound in ABOVE.items():
        problems += _above(f"{section}.{name}", getattr(getattr(cfg, section), name), bound)
    return problems


def _rule_problems(path: str, value, field_rule: FieldRule) -> list[str]:
    problems = _one_of(path, value, field_rule.choices) if field_rule.choices else []
    if field_rule.minimum is not None:
        problems += _at_least(path, value, field_rule.minimum)
    if field_rule.above is not None:
        problems += _above(path, value, field_rule.above)
    return problems


def _list_item_checks(cfg: TrainConfig) -> list[str]:
    """The rules declared on the fields of list items (`data.concepts[2].role`), item by item; the tables
    above hold the sections' own fields, which have one path each."""
    problems = []
    for section, cls in section_classes(TrainConfig).items():
        if not section.endswith("[]") or section.count("[") > 1:
            continue
        items = functools.reduce(getattr, section[:-2].split("."), cfg)
        for i, item in enumerate(items):
            for name, field_rule in rules_of(cls).items():
                problems += _rule_problems(f"{section[:-2]}[{i}].{name}", getattr(item, name), field_rule)
    return problems


def _finite_checks(node, path: str = "") -> list[str]:
    """Every float field must be a real number: JSON and overrides accept NaN and Infinity, which pass
    the range checks (`inf > 0`, and a NaN compares as neither) and then fail deep inside training."""
    problems = []
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            problems += _finite_checks(getattr(node, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            problems += _finite_checks(item, f"{path}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        default = _default_of(path)
        hint = f" such as {default:g} (the default)" if default is not None else ""
        problems.append(f"{path}: {node!r} is not a usable number; set a finite value{hint}.")
    return problems


def _default_of(path: str) -> float | None:
    """The default of a field outside lists (a list item's default depends on the item)."""
    try:
        steps = [step for step, _, _ in walk_types(path)]
    except (ValueError, KeyError):
        return None
    if any(isinstance(step, int) for step in steps):
        return None
    node = functools.reduce(getattr, steps, TrainConfig())
    return node if isinstance(node, float) and math.isfinite(node) else None


def _training_checks(cfg: TrainConfig) -> list[str]:
    t = cfg.training
    problems = []
    if t.max_steps <= 0 and t.epochs < 1:
        problems.append(f"training.epochs: {t.epochs!r} is not allowed while training.max_steps is 0; "
                        "set epochs to 1 or more, or set max_steps.")
    problems += _between("training.ema_decay", t.ema_decay, 0, 1, open_ends=True)
    problems += _between("training.lora_dropout", t.lora_dropout, 0.0, 1.0)
    if t.cuda_graphs == "on" and t.compile == "off":
        problems.append("training.cuda_graphs: on replays the compiled denoiser's kernels, and training.compile is "
                        "off; set training.compile to on or auto, or training.cuda_graphs to auto or off.")
    if t.method == "lora" and not t.lora_target_modules:
        problems.append("training.lora_target_modules: [] leaves LoRA nothing to train; "
                        'list module names such as ["to_q", "to_k", "to_v", "to_out.0"].')
    if cfg.model.unet_dtype == "fp8":
        # float8.py: a frozen base, computed in bf16 (the float8 -> bf16 upcast is exact).
        if t.method != "lora":
            problems.append(f"model.unet_dtype: 'fp8' stores the frozen base weights of a LoRA, and training.method "
                            f"{t.method!r} trains every weight (kept in fp32); set model.unet_dtype to fp32 or "
                            "training.method to lora.")
        elif t.precision != "bf16":
            problems.append(f"model.unet_dtype: 'fp8' weights are computed in bf16, and training.precision is "
                            f"{t.precision!r}; set training.precision to bf16 (or model.unet_dtype to bf16).")
    if t.method == "lora" and t.precision == "fp32" and cfg.model.unet_dtype in ("bf16", "fp16"):
        # LoRA keeps the frozen UNet in unet_dtype; without autocast its layers would get fp32 inputs.
        problems.append(f"model.unet_dtype: {cfg.model.unet_dtype!r} stores LoRA's frozen UNet in half precision, "
                        "which training.precision 'fp32' (no autocast) cannot run; set model.unet_dtype to fp32 "
                        "or training.precision to bf16 or fp16.")
    problems += _between("optimizer.beta1", cfg.optimizer.beta1, 0.0, 1.0)
    problems += _between("optimizer.beta2", cfg.optimizer.beta2, 0.0, 1.0)
    problems += _between("optimizer.momentum", cfg.optimizer.momentum, 0.0, 1.0)
    return problems + _optimizer_checks(cfg)


def _optimizer_checks(cfg: TrainConfig) -> list[str]:
    """What Prodigy and schedule-free AdamW cannot combine with."""
    o, t = cfg.optimizer, cfg.training
    problems = []
    if 0 < o.prodigy_growth_rate < 1:
        problems.append(f"optimizer.prodigy_growth_rate: {o.prodigy_growth_rate!r} would shrink Prodigy's step size "
                        "every step; set it to 1 or more (1.02 is a gentle limit), or 0 for no limit.")
    if o.name == "prodigy" and t.train_text_encoder and t.text_encoder_learning_rate not in (0, t.learning_rate):
        # prodigyopt raises at the first step when parameter groups have different non-zero rates.
        problems.append(f"training.text_encoder_learning_rate: {t.text_encoder_learning_rate!r} differs from "
                        f"training.learning_rate ({t.learning_rate!r}), and Prodigy estimates one step size for all "
                        "weights; set training.text_encoder_learning_rate to 0 (the same rate).")
    if o.name == "adamw_schedule_free":
        if t.lr_scheduler != "constant":
            problems.append(f"training.lr_scheduler: {t.lr_scheduler!r} decays the learning rate, which "
                            "optimizer.name 'adamw_schedule_free' replaces by averaging the weights; set "
                            "training.lr_scheduler to constant (training.lr_warmup_steps still warms up).")
        if t.ema:
            problems.append("training.ema: true keeps a second average of the weights beside the one "
                            "optimizer.name 'adamw_schedule_free' keeps (its samples and saved models are that "
                            "average); set training.ema to false.")
    return problems


def _data_checks(cfg: TrainConfig, check_paths: bool) -> list[str]:
    d = cfg.data
    problems = []
    bucket_step_ok = d.bucket_step >= 8 and d.bucket_step % 8 == 0
    if not bucket_step_ok:
        problems.append(f"data.bucket_step: {d.bucket_step!r} is not allowed; "
                        "set it to a multiple of 8 (64 is usual).")
    if d.resolution < 64:
        problems.append(f"data.resolution: {d.resolution!r} is not allowed; set it to 64 or more.")
    elif bucket_step_ok and d.resolution % d.bucket_step:  # a bad step is reported once, above
        nearest = max(d.bucket_step, round(d.resolution / d.bucket_step) * d.bucket_step)
        problems.append(f"data.resolution: {d.resolution!r} is not a multiple of data.bucket_step "
                        f"({d.bucket_step}); set it to {nearest}, for example.")
    problems += _between("data.caption_dropout", d.caption_dropout, 0.0, 1.0)
    enabled = [i for i, c in enumerate(d.concepts) if c.enabled]
    if not enabled:
        problems.append(f"data.concepts: none of the {len(d.concepts)} concept(s) is enabled; "
                        "add a concept or set enabled to true on one.")
    elif not any(d.concepts[i].role == "train" for i in enabled):
        problems.append("data.concepts: no enabled concept has role 'train' (regularisation and validation "
                        "images only accompany training images); set one concept's role to 'train'.")
    problems += _between("data.validation_fraction", d.validation_fraction, 0.0, 0.5)
    for i, concept in enumerate(d.concepts):  # repeats, role and loss_weight: their rules (_list_item_checks)
        problems += _between(f"data.concepts[{i}].unmasked_weight", concept.unmasked_weight, 0.0, 1.0)
        if concept.enabled and check_paths:
            problems += _path_problem(f"data.concepts[{i}].path", concept.path,
                                      "a folder of images, or disable the concept")
            problems += _control_problem(i, concept)
    return problems


def _control_problem(index: int, concept) -> list[str]:
    """A concept's control folder or manifest that is not there (a built-in dataset's are checked by its scan)."""
    if not concept.control.strip() or concept.path.startswith(BUILTIN_PREFIX):
        return []
    folder = Path(concept.path).expanduser()
    problem = setting_problem(folder if folder.is_absolute() else Path.cwd() / folder, concept.control,
                              f"data.concepts[{index}].control")
    return [problem] if problem else []


def _output_checks(cfg: TrainConfig) -> list[str]:
    problems = []
    if not cfg.general.workspace_dir.strip():
        problems.append("general.workspace_dir: empty; set a run folder such as 'workspace/run'.")
    name = cfg.save.output_name
    if not name.strip():
        problems.append("save.output_name: empty; set a file name such as 'tandem'.")
    elif any(sep in name for sep in OUTPUT_NAME_FORBIDDEN) or name.strip() in (".", ".."):
        # The name is joined to save.output_dir: a separator or '..' would write somewhere else.
        problems.append(f"save.output_name: {name!r} is not a plain file name (no '/', '\\' or '..'); "
                        "set a name such as 'tandem' and choose the folder with save.output_dir.")
    for i, prompt in enumerate(cfg.sampling.prompts):
        for name in ("width", "height"):
            value = getattr(prompt, name)
            if value < 0 or value % 8:
                problems.append(f"sampling.prompts[{i}].{name}: {value!r} is not allowed; "
                                "set it to a multiple of 8, or 0 for the training resolution.")
    return problems


def fsdp_blockers(cfg: TrainConfig) -> list[str]:
    """What in `cfg` sharded training does not support yet, each with its fix (empty: FSDP can train it)."""
    t = cfg.training
    blockers = []
    if t.precision == "fp16":
        blockers.append("training.precision fp16: loss scaling over sharded gradients is not supported; use bf16 "
                        "(or fp32)")
    if t.compile == "on":
        blockers.append("training.compile on: the compiled denoiser's check against eager mode runs on whole "
                        "weights; set training.compile to auto or off")
    if cfg.optimizer.name == "adamw_8bit":
        blockers.append("optimizer.name adamw_8bit: bitsandbytes' 8-bit state does not take sharded parameters; "
                        "use adamw (sharded, its state costs 1/N per GPU) or adafactor")
    if cfg.optimizer.name == "prodigy":
        # Measured (2 CPU processes, FSDP2, prodigyopt 1.1): the ranks' d parted from the 5th step on.
        blockers.append("optimizer.name prodigy: Prodigy estimates its step size d from sums over all weights and "
                        "gradients, which under FSDP each rank takes over its own shards only, so the ranks' step "
                        "sizes part; use adamw or adamw_schedule_free (both train under FSDP as under DDP)")
    return blockers


def _multi_gpu_checks(cfg: TrainConfig) -> list[str]:
    m = cfg.multi_gpu
    problems = _between("multi_gpu.master_port", m.master_port, 0, 65535)
    try:
        indexes = parse_device_indexes(m.device_indexes)
    except ValueError as reason:
        problems.append(f"multi_gpu.device_indexes: {m.device_indexes!r} is not valid ({reason}); "
                        "write comma-separated GPU numbers such as '0,1,3', or leave it empty.")
        return problems
    split = m.batch_split.strip().lower()
    if split not in ("equal", "auto", ""):
        # A list names one size per GPU; with num_gpus 0 (all visible) its length says how many.
        gpus = m.num_gpus or len(indexes) or len(split.split(","))
        try:
            parse_split(split, gpus, cfg.training.batch_size)
        except ValueError as reason:
            problems.append(f"multi_gpu.batch_split: {reason}; or set it to equal or auto.")
    problems += _memory_limit_checks(cfg, indexes)
    problems += layer_offload_problems(cfg)
    problems += context_parallel_problems(cfg, m.num_gpus or len(indexes) or None)
    if indexes and m.num_gpus > 0 and m.num_gpus != len(indexes):
        problems.append(f"multi_gpu.num_gpus: {m.num_gpus} does not match multi_gpu.device_indexes "
                        f"{m.device_indexes!r} ({len(indexes)} GPU(s)); set num_gpus to 0 or "
                        f"{len(indexes)}, or list {m.num_gpus} indexes.")
    problems += _nodes_and_restarts_checks(cfg)
    if m.enabled and m.strategy == "fsdp":
        problems += [f"multi_gpu.strategy fsdp with {blocker}, or set multi_gpu.strategy to ddp."
                     for blocker in fsdp_blockers(cfg)]
    if m.enabled and m.static_graph:
        # PyTorch's DDP asserts (expect_autograd_hooks_) when a static graph's first backward runs
        # inside no_sync(), and past that it stops all-reducing (pytorch/pytorch#143580, PR #187732).
        # Tandem runs a backward without synchronising for gradient accumulation and for the compiled
        # UNet's first-step check.
        for path, value, active in (
                ("training.gradient_accumulation_steps", cfg.training.gradient_accumulation_steps,
                 cfg.training.gradient_accumulation_steps > 1),
                ("training.compile", cfg.training.compile, cfg.training.compile == "on")):
            if active:
                problems.append(f"multi_gpu.static_graph: true cannot be combined with {path} = "
                                f"{str(value).lower()} (PyTorch's DDP fails on a static graph's unsynchronised "
                                "first backward, pytorch/pytorch#143580); set multi_gpu.static_graph to false.")
    return problems


def parse_memory_limits(text: str) -> list[float]:
    """`multi_gpu.memory_limit_gib`: `""` -> [], `24` -> [24.0], `24,16` -> [24.0, 16.0]; ValueError with the reason."""
    text = text.strip()
    if not text:
        return []
    limits = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"{part.strip()!r} is not a number of GiB") from None
        if not value > 0:
            raise ValueError(f"{part.strip()!r}: a GPU needs more than 0 GiB")
        limits.append(value)
    return limits


def parse_layer_offload(text: str) -> int | None:
    """`multi_gpu.layer_offload`: `auto` -> None (the plan decides), `off` -> 0, `20` -> 20 blocks; ValueError
    with the reason."""
    value = text.strip().lower()
    if value in ("auto", ""):
        return None
    if value == "off":
        return 0
    try:
        blocks = int(value)
    except ValueError:
        raise ValueError(f"{text!r} is not auto, off or a number of blocks") from None
    if blocks < 0:
        raise ValueError(f"{text!r}: a number of blocks is 0 or more")
    return blocks


def layer_offload_problems(cfg: TrainConfig) -> list[str]:
    """What stops `multi_gpu.layer_offload` as set (a number of blocks), each with its fix."""
    m, t = cfg.multi_gpu, cfg.training
    try:
        blocks = parse_layer_offload(m.layer_offload)
    except ValueError as reason:
        return [f"multi_gpu.layer_offload: {reason}; write auto (the memory plan decides), off, or how many blocks "
                "keep their weights in CPU memory, e.g. 20."]
    if not blocks:
        return []
    field = f"multi_gpu.layer_offload: {blocks}"
    problems = []
    if t.method != "lora":
        problems.append(f"{field} swaps a frozen base's blocks, and training.method {t.method!r} trains every weight "
                        "(the optimizer updates them on the GPU each step); set multi_gpu.layer_offload to auto or "
                        "off - a full fine-tune larger than one GPU trains on several with multi_gpu.strategy fsdp and "
                        "multi_gpu.fsdp_cpu_offload.")
    if not t.gradient_checkpointing:
        problems.append(f"{field} needs training.gradient_checkpointing: without it autograd keeps every block's "
                        "weights on the GPU until the backward; set training.gradient_checkpointing to true.")
    for path, active, fix in (("training.compile", t.compile == "on", "auto or off"),
                              ("training.channels_last", t.channels_last, "false")):
        if active:
            problems.append(f"{field} with {path}: the swapped weights change place every call; set {path} to "
                            f"{fix} (or multi_gpu.layer_offload to off).")
    if m.enabled and m.strategy == "fsdp":
        problems.append(f"{field} with multi_gpu.strategy fsdp: FSDP shards the base instead; set "
                        "multi_gpu.strategy to ddp or auto (or multi_gpu.layer_offload to auto or off).")
    return problems


def context_parallel_family_problem(degree: int, family: str) -> str | None:
    """Why `family` cannot split a sample over `degree` GPUs (None: it can, or the family is not known yet)."""
    from modules.families.registry import FAMILIES

    info = FAMILIES.get(family)
    if degree <= 1 or info is None or info.context_parallel:
        return None
    able = ", ".join(f.title for f in FAMILIES.values() if f.context_parallel)
    return (f"multi_gpu.context_parallel: {degree} splits a sample's sequence over GPUs, which {info.title} cannot "
            f"(its transformer has no context-parallel plan Tandem trains with); models that can: {able}. Set it to 1.")


def context_parallel_problems(cfg: TrainConfig, gpus: int | None, family: str | None = None) -> list[str]:
    """What stops `multi_gpu.context_parallel` on `gpus` processes (None: not known yet) for the family `family`
    (None: the config's model type, where it names one), each with its fix."""
    m = cfg.multi_gpu
    degree = m.context_parallel
    if degree <= 1:
        return []
    field = f"multi_gpu.context_parallel: {degree}"
    problems = []
    unable = context_parallel_family_problem(degree, family or cfg.model.model_type)
    if unable:
        problems.append(unable)
    if gpus is not None and gpus % degree:
        problems.append(f"{field} must divide the number of GPUs ({gpus}): each group of {degree} GPUs trains one "
                        f"share of the batch; use {' or '.join(str(d) for d in range(2, gpus + 1) if gpus % d == 0) or 1}, "
                        f"or {degree * max(1, gpus // degree)} GPUs.")
    if cfg.training.compile == "on":
        problems.append(f"{field} with training.compile on: the compiled denoiser is checked against eager mode on "
                        "the whole sequence; set training.compile to auto or off (or context_parallel to 1).")
    split = m.batch_split.strip().lower()
    if split not in ("", "equal"):
        problems.append(f"{field} with multi_gpu.batch_split {m.batch_split!r}: the GPUs of a group run one sample "
                        "together, so every group takes an equal share; set multi_gpu.batch_split to equal.")
    return problems


def _memory_limit_checks(cfg: TrainConfig, indexes: list[int]) -> list[str]:
    m = cfg.multi_gpu
    problems = []
    try:
        limits = parse_memory_limits(m.memory_limit_gib)
    except ValueError as reason:
        return [f"multi_gpu.memory_limit_gib: {m.memory_limit_gib!r} is not valid ({reason}); write one number of "
                "GiB for every GPU, e.g. 24, or one per GPU, e.g. 24,16; or leave it empty."]
    gpus = m.num_gpus or len(indexes)
    if len(limits) > 1 and gpus and len(limits) != gpus:
        problems.append(f"multi_gpu.memory_limit_gib: {m.memory_limit_gib!r} gives {len(limits)} limits for {gpus} "
                        "GPU(s); give one number for every GPU or one per GPU.")
    if m.activation_offload and not cfg.training.gradient_checkpointing:
        problems.append("multi_gpu.activation_offload: true offloads what checkpointed blocks keep; set "
                        "training.gradient_checkpointing to true, or turn it off.")
    return problems


def _nodes_and_restarts_checks(cfg: TrainConfig) -> list[str]:
    """Several machines and restarts: what torchrun's elastic agent can do, and a node number that exists."""
    m = cfg.multi_gpu
    problems = []
    if m.nnodes >= 1 and not 0 <= m.node_rank < m.nnodes:
        problems.append(f"multi_gpu.node_rank: {m.node_rank} is not a node of multi_gpu.nnodes = {m.nnodes}; "
                        f"number the machines 0 to {m.nnodes - 1}, 0 on the one at multi_gpu.master_addr.")
    if m.launcher == "spawn":
        for path, value, active in (("multi_gpu.nnodes", m.nnodes, m.nnodes > 1),
                                    ("multi_gpu.max_restarts", m.max_restarts, m.max_restarts > 0),
                                    ("multi_gpu.min_gpus", m.min_gpus, m.min_gpus > 0)):
            if active:
                problems.append(f"{path}: {value} needs torchrun's elastic agent; set multi_gpu.launcher to "
                                "auto or torchrun.")
    if m.min_gpus > 0 and m.nnodes < 2:
        problems.append(f"multi_gpu.min_gpus: {m.min_gpus} applies to several machines (a lost machine's GPUs "
                        "are left out after a restart); with multi_gpu.nnodes = 1 set it to 0.")
    if m.min_gpus > 0 and m.max_restarts == 0:
        problems.append(f"multi_gpu.min_gpus: {m.min_gpus} continues after a restart; set multi_gpu.max_restarts "
                        "to 1 or more.")
    if m.nnodes > 1 and m.master_port == 0:
        problems.append("multi_gpu.master_port: 0 (a free port) cannot be found by the other machines; "
                        "set the same fixed port on every machine, e.g. 29500.")
    return problems


CONFIG_OVERRIDE_PARTS = ("unet", "vae", "text_encoder", "text_encoder_2")
"""The parts `model.config_overrides` may name (the parts of a single-file checkpoint)."""


def parse_config_overrides(text: str) -> dict[str, dict]:
    """`model.config_overrides` text -> {part: {field: value}}; raises ValueError with a user-facing reason."""
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(data, dict):
        raise ValueError('it must be a JSON object such as {"unet": {"attention_head_dim": 8}}')
    unknown = sorted(set(data) - set(CONFIG_OVERRIDE_PARTS))
    if unknown:
        raise ValueError(f"unknown part(s) {', '.join(unknown)}; use {', '.join(CONFIG_OVERRIDE_PARTS)}")
    for part, fields in data.items():
        if not isinstance(fields, dict):
            raise ValueError(f'"{part}" must hold an object of config fields, e.g. {{"{part}": {{"field": 1}}}}')
    return data


def _model_checks(cfg: TrainConfig, check_paths: bool) -> list[str]:
    m = cfg.model
    problems = []
    try:
        overrides = parse_config_overrides(m.config_overrides)
    except ValueError as e:
        problems.append(f"model.config_overrides: {e}.")
        overrides = {}
    if overrides and set(overrides) != {"vae"}:
        folder = check_paths and Path(m.base_model).expanduser().is_dir()
        if m.base_model.startswith(BUILTIN_PREFIX) or folder:
            problems.append("model.config_overrides: applies to single-file checkpoints only, and "
                            f"model.base_model {m.base_model!r} is not one (a diffusers folder's own config "
                            "files describe it); clear model.config_overrides.")
    builtin = m.base_model.strip()
    if builtin.startswith(BUILTIN_PREFIX) and family_of_builtin(builtin) is None:
        known = ", ".join(info.demo for info in FAMILIES.values() if info.demo)
        problems.append(f"model.base_model: {builtin!r} is not a built-in model; use one of {known}, "
                        "a diffusers folder or a .safetensors/.ckpt file.")
    if not check_paths:
        return problems
    problems += _path_problem("model.base_model", m.base_model,
                              "a diffusers folder, a .safetensors/.ckpt file or builtin:demo")
    if m.vae_path:
        problems += _path_problem("model.vae_path", m.vae_path,
                                  "a VAE folder or file, or leave it empty for the model's own")
    if m.components_folder:
        problems += _path_problem("model.components_folder", m.components_folder,
                                  "a diffusers folder of the same family, or leave it empty")
    return problems


def known_family(cfg: TrainConfig) -> str | None:
    """The model family the config names (model_type, or a built-in model), None when it is detected later."""
    if cfg.model.model_type in FAMILIES:
        return cfg.model.model_type
    return family_of_builtin(cfg.model.base_model)


# Settings whose default means "off" (or "the model's own"): a family that does not use a field only
# objects when the user changed it, since the value would silently do nothing.
_INERT_VALUES = {"model.prediction_type": "auto", "training.min_snr_gamma": 0.0}


def _control_checks(cfg: TrainConfig, info) -> list[str]:
    """An edit model trains on pairs only (a model whose controls are optional on pairs or plain images, not both),
    with no more controls than it takes, and a model that takes no control image on none."""
    concepts = [(i, c) for i, c in enumerate(cfg.data.concepts) if c.enabled]
    if not info.controls:
        return [f"data.concepts[{i}].control: {c.control!r} names control images, but {info.title} (model.model_type "
                f"{info.name}) is no edit model; leave it empty, or train an edit model "
                f"({', '.join(f.name for f in FAMILIES.values() if f.controls)})." for i, c in concepts if c.control.strip()]
    paired = [i for i, c in concepts if c.control.strip()]
    if info.controls_optional:  # pairs or plain images, not both: a step's items carry controls or none
        problems = [f"data.concepts[{i}].control: empty, but data.concepts[{paired[0]}] names control images; "
                    f"{info.title} trains on pairs or on plain images in one run, not both: name this concept's "
                    "controls too, or disable it." for i, c in concepts if paired and not c.control.strip()]
    else:
        problems = [f"data.concepts[{i}].control: empty, but {info.title} learns edits from pairs; name the folder "
                    f"of each image's control image (`control`), or a manifest." for i, c in concepts
                    if not c.control.strip()]
        problems += [f"sampling.prompts[{i}].control: empty, but {info.title} edits an image; give the path of the "
                     "image the prompt edits." for i, prompt in enumerate(cfg.sampling.prompts)
                     if not prompt.control.strip()]
    if info.max_controls:
        named = [(f"data.concepts[{i}].control", c.control) for i, c in concepts if not is_manifest(c.control)]
        named += [(f"sampling.prompts[{i}].control", p.control) for i, p in enumerate(cfg.sampling.prompts)]
        problems += [f"{field}: {value!r} names {count} control images, but {info.title} takes at most "
                     f"{info.max_controls}; name at most {info.max_controls}." for field, value in named
                     if (count := len([p for p in value.split(",") if p.strip()])) > info.max_controls]
    if info.controls == "latents+text" and cfg.data.caption_dropout > 0:
        problems.append(f"data.caption_dropout: {cfg.data.caption_dropout!r}, but {info.title}'s text encoder reads "
                        "each caption with its control images, which a dropped caption would lose; set it to 0.")
    return problems


def _family_checks(cfg: TrainConfig) -> list[str]:
    """What the family the config names does not accept: settings of other families, image sizes."""
    family = known_family(cfg)
    if family is None or family not in FAMILIES:
        return []
    info = FAMILIES[family]
    problems = []
    for path, inert in _INERT_VALUES.items():
        section, name = path.split(".")
        value = getattr(getattr(cfg, section), name)
        if value != inert and not field_applies(path, family):
            problems.append(f"{path}: {value!r} does not apply to {info.title} (model.model_type {family}), "
                            f"which trains rectified flow; set it to {inert!r}.")
    problems += _text_apart_checks(cfg, info)
    problems += _control_checks(cfg, info)
    if cfg.model.wan_expert and not field_applies("model.wan_expert", family):
        problems.append(f"model.wan_expert: {cfg.model.wan_expert!r} picks an expert of Wan 2.2 A14B, but the model is "
                        f"{info.title} (model.model_type {family}); leave it empty.")
    # Sizes that are not even multiples of 8 (the VAE's step) are reported by the general checks.
    step = info.pixel_multiple
    d = cfg.data
    if d.resolution % 8 == 0 and d.resolution % step:
        problems.append(f"data.resolution: {d.resolution!r} is not a multiple of {step}, the image-size step of "
                        f"{info.title}; set it to {max(step, round(d.resolution / step) * step)}, for example.")
    if d.aspect_bucketing and d.bucket_step % 8 == 0 and d.bucket_step % step:
        problems.append(f"data.bucket_step: {d.bucket_step!r} is not a multiple of {step}, the image-size step of "
                        f"{info.title}; set it to {max(step, round(d.bucket_step / step) * step)} (64 is usual).")
    if info.video and d.video_frames % 4 != 1:
        problems.append(f"data.video_frames: {d.video_frames!r} is not 4k + 1, the clip lengths {info.title} takes "
                        f"(its VAE keeps the first frame and one in four after it); set it to "
                        f"{max(1, d.video_frames // 4 * 4 + 1)}, for example.")
    frames = cfg.sampling.video_frames
    if info.video and frames % 4 != 1:
        problems.append(f"sampling.video_frames: {frames!r} is not 4k + 1, the clip lengths {info.title} renders "
                        f"(1 is a still image); set it to {max(1, frames // 4 * 4 + 1)}, for example.")
    for i, prompt in enumerate(cfg.sampling.prompts):
        for name in ("width", "height"):
            value = getattr(prompt, name)
            if value > 0 and value % 8 == 0 and value % step:
                problems.append(f"sampling.prompts[{i}].{name}: {value!r} is not a multiple of {step}, the "
                                f"image-size step of {info.title}; set it to {max(step, value // step * step)}.")
    return problems


def _text_apart_checks(cfg: TrainConfig, info) -> list[str]:
    """A family whose text encoder is loaded apart trains from cached text only; fp8 text encoders are theirs."""
    title = f"{info.title} (model.model_type {info.name})"
    if not info.text_apart:
        if cfg.model.text_encoder_dtype == "fp8":
            return [f"model.text_encoder_dtype: 'fp8' is for the families whose text encoder is loaded apart "
                    f"(Qwen-Image, Z-Image); {title} loads its text encoders with the model: set it to bf16."]
        return []
    reason = f"{title} trains from cached text only: its text encoder is loaded apart and never trains"
    problems = []
    if not cfg.data.cache_text_embeddings:
        problems.append(f"data.cache_text_embeddings: false, but {reason}; set it to true.")
    if cfg.data.shuffle_tags:
        problems.append(f"data.shuffle_tags: true, but {reason} (a shuffled caption is a new text each time); "
                        "set it to false.")
    if cfg.training.train_text_encoder:
        problems.append(f"training.train_text_encoder: true, but {reason}; set it to false.")
    return problems


def validate(cfg: TrainConfig, check_paths: bool = True) -> list[str]:
    """Every problem in `cfg`, each a sentence naming the field, the value and the fix.

    `check_paths=False` skips the checks against the file system (base model, VAE, concept
    folders): presets name models the user has yet to download, and the GUI validates while the
    user is still typing a path.
    """
    return (_value_checks(cfg) + _list_item_checks(cfg) + _finite_checks(cfg) + _model_checks(cfg, check_paths)
            + _data_checks(cfg, check_paths) + _training_checks(cfg) + _output_checks(cfg) + _multi_gpu_checks(cfg)
            + _family_checks(cfg) + _recipe_checks(cfg, check_paths))


def _recipe_checks(cfg: TrainConfig, check_paths: bool) -> list[str]:
    from .recipe_checks import recipe_problems  # imported late, to keep validation's imports one-way
    return recipe_problems(cfg, known_family(cfg), check_paths)


def check(cfg: TrainConfig, source: str | None = None, check_paths: bool = True) -> TrainConfig:
    """Raise `ConfigError` listing every problem of `cfg`; return `cfg` when there is none."""
    problems = validate(cfg, check_paths=check_paths)
    if problems:
        raise ConfigError(problems, source)
    return cfg
