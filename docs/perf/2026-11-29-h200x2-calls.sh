# GPU calls of 2026-11-29 on nvidia-h200-x2 (run with the device tool, carry [".bench", ".whl"]; .bench holds a copy
# of ../shared/bench/raw_ddp_reference.py, .whl the diffusers 0.42.1 wheel). Results: 2026-11-29-h200x2.jsonl.

# ---- call ngtF (commit fa84f28, 2x H200 of one host; lines in 2026-11-29-h200x2.jsonl): the SD1.5 job compiled with training graphs and sample graphs on 2 GPUs, then on 1 GPU of
# the same host, compile cache filled by a 4-step 2-GPU run first; the raw reference on 1 and 2 GPUs
set -u
source scripts/gpu/common.sh
export PYTHONPATH=/tmp/site
nvidia-smi -L
log "raw reference, SD1.5 LoRA 8 per GPU, 1 and 2 GPUs"
limited 60 bash -c "source scripts/gpu/common.sh; ref 1 --model sd15 --mode lora --batch 8" | cut -c1-400
limited 70 bash -c "source scripts/gpu/common.sh; ref 2 --model sd15 --mode lora --batch 8" | cut -c1-400
G="--config-value training.compile=true --config-value training.cuda_graphs=true"
log "fill: 4 steps on 2 GPUs, compiled with graphs, cold cache"
E2E_ARGS="$G --config-value training.max_steps=4 --prompts 0 --sample-every 0" \
  JOB=sd15 GPUS=2 limited 300 bash scripts/gpu/end_to_end.sh job 2>&1 | grep -a -E "^\{|^==|rror" | cut -c1-300
left=$((585 - SECONDS)); log "the SD1.5 job on 2 GPUs, then 1 (limit $left s)"
E2E_ARGS="$G" JOB=sd15 GPUS="2 1" limited $left bash scripts/gpu/end_to_end.sh job 2>&1 | grep -a -E "^\{|^==|rror" | cut -c1-2500
grep -a -h -E "compiled and checked|Samples at step|replay the denoiser|without CUDA graphs" -r $OUT/runs 2>/dev/null | cut -c1-300 | tail -12
log "call ends"
