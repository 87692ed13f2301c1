# Shared by the GPU scripts in this folder (sourced, not run): environment, result file and helpers.
# NVLink multicast stays off (see the device notes); every measurement becomes one JSON line in
# $OUT/results.jsonl on a lent machine, ./gpu-results.jsonl elsewhere.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUTDIR="${OUT:-.}"; RES="$OUTDIR/${OUT:+results.jsonl}"; [ -n "${OUT:-}" ] || RES=./gpu-results.jsonl
REF="${REF:-.bench/raw_ddp_reference.py}"  # a copy of ../shared/bench/raw_ddp_reference.py
# The GPU machines' image has no diffusers: its wheel, carried in .whl/, is installed beside the image's
# packages (without bytecode, as the image's own packages are).
if ! python3 -c "import diffusers" 2>/dev/null; then
    [ -d /tmp/site/diffusers ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site .whl/*.whl || echo "diffusers is not importable: carry its wheel in .whl/" >&2
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
log() { echo "== $(date +%T) $*"; }
ref() { # raw reference: 1 GPU plain, N GPUs under torchrun
    local n=$1; shift
    if [ "$n" = 1 ]; then python3 "$REF" "$@"; else python3 -m torch.distributed.run --standalone --nproc_per_node="$n" "$REF" "$@"; fi \
        | grep '^{' | sed 's/^{/{"source": "raw_reference", /' | tee -a "$RES"
}
bench() { python3 scripts/benchmark.py "$@" --json "$RES" | grep -v '^{'; }
# `limited SECONDS command...`: stop a part at its time limit for good. A plain `timeout` sends SIGTERM, on
# which the trainer stops gracefully (finishing its step, writing a stop backup) - and would go on using the
# GPUs the next part measures on.
limited() { local seconds=$1; shift; timeout -k 5 -s KILL "$seconds" "$@"; }
