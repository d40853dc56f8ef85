"""Stochastic integer shifts and quotients: unbiased within 4 sigma, the documented truncation for
shifts past rbits, ties to even for nearest, and reproducibility.

Each statistical test rounds N copies of one value in one call, so every copy draws its own
random word, and compares the mean with the exact expectation within 4 standard deviations of the
Bernoulli mean: a value a fraction p of the way between two integers has a rounded mean with
standard deviation sqrt(p (1 - p) / N). The seed is fixed, so each test is deterministic; the
bound is what makes it meaningful.
"""

import math
from fractions import Fraction

import pytest
import torch

from lpsim import dyadic
from lpsim.dyadic import DyadicTensor

N = 1 << 16


def _shifted(v: int, k: int, seed: int = 7, rbits=None, dtype=torch.int64) -> torch.Tensor:
    x = DyadicTensor(torch.full((N,), v, dtype=dtype), k)
    return dyadic.requantize(x, 0, 64, rounding="stochastic", seed=seed, rbits=rbits).value.mantissa


def _assert_mean(draws: torch.Tensor, expected: Fraction, label: str):
    low = math.floor(expected)
    p = float(expected - low)
    assert set(draws.unique().tolist()) <= {low, low + 1}, label
    sigma = math.sqrt(max(p * (1 - p), 1 / N) / N)
    share_up = (draws - low).double().mean().item()  # small numbers: no precision lost
    assert abs(share_up - p) <= 4 * sigma, (label, share_up, p, sigma)


# (mantissa, shift): small and large shifts, negative mantissas (floor semantics), a shift of the
# width of the random word, and shifts past it, where the decision uses the top 32 discarded bits.
UNBIASED = [
    (5, 3),
    (-5, 3),
    (1, 1),
    (-1, 1),
    (3, 2),
    (-3, 2),
    (1, 20),
    (-(2**19) - 7, 20),
    (12345, 16),
    (2**31 + 2**30 + 1, 32),
    (-(2**45) - 2**44 - 12345, 46),
    (2**62 + 2**61 + 3, 63),
    (-(2**63), 64),
    (2**62 + 2**60, 80),
]


@pytest.mark.parametrize("v,k", UNBIASED, ids=[f"{v}>>{k}" for v, k in UNBIASED])
def test_stochastic_shift_is_unbiased(v, k):
    _assert_mean(_shifted(v, k), Fraction(v, 2**k), f"{v} >> {k}")


def test_stochastic_shift_of_an_int32_mantissa_is_unbiased():
    _assert_mean(_shifted(-1_000_003, 7, dtype=torch.int32), Fraction(-1_000_003, 128), "int32")


def test_shift_past_rbits_truncates_the_discarded_bits_first():
    # v = 31, k = 8, rbits = 4: frac = 31/256, truncated to 4 bits it is 1/16. The mean follows the
    # truncated fraction (p = 0.0625) and is far from the exact one (p = 0.121): the documented
    # behaviour, not an accident of the sample.
    draws = _shifted(31, 8, rbits=4)
    _assert_mean(draws, Fraction(1, 16), "truncated")
    sigma = math.sqrt(0.0625 * 0.9375 / N)
    assert abs(draws.double().mean().item() - 31 / 256) > 20 * sigma  # the exact p is excluded


def test_shift_within_rbits_is_exactly_unbiased():
    # k = 3 <= rbits = 4: P(up) = 5/8 exactly, as SR(v, k) = floor(v / 8) + [(v mod 8) > U].
    _assert_mean(_shifted(5, 3, rbits=4), Fraction(5, 8), "k <= rbits")


@pytest.mark.parametrize("n,d", [(1, 3), (-1, 3), (7, -5), (2**40 + 1, 3**20), (-(2**61), 7)])
def test_stochastic_quotient_is_unbiased(n, d):
    a = DyadicTensor(torch.full((N,), n, dtype=torch.int64), 0)
    b = DyadicTensor(torch.tensor(d, dtype=torch.int64), 0)
    draws = dyadic.div(a, b, 0, rounding="stochastic", seed=3).mantissa
    _assert_mean(draws, Fraction(n, d), f"{n} / {d}")


