"""The benchmarks' option types: argparse refuses a bad value with a message that names the option
and the values it takes, instead of a script measuring something else (a default put in place of
a zero, a thread count left as it was, an empty table).

    parser.add_argument("--repeat", type=at_least(1), default=7)
"""

from __future__ import annotations

import argparse
import math


def at_least(minimum: int, multiple_of: int = 1):
    """An argparse type: an integer >= minimum (and a multiple of ``multiple_of``)."""
    allowed = f"an integer >= {minimum}" + (
        f" and a multiple of {multiple_of}" if multiple_of > 1 else ""
    )

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if value < minimum or value % multiple_of:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value

    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def counts(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1 ("64,4096")."""
    one = at_least(1)
    try:
        return [one(item) for item in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated integers >= 1, got {text!r}"
        ) from None


def shapes(text: str) -> list[tuple[int, int, int]]:
    """An argparse type: comma-separated MxNxK shapes of positive integers ("512x512x512")."""
    found = []
    for item in text.split(","):
        try:
            m, n, k = (int(v) for v in item.lower().split("x"))
        except ValueError:
            m = n = k = 0
        if min(m, n, k) < 1:
            raise argparse.ArgumentTypeError(
                f"must be comma-separated MxNxK shapes of integers >= 1, got {item!r}"
            )
        found.append((m, n, k))
    return found
