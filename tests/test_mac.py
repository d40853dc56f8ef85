"""lpsim.MAC, the description of a simulated multiply-accumulate, and its exact reference
(lpsim.reference.mac_matmul): checked against IEEE float32 and float64 arithmetic done by numpy and
Python, against lpsim.accumulate (whose sums the compiled core rounds on integer bits), against
the classical error bounds of recursive, pairwise and compensated summation (Higham, Accuracy and
Stability of Numerical Algorithms, 2nd ed., ch. 4), and against the unbiasedness of stochastic
rounding."""

from __future__ import annotations

import dataclasses
import math
import statistics
from fractions import Fraction

import numpy as np
import pytest
import torch
from gfloat import RoundMode, round_float
from gfloat.formats import format_info_p3109
from gfloat.types import Domain, Signedness
from hypothesis import given, settings
from hypothesis import strategies as st
from support import assert_same_bits, assert_same_for_any_thread_count

import lpsim
from lpsim import MAC, Fixed, Float
from lpsim import reference as ref

FLOAT16 = Float(5, 10)
BFLOAT16 = Float(8, 7)
FLOAT32 = Float(8, 23)
FLOAT64 = Float(11, 52)
DETERMINISTIC = ["nearest", "nearest_away", "toward_zero", "up", "down", "odd"]


def exact_dot(a: torch.Tensor, b: torch.Tensor) -> Fraction:
    return sum(
        (Fraction(x) * Fraction(y) for x, y in zip(a.double().tolist(), b.double().tolist())),
        Fraction(0),
    )


def one_result(a_row: torch.Tensor, b_column: torch.Tensor, mac: MAC, seed=None) -> float:
    return ref.mac_matmul(a_row.reshape(1, -1), b_column.reshape(-1, 1), mac, seed=seed).item()


def normal_terms(k: int, seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(k, generator=g) * scale).to(torch.bfloat16).float()
    b = torch.randn(k, generator=g).to(torch.bfloat16).float()
    return a, b


# ---- The description: validated, and every field named in its errors.


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(accumulator=3), TypeError, "accumulator"),
        (dict(accumulator=FLOAT16, product="e5m2"), TypeError, "product"),
        (dict(accumulator=FLOAT16, order="tree"), ValueError, "order"),
        (dict(accumulator=FLOAT16, order="chunked"), ValueError, "chunk"),
        (dict(accumulator=FLOAT16, order="chunked", chunk=0), ValueError, "chunk must be in"),
        (dict(accumulator=FLOAT16, order="chunked", chunk=2.0), TypeError, "chunk"),
        (dict(accumulator=FLOAT16, chunk=4), ValueError, "chunk"),
        (dict(accumulator=FLOAT16, chunk_accumulator=BFLOAT16), ValueError, "chunk_accumulator"),
        (dict(accumulator=FLOAT16, order="pairwise", compensated=True), ValueError, "compensated"),
        (dict(accumulator=FLOAT16, compensated=1), TypeError, "compensated"),
        (dict(accumulator=FLOAT16, rounding="round"), ValueError, "round"),
        (dict(accumulator=FLOAT16, rbits=8), ValueError, "rbits"),
        (dict(accumulator=FLOAT16, rounding="stochastic", rbits=40), ValueError, "rbits"),
        (dict(product=FLOAT16), ValueError, "accumulator=None"),
        (dict(rounding="stochastic"), ValueError, "accumulator=None"),
    ],
)
def test_bad_fields_raise_errors_naming_them(kwargs, error, words):
    with pytest.raises(error, match=words):
        MAC(**kwargs)


def test_the_default_is_torchs_own_product_and_fused_means_exact_products():
    assert MAC().native and MAC().fused
    assert not MAC(accumulator=FLOAT16, product=FLOAT16).fused
    assert MAC(accumulator=FLOAT16, rounding="stochastic").rounding is lpsim.Rounding.stochastic
    with pytest.raises(ValueError, match="unspecified order"):
        ref.mac_dot([1.0], MAC())


# ---- The reference against arithmetic no one here wrote.


@given(st.integers(1, 64), st.integers(0, 2**32 - 1))
@settings(max_examples=30, deadline=None)
def test_separate_float32_multiply_and_add_is_numpys_float32_loop(k, seed):
    a, b = normal_terms(k, seed)
    a = a * torch.randn(k, generator=torch.Generator().manual_seed(seed + 1)).exp()
    s = np.float32(a[0].item()) * np.float32(b[0].item())
    for x, y in zip(a[1:].tolist(), b[1:].tolist()):
        s = np.float32(s + np.float32(np.float32(x) * np.float32(y)))
    mac = MAC(accumulator=FLOAT32, product=FLOAT32)
    assert one_result(a, b, mac) == float(s)


