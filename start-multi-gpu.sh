#!/usr/bin/env bash
# Start a multi-GPU training run: installs on first use, asks for the config, the number of GPUs,
# the backend and the launcher (or takes them as flags), prints the command, then runs it.
# Run with --help for the options; docs/MultiGPUTraining.md explains each choice.
set -euo pipefail
cd "$(dirname "$0")"

usage() {
    cat <<'EOF'
Usage: ./start-multi-gpu.sh [options]

Without options it asks for each setting; press Enter to take the default shown in [brackets].

Options:
  --yes, -y              take the defaults for everything not given, ask nothing
  --config PATH|PRESET   config JSON file or preset name (default: #demo); presets are the
                         files in training_presets/
  --num-gpus N           GPUs (or CPU processes with --device cpu) to use (default: all visible GPUs;
                         2 with --device cpu)
  --backend nccl|gloo    communication backend (default: nccl on Linux with CUDA, else gloo)
  --spawn                start workers with torch.multiprocessing (the same as --launcher spawn)
  --launcher auto|torchrun|spawn  how workers start (default: auto = as the config's multi_gpu.launcher
                         says, whose default picks torchrun where restarts or several machines need its
                         agent, else spawn, which reaches the first step sooner)
  --port N               rendezvous port (default: $MASTER_PORT, else a free port)
  --device cpu           train in CPU processes over gloo (no GPU needed; for trying things out)
  --nnodes N             machines training together (default: 1); run this on each of them
  --node-rank K          this machine is node K of N (0: the one the others connect to)
  --master-addr ADDR     node 0's address, reachable from every machine (several machines)
  --max-restarts N       restart every worker after a failure, up to N times; training continues
                         from the newest backup (default: 0)
  --config-value K=V     override one config field, e.g. training.max_steps=100 (repeatable)
  --dry-run              print the command instead of running it
  --help, -h             this text

Environment:
  CUDA_VISIBLE_DEVICES   which GPUs are visible (e.g. 0,1); the GPU count default follows it
  MASTER_ADDR, MASTER_PORT  rendezvous address and port for the process group
  NCCL_DEBUG=INFO        NCCL logs its set-up (rings, NVLink/PCIe paths); for hangs and errors
  NCCL_P2P_DISABLE=1     work around consumer GPUs whose peer-to-peer transfers hang
  TANDEM_FORCE_SINGLE_GPU=1  ignore the GPU count and train in one process (scripts/train.py)
  TANDEM_SKIP_INSTALL=1  do not run ./install.sh (tests, or an environment you manage yourself)
  TANDEM_PYTHON          the Python to run training with (default: .venv/bin/python)

Check the machine first with: .venv/bin/python scripts/check_multi_gpu.py --config-path <config>
EOF
}

die() { echo "start-multi-gpu.sh: $*" >&2; exit 2; }

assume_yes=0 dry_run=0 config="" num_gpus="" backend="" launcher="" port="" device=""
nnodes="" node_rank="" master_addr="" max_restarts=""
overrides=()
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        -y|--yes) assume_yes=1 ;;
        --dry-run) dry_run=1 ;;
        --spawn) launcher=spawn ;;
        --torchrun) launcher=torchrun ;;
        --config|--num-gpus|--backend|--launcher|--port|--device|--config-value|--nnodes|--node-rank|--master-addr|--max-restarts)
            [ $# -ge 2 ] || die "$1 needs a value (see --help)"
            case "$1" in
                --config) config="$2" ;;
                --num-gpus) num_gpus="$2" ;;
                --backend) backend="$2" ;;
                --launcher) launcher="$2" ;;
                --port) port="$2" ;;
                --device) device="$2" ;;
                --config-value) overrides+=("$2") ;;
                --nnodes) nnodes="$2" ;;
                --node-rank) node_rank="$2" ;;
                --master-addr) master_addr="$2" ;;
                --max-restarts) max_restarts="$2" ;;
            esac
            shift ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
    shift
done

if [ "${TANDEM_SKIP_INSTALL:-0}" != "1" ]; then
    ./install.sh
fi
if [ -n "${TANDEM_PYTHON:-}" ]; then
    python_bin="$TANDEM_PYTHON"
elif [ -x .venv/bin/python ]; then
    python_bin=".venv/bin/python"
else
    die "no .venv/bin/python: run ./install.sh, or set TANDEM_PYTHON to a Python with Tandem installed"
fi

# Ask one question; an empty answer (or end of input) takes the default.
ask() {
    local prompt="$1" default="$2" answer=""
    if [ "$assume_yes" = "1" ]; then
        echo "$default"; return
    fi
    printf '%s [%s]: ' "$prompt" "$default" >&2
    IFS= read -r answer || true
    echo "${answer:-$default}"
}

[ -z "$device" ] || [ "$device" = "cpu" ] || die "--device accepts only 'cpu' (GPUs are the default), got '$device'"

