"""Model loading: Hub ids, local directories and config.json files, with shipped architecture configs.

    from patchdsl.model import load_model
    loaded = load_model("Qwen/Qwen3-0.6B", meta=True)      # architecture only, for planning
    loaded = load_model("Qwen/Qwen3-0.6B", tiny=True)      # shrunk, random weights, for CPU tests

Importing this package is cheap; torch and transformers are imported on first use.
"""

from .loading import (
    CONFIGS_DIR,
    LoadedModel,
    ModelLoadError,
    config_from_dict,
    load_model,
    parse_dtype,
    shipped_config_path,
    shipped_models,
)
from .shrink import tiny_config

__all__ = [
    "CONFIGS_DIR",
    "LoadedModel",
    "ModelLoadError",
    "config_from_dict",
    "load_model",
    "parse_dtype",
    "shipped_config_path",
    "shipped_models",
    "tiny_config",
]
