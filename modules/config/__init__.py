"""Training configuration: typed dataclasses, JSON with migrations, validation, presets."""
from .migrations import MIGRATIONS, migrate
from .serialization import ConfigError, config_from_dict, config_to_dict, read_json, save_config
from .train_config import (CONFIG_VERSION, ConceptConfig, DataConfig, GeneralConfig, ModelConfig,
                           MultiGPUConfig, OptimizerConfig, SamplePromptConfig, SamplingConfig,
                           SaveConfig, TrainConfig, TrainingConfig)
