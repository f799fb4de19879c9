"""LoRA adapters on any family's linear weights, chosen by the parameter description.

A target is a weight whose Hugging Face key names a linear module (``...self_attn.q_proj.weight``,
stored ``[out, in]``); targets are named as PEFT names them, by the module's name or a dotted
suffix of its path (``"q_proj"``, ``"self_attn.q_proj"``, ``"shared_experts.gate_proj"``), so one
name adapts every weight it names (``"gate_proj"``: the dense MLP's, every routed expert's and the
shared experts'). The adapter of a weight ``W`` stored ``[out, in]`` is ``A [r, in]`` and
``B [out, r]`` per stored tensor (so ``[*stacked, r, in]`` and ``[*stacked, out, r]`` for a stack
of layers or experts), in PEFT's layout; the adapted weight is ``W + scale · B A`` (``scale =
alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA), folded into the family's own layout by the
same description (:meth:`zoo.core.params.Param.from_hf`'s transposition), so no family code
knows about LoRA: :class:`LoraModel` merges its adapters into the weights and calls the base
model (the layer scan sees merged stacks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int, PRNGKeyArray, UInt32

from zoo.core.layout import gather_axes, is_layer_stack, layout_sizes, param_axes
from zoo.core.mesh import axis_names, axis_size
from zoo.core.params import Deferred, Param, is_deferred, path_name
from zoo.core.protocol import VOCAB, CausalLM
from zoo.core.registry import family_of
from zoo.errors import ConfigError
from zoo.hooks import products
from zoo.hooks.products import add_term
from zoo.hooks.step import block_of, current_step
from zoo.lora import dropout


@dataclass(frozen=True)
class LoraConfig:
    """rank ``r``, ``alpha``, the target names (PEFT's ``target_modules``), rsLoRA scaling
    (``alpha / sqrt(r)`` in place of ``alpha / r``), and ``dropout`` (PEFT's ``lora_dropout``:
    the rate at which a training step drops the adapters' inputs, :mod:`zoo.lora.dropout`)."""

    r: int
    alpha: int | float
    targets: tuple[str, ...]
    rslora: bool = False
    dropout: float = 0.0

    def __post_init__(self):
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ConfigError(f"LoRA r must be a positive integer, got {self.r!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha):
            raise ConfigError(f"LoRA alpha must be a finite number, got {self.alpha!r}")
        if isinstance(self.targets, str):
            raise ConfigError(f"LoRA targets must be a sequence of names, got the string {self.targets!r}")
        if not self.targets:
            raise ConfigError("LoRA targets: at least one target name is needed")
        if not (0.0 <= self.dropout < 1.0):
            raise ConfigError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


# PEFT's keys: ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``.lora_B.weight`` ``[out, r]``.
PREFIX = "base_model.model."


def peft_key(module: str, which: str) -> str:
    """The key PEFT stores adapter matrix ``which`` (``"A"``, ``"B"``) of ``module`` under."""
    return f"{PREFIX}{module}.lora_{which}.weight"


def module_of(p: Param) -> str:
    """The Hugging Face module path template of a linear weight (its key without ``.weight``)."""
    assert p.hf is not None
    return p.hf[: -len(".weight")]


# Modules stored as ``[V, D]`` matrices that are lookups, not linear maps: ``transformers``'
# ``nn.Embedding``, whose PEFT adapter is another layout (``lora_embedding_A``); not targets yet.
EMBEDDINGS = ("embed_tokens",)


def linear_weights(specs: Mapping[str, Param]) -> dict[str, Param]:
    """The parameters a LoRA adapter can target: trainable weights stored as one ``[out, in]``
    matrix per stacked index under a ``.weight`` key; not the embedding."""
    out = {}
    for path, p in specs.items():
        if p.hf is None or not p.hf.endswith(".weight") or not p.trainable:
            continue
        groups = p.hf_groups()
        if len(groups) != 2 or VOCAB in groups[1] or module_of(p).rsplit(".", 1)[-1] in EMBEDDINGS:
            continue
        out[path] = p
    return out


# PEFT's name for every linear module but the output head; here also not the MoE routers
# (``mlp.gate``), which ``transformers`` 5 makes router modules, not ``nn.Linear``, so PEFT's
# ``all-linear`` passes them by (name one as a target to adapt it).
ALL_LINEAR = "all-linear"
NOT_ALL_LINEAR = ("lm_head", "gate")


def _matches(module: str, target: str) -> bool:
    """PEFT's rule: the module's path is the target or ends with ``"." + target``."""
    return module == target or module.endswith("." + target)


def valid_targets(specs: Mapping[str, Param]) -> list[str]:
    """The module names a family's LoRA targets may use (each also accepted with more of its path)."""
    return sorted({module_of(p).rsplit(".", 1)[-1] for p in linear_weights(specs).values()})


def resolve_targets(specs: Mapping[str, Param], targets: Sequence[str], family: str = "this model",
                    field: str = "targets") -> dict[str, Param]:  # fmt: skip
    """The weights (zoo path -> parameter) that ``targets`` name (``("all-linear",)``: every
    linear weight but the output head and the routers, as PEFT's ``"all-linear"``); a name that names none is
    refused, naming it and the valid ones."""
    weights = linear_weights(specs)
    if tuple(targets) == (ALL_LINEAR,):
        targets = [t for t in valid_targets(specs) if t not in NOT_ALL_LINEAR]
    out: dict[str, Param] = {}
    for t in targets:
        if not isinstance(t, str) or not t or "{" in t:
            raise ConfigError(f"LoRA {field}: {t!r} is not a module name; valid for {family}: {valid_targets(specs)}")
        hit = {path: p for path, p in weights.items() if _matches(module_of(p), t)}
        if not hit:
            raise ConfigError(f"LoRA {field}: {t!r} names no linear weight of {family}; "
                              f"valid targets: {', '.join(valid_targets(specs))}")  # fmt: skip
        out.update(hit)
    return dict(sorted(out.items()))


def dims(p: Param, sizes: Mapping[str, int]) -> tuple[tuple[int, ...], int, int]:
    """(stacked sizes, out features, in features) of a linear weight's stored matrices."""
    out_group, in_group = p.hf_groups()
    return (tuple(sizes[a] for a in p.stacked), math.prod(sizes[a] for a in out_group),
            math.prod(sizes[a] for a in in_group))  # fmt: skip


class Adapter(eqx.Module):
    """One weight's low-rank update in PEFT's layout: ``delta = scale · b @ a`` per stored matrix."""

    a: Float[Array, "*S r i"]
    b: Float[Array, "*S o r"]


def adapter_params(p: Param) -> tuple[Param, Param]:
    """The descriptions of the adapter of weight ``p``: ``A [*stacked, r, i]`` and ``B
    [*stacked, o, r]`` under PEFT's keys. Laid out on a mesh as the weight is: by its stacked
    letters, and where its in (out) features are one letter of its own (``D``, ``F``), ``A``'s
    ``i`` (``B``'s ``o``) is that letter, split as the weight splits it (FSDP's and the tensor
    split's blocks); ``r``, and features of several letters (``(H K)``), whole."""
    out_group, in_group = p.hf_groups()
    stacked, module = " ".join(p.stacked), module_of(p)
    i = in_group[0] if len(in_group) == 1 else "i"
    o = out_group[0] if len(out_group) == 1 else "o"
    return (Param(axes=f"{stacked} r {i}".strip(), hf=peft_key(module, "A")),
            Param(axes=f"{stacked} {o} r".strip(), hf=peft_key(module, "B")))  # fmt: skip


def _held(p: Param, sizes: Mapping[str, int]) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """Inside the parallel step, per letter of ``p``'s in (out) features, the mesh axes whose
    block of it this device's ``A`` (``B``) holds (:func:`adapter_params`); empty elsewhere."""
    step = current_step()
    if step is None:
        return {}, {}
    held = []
    for q, at in zip(adapter_params(p), (-1, -2)):
        letter = q.names[at]
        axes = axis_names(param_axes(q, step.mesh, rules=step.rules, sizes=sizes)[at])
        held.append({letter: axes} if axes else {})
    return held[0], held[1]


def _as_block(x: Float[Array, "..."], dim: int, held: tuple[str, ...], want: tuple[str, ...]) -> Float[Array, "..."]:
    """``x`` holding on ``dim`` its block over mesh axes ``held`` -> its block over ``want``
    (as it is where they are the same: the layer scan's weights and adapters)."""
    if held == want:
        return x
    if held:
        x = jax.lax.all_gather(x, held, axis=dim, tiled=True)
    return block_of(x, dim, want)


def factors(p: Param, sizes: Mapping[str, int], adapter: Adapter, split: Mapping[str, tuple[str, ...]] | None = None
            ) -> tuple[Float[Array, "*S *o r"], Float[Array, "*S r *i"]]:  # fmt: skip
    """``B`` and ``A`` in float32 with each of the weight's out (in) feature letters a dimension
    of its own, ``p.hf_groups()``'s order; ``split``: per letter, the mesh axes that split it
    where this runs (inside the parallel step): the blocks of ``B`` and ``A`` a weight block
    split so needs (as held where they are the same; gathered, or cut, where not)."""
    out_group, in_group = p.hf_groups()
    split = split or {}
    held_a, held_b = _held(p, sizes)  # (a feature of one letter: the adapter's block of it, as laid out)
    b, a = adapter.b.astype(jnp.float32), adapter.a.astype(jnp.float32)
    b = b.reshape(*b.shape[:-2], *(sizes[x] for x in out_group), b.shape[-1]) if len(out_group) > 1 else b
    a = a.reshape(*a.shape[:-1], *(sizes[x] for x in in_group)) if len(in_group) > 1 else a
    n = a.ndim - 1 - len(in_group)  # leading (stacked) dimensions
    for j, x in enumerate(out_group):
        b = _as_block(b, n + j, held_b.get(x, ()), split.get(x, ()))
    for j, x in enumerate(in_group):
        a = _as_block(a, n + 1 + j, held_a.get(x, ()), split.get(x, ()))
    return b, a


def delta(p: Param, sizes: Mapping[str, int], adapter: Adapter, scale: float, lead: tuple[int, ...] | None = None,
          split: Mapping[str, tuple[str, ...]] | None = None) -> Float[Array, "*dims"]:  # fmt: skip
    """``scale · B A`` in the family's layout of ``p`` (its axes, stacked ones included), float32.
    ``lead``: of one layer's slice of the adapter instead (the layer axis gone), led by these
    sizes (none; or a view's, where the scan runs the stack reshaped). ``split``: per letter of
    the weight's out and in features, the mesh axes that split it where this runs (inside the
    parallel step): the block this device holds, from those blocks of ``B`` and ``A``."""
    out_group, in_group = p.hf_groups()
    b, a = factors(p, sizes, adapter, split)
    n = a.ndim - 1 - len(in_group)  # leading (stacked) dimensions
    no, ni, r = len(out_group), len(in_group), n + len(out_group) + len(in_group)
    d = scale * jnp.einsum(b, [*range(n + no), r], a, [*range(n), r, *range(n + no, n + no + ni)],
                           [*range(n + no + ni)], precision=jax.lax.Precision.HIGHEST)  # fmt: skip
    names, lead = (p.names, ()) if lead is None else (p.names[1:], lead)
    stacked = [x for x in p.stacked if x in names]
    order = stacked + out_group + in_group
    d = d.reshape(*lead, *d.shape[n - len(stacked) : n], *d.shape[n:])
    return d.transpose([*range(len(lead)), *(len(lead) + order.index(x) for x in names)])


def local_split(path: str, p: Param, sizes: Mapping[str, int], shape: tuple[int, ...]) -> dict[str, tuple[str, ...]]:
    """Per letter of ``p``'s out and in features, the mesh axes that split it in a weight of
    local ``shape`` (ending with ``p``'s letters; the layer axis may be gone): the step's layout
    (:func:`zoo.core.layout.param_axes`), less what the step gathered already (FSDP's axes, for
    a weight outside the layer stacks). Empty outside the parallel step."""
    step = current_step()
    if step is None:
        return {}
    axes = param_axes(p, step.mesh, rules=step.rules, sizes=sizes)
    gathered = gather_axes(p, axes, rules=step.rules)
    out = {}
    for i, letter in enumerate(p.names):
        j = len(shape) - len(p.names) + i
        if letter in p.stacked or j < 0 or shape[j] == sizes[letter]:
            continue
        laid = axis_names(axes[i])
        for cand in (laid, tuple(x for x in laid if x not in gathered[i])):
            if cand and shape[j] * axis_size(step.mesh, cand) == sizes[letter]:
                out[letter] = cand
                break
        else:
            raise ConfigError(f"LoRA on {path}: its {letter} ({sizes[letter]}) is {shape[j]} on this device, not a block "
                              f"of the mesh's layout {laid} (a padded layout is not supported: use a mesh that divides "
                              "the model)")  # fmt: skip
    return out


def _factors_for(path: str, p: Param, sizes: Mapping[str, int], adapter: Adapter) -> dropout.Factors:
    """For a weight of a given local shape, the blocks of ``adapter``'s factors it needs."""
    return lambda shape: factors(p, sizes, adapter, local_split(path, p, sizes, shape))


def _merged(path: str, w: Array, d: Array, frozen: bool) -> Array:
    if d.shape != w.shape:
        raise ConfigError(f"LoRA on {path}: the weight has shape {w.shape}, its adapter's update "
                          f"{d.shape} (a padded layout is not supported: use a mesh that divides the model)")  # fmt: skip
    w0 = jax.lax.stop_gradient(w) if frozen else w
    return (w0.astype(jnp.float32) + d).astype(w.dtype)


def on_device(tree: Any) -> Any:
    """A layer's arrays in device memory: those a run keeps in pinned host memory
    (``param_memory="pinned_host"``, which leaves a frozen base's layer stacks there through the
    step: :func:`place_unstreamed`) come over a layer at a time, where the layer scan reads them."""

    def move(x):
        host = "host" in str(getattr(jax.typeof(x), "memory_space", "")).lower()
        return jax.device_put(x, jax.memory.Space.Device) if host else x

    return jax.tree.map(move, tree)


class FrozenLayer(Deferred):
    """A frozen layer stack's weight that no adapter updates, read a layer at a time where the
    layer scan reads it (from host memory, where the run keeps the base there)."""

    w: Float[Array, "*dims"]

    def value(self) -> Float[Array, "*dims"]:
        return jax.lax.stop_gradient(on_device(self.w))


class LayerUpdate(Deferred):
    """A layer stack's weight and its adapter, merged a layer at a time where the layer scan
    reads them (:class:`zoo.core.params.Deferred`): one layer's merged weight, and in the
    backward pass one layer's gradient of it, exist at a time."""

    w: Float[Array, "*dims"] | Deferred  # a frozen weight, or what computes it (QLoRA's NF4 base)
    adapter: Adapter
    path: str = eqx.field(static=True)
    param: Param = eqx.field(static=True)
    sizes: tuple[tuple[str, int], ...] = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    # LoRA dropout's (zoo.lora.dropout): each layer's key, and the rate (no key: no dropout)
    key: UInt32[Array, "*L 2"] | None = None
    rate: float = eqx.field(static=True, default=0.0)

    def value(self) -> Float[Array, "*dims"]:
        """One layer's merged weight; inside the parallel step, the block of it this device
        holds (the FSDP gather comes after, on the merged block). With dropout, the term its
        product adds (:func:`zoo.lora.dropout.term`) is this layer's."""
        w = self.w.value() if isinstance(self.w, Deferred) else on_device(self.w)
        lead = w.shape[: w.ndim - (len(self.param.names) - 1)]
        sizes = dict(self.sizes)
        # With dropout, PEFT's path: the named product that reads the frozen weight adds
        # scale · B A drop(x) (zoo.lora.dropout.term). A view's slice of one layer (Qwen3's
        # repeats) holds it as [1, ...]; a body of several layers is refused, as is a clash of
        # two kinds' product names in one body (zoo.hooks.products). (Without dropout the
        # update stays merged: on one TPU v5e, Llama 3.2 1B shape, this path for every LoRA step
        # was 1.9% faster and 1.6% smaller, but 35% more temporaries on XLA:CPU and 19% over the
        # planner's walk, against 10%.)
        if self.key is not None:
            if math.prod(lead) != 1:
                raise ConfigError(f"LoRA dropout on {self.path}: the layer scan runs {math.prod(lead)} of its layers "
                                  "in one body, where dropout's path is not implemented yet: use dropout=0")  # fmt: skip
            adapter, key = jax.tree.map(lambda x: x.reshape(x.shape[len(lead):]), (self.adapter, self.key))
            term = dropout.term(self.path, self.param, _factors_for(self.path, self.param, sizes, adapter), self.scale,
                                self.rate, None if key is None else jr.wrap_key_data(key))  # fmt: skip
            add_term(self.param.matmul, term, f"LoRA on {self.path}")
            return jax.lax.stop_gradient(w)
        split = local_split(self.path, self.param, sizes, w.shape)
        d = delta(self.param, sizes, self.adapter, self.scale, lead=lead, split=split)
        return _merged(self.path, w, d, frozen=True)


class LoraModel(eqx.Module):
    """A base model and adapters on some of its weights, called as the base model is
    (``model(ids)``, ``loss``, ``forward``, ``prefill``, ``decode_step``): each call merges
    ``W + scale · B A`` into the weights and runs the base model, the base weights behind
    ``stop_gradient`` (gradients reach the adapters only). :func:`merge` gives the plain model."""

    base: CausalLM
    adapters: dict[str, Adapter]
    lora: LoraConfig = eqx.field(static=True)

    @property
    def config(self) -> Any:
        return self.base.config

    @property
    def compute_dtype(self) -> Any:
        return self.base.compute_dtype

    @property
    def placement_map(self) -> type:
        """The base model's (the adapted model's layers run the base's code, under its map)."""
        return type(self.base).placement_map

    def _with_deltas(self, frozen: bool, per_layer: bool = False) -> CausalLM:
        specs, sizes, scale = family_of(self.base).param_specs(self.base.config), self.base.config.sizes, self.lora.scale
        # LoRA dropout where a step gives a key (training), in a forward pass (zoo.lora.dropout)
        key = dropout.current_key() if per_layer and self.lora.dropout else None

        def leaf(at, w):
            path = path_name(at)
            deferred = isinstance(w, Deferred)  # a frozen weight given as what computes it (zoo.lora.nf4)
            if not deferred and not eqx.is_inexact_array(w):
                return w
            lazy = per_layer and frozen and is_layer_stack(specs[path]) if path in specs else False
            if path not in self.adapters:
                if deferred:
                    return w if lazy else w.stacked_value()
                if lazy:  # read by the layer scan a layer at a time (from host memory, where the base waits)
                    return FrozenLayer(w)
                return jax.lax.stop_gradient(w) if frozen else w
            p = specs[path]
            adapter = self.adapters[path]
            if lazy:  # merged by the layer scan, a layer at a time
                keys = None if key is None else dropout.layer_keys(key, path, adapter.a.shape[0])
                return LayerUpdate(w, adapter, path, p, tuple(sorted(sizes.items())), scale, keys, self.lora.dropout)
            w = w.stacked_value() if deferred else w
            if key is not None:  # dropping, outside the layer stacks: a term of the model call's scope
                term = dropout.term(path, p, _factors_for(path, p, sizes, adapter), scale, self.lora.dropout,
                                    dropout.weight_key(key, path))  # fmt: skip
                add_term(p.matmul, term, f"LoRA on {path}")
                return jax.lax.stop_gradient(w)
            split = local_split(path, p, sizes, w.shape)
            return _merged(path, w, delta(p, sizes, self.adapters[path], scale, split=split), frozen)

        return jax.tree_util.tree_map_with_path(leaf, self.base, is_leaf=lambda x: isinstance(x, Deferred))

    def adapted(self) -> CausalLM:
        """The base model with the adapters merged, its own weights frozen (``stop_gradient``)."""
        return self._with_deltas(frozen=True)

    def _scanned(self) -> CausalLM:
        """The base model for a forward pass: the layer stacks' adapted weights merged inside the
        layer scan, a layer at a time (:class:`LayerUpdate`), the others merged here."""
        return self._with_deltas(frozen=True, per_layer=True)

    def _terms(self) -> contextlib.AbstractContextManager:
        """The scope of the adapters' terms (zoo.hooks.products) for one call."""
        return products.scope()

    def __call__(self, input_ids: Int[Array, "B S"], **kw: Any) -> Float[Array, "B S V"]:
        with self._terms():
            return self._scanned()(input_ids, **kw)

    def forward(self, input_ids: Int[Array, "B S"], **kw: Any) -> tuple[Any, ...]:
        with self._terms():
            return self._scanned().forward(input_ids, **kw)

    def loss(self, input_ids: Int[Array, "B S"], **kw: Any) -> tuple[Float[Array, ""], dict[str, Array]]:
        with self._terms():
            return self._scanned().loss(input_ids, **kw)

    def unembedding(self) -> Float[Array, "V D"]:
        return self.adapted().unembedding()

    def merged(self) -> CausalLM:
        """The base model with the adapters folded in (:func:`merge`): what ``zoo.generate`` runs."""
        return merge(self)

    def layout_specs(self) -> dict[str, Param]:
        """Every array's description (:func:`param_specs`): how a mesh lays the model out."""
        return param_specs(self)

    def after_step(self, metrics: Mapping[str, Array], options: Any = None) -> LoraModel:
        return eqx.tree_at(lambda m: m.base, self, self.base.after_step(metrics, options))

    def init_cache(self, batch: int, max_len: int, **options: Any) -> eqx.Module:
        return self.base.init_cache(batch, max_len, **options)

    def prefill(self, input_ids: Int[Array, "B S"], lengths: Int[Array, " B"], **kw: Any) -> tuple[Any, eqx.Module]:
        return self.adapted().prefill(input_ids, lengths, **kw)

    def decode_step(self, cache: eqx.Module, tokens: Int[Array, " B"]) -> tuple[Float[Array, "B V"], eqx.Module]:
        return self.adapted().decode_step(cache, tokens)


def place_unstreamed(params: Any, place: Any) -> Any:
    """``params`` (a run state: a model's, or an adapted model's) with ``place`` applied to each
    array the step reads whole, and not to what the layer scan brings to the device a layer at a
    time: a quantized weight (its codes), and an adapted model's frozen layer-stack weights (the
    base of a run that keeps its parameters in pinned host memory stays there through the step)."""

    def each(tree: Any, keep: Any = lambda path: False) -> Any:
        def leaf(at, x):
            if is_deferred(x) or not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or keep(path_name(at)):
                return x
            return place(x)

        return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=is_deferred)

    if not isinstance(params, LoraModel):
        return each(params)
    specs = family_of(params.base).param_specs(params.base.config)
    base = each(params.base, lambda path: path in specs and is_layer_stack(specs[path]))
    return LoraModel(base=base, adapters=each(params.adapters), lora=params.lora)


def base_model(model: Any) -> CausalLM:
    """The family's model under an adapted one (``model`` itself when it has no adapters)."""
    return model.base if isinstance(model, LoraModel) else model


def merge(model: LoraModel) -> CausalLM:
    """The base model with ``W + scale · B A`` folded into its weights (in their dtype): a plain
    model of the family, which ``save_pretrained`` writes."""
    return model._with_deltas(frozen=False)


def _kaiming_uniform(key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int) -> Float[Array, "*dims"]:
    """``torch.nn.init.kaiming_uniform_(w, a=sqrt(5))`` (PEFT's ``lora_A``): U(-b, b) with
    ``b = gain · sqrt(3 / fan_in)``, ``gain = sqrt(2 / (1 + a²)) = sqrt(1/3)``, so ``b = 1 / sqrt(fan_in)``."""
    bound = 1.0 / math.sqrt(fan_in)
    return jr.uniform(key, shape, jnp.float32, -bound, bound)


def init(model: CausalLM, config: LoraConfig, *, key: PRNGKeyArray, dtype=jnp.float32) -> LoraModel:
    """Fresh adapters on the weights ``config.targets`` name, as PEFT starts them: ``A``
    Kaiming-uniform (``a = sqrt(5)``), ``B`` zeros (so the adapted model is the base model)."""
    if isinstance(model, LoraModel):
        raise ConfigError("LoRA: the model already has adapters (merge them first: zoo.lora.merge)")
    family = family_of(model)
    specs, sizes = family.param_specs(model.config), model.config.sizes
    chosen = resolve_targets(specs, config.targets, family.__name__)
    keys = jr.split(key, len(chosen))
    adapters = {}
    for k, (path, p) in zip(keys, chosen.items()):
        stacked, n_out, n_in = dims(p, sizes)
        if config.r > min(n_out, n_in):  # B A would not be low-rank: a full update with extra parameters
            raise ConfigError(f"LoRA r={config.r} is larger than {path}'s weight ({n_out} out x {n_in} in features): "
                              f"use r <= {min(n_out, n_in)} or leave it out of the targets")  # fmt: skip
        a = _kaiming_uniform(k, (*stacked, config.r, n_in), n_in).astype(dtype)
        adapters[path] = Adapter(a=a, b=jnp.zeros((*stacked, n_out, config.r), dtype))
    return LoraModel(base=model, adapters=adapters, lora=config)


def param_specs(model: LoraModel) -> dict[str, Param]:
    """The parameter description of an adapted model, by its pytree paths (``base.<path>``,
    ``adapters.['<path>'].a``): the base's parameters ``trainable=False`` (no gradient, no
    optimizer state), the adapters' trainable weight matrices (``init="normal"``: decayed as
    weight matrices are; :func:`init` makes them, not ``init_params``), under PEFT's keys
    (:mod:`zoo.lora.peft` writes them), laid out on a mesh as their weight is
    (:func:`adapter_params`). A weight the base holds as what computes it (QLoRA's NF4 codes and
    scales: :mod:`zoo.lora.nf4`) is described by its fields' frozen parameters
    (``base.<path>.packed``, ...)."""
    base = family_of(model.base).param_specs(model.base.config)
    held = jax.tree_util.tree_flatten_with_path(model.base, is_leaf=is_deferred)[0]
    deferred = {path_name(at): x for at, x in held if is_deferred(x)}
    out = {}
    for k, p in base.items():
        if k in deferred:
            out.update({f"base.{k}.{f}": q for f, q in deferred[k].field_params().items()})
        else:
            out[f"base.{k}"] = dataclasses.replace(p, trainable=False)
    for name in model.adapters:
        a, b = adapter_params(base[name])
        out[f"adapters.{jax.tree_util.DictKey(name)}.a"], out[f"adapters.{jax.tree_util.DictKey(name)}.b"] = a, b
    return out


def trainable_labels(model: LoraModel) -> LoraModel:
    """``"train"`` on every adapter array, ``"frozen"`` on every base parameter: the labels of
    :func:`optimizer`'s ``optax.multi_transform``."""
    return LoraModel(base=jax.tree.map(lambda _: "frozen", model.base),
                     adapters=jax.tree.map(lambda _: "train", model.adapters), lora=model.lora)  # fmt: skip


def check_trainable(model: Any, *, mesh: Any = None) -> None:
    """Refuse what zoo.train cannot honour yet: a model with quantized weights but no adapters
    (its base is frozen: only adapters train on it), LoRA dropout on a weight that no named
    product reads (routed experts), and an adapted or quantized
    weight that the mesh pads. Adapters train on any mesh: laid out as their weight is (layers
    over ``pipeline``, experts over ``expert``, a feature of one letter as the weight splits
    it: :func:`adapter_params`), each device merging the block of the update its weight's block
    needs; a quantized base's codes split over the mesh, each device gathering a layer's,
    dequantizing it and taking its block. A placement map places the
    base model's named tensors; host memory holds the whole tree (base, quantized codes too,
    adapters and their moments) between steps."""
    if isinstance(model, LoraConfig):  # its first argument was the config until 2026-12-05
        raise TypeError("zoo.lora.check_trainable takes the model (a LoraModel, or a model without adapters), "
                        "not its LoraConfig")  # fmt: skip
    if not isinstance(model, LoraModel):
        if any(is_deferred(x) for x in jax.tree.leaves(model, is_leaf=is_deferred)):
            raise ConfigError("the model holds quantized weights (zoo.lora.nf4 / zoo.lora.int8), which are frozen: "
                              "train LoRA adapters on it (zoo.lora.init), or train zoo.lora.quantized.dequantized(model)")  # fmt: skip
        return
    config = model.lora
    if config.dropout:  # (its path is the product that reads the weight: zoo.lora.dropout)
        specs = family_of(model.base).param_specs(model.base.config)
        for path in (x for x in model.adapters if specs[x].matmul is None):
            raise ConfigError(f"LoRA dropout {config.dropout} on {path}: the weight is not read by a named projection "
                              f"(a routed expert's grouped products), where dropout has no input of its own to drop "
                              f"(PEFT's lora.ParamWrapper, which adapts fused experts, refuses lora_dropout too): use "
                              f"dropout=0, or leave {module_of(specs[path]).rsplit('.', 1)[-1]} out of the targets")  # fmt: skip
    if mesh is None or mesh.size == 1:
        return
    config = model.base.config
    family = family_of(model.base)
    sizes, laid = config.sizes, layout_sizes(config, mesh)
    specs, rules = family.param_specs(config), family.config_cls.axis_rules
    for path in model.adapters:  # an update is merged into the weight's block as it is: not into padding
        for letter in (a for g in specs[path].hf_groups() for a in g if laid[a] != sizes[a]):
            raise ConfigError(f"LoRA on {path}: this mesh pads its {letter} ({rules[letter].field} {sizes[letter]} "
                              f"-> {laid[letter]}), which adapters do not support yet: use a mesh whose "
                              f"{rules[letter].mesh_axis} divides {sizes[letter]}, or leave {module_of(specs[path]).rsplit('.', 1)[-1]} "
                              "out of the targets")  # fmt: skip
    held = jax.tree_util.tree_flatten_with_path(model.base, is_leaf=is_deferred)[0]
    for path in (path_name(at) for at, x in held if is_deferred(x)):  # a quantized weight's codes are not padded
        for letter in (a for a in specs[path].names if laid[a] != sizes[a]):
            raise ConfigError(f"QLoRA: this mesh pads {path}'s {letter} ({rules[letter].field} {sizes[letter]} -> "
                              f"{laid[letter]}), which a quantized base does not support: use a mesh whose "
                              f"{rules[letter].mesh_axis} divides {sizes[letter]}")  # fmt: skip
