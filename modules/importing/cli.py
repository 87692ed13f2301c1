"""`scripts/import_config.py`: a kohya or OneTrainer config -> a Tandem config file, with the report.

    python scripts/import_config.py kohya.toml --out my.json
    python scripts/import_config.py onetrainer.json --out my.json --config-value data.resolution=768
    python scripts/import_config.py onetrainer.json --concepts concepts.json --out my.json

Exit status 0 when the file was written (the report says what was not taken over, which files the config
names that were not read, and which values the config check would still refuse: a path to fill in, for
example); 2 when nothing was written, with one line saying why.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from modules.config.field_labels import labelled_paths
from modules.config.overrides import apply_overrides
from modules.config.serialization import ConfigError, save_config
from modules.config.validation import validate

from .config_import import import_config, import_error_line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="import_config.py",
                                     description="Turn a kohya (.toml/.json) or OneTrainer (.json) config into a "
                                                 "Tandem config.")
    parser.add_argument("source", help="the kohya sd-scripts .toml, kohya_ss GUI .json or OneTrainer .json file")
    parser.add_argument("--out", required=True, help="the Tandem config (.json) to write")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--concepts", metavar="FILE",
                        help="OneTrainer's concepts file (concept_file_name) to read: a config's own file names "
                             "are not read unless named here")
    parser.add_argument("--samples", metavar="FILE",
                        help="OneTrainer's sample definitions file (sample_definition_file_name) or sd-scripts' "
                             "prompt file (sample_prompts) to read")
    parser.add_argument("--config-value", action="append", default=[], metavar="FIELD=VALUE",
                        help="set a field after importing (repeatable), as scripts/train.py takes it")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.suffix.lower() != ".json":
        print(f"import_config.py: --out {out} must end in .json (Tandem configs are JSON).", file=sys.stderr)
        return 2
    if out.exists() and not args.force:
        print(f"import_config.py: {out} exists; choose another --out, or add --force to replace it.", file=sys.stderr)
        return 2
    try:
        result = import_config(args.source, concepts=args.concepts, samples=args.samples)
        cfg = apply_overrides(result.config(), args.config_value)
    except ConfigError as error:
        print(f"import_config.py: {import_error_line(error)}", file=sys.stderr)
        return 2
    try:
        save_config(cfg, out, follow_link=True)  # the file the user named, a link to elsewhere included
    except OSError as error:
        print(f"import_config.py: --out {out} cannot be written ({error.strerror or error}); choose another "
              "--out.", file=sys.stderr)
        return 2
    print(result.report())
    print(f"\nWrote {out}.")
    problems = validate(cfg, check_paths=False)
    if problems:
        print("Fix before training (the config check refuses these):")
        print("\n".join(f"  - {labelled_paths(p)}" for p in problems))
    return 0
