"""The memory plan: how a run spreads its model over the GPUs so that it fits every card, chosen once.

With `multi_gpu.strategy = auto` the plan is the first of these that fits every GPU - each step saves
memory and costs some speed, so the first that fits is the fastest that fits:

| plan | saves | costs |
| --- | --- | --- |
| DDP | nothing: every GPU holds the whole model | - |
| DDP + fp8 base (LoRA) | half of a bf16 base | a cast per layer |
| FSDP | the trained module (a LoRA's frozen base too) sharded 1/N per GPU | gathering every block, every step |
| + fp8 base (LoRA) | half of the sharded base | a cast per layer |
| + activation checkpointing | activations: each block keeps its input only | recomputing each block's forward |
| + activation offloading (transformers) | the checkpointed inputs move to host memory | copies that overlap the compute |
| + CPU offload of the shards | the sharded state lives in host memory | the optimizer step on the CPU, copies |

DDP with an fp8 base comes before FSDP: a cast per layer costs less than gathering every block (FSDP2
was 3-6x slower than DDP for a small-batch LoRA in SimpleTuner's measurements). One process and DDP have
their own steps after checkpointing: layer offload of as few blocks as fit, and activation offloading of the
checkpointed inputs (each with the other too). A setting the config
already turns on stays on in every plan; `ddp` or `fsdp` set explicitly is the one plan. The cards are
`multi_gpu.memory_limit_gib` (each GPU held to it: `torch.cuda.set_per_process_memory_fraction`) or the
GPUs' free memory; a plan fits when each rank's estimate (`memory_need.py`) stays within
`SAFETY_FRACTION` of its card. When none does, the most frugal plan is taken if it fits the whole card
(the log says it is tight); a config that fits no card is refused - by the launcher, before any worker
starts - naming the smallest changes that would fit (`NoPlanFits`).

Torch-free: the launcher's checks, `scripts/check_multi_gpu.py --plan-for`, the GUI's memory line and
every worker (`DistributedTrainer`) make the same plan from the same numbers.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from modules.planning.host_need import HOST_SAFETY_FRACTION, HostNeed, HostRoom, host_need
from modules.planning.host_need import fits as host_fits
from modules.planning.memory_need import RUNTIME_OVERHEAD_GIB, Facts, Need, Setup, facts, need
from modules.families.registry import FAMILIES
from modules.planning.model_sizes import ModelSizes
from modules.planning.plan_speed import step_seconds
from modules.config.validation import parse_layer_offload, parse_memory_limits, validate
from modules.util.batch_slice import RankCapacity, SplitDoesNotFit, choose_split, parse_split

SAFETY_FRACTION = 0.9
"""Share of a card a plan may fill: the estimate leaves out the allocator's fragmentation."""
MOST_CARDS = 16
"""How many cards the refusal looks at when it asks whether more cards would fit."""


class NoPlanFits(ValueError):
    """No plan fits the cards; the message gives the figures and the smallest changes that would fit."""


@dataclass(frozen=True)
class Candidate:
    name: str
    setup: Setup


