#!/usr/bin/env bash
# The job queue on 4 GPUs (docs/Queue.md): four SD1.5 LoRA jobs (random weights, 512 px, 64 images, STEPS steps of
# a global batch of 16 each: the same training either way) queued
#   A. one GPU each (4 per micro-batch x 4 accumulation): all four run at once, side by side;
#   B. four GPUs each (4 per GPU): one after another, each over all four GPUs (DDP);
# total wall clock of each queue, from the first `add` to the last job's end, and each job's own time, from
# the queue file. Needs a 4-GPU machine and diffusers importable (common.sh). About 15 minutes on H100s.
# Results: one JSON line per queue in $OUT/results.jsonl, then a table.
set -u
source "$(dirname "$0")/common.sh"
nvidia-smi -L
GPUS=$(nvidia-smi -L | wc -l)
[ "$GPUS" -ge 4 ] || { echo "needs 4 GPUs, found $GPUS" >&2; exit 2; }
STEPS="${STEPS:-300}"
W="${WORK:-/tmp/queue-bench}"
rm -rf "$W"; mkdir -p "$W"
export TANDEM_HOME="$W/home"
log "random SD1.5 and 64 pictures"
python3 scripts/make_random_model.py --type sd1 --out "$W/sd15" >/dev/null
python3 - "$W/data" <<'PY'
import sys
from pathlib import Path
from PIL import Image
import numpy as np
out = Path(sys.argv[1]); out.mkdir(parents=True)
rng = np.random.default_rng(0)
for i in range(64):
    Image.fromarray(rng.integers(0, 255, (512, 512, 3), dtype=np.uint8)).save(out / f"{i}.png")
    (out / f"{i}.txt").write_text(f"a picture number {i}")
PY
common=(--config-value "model.base_model=$W/sd15" --config-value "data.concepts[0].path=$W/data"
        --config-value data.concepts[0].repeats=1 --config-value data.resolution=512
        --config-value training.batch_size=4 --config-value "training.max_steps=$STEPS"
        --config-value sampling.every_n_epochs=0 --config-value sampling.every_n_steps=0
        --config-value save.backup_every_n_epochs=0 --config-value general.tensorboard=false)
queue_of() { # queue_of NAME GPUS ACCUMULATION: four jobs, each on GPUS GPUs; waits until nothing is left to run
    local name=$1 gpus=$2 accumulation=$3 folder="$W/$1" start end deadline
    start=$(date +%s.%N); deadline=$(( $(date +%s) + 3600 ))
    for k in 1 2 3 4; do
        python3 scripts/train_queue.py --folder "$folder" add training_presets/sd15_lora.json --gpus "$gpus" \
            --name "$name-$k" "${common[@]}" --config-value "training.gradient_accumulation_steps=$accumulation" \
            --config-value "general.workspace_dir=$W/ws-$name-$k" >/dev/null
    done
    while python3 scripts/train_queue.py --folder "$folder" --json list | python3 -c "import json, sys; sys.exit(0 if any(
            j['state'] in ('queued', 'starting', 'running') for j in json.load(sys.stdin)['jobs']) else 1)"; do
        if [ "$(date +%s)" -gt "$deadline" ]; then  # an hour: end it, so that B measures on free GPUs
            for k in 1 2 3 4; do python3 scripts/train_queue.py --folder "$folder" cancel "$name-$k" 2>/dev/null; done
            deadline=$(( $(date +%s) + 120 ))
        fi
        sleep 2
    done
    end=$(date +%s.%N)
    python3 scripts/train_queue.py --folder "$folder" list
    python3 - "$folder/queue.json" "$name" "$gpus" "$start" "$end" "$STEPS" <<'PY' | tee -a "$RES"
import json, sys
queue, name, gpus, start, end, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
jobs = json.load(open(queue))["jobs"]
print(json.dumps({"check": "queue", "queue": name, "gpus_per_job": gpus, "jobs": len(jobs), "steps": steps,
                  "states": [j["state"] for j in jobs], "total_s": round(end - start, 1),
                  "job_s": [round((j["ended"] or 0) - (j["started"] or 0), 1) for j in jobs],
                  "devices": [j["devices"] for j in jobs]}))
PY
}
log "A: four jobs of 1 GPU each, side by side"
queue_of one-each 1 4
log "B: four jobs of 4 GPUs each, one after another"
queue_of four-each 4 1
python3 - "$RES" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"check": "queue"' in l]
print(f"\n{'queue':12} {'GPUs/job':>8} {'total s':>8}  per-job s")
for r in rows:
    print(f"{r['queue']:12} {r['gpus_per_job']:>8} {r['total_s']:>8}  {r['job_s']}  {r['states']}")
PY
