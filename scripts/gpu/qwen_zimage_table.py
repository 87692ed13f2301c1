"""The table of scripts/gpu/qwen_zimage.sh: its part's JSON lines (raw reference, trainer, text encoder) side by side.

    python3 scripts/gpu/qwen_zimage_table.py RESULTS.jsonl FIRST_LINE
Rows pair each trainer result with the raw reference of the same model, mode, world size and sharding that ran
before it in the same call; the targets are the issue's: throughput >= the reference, peak memory within 10%.
"""
import json
import sys


def main(path: str, first: int) -> None:
    lines = [json.loads(line) for line in open(path).read().splitlines()[first:] if line.startswith("{")]
    refs = [r for r in lines if r.get("source") == "raw_reference"]
    print("| case | GPUs | strategy | reference img/s | Tandem img/s | Tandem / ref | ref peak GiB | Tandem peak GiB "
          "(max over GPUs) | peak vs ref | card |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in lines:
        if "case" not in r:
            continue
        sharded = r.get("strategy") == "fsdp"
        ref = next((x for x in reversed(refs) if x["model"] == r["model"] and x["mode"] == r["mode"]
                    and x["world"] == r["world"] and bool(x.get("fsdp")) == sharded), None)
        speed = f"{r['samples_per_s'] / ref['samples_per_s']:.2f}" if ref else "-"
        memory = f"{100 * (r['max_mem_gib'] / ref['max_mem_gib'] - 1):+.0f}%" if ref and ref.get("max_mem_gib") else "-"
        print(f"| {r['case']} | {r['world']} | {r['strategy']} | {ref['samples_per_s'] if ref else '-'} | "
              f"{r['samples_per_s']} | {speed} | {ref['max_mem_gib'] if ref else '-'} | {r['max_mem_gib']} | {memory} | "
              f"{r.get('gpu', '')} |")
    texts = [r for r in lines if r.get("source") == "tandem_text_encoder"]
    if texts:
        print()
        print("| text encoder | placement | GPUs | weights GiB | place s | encode s | texts/s | peak GiB per GPU |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in texts:
            print(f"| {r['family']} | {r['placement']} | {r['world']} | {r['weights_gib']} | {r.get('place_s', r.get('build_and_place_s'))} | "
                  f"{r['encode_s']} ({r['texts']} texts) | {r['texts_per_s']} | {r['peak_gib']} |")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
