"""lpsim.dyadic's kernels compute exactly what Python's integers and fractions do.

Every test builds its expectation from lpsim.dyadic.reference (rationals, floor, and the random
words of lpsim.reference.random_word) and compares mantissas and scales exactly, for random
inputs drawn by hypothesis over the full int32/int64 range, every rounding rule, shifts far beyond
the random word, and per-tensor and per-channel scales.
"""

import math
import warnings
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lpsim
from lpsim import dyadic
from lpsim.dyadic import DyadicOverflowWarning, DyadicTensor
from lpsim.dyadic import reference as ref
from lpsim.reference import random_word
from lpsim.rounding import Rounding

RULES = st.sampled_from(["nearest", "down", "stochastic"])
SEEDS = st.integers(0, 2**64 - 1)
OFFSETS = st.integers(0, 2**64 - 1)
INT_RANGE = {torch.int32: (-(2**31), 2**31 - 1), torch.int64: (-(2**63), 2**63 - 1)}


@st.composite
def mantissas(draw, dtype=None, min_size=1, max_size=24):
    dtype = dtype or draw(st.sampled_from([torch.int32, torch.int64]))
    lo, hi = INT_RANGE[dtype]
    edges = st.sampled_from([lo, lo + 1, -1, 0, 1, hi - 1, hi])
    values = draw(
        st.lists(
            st.one_of(st.integers(lo, hi), st.integers(-300, 300), edges),
            min_size=min_size,
            max_size=max_size,
        )
    )
    return torch.tensor(values, dtype=dtype)


def _random(rule: str, seed: int, offset: int, rbits: int) -> dict:
    if rule == "stochastic":
        return dict(rounding=rule, seed=seed, offset=offset, rbits=rbits)
    return dict(rounding=rule)


def _expected_requantize(values, shifts, lo, hi, rule, seed, offset, rbits):
    r = Rounding[rule]
    out = [
        ref.requantize_value(v, k, lo, hi, r, ref.word_of(r, seed, offset, i), rbits)
        for i, (v, k) in enumerate(zip(values, shifts))
    ]
    return [v for v, _ in out], [c for _, c in out]


@given(
    v=mantissas(),
    shift=st.integers(-70, 70),
    bits=st.integers(2, 64),
    signed=st.booleans(),
    rule=RULES,
    seed=SEEDS,
    offset=OFFSETS,
    rbits=st.integers(1, 32),
    scale=st.integers(-50, 50),
)
def test_requantize_matches_python_integers(
    v, shift, bits, signed, rule, seed, offset, rbits, scale
):
    bits = min(bits, 63) if not signed else bits
    lo, hi = dyadic.integer_range(bits, signed)
    out = dyadic.requantize(
        DyadicTensor(v, scale), scale - shift, bits, signed, **_random(rule, seed, offset, rbits)
    )
    want, clipped = _expected_requantize(
        v.tolist(), [shift] * v.numel(), lo, hi, rule, seed, offset, rbits
    )
    assert out.value.mantissa.tolist() == want
    assert out.clipped.tolist() == clipped
    assert out.value.scale == scale - shift
    assert out.value.dtype == (torch.int32 if lo >= -(2**31) and hi < 2**31 else torch.int64)


@given(
    data=st.data(),
    rows=st.integers(1, 4),
    cols=st.integers(1, 5),
    axis=st.sampled_from([0, 1]),
    rule=RULES,
    seed=SEEDS,
    bits=st.integers(2, 20),
)
def test_requantize_per_channel_scales_match_python_integers(
    data, rows, cols, axis, rule, seed, bits
):
    v = data.draw(mantissas(torch.int32, rows * cols, rows * cols)).reshape(rows, cols)
    channels = (rows, cols)[axis]
    own = data.draw(st.lists(st.integers(-40, 40), min_size=channels, max_size=channels))
    target = data.draw(st.lists(st.integers(-40, 40), min_size=channels, max_size=channels))
    one = data.draw(st.integers(-40, 40))  # a per-tensor target
    x = DyadicTensor(v, own, axis)
    lo, hi = dyadic.integer_range(bits)
    for goal, goals in ((torch.tensor(target), target), (one, [one] * channels)):
        out = dyadic.requantize(x, goal, bits, **_random(rule, seed, 0, 32))
        shifts = [own[(r, c)[axis]] - goals[(r, c)[axis]] for r in range(rows) for c in range(cols)]
        want, clipped = _expected_requantize(
            v.flatten().tolist(), shifts, lo, hi, rule, seed, 0, 32
        )
        assert out.value.mantissa.flatten().tolist() == want
        assert out.clipped.flatten().tolist() == clipped
        if isinstance(goal, int):
            assert out.value.axis is None and out.value.scale == one
        else:
            assert out.value.axis == axis and out.value.scale.tolist() == target


