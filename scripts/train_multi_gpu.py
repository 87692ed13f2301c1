"""Train on N GPUs: `python scripts/train_multi_gpu.py --config-path X.json --num-gpus 2 [--spawn]`.

`--device cpu --num-gpus 2` runs two CPU processes over gloo, to try things without GPUs.
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

from modules.cli import train_multi_gpu_main  # noqa: E402
from modules.util.exit import exit_now  # noqa: E402

if __name__ == "__main__":
    exit_now(train_multi_gpu_main())