@given(st.integers(1, 64), st.integers(0, 2**32 - 1))
@settings(max_examples=30, deadline=None)
def test_fused_float64_accumulation_is_pythons_float_loop(k, seed):
    # float32 products are exact in float64, so each Python addition is the fused step.
    a, b = normal_terms(k, seed)
    s = 0.0
    for x, y in zip(a.tolist(), b.tolist()):
        s = s + x * y
    assert one_result(a, b, MAC(accumulator=FLOAT64)) == s


@pytest.mark.parametrize("rounding", DETERMINISTIC)
@pytest.mark.parametrize(
    "acc, mul",
    [(FLOAT16, None), (BFLOAT16, None), (Float(4, 3), Float(4, 3)), (Fixed(12, 6), None)],
)
def test_sequential_order_is_lpsim_accumulate_matmul(rounding, acc, mul):
    g = torch.Generator().manual_seed(3)
    a = torch.randn(3, 40, generator=g).to(torch.bfloat16)
    b = torch.randn(40, 2, generator=g).to(torch.bfloat16)
    want = lpsim.accumulate.matmul(a, b, acc=acc, mul=mul, rounding=rounding).double()
    got = ref.mac_matmul(a, b, MAC(accumulator=acc, product=mul, rounding=rounding))
    assert torch.equal(got, want)


# ---- The orders against one another.


@pytest.mark.parametrize("rounding", DETERMINISTIC)
@pytest.mark.parametrize("k", [1, 7, 33])
def test_one_chunk_of_the_accumulators_format_is_the_sequential_sum(rounding, k):
    a, b = normal_terms(k, k)
    sequential = MAC(accumulator=BFLOAT16, rounding=rounding)
    chunked = MAC(accumulator=BFLOAT16, rounding=rounding, order="chunked", chunk=64)
    assert one_result(a, b, chunked) == one_result(a, b, sequential)


@pytest.mark.parametrize("rounding", DETERMINISTIC)
def test_chunks_of_one_term_round_each_product_into_the_chunk_format(rounding):
    a, b = normal_terms(50, 5)
    chunked = MAC(
        accumulator=FLOAT16,
        rounding=rounding,
        order="chunked",
        chunk=1,
        chunk_accumulator=Float(4, 3),
    )
    separate = MAC(accumulator=FLOAT16, product=Float(4, 3), rounding=rounding)
    assert one_result(a, b, chunked) == one_result(a, b, separate)


def test_adding_ones_stagnates_sequentially_but_not_in_a_tree_chunks_or_kahan():
    # float16 holds every integer up to 2048 and 2048 + 1 rounds back to 2048 (ties to even).
    ones = torch.ones(4096)
    assert one_result(ones, ones, MAC(accumulator=FLOAT16)) == 2048.0
    assert one_result(ones, ones, MAC(accumulator=FLOAT16, order="pairwise")) == 4096.0
    chunked = MAC(accumulator=FLOAT16, order="chunked", chunk=256)  # 16 exact chunks of 256
    assert one_result(ones, ones, chunked) == 4096.0
    assert one_result(ones, ones, MAC(accumulator=FLOAT16, compensated=True)) == 4096.0


def test_chunk_sums_in_a_narrow_format_lose_what_the_accumulator_would_keep():
    # bfloat16 (8 significant bits) sums 1 + 2^-9 to 1 in every chunk; float32 keeps it.
    a = torch.tensor([1.0, 2.0**-9] * 4)
    ones = torch.ones(8)
    narrow = MAC(accumulator=FLOAT32, order="chunked", chunk=2, chunk_accumulator=BFLOAT16)
    wide = MAC(accumulator=FLOAT32, order="chunked", chunk=2)
    assert one_result(a, ones, narrow) == 4.0
    assert one_result(a, ones, wide) == 4.0 + 4 * 2.0**-9


def test_the_pairwise_tree_splits_at_the_largest_power_of_two_below_the_count():
    # float16 spaces 2048..4096 by 2, and ties go to the even significand (2048, 2052). Four terms:
    # (2048 + 1) + (1 + 1) = 2048 + 2 = 2050. Five terms split 4 + 1: 2050 + 1 = 2051 -> 2052; a
    # split into 3 + 2 would give ((2048 + 1) + 1) + (1 + 1) = 2048 + 2 = 2050.
    t = torch.tensor([2048.0, 1.0, 1.0, 1.0, 1.0])
    mac = MAC(accumulator=FLOAT16, order="pairwise")
    assert one_result(t[:4], torch.ones(4), mac) == 2050.0
    assert one_result(t, torch.ones(5), mac) == 2052.0


