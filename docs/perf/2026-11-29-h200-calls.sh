# The device calls of 2026-11-29 (night, morning, afternoon) on 1x NVIDIA H200 (nvidia-h200, the only kind lent), in order, at
# commit e1ca410 (nightC: e1ca410 with the compile-cache folder chosen at the scripts' start); result lines in
# docs/perf/2026-11-29-h200.jsonl (field "call"). Carried: .bench (these scripts), .whl (the diffusers 0.42.1 wheel).

# ---- call nightA
# #38, call nightA (1x H200): the SDXL job on 1 GPU for 120 steps, uncompiled, then compiled (a cold compile
# cache) started detached (collected by nightB, which then runs it again with the warm cache)
set -u
source scripts/gpu/common.sh
export PYTHONPATH=/tmp/site
T=/tmp/tandem-e2e
log "SDXL job, 1 GPU, 120 steps, uncompiled"
E2E_ARGS="--config-value training.max_steps=120" JOB=sdxl GPUS=1 limited 480 bash scripts/gpu/end_to_end.sh job > $OUT/sdxl-plain.txt 2>&1
tail -n 25 $OUT/sdxl-plain.txt
pgrep -af '[t]rain(_multi_gpu)?\.py' && { log "training processes left"; exit 1; }
log "SDXL job, 1 GPU, 120 steps, compiled (cold cache), detached"
rm -rf ~/.cache/tandem/torchinductor
DETACHED=$T/d-sdxlc1 E2E_ARGS="--config-value training.max_steps=120 --config-value training.compile=true" JOB=sdxl bash scripts/gpu/end_to_end.sh detach cold@.:1:0
sleep 3; cat $T/d-sdxlc1.log; log "call ends"

# ---- call nightB
# (the cold compile was still going after 400 s, so the call ended at the check for training processes left)
# #38, call nightB (1x H200): collect the cold compiled SDXL run, then the same with the warm compile cache
set -u
source scripts/gpu/common.sh
export PYTHONPATH=/tmp/site
T=/tmp/tandem-e2e
DETACHED=$T/d-sdxlc1 JOB=sdxl WAIT=400 bash scripts/gpu/end_to_end.sh collect > $OUT/sdxl-cold.txt 2>&1
tail -n 30 $OUT/sdxl-cold.txt
pgrep -af '[t]rain(_multi_gpu)?\.py' && { log "training processes left"; exit 1; }
log "SDXL job, 1 GPU, 120 steps, compiled (warm cache)"
E2E_ARGS="--config-value training.max_steps=120 --config-value training.compile=true" JOB=sdxl GPUS=1 limited 180 bash scripts/gpu/end_to_end.sh job > $OUT/sdxl-warm.txt 2>&1
tail -n 25 $OUT/sdxl-warm.txt; log "call ends"

# ---- call nightB2: collect the cold compiled run
DETACHED=/tmp/tandem-e2e/d-sdxlc1 JOB=sdxl WAIT=420 bash scripts/gpu/end_to_end.sh collect

# ---- call nightB3: the warm run (killed at 400 s by `limited`, still in its first step after 339 s: the
# compile cache did not serve it; see nightC)
E2E_ARGS="--config-value training.max_steps=120 --config-value training.compile=true" JOB=sdxl GPUS=1 limited 400 bash scripts/gpu/end_to_end.sh job

# ---- call nightC
# #38, call nightC (1x H200): does PyTorch's compile cache serve a second run, with and without gradient
# checkpointing? The demo (tiny SD1-structure UNet) compiled, 2 steps, a fresh HOME; twice each
set -u
source scripts/gpu/common.sh
export PYTHONPATH=/tmp/site HOME=/tmp/h-cc; rm -rf $HOME /tmp/torchinductor_*; mkdir -p $HOME
for gc in true false; do for run in cold warm; do
  log "gc=$gc $run"
  timeout -s KILL 150 python3 scripts/train.py --config-path "#demo" --config-value training.compile=true \
    --config-value training.max_steps=2 --config-value training.gradient_checkpointing=$gc \
    --config-value sampling.every_n_epochs=0 --config-value general.workspace_dir=/tmp/ws-$gc-$run > $OUT/demo-$gc-$run.log 2>&1
  echo "exit $?"; grep -E "compiled and checked|Error|error" $OUT/demo-$gc-$run.log | head -5 | cut -c1-400
