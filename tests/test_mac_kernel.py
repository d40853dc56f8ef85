"""mac_matmul's lane loop (csrc/cpu/mac_lanes.cpp) against the scalar loop it replaces for
sequential MACs (one MacSum per result, csrc/cpu/accumulate.cpp), bit for bit: every rule, Float,
Fixed and P3109 accumulators, rounded products, tile remainders, tasks split across threads, and
adversarial sums (ties, near ties, cancellation, subnormals, overflow, Inf and NaN) for its float64
fast path (csrc/include/lpsim/nearest_sum.h). The scalar loop itself is checked against the exact
reference in test_mac.py; a few cases here check the lanes against that reference directly."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
from support import assert_same_bits

import lpsim
from lpsim import MAC, P3109, Fixed, Float
from lpsim import reference as ref

FLOAT16 = Float(5, 10)
BFLOAT16 = Float(8, 7)
FLOAT32 = Float(8, 23)
RULES = [
    "nearest",
    "nearest_away",
    "nearest_zero",
    "toward_zero",
    "away",
    "up",
    "down",
    "odd",
    "stochastic",
    "stochastic_equal",
]
ACCUMULATORS = [
    FLOAT16,
    BFLOAT16,
    FLOAT32,
    Float(4, 3, subnormals=False),
    Float(5, 2, saturate=True),
    Float(4, 3, special="fn"),
    Float(5, 2, special="fnuz"),
    Float(6, 0),
    Fixed(12, 6),
    Fixed(16, 8, clamp=True),
    P3109(8, 3),
    P3109(8, 1),
]


@contextlib.contextmanager
def scalar_loop():
    """Every mac_matmul result from the scalar loop while inside (the lanes switched off)."""
    before = torch.ops.lpsim._mac_lanes(False)
    try:
        yield
    finally:
        torch.ops.lpsim._mac_lanes(before)


def lanes_and_scalar(a, b, mac, seed=3):
    got = lpsim.mac.matmul(a, b, mac, seed=seed, offset=1)
    with scalar_loop():
        want = lpsim.mac.matmul(a, b, mac, seed=seed, offset=1)
    return got, want


def operands(dtype, m, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.randn(m, k, generator=g).mul(2).exp()
    b = torch.randn(k, n, generator=g)
    return a.to(dtype), b.to(dtype)


def test_the_switch_restores_the_lane_loop():
    assert torch.ops.lpsim._mac_lanes(True) is True  # on at load, and left on by every test
    with scalar_loop():
        assert torch.ops.lpsim._mac_lanes(False) is False
    assert torch.ops.lpsim._mac_lanes(True) is True


@pytest.mark.parametrize("rounding", RULES)
@pytest.mark.parametrize("acc", ACCUMULATORS, ids=repr)
def test_lanes_equal_the_scalar_loop_for_every_rule_and_accumulator(acc, rounding):
    # 9 rows and 35 columns: two full tiles of 4 rows and a row left over, two full lane groups of
    # 16 columns and 3 left over.
    a, b = operands(torch.float32, 9, 37, 35, 1)
    mac = MAC(accumulator=acc, rounding=rounding)
    got, want = lanes_and_scalar(a, b, mac)
    assert_same_bits(got, want, repr(mac))


@pytest.mark.parametrize("rounding", RULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lanes_round_products_as_the_scalar_loop_does(dtype, rounding):
    a, b = operands(dtype, 5, 41, 18, 2)
    for mac in (
        MAC(accumulator=BFLOAT16, product=Float(4, 3), rounding=rounding),
        MAC(accumulator=FLOAT32, product=BFLOAT16, rounding=rounding, rbits=7)
        if rounding.startswith("stochastic")
        else MAC(accumulator=FLOAT32, product=BFLOAT16, rounding=rounding),
    ):
        got, want = lanes_and_scalar(a, b, mac)
        assert_same_bits(got, want, repr(mac))


@pytest.mark.parametrize("k", [1, 2, 31, 32, 33, 65])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "up"])
def test_lanes_equal_the_exact_reference(k, rounding):
    # k around the 32 terms whose random words are drawn per block.
    a, b = operands(torch.bfloat16, 5, k, 17, k)
    for acc in (BFLOAT16, Float(4, 3, subnormals=False)):
        mac = MAC(accumulator=acc, rounding=rounding)
        got = lpsim.mac.matmul(a, b, mac, seed=7)
        assert_same_bits(got.double(), ref.mac_matmul(a, b, mac, seed=7), repr(mac))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_lanes_do_not_depend_on_the_thread_count_or_the_tasks_row_boundaries(threads, rounding):
    # 221 results of 300 terms: the op's tasks (16384 / 300 = 54 results) start and end inside
    # rows of 13, so tiles are cut at both ends of a task.
    a, b = operands(torch.float32, 17, 300, 13, 4)
    mac = MAC(accumulator=BFLOAT16, rounding=rounding)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got, want = lanes_and_scalar(a, b, mac)
    finally:
        torch.set_num_threads(before)
    assert_same_bits(got, want, repr(mac))


def adversarial_sums(acc: Float) -> tuple[torch.Tensor, torch.Tensor]:
    """a (M, 2) and b (2, N) whose results are round(round(s) + t) for s every finite value of the
    float32-representable accumulator grid near 1, its subnormals and its largest values (a[:, 0]
    times b[0] = 1), and t (a[:, 1] times b[1]) the distances to the neighbouring midpoints and
    values, nudged by small amounts, and cancellations, zeros, Inf and NaN."""
    values = acc.values().double() if hasattr(acc, "values") else None
    if values is None:
        raise AssertionError("the accumulator must enumerate its values")
    finite = values[torch.isfinite(values)]
    positive = finite[finite > 0]
    picks = torch.cat(
        [positive[:40], positive[len(positive) // 2 - 40 : len(positive) // 2 + 40], positive[-40:]]
    )
    s = torch.cat([picks, -picks, torch.tensor([0.0, -0.0])])
    spacing = torch.cat([positive[1:] - positive[:-1], positive[-1:] - positive[-2:-1]])
    step = torch.cat([spacing[:40], spacing[len(positive) // 2 - 40 : len(positive) // 2 + 40]])
    step = torch.cat([step, spacing[-40:], step.flip(0)[:0]])
    steps = torch.cat([step, step, torch.tensor([1.0, 1.0])])
    # t for each s: multiples of half the spacing at s, nudged by 2^-12 and 2^-30 of it.
    nudges = [0.0, 2.0**-12, -(2.0**-12), 2.0**-30, -(2.0**-30)]
    multiples = [-3.0, -2.0, -1.5, -1.0, -0.5, 0.5, 1.0, 1.5, 2.0, 3.0]
    a1 = []
    for half in multiples:
        for nudge in nudges:
            a1.append(half + nudge)
    a_rows = []
    b_cols = []
    # One row per s, one column per multiple: t = a[i, 1] * b[1, j] = step_i * coefficient_j.
    for si, st in zip(s.tolist(), steps.tolist()):
        a_rows.append([si, st])
    b_cols = [[1.0, c] for c in a1]
    # Terms far below the spacing: s + t is then no float64 value (TwoSum's error is t itself), and
    # rounding it toward zero, down or stochastically differs from rounding s.
    tiny = [2.0**-40, -(2.0**-40), 2.0**-70, -(2.0**-70)]
    extra = [0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0, *tiny]
    b_cols += [[1.0, e] for e in extra]
    a = torch.tensor(a_rows, dtype=torch.float64)
    b = torch.tensor(b_cols, dtype=torch.float64).t()
    # Cancellation: t = -s exactly.
    a_cancel = torch.stack([s, -s], dim=1)
    return torch.cat([a, a_cancel]).float(), b.float()


@pytest.mark.parametrize(
    "acc",
    [FLOAT16, BFLOAT16, Float(4, 3), Float(4, 3, subnormals=False), Float(5, 2, saturate=True)],
    ids=repr,
)
@pytest.mark.parametrize("rounding", RULES)
def test_lanes_agree_on_adversarial_sums(acc, rounding):
    a, b = adversarial_sums(acc)
    assert torch.equal(a.double()[:, 0], a[:, 0].double())  # s is exact in float32
    mac = MAC(accumulator=acc, rounding=rounding)
    got, want = lanes_and_scalar(a, b, mac)
    assert_same_bits(got, want, repr(mac))


@pytest.mark.parametrize("rbits", [1, 4, 13])
@pytest.mark.parametrize("rounding", ["stochastic", "stochastic_equal"])
def test_lanes_agree_on_adversarial_sums_with_few_random_bits(rounding, rbits):
    a, b = adversarial_sums(BFLOAT16)
    mac = MAC(accumulator=BFLOAT16, rounding=rounding, rbits=rbits)
    got, want = lanes_and_scalar(a, b, mac)
    assert_same_bits(got, want, repr(mac))


@pytest.mark.parametrize("rounding", RULES)
@pytest.mark.parametrize("acc", [BFLOAT16, FLOAT16], ids=repr)
def test_lanes_match_the_core_on_random_float32_sums_of_every_magnitude(acc, rounding):
    # Products of random float32 values of every magnitude: 48-bit terms against short sums.
    g = torch.Generator().manual_seed(9)
    a = torch.randn(33, 64, generator=g) * torch.randn(33, 64, generator=g).mul(6).exp()
    b = torch.randn(64, 47, generator=g) * torch.randn(64, 47, generator=g).mul(6).exp()
    a[3, 10] = math.inf
    b[20, 5] = math.nan
    a[7, :] = 0.0
    b[:, 9] = -0.0
    mac = MAC(accumulator=acc, rounding=rounding)
    got, want = lanes_and_scalar(a, b, mac)
    assert_same_bits(got, want, repr(mac))


def test_lanes_handle_every_mac_field_they_do_not_serve_by_the_scalar_loop():
    a, b = operands(torch.float32, 6, 20, 19, 5)
    for mac in (
        MAC(accumulator=BFLOAT16, compensated=True),
        MAC(accumulator=BFLOAT16, order="pairwise"),
        MAC(accumulator=FLOAT32, order="chunked", chunk=4, chunk_accumulator=BFLOAT16),
        lpsim.mac.preset("H100/bf16"),
        lpsim.mac.preset("DeepSeek-V3"),
    ):
        got, want = lanes_and_scalar(a, b, mac)
        assert_same_bits(got, want, repr(mac))
    assert dataclasses.replace(MAC(accumulator=BFLOAT16), rounding="up").rounding.name == "up"
