# Development machine (2 cores, CPU torch 2.13): `python docs/perf/2026-11-27-session14-cpu-exit.py /tmp/fresh-cache --config-value training.compile=true --config-value training.max_steps=4`
# Seconds from the `done` event line to the launcher's exit, for one multi-process CPU run of the demo.
import subprocess, sys, time, os, json
cmd = [sys.executable, "scripts/train_multi_gpu.py", "--config", "training_presets/#demo.json", "--device", "cpu",
       "--num-gpus", "2", "--spawn"] + sys.argv[2:]
env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=sys.argv[1])
t0 = time.monotonic(); done = None
p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
for line in p.stdout:
    if line.startswith('Trained ') or '"type": "done"' in line: done = time.monotonic()
    if "compiled and checked" in line or "Error" in line: print(line.strip()[:200])
p.wait(); end = time.monotonic()
print(f"exit {p.returncode}; wall {end-t0:.1f} s; done->exit {end-done:.2f} s" if done else f"no done, exit {p.returncode}")