@dataclass
class Plan:
    """The chosen plan, with the figures it was chosen by."""
    candidate: Candidate
    needs: list[Need]
    """Each rank's estimate under this plan."""
    batches: list[int]
    """Each rank's samples per micro-batch."""
    capacities: list[float]
    """Each rank's card in GiB (`memory_limit_gib` or its free memory)."""
    capacity_source: str
    rejected: list[str] = field(default_factory=list)
    """Why each faster plan did not fit, one sentence each."""
    tight: bool = False
    """Fits the cards only beyond `SAFETY_FRACTION`."""
    planned_split: list[int] | None = None
    """The uneven split of each global batch this plan chose (FSDP with `multi_gpu.batch_split = auto`)."""
    changes: dict[str, object] = field(default_factory=dict)
    """The config fields the plan sets (`section.field` -> value), beyond what the config says."""
    chosen_by: str = "auto"
    slower: str = ""
    host: HostNeed | None = None
    """The machine's host memory under this plan (`host_need.py`)."""
    host_room: HostRoom | None = None
    """The host memory it was checked against (None: not checked, the machine unknown)."""
    """The next plan that fits too, with its estimated step time against this one's (why this one)."""

    @property
    def name(self) -> str:
        return self.candidate.name

    @property
    def strategy(self) -> str:
        return self.candidate.setup.strategy

    @property
    def peaks(self) -> list[float]:
        """Each rank's estimated peak: training, or caching where the plan decides that (`peak`)."""
        return [peak(n, c * SAFETY_FRACTION) for n, c in zip(self.needs, self.capacities)]

    def warnings(self) -> list[str]:
        """What no plan changes but the user should know: encoders larger than a card while caching."""
        found = []
        for rank, (n, c) in enumerate(zip(self.needs, self.capacities)):
            if encoders_exceed(n, c * SAFETY_FRACTION):
                found.append(f"The text encoders and VAE need ~{n.encoders:.1f} GiB on GPU {rank} while the cache is "
                             f"filled, more than its {c:.1f} GiB: set model.text_encoder_dtype (and model.vae_dtype) to "
                             "bf16, or fill the cache once on a larger GPU (it is reused).")
                break
        return found

    def apply(self, cfg):
        """`cfg` as this plan trains it (the fields in `changes` set)."""
        return with_changes(cfg, self.changes)

    def describe(self) -> str:
        """The start-up log's account: the plan, each GPU's estimate and card, why faster plans did not fit."""
        cards = _cards(self.capacities, self.capacity_source)
        peaks = ", ".join(f"GPU {r} ~{p:.1f}" for r, p in enumerate(self.peaks))
        text = f"Memory plan for {cards}: {self.name} ({self.chosen_by}), estimated peak per GPU {peaks} GiB"
        if not all(n.activations_known for n in self.needs):
            text += " before activations (not estimated for this model)"
        over = [r for r, (p, c) in enumerate(zip(self.peaks, self.capacities)) if p > c]
        if over:
            text += (f"; DOES NOT FIT GPU {', '.join(map(str, over))}: expect it to run out of memory "
                     "(scripts/check_multi_gpu.py --plan-for names what would fit)")
        elif self.tight:
            text += f"; TIGHT: beyond {SAFETY_FRACTION:.0%} of the card, no plan fits with room to spare"
        if self.host is not None:
            text += f"; host memory ~{self.host.total:.1f} GiB for {self.host.processes} process(es)"
            if self.host_room is not None:
                text += f" of {self.host_room.gib:.1f} ({self.host_room.source})"
                if not host_fits(self.host, self.host_room):
                    text += ", MORE THAN THE MACHINE HAS: expect it to swap or be ended for lack of memory"
        if self.changes:
            text += "; sets " + ", ".join(f"{k}={_value(v)}" for k, v in self.changes.items())
        if self.planned_split:
            text += f"; batch split {','.join(map(str, self.planned_split))} by the cards' room"
        if self.slower:
            text += f"; {self.slower}"
        text += "."
        if self.rejected:
            text += " Faster plans that do not fit: " + "; ".join(self.rejected) + "."
        return " ".join([text, *self.warnings()])


def with_changes(cfg, changes: dict[str, object]):
    for path, value in changes.items():
        section, name = path.split(".")
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: value})})
    return cfg


