"""Property tests: for random formats, containers, rules, rbits, seeds and adversarial inputs, the
kernels return exactly what the oracle returns, and the rules keep the properties every rounding
rule must have."""

import math

import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from support import assert_same_bits

import lpsim
from lpsim import BlockFloat, Fixed, Float, Rounding
from lpsim import reference as ref
from lpsim.formats import check_fits

CONTAINER = st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16])


@st.composite
def float_formats(draw):
    exp = draw(st.integers(1, 11))
    man = draw(st.integers(0, 52))
    special = draw(st.sampled_from(["ieee", "fn", "fnuz", "none"]))
    assume(not (special == "ieee" and exp < 2) and not (special == "fn" and exp == 1 and man == 0))
    default = 2 ** (exp - 1) - (0 if special == "fnuz" else 1)
    bias = default + draw(st.integers(-3, 3) | st.just(0))
    try:
        return Float(
            exp,
            man,
            bias=bias,
            special=special,
            subnormals=draw(st.booleans()),
            saturate=draw(st.booleans()),
        )
    except ValueError:
        assume(False)


@st.composite
def fixed_formats(draw):
    signed = draw(st.booleans())
    try:
        return Fixed(
            draw(st.integers(2, 54)),
            draw(st.integers(-60, 160)),
            signed=signed,
            clamp=draw(st.booleans()),
            symmetric=signed and draw(st.booleans()),
        )
    except ValueError:
        assume(False)


def block_formats():
    return st.builds(
        lambda wl, kind, dim, size: BlockFloat(
            wl, dim if kind == "dim" else None, block_size=size if kind == "size" else None
        ),
        st.integers(2, 25),
        st.sampled_from(["tensor", "dim", "size"]),
        st.integers(0, 1),
        st.integers(1, 9),
    )


def _grid_points(fmt, draw, count):
    """Values at and around the format's own grid: the adversarial inputs."""
    if isinstance(fmt, Float):
        top, low = fmt.emax, fmt.emin - fmt.man
    elif isinstance(fmt, Fixed):
        low = -fmt.fl
        top = low + fmt.wl
    else:
        top, low = 8, -8
    points = []
    for _ in range(count):
        e = draw(st.integers(low - 2, top + 2))
        k = draw(st.integers(0, 2 ** min(12, max(fmt.bits, 1))))
        half = draw(st.sampled_from([0.0, 0.5, 0.25, 0.75]))
        value = math.ldexp(k + half, e - min(12, fmt.bits))
        points.append(-value if draw(st.booleans()) else value)
    return points


@st.composite
def cases(draw):
    fmt = draw(st.one_of(float_formats(), fixed_formats(), block_formats()))
    dtype = draw(CONTAINER)
    try:
        check_fits(fmt, dtype)
    except ValueError:
        assume(False)
    rule = draw(st.sampled_from(list(Rounding)))
    rbits = draw(st.none() | st.integers(1, 32)) if rule.is_stochastic else None
    seed = draw(st.integers(0, 2**64 - 1))
    offset = draw(st.sampled_from([0, 1, 2**63 + 5]))
    raw = draw(st.lists(st.floats(width=64, allow_nan=True, allow_infinity=True), max_size=24))
    raw += _grid_points(fmt, draw, draw(st.integers(0, 24)))
    x = torch.tensor(raw or [0.0], dtype=torch.float64).to(dtype)
    rows = draw(st.sampled_from([1, 2, 3]))
    if x.numel() % rows == 0:
        x = x.reshape(rows, -1)
    if isinstance(fmt, BlockFloat) and fmt.dim is not None:
        assume(fmt.dim < x.dim())
    return fmt, dtype, rule, rbits, seed, offset, x


@given(cases())
def test_kernels_equal_the_oracle(case):
    fmt, dtype, rule, rbits, seed, offset, x = case
    got = lpsim.quantize(x, fmt, rule, rbits=rbits, seed=seed, offset=offset)
    want = ref.quantize(x, fmt, rule, rbits=rbits, seed=seed, offset=offset)
    assert_same_bits(got, want, f"{fmt!r} {rule.name} rbits={rbits} {dtype}")


@given(cases())
def test_rounding_is_idempotent_and_never_flips_a_sign(case):
    fmt, dtype, rule, rbits, seed, offset, x = case
    y = lpsim.quantize(x, fmt, rule, rbits=rbits, seed=seed, offset=offset)
    # A value of the format is returned unchanged by every rule, stochastic ones included.
    again = lpsim.quantize(y, fmt, rule, rbits=rbits, seed=seed + 1 if seed < 2**64 - 1 else 0)
    if not isinstance(fmt, BlockFloat):  # a block's exponent can drop after rounding
        assert_same_bits(again, y, f"{fmt!r} {rule.name}")
    signed_zero_kept = not (isinstance(fmt, Float) and fmt.special == "fnuz") and not (
        isinstance(fmt, Fixed) and not fmt.signed
    )
    finite = ~torch.isnan(y)
    if signed_zero_kept:
        assert torch.equal(torch.signbit(y[finite]), torch.signbit(x[finite]))
    else:
        assert not bool(
            (torch.signbit(y[finite]) & (y[finite] != 0) & ~torch.signbit(x[finite])).any()
        )
