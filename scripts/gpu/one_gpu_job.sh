#!/usr/bin/env bash
# The `training.compile` auto rows of the 5,120-image SD1.5 LoRA job (docs/Performance.md, "From the command to the
# saved model"; the job as scripts/gpu/end_to_end.sh runs it: a real-size random SD1.5 folder built here, 512 JPEGs
# at 512 px with captions, the sd15_lora preset at batch 8, 10 epochs, 4 prompts every 5 epochs, a fresh latent
# cache per run), launch to exit through the real entry point (scripts/train.py), each run a fresh process, one
# after the other on GPU 0, all with one compile cache of their own that starts empty:
#   auto-cold  training.compile auto (the default) with the empty compile cache; its line `training.compile auto:
#              ...` says what it chose and why (for this job: not compiling - a cold compile costs more than the
#              640 steps would save), so it is the job's uncompiled figure as a user gets it
#   fill       training.compile on, 1 step, no samples or backups: a cold compile that fills the cache (~3.5 min)
#   auto-warm  training.compile auto with the cache filled: compiles from it, with CUDA graphs
#   off        training.compile off: the uncompiled job (not in the default ROWS, to fit one call)
# ROWS picks and orders them: default "auto-cold fill auto-warm" (~8 minutes on one H200, the model and images
# built first included); ROWS=off for the uncompiled job alone (~2.5 minutes), e.g. in a second call.
# The table printed last (scripts/gpu/one_gpu_table.py): wall, before step 1 with its phases, the first step
# with its compile, launch to the first step with the compile left out, images/s over the run, and what
# training.compile auto chose. Results: one JSON line per run in $OUT/results.jsonl (./gpu-results.jsonl
# elsewhere), each run's log in $OUT/runs.
#   bash scripts/gpu/one_gpu_job.sh          (carry .whl where the machine's image has no diffusers)
#   E2E_ARGS="--cpu --make-data 16 --epochs 1 --prompts 0 --sample-steps 2" ...: the plumbing on a CPU
set -u
source "$(dirname "$0")/common.sh"
E2E="$(realpath -m "${E2E:-/tmp/tandem-e2e/models}")"
# Beside the models, outside the working tree (the device tool replaces the tree at every call).
export TORCHINDUCTOR_CACHE_DIR="$(realpath -m "${COMPILE_CACHE:-/tmp/tandem-e2e/compile-cache}")"
[[ " ${ROWS:-auto-cold} " != *" auto-cold "* ]] || rm -rf "$TORCHINDUCTOR_CACHE_DIR"  # empty for auto-cold
KEEP="${E2E_KEEP:-${OUT:+$OUT/runs}}"
touch "$RES"; START=$(wc -l < "$RES")
ROWS_CONFIG=(--label-config "off:training.compile=off" --label-config "fill:training.compile=on"
             --label-config "fill:training.max_steps=1" --label-config "fill:sampling.every_n_epochs=0"
             --label-config "fill:save.backup_every_n_epochs=0")
RUNS=(); for row in ${ROWS:-auto-cold fill auto-warm}; do RUNS+=(--run "$row@.:1:${GPU:-0}"); done
command -v nvidia-smi > /dev/null && nvidia-smi -L
log "the SD1.5 LoRA job on one GPU: ${ROWS:-auto-cold fill auto-warm} (compile cache $TORCHINDUCTOR_CACHE_DIR)"
python3 scripts/end_to_end.py --job sd15 --base-model "$E2E/sd15" --make-model --data "$E2E/images-sd15" \
    --make-data --json "$RES" ${KEEP:+--keep "$KEEP"} "${ROWS_CONFIG[@]}" ${E2E_ARGS:-} "${RUNS[@]}" | grep -v '^{'
log "the table"
python3 scripts/gpu/one_gpu_table.py "$RES" "$START"
