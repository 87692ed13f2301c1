#!/usr/bin/env bash
# Mixed GPUs (multi_gpu.batch_split) on 2 equal GPUs, GPU 1 capped to a quarter of its memory
# (TANDEM_CUDA_MEMORY_FRACTION=1,0.25: ~20 GiB of an 80 GiB H100) to stand in for a smaller card.
# SD1.5-size full fine-tune, 512 px (~14 GiB of weights, gradients and AdamW state, ~0.9 GiB per image):
#   equal 4 per GPU        the equal split that fits the small card (global batch 8)
#   equal 8 per GPU        what the small card cannot hold (expected: out of memory on GPU 1)
#   split 12,4             the big card carries more (global batch 16)
#   auto                   the start-up probe chooses the split of a global batch of 16
# One JSON line per case in $OUT/results.jsonl (or ./gpu-results.jsonl); per_rank gives each GPU's peak.
set -u
source "$(dirname "$0")/common.sh"
export TANDEM_CUDA_MEMORY_FRACTION="${TANDEM_CUDA_MEMORY_FRACTION:-1,0.25}"
CASE="--model sd15 --mode full --res 512 --steps 20 --warmup 5 --gpus 2"
nvidia-smi -L
log "equal, 4 per GPU"; bench $CASE --batch 4
log "equal, 8 per GPU (expected to run out of memory on the capped GPU)"; timeout 240 python3 scripts/benchmark.py $CASE --batch 8 --json "$RES" 2>&1 | grep -E "OutOfMemory|out of memory|^\|" | head -5
log "split 12,4"; bench $CASE --batch 8 --config-value multi_gpu.batch_split=12,4
log "auto"; bench $CASE --batch 8 --config-value multi_gpu.batch_split=auto
log done
