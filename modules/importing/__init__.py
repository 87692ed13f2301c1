"""Importing another trainer's config - kohya sd-scripts (`.toml`), the kohya_ss GUI and OneTrainer (`.json`) -
as a Tandem config, with a report of what had no counterpart. Torch-free: the GUI's Import and
`scripts/import_config.py` use it.

    config_import.py   `import_config(path)`: recognise whose file it is and map it; every refusal one line
    kohya.py           kohya's settings -> Tandem's
    onetrainer.py      OneTrainer's settings -> Tandem's
    result.py          what an import yields (`ImportResult`) and the value readers the mappings share
    files.py           reading the files an import is given, every problem one sentence
    cli.py             `scripts/import_config.py`: the import written as a config file, with the report
"""
