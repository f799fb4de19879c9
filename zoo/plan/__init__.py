"""Memory planning for training: how much one step needs per device, and where to put what.

- :func:`estimate`: per-device bytes of one training step from abstract shapes alone.
- :func:`measure`: the same figures from XLA's ``memory_analysis()`` of the compiled step.
- :func:`plan`: the placement map and batch that train fastest within device and host budgets.
- :func:`price`: the same cost model's figures for maps of your choosing.
- :data:`HARDWARE` / :func:`hardware`: the accelerators the cost model knows.

Reference: ``docs/planning.md``.
"""

# The table's old module loaded first: loading zoo.plan.hardware sets this package's attribute
# ``hardware`` to that module, and the function imported below must replace it (as it did when
# the table lived there), not be replaced by it when someone imports the old module later.
from zoo.plan import hardware as _old_hardware_module

# isort: split
from zoo.hardware import HARDWARE, Hardware, hardware
from zoo.plan._step import StepOptions
from zoo.plan.estimate import Estimate, estimate, measure
from zoo.plan.planner import Candidate, NothingFits, Plan, candidate_table, plan, price

__all__ = [
    "HARDWARE", "Candidate", "Estimate", "Hardware", "NothingFits", "Plan", "StepOptions", "candidate_table", "estimate", "hardware",
    "measure", "plan", "price",
]  # fmt: skip

del _old_hardware_module
