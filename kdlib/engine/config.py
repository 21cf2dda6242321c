"""The engine's name for `kdlib.config` (notebooks, tools and tests import it from here).

    from kdlib.engine.config import ModelConfig      # == kdlib.config.ModelConfig

The reader, `ConfigError` and YaRN live in `kdlib.config` (pure Python); this module adds nothing.
"""

from kdlib.config import SUPPORTED_MODEL_TYPES, ConfigError, ModelConfig, YarnScaling

__all__ = ["SUPPORTED_MODEL_TYPES", "ConfigError", "ModelConfig", "YarnScaling"]