done; done
ls $HOME/.cache/tandem/ $HOME/.cache/tandem/torchinductor | head; ls -d /tmp/torchinductor_* 2>&1

# ==== 2026-11-29 morning: the same card (the only kind lent), calls mornI-mornL; result lines in the same
# .jsonl. mornI, mornI2 at a219fb8; mornJ at a219fb8; mornK, mornL at 4ffe1ef (the compile cache's fix for checkpointed
# randomness) before 70e0c45 (the end-to-end script choosing the cache folder)

# ---- call mornI
# #38, call I1 (1x H200): (a) why the compile cache misses a checkpointed denoiser on CUDA: the demo with
# gradient checkpointing, compiled, twice with a fresh HOME, the autograd cache's key details logged (debug);
# (b) the SDXL job without gradient checkpointing, compiled, 120 steps, a cold compile cache, detached
set -u
source scripts/gpu/common.sh
export PYTHONPATH=/tmp/site
T=/tmp/tandem-e2e
( export HOME=/tmp/h-cc; rm -rf $HOME /tmp/torchinductor_*; mkdir -p $HOME
  for run in cold warm; do
    log "demo gc=true $run"
    TORCH_LOGS=+torch._functorch._aot_autograd.autograd_cache,+torch._inductor.codecache timeout -s KILL 150 \
      python3 scripts/train.py --config-path "#demo" --config-value training.compile=true \
      --config-value training.max_steps=2 --config-value training.gradient_checkpointing=true \
      --config-value sampling.every_n_epochs=0 --config-value general.workspace_dir=/tmp/ws-$run > /tmp/demo-$run.log 2>&1
    echo "exit $?"; grep -a -E "compiled and checked|cache hit|cache miss|Bypass" /tmp/demo-$run.log | cut -c1-300 | head -8
    gzip -c /tmp/demo-$run.log > $OUT/demo-$run.log.gz
  done )
log "SDXL job, 1 GPU, 120 steps, compiled, no gradient checkpointing, cold cache, detached"
rm -rf ~/.cache/tandem/torchinductor /tmp/torchinductor_*
TORCH_LOGS=torch._functorch._aot_autograd.autograd_cache DETACHED=$T/d-sdxlng E2E_ARGS="--config-value training.max_steps=120 --config-value training.compile=true --config-value training.gradient_checkpointing=false" JOB=sdxl bash scripts/gpu/end_to_end.sh detach cold@.:1:0
sleep 5; cat $T/d-sdxlng.log
while [ $SECONDS -lt 560 ] && [ ! -e $T/d-sdxlng.done ]; do sleep 5; done
tail -n 5 $T/d-sdxlng.log; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv; log "call ends"

# ---- call mornI2: collect the cold run (line mornI2-collect), then the same with the cache filled: killed by
# `limited 240` before its first step ended; its cache had gone to /tmp (see mornK)
source scripts/gpu/common.sh; export PYTHONPATH=/tmp/site; T=/tmp/tandem-e2e
DETACHED=$T/d-sdxlng JOB=sdxl WAIT=330 bash scripts/gpu/end_to_end.sh collect
TORCH_LOGS=torch._functorch._aot_autograd.autograd_cache E2E_ARGS="--config-value training.max_steps=120 --config-value training.compile=true --config-value training.gradient_checkpointing=false" JOB=sdxl GPUS=1 limited 240 bash scripts/gpu/end_to_end.sh job

# ---- call mornJ: call mornI's first part again - its lines from `set -u` down to `done )` - since its logs had been
# cut at the first binary byte (as mornI ran, they were copied through `grep -v`; the lines above are as mornJ
# ran them). It read "Bypassing FX Graph Cache because 'Can't cache HigherOrderOperator: graphsafe_run_with_rng_state'"

