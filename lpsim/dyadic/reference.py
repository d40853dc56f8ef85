"""An exact, slow oracle for lpsim.dyadic, in Python integers and fractions (tests and debugging).

Every function works on values, not bits: a shift by k is the rational v / 2**k, a quotient is
n / d, and one function decides how a rational becomes an integer. The random words are those of
lpsim.reference.random_word (Philox4x32-10 written from the published algorithm). Nothing here
shares code with the kernels, which compute the same functions with shifts and masks.
"""

from __future__ import annotations

import math
from fractions import Fraction

from lpsim.reference import random_word
from lpsim.rounding import MAX_RBITS, Rounding

__all__ = ["round_rational", "requantize_value", "word_of", "elementwise", "matmul"]


def round_rational(x: Fraction, rule: Rounding, word: int = 0, rbits: int = MAX_RBITS) -> int:
    """The integer the rule makes of x: with q = floor(x) and frac = x - q,
    down: q; nearest: q + 1 iff frac > 1/2 or (frac = 1/2 and q odd);
    stochastic: q + 1 iff floor(frac * 2**rbits) + (word >> (32 - rbits)) >= 2**rbits, the
    decision lpsim.reference makes for the float and fixed formats."""
    q = math.floor(x)
    frac = x - q
    if rule is Rounding.down:
        return q
    if rule is Rounding.nearest:
        half = Fraction(1, 2)
        return q + (frac > half or (frac == half and q % 2 == 1))
    if rule is Rounding.stochastic:
        return q + (math.floor(frac * 2**rbits) + (word >> (MAX_RBITS - rbits)) >= 2**rbits)
    raise ValueError(f"no integer rounding {rule!r}")


def requantize_value(
    v: int, k: int, lo: int, hi: int, rule: Rounding, word: int = 0, rbits: int = MAX_RBITS
) -> tuple[int, bool]:
    """(clip(round(v / 2**k), lo, hi), whether the clip fired), for any integer k."""
    r = round_rational(Fraction(v) / Fraction(2) ** k, rule, word, rbits)
    return min(max(r, lo), hi), not lo <= r <= hi


def word_of(rule: Rounding, seed: int | None, offset: int, index: int) -> int:
    """The random word element ``index`` uses (0 for the rules that draw none)."""
    return random_word(seed, offset, index) if rule is Rounding.stochastic else 0


def elementwise(
    op: str,
    a: list[int],
    b: list[int],
    shift_a: list[int],
    shift_b: list[int],
    rule: Rounding,
    seed: int | None = None,
    offset: int = 0,
    rbits: int = MAX_RBITS,
) -> list[int]:
    """The exact results of the elementwise kernels on flat lists, before any range check:
    "add"/"sub": round(a / 2**shift_a) +/- round(b / 2**shift_b) (the finer operand shifted);
    "mul": round(a b / 2**shift_a); "div": round(a 2**shift_a / b). Shifts are per element."""
    out = []
    for i, (x, y, ka, kb) in enumerate(zip(a, b, shift_a, shift_b)):
        w = word_of(rule, seed, offset, i)
        if op in ("add", "sub"):
            u = round_rational(Fraction(x, 2**ka), rule, w, rbits)
            v = round_rational(Fraction(y, 2**kb), rule, w, rbits)
            out.append(u + v if op == "add" else u - v)
        elif op == "mul":
            out.append(round_rational(Fraction(x * y, 2**ka), rule, w, rbits))
        elif op == "div":
            out.append(round_rational(Fraction(x * 2**ka, y), rule, w, rbits))
        else:
            raise ValueError(f"no elementwise op {op!r}")
    return out


def matmul(a: list[list[int]], b: list[list[int]], columns: int) -> list[list[int]]:
    """The exact product of an (N, K) and a (K, columns) integer matrix given as nested lists
    (columns is explicit so that K = 0 is well defined: a matrix of zeros)."""
    return [[sum(row[t] * b[t][j] for t in range(len(b))) for j in range(columns)] for row in a]
