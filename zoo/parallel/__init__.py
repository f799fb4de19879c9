"""Pipeline, data, FSDP, tensor, expert and context parallelism: one device mesh, one ``jax.shard_map`` step.

What a mesh does around the step: :mod:`zoo.parallel.mesh` builds it (and joins a multi-host
job), :mod:`zoo.parallel.place` puts models and optimizer state on it, :mod:`zoo.parallel.step`
runs the loss and its gradient under ``jax.shard_map``. The mesh always has the six axes of
:data:`AXES` (size 1 when unused). Where each parameter lives is derived from the model's own
parameter description (:mod:`zoo.core.layout`, re-exported here), never written per model.
Model code never imports this package: inside the step it calls :mod:`zoo.hooks`.
"""

from zoo.core.layout import (
    StageOrdered,
    gather_axes,
    init_arrays,
    is_padded,
    layout_sizes,
    pad,
    param_axes,
    param_shardings,
    partition_specs,
    unpad,
    validate_mesh,
)
from zoo.core.mesh import AXES, BATCH_AXES, PIPELINE, WEIGHT_SHARDS, axis_names, check_axis, parse_mesh
from zoo.errors import MeshError
from zoo.hooks.step import GATHERED, gather_layer, in_step, remat_policy, sum_to_varying_of, tensor_psum, varying_like
from zoo.layers.moe import routed_experts
from zoo.parallel.mesh import initialize_distributed, make_mesh
from zoo.parallel.place import init_optimizer, param_bytes, reorder_stacks, replicate_unplaced, shard, to_stage_order
from zoo.parallel.step import pipeline_split_of, value, value_and_grad, vocab_split_of

__all__ = [
    "AXES", "BATCH_AXES", "GATHERED", "PIPELINE", "WEIGHT_SHARDS", "MeshError", "StageOrdered", "axis_names", "check_axis",
    "gather_axes", "gather_layer", "in_step",
    "init_arrays", "init_optimizer", "initialize_distributed", "is_padded", "layout_sizes", "make_mesh", "pad",
    "param_axes", "param_bytes", "param_shardings", "parse_mesh", "partition_specs", "pipeline_split_of",
    "remat_policy", "reorder_stacks", "replicate_unplaced", "routed_experts", "shard", "sum_to_varying_of", "tensor_psum",
    "to_stage_order", "unpad", "validate_mesh", "value", "value_and_grad", "varying_like", "vocab_split_of",
]  # fmt: skip
