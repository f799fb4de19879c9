"""The accelerator table, now :mod:`zoo.hardware` (below ``zoo.train``, which reads it too):
kept for old imports of ``zoo.plan.hardware``."""

from typing import Any

import zoo.hardware
from zoo.hardware import CALIBRATED_EFFICIENCY, GB, HARDWARE, Hardware, for_device, hardware, measure_host_link

__all__ = ["CALIBRATED_EFFICIENCY", "GB", "HARDWARE", "Hardware", "for_device", "hardware", "measure_host_link"]


def __getattr__(name: str) -> Any:
    """The module's other names (its private constants) from :mod:`zoo.hardware` too."""
    if name.startswith("__") or not hasattr(zoo.hardware, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(zoo.hardware, name)
