# The device calls of 2026-12-02 on 1x NVIDIA H200 (nvidia-h200) for issue 56 (layer offload, the one-GPU plan), at commit
# 4d26914; result lines in docs/perf/2026-12-02-h200-offload.jsonl. Carried: .bench (these scripts, raw_ddp_reference.py), .whl
# (diffusers 0.42.1). Each call began: pip install the wheel into /tmp/site; export PYTHONPATH=/tmp/site NCCL_NVLS_ENABLE=0 ...

# ---- call 1: the raw reference, 1 GPU
python3 .bench/raw_ddp_reference.py --model qwen --mode lora --gc --batch 1 --res 1024 --steps 6 --warmup 3

# ---- call 2: .bench/offload_a.sh
# issue 56, call A (1x H200): Qwen-Image LoRA 1024 px, batch 1, checkpointing: auto held to 24 and 16 GiB;
# layer offload of 30 of 60 blocks against none (uncapped); the raw reference, 1 GPU.
set -u
B="python3 scripts/benchmark.py --model qwen --mode lora --gc --batch 1 --res 1024 --gpus 1 --steps 6 --warmup 3 --json $OUT/a.jsonl"
for args in "multi_gpu.memory_limit_gib=24" "multi_gpu.memory_limit_gib=16" "multi_gpu.layer_offload=30" "multi_gpu.layer_offload=off"; do
  echo "=== $args $(date +%T)"
  timeout 170 $B --config-value $args > $OUT/a-${args//[^a-z0-9]/_}.txt 2>&1; echo "rc $?"
  grep -E "Memory plan|Layer offload|First step|Traceback|Error|out of memory" $OUT/a-${args//[^a-z0-9]/_}.txt | cut -c1-600 | head -8
  tail -n 3 $OUT/a-${args//[^a-z0-9]/_}.txt | cut -c1-300
done
cat $OUT/a.jsonl | python3 -c "import sys,json; [print({k: r.get(k) for k in ('extra','plan','plan_changes','layer_offload_blocks','samples_per_s','step_s','max_mem_gib','estimated_peak_gib','setup_peak_gib')}) for r in map(json.loads, sys.stdin)]"

# ---- call 3: .bench/offload_b.sh, first as is (out of memory before the first step: 9.0 GiB reserved but
# unallocated), then again with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the figure in the docs)
# issue 56, call B (1x H200): Flux.2-dev LoRA 1024 px, batch 1, checkpointing, auto held to 24 GiB.
set -u
echo "=== flux2 1x24 $(date +%T)"
timeout 400 python3 scripts/benchmark.py --model flux2 --mode lora --gc --batch 1 --res 1024 --gpus 1 --steps 5 --warmup 2 --json $OUT/b.jsonl --config-value multi_gpu.memory_limit_gib=24 > $OUT/b-flux2-24.txt 2>&1; echo "rc $?"
grep -E "Memory plan|Layer offload|First step|Traceback|Error|out of memory" $OUT/b-flux2-24.txt | cut -c1-700 | head -8
tail -n 3 $OUT/b-flux2-24.txt | cut -c1-300
cat $OUT/b.jsonl | python3 -c "import sys,json; [print({k: r.get(k) for k in ('extra','plan','plan_changes','layer_offload_blocks','samples_per_s','step_s','max_mem_gib','estimated_peak_gib','setup_peak_gib')}) for r in map(json.loads, sys.stdin)]"

# ---- call 4 (after layer offload asks for expandable segments itself): .bench/offload_c.sh, no allocator
# variable set; Flux.2-dev LoRA 1024 px, 1x24: fp8 base + 33 of 56 blocks, 0.40 img/s, peak 18.64 GiB.
# The raw reference (uncapped, same call as the earlier try): 0.45 img/s at 66.21 GiB.
set -u
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF
timeout 330 python3 scripts/benchmark.py --model flux2 --mode lora --gc --batch 1 --res 1024 --gpus 1 --steps 5 --warmup 2 --json $OUT/c.jsonl --config-value multi_gpu.memory_limit_gib=24
timeout 200 python3 .bench/raw_ddp_reference.py --model flux2 --mode lora --gc --batch 1 --res 1024 --steps 5 --warmup 2

# ---- call 5 (.bench/offload_d.sh): Wan 2.1 14B at 24 GiB before activation offloading existed for one process: refused
# (nothing fits: ~26.1 GiB with every block swapped, activations 23.4); the raw reference after, uncapped:
# {"model": "wan14", "res": 640, "frames": 81, "step_s": 19.3628, "samples_per_s": 0.05, "max_mem_gib": 51.08}
set -u
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF
echo "=== wan-14b 1x24 $(date +%T)"
timeout 370 python3 scripts/benchmark.py --model wan-14b --mode lora --gc --batch 1 --res 640 --gpus 1 --steps 3 --warmup 1 --json $OUT/d.jsonl --config-value multi_gpu.memory_limit_gib=24 --config-value data.video_frames=81 > $OUT/d-wan14-24.txt 2>&1; echo "rc $?"
grep -E "Memory plan|Layer offload|First step|Traceback|Error|out of memory" $OUT/d-wan14-24.txt | cut -c1-700 | head -8
tail -n 3 $OUT/d-wan14-24.txt | cut -c1-300
cat $OUT/d.jsonl | python3 -c "import sys,json; [print({k: r.get(k) for k in ('extra','plan','plan_changes','layer_offload_blocks','samples_per_s','step_s','max_mem_gib','estimated_peak_gib','setup_peak_gib')}) for r in map(json.loads, sys.stdin)]"
echo "=== raw reference wan14 640 $(date +%T)"
timeout 190 python3 .bench/raw_ddp_reference.py --model wan14 --mode lora --gc --batch 1 --res 640 --frames 81 --steps 3 --warmup 1 2>&1 | tail -n 2 | cut -c1-400

# ---- call 6 (.bench/call_e.sh): Wan 2.1 14B at 24 GiB with activation offloading planned, then Lumina 2 LoRA and its reference
set -u
T0=$(date +%s)
source scripts/gpu/common.sh
RES=$OUT/results.jsonl
log "wan14 1x24"
limited 400 python3 scripts/benchmark.py --model wan-14b --mode lora --gc --batch 1 --res 640 --gpus 1 --steps 3 --warmup 1 \
   --config-value multi_gpu.memory_limit_gib=24 --config-value data.video_frames=81 --json $RES > $OUT/wan14.txt 2>&1; echo "rc $?"
grep -E "Memory plan|Layer offload|Activation offloading|host memory|First step|Traceback|Error|out of memory" $OUT/wan14.txt | cut -c1-600 | head -12
tail -n 2 $OUT/wan14.txt | cut -c1-300
left=$(( 560 - ($(date +%s) - T0) ))
log "time left $left s"
if [ $left -gt 150 ]; then
  limited $(( left - 70 )) python3 scripts/benchmark.py --model lumina2 --mode lora --gc --batch 1 --res 1024 --gpus 1 --steps 6 --warmup 3 --json $RES > $OUT/lumina2.txt 2>&1; echo "rc $?"
  tail -n 2 $OUT/lumina2.txt | cut -c1-300
  left=$(( 570 - ($(date +%s) - T0) ))
  [ $left -gt 30 ] && limited $left python3 .bench/raw_ddp_reference_lumina2.py --model lumina2 --mode lora --gc --batch 1 --res 1024 --steps 6 --warmup 3 | grep '^{' | tee -a $RES
fi
python3 -c "
import json
for l in open('$RES'):
    r=json.loads(l); print({k: r.get(k) for k in ('source','case','model','plan','plan_changes','samples_per_s','step_s','max_mem_gib','host')})
"

# ---- call 7 (.bench/call_f.sh): Flux.3 and Qwen-Image 2.1 LoRA, each beside its raw reference
set -u
T0=$(date +%s)
source scripts/gpu/common.sh
RES=$OUT/results.jsonl
for m in flux3 qwen_image21; do
  ref_file=.bench/raw_ddp_reference_$([ $m = flux3 ] && echo flux3 || echo qwen21).py
  log "$m tandem"
  limited 200 python3 scripts/benchmark.py --model $m --mode lora --gc --batch 1 --res 1024 --gpus 1 --steps 6 --warmup 3 --json $RES > $OUT/$m.txt 2>&1; echo "rc $?"
  grep -E "Memory plan|Traceback|Error|out of memory" $OUT/$m.txt | cut -c1-400 | head -4; tail -n 2 $OUT/$m.txt | cut -c1-300
  log "$m raw reference"
  limited 120 python3 $ref_file --model $m --mode lora --gc --batch 1 --res 1024 --steps 6 --warmup 3 2>&1 | grep '^{' | sed 's/^{/{"source": "raw_reference", /' | tee -a $RES
  echo "elapsed $(( $(date +%s) - T0 )) s"
done

# ---- call 8 (.bench/call_g.sh): Wan 2.1 14B at 24 GiB and its raw reference in one call (the docs' figures)
set -u
source scripts/gpu/common.sh
RES=$OUT/results.jsonl
log "wan14 1x24"
limited 330 python3 scripts/benchmark.py --model wan-14b --mode lora --gc --batch 1 --res 640 --gpus 1 --steps 3 --warmup 1 \
   --config-value multi_gpu.memory_limit_gib=24 --config-value data.video_frames=81 --json $RES > $OUT/wan14.txt 2>&1; echo "rc $?"
grep -E "Memory plan|Activation offloading" $OUT/wan14.txt | cut -c1-300
tail -n 1 $OUT/wan14.txt | cut -c1-300
log "raw reference wan14"
limited 200 python3 .bench/raw_ddp_reference.py --model wan14 --mode lora --gc --batch 1 --res 640 --frames 81 --steps 3 --warmup 1 2>&1 | grep '^{' | sed 's/^{/{"source": "raw_reference", /' | tee -a $RES