def _value(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _cards(capacities: list[float], source: str) -> str:
    sizes = sorted(set(round(c, 1) for c in capacities))
    if len(sizes) == 1:
        return f"{len(capacities)} GPU(s) of {sizes[0]:g} GiB ({source})"
    return f"GPUs of {', '.join(f'{c:.1f}' for c in capacities)} GiB ({source})"


# ---------------------------------------------------------------------------- the cards
def memory_limits(text: str, world: int) -> list[float] | None:
    """Each rank's limit in GiB (one number for every GPU, or one per GPU); None when none is set."""
    limits = parse_memory_limits(text)
    if not limits:
        return None
    if len(limits) == 1:
        return limits * world
    if len(limits) != world:
        raise ValueError(f"multi_gpu.memory_limit_gib: {text!r} gives {len(limits)} limits for {world} GPU(s); give "
                         "one number for every GPU or one per GPU")
    return limits


def own_limit(cfg, local_rank: int, local_world: int) -> float | None:
    """This process's `multi_gpu.memory_limit_gib` (limits are per machine, numbered as its GPUs); None: none set."""
    limits = memory_limits(cfg.multi_gpu.memory_limit_gib, local_world)
    return None if limits is None else limits[local_rank]


def capacities(cfg, world: int, card_gib: list[float] | None) -> tuple[list[float] | None, str]:
    """(each rank's GiB, where it comes from): `multi_gpu.memory_limit_gib` (never more than the card), else
    the cards' memory; None when neither is known."""
    limits = memory_limits(cfg.multi_gpu.memory_limit_gib, world)
    if limits is not None:
        if card_gib:
            return [min(limit, card) for limit, card in zip(limits, card_gib)], "multi_gpu.memory_limit_gib"
        return limits, "multi_gpu.memory_limit_gib"
    if card_gib:
        return list(card_gib), "free memory"
    return None, "unknown"


# ---------------------------------------------------------------------------- candidates
FEWEST = -1
"""`Setup.offload_blocks` of a layer-offload candidate before `choose_plan` gives it the fewest blocks that fit."""


def plan_problems(cfg, world: int, changes: dict[str, object]) -> list[str]:
    """What the config check (`validation.validate`) refuses in `cfg` as a plan would set it (`changes`) on `world`
    processes, beyond what it refuses in `cfg` itself: a plan is only ever what the check lets through (no FSDP
    for LoHa's adapters, no fp8 base for DoRA, no layer offload of a full fine-tune)."""
    return _Check(cfg, world).problems(changes)


class _Check:
    """`plan_problems` for several plans of one config: the config itself is checked once."""

    def __init__(self, cfg, world: int) -> None:
        self.cfg = with_changes(cfg, {"multi_gpu.enabled": world > 1})
        self.before = set(validate(self.cfg, check_paths=False))

    def problems(self, changes: dict[str, object]) -> list[str]:
        if not changes:
            return []
        return [p for p in validate(with_changes(self.cfg, changes), check_paths=False) if p not in self.before]

    def allows(self, changes: dict[str, object]) -> bool:
        return not self.problems(changes)


def layer_offload_allowed(cfg, sizes: ModelSizes, world: int = 1, check: _Check | None = None) -> bool:
    """Whether a plan may choose how many blocks swap (`multi_gpu.layer_offload` auto): a model with repeated blocks
    the family lists, and the config check lets a number of blocks through (with checkpointing, which it needs)."""
    try:
        setting = parse_layer_offload(cfg.multi_gpu.layer_offload)
    except ValueError:
        return False
    has_blocks = sizes.denoiser_name == "unet" or bool(FAMILIES.get(sizes.family) and FAMILIES[sizes.family].block_groups)
    return setting is None and has_blocks and (check or _Check(cfg, world)).allows({
        "multi_gpu.layer_offload": "1", "training.gradient_checkpointing": True,
        **({"multi_gpu.strategy": "ddp"} if world > 1 else {})})


def candidates(cfg, world: int, sizes: ModelSizes) -> list[Candidate]:
    """The plans to try for `cfg` on `world` processes (`choose_plan` orders them by their estimated speed): each one
    the config check lets through (`plan_problems`)."""
    check = _Check(cfg, world)
    return [c for c in _candidates(cfg, world, sizes, check) if check.allows(changes_of(cfg, _counted(c.setup)))]


def _counted(setup: Setup) -> Setup:
    """`setup` with a number of blocks where the plan has yet to choose how many swap (as the config check sees it)."""
    return dataclasses.replace(setup, offload_blocks=1) if setup.offload_blocks == FEWEST else setup


def _candidates(cfg, world: int, sizes: ModelSizes, check: _Check) -> list[Candidate]:
    t, m, mg = cfg.training, cfg.model, cfg.multi_gpu
    # Each saver the check refuses is left out of every step after it too (FSDP's steps build on each other).
    fp8_possible = m.unet_dtype != "fp8" and check.allows({"model.unet_dtype": "fp8"})
    offload = layer_offload_allowed(cfg, sizes, world, check)
    # Activation offloading moves what checkpointed blocks keep: a transformer's (a UNet's is not estimated).
    activations = sizes.denoiser_name == "transformer" and check.allows({
        "multi_gpu.activation_offload": True, "training.gradient_checkpointing": True})
    if world < 2:
        given = user_setup(cfg, 1, "single")
        return _whole_model_candidates(given, fp8_possible, offload, activations, with_checkpointing=True)
    ddp, fsdp = user_setup(cfg, world, "ddp"), user_setup(cfg, world, "fsdp")
    if mg.strategy == "ddp":
        return _whole_model_candidates(ddp, False, offload, activations, with_checkpointing=False)
    if mg.strategy == "fsdp":
        return [Candidate(_fsdp_name(fsdp, fsdp), fsdp)]
    found = _whole_model_candidates(ddp, fp8_possible, offload, activations, with_checkpointing=False)
    if not check.allows({"multi_gpu.strategy": "fsdp"}):
        return found
    steps = [fsdp]
    if fp8_possible:
        steps.append(dataclasses.replace(steps[-1], fp8=True))
    if not t.gradient_checkpointing:
        steps.append(dataclasses.replace(steps[-1], checkpointing=True))
    if sizes.denoiser_name == "transformer" and not steps[-1].activation_offload:
        steps.append(dataclasses.replace(steps[-1], activation_offload=True))
    if not mg.fsdp_cpu_offload:
        steps.append(dataclasses.replace(steps[-1], cpu_offload=True))
    return found + [Candidate(_fsdp_name(s, fsdp), s) for s in steps]


def _whole_model_candidates(given: Setup, fp8: bool, offload: bool, activations: bool,
                            with_checkpointing: bool) -> list[Candidate]:
    """Plans that hold the whole model on every GPU (one process, DDP): as the config says, with an fp8 base,
    with checkpointing (one process: several GPUs have FSDP's plans for what it saves), with layer offload
    (which needs checkpointing) of as few blocks as fit, and each plan with checkpointing also with activation
    offloading (what checkpointing keeps waits in host memory; `activations`: a transformer the check allows it)."""
    setups = [given]
    if fp8:
        setups.append(dataclasses.replace(given, fp8=True))
    if with_checkpointing and not given.checkpointing:
        setups += [dataclasses.replace(s, checkpointing=True) for s in list(setups)]
    if offload:
        setups += [dataclasses.replace(s, checkpointing=True, offload_blocks=FEWEST) for s in
                   ([given, dataclasses.replace(given, fp8=True)] if fp8 else [given])]
    if activations:
        setups += [dataclasses.replace(s, activation_offload=True) for s in list(setups)
                   if s.checkpointing and not s.activation_offload]
    return [Candidate(_whole_model_name(s, given), s) for s in setups]


def _whole_model_name(setup: Setup, given: Setup, total_blocks: int | None = None) -> str:
    name = "one process" if setup.strategy == "single" else "DDP"
    if setup.fp8 and not given.fp8:
        name += " + fp8 base"
    if setup.checkpointing and not given.checkpointing:
        name += " + checkpointing"
    if setup.offload_blocks and setup.offload_blocks != given.offload_blocks:
        count = "as few blocks as fit" if setup.offload_blocks == FEWEST else f"{setup.offload_blocks} of {total_blocks} blocks"
        name += f" + layer offload ({count})"
    if setup.activation_offload and not given.activation_offload:
        name += " + activation offloading"
    return name


def _fsdp_name(setup: Setup, given: Setup) -> str:
    name = "FSDP"
    for flag, words in (("fp8", "fp8 base"), ("checkpointing", "checkpointing"),
                        ("activation_offload", "activation offloading"), ("cpu_offload", "CPU offload")):
        if getattr(setup, flag) and not getattr(given, flag):
            name += f" + {words}"
    return name


def changes_of(cfg, setup: Setup) -> dict[str, object]:
    """The config fields a plan sets beyond the config (nothing for the config's own plan)."""
    t, m, mg = cfg.training, cfg.model, cfg.multi_gpu
    changes: dict[str, object] = {}
    if setup.strategy in ("ddp", "fsdp") and mg.strategy != setup.strategy:
        changes["multi_gpu.strategy"] = setup.strategy
    if setup.fp8 and m.unet_dtype != "fp8":
        changes["model.unet_dtype"] = "fp8"
    if setup.checkpointing and not t.gradient_checkpointing:
        changes["training.gradient_checkpointing"] = True
    if setup.activation_offload and not mg.activation_offload:
        changes["multi_gpu.activation_offload"] = True
    if setup.cpu_offload and not mg.fsdp_cpu_offload:
        changes["multi_gpu.fsdp_cpu_offload"] = True
    if setup.offload_blocks > 0 and mg.layer_offload.strip().lower() != str(setup.offload_blocks):
        changes["multi_gpu.layer_offload"] = str(setup.offload_blocks)
    return changes


# ---------------------------------------------------------------------------- choosing
def batches_of(cfg, world: int) -> list[int] | None:
    """Each rank's micro-batch from `multi_gpu.batch_split`; None for `auto` (decided with the plan)."""
    try:
        split = parse_split(cfg.multi_gpu.batch_split, world, cfg.training.batch_size)
    except ValueError:
        split = None  # a list for another number of GPUs (validation names it): plan with equal batches
    if split == "auto":
        return None
    return split or [cfg.training.batch_size] * world


def _fit(f: Facts, cfg, setup: Setup, caps: list[float], batches: list[int] | None,
         margin: float) -> tuple[bool, list[Need], list[int], list[int] | None]:
    """(fits, each rank's need, each rank's batch, the planned uneven split or None)."""
    world = len(caps)
    planned = None
    if batches is None:  # multi_gpu.batch_split auto: the split the cards' room allows
        planned = _uneven_split(f, cfg, setup, caps, margin)
        batches = planned or [cfg.training.batch_size] * world
    needs = [need(f, cfg, setup, b) for b in batches]
    fits = all(peak(n, c * margin) <= c * margin for n, c in zip(needs, caps))
    # DDP measures each GPU at start (split_probe) and splits by that; FSDP cannot, so it takes this split.
    uneven = planned is not None and len(set(planned)) > 1 and setup.strategy == "fsdp"
    return fits, needs, batches, planned if uneven else None


def encoders_exceed(n: Need, usable: float) -> bool:
    """Whether the text encoders and VAE alone exceed the card while the cache is filled: no plan changes
    that, so plans are then judged by their training peak (and the start-up log warns)."""
    return n.encoders + RUNTIME_OVERHEAD_GIB > usable


def peak(n: Need, usable: float) -> float:
    """What a plan must fit: its training peak, and its caching peak where the plan decides that."""
    return n.training if encoders_exceed(n, usable) else n.total


def _uneven_split(f: Facts, cfg, setup: Setup, caps: list[float], margin: float) -> list[int] | None:
    """The split of the global micro-batch that finishes soonest within each card's room (equal speeds
    assumed: the room decides), or None when even that does not fit."""
    one = need(f, cfg, setup, 1)
    per_sample = one.parts["activations"]
    if per_sample <= 0:
        return None
    fixed = one.training - per_sample
    ranks = [RankCapacity(max(0.0, c * margin - fixed), per_sample, 1.0) for c in caps]
    try:
        return choose_split(cfg.training.batch_size * len(caps), ranks)
    except SplitDoesNotFit:
        return None


def choose_plan(cfg, sizes: ModelSizes, caps: list[float], capacity_source: str = "free memory",
                refuse: bool = True, host: HostRoom | None = None) -> Plan:
    """The fastest plan that fits every card (see the module's doc) - and the machine's host memory, where `host`
    says how much there is (`host_need.py`); raises `NoPlanFits` when none fits - or, with `refuse` off (a
    worker: the launcher refuses), takes the most frugal plan and says it is tight."""
    f = facts(sizes, cfg)
    world = len(caps)
    processes = host.processes if host is not None else world
    batches = batches_of(cfg, world)
    found = ranked(f, cfg, caps, batches)
    explicit = cfg.multi_gpu.strategy if world > 1 and cfg.multi_gpu.strategy != "auto" else None
    chosen_by = f"multi_gpu.strategy {explicit}" if explicit else "auto"
    rejected: list[str] = []
    too_large_for_host: list[Plan] = []
    for candidate in found:
        fits, needs, chosen, planned = _fit(f, cfg, candidate.setup, caps, batches, SAFETY_FRACTION)
        if fits:
            if len(found) > 1 and candidate.setup.strategy == "fsdp":
                candidate, (needs, chosen, planned) = _leaner(f, cfg, candidate, caps, batches, (needs, chosen, planned))
            plan = _plan(cfg, candidate, needs, chosen, caps, capacity_source, rejected, planned, False, chosen_by)
            plan.host, plan.host_room = host_need(f, cfg, candidate.setup, needs[0], processes, max(chosen)), host
            if not host_fits(plan.host, host):
                too_large_for_host.append(plan)
                rejected.append(f"{candidate.name} ~{plan.host.total:.1f} GiB of host memory (of {host.gib:.1f}, "
                                f"{HOST_SAFETY_FRACTION:.0%} usable)")
                continue
            plan.rejected = list(rejected)
            plan.slower = _next_that_fits(f, cfg, candidate, found, caps, batches)
            return plan
        rejected.append(_why_not(candidate, needs, caps))
    if too_large_for_host:  # the GPUs hold a plan, the machine's memory none
        least = min(too_large_for_host, key=lambda p: p.host.total)
        if refuse:
            raise NoPlanFits(host_refusal(cfg, sizes, caps, capacity_source, least, host))
        least.rejected = [r for r in rejected if not r.startswith(least.name + " ~")]
        return least
    last = most_frugal(f, cfg, found, caps, batches)
    fits, needs, chosen, planned = _fit(f, cfg, last.setup, caps, batches, 1.0)
    if fits or not refuse:  # the most frugal plan (or the one asked for): the log says it is tight
        rejected = [r for c, r in zip(found, rejected) if c is not last]
        plan = _plan(cfg, last, needs, chosen, caps, capacity_source, rejected, planned, True, chosen_by)
        plan.host, plan.host_room = host_need(f, cfg, last.setup, needs[0], processes, max(chosen)), host
        if fits and refuse and not host_fits(plan.host, host):
            raise NoPlanFits(host_refusal(cfg, sizes, caps, capacity_source, plan, host))
        return plan
    raise NoPlanFits(refusal(cfg, f, last, caps, capacity_source))


def host_refusal(cfg, sizes: ModelSizes, caps: list[float], source: str, least: Plan, host: HostRoom) -> str:
    """Why the machine's memory holds no plan the GPUs hold: the figure by part, and what would fit."""
    parts = ", ".join(f"{name} {gib:.1f}" for name, gib in least.host.parts.items())
    text = (f"nothing fits the host memory of this machine ({host.gib:.1f} GiB, {host.source}; "
            f"{HOST_SAFETY_FRACTION:.0%} usable) beside {_cards(caps, source)}: the plan that needs the least, "
            f"{least.name}, needs ~{least.host.total:.1f} GiB of host memory for {host.processes} process(es) ({parts}).")
    options = []
    if cfg.training.method == "lora" and cfg.model.unet_dtype != "fp8":
        fp8 = with_changes(cfg, {"model.unet_dtype": "fp8"})
        if not plan_problems(cfg, len(caps), {"model.unet_dtype": "fp8"}):
            try:
                choose_plan(fp8, sizes, caps, source, host=host)
                options.append("model.unet_dtype fp8 (half the bytes of a swapped or offloaded base)")
            except NoPlanFits:
                pass
    options.append(f"a machine with {math.ceil(least.host.total / HOST_SAFETY_FRACTION)} GiB or more of available "
                   "memory (or close what else uses it)")
    return text + " Any one of these fits: " + "; ".join(options) + "."


def ranked(f: Facts, cfg, caps: list[float], batches) -> list[Candidate]:
    """The candidates, each layer offload given its fewest blocks that fit, fastest first by the estimate
    (`plan_speed.py`; equal estimates keep the order the candidates were listed in)."""
    found = [_with_fewest_blocks(f, cfg, c, caps, batches) for c in candidates(cfg, len(caps), f.sizes)]
    batch = max(batches or [cfg.training.batch_size])
    return sorted(found, key=lambda c: step_seconds(f, cfg, c.setup, batch))


def _with_fewest_blocks(f: Facts, cfg, candidate: Candidate, caps: list[float], batches) -> Candidate:
    """A layer-offload candidate with the fewest swapped blocks that fit every card (all of them when none do;
    none when checkpointing alone fits - then it is the plan with checkpointing, named so)."""
    if candidate.setup.offload_blocks != FEWEST:
        return candidate
    total = len(f.block_params)

    def fits(count: int) -> bool:
        return _fit(f, cfg, dataclasses.replace(candidate.setup, offload_blocks=count), caps, batches,
                    SAFETY_FRACTION)[0]

    low, high = 0, total  # more blocks swapped never needs more memory: the first count that fits, by halving
    if not fits(high):
        low = high
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    setup = dataclasses.replace(candidate.setup, offload_blocks=low)
    given = user_setup(cfg, len(caps), setup.strategy)
    return Candidate(_whole_model_name(setup, given, total), setup)


def _next_that_fits(f: Facts, cfg, chosen: Candidate, found: list[Candidate], caps: list[float], batches) -> str:
    """"X fits too, at an estimated N x the step time": the next candidate that fits, which the chosen one beat on
    the speed estimate (empty when none does)."""
    batch = max(batches or [cfg.training.batch_size])
    mine = step_seconds(f, cfg, chosen.setup, batch)
    for other in found[found.index(chosen) + 1 if chosen in found else len(found):]:
        if _fit(f, cfg, other.setup, caps, batches, SAFETY_FRACTION)[0]:
            ratio = step_seconds(f, cfg, other.setup, batch) / mine if mine > 0 else 1.0
            return f"{other.name} fits too, at an estimated {ratio:.2f}x the step time"
    return ""


def most_frugal(f: Facts, cfg, found: list[Candidate], caps: list[float], batches) -> Candidate:
    """The candidate whose largest estimate over the cards is the smallest (ties: the later listed)."""
    def worst(candidate: Candidate) -> float:
        needs = _fit(f, cfg, candidate.setup, caps, batches, SAFETY_FRACTION)[1]
        return max(peak(n, c * SAFETY_FRACTION) - c for n, c in zip(needs, caps))
    return min(reversed(found), key=worst)


PRUNED = ("checkpointing", "activation_offload", "fp8")
"""Savers a plan drops again when a later step made them unnecessary, costliest first."""
ADDED_IN_ORDER = ("fp8", "checkpointing", "activation_offload", "cpu_offload")


def _leaner(f: Facts, cfg, candidate: Candidate, caps: list[float], batches, figures):
    """`candidate` without the savers it no longer needs: the step that made it fit (CPU offload, say) can
    make an earlier one (checkpointing) unnecessary, and each costs speed. The step that made it fit stays."""
    setup, given = candidate.setup, user_setup(cfg, len(caps), candidate.setup.strategy)
    added = [flag for flag in ADDED_IN_ORDER if getattr(setup, flag) and not getattr(given, flag)]
    for flag in PRUNED:
        if flag not in added[:-1]:
            continue
        fewer = dataclasses.replace(setup, **{flag: False})
        if flag == "checkpointing" and fewer.activation_offload and not given.activation_offload:
            fewer = dataclasses.replace(fewer, activation_offload=False)  # offloading moves what checkpointing keeps
        if fewer.activation_offload and not fewer.checkpointing:
            continue
        fits, *rest = _fit(f, cfg, fewer, caps, batches, SAFETY_FRACTION)
        if fits:
            setup, figures = fewer, tuple(rest)
    if setup == candidate.setup:
        return candidate, figures
    name = _fsdp_name(setup, given) if setup.strategy == "fsdp" else candidate.name
    return Candidate(name, setup), figures


def user_setup(cfg, world: int, strategy: str) -> Setup:
    """The savers the config itself turns on, under `strategy`."""
    t, mg = cfg.training, cfg.multi_gpu
    if strategy != "fsdp":
        try:
            blocks = parse_layer_offload(mg.layer_offload) or 0
        except ValueError:
            blocks = 0  # validation names it
        return Setup(strategy, world, cfg.model.unet_dtype == "fp8", t.gradient_checkpointing,
                     mg.activation_offload and t.gradient_checkpointing,
                     offload_blocks=blocks if t.method == "lora" else 0)
    return Setup("fsdp", world, cfg.model.unet_dtype == "fp8", t.gradient_checkpointing,
                 mg.activation_offload and t.gradient_checkpointing, mg.fsdp_cpu_offload)


def _plan(cfg, candidate, needs, batches, caps, source, rejected, planned, tight, chosen_by="auto") -> Plan:
    return Plan(candidate, needs, batches, caps, source, rejected, tight, planned, changes_of(cfg, candidate.setup),
                chosen_by)


def _why_not(candidate: Candidate, needs: list[Need], caps: list[float]) -> str:
    worst = max(range(len(needs)), key=lambda r: peak(needs[r], caps[r] * SAFETY_FRACTION) - caps[r])
    n, usable = needs[worst], caps[worst] * SAFETY_FRACTION
    caching = n.training <= usable < peak(n, usable)
    return (f"{candidate.name} ~{n.caching if caching else n.training:.1f} GiB{' while caching' if caching else ''} "
            f"on GPU {worst} (of {caps[worst]:.1f}, {SAFETY_FRACTION:.0%} usable)")


# ---------------------------------------------------------------------------- refusing
def refusal(cfg, f: Facts, last: Candidate, caps: list[float], source: str) -> str:
    """Why nothing fits, with the smallest changes that would."""
    world = len(caps)
    n = max((need(f, cfg, last.setup, b) for b in (batches_of(cfg, world) or [cfg.training.batch_size])),
            key=lambda x: peak(x, min(caps) * SAFETY_FRACTION))
    usable = min(caps) * SAFETY_FRACTION
    caching = n.training <= usable < peak(n, usable)
    figure = n.caching if caching else n.training
    which = (f"multi_gpu.strategy {cfg.multi_gpu.strategy} ({last.name})" if cfg.multi_gpu.strategy != "auto"
             else f"the plan that saves the most memory, {last.name},")
    text = (f"nothing fits {_cards(caps, source)}: {which} needs ~{figure:.1f} GiB per GPU"
            + (" while caching (the model on the GPU with the text encoders)" if caching else
               f" (weights and state {n.training - n.parts['activations']:.1f}, activations "
               f"{n.parts['activations']:.1f})") + ".")
    options = smallest_changes(cfg, f, caps)
    if options:
        text += " Any one of these fits: " + "; ".join(options) + "."
    else:
        text += " No single change of batch size, resolution, fp8 base or more GPUs fits: use GPUs with more memory."
    return text


def _quick_fit(cfg, f: Facts, caps: list[float]) -> bool:
    """Whether some plan fits the cards with room to spare (what the refusal's changes are judged by)."""
    batches = batches_of(cfg, len(caps))
    return any(_fit(f, cfg, c.setup, caps, batches, SAFETY_FRACTION)[0] for c in ranked(f, cfg, caps, batches))


def smallest_changes(cfg, f: Facts, caps: list[float]) -> list[str]:
    """The changes that would fit, each alone, least intrusive first: the automatic plan (for an explicit
    strategy), a smaller batch per GPU (the global batch kept by accumulation), bf16 training or an fp8 base,
    a lower resolution, more GPUs like the smallest."""
    t = cfg.training
    options = []
    if cfg.multi_gpu.strategy != "auto" and len(caps) > 1:
        auto = with_changes(cfg, {"multi_gpu.strategy": "auto"})
        if _quick_fit(auto, f, caps):
            options.append(f"multi_gpu.strategy auto (plan: {choose_plan(auto, f.sizes, caps).name})")
    if cfg.multi_gpu.layer_offload.strip().lower() not in ("auto", ""):
        auto = with_changes(cfg, {"multi_gpu.layer_offload": "auto"})
        if _quick_fit(auto, f, caps):
            options.append(f"multi_gpu.layer_offload auto (plan: {choose_plan(auto, f.sizes, caps).name})")
    if t.batch_size > 1:
        for batch in range(t.batch_size - 1, 0, -1):
            smaller = with_changes(cfg, {"training.batch_size": batch, "multi_gpu.batch_split": "equal"})
            if _quick_fit(smaller, f, caps):
                keep = t.batch_size * t.gradient_accumulation_steps
                accumulation = f" with training.gradient_accumulation_steps {keep // batch}" if keep % batch == 0 else ""
                options.append(f"training.batch_size {batch}{accumulation} (the same global batch)"
                               if accumulation else f"training.batch_size {batch}")
                break
    if t.precision != "bf16" and _quick_fit(with_changes(cfg, {"training.precision": "bf16"}), f, caps):
        options.append("training.precision bf16")  # half the activations; FSDP and an fp8 base become possible
    elif t.method == "lora" and cfg.model.unet_dtype != "fp8":
        fp8 = with_changes(cfg, {"model.unet_dtype": "fp8", "training.precision": "bf16"})
        if _quick_fit(fp8, f, caps):
            options.append("model.unet_dtype fp8" + (" with training.precision bf16" if t.precision != "bf16" else ""))
    step = max(64, FAMILIES[f.sizes.family].pixel_multiple if f.sizes.family in FAMILIES else 64)
    for resolution in range(cfg.data.resolution - step, 255, -step):
        if _quick_fit(with_changes(cfg, {"data.resolution": resolution}), f, caps):
            options.append(f"data.resolution {resolution}")
            break
    if cfg.multi_gpu.strategy != "ddp":
        for cards in range(len(caps) + 1, MOST_CARDS + 1):
            more = [min(caps)] * cards
            if _quick_fit(with_changes(cfg, {"multi_gpu.batch_split": "equal"}), f, more):
                options.append(f"{cards} GPUs of {min(caps):g} GiB")
                break
    return options


def plan_for_cards(cfg, sizes: ModelSizes, card_gib: list[float] | None, world: int) -> Plan | None:
    """The plan for `world` processes on cards of `card_gib` (None: unknown, then only `memory_limit_gib`
    says); None when the cards are unknown."""
    caps, source = capacities(cfg, world, card_gib)
    if caps is None:
        return None
    return choose_plan(cfg, sizes, caps, source)


def parse_plan_for(text: str) -> tuple[list[float], float | None]:
    """`--plan-for` as cards and the machine's host memory: `1x24:64` -> ([24], 64.0) - one 24 GiB card in a
    machine with 64 GiB of memory to spare; `2x24` -> ([24, 24], None), the host memory not checked."""
    cards, colon, host = text.replace(" ", "").partition(":")
    if not colon:
        return parse_cards(cards), None
    try:
        gib = float(host)
    except ValueError:
        gib = 0.0
    if not gib > 0:
        raise ValueError(f"--plan-for {text!r}: after the cards, ':' names the machine's host memory in GiB, "
                         "e.g. 1x24:64")
    return parse_cards(cards), gib


def parse_cards(text: str) -> list[float]:
    """`--plan-for` cards: `2x24` -> [24, 24], `24,16` -> [24, 16], `4x24,2x16` -> 4 x 24 and 2 x 16."""
    cards: list[float] = []
    for part in text.replace(" ", "").split(","):
        count, times, size = part.partition("x")
        try:
            cards += [float(size)] * int(count) if times else [float(part)]
        except ValueError:
            raise ValueError(f"--plan-for {text!r}: write the cards as 2x24 (two of 24 GiB) or 24,16 (one each), and "
                             "the machine's host memory after a colon if it should be checked: 1x24:64") from None
    if not cards or any(c <= 0 for c in cards):
        raise ValueError(f"--plan-for {text!r}: name at least one card of more than 0 GiB")
    return cards
