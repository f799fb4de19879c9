"""zoo: a pure-functional Equinox model zoo for memory-bound LLM training in JAX."""

from zoo.deepseek_v3 import DeepseekV3, DeepseekV3Config
from zoo.errors import CheckpointError, ConfigError
from zoo.hf.pretrained import from_pretrained, save_pretrained
from zoo.llama import Llama, LlamaConfig
from zoo.loss import lm_loss
from zoo.placement import DeepseekV3Placement, LlamaPlacement, Placement, PlacementError

__all__ = [
    "CheckpointError", "ConfigError", "DeepseekV3", "DeepseekV3Config", "Llama", "LlamaConfig", "from_pretrained", "lm_loss", "save_pretrained"]
__all__ += ["DeepseekV3Placement", "LlamaPlacement", "Placement", "PlacementError"]