# ---- Classical error bounds (Higham, ch. 4), on random data.


def unit_roundoff(fmt: Float) -> Fraction:
    return Fraction(1, 2 ** (fmt.man + 1))


def gamma(n: int, u: Fraction) -> Fraction:
    return n * u / (1 - n * u)


@given(st.integers(2, 200), st.integers(0, 2**32 - 1), st.sampled_from([FLOAT16, BFLOAT16]))
@settings(max_examples=25, deadline=None)
def test_every_order_is_within_its_classical_error_bound(k, seed, acc):
    a, b = normal_terms(k, seed, scale=0.25)
    exact = exact_dot(a, b)
    magnitude = exact_dot(a.abs(), b.abs())
    u = unit_roundoff(acc)
    depth = math.ceil(math.log2(k))
    bounds = {
        MAC(accumulator=acc): gamma(k, u),  # the first rounding (of t_0) counted too
        MAC(accumulator=acc, order="pairwise"): gamma(depth + 1, u),
        MAC(accumulator=acc, order="chunked", chunk=16): gamma(16 + math.ceil(k / 16), u),
        # |E| <= (2u + O(n u^2)) sum |t_k|, plus the first term's rounding (u).
        MAC(accumulator=acc, compensated=True): 3 * u + 8 * k * u * u,
    }
    for mac, bound in bounds.items():
        error = abs(Fraction(one_result(a, b, mac)) - exact)
        assert error <= bound * magnitude, (mac, float(error), float(bound * magnitude))


def test_kahan_stays_near_the_exact_sums_where_recursion_drifts():
    # Eight sums of 2000 products in bfloat16: on average the recursive sums drift by many units
    # of roundoff of the result, the compensated ones by about the final rounding's half unit.
    g = torch.Generator().manual_seed(11)
    a = torch.randn(1, 2000, generator=g).to(torch.bfloat16).float()
    b = torch.randn(2000, 8, generator=g).to(torch.bfloat16).float()
    exact = [exact_dot(a[0], b[:, j]) for j in range(8)]
    size = sum(abs(e) for e in exact) * unit_roundoff(BFLOAT16)

    def drift(mac: MAC) -> Fraction:
        c = ref.mac_matmul(a, b, mac)[0].tolist()
        return sum(abs(Fraction(v) - e) for v, e in zip(c, exact)) / size

    plain = drift(MAC(accumulator=BFLOAT16))
    kahan = drift(MAC(accumulator=BFLOAT16, compensated=True))
    assert kahan <= 1.5
    assert plain >= 5 * kahan


@pytest.mark.parametrize("saturation", lpsim.formats.P3109_SATURATIONS)
def test_kahan_needs_a_signed_accumulator(saturation):
    """Kahan's compensation c = (u - s) - y takes both signs even when every term is positive: in
    a signed P3109 accumulator the compensated sum is gfloat's rounding of each of Kahan's steps
    (and near the exact sum where the recursive one stalls), and an unsigned accumulator, which
    would clip every negative c to 0 (or make it NaN under SatNone), is refused."""
    signed = lpsim.P3109(8, 4, saturation=saturation)
    info = format_info_p3109(8, 4, Signedness.Signed, Domain.Extended)

    def rnd(v: float) -> float:
        return round_float(info, v, RoundMode.TiesToEven, True)

    g = torch.Generator().manual_seed(3)
    a = (torch.rand(1, 64, generator=g) + 0.5).to(torch.bfloat16).float()
    b = (torch.rand(64, 1, generator=g) + 0.5).to(torch.bfloat16).float()
    terms = [float(x) * float(y) for x, y in zip(a[0].tolist(), b[:, 0].tolist())]
    s, c = rnd(terms[0]), 0.0
    for t in terms[1:]:
        y = rnd(t - c)
        u = rnd(s + y)
        c = rnd(rnd(u - s) - y)
        s = u
    kahan = lpsim.mac.matmul(a, b, MAC(accumulator=signed, compensated=True)).item()
    plain = lpsim.mac.matmul(a, b, MAC(accumulator=signed)).item()
    exact = float(sum(Fraction(t) for t in terms))
    assert kahan == s
    assert abs(kahan - exact) <= 2 < exact - plain  # the recursive sum stalls at 32
    for unsigned in (
        lpsim.P3109(8, 4, signed=False, saturation=saturation),
        Fixed(8, 4, signed=False),
    ):
        with pytest.raises(
            ValueError, match="accumulator must be a signed format with compensated"
        ):
            MAC(accumulator=unsigned, compensated=True)
        MAC(accumulator=unsigned)  # without compensation it is an accumulator


