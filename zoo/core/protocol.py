"""The protocol every model family implements, so generic code never asks which family it has.

``zoo.train``, ``zoo.parallel``, ``zoo.generate``, ``zoo.placement`` and ``zoo.hf`` call only what
is declared here. A family (``zoo/<family>/``) subclasses :class:`ModelConfig` and
:class:`CausalLM`, implements every abstract method and attribute (Equinox's abstract/final
pattern: abstract here, concrete and final in the family), and registers its model class in
:mod:`zoo.registry`. ``docs/adding-a-family.md`` walks through it.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import equinox as eqx
from jaxtyping import Array, Bool, Float, Int

from zoo.core.params import Param
from zoo.core.registry import family_of
from zoo.errors import ConfigError


@dataclass(frozen=True)
class AxisRule:
    """How one dimension letter of a family's legend is laid out on the mesh.

    mesh_axis: the mesh axis that splits the dimension (``"tensor"``, ``"fsdp"``, ``"expert"``),
        or axes, outermost first (the vocabulary's ``("pipeline", "fsdp")``: a block per stage,
        split over its FSDP devices).
    field: the config field behind the letter, named in errors (``"num_heads"``).
    stored_apart_only: split only where the letter indexes separately stored tensors
        (``{E}`` in the checkpoint key): experts are split, the router's expert scores are not.
    pad: a size the mesh axis does not divide is padded with zeros to its next multiple, which
        must leave the model's function unchanged: the vocabulary (padded logits are never
        predicted), an MLP's hidden units (a zero unit adds nothing and gets no gradient) and
        a pipelined stack's layers (a padding layer is skipped: :mod:`zoo.pipeline`).
        Never a dimension that a norm or a softmax runs over, nor heads or experts.
    optional: axes of ``mesh_axis`` that join the split only where the mesh's sizes still
        divide the dimension with them; where they do not, it is split as the rule's other
        axes split it and stored whole over them, as it was before they joined. The expert
        group joins ``fsdp`` so on the weights outside the routed experts
        (:data:`zoo.core.mesh.WEIGHT_SHARDS`): its devices hold different tokens, like
        ``fsdp``'s, and the step gathers these weights over both (``docs/parallelism.md``).
        Never with ``pad``.
    """

    mesh_axis: str | tuple[str, ...]
    field: str
    stored_apart_only: bool = False
    pad: bool = False
    optional: tuple[str, ...] = ()

    def __post_init__(self):
        names = (self.mesh_axis,) if isinstance(self.mesh_axis, str) else tuple(self.mesh_axis)
        if not set(self.optional) <= set(names) or (self.optional and self.pad):
            raise ConfigError(f"AxisRule {self.field!r}: optional axes {self.optional} must be among its mesh axes "
                              f"{names}, and never with pad=True")  # fmt: skip


# The dimension letter of the vocabulary in every family's legend: the embedding and the output
# head are laid out by it, and inside the parallel step split over it (zoo.vocab_parallel).
VOCAB = "V"


class ModelConfig(abc.ABC):
    """A family's architecture: a frozen dataclass with Hugging Face's field names where they exist."""

    # Dimension letter -> layout on the mesh (the letters of the family's legend).
    axis_rules: ClassVar[Mapping[str, AxisRule]]
    vocab_size: int
    max_position_embeddings: int
    eos_token_id: int | list[int] | None

    @property
    @abc.abstractmethod
    def sizes(self) -> dict[str, int]:
        """Size of every dimension letter in the family's legend."""

    @abc.abstractmethod
    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at sequence length ``seq_len``."""

    @classmethod
    @abc.abstractmethod
    def preset(cls, name: str, model_type: str | None = None) -> ModelConfig:
        """A named configuration (published sizes, and small ones for tests and CPU runs);
        ``model_type`` picks among a family's model types where they differ (dense or MoE)."""

    @classmethod
    @abc.abstractmethod
    def from_hf(cls, data: dict[str, Any], source: str = "config.json", **options: Any) -> ModelConfig:
        """The config of a Hugging Face ``config.json`` (errors name ``source`` and the field)."""

    @abc.abstractmethod
    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` that ``transformers`` loads."""

    def num_params(self) -> int:
        """Every parameter (buffers included), from the family's parameter description."""
        specs = family_of(self).param_specs(self)
        return sum(math.prod(p.shape(self.sizes)) for p in specs.values())


def check_positive(config: Any, *fields: str) -> None:
    """Each field a positive, finite number, else a :class:`~zoo.errors.ConfigError` naming it:
    ``rms_norm_eps = -1`` or ``max_position_embeddings = -5`` would load and give NaN or nothing."""
    for name in fields:
        value = getattr(config, name)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        if not ok:
            raise ConfigError(f"{type(config).__name__}.{name} must be a positive finite number, got {value!r}")


def check_positive_ints(config: Any, *fields: str) -> None:
    """Each field a positive integer (not a bool), else a :class:`~zoo.errors.ConfigError` naming it."""
    for name in fields:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{type(config).__name__}.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class NoTrainingOptions:
    """A family whose training objective is the plain next-token loss has no options."""


class CausalLM(eqx.Module):
    """A causal language model: ``model(input_ids) -> logits`` and everything generic code needs.

    Abstract: each family's model class (``Llama``, ``DeepseekV3``, ``Qwen3``) implements it.
    """

    config: eqx.AbstractVar[ModelConfig]
    compute_dtype: eqx.AbstractVar[Any]

    # Facts about the family, declared by its model class.
    config_cls: eqx.AbstractClassVar[type[ModelConfig]]
    model_types: eqx.AbstractClassVar[tuple[str, ...]]  # Hugging Face ``model_type`` values it loads
    placement_map: eqx.AbstractClassVar[type]  # its zoo.placement.PlacementMap subclass
    training_options: ClassVar[type] = NoTrainingOptions  # settings of its training objective
    # Keyword options its generation cache takes (init_cache, prefill, zoo.generate's cache_options):
    # name -> (choices, the first the default; what they do, for a recipe's flag). Default: none.
    cache_options: ClassVar[Mapping[str, tuple[tuple[str, ...], str]]] = {}
    # Dotted paths of sub-modules that are one layer run on its own, shaped like a layer of one
    # of its stacks (DeepSeek-V3's MTP block): under zoo.parallel the model gathers each with
    # zoo.hooks.gather_layer where it runs it, as a stack's layer, instead of the step
    # gathering it whole at its start (its routed experts then a block at a time). Default: none.
    layer_blocks: ClassVar[tuple[str, ...]] = ()

    # -- parameters --------------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def param_specs(cls, config: Any) -> dict[str, Param]:
        """Every parameter: layout in dimension letters, init, Hugging Face key (:mod:`zoo.params`)."""

    # -- forward and training ------------------------------------------------------------
    @abc.abstractmethod
    def forward(
        self,
        input_ids: Int[Array, "B S"],
        *,
        positions: Int[Array, "B S"] | None = None,
        segment_ids: Int[Array, "B S"] | None = None,
        placement: Any = None,
        return_hidden: bool = False,
        head: bool = True,
    ) -> tuple[Any, ...]:
        """A tuple whose first entry is the float32 logits and second the hidden states as
        ``transformers`` reports them (with ``return_hidden``; else ``None``). ``head=False``:
        every logits entry holds the final-normed hidden states ``[B, S, D]`` instead, for a
        loss that applies :meth:`unembedding` itself (``zoo.loss.chunked_cross_entropy``)."""

    @abc.abstractmethod
    def unembedding(self) -> Float[Array, "V D"]:
        """The output head's matrix (the embedding where the head is tied)."""

    def __call__(
        self,
        input_ids: Int[Array, "B S"],
        *,
        positions: Int[Array, "B S"] | None = None,
        segment_ids: Int[Array, "B S"] | None = None,
        placement: Any = None,
    ) -> Float[Array, "B S V"]:
        """Float32 logits for every position (causal; packed segments never see each other)."""
        return self.forward(input_ids, positions=positions, segment_ids=segment_ids, placement=placement)[0]

    @abc.abstractmethod
    def loss(
        self,
        input_ids: Int[Array, "B S"],
        *,
        options: Any = None,
        positions: Int[Array, "B S"] | None = None,
        segment_ids: Int[Array, "B S"] | None = None,
        loss_mask: Bool[Array, "B S"] | None = None,
        placement: Any = None,
    ) -> tuple[Float[Array, ""], dict[str, Array]]:
        """The training objective and what to log about it (``lm_loss`` at least). Floating
        metrics are averaged over micro-batches and devices, integer ones (counts) summed.
        A family with nothing but the next-token loss derives from ``zoo.loss.NextTokenLM``."""

    def after_step(self, metrics: Mapping[str, Array], options: Any = None) -> CausalLM:
        """What the training step changes outside the gradient, from the step's metrics
        (DeepSeek-V3: the router bias from the expert load). The default changes nothing."""
        return self

    # -- generation ----------------------------------------------------------------------
    @abc.abstractmethod
    def init_cache(self, batch: int, max_len: int, **options: Any) -> eqx.Module:
        """An empty generation cache of ``max_len`` positions for ``batch`` rows."""

    @abc.abstractmethod
    def prefill(
        self,
        input_ids: Int[Array, "B S"],
        lengths: Int[Array, " B"],
        *,
        max_len: int,
        all_logits: bool = False,
        **options: Any,
    ) -> tuple[Float[Array, "B V"] | Float[Array, "B S V"], eqx.Module]:
        """Right-padded prompts through the model into a fresh cache (see :mod:`zoo.generate`)."""

    @abc.abstractmethod
    def decode_step(self, cache: eqx.Module, tokens: Int[Array, " B"]) -> tuple[Float[Array, "B V"], eqx.Module]:
        """One token per row at position ``cache.lengths``: next-token logits and the cache."""

    # -- Hugging Face checkpoints -----------------------------------------------------------
    @classmethod
    def hf_skipped(cls, config: Any, keys: set[str]) -> set[str]:
        """Keys a checkpoint may hold that this model does not load (logged, not an error)."""
        return set()

    @classmethod
    def hf_duplicates(cls, config: Any) -> dict[str, str]:
        """Tensors the hub layout stores twice: key -> the parameter path it copies (written
        on save, not read on load)."""
        return {}

    @classmethod
    def hf_check(cls, config: Any, keys: set[str]) -> None:
        """Consistency checks of a file's keys against the config (raise ``CheckpointError``)."""

    # -- layout on a mesh ---------------------------------------------------------------
    @classmethod
    def check_layout(cls, config: Any, mesh: Any, *, virtual_stages: int = 1) -> None:
        """The family's own checks that ``mesh`` can run ``config`` (raise ``MeshError``), beyond
        what its axis rules make :func:`zoo.core.layout.validate_mesh` check, which calls this
        before anything is placed or traced. ``virtual_stages``: the interleaved pipeline
        schedule's chunks per stage. The default accepts every layout."""


def options_or_default(model: CausalLM, options: Any) -> Any:
    """``options`` checked against the family's training options class (``None``: its defaults)."""
    cls = type(model).training_options
    if options is None:
        return cls()
    if not isinstance(options, cls):
        raise TypeError(
            f"{type(model).__name__} trains with {cls.__name__} options, got {type(options).__name__}; "
            f"fields: {[f.name for f in dataclasses.fields(cls)]}"
        )
    return options


@runtime_checkable
class Mergeable(Protocol):
    """A model with adapters that fold into a family's model (:class:`zoo.lora.LoraModel`):
    what generic code that runs a family's model (``zoo.generate``) takes as that model."""

    def merged(self) -> CausalLM: ...


@runtime_checkable
class Wrapper(Protocol):
    """A family's model with arrays of its own around it (:class:`zoo.lora.LoraModel`: the
    adapters around ``base``): laid out on a mesh by :meth:`layout_specs`, a description of
    every array in the family's letters (a letter without a rule in the family's layout is kept
    whole), and run by the parallel step as its base model is (:mod:`zoo.parallel`)."""

    base: CausalLM

    def layout_specs(self) -> dict[str, Param]: ...