# ---- call mornK
# #38, call K (1x H200): with compile_unet turning off the CUDA-graph-safe form of checkpointed randomness
# (torch 2.11 cannot cache it): (a) the demo with gradient checkpointing, compiled, twice with a fresh HOME;
# (b) the SD1.5 job with gradient checkpointing, compiled, 40 steps, cold then warm compile cache
set -u
source scripts/gpu/common.sh
export PYTHONPATH=/tmp/site TORCH_LOGS=torch._functorch._aot_autograd.autograd_cache,torch._inductor.codecache
( export HOME=/tmp/h-cc; rm -rf $HOME /tmp/torchinductor_*; mkdir -p $HOME
  for run in cold warm; do
    log "demo gc=true $run"
    timeout -s KILL 150 python3 scripts/train.py --config-path "#demo" --config-value training.compile=true \
      --config-value training.max_steps=2 --config-value training.gradient_checkpointing=true \
      --config-value sampling.every_n_epochs=0 --config-value general.workspace_dir=/tmp/ws-$run > /tmp/demo-$run.log 2>&1
    echo "exit $?"; grep -a -E "compiled and checked|cache hit|cache miss|Bypass|Error" /tmp/demo-$run.log | cut -c1-300 | head -8
    gzip -c /tmp/demo-$run.log > $OUT/demo-$run.log.gz
  done )
rm -rf ~/.cache/tandem/torchinductor /tmp/torchinductor_*
for run in cold warm; do
  left=$((585 - SECONDS)); [ $left -gt 60 ] || break
  log "SD1.5 job, gc, compiled, 40 steps, $run (limit $left s)"
  E2E_ARGS="--config-value training.max_steps=40 --config-value training.compile=true --config-value training.gradient_checkpointing=true" \
    JOB=sd15 GPUS=1 limited $left bash scripts/gpu/end_to_end.sh job > $OUT/sd15gc-$run.txt 2>&1
  grep -E "^\| new|^\{" $OUT/sd15gc-$run.txt | cut -c1-300
  grep -a -h -E "compiled and checked|Bypass" -r $OUT/runs 2>/dev/null | cut -c1-300 | tail -3
done
log "call ends"

# ---- call mornL: the SD1.5 job with checkpointing once more, the cache filled by mornK's second run (line mornL)
source scripts/gpu/common.sh; export PYTHONPATH=/tmp/site TORCH_LOGS=torch._functorch._aot_autograd.autograd_cache
E2E_ARGS="--config-value training.max_steps=40 --config-value training.compile=true --config-value training.gradient_checkpointing=true" JOB=sd15 GPUS=1 limited 105 bash scripts/gpu/end_to_end.sh job

# ---- call aftA (afternoon session, commit 08d4ccf; line aftA): the compile cache for the SDXL job filled; the
# checkpointed run beside it was killed at 575 s before its compile ended (two cold compiles at once on 16 cores)
set -u
source scripts/gpu/common.sh
export PYTHONPATH=/tmp/site TORCH_LOGS=torch._functorch._aot_autograd.autograd_cache
rm -rf ~/.cache/tandem/torchinductor /tmp/torchinductor_*
log "SDXL job, compiled, 4 steps: no checkpointing | checkpointing, both on GPU 0, cold cache"
E2E_ARGS="--config-value training.max_steps=4 --config-value training.compile=true --label-config fillng:training.gradient_checkpointing=false --label-config fillgc:training.gradient_checkpointing=true --prompts 0 --sample-every 0" \
  JOB=sdxl limited 575 bash scripts/gpu/end_to_end.sh runs "fillng@.:1:0+fillgc@.:1:0"
grep -a -h -E "compiled and checked|Bypass|autograd cache" -r $OUT/runs 2>/dev/null | cut -c1-250 | tail -8
du -sh ~/.cache/tandem/torchinductor; log "call ends"

