#!/usr/bin/env bash
# Issue 56's GPU rows that wait for a measurement, through Tandem's benchmark (scripts/benchmark.py: the real
# trainer, random weights of the published sizes, cached latents), each part one call under 10 minutes:
#   two   (2 GPUs: nvidia-h200-x2) Qwen-Image LoRA 1024 px, batch 1, checkpointing, held to 16 GiB per GPU,
#         multi_gpu.strategy auto: on 2 GPUs (target >= 1.2 img/s), then on 1 GPU (the host memory of one rank
#         the 2-GPU run is compared with: target <= 1.2x), then the raw reference on 2 GPUs (uncapped)
#   wan   (1 GPU) Wan 2.1 14B LoRA, 81 frames at 640 px (~832x480's pixels), batch 1, checkpointing, held to
#         24 GiB, auto (target: trains); the raw reference (uncapped) after
# Every part ends with the table (scripts/gpu/offload_table.py): plan, img/s, GPU peak, and every rank's host
# memory - PSS, RSS, peak RSS, layer offload's host copy and each rank's share of it. Results: one JSON line
# per run in $OUT/results.jsonl (./gpu-results.jsonl elsewhere), each run's output in $OUTDIR/offload-*.txt.
#   bash scripts/gpu/offload.sh two      (carry .whl and .bench where the machine's image has no diffusers)
set -u
PART="${1:?usage: offload.sh two|wan}"
source "$(dirname "$0")/common.sh"
touch "$RES"; START=$(wc -l < "$RES")
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF  # layer offload asks for expandable segments itself
run() { # NAME SECONDS benchmark arguments...: one run, its key lines shown
    local name=$1 seconds=$2; shift 2
    log "$name"
    limited "$seconds" python3 scripts/benchmark.py "$@" --json "$RES" > "$OUTDIR/offload-$name.txt" 2>&1
    echo "rc $?"
    grep -E "Memory plan|Layer offload|Host memory after|Memory after the first step|Traceback|Error|out of memory" \
        "$OUTDIR/offload-$name.txt" | cut -c1-700 | head -10
}
command -v nvidia-smi > /dev/null && nvidia-smi -L
free -g | head -2
case "$PART" in
two)
    QWEN=(--model qwen --mode lora --gc --batch 1 --res 1024 --steps 6 --warmup 3
          --config-value multi_gpu.memory_limit_gib=16)
    run qwen-2x16 250 "${QWEN[@]}" --gpus 2
    run qwen-1x16 200 "${QWEN[@]}" --gpus 1
    log "raw reference, qwen, 2 GPUs"
    ref 2 --model qwen --mode lora --gc --res 1024 --batch 1 --steps 6 --warmup 3 ;;
wan)
    run wan14-1x24 380 --model wan-14b --mode lora --gc --batch 1 --res 640 --gpus 1 --steps 3 --warmup 1 \
        --config-value multi_gpu.memory_limit_gib=24 --config-value data.video_frames=81
    log "raw reference, wan 14B, 1 GPU"
    limited 190 python3 "$REF" --model wan14 --mode lora --gc --batch 1 --res 640 --frames 81 --steps 3 --warmup 1 \
        | grep '^{' | sed 's/^{/{"source": "raw_reference", /' | tee -a "$RES" ;;
*) echo "unknown part $PART: two or wan" >&2; exit 2 ;;
esac
log "the table"
python3 scripts/gpu/offload_table.py "$RES" "$START"
