"""What the recipes' command lines share: a ``--help`` that shows the module's text as written
and each flag's default, and flag value types that refuse a bad value in argparse's one line."""

from __future__ import annotations

import argparse
import math


class Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help with the module's text as written and each flag's default (those that have one,
    where its help does not already say)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default in ("", [], argparse.SUPPRESS)
        if unset or "default" in text:
            return text
        return super()._get_help_string(action) or ""


def positive(text: str) -> float:
    """A flag's value that must be a finite number > 0 (a learning rate, a clip norm)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """A flag's value that must be a whole number >= 1 (a row or token count)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
