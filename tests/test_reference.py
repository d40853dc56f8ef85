"""The oracle itself is checked against independent facts: its grid is exactly the set of values
that the format's codes enumerate, and each rule picks the neighbour its definition names."""

import math
from fractions import Fraction

import pytest
import torch

from lpsim import Fixed, Float, Rounding
from lpsim import reference as ref

SMALL_FORMATS = [
    Float(3, 2),
    Float(3, 2, subnormals=False),
    Float(3, 2, special="fn"),
    Float(3, 2, special="fnuz"),
    Float(3, 2, special="none"),
    Float(2, 3, special="none"),
    Float(4, 0, special="fn"),
    Float(4, 3, bias=3),
    Fixed(5, 2),
    Fixed(5, 2, signed=False),
    Fixed(5, 2, symmetric=True),
    Fixed(4, -1),
]
DETERMINISTIC = [r for r in Rounding if not r.is_stochastic]


@pytest.mark.parametrize("fmt", SMALL_FORMATS, ids=repr)
def test_every_value_of_the_format_is_a_fixed_point_of_every_rule(fmt):
    grid = ref.grid_of(fmt)
    for v in fmt.values().tolist():
        for rule in Rounding:
            for word in (0, 2**31, 2**32 - 1):
                out = ref.round_value(v, grid, rule, word)
                assert out == v, (fmt, rule, v, out)


@pytest.mark.parametrize("fmt", SMALL_FORMATS, ids=repr)
def test_rules_pick_the_neighbour_their_definition_names(fmt):
    grid = ref.grid_of(fmt)
    values = fmt.values().tolist()
    for lo, hi in zip(values, values[1:]):
        for t in (Fraction(1, 4), Fraction(1, 2), Fraction(3, 4)):
            x = float(Fraction(lo) + t * (Fraction(hi) - Fraction(lo)))
            toward_zero = lo if x > 0 else hi
            away = hi if x > 0 else lo
            got = {rule: ref.round_value(x, grid, rule) for rule in DETERMINISTIC}
            assert got[Rounding.up] == hi and got[Rounding.down] == lo
            assert got[Rounding.toward_zero] == toward_zero and got[Rounding.away] == away
            if t != Fraction(1, 2):
                nearest = lo if t < Fraction(1, 2) else hi
                for rule in (Rounding.nearest, Rounding.nearest_away, Rounding.nearest_zero):
                    assert got[rule] == nearest
            else:
                assert got[Rounding.nearest_away] == away
                assert got[Rounding.nearest_zero] == toward_zero
                assert got[Rounding.nearest] in (lo, hi)
            assert got[Rounding.odd] in (lo, hi)


def test_nearest_ties_to_the_even_code_and_odd_to_the_odd_code():
    fmt = Float(3, 2)  # values around 1: 1, 1.25, 1.5, 1.75, 2
    grid = ref.grid_of(fmt)
    assert ref.round_value(1.125, grid, Rounding.nearest) == 1.0  # code ..00 is even
    assert ref.round_value(1.375, grid, Rounding.nearest) == 1.5  # code ..10 is even
    assert ref.round_value(1.875, grid, Rounding.nearest) == 2.0  # next binade, fraction 00
    assert ref.round_value(1.125, grid, Rounding.odd) == 1.25
    assert ref.round_value(1.375, grid, Rounding.odd) == 1.25
    assert ref.round_value(1.9, grid, Rounding.odd) == 1.75


def test_overflow_follows_the_format_and_the_rule():
    ieee = ref.grid_of(Float(3, 2))  # max 14, next grid point 16
    assert ref.round_value(15.0, ieee, Rounding.nearest) == math.inf
    assert ref.round_value(14.9, ieee, Rounding.nearest) == 14.0
    assert ref.round_value(15.0, ieee, Rounding.toward_zero) == 14.0
    assert ref.round_value(-15.0, ieee, Rounding.up) == -14.0
    assert ref.round_value(-14.5, ieee, Rounding.down) == -math.inf
    fn = ref.grid_of(Float(3, 2, special="fn"))  # max 24 (28 is the NaN code's value)
    assert math.isnan(ref.round_value(27.0, fn, Rounding.nearest))
    assert ref.round_value(25.0, fn, Rounding.nearest) == 24.0
    saturating = ref.grid_of(Float(3, 2, special="fn", saturate=True))
    assert ref.round_value(1e9, saturating, Rounding.nearest) == 24.0
    assert ref.round_value(-math.inf, saturating, Rounding.nearest) == -24.0


def test_below_the_smallest_value_the_choice_is_zero_or_the_smallest_value():
    fmt = Float(3, 2)  # smallest subnormal 1/16
    grid = ref.grid_of(fmt)
    assert ref.round_value(1 / 32, grid, Rounding.nearest) == 0.0  # tie to even: 0
    assert ref.round_value(1 / 31, grid, Rounding.nearest) == 1 / 16
    assert ref.round_value(-1e-30, grid, Rounding.away) == -1 / 16
    flush = ref.grid_of(Float(3, 2, subnormals=False))  # smallest normal 1/4
    assert ref.round_value(0.1, flush, Rounding.nearest) == 0.0
    assert ref.round_value(0.2, flush, Rounding.nearest) == 0.25
    assert ref.round_value(-1e-30, flush, Rounding.down) == -0.25


def test_stochastic_decision_uses_the_truncated_fraction_and_the_word():
    grid = ref.grid_of(Float(3, 2))
    x = 1.0 + 0.25 * 0.3  # frac = 0.3 of the spacing above 1
    threshold = 2**32 - math.floor(0.3 * 2**32)  # words at or above it round up
    assert ref.round_value(x, grid, Rounding.stochastic, threshold - 1) == 1.0
    assert ref.round_value(x, grid, Rounding.stochastic, threshold) == 1.25
    # rbits=2 truncates frac to 0.25: words with top two bits 11 round up.
    assert ref.round_value(x, grid, Rounding.stochastic, 0xBFFFFFFF, rbits=2) == 1.0
    assert ref.round_value(x, grid, Rounding.stochastic, 0xC0000000, rbits=2) == 1.25
    assert ref.round_value(x, grid, Rounding.stochastic_equal, 2**31 - 1) == 1.0
    assert ref.round_value(x, grid, Rounding.stochastic_equal, 2**31) == 1.25


def test_block_grid_spacing_follows_the_largest_magnitude():
    x = torch.tensor([3.0, 0.3, -0.2, 0.1])  # exponent of 3 is 1: spacing 2**(1 - 2) for wl=4
    y = ref.quantize(x, __import__("lpsim").BlockFloat(4), "nearest")
    assert y.tolist() == [3.0, 0.5, -0.0, 0.0]
