"""Llama 3.x: config, model, placement and precision maps, decoding, Hugging Face mapping."""

from zoo.core.registry import register
from zoo.llama.config import PRESETS, LlamaConfig, preset
from zoo.llama.model import Llama, LlamaLayer, llama_params
from zoo.llama.placement import LlamaPlacement
from zoo.llama.precision import LlamaPrecision

register(Llama)

__all__ = ["PRESETS", "Llama", "LlamaConfig", "LlamaLayer", "LlamaPlacement", "LlamaPrecision", "llama_params", "preset"]
