"""Kept for code that imports the parameter description from here: it lives in
:mod:`zoo.core.params` (``init_arrays``, which lays arrays out on a mesh, in :mod:`zoo.core.layout`)."""

from zoo.core.layout import init_arrays  # noqa: F401
from zoo.core.params import *  # noqa: F403
from zoo.core.params import Param, build, flatten, init_params, init_with_stacks, is_param, map_params  # noqa: F401
