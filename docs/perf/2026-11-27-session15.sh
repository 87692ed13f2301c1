#!/usr/bin/env bash
# Session 15, 4x H100. Carry [".whl", ".bench"]. Parts: I (imports on this host), X (cold compile, exit),
# U (uncompiled LoRA job alone on 1, 2, 4 GPUs), R (LoRA 8/GPU scaling round beside the raw reference),
# K (compiled job on 1 GPU, then the compiled benchmark). Several parts per call: bash .bench/s15.sh I X
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
source scripts/gpu/common.sh
mkdir -p "$OUT/logs"
keep_logs() { tar -czf "$OUT/logs/e2e-logs-$1.tgz" -C /tmp/tandem-e2e $(cd /tmp/tandem-e2e && ls *.log) 2>/dev/null; true; }
show() { grep -E "^==|^\||Error|Traceback|^ *[0-9]+ GPU" | cut -c1-400; }
E2E=/tmp/e2e-data
E2EPY=(python3 scripts/end_to_end.py --base-model "$E2E/sd15" --make-model sd1 --data "$E2E/images" --make-data 512 --json "$RES")
C=(--label-config "c1:training.compile=true" --label-config "c2:training.compile=true" --label-config "c4:training.compile=true")
IMPORTS="import torch; import modules.distributed.launch; import modules.distributed.distributed_trainer, modules.trainer.callbacks, modules.model.loading; from diffusers import UNet2DConditionModel, AutoencoderKL; from transformers import CLIPTextModel"
parts() { grep -h "Start-up\|compiled and checked\|Trained\|sample" /tmp/tandem-e2e/$1*.log | grep -v '@tandem' | cut -c1-330 | head -${2:-40}; }
nvidia-smi -L
for part in "$@"; do case "$part" in
I) log "host facts and imports"
   { nproc; lscpu | grep -E "Model name|MHz|Thread|Socket"; python3 -VV; df -hT / /tmp /usr 2>&1; mount | grep -E " / | /tmp | /usr" ;
     python3 -c "import sys, os; [print(p, len(os.listdir(p)) if os.path.isdir(p) else '-') for p in sys.path]";
     python3 -c "import time; t=time.perf_counter(); sum(i*i for i in range(10**7)); print('python loop', round(time.perf_counter()-t, 2), 's')";
     python3 -c "import importlib.metadata as m, time; t=time.perf_counter(); n=len(list(m.distributions())); print('distributions', n, round(time.perf_counter()-t, 2), 's')"; } > "$OUT/host.txt" 2>&1
   cat "$OUT/host.txt"
   for i in 1 2; do TIMEFORMAT="imports run $i: %R s wall, %U s user, %S s sys"; time python3 -X importtime -c "$IMPORTS" 2> "$OUT/importtime$i.txt"; done
   python3 - "$IMPORTS" > "$OUT/cprofile.txt" 2>&1 <<'PY'
import cProfile, pstats, sys, io, time
t = time.perf_counter()
pr = cProfile.Profile(); pr.enable(); exec(sys.argv[1]); pr.disable()
print("profiled imports", round(time.perf_counter() - t, 2), "s")
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(45); print(s.getvalue())
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(60); print(s.getvalue())
PY
   head -60 "$OUT/cprofile.txt" | cut -c1-200
   sort -t'|' -k2 -n -r "$OUT/importtime2.txt" | head -40
   echo "self-time top:"; sort -t'|' -k1.13 -n -r "$OUT/importtime2.txt" | head -25 ;;
X) log "cold compile (fresh machine's cache), 2 GPUs, 6 steps: done to exit (cff0fa7)"
   limited 330 "${E2EPY[@]}" "${C[@]}" --epochs 1 --prompts 0 --sample-every 0 --config-value training.max_steps=6 --run "c2@.:2:0,1" | show
   parts c2; keep_logs X ;;
U) log "uncompiled LoRA job (10 epochs, 4 prompts every 5) alone on 1, 2, 4 GPUs"
   limited 560 "${E2EPY[@]}" --run "u@.:1:0" --run "u@.:2:0,1" --run "u@.:4:0,1,2,3" | show
   parts u 60; keep_logs U ;;
R) log "LoRA 8/GPU uncompiled: raw reference and Tandem on 1 and 2 GPUs"
   limited 100 bash -c "source scripts/gpu/common.sh; ref 1 --model sd15 --mode lora --batch 8; ref 2 --model sd15 --mode lora --batch 8" | cut -c1-300
   limited 200 python3 scripts/benchmark.py --model sd15 --mode lora --batch 8 --gpus 1,2 --json "$RES" | grep -E "^\||Error" | cut -c1-300 ;;
K) log "compiled job on 1, 2, 4 GPUs (warm cache), then the compiled benchmark on 1 GPU"
   limited 420 "${E2EPY[@]}" "${C[@]}" --run "c1@.:1:0" --run "c2@.:2:0,1" --run "c4@.:4:0,1,2,3" | show
   parts c 60; keep_logs K
   limited 150 python3 scripts/benchmark.py --model sd15 --mode lora --batch 8 --gpus 1 --config-value training.compile=true --json "$RES" | grep -E "^\||Error" | cut -c1-300 ;;
esac; done
cp "$RES" "$OUT/" 2>/dev/null; true
for part in "$@"; do case "$part" in
L) log "launch to first step, complete cache, 8 steps: bytecode cache off (1, 4 GPUs), then on: fill (4 GPUs), 1 GPU, 4 GPUs (image: PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset})"
   rm -rf /tmp/tandem-e2e/shared-cache ~/.cache/tandem/bytecode
   S=(--shared-cache /tmp/tandem-e2e/shared-cache --config-value training.max_steps=8 --prompts 0 --sample-every 0)
   TANDEM_BYTECODE_CACHE=off limited 200 "${E2EPY[@]}" "${S[@]}" --run "fill@.:1:0" --run "off@.:1:0" --run "off@.:4:0,1,2,3" | show
   limited 200 "${E2EPY[@]}" "${S[@]}" --run "fillbc@.:4:0,1,2,3" --run "on@.:1:0" --run "on@.:4:0,1,2,3" | show
   parts off; parts fillbc; parts on; keep_logs L
   echo "bytecode cache: $(find ~/.cache/tandem/bytecode -name '*.pyc' | wc -l) files, $(du -sh ~/.cache/tandem/bytecode | cut -f1)" ;;
esac; done
# Calls (one 4x H100 machine for calls 1-4, a fresh one for call 5; tree = main c520c9d for calls 1-4, cff3bc2 for call 5):
#   1: bash .bench/s15.sh I X                     (the image's default: PYTHONDONTWRITEBYTECODE=1, packages without bytecode)
#   2: bash .bench/s15.sh U
#   3: unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc; bash .bench/s15.sh I U R
#   4: (same two variables, /tmp/pyc as call 3 left it) bash .bench/s15.sh K
#   5: bash .bench/s15.sh L                       (the image's default again; the bytecode cache of cff3bc2)
# .bench/raw_ddp_reference.py = ../shared/bench/raw_ddp_reference.py; .whl = diffusers-0.42.1-py3-none-any.whl.
