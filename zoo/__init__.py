"""zoo: a pure-functional Equinox model zoo for memory-bound LLM training in JAX."""

from importlib import metadata

from zoo.core.protocol import CausalLM, ModelConfig
from zoo.deepseek_v3 import DeepseekV3, DeepseekV3Config, DeepseekV3Placement
from zoo.errors import CheckpointError, ConfigError, MeshError
from zoo.hf.load import from_pretrained
from zoo.hf.save import save_pretrained
from zoo.llama import Llama, LlamaConfig, LlamaPlacement
from zoo.loss import lm_loss
from zoo.placement import Placement, PlacementError, PlacementMap
from zoo.qwen3 import Qwen3, Qwen3Config, Qwen3Placement

try:  # the installed distribution's version (pyproject.toml's)
    __version__ = metadata.version("zoo")
except metadata.PackageNotFoundError:  # a source tree on the path, not installed: pyproject.toml's version
    __version__ = "0.1.0"

__all__ = [
    "CausalLM", "CheckpointError", "ConfigError", "DeepseekV3", "DeepseekV3Config", "DeepseekV3Placement", "Llama",
    "LlamaConfig", "LlamaPlacement", "MeshError", "ModelConfig", "Placement", "PlacementError", "PlacementMap", "Qwen3",
    "Qwen3Config", "Qwen3Placement", "from_pretrained", "lm_loss", "save_pretrained",
]  # fmt: skip
