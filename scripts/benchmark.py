"""Benchmark the real trainer on synthetic cached latents, 1 vs N GPUs.

    python scripts/benchmark.py --model sd15 --mode full --batch 8 --gpus 1,2 --repeat 3
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modules.util.bytecode import keep_bytecode  # noqa: E402
from modules.util.compile_cache import keep_compile_cache  # noqa: E402
from modules.util.import_structure import remember_import_structure  # noqa: E402
from modules.util.package_map import remember_package_map  # noqa: E402

keep_bytecode()  # before torch is imported: see modules/util/bytecode.py
keep_compile_cache()  # before diffusers is imported: see modules/util/compile_cache.py
remember_package_map()  # before diffusers and transformers: see modules/util/package_map.py
remember_import_structure()  # before transformers: see modules/util/import_structure.py

from modules.benchmark.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
