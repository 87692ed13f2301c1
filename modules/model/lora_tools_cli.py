"""`scripts/lora_tools.py`: merge a LoRA into its base, resize a LoRA's rank, extract a LoRA from a fine-tune.

    python scripts/lora_tools.py merge --base-model MODEL --lora LORA.safetensors --out MERGED[.safetensors]
                                       [--strength 1.0] [--dtype fp16|bf16|fp32]
    python scripts/lora_tools.py resize --lora LORA.safetensors --out SMALLER.safetensors (--rank N | --energy 0.9)
    python scripts/lora_tools.py extract --base-model BASE --tuned-model TUNED --out LORA.safetensors --rank N
                                         [--alpha A] [--format kohya|peft] [--conv] [--load-dtype bf16]

Every command takes `--device cpu|cuda` (a GPU when there is one) and `--overwrite` (replace an existing
output). Exit status 0 with one line saying what was written; 2 with one line saying what is wrong.
With `TANDEM_EVENTS=1` (the GUI) progress and the outcome also come as `@tandem-tool` lines
(`modules/util/tool_lines.py`).
"""
from __future__ import annotations

import argparse
import os
import sys

from modules.util.run_protocol import EVENTS_VARIABLE
from modules.util.tool_lines import tool_line

DTYPES = ("fp16", "bf16", "fp32")
PROG = "lora_tools.py"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="LoRA tools: merge, resize, extract.")
    commands = p.add_subparsers(dest="command", required=True)

    merge = commands.add_parser("merge", help="merge a LoRA into its base model and write the merged model")
    merge.add_argument("--base-model", required=True, help="diffusers folder, single file or builtin:demo")
    merge.add_argument("--lora", required=True, help="the LoRA (.safetensors; kohya/ComfyUI or diffusers layout)")
    merge.add_argument("--out", required=True, help="a folder (diffusers layout) or a .safetensors single file")
    merge.add_argument("--strength", type=float, default=1.0, help="how much of the LoRA to merge (1: all of it)")
    merge.add_argument("--dtype", choices=DTYPES, default="fp16", help="the merged model's weights")

    resize = commands.add_parser("resize", help="lower a LoRA's rank (SVD), keeping its scale")
    resize.add_argument("--lora", required=True, help="the LoRA (.safetensors)")
    resize.add_argument("--out", required=True, help="the resized LoRA (.safetensors)")
    resize.add_argument("--rank", type=int, help="the new rank (with --energy: the most any module gets)")
    resize.add_argument("--energy", type=float,
                        help="instead of one rank: keep this share (0-1] of each module's squared Frobenius norm, "
                             "as kohya's dynamic_method sv_fro")
    resize.add_argument("--verbose", action="store_true", help="list every module's new rank and kept energy")

    extract = commands.add_parser("extract", help="extract a LoRA from a fine-tuned model and its base")
    extract.add_argument("--base-model", required=True, help="the model the fine-tune started from")
    extract.add_argument("--tuned-model", required=True, help="the fine-tuned model")
    extract.add_argument("--out", required=True, help="the LoRA (.safetensors)")
    extract.add_argument("--rank", type=int, required=True, help="the LoRA's rank")
    extract.add_argument("--alpha", type=float, help="the LoRA's alpha (default: the rank)")
    extract.add_argument("--format", choices=("kohya", "peft"), default="kohya",
                         help="kohya: ComfyUI, A1111, Forge, sd-scripts; peft: diffusers' load_lora_weights")
    extract.add_argument("--dtype", choices=DTYPES, default="fp16", help="the LoRA's weights")
    extract.add_argument("--load-dtype", choices=DTYPES, default="fp32",
                         help="the precision both models wait in while extracting: bf16 halves the memory (a 12B "
                              "Flux pair: about 48 GB instead of 96 GB); each layer's difference is taken in fp32")
    extract.add_argument("--conv", action="store_true", help="also the convolutions (LoCon), not only Linear layers")
    extract.add_argument("--verbose", action="store_true", help="list every layer's kept energy")

    for command in (merge, resize, extract):
        command.add_argument("--device", help="cpu or cuda (default: cuda when there is a GPU)")
        command.add_argument("--overwrite", action="store_true", help="replace the output if it exists")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    events = os.environ.get(EVENTS_VARIABLE) == "1"

    def progress(done: int, total: int, what: str) -> None:
        if events:
            print(tool_line("progress", done=done, total=total, what=what), flush=True)

    from .lora_tools import ToolError
    try:
        report = _run(args, progress)
    except (ToolError, OSError) as error:  # OSError: a file that cannot be read or written (a full disk, say)
        text = str(error) if isinstance(error, ToolError) else f"{error}; check that the inputs can be read and --out written (permissions, free space)"
        if events:
            print(tool_line("error", text=text), flush=True)
        print(f"{PROG}: {text}", file=sys.stderr)
        return 2
    if getattr(args, "verbose", False):
        for layer in report.layers:
            print(f"{layer.module}: rank {layer.old_rank} -> {layer.new_rank}, kept energy {layer.kept:.4f}")
    print(report.line())
    if events:
        print(tool_line("result", text=report.line()), flush=True)
    return 0


def _run(args, progress):
    from .lora_resize import resize
    from .lora_tools import extract, merge

    if args.command == "merge":
        return merge(args.base_model, args.lora, args.out, args.strength, args.dtype, args.device, args.overwrite,
                     progress)
    if args.command == "resize":
        return resize(args.lora, args.out, args.rank, args.energy, args.device, args.overwrite, progress)
    return extract(args.base_model, args.tuned_model, args.out, args.rank, args.alpha, args.format, args.dtype,
                   args.conv, args.device, args.overwrite, progress, args.load_dtype)
