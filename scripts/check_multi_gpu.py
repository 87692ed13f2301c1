"""Check this machine for multi-GPU training and, with --config-path, estimate memory per GPU.

    python scripts/check_multi_gpu.py                       # versions, GPUs, NVLink, real all-reduce
    python scripts/check_multi_gpu.py --config-path '#demo' # plus the memory estimate for a config
    python scripts/check_multi_gpu.py --config-path my.json --plan-for 2x24   # the plan for other cards
    python scripts/check_multi_gpu.py --json                # the same report as JSON

Exit status 0 when every check passed, 1 when a problem was found (see docs/MultiGPUTraining.md), 2 for bad
input. `--help`, argument errors and `--plan-for` for a model sized from its published sizes or files answer
without importing PyTorch (modules/distributed/check_cli.py).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modules.util.bytecode import keep_bytecode  # noqa: E402
from modules.util.compile_cache import keep_compile_cache  # noqa: E402

keep_bytecode()  # before torch is imported: see modules/util/bytecode.py
keep_compile_cache()  # before diffusers is imported: see modules/util/compile_cache.py

from modules.distributed.check_cli import parse_args, plan_for  # noqa: E402  (torch-free)


def main(argv: list[str]) -> int:
    args = parse_args(argv)  # --help and argument errors end here, before PyTorch is imported
    if args.plan_for:
        return plan_for(args.config_path, args.plan_for, args.json, args.config_value)
    from modules.distributed.diagnostics import main as check

    return check(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
