"""Building blocks shared by every model: norm, rotary embeddings, attention, MLP, embeddings."""

from zoo.layers.attention import causal_attention
from zoo.layers.embed import embed, unembed
from zoo.layers.mlp import SwiGLU, swiglu
from zoo.layers.norm import rms_norm
from zoo.layers.rope import Rope, apply_rope, rope_cos_sin, yarn_mscale

__all__ = ["Rope", "SwiGLU", "apply_rope", "causal_attention", "embed", "rms_norm", "rope_cos_sin", "swiglu", "unembed", "yarn_mscale"]
