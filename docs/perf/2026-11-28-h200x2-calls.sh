# The device calls of 2026-11-28 on 2x NVIDIA H200 (nvidia-h200-x2), in order; result lines in
# docs/perf/2026-11-28-h200x2.jsonl (field "call"). Commit 'da0c537' + the flux2dev1 part of families.sh.

# ---- call flux2dev1
bash scripts/gpu/families.sh flux2dev1

# ---- call text+sd15job (.bench/call2.sh)
# #34 text-encoder table (qwen_zimage.sh text), then #38 the SD1.5 job on 1 and 2 GPUs (this tree, one at a time)
set -u
source scripts/gpu/common.sh
export OUT
START=$(date +%s)
timeout -k 5 -s KILL 240 bash scripts/gpu/qwen_zimage.sh text 2>&1 | grep -v "^\s*$" | tail -25
log "text done after $(( $(date +%s) - START )) s"
E2E=.bench/e2e
timeout -k 5 -s KILL $(( 575 - ($(date +%s) - START) )) python3 scripts/end_to_end.py --base-model "$E2E/sd15" --make-model sd1 --data "$E2E/images" --make-data 512 \
   --json "$OUTDIR/e2e.jsonl" --run "new@.:1:0" --run "new@.:2:0,1" 2>&1 | tail -30
log "e2e done after $(( $(date +%s) - START )) s"

# ---- call shortsteps (.bench/call3.sh)
# #38 short steps: SD1.5 LoRA r16 512 px batch 8 per GPU, uncompiled: reference 1 and 2 GPUs, Tandem 1,2 with a profile
set -u
source scripts/gpu/common.sh
export OUT
C="--model sd15 --mode lora --batch 8 --res 512 --steps 60 --warmup 10"
ref 1 $C
ref 2 $C
mkdir -p "$OUTDIR/prof"
timeout -k 5 -s KILL 300 python3 scripts/benchmark.py $C --gpus 1,2 --profile "$OUTDIR/prof" --profile-steps 5 --json "$RES" 2>&1 | grep -v '^{' | tail -20

# ---- later calls: the spawn launcher's forkserver (commit 5689210; the last with stop_forkserver killing the server)
# call forkserver-1gpu-check (1x H200): scripts/benchmark.py --model sd15 --mode lora --batch 8 --res 512 --steps 20 --warmup 5 --gpus 1 --repeat 2
# call forkserver-benchmark-2-then-1: scripts/benchmark.py --model sd15 --mode lora --batch 8 --res 512 --steps 10 --warmup 3 --gpus 2,1
# call forkserver-launch (.bench/baseline = git archive 6badf99, spawned workers):
E2E=.bench/e2e
e2e() { python3 scripts/end_to_end.py --base-model "$E2E/sd15" --make-model sd1 --data "$E2E/images" --make-data 512 --json "$OUTDIR/e2e.jsonl" "$@"; }
rm -rf /tmp/tandem-e2e/shared-cache
S=(--shared-cache /tmp/tandem-e2e/shared-cache --config-value training.max_steps=8 --prompts 0 --sample-every 0 --config-value multi_gpu.launcher=spawn)
e2e "${S[@]}" --run "fill@.:1:0" --run "spawned@.bench/baseline:2:0,1" --run "forkserver@.:2:0,1" \
   --run "spawned@.bench/baseline:2:0,1" --run "forkserver@.:2:0,1" 2>&1 | tail -12
nvidia-smi --query-gpu=index,memory.used --format=csv
# call forkserver-killed-at-end:
E2E=.bench/e2e
S=(--shared-cache /tmp/tandem-e2e/shared-cache --config-value training.max_steps=8 --prompts 0 --sample-every 0 --config-value multi_gpu.launcher=spawn)
python3 scripts/end_to_end.py --base-model "$E2E/sd15" --make-model sd1 --data "$E2E/images" --make-data 512 --json "$OUTDIR/e2e.jsonl" "${S[@]}" \
  --run "fill@.:1:0" --run "forkserver@.:2:0,1" --run "spawned@.bench/baseline:2:0,1" --run "forkserver@.:2:0,1" 2>&1 | tail -5

# ---- call sdxljob (a later session, 13:08-13:36; tree e732655 + the end-to-end jobs of scripts/end_to_end.py)
# #38 the SDXL LoRA job on 1 GPU then 2 GPUs, each alone on the host; the 1-GPU run (965 s) outlasts a 10-minute
# call, so each run is detached and the next call collects it
JOB=sdxl bash scripts/gpu/end_to_end.sh detach new@.:1:0; WAIT=555 JOB=sdxl bash scripts/gpu/end_to_end.sh collect
WAIT=500 JOB=sdxl bash scripts/gpu/end_to_end.sh collect && JOB=sdxl bash scripts/gpu/end_to_end.sh detach new@.:2:0,1
WAIT=520 JOB=sdxl bash scripts/gpu/end_to_end.sh collect
