#!/usr/bin/env bash
# Launch to exit, as a user waits: the jobs of docs/Performance.md, "From the command to the saved model" (JOB=sd15,
# the default: the 5,120-image SD1.5 LoRA job - real-size random SD1.5 folder, 512 JPEGs at 512 px with captions,
# batch 8 per GPU, 10 epochs, 4 sample prompts every 5 epochs, backups every epoch, fresh cache; JOB=sdxl and
# JOB=flux: the SDXL and Flux.1-size LoRA jobs of scripts/end_to_end.py's JOBS) on 1, 2 and 4 GPUs, for this tree
# and a baseline tree (an earlier commit exported to .bench/baseline: `git archive <commit> modules scripts
# training_presets pyproject.toml | tar -x -C .bench/baseline`). Parts that each fit a 10-minute call on a 4-GPU
# machine:
#   alone    this tree: 1 GPU, 2 GPUs, 4 GPUs, one after the other (no run shares the host with another)
#   job      this tree on each GPU count in GPUS (default "1 2 4"), one after the other
#   detach RUN...  runs (LABEL@TREE:GPUS[:DEVICES]) from a snapshot of the tree, in a process session of their
#            own that outlives this call, for a job longer than one 10-minute call (the SDXL and Flux jobs on
#            1 GPU): the next call runs
#   collect  which waits (up to WAIT s, default 580) for them to end and adds their lines to the results
#   compiled the same with training.compile=on (CUDA graphs off); run it twice on a fresh machine (the first run of each
#            GPU count fills the compile cache; the second is the warm figure)
#   coldexit `done` to exit after a cold compile: 2 GPUs, 1 epoch, a fresh compile cache
#   bytecode launch to first step with a complete cache, 8 steps: Tandem's bytecode cache off (1, 4 GPUs),
#            then on: the first start writes it (4 GPUs), then 1 GPU and 4 GPUs read it. Meaningful where
#            the packages have no bytecode and PYTHONDONTWRITEBYTECODE is set
#   imports  where one process's imports go: `python -X importtime` and cProfile, into $OUT
#   before   both trees at the same time on different GPUs: 1 GPU (GPU 0 | GPU 1), 2 GPUs (0,1 | 2,3);
#            then the baseline on 4 GPUs
#   after    this tree: 1 GPU (GPU 0) beside 2 GPUs (1,2), then 4 GPUs
#   startup  the first step with cuDNN autotuning on | auto (the default: off for this LoRA); launch to first
#            step with a complete cache
#   backups  what a backup costs the training: full fine-tune on 2 GPUs, 3 epochs, backups every epoch
#            against none (the two at the same time on GPUs 0,1 | 2,3); the LoRA job on 1 GPU with and
#            without backups (GPU 0 | GPU 1), both with data.num_workers=4 (the shut-down with 4 workers)
#   sampling the first and the second sampling (2 epochs, samples every epoch), 1 GPU: the tree in
#            $SAMPLING_BASE (default .bench/sampling-base) | this tree (GPU 0 | GPU 1)
#   launchers launch to exit of 8 steps on 2 GPUs: torchrun | spawn (GPUs 0,1 | 2,3)
#   launch4  launch to first step with a complete cache, 8 steps: 1 GPU, then 4 GPUs under torchrun and
#            under spawn (the start-up's parts: the launcher, starting workers, imports, process group)
# Results: one JSON line per run in $OUT/results.jsonl (or ./gpu-results.jsonl), logs in /tmp/tandem-e2e
# (each run's split of its wall clock, as in docs/Performance.md: `scripts/end_to_end.py` prints it, `training_split_s`).
set -u
PART="${1:?usage: end_to_end.sh alone|job|detach|collect|compiled|coldexit|bytecode|imports|before|baseline|after|backups|sampling|launchers|launch4|startup}"
STARTUP_EXTRA="${STARTUP_EXTRA:-}"
source "$(dirname "$0")/common.sh"
# The random models and images live outside the working tree: the device tool replaces the tree (and each
# carried folder) at the start of every call, which would delete them under a detached run.
E2E="$(realpath -m "${E2E:-/tmp/tandem-e2e/models}")"; BASE="$(realpath -m .bench/baseline)"; JOB="${JOB:-sd15}"
# .log, .jsonl and .done of the runs started by `detach`; a DETACHED of its own for each set of runs that is
# started while another is still going (two jobs at once on different GPUs)
DETACHED="${DETACHED:-/tmp/tandem-e2e/detached}"
[ -z "${E2E_RESULTS:-}" ] || RES="$E2E_RESULTS"
COMPILED=(); for c in c1 c2 c4; do COMPILED+=(--label-config "$c:training.compile=on" --label-config "$c:training.cuda_graphs=off"); done
# Each run's log and profile reports (TANDEM_PROFILE_STEPS) are kept in $OUT/runs on a device machine, so that
# they come back with the call; detached runs keep theirs beside their results until `collect`.
KEEP="${E2E_KEEP:-${OUT:+$OUT/runs}}"
e2e() { python3 scripts/end_to_end.py --job "$JOB" --base-model "$E2E/$JOB" --make-model --data "$E2E/images-$JOB" \
        --make-data --json "$RES" ${KEEP:+--keep "$KEEP"} ${E2E_ARGS:-} "$@"; }  # E2E_ARGS: more options, e.g. for a trial on CPU