def test_stochastic_product_shift_is_unbiased():
    a = DyadicTensor(torch.full((N,), 12345, dtype=torch.int32), 0)
    b = DyadicTensor(torch.tensor(-678, dtype=torch.int32), 0)
    draws = dyadic.mul(a, b, 10, rounding="stochastic", seed=5).mantissa
    _assert_mean(draws, Fraction(12345 * -678, 1024), "product")


def test_stochastic_alignment_in_add_is_unbiased():
    a = DyadicTensor(torch.full((N,), 1000, dtype=torch.int32), 0)
    b = DyadicTensor(torch.full((N,), -77, dtype=torch.int32), 5)  # finer: shifted right by 5
    draws = dyadic.add(a, b, rounding="stochastic", seed=9).mantissa
    _assert_mean(draws, Fraction(1000) + Fraction(-77, 32), "aligned sum")


def test_nearest_ties_to_even_and_rounds_negative_values_symmetrically():
    v = torch.tensor([1, 3, 5, 7, -1, -3, -5, -7, 9, -9], dtype=torch.int32)  # halves: k = 1
    out = dyadic.requantize(DyadicTensor(v, 1), 0, 8, rounding="nearest").value.mantissa
    assert out.tolist() == [0, 2, 2, 4, 0, -2, -2, -4, 4, -4]
    # Not a tie: 3/4 -> 1, -3/4 -> -1, 5/4 -> 1.
    w = torch.tensor([3, -3, 5, -5], dtype=torch.int32)
    assert dyadic.requantize(
        DyadicTensor(w, 2), 0, 8, rounding="nearest"
    ).value.mantissa.tolist() == [1, -1, 1, -1]


def test_down_is_floor_on_twos_complement():
    v = torch.tensor([7, -7, -8, -9, -1], dtype=torch.int32)
    out = dyadic.requantize(DyadicTensor(v, 3), 0, 8, rounding="down").value.mantissa
    assert out.tolist() == [0, -1, -1, -2, -1]


def test_same_seed_same_result_other_offset_other_stream():
    x = DyadicTensor(torch.arange(-5000, 5000, dtype=torch.int32), 6)
    one = dyadic.requantize(x, 0, 16, seed=11).value.mantissa
    assert torch.equal(one, dyadic.requantize(x, 0, 16, seed=11).value.mantissa)
    assert not torch.equal(one, dyadic.requantize(x, 0, 16, seed=11, offset=1).value.mantissa)


def test_seed_from_torch_generator_is_reproducible():
    x = DyadicTensor(torch.arange(-5000, 5000, dtype=torch.int32), 6)
    torch.manual_seed(3)
    one = dyadic.requantize(x, 0, 16).value.mantissa
    torch.manual_seed(3)
    assert torch.equal(one, dyadic.requantize(x, 0, 16).value.mantissa)


@pytest.mark.filterwarnings("ignore::lpsim.dyadic.DyadicOverflowWarning")
def test_results_do_not_depend_on_the_thread_count():
    # Larger than one parallel task (64 groups of 256 elements), so two threads split the work.
    size = 5 * 64 * 256 + 77
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-(2**30), 2**30, (size,), generator=gen, dtype=torch.int32)
    b = torch.randint(-(2**30), 2**30, (size,), generator=gen, dtype=torch.int32)
    x, y = DyadicTensor(a, 9), DyadicTensor(b, 3)
    previous = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(
                (
                    dyadic.requantize(x, 2, 12, seed=1).value.mantissa,
                    dyadic.add(x, y, seed=2).mantissa,
                    dyadic.mul(x, y, 30, seed=3, overflow="saturate").mantissa,
                    dyadic.div(x, y, 20, seed=4, overflow="saturate").mantissa,
                )
            )
    finally:
        torch.set_num_threads(previous)
    for one, two in zip(*results):
        assert torch.equal(one, two)
