#!/usr/bin/env bash
# GPU verification matrix, part 2: the DDP bucket-size lever, LoRA, SDXL-size, and SD1.5-size
# equivalence through both launchers on real files (random weights). Same conventions as verify_2gpu.sh.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUTDIR="${OUT:-.}"; RES="$OUTDIR/results.jsonl"; REF="${REF:-.bench/raw_ddp_reference.py}"
log() { echo "== $(date +%T) $*"; }
ref() {
    local n=$1; shift
    if [ "$n" = 1 ]; then python3 "$REF" "$@"; else python3 -m torch.distributed.run --standalone --nproc_per_node="$n" "$REF" "$@"; fi \
        | grep '^{' | sed 's/^{/{"source": "raw_reference", /' | tee -a "$RES"
}
bench() { python3 scripts/benchmark.py "$@" --json "$RES" | grep -v '^{'; }
log "sd15 full b8, bucket 100"
ref 1 --model sd15 --mode full --batch 8; ref 2 --model sd15 --mode full --batch 8 --bucket-mb 100
bench --model sd15 --mode full --batch 8 --gpus 1,2 --config-value multi_gpu.bucket_cap_mb=100
log "sd15 lora b8"
ref 1 --model sd15 --mode lora --batch 8; ref 2 --model sd15 --mode lora --batch 8
bench --model sd15 --mode lora --batch 8 --gpus 1,2
log "sdxl lora 1024 b4 gc"
ref 1 --model sdxl --mode lora --batch 4 --res 1024 --gc --steps 12 --warmup 4
ref 2 --model sdxl --mode lora --batch 4 --res 1024 --gc --steps 12 --warmup 4
bench --model sdxl --mode lora --batch 4 --res 1024 --gc --gpus 1,2 --steps 12 --warmup 4
log "sd15-size equivalence on real files, both launchers"
python3 scripts/make_random_model.py --type sd1 --out /tmp/random-sd15 >/dev/null
python3 scripts/check_equivalence.py --config-path '#demo' --num-gpus 2 --batch 2 --steps 3 --launchers torchrun,spawn \
  --config-value model.base_model=/tmp/random-sd15 --config-value data.resolution=512 --config-value training.method=lora \
  --config-value training.precision=bf16 --config-value model.unet_dtype=bf16 | tee -a "$RES"
log "done"
