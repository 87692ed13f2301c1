"""Turn a kohya_ss / sd-scripts (.toml, .json) or OneTrainer (.json) config into a Tandem config.

    python scripts/import_config.py IN --out OUT.json [--force] [--config-value FIELD=VALUE ...]

Prints what was mapped and lists every setting that has no Tandem counterpart (modules/importing/config_import.py).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from modules.importing.cli import main
    sys.exit(main())
