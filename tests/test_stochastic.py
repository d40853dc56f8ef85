"""Stochastic rounding: statistics and reproducibility.

Each statistical test rounds N copies of x in one call (every copy draws its own random word) and
compares the sample mean with the exact expectation, within 4 standard deviations of the
Bernoulli variance: for a value a fraction p of the way from `below` to `above`, the mean of N
draws has standard deviation (above - below) * sqrt(p (1 - p) / N). With a fixed seed each test is
deterministic; the bound makes it meaningful rather than lucky.
"""

import math
import random
from fractions import Fraction

import pytest
import torch
from support import assert_same_bits

import lpsim
from lpsim import P3109, BlockFloat, Fixed, Float, reference

N = 1 << 16


def _neighbours(fmt, x: float) -> tuple[float, float]:
    """The grid values just below and just above x (x not on the grid), from values()."""
    v = fmt.values().tolist()
    below = max(u for u in v if u < x)
    above = min(u for u in v if u > x)
    return below, above


def _draws(x: float, fmt, rule: str, seed: int, rbits=None, dtype=torch.float64) -> torch.Tensor:
    return lpsim.quantize(
        torch.full((N,), x, dtype=dtype), fmt, rule, seed=seed, rbits=rbits
    ).double()


def _assert_mean(draws: torch.Tensor, expected: float, below: float, above: float, p: float):
    sigma = (above - below) * math.sqrt(max(p * (1 - p), 1 / N) / N)
    mean = draws.mean().item()
    assert abs(mean - expected) <= 4 * sigma, (mean, expected, sigma)


E5M2 = Float(5, 2)
# Inputs at binade edges, mid-binade, in the subnormal range and below the smallest subnormal.
UNBIASED_CASES = [
    (E5M2, 1.0 + 1e-6),  # just above a power of two
    (E5M2, 2.0 - 1e-6),  # just below the next one
    (E5M2, 1.1),
    (E5M2, -3.3),
    (E5M2, 5e-6),  # subnormal range: spacing 2**-16
    (E5M2, 3e-6),  # below the smallest subnormal: 0 or 2**-16
    (E5M2, 57344.0 * 0.99),  # the top binade
    (Float(4, 3, special="fn"), 300.0),
    (Float(3, 2, subnormals=False), 0.1),  # below the smallest normal: 0 or 0.25
    (Fixed(8, 4), 0.03),
    (Fixed(8, 4), -5.4321),
    (Float(8, 7), 1.0 / 3.0),
]


@pytest.mark.parametrize("fmt,x", UNBIASED_CASES, ids=[f"{f!r}-{x}" for f, x in UNBIASED_CASES])
def test_stochastic_is_unbiased(fmt, x):
    below, above = _neighbours(fmt, x) if fmt.bits <= 16 else _bracket(fmt, x)
    draws = _draws(x, fmt, "stochastic", seed=1)
    assert set(draws.unique().tolist()) <= {below, above}
    p = (x - below) / (above - below)
    _assert_mean(draws, x, below, above, p)


def _bracket(fmt, x):
    below = lpsim.quantize(torch.tensor([x], dtype=torch.float64), fmt, "down").item()
    above = lpsim.quantize(torch.tensor([x], dtype=torch.float64), fmt, "up").item()
    return below, above


def test_stochastic_between_max_and_the_next_grid_point_overflows_with_its_probability():
    # Between max (57344) and 65536 rounding behaves as if the exponent were unbounded: up with
    # probability (x - max) / 8192, and "up" is an overflow, which is Inf in e5m2.
    x = 57344.0 + 8192 * 0.3
    draws = _draws(x, E5M2, "stochastic", seed=3)
    assert set(draws.unique().tolist()) == {57344.0, math.inf}
    share = (draws == math.inf).double().mean().item()
    assert abs(share - 0.3) <= 4 * math.sqrt(0.3 * 0.7 / N)
    saturating = _draws(x, Float(5, 2, saturate=True), "stochastic", seed=3)
    assert set(saturating.unique().tolist()) == {57344.0}


@pytest.mark.parametrize(
    "fmt,x", UNBIASED_CASES[:8], ids=[f"{f!r}-{x}" for f, x in UNBIASED_CASES[:8]]
)
def test_stochastic_equal_picks_each_neighbour_half_the_time(fmt, x):
    below, above = _neighbours(fmt, x)
    draws = _draws(x, fmt, "stochastic_equal", seed=2)
    share_up = (draws == above).double().mean().item()
    assert (draws == below).sum() + (draws == above).sum() == N
    assert abs(share_up - 0.5) <= 4 * math.sqrt(0.25 / N)


