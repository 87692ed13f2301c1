"""Can this PyTorch keep dynamo's work between processes (`torch._dynamo.config.caching_precompile`)?

A compiled run's start pays dynamo's tracing again even when every kernel comes from the compile cache
(8.3 s of the SD1.5 LoRA's 15.8 s compile on an H200, docs/perf/2026-11-29-h200x2.jsonl). PyTorch's experimental
"caching precompile" records dynamo's output, and `torch.compiler.save_cache_artifacts` /
`load_cache_artifacts` carry it to the next process. Tandem could use it only if a process that loaded it
can still compile what the saved one had not seen: every aspect bucket is a batch shape of its own, and a
run may meet a new one. Three fresh processes answer: one compiles and saves; one loads and calls the same
shape (is the tracing skipped, are the results the eager ones); one loads and calls a new shape too.

    python3 scripts/gpu/precompile_probe.py [cpu|cuda]      # prints one JSON line per process, then a verdict

On the CPU build of PyTorch 2.13 (2026-11-29, 2-core machine): after loading, the same shape's first call
took 0.006 s (15.0 s compiling afresh; 2.4 s served by the kernel cache alone, in a run apart), with the
eager results; the new shape failed inside dynamo ("AssertionError: Name '__builtins_dict___0' already
exists in scope"), as did a model of another width with the same code (tried apart). Not usable for
training in that version; run it again on a newer one.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

DEVICE = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in ("cpu", "cuda") else "cpu"


def one_process(step: str, artifacts: str) -> None:
    import torch
    from torch._dynamo.utils import compilation_time_metrics, counters

    if step != "save":
        torch.compiler.load_cache_artifacts(open(artifacts, "rb").read())
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
                                  for _ in range(12)]).to(DEVICE)
    compiled = torch.compile(model, backend="inductor", dynamic=False)
    result = {"step": step, "torch": torch.__version__, "device": DEVICE}
    for batch in ((8, 4) if step == "load-new-shape" else (8,)):
        x = torch.randn(batch, 64, device=DEVICE, requires_grad=True)
        started = time.perf_counter()
        try:
            out = compiled(x)
            out.sum().backward()
        except Exception as e:  # noqa: BLE001 - the answer this probe is for
            result[f"batch {batch}"] = f"failed: {type(e).__name__}: {str(e).splitlines()[-1][:200]}"
            break
        seconds = time.perf_counter() - started
        grad, x.grad = x.grad.clone(), None
        eager = model(x)
        eager.sum().backward()
        result[f"batch {batch}"] = {"first call s": round(seconds, 3),
                                    "max difference to eager": max((out - eager).abs().max().item(),
                                                                   (grad - x.grad).abs().max().item())}
    result["tracing s"] = round(sum(compilation_time_metrics.get("bytecode_tracing", ())), 3)
    result["dynamo cache"] = dict(counters["dynamo_cache"])
    if step == "save":
        with open(artifacts, "wb") as f:
            f.write(torch.compiler.save_cache_artifacts()[0])
    print(json.dumps(result), flush=True)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        artifacts = os.path.join(folder, "artifacts.bin")
        lines = []
        for step in ("save", "load-same-shape", "load-new-shape"):
            # Each process with an empty kernel cache of its own, so only the loaded artifacts can serve it.
            env = {**os.environ, "TORCH_CACHING_PRECOMPILE": "1", "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, step)}
            done = subprocess.run([sys.executable, __file__, DEVICE, step, artifacts], env=env, capture_output=True,
                                  text=True)
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("{")), None)
            print(line or json.dumps({"step": step, "exit": done.returncode, "stderr": done.stderr[-500:]}), flush=True)
            lines.append(json.loads(line) if line else {})
        same, new = lines[1].get("batch 8", {}), lines[2].get("batch 4", "")
        usable = (isinstance(same, dict) and lines[1].get("dynamo cache", {}).get("dynamo_cache_hit")
                  and isinstance(new, dict))
        print("verdict:", "usable: a loaded process skips tracing and still compiles new shapes" if usable else
              "not usable for training: " + (f"a new shape after loading {new}" if not isinstance(new, dict)
                                             else "the loaded work was not used"))


if __name__ == "__main__":
    if len(sys.argv) > 3:
        one_process(sys.argv[2], sys.argv[3])
    else:
        main()
