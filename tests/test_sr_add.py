"""sr_add and its fused forms: the exact sum rounded once, against the exact oracle, statistics
and reproducibility.

The oracle (lpsim.reference.round_sum) adds the operands as Fractions and rounds the rational
sum; the kernels add the operands' bits with integers. Statistical tests compare sample means with
the exact expectation within 4 standard deviations of the Bernoulli variance, as in
test_stochastic.py; with fixed seeds they are deterministic.
"""

from __future__ import annotations

import doctest
import inspect
import itertools
import math
import re
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support import assert_same_bits

import lpsim
import lpsim.accumulate
import lpsim.compat.stochastorch
import lpsim.optim.stochastic
import lpsim.update
from lpsim import Fixed, Float, Rounding
from lpsim import reference as ref
from lpsim.compat.stochastorch import StochasticAdder
from lpsim.formats import check_fits

N = 1 << 16
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INT_VIEW = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}
BITS = {torch.float32: 32, torch.float64: 64, torch.bfloat16: 16, torch.float16: 16}
FORMATS = [
    None,
    Float(5, 2),
    Float(4, 3, special="fn"),
    Float(5, 2, special="fnuz"),
    Float(3, 2, subnormals=False),
    Float(2, 1, special="none", saturate=True),
    Float(8, 7),
    Float(5, 10, saturate=True),
    Float(8, 10),
    Float(8, 23),
    Fixed(6, 3),
    Fixed(7, 2, clamp=False),
    Fixed(5, 2, symmetric=True),
    Fixed(6, 4, signed=False),
]


def _fits(fmt, dtype) -> bool:
    if fmt is None:
        return True
    try:
        check_fits(fmt, dtype)
        return True
    except ValueError:
        return False


def _from_bits(words: list[int], dtype: torch.dtype) -> torch.Tensor:
    bits = BITS[dtype]
    signed = [w - (1 << bits) if w >= 1 << (bits - 1) else w for w in words]
    return torch.tensor(signed, dtype=INT_VIEW[dtype]).view(dtype)


@st.composite
def operands(draw, dtype: torch.dtype, n: int):
    """n values of dtype: random bit patterns (every exponent, subnormals, Inf, NaN, zeros)."""
    words = draw(st.lists(st.integers(0, (1 << BITS[dtype]) - 1), min_size=n, max_size=n))
    return _from_bits(words, dtype)


@st.composite
def partners(draw, a: torch.Tensor, dtype: torch.dtype):
    """Second operands for a: near -a (cancellation), far below a (long tails, sticky bits),
    near a, or random bit patterns."""
    n = a.numel()
    kinds = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    scales = draw(st.lists(st.integers(-90, 8), min_size=n, max_size=n))
    signs = draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=n, max_size=n))
    raw = draw(operands(dtype, n)).double()
    ad = a.double()
    out = []
    for i in range(n):
        x = ad[i].item()
        if not math.isfinite(x):
            out.append(raw[i].item())
        elif kinds[i] == 0:
            out.append(-x * (1 + signs[i] * 2.0 ** scales[i]))
        elif kinds[i] == 1:
            out.append(signs[i] * abs(x) * 2.0 ** scales[i] * 1.37)
        elif kinds[i] == 2:
            out.append(x * (1 + signs[i] * 2.0 ** scales[i]))
        else:
            out.append(raw[i].item())
    return torch.tensor(out, dtype=torch.float64).to(dtype)


@st.composite
def sum_cases(draw):
    a_dtype = draw(st.sampled_from(DTYPES))
    b_dtype = draw(st.sampled_from(sorted({a_dtype, torch.float32, torch.float64}, key=str)))
    fmt = draw(st.sampled_from([f for f in FORMATS if _fits(f, a_dtype)]))
    a = draw(operands(a_dtype, 24))
    if draw(st.booleans()) and fmt is not None:
        a = lpsim.quantize(a, fmt, "nearest")  # operands in the format, as in a training loop
    b = draw(partners(a, b_dtype))
    rule = draw(st.sampled_from(list(Rounding)))
    rbits = draw(st.sampled_from([None, 1, 3, 8, 31])) if rule.is_stochastic else None
    randomness = draw(st.sampled_from(["position", "value"]))
    seed = draw(st.integers(0, 2**64 - 1))
    offset = draw(st.integers(0, 2**64 - 1))
    return a, b, fmt, rule, rbits, randomness, seed, offset


@given(sum_cases())
def test_sr_add_is_the_exact_sum_rounded_once(case):
    a, b, fmt, rule, rbits, randomness, seed, offset = case
    kwargs = dict(rbits=rbits, seed=seed, offset=offset, randomness=randomness)
    got = lpsim.sr_add(a, b, fmt, rule, **kwargs)
    want = ref.sr_add(a, b, fmt, rule, **kwargs)
    assert_same_bits(got, want, f"{a.dtype}+{b.dtype} {fmt!r} {rule.name} {kwargs}")
    inplace = a.clone()
    lpsim.sr_add_(inplace, b, fmt, rule, **kwargs)
    assert_same_bits(inplace, want, "in place")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_operands_follow_ieee_addition_then_the_format(dtype):
    info = torch.finfo(dtype)
    values = [
        0.0,
        -0.0,
        math.inf,
        -math.inf,
        math.nan,
        1.0,
        -1.0,
        info.max,
        -info.max,
        info.smallest_normal,
        -info.smallest_normal,
        info.smallest_normal / 4,
        3.0,
    ]
    a = torch.tensor([x for x in values for _ in values], dtype=dtype)
    b = torch.tensor([y for _ in values for y in values], dtype=dtype)
    for fmt in (
        None,
        Float(5, 2),
        Float(4, 3, special="fn"),
        Float(5, 2, special="fnuz"),
        Float(5, 2, saturate=True),
        Fixed(6, 3),
        Fixed(7, 2, clamp=False),
    ):
        for rule in Rounding:
            got = lpsim.sr_add(a, b, fmt, rule, seed=5)
            assert_same_bits(got, ref.sr_add(a, b, fmt, rule, seed=5), f"{fmt!r} {rule.name}")


def test_zero_sums_take_ieee_signs():
    a = torch.tensor([1.5, -0.0, -0.0, 0.0, 2.0])
    b = torch.tensor([-1.5, -0.0, 0.0, -0.0, -2.0])
    want_signs = {"nearest": [1, -1, 1, 1, 1], "down": [-1, -1, -1, -1, -1]}
    for rule, signs in want_signs.items():
        got = lpsim.sr_add(a, b, None, rule)
        assert got.eq(0).all()
        assert [math.copysign(1.0, v) for v in got.tolist()] == signs


@pytest.mark.parametrize(
    "fmt",
    [
        Float(5, 2),
        Float(3, 2, subnormals=False),
        Fixed(6, 3),
        Float(2, 1, special="none", saturate=True),
    ],
    ids=repr,
)
def test_exact_sums_are_returned_unchanged_by_every_rule(fmt):
    values = fmt.values().tolist()
    exact = set(map(Fraction, values))
    pairs = [(x, y) for x in values for y in values if Fraction(x) + Fraction(y) in exact]
    a = torch.tensor([x for x, _ in pairs]).repeat(8)
    b = torch.tensor([y for _, y in pairs]).repeat(8)
    want = (a.double() + b.double()).float()
    nonzero = want != 0  # the sign of an exact zero depends on the rule (checked above)
    for rule in Rounding:
        for rbits in [None, 1, 7] if rule.is_stochastic else [None]:
            for randomness in ("position", "value"):
                got = lpsim.sr_add(a, b, fmt, rule, rbits=rbits, seed=11, randomness=randomness)
                assert_same_bits(got[nonzero], want[nonzero], f"{rule.name} rbits={rbits}")


