#!/usr/bin/env bash
# Pooling memory (multi_gpu.memory_limit_gib, issue #35): large jobs on GPUs held to a consumer card's
# memory - each GPU capped at the limit, so an H100 behaves like a 24 GiB card - with the plan Tandem
# chose, each GPU's estimated and measured peak and img/s, beside one uncapped GPU where the job fits
# one and the raw reference's FSDP (.bench/raw_ddp_reference.py --fsdp, uncapped: the floor). One part
# per call, each within ~8 minutes:
#   plans     (no GPU needed) the plan Tandem makes for every row below (check_multi_gpu.py --plan-for)
#   check     on 2 GPUs (NCCL), the plans' savers train what 1 GPU trains (the demo through
#             check_equivalence.py, relative L2 within its tolerance): an fp8 base sharded under FSDP (bf16),
#             checkpointing + activation offloading + CPU offload (fp32); then a run held to a limit far below
#             its need (0.01 GiB; past the launcher's refusal with TANDEM_SKIP_MEMORY_CHECK=1) must end with exit 1 and
#             the out-of-memory figure, no CUDA traceback
#   qwen      Qwen-Image LoRA r16, 1024 px, batch 1, 2 GPUs capped at 24 GiB (target: trains, peak <= 24,
#             >= 1.4 img/s on H200; the reference: 1.50 img/s at 23.0 GiB on 2x H200); 1 uncapped GPU
#   flux2     Flux.2-dev LoRA r16, 1024 px, batch 1, 4 GPUs capped at 24 GiB; 1 uncapped GPU
#   flux2fp8  Flux.2-dev LoRA r16 with its base in fp8, 1024 px, batch 1, 2 GPUs capped at 24 GiB
#   flux      Flux.1-dev full fine-tune, 1024 px, batch 1, 4 GPUs capped at 24 GiB (one GPU cannot hold it)
#   sdxl      SDXL full fine-tune, 1024 px, batch 1, 2 GPUs capped at 16 GiB; 1 uncapped GPU
#   table     the table of every part run so far (each part prints it last too)
# e.g. `scripts/gpu/pooling.sh qwen` on 2 GPUs, `scripts/gpu/pooling.sh flux2` on 4. Qwen-Image and Flux.2
# need their families (benchmark --model qwen, flux2). Each part's JSON lines go to $OUT/pooling-<part>.jsonl
# (or ./pooling-<part>.jsonl): the capped run carries "plan", "memory_limit_gib", "estimated_peak_gib" and
# "per_rank" (each GPU's measured peak, from the sharded state on; the random model is built uncapped).
set -u
PART="${1:?usage: pooling.sh plans|check|qwen|flux2|flux2fp8|flux|sdxl|table}"
source "$(dirname "$0")/common.sh"
RES="${OUTDIR}/pooling-${PART}.jsonl"
CASE=(--res 1024 --batch 1 --gc --steps 8 --warmup 3)
FLUX2_TARGETS='training.lora_target_modules=["to_q","to_k","to_v","to_out.0","to_qkv_mlp_proj","attn.to_out"]'
ours() { # seconds, then scripts/benchmark.py's arguments
    local seconds=$1; shift
    limited "$seconds" python3 scripts/benchmark.py "$@" --json "$RES" | grep -v '^{'
}
capped() { # seconds, GPUs, limit in GiB, then scripts/benchmark.py's arguments
    local seconds=$1 gpus=$2 limit=$3; shift 3
    ours "$seconds" "$@" --gpus "$gpus" --config-value "multi_gpu.memory_limit_gib=$limit" \
        --config-value multi_gpu.strategy=auto
}
theirs() { # seconds, GPUs, then the raw reference's arguments (--fsdp added)
    local seconds=$1 gpus=$2; shift 2
    limited "$seconds" python3 -m torch.distributed.run --standalone --nproc_per_node="$gpus" "$REF" "$@" --fsdp \
        | grep '^{' | sed 's/^{/{"source": "raw_reference", /' | tee -a "$RES"
}
table() { python3 -m modules.benchmark.pooling_table "$OUTDIR"/pooling-*.jsonl; }
plan() { # GPUs (2x24), model type, method, then config values: the plan without a GPU, for the config the
    # benchmark's case builds (a model by its published sizes, the rest defaults)
    local cards=$1 model=$2 method=$3; shift 3
    local config="$OUTDIR/plan-config.json"
    echo '{"model": {"base_model": "/tmp/unused.safetensors"}}' > "$config"
    local values=(--config-value "model.model_type=$model"
                  --config-value "training.method=$method" --config-value training.precision=bf16
                  --config-value training.batch_size=1 --config-value data.resolution=1024
                  --config-value training.gradient_checkpointing=true --config-value multi_gpu.enabled=true)
    if [ "$method" = lora ]; then values+=(--config-value model.unet_dtype=bf16); fi
    for v in "$@"; do values+=(--config-value "$v"); done
    log "plan: $model $method on $cards GiB"
    python3 scripts/check_multi_gpu.py --config-path "$config" --plan-for "$cards" "${values[@]}"
}
case "$PART" in
plans)
    plan 2x24 qwen lora
    plan 4x24 flux2 lora "$FLUX2_TARGETS"
    plan 2x24 flux2 lora "$FLUX2_TARGETS" model.unet_dtype=fp8
    plan 4x24 flux full
    plan 2x16 sdxl full
    exit 0
    ;;
