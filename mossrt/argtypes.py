"""Argument types that bound every size a user can give on the command line (clear errors, exit 2)."""

from __future__ import annotations

import argparse
import math


def int_in(lo: int, hi: int):
    """An integer in ``lo..hi``."""
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in {lo}..{hi}, got {text}")
        return value
    parse.__name__ = "integer"
    return parse


def finite_float(text: str) -> float:
    """A finite number (range checks belong to the engine's settings validation)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return value


# integers the engine range-checks itself; this bound only keeps them machine-sized
any_int = int_in(-(1 << 62), 1 << 62)
