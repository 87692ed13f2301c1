# The device calls of 2026-11-28 (4x H200) whose figures are in docs/MultiGPUTraining.md and docs/Performance.md,
# as run (the parts of scripts/gpu/pooling.sh, wan.sh, families.sh and qwen_zimage.sh packed into fewer calls).

# ---- call: .bench/pool_flux2.sh
# pooling.sh flux2's capped run and reference on 4 GPUs, then flux2fp8's capped run on 2 with the time left
set -u
source scripts/gpu/common.sh
START=$(date +%s)
RES="${OUTDIR}/pooling-flux2.jsonl"
CASE=(--res 1024 --batch 1 --gc --steps 8 --warmup 3)
T='training.lora_target_modules=["to_q","to_k","to_v","to_out.0","to_qkv_mlp_proj","attn.to_out"]'
nvidia-smi -L
log "Flux.2-dev LoRA: 4 GPUs capped at 24 GiB"
limited 250 python3 scripts/benchmark.py --model flux2 --mode lora "${CASE[@]}" --config-value "$T" --gpus 4 \
  --config-value multi_gpu.memory_limit_gib=24 --config-value multi_gpu.strategy=auto --json "$RES" | grep -v '^{' | tail -40
log "raw reference FSDP on 4"
limited 140 python3 -m torch.distributed.run --standalone --nproc_per_node=4 "$REF" --model flux2 --mode lora "${CASE[@]}" --fsdp \
  | grep '^{' | sed 's/^{/{"source": "raw_reference", /' | tee -a "$RES"
LEFT=$(( 585 - ($(date +%s) - START) ))
log "Flux.2-dev LoRA fp8 base: 2 GPUs capped at 24 GiB ($LEFT s left)"
RES2="${OUTDIR}/pooling-flux2fp8.jsonl"
[ $LEFT -gt 60 ] && CUDA_VISIBLE_DEVICES=0,1 limited $LEFT python3 scripts/benchmark.py --model flux2 --mode lora "${CASE[@]}" --config-value "$T" --gpus 2 \
  --config-value model.unet_dtype=fp8 --config-value multi_gpu.memory_limit_gib=24 --config-value multi_gpu.strategy=auto --json "$RES2" | grep -v '^{' | tail -40
python3 -m modules.benchmark.pooling_table "$OUTDIR"/pooling-*.jsonl

# ---- call: .bench/pool_more.sh
set -u
source scripts/gpu/common.sh
START=$(date +%s); left() { echo $(( 585 - ($(date +%s) - START) )); }
CASE=(--res 1024 --batch 1 --gc --steps 8 --warmup 3)
nvidia-smi -L
RES="${OUTDIR}/pooling-qwen.jsonl"
log "Qwen-Image LoRA 2 GPUs capped at 24 (0,1) and raw reference FSDP on 2 (2,3) at once"
CUDA_VISIBLE_DEVICES=0,1 limited 200 python3 scripts/benchmark.py --model qwen --mode lora "${CASE[@]}" --gpus 2 \
  --config-value multi_gpu.memory_limit_gib=24 --config-value multi_gpu.strategy=auto --json "$RES" > /tmp/q.log 2>&1 &
CUDA_VISIBLE_DEVICES=2,3 limited 150 python3 -m torch.distributed.run --standalone --nproc_per_node=2 --master_port 29611 "$REF" --model flux2 --mode lora "${CASE[@]}" --fsdp \
  | grep '^{' | sed 's/^{/{"source": "raw_reference", /' | tee -a "${OUTDIR}/pooling-flux2fp8.jsonl"
wait
tail -4 /tmp/q.log
CUDA_VISIBLE_DEVICES=0,1 limited 120 python3 -m torch.distributed.run --standalone --nproc_per_node=2 "$REF" --model qwen --mode lora "${CASE[@]}" --fsdp \
  | grep '^{' | sed 's/^{/{"source": "raw_reference", /' | tee -a "$RES" &
