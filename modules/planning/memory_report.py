"""The memory plan in words: `scripts/check_multi_gpu.py --plan-for 2x24` and the GUI's memory line.

Both show the plan Tandem would make for cards you name (or the GUI sees) without touching a GPU: the
plan, each GPU's estimate by part, why faster plans do not fit - or, when nothing fits, the smallest
changes that would. Torch-free; a model that must be built on `meta` to be sized is built by the
caller's `measure` (`modules/distributed/memory_estimate.py`).
"""
from __future__ import annotations

import json
import time

from modules.planning.host_need import HostRoom
from modules.planning.memory_plan import NoPlanFits, Plan, capacities, choose_plan, parse_plan_for
from modules.planning.model_sizes import ModelSizes, model_sizes


def plan_table(plan: Plan) -> list[str]:
    """Each GPU's estimate by part, in GiB, one column per GPU (identical GPUs: one column)."""
    columns = list(range(len(plan.needs)))
    same = all(plan.needs[r].parts == plan.needs[0].parts and plan.capacities[r] == plan.capacities[0] for r in columns)
    columns = columns[:1] if same else columns
    head = "all GPUs" if same and len(plan.needs) > 1 else None
    width = 10
    lines = ["per GPU, GiB" + " " * 20 + "".join(f"{(head or f'GPU {r}'):>{width}}" for r in columns)]
    for part in plan.needs[0].parts:
        values = [plan.needs[r].parts[part] for r in columns]
        if any(v > 0.005 for v in values):
            lines.append(f"  {part:<30}" + "".join(f"{v:>{width}.2f}" for v in values))
    rows = (("training peak", [plan.needs[r].training for r in columns]),
            ("while caching", [plan.needs[r].caching for r in columns]),
            ("the card", [plan.capacities[r] for r in columns]))
    lines += [f"  {name:<30}" + "".join(f"{v:>{width}.2f}" for v in values) for name, values in rows]
    hosts = [plan.needs[r].host for r in columns]
    if any(h > 0 for h in hosts):
        lines.append(f"  {'in host memory (offload)':<30}" + "".join(f"{v:>{width}.2f}" for v in hosts))
    if plan.host is not None:
        room = f" of {plan.host_room.gib:.2f}" if plan.host_room is not None else ""
        lines.append(f"host memory of the machine, GiB: {plan.host.total:.2f}{room} ("
                     + ", ".join(f"{name} {gib:.2f}" for name, gib in plan.host.parts.items()) + ")")
    return lines


def describe_model(cfg, sizes: ModelSizes) -> str:
    t = cfg.training
    method = f"LoRA rank {t.lora_rank}" if t.method == "lora" else "full fine-tune"
    return (f"{sizes.family}, {method}, {t.precision}, batch {t.batch_size} x accumulation "
            f"{t.gradient_accumulation_steps} at {cfg.data.resolution} px, {cfg.optimizer.name}; sizes from {sizes.source}")


def plan_report(cfg, cards_text: str, measure=None, builtin_folder=None) -> tuple[dict, str, int]:
    """(report as data, as text, exit status: 0 a plan fits, 1 nothing fits) for `cfg` on the cards
    `cards_text` names (`2x24`, `24,16`)."""
    started = time.perf_counter()
    cards, host_gib = parse_plan_for(cards_text)
    sizes = model_sizes(cfg, measure, builtin_folder)
    sized = time.perf_counter()
    caps, source = capacities(cfg, len(cards), cards)
    source = f"{source} of --plan-for {cards_text}" if source == "multi_gpu.memory_limit_gib" else f"--plan-for {cards_text}"
    host = HostRoom(host_gib, f"--plan-for {cards_text}", len(cards)) if host_gib else None
    data: dict = {"cards": cards, "capacities": caps, "host_gib": host_gib, "model": describe_model(cfg, sizes)}
    lines = [f"Model: {data['model']}"]
    try:
        plan = choose_plan(cfg, sizes, caps, source, host=host)
    except NoPlanFits as e:
        lines.append(f"REFUSED: {e}")
        data.update(plan=None, refused=str(e))
        code = 1
    else:
        lines.append(plan.describe())
        lines += plan_table(plan)
        data.update(plan=plan.name, strategy=plan.strategy, changes=plan.changes, peaks=plan.peaks, tight=plan.tight,
                    rejected=plan.rejected, split=plan.planned_split,
                    parts=[n.parts for n in plan.needs], training=[n.training for n in plan.needs],
                    caching=[n.caching for n in plan.needs],
                    host=dict(plan.host.parts, total=plan.host.total) if plan.host is not None else None)
        code = 0
    data["seconds"] = {"sizing the model": round(sized - started, 3), "planning": round(time.perf_counter() - sized, 3)}
    lines.append(f"(sized in {1000 * (sized - started):.0f} ms, planned in {1000 * (time.perf_counter() - sized):.0f} ms;"
                 " nothing ran on a GPU)")
    return data, "\n".join(lines), code


def memory_line(cfg, world: int, cards: list[float] | None, sizes: ModelSizes) -> str:
    """The GUI's memory line for the chosen GPUs (`cards`: each one's memory in GiB; one for a run of one
    process): the plan, its estimate per GPU and what it sets, or what would fit."""
    if cards and len(cards) != world:
        cards = [min(cards)] * world
    caps, source = capacities(cfg, world, cards)
    if caps is None:
        return ("Memory plan: no GPU to compare with (type the GPUs' memory into Memory per GPU to plan for "
                "them).")
    label = "limit" if source == "multi_gpu.memory_limit_gib" else "card"
    sizes_text = ", ".join(sorted({f"{c:g}" for c in caps}, key=float))
    gpus = "one GPU" if len(caps) == 1 else f"{len(caps)} GPU(s)"
    head = f"Memory plan for {gpus} of {sizes_text} GiB ({label})"
    try:
        plan = choose_plan(cfg, sizes, caps, source)
    except NoPlanFits as e:
        return f"{head}: {str(e).split(': ', 1)[-1]}"
    line = f"{head}: {plan.name}, ~{max(plan.peaks):.1f} GiB per GPU"
    if plan.chosen_by != "auto":  # the window names the field by its label (`FieldPlaces.describe`)
        line += " (set by multi_gpu.strategy)" if plan.chosen_by.startswith("multi_gpu.strategy") else f" ({plan.chosen_by})"
    if not all(n.activations_known for n in plan.needs):
        line += " before activations (not estimated for this model)"
    if any(p > c for p, c in zip(plan.peaks, plan.capacities)):
        line += " - does not fit"
    elif plan.tight:
        line += " - tight"
    if plan.changes:  # what the plan turns on: the window names each field by its tab and label
        line += " · sets " + ", ".join(f"{k} {_shown(v)}" for k, v in plan.changes.items())
    if plan.host is not None and plan.host.parts.get("layer offload's copy (one per machine)"):
        line += f" · ~{plan.host.total:.0f} GiB of host memory"
    if plan.rejected:
        line += " · faster plans do not fit: " + "; ".join(r.split(" on GPU")[0] for r in plan.rejected)
    return line


def _shown(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def report_json(data: dict) -> str:
    return json.dumps(data, indent=2, default=str)