# ---- Stochastic rounding.


@pytest.mark.parametrize("order", ["sequential", "pairwise", "chunked"])
def test_stochastic_sums_are_unbiased(order):
    # Each stochastic rounding is unbiased given what came before, so the final sum's mean is the
    # exact sum: the sample mean over 300 seeds lies within 5 standard errors of it.
    a, b = normal_terms(96, 2)
    extra = dict(chunk=8) if order == "chunked" else {}
    mac = MAC(accumulator=BFLOAT16, rounding="stochastic", order=order, **extra)
    results = [one_result(a, b, mac, seed=s) for s in range(300)]
    exact = float(exact_dot(a, b))
    error = statistics.fmean(results) - exact
    assert abs(error) <= 5 * statistics.stdev(results) / math.sqrt(len(results))
    assert len(set(results)) > 3  # the results do vary: the bound is not vacuous


@pytest.mark.parametrize(
    "mac",
    [
        MAC(accumulator=BFLOAT16, product=Float(4, 3), rounding="stochastic", rbits=6),
        MAC(accumulator=FLOAT16, rounding="stochastic_equal", compensated=True),
        MAC(accumulator=Fixed(10, 4), rounding="stochastic", order="pairwise"),
    ],
)
def test_every_result_lies_on_the_accumulators_grid(mac):
    g = torch.Generator().manual_seed(4)
    a = torch.randn(2, 30, generator=g)
    b = torch.randn(30, 3, generator=g)
    c = ref.mac_matmul(a, b, mac, seed=9)
    assert torch.equal(lpsim.quantize(c, mac.accumulator, "nearest"), c)


def test_results_draw_the_documented_words():
    # Result r = i N + j, term k, rounding j' draws word 8 (r K + k) + j' of (seed, offset).
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(2, 5, generator=g), torch.randn(5, 3, generator=g)
    mac = MAC(accumulator=BFLOAT16, product=Float(4, 3), rounding="stochastic", order="pairwise")
    c = ref.mac_matmul(a, b, mac, seed=12, offset=7)
    i, j = 1, 2
    r = i * 3 + j
    products = [a[i, k].item() * b[k, j].item() for k in range(5)]

    def word(k, slot):
        return ref.random_word(12, 7, 8 * (r * 5 + k) + slot)

    assert c[i, j].item() == ref.mac_dot(products, mac, word)
    assert not torch.equal(c, ref.mac_matmul(a, b, mac, seed=12, offset=8))


# ---- The compiled kernel (lpsim.mac.matmul) against the exact reference, bit for bit.

KERNEL_MACS = [
    MAC(accumulator=FLOAT16),
    MAC(accumulator=BFLOAT16, product=Float(4, 3)),
    MAC(accumulator=FLOAT32, product=BFLOAT16),
    MAC(accumulator=Float(4, 3, subnormals=False)),
    MAC(accumulator=Fixed(12, 6)),
    MAC(accumulator=FLOAT16, compensated=True),
    MAC(accumulator=BFLOAT16, order="pairwise"),
    MAC(accumulator=FLOAT16, product=Float(5, 2), order="pairwise"),
    MAC(accumulator=FLOAT32, order="chunked", chunk=4, chunk_accumulator=BFLOAT16),
    MAC(accumulator=BFLOAT16, order="chunked", chunk=3, chunk_accumulator=FLOAT32),
    MAC(accumulator=FLOAT16, order="chunked", chunk=64),
]
RULES = [*DETERMINISTIC, "nearest_zero", "away", "stochastic", "stochastic_equal"]


def kernel_operands(dtype: torch.dtype, m: int, k: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.randn(m, k, generator=g).mul(3).exp()
    b = torch.randn(k, n, generator=g)
    a[0, : min(k, 3)] = torch.tensor([1e4, -1e4, 3.0])[: min(k, 3)]  # cancellation
    return a.to(dtype), b.to(dtype)


@pytest.mark.parametrize("rounding", RULES)
@pytest.mark.parametrize("mac", KERNEL_MACS, ids=repr)
def test_kernel_equals_the_exact_reference_bit_for_bit(mac, rounding):
    mac = dataclasses.replace(mac, rounding=rounding)
    a, b = kernel_operands(torch.bfloat16, 3, 23, 4, 1)
    got = lpsim.mac.matmul(a, b, mac, seed=5, offset=3)
    assert_same_bits(got.double(), ref.mac_matmul(a, b, mac, seed=5, offset=3), repr(mac))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [0, 1, 2, 5, 16, 17, 100])