table) table; exit 0 ;;
esac
nvidia-smi -L
case "$PART" in
check)
    EQ=(python3 scripts/check_equivalence.py --num-gpus 2 --batch 4 --steps 5 --launchers spawn
        --config-value training.method=lora --config-value multi_gpu.strategy=fsdp)
    log "equivalence: FSDP with an fp8 base (bf16), 2 x 4 == 1 x 8"
    limited 240 "${EQ[@]}" --config-value training.precision=bf16 --config-value model.unet_dtype=fp8 | tee -a "$RES"
    log "equivalence: FSDP with checkpointing, activation offloading and CPU offload (fp32), 2 x 4 == 1 x 8"
    limited 240 "${EQ[@]}" --config-value training.precision=fp32 --config-value training.gradient_checkpointing=true \
        --config-value multi_gpu.activation_offload=true --config-value multi_gpu.fsdp_cpu_offload=true | tee -a "$RES"
    log "a run held to 0.01 GiB per GPU (the demo model alone is more): must end with the out-of-memory figure, no traceback"
    TANDEM_SKIP_MEMORY_CHECK=1 limited 150 python3 scripts/train_multi_gpu.py --num-gpus 2 --config-path '#demo' \
        --config-value multi_gpu.memory_limit_gib=0.01 --config-value general.workspace_dir=/tmp/pooling-oom \
        --config-value training.max_steps=2 --config-value sampling.every_n_epochs=0 > /tmp/pooling-oom.log 2>&1
    code=$?
    said=$(grep -c "ran out of memory" /tmp/pooling-oom.log)
    traceback=$(grep -c "Traceback" /tmp/pooling-oom.log)
    grep -m 3 "ran out of memory\|Training failed" /tmp/pooling-oom.log
    echo "{\"check\": \"out_of_memory_message\", \"exit\": $code, \"said\": $said, \"tracebacks\": $traceback}" | tee -a "$RES"
    exit 0
    ;;
qwen)
    log "Qwen-Image LoRA: 2 GPUs capped at 24 GiB, the raw reference on 2, 1 uncapped GPU"
    capped 200 2 24 --model qwen --mode lora "${CASE[@]}"
    theirs 150 2 --model qwen --mode lora "${CASE[@]}"
    ours 120 --model qwen --mode lora "${CASE[@]}" --gpus 1
    ;;
flux2)
    log "Flux.2-dev LoRA: 4 GPUs capped at 24 GiB, the raw reference on 4, 1 uncapped GPU"
    capped 240 4 24 --model flux2 --mode lora "${CASE[@]}" --config-value "$FLUX2_TARGETS"
    theirs 150 4 --model flux2 --mode lora "${CASE[@]}"
    ours 90 --model flux2 --mode lora "${CASE[@]}" --gpus 1 --config-value "$FLUX2_TARGETS"
    ;;
flux2fp8)
    log "Flux.2-dev LoRA, fp8 base: 2 GPUs capped at 24 GiB; the raw reference (bf16 base) on 2"
    capped 300 2 24 --model flux2 --mode lora "${CASE[@]}" --config-value "$FLUX2_TARGETS" \
        --config-value model.unet_dtype=fp8
    theirs 150 2 --model flux2 --mode lora "${CASE[@]}"
    ;;
flux)
    log "Flux.1-dev full fine-tune: 4 GPUs capped at 24 GiB; the raw reference on 4"
    capped 300 4 24 --model flux --mode full --res 1024 --batch 1 --gc --steps 4 --warmup 2
    theirs 150 4 --model flux --mode full --res 1024 --batch 1 --gc --steps 4 --warmup 2
    ;;
sdxl)
    log "SDXL full fine-tune: 2 GPUs capped at 16 GiB, the raw reference on 2, 1 uncapped GPU"
    capped 200 2 16 --model sdxl --mode full "${CASE[@]}"
    theirs 120 2 --model sdxl --mode full "${CASE[@]}"
    ours 120 --model sdxl --mode full "${CASE[@]}" --gpus 1
    ;;
*) echo "unknown part $PART" >&2; exit 2 ;;
esac
log "done"
table