if [ -z "$config" ]; then
    presets=()
    for f in training_presets/*.json; do [ -e "$f" ] && presets+=("$f"); done
    if [ "$assume_yes" != "1" ] && [ ${#presets[@]} -gt 0 ]; then
        echo "Presets:" >&2
        for i in "${!presets[@]}"; do echo "  $((i + 1))) ${presets[$i]}" >&2; done
    fi
    config="$(ask "Config file, preset name or number" "#demo")"
    if [[ "$config" =~ ^[0-9]+$ ]]; then
        [ "$config" -ge 1 ] && [ "$config" -le ${#presets[@]} ] || die "no preset number $config (1-${#presets[@]})"
        config="${presets[$((config - 1))]}"
    fi
fi
if [[ "$config" != \#* ]] && [ ! -f "$config" ]; then
    if [ -f "training_presets/$config.json" ]; then
        config="training_presets/$config.json"
    else
        die "config '$config' is neither a file nor a preset in training_presets/"
    fi
fi

# What the GPUs allow; skipped for CPU runs so that they need no CUDA at all.
gpu_count=0
if [ "$device" != "cpu" ]; then
    gpu_count="$("$python_bin" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
    if [ "$gpu_count" = "0" ]; then
        echo "No CUDA GPU is visible (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}): training in CPU processes (--device cpu)." >&2
        device=cpu
    fi
fi
if [ -z "$num_gpus" ]; then
    if [ "$device" = "cpu" ]; then default_n=2; label="Number of CPU processes"; else default_n="$gpu_count"; label="Number of GPUs"; fi
    num_gpus="$(ask "$label" "$default_n")"
fi
[[ "$num_gpus" =~ ^[1-9][0-9]*$ ]] || die "--num-gpus must be a whole number of 1 or more, got '$num_gpus'"
if [ "$device" != "cpu" ] && [ "$num_gpus" -gt "$gpu_count" ]; then
    die "--num-gpus $num_gpus but only $gpu_count GPU(s) are visible; lower it or check CUDA_VISIBLE_DEVICES"
fi

if [ -z "$backend" ]; then
    default_backend=gloo
    [ "$device" != "cpu" ] && [ "$(uname -s)" = "Linux" ] && default_backend=nccl
    backend="$(ask "Backend (nccl/gloo)" "$default_backend")"
fi
case "$backend" in nccl|gloo) ;; *) die "--backend must be nccl or gloo, got '$backend'" ;; esac
[ "$backend" = "nccl" ] && [ "$device" = "cpu" ] && die "--backend nccl needs GPUs; use gloo with --device cpu"

[ -n "$launcher" ] || launcher="$(ask "Launcher (auto/torchrun/spawn)" "auto")"
case "$launcher" in auto|torchrun|spawn) ;; *) die "--launcher must be auto, torchrun or spawn, got '$launcher'" ;; esac
[ -n "$port" ] || port="${MASTER_PORT:-}"
[ -z "$port" ] || [[ "$port" =~ ^[0-9]+$ ]] || die "--port must be a number, got '$port'"

# Several machines: each runs this script with the same config and its own node number.
[ -n "$nnodes" ] || nnodes="$(ask "Machines training together (nodes)" "1")"
[[ "$nnodes" =~ ^[1-9][0-9]*$ ]] || die "--nnodes must be a whole number of 1 or more, got '$nnodes'"
if [ "$nnodes" -gt 1 ]; then
    [ -n "$node_rank" ] || node_rank="$(ask "This machine is node K of $nnodes; K (0: the one the others connect to)" "0")"
    [[ "$node_rank" =~ ^[0-9]+$ ]] && [ "$node_rank" -lt "$nnodes" ] || die "--node-rank must be 0 to $((nnodes - 1)), got '$node_rank'"
    [ -n "$master_addr" ] || master_addr="$(ask "Address of node 0 (reachable from every machine)" "${MASTER_ADDR:-127.0.0.1}")"
    [ -n "$port" ] || port="$(ask "Rendezvous port (the same on every machine)" "29500")"
    [[ "$port" =~ ^[0-9]+$ ]] || die "--port must be a number, got '$port'"
fi
[ -n "$max_restarts" ] || max_restarts="$(ask "Restarts after a failure (0: none)" "0")"
[[ "$max_restarts" =~ ^[0-9]+$ ]] || die "--max-restarts must be a whole number, got '$max_restarts'"

for name in CUDA_VISIBLE_DEVICES MASTER_ADDR MASTER_PORT NCCL_DEBUG NCCL_P2P_DISABLE TANDEM_FORCE_SINGLE_GPU; do
    echo "$name=${!name:-(unset)}"
done

cmd=("$python_bin")
if [ "${TANDEM_FORCE_SINGLE_GPU:-0}" = "1" ]; then
    echo "TANDEM_FORCE_SINGLE_GPU=1: training in a single process."
    cmd+=(scripts/train.py --config-path "$config")
    [ "$device" != "cpu" ] || cmd+=(--config-value general.device=cpu)
else
    cmd+=(scripts/train_multi_gpu.py --config-path "$config" --num-gpus "$num_gpus" --distributed-backend "$backend")
    [ "$launcher" = "auto" ] || cmd+=(--launcher "$launcher")  # auto: as the config says (its default is auto)
    [ -z "$port" ] || cmd+=(--port "$port")
    [ "$device" != "cpu" ] || cmd+=(--device cpu)
    [ "$nnodes" = "1" ] || cmd+=(--nnodes "$nnodes" --node-rank "$node_rank" --master-addr "$master_addr")
    [ "$max_restarts" = "0" ] || cmd+=(--max-restarts "$max_restarts")
fi
for kv in ${overrides[@]+"${overrides[@]}"}; do
    cmd+=(--config-value "$kv")
done

printf 'Command:'; printf ' %q' "${cmd[@]}"; printf '\n'
if [ "$dry_run" = "1" ]; then
    exit 0
fi
exec "${cmd[@]}"