def _saturated(values, dtype):
    lo, hi = INT_RANGE[dtype]
    return [min(max(v, lo), hi) for v in values], any(not lo <= v <= hi for v in values)


def _run_saturating(op, *args, **kwargs):
    """(result, whether a DyadicOverflowWarning was issued) of op(..., overflow="saturate")."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = op(*args, overflow="saturate", **kwargs)
    return result, any(issubclass(w.category, DyadicOverflowWarning) for w in caught)


@given(
    data=st.data(),
    subtract=st.booleans(),
    rule=RULES,
    seed=SEEDS,
    offset=OFFSETS,
    rbits=st.integers(1, 32),
    sa=st.integers(-40, 40),
    sb=st.integers(-40, 40),
)
def test_add_and_sub_match_python_integers(data, subtract, rule, seed, offset, rbits, sa, sb):
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    a = data.draw(mantissas(dtype, 1, 16))
    b = data.draw(mantissas(dtype, a.numel(), a.numel()))
    op = dyadic.sub if subtract else dyadic.add
    out, warned = _run_saturating(
        op, DyadicTensor(a, sa), DyadicTensor(b, sb), **_random(rule, seed, offset, rbits)
    )
    s = min(sa, sb)
    exact = ref.elementwise(
        "sub" if subtract else "add",
        a.tolist(),
        b.tolist(),
        [sa - s] * a.numel(),
        [sb - s] * a.numel(),
        Rounding[rule],
        seed,
        offset,
        rbits,
    )
    want, overflowed = _saturated(exact, dtype)
    assert out.mantissa.tolist() == want and out.scale == s
    assert warned == overflowed


@given(data=st.data(), rule=RULES, seed=SEEDS)
def test_add_broadcasts_per_channel_scales_and_matches_python_integers(data, rule, seed):
    rows, cols = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 5))
    a = data.draw(mantissas(torch.int32, rows * cols, rows * cols)).reshape(rows, cols) // 4
    b = data.draw(mantissas(torch.int32, cols, cols)) // 4
    sa = data.draw(st.integers(-20, 20))
    sb = data.draw(st.lists(st.integers(-20, 20), min_size=cols, max_size=cols))
    # b (cols,) with a scale per entry broadcasts along the rows of a: the result's axis is 1.
    out = dyadic.add(DyadicTensor(a, sa), DyadicTensor(b, sb, 0), rounding=rule, seed=seed)
    s = [min(sa, t) for t in sb]
    flat_b = b.repeat(rows).tolist()
    exact = ref.elementwise(
        "add",
        a.flatten().tolist(),
        flat_b,
        [sa - s[c] for _ in range(rows) for c in range(cols)],
        [sb[c] - s[c] for _ in range(rows) for c in range(cols)],
        Rounding[rule],
        seed,
        0,
    )
    assert out.mantissa.flatten().tolist() == exact
    assert out.axis == 1 and out.scale.tolist() == s


@given(data=st.data(), rule=RULES, seed=SEEDS, sa=st.integers(-40, 40), sb=st.integers(-40, 40))
def test_add_is_the_exact_sum_of_the_aligned_operands(data, rule, seed, sa, sb):
    a = data.draw(mantissas(torch.int32, 1, 16)) // 2
    b = data.draw(mantissas(torch.int32, a.numel(), a.numel())) // 2
    x, y = DyadicTensor(a, sa), DyadicTensor(b, sb)
    u, v = dyadic.align(x, y, rounding=rule, seed=seed)
    total = dyadic.add(x, y, rounding=rule, seed=seed)
    assert u.scale == v.scale == total.scale == min(sa, sb)
    assert total.mantissa.tolist() == (u.mantissa.long() + v.mantissa.long()).tolist()


@given(
    data=st.data(),
    shift=st.integers(0, 140),
    rule=RULES,
    seed=SEEDS,
    rbits=st.integers(1, 32),
    sa=st.integers(-40, 40),
    sb=st.integers(-40, 40),
)
def test_mul_matches_python_integers(data, shift, rule, seed, rbits, sa, sb):
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    a = data.draw(mantissas(dtype, 1, 16))
    b = data.draw(mantissas(dtype, a.numel(), a.numel()))
    out, warned = _run_saturating(
        dyadic.mul, DyadicTensor(a, sa), DyadicTensor(b, sb), shift, **_random(rule, seed, 0, rbits)
    )
    exact = ref.elementwise(
        "mul",
        a.tolist(),
        b.tolist(),
        [shift] * a.numel(),
        [0] * a.numel(),
        Rounding[rule],
        seed,
        0,
        rbits,
    )
    want, overflowed = _saturated(exact, dtype)
    assert out.mantissa.tolist() == want and out.scale == sa + sb - shift
    assert warned == overflowed


@given(
    data=st.data(),
    rule=RULES,
    seed=SEEDS,
    rbits=st.integers(1, 32),
    sa=st.integers(-40, 40),
    sb=st.integers(-40, 40),
)
def test_div_matches_python_integers(data, rule, seed, rbits, sa, sb):
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    shift = data.draw(st.integers(0, 31 if dtype == torch.int32 else 63))
    a = data.draw(mantissas(dtype, 1, 16))
    b = data.draw(mantissas(dtype, a.numel(), a.numel()))
    b = torch.where(b == 0, torch.ones_like(b), b)  # division by zero raises (tested elsewhere)
    out, warned = _run_saturating(
        dyadic.div, DyadicTensor(a, sa), DyadicTensor(b, sb), shift, **_random(rule, seed, 0, rbits)
    )
    exact = ref.elementwise(
        "div",
        a.tolist(),
        b.tolist(),
        [shift] * a.numel(),
        [0] * a.numel(),
        Rounding[rule],
        seed,
        0,
        rbits,
    )
    want, overflowed = _saturated(exact, dtype)
    assert out.mantissa.tolist() == want and out.scale == sa - sb + shift
    assert warned == overflowed


@given(
    data=st.data(),
    n=st.integers(1, 5),
    k=st.integers(0, 6),
    m=st.integers(1, 5),
    acc_bits=st.integers(8, 64),
    sa=st.integers(-20, 20),
    sb=st.integers(-20, 20),
)
def test_matmul_is_exact_and_checked_against_the_accumulator(data, n, k, m, acc_bits, sa, sb):
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    bound = data.draw(st.sampled_from([100, 2**20, INT_RANGE[dtype][1]]))
    values = st.integers(-bound, bound)
    a = torch.tensor(data.draw(st.lists(values, min_size=n * k, max_size=n * k)), dtype=dtype)
    b = torch.tensor(data.draw(st.lists(values, min_size=k * m, max_size=k * m)), dtype=dtype)
    a, b = a.reshape(n, k), b.reshape(k, m)
    exact = ref.matmul(a.tolist(), b.tolist(), m)
    lo, hi = dyadic.integer_range(acc_bits)
    overflowed = any(not lo <= v <= hi for row in exact for v in row)
    if overflowed:
        with pytest.raises(OverflowError, match=r"matmul: \d+ result\(s\) outside"):
            dyadic.matmul(DyadicTensor(a, sa), DyadicTensor(b, sb), accumulator_bits=acc_bits)
    out, warned = _run_saturating(
        dyadic.matmul, DyadicTensor(a, sa), DyadicTensor(b, sb), accumulator_bits=acc_bits
    )
    assert out.mantissa.tolist() == [[min(max(v, lo), hi) for v in row] for row in exact]
    assert out.scale == sa + sb and warned == overflowed
    assert out.dtype == (torch.int32 if acc_bits <= 32 else torch.int64)


@given(
    x=st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=16),
    scale=st.integers(-160, 160),
    bits=st.integers(2, 40),
    signed=st.booleans(),
    rule=RULES,
    seed=SEEDS,
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_from_float_matches_exact_rationals(x, scale, bits, signed, rule, seed, dtype):
    t = torch.tensor(x, dtype=dtype)
    out = dyadic.from_float(t, bits, scale, signed=signed, **_random(rule, seed, 0, 32))
    lo, hi = dyadic.integer_range(bits, signed)
    r = Rounding[rule]
    for i, value in enumerate(t.tolist()):
        exact = ref.round_rational(
            Fraction(value) * Fraction(2) ** scale, r, ref.word_of(r, seed, 0, i)
        )
        assert out.value.mantissa[i].item() == min(max(exact, lo), hi)
        assert out.clipped[i].item() == (not lo <= exact <= hi)


@pytest.mark.parametrize(
    "dtype",
    [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu],
    ids=str,
)
@pytest.mark.parametrize("rule", ["nearest", "stochastic"])
def test_from_float_takes_every_narrow_float_dtype_at_its_exact_values(dtype, rule):
    # The values of every code of the dtype (its finite ones), as Python floats: exact.
    if dtype == torch.float8_e8m0fnu:
        values = [2.0**e for e in range(-12, 13)]
    else:
        codes = torch.arange(-300, 300, 0.37).to(dtype).float().unique()
        values = [v for v in codes.tolist() if math.isfinite(v)]
    t = torch.tensor(values, dtype=torch.float64).to(dtype)
    assert t.tolist() == values
    peak = max(abs(v) for v in values)
    scale = 16 - 2 - (math.frexp(peak)[1] - 1)  # the documented scale_for(x, 16)
    out = dyadic.from_float(t, 16, rounding=rule, seed=3)
    assert out.value.scale == scale
    r = Rounding[rule]
    for i, value in enumerate(values):
        exact = ref.round_rational(
            Fraction(value) * Fraction(2) ** scale, r, ref.word_of(r, 3, 0, i)
        )
        assert out.value.mantissa[i].item() == min(max(exact, -(2**15)), 2**15 - 1), value


def test_from_float_chooses_the_scale_from_the_largest_magnitude():
    # max |x| = 2.5 -> floor(log2) = 1 -> scale 8 - 2 - 1 = 5 (signed), 6 (unsigned): 2.5 * 32 = 80.
    x = torch.tensor([0.3, -1.7, 2.5])
    assert dyadic.from_float(x, 8).value.scale == 5
    assert dyadic.from_float(x.abs(), 8, signed=False).value.scale == 6
    per_channel = dyadic.from_float(torch.tensor([[0.1, 8.0], [-0.2, 1.0]]), 8, axis=1).value
    assert per_channel.scale.tolist() == [8 - 2 + 3, 8 - 2 - 3]  # max 0.2: e = -3; max 8: e = 3


def test_scale_for_counts_a_negative_axis_from_the_end():
    x = torch.tensor([[0.1, 8.0, -3.0], [-0.2, 1.0, 0.0]])
    # A channel whose largest magnitude is f 2**e with f in [0.5, 1) gets scale 8 - 1 - e.
    columns = [8 - 1 - math.frexp(max(abs(v) for v in col))[1] for col in x.t().tolist()]
    rows = [8 - 1 - math.frexp(max(abs(v) for v in row))[1] for row in x.tolist()]
    assert dyadic.scale_for(x, 8, axis=-1).tolist() == columns == [9, 3, 5]
    assert dyadic.scale_for(x, 8, axis=-2).tolist() == rows == [3, 6]
    assert dyadic.from_float(x, 8, axis=-1).value.scale.tolist() == columns


def test_scale_for_gives_an_empty_channel_the_scale_of_an_all_zero_one():
    assert dyadic.scale_for(torch.zeros(3, 0), 8, axis=0).tolist() == [7, 7, 7]
    assert dyadic.scale_for(torch.zeros(3, 1), 8, axis=0).tolist() == [7, 7, 7]
    out = dyadic.from_float(torch.zeros(3, 0), 8, axis=0).value
    assert out.scale.tolist() == [7, 7, 7] and out.shape == (3, 0)


@pytest.mark.parametrize("signed", [True, False])
def test_scale_for_puts_the_largest_integer_magnitude_in_the_top_bit_beyond_2_to_53(signed):
    # Integers above 2**53 round in float64, up to the next power of two for 2**54 - 1: the scale
    # must come from the exact magnitude. Documented: max|x| 2**scale in [2**(b-2), 2**(b-1))
    # signed, [2**(b-1), 2**b) unsigned.
    bits = 8
    low, high = (2 ** (bits - 2), 2 ** (bits - 1)) if signed else (2 ** (bits - 1), 2**bits)
    cases = [
        (torch.int64, [2**54 - 1, 3]),
        (torch.int64, [-(2**54 - 1), 0]),
        (torch.int64, [2**63 - 1]),
        (torch.int64, [-(2**63)]),
        (torch.int64, [2**53 + 1, -5]),
        (torch.int32, [2**31 - 1, -7]),
        (torch.uint64, [2**64 - 1, 1]),
        (torch.uint64, [2**63 - 1]),
    ]
    for dtype, values in cases:
        if not signed and any(v < 0 for v in values):
            continue
        peak = max(abs(v) for v in values)
        scale = dyadic.scale_for(torch.tensor(values, dtype=dtype), bits, signed)
        assert low <= Fraction(peak) * Fraction(2) ** scale < high, (dtype, values, scale)
    rows = torch.tensor([[2**54 - 1, 1], [-(2**62 - 1), 2**40]], dtype=torch.int64)
    per_row = dyadic.scale_for(rows, bits, signed, axis=0).tolist()
    expected = [bits - 2 - 53, bits - 2 - 61] if signed else [bits - 1 - 53, bits - 1 - 61]
    assert per_row == expected


def test_a_per_channel_axis_of_size_0_takes_an_empty_scale_list():
    # Zero channels have zero scales: [] (as a list, a tuple or a tensor) is the one valid scale,
    # and every operation returns the empty result at it, as for any other empty tensor.
    empty = torch.zeros(0, 3, dtype=torch.int32)
    for scale in ([], (), torch.tensor([], dtype=torch.int64)):
        x = DyadicTensor(empty, scale, axis=0)
        assert x.scale.dtype == torch.int64 and x.scale.tolist() == [] and x.axis == 0
    x = DyadicTensor(empty, [], axis=0)
    results = [
        dyadic.from_float(torch.zeros(0, 3), 8, [], axis=0).value,
        dyadic.from_float(torch.zeros(0, 3), 8, axis=0).value,
        dyadic.requantize(DyadicTensor(empty, 2), [], 8, axis=0).value,
        dyadic.requantize(x, [], 8, rounding="nearest").value,
        dyadic.add(x, x),
        dyadic.sub(x, DyadicTensor(torch.zeros(3, dtype=torch.int32), 4)),
        dyadic.align(x, DyadicTensor(torch.zeros(1, 3, dtype=torch.int32), 4))[1],
    ]
    for r in results:
        assert r.shape == (0, 3) and r.axis == 0 and r.scale.tolist() == []
        assert torch.equal(r.to_float(), torch.zeros(0, 3))
    assert dyadic.requantize(x, 5, 8).value.scale == 5


def test_to_float_is_exact_for_representable_values():
    v = torch.tensor([3, -5, 2**31 - 1, -(2**31)], dtype=torch.int32)
    x = DyadicTensor(v, 33)
    assert x.to_float(torch.float64).tolist() == [float(Fraction(k, 2**33)) for k in v.tolist()]
    per_channel = DyadicTensor(torch.tensor([[1, 1], [3, 3]], dtype=torch.int32), [1, -2], axis=1)
    assert per_channel.to_float().tolist() == [[0.5, 4.0], [1.5, 12.0]]


def _nearest_even_in(value: Fraction, precision: int, emin: int, largest: Fraction) -> float:
    """value rounded once to nearest, ties to even, into a binary format of ``precision``
    significant bits, smallest normal exponent emin and largest finite value ``largest``."""
    magnitude = abs(value)
    if magnitude == 0:
        return 0.0
    exponent = max(magnitude.numerator.bit_length() - magnitude.denominator.bit_length(), emin)
    while Fraction(2) ** (exponent + 1) <= magnitude:
        exponent += 1
    while exponent > emin and Fraction(2) ** exponent > magnitude:
        exponent -= 1
    quantum = Fraction(2) ** (exponent - precision + 1)
    rounded = ref.round_rational(magnitude / quantum, Rounding.nearest) * quantum
    result = math.inf if rounded > largest else float(rounded)
    return -result if value < 0 else result


FLOAT_FORMATS = {  # precision, emin, largest finite value
    torch.float16: (11, -14, Fraction(65504)),
    torch.bfloat16: (8, -126, Fraction(2**8 - 1, 2**7) * Fraction(2) ** 127),
    torch.float32: (24, -126, Fraction(2**24 - 1, 2**23) * Fraction(2) ** 127),
    torch.float64: (53, -1022, Fraction(2**53 - 1, 2**52) * Fraction(2) ** 1023),
}


@st.composite
def near_ties(draw):
    """Integers exact in float64, each within 1 of a half-way case of a short significand:
    (2 t + 1) 2**j + d with t of 1 to 12 bits and d in {-1, 0, 1}."""
    t = draw(st.integers(1, 2**12 - 1))
    j = draw(st.integers(0, 53 - (2 * t + 1).bit_length()))
    sign = draw(st.sampled_from([-1, 1]))
    return sign * (((2 * t + 1) << j) + draw(st.sampled_from([-1, 0, 1])))


@given(
    v=st.lists(
        st.one_of(st.integers(-(2**53) + 1, 2**53 - 1), near_ties()), min_size=1, max_size=16
    ),
    scale=st.integers(-40, 200),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
)
def test_to_float_rounds_once_to_nearest_into_float16_and_bfloat16(v, scale, dtype):
    # The values are exact in float64; a cast from there rounds twice (through float32).
    got = DyadicTensor(torch.tensor(v, dtype=torch.int64), scale).to_float(dtype)
    expected = [
        _nearest_even_in(Fraction(k) / Fraction(2) ** scale, *FLOAT_FORMATS[dtype]) for k in v
    ]
    assert got.double().tolist() == expected


@st.composite
def scales_near_the_edges_of(draw, dtype):
    """Scales that put an int32/int64 mantissa near 1, near the subnormals or below them, or near
    the overflow threshold of ``dtype``; or anywhere in [-5000, 5000]."""
    precision, emin, largest = FLOAT_FORMATS[dtype]
    emax = largest.numerator.bit_length() - largest.denominator.bit_length()
    anchor = draw(st.sampled_from([0, -emin, -emin + precision, -emax]))
    near = st.integers(anchor - 70, anchor + 70)
    return draw(st.one_of(near, st.integers(-5000, 5000)))


@given(data=st.data(), dtype=st.sampled_from(list(FLOAT_FORMATS)))
def test_to_float_rounds_every_value_once_to_nearest_even(data, dtype):
    # Subnormal results, mantissas wider than the format's significand (int64 into float64 or
    # float32), overflow to inf and underflow to -0.0: one rounding of the exact value, compared
    # bit for bit with the rational rounded by hand.
    v = data.draw(mantissas())
    scale = data.draw(scales_near_the_edges_of(dtype))
    got = DyadicTensor(v, scale).to_float(dtype).double()
    expected = [
        _nearest_even_in(Fraction(k) / Fraction(2) ** scale, *FLOAT_FORMATS[dtype])
        for k in v.tolist()
    ]
    expected = torch.tensor(expected, dtype=torch.float64)
    assert torch.equal(got.view(torch.int64), expected.view(torch.int64))


def test_to_float_rounds_a_subnormal_and_a_wide_mantissa_once():
    # 3 * 2**-1075 is 1.5 of float64's smallest subnormal, a tie: to even, 2 * 2**-1074 (it was
    # 0). 2**60 + 2**36 + 1 is just above half-way between two float32 numbers (their step is
    # 2**37): up, where int64 -> float64 -> float32 rounds to the tie and then to even, down.
    tiny = DyadicTensor(torch.tensor([3, -3, 1]), 1075).to_float(torch.float64)
    assert tiny.tolist() == [2.0**-1073, -(2.0**-1073), 0.0]
    wide = DyadicTensor(torch.tensor([2**60 + 2**36 + 1]), 0).to_float(torch.float32)
    assert wide.item() == 2**60 + 2**37
    extreme = DyadicTensor(torch.tensor([5, -5]), 2**30).to_float(torch.float64)
    assert (
        extreme.view(torch.int64).tolist()
        == torch.tensor([0.0, -0.0]).double().view(torch.int64).tolist()
    )
    assert DyadicTensor(torch.tensor([5, -5]), -(2**30)).to_float().tolist() == [
        math.inf,
        -math.inf,
    ]
    per_channel = DyadicTensor(torch.tensor([[3, 3], [1, 1]]), [1075, 1074], axis=1)
    assert per_channel.to_float(torch.float64).tolist() == [
        [2.0**-1073, 3 * 2.0**-1074],
        [0.0, 2.0**-1074],
    ]


def test_to_float_rounds_just_above_a_half_way_case_up_in_float16_and_bfloat16():
    # 1 + 2**-11 + 2**-40 is just above half-way between float16's 1 and 1 + 2**-10; float32
    # rounds it to the tie 1 + 2**-11, which float16 then rounds to even, 1 (and so for bfloat16).
    x = DyadicTensor(torch.tensor([2**40 + 2**29 + 1, 2**40 + 2**32 + 1]), 40)
    assert x.to_float(torch.float16)[0].item() == 1 + 2**-10
    assert x.to_float(torch.bfloat16)[1].item() == 1 + 2**-7


def test_reference_rounding_rules_on_hand_values():
    half = Fraction(5, 2)
    assert ref.round_rational(half, Rounding.nearest) == 2  # ties to even
    assert ref.round_rational(Fraction(7, 2), Rounding.nearest) == 4
    assert ref.round_rational(Fraction(-5, 2), Rounding.nearest) == -2
    assert ref.round_rational(Fraction(-7, 4), Rounding.down) == -2  # floor, not truncation
    # stochastic: up iff floor(frac * 2**rbits) + (word >> (32 - rbits)) >= 2**rbits; frac of
    # -7/4 is 1/4, so with rbits=2 only the top two word bits 11 round up.
    assert ref.round_rational(Fraction(-7, 4), Rounding.stochastic, word=3 << 30, rbits=2) == -1
    assert ref.round_rational(Fraction(-7, 4), Rounding.stochastic, word=2 << 30, rbits=2) == -2


@given(
    v=mantissas(torch.int32),
    scale=st.integers(-20, 20),
    target=st.integers(-20, 20),
    bits=st.integers(2, 24),
    signed=st.booleans(),
    rule=st.sampled_from(["nearest", "down"]),
)
def test_requantize_agrees_with_lpsim_fixed_point_quantize(v, scale, target, bits, signed, rule):
    # A per-tensor dyadic tensor of b-bit mantissas at scale t holds the values of Fixed(b, t):
    # requantising to it must give what lpsim.quantize gives on the same values in float64.
    out = dyadic.requantize(DyadicTensor(v, scale), target, bits, signed, rule).value
    values = DyadicTensor(v, scale).to_float(torch.float64)
    fixed = lpsim.quantize(values, lpsim.Fixed(bits, target, signed=signed), rule)
    assert out.to_float(torch.float64).tolist() == fixed.tolist()


def test_a_per_channel_scale_is_a_copy_of_the_callers_tensor():
    # The scales are part of the value: changing the caller's tensor afterwards changes neither
    # the DyadicTensor nor what from_float returned (and cannot bypass the scale range check).
    scales = torch.tensor([1, 2], dtype=torch.int64)
    x = DyadicTensor(torch.tensor([[4], [4]], dtype=torch.int32), scales, axis=0)
    y = dyadic.from_float(torch.tensor([[1.0], [1.0]]), 8, scales, axis=0).value
    scales += 2**40
    assert x.scale.tolist() == [1, 2] and x.to_float().tolist() == [[2.0], [1.0]]
    assert y.scale.tolist() == [1, 2] and y.mantissa.tolist() == [[2], [4]]


def _stochastic_shift(v: int, k: int, word: int) -> int:
    """SR(v, k) = floor(v / 2**k) + [(v mod 2**k) + U >= 2**k], U the top k bits of the element's
    32-bit word (docs/integer.md, for 0 <= k <= 32)."""
    return (v >> k) + ((v % 2**k) + (word >> (32 - k)) >= 2**k)


@pytest.mark.parametrize(
    "scales_a,scales_b,axis",
    [(3, 11, None), (11, 3, None), ([2, 9], [9, 2], 0)],
    ids=["b finer", "a finer", "each finer in one channel"],
)
def test_align_without_a_seed_uses_one_draw_and_add_sums_its_operands(scales_a, scales_b, axis):
    # Without seed= an operation draws one seed from torch's default generator. align() shifts
    # the finer operand of each element with that element's word of the one seed, as add() does:
    # from the same generator state add(a, b) is the exact sum of align(a, b), and both leave the
    # generator in the same state.
    generator = torch.Generator().manual_seed(3)
    a = torch.randint(-5000, 5000, (2, 40), generator=generator, dtype=torch.int32)
    b = torch.randint(-5000, 5000, (2, 40), generator=generator, dtype=torch.int32)
    x, y = DyadicTensor(a, scales_a, axis), DyadicTensor(b, scales_b, axis)
    torch.manual_seed(11)
    seed = int(torch.randint(2**63 - 1, ()))  # the draw of draw_seed: 63 random bits
    torch.manual_seed(11)
    u, v = dyadic.align(x, y)
    after_align = torch.get_rng_state()
    torch.manual_seed(11)
    total = dyadic.add(x, y)
    assert torch.equal(torch.get_rng_state(), after_align)
    assert total.mantissa.tolist() == (u.mantissa + v.mantissa).tolist()
    rows_a = [scales_a] * 2 if axis is None else scales_a
    rows_b = [scales_b] * 2 if axis is None else scales_b
    for mantissas_, rows, aligned in ((a, rows_a, u), (b, rows_b, v)):
        expected = [
            _stochastic_shift(value, rows[r] - min(rows_a[r], rows_b[r]), random_word(seed, 0, i))
            for i, (r, value) in enumerate(
                (r, value) for r in range(2) for value in mantissas_[r].tolist()
            )
        ]
        assert aligned.mantissa.flatten().tolist() == expected


@pytest.mark.parametrize("axis", [None, 0, 1])
def test_from_float_chooses_the_scale_of_block_float_and_differs_only_at_qmin(axis):
    # docs/integer.md: from_float with the scale from the largest magnitude makes BlockFloat(wl)'s
    # choice (one shared exponent, the largest element in the top bit) on two's complement
    # integers: the values agree except where the two's complement mantissa is -2**(wl-1), which
    # sign and magnitude cannot hold (BlockFloat saturates to -(2**(wl-1) - 1) there).
    generator = torch.Generator().manual_seed(8)
    for wl in range(2, 14):
        x = torch.randn(5, 6, generator=generator, dtype=torch.float64) * 2.0 ** (wl - 6)
        # A negative largest magnitude just below a power of two: its mantissa rounds to Qmin.
        x[wl % 5, wl % 6] = -(2 - 2.0**-wl) * 2.0 ** (wl - 3)
        value = dyadic.from_float(x, wl, axis=axis).value
        block = lpsim.quantize(x, lpsim.BlockFloat(wl, dim=axis), "nearest")
        lowest = value.mantissa == -(2 ** (wl - 1))
        at_lowest = value.with_mantissa(torch.where(lowest, value.mantissa + 1, value.mantissa))
        assert torch.equal(at_lowest.to_float(torch.float64), block), wl
        assert lowest[wl % 5, wl % 6]
