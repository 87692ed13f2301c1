#!/usr/bin/env bash
# GPU verification matrix, part 1 (run on a machine with 2 GPUs; needs diffusers importable).
# Functional checks (NCCL, both launchers, equivalence) and the SD1.5-size benchmark beside the raw
# reference. Results: one JSON line per measurement in $OUT/results.jsonl (or ./gpu-results.jsonl).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUTDIR="${OUT:-.}"; RES="$OUTDIR/results.jsonl"; REF="${REF:-.bench/raw_ddp_reference.py}"
log() { echo "== $(date +%T) $*"; }
ref() { # raw reference: 1 GPU plain, N GPUs under torchrun
    local n=$1; shift
    if [ "$n" = 1 ]; then python3 "$REF" "$@"; else python3 -m torch.distributed.run --standalone --nproc_per_node="$n" "$REF" "$@"; fi \
        | grep '^{' | sed 's/^{/{"source": "raw_reference", /' | tee -a "$RES"
}
bench() { python3 scripts/benchmark.py "$@" --json "$RES" | grep -v '^{'; }
nvidia-smi -L
log "check_multi_gpu"; python3 scripts/check_multi_gpu.py --skip-gloo | tail -25
log "equivalence demo, torchrun";  python3 scripts/check_equivalence.py --num-gpus 2 --batch 4 --steps 5 --launchers torchrun --config-value training.precision=bf16 | tee -a "$RES"
log "equivalence demo, spawn";     python3 scripts/check_equivalence.py --num-gpus 2 --batch 4 --steps 5 --launchers spawn --config-value training.method=full | tee -a "$RES"
for i in 1 2 3; do
  log "sd15 full b8 round $i"
  ref 1 --model sd15 --mode full --batch 8
  ref 2 --model sd15 --mode full --batch 8
  bench --model sd15 --mode full --batch 8 --gpus 1,2 --steps 30 --warmup 8
done
log "sd15 full b8 bucket 100"; bench --model sd15 --mode full --batch 8 --gpus 2 --config-value multi_gpu.bucket_cap_mb=100 --repeat 2
log "done"
