"""Kept for code that imports the vocabulary-split embedding and head from here: they live in
:mod:`zoo.hooks.vocab`."""

from zoo.hooks.vocab import *  # noqa: F403
from zoo.hooks.vocab import CHUNK_BYTES, embed, gather, weighted_nll_sum  # noqa: F401
