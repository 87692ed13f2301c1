"""The text encoders of Qwen-Image and Z-Image at their real size, placed and timed as the trainer places them.

    python scripts/benchmark_text_encoder.py --family qwen --placement gpu            # 1 GPU, bf16
    python scripts/benchmark_text_encoder.py --family qwen --placement fp8            # 1 GPU, float8 weights
    python scripts/benchmark_text_encoder.py --family qwen --placement offload        # layers from host memory
    torchrun --nproc_per_node=2 scripts/benchmark_text_encoder.py --family qwen --placement sharded
    python scripts/benchmark_text_encoder.py --family zimage --tiny --device cpu      # a smoke test

The encoder has random weights (Qwen2.5-VL 7B / Qwen3 4B as Tandem ships their configs), built on the GPU in
its storage dtype (fast; float8 after bf16) and moved to host memory, where the trainer's `TextSide.load` leaves
a model it reads from disk; then placed by `modules/trainer/text_encoding.place`, the trainer's own code. The
peak GPU memory is counted from there on: the build is not the trainer's and would otherwise set the peak. `--texts` synthetic captions of 20 to
60 words are encoded into a throw-away text cache by `modules/data/cache.fill_text_cache`, each rank its share,
as a training start does. Rank 0 prints one JSON line: the placement, the encoder's size, how long building and
placing each took (reading 16 GB from disk is not part of it), encoding time, texts/s and the peak GPU memory
of placing and encoding.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from modules.families.registry import FAMILIES

PLACEMENTS = ("gpu", "fp8", "offload", "sharded", "cpu")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Time the placement and encoding of a 2026 family's text encoder.")
    p.add_argument("--family", choices=[name for name, info in FAMILIES.items() if info.text_apart], default="qwen")
    p.add_argument("--placement", choices=PLACEMENTS, default="gpu")
    p.add_argument("--texts", type=int, default=256, help="captions to encode (all ranks together)")
    p.add_argument("--tiny", action="store_true", help="the built-in demo's tiny encoder (a smoke test)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args(argv)

    import torch.distributed as dist

    from modules.data.cache import fill_text_cache
    from modules.trainer.text_encoding import PlacedEncoder
    from modules.util import dist_utils as du

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    side, build = _text_side(args.family, args.placement, args.tiny, device)
    placement = "gpu" if args.placement == "fp8" else args.placement
    started = time.perf_counter()
    built = build()
    build_s = time.perf_counter() - started
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    side.load = built.to  # random weights instead of the files' (the placement code is the trainer's)
    placed = PlacedEncoder(side, placement, device)
    placed.place()
    placed_s = time.perf_counter() - started
    del built
    gib = sum(t.numel() * t.element_size() for t in side.encoder.state_dict().values()) / 2 ** 30
    texts = _captions(args.texts)
    du.barrier()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache, torch.no_grad():
        encoded = fill_text_cache(texts, placed, "benchmark", cache, du.rank(), du.world_size(), progress=False)
        placed.drain()
        if device.type == "cuda":
            torch.cuda.synchronize()
        du.barrier()
    encode_s = time.perf_counter() - started
    result = {"source": "tandem_text_encoder", "family": args.family, "placement": args.placement,
              "world": du.world_size(), "texts": len(texts), "encoded_by_rank0": encoded,
              "weights_gib": round(gib * (du.world_size() if placement == "sharded" else 1), 2),
              "build_s": round(build_s, 3), "place_s": round(placed_s, 3), "encode_s": round(encode_s, 2),
              "texts_per_s": round(len(texts) / encode_s, 1),
              "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2) if device.type == "cuda" else None,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if du.rank() == 0:
        print(json.dumps(result), flush=True)
    side.release()
    if distributed:
        dist.destroy_process_group()
    return 0


def _text_side(family_name: str, placement: str, tiny: bool, device: torch.device):
    """(the family's TextSide, a builder of its random encoder in the storage dtype, left in host memory)."""
    import transformers

    from modules.model.families import family
    from modules.model.families.flow_base import shipped
    from modules.model.families.llm_demo import demo_qwen_tokenizer
    from modules.model.text_apart import TextSide

    fam = family(family_name)
    tokenizer = demo_qwen_tokenizer()
    storage = "fp8" if placement == "fp8" else ("fp32" if device.type == "cpu" else "bf16")
    kind = fam.text_encoder_kind()
    name = kind.classes[0]
    side = TextSide(folder=Path(tempfile.gettempdir()), class_name=f"random {name}", storage=storage,
                    tokenizer=tokenizer, encode_fn=fam.encode_with, runnable=fam.runnable_text_encoder,
                    layers=fam.text_encoder_layers)

    def build():
        from modules.model.text_apart import FLOAT8

        default = torch.get_default_dtype()
        torch.set_default_dtype(side.compute_dtype())
        try:
            if tiny:
                module, function = kind.tiny.split(":")
                model = getattr(importlib.import_module(module), function)(tokenizer, 0)
            else:
                config = shipped(family_name, "text_encoder")
                cls = getattr(transformers, config["architectures"][0])
                with torch.device(device):  # building 8 B weights on a CPU takes minutes
                    model = cls(cls.config_class(**{k: v for k, v in config.items() if not k.startswith("_")}))
        finally:
            torch.set_default_dtype(default)
        runnable = side.runnable(model).requires_grad_(False).eval()
        if side.storage == FLOAT8:
            from modules.model.float8 import store_linear_weights_in_float8
            store_linear_weights_in_float8(runnable, "the text encoder")
        return runnable.to("cpu")

    return side, build


def _captions(count: int) -> list[str]:
    from modules.model.demo import DEMO_WORDS

    generator = random.Random(0)
    return [" ".join(generator.choice(DEMO_WORDS) for _ in range(generator.randint(20, 60))) for _ in range(count)]


if __name__ == "__main__":
    raise SystemExit(main())
