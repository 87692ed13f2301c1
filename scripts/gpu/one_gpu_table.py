"""The table that ends scripts/gpu/one_gpu_job.sh: each run of the one-GPU job, launch to exit.

    python3 scripts/gpu/one_gpu_table.py RESULTS.jsonl [FIRST_LINE]

Reads the result lines of scripts/end_to_end.py written from line FIRST_LINE on (the call's own) and prints per
run: the wall clock, the time before step 1 with its phases, the first step and the compile in it, launch to the
first step with the compile left out (issue 62's start-up figure), images/s over the whole run, and what
`training.compile` auto chose.
"""
import json
import sys


def rows(path: str, first: int) -> list[dict]:
    with open(path, encoding="utf-8") as file:
        lines = file.read().splitlines()[first:]
    return [json.loads(line) for line in lines if line.startswith("{") and '"wall_s"' in line]


def seconds(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(results: list[dict]) -> str:
    out = ["| run | exit | wall s | before step 1 s (phases) | first step s (compile) | launch to step 1, compile "
           "aside s | img/s over the run | training.compile |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        phases = ", ".join(f"{name} {value:.1f}" for name, value in r.get("startup_phases_s", {}).items())
        compile_s = sum(c["s"] for c in r.get("compiles", []))
        first = r.get("first_step_s")
        before = r.get("before_step1_s")
        to_step = None if first is None or before is None else before + first - compile_s
        choice = r.get("compile_choice") or next((v.split("=", 1)[1] for v in r["job"]["extra"]
                                                   if v.split(":", 1)[-1].startswith("training.compile=")), "auto")
        out.append(f"| {r['label']} | {r['exit_code']} | {seconds(r['wall_s'])} | {seconds(before)} ({phases}) | "
                   f"{seconds(first)} ({seconds(compile_s) if r.get('compiles') else 'no compile'}) | "
                   f"{seconds(to_step)} | {r.get('run_images_per_s', '-')} | {choice} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table(rows(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)))
