"""Qwen3's Hugging Face checkpoint facts beyond its parameter description."""

from __future__ import annotations

import re

from zoo.errors import CheckpointError
from zoo.qwen3.config import Qwen3Config


def check_layer_kinds(config: Qwen3Config, keys: set[str]) -> None:
    """A layer stored as MoE where the config says dense (or the reverse), or an expert count
    that disagrees with ``num_experts``, is named, not reported as hundreds of tensors."""
    kinds = config.layer_kinds
    experts: dict[int, int] = {}
    for k in keys:
        if m := re.match(r"model\.layers\.(\d+)\.mlp\.(experts\.(\d+)\.|gate_proj\.)", k):
            layer = int(m.group(1))
            if layer >= len(kinds):
                continue
            stored = "moe" if m.group(3) is not None else "dense"
            if stored != kinds[layer]:
                raise CheckpointError(
                    f"layer {layer} is stored as a {stored} MLP but config.json makes it {kinds[layer]} "
                    f"(mlp_only_layers={list(config.mlp_only_layers)}, decoder_sparse_step={config.decoder_sparse_step})"
                )
            if stored == "moe":
                experts[layer] = max(experts.get(layer, 0), int(m.group(3)) + 1)
    for layer, n in sorted(experts.items()):
        if n != config.num_experts:
            raise CheckpointError(
                f"layer {layer} stores {n} experts (mlp.experts.0..{n - 1}) but config.json says num_experts={config.num_experts}"
            )