def test_kernel_equals_the_reference_for_every_dtype_and_length(dtype, k):
    a, b = kernel_operands(dtype, 2, k, 3, k)
    for mac in (
        MAC(accumulator=BFLOAT16, order="pairwise", rounding="stochastic", rbits=5),
        MAC(accumulator=FLOAT16, order="chunked", chunk=7, chunk_accumulator=Float(4, 3)),
        MAC(accumulator=Float(6, 9), compensated=True, rounding="up"),
    ):
        got = lpsim.mac.matmul(a, b, mac, seed=1)
        assert_same_bits(got.double(), ref.mac_matmul(a, b, mac, seed=1), repr(mac))


@given(
    st.integers(1, 40),
    st.sampled_from(KERNEL_MACS),
    st.sampled_from(RULES),
    st.integers(0, 2**64 - 1),
)
@settings(max_examples=60, deadline=None)
def test_kernel_equals_the_reference_on_random_products(k, mac, rounding, seed):
    mac = dataclasses.replace(mac, rounding=rounding)
    a, b = kernel_operands(torch.float32, 2, k, 2, seed % 1000)
    got = lpsim.mac.matmul(a, b, mac, seed=seed)
    assert_same_bits(got.double(), ref.mac_matmul(a, b, mac, seed=seed), repr(mac))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_results_do_not_depend_on_the_thread_count(threads):
    a, b = kernel_operands(torch.float32, 17, 300, 13, 2)
    mac = MAC(accumulator=BFLOAT16, order="pairwise", rounding="stochastic")
    assert_same_for_any_thread_count(lambda: lpsim.mac.matmul(a, b, mac, seed=4), threads)


def test_the_native_mac_is_torchs_matmul():
    a, b = kernel_operands(torch.float32, 5, 7, 3, 0)
    assert torch.equal(lpsim.mac.matmul(a, b, MAC()), a @ b)


def test_kernel_results_take_the_accumulators_container():
    a, b = kernel_operands(torch.bfloat16, 2, 4, 2, 0)
    assert lpsim.mac.matmul(a, b, MAC(accumulator=BFLOAT16)).dtype == torch.bfloat16
    assert lpsim.mac.matmul(a, b, MAC(accumulator=FLOAT16)).dtype == torch.float32
    assert lpsim.mac.matmul(a, b, MAC(accumulator=Float(9, 30))).dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_an_unclamped_fixed_accumulator_keeps_its_grid_beyond_the_operands_dtype(dtype):
    # Fixed(9, 3, clamp=False) holds every multiple of 1/8: 2048 + 1 and 2^15 + 2^15 + 1/8 exactly.
    a = torch.tensor([[2048.0, 1.0, 0.0], [2.0**15, 2.0**15, 2.0**-3]], dtype=dtype)
    b = torch.tensor([[1.0], [1.0], [1.0]], dtype=dtype)
    for mac in (
        MAC(accumulator=Fixed(9, 3, clamp=False)),
        MAC(accumulator=Fixed(9, 3, clamp=False), order="pairwise"),
    ):
        want = torch.tensor([[2049.0], [2.0**16 + 2.0**-3]], dtype=torch.float64)
        assert_same_bits(lpsim.mac.matmul(a, b, mac), want)


@pytest.mark.parametrize(
    "a, b, mac, error, words",
    [
        (torch.ones(2, 3), torch.ones(3, 2), "fp16", TypeError, "mac must be a MAC"),
        (torch.ones(2, 3).double(), torch.ones(3, 2).double(), MAC(FLOAT16), TypeError, "a must"),
        (torch.ones(2, 3), torch.ones(3, 2).half(), MAC(FLOAT16), TypeError, "b must have"),
        (torch.ones(2, 3), torch.ones(2, 2), MAC(FLOAT16), ValueError, "shape"),
        (torch.ones(3), torch.ones(3, 2), MAC(FLOAT16), ValueError, "shape"),
    ],
)
def test_kernel_arguments_are_checked(a, b, mac, error, words):
    with pytest.raises(error, match=words):
        lpsim.mac.matmul(a, b, mac)
