"""The command line of `scripts/check_multi_gpu.py`, torch-free: `--help` and argument errors answer without
importing PyTorch (a few tenths of a second instead of the 30-42 s its import took on a busy 2-core machine),
and `--plan-for` imports it only when the model must be built to be sized (the built-in demos).

The checks themselves (GPUs, all-reduces, the memory estimate on this machine) are `diagnostics.main`.
"""
from __future__ import annotations

import argparse
import sys

GPU_ALLREDUCE_MIB = 256
"""The all-reduce's size between machines (`--size-mib`) and on this machine's GPUs."""

DEFAULT_PLAN_CONFIG = "#demo"
"""What `--plan-for` plans for without `--config-path`: the README's demo, the one config every install has."""

DESCRIPTION = """Check this machine for multi-GPU training: versions, GPUs, NVLink, a real all-reduce and, with
--config-path, whether that config fits the GPUs' memory. --plan-for 2x24 plans for cards this machine need not
have (for --config-path, '#demo' without it).

  check_multi_gpu.py                                        the machine's report
  check_multi_gpu.py --config-path my.json                  plus that config's memory on these GPUs
  check_multi_gpu.py --config-path my.json --plan-for 2x24  only the memory plan for two 24 GiB cards

Exit status 0 when every check passed (or a plan fits), 1 when a problem was found (nothing fits), 2 for bad
input (see docs/MultiGPUTraining.md)."""


def _cards(text: str) -> str:
    """`--plan-for` as written, once it reads as cards: a typo is refused before anything heavy is imported."""
    from modules.planning.memory_plan import parse_plan_for

    try:
        parse_plan_for(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="check_multi_gpu.py", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-path", help="config JSON or preset name (e.g. '#demo', flux_lora) to estimate "
                                              f"memory for (--plan-for without it: {DEFAULT_PLAN_CONFIG!r})")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    parser.add_argument("--skip-gloo", action="store_true", help="skip the 2-process gloo all-reduce on the CPU")
    parser.add_argument("--assume-free-gib", type=float,
                        help="compare the memory estimate with this much free GPU memory instead of the GPUs'")
    parser.add_argument("--plan-for", metavar="CARDS", type=_cards,
                        help="only the memory plan of --config-path (default "
                             f"{DEFAULT_PLAN_CONFIG!r}) for these GPUs, e.g. 2x24 (two of 24 GiB) or 24,16; "
                             "with :GiB after them also for that much host memory, e.g. 1x24:64; no GPU is used")
    parser.add_argument("--config-value", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of --config-path (repeatable), e.g. training.batch_size=2")
    parser.add_argument("--nnodes", type=int, default=1, help="check the all-reduce between this many machines "
                                                              "(run it on each, with its --node-rank)")
    parser.add_argument("--node-rank", type=int, default=0, help="this machine's number (0 serves the rendezvous)")
    parser.add_argument("--master-addr", default="127.0.0.1", help="node 0's address the others reach it by")
    parser.add_argument("--master-port", type=int, default=29500, help="the rendezvous port on node 0")
    parser.add_argument("--size-mib", type=int, default=GPU_ALLREDUCE_MIB, help="all-reduce size between machines")
    return parser.parse_args(argv)


def _measure(*args, **kwargs):
    from . import memory_estimate
    return memory_estimate.measure(*args, **kwargs)


def _builtin_folder(family: str):
    from . import memory_estimate
    return memory_estimate.builtin_folder(family)


def plan_for(config_path: str | None, cards: str, as_json: bool, overrides: list[str] = ()) -> int:
    """`--plan-for`: the memory plan for cards this machine need not have (and a model it need not have yet:
    paths are not checked); 0 when a plan fits, 1 when none does, 2 for bad input. Without a config, the
    plan for `DEFAULT_PLAN_CONFIG`, saying so. PyTorch is imported only if the model must be built to be sized."""
    from modules.config import load_config
    from modules.planning.memory_report import plan_report, report_json

    if not config_path:
        config_path = DEFAULT_PLAN_CONFIG
        print(f"No --config-path: the plan for {DEFAULT_PLAN_CONFIG!r}, the built-in demo; name yours with "
              "--config-path my.json (or a preset: flux_lora, sdxl_lora, ...).",
              file=sys.stderr if as_json else sys.stdout, flush=True)
    try:
        cfg = load_config(config_path, overrides, check_paths=False)
        data, text, code = plan_report(cfg, cards, _measure, _builtin_folder)
    except (ValueError, OSError) as e:  # ConfigError, the estimate's and --plan-for's errors name what to fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report_json(data) if as_json else text, flush=True)
    return code
