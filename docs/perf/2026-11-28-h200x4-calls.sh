# The device calls of 2026-11-28 (evening) on 4x NVIDIA H200 (nvidia-h200-x4), in order, at commit 6036a74;
# result lines in docs/perf/2026-11-28-h200x4.jsonl (field "call"). Carried: .bench (these scripts), .whl
# (the diffusers 0.42.1 wheel).

# ---- call callA
# #38: the Flux.1-size job on 1 GPU (GPU 0) beside 2 GPUs (1,2), detached (they outlast a call); the SD1.5 job
# on 1 GPU (GPU 3) meanwhile.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD"
JOB=flux bash scripts/gpu/end_to_end.sh detach "new@.:1:0+new@.:2:1,2"
JOB=sd15 bash scripts/gpu/end_to_end.sh runs "new@.:1:3"

# ---- call callB
# wait for the Flux job's 2-GPU line, then the SD1.5 job on 2 GPUs (1,2) beside the Flux 1-GPU run
while ! grep -q '"gpus": 2' /tmp/tandem-e2e/detached.jsonl; do sleep 2; done
JOB=sd15 bash scripts/gpu/end_to_end.sh runs "new@.:2:1,2"

# ---- call callC
# collect the Flux runs; then the Flux job on 4 GPUs and the SD1.5 job on 4 GPUs - both were stopped by this
# call's time limit (a limit too short for the Flux run, 265 s), so no line of theirs is kept
WAIT=300 JOB=flux bash scripts/gpu/end_to_end.sh collect
JOB=flux GPUS=4 bash scripts/gpu/end_to_end.sh job
JOB=sd15 GPUS=4 bash scripts/gpu/end_to_end.sh job

# ---- call flux4
# the Flux job on 4 GPUs, alone on the host
JOB=flux GPUS=4 bash scripts/gpu/end_to_end.sh job

# ==== the night session (18:29-18:58), another lease of nvidia-h200-x4, at commit 862af73 (the code of 036d6a7:
# samples from the kept prompt embeddings, the encoders back onto their host copies). `log` and the install
# come from scripts/gpu/common.sh; T=/tmp/tandem-e2e.

# ---- call nightA
# the Flux job on 1 GPU (GPU 0) and the SDXL job on 1 GPU (GPU 1), detached; once both train, the SD1.5 job on
# 1 GPU (GPU 2) and on 2 GPUs (2,3) beside them; then the SDXL job on 2 GPUs (2,3), detached - that run ended
# after 13 s: its workers started while the next call was replacing the working tree (end_to_end.sh's detach
# now starts runs from a snapshot of the tree, cbda7cc)
DETACHED=$T/d-flux1 JOB=flux bash scripts/gpu/end_to_end.sh detach new@.:1:0
DETACHED=$T/d-sdxl1 JOB=sdxl bash scripts/gpu/end_to_end.sh detach new@.:1:1
for i in $(seq 330); do   # until both have made their first step
  [ "$(grep -l '^ *[0-9.]* First step: ' $T/new-1gpu-*.log 2>/dev/null | wc -l)" -ge 2 ] && break; sleep 1
done
JOB=sd15 bash scripts/gpu/end_to_end.sh runs "new@.:1:2"
JOB=sd15 bash scripts/gpu/end_to_end.sh runs "new@.:2:2,3"
DETACHED=$T/d-sdxl2 JOB=sdxl bash scripts/gpu/end_to_end.sh detach new@.:2:2,3

# ---- call nightB
WAIT=575 DETACHED=$T/d-flux1 JOB=flux bash scripts/gpu/end_to_end.sh collect

# ---- call nightC
# the SDXL 1-GPU run was still going after 150 s (its line came in call nightD); the Flux job on 4 GPUs started
# after it had ended (no training process left), alone on the host
WAIT=150 DETACHED=$T/d-sdxl1 JOB=sdxl bash scripts/gpu/end_to_end.sh collect
WAIT=150 DETACHED=$T/d-sdxl2 JOB=sdxl bash scripts/gpu/end_to_end.sh collect
pgrep -af '[t]rain(_multi_gpu)?\.py' && exit 1
JOB=flux GPUS=4 bash scripts/gpu/end_to_end.sh job

# ---- call nightD
cp $T/d-*.jsonl $T/d-*.log $OUT/

# ---- call nightE
# the SD1.5 job on 4 GPUs, alone on the host (the session's device time was then spent)
JOB=sd15 GPUS=4 bash scripts/gpu/end_to_end.sh job

# ==== the day session (2026-11-28, 20:58-21:22), another lease of nvidia-h200-x4, at commit 8e4413d. The
# random models and images are made by the first run of each job on the machine (scripts/end_to_end.py
# --make-model --make-data), outside the timed runs.

# ---- call dayA
# the Flux.1-size job on 4 GPUs for 60 steps with steps 40-44 profiled on every rank; the SD1.5 job on 1, then
# 2 GPUs, each alone on the host; then the SDXL job on 2 GPUs (0,1), detached. The call reached its 600-s limit
# while the SDXL run was making its model; the run went on and dayB collected it.
source scripts/gpu/common.sh; export PYTHONPATH=/tmp/site; T=/tmp/tandem-e2e
TANDEM_PROFILE_STEPS=40:5 E2E_ARGS="--config-value training.max_steps=60" JOB=flux GPUS=4 limited 250 bash scripts/gpu/end_to_end.sh job
JOB=sd15 GPUS="1 2" limited 290 bash scripts/gpu/end_to_end.sh job
DETACHED=$T/d-sdxl2 JOB=sdxl bash scripts/gpu/end_to_end.sh detach new@.:2:0,1

# ---- call dayB
WAIT=575 DETACHED=$T/d-sdxl2 JOB=sdxl bash scripts/gpu/end_to_end.sh collect

# ---- call dayC
# the SDXL job on 4 GPUs, alone on the host (no training process left from dayB)
pgrep -af '[t]rain(_multi_gpu)?\.py' && exit 1
JOB=sdxl GPUS=4 limited 480 bash scripts/gpu/end_to_end.sh job