# ---- call aftB (line aftB): the warm run; the checkpointed cold compile after it, alone, was killed at 394 s
set -u
source scripts/gpu/common.sh
export PYTHONPATH=/tmp/site TORCH_LOGS=torch._functorch._aot_autograd.autograd_cache
log "SDXL job, compiled, no checkpointing, 120 steps, warm cache"
E2E_ARGS="--config-value training.max_steps=120 --config-value training.compile=true --config-value training.gradient_checkpointing=false" \
  JOB=sdxl GPUS=1 limited 330 bash scripts/gpu/end_to_end.sh job 2>&1 | grep -a -E "^\{|^==" | cut -c1-1500
grep -a -h -E "compiled and checked" -r $OUT/runs 2>/dev/null | cut -c1-250 | tail -3
left=$((590 - SECONDS)); log "SDXL job, compiled, checkpointing, 4 steps, cold (limit $left s)"
E2E_ARGS="--config-value training.max_steps=4 --config-value training.compile=true --config-value training.gradient_checkpointing=true --prompts 0 --sample-every 0" \
  JOB=sdxl GPUS=1 limited $left bash scripts/gpu/end_to_end.sh job 2>&1 | grep -a -E "^\{|^==" | cut -c1-1500
grep -a -h -E "compiled and checked" -r $OUT/runs 2>/dev/null | cut -c1-250 | tail -3
du -sh ~/.cache/tandem/torchinductor; log "call ends"

# ---- call aftC (commit c2aba8d; lines aftC-fill, aftC-warm): its first run (uncompiled) was killed by its 170-s
# limit while the random SD1.5 model and images were being made on the fresh machine, and left no line
set -u
source scripts/gpu/common.sh
export PYTHONPATH=/tmp/site TORCH_LOGS=torch._functorch._aot_autograd.autograd_cache
rm -rf ~/.cache/tandem/torchinductor /tmp/torchinductor_*
log "SD1.5 job, 1 GPU, uncompiled"
JOB=sd15 GPUS=1 limited 170 bash scripts/gpu/end_to_end.sh job 2>&1 | grep -a -E "^\{|^==" | cut -c1-1200
log "SD1.5 job, compiled, 4 steps, cold cache (fills it)"
E2E_ARGS="--config-value training.max_steps=4 --config-value training.compile=true --prompts 0 --sample-every 0" \
  JOB=sd15 GPUS=1 limited 230 bash scripts/gpu/end_to_end.sh job 2>&1 | grep -a -E "^\{|^==" | cut -c1-600
left=$((545 - SECONDS)); log "SD1.5 job, 1 GPU, compiled, cache filled (limit $left s)"
E2E_ARGS="--config-value training.compile=true" JOB=sd15 GPUS=1 limited $left bash scripts/gpu/end_to_end.sh job 2>&1 | grep -a -E "^\{|^==" | cut -c1-1200
grep -a -h -E "compiled and checked" -r $OUT/runs 2>/dev/null | cut -c1-250
log "call ends"

# ---- call lateA (commit a641d84; line lateA): the fill ended inside the call (collect saw it done)
set -u
source scripts/gpu/common.sh
export PYTHONPATH=/tmp/site TORCH_LOGS=torch._functorch._aot_autograd.autograd_cache
rm -rf ~/.cache/tandem/torchinductor /tmp/torchinductor_*
export DETACHED=/tmp/tandem-e2e/d-fillgc JOB=sdxl
E2E_ARGS="--config-value training.max_steps=4 --config-value training.compile=true --config-value training.gradient_checkpointing=true --prompts 0 --sample-every 0" \
  bash scripts/gpu/end_to_end.sh detach fillgc@.:1:0
WAIT=$((585 - SECONDS)) bash scripts/gpu/end_to_end.sh collect 2>&1 | cut -c1-700 | tail -40
grep -a -h -E "compiled and checked" -r $OUT/runs 2>/dev/null | cut -c1-250 | tail -3
du -sh ~/.cache/tandem/torchinductor; log "call ends"

