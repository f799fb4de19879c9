"""The accelerator table, now :mod:`zoo.hardware` (below ``zoo.train``, which reads it too):
kept for old imports of ``zoo.plan.hardware``.

``zoo.plan.hardware`` is also the function :func:`zoo.hardware.hardware`; importing this module
makes Python bind the module to that attribute of ``zoo.plan``, so the module is callable as the
function is, and old code calling ``zoo.plan.hardware("h100")`` works in either order."""

import sys
import types
from typing import Any

import zoo.hardware
from zoo.hardware import CALIBRATED_EFFICIENCY, GB, HARDWARE, Hardware, for_device, hardware, measure_host_link

__all__ = ["CALIBRATED_EFFICIENCY", "GB", "HARDWARE", "Hardware", "for_device", "hardware", "measure_host_link"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Hardware:
        return hardware(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """The module's other names (its private constants) from :mod:`zoo.hardware` too."""
        if name.startswith("__") or not hasattr(zoo.hardware, name):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        return getattr(zoo.hardware, name)


sys.modules[__name__].__class__ = _CallableModule
