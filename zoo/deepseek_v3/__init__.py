"""DeepSeek-V3."""

import re

from zoo.deepseek_v3.config import PRESETS, DeepseekV3Config, preset
from zoo.deepseek_v3.loss import DeepseekV3Metrics, deepseek_v3_loss
from zoo.deepseek_v3.model import DeepseekV3, DeepseekV3Output, deepseek_v3_params, mtp_duplicates
from zoo.deepseek_v3.moe import route, routed_experts_dense, routed_experts_ragged, sequence_balance_loss, update_router_bias
from zoo.errors import CheckpointError
from zoo.hf.pretrained import Family, register


def _mtp_keys(config: DeepseekV3Config, keys: set[str]) -> set[str]:
    """Without ``mtp=True`` the multi-token-prediction layers (stored after the decoder's) are skipped."""
    if config.mtp:
        return set()
    mtp_layers = range(config.num_layers, config.num_layers + config.num_nextn_predict_layers)
    pattern = re.compile(r"model\.layers\.(\d+)\.")
    return {k for k in keys if (m := pattern.match(k)) and int(m.group(1)) in mtp_layers}


def _check_experts(config: DeepseekV3Config, keys: set[str]) -> None:
    """An expert count in the file that disagrees with the config is named, not reported as
    hundreds of missing or unexpected tensors."""
    pattern = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
    found: dict[int, int] = {}
    for k in keys:
        if m := pattern.match(k):
            layer, expert = int(m.group(1)), int(m.group(2))
            found[layer] = max(found.get(layer, 0), expert + 1)
    for layer, n in sorted(found.items()):
        if n != config.n_routed_experts and layer < config.num_layers:
            raise CheckpointError(
                f"layer {layer} stores {n} routed experts (mlp.experts.0..{n - 1}) but config.json "
                f"says n_routed_experts={config.n_routed_experts}"
            )


def _duplicates(config: DeepseekV3Config) -> dict[str, str]:
    return mtp_duplicates(config) if config.mtp else {}


register(Family("deepseek_v3", DeepseekV3Config, DeepseekV3, deepseek_v3_params, skipped=_mtp_keys, duplicates=_duplicates, check=_check_experts))

__all__ = [
    "PRESETS", "DeepseekV3", "DeepseekV3Config", "DeepseekV3Metrics", "deepseek_v3_loss", "DeepseekV3Output", "deepseek_v3_params", "preset", "route",
    "routed_experts_dense", "routed_experts_ragged", "sequence_balance_loss", "update_router_bias",
]  # fmt: skip
