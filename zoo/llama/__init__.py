"""Llama 3.x."""

from zoo.hf.pretrained import Family, register
from zoo.llama.config import PRESETS, LlamaConfig, preset
from zoo.llama.model import Llama, LlamaLayer, llama_params

register(Family("llama", LlamaConfig, Llama, llama_params))

__all__ = ["PRESETS", "Llama", "LlamaConfig", "LlamaLayer", "llama_params", "preset"]