CUDA_VISIBLE_DEVICES=2 limited 120 python3 scripts/benchmark.py --model qwen --mode lora "${CASE[@]}" --gpus 1 --json "$RES" > /tmp/q1.log 2>&1
wait
RES="${OUTDIR}/pooling-flux.jsonl"
L=$(left); log "Flux.1-dev full 4x24 ($L s left)"
[ $L -gt 90 ] && limited $((L-60)) python3 scripts/benchmark.py --model flux --mode full --res 1024 --batch 1 --gc --steps 4 --warmup 2 --gpus 4 \
  --config-value multi_gpu.memory_limit_gib=24 --config-value multi_gpu.strategy=auto --json "$RES" 2>&1 | grep -v '^{' | grep -i "plan\|peak\|error\|img/s\|fail" | head -20
L=$(left); [ $L -gt 40 ] && limited $((L-5)) python3 -m torch.distributed.run --standalone --nproc_per_node=4 "$REF" --model flux --mode full --res 1024 --batch 1 --gc --steps 4 --warmup 2 --fsdp \
  | grep '^{' | sed 's/^{/{"source": "raw_reference", /' | tee -a "$RES"
python3 -m modules.benchmark.pooling_table "$OUTDIR"/pooling-*.jsonl .bench/prev/*.jsonl 2>/dev/null || python3 -m modules.benchmark.pooling_table "$OUTDIR"/pooling-*.jsonl

# ---- call: .bench/final.sh
# One call on 4 GPUs: the 4-GPU rows of the 2026 families and the clean Qwen-Image pooling row, each run alone.
set -u
source scripts/gpu/common.sh
START=$(date +%s); left() { echo $(( 580 - ($(date +%s) - START) )); }
C="--res 1024 --batch 1 --gc --steps 8 --warmup 3"
T='training.lora_target_modules=["to_q","to_k","to_v","to_out.0","to_qkv_mlp_proj","attn.to_out"]'
nvidia-smi -L | head -1
log "Flux.2-dev LoRA FSDP2 on 4: Tandem, then the reference"
limited 150 python3 scripts/benchmark.py --model flux2-dev --mode lora --gpus 4 $C --config-value multi_gpu.strategy=fsdp --config-value "$T" --json "$RES" | grep -v '^{' | grep "^|"
limited 100 python3 -m torch.distributed.run --standalone --nproc_per_node=4 "$REF" --model flux2 --mode lora --fsdp $C | grep '^{' | sed 's/^{/{"source": "raw_reference", /' | tee -a "$RES"
log "Qwen-Image LoRA, 2 GPUs capped at 24 GiB (alone), then the reference FSDP on 2 (alone)"
limited 120 python3 scripts/benchmark.py --model qwen --mode lora --gpus 2 $C --config-value multi_gpu.memory_limit_gib=24 --config-value multi_gpu.strategy=auto --json "$RES" | grep -v '^{' | grep "^|"
limited 80 python3 -m torch.distributed.run --standalone --nproc_per_node=2 "$REF" --model qwen --mode lora --fsdp $C | grep '^{' | sed 's/^{/{"source": "raw_reference", /' | tee -a "$RES"
L=$(left); log "Qwen-Image LoRA FSDP2 on 4: Tandem, reference ($L s left)"
[ $L -gt 120 ] && limited 90 python3 scripts/benchmark.py --model qwen --mode lora --gpus 4 $C --config-value multi_gpu.strategy=fsdp --json "$RES" | grep -v '^{' | grep "^|"
L=$(left); [ $L -gt 40 ] && limited $((L < 70 ? L - 5 : 65)) python3 -m torch.distributed.run --standalone --nproc_per_node=4 "$REF" --model qwen --mode lora --fsdp $C | grep '^{' | sed 's/^{/{"source": "raw_reference", /' | tee -a "$RES"
L=$(left); log "done, $L s left"

# ---- call: bash scripts/gpu/wan.sh cp
# ---- call: timeout 290 bash scripts/gpu/qwen_zimage.sh qwen4full; then Wan 1.3B LoRA, 81 frames, 640 px, 1 GPU:
#   scripts/benchmark.py --model wan-1.3b --mode lora --batch 1 --res 640 --gc --steps 6 --warmup 2 --gpus 1 --config-value data.video_frames=81 (wan_lora targets)
# ---- call: Wan 2.2 TI2V 5B (960 px) on GPU 0 and an A14B expert (low_noise, 640 px) on GPU 1 at the same time, 81 frames:
#   scripts/benchmark.py --model wan-ti2v-5b|wan-a14b --mode lora --batch 1 --gc --steps 6 --warmup 2 --gpus 1 --config-value data.video_frames=81
