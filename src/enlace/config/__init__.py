"""Layered, validated configuration."""

from .data import DataConfig
from .extra import EvalConfig, GenerationConfig
from .finetune import FinetuneConfig
from .hardware import HardwareConfig
from .model import ModelConfig
from .resolve import Config, load_config, read_params, save_resolved, show
from .train import TrainConfig

__all__ = [
    "Config",
    "DataConfig",
    "EvalConfig",
    "FinetuneConfig",
    "GenerationConfig",
    "HardwareConfig",
    "ModelConfig",
    "TrainConfig",
    "load_config",
    "read_params",
    "save_resolved",
    "show",
]