def _bfloat16_rounding(x: Fraction, rule: str) -> Fraction:
    """x (nonzero, within bfloat16's normal range) rounded into bfloat16 by rule, from the two
    neighbours of |x| with 8 significant bits."""
    magnitude = abs(x)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:
        exponent -= 1
    spacing = Fraction(2) ** (exponent - 7)
    steps = math.floor(magnitude / spacing)
    excess = magnitude / spacing - steps
    away_from_zero = {
        "toward_zero": False,
        "away": excess > 0,
        "up": excess > 0 and x > 0,
        "down": excess > 0 and x < 0,
        "odd": excess > 0 and steps % 2 == 0,
        "nearest": excess > Fraction(1, 2) or (excess == Fraction(1, 2) and steps % 2 == 1),
    }[rule]
    return (1 if x > 0 else -1) * (steps + away_from_zero) * spacing


def test_a_second_rounding_by_the_same_directed_rule_is_harmless_and_torch_bfloat16_adds_right():
    # docs/stochastic-rounding.md: the float32 sum of a bfloat16 a and a float32 b, rounded again
    # into bfloat16 by the same rule, is the exact sum rounded once for toward_zero, away, up, down
    # and odd (sr_add rounds once for every rule); and torch's bfloat16 + bfloat16, computed in
    # float32, is the exact sum rounded to nearest.
    generator = torch.Generator().manual_seed(8)
    a = (torch.randn(3000, generator=generator) * 4).bfloat16()
    scales = torch.randint(-30, 1, (3000,), generator=generator).float()
    b = torch.randn(3000, generator=generator) * 2.0**scales
    exact = [Fraction(x) + Fraction(y) for x, y in zip(a.double().tolist(), b.double().tolist())]
    for rule in ("toward_zero", "away", "up", "down", "odd", "nearest"):
        want = [float(_bfloat16_rounding(x, rule)) for x in exact]
        assert lpsim.sr_add(a, b, rounding=rule).double().tolist() == want, rule
        if rule != "nearest":
            wide = lpsim.sr_add(a.float(), b, rounding=rule)
            twice = lpsim.quantize(wide, Float(8, 7), rule).bfloat16()
            assert twice.double().tolist() == want, rule
    c = (torch.randn(3000, generator=generator) * 2.0**scales).bfloat16()
    exact = [Fraction(x) + Fraction(y) for x, y in zip(a.double().tolist(), c.double().tolist())]
    assert (a + c).double().tolist() == [float(_bfloat16_rounding(x, "nearest")) for x in exact]
    # Rounded twice to nearest, the sum can be wrong: 1 + 2**-8 + 2**-24 is a float32 tie that
    # goes to even, 1 + 2**-8, and then a bfloat16 tie that goes to 1.
    one, over_half = torch.ones(1, dtype=torch.bfloat16), torch.tensor([2.0**-8 + 2.0**-24])
    wide = lpsim.sr_add(one.float(), over_half, rounding="nearest")
    assert lpsim.quantize(wide, Float(8, 7), "nearest").item() == 1.0
    assert lpsim.sr_add(one, over_half, rounding="nearest").item() == 1.0 + 2.0**-7


