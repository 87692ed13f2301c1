"""The raw reference (`.bench/raw_ddp_reference.py`) at another published size of a family.

The reference builds each 2026 family at diffusers' default config (Flux.2: dev, 32 B). Flux.2 Klein's
sizes differ only in that config, so this runs the reference unchanged with the family's transformer
class made to default to the variant's config (Tandem's shipped one, the same the benchmark builds):

    python3 scripts/gpu/reference_variant.py klein-4b --model flux2 --mode full --fsdp ...   # under torchrun too
"""
import json
import os
import runpy
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[2] / "modules" / "model" / "configs"


def main() -> None:
    variant, argv = sys.argv[1], sys.argv[2:]
    model = argv[argv.index("--model") + 1]
    config = json.loads((CONFIGS / model / f"transformer_{variant}.json").read_text())
    import diffusers

    cls = getattr(diffusers, config.pop("_class_name"))
    setattr(diffusers, cls.__name__, lambda **given: cls(**{**config, **given}))
    reference = os.environ.get("REF", ".bench/raw_ddp_reference.py")
    sys.argv = [reference, *argv]
    runpy.run_path(reference, run_name="__main__")


if __name__ == "__main__":
    main()
