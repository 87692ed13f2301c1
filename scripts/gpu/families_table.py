"""The table that ends each part of scripts/gpu/families.sh: the raw reference and Tandem side by side.

    python3 scripts/gpu/families_table.py RESULTS.jsonl [FIRST_LINE]

Reads the results written from line FIRST_LINE on (the part's own) and prints, per model, mode and GPU
count, img/s and peak GiB per GPU of each, and Tandem's throughput as a share of the reference's.
"""
import json
import sys


def rows(path: str, first: int) -> list[dict]:
    with open(path, encoding="utf-8") as file:
        lines = file.read().splitlines()[first:]
    return [json.loads(line) for line in lines if line.startswith("{")]


EDIT_MODELS = {"qwen": "qwen_edit"}
"""The reference's --model whose control images make it another Tandem family (Qwen-Image-Edit is Qwen-Image's
transformer trained on pairs); Flux.2 with reference images stays Flux.2."""


def key(result: dict) -> tuple:
    if result.get("source") == "raw_reference":
        variant = result.get("variant") or ("dev" if result["model"] == "flux2" else "")
        controls = result.get("control", 0)
        name = EDIT_MODELS.get(result["model"], result["model"]) if controls else result["model"]
        model = f"{name}-{variant}" if variant else name
        return model, result["mode"], result["world"], controls
    return result["case"].split()[0], result["mode"], result["world"], result.get("controls", 0)


def table(results: list[dict]) -> str:
    cases: dict[tuple, dict] = {}
    for result in results:
        side = "reference" if result.get("source") == "raw_reference" else "tandem"
        cases.setdefault(key(result), {})[side] = result
    out = ["| model | mode | GPUs | controls | reference img/s | reference peak GiB/GPU | Tandem img/s | Tandem peak GiB/GPU "
           "| Tandem strategy | Tandem / reference |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (model, mode, world, controls), sides in sorted(cases.items()):
        ref, tan = sides.get("reference", {}), sides.get("tandem", {})
        share = (f"{100 * tan['samples_per_s'] / ref['samples_per_s']:.0f}%"
                 if ref.get("samples_per_s") and tan.get("samples_per_s") else "-")
        out.append(f"| {model} | {mode} | {world} | {controls} | {ref.get('samples_per_s', '-')} | {ref.get('max_mem_gib', '-')} "
                   f"| {tan.get('samples_per_s', '-')} | {tan.get('max_mem_gib', '-')} | {tan.get('strategy', '-')} "
                   f"| {share} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table(rows(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)))
