"""DeepSeek-V3's Hugging Face checkpoint facts beyond its parameter description: the MTP layers
stored after the decoder's, and the expert count a file holds."""

from __future__ import annotations

import re

from zoo.deepseek_v3.config import DeepseekV3Config
from zoo.errors import CheckpointError


def mtp_keys_skipped(config: DeepseekV3Config, keys: set[str]) -> set[str]:
    """Without ``mtp=True`` the multi-token-prediction layers (stored after the decoder's) are skipped."""
    if config.mtp:
        return set()
    mtp_layers = range(config.num_layers, config.num_layers + config.num_nextn_predict_layers)
    pattern = re.compile(r"model\.layers\.(\d+)\.")
    return {k for k in keys if (m := pattern.match(k)) and int(m.group(1)) in mtp_layers}


def check_expert_count(config: DeepseekV3Config, keys: set[str]) -> None:
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