@pytest.mark.parametrize("rbits", [1, 2, 3, 4, 8])
def test_rbits_gives_the_bias_of_truncation_to_rbits_bits(rbits):
    # x sits a fraction 0.7 of the way from 1 to 1.25; with rbits bits the fraction is truncated
    # to floor(0.7 * 2**rbits) / 2**rbits, and that is the probability of rounding up.
    fmt = Float(5, 2)
    x = 1.0 + 0.25 * 0.7
    draws = _draws(x, fmt, "stochastic", seed=4, rbits=rbits)
    p = math.floor(0.7 * 2**rbits) / 2**rbits
    _assert_mean(draws, 1.0 + 0.25 * p, 1.0, 1.25, p)
    bias = 0.25 * (0.7 - p)
    noise = 0.25 * math.sqrt(0.21 / N)
    if bias > 10 * noise:  # rbits 1 to 3: the bias is large enough to see, and it is there
        assert abs(draws.mean().item() - x) > bias / 2


def test_stochastic_equal_with_rbits_moves_only_what_truncation_leaves_inexact():
    fmt = Float(5, 2)
    tiny = 1.0 + 0.25 * 2**-6  # inexact, but zero after truncation to 4 bits
    assert torch.equal(
        _draws(tiny, fmt, "stochastic_equal", seed=5, rbits=4),
        torch.full((N,), 1.0, dtype=torch.float64),
    )
    moved = _draws(tiny, fmt, "stochastic_equal", seed=5)
    assert abs((moved == 1.25).double().mean().item() - 0.5) <= 4 * math.sqrt(0.25 / N)


def test_stochastic_equal_with_rbits_32_is_the_default_and_moves_every_inexact_value():
    fmt = Float(5, 2)
    tiny = 1.0 + 2**-40  # below 2^-32 of a spacing: zero after truncation to 31 or 32 bits
    default = _draws(tiny, fmt, "stochastic_equal", seed=5)
    assert_same_bits(_draws(tiny, fmt, "stochastic_equal", seed=5, rbits=32), default)
    assert (default == 1.25).any()
    assert torch.equal(
        _draws(tiny, fmt, "stochastic_equal", seed=5, rbits=31),
        torch.full((N,), 1.0, dtype=torch.float64),
    )


@pytest.mark.parametrize(
    "fmt", [Float(5, 2), Float(4, 3, special="fnuz"), Fixed(6, 3), BlockFloat(5)], ids=repr
)
@pytest.mark.parametrize("rule", ["stochastic", "stochastic_equal"])
def test_exact_values_never_move(fmt, rule):
    v = fmt.values().float()
    x = v.repeat(64)
    if isinstance(fmt, BlockFloat):  # one block: its largest value sets the exponent 0
        x = x.view(64, -1)
        fmt = BlockFloat(fmt.wl, 0)
    for seed in range(4):
        for rbits in (None, 1, 7):
            assert_same_bits(lpsim.quantize(x, fmt, rule, seed=seed, rbits=rbits), x, f"{fmt!r}")


@pytest.mark.parametrize(
    "fmt",
    [Float(5, 2), Fixed(8, 3), BlockFloat(6), BlockFloat(6, 0), BlockFloat(6, block_size=7)],
    ids=repr,
)
def test_same_seed_gives_the_same_bits_for_any_thread_count(fmt):
    x = torch.randn(257, 1031) * 10  # not a multiple of any chunk or group size
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(lpsim.quantize(x, fmt, "stochastic", seed=77))
    finally:
        torch.set_num_threads(previous)
    assert_same_bits(results[1], results[0], "2 threads")
    assert_same_bits(results[2], results[0], "3 threads")


def test_torch_manual_seed_makes_unseeded_calls_reproducible():
    x = torch.randn(1000)
    torch.manual_seed(123)
    a = lpsim.quantize(x, E5M2, "stochastic")
    b = lpsim.quantize(x, E5M2, "stochastic")
    torch.manual_seed(123)
    a2 = lpsim.quantize(x, E5M2, "stochastic")
    assert_same_bits(a2, a)
    assert not torch.equal(a, b)


def test_nearest_does_not_consume_the_default_generator():
    state = torch.get_rng_state()
    lpsim.quantize(torch.randn(10), E5M2, "nearest")
    torch.set_rng_state(state)  # the randn above moved it; compare from the same point
    before = torch.get_rng_state()
    lpsim.quantize(torch.ones(10), E5M2, "nearest")
    assert torch.equal(torch.get_rng_state(), before)


