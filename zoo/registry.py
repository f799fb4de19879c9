"""Kept for code that imports the registry from here: it lives in :mod:`zoo.core.registry`."""

from zoo.core.registry import *  # noqa: F403
from zoo.core.registry import FAMILY_PACKAGES, by_model_type, families, family_of, is_model, model_types, register  # noqa: F401
