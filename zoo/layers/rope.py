"""Rotary position embeddings: the default, ``llama3`` and ``yarn`` frequency rules.

Frequencies are computed once on the host in float32, exactly as the published reference
implementations do, so positions, cos and sin agree bit for bit with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

RopeKind = Literal["default", "llama3", "yarn"]


@dataclass(frozen=True)
class Rope:
    """The rotary frequency rule of a model (``rope_theta`` + ``rope_scaling`` in HF configs)."""

    theta: float = 10000.0
    kind: RopeKind = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        # A theta of 0 or a negative factor loads and gives NaN logits: refuse, naming the field.
        positive = ["theta", "factor", "original_max_position_embeddings"]
        if self.kind == "llama3":
            positive += ["low_freq_factor", "high_freq_factor"]
        if self.kind == "yarn":
            positive += ["beta_fast", "beta_slow"]
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"rope {name} must be a positive finite number, got {value!r}")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor ({self.low_freq_factor})"
            )

    def inv_freq(self, dim: int) -> np.ndarray:
        """Inverse frequencies for a rotary dimension ``dim`` (``dim // 2`` of them), float32."""
        exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
        pos_freqs = np.float32(self.theta) ** exponent
        inv = (np.float32(1.0) / pos_freqs).astype(np.float32)
        if self.kind == "llama3":
            return self._llama3(inv)
        if self.kind == "yarn":
            return self._yarn(dim, pos_freqs)
        return inv

    def _llama3(self, inv: np.ndarray) -> np.ndarray:
        old = self.original_max_position_embeddings
        low_wavelen = old / self.low_freq_factor
        high_wavelen = old / self.high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / np.float32(self.factor), inv).astype(np.float32)
        smooth = ((old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)).astype(np.float32)
        smoothed = (1 - smooth) * scaled / np.float32(self.factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    def _yarn(self, dim: int, pos_freqs: np.ndarray) -> np.ndarray:
        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta)
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
        extrapolation_factor = (1 - ramp).astype(np.float32)
        extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
        interpolation = (np.float32(1.0) / (np.float32(self.factor) * pos_freqs)).astype(np.float32)
        return (interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor).astype(np.float32)

    @property
    def cos_sin_scale(self) -> float:
        """What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim))
        return float(yarn_mscale(self.factor))

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Rope:
        """Read either spelling: ``rope_theta`` + ``rope_scaling``, or one ``rope_parameters`` dict."""
        params = dict(config.get("rope_parameters") or {})
        scaling = dict(config.get("rope_scaling") or {})
        merged = {**params, **scaling}
        theta = merged.get("rope_theta", config.get("rope_theta", 10000.0))
        kind = merged.get("rope_type", merged.get("type", "default"))
        if kind not in ("default", "llama3", "yarn"):
            raise ValueError(f"config.json: rope type {kind!r} is not supported (default, llama3, yarn)")
        fields = {}
        for name in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
            "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate",
        ):  # fmt: skip
            if merged.get(name) is not None:
                fields[name] = merged[name]
        if kind == "yarn" and "factor" not in fields and "max_position_embeddings" in config:
            # As the reference does when no factor is given: the ratio of the raised context to
            # the pretrained one (DeepSeek-V3 keeps the pretrained length in the rope settings).
            fields["factor"] = config["max_position_embeddings"] / fields.get("original_max_position_embeddings", 4096)
        return cls(theta=float(theta), kind=kind, **fields)

    def to_hf(self) -> dict[str, Any]:
        """The published spelling: ``rope_theta`` and ``rope_scaling``."""
        out: dict[str, Any] = {"rope_theta": self.theta}
        if self.kind == "llama3":
            out["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": self.factor,
                "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
            }
        elif self.kind == "yarn":
            out["rope_scaling"] = {
                "type": "yarn",
                "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
                "mscale": self.mscale,
                "mscale_all_dim": self.mscale_all_dim,
            }
            if self.attention_factor is not None:
                out["rope_scaling"]["attention_factor"] = self.attention_factor
        return out


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when not scaled)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_cos_sin(
    rope: Rope, dim: int, positions: Int[Array, "B S"]
) -> tuple[Float[Array, "B S R"], Float[Array, "B S R"]]:
    """cos and sin of ``position * inv_freq`` (R = dim / 2 frequencies), float32."""
    inv_freq = jnp.asarray(rope.inv_freq(dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    scale = rope.cos_sin_scale
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(
    x: Float[Array, "B S N K"],
    cos: Float[Array, "B S R"],
    sin: Float[Array, "B S R"],
    *,
    interleaved: bool = False,
) -> Float[Array, "B S N K"]:
    """Rotate pairs of ``x``: halves ``(x[:K/2], x[K/2:])`` (Llama) or neighbours
    ``(x[2i], x[2i+1])`` (``interleaved``, the DeepSeek-V3 checkpoints' layout)."""
    dtype = x.dtype
    x = x.astype(jnp.float32)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(x.shape)
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(dtype)
