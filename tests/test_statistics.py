"""Rounding statistics (lpsim.statistics): exact counts of every category on hand-made tensors of
each format family, the kernel against a recount written from the definitions in plain Python, the
float64 sums against exact rational arithmetic and against a model of their documented order, the
same bits for any thread count, and quantize_with_statistics against quantize."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support import DTYPES, assert_same_bits, block_float_bounds_model, scaled_bounds_model

import lpsim
from lpsim import P3109, BlockFloat, Fixed, Float
from lpsim.delayed_scaling import DelayedScaling
from lpsim.scaled import PowerOfTwo, Scaled, preset
from lpsim.statistics import (
    FRACTIONS,
    RoundingStatistics,
    quantize_with_statistics,
    rounding_statistics,
    statistics_bounds,
)

INF, NAN = math.inf, math.nan

CHUNK = 256 * 64  # elements per chunk of the documented summation order


def counts(s: RoundingStatistics) -> tuple:
    return (s.elements, s.nonfinite, s.overflow, s.underflow, s.subnormal, s.unchanged)


def recount(x: torch.Tensor, y: torch.Tensor, fmt) -> RoundingStatistics:
    """The statistics from their definitions, element by element in Python, sums exact
    (Fraction) and then rounded once."""
    if isinstance(fmt, Scaled):
        bounds = scaled_bounds_model(x, fmt)
    elif isinstance(fmt, BlockFloat):
        bounds = block_float_bounds_model(x, fmt)
    else:
        bounds = [statistics_bounds(fmt)] * x.numel()
    n = [0] * 6
    squared_error = squared_value = Fraction(0)
    xs, ys = x.double().flatten().tolist(), y.double().flatten().tolist()
    for a, b, (low, high, smallest_normal) in zip(xs, ys, bounds, strict=True):
        n[0] += 1
        if not math.isfinite(a):
            n[1] += 1
            continue
        n[2] += a < low or a > high or not math.isfinite(b)
        overflow = a < low or a > high or not math.isfinite(b)
        n[3] += not overflow and a != 0 and b == 0
        n[4] += math.isfinite(b) and b != 0 and abs(b) < smallest_normal
        n[5] += a == b
        if math.isfinite(b):
            squared_error += (Fraction(b) - Fraction(a)) ** 2
            squared_value += Fraction(a) ** 2
    return RoundingStatistics(*n, float(squared_error), float(squared_value))


def assert_sums_close(got: RoundingStatistics, exact: RoundingStatistics, terms: int) -> None:
    """float64 sums of `terms` nonnegative terms, each rounded once, are within terms * 2^-52 of
    the exact sum, relatively."""
    bound = (terms + 2) * 2.0**-52
    for name in ("squared_error", "squared_value"):
        g, e = getattr(got, name), getattr(exact, name)
        assert abs(g - e) <= bound * e, f"{name}: {g!r} vs exact {e!r}"


def stats_of(values, fmt, rounding="nearest", dtype=torch.float32) -> RoundingStatistics:
    x = torch.tensor(values, dtype=dtype)
    return rounding_statistics(x, lpsim.quantize(x, fmt, rounding), fmt)


# ---- Every category, by hand, for each family


def test_float_counts_each_category_exactly():
    e5m2 = Float(5, 2)  # max 57344, smallest normal 2^-14, smallest subnormal 2^-16
    s = stats_of([1.0, 1.1, 1e6, -1e6, 2.0**-15, 2.0**-20, 0.0, -0.0, NAN, INF, -INF], e5m2)
    # 1.0, 0.0, -0.0 and 2^-15 are unchanged; 1e6 and -1e6 overflow to +/-Inf (left out of the
    # sums); 2^-15 is subnormal; 2^-20 underflows; NaN and +/-Inf are non-finite.
    assert counts(s) == (11, 3, 2, 1, 1, 4)
    x11 = float(torch.tensor(1.1))  # 1.1 in float32, rounded to 1.0
    assert s.squared_error == (x11 - 1.0) ** 2 + 2.0**-40
    assert s.squared_value == 1.0 + x11**2 + 2.0**-30 + 2.0**-40


def test_saturating_float_counts_saturated_values_as_overflow():
    e4m3fn = Float(4, 3, special="fn", saturate=True)  # saturates at 448
    x = torch.tensor([500.0, -1000.0, 448.0, 1.0])
    y = lpsim.quantize(x, e4m3fn)
    assert y.tolist() == [448.0, -448.0, 448.0, 1.0]
    s = rounding_statistics(x, y, e4m3fn)
    assert counts(s) == (4, 0, 2, 0, 0, 2)
    # the saturated values' errors are in the sums: (500-448)^2 + (1000-448)^2
    assert s.squared_error == 52.0**2 + 552.0**2
    assert s.squared_value == 500.0**2 + 1000.0**2 + 448.0**2 + 1.0


def test_p3109_counts_against_its_range():
    fmt = P3109(8, 3)  # signed, extended: overflow saturates or gives Inf by its saturation
    x = torch.tensor([fmt.max * 4, -fmt.max * 4, fmt.smallest_subnormal, fmt.max, 0.25 * 2**-20])
    s = rounding_statistics(x, lpsim.quantize(x, fmt), fmt)
    assert counts(s) == (5, 0, 2, 1, 1, 2)  # smallest_subnormal and max are values


def test_fixed_counts_asymmetric_range_and_no_subnormals():
    fmt = Fixed(8, 4)  # [-8, 7.9375], spacing 1/16, clamps
    s = stats_of([-8.0, -8.01, 7.9375, 7.95, 0.01, 0.5, 0.04], fmt)
    # -8, 7.9375 and 0.5 are values; -8.01 and 7.95 lie outside the range; 0.01 underflows
    # (below half the spacing); 0.04 rounds to 1/16
    assert counts(s) == (7, 0, 2, 1, 0, 3)


def test_unsigned_fixed_counts_negative_values_as_overflow():
    fmt = Fixed(8, 6, signed=False)
    s = stats_of([-1.0, -0.001, 1.0], fmt)
    # both negative values lie outside [0, max]: overflow, not underflow, though they became 0
    assert counts(s) == (3, 0, 2, 0, 0, 1)


def test_block_float_counts_underflow_inside_a_block():
    fmt = BlockFloat(4)  # one exponent for the whole tensor, 4-bit significands
    s = stats_of([8.0, 0.001, 1.0, 0.0, NAN], fmt)
    # NaN is left out of the block's exponent, whose spacing is 2: 0.001 and 1.0 (a tie, to the
    # even 0) underflow
    assert counts(s) == (5, 1, 0, 2, 0, 2)


def test_block_float_counts_elements_beyond_their_blocks_limit_as_overflow():
    fmt = BlockFloat(4)  # largest magnitude 7.9: exponent 2, spacing 2^(2-2) = 1, limit 7
    s = stats_of([7.9, -7.6, 7.0, 6.6, 0.2], fmt)
    # 7.9 and -7.6 lie beyond +-7 and saturate to it; 7 is the limit itself; 6.6 rounds up to 7
    # inside the range; 0.2 underflows
    assert counts(s) == (5, 0, 2, 1, 0, 1)


@pytest.mark.parametrize("rule", ["nearest", "toward_zero", "up", "stochastic"])
def test_block_float_limits_are_each_blocks_own(rule):
    fmt = BlockFloat(4, block_size=2)
    # block 1: limit 7; block 2: largest 0.24 has exponent -3, spacing 2^-5, limit 7/32 = 0.21875
    x = torch.tensor([[7.9, 1.0, 0.24, 0.2], [-0.95, 0.25, math.inf, 3.9]])
    # row 2: largest 0.95 gives spacing 2^-3 and limit 0.875; Inf takes no part in the exponent
    # of its block, whose largest finite 3.9 gives spacing 2^-1 and limit 3.5
    y = lpsim.quantize(x, fmt, rule, seed=1)
    s = rounding_statistics(x, y, fmt)
    assert s.overflow == 4  # 7.9, 0.24, -0.95 and 3.9
    assert counts(s) == counts(recount(x, y, fmt))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "fmt",
    [
        BlockFloat(4),
        BlockFloat(3, dim=0),
        BlockFloat(5, dim=1),
        BlockFloat(4, block_size=3),
        BlockFloat(6, block_size=64),
    ],
    ids=repr,
)
def test_block_float_statistics_count_each_element_within_its_blocks_range(fmt, dtype):
    x = wide_values(3 * 5500, dtype, 17).reshape(3, 5500)  # two chunks
    x[:, 7] = 0.0  # some blocks with zeros, NaN and Inf only
    x[:, :3] = torch.tensor([math.nan, math.inf, 0.0], dtype=dtype)
    if isinstance(fmt.dim, int):
        x = x[:, :40]  # dim=1: a class per column, each element counted
    assert_statistics_of_rounding_equal_recount(x, fmt, "nearest")


def test_block_float_statistics_refuse_what_quantize_refuses():
    x = torch.ones(4, 3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="wl"):
        rounding_statistics(x, x, BlockFloat(12))  # wider than bfloat16's 8-bit significand
    with pytest.raises(IndexError, match="BlockFloat.dim"):
        rounding_statistics(x, x, BlockFloat(5, dim=2))
    with pytest.raises(TypeError, match="x must be a"):
        rounding_statistics(x.to(torch.float8_e4m3fn), x, BlockFloat(5))
    with pytest.raises(ValueError, match="rounded must hold values of x's dtype"):
        rounding_statistics(x, x.double() + 2.0**-40, BlockFloat(5))
    with pytest.raises(TypeError, match="BlockFloat format's bounds"):
        statistics_bounds(BlockFloat(5))


def test_scaled_counts_underflow_and_subnormal_elements_in_large_blocks():
    fmt = preset("mxfp4_e2m1")  # E2M1: smallest normal 1, subnormal 0.5
    x = torch.zeros(32)
    x[0], x[1], x[2], x[3] = 6.0, 1e-3, 1.0, 0.5  # amax 6: scale 2^0
    s = rounding_statistics(x, lpsim.quantize(x, fmt), fmt)
    assert counts(s) == (32, 0, 0, 1, 1, 31)
    # a block whose largest magnitude is 96 (scale 2^4): 16 and 8 decode from E2M1's smallest
    # normal 1 and subnormal 0.5
    x[0], x[2], x[3] = 96.0, 16.0, 8.0
    s = rounding_statistics(x, lpsim.quantize(x, fmt), fmt)
    assert counts(s) == (32, 0, 0, 1, 1, 31)


def test_mx_counts_elements_beyond_the_floor_scale_as_overflow():
    # OCP's floor rule: amax 1.9 gives 2^(0 - 8) for E4M3 (emax 8), so 1.9 / 2^-8 = 486.4 lies
    # beyond E4M3's 448 and saturates to 448 * 2^-8 = 1.75, the block's range
    fmt = preset("mxfp8_e4m3")
    x = torch.zeros(64)
    x[:4] = torch.tensor([1.9, -1.8, 1.75, 1.7])
    x[32:34] = torch.tensor([3.9, 3.5])  # another block: scale 2^-7, range 3.5
    y = lpsim.quantize(x, fmt)
    assert y[:4].tolist() == [1.75, -1.75, 1.75, 1.75]
    assert y[32:34].tolist() == [3.5, 3.5]
    s = rounding_statistics(x, y, fmt)
    # 1.9, -1.8 and 3.9 overflowed; 1.75 and 3.5 are the limits themselves, and 1.7 rounded up to
    # 1.75 inside the range
    assert counts(s) == (64, 0, 3, 0, 0, 60)


def test_nvfp4_counts_elements_whose_block_scale_rounded_down_as_overflow():
    fmt = preset("nvfp4")  # E2M1 elements, E4M3 scale per 16, float32 tensor scale
    x = torch.zeros(32)
    x[0] = 6.0 * 448  # the tensor scale t = amax / (448 * 6) = 1
    # the second block's amax 102 asks for a scale 102 / 6 = 17, a tie that E4M3 rounds to the
    # even 16: 102 / 16 = 6.375 saturates to E2M1's 6, which decodes to 96
    x[16:18] = torch.tensor([102.0, 101.9])
    y = lpsim.quantize(x, fmt)
    assert y[16:18].tolist() == [96.0, 96.0]
    s = rounding_statistics(x, y, fmt)
    assert s.overflow == 2
    assert counts(s) == counts(recount(x, y, fmt))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_blocks_with_nan_count_their_finite_elements_as_overflow(dtype):
    fmt = preset("mxfp8_e4m3")
    x = torch.ones(64, dtype=dtype)
    x[3] = math.nan
    y = lpsim.quantize(x, fmt)
    s = rounding_statistics(x, y, fmt)
    assert counts(s) == (64, 1, 31, 0, 0, 32)


def test_statistics_add_up_and_derive_sqnr():
    a = RoundingStatistics(4, 0, 1, 0, 0, 1, 1.0, 100.0)
    b = RoundingStatistics(2, 1, 0, 1, 1, 0, 0.0, 0.0)
    total = a + b
    assert total == RoundingStatistics(6, 1, 1, 1, 1, 1, 1.0, 100.0)
    assert total.sqnr_db == 20.0 and total.relative_error == 0.1
    assert total.fraction("overflow") == 0.2
    assert RoundingStatistics().sqnr_db != RoundingStatistics().sqnr_db  # nan without a signal
    assert RoundingStatistics(1, 0, 0, 0, 0, 1, 0.0, 4.0).sqnr_db == math.inf


def test_fraction_takes_the_counts_of_finite_elements_only():
    s = RoundingStatistics(4, 0, 1, 0, 0, 1, 1.0, 100.0)
    assert [s.fraction(name) for name in FRACTIONS] == [0.25, 0.0, 0.0, 0.25]
    # Other fields are no counts of finite elements: their quotient by the finite count is no
    # share (sqnr_db / 4, elements / 4 = 1.0 were returned as if they were).
    for name in ("sqnr_db", "squared_error", "elements", "nonfinite", "finite", "overflows"):
        with pytest.raises(ValueError, match="name must be one of"):
            s.fraction(name)


def exact_log10(q: Fraction) -> float:
    return math.log10(q.numerator) - math.log10(q.denominator)


def test_sqnr_and_relative_error_of_float64_sums_whose_quotient_leaves_float64():
    """A float64 tensor holding 2^500 exactly and a rounded 1.1e-150: the sums are finite, their
    quotient is not (about 1e608). The SQNR is finite (6082 dB), not the inf of an exact rounding,
    and the relative error is not 0."""
    x = torch.tensor([2.0**500, 1.1e-150], dtype=torch.float64)
    rounded, s = quantize_with_statistics(x, Float(11, 10))
    assert s.unchanged == 1 and math.isfinite(s.squared_error) and s.squared_error > 0
    error = sum((Fraction(b) - Fraction(a)) ** 2 for a, b in zip(x.tolist(), rounded.tolist()))
    value = sum(Fraction(a) ** 2 for a in x.tolist())
    assert s.sqnr_db == pytest.approx(10 * exact_log10(value / error), rel=1e-12)
    assert math.log10(s.relative_error) == pytest.approx(exact_log10(error / value) / 2, rel=1e-12)


def test_relative_error_is_finite_where_the_quotient_of_the_sums_overflows():
    """1e-150 rounded up onto Fixed(8, -500)'s grid (spacing 2^500, about 3.27e150): the sums
    1.07e301 and 1e-300 are finite, their quotient (about 1e601) is not, and the relative error,
    the square root of it, is about 3.27e300; it was reported as inf."""
    x = torch.tensor([1e-150], dtype=torch.float64)
    rounded, s = quantize_with_statistics(x, Fixed(8, -500), "up")
    assert rounded.item() == 2.0**500
    error = (Fraction(2) ** 500 - Fraction(1e-150)) ** 2
    value = Fraction(1e-150) ** 2
    assert math.isfinite(s.relative_error)
    assert math.log10(s.relative_error) == pytest.approx(exact_log10(error / value) / 2, rel=1e-12)
    assert s.sqnr_db == pytest.approx(10 * exact_log10(value / error), rel=1e-12)


def test_sqnr_and_relative_error_are_unknown_where_a_sum_overflowed():
    """2^600 squared overflows float64: squared_value is inf, and the ratio of a finite error to it
    is unknown; it was reported as inf dB and a relative error of 0, an exact rounding."""
    x = torch.tensor([2.0**600, 1.1], dtype=torch.float64)
    _, s = quantize_with_statistics(x, Float(11, 10))
    assert s.squared_value == math.inf and 0 < s.squared_error < math.inf and s.unchanged == 1
    assert math.isnan(s.sqnr_db) and math.isnan(s.relative_error)
    assert math.isnan(RoundingStatistics(1, 0, 0, 0, 0, 0, math.inf, 1.0).sqnr_db)


def test_statistics_add_up_with_sum_from_its_start_of_zero():
    a = RoundingStatistics(4, 0, 1, 0, 0, 1, 1.0, 100.0)
    b = RoundingStatistics(2, 1, 0, 1, 1, 0, 0.0, 0.0)
    assert sum([a, b]) == a + b
    with pytest.raises(TypeError):
        1 + a


# ---- The kernel against the definition


FAMILIES = [
    Float(5, 2),
    Float(4, 3, special="fn"),
    Float(2, 1, special="none", saturate=True),
    Float(3, 2, subnormals=False),
    P3109(8, 4, domain="finite"),
    P3109(6, 2, signed=False, saturation="SatFinite"),
    Fixed(8, 4),
    Fixed(10, 2, clamp=False),
    BlockFloat(5, block_size=8),
    BlockFloat(4),
    BlockFloat(6, dim=0),
    preset("mxfp8_e4m3"),
    preset("nvfp4"),
]


def wide_values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over a wide exponent range with zeros, exact values, NaN and Inf among them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-30, 30, (n,), generator=gen).double())
    special = torch.randint(0, 12, (n,), generator=gen)
    x = torch.where(special == 0, 0.0, x)
    x = torch.where(special == 1, torch.randint(-8, 8, (n,), generator=gen).double(), x)
    x = torch.where(special == 2, math.nan, x)
    x = torch.where(special == 3, math.inf, x)
    x = torch.where(special == 4, -0.0, x)
    return x.to(dtype)


@given(
    family=st.sampled_from(range(len(FAMILIES))),
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 700),
    seed=st.integers(0, 2**16),
    rule=st.sampled_from(["nearest", "toward_zero", "up", "stochastic"]),
)
def test_kernel_counts_equal_a_python_recount(family, dtype, n, seed, rule):
    assert_statistics_of_rounding_equal_recount(wide_values(n, dtype, seed), FAMILIES[family], rule)


def assert_statistics_of_rounding_equal_recount(x: torch.Tensor, fmt, rule: str) -> None:
    """The statistics of x's rounding (seed 5 for stochastic rules) are the recount's: the counts
    exactly, the sums to their rounding bound. Formats that do not fit x's dtype are skipped."""
    try:
        y = lpsim.quantize(x, fmt, rule, seed=5)
    except ValueError:  # the format does not fit this container
        return
    got = rounding_statistics(x, y, fmt)
    want = recount(x, y, fmt)
    assert counts(got) == counts(want)
    assert_sums_close(got, want, x.numel())


