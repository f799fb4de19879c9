"""DeepSeek-V3's precision map: which matmul of a decoder layer runs in FP8, and in which recipe."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from zoo.layers.precision import PrecisionMap, Recipe


@dataclass(frozen=True)
class DeepseekV3Precision(PrecisionMap, model="zoo.deepseek_v3.model.DeepseekV3"):
    """Recipe of every projection of a DeepSeek-V3 layer (``zoo/deepseek_v3/mla.py``,
    ``layer.py``):

    - ``q_a``: the query's down projection (with ``q_lora_rank``); ``query``: its up projection,
      or the single query projection without a query latent.
    - ``kv_a``: the down projection to the key/value latent and the rope key; ``kv_b``: the
      latent's up projection to per-head keys and values; ``attn_out``: the output projection.
    - ``mlp_gate``/``mlp_up``/``mlp_down``: the dense first layers' SwiGLU;
      ``shared_gate``/``shared_up``/``shared_down``: the shared experts'.
    - ``moe_gate``/``moe_up``/``moe_down``: the routed experts' (in FP8 on the ``capacity``
      expert path only: :mod:`zoo.layers.capacity_mlp`).
    - ``mtp_proj``: the MTP block's projection of [embedding, hidden state] to the model width
      (the block's own layer runs the names above).

    The ``deepseek`` preset is the technical report's (section 3.3): every linear layer's GEMMs
    in the blockwise recipe; the router, attention, norms, embedding and head in higher
    precision.
    """

    presets: ClassVar[Mapping[str, str]] = {"deepseek": "blockwise"}

    q_a: Recipe = "none"
    query: Recipe = "none"
    kv_a: Recipe = "none"
    kv_b: Recipe = "none"
    attn_out: Recipe = "none"
    mlp_gate: Recipe = "none"
    mlp_up: Recipe = "none"
    mlp_down: Recipe = "none"
    shared_gate: Recipe = "none"
    shared_up: Recipe = "none"
    shared_down: Recipe = "none"
    moe_gate: Recipe = "none"
    moe_up: Recipe = "none"
    moe_down: Recipe = "none"
    mtp_proj: Recipe = "none"
