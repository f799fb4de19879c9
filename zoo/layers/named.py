"""Kept for code that imports named tensors from here: they live in :mod:`zoo.core.named`."""

from zoo.core.named import named, region  # noqa: F401
