"""Qwen3 and Qwen3-MoE: config, model, routing, loss, placement map, decoding, HF mapping."""

from zoo.core.registry import register
from zoo.qwen3.config import PRESETS, Qwen3Config, preset
from zoo.qwen3.loss import Qwen3Training, switch_balance_loss
from zoo.qwen3.model import Qwen3, Qwen3Output, qwen3_params
from zoo.qwen3.placement import Qwen3Placement
from zoo.qwen3.precision import Qwen3Precision
from zoo.qwen3.routing import route

register(Qwen3)

__all__ = [
    "PRESETS", "Qwen3", "Qwen3Config", "Qwen3Output", "Qwen3Placement", "Qwen3Precision", "Qwen3Training", "preset", "qwen3_params",
    "route", "switch_balance_loss",
]  # fmt: skip