@pytest.mark.parametrize("a_dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_every_depth_of_the_excess_is_seen_by_every_rule(a_dtype):
    # a + b with a on the bfloat16 grid and b's bits lying 1 to 140 bits below the grid's last bit,
    # on both sides of a and of a binade edge: every rule must see the excess, however deep.
    depths = torch.arange(1, 141, dtype=torch.float64)
    tails = torch.cat([2.0 ** -(7 + depths), 3 * 2.0 ** -(8 + depths), -(2.0 ** -(7 + depths))])
    a = torch.tensor([1.0, 1.5, 2.0**-100], dtype=a_dtype).repeat_interleave(tails.numel())
    b = tails.repeat(3) * torch.tensor(
        [1.0, 1.0, 2.0**-100], dtype=torch.float64
    ).repeat_interleave(tails.numel())
    for rule in Rounding:
        got = lpsim.sr_add(a, b, Float(8, 7), rule, seed=3)
        assert_same_bits(got, ref.sr_add(a, b, Float(8, 7), rule, seed=3), rule.name)


def _assert_mean(draws: torch.Tensor, expected: float, below: float, above: float, p: float):
    sigma = (above - below) * math.sqrt(max(p * (1 - p), 1 / draws.numel()) / draws.numel())
    mean = draws.double().mean().item()
    assert abs(mean - expected) <= 4 * sigma, (mean, expected, sigma)


# (a, b, the container of a, the format): the neighbours of a + b and the fraction p between them.
UNBIASED_CASES = [
    (1.0, 1e-4, torch.bfloat16, None),  # far below half a spacing
    (1.0, -1e-4, torch.bfloat16, None),  # crosses below the binade edge
    (-3.0, 0.0107421875, torch.bfloat16, None),
    (1.0, 2.0**-7 * 0.3, torch.float32, Float(8, 7)),  # bfloat16 values in float32
    (0.5, 2.0**-40 * 3, torch.float32, Float(8, 23)),  # a tail 40 bits down
    (1.0, 0.126, torch.float16, Float(5, 2)),
    (2.0**-15, 3e-6, torch.float16, None),  # subnormal range
    (0.0, 1e-8, torch.float16, None),  # below the smallest subnormal
    (3.0, 0.4, torch.float32, Fixed(8, 2)),
    (1.0, 1e-20, torch.float64, Float(11, 52)),
]


def _neighbours(a: float, b: float, dtype, fmt) -> tuple[float, float, float]:
    """The two format values around a + b (exact, as Fractions) and the fraction p of the way."""
    grid = ref.container_grid(fmt if fmt is not None else lpsim.update.own_format(dtype), dtype)
    total = Fraction(a) + Fraction(b)
    below = Fraction(ref.round_rational(abs(total), total < 0, grid, Rounding.down))
    above = Fraction(ref.round_rational(abs(total), total < 0, grid, Rounding.up))
    low, high = min(below, above), max(below, above)
    return float(low), float(high), float((total - low) / (high - low))


@pytest.mark.parametrize(
    "a,b,dtype,fmt", UNBIASED_CASES, ids=[f"{a}+{b}-{d}-{f!r}" for a, b, d, f in UNBIASED_CASES]
)
def test_stochastic_sum_is_unbiased(a, b, dtype, fmt):
    below, above, p = _neighbours(a, b, dtype, fmt)
    b_tensor = torch.tensor(b, dtype=torch.float64)
    draws = lpsim.sr_add(torch.full((N,), a, dtype=dtype), b_tensor, fmt, seed=1).double()
    assert set(draws.unique().tolist()) <= {below, above}
    exact = float(Fraction(a) + Fraction(b))
    _assert_mean(draws, exact, below, above, p)


@pytest.mark.parametrize(
    "a,b,dtype,fmt", UNBIASED_CASES[:6], ids=[f"{a}+{b}-{d}" for a, b, d, _ in UNBIASED_CASES[:6]]
)
def test_stochastic_equal_sum_moves_either_way_half_the_time(a, b, dtype, fmt):
    below, above, _ = _neighbours(a, b, dtype, fmt)
    draws = lpsim.sr_add(
        torch.full((N,), a, dtype=dtype),
        torch.tensor(b, dtype=torch.float64),
        fmt,
        "stochastic_equal",
        seed=2,
    ).double()
    share_up = (draws == above).double().mean().item()
    assert (draws == below).sum() + (draws == above).sum() == N
    assert abs(share_up - 0.5) <= 4 * math.sqrt(0.25 / N)


@pytest.mark.parametrize("rbits", [1, 2, 3, 8])
def test_rbits_gives_the_bias_of_truncating_the_exact_sum(rbits):
    # The fraction 0.7 of a bfloat16 spacing lies in the float64 operand, below a's last bit.
    a = torch.ones(N, dtype=torch.bfloat16)
    b = torch.tensor(0.7 * 2.0**-7, dtype=torch.float64)
    draws = lpsim.sr_add(a, b, rbits=rbits, seed=4).double()
    p = math.floor(0.7 * 2**rbits) / 2**rbits
    _assert_mean(draws, 1.0 + 2.0**-7 * p, 1.0, 1.0 + 2.0**-7, p)


@pytest.mark.parametrize("rbits", [2, 8])
def test_rbits_truncates_the_magnitude_so_small_steps_toward_zero_move_a_whole_spacing(rbits):
    # rbits=k truncates |a + b| to k bits below the format's last digit. So -1.5 + 0.1 spacings
    # of bfloat16 rounds up (toward zero) with probability 1 - floor(0.9 * 2**k) / 2**k, not
    # floor(0.1 * 2**k) / 2**k; and a term of 0.001 spacings is never added when it moves the
    # value away from zero, while one that moves it toward zero moves it a whole spacing with
    # probability 2**-k.
    spacing = 2.0**-7
    a = torch.full((N,), -1.5, dtype=torch.bfloat16)
    draws = lpsim.sr_add(a, 0.1 * spacing, rbits=rbits, seed=2)
    p = 1 - math.floor(0.9 * 2**rbits) / 2**rbits
    _assert_mean(draws.double(), -1.5 + spacing * p, -1.5, -1.5 + spacing, p)
    for start in (1.5, -1.5):
        a = torch.full((N,), start, dtype=torch.bfloat16)
        step = math.copysign(1e-3 * spacing, start)
        assert lpsim.sr_add(a, step, rbits=rbits, seed=3).eq(start).all()
        toward = lpsim.sr_add(a, -step, rbits=rbits, seed=3).double()
        moved = toward.ne(start)
        assert toward[moved].eq(start - math.copysign(spacing, start)).all()
        p = 2.0**-rbits
        assert abs(moved.double().mean().item() - p) <= 4 * math.sqrt(p * (1 - p) / N)


def test_probability_is_resolved_to_two_to_the_minus_32():
    # A fraction below 2**-32 of a spacing never rounds up; one within 2**-32 of 1 always does.
    a = torch.ones(N, dtype=torch.bfloat16)
    tiny = lpsim.sr_add(a, torch.tensor(2.0**-7 * 2.0**-33, dtype=torch.float64), seed=6)
    assert tiny.eq(1.0).all()
    almost = lpsim.sr_add(a, torch.tensor(2.0**-7 * (1 - 2.0**-40), dtype=torch.float64), seed=6)
    assert almost.eq(1.0 + 2.0**-7).all()


def test_mixed_precision_operand_is_added_exactly_not_rounded_first():
    # 1 + 2**-8 + 2**-24 lies just above the midpoint of 1 and 1 + 2**-7: nearest rounds up.
    # Rounding b to bfloat16 first (as torch's bfloat16 addition does) makes it a tie, which goes
    # to 1.
    a = torch.ones(1, dtype=torch.bfloat16)
    b = torch.tensor([2.0**-8 + 2.0**-24])
    assert lpsim.sr_add(a, b, rounding="nearest").item() == 1.0 + 2.0**-7
    assert (a + b.bfloat16()).item() == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("b_dtype", [torch.float32, torch.float64], ids=str)
def test_every_code_survives_the_wider_container_unchanged(dtype, b_dtype):
    # a + 0 computed in b's wider container and converted back: every code, NaNs aside, comes back.
    a = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    got = lpsim.sr_add(a, torch.zeros((), dtype=b_dtype), rounding="nearest")
    finite = ~a.isnan()
    nonzero = a != 0
    assert_same_bits(got[finite & nonzero], a[finite & nonzero], "non-zero codes")
    assert got[a.isnan()].isnan().all()


def test_same_seed_gives_the_same_bits_and_other_offsets_other_bits():
    a = torch.randn(4096).bfloat16()
    b = torch.randn(4096) * 1e-3
    first = lpsim.sr_add(a, b, seed=9, offset=3)
    assert_same_bits(lpsim.sr_add(a, b, seed=9, offset=3), first)
    assert not torch.equal(lpsim.sr_add(a, b, seed=9, offset=4), first)
    assert not torch.equal(lpsim.sr_add(a, b, seed=10, offset=3), first)
    torch.manual_seed(5)
    unseeded = lpsim.sr_add(a, b)
    torch.manual_seed(5)
    assert_same_bits(lpsim.sr_add(a, b), unseeded, "torch.manual_seed")


@pytest.mark.parametrize("randomness", ["position", "value"])
def test_same_seed_gives_the_same_bits_for_any_thread_count(randomness):
    a = torch.randn(257, 1031).bfloat16()
    b = torch.randn(257, 1031) * 1e-3
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(lpsim.sr_add(a, b, seed=77, randomness=randomness))
    finally:
        torch.set_num_threads(previous)
    assert_same_bits(results[1], results[0], "2 threads")
    assert_same_bits(results[2], results[0], "3 threads")


def test_value_keyed_rounding_is_invariant_under_permutation_layout_and_splitting():
    torch.manual_seed(0)
    a = torch.randn(64, 48).bfloat16()
    b = torch.randn(64, 48) * 3e-3
    want = lpsim.sr_add(a, b, seed=8, randomness="value")
    perm = torch.randperm(a.numel())
    permuted = lpsim.sr_add(a.flatten()[perm], b.flatten()[perm], seed=8, randomness="value")
    assert_same_bits(permuted, want.flatten()[perm], "permuted")
    transposed = lpsim.sr_add(a.t().contiguous(), b.t().contiguous(), seed=8, randomness="value")
    assert_same_bits(transposed.t(), want, "transposed")
    halves = torch.cat(
        [
            lpsim.sr_add(a[:20], b[:20], seed=8, randomness="value"),
            lpsim.sr_add(a[20:], b[20:], seed=8, randomness="value"),
        ]
    )
    assert_same_bits(halves, want, "split")
    # Position-keyed words do depend on the order (so the permutation above was a real test).
    by_position = lpsim.sr_add(a.flatten()[perm], b.flatten()[perm], seed=8)
    assert not torch.equal(by_position, lpsim.sr_add(a, b, seed=8).flatten()[perm])


def test_value_words_are_the_reference_philox_of_the_operands():
    torch.manual_seed(1)
    x = torch.randn(300, dtype=torch.float64) * 1e3
    y = torch.randn(300, dtype=torch.float64)
    for seed, offset in ((0, 0), (2**64 - 1, 7), (12345, 2**40 + 3)):
        seed_tensor = torch.tensor(seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64)
        offset_arg = offset - 2**64 if offset >= 2**63 else offset
        got = torch.ops.lpsim.value_words(
            x.view(torch.int64), y.view(torch.int64), seed_tensor, offset_arg
        ).tolist()
        want = [ref.value_word(seed, offset, u, v) for u, v in zip(x.tolist(), y.tolist())]
        assert got == want


def test_non_contiguous_and_broadcast_operands():
    a = torch.randn(30, 40).bfloat16().t()  # a transposed view
    b = torch.randn(40, 1) * 1e-2  # broadcast along the last dimension
    want = ref.sr_add(a, b, None, "stochastic", seed=3)
    assert_same_bits(lpsim.sr_add(a, b, seed=3), want, "functional")
    inplace = a.clone().t().contiguous().t()
    lpsim.sr_add_(inplace, b, seed=3)
    assert_same_bits(inplace, want, "in place on a view")


@pytest.mark.parametrize("shift", [1, -1, 7])
def test_in_place_update_of_an_operand_that_overlaps_it_uses_the_values_before_it(shift):
    # x[1:] += x[:-1]: the kernel writes element i before it reads element i + 1 of the operand,
    # so an operand that shares memory with a must be read as it was before the update.
    torch.manual_seed(4)
    n = 5000
    x = torch.randn(n + abs(shift))
    head, tail = x[:n], x[abs(shift) :]
    a, b = (tail, head) if shift > 0 else (head, tail)
    a_before, b_before = a.clone(), b.clone()
    fmt = Float(5, 2)
    for rule in ("nearest", "stochastic"):
        want = lpsim.sr_add(a_before, b_before, fmt, rule, seed=1)
        y = x.clone()
        ya, yb = (y[abs(shift) :], y[:n]) if shift > 0 else (y[:n], y[abs(shift) :])
        lpsim.sr_add_(ya, yb, fmt, rule, seed=1)
        assert torch.equal(ya, want), f"sr_add_ {rule}"
        want = lpsim.sr_addcmul(a_before, b_before, b_before, 0.5, fmt, rule, seed=1)
        y = x.clone()
        ya, yb = (y[abs(shift) :], y[:n]) if shift > 0 else (y[:n], y[abs(shift) :])
        lpsim.sr_addcmul_(ya, yb, yb, 0.5, fmt, rule, seed=1)
        assert torch.equal(ya, want), f"sr_addcmul_ {rule}"
        want = lpsim.sr_addcdiv(a_before, b_before, a_before, 0.5, fmt, rule, seed=1)
        y = x.clone()
        ya, yb = (y[abs(shift) :], y[:n]) if shift > 0 else (y[:n], y[abs(shift) :])
        lpsim.sr_addcdiv_(ya, yb, ya, 0.5, fmt, rule, seed=1)
        assert torch.equal(ya, want), f"sr_addcdiv_ {rule}"


def test_compiled_in_place_update_of_an_overlapping_operand_uses_the_values_before_it():
    # Inductor calls the op with the aliasing views (it removes even a clone the caller makes): the
    # op itself reads the operand from a copy.
    def update(x):
        lpsim.sr_add_(x[1:], x[:-1], Float(5, 2), "nearest")
        return x

    x = torch.randn(2000)
    want = update(x.clone())
    got = torch.compile(update, backend="inductor", fullgraph=True)(x.clone())
    assert torch.equal(got, want)


def test_in_place_update_with_a_itself_as_operand_adds_each_element_to_itself():
    for x in (torch.randn(3000), torch.randn(60, 50).t()):
        want = lpsim.sr_add(x.clone(), x.clone(), Float(5, 2), "nearest")
        lpsim.sr_add_(x, x, Float(5, 2), "nearest")
        assert torch.equal(x, want)


@pytest.mark.parametrize("divide", [False, True])
@pytest.mark.parametrize(
    "a_dtype,t_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float16, torch.float64),
        (torch.float64, torch.float32),
    ],
    ids=str,
)
def test_addcmul_and_addcdiv_round_the_exact_sum_of_a_and_the_term(divide, a_dtype, t_dtype):
    torch.manual_seed(2)
    a = torch.randn(2000).to(a_dtype)
    t1 = torch.randn(2000).to(t_dtype)
    t2 = (torch.rand(2000) + 0.5).to(t_dtype)
    value = -1.7e-3
    term = ref.addc_term(a_dtype, t1, t2, value, divide)
    for rule in ("stochastic", "nearest", "stochastic_equal"):
        want = ref.sr_add(a, term, None, rule, seed=21, offset=2)
        fused = lpsim.sr_addcdiv if divide else lpsim.sr_addcmul
        assert_same_bits(fused(a, t1, t2, value, rounding=rule, seed=21, offset=2), want, rule)
        inplace = a.clone()
        (lpsim.sr_addcdiv_ if divide else lpsim.sr_addcmul_)(
            inplace, t1, t2, value, rounding=rule, seed=21, offset=2
        )
        assert_same_bits(inplace, want, f"{rule} in place")


