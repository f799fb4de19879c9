"""zoo: a pure-functional Equinox model zoo for memory-bound LLM training in JAX."""

from importlib import metadata

from zoo.core.protocol import CausalLM, ModelConfig
from zoo.deepseek_v3 import DeepseekV3, DeepseekV3Config, DeepseekV3Placement, DeepseekV3Precision
from zoo.errors import CheckpointError, ConfigError, MeshError
from zoo.hf.load import from_pretrained
from zoo.hf.save import save_pretrained
from zoo.layers.precision import PrecisionError, PrecisionMap
from zoo.llama import Llama, LlamaConfig, LlamaPlacement, LlamaPrecision
from zoo.loss import lm_loss
from zoo.placement import Placement, PlacementError, PlacementMap
from zoo.qwen3 import Qwen3, Qwen3Config, Qwen3Placement, Qwen3Precision

try:  # the installed distribution's version (pyproject.toml's)
    __version__ = metadata.version("zoo")
except metadata.PackageNotFoundError:  # a source tree on the path, not installed: pyproject.toml's version
    __version__ = "0.1.0"

__all__ = [
    "CausalLM", "CheckpointError", "ConfigError", "DeepseekV3", "DeepseekV3Config", "DeepseekV3Placement",
    "DeepseekV3Precision", "Llama", "LlamaConfig", "LlamaPlacement", "LlamaPrecision", "MeshError", "ModelConfig",
    "Placement", "PlacementError", "PlacementMap", "PrecisionError", "PrecisionMap", "Qwen3", "Qwen3Config",
    "Qwen3Placement", "Qwen3Precision", "from_pretrained", "lm_loss", "save_pretrained",
]  # fmt: skip
