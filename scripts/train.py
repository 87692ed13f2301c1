"""Train with a config file: `python scripts/train.py --config-path X.json [--config-value k=v ...]`.

Single process; when started by torchrun (`torchrun --nproc_per_node=N scripts/train.py ...`) it is
one worker of a multi-GPU run.
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

from modules.cli import train_main  # noqa: E402
from modules.util.exit import exit_now  # noqa: E402

if __name__ == "__main__":
    exit_now(train_main())
