#!/usr/bin/env bash
# Sharded training (multi_gpu.strategy) on one host with 4 GPUs, the raw reference
# (.bench/raw_ddp_reference.py, --fsdp: fully_shard per block) beside the trainer in the same call, in
# parts that each fit a 10-minute call:
#   check    FSDP on GPUs (NCCL): the demo's 2 x 4 == 1 x 8 through torchrun (full fine-tune, fp32),
#            LoRA bf16 the same, the full fine-tune with CPU offload; a run with CPU offload and gradient
#            clipping (its norm reduces over host-memory shards: the NCCL + gloo process group);
#            check_multi_gpu's per-strategy estimate for the Flux full fine-tune
#   sdxl2    SDXL-size UNet, full fine-tune at 1024 px, 4 images per GPU, gradient checkpointing, 2 GPUs:
#            DDP vs FSDP, reference and trainer (img/s, peak GiB per GPU)
#   sdxl4    the same on 4 GPUs
#   flux4    Flux.1-dev-size transformer (12 B), full fine-tune at 1024 px, 1 image per GPU, gradient
#            checkpointing, 4 GPUs: FSDP (DDP cannot hold it), reference and trainer; the trainer with
#            strategy auto, which must pick FSDP
#   lora     LoRA r16 at batch 1 (where SimpleTuner found FSDP2 3-6x slower than DDP): SDXL-size at
#            1024 px on 2 GPUs, DDP vs FSDP vs auto (auto must pick DDP), reference DDP and FSDP
#   e2e      the whole path on a real-size model read from files: SD1.5-size random model folder (an
#            SDXL-size one writes ~80 GB of backups and models before the first resume), full fine-tune
#            under FSDP on 2 GPUs (bf16, 512 px, global batch 4) with a sharded backup every
#            3 steps and the final model (diffusers folder + single file, streamed) - then resumed from
#            the step-3 backup on 4 GPUs (FSDP) and on 1 GPU (DCP resharding), each to step 6, and the
#            three step-6 backups compared (relative L2; bf16, so ~1e-2 is the same training; measured
#            1.1e-4 and 2.5e-4). Takes ~5.5 min on 4x H100, the comparison ~1.5 min more: limit it to 480 s
# Each trainer result carries "strategy" (what multi_gpu.strategy gave) and "per_rank" peak memory.
# Results: one JSON line per measurement in $OUT/results.jsonl (or ./gpu-results.jsonl).
set -u
PART="${1:?usage: fsdp.sh check|sdxl2|sdxl4|flux4|lora|e2e}"
source "$(dirname "$0")/common.sh"
FSDP="--config-value multi_gpu.strategy=fsdp"
DDP="--config-value multi_gpu.strategy=ddp"
AUTO="--config-value multi_gpu.strategy=auto"
nvidia-smi -L
case "$PART" in
check)
    log "equivalence demo under FSDP, torchrun, full fp32"
    python3 scripts/check_equivalence.py --num-gpus 2 --batch 4 --steps 5 --launchers torchrun \
        --config-value training.method=full --config-value training.precision=fp32 $FSDP | tee -a "$RES"
    log "equivalence demo under FSDP, spawn, LoRA bf16"
    python3 scripts/check_equivalence.py --num-gpus 2 --batch 4 --steps 5 --launchers spawn \
        --config-value training.method=lora --config-value training.precision=bf16 $FSDP | tee -a "$RES"
    log "equivalence demo under FSDP with CPU offload, torchrun, full fp32"
    python3 scripts/check_equivalence.py --num-gpus 2 --batch 4 --steps 5 --launchers torchrun \
        --config-value training.method=full --config-value training.precision=fp32 $FSDP \
        --config-value multi_gpu.fsdp_cpu_offload=true | tee -a "$RES"
    log "CPU offload with gradient clipping (bf16, 5 steps): must exit 0"
    python3 scripts/train_multi_gpu.py --num-gpus 2 --config-path '#demo' $FSDP \
        --config-value multi_gpu.fsdp_cpu_offload=true --config-value training.method=full \
        --config-value training.max_grad_norm=1.0 --config-value training.max_steps=5 \
        --config-value general.workspace_dir=/tmp/fsdp-offload --config-value sampling.every_n_epochs=0
    echo "{\"check\": \"offload_with_clipping\", \"exit\": $?}" | tee -a "$RES"
    log "check_multi_gpu: Flux full fine-tune on 4 GPUs, per strategy"
    mkdir -p /tmp/fsdp-check && : > /tmp/fsdp-check/flux.safetensors
    cat > /tmp/fsdp-check/flux.json <<'EOF'
{"model": {"base_model": "/tmp/fsdp-check/flux.safetensors", "model_type": "flux"}, "data": {"resolution": 1024},
 "training": {"method": "full", "precision": "bf16", "batch_size": 1, "gradient_checkpointing": true},
 "multi_gpu": {"enabled": true, "num_gpus": 4}}
