#!/usr/bin/env bash
# Wan 2.1 T2V 1.3B (real size, random weights) LoRA on 1 GPU: clips of 81 frames (21 latent frames) at about
# 832x480 (--res 624: a 624 px square of the same area, 78x78 latents, 31,941 tokens per clip), 1 clip per
# step, gradient checkpointing, LoRA r16 on every linear layer of the blocks (the wan_lora preset's targets).
# Tandem's real trainer on synthetic cached latents and UMT5 embeddings (scripts/benchmark.py); then a table
# of clips/s and peak memory. Parts, each within an 8-minute call:
#   lora1     the 1.3B at 81 frames (the quick row of issue #36), and at 17 frames for scale
#   lora14    the 14B at 81 frames (the issue's floor: 1 GPU with checkpointing); 14B in bf16 is 28 GB
#   cp        the 14B at 81 frames, 512 px (21 latent frames of 32 x 32 tokens: 21,504 per clip, the raw
#             reference's case), one clip per step: 1 GPU (the floor), then multi_gpu.context_parallel = 2 on 2 GPUs
#             and 4 on 4 (one clip split over all of them: scaling = clips/s against 1 GPU x the GPUs), DDP
#             (each GPU holds the 14B in bf16); the raw reference (--model wan14, 1 GPU) beside them. Run on
#             nvidia-h100-x4 (or h200-x4).
#   wan22     Wan 2.2: TI2V 5B LoRA at 81 frames, --res 960 (about 1280x704, its 720p: 60x60 latents of its 16x
#             VAE, 18,900 tokens per clip), and one T2V A14B expert (the trained one; the frozen expert waits in
#             host memory and is not part of a step) at 81 frames, 624 px
# Every measurement is one JSON line in $OUT/results.jsonl (or ./gpu-results.jsonl); the table at the end
# shows this call's.
set -u
PART="${1:-lora1}"
source "$(dirname "$0")/common.sh"
touch "$RES"; FIRST=$(wc -l < "$RES")
nvidia-smi -L
TARGETS='training.lora_target_modules=["to_q","to_k","to_v","to_out.0","ffn.net.0.proj","ffn.net.2"]'
LORA=(--mode lora --batch 1 --res 624 --gc --steps 6 --warmup 2 --gpus 1 --config-value "$TARGETS")
case "$PART" in
lora1)
    log "Wan 1.3B LoRA, 81 frames, 624 px, b1 gc, 1 GPU"
    limited 420 python3 scripts/benchmark.py --model wan-1.3b "${LORA[@]}" --config-value data.video_frames=81 --json "$RES" | grep -v '^{'
    log "Wan 1.3B LoRA, 17 frames, 624 px, b1 gc, 1 GPU"
    limited 120 python3 scripts/benchmark.py --model wan-1.3b "${LORA[@]}" --config-value data.video_frames=17 --json "$RES" | grep -v '^{'
    ;;
lora14)
    log "Wan 14B LoRA, 81 frames, 624 px, b1 gc, 1 GPU"
    limited 470 python3 scripts/benchmark.py --model wan-14b "${LORA[@]}" --config-value data.video_frames=81 --json "$RES" | grep -v '^{'
    ;;
cp)
    CP=(--model wan-14b --mode lora --batch 1 --res 512 --gc --steps 4 --warmup 2 --config-value "$TARGETS"
        --config-value data.video_frames=81)
    log "Wan 14B LoRA, 81 frames, 512 px, b1 gc: 1 GPU"
    limited 170 python3 scripts/benchmark.py "${CP[@]}" --gpus 1 --json "$RES" | grep -v '^{'
    for n in 2 4; do
        log "Wan 14B LoRA, 81 frames, 512 px, b1 gc: context parallel over $n GPUs"
        limited 150 python3 scripts/benchmark.py "${CP[@]}" --gpus "$n" --config-value multi_gpu.strategy=ddp \
            --config-value "multi_gpu.context_parallel=$n" --json "$RES" | grep -v '^{'
    done
    log "raw reference: Wan 14B, 81 frames, 512 px, 1 GPU"
    limited 100 python3 "$REF" --model wan14 --mode lora --frames 81 --res 512 --batch 1 --gc --steps 4 --warmup 2 \
        | grep '^{' | sed 's/^{/{"source": "raw_reference", /' | tee -a "$RES"
    ;;
wan22)
    log "Wan 2.2 TI2V 5B LoRA, 81 frames, 960 px, b1 gc, 1 GPU"
    limited 300 python3 scripts/benchmark.py --model wan-ti2v-5b --mode lora --batch 1 --res 960 --gc --steps 6 --warmup 2 --gpus 1 --config-value "$TARGETS" --config-value data.video_frames=81 --json "$RES" | grep -v '^{'
    log "Wan 2.2 T2V A14B expert LoRA, 81 frames, 624 px, b1 gc, 1 GPU"
    limited 170 python3 scripts/benchmark.py --model wan-a14b "${LORA[@]}" --config-value data.video_frames=81 --json "$RES" | grep -v '^{'
    ;;
*) echo "unknown part $PART (lora1 | lora14 | wan22 | cp)"; exit 2 ;;
esac
python3 - "$RES" "$FIRST" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]).read().splitlines()[int(sys.argv[2]):] if l.startswith("{")]
print(f"{'case':<70} {'GPUs':>4} {'CP':>3} {'frames':>6} {'clips/s':>8} {'frames/s':>9} {'step s':>7} {'peak GiB':>9}")
for r in rows:
    if r.get("source") == "raw_reference":
        print(f"{'raw reference ' + r.get('model', ''):<70} {r.get('world', 1):>4} {'-':>3} {r.get('frames', '-'):>6} "
              f"{r['samples_per_s']:>8} {'':>9} {r['step_s']:>7} {r['max_mem_gib']:>9}")
        continue
    frames = next((int(e.split("=")[1]) for e in r.get("extra", []) if e.startswith("data.video_frames=")), 1)
    print(f"{r['case'][:70]:<70} {r['world']:>4} {r.get('context_parallel', 1):>3} {frames:>6} {r['samples_per_s']:>8} "
          f"{r['samples_per_s'] * frames:>9.1f} {r['step_s']:>7} {r['max_mem_gib']:>9}")
PY
