#!/usr/bin/env bash
# Faults on GPUs (NCCL), as the machine and the user cause them: every kind of process killed at a random
# step of a real-size SD1.5 LoRA (random weights, 512 px, batch 4 per GPU, 2 GPUs), through
# scripts/fault_trials.py. Each trial waits for the job's first backup, then kills (or stops) one process:
#   rank      kill -9 of a rank                       loader    kill -9 of a DataLoader worker of a rank
#   stuck     SIGSTOP of a rank (found by the workers' watchdog after multi_gpu.stall_seconds, default 30 s)
#   agent     kill -9 of torchrun's agent             launcher  kill -9 of the launcher
# torchrun trials run with multi_gpu.max_restarts=1 (they restart; the agent kind ends the job: the agent
# is what restarts), spawn trials end. Then the backups are read back and a --resume run continues the
# newest (a restart's own line says where it resumed). Parts that each fit a 10-minute call on 2 GPUs:
#   torchrun   loader, stuck, rank, agent under torchrun
#   spawn      loader, rank, launcher under spawn
#   all        both, one after the other (about 12 minutes)
# Every part prints the table of all trials so far last (kind, launcher, seconds from the fault to the end
# or the restart, the rank the killed process belonged to, the rank named, whether the backup resumed).
# Results: one JSON line per trial in $OUT/results.jsonl (or ./gpu-results.jsonl); workspaces in .bench/faults.
# DEVICE=cpu runs the same trials on 2 CPU processes with the built-in demo (a check of the script itself);
# PYTHON picks the interpreter (default python3).
set -u
PART="${1:?usage: faults.sh torchrun|spawn|all}"
source "$(dirname "$0")/common.sh"
PY="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
W=.bench/faults
mkdir -p "$W"
JOB=(--device "$DEVICE" --num-gpus 2 --timeout 180 --json "$RES" --work "$W/trials")
if [ "$DEVICE" = cuda ]; then
    nvidia-smi -L
    if [ ! -f "$W/sd15/model_index.json" ]; then
        log "a random-weight SD1.5 folder (fp16) in $W/sd15"
        "$PY" scripts/make_random_model.py --type sd1 --out "$W/sd15" >/dev/null
    fi
    if [ ! -f "$W/images/done" ]; then
        log "64 JPEGs of 512 px with captions in $W/images"
        "$PY" -c "import sys; from pathlib import Path; sys.path.insert(0, '.'); \
from modules.benchmark.end_to_end import make_images; make_images(Path('$W/images'), 64, 512)" && touch "$W/images/done"
    fi
    JOB+=(--config-value "model.base_model=$W/sd15" --config-value "data.concepts=[{\"path\": \"$W/images\"}]"
          --config-value data.resolution=512 --config-value training.batch_size=4 --config-value training.method=lora
          --config-value training.precision=bf16 --config-value data.num_workers=2)
fi
trials() { "$PY" scripts/fault_trials.py "${JOB[@]}" --seed "$RANDOM" --trials 1 "$@" | grep -v '^{'; }
case "$PART" in
torchrun|all)
    log "torchrun, max_restarts=1: a loader worker, a stuck rank, a rank; then the agent"
    trials --launcher torchrun --max-restarts 1 --kind loader --kind stuck --kind rank
    trials --launcher torchrun --kind agent
    ;;&
spawn|all)
    log "spawn: a loader worker, a rank, the launcher"
    trials --launcher spawn --kind loader --kind rank --kind launcher
    ;;
esac
log "every trial so far ($RES)"
"$PY" scripts/fault_trials.py --table-from "$RES"