def test_offsets_and_seeds_give_different_streams():
    x = torch.full((4096,), 1.1)
    a = lpsim.quantize(x, E5M2, "stochastic", seed=9)
    assert not torch.equal(a, lpsim.quantize(x, E5M2, "stochastic", seed=10))
    assert not torch.equal(a, lpsim.quantize(x, E5M2, "stochastic", seed=9, offset=1))
    assert torch.equal(a, lpsim.quantize(x, E5M2, "stochastic", seed=9, offset=0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_stochastic_rounding_does_not_depend_on_the_container(dtype):
    # The decision uses the discarded fraction of the quantum, a property of the value, so a value
    # rounds the same way whatever container holds it.
    fmt = Float(4, 2)
    x = (torch.randn(5000) * 4).to(dtype).float()  # values every container holds
    want = lpsim.quantize(x, fmt, "stochastic", seed=31)
    got = lpsim.quantize(x.to(dtype), fmt, "stochastic", seed=31)
    assert_same_bits(got.float(), want, str(dtype))


def test_layout_does_not_change_the_draws():
    x = torch.randn(64, 48)
    want = lpsim.quantize(x, E5M2, "stochastic", seed=8)
    transposed = x.t().contiguous().t()  # same values, column-major storage
    assert_same_bits(lpsim.quantize(transposed, E5M2, "stochastic", seed=8), want)


def test_expected_value_is_exact_for_rational_fractions():
    # A sharper check at one point: 2**20 draws, p = 5/8 exactly.
    fmt = Fixed(8, 2)
    x = 1.0 + 0.25 * 5 / 8
    draws = lpsim.quantize(torch.full((1 << 20,), x), fmt, "stochastic", seed=12).double()
    p = Fraction(5, 8)
    sigma = 0.25 * math.sqrt(float(p * (1 - p)) / draws.numel())
    assert abs(draws.mean().item() - x) <= 4 * sigma


@pytest.mark.parametrize(
    "fmt",
    [
        Float(4, 3, bias=3),
        Float(4, 2, bias=-2, special="none"),
        Float(5, 2, subnormals=False),  # [0, smallest normal] is one step
        Float(3, 0, special="fnuz"),
        P3109(6, 3, signed=False),
        P3109(7, 1, domain="finite"),
        Fixed(7, 3),
    ],
    ids=repr,
)
@pytest.mark.parametrize("rbits", [1, 3, 8, 31, 32])
def test_each_draw_rounds_up_exactly_when_its_top_rbits_reach_the_truncated_fraction(fmt, rbits):
    """Exact, draw by draw: x = a + frac (b - a) between neighbouring values a < b (of values())
    rounds away from zero, to b, exactly when floor(frac 2**k) + (word >> (32 - k)) >= 2**k for
    k = rbits, word being the element's Philox word (reference.random_word, which
    tests/test_philox.py holds to Random123's known answers); so over the words the probability
    is floor(frac 2**k) / 2**k, frac truncated to k bits. frac has 40 random bits, more than a
    word, in a float64 tensor; negative x mirror positive ones."""
    rng = random.Random(rbits)
    positive = [Fraction(v) for v in fmt.values().tolist() if v >= 0]
    xs, expected, ups = [], [], 0
    for a, b in zip(positive, positive[1:]):
        for _ in range(4):
            frac = Fraction(rng.getrandbits(40) | 1, 2**40)
            xs.append(float(a + frac * (b - a)))
            truncated = math.floor(frac * 2**rbits)
            word = reference.random_word(2024, 0, len(xs) - 1)
            up = truncated + (word >> (32 - rbits)) >= 2**rbits
            ups += up
            sign = -1 if lpsim.finfo(fmt).min < 0 and len(xs) % 2 else 1
            xs[-1] *= sign
            rounded = sign * float(b if up else a)
            expected.append(rounded if rounded or getattr(fmt, "has_negative_zero", True) else 0.0)
    assert Fraction(xs[-1]) * sign == a + frac * (b - a)  # the inputs are exact in float64
    x = torch.tensor(xs, dtype=torch.float64)
    got = lpsim.quantize(x, fmt, "stochastic", seed=2024, rbits=rbits)
    assert_same_bits(got, torch.tensor(expected, dtype=torch.float64), f"{fmt!r}, rbits={rbits}")
    assert 0 < ups < len(xs)
