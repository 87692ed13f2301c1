#!/usr/bin/env bash
# GPU verification on a machine with 2 GPUs (needs diffusers importable), in parts that each fit a
# 10-minute call:
#   full    SD1.5-size full fine-tune, 8/GPU: 3 rounds of raw reference and Tandem on 1 and 2 GPUs,
#           then PyTorch's 25 MiB bucket against the 100 MiB default; the demo's 2 x 4 == 1 x 8 check
#           through torchrun first
#   lora    SD1.5-size LoRA, 8/GPU: 3 rounds as above; SDXL-size LoRA at 1024 px, 4/GPU, one round
#   levers  DDP levers for the full fine-tune at 8/GPU (bucket 100/200 MiB, bf16 compression) beside
#           the reference, one LoRA round, and the demo's equivalence through spawn (full, fp32)
#   profile is the step GPU-bound or host-bound, and which rank waits? SD1.5 full and LoRA, 8/GPU,
#           1 and 2 GPUs, with --profile (per rank: op tables, compute and NCCL busy fractions in
#           $OUT/profile-*.txt), then three levers for LoRA on 2 GPUs (static graph, no cuDNN
#           autotuning, loading in the main process)
#   compile MODE (lora | full): SD1.5-size, 8/GPU, training.compile on, 1 and 2 GPUs, beside the
#           reference (uncompiled, the targets' baseline) and Tandem uncompiled; recompilations logged
#   checks  equivalence through both launchers (demo; SD1.5-size model read from real files),
#           check_multi_gpu, and caching time on 1 vs 2 GPUs (SD1.5-size VAE, 1024 images at 512 px)
# Results: one JSON line per measurement in $OUT/results.jsonl (or ./gpu-results.jsonl).
set -u
PART="${1:?usage: verify_2gpu.sh full|lora|levers|profile|compile MODE|checks}"
source "$(dirname "$0")/common.sh"
rounds() { # 3 interleaved rounds of reference and Tandem, 1 and 2 GPUs
    for i in 1 2 3; do
        log "$* round $i"
        ref 1 "$@"; ref 2 "$@"
        bench "$@" --gpus 1,2
    done
}
nvidia-smi -L
case "$PART" in
full)
    log "equivalence demo, torchrun, LoRA bf16"
    python3 scripts/check_equivalence.py --num-gpus 2 --batch 4 --steps 5 --launchers torchrun \
        --config-value training.method=lora --config-value training.precision=bf16 | tee -a "$RES"
    rounds --model sd15 --mode full --batch 8
    log "sd15 full b8, PyTorch's bucket 25 against the default 100, same call"
    ref 2 --model sd15 --mode full --batch 8 --bucket-mb 100
    bench --model sd15 --mode full --batch 8 --gpus 2 --config-value multi_gpu.bucket_cap_mb=25
    ;;
lora)
    rounds --model sd15 --mode lora --batch 8
    log "sdxl lora 1024 b4 gc"
    ref 1 --model sdxl --mode lora --batch 4 --res 1024 --gc --steps 12 --warmup 4
    ref 2 --model sdxl --mode lora --batch 4 --res 1024 --gc --steps 12 --warmup 4
    bench --model sdxl --mode lora --batch 4 --res 1024 --gc --gpus 1,2 --steps 12 --warmup 4
    ;;
levers)
    log "equivalence demo, spawn, full fp32"
    python3 scripts/check_equivalence.py --num-gpus 2 --batch 4 --steps 5 --launchers spawn \
        --config-value training.method=full | tee -a "$RES"
    log "sd15 full b8: DDP levers"
    ref 1 --model sd15 --mode full --batch 8; ref 2 --model sd15 --mode full --batch 8 --bucket-mb 100
    bench --model sd15 --mode full --batch 8 --gpus 1,2 --config-value multi_gpu.bucket_cap_mb=100
    bench --model sd15 --mode full --batch 8 --gpus 2 --config-value multi_gpu.bucket_cap_mb=200
    bench --model sd15 --mode full --batch 8 --gpus 2 --config-value multi_gpu.bucket_cap_mb=100 \
        --config-value multi_gpu.gradient_compression=bf16
    log "sd15 lora b8"
    ref 1 --model sd15 --mode lora --batch 8; ref 2 --model sd15 --mode lora --batch 8
    bench --model sd15 --mode lora --batch 8 --gpus 1,2
    ;;