runs() { local args=() r; for r in "$@"; do args+=(--run "$r"); done; e2e "${args[@]}"; }
nvidia-smi -L
case "$PART" in
job)
    log "JOB=$JOB, this tree on ${GPUS:-1 2 4} GPU(s), one at a time"
    for n in ${GPUS:-1 2 4}; do runs "new@.:$n:$(seq -s, 0 $((n - 1)))"; done
    ;;
runs)  # what `detach` starts: the runs named after it
    shift; runs "$@"
    ;;
detach)
    shift; mkdir -p "$(dirname "$DETACHED")"; rm -f "$DETACHED".{log,jsonl,done}
    # A snapshot of the tree to start from: a run's processes start after this call has ended, when the next
    # call may be replacing the working tree ("." in a run spec is the snapshot).
    rm -rf "$DETACHED.tree"; mkdir -p "$DETACHED.tree"
    cp -a modules scripts training_presets pyproject.toml "$DETACHED.tree/"
    log "JOB=$JOB detached: $* (from the snapshot $DETACHED.tree)"
    rm -rf "$DETACHED.runs"
    # The redirections stand outside the group: a subshell between this script and the runs kept this call's
    # stdout open until the runs ended, so a caller reading it waited for them.
    (cd "$DETACHED.tree" && E2E="$E2E" E2E_RESULTS="$DETACHED.jsonl" E2E_KEEP="$DETACHED.runs" DONE="$DETACHED.done" \
        setsid nohup bash -c 'bash scripts/gpu/end_to_end.sh runs "$@"; touch "$DONE"' detached "$@") \
        > "$DETACHED.log" 2>&1 < /dev/null &
    ;;
collect)
    log "waiting up to ${WAIT:-580} s for the detached runs"
    for _ in $(seq "${WAIT:-580}"); do [ -e "$DETACHED.done" ] && break; sleep 1; done
    tail -n 30 "$DETACHED.log"
    if [ -e "$DETACHED.done" ]; then
        cat "$DETACHED.jsonl" >> "$RES"
        [ -z "$KEEP" ] || [ ! -d "$DETACHED.runs" ] || { mkdir -p "$KEEP"; cp -r "$DETACHED.runs"/. "$KEEP"/; }
    else
        log "the detached runs are still going"
    fi
    ;;
before)
    log "prepare; 1 GPU both trees, 2 GPUs both trees, baseline on 4 GPUs"
    e2e --run "baseline@$BASE:1:0+new@.:1:1" --run "baseline@$BASE:2:0,1+new@.:2:2,3" --run "baseline@$BASE:4"
    ;;
baseline)
    log "the baseline alone: 1 GPU beside 2 GPUs, then 4 GPUs"
    e2e --run "baseline@$BASE:1:0+baseline@$BASE:2:1,2" --run "baseline@$BASE:4"
    ;;
after)
    log "this tree: 1 GPU beside 2 GPUs, then 4 GPUs"
    e2e --run "new@.:1:0+new@.:2:1,2" --run "new@.:4"
    ;;
alone)
    log "this tree: 1 GPU, 2 GPUs, 4 GPUs, one at a time"
    e2e --run "new@.:1:0" --run "new@.:2:0,1" --run "new@.:4"
    ;;
compiled)
    log "training.compile: 1 GPU, 2 GPUs, 4 GPUs, one at a time"
    e2e "${COMPILED[@]}" --run "c1@.:1:0" --run "c2@.:2:0,1" --run "c4@.:4"
    ;;
coldexit)
    log "done to exit after a cold compile: 2 GPUs, 6 steps, a fresh compile cache"
    TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" e2e "${COMPILED[@]}" --epochs 1 --prompts 0 --sample-every 0 \
        --config-value training.max_steps=6 --run "c2@.:2:0,1"
    ;;
