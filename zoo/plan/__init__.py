"""Memory planning for training: how much one step needs per device, and where to put what.

- :func:`estimate`: per-device bytes of one training step from abstract shapes alone.
- :func:`measure`: the same figures from XLA's ``memory_analysis()`` of the compiled step.
- :func:`plan`: the placement map and batch that train fastest within device and host budgets.
- :func:`price`: the same cost model's figures for maps of your choosing.
- :data:`HARDWARE` / :func:`hardware`: the accelerators the cost model knows.

Reference: ``docs/planning.md``.
"""

from zoo.hardware import HARDWARE, Hardware, hardware
from zoo.plan._step import StepOptions
from zoo.plan.estimate import Estimate, estimate, measure
from zoo.plan.planner import Candidate, NothingFits, Plan, candidate_table, plan, price

__all__ = [
    "HARDWARE", "Candidate", "Estimate", "Hardware", "NothingFits", "Plan", "StepOptions", "candidate_table", "estimate", "hardware",
    "measure", "plan", "price",
]  # fmt: skip

