"""The table `scripts/gpu/pooling.sh` prints last: each memory-pooling row beside one uncapped GPU and the
raw reference, and the plan's estimate beside each GPU's measured peak.

    python -m modules.benchmark.pooling_table OUT/pooling-*.jsonl

Each file holds one row's JSON lines (`scripts/benchmark.py --json` and the raw reference's): the capped
multi-GPU run (it carries `memory_limit_gib` and the plan), the one-GPU run without a limit where the
job fits one, and the raw reference (`"source": "raw_reference"`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def read(path: Path) -> dict:
    """A row's runs by role: `capped`, `one` and `reference` (None when missing: not run, or it failed)."""
    runs = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("{")]
    reference = next((r for r in runs if r.get("source") == "raw_reference"), None)
    ours = [r for r in runs if r.get("source") != "raw_reference"]
    capped = next((r for r in ours if r.get("memory_limit_gib")), None)
    one = next((r for r in ours if r.get("world") == 1 and not r.get("memory_limit_gib")), None)
    return {"row": path.stem.removeprefix("pooling-"), "capped": capped, "one": one, "reference": reference}


def _peaks(run: dict | None) -> str:
    if not run:
        return "-"
    ranks = sorted(run.get("per_rank") or [], key=lambda r: r["rank"])
    return ", ".join(f"{r['max_mem_gib']:.1f}" for r in ranks) or "-"


def _speed(run: dict | None) -> str:
    return f"{run['samples_per_s']:.2f}" if run and run.get("samples_per_s") is not None else "-"


def table(rows: list[dict]) -> str:
    out = ["| row | case | GPUs x limit (GiB) | plan | estimated peak per GPU | measured peak per GPU | img/s | "
           "one uncapped GPU img/s | raw reference img/s (peak GiB) | GPU |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        capped, one, ref = row["capped"], row["one"], row["reference"]
        estimate = ", ".join(f"{p:.1f}" for p in (capped or {}).get("estimated_peak_gib") or []) or "-"
        limit = f"{capped['world']} x {capped['memory_limit_gib']}" if capped else "-"
        reference = f"{ref['samples_per_s']:.2f} ({ref.get('max_mem_gib')})" if ref else "-"
        case, plan = (capped or one or {}).get("case", "-"), (capped or {}).get("plan", "-")
        out.append(f"| {row['row']} | {case} | {limit} | {plan} | {estimate} | {_peaks(capped)} | {_speed(capped)} | "
                   f"{_speed(one)} | {reference} | {(capped or one or ref or {}).get('gpu', '-')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    rows = [read(p) for p in paths if p.is_file()]
    if not rows:
        print("no pooling results found", file=sys.stderr)
        return 1
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