bytecode)
    log "launch to first step, complete cache, 8 steps: bytecode cache off (1, 4 GPUs), then on (PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset})"
    rm -rf /tmp/tandem-e2e/shared-cache ~/.cache/tandem/bytecode
    S=(--shared-cache /tmp/tandem-e2e/shared-cache --config-value training.max_steps=8 --prompts 0 --sample-every 0)
    TANDEM_BYTECODE_CACHE=off e2e "${S[@]}" --run "fill@.:1:0" --run "off@.:1:0" --run "off@.:4"
    e2e "${S[@]}" --run "fillbc@.:4" --run "on@.:1:0" --run "on@.:4"
    echo "bytecode cache: $(find ~/.cache/tandem/bytecode -name '*.pyc' | wc -l) files, $(du -sh ~/.cache/tandem/bytecode | cut -f1)"
    ;;
imports)
    log "one process's imports: -X importtime (twice) and cProfile"
    IMPORTS="import torch; import modules.distributed.launch, modules.distributed.distributed_trainer, modules.model.loading; from diffusers import UNet2DConditionModel, AutoencoderKL; from transformers import CLIPTextModel"
    for i in 1 2; do TIMEFORMAT="imports, run $i: %R s"; time python3 -X importtime -c "$IMPORTS" 2> "$OUTDIR/importtime$i.txt"; done
    python3 -c "import cProfile, pstats, sys; cProfile.run(sys.argv[1], '/tmp/imports.prof'); pstats.Stats('/tmp/imports.prof').sort_stats('tottime').print_stats(40)" "$IMPORTS" > "$OUTDIR/cprofile.txt"
    sort -t'|' -k2 -n -r "$OUTDIR/importtime2.txt" | head -40
    ;;
backups)  # BACKUPS="full" runs the full fine-tune's pair only (default "full lora")
    if [[ " ${BACKUPS:-full lora} " == *" full "* ]]; then
        log "full fine-tune 2 GPUs 3 epochs: backups every epoch | none"
        e2e --epochs 3 --prompts 0 --sample-every 0 --config-value training.method=full \
            --label-config "nobackup:save.backup_every_n_epochs=0" --run "backup@.:2:0,1+nobackup@.:2:2,3"
    fi
    if [[ " ${BACKUPS:-full lora} " == *" lora "* ]]; then
        log "the LoRA job on 1 GPU, 4 loader workers: backups every epoch | none"
        e2e --config-value data.num_workers=4 --label-config "nobackup:save.backup_every_n_epochs=0" \
            --run "backup@.:1:0+nobackup@.:1:1"
    fi
    ;;
sampling)
    log "samplings (2 epochs, every epoch, 4 prompts): ${SAMPLING_BASE:-.bench/sampling-base} | this tree"
    e2e --epochs 2 --sample-every 1 --run "before@${SAMPLING_BASE:-.bench/sampling-base}:1:0+new@.:1:1"
    ;;
launchers)
    log "8 steps on 2 GPUs: torchrun | spawn"
    e2e --config-value training.max_steps=8 --prompts 0 --sample-every 0 \
        --label-config "spawn:multi_gpu.launcher=spawn" --label-config "torchrun:multi_gpu.launcher=torchrun" \
        --run "torchrun@.:2:0,1+spawn@.:2:2,3"
    ;;
launch4)
    log "launch to first step with a complete cache, 8 steps: fill it (1 GPU), 1 GPU, 4 GPUs torchrun, 4 GPUs spawn"
    rm -rf /tmp/tandem-e2e/shared-cache
    e2e --shared-cache /tmp/tandem-e2e/shared-cache --config-value training.max_steps=8 --prompts 0 --sample-every 0 \
        --label-config "spawn:multi_gpu.launcher=spawn" --label-config "torchrun:multi_gpu.launcher=torchrun" \
        --run "fill@.:1:0" --run "complete@.:1:0" --run "torchrun@.:4" --run "spawn@.:4"
    ;;
startup)
    log "first step with cuDNN autotuning on | auto, 40 steps of the LoRA job on 1 GPU (GPU 0 | GPU 1)"
    e2e --config-value training.max_steps=40 --label-config "autotune:training.cudnn_benchmark=on" \
        --run "autotune@.:1:0+auto@.:1:1"
    log "launch to first step with a complete cache: fill it (1 GPU), then 1 GPU and 4 GPUs"
    rm -rf /tmp/tandem-e2e/shared-cache
    e2e --shared-cache /tmp/tandem-e2e/shared-cache --config-value training.max_steps=8 $STARTUP_EXTRA \
        --run "fill@.:1:0" --run "complete@.:1:0" --run "complete@.:4"
    ;;
esac
