"""Training configuration: typed dataclasses, JSON with migrations, validation, presets, overrides."""
from .docs import field_docs, section_classes
from .loading import load_config, read_config, resolve_config_source
from .migrations import MIGRATIONS, migrate
from .overrides import apply_overrides
from .presets import (PRESETS_DIR, config_from_overlay, deep_merge, find_preset, list_presets,
                      load_preset, preset_path)
from .run_paths import RunPaths
from .serialization import (VERSION_KEY, ConfigError, config_from_dict, config_to_dict, read_json,
                            save_config)
from .train_config import (CONFIG_VERSION, ConceptConfig, DataConfig, GeneralConfig, ModelConfig,
                           MultiGPUConfig, OptimizerConfig, SamplePromptConfig, SamplingConfig,
                           SaveConfig, TrainConfig, TrainingConfig)
from .validation import CHOICES, check, parse_device_indexes, validate

__all__ = [
    "CHOICES", "CONFIG_VERSION", "MIGRATIONS", "PRESETS_DIR", "VERSION_KEY",
    "ConceptConfig", "ConfigError", "DataConfig", "GeneralConfig", "ModelConfig", "MultiGPUConfig",
    "OptimizerConfig", "RunPaths", "SamplePromptConfig", "SamplingConfig", "SaveConfig",
    "TrainConfig", "TrainingConfig",
    "apply_overrides", "check", "config_from_dict", "config_from_overlay", "config_to_dict",
    "deep_merge", "field_docs", "find_preset", "list_presets", "load_config", "load_preset",
    "migrate", "parse_device_indexes", "preset_path", "read_config", "read_json",
    "resolve_config_source", "save_config", "section_classes", "validate",
]
