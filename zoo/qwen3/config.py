"""Qwen3 and Qwen3-MoE hyper-parameters, presets, FLOP and parameter counts, and the HF ``config.json`` mapping.

One config serves both Hugging Face model types: ``qwen3`` (every layer a dense SwiGLU) and
``qwen3_moe`` (a layer is MoE unless ``mlp_only_layers`` lists it or ``decoder_sparse_step``
skips it; :attr:`Qwen3Config.layer_kinds`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple

from zoo.core.mesh import WEIGHT_SHARDS
from zoo.core.protocol import AxisRule
from zoo.errors import ConfigError, MeshError
from zoo.hf.config import HFConfig, decoder_hf
from zoo.layers.decoder import GQAConfig
from zoo.layers.moe_dispatch import dispatch_of
from zoo.layers.rope import Rope

QWEN3_ROPE = Rope(theta=1000000.0)

# Dimension letter -> mesh axis (and the config field behind it, for errors).
QWEN3_AXES: dict[str, AxisRule] = {
    "H": AxisRule("tensor", "num_heads"),
    "G": AxisRule("tensor", "num_kv_heads"),
    "F": AxisRule("tensor", "intermediate_size", pad=True),
    "M": AxisRule("tensor", "moe_intermediate_size", pad=True),
    "E": AxisRule("expert", "num_experts", stored_apart_only=True),
    "D": AxisRule(WEIGHT_SHARDS, "hidden_size", optional=("expert",)),
    "V": AxisRule(("pipeline", "fsdp"), "vocab_size", pad=True),
    # Both layer stacks are pipelined (zoo.pipeline): each block of the forward pass (one
    # repeating pattern of kinds, or one run of a kind) is a GPipe pass over its repeats, which
    # needs each block to hold its kinds' whole stacks (Qwen3Config.check_pipeline, run by the mesh check).
    "Ld": AxisRule("pipeline", "num_layers (its dense layers)", pad=True),
    "Lm": AxisRule("pipeline", "num_layers (its MoE layers)", pad=True),
}

ModelType = Literal["qwen3", "qwen3_moe"]


class Block(NamedTuple):
    """``repeats`` consecutive repeats of the layer kinds ``pattern``, whose dense layers start
    at ``dense_first`` in the dense stack and MoE layers at ``moe_first`` in the MoE stack."""

    pattern: tuple[str, ...]
    dense_first: int
    moe_first: int
    repeats: int

    def count(self, kind: str) -> int:
        return self.pattern.count(kind) * self.repeats


@dataclass(frozen=True)
class Qwen3Config(GQAConfig):
    """Architecture of a Qwen3 or Qwen3-MoE decoder. Field names follow Hugging Face's (the shared
    ones: :class:`~zoo.layers.decoder.GQAConfig`).

    ``model_type="qwen3"`` has no experts; ``"qwen3_moe"`` has ``num_experts`` routed experts
    (softmax router, top ``num_experts_per_tok``, renormalised when ``norm_topk_prob``, no
    shared expert) in the layers :attr:`layer_kinds` marks ``"moe"``.
    """

    axis_rules: ClassVar[dict[str, AxisRule]] = QWEN3_AXES

    model_type: ModelType = "qwen3"
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    rms_norm_eps: float = 1e-6
    rope: Rope = field(default_factory=lambda: QWEN3_ROPE)
    max_position_embeddings: int = 40960
    # Not architecture (never in config.json): expert parallelism's all-to-all rounds, a slot of
    # capacity_factor x the mean rows per destination, and past it "dropless" (more rounds) or
    # "drop" (dropped, counted); the rows travel by ragged all-to-alls where XLA has them
    # ("auto"), or "padded" / "ragged": zoo.layers.moe_dispatch.
    capacity_factor: float = 1.25
    moe_overflow: str = "dropless"
    moe_transport: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        dispatch_of(self)
        name = "Qwen3Config"
        if self.model_type not in ("qwen3", "qwen3_moe"):
            raise ConfigError(f"{name}.model_type must be 'qwen3' or 'qwen3_moe', got {self.model_type!r}")
        if self.model_type == "qwen3" and self.num_experts:
            raise ConfigError(f"{name}: model_type 'qwen3' has no experts, got num_experts={self.num_experts}")
        if self.model_type == "qwen3_moe":
            for f in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
                value = getattr(self, f)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ConfigError(f"{name}.{f} must be a positive integer for qwen3_moe, got {value!r}")
            if self.num_experts_per_tok > self.num_experts:
                raise ConfigError(
                    f"{name}.num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})"
                )
        bad = [i for i in self.mlp_only_layers if not (isinstance(i, int) and 0 <= i < self.num_layers)]
        if bad:
            raise ConfigError(f"{name}.mlp_only_layers: {bad} are not layer indices 0..{self.num_layers - 1}")

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """``"dense"`` or ``"moe"`` per layer, as ``transformers`` decides: MoE iff the layer is not
        in ``mlp_only_layers``, there are experts, and ``(i + 1) % decoder_sparse_step == 0``."""
        return tuple(
            "moe"
            if i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0
            else "dense"
            for i in range(self.num_layers)
        )

    @property
    def dense_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "dense")

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "moe")

    @property
    def blocks(self) -> tuple[Block, ...]:
        """How the forward pass scans the layers. When the layer kinds repeat a pattern (all MoE;
        dense and MoE alternating, as ``decoder_sparse_step=2`` makes them), one ``lax.scan`` over
        the repeats, each step running the pattern's layers in order; otherwise one scan per run of
        consecutive layers of one kind. (One scan per layer would cost memory: XLA gives each
        loop its own temporaries; at 8 alternating layers the training step's temp bytes were
        46 MiB, and 45 MiB under full remat, against 23 and 12 MiB for one scan over the pairs.)"""
        kinds, n = self.layer_kinds, self.num_layers
        for p in range(1, n // 2 + 1):
            if n % p == 0 and kinds == kinds[:p] * (n // p):
                return (Block(kinds[:p], 0, 0, n // p),)
        out, seen = [], {"dense": 0, "moe": 0}
        for kind, first, end in self.runs:
            out.append(Block((kind,), seen["dense"], seen["moe"], end - first))
            seen[kind] += end - first
        return tuple(out)

    def check_pipeline(self, stages: int, virtual_stages: int = 1) -> None:
        """That ``stages`` pipeline stages can run the layers (a :class:`MeshError` if not): each
        block of the forward pass is a GPipe pass over its repeats, a stage holding whole
        repeats. That needs every block to hold the whole stack of each kind in its pattern (no
        kind split into runs between the other's) and, where a repeat has several layers of a
        kind, the repeats to divide the stages or their padding to line up (each stack is padded
        on its own), and one layer of it per repeat on the interleaved schedule."""
        if stages == 1:
            return
        for block in self.blocks:
            for kind in dict.fromkeys(block.pattern):
                n = len(self.dense_layer_ids if kind == "dense" else self.moe_layer_ids)
                if block.count(kind) != n:
                    raise MeshError(
                        f"Qwen3Config: a pipeline axis needs each kind of layer in one block, but layer kinds "
                        f"{self.layer_kinds} (mlp_only_layers={self.mlp_only_layers}, decoder_sparse_step="
                        f"{self.decoder_sparse_step}) split the {kind} layers into runs; use a mesh without pipeline"
                    )
                if virtual_stages > 1 and block.pattern.count(kind) > 1:
                    # zoo.hooks.pipeline.stage_order permutes single layers, not repeats of several.
                    raise MeshError(
                        f"Qwen3Config: the interleaved schedule (virtual_stages={virtual_stages}) needs one {kind} "
                        f"layer per repeat of the layer pattern, but {block.pattern} has {block.pattern.count(kind)}; "
                        "use virtual_stages=1"
                    )
                if -(-n // stages) != block.pattern.count(kind) * -(-block.repeats // stages):
                    raise MeshError(
                        f"Qwen3Config: pipeline={stages} does not divide the {block.repeats} repeats of the layer "
                        f"pattern {block.pattern}, whose {kind} layers would then not line up with the other kind's "
                        "across the stages; use a pipeline size that divides them"
                    )

    @property
    def runs(self) -> tuple[tuple[str, int, int], ...]:
        """Runs of consecutive layers of one kind: ``(kind, first, end)`` as indices into that
        kind's stack (decoding scans each run)."""
        out: list[tuple[str, int, int]] = []
        seen = {"dense": 0, "moe": 0}
        for kind in self.layer_kinds:
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1], out[-1][2] + 1)
            else:
                out.append((kind, seen[kind], seen[kind] + 1))
            seen[kind] += 1
        return tuple(out)

    @property
    def own_sizes(self) -> dict[str, int]:
        return {
            "H": self.num_heads,
            "G": self.num_kv_heads,
            "K": self.head_dim,
            "E": self.num_experts,
            "M": self.moe_intermediate_size,
            "Ld": len(self.dense_layer_ids),
            "Lm": len(self.moe_layer_ids),
        }

    def _attn_matmul(self) -> int:
        d, h, g, k = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        return d * (h + 2 * g) * k + h * k * d

    def num_active_params(self) -> int:
        """Parameters one token uses: every parameter but the experts it is not routed to."""
        idle = self.num_experts - self.num_experts_per_tok
        return self.num_params() - len(self.moe_layer_ids) * idle * 3 * self.hidden_size * self.moe_intermediate_size

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (3x forward) per token; only the activated experts count, plus the
        router and causal attention (``6·L·H·K·S``, half the square, as for Llama)."""
        d = self.hidden_size
        dense = len(self.dense_layer_ids) * 3 * d * self.intermediate_size
        moe = len(self.moe_layer_ids) * (3 * d * self.moe_intermediate_size * self.num_experts_per_tok + d * self.num_experts)
        matmul = self.num_layers * self._attn_matmul() + dense + moe + self.vocab_size * d
        return 6.0 * matmul + 6.0 * self.num_layers * self.num_heads * self.head_dim * seq_len

    @classmethod
    def preset(cls, name: str, model_type: str | None = None) -> Qwen3Config:
        return preset(name, model_type)

    # -- Hugging Face config.json ---------------------------------------------------------
    @classmethod
    def from_hf(cls, data: dict[str, Any], source: str = "config.json", *, capacity_factor: float = 1.25,
                moe_overflow: str = "dropless", moe_transport: str = "auto") -> Qwen3Config:  # fmt: skip
        c = HFConfig(data, source)
        model_type = c.get("model_type", str)
        if c.get("attention_bias", bool, False):
            raise ConfigError(f"{source}: field 'attention_bias' is true; zoo's Qwen3 has no attention biases")
        if c.get("use_sliding_window", bool, False):
            raise ConfigError(f"{source}: field 'use_sliding_window' is true; zoo's Qwen3 attends over the full context")
        act = c.get("hidden_act", str, "silu")
        if act != "silu":
            raise ConfigError(f"{source}: field 'hidden_act' is {act!r}; Qwen3's MLP is SwiGLU ('silu')")
        shared = c.decoder_fields(max_position_embeddings=40960)
        heads = shared["num_heads"]
        moe: dict[str, Any] = {}
        if model_type == "qwen3_moe":
            experts = c.get("num_experts", int, None)
            if experts is None:
                experts = c.get("num_local_experts", int)  # the newer spelling
            mlp_only = c.get("mlp_only_layers", list, [])
            moe = dict(
                num_experts=experts,
                num_experts_per_tok=c.get("num_experts_per_tok", int),
                moe_intermediate_size=c.get("moe_intermediate_size", int),
                norm_topk_prob=c.get("norm_topk_prob", bool, False),
                decoder_sparse_step=c.get("decoder_sparse_step", int, 1),
                mlp_only_layers=tuple(mlp_only),
                router_aux_loss_coef=c.get("router_aux_loss_coef", float, 0.001),
            )
        return cls(
            **shared,
            num_kv_heads=c.get("num_key_value_heads", int, heads),
            head_dim=c.get("head_dim", int, shared["hidden_size"] // heads),
            model_type=model_type,
            rope=c.parsed("rope settings", Rope.from_hf),
            **moe,
            capacity_factor=capacity_factor,
            moe_overflow=moe_overflow,
            moe_transport=moe_transport,
        )

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM" if self.model_type == "qwen3_moe" else "Qwen3ForCausalLM"],
            "model_type": self.model_type,
            **decoder_hf(self),
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "use_sliding_window": False,
            "sliding_window": None,
            **self.rope.to_hf(),
        }
        out.setdefault("rope_scaling", None)
        if self.model_type == "qwen3_moe":
            out.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
            )
        return out


def _dense(**kw) -> Qwen3Config:
    return Qwen3Config(**kw)


def _moe(**kw) -> Qwen3Config:
    return Qwen3Config(model_type="qwen3_moe", **kw)


_QWEN = dict(vocab_size=151936, head_dim=128, bos_token_id=151643, eos_token_id=151645)

PRESETS: dict[str, Qwen3Config] = {
    # Published sizes (Qwen/Qwen3-*/config.json).
    "qwen3-0.6b": _dense(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
                         tie_word_embeddings=True, **_QWEN),
    "qwen3-8b": _dense(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8, **_QWEN),
    "qwen3-32b": _dense(hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64, num_kv_heads=8, **_QWEN),
    "qwen3-30b-a3b": _moe(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_layers=48,
                          num_heads=32, num_kv_heads=4, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          **_QWEN),
    "qwen3-235b-a22b": _moe(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_layers=94,
                            num_heads=64, num_kv_heads=4, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                            **_QWEN),
    # Byte-level models for tests and CPU training (vocab 256: one token per byte).
    "tiny": _dense(vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, tie_word_embeddings=True),
    "small": _dense(vocab_size=256, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8, num_kv_heads=4,
                    head_dim=32),
    "bench": _dense(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8, num_kv_heads=4,
                    head_dim=64),
    # The same for Qwen3-MoE (``--model qwen3_moe --preset small``): a dense first layer, as
    # mlp_only_layers allows, then MoE layers.
    "moe-tiny": _moe(vocab_size=256, hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=True, mlp_only_layers=(0,)),
    "moe-small": _moe(vocab_size=256, hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_layers=4,
                      num_heads=8, num_kv_heads=4, head_dim=32, num_experts=16, num_experts_per_tok=2,
                      norm_topk_prob=True, mlp_only_layers=(0,)),
    "moe-bench": _moe(vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256, num_layers=4,
                      num_heads=8, num_kv_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=2,
                      norm_topk_prob=True, mlp_only_layers=(0,)),
}  # fmt: skip


def preset(name: str, model_type: str | None = None, **overrides) -> Qwen3Config:
    """A named configuration (``qwen3-8b``, ``qwen3-30b-a3b``, ``small``, ...). With
    ``model_type="qwen3_moe"`` the small names (``tiny``, ``small``, ``bench``) are the MoE ones."""
    if model_type == "qwen3_moe" and f"moe-{name}" in PRESETS:
        name = f"moe-{name}"
    if name not in PRESETS:
        raise ConfigError(f"unknown Qwen3 preset {name!r}; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