def test_stochastic_adder_add_is_mode_2_and_add_biased_is_unbiased():
    adder = StochasticAdder(torch.bfloat16, seed=3)
    a = torch.ones(N, dtype=torch.bfloat16)
    b = torch.full((N,), 2.0**-7 * 0.1)  # a tenth of a spacing
    biased_coin = adder.add_biased(a, b).double()
    _assert_mean(biased_coin, 1.0 + 2.0**-7 * 0.1, 1.0, 1.0 + 2.0**-7, 0.1)
    fair_coin = adder.add(a, b).double()
    assert abs((fair_coin > 1).double().mean().item() - 0.5) <= 4 * math.sqrt(0.25 / N)
    # Each call draws new words; a float32 operand pair is rounded into the adder's dtype.
    assert not torch.equal(adder.add_biased(a, b), adder.add_biased(a, b))
    out = adder.add_biased(b, a.float())
    assert out.dtype == torch.bfloat16
    assert adder.calls == 5


def test_stochastic_adder_takes_stochastorchs_arguments_positionally_and_by_name():
    # StochasTorch: StochasticAdder(float_type, seed=None), both positional or keyword.
    parameters = inspect.signature(StochasticAdder).parameters
    positional = [p for p in parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == [
        ("float_type", inspect.Parameter.empty),
        ("seed", None),
    ]
    a = torch.ones(256, dtype=torch.bfloat16)
    b = torch.full((256,), 2.0**-10)
    want = StochasticAdder(torch.bfloat16, seed=5).add_biased(a, b)
    for adder in (
        StochasticAdder(torch.bfloat16, 5),
        StochasticAdder(float_type=torch.bfloat16, seed=5),
    ):
        assert adder.dtype == adder.float_type == torch.bfloat16
        assert_same_bits(adder.add_biased(a, b), want)


def test_stochastic_adder_methods_take_stochastorchs_parameter_names():
    # StochasTorch: add(self, x, y) and add_biased(self, x, y); a call by keyword carries over.
    a = torch.ones(256, dtype=torch.bfloat16)
    b = torch.full((256,), 2.0**-10)
    for name in ("add", "add_biased"):
        parameters = inspect.signature(getattr(StochasticAdder, name)).parameters
        assert list(parameters) == ["self", "x", "y"]
        want = getattr(StochasticAdder(torch.bfloat16, seed=5), name)(a, b)
        got = getattr(StochasticAdder(torch.bfloat16, seed=5), name)(x=a, y=b)
        assert_same_bits(got, want, name)
        adder = StochasticAdder(torch.bfloat16, seed=5)
        with pytest.raises(TypeError, match=re.escape("x must be a torch.Tensor")):
            getattr(adder, name)([1.0], b)
        with pytest.raises(TypeError, match=re.escape("y must be a torch.Tensor")):
            getattr(adder, name)(a, "0.5")
        with pytest.raises(ValueError, match=re.escape("x of shape (256,) and y of shape (3,)")):
            getattr(adder, name)(a, torch.ones(3))
        with pytest.raises(ValueError, match=re.escape("y must be on x's device (cpu)")):
            getattr(adder, name)(a, torch.ones(256, device="meta"))
        with pytest.raises(ValueError, match=re.escape("y must be within the float64 range")):
            getattr(adder, name)(a, 2**1100)
        assert adder.calls == 0


def test_stochastic_adder_returns_exact_sums_unchanged():
    # StochasTorch's add moves an exact sum one step down half the time, and its add_biased does
    # so for equal operands; here every exact sum (x + x, and sums that fit bfloat16) stays.
    adder = StochasticAdder(torch.bfloat16, seed=0)
    x = torch.linspace(1, 2, 257, dtype=torch.bfloat16)
    y = torch.linspace(0.5, 0.75, 257, dtype=torch.bfloat16)
    exact = (x.double() + y.double()).bfloat16().double() == x.double() + y.double()
    for add in (adder.add, adder.add_biased):
        assert_same_bits(add(x, x), (x.double() * 2).bfloat16())
        assert_same_bits(add(x, y)[exact], (x + y)[exact])


def test_a_stochastic_adder_call_that_raises_leaves_the_next_calls_words_as_they_were():
    a, b = torch.ones(64, dtype=torch.bfloat16), torch.full((64,), 2.0**-10)
    untouched, failed = (StochasticAdder(torch.bfloat16, seed=4) for _ in range(2))
    with pytest.raises(ValueError, match="b"):  # raised by sr_add: beyond float64's range
        failed.add_biased(a, 10**400)
    assert_same_bits(failed.add_biased(a, b), untouched.add_biased(a, b))


def test_a_stochastic_adder_resumed_from_its_state_dict_continues_the_uninterrupted_run():
    """Ten stochastic weight updates, uninterrupted, and stopped after four: a new adder given the
    saved state_dict (and made after torch's generator moved on) draws the words the first adder
    would have drawn; without it the resumed adder repeats the words of the first calls."""
    g = torch.Generator().manual_seed(8)
    updates = [torch.randn(512, generator=g) * 2.0**-9 for _ in range(10)]

    def train(adder, w, steps):
        for u in steps:
            w = adder.add_biased(w, u)
        return w

    w0 = torch.ones(512, dtype=torch.bfloat16)
    torch.manual_seed(1)
    straight = train(StochasticAdder(torch.bfloat16), w0, updates)
    torch.manual_seed(1)
    first = StochasticAdder(torch.bfloat16)
    w = train(first, w0, updates[:4])
    saved = first.state_dict()
    assert saved == {"seed": first.seed, "calls": 4}
    torch.manual_seed(2)
    resumed = StochasticAdder(torch.bfloat16)
    resumed.load_state_dict(saved)
    assert_same_bits(train(resumed, w, updates[4:]), straight)
    # The oracle of the streams: call k of an adder is sr_add at offset k under its seed.
    want = lpsim.sr_add(w, updates[4], None, "stochastic", seed=saved["seed"], offset=4)
    resumed.load_state_dict(saved)
    assert_same_bits(resumed.add_biased(w, updates[4]), want)
    with pytest.raises(ValueError, match=re.escape("state_dict['calls'] must be in [0,")):
        resumed.load_state_dict({"seed": 0, "calls": -1})
    with pytest.raises(ValueError, match=re.escape("state_dict['seed']: seed must be in [0,")):
        resumed.load_state_dict({"seed": 2**64, "calls": 0})
    with pytest.raises(KeyError, match="calls"):
        resumed.load_state_dict({"seed": 0})


def test_stochastic_adder_of_float64_adds_narrower_operands_exactly():
    adder = StochasticAdder(torch.float64, seed=0)
    a = torch.tensor([1.0, -3.0, 2.0**-20], dtype=torch.bfloat16)
    b = torch.tensor([2.0**-30, 2.0**100, -(2.0**-149)])
    want = a.double() + b.double()  # exact in float64: returned unchanged
    assert_same_bits(adder.add_biased(a, b), want, "add_biased")
    assert_same_bits(adder.add(b, a), want, "add")


@pytest.mark.parametrize("swap", [False, True])
def test_stochastic_adder_broadcasts_its_operands_as_torch_addition(swap):
    adder = StochasticAdder(torch.bfloat16, seed=0)
    column = torch.tensor([[1.0], [2.0]], dtype=torch.bfloat16)
    row = torch.tensor([0.5, 0.25, -1.0])  # float32: the container is the bfloat16 operand
    a, b = (row, column) if swap else (column, row)
    want = torch.add(a, b).bfloat16()  # every sum is exact in bfloat16
    assert_same_bits(adder.add_biased(a, b), want, "add_biased")
    assert_same_bits(adder.add(a, b), want, "add")
    with pytest.raises(ValueError, match="cannot be broadcast together"):
        adder.add(torch.ones(2, dtype=torch.bfloat16), torch.ones(3))


def test_sr_add_gradient_is_the_identity_for_both_operands():
    a = torch.randn(5, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    lpsim.sr_add(a, b, Float(5, 2), seed=0).sum().backward()
    assert torch.equal(a.grad, torch.ones(5))
    assert torch.equal(b.grad, torch.ones(5, dtype=torch.float64))


@pytest.mark.parametrize(
    "call,error,words",
    [
        (lambda a: lpsim.sr_add(a, 1.0, lpsim.BlockFloat(8)), TypeError, "Float, Fixed or P3109"),
        (lambda a: lpsim.sr_add(a, 1.0, Float(8, 10)), ValueError, "does not fit a bfloat16"),
        (lambda a: lpsim.sr_add(a, torch.ones(3)), ValueError, "cannot be broadcast"),
        (lambda a: lpsim.sr_add(a, "x"), TypeError, "b must be a torch.Tensor"),
        (lambda a: lpsim.sr_add(a.int(), 1.0), TypeError, "a must be a float32"),
        (
            lambda a: lpsim.sr_add(a, 1.0, randomness="hash"),
            ValueError,
            "randomness must be one of",
        ),
        (lambda a: lpsim.sr_add(a, 1.0, rounding="nearest", rbits=4), ValueError, "rbits applies"),
        (lambda a: lpsim.sr_add(a, 1.0, rbits=0), ValueError, "rbits must be in [1, 32]"),
        (lambda a: lpsim.sr_add(a, 1.0, seed=-1), ValueError, "seed must be in [0, 2**64)"),
        (lambda a: lpsim.sr_addcmul_(a, a, a, value="x"), TypeError, "value must be a number"),
        (lambda a: lpsim.sr_add(a, 2**1100), ValueError, "b must be within the float64 range"),
        (
            lambda a: lpsim.sr_addcdiv(a, a, a, value=-(2**1024)),
            ValueError,
            "value must be within the float64 range",
        ),
        (
            lambda a: lpsim.sr_addcmul(a, 3**700, a),
            ValueError,
            "tensor1 must be within the float64 range",
        ),
        (lambda a: StochasticAdder(torch.int32), TypeError, "float_type must be"),
        # "unhashable type: 'list'" from the cache of the dtype's format
        (lambda a: StochasticAdder([torch.bfloat16]), TypeError, "float_type must be"),
        (lambda a: lpsim.sr_add(a.to_sparse(), 1.0), TypeError, "a is a sparse_coo tensor"),
        (lambda a: lpsim.sr_add_(a, a.to_sparse()), TypeError, "b is a sparse_coo tensor"),
        (lambda a: lpsim.sr_addcdiv(a, a, a.to_sparse()), TypeError, "tensor2 is a sparse_coo"),
        # torch's "Promotion for Float8 Types is not supported" before the operands were checked
        (
            lambda a: lpsim.sr_addcmul(a, a.to(torch.float8_e4m3fn), a),
            TypeError,
            "tensor1 must be a float32, float64, bfloat16 or float16 tensor, got torch.float8",
        ),
        (
            lambda a: lpsim.sr_addcdiv_(a, a, a.to(torch.float8_e5m2)),
            TypeError,
            "tensor2 must be a float32, float64, bfloat16 or float16 tensor, got torch.float8",
        ),
        # named a (sr_add's), and y's raised torch's "expand is unsupported for Sparse tensors"
        (
            lambda a: StochasticAdder(torch.bfloat16, 0).add(a.to_sparse(), a),
            TypeError,
            "x is a sparse_coo tensor; StochasticAdder takes strided tensors",
        ),
        (
            lambda a: StochasticAdder(torch.bfloat16, 0).add_biased(a, a.to_sparse()),
            TypeError,
            "y is a sparse_coo tensor; StochasticAdder takes strided tensors",
        ),
    ],
)
def test_bad_arguments_raise_errors_that_name_them(call, error, words):
    with pytest.raises(error, match=re.escape(words)):
        call(torch.ones(4, dtype=torch.bfloat16))


def test_the_op_rejects_grids_without_explicit_precision():
    a = torch.ones(4)
    with pytest.raises(RuntimeError, match="explicit precision and finite limits"):
        torch.ops.lpsim.sr_add(
            a, a, *Fixed(8, 4).grid(), 0, 32, torch.zeros((), dtype=torch.int64), 0, 0
        )


@pytest.mark.parametrize(
    "module",
    [lpsim.update, lpsim.accumulate, lpsim.optim.stochastic, lpsim.compat.stochastorch],
    ids=lambda m: m.__name__,
)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


@pytest.mark.parametrize(
    "op, dtype",
    [("addcmul", torch.float32), ("addcdiv", torch.float32), ("addcdiv", torch.float64)],
    ids=str,
)
def test_addcmul_and_addcdiv_with_nearest_into_a_own_dtype_are_torchs(op, dtype):
    # torch's CPU addcdiv is a + (value * t1) / t2, each operation rounded; its addcmul is
    # fma(value * t1, t2, a), the last product exact. lpsim forms the same term (addcmul's product
    # held exactly) and rounds its exact sum with a once: to nearest, torch's result. (A float64
    # addcmul product has no wider container to be held in, so float64 addcmul is not compared.)
    generator = torch.Generator().manual_seed(4)
    a, t1 = (torch.randn(20000, generator=generator, dtype=dtype) for _ in range(2))
    t2 = torch.rand(20000, generator=generator, dtype=dtype) + 0.01
    for value in (1.0, -1.7e-3, 0.3):
        got = getattr(lpsim, f"sr_{op}")(a, t1, t2, value, rounding="nearest")
        assert_same_bits(got, getattr(torch, op)(a, t1, t2, value=value), f"value {value}")
        inplace = a.clone()
        getattr(lpsim, f"sr_{op}_")(inplace, t1, t2, value, rounding="nearest")
        want = getattr(a.clone(), f"{op}_")(t1, t2, value=value)
        assert_same_bits(inplace, want, f"value {value} in place")


@pytest.mark.parametrize("op", ["addcmul", "addcdiv"])
def test_addcmul_and_addcdiv_are_torchs_on_special_operands_up_to_the_bits_of_a_nan(op):
    # Every triple of zeros, infinities, NaNs, extremes and subnormals: float32 results with
    # "nearest" are torch's bit for bit, NaN where torch's is NaN. A NaN's sign may differ: Inf -
    # Inf gives +NaN, and a NaN a is kept before a NaN term (torch on x86: its negative default
    # NaN, and the term's NaN).
    finfo = torch.finfo(torch.float32)
    values = [0.0, -0.0, 1.0, -1.5, math.inf, -math.inf, math.nan, finfo.max, -finfo.max]
    values += [finfo.smallest_normal, -(2.0**-149), 3.0]
    a, t1, t2 = (torch.tensor(column) for column in zip(*itertools.product(values, repeat=3)))
    for value in (1.0, -0.5, 0.0, math.inf):
        got = getattr(lpsim, f"sr_{op}")(a, t1, t2, value, rounding="nearest")
        want = getattr(torch, op)(a, t1, t2, value=value)
        assert_same_bits(got, want, f"value {value}")
        assert torch.equal(got.isnan(), want.isnan())
        term = getattr(torch, op)(torch.zeros_like(a), t1, t2, value=value)
        nan_sum = a.isinf() & term.isinf() & got.isnan()  # Inf - Inf
        assert not got[nan_sum].signbit().any()
        nan_a = a.isnan()
        assert torch.equal(got[nan_a].view(torch.int32), a[nan_a].view(torch.int32))


@pytest.mark.parametrize("op", ["addcmul", "addcdiv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_addc_value_beyond_float32s_range_is_refused_where_torch_refuses_it(op, dtype):
    # torch converts value to float32, its opmath type for these dtypes, and refuses a finite
    # value beyond float32's range rather than make the factor infinite; lpsim's term is the same
    # float32 computation, so it refuses the same values, and takes those torch takes as torch does.
    a, t1 = torch.full((3,), 1.0, dtype=dtype), torch.full((3,), 0.0, dtype=dtype)
    t2 = torch.full((3,), 2.0, dtype=dtype)
    largest = torch.finfo(torch.float32).max
    for value in (math.nextafter(largest, math.inf), -1e39, 1e300):
        with pytest.raises(RuntimeError, match="without overflow"):
            getattr(torch, op)(a, t1, t2, value=value)
        for fused in (getattr(lpsim, f"sr_{op}"), getattr(lpsim, f"sr_{op}_")):
            with pytest.raises(ValueError, match="value must be within float32's range"):
                fused(a.clone(), t1, t2, value, rounding="nearest")
    for value in (largest, -largest, math.inf, 1e-50):
        want = getattr(torch, op)(a.float(), t1.float(), t2.float(), value=value)
        got = getattr(lpsim, f"sr_{op}")(a, t1, t2, value, rounding="nearest")
        assert_same_bits(got.float(), want, f"value {value!r}")
    # A float64 term takes any float64 value (torch too): 1e300 * 0 is 0.
    a64, t64 = a.double(), t1.double()
    got = getattr(lpsim, f"sr_{op}")(a64, t64, t2.double(), 1e300, rounding="nearest")
    assert_same_bits(got, getattr(torch, op)(a64, t64, t2.double(), value=1e300), "float64")


@pytest.mark.parametrize("op", ["addcmul", "addcdiv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_addc_zero_dim_and_number_operands_follow_torchs_type_promotion(op, dtype):
    # torch.addcmul(a, t1, t2) with a 0-d t2 converts it to the dtype of the tensors with
    # dimensions (a 0-d float64 tensor does not make the term float64), and a Python number is a
    # wrapped number, which never decides the dtype: torch.result_type(a, t2) is that dtype. In
    # float32 the oracle is torch's addcmul and addcdiv themselves; in bfloat16 and float16
    # (where torch rounds its float32 sum a second time) it is the operand converted by torch and
    # given with a's shape.
    generator = torch.Generator().manual_seed(5)
    a, t1 = (torch.randn(4000, generator=generator).to(dtype) for _ in range(2))
    fused, inplace = getattr(lpsim, f"sr_{op}"), getattr(lpsim, f"sr_{op}_")
    for t2 in (0.7, 1 + 2**-30, torch.tensor(0.7, dtype=torch.float64), torch.tensor(1 + 2**-30)):
        as_tensor = t2 if isinstance(t2, torch.Tensor) else torch.tensor(t2, dtype=torch.float64)
        promoted = as_tensor.to(torch.result_type(a, t2)).expand(a.shape).contiguous()
        for first in (True, False):
            args = (t1, t2) if first else (t2, t1)
            if dtype == torch.float32:
                want_args = (t1, as_tensor) if first else (as_tensor, t1)
                want = getattr(torch, op)(a, *want_args, value=0.3)
            else:
                want_args = (t1, promoted) if first else (promoted, t1)
                want = fused(a, *want_args, 0.3, rounding="nearest")
            got = fused(a, *args, 0.3, rounding="nearest")
            assert_same_bits(got, want, f"{t2!r} {dtype}")
            b = a.clone()
            inplace(b, *args, 0.3, rounding="nearest")
            assert_same_bits(b, want, f"{t2!r} {dtype} in place")


def test_in_place_updates_of_a_negative_view_write_the_results_through_it():
    # z.conj().imag views z's imaginary parts with torch's negative bit. The in-place updates leave
    # it holding the out-of-place results for its values (and z.imag their negatives), b read
    # before the update when it is the view itself. Calls alternate deterministic and stochastic
    # rules: torch's fallback for such views corrupted the heap on lpsim's in-place ops.
    generator = torch.Generator().manual_seed(8)
    a, b = (torch.randn(6, 40, generator=generator) for _ in range(2))
    t2 = torch.rand(6, 40, generator=generator) + 0.5
    ops = [
        (lpsim.sr_add_, lpsim.sr_add, (b,)),
        (lpsim.sr_addcmul_, lpsim.sr_addcmul, (b, t2, 0.3)),
        (lpsim.sr_addcdiv_, lpsim.sr_addcdiv, (b, t2, -0.7)),
    ]
    for i, rule in enumerate(["nearest", "stochastic", "up", "stochastic_equal", "down"] * 2):
        for inplace, fused, operands in ops:
            z = torch.complex(torch.zeros(6, 40), -a)
            view = z.conj().imag
            assert inplace(view, *operands, Float(5, 4), rule, seed=i) is view
            want = fused(a, *operands, Float(5, 4), rule, seed=i)
            assert_same_bits(view, want, f"{fused.__name__} {rule}")
            assert_same_bits(z.imag, -want, f"{fused.__name__} {rule}: the memory")
        z = torch.complex(torch.zeros(6, 40), -a)
        view = z.conj().imag
        lpsim.sr_add_(view, view, Float(5, 4), rule, seed=i)
        assert_same_bits(view, lpsim.sr_add(a, a, Float(5, 4), rule, seed=i), f"b is a {rule}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_adder_rounds_subnormals_overflow_and_specials_as_ieee_addition(dtype):
    # A plain model of StochasTorch's documented semantics: the exact sum rounds to one of its two
    # neighbours in the dtype, up with probability (distance from the lower one) / spacing, where
    # the neighbour above the largest finite value is Inf; IEEE addition's special cases stand.
    info = torch.finfo(dtype)
    adder = StochasticAdder(dtype, seed=11)
    tiny = info.smallest_normal * info.eps  # the smallest subnormal
    low = torch.full((N,), tiny, dtype=dtype)
    up = adder.add_biased(low, tiny / 4).double()  # a quarter of the subnormal spacing
    assert set(up.unique().tolist()) <= {tiny, 2 * tiny}
    _assert_mean(up, tiny * 1.25, tiny, 2 * tiny, 0.25)
    top_spacing = info.max * info.eps / (2 - info.eps)  # the spacing below max: 2^emax eps
    top = torch.full((N,), info.max, dtype=dtype)
    over = adder.add_biased(top, top_spacing / 2)
    assert set(over.double().unique().tolist()) == {info.max, math.inf}
    assert abs(over.isinf().double().mean().item() - 0.5) <= 4 * math.sqrt(0.25 / N)
    a = torch.tensor([math.nan, math.inf, math.inf, -0.0, 1.0, -1.0], dtype=dtype)
    b = torch.tensor([1.0, 1.0, -math.inf, -0.0, -1.0, 1.0], dtype=dtype)
    want = torch.tensor([math.nan, math.inf, math.nan, -0.0, 0.0, 0.0], dtype=dtype)
    for add in (adder.add, adder.add_biased):
        got = add(a, b)
        assert torch.equal(got.isnan(), want.isnan())
        assert_same_bits(got[~want.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_stochastic_adder_by_value_rounds_a_plus_b_as_b_plus_a(dtype):
    # StochasTorch's random choice hashes the XOR of the two operands, so add(x, y) and add(y, x)
    # round alike; the adder's randomness="value" keys by the operands' values and must too (and
    # "position" does, as the position is the same).
    g = torch.Generator().manual_seed(1)
    x = torch.rand(4096, generator=g).to(dtype)
    y = (torch.rand(4096, generator=g) * 2.0**-6).to(dtype)
    x[:4] = torch.tensor([math.nan, 0.0, -0.0, -0.0])
    y[:4] = torch.tensor([1.0, -0.0, 0.0, -0.0])
    for randomness in ("value", "position"):
        for name in ("add", "add_biased"):
            adders = [StochasticAdder(dtype, seed=9, randomness=randomness) for _ in range(2)]
            xy = getattr(adders[0], name)(x, y)
            yx = getattr(adders[1], name)(y, x)
            assert_same_bits(xy, yx)
            assert math.isnan(xy[0].item())
            assert_same_bits(xy[1:4], torch.tensor([0.0, 0.0, -0.0], dtype=dtype))
            assert bool(((xy[4:] - (x[4:].double() + y[4:].double())).abs() > 0).any())


@pytest.mark.parametrize(
    "dtype,dtype_a,dtype_b",
    [
        (torch.bfloat16, torch.float32, torch.float64),
        (torch.bfloat16, torch.float16, torch.float32),
        (torch.float16, torch.float32, torch.bfloat16),
        (torch.float32, torch.bfloat16, torch.float64),
        (torch.float32, torch.float16, torch.bfloat16),
    ],
)
def test_stochastic_adder_by_value_rounds_a_plus_b_as_b_plus_a_when_neither_has_its_dtype(
    dtype, dtype_a, dtype_b
):
    # The adder's docstring: under both randomness settings add(a, b) and add(b, a) round alike,
    # also for operands of other dtypes (the sum is rounded into the adder's dtype). Each result
    # is one of the two neighbours of the exact sum in that dtype.
    g = torch.Generator().manual_seed(2)
    x = torch.rand(4096, generator=g).to(dtype_a)
    y = torch.rand(4096, generator=g) * torch.exp2(-torch.randint(6, 30, (4096,), generator=g))
    y = y.to(dtype_b)
    exact = x.double() + y.double()
    below = exact.to(dtype).double()
    below = torch.where(
        below > exact,
        torch.nextafter(below.to(dtype), below.new_tensor(0.0).to(dtype)).double(),
        below,
    )
    above = torch.nextafter(below.to(dtype), below.new_tensor(math.inf).to(dtype)).double()
    above = torch.where(below == exact, below, above)
    for randomness in ("value", "position"):
        for name in ("add", "add_biased"):
            adders = [StochasticAdder(dtype, seed=9, randomness=randomness) for _ in range(2)]
            xy = getattr(adders[0], name)(x, y)
            yx = getattr(adders[1], name)(y, x)
            assert xy.dtype == dtype
            assert_same_bits(xy, yx, f"{randomness} {name}")
            assert bool(((xy.double() == below) | (xy.double() == above)).all())
            assert bool((xy.double() != exact).any())


# ---- An oracle written from the documentation alone (docs/rounding.md, lpsim.formats), sharing
# nothing with lpsim.reference: the grid of a Float or a clamping Fixed format, each deterministic
# rule on a magnitude, the overflow policy, and IEEE 754's signs of zero sums.

_TOWARD_ZERO_ON_OVERFLOW = {"toward_zero", "odd"}


def _floor_log2(m: Fraction) -> int:
    e = m.numerator.bit_length() - m.denominator.bit_length()
    while Fraction(2) ** e > m:
        e -= 1
    while Fraction(2) ** (e + 1) <= m:
        e += 1
    return e


def _doc_round(v, negative_zero: bool, fmt, rule: str) -> float:
    """v (a Fraction, or a float Inf or NaN; a zero v is -0 when negative_zero) rounded into fmt
    by a deterministic rule, as the docs describe it: the neighbours below and above |v| on the
    grid, the rule's choice (ties to the neighbour whose last digit is 0; man=0 significands are
    all odd, zero is even), then a result beyond the limit overflows (the limit for saturating
    formats, clamping Fixed formats and the rules rounding toward zero there; else Inf, or NaN
    without Inf)."""
    no_negative_zero = (fmt.special == "fnuz") if isinstance(fmt, Float) else not fmt.signed
    if isinstance(v, float):  # Inf or NaN
        if math.isnan(v) or (isinstance(fmt, Float) and fmt.has_inf):
            return v
        if isinstance(fmt, Fixed) or fmt.saturate:
            return fmt.min if v < 0 else fmt.max
        return math.nan
    if v == 0:
        return -0.0 if negative_zero and not no_negative_zero else 0.0
    negative, m = v < 0, abs(v)
    if isinstance(fmt, Float):
        small = m < Fraction(2) ** fmt.emin
        if small and not fmt.subnormals:
            lo, hi, lo_odd = Fraction(0), Fraction(2) ** fmt.emin, False
        else:
            q = Fraction(2) ** ((fmt.emin if small else _floor_log2(m)) - fmt.man)
            lo = m // q * q
            hi, lo_odd = lo + q, lo > 0 and (fmt.man == 0 or (lo / q) % 2 == 1)
        limit = Fraction(fmt.max)
    else:
        q = Fraction(2) ** -fmt.fl
        lo = m // q * q
        hi, lo_odd = lo + q, (lo / q) % 2 == 1
        limit = -Fraction(fmt.min) if negative else Fraction(fmt.max)
    mid = (lo + hi) / 2
    choice = {
        "nearest": lo if m < mid or (m == mid and not lo_odd) else hi,
        "nearest_away": lo if m < mid else hi,
        "nearest_zero": lo if m <= mid else hi,
        "toward_zero": lo,
        "away": hi,
        "up": lo if negative else hi,
        "down": hi if negative else lo,
        "odd": lo if lo_odd else hi,
    }
    r = m if m == lo else choice[rule]
    if r > limit:
        toward_zero = rule in _TOWARD_ZERO_ON_OVERFLOW or rule == ("up" if negative else "down")
        if isinstance(fmt, Fixed) or fmt.saturate or toward_zero:
            r = limit
        elif fmt.has_inf:
            return -math.inf if negative else math.inf
        else:
            return math.nan
    if r == 0:
        return -0.0 if negative and not no_negative_zero else 0.0
    return float(-r if negative else r)


def _ieee_sum(a: float, b, rule: str):
    """(a + b exactly, whether a zero sum is -0), for a float a and a float or Fraction b."""
    b_float = float(b) if isinstance(b, Fraction) else b
    if not (math.isfinite(a) and math.isfinite(b_float)):
        if math.isnan(a) or math.isnan(b_float) or (a == -b_float and math.isinf(a)):
            return math.nan, False
        return (a if math.isinf(a) else b_float), False
    s = Fraction(a) + Fraction(b)
    if s != 0:
        return s, False
    if a == 0 and b == 0:
        a_negative = math.copysign(1, a) < 0
        b_negative = math.copysign(1, b_float) < 0 if isinstance(b, float) else False
        if a_negative == b_negative:
            return s, a_negative
    return s, rule == "down"


_DOC_FORMATS = [
    Float(5, 2),
    Float(4, 3, special="fn"),
    Float(4, 3, special="fn", saturate=True),
    Float(5, 2, special="fnuz"),
    Float(3, 2, subnormals=False),
    Float(3, 0),
    Float(2, 0, special="none", subnormals=False),
    Float(1, 2, special="none"),
    Float(3, 1, bias=-2),
    Float(8, 7),
    Float(5, 10, saturate=True),
    Fixed(6, 3),
    Fixed(5, 2, symmetric=True),
    Fixed(6, 4, signed=False),
    Fixed(8, -2),
]
_DETERMINISTIC = [r.name for r in Rounding if not r.is_stochastic]


@st.composite
def _doc_cases(draw):
    a_dtype = draw(st.sampled_from(DTYPES))
    fmt = draw(st.sampled_from([f for f in _DOC_FORMATS if _fits(f, a_dtype)]))
    low = math.log2(fmt.smallest_subnormal) - 3
    high = math.log2(fmt.max) + 2

    def values(n):
        specials = [0.0, -0.0, math.inf, -math.inf, math.nan, fmt.max, -fmt.max]
        return [
            draw(st.sampled_from(specials))
            if draw(st.integers(0, 9)) == 0
            else draw(st.sampled_from([-1.0, 1.0])) * 2.0 ** draw(st.floats(low, high))
            for _ in range(n)
        ]

    b_dtype = draw(st.sampled_from(sorted({a_dtype, torch.float32, torch.float64}, key=str)))
    a = torch.tensor(values(16), dtype=torch.float64).to(a_dtype)
    b = torch.tensor(values(16), dtype=torch.float64).to(b_dtype)
    return a, b, fmt, draw(st.sampled_from(_DETERMINISTIC))


@given(_doc_cases())
def test_sr_add_and_addcdiv_equal_a_fraction_model_written_from_the_docs(case):
    a, b, fmt, rule = case
    a_values, b_values = a.double().tolist(), b.double().tolist()
    want = [_doc_round(*_ieee_sum(x, y, rule), fmt, rule) for x, y in zip(a_values, b_values)]
    want = torch.tensor(want, dtype=torch.float64).to(a.dtype)
    assert_same_bits(lpsim.sr_add(a, b, fmt, rule), want, f"sr_add {fmt!r} {rule}")
    # addcdiv with value 1 and tensor2 = 1: the term is tensor1 rounded to the term's dtype (a and
    # tensor1 promoted; float32 unless float64), then the exact sum rounded once.
    term_dtype = torch.promote_types(a.dtype, b.dtype)
    term = b.to(torch.float64 if term_dtype == torch.float64 else torch.float32).double().tolist()
    want = [_doc_round(*_ieee_sum(x, t, rule), fmt, rule) for x, t in zip(a_values, term)]
    want = torch.tensor(want, dtype=torch.float64).to(a.dtype)
    got = lpsim.sr_addcdiv(a, b, torch.ones_like(b), 1.0, fmt, rule)
    assert_same_bits(got, want, f"sr_addcdiv {fmt!r} {rule}")


def test_unclamped_fixed_past_its_range_rounds_once_onto_the_values_the_dtype_holds():
    # docs/stochastic-rounding.md: past an unclamped Fixed's range the sum is rounded once onto
    # the grid values that a's dtype holds. The oracle enumerates them: every finite bfloat16 that
    # is a multiple of 1/4, and picks the neighbours of the rational sum by each directed rule
    # and by nearest where the sum is not a tie.
    import bisect

    fmt = Fixed(6, 2, clamp=False)
    codes = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    held = codes.double()[torch.isfinite(codes)]
    grid = sorted({v for v in held.tolist() if (4 * v).is_integer()})
    gen = torch.Generator().manual_seed(0)
    n = 2000
    a = (
        torch.randn(n, generator=gen) * 2.0 ** torch.randint(-3, 11, (n,), generator=gen)
    ).bfloat16()
    b = (
        torch.randn(n, generator=gen) * 2.0 ** torch.randint(-14, 10, (n,), generator=gen)
    ).bfloat16()
    a[0], b[0] = 246.0, 0.6  # 246.6015625: 247 (246.5 rounded again would be 246)
    pairs = list(zip(a.double().tolist(), b.double().tolist()))
    for rule in ("nearest", "toward_zero", "away", "up", "down"):
        got = lpsim.sr_add(a, b, fmt, rule).double().tolist()
        checked = 0
        for (x, y), g in zip(pairs, got):
            exact = Fraction(x) + Fraction(y)
            i = bisect.bisect_left(grid, exact)
            if grid[i] == exact:
                want = grid[i]
            else:
                lo, hi = grid[i - 1], grid[i]
                below, above = exact - Fraction(lo), Fraction(hi) - exact
                if rule == "nearest":
                    if below == above:
                        continue
                    want = lo if below < above else hi
                else:
                    toward_zero = hi if exact < 0 else lo
                    want = {
                        "toward_zero": toward_zero,
                        "away": lo if toward_zero == hi else hi,
                        "up": hi,
                        "down": lo,
                    }[rule]
            assert g == want, (rule, x, y, g, want)
            checked += 1
        assert checked > n * 0.9
    assert lpsim.sr_add(a[:1], b[:1], fmt, "nearest").item() == 247.0


@pytest.mark.parametrize(
    "dtype, fmt, big, top",
    [
        (torch.float16, Fixed(2, -14, clamp=False), 65504.0, 49152.0),
        (torch.float32, Fixed(2, -120, clamp=False), 3.0e38, 255 * 2.0**120),
        (torch.float16, Fixed(8, 4, clamp=False), 65504.0, 65504.0),
    ],
    ids=["float16-coarse", "float32-coarse", "float16-fine"],
)
def test_unclamped_fixed_overflow_past_the_dtype_gives_the_largest_grid_value_it_holds(
    dtype, fmt, big, top
):
    # docs/stochastic-rounding.md: past an unclamped Fixed's range the sum is rounded once onto
    # the grid values a's dtype holds, and a sum beyond the largest of them overflows as IEEE 754
    # says: the rules that round toward zero there give that largest value (top: the dtype's
    # largest multiple of the spacing 2**-fl, computed here with Fractions), the others Inf.
    spacing = Fraction(2) ** -fmt.fl
    assert float(Fraction(torch.finfo(dtype).max) // spacing * spacing) == top
    a = torch.tensor([big, -big], dtype=dtype)
    expected = {
        "toward_zero": [top, -top],
        "odd": [top, -top],
        "down": [top, -math.inf],
        "up": [math.inf, -top],
        "nearest": [math.inf, -math.inf],
        "away": [math.inf, -math.inf],
    }
    for rule, want in expected.items():
        assert lpsim.sr_add(a, a, fmt, rule).tolist() == want, rule
        assert ref.sr_add(a, a, fmt, rule).tolist() == want, rule
    # Below the overflow, the same grid: a sum just under top rounds down to it.
    below = torch.tensor([top / 2], dtype=dtype)
    assert lpsim.sr_add(below, below, fmt, "toward_zero").tolist() == [top]