# ---- call lateB (commit a641d84; line lateB): lateA's fill collected, then the job from the filled cache; the
# preamble (set -u, common.sh, PYTHONPATH, TORCH_LOGS) and the greps of the output as in aftB
export DETACHED=/tmp/tandem-e2e/d-fillgc JOB=sdxl
WAIT=420 bash scripts/gpu/end_to_end.sh collect
E2E_ARGS="--config-value training.max_steps=120 --config-value training.compile=true --config-value training.gradient_checkpointing=true" \
  JOB=sdxl GPUS=1 limited $((590 - SECONDS)) bash scripts/gpu/end_to_end.sh job

# ---- call lateC (commit a641d84; lines lateC): does CUDA graphs' replay shorten the SD1.5 LoRA's host-paced
# steps? Uncompiled, compiled, compiled with inductor's CUDA graphs (the setting training.cuda_graphs, added
# after this call, turns on through mode="reduce-overhead"); a cold compile each
set -u
source scripts/gpu/common.sh
export PYTHONPATH=/tmp/site
B="--model sd15 --mode lora --batch 8 --res 512 --gpus 1 --steps 30 --warmup 5"
log "uncompiled"; limited 150 python3 scripts/benchmark.py $B --json $RES 2>&1 | grep -a -v "^{" | tail -4
log "compiled"; limited 260 python3 scripts/benchmark.py $B --config-value training.compile=true --json $RES 2>&1 | grep -a -v "^{" | tail -6
left=$((590 - SECONDS)); log "compiled, CUDA graphs (limit $left s)"
TORCH_LOGS=perf_hints TORCHINDUCTOR_CUDAGRAPHS=1 limited $left python3 scripts/benchmark.py $B --config-value training.compile=true --json $RES 2>&1 \
  | grep -a -v "^{" | cut -c1-400 | tail -30
log "call ends"

# ---- call lateD (the tree of f5486f7 before its compile-cache log line; lines lateD): training.cuda_graphs with
# gradient accumulation 2 and gradient checkpointing (what the SDXL preset uses), against uncompiled
set -u
source scripts/gpu/common.sh
export PYTHONPATH=/tmp/site
B="--model sd15 --mode lora --batch 8 --res 512 --gpus 1 --steps 20 --warmup 3 --gc --config-value training.gradient_accumulation_steps=2"
log "uncompiled"; limited 110 python3 scripts/benchmark.py $B --json $RES 2>&1 | grep -a -v "^{" | tail -5
left=$((SECONDS < 300 ? 420 - SECONDS : 100)); log "compiled, CUDA graphs (limit $left s)"
TORCH_LOGS=perf_hints limited $left python3 scripts/benchmark.py $B --config-value training.compile=true --config-value training.cuda_graphs=true \
  --json $RES 2>&1 | grep -a -v "^{" | grep -a -v "possibly bad tiling" | cut -c1-400 | tail -25
log "call ends"

# ==== 2026-11-29 afternoon: the same card, calls eveA-eveC (commit 0ecdfd6); result lines in the same file

# ---- call eveA (lines eveA: the raw reference, eveA-fill, eveA-job)
set -u
source scripts/gpu/common.sh
export PYTHONPATH=/tmp/site
rm -rf ~/.cache/tandem/torchinductor /tmp/torchinductor_*
log "raw reference, SD1.5 LoRA 8 per GPU, 512 px"
limited 90 bash -c "source scripts/gpu/common.sh; ref 1 --model sd15 --mode lora --batch 8" | cut -c1-600
G="--config-value training.compile=true --config-value training.cuda_graphs=true"
log "fill: the job's first 4 steps, compiled with graphs, cold cache"
E2E_ARGS="$G --config-value training.max_steps=4 --prompts 0 --sample-every 0" \
  JOB=sd15 GPUS=1 limited 380 bash scripts/gpu/end_to_end.sh job 2>&1 | grep -a -E "^\{|^==|rror" | cut -c1-1500
