"""Per-device memory of one training step: estimated from shapes, or measured by XLA."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Unpack

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from zoo import hooks, parallel
from zoo.lora import base_model
from zoo.loss import chunked_cross_entropy
from zoo.placement import placement_map_for
from zoo.plan import _liveness, collectives
from zoo.plan._step import SDS, Step, StepOptions, layer_stacks, make_step, mesh_spec, stack_bytes

GiB = 2**30


@dataclass(frozen=True)
class Estimate:
    """Per-device bytes of one training step (AdamW, one micro-batch), and what they are.

    ``device_bytes`` / ``host_bytes`` are the totals: the step's arguments (parameters,
    optimizer state, the batch) plus its peak temporaries, outputs aliasing the arguments they
    replace. The parts say what is inside them; they are not a partition of the peak (the
    gradients and the residuals are live together in the backward pass, the gradients and the
    optimizer's temporaries in the update).
    """

    model: str
    batch_size: int
    seq_len: int
    placement: str
    mesh: str
    param_memory: str
    opt_memory: str
    params: int  # parameters (in param_memory)
    gradients: int  # one per parameter, live through the backward pass (device)
    optimizer: int  # AdamW's moments and counts (in opt_memory)
    batch: int  # the token ids and the step's metrics
    residuals: dict[str, tuple[int, int]]  # named tensor -> (device, host) bytes over every layer
    layer: int  # the transient peak of one layer's backward pass (a loop body), beyond its inputs
    loss: int  # the loss head's own peak: one chunk of float32 logits and the gradients it keeps
    temporaries: int  # the step's device temporaries at their peak, packed
    host_temporaries: int  # the step's pinned-host temporaries at their peak (offloaded residuals)
    device_bytes: int
    host_bytes: int
    source: str = "estimate"  # or "measure"
    notes: tuple[str, ...] = field(default=())
    # Device temporaries of the forward and backward passes and of the update, each at its
    # own peak (the estimate's; ``temporaries`` is the larger, packed).
    passes: int = 0
    update: int = 0
    # A measurement's estimate of the same traced program (None for an estimate).
    predicted: Estimate | None = None
    # A measurement's ``peak_memory_in_bytes`` per device, XLA's own (0 for an estimate). On
    # XLA:TPU it is the figure to read: its temporaries leave out buffers the peak holds (0 bytes
    # for a pipelined step whose peak is 45.8 MiB: benchmarks/one_f_one_b.py), and it is what a
    # step must fit (one whose device_bytes are 3.6 GiB over the chip runs:
    # benchmarks/results/tpu-v5e-2026-12-07.md).
    peak_bytes: int = 0
    # A measurement's collective bytes per device in XLA's compiled program, per (kind, mesh
    # axes) (:func:`zoo.plan.collectives.hlo_traffic`: its while loops times their trip counts);
    # empty for an estimate.
    collectives: Mapping[tuple[str, tuple[str, ...]], int] = field(default_factory=dict)

    @property
    def residual_device(self) -> int:
        return sum(d for d, _ in self.residuals.values())

    @property
    def residual_host(self) -> int:
        return sum(h for _, h in self.residuals.values())

    def table(self) -> str:
        """The breakdown as aligned text, GiB per device."""

        def g(b: int) -> str:
            return f"{b / GiB:9.3f}"

        head = (
            f"{self.source} per device: {self.model}, batch {self.batch_size} x {self.seq_len} tokens, "
            f"mesh {self.mesh or 'one device'}, placement {self.placement}"
        )
        rows = [
            head,
            f"  parameters ({self.param_memory:11s})  {g(self.params)} GiB",
            f"  optimizer  ({self.opt_memory:11s})  {g(self.optimizer)} GiB",
            f"  gradients                {g(self.gradients)} GiB",
            f"  batch and metrics        {g(self.batch)} GiB",
            f"  residuals on device      {g(self.residual_device)} GiB",
            f"  residuals on host        {g(self.residual_host)} GiB",
            f"  one layer's transient    {g(self.layer)} GiB",
            f"  loss head                {g(self.loss)} GiB",
            f"  device temporaries       {g(self.temporaries)} GiB (peak, gradients and residuals included)",
            f"  device total             {g(self.device_bytes)} GiB",
            f"  host total               {g(self.host_bytes)} GiB",
        ]
        for name, (d, h) in sorted(self.residuals.items(), key=lambda kv: -sum(kv[1])):
            if d or h:
                rows.append(f"    {name:22s} device {g(d)}  host {g(h)} GiB")
        rows += [f"  note: {n}" for n in self.notes]
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def _model_type(cfg: Any) -> str:
    kind = getattr(cfg, "model_type", None)
    return f"{kind}, " if isinstance(kind, str) else ""


def _describe(step: Step) -> dict[str, Any]:
    cfg = step.config
    return {
        # A config spelling several model types (Qwen3's dense and MoE) says which it is.
        "model": f"{type(cfg).__name__}({_model_type(cfg)}{cfg.num_params() / 1e9:.3g}B params, "
        f"{jnp.dtype(step.model.compute_dtype).name} compute)",
        "batch_size": step.batch_size,
        "seq_len": step.seq_len,
        "placement": "none (XLA keeps what the backward pass uses)"
        if step.placement is None
        else step.placement.spec(),
        "mesh": mesh_spec(step.sizes),
        "param_memory": step.param_memory,
        "opt_memory": step.opt_memory,
    }


def _loss_peak(step: Step, unified: bool) -> int:
    """The chunked loss head's own peak, traced on the per-device features (zoo/loss.py): with
    the vocabulary split over the mesh, inside ``shard_map`` as the step runs it (the head
    streamed a block of rows at a time, zoo/vocab_parallel.py)."""
    model = base_model(step.model)  # a LoRA model's head is its base's
    dtype, vocab = model.compute_dtype, model.config.vocab_size
    d = model.config.sizes["D"]
    b, s = step.local_batch, step.seq_len - 1
    split = parallel.vocab_split_of(model, step.mesh)

    def loss(x, w, labels):
        return chunked_cross_entropy(x, w.astype(dtype), labels, vocab_size=vocab)

    if split is None:

        def f(m, x, labels):
            return jax.value_and_grad(loss, argnums=(0, 1))(x, m.unembedding(), labels)

        jaxpr = jax.make_jaxpr(f)(step.params, SDS((b, s, d), dtype), SDS((b, s), jnp.int32))
    else:
        n = step.batch_size // step.local_batch

        def local(x, w, labels):
            with hooks.step_context(step.mesh, {}, split):
                return jax.value_and_grad(loss, argnums=(0, 1))(x, w, labels)

        batch, head = PartitionSpec(step.axes), PartitionSpec(split.spec)
        f = jax.shard_map(local, mesh=step.mesh, in_specs=(batch, head, batch),
                          out_specs=(PartitionSpec(), (batch, head)))
        w = jax.eval_shape(lambda m: m.unembedding(), step.params)
        jaxpr = jax.make_jaxpr(f)(SDS((b * n, s, d), dtype), SDS(w.shape, w.dtype), SDS((b * n, s), jnp.int32))
    peak, _ = _liveness.program_peak(jaxpr, unified=unified)
    return peak.device


def _from_step(step: Step, *, unified: bool, jaxpr: Any = None) -> Estimate:
    jaxpr = step.trace() if jaxpr is None else jaxpr
    peak, bodies = _liveness.program_peak(
        jaxpr, arg_divisors=step.arg_divisors(), unified=unified, shape_div=step.shape_divisors()
    )
    params = step.per_device(step.params)
    opt = step.per_device(step.opt)
    batch = step.local_batch * step.seq_len * 4 + 64  # int32 ids, the index and a few metrics
    named = stack_bytes(layer_stacks(jaxpr))
    fields = set(placement_map_for(step.model).names())
    residuals: dict[str, tuple[int, int]] = {}
    for name, nbytes in named.items():
        if name not in fields:
            continue  # a name of the step's own (zoo.hooks: FSDP's gathered weights, never saved)
        where = "device" if step.placement is None else getattr(step.placement, name, "device")
        if where == "pinned_host" and unified:
            where = "device"
        residuals[name] = (nbytes if where == "device" else 0, nbytes if where == "pinned_host" else 0)
    host_args = (params if step.param_memory == "pinned_host" else 0) + (opt if step.opt_memory == "pinned_host" else 0)
    dev_args = params + opt - host_args
    notes = []
    if unified:
        notes.append("one memory for host and device (XLA:CPU): transfers are no-ops, offloaded residuals stay in it")
        dev_args, host_args = params + opt, 0
    return Estimate(
        **_describe(step),
        params=params,
        gradients=step.gradient_bytes(),
        optimizer=opt,
        batch=batch,
        residuals=residuals,
        layer=bodies[0].device if bodies else 0,
        loss=_loss_peak(step, unified),
        temporaries=peak.device,
        host_temporaries=peak.host,
        device_bytes=dev_args + batch + peak.device,
        host_bytes=host_args + peak.host,
        notes=tuple(notes),
        passes=round(peak.passes * peak.device / max(peak.live, 1)),
        update=round(peak.update * peak.device / max(peak.live, 1)),
    )


def estimate(
    model_or_config: Any, *, batch_size: int, seq_len: int, unified_memory: bool = False, **options: Unpack[StepOptions]
) -> Estimate:
    """Per-device bytes of one training step, from shapes alone (nothing allocated, no device
    needed): the step is traced on an abstract mesh and its temporaries found by a liveness
    walk of the traced program (``zoo/plan/_liveness.py``).

    ``model_or_config``: a model (its arrays' shapes are used) or a config (built abstractly
    in ``compute_dtype``, default float32). ``batch_size``: the global batch, split over the
    mesh's ``data``, ``fsdp`` and ``expert`` axes. ``options``: ``placement``, ``mesh`` (``None``,
    a spec ``"data=9,fsdp=8"``, a mapping or a mesh), ``param_memory``, ``opt_memory``,
    ``compute_dtype`` (:class:`~zoo.plan._step.StepOptions`). ``unified_memory``: count as
    XLA:CPU does, host and device one memory (what :func:`measure` sees on CPU).
    """
    step = make_step(model_or_config, batch_size=batch_size, seq_len=seq_len, **options)
    return _from_step(step, unified=unified_memory)


def measure(
    model_or_config: Any, *, batch_size: int, seq_len: int, compiler_options: Mapping[str, Any] | None = None,
    devices: Sequence[Any] | None = None, **options: Unpack[StepOptions],
) -> Estimate:
    """The same figures from XLA: the step compiled on the devices present (the mesh must fit
    them; ``devices``: these instead, e.g. a TPU topology's, ``jax.experimental.topologies``, for
    chips that are not present), its ``memory_analysis()`` per device: arguments + outputs +
    temporaries - aliases, device and host, XLA's own peak (``peak_bytes``) and the program's
    collective bytes (``collectives``). Nothing is run.

    What XLA:CPU counts: one memory (``unified``); offloaded residuals and parameters in
    pinned host memory are among the device figures, and no host figure is reported. The
    residual and layer parts are the estimate's (XLA reports totals only), and ``predicted`` is
    the whole estimate of the same traced program (``unified`` on CPU)."""
    step = make_step(model_or_config, batch_size=batch_size, seq_len=seq_len, **options)
    jaxpr, compiled = step.compile(compiler_options, devices)
    m = compiled.memory_analysis()
    device = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    host = (
        m.host_argument_size_in_bytes + m.host_output_size_in_bytes + m.host_temp_size_in_bytes
        - m.host_alias_size_in_bytes
    )  # fmt: skip
    platform = (jax.devices() if devices is None else devices)[0].platform
    est = _from_step(step, unified=platform == "cpu", jaxpr=jaxpr)
    notes = [f"XLA:{platform.upper()} memory_analysis of the compiled step"]
    if platform == "cpu":
        notes.append("XLA:CPU has one memory: host arguments, offloaded residuals and transfers count as device")
    return dataclasses.replace(
        est,
        temporaries=m.temp_size_in_bytes,
        host_temporaries=m.host_temp_size_in_bytes,
        device_bytes=device,
        host_bytes=host,
        source="measure",
        notes=tuple(notes),
        predicted=est,
        peak_bytes=int(getattr(m, "peak_memory_in_bytes", 0) or 0),
        collectives=collectives.hlo_traffic(compiled.as_text(), step.sizes),
    )