def documented_order_sums(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """The two sums in the order lpsim/rounding_statistics.h fixes, in numpy float64: lane l of a
    chunk adds its elements l, l + 256, ... in turn, lanes are added pairwise, chunks in order."""
    a, b = x.double().flatten().numpy(), y.double().flatten().numpy()
    both = np.isfinite(a) & np.isfinite(b)
    value = np.where(both, a, 0.0)
    error = np.where(both, b, 0.0) - value
    totals = []
    for terms in (error * error, value * value):
        padded = np.zeros(-(-len(terms) // CHUNK) * CHUNK)
        padded[: len(terms)] = terms
        total = 0.0
        for chunk in padded.reshape(-1, 64, 256):
            lanes = np.zeros(256)
            for row in chunk:
                lanes = lanes + row
            width = 128
            while width >= 1:
                lanes[:width] = lanes[:width] + lanes[width : 2 * width]
                width //= 2
            total = total + lanes[0]
        totals.append(float(total))
    return totals[0], totals[1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_sums_follow_the_documented_order_bit_for_bit(dtype):
    x = wide_values(3 * CHUNK + 1234, dtype, 7)
    fmt = Float(3, 2)
    y = lpsim.quantize(x, fmt, "nearest")
    got = rounding_statistics(x, y, fmt)
    assert (got.squared_error, got.squared_value) == documented_order_sums(x, y)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_statistics_are_the_same_for_any_thread_count(threads):
    x = wide_values(5 * CHUNK + 99, torch.float32, 3)
    fmt = Float(4, 3)
    y = lpsim.quantize(x, fmt)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        reference = rounding_statistics(x, y, fmt)
        _, fused_reference = quantize_with_statistics(x, fmt)
        torch.set_num_threads(threads)
        assert rounding_statistics(x, y, fmt) == reference
        assert quantize_with_statistics(x, fmt)[1] == fused_reference == reference
    finally:
        torch.set_num_threads(before)


def test_strided_and_mixed_dtype_inputs_give_the_contiguous_statistics():
    x = wide_values(2 * 3000, torch.float32, 5).reshape(3000, 2).t()  # non-contiguous
    fmt = Float(5, 2)
    y = lpsim.quantize(x, fmt)
    want = rounding_statistics(x.contiguous(), y, fmt)
    assert rounding_statistics(x, y, fmt) == want
    # rounded in another dtype: both compared in float64, exactly
    assert rounding_statistics(x, y.double(), fmt) == want


# ---- Scaled formats: every element within its block's range


ROW_BLOCK_PRESETS = [
    "mxfp8_e4m3",
    "mxfp8_e5m2",
    "mxfp6_e3m2",
    "mxfp6_e2m3",
    "mxfp4_e2m1",
    "mxint8",
    "nvfp4",
    "fp8_e4m3_1x128",
]


@given(
    name=st.sampled_from(ROW_BLOCK_PRESETS),
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 700),
    seed=st.integers(0, 2**16),
    spread=st.integers(0, 30),
    rule=st.sampled_from(["nearest", "toward_zero", "up", "stochastic"]),
)
def test_scaled_counts_equal_a_model_of_the_block_ranges(name, dtype, n, seed, spread, rule):
    fmt = preset(name)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-spread, spread + 1, (n,), generator=gen).double())
    special = torch.randint(0, 200, (n,), generator=gen)
    x = torch.where(special == 0, math.nan, torch.where(special == 1, 0.0, x)).to(dtype)
    assert_statistics_of_rounding_equal_recount(x, fmt, rule)


@pytest.mark.parametrize("rule", ["floor", "ceil", "even", "rceil"])
def test_power_of_two_scale_rules_count_each_element_within_its_blocks_documented_range(rule):
    """Every power-of-two scale rule, with scales whose exponent range clamps the blocks' scales
    at both ends (2**-3 to 2**3, and 2**-149 to 2**105, float32's subnormal powers of two
    included), blocks of 8 along the first axis of length 33 (a last block of one), all-zero and
    NaN blocks, Float and (unsigned) Fixed elements: the counts are those of a model of
    lpsim.scaled's documented rules (support.power_of_two_exponent), for every dtype."""
    gen = torch.Generator().manual_seed(11)
    magnitudes = torch.tensor([-145.0, -120.0, -30.0, -2.0, 5.0, 40.0])  # one per column
    x = torch.randn(33, 6, generator=gen, dtype=torch.float64) * torch.exp2(magnitudes)
    x = x * torch.exp2(torch.randint(-3, 4, (33, 6), generator=gen).double())
    x[8:16, 2] = 0.0  # an all-zero block
    x[3, 4] = math.nan  # a block with NaN: its finite elements overflow
    elements = [
        Float(4, 3, special="fn", saturate=True),
        Float(2, 1, special="none", saturate=True),
        Fixed(8, 6),
        Fixed(4, 1, signed=False),
    ]
    scales = [PowerOfTwo(3), PowerOfTwo(8, bias=149), PowerOfTwo(8)]
    for element in elements:
        for scale in scales:
            fmt = Scaled(element, scale, 8, axis=0, scale_rule=rule)
            for dtype in DTYPES:
                for rounding in ("nearest", "stochastic", "toward_zero"):
                    assert_statistics_of_rounding_equal_recount(x.to(dtype), fmt, rounding)


def test_mx_blocks_of_normal_data_saturate_often():
    # the model test above is meaningful: a quarter or so of the blocks of Gaussian data have a
    # largest magnitude whose significand exceeds E4M3's 1.75 (log2(2 / 1.75) = 0.19 of a binade
    # and more), so it saturates
    x = torch.randn(32 * 1000, generator=torch.Generator().manual_seed(0))
    fmt = preset("mxfp8_e4m3")
    s = rounding_statistics(x, lpsim.quantize(x, fmt), fmt)
    assert 150 < s.overflow < 450
    assert counts(s) == counts(recount(x, lpsim.quantize(x, fmt), fmt))


def test_scaled_layouts_count_as_their_blocks_laid_out_in_rows():
    """Blocks along another axis, tiles, whole rows and the whole tensor count each element
    within its own block: the counts of the same blocks laid out as consecutive rows."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 48, generator=gen) * torch.exp2(
        torch.randint(-8, 9, (64, 48), generator=gen)
    )
    element = Float(4, 3, special="fn", saturate=True)
    e8m0 = preset("mxfp8_e4m3").scale
    cases = [
        (Scaled(element, e8m0, 16, axis=0), x.t().reshape(-1, 16)),
        (
            Scaled(element, e8m0, (16, 8)),
            x.reshape(4, 16, 6, 8).permute(0, 2, 1, 3).reshape(-1, 128),
        ),
        (Scaled(element, e8m0, None), x),
        (Scaled(element, e8m0, "tensor"), x.reshape(1, -1)),
        (preset("fp8_e4m3_128x128"), x.reshape(1, -1)),
    ]
    overflow = 0
    for fmt, rows in cases:
        as_rows = Scaled(fmt.element, fmt.scale, rows.shape[1], scale_rule=fmt.scale_rule)
        got = rounding_statistics(x, lpsim.quantize(x, fmt), fmt)
        want = rounding_statistics(rows, lpsim.quantize(rows, as_rows), as_rows)
        assert counts(got) == counts(want), fmt
        overflow += got.overflow
    assert overflow > 0


@pytest.mark.parametrize("threads", [2, 3])
def test_scaled_statistics_are_the_same_for_any_thread_count(threads):
    x = wide_values(5 * CHUNK + 99, torch.float32, 8).reshape(-1, 7)
    before = torch.get_num_threads()
    for fmt in (preset("mxfp4_e2m1"), preset("nvfp4"), Scaled(Float(2, 1), block=None, axis=0)):
        y = lpsim.quantize(x, fmt)
        try:
            torch.set_num_threads(1)
            reference = rounding_statistics(x, y, fmt)
            torch.set_num_threads(threads)
            assert rounding_statistics(x, y, fmt) == reference
            assert quantize_with_statistics(x, fmt)[1] == reference
        finally:
            torch.set_num_threads(before)


def test_scaled_statistics_refuse_a_rounded_value_that_xs_dtype_does_not_hold():
    fmt = preset("mxfp8_e4m3")
    x = torch.ones(32)
    y = lpsim.quantize(x, fmt)
    assert rounding_statistics(x, y.double(), fmt) == rounding_statistics(x, y, fmt)
    with pytest.raises(ValueError, match="rounded must hold values of x's dtype"):
        rounding_statistics(x, y.double() + 2.0**-40, fmt)
    with pytest.raises(TypeError, match="x must be a"):
        rounding_statistics(x.to(torch.float8_e4m3fn), y, fmt)
    with pytest.raises(TypeError, match="Scaled format's bounds"):
        statistics_bounds(fmt)


# ---- DelayedScaler: the range of the scale its latest call used


def test_a_delayed_scalers_call_counts_values_beyond_its_scales_range_as_overflow():
    scaler = DelayedScaling(Float(4, 3, special="fn")).scaler()
    scaler(torch.tensor([1.0, -0.5]))  # scale 1 for this call; then amax 1 gives scale 448
    inverse = torch.tensor(1.0) / 448  # the float32 scale_inverse of the next call
    x = torch.tensor([2.0, -1.5, 1.0, 3 * 2.0**-9 / 448, 2.0**-11 / 448, 0.0])
    y = scaler(x)
    # x * 448: 896 and -672 saturate to +-448, decoding to +-448 * inverse; 3 * 2^-9 is an E4M3
    # subnormal (below 2^-6); 2^-11 lies below half the smallest subnormal and becomes 0
    decoded = float(448 * inverse)
    assert y[:3].tolist() == [decoded, -decoded, decoded]
    assert y[3].item() == float(3 * 2.0**-9 * inverse) and y[4].item() == 0.0
    s = rounding_statistics(x, y, scaler)
    assert counts(s) == (6, 0, 2, 1, 1, 1 + int(decoded == 1.0))
    # the range reaches 1, whose product with the scale 448 is E4M3's limit itself (the next
    # float32 up scales past it): 1 did not saturate, whatever 448 * inverse decodes to
    assert scaler.statistics_bounds(torch.float32) == (-1.0, 1.0, float(2.0**-6 * inverse))
    # the scaling alone does not know the scale: only non-finite results would overflow
    assert rounding_statistics(x, y, scaler.scaling).overflow == 0
    # the bounds are the latest call's: its record moved the scale (amax 2: 224), not them
    assert float(scaler.scale) == 224 and float(scaler.call_scale_inverse) == float(inverse)


def test_a_delayed_scalers_call_counts_no_overflow_where_x_times_its_scale_is_the_limit():
    """500 * (448 / 500) is 448 in float32: the element limit itself, no saturation, though 500
    lies above 448 times the call's scale_inverse (1 / scale rounded) in float32."""
    scaler = DelayedScaling(Float(4, 3, special="fn"), history_length=1).scaler()
    scaler(torch.tensor([500.0, 1.0, 448.0]))  # the next call's scale: 448 / 500
    scale = torch.tensor(448.0) / 500.0
    assert float(torch.tensor(500.0) * scale) == 448.0  # the premise, in float32
    assert 500.0 > float(448.0 * (torch.tensor(1.0) / scale))
    x = torch.tensor([600.0, 1.0, 500.0])
    s = rounding_statistics(x, scaler(x), scaler)
    assert s.overflow == 1  # 600 only


def test_a_delayed_scalers_float64_call_counts_overflow_where_its_product_passes_the_limit():
    """A float64 call multiplies by the float32 scale 448 / 3 in float64, and decodes with the
    float32 scale_inverse, which lies 2**28 float64 steps from 1 / scale: the range reaches from
    3 * 448 * scale_inverse to the largest float64 x with x * scale <= 448 (numpy's float64
    product). Before, the bound was searched one float64 step at a time from the decoded limit, a
    search of hundreds of millions of steps that did not return."""
    scaler = DelayedScaling(Float(4, 3, special="fn")).scaler()
    scaler(torch.tensor([3.0, -1.0], dtype=torch.float64))  # the next call's scale: 448 / 3
    scale = np.float64(np.float32(448) / np.float32(3))
    limit = 448 / scale  # within a float64 rounding of the last unsaturated x
    near = [float(np.nextafter(limit, sign * np.inf)) for sign in (-1, 1)]
    x = torch.tensor([*near, limit, -limit, 3.0, 3.1, -4.0, 1.0], dtype=torch.float64)
    y = scaler(x)
    signal.signal(signal.SIGALRM, _took_too_long)
    signal.setitimer(signal.ITIMER_REAL, 60.0)
    try:
        s = rounding_statistics(x, y, scaler)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
    decoded = 448 * np.float64(scaler.call_scale_inverse.item())
    beyond = [abs(v) > decoded and abs(v) * scale > 448 for v in x.tolist()]
    assert s.overflow == sum(beyond)
    # 3 is the call's amax (3 * scale is 448), 3.1 and -4 saturate, and the bound lies between
    # the two float64 numbers next to 448 / scale
    assert beyond[:2] == [False, True] and beyond[4:] == [False, True, True, False]
    high = scaler.statistics_bounds(torch.float64)[1]
    assert high * scale <= 448 < float(np.nextafter(high, np.inf)) * scale


def test_a_float_scale_whose_reciprocal_is_subnormal_counts_in_a_few_steps():
    """Fixed(4, 30) elements (largest 7 * 2**-30) under float32 scales: the block holding 3e38
    takes the largest scale, float32's max, whose reciprocal 2**-128 is subnormal (the coarsest
    reciprocal a Scaled format reaches: two-level formats need elem_max >= 2). The bounds search
    starts from m / reciprocal; from the decoded limit it stepped through float32 numbers one at
    a time. Run in a subprocess with a time limit: a loop in the kernel does not return to
    Python."""
    code = (
        "import torch, lpsim\n"
        "from lpsim.scaled import Scaled\n"
        "from lpsim.statistics import rounding_statistics\n"
        "fmt = Scaled(lpsim.Fixed(4, 30), scale=lpsim.Float(8, 23), block=16, "
        "scale_rule='amax')\n"
        "x = torch.tensor([3e38] + [1.0] * 15 + [2.0] * 16)\n"
        "s = rounding_statistics(x, lpsim.quantize(x, fmt), fmt)\n"
        "print(s.elements, s.nonfinite, s.overflow)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    # 3e38 saturates to 7 * 2**-30 * float32's max
    assert done.stdout.split() == ["32", "0", "1"]


def _took_too_long(signum, frame):
    raise TimeoutError("rounding_statistics took over a minute for two float64 elements")


def test_a_float_scale_counts_no_overflow_where_x_times_its_reciprocal_is_the_limit():
    """fp8_e4m3_tensor's float32 scale s = amax / 448 and reciprocal r = 1 / s: x * r rounds to
    448 exactly (no saturation), though x lies above what 448 decodes to (448 * s)."""
    fmt = preset("fp8_e4m3_tensor")
    x = torch.tensor([1.8623102903366089, 0.5])
    scale = np.float32(x[0].item()) / np.float32(448)
    assert np.float32(x[0].item()) * (np.float32(1) / scale) == 448  # the premise
    y = lpsim.quantize(x, fmt)
    assert y[0].item() < x[0].item()  # 448 decodes below x
    assert rounding_statistics(x, y, fmt).overflow == 0


# ---- quantize_with_statistics


@pytest.mark.parametrize("fmt", FAMILIES, ids=repr)
@pytest.mark.parametrize("rule", ["nearest", "stochastic", "down"])
def test_quantize_with_statistics_returns_quantize_bits(fmt, rule):
    x = wide_values(7 * 4700, torch.float32, 11).reshape(-1, 7)[:, :4]  # 2 chunks, strided
    rounded, stats = quantize_with_statistics(x, fmt, rule, seed=5, offset=3)
    want = lpsim.quantize(x, fmt, rule, seed=5, offset=3)
    assert_same_bits(rounded, want)
    assert stats == rounding_statistics(x, want, fmt)


def test_quantize_with_statistics_draws_as_quantize_from_torchs_generator():
    x = torch.randn(5000)
    torch.manual_seed(1)
    rounded, _ = quantize_with_statistics(x, Float(5, 2), "stochastic")
    torch.manual_seed(1)
    assert_same_bits(rounded, lpsim.quantize(x, Float(5, 2), "stochastic"))


def test_quantize_with_statistics_is_not_differentiable():
    x = torch.randn(10, requires_grad=True)
    rounded, _ = quantize_with_statistics(x, Float(5, 2))
    assert not rounded.requires_grad


# ---- Bad input


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_sparse_tensors_are_refused_naming_the_argument(layout):
    dense = torch.randn(2, 3)
    sparse = dense.to_sparse() if layout == "sparse_coo" else dense.to_sparse_csr()
    for fmt in (Float(5, 2), BlockFloat(5)):
        with pytest.raises(TypeError, match=rf"x is a {layout} tensor; rounding_statistics"):
            rounding_statistics(sparse, dense, fmt)
        with pytest.raises(TypeError, match=rf"rounded is a {layout} tensor; rounding_statistics"):
            rounding_statistics(dense, sparse, fmt)
        with pytest.raises(TypeError, match=rf"x is a {layout} tensor; quantize_with_statistics"):
            quantize_with_statistics(sparse, fmt)


def test_bad_arguments_raise_errors_naming_them():
    x = torch.randn(4)
    with pytest.raises(ValueError, match="rounded must have x's shape"):
        rounding_statistics(x, torch.randn(5), Float(5, 2))
    with pytest.raises(TypeError, match="x and rounded must be tensors"):
        rounding_statistics([1.0], x, Float(5, 2))
    with pytest.raises(TypeError, match="floating tensors"):
        rounding_statistics(x, torch.ones(4, dtype=torch.int32), Float(5, 2))
    with pytest.raises(TypeError, match="fmt must be a Float"):
        rounding_statistics(x, x, "e5m2")
    with pytest.raises(TypeError, match="fmt must be a Float"):
        quantize_with_statistics(x, object())
    with pytest.raises(ValueError, match="rbits"):
        quantize_with_statistics(x, Float(5, 2), "stochastic", rbits=0)
    ops = torch.ops.lpsim
    with pytest.raises(RuntimeError, match="low and high"):
        ops.rounding_statistics(x, x, 1.0, -1.0, 0.0)
    with pytest.raises(RuntimeError, match="smallest_normal"):
        ops.rounding_statistics(x, x, -1.0, 1.0, -1.0)
    with pytest.raises(RuntimeError, match="x's dtype"):
        ops.rounding_statistics(x, x.double(), -1.0, 1.0, 0.0)


def test_statistics_under_vmap_are_refused_clearly_and_a_recorder_under_grad_records():
    # Under vmap the counts were batched tensors, and turning them into numbers failed with
    # "Cannot access data pointer of Tensor that doesn't have storage", far from the cause.
    from lpsim.diagnostics.recorder import Recorder

    fmt = Float(3, 2)
    xs = torch.randn(3, 8) * 4
    with pytest.raises(RuntimeError, match=r"^rounding statistics are Python numbers.*vmap"):
        torch.func.vmap(lambda x: rounding_statistics(x, lpsim.quantize(x, fmt), fmt))(xs)
    with pytest.raises(RuntimeError, match=r"^rounding statistics are Python numbers.*vmap"):
        torch.func.vmap(lambda x: quantize_with_statistics(x, fmt)[0])(xs)
    model = torch.nn.Sequential(lpsim.nn.Quantizer(fmt, None, "nearest"))
    with Recorder(model) as recorder:
        with pytest.raises(RuntimeError, match=r"^rounding statistics are Python numbers.*vmap"):
            torch.func.vmap(model)(xs)
        # under grad alone (no vmap) the recorder records as in eager mode
        torch.func.grad(lambda x: model(x).sum())(xs)
    (record,) = recorder.records
    assert record.statistics == rounding_statistics(xs, lpsim.quantize(xs, fmt), fmt)
