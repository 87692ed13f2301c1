"""The table of scripts/gpu/offload.sh: each benchmark line's plan, speed, GPU peak and every rank's host memory.

    python3 scripts/gpu/offload_table.py RESULTS.jsonl [FIRST_LINE]

Host memory per rank as the benchmark read it at the end of the measured steps (`modules/util/host_memory.py`):
PSS (each shared page divided over the processes mapping it: the ranks' PSS add up to what they hold together),
RSS, the peak RSS (VmHWM, loading included), and layer offload's host copy with each rank's PSS of it. The last
column compares a run's summed PSS with the one-GPU run of the same model and limit: issue 56 asks at most 1.2x.
"""
from __future__ import annotations

import json
import sys


def _gib(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def rows(lines: list[dict]) -> list[str]:
    out = ["| case | GPUs | plan | layer offload | img/s | GPU peak GiB | host PSS GiB per rank (sum) | host RSS / peak RSS "
           "GiB per rank | offload copy GiB (PSS per rank) | PSS vs 1 GPU |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    one_gpu = {}
    for r in lines:
        if r.get("source") == "raw_reference" or r.get("world") != 1:
            continue
        one_gpu[(r.get("model"), r.get("memory_limit_gib"))] = sum(p.get("host_pss_gib") or 0 for p in r["per_rank"])
    for r in lines:
        if r.get("source") == "raw_reference":
            out.append(f"| raw reference {r.get('model', '')} | {r.get('world', r.get('gpus', '-'))} | - | - | "
                       f"{r.get('samples_per_s', r.get('img_s', '-'))} | {_gib(r.get('max_mem_gib'))} | - | - | - | - |")
            continue
        ranks = r.get("per_rank", [])
        pss = [p.get("host_pss_gib") for p in ranks]
        total = sum(p or 0 for p in pss)
        rss = " · ".join(f"{_gib(p.get('host_rss_gib'))}/{_gib(p.get('host_peak_rss_gib'))}" for p in ranks)
        copy = ranks[0].get("offload_copy_gib") if ranks else None
        shares = " + ".join(_gib(p.get("offload_copy_pss_gib")) for p in ranks)
        base = one_gpu.get((r.get("model"), r.get("memory_limit_gib")))
        ratio = f"{total / base:.2f}x" if base and r.get("world", 1) > 1 else "-"
        out.append(f"| {r['case']} | {r['world']} | {r.get('plan') or r.get('strategy')} | "
                   f"{r.get('layer_offload_blocks') or 0} | {r['samples_per_s']} | {_gib(r.get('max_mem_gib'))} | "
                   f"{' + '.join(_gib(p) for p in pss)} ({total:.1f}) | {rss} | "
                   f"{_gib(copy)} ({shares}) | {ratio} |")
    return out


def main(argv: list[str]) -> int:
    path, first = argv[0], int(argv[1]) if len(argv) > 1 else 0
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f.read().splitlines()[first:] if line.startswith("{")]
    print("\n".join(rows(lines)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
