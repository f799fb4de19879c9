"""DeepSeek-V3: config, model (MLA, sigmoid-routed MoE, MTP), loss, placement map, decoding, HF mapping."""

from zoo.core.registry import register
from zoo.deepseek_v3.config import PRESETS, DeepseekV3Config, preset
from zoo.deepseek_v3.decode import MLA_DECODES, MLACache
from zoo.deepseek_v3.loss import DeepseekV3Metrics, DeepseekV3Training, deepseek_v3_loss
from zoo.deepseek_v3.model import DeepseekV3, DeepseekV3Output, deepseek_v3_params, mtp_duplicates
from zoo.deepseek_v3.moe import (
    route,
    routed_experts_dense,
    routed_experts_ragged,
    sequence_balance_loss,
    update_router_bias,
)
from zoo.deepseek_v3.placement import DeepseekV3Placement
from zoo.deepseek_v3.precision import DeepseekV3Precision

register(DeepseekV3)

__all__ = [
    "MLA_DECODES", "PRESETS", "DeepseekV3", "DeepseekV3Config", "DeepseekV3Metrics", "DeepseekV3Output",
    "DeepseekV3Placement", "DeepseekV3Precision", "DeepseekV3Training", "MLACache", "deepseek_v3_loss", "deepseek_v3_params", "preset",
    "route", "routed_experts_dense", "routed_experts_ragged", "sequence_balance_loss", "update_router_bias",
]  # fmt: skip