profile)
    for mode in full lora; do ref 1 --model sd15 --mode $mode --batch 8; ref 2 --model sd15 --mode $mode --batch 8; done
    bench --model sd15 --mode full --batch 8 --gpus 1,2 --profile "$OUTDIR"
    bench --model sd15 --mode lora --batch 8 --gpus 1,2 --profile "$OUTDIR"
    log "levers for the worst case (LoRA b8 on 2 GPUs: 80% on 4x H100, reference 101%)"
    bench --model sd15 --mode lora --batch 8 --gpus 2 --config-value multi_gpu.static_graph=true
    bench --model sd15 --mode lora --batch 8 --gpus 2 --config-value training.cudnn_benchmark=off
    bench --model sd15 --mode lora --batch 8 --gpus 2 --config-value data.num_workers=0
    ;;
compile)
    mode="${2:?usage: verify_2gpu.sh compile lora|full}"
    ref 1 --model sd15 --mode "$mode" --batch 8; ref 2 --model sd15 --mode "$mode" --batch 8
    log "sd15 $mode b8 compiled (the first step compiles and checks; the warm-up leaves it out)"
    TORCH_LOGS=recompiles bench --model sd15 --mode "$mode" --batch 8 --gpus 1,2 --config-value training.compile=on --config-value training.cuda_graphs=off
    bench --model sd15 --mode "$mode" --batch 8 --gpus 1,2
    ;;
checks)
    log "SD1.5-size model from real files (random weights), both launchers, LoRA bf16"
    python3 scripts/make_random_model.py --type sd1 --out /tmp/random-sd15 >/dev/null
    python3 scripts/check_equivalence.py --num-gpus 2 --batch 2 --steps 3 --launchers torchrun,spawn \
        --config-value model.base_model=/tmp/random-sd15 --config-value data.resolution=512 \
        --config-value training.method=lora --config-value training.precision=bf16 \
        --config-value model.unet_dtype=bf16 | tee -a "$RES"
    log "caching time, 1024 images at 512 px, SD1.5-size VAE: 1 GPU vs 2 GPUs"
    python3 -c "
import numpy as np, os; from PIL import Image
os.makedirs('/tmp/imgs', exist_ok=True); g = np.random.default_rng(0)
for i in range(1024):
    small = g.integers(0, 255, (8, 8, 3), dtype=np.uint8)
    Image.fromarray(small).resize((512, 512), Image.BICUBIC).save(f'/tmp/imgs/{i:04d}.jpg', quality=90)
    open(f'/tmp/imgs/{i:04d}.txt', 'w').write('a random picture')"
    common=(--config-value model.base_model=/tmp/random-sd15 --config-value data.resolution=512
            --config-value 'data.concepts[0].path=/tmp/imgs' --config-value training.method=lora
            --config-value training.precision=bf16 --config-value training.max_steps=1
            --config-value sampling.every_n_epochs=0 --config-value sampling.sample_at_start=false
            --config-value data.random_flip=false)
    for n in 1 2; do
        if [ $n = 1 ]; then script=(scripts/train.py); else script=(scripts/train_multi_gpu.py --num-gpus 2); fi
        TANDEM_EVENTS=1 python3 "${script[@]}" --config-path '#demo' "${common[@]}" \
            --config-value general.workspace_dir=/tmp/cache-ws-$n --config-value general.cache_dir=/tmp/cache-$n \
            | grep '"type": "cache"' | sed "s/^@tandem {/{\"check\": \"caching\", \"gpus\": $n, /" | tee -a "$RES"
    done
    log "check_multi_gpu"; python3 scripts/check_multi_gpu.py --skip-gloo | tail -25
    ;;
*) echo "unknown part $PART" >&2; exit 2 ;;
esac
log "done"