grep -a -h -E "compiled and checked" -r $OUT/runs 2>/dev/null | cut -c1-300 | tail -3
left=$((590 - SECONDS)); log "the SD1.5 job, compiled with graphs, cache filled (limit $left s)"
E2E_ARGS="$G" JOB=sd15 GPUS=1 limited $left bash scripts/gpu/end_to_end.sh job 2>&1 | grep -a -E "^\{|^==|rror" | cut -c1-1500
grep -a -h -E "compiled and checked|CUDA graph" -r $OUT/runs 2>/dev/null | cut -c1-300 | tail -4
du -sh ~/.cache/tandem/torchinductor; log "call ends"

# ---- call eveB (a fresh machine; lines eveB): the folder test for the fill saw the folder the uncompiled run had
# created, so the fill was skipped and the job compiled cold; the uncompiled run was killed by its 200-s limit
# and left no line (making the random model and images and the run itself take longer on a fresh machine: eveC)
set -u
source scripts/gpu/common.sh
export PYTHONPATH=/tmp/site
log "raw reference, SD1.5 LoRA 8 per GPU, 512 px"
limited 90 bash -c "source scripts/gpu/common.sh; ref 1 --model sd15 --mode lora --batch 8" | cut -c1-600
log "the SD1.5 job, uncompiled"
JOB=sd15 GPUS=1 limited 200 bash scripts/gpu/end_to_end.sh job 2>&1 | grep -a -E "^\{|^==|rror" | cut -c1-1500
G="--config-value training.compile=true --config-value training.cuda_graphs=true"
if [ ! -d ~/.cache/tandem/torchinductor ]; then
  log "fill: the job's first 4 steps, compiled with graphs, cold cache"
  E2E_ARGS="$G --config-value training.max_steps=4 --prompts 0 --sample-every 0" \
    JOB=sd15 GPUS=1 limited 250 bash scripts/gpu/end_to_end.sh job 2>&1 | grep -a -E "^\{|^==|rror" | cut -c1-600
fi
left=$((590 - SECONDS)); log "the SD1.5 job, compiled with graphs, cache filled (limit $left s)"
E2E_ARGS="$G" JOB=sd15 GPUS=1 limited $left bash scripts/gpu/end_to_end.sh job 2>&1 | grep -a -E "^\{|^==|rror" | cut -c1-1500
grep -a -h -E "compiled and checked|CUDA graph" -r $OUT/runs 2>/dev/null | cut -c1-300 | tail -4
log "call ends"

# ---- call eveC (a fresh machine; lines eveC): the preamble, the raw reference (limit 80 s) and the uncompiled
# job as in eveB, the job's limit 300 s; then
left=$((590 - SECONDS)); log "launch to first step, complete cache, 8 steps, 1 GPU: fill, then twice from it (limit $left s)"
E2E_ARGS="--shared-cache /tmp/tandem-e2e/shared-cache --config-value training.max_steps=8 --prompts 0 --sample-every 0" \
  JOB=sd15 limited $left bash scripts/gpu/end_to_end.sh runs "fill@.:1:0" "warm@.:1:0" "warm2@.:1:0" 2>&1 | grep -a -E "^\{|^==|rror" | cut -c1-900
log "call ends"

# ---- call eveD (commit 85d97ca, a fresh machine; lines eveD): the start-up's model phase in parts
set -u
source scripts/gpu/common.sh
export PYTHONPATH=/tmp/site
log "launch to first step, complete cache, 8 steps, 1 GPU: fill, then three from it"
E2E_ARGS="--shared-cache /tmp/tandem-e2e/shared-cache --config-value training.max_steps=8 --prompts 0 --sample-every 0" \
  JOB=sd15 limited 400 bash scripts/gpu/end_to_end.sh runs "fill@.:1:0" "warm@.:1:0" "warm2@.:1:0" "warm3@.:1:0" 2>&1 | grep -a -E "^\{|^==|rror" | cut -c1-700
grep -a -h "Start-up" -r $OUT/runs | cut -c1-300
log "call ends"

# ==== 2026-11-29 night session: the same card (nvidia-h200, the only kind lent), calls ngtA-ngtD; lines ngt* in the same
# file. ngtA and ngtB ran the working tree that became commit fa84f28 (ngtB before its hook-registry check, which SD1.5's
# pipeline never meets); ngtC and ngtD that commit's code.

