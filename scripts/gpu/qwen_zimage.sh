#!/usr/bin/env bash
# Qwen-Image and Z-Image at their published sizes (random weights), the raw reference
# (.bench/raw_ddp_reference.py --model qwen|zimage) beside Tandem's real trainer (scripts/benchmark.py) in the
# same call, 1024 px, 1 image per GPU, gradient checkpointing, LoRA r16 on the attention (to_q/k/v/out, the
# reference's targets); then a table. Parts, each within an 8-minute call:
#   qwen1      Qwen-Image LoRA on 1 GPU (the issue: reference 0.88 img/s, 40.8 GiB on an H200)
#   qwen2      Qwen-Image LoRA with FSDP2 on 2 GPUs (reference 1.50 img/s, 23.0 GiB per GPU)
#   qwen2ddp   Qwen-Image LoRA with DDP on 2 GPUs (a whole bf16 base per GPU)
#   qwen4full  Qwen-Image full fine-tune, FSDP2 on 4 GPUs. Both sides build the 20 B transformer whole in fp32
#              (82 GB) on every GPU before sharding it: run on nvidia-h200-x4 (needs_h200); a user's run loads
#              it into host memory instead (FSDPParallelism.load_device)
#   zimage     Z-Image LoRA on 1 and 2 GPUs (DDP)
#   text       the text encoders at their real size, placed as the trainer places them: Qwen2.5-VL 7B whole
#              on a GPU in bf16, in fp8, offloaded, sharded over 2 GPUs; Qwen3 4B whole (needs 2 GPUs)
# Targets (issue #34): Tandem's img/s >= the reference's, its peak memory within 10% of the reference's.
# Every measurement is one JSON line in $OUT/results.jsonl (or ./gpu-results.jsonl); the table at the end
# shows this call's.
set -u
PART="${1:?usage: qwen_zimage.sh qwen1|qwen2|qwen2ddp|qwen4full|zimage|text}"
source "$(dirname "$0")/common.sh"
FSDP="--config-value multi_gpu.strategy=fsdp"
DDP="--config-value multi_gpu.strategy=ddp"
touch "$RES"; FIRST=$(wc -l < "$RES")
nvidia-smi -L
LORA="--mode lora --batch 1 --res 1024 --gc --steps 8 --warmup 3"
case "$PART" in
qwen1)
    log "Qwen-Image LoRA 1024 b1 gc, 1 GPU: reference, Tandem"
    ref 1 --model qwen $LORA
    bench --model qwen $LORA --gpus 1
    ;;
qwen2)
    log "Qwen-Image LoRA 1024 b1 gc, 2 GPUs with FSDP2: reference, Tandem"
    ref 2 --model qwen $LORA --fsdp
    bench --model qwen $LORA --gpus 2 $FSDP
    ;;
qwen2ddp)
    log "Qwen-Image LoRA 1024 b1 gc, 2 GPUs with DDP: reference, Tandem"
    ref 2 --model qwen $LORA
    bench --model qwen $LORA --gpus 2 $DDP
    ;;
qwen4full)
    FULL="--model qwen --mode full --batch 1 --res 1024 --gc --steps 6 --warmup 3"
    log "Qwen-Image full fine-tune 1024 b1 gc, FSDP2 on 4 GPUs: reference, Tandem"
    ref 4 $FULL --fsdp
    bench $FULL --gpus 4 $FSDP
    ;;
zimage)
    log "Z-Image LoRA 1024 b1 gc, 1 and 2 GPUs (DDP): reference, Tandem"
    ref 1 --model zimage $LORA
    ref 2 --model zimage $LORA
    bench --model zimage $LORA --gpus 1,2 $DDP
    ;;
text)
    log "text encoders at real size: placement and encoding of 256 captions"
    for placement in gpu fp8 offload; do
        python3 scripts/benchmark_text_encoder.py --family qwen --placement "$placement" | tee -a "$RES"
    done
    python3 -m torch.distributed.run --standalone --nproc_per_node=2 scripts/benchmark_text_encoder.py \
        --family qwen --placement sharded | tee -a "$RES"
    python3 scripts/benchmark_text_encoder.py --family zimage --placement gpu | tee -a "$RES"
    ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
python3 "$(dirname "$0")/qwen_zimage_table.py" "$RES" "$FIRST"
