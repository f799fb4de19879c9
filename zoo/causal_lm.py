"""Kept for code that imports the protocol from here: it lives in :mod:`zoo.core.protocol`
(``check_attention`` in :mod:`zoo.layers.attention`, ``positions_for`` in :mod:`zoo.layers.embed`)."""

from zoo.core.protocol import *  # noqa: F403
from zoo.core.protocol import AxisRule, CausalLM, ModelConfig, NoTrainingOptions, VOCAB  # noqa: F401
from zoo.core.protocol import check_positive, options_or_default  # noqa: F401
from zoo.layers.attention import check_attention  # noqa: F401
from zoo.layers.embed import positions_for  # noqa: F401
