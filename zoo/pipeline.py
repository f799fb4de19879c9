"""Kept for code that imports the pipeline from here: the in-step schedules live in
:mod:`zoo.hooks.pipeline`, laying stacks out in stage order (:func:`to_stage_order`) in
:mod:`zoo.parallel.place`."""

from zoo.hooks.pipeline import *  # noqa: F403
from zoo.hooks.pipeline import bubble, per_layer_to_stored, pipelined_scan, stacks_in_stage_order, stage_order  # noqa: F401
from zoo.parallel.place import reorder_stacks, to_stage_order  # noqa: F401
