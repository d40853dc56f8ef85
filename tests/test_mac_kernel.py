"""mac_matmul's faster loops against the scalar loop they replace (one MacSum per result,
csrc/cpu/accumulate.cpp), bit for bit. The lane loop (csrc/cpu/mac_lanes.cpp) for sequential MACs:
every rule, Float, Fixed and P3109 accumulators, rounded products, tile remainders, tasks split
across threads, and adversarial sums (ties, near ties, cancellation, subnormals, overflow, Inf and
NaN) for its float64 fast path (csrc/include/lpsim/nearest_sum.h). The tensor-core loop
(csrc/cpu/tensor_core_loop.cpp): every preset, random tensor cores under every deterministic rule,
Inf, NaN, overflow, cancellation and task boundaries. The scalar loop itself is checked against
the exact reference in test_mac.py; a few cases here check the lanes against that reference
directly."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import assert_same_bits

import lpsim
from lpsim import MAC, P3109, Fixed, Float
from lpsim import reference as ref
from lpsim.mac import TensorCore

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


def lanes_and_scalar(a, b, mac, seed=3, threads=None):
    """a @ b under mac by the faster loops and by the scalar loop, on `threads` threads (None:
    torch's current count, which is restored either way)."""
    before = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        got = lpsim.mac.matmul(a, b, mac, seed=seed, offset=1)
        with scalar_loop():
            want = lpsim.mac.matmul(a, b, mac, seed=seed, offset=1)
    finally:
        torch.set_num_threads(before)
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
    got, want = lanes_and_scalar(a, b, mac, threads=threads)
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
    for si, step_i in zip(s.tolist(), steps.tolist()):
        a_rows.append([si, step_i])
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
    operands_of_every_mac = a, b = operands(torch.float32, 6, 20, 19, 5)
    for mac in (
        MAC(accumulator=BFLOAT16, compensated=True),
        MAC(accumulator=BFLOAT16, order="pairwise"),
        MAC(accumulator=FLOAT32, order="chunked", chunk=4, chunk_accumulator=BFLOAT16),
        lpsim.mac.preset("H100/bf16"),
        lpsim.mac.preset("DeepSeek-V3"),
    ):
        if mac.tensor_core is not None:  # operands of the tensor core's format
            a, b = (lpsim.quantize(x, mac.tensor_core.operands) for x in operands_of_every_mac)
        got, want = lanes_and_scalar(a, b, mac)
        assert_same_bits(got, want, repr(mac))
    assert dataclasses.replace(MAC(accumulator=BFLOAT16), rounding="up").rounding.name == "up"


# ---- The float32 form of the lane loop: nearest onto a grid with float32's exponent range and at
# most 21 kept bits (Float(8, m) with subnormals: bfloat16's), for tiles whose products are exact
# float32 values (operands of at most 24 significant bits between them, magnitudes in
# [2^-62, 2^62)). Every test counts the tiles that form served, so that it cannot pass by falling
# back to the float64 form; the other grids' tiles (float16's among them) are the tests above.


@contextlib.contextmanager
def float_tiles(at_least=1):
    """Asserts that at least `at_least` tiles took the float32 lanes inside the block."""
    before = torch.ops.lpsim._mac_float_tiles()
    yield
    served = torch.ops.lpsim._mac_float_tiles() - before
    assert served >= at_least, f"{served} tiles took the float32 lanes"


def narrow_operands(m, k, n, seed, fmt, spread=2.0):
    """a (m, k) and b (k, n) rounded to `fmt`, of log-normal magnitudes, in float32."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.randn(m, k, generator=g).mul(spread).exp()
    b = torch.randn(k, n, generator=g) * torch.randn(k, n, generator=g).mul(spread).exp()
    return lpsim.quantize(a, fmt), lpsim.quantize(b, fmt)


FLOAT_LANE_ACCUMULATORS = [BFLOAT16, Float(8, 1), Float(8, 3), Float(8, 12), Float(8, 21)]


@pytest.mark.parametrize("acc", FLOAT_LANE_ACCUMULATORS, ids=repr)
@pytest.mark.parametrize("operand", [BFLOAT16, FLOAT16, Float(5, 2)], ids=repr)
def test_float32_lanes_equal_the_scalar_loop_on_narrow_operands(acc, operand):
    # 9 x 35 results (tiles cut in both directions) of 70 terms, magnitudes spread over e^(+-8)
    # (into float16's subnormals); a few operands scaled to overflow the sums of their tiles, which
    # fall back.
    a, b = narrow_operands(9, 70, 35, 11, operand)
    a[8, 3] = 2.0**60
    b[3, 34] = 2.0**61
    mac = MAC(accumulator=acc)
    with float_tiles():
        got, want = lanes_and_scalar(a, b, mac)
    assert_same_bits(got, want, f"{mac!r} on {operand!r} operands")


@pytest.mark.parametrize(
    "a_man, b_man, served", [(11, 11, True), (12, 11, False), (21, 1, True), (22, 1, False)]
)
def test_float32_lanes_take_a_tile_exactly_when_its_products_are_float32_values(
    a_man, b_man, served
):
    # One tile (4 rows by 16 columns) whose widest operands have a_man + 1 and b_man + 1
    # significant bits: its products are all float32 values where these add up to at most 24, and
    # the float32 lanes must then take it and otherwise leave it to the float64 ones.
    g = torch.Generator().manual_seed(5)
    a = lpsim.quantize(torch.randn(4, 40, generator=g), Float(8, a_man))
    b = lpsim.quantize(torch.randn(40, 16, generator=g), Float(8, b_man))
    a[0, 0] = 1 + 2.0**-a_man
    b[0, 0] = -(1 + 2.0**-b_man)
    mac = MAC(accumulator=BFLOAT16)
    before = torch.ops.lpsim._mac_float_tiles()
    got, want = lanes_and_scalar(a, b, mac)
    assert (torch.ops.lpsim._mac_float_tiles() > before) == served
    assert_same_bits(got, want, f"operands of {a_man + 1} and {b_man + 1} bits")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_lanes_take_bfloat16_and_float16_tensors(dtype):
    a, b = narrow_operands(6, 50, 21, 12, BFLOAT16 if dtype == torch.bfloat16 else FLOAT16)
    a, b = a.to(dtype), b.to(dtype)
    for acc in (BFLOAT16, Float(8, 12)):
        mac = MAC(accumulator=acc)
        with float_tiles():
            got, want = lanes_and_scalar(a, b, mac)
        assert_same_bits(got, want, repr(mac))
        assert_same_bits(got.double(), ref.mac_matmul(a, b, mac), f"{mac!r} against the reference")


@pytest.mark.parametrize("acc", [BFLOAT16, Float(8, 7, saturate=True)], ids=repr)
def test_float32_lanes_hand_sums_beyond_the_limit_to_the_core(acc):
    # Row 0 against column 0: 32 terms of 2^123.17 (beyond bfloat16's largest value after 29),
    # then 20 of -2^123.17: the sum overflows and then, saturated, comes back down; row 1 against
    # column 1 overflows negatively. Their tile falls back; rows 4-7 stay in range.
    g = torch.Generator().manual_seed(13)
    a = lpsim.quantize(torch.randn(8, 52, generator=g), BFLOAT16)
    b = lpsim.quantize(torch.randn(52, 16, generator=g), BFLOAT16)
    big = 1.5 * 2.0**61
    a[0, :] = big
    b[:32, 0] = big
    b[32:, 0] = -big
    a[1, :] = -big
    b[:, 1] = big
    mac = MAC(accumulator=acc)
    with float_tiles():
        got, want = lanes_and_scalar(a, b, mac)
    assert_same_bits(got, want, repr(mac))
    assert got[1, 1] == (-acc.max if acc.saturate else -math.inf)
    assert got[0, 0] == (acc.max - 20 * big * big if acc.saturate else math.inf)


def narrow_adversarial_sums(acc: Float) -> tuple[torch.Tensor, torch.Tensor]:
    """adversarial_sums with operands narrow enough for the float32 lanes: a[:, 0] = s, a value of
    the accumulator grid (near its smallest subnormals, near 1, near its largest values, and their
    negatives), times b[0] = 1; a[:, 1] = the grid's spacing at s (a power of two) times b[1] = a
    multiple of half of it nudged by 2^-10 of it (ties, and the values next to them, on both
    sides), so s + t lands on and next to every midpoint and grid value around s; and rows t = -s
    (exact cancellation to +0)."""
    values = acc.values().double()
    positive = values[torch.isfinite(values) & (values > 0)]
    spacing = torch.cat([positive[1:] - positive[:-1], positive[-1:] - positive[-2:-1]])
    middle = len(positive) // 2
    picks = torch.cat([torch.arange(0, 24), torch.arange(middle - 24, middle + 24)])
    picks = torch.cat([picks, torch.arange(len(positive) - 24, len(positive))]).clamp(
        0, len(positive) - 1
    )
    s = torch.cat([positive[picks], -positive[picks]])
    step = torch.cat([spacing[picks], spacing[picks]])
    multiples = [-3.0, -2.0, -1.5, -1.0, -0.5, 0.5, 1.0, 1.5, 2.0, 3.0]
    coefficients = [m + nudge for m in multiples for nudge in (0.0, 2.0**-10, -(2.0**-10))]
    a = torch.stack([s, step], dim=1)
    b = torch.tensor([[1.0, c] for c in coefficients], dtype=torch.float64).t()
    a_cancel = torch.stack([s, -s], dim=1)
    a, b = torch.cat([a, a_cancel]).float(), b.float()
    assert torch.equal(a.double(), torch.cat([torch.stack([s, step], 1), a_cancel]))
    return a, b


@pytest.mark.parametrize("acc", [BFLOAT16, Float(8, 1), Float(8, 4)], ids=repr)
def test_float32_lanes_agree_on_ties_near_ties_cancellation_and_overflow(acc):
    a, b = narrow_adversarial_sums(acc)
    mac = MAC(accumulator=acc)
    with float_tiles():
        got, want = lanes_and_scalar(a, b, mac)
    assert_same_bits(got, want, repr(mac))
    assert_same_bits(got.double(), ref.mac_matmul(a, b, mac), f"{mac!r} against the reference")


def test_float32_lanes_keep_bfloat16_subnormals_in_flush_to_zero_mode_too():
    # Sums that pass through float32's (and bfloat16's) subnormals: 2^-124 (1 + 2^-7) - 2^-124 is
    # 2^-131, and adding 2^-124 back gives 2^-124 (1 + 2^-7). Under flush-to-zero the float32
    # arithmetic would lose the 2^-131 and give 2^-124; the ops' tasks clear that mode
    # (csrc/parallel.h), so the float32 lanes run and keep it.
    a = torch.full((4, 6), 2.0**-62)
    b = torch.zeros(6, 16)
    b[0, :] = 2.0**-62 * (1 + 2.0**-7)
    b[1, :] = -(2.0**-62)
    b[2, :] = 2.0**-62
    b[3, 1::2] = 2.0**-60
    b[4, 2::3] = -(2.0**-61)
    mac = MAC(accumulator=BFLOAT16)
    with float_tiles():
        got, want = lanes_and_scalar(a, b, mac, threads=1)
    assert_same_bits(got, want, "sums through the subnormals")
    assert bool((got[:, 0] == 2.0**-124 * (1 + 2.0**-7)).all())
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        before = torch.ops.lpsim._mac_float_tiles()
        flushed = lpsim.mac.matmul(a, b, mac, seed=3, offset=1)
        assert torch.ops.lpsim._mac_float_tiles() > before
    finally:
        torch.set_flush_denormal(False)
    assert_same_bits(flushed, want, "sums through the subnormals in flush-to-zero mode")


@settings(max_examples=60, deadline=None)
@given(
    man=st.integers(1, 21),
    width=st.integers(1, 12),
    spread=st.floats(0.0, 8.0),
    k=st.integers(1, 90),
    seed=st.integers(0, 2**16),
)
def test_float32_lanes_equal_the_scalar_loop_for_random_grids_and_operand_widths(
    man, width, spread, k, seed
):
    acc = Float(8, man)
    a, b = narrow_operands(5, k, 19, seed, Float(8, width - 1), spread)
    mac = MAC(accumulator=acc)
    got, want = lanes_and_scalar(a, b, mac)
    assert_same_bits(got, want, f"{mac!r}, operands of {width} bits")


# ---- The tensor-core loop (csrc/cpu/tensor_core_loop.cpp) against the scalar loop, bit for bit.

DETERMINISTIC = [r for r in RULES if not r.startswith("stochastic")]


def tensor_core_operands(dtype, m, k, n, seed, fmt=None, spread=4.0):
    """Operands of every magnitude (log-normal), with a cancellation, zero rows and columns, signed
    zeros, and, in float32, subnormals; quantised to `fmt` when given."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.randn(m, k, generator=g).mul(spread).exp()
    b = torch.randn(k, n, generator=g) * torch.randn(k, n, generator=g).mul(spread).exp()
    if k >= 3:
        a[0, :3] = torch.tensor([1e4, -1e4, 3.0])
        b[:3, 0] = 1.0
    if m >= 3:
        a[1, :] = 0.0
        a[2, ::2] = -0.0
    if n >= 3:
        b[:, 1] = -0.0
    if k >= 5 and m >= 4:
        a[3, :5] = torch.tensor([1e-40, -3e-42, 2.0**-149, 1e-39, 5.0])  # float32 subnormals
    if fmt is not None:
        a, b = lpsim.quantize(a, fmt), lpsim.quantize(b, fmt)
    return a.to(dtype), b.to(dtype)


@pytest.mark.parametrize("name", sorted(lpsim.mac.PRESETS))
def test_tensor_core_loop_equals_the_scalar_loop_for_every_preset(name):
    mac = lpsim.mac.preset(name)
    core = mac.tensor_core
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        k = 3 * (mac.chunk or core.group) + 5  # whole groups and chunks, then a partial one
        a, b = tensor_core_operands(dtype, 7, k, 6, 1, core.operands)
        got, want = lanes_and_scalar(a, b, mac)
        assert_same_bits(got, want, f"{name} {dtype}")


@given(
    st.integers(0, 140),
    st.integers(1, 128),
    st.integers(0, 52),
    st.one_of(st.none(), st.integers(-160, 40), st.sampled_from([-1000, 1000])),
    st.sampled_from(DETERMINISTIC),
    st.sampled_from(DETERMINISTIC),
    st.sampled_from(["sequential", "chunked"]),
    st.sampled_from([FLOAT32, FLOAT16, Float(8, 13), Float(4, 3, saturate=True), Float(6, 9)]),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    st.integers(0, 10_000),
)
@settings(max_examples=150, deadline=None)
def test_tensor_core_loop_equals_the_scalar_loop_for_random_tensor_cores(
    k, group, fraction_bits, floor, normalise, rounding, order, acc, dtype, seed
):
    # fraction_bits above 43 with large groups leave float64's exact sums: the loop declines them.
    core = TensorCore(group, fraction_bits, floor, normalise)
    # rounding is the chunks' promotion's rule; a sequential chain takes none but normalise
    chunked = dict(
        order="chunked",
        chunk=group * (1 + seed % 3),
        chunk_accumulator=Float(8, 13),
        rounding=rounding,
    )
    mac = MAC(accumulator=acc, tensor_core=core, **(chunked if order == "chunked" else {}))
    a, b = tensor_core_operands(dtype, 5, k, 4, seed, spread=1.0 + seed % 7)
    got, want = lanes_and_scalar(a, b, mac)
    assert_same_bits(got, want, repr(mac))


@pytest.mark.parametrize("normalise", ["toward_zero", "nearest", "up"])
def test_tensor_core_loop_handles_inf_nan_overflow_and_exact_cancellation(normalise):
    core = TensorCore(4, 13, -133, normalise)
    a = torch.tensor(
        [
            [3e38, 3e38, 3e38, 3e38, 3e38, 1.0, 1.0, 1.0],  # the chain overflows, then goes on
            [1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 0.0, -0.0],  # exact cancellation: +0
            [math.inf, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            [1.0, math.nan, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            [-0.0, -0.0, -0.0, -0.0, -0.0, -0.0, -0.0, -0.0],
        ]
    )
    b = torch.ones(8, 3)
    b[:, 2] = -1.0
    for acc in (FLOAT32, Float(8, 13), Float(5, 10), Float(4, 3, saturate=True)):
        for mac in (
            MAC(accumulator=acc, tensor_core=core),
            MAC(accumulator=acc, order="chunked", chunk=4, chunk_accumulator=acc, tensor_core=core),
        ):
            got, want = lanes_and_scalar(a, b, mac)
            assert_same_bits(got, want, repr(mac))
            if normalise != "up":
                assert got[1].tolist() == [0.0, 0.0, 0.0]
                assert math.copysign(1.0, got[1, 0].item()) == 1.0


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_tensor_core_loop_does_not_depend_on_the_thread_count_or_the_tasks_row_boundaries(threads):
    # 221 results of 300 terms: the op's tasks start and end inside rows of 13.
    a, b = tensor_core_operands(torch.float32, 17, 300, 13, 4, Float(4, 3, special="fn"))
    mac = lpsim.mac.preset("DeepSeek-V3")
    got, want = lanes_and_scalar(a, b, mac, threads=threads)
    assert_same_bits(got, want, repr(mac))
