"""DeepSeek-V3."""

import re

from zoo.deepseek_v3.config import PRESETS, DeepseekV3Config, preset
from zoo.deepseek_v3.model import DeepseekV3, DeepseekV3Output, deepseek_v3_params, mtp_duplicates
from zoo.deepseek_v3.moe import route, routed_experts_dense, routed_experts_ragged, sequence_balance_loss, update_router_bias
from zoo.hf.pretrained import Family, register


def _mtp_keys(config: DeepseekV3Config, keys: set[str]) -> set[str]:
    """Without ``mtp=True`` the multi-token-prediction layers (stored after the decoder's) are skipped."""
    if config.mtp:
        return set()
    mtp_layers = range(config.num_layers, config.num_layers + config.num_nextn_predict_layers)
    pattern = re.compile(r"model\.layers\.(\d+)\.")
    return {k for k in keys if (m := pattern.match(k)) and int(m.group(1)) in mtp_layers}


def _duplicates(config: DeepseekV3Config) -> dict[str, str]:
    return mtp_duplicates(config) if config.mtp else {}


register(Family("deepseek_v3", DeepseekV3Config, DeepseekV3, deepseek_v3_params, skipped=_mtp_keys, duplicates=_duplicates))

__all__ = [
    "PRESETS", "DeepseekV3", "DeepseekV3Config", "DeepseekV3Output", "deepseek_v3_params", "preset", "route",
    "routed_experts_dense", "routed_experts_ragged", "sequence_balance_loss", "update_router_bias",
]  # fmt: skip
