#!/usr/bin/env bash
# The 2026 families at their published sizes (issue #34): Tandem's real trainer (scripts/benchmark.py:
# random real-size transformer, synthetic cached latents and text, the real loop, DDP/FSDP2, optimizer)
# beside the raw reference (.bench/raw_ddp_reference.py, a copy of ../shared/bench/raw_ddp_reference.py)
# in the same call, 1024 px, batch 1 per GPU, gradient checkpointing, bf16 autocast. Parts, each one call
# of under 8 minutes:
#   flux2dev1   Flux.2-dev (32.2 B) LoRA r16 on 1 GPU (the bf16 base, 64 GB, whole on it: an 80 GB card or more)
#   flux2dev2   Flux.2-dev (32.2 B) LoRA r16 on the attention and the fused single-block projections,
#               FSDP2 on 2 GPUs (the base in bf16, sharded; DDP cannot hold it next to activations)
#   flux2dev4   the same on 4 GPUs
#   klein2      Flux.2 Klein 4B full fine-tune, FSDP2 on 2 GPUs (fp32 master weights, AdamW); the reference
#               runs at Klein's size through scripts/gpu/reference_variant.py
#   chroma      Chroma (8.9 B) LoRA r16 on the attention projections, 1 and 2 GPUs (DDP)
#   edit1       Qwen-Image-Edit(-Plus) LoRA r16 on 1 GPU with one control image of the target's size (the token
#               sequence doubles; the reference's qwen --control 1)
#   edit2       the same, FSDP2 on 2 GPUs
#   kleinref1   Flux.2 Klein 4B LoRA r16 on 1 GPU with one reference image (the reference's flux2 --control 1 at
#               Klein's size)
#   smoke       CPU only: the reference (tiny, 2 processes) and the variant wrapper, and the table - the
#               plumbing of this script, no measurement
# Each part ends with a table: img/s and peak GiB per GPU of the reference and of Tandem.
# Results: one JSON line per measurement in $OUT/results.jsonl (or ./gpu-results.jsonl).
#   run on a 4-GPU machine, e.g.:  bash scripts/gpu/families.sh flux2dev2   (carry .bench)
set -u
PART="${1:?usage: families.sh flux2dev1|flux2dev2|flux2dev4|klein2|chroma|edit1|edit2|kleinref1|smoke}"
source "$(dirname "$0")/common.sh"
touch "$RES"; START=$(wc -l < "$RES")
COMMON="--res 1024 --batch 1 --gc --steps 8 --warmup 3"
FSDP="--config-value multi_gpu.strategy=fsdp"
DDP="--config-value multi_gpu.strategy=ddp"
# The reference's Flux.2 LoRA targets: q, k, v and the output of attention, the single blocks' fused
# q/k/v + MLP input and their fused output (`attn.to_out` is that layer in single blocks only).
FLUX2_TARGETS='training.lora_target_modules=["to_q","to_k","to_v","to_out.0","to_qkv_mlp_proj","attn.to_out"]'
# Each run is stopped for good at its limit (common.sh's `limited`), so a part never outruns its call; the
# limits of a part add up to under 8 minutes.
reference() { # SECONDS N [VARIANT] -- reference arguments: the raw reference (at the family's VARIANT size)
    local seconds=$1 n=$2 variant=""; shift 2
    if [ "$1" != "--" ]; then variant=$1; shift; fi
    shift
    local script=("$REF") tag=""
    if [ -n "$variant" ]; then script=(scripts/gpu/reference_variant.py "$variant"); tag="\"variant\": \"$variant\", "; fi
    if [ "$n" = 1 ]; then limited "$seconds" python3 "${script[@]}" "$@"
    else limited "$seconds" python3 -m torch.distributed.run --standalone --nproc_per_node="$n" "${script[@]}" "$@"; fi \
        | grep '^{' | sed "s/^{/{\"source\": \"raw_reference\", $tag/" | tee -a "$RES"
}
tandem() { # SECONDS -- benchmark arguments: Tandem's trainer
    local seconds=$1; shift 2
    limited "$seconds" python3 scripts/benchmark.py "$@" --json "$RES" | grep -v '^{'
}
[ "$PART" = smoke ] || nvidia-smi -L
case "$PART" in
flux2dev1)
    log "Flux.2-dev LoRA r16 1024 b1 gc on 1 GPU: reference, Tandem"
    reference 200 1 -- --model flux2 --mode lora $COMMON
    tandem 250 -- --model flux2-dev --mode lora --gpus 1 $COMMON --config-value "$FLUX2_TARGETS"
    ;;
flux2dev2|flux2dev4)
    n=${PART#flux2dev}
    log "Flux.2-dev LoRA r16 1024 b1 gc, FSDP2 on $n GPUs: reference, Tandem"
    reference 200 "$n" -- --model flux2 --mode lora --fsdp $COMMON
    tandem 250 -- --model flux2-dev --mode lora --gpus "$n" $COMMON $FSDP --config-value "$FLUX2_TARGETS"
    ;;
klein2)
    log "Flux.2 Klein 4B full fine-tune 1024 b1 gc, FSDP2 on 2 GPUs: reference, Tandem"
    reference 200 2 klein-4b -- --model flux2 --mode full --fsdp $COMMON
    tandem 250 -- --model flux2-klein-4b --mode full --gpus 2 $COMMON $FSDP
    ;;
chroma)
    log "Chroma LoRA r16 (attention) 1024 b1 gc on 1 and 2 GPUs (DDP): reference, Tandem"
    reference 100 1 -- --model chroma --mode lora $COMMON
    reference 100 2 -- --model chroma --mode lora $COMMON
    tandem 260 -- --model chroma --mode lora --gpus 1,2 $COMMON $DDP
    ;;
edit1)
    log "Qwen-Image-Edit LoRA r16 1024 b1 gc, one control image, on 1 GPU: reference, Tandem"
    reference 200 1 -- --model qwen --mode lora --control 1 $COMMON
    tandem 250 -- --model qwen_edit --mode lora --controls 1 --gpus 1 $COMMON
    ;;
kleinref1)
    log "Flux.2 Klein 4B LoRA r16 1024 b1 gc, one reference image, on 1 GPU: reference, Tandem"
    reference 120 1 klein-4b -- --model flux2 --mode lora --control 1 $COMMON
    tandem 200 -- --model flux2-klein-4b --mode lora --controls 1 --gpus 1 $COMMON --config-value "$FLUX2_TARGETS"
    ;;
edit2)
    log "Qwen-Image-Edit LoRA r16 1024 b1 gc, one control image, FSDP2 on 2 GPUs: reference, Tandem"
    reference 200 2 -- --model qwen --mode lora --control 1 --fsdp $COMMON
    tandem 250 -- --model qwen_edit --mode lora --controls 1 --gpus 2 $COMMON $FSDP
    ;;
smoke)
    log "CPU: the reference at tiny size on 2 processes, and through the variant wrapper"
    TINY="--tiny --device cpu --res 64 --batch 1 --steps 2 --warmup 1"
    reference 300 2 -- --model flux2 --mode lora --fsdp $TINY
    reference 300 2 klein-4b -- --model flux2 --mode full --fsdp $TINY
    reference 300 1 -- --model chroma --mode lora $TINY
    ;;
*) echo "unknown part $PART" >&2; exit 2 ;;
esac
python3 scripts/gpu/families_table.py "$RES" "$START"
log "done"
