"""apytypes (a simulator of fixed- and floating-point formats of any width) as an independent oracle
of lpsim's sequential multiply-accumulate: lpsim.mac.matmul, lpsim.accumulate.matmul and
lpsim.nn.functional's matmul and linear.

What apytypes 0.5.1 models. Under ``APyFloatAccumulatorContext(exp_bits=E, man_bits=M,
quantization=q)`` a matrix product of APyFloatArrays gives, for each result,

    s = +0;  s = round(s + round(a[i, k] b[k, j]))  for k = 0, 1, ..., K - 1,

every round from the exact value onto the IEEE-style format (E, M) (bias 2^(E-1) - 1, subnormals,
the top exponent for Inf and NaN), by the rule q. Each product is rounded into the accumulator
before it is added; overflow is IEEE 754's (a rule that rounds the value toward zero gives +/-max,
the others +/-Inf); Inf - Inf and Inf x 0 give NaN.
test_apytypes_sums_are_the_ones_computed_by_hand pins these facts.

What it checks. That model is lpsim's ``MAC(accumulator=Float(E, M), product=Float(E, M),
rounding=r)``, order "sequential", for lpsim's eight deterministic rules (``MODES``): the results
are compared bit for bit (NaN as NaN) for bfloat16, float16, e4m3 and e5m2 accumulators, on random
operands of those formats and on adversarial sums.

Where the two models do not overlap:

- apytypes starts each sum at +0, lpsim at its first term (s = round(t_0)). They differ only where
  every product of a result rounds to -0: lpsim gives -0 (IEEE's -0 + -0), apytypes +0 + -0 = +0,
  except when rounding down (-0 in both). The comparisons expect lpsim's -0 there.
- apytypes rounds every product into the accumulator. lpsim's exact products (the fused MAC,
  ``product=None``) are compared only where the accumulator holds every product exactly; other
  product formats, the chunked and pairwise orders, Kahan's summation and the tensor cores have
  no counterpart in apytypes.
- The stochastic rules are not compared: apytypes draws its own random bits. apytypes' JAM,
  TIES_ODD, TIES_POS, TIES_NEG and TRN_MAG are not lpsim rules.
- apytypes' floating-point formats are IEEE-style only: lpsim's fn, fnuz and none formats, and
  its saturating and subnormal-free ones, are not compared. Float(4, 3) here is the IEEE-style
  e4m3 (largest value 240), not OCP's E4M3.
- apytypes 0.5.1 departs from its own model for some pairs of a narrow operand format and an
  accumulator, none of them compared here: with e5m2 operands and a float16 accumulator a product
  that overflows enters the addition as a finite value beyond the format, not as the rounded
  +/-max or +/-Inf (8 + round(16384 x -80) toward zero gives -65504, not -65472), and with e4m3
  operands and a Float(4, 12) accumulator some subnormal products are misrounded (-0.0703125 x
  0.04296875, exact in the format, comes back as -0.00299072265625). The same values given as
  float64 operands are summed correctly.
- Fixed point: under ``APyFixedAccumulatorContext(int_bits=I, frac_bits=F, quantization=q,
  overflow=o)`` each product is rounded onto multiples of 2^-F (and with ``o`` SAT saturated into
  the format), and the rounded products are added exactly: apytypes 0.5.1 applies no overflow
  mode to the sum, which may leave the declared format. lpsim's ``MAC(accumulator=Fixed(I + F,
  F), product=Fixed(I + F, F))`` saturates every partial sum. They are compared where no product
  or partial sum leaves the format's range (fixed point has no -0: by value).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import assert_same_bits

import lpsim
from lpsim import MAC, Fixed, Float

apytypes = pytest.importorskip("apytypes")
APyFloatArray = apytypes.APyFloatArray
APyFixedArray = apytypes.APyFixedArray
QuantizationMode = apytypes.QuantizationMode

BFLOAT16 = Float(8, 7)
FLOAT16 = Float(5, 10)
E4M3 = Float(4, 3)
E5M2 = Float(5, 2)

# lpsim's deterministic rules and apytypes' modes (one enum serves both number kinds: TIES_EVEN is
# RND_CONV, TO_NEG is TRN, ...). JAM_UNBIASED sets the last bit of an inexact result: round to odd.
MODES = {
    "nearest": QuantizationMode.TIES_EVEN,
    "nearest_away": QuantizationMode.TIES_AWAY,
    "nearest_zero": QuantizationMode.TIES_ZERO,
    "toward_zero": QuantizationMode.TO_ZERO,
    "away": QuantizationMode.TO_AWAY,
    "up": QuantizationMode.TO_POS,
    "down": QuantizationMode.TO_NEG,
    "odd": QuantizationMode.JAM_UNBIASED,
}
RULES = list(MODES)
LENGTHS = [1, 2, 3, 17, 64, 257]


@dataclass(frozen=True)
class Case:
    """Operands of the format ``operands``, carried to lpsim in ``dtype``, summed in
    ``accumulator``; ``draw`` takes their exponents from ``exponents`` (products from below the
    accumulator's subnormals to near its largest value)."""

    operands: Float
    dtype: torch.dtype
    accumulator: Float
    exponents: tuple[int, int] = (0, 0)


CASES = {
    "bf16": Case(BFLOAT16, torch.bfloat16, BFLOAT16, (-70, 60)),
    "fp16": Case(FLOAT16, torch.float16, FLOAT16, (-13, 5)),
    "e4m3": Case(E4M3, torch.bfloat16, E4M3, (-5, 2)),
    "e5m2": Case(E5M2, torch.float16, E5M2, (-9, 5)),
    "bf16 in fp16": Case(BFLOAT16, torch.bfloat16, FLOAT16, (-13, 5)),
    "fp16 in e4m3": Case(FLOAT16, torch.float16, E4M3, (-5, 2)),
}
NARROW = (-2, 2)  # exponents of ordinary data: sums that cancel


def draw(rng: np.random.Generator, fmt: Float, shape, exponents: tuple[int, int]) -> np.ndarray:
    """Normal values of fmt with exponents in the window and random fraction bits; one in twenty
    a zero of either sign."""
    e = rng.integers(exponents[0], exponents[1] + 1, shape)
    fraction = rng.integers(0, 2**fmt.man, shape) / 2**fmt.man
    x = rng.choice([-1.0, 1.0], shape) * (1 + fraction) * np.exp2(e)
    return np.where(rng.random(shape) < 0.05, 0.0 * x, x)


def decode(codes, fmt: Float) -> np.ndarray:
    """The values of fmt's bit patterns (Inf and NaN included), by apytypes."""
    return APyFloatArray.from_bits(np.asarray(codes, dtype=np.int64), fmt.exp, fmt.man).to_numpy()


def carried(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """x in a tensor of dtype, which holds its values exactly."""
    t = torch.from_numpy(x).to(dtype)
    torch.testing.assert_close(t.double(), torch.from_numpy(x), rtol=0, atol=0, equal_nan=True)
    return t


def apytypes_product(a, b, operands: Float, accumulator: Float, rounding: str) -> torch.Tensor:
    """a @ b by apytypes under an accumulator context, as float64 values."""
    x = APyFloatArray.from_float(a, exp_bits=operands.exp, man_bits=operands.man)
    y = APyFloatArray.from_float(b, exp_bits=operands.exp, man_bits=operands.man)
    with apytypes.APyFloatAccumulatorContext(
        exp_bits=accumulator.exp, man_bits=accumulator.man, quantization=MODES[rounding]
    ):
        c = x @ y
    assert (c.exp_bits, c.man_bits) == (accumulator.exp, accumulator.man)
    return torch.from_numpy(np.asarray(c.to_numpy(), dtype=np.float64))


def expected(a, b, operands: Float, accumulator: Float, rounding: str) -> torch.Tensor:
    """apytypes' sums, with lpsim's -0 where every product of a result rounds to -0: lpsim's
    first term is -0, and -0 + -0 is -0; apytypes' +0 + -0 is +0 (-0 only rounding down)."""
    want = apytypes_product(a, b, operands, accumulator, rounding)
    with np.errstate(invalid="ignore"):
        products = a[:, :, None] * b[None, :, :]  # exact in float64; Inf x 0 is NaN
    rounded = (
        APyFloatArray.from_float(products, exp_bits=11, man_bits=52)
        .cast(accumulator.exp, accumulator.man, quantization=MODES[rounding])
        .to_numpy()
    )
    minus_zero = np.all((rounded == 0) & np.signbit(rounded), axis=1)
    want[torch.from_numpy(minus_zero)] = -0.0
    return want


def assert_lpsim_is_apytypes(
    a: np.ndarray, b: np.ndarray, case: Case, rounding: str, fused: bool = False
) -> None:
    """lpsim.mac.matmul gives apytypes' sums bit for bit, its products rounded into the
    accumulator (apytypes' model) or, fused, exact."""
    acc = case.accumulator
    mac = MAC(accumulator=acc, product=None if fused else acc, rounding=rounding)
    got = lpsim.mac.matmul(carried(a, case.dtype), carried(b, case.dtype), mac).double()
    assert_same_bits(got, expected(a, b, case.operands, acc, rounding), str(mac))


# ---- apytypes' model, on sums computed by hand.


@pytest.mark.parametrize(
    "a, b, fmt, rounding, value",
    [
        # 1.25^2 = 1.5625 rounds to 1.5 in e5m2 before it is added: 1.5, 3, then 4.5, a tie, to
        # 4. Exact products would give 1.5, 3.0625 -> 3, 4.5625 -> 5.
        ([1.25] * 3, [1.25] * 3, E5M2, "nearest", 4.0),
        # Terms in increasing k: 1 + 2^-11 is a tie, to 1, twice. In reverse order,
        # 2^-11 + 2^-11 = 2^-10 and 1 + 2^-10 is exact.
        ([1.0, 2.0**-11, 2.0**-11], [1.0] * 3, FLOAT16, "nearest", 1.0),
        ([1.0, 2.0**-11, 2.0**-11], [1.0] * 3, FLOAT16, "up", 1.0 + 2 * 2.0**-10),
        # Overflow: 65504 + 32 rounds past float16's largest value: Inf to nearest, 65504 toward
        # zero, and for the negative sum -Inf down and -65504 up.
        ([65504.0, 32.0], [1.0, 1.0], FLOAT16, "nearest", np.inf),
        ([65504.0, 32.0], [1.0, 1.0], FLOAT16, "toward_zero", 65504.0),
        ([-65504.0, -32.0], [1.0, 1.0], FLOAT16, "down", -np.inf),
        ([-65504.0, -32.0], [1.0, 1.0], FLOAT16, "up", -65504.0),
        ([65504.0, 32.0], [1.0, 1.0], FLOAT16, "odd", 65504.0),
        # Subnormals: 2^-13 2^-12 = 2^-25 is half the smallest subnormal 2^-24: a tie, rounded
        # to 0 (even) to nearest, to 2^-24 by ties away and by round to odd; then added.
        ([2.0**-13, 2.0**-13], [2.0**-12, 2.0**-12], FLOAT16, "nearest", 0.0),
        ([2.0**-13, 2.0**-13], [2.0**-12, 2.0**-12], FLOAT16, "nearest_away", 2 * 2.0**-24),
        ([2.0**-13, 2.0**-13], [2.0**-12, 2.0**-12], FLOAT16, "odd", 2 * 2.0**-24),
        # Inf x 0 and Inf - Inf are NaN; an Inf stays.
        ([np.inf], [0.0], FLOAT16, "nearest", np.nan),
        ([np.inf, -np.inf], [1.0, 1.0], FLOAT16, "nearest", np.nan),
        ([np.inf, 65504.0], [1.0, -1.0], FLOAT16, "toward_zero", np.inf),
        # An exact cancellation is +0, or -0 rounding down.
        ([1.5, -1.5], [1.0, 1.0], FLOAT16, "nearest", 0.0),
        ([1.5, -1.5], [1.0, 1.0], FLOAT16, "down", -0.0),
    ],
)
def test_apytypes_sums_are_the_ones_computed_by_hand(a, b, fmt, rounding, value):
    a, b = np.array([a]), np.array([b]).T
    want = torch.tensor([[value]], dtype=torch.float64)
    assert_same_bits(apytypes_product(a, b, FLOAT16, fmt, rounding), want, "apytypes")
    assert_lpsim_is_apytypes(a, b, Case(FLOAT16, torch.float16, fmt), rounding)


def test_sums_of_negative_zero_products_are_minus_0_in_lpsim_and_plus_0_in_apytypes():
    # -1 x 0 and 0 x -3 are -0: lpsim's -0 + -0 is -0; apytypes' +0 + -0 is +0, or -0 rounding
    # down.
    a, b = np.array([[-1.0, 0.0]]), np.array([[0.0, -3.0]]).T
    for rounding in RULES:
        mac = MAC(accumulator=FLOAT16, product=FLOAT16, rounding=rounding)
        got = lpsim.mac.matmul(carried(a, torch.float16), carried(b, torch.float16), mac).item()
        theirs = apytypes_product(a, b, FLOAT16, FLOAT16, rounding).item()
        assert (got, np.signbit(got)) == (0.0, True), rounding
        assert (theirs, np.signbit(theirs)) == (0.0, rounding == "down"), rounding


# ---- lpsim against apytypes, bit for bit.


@pytest.mark.parametrize("rounding", RULES)
@pytest.mark.parametrize("name", list(CASES))
def test_products_rounded_into_the_accumulator_and_added_in_order_are_apytypes_sums(name, rounding):
    case = CASES[name]
    rng = np.random.default_rng(list(CASES).index(name) * 100 + RULES.index(rounding))
    for k in LENGTHS:
        for exponents in (case.exponents, NARROW):
            a = draw(rng, case.operands, (3, k), exponents)
            b = draw(rng, case.operands, (k, 4), exponents)
            assert_lpsim_is_apytypes(a, b, case, rounding)


@given(
    st.sampled_from(list(CASES)),
    st.sampled_from(RULES),
    st.sampled_from(LENGTHS),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
@settings(max_examples=120, deadline=None)
def test_random_sums_are_apytypes_sums(name, rounding, k, narrow, seed):
    case = CASES[name]
    rng = np.random.default_rng(seed)
    exponents = NARROW if narrow else case.exponents
    a = draw(rng, case.operands, (2, k), exponents)
    b = draw(rng, case.operands, (k, 3), exponents)
    assert_lpsim_is_apytypes(a, b, case, rounding)


# 8-bit operands, every code: zeros, subnormals, the largest values, Inf and NaN.
EIGHT_BIT = {
    "e4m3 in e4m3": Case(E4M3, torch.float32, E4M3),
    "e5m2 in e5m2": Case(E5M2, torch.float32, E5M2),
    "e5m2 in e4m3": Case(E5M2, torch.float32, E4M3),
    "e4m3 in fp16": Case(E4M3, torch.float32, FLOAT16),
}


@given(
    st.sampled_from(list(EIGHT_BIT)),
    st.sampled_from(RULES),
    st.lists(st.tuples(st.integers(0, 255), st.integers(0, 255)), min_size=1, max_size=20),
)
@settings(max_examples=150, deadline=None)
def test_sums_of_any_8_bit_codes_are_apytypes_sums(name, rounding, codes):
    case = EIGHT_BIT[name]
    a = decode([[x for x, _ in codes]], case.operands)
    b = decode([[y] for _, y in codes], case.operands)
    assert_lpsim_is_apytypes(a, b, case, rounding)


# Exact products: e4m3's (8 significant bits, 2^-18 to 57600) fit float16 and bfloat16, e5m2's
# (6 bits, 2^-32 to 57344^2) fit bfloat16. There the fused MAC is apytypes' sum too.
EXACT_PRODUCTS = {
    "e4m3 in fp16": Case(E4M3, torch.float32, FLOAT16),
    "e4m3 in bf16": Case(E4M3, torch.float32, BFLOAT16),
    "e5m2 in bf16": Case(E5M2, torch.float32, BFLOAT16),
}


@pytest.mark.parametrize("rounding", RULES)
@pytest.mark.parametrize("name", list(EXACT_PRODUCTS))
def test_fused_sums_of_products_the_accumulator_holds_exactly_are_apytypes_sums(name, rounding):
    case = EXACT_PRODUCTS[name]
    rng = np.random.default_rng(RULES.index(rounding))
    for k in LENGTHS:
        codes = rng.integers(0, 256, (2, k)), rng.integers(0, 256, (k, 3))
        a, b = (decode(c, case.operands) for c in codes)
        assert_lpsim_is_apytypes(a, b, case, rounding, fused=True)


# Adversarial sums (b is all ones unless given): each under every rule.
ADVERSARIAL = {
    # The small terms fall below the last bit of 1024 (to nearest, lost), then 1024 cancels.
    "cancellation": (FLOAT16, [1024.0, 0.125, -1024.0, 2.0**-9, 0.375], None),
    "cancellation to zero": (BFLOAT16, [3.0, -1.0, -2.0, 0.0], None),
    # 2^-24 terms beside 2^15 (alignment shift 39): they only count when a rule rounds away.
    "alignment shift": (FLOAT16, [32768.0] + [2.0**-24] * 16 + [-32768.0], None),
    "alignment shift, negative": (FLOAT16, [-32768.0] + [2.0**-24] * 16 + [32768.0], None),
    "alignment shift 200": (BFLOAT16, [2.0**100, 2.0**-100, -(2.0**100), 2.0**-100], None),
    # 65504 + 16 = 65520 is halfway to 2^16: a tie at the overflow threshold.
    "overflow tie": (FLOAT16, [65504.0, 16.0], None),
    "overflow then back": (FLOAT16, [65504.0, 32.0, -65504.0], None),
    "overflow, negative": (FLOAT16, [-65504.0, -65504.0, 65504.0], None),
    "product overflow": (FLOAT16, [300.0, -1.0], [300.0, 1.0]),
    "e4m3 overflow": (E4M3, [240.0, 16.0, -240.0], None),
    "e5m2 overflow tie": (E5M2, [57344.0, 4096.0], None),
    "Inf - Inf": (FLOAT16, [65504.0, 65504.0, -np.inf], None),
    "Inf x 0": (E4M3, [1.0, np.inf], [1.0, 0.0]),
    "NaN": (FLOAT16, [1.0, np.nan, 1.0], None),
    # Subnormal products, ties at half the smallest subnormal, and crossing into the subnormals.
    "subnormal products": (FLOAT16, [2.0**-13] * 3, [2.0**-12, 3 * 2.0**-12, 2.0**-11]),
    "into the subnormals": (FLOAT16, [2.0**-14, -(2.0**-24), -(2.0**-15)], None),
    "bf16 subnormals": (BFLOAT16, [2.0**-70, -(2.0**-66)], [2.0**-64, 2.0**-66]),
    "signed zeros": (FLOAT16, [-0.0, 0.0, -0.0], [1.0, 1.0, -1.0]),
}


@pytest.mark.parametrize("rounding", RULES)
@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_sums_are_apytypes_sums(name, rounding):
    fmt, a, b = ADVERSARIAL[name]
    a = np.array([a])
    b = np.ones((a.shape[1], 1)) if b is None else np.array([b]).T
    assert_lpsim_is_apytypes(a, b, Case(fmt, torch.float32, fmt), rounding)


@pytest.mark.parametrize("rounding", RULES)
def test_accumulate_and_the_functional_products_are_apytypes_sums(rounding):
    case = CASES["fp16"]
    rng = np.random.default_rng(7)
    a = draw(rng, FLOAT16, (2, 3, 64), case.exponents)
    w = draw(rng, FLOAT16, (4, 64), case.exponents)
    want = torch.stack([expected(m, w.T, FLOAT16, FLOAT16, rounding) for m in a])
    x, weight = carried(a, torch.float16), carried(w, torch.float16)
    mac = MAC(accumulator=FLOAT16, product=FLOAT16, rounding=rounding)
    accumulated = [
        lpsim.accumulate.matmul(m, weight.T, acc=FLOAT16, mul=FLOAT16, rounding=rounding) for m in x
    ]
    results = {
        "accumulate.matmul": torch.stack(accumulated),
        "functional.matmul": lpsim.nn.functional.matmul(x, weight.T, mac=mac),
        "functional.linear": lpsim.nn.functional.linear(x, weight, mac=mac),
    }
    for where, got in results.items():
        assert_same_bits(got.double(), want, where)


# ---- Fixed point: where no product or partial sum leaves the range.

FIXED_OPERANDS = (3, 4)  # apytypes' (int_bits, frac_bits): k / 16 in [-4, 4)
FIXED_ACCUMULATORS = [Fixed(16, 2), Fixed(20, 6), Fixed(22, 8)]  # 14 integer bits


def apytypes_fixed_product(a, b, accumulator: Fixed, rounding: str, overflow: str = "SAT"):
    int_bits, frac_bits = FIXED_OPERANDS
    x = APyFixedArray.from_float(a, int_bits=int_bits, frac_bits=frac_bits)
    y = APyFixedArray.from_float(b, int_bits=int_bits, frac_bits=frac_bits)
    with apytypes.APyFixedAccumulatorContext(
        int_bits=accumulator.wl - accumulator.fl,
        frac_bits=accumulator.fl,
        quantization=MODES[rounding],
        overflow=getattr(apytypes.OverflowMode, overflow),
    ):
        c = x @ y
    return torch.from_numpy(np.asarray(c.to_numpy(), dtype=np.float64))


@pytest.mark.parametrize("rounding", RULES)
@pytest.mark.parametrize("acc", FIXED_ACCUMULATORS, ids=repr)
def test_fixed_point_sums_within_range_are_apytypes_sums(acc, rounding):
    # |a b| <= 16, so 257 products rounded by at most one unit stay below 2^13: in range.
    rng = np.random.default_rng(acc.fl * 10 + RULES.index(rounding))
    for k in LENGTHS:
        a = rng.integers(-64, 64, (3, k)) / 16
        b = rng.integers(-64, 64, (k, 4)) / 16
        mac = MAC(accumulator=acc, product=acc, rounding=rounding)
        got = lpsim.mac.matmul(carried(a, torch.float32), carried(b, torch.float32), mac)
        want = apytypes_fixed_product(a, b, acc, rounding)
        assert torch.equal(got.double(), want), (k, got.double() - want)


def test_out_of_range_fixed_point_sums_saturate_in_lpsim_and_only_products_in_apytypes():
    # Fixed(4, 0) holds -8 to 7. Both saturate the product 3 x 3 at 7. The sum 3 + 3 + 3
    # saturates at 7 in lpsim; apytypes 0.5.1 returns 9, a value its own format cannot hold,
    # whichever overflow mode is asked for.
    fmt = Fixed(4, 0)
    mac = MAC(accumulator=fmt, product=fmt)
    for a, b, theirs in [([[3.0]], [[3.0]], 7), ([[3.0, 3.0, 3.0]], [[1.0]] * 3, 9)]:
        a, b = np.array(a), np.array(b)
        assert lpsim.mac.matmul(carried(a, torch.float32), carried(b, torch.float32), mac) == 7
        assert apytypes_fixed_product(a, b, fmt, "nearest").item() == theirs
    assert apytypes_fixed_product(a, b, fmt, "nearest", "WRAP").item() == 9
