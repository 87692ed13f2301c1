#!/usr/bin/env bash
# LoRA variants (training.lora_type lora, dora, loha, lokr) on 2 GPUs, in one call (about 6 minutes on H100s):
#   1. the demo's 2 GPUs x 4 == 1 GPU x 8 through torchrun, bf16, per variant (scripts/check_equivalence.py)
#   2. an SD1.5-size LoRA (random weights, 512 px, 8 per GPU) per variant on 1 and 2 GPUs: images/s,
#      peak memory, trainable parameters (scripts/benchmark.py)
# then a table, one row per variant. `--device cpu` runs the same on 2 CPU processes with the demo
# only (part 2 needs CUDA). Needs diffusers importable. Results: one JSON line each in $OUT/results.jsonl.
set -u
DEVICE="${1:-cuda}"
source "$(dirname "$0")/common.sh"
[ "$DEVICE" = cuda ] && nvidia-smi -L
TYPES="${TYPES:-lora dora loha lokr}"  # e.g. TYPES=lokr for one variant
LIMIT=$([ "$DEVICE" = cuda ] && echo 240 || echo 900)  # CPU processes on a busy machine take minutes
for t in $TYPES; do
    log "equivalence demo $t"
    limited "$LIMIT" python3 scripts/check_equivalence.py --num-gpus 2 --batch 4 --steps 5 --launchers torchrun \
        --device "$DEVICE" --config-value training.method=lora --config-value training.lora_type="$t" \
        --config-value training.precision="$([ "$DEVICE" = cuda ] && echo bf16 || echo fp32)" \
        | grep '^{' | sed "s/^{/{\"lora_type\": \"$t\", /" | tee -a "$RES"
done
if [ "$DEVICE" = cuda ]; then
    for t in $TYPES; do
        log "sd15 lora_type $t, 8/GPU, 1 and 2 GPUs"
        limited 300 python3 scripts/benchmark.py --model sd15 --mode lora --batch 8 --gpus 1,2 --steps 20 --warmup 5 \
            --config-value training.lora_type="$t" | grep '^{' | sed "s/^{/{\"lora_type\": \"$t\", /" | tee -a "$RES"
    done
fi
python3 - "$RES" <<'PY'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    t = r.get("lora_type")
    if not t:
        continue
    row = rows.setdefault(t, {})
    if r.get("check") == "equivalence":
        row["equiv"] = f"{r['relative_l2']:.1e} {'ok' if r['ok'] else 'FAIL'}"
    elif "samples_per_s" in r:
        row[f"ips{r['world']}"] = r["samples_per_s"]
        row[f"mem{r['world']}"] = r["max_mem_gib"]
        row["trainable"] = r["trainable"]
print(f"\n{'type':6} {'2x4 vs 1x8 (rel L2)':22} {'img/s 1 GPU':>11} {'img/s 2 GPUs':>12} {'GiB 1':>6} {'GiB 2':>6} {'trainable':>10}")
for t in ("lora", "dora", "loha", "lokr"):
    r = rows.get(t, {})
    print(f"{t:6} {r.get('equiv', '-'):22} {r.get('ips1', '-'):>11} {r.get('ips2', '-'):>12} {r.get('mem1', '-'):>6} "
          f"{r.get('mem2', '-'):>6} {r.get('trainable', '-'):>10}")
PY
