#!/usr/bin/env bash
# Scaling run on every GPU of one host (1, 2, 4, 8, ... up to the GPUs visible), the raw reference
# beside the trainer in the same call, in parts that each fit a 10-minute call on 4 GPUs:
#   full    equivalence N x 2 == 1 x 2N at the largest N (torchrun); SD1.5-size full fine-tune,
#           8 and 32 images per GPU
#   lora    SD1.5-size LoRA, 8 and 32 images per GPU; the full fine-tune at 8 on 1 GPU with cuDNN
#           autotuning off (a lever: the reference does not autotune)
#   sdxl    SDXL-size UNet at 1024 px, 4 images per GPU, gradient checkpointing: LoRA, then full
#   flux    Flux.1-dev-size transformer (12 B, bf16 base), LoRA r16 on the attention, 1024 px,
#           gradient checkpointing, 1 image per GPU
#   flux2   the same, 2 images per GPU
#   sd35m   SD3.5-Medium-size transformer, LoRA r16, 1024 px, gradient checkpointing, 2 images per GPU
#   sd35mc  the `sd35m` case with training.compile=on (the reference uncompiled); a cold compile takes
#           ~4 minutes per world size: run WORLDS="1" and WORLDS="2" in separate calls
#   graphs  SD1.5-size LoRA at 8 per GPU with training.compile and training.cuda_graphs, the reference
#           (uncompiled) beside; the first world size fills the compile cache (~3 minutes), the others read it
#   autotune  cuDNN autotuning on | off at the same time on GPUs 0 | 1, 1 GPU each: SD1.5 full and LoRA
#           at 8 per GPU, SDXL LoRA at 4 per GPU (1024 px)
#   fp8     the `flux` case with its base in float8 (model.unet_dtype=fp8) beside the bf16 base and the raw
#           reference on 1 GPU, then at every world size: peak memory (max_mem_gib, denoiser_gib) and speed
# Every measurement is one JSON line in $OUT/results.jsonl (or ./gpu-results.jsonl); on 8 GPUs a
# part takes longer than 10 minutes: split it with WORLDS="1 2" and WORLDS="4 8" (scaling is then
# computed from the JSON lines; `full` runs the equivalence check at each call's largest world size).
# FULL_WORLDS="4" with `lora`: re-run the trainer's full fine-tune cases at those world sizes instead
# of the cuDNN lever (to fill in cases an earlier call lost).
set -u
PART="${1:?usage: scaling.sh full|lora|sdxl|flux|flux2|sd35m|sd35mc|graphs|autotune|fp8}"
source "$(dirname "$0")/common.sh"
GPUS=$(nvidia-smi -L | wc -l)
if [ -z "${WORLDS:-}" ]; then WORLDS=""; n=1; while [ $n -le "$GPUS" ]; do WORLDS="$WORLDS $n"; n=$((n * 2)); done; fi
LARGEST=$(echo $WORLDS | tr ' ' '\n' | tail -1)
matrix() { # the reference at every world size, then the trainer at every world size
    log "$*"
    for n in $WORLDS; do ref "$n" "$@"; done
    bench "$@" --gpus "$(echo $WORLDS | tr ' ' ',')"
}
nvidia-smi -L; nvidia-smi topo -m | head -$((GPUS + 1))
case "$PART" in
full)
    log "equivalence demo, $LARGEST GPUs x 2 against 1 GPU x $((2 * LARGEST)), torchrun, LoRA bf16"
    python3 scripts/check_equivalence.py --num-gpus "$LARGEST" --batch 2 --steps 5 --launchers torchrun \
        --config-value training.method=lora --config-value training.precision=bf16 | tee -a "$RES"
    matrix --model sd15 --mode full --batch 8
    matrix --model sd15 --mode full --batch 32 --steps 20 --warmup 5
    ;;
lora)
    matrix --model sd15 --mode lora --batch 8
    matrix --model sd15 --mode lora --batch 32 --steps 20 --warmup 5
    if [ -n "${FULL_WORLDS:-}" ]; then # the trainer's full fine-tune again at these world sizes
        bench --model sd15 --mode full --batch 8 --gpus "$FULL_WORLDS"
        bench --model sd15 --mode full --batch 32 --steps 20 --warmup 5 --gpus "$FULL_WORLDS"
    else
        log "lever: full b8 on 1 GPU without cuDNN autotuning"
        bench --model sd15 --mode full --batch 8 --gpus 1 --config-value training.cudnn_benchmark=off
    fi
    ;;
sdxl)
    matrix --model sdxl --mode lora --batch 4 --res 1024 --gc --steps 10 --warmup 3
    matrix --model sdxl --mode full --batch 4 --res 1024 --gc --steps 10 --warmup 3
    ;;
flux)
    matrix --model flux --mode lora --batch 1 --res 1024 --gc --steps 10 --warmup 3
    ;;
flux2)
    matrix --model flux --mode lora --batch 2 --res 1024 --gc --steps 10 --warmup 3
    ;;
sd35m)
    matrix --model sd35m --mode lora --batch 2 --res 1024 --gc --steps 10 --warmup 3
    ;;
sd35mc)
    SD35="--model sd35m --mode lora --batch 2 --res 1024 --gc --steps 10 --warmup 3"
    log "$SD35, the trainer compiled"
    for n in $WORLDS; do ref "$n" $SD35; done
    bench $SD35 --gpus "$(echo $WORLDS | tr ' ' ',')" --config-value training.compile=on --config-value training.cuda_graphs=off
    ;;
graphs)
    G="--model sd15 --mode lora --batch 8"
    log "$G, the trainer compiled with CUDA graphs"
    for n in $WORLDS; do ref "$n" $G; done
    bench $G --gpus "$(echo $WORLDS | tr ' ' ',')" --config-value training.compile=on --config-value training.cuda_graphs=on
    ;;
autotune)
    for case in "--model sd15 --mode full --batch 8" "--model sd15 --mode lora --batch 8" \
                "--model sdxl --mode lora --batch 4 --res 1024 --gc --steps 10 --warmup 3"; do
        log "$case: cuDNN autotuning on (GPU 0) | off (GPU 1), at once"
        CUDA_VISIBLE_DEVICES=0 bench $case --gpus 1 --config-value training.cudnn_benchmark=on > "$OUTDIR/autotune-on.log" 2>&1 &
        CUDA_VISIBLE_DEVICES=1 bench $case --gpus 1 --config-value training.cudnn_benchmark=off > "$OUTDIR/autotune-off.log" 2>&1
        wait
        grep -h "^| [a-z]" "$OUTDIR/autotune-on.log" "$OUTDIR/autotune-off.log" | grep -v "^| case"
    done
    ;;
fp8)
    FLUX="--model flux --mode lora --batch 1 --res 1024 --gc --steps 10 --warmup 3"
    log "Flux-size LoRA on 1 GPU: raw reference (bf16 base), trainer bf16 base, trainer fp8 base"
    ref 1 $FLUX
    bench $FLUX --gpus 1 --config-value model.unet_dtype=bf16
    bench $FLUX --gpus "$(echo $WORLDS | tr ' ' ',')" --config-value model.unet_dtype=fp8
    ;;
*) echo "unknown part $PART" >&2; exit 2 ;;
esac
log "done"
