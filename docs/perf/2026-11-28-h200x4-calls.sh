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