EOF
    python3 scripts/check_multi_gpu.py --skip-gloo --config-path /tmp/fsdp-check/flux.json | tail -12
    ;;
sdxl2|sdxl4)
    n=${PART#sdxl}
    CASE="--model sdxl --mode full --batch 4 --res 1024 --gc --steps 10 --warmup 3"
    log "sdxl full 1024 b4 gc on $n GPUs: reference DDP, reference FSDP, Tandem DDP, Tandem FSDP"
    ref "$n" $CASE --bucket-mb 100
    ref "$n" $CASE --fsdp
    bench $CASE --gpus "$n" $DDP --config-value multi_gpu.bucket_cap_mb=100
    bench $CASE --gpus "$n" $FSDP
    ;;
flux4)
    CASE="--model flux --mode full --batch 1 --res 1024 --gc --steps 8 --warmup 3"
    log "flux full 1024 b1 gc on 4 GPUs: reference FSDP, Tandem auto (must pick FSDP)"
    ref 4 $CASE --fsdp
    bench $CASE --gpus 4 $AUTO
    ;;
lora)
    CASE="--model sdxl --mode lora --batch 1 --res 1024 --gc --steps 12 --warmup 4"
    log "sdxl lora 1024 b1 gc on 2 GPUs: reference DDP and FSDP, Tandem DDP, FSDP, auto (must pick DDP)"
    ref 2 $CASE
    ref 2 $CASE --fsdp
    bench $CASE --gpus 2 $DDP
    bench $CASE --gpus 2 $FSDP
    bench $CASE --gpus 2 $AUTO
    ;;
e2e)
    W=/tmp/fsdp-e2e; rm -rf "$W"; mkdir -p "$W"
    log "SD1.5-size random model folder"
    python3 -c "from modules.benchmark.synthetic import write_random_model; write_random_model('sd1', '$W/model')"
    run() { # workspace, per-GPU batch, then the launch command; global batch 4 in every run
        local ws=$1 batch=$2; shift 2
        local flags=()
        for o in "general.workspace_dir=$W/$ws" "model.base_model=$W/model" "data.resolution=512" \
                 "training.method=full" "training.precision=bf16" "training.batch_size=$batch" \
                 "training.gradient_checkpointing=true" "training.max_steps=6" "save.backup_every_n_steps=3" \
                 "save.full_format=both" "sampling.every_n_epochs=0" "general.tensorboard=false"; do
            flags+=(--config-value "$o")
        done
        "$@" --config-path '#demo' "${flags[@]}"
    }
    log "FSDP on 2 GPUs: 6 steps, sharded backups at 3 and 6, the final model streamed (folder + single file)"
    run two 2 python3 scripts/train_multi_gpu.py --num-gpus 2 --config-value multi_gpu.strategy=fsdp
    ls -la "$W/two/output" "$W"/two/backups/*/*/
    STEP3=$(ls -d "$W"/two/backups/*/step-00000003)
    log "resume the step-3 sharded backup on 4 GPUs (FSDP) and on 1 GPU"
    run four 1 python3 scripts/train_multi_gpu.py --num-gpus 4 --resume "$STEP3" --config-value multi_gpu.strategy=fsdp
    run one 4 python3 scripts/train.py --resume "$STEP3"
    python3 scripts/gpu/compare_backups.py "$W" two four one | tee -a "$RES"
    ;;
*) echo "unknown part $PART" >&2; exit 2 ;;
esac
log "done"
