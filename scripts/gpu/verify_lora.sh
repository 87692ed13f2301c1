#!/usr/bin/env bash
# GPU check of the LoRA path alone (SD1.5-size, batch 8 per GPU): raw reference and Tandem, 1 and 2 GPUs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUTDIR="${OUT:-.}"; RES="$OUTDIR/results.jsonl"; REF="${REF:-.bench/raw_ddp_reference.py}"
python3 "$REF" --model sd15 --mode lora --batch 8 | grep '^{' | sed 's/^{/{"source": "raw_reference", /' | tee -a "$RES"
python3 -m torch.distributed.run --standalone --nproc_per_node=2 "$REF" --model sd15 --mode lora --batch 8 \
    | grep '^{' | sed 's/^{/{"source": "raw_reference", /' | tee -a "$RES"
python3 scripts/benchmark.py --model sd15 --mode lora --batch 8 --gpus 1,2 --json "$RES" | grep -v '^{'
