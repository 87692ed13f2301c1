#!/usr/bin/env bash
# Session 14, 4x H100. Carry [".whl", ".bench"]. Parts chained on one warm machine: A1 A2 C B.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
source scripts/gpu/common.sh
keep_logs() { mkdir -p "$OUT/logs"; cp /tmp/tandem-e2e/*.log "$OUT/logs/" 2>/dev/null; true; }
show() { grep -E "^==|^\{|Error|Traceback" | cut -c1-1200; }
E2E=/tmp/e2e-data
E2EPY=(python3 scripts/end_to_end.py --base-model "$E2E/sd15" --make-model sd1 --data "$E2E/images" --make-data 512 --json "$RES")
C=(--label-config "c1:training.compile=true" --label-config "c2:training.compile=true" --label-config "c4:training.compile=true")
FULL=(--epochs 3 --prompts 0 --sample-every 0 --config-value training.method=full)
case "$1" in
A1) log "NCCL with one GPU per worker: full fine-tune 8/GPU 2 GPUs, branch one-gpu-per-worker on 0,1 | main on 2,3, at once"
   (cd .bench/onegpu && CUDA_VISIBLE_DEVICES=0,1 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT limited 170 python3 scripts/benchmark.py --model sd15 --mode full --batch 8 --gpus 2 \
        --json "$RES" > /tmp/a1-branch.log 2>&1) &
   (CUDA_VISIBLE_DEVICES=2,3 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT limited 170 python3 scripts/benchmark.py --model sd15 --mode full --batch 8 --gpus 2 --json "$RES" > /tmp/a1-main.log 2>&1)
   wait
   for v in branch main; do grep -E "^\||Error|Duplicate" /tmp/a1-$v.log | sed "s/^/$v: /" | cut -c1-300
     echo "$v transports:"; grep -oE "via [A-Za-z/]+" /tmp/a1-$v.log | sort | uniq -c; done
   limited 100 bash -c "source scripts/gpu/common.sh; ref 2 --model sd15 --mode full --batch 8"
   log "prepare the model and data"; limited 200 "${E2EPY[@]}" --epochs 1 --prompts 0 --sample-every 0 --config-value training.max_steps=1 --run "prep@.:1:0" | show ;;
A2) log "branch one-gpu-per-worker: compiled LoRA job, 2 GPUs cold (1 epoch), then 4 GPUs (1 epoch): ranks 2,3 should hit the cache"
   limited 400 "${E2EPY[@]}" "${C[@]}" --epochs 1 --prompts 0 --sample-every 0 --run "c2@.bench/onegpu:2:0,1" --run "c4@.bench/onegpu:4:0,1,2,3" | show
   grep -h "compiled and checked\|training.compile:" /tmp/tandem-e2e/c*.log | cut -c1-300
   keep_logs ;;
C) log "backups' pinned memory: full fine-tune 2 GPUs 3 epochs, branch release-pinned-at-end on 0,1 | main on 2,3, at once"
   limited 260 "${E2EPY[@]}" "${FULL[@]}" --run "release@.bench/release:2:0,1+main@.:2:2,3" | show
   grep -h "Backup\|Released\|First step" /tmp/tandem-e2e/{release,main}*.log | cut -c1-220
   keep_logs ;;
B) log "one-gpu-per-worker: the compiled LoRA job (10 epochs, 4 prompts) alone on 1, 2, 4 GPUs, warm cache"
   limited 560 "${E2EPY[@]}" "${C[@]}" --run "c1@.bench/onegpu:1:0" --run "c2@.bench/onegpu:2:0,1" --run "c4@.bench/onegpu:4:0,1,2,3" | show
   grep -h "compiled and checked" /tmp/tandem-e2e/c*.log | cut -c1-300
   keep_logs ;;
esac
python3 .bench/summary.py
case "$1" in
D) log "what lingers after done: compiled LoRA 2 GPUs, cold cache (fresh TORCHINDUCTOR_CACHE_DIR), 1 epoch; ps every 0.2 s"
   ( while true; do echo "@ $(date +%s.%N)"; ps -eo pid,ppid,pgid,stat,etimes,rss,comm --sort=pid | grep -vE " (ps|grep|sleep|bash|date|timeout)$" | awk '$6 > 50000'; sleep 0.2; done ) > /tmp/ps.log 2>&1 &
   PSL=$!
   TORCHINDUCTOR_CACHE_DIR=/tmp/ind-cold-d limited 300 "${E2EPY[@]}" "${C[@]}" --epochs 1 --prompts 0 --sample-every 0 --run "c2@.:2:0,1" | show
   kill $PSL
   d=$(grep -l '"type": "done"' /tmp/tandem-e2e/c2-2gpu-*.log | tail -1); echo "log $d"; tail -2 "$d" | cut -c1-120
   python3 - "$d" <<'PY'
import sys, re, time
log = sys.argv[1]
# the done line's wall time: the log's first column counts seconds from the harness start, recorded in the JSON
lines = open("/tmp/ps.log").read().split("@ ")[1:]
snaps = [(float(s.split("\n",1)[0]), s.split("\n",1)[1]) for s in lines]
# print the snapshots from 6 s before the last python-free snapshot
last_py = max(i for i,(t,s) in enumerate(snaps) if "python" in s or "pt_main" in s)
for t, s in snaps[max(0,last_py-30):last_py+2]:
    procs = [l.split() for l in s.strip().splitlines() if l.strip() and not l.strip().startswith("PID")]
    print(f"{t:.2f}", len(procs), " ".join(f"{p[0]}:{p[6]}:{int(p[5])//1024}M:{p[3]}" for p in procs)[:600])
PY
   mkdir -p "$OUT"; cp /tmp/ps.log "$OUT/"; keep_logs ;;
esac
# Calls 7-8 (1x H100): .bench/imports.sh (timed out: `bc` missing, 15 slow imports), then:
#   P='import time; s=time.perf_counter(); import torch; a=time.perf_counter(); from diffusers import UNet2DConditionModel, AutoencoderKL; b=time.perf_counter(); print(f"torch {a-s:.2f} s, diffusers after it {b-a:.2f} s")'
#   python3 -c "$P"; python3 -c "$P"; python3 -m compileall -q -j 16 /tmp/site/diffusers; python3 -c "$P"; python3 -c "$P"
# Trees: . = main 8e22d7c; .bench/onegpu = one-gpu-per-worker 484a5c6; .bench/release = release-pinned-at-end cf4bbbf
# (each exported with `git archive <commit> | tar -x -C .bench/<name>`); .bench/raw_ddp_reference.py = ../shared/bench/raw_ddp_reference.py.
# Order on the machine: A1, A2, C (round 1: release on GPUs 0,1), B, C (round 2, after the sed that swaps the GPUs), D.
