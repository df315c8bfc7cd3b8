"""Argument types for the command line: numbers are checked where they are parsed, so a bad
value is one clear usage error (`--steps must be a positive integer, got -1`) instead of an
exception from deep inside a run."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "a non-negative integer")


def positive_float(text: str) -> float:
    return _number(text, float, lambda v: 0 < v < math.inf, "a positive number")


def non_negative_float(text: str) -> float:
    return _number(text, float, lambda v: 0 <= v < math.inf, "a non-negative number")


ACTIVATION_BUDGET_HELP = (
    "activation recomputation: keep about this share (0 < B <= 1) of the activations the backward reads and recompute the "
    "rest in the backward (aot_autograd's min-cut partition under the budget; default: keep them all)"
)


def budget(text: str) -> float:
    """A share in (0, 1]: `--activation-memory-budget`."""
    return _number(text, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def _number(text: str, kind, ok, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value
