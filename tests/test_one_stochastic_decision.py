"""One stochastic-rounding decision across lpsim (csrc/include/lpsim/stochastic.h), and one
declaration of the grid's fields (csrc/include/lpsim/grid_spec.h and lpsim.formats' GridSpec).

Element i of a dyadic op and element i of lpsim.quantize draw the same Philox word under the same
(seed, offset), and both cores decide "up" as floor(frac * 2**rbits) + U >= 2**rbits with U the top
rbits bits of that word. So a non-negative value held by both a dyadic tensor and a Fixed format
rounds the same way in both, bit for bit. (A negative one need not: Fixed rounds the magnitude,
dyadic the two's complement floor, which are different fractions of different neighbours.)
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lpsim
from lpsim import _ops, dyadic
from lpsim.dyadic import DyadicTensor
from lpsim.formats import GridSpec

SEEDS = st.integers(0, 2**64 - 1)
OFFSETS = st.integers(0, 2**64 - 1)


@st.composite
def non_negative_mantissas(draw):
    edges = st.sampled_from([0, 1, 2**31 - 1, 2**24, 2**24 - 1])
    values = draw(
        st.lists(
            st.one_of(st.integers(0, 2**31 - 1), st.integers(0, 600), edges),
            min_size=1,
            max_size=300,
        )
    )
    return torch.tensor(values, dtype=torch.int32)


@settings(max_examples=300, deadline=None)
@given(
    v=non_negative_mantissas(),
    scale=st.integers(-20, 20),
    target=st.integers(-20, 20),
    bits=st.integers(2, 32),
    signed=st.booleans(),
    seed=SEEDS,
    offset=OFFSETS,
    rbits=st.integers(1, 32),
)
def test_stochastic_requantize_equals_stochastic_fixed_quantize(
    v, scale, target, bits, signed, seed, offset, rbits
):
    random = dict(seed=seed, offset=offset, rbits=rbits)
    out = dyadic.requantize(
        DyadicTensor(v, scale), target, bits, signed, "stochastic", dtype=torch.int64, **random
    ).value
    values = DyadicTensor(v, scale).to_float(torch.float64)
    fixed = lpsim.quantize(values, lpsim.Fixed(bits, target, signed=signed), "stochastic", **random)
    assert out.to_float(torch.float64).tolist() == fixed.tolist()


def test_the_decision_is_the_float_rule_on_a_hand_value():
    # 3/8 of a unit rounds up when 3 + U >= 8 for U = word >> 29 (rbits = 3): in both cores.
    from lpsim.reference import random_word

    n = 512
    v = DyadicTensor(torch.full((n,), 3, dtype=torch.int32), 3)
    up = dyadic.requantize(v, 0, 8, rbits=3, seed=7).value.mantissa
    fixed = lpsim.quantize(
        torch.full((n,), 3 / 8, dtype=torch.float64),
        lpsim.Fixed(8, 0),
        "stochastic",
        seed=7,
        rbits=3,
    )
    expected = [int(3 + (random_word(7, 0, i) >> 29) >= 8) for i in range(n)]
    assert up.tolist() == expected
    assert fixed.tolist() == expected


def _grid_names(op: str, start: str, stop: str) -> list[str]:
    names = [a.name for a in getattr(torch.ops.lpsim, op).default._schema.arguments]
    return names[names.index(start) : names.index(stop)]


def test_grid_fields_are_the_schemas_grid_arguments():
    fields = list(GridSpec._fields)
    assert _grid_names("quantize_grid", fields[0], "rounding") == fields
    assert _grid_names("quantize_grid_out", fields[0], "rounding") == fields
    assert _grid_names("sr_add", fields[0], "rounding") == fields
    assert _grid_names("sr_addc_", fields[0], "rounding") == fields
    assert _grid_names("sum_rounded", fields[0], "rounding") == fields
    assert _grid_names("dot_rounded", "mul_" + fields[0], fields[0]) == ["mul_" + f for f in fields]
    assert _grid_names("dot_rounded", fields[0], "rounding") == fields


def test_argument_counts_come_from_the_schema():
    # x, the grid, then rounding, rbits, seed, offset.
    assert len(_ops.ops.quantize_grid.default._schema.arguments) == 1 + len(GridSpec._fields) + 4
    # a, b, the grid, then rounding, rbits, seed, offset, randomness.
    assert len(_ops.ops.sr_add.default._schema.arguments) == 2 + len(GridSpec._fields) + 5
