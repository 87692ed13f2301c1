# The device calls of 2026-11-29 (night) on 1x NVIDIA H200 (nvidia-h200, the only kind lent), in order, at
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