# ---- call ngtA (lines ngtA): diffusers' loading straight onto the GPU, and prompts in one batch
set -u; source scripts/gpu/common.sh; export PYTHONPATH=/tmp/site
python3 scripts/make_random_model.py --type sd1 --out /tmp/tandem-e2e/models/sd15 --device cuda
limited 400 python3 scripts/gpu/pipeline_ab.py all /tmp/tandem-e2e/models/sd15
limited 90 bash -c "source scripts/gpu/common.sh; ref 1 --model sd15 --mode lora --batch 8" | cut -c1-600

# ---- call ngtB (lines ngtB): the GPU tests of sample graphs, then the job's samplings without | with graphs
# (pytest and its wheels carried in .whl/ beside diffusers')
set -u; source scripts/gpu/common.sh; export PYTHONPATH=/tmp/site
limited 240 python3 -m pytest -q -p no:cacheprovider tests/test_sample_graphs.py 2>&1 | tail -25
E2E_ARGS="--shared-cache /tmp/tandem-e2e/shared-cache --epochs 2 --sample-every 1 --prompts 4 --label-config plain:sampling.cuda_graphs=false --label-config plain2:sampling.cuda_graphs=false" \
  JOB=sd15 limited 330 bash scripts/gpu/end_to_end.sh runs "plain@.:1:0" "graphs@.:1:0" "plain2@.:1:0" "graphs2@.:1:0" 2>&1 | grep -a -E "^\{|^==|rror" | cut -c1-600
grep -a -h -E "Samples at step|replay the denoiser|without CUDA graphs" -r $OUT/runs | cut -c1-400
limited 90 bash -c "source scripts/gpu/common.sh; ref 1 --model sd15 --mode lora --batch 8" | cut -c1-600

# ---- call ngtC (lines ngtC: the raw reference, ngtC-fill, ngtC-job): the GPU tests again, then the SD1.5 job compiled
# with training graphs and sample graphs (the default), compile cache filled first
set -u; source scripts/gpu/common.sh; export PYTHONPATH=/tmp/site
rm -rf ~/.cache/tandem/torchinductor /tmp/torchinductor_*
limited 150 python3 -m pytest -q -p no:cacheprovider tests/test_sample_graphs.py 2>&1 | tail -6
limited 90 bash -c "source scripts/gpu/common.sh; ref 1 --model sd15 --mode lora --batch 8" | cut -c1-600
G="--config-value training.compile=true --config-value training.cuda_graphs=true"
E2E_ARGS="$G --config-value training.max_steps=4 --prompts 0 --sample-every 0" \
  JOB=sd15 GPUS=1 limited 330 bash scripts/gpu/end_to_end.sh job 2>&1 | grep -a -E "^\{|^==|rror" | cut -c1-300
left=$((590 - SECONDS))
E2E_ARGS="$G" JOB=sd15 GPUS=1 limited $left bash scripts/gpu/end_to_end.sh job 2>&1 | grep -a -E "^\{|^==|rror" | cut -c1-2500
grep -a -h -E "compiled and checked|Samples at step|replay the denoiser|without CUDA graphs" -r $OUT/runs | cut -c1-300 | tail -8

# ---- call ngtD (the same lease): why Chroma's demo sampled without graphs in ngtC's tests (the test now expects it)
source scripts/gpu/common.sh >/dev/null; export PYTHONPATH=/tmp/site
python3 -m pytest -q -p no:cacheprovider "tests/test_sample_graphs.py::test_samples_with_graphs_are_the_samples_without[builtin:demo-chroma]"

# ---- call ngtE (commit fa84f28 with the test's Chroma expectation; a fresh machine): 11 passed, all 8 demo families
source scripts/gpu/common.sh >/dev/null; export PYTHONPATH=/tmp/site
python3 -m pytest -q -p no:cacheprovider tests/test_sample_graphs.py 2>&1 | tail -3
