"""Kernels equal the exact oracle over every code of small formats and every rounding decision
around them (values, midpoints, the container values beside each, overflow), for every rule and
every container the format fits."""

import pytest
import torch
from support import DTYPES, assert_same_bits, neighbourhood

import lpsim
from lpsim import BlockFloat, Fixed, Float, Rounding
from lpsim import reference as ref
from lpsim.formats import check_fits

FORMATS = [
    Float(3, 2),
    Float(3, 2, subnormals=False),
    Float(3, 2, special="fn"),
    Float(3, 2, special="fnuz"),
    Float(3, 2, special="none", saturate=True),
    Float(3, 2, saturate=True),
    Float(4, 3, special="fn"),
    Float(2, 1, special="none", saturate=True),
    Float(5, 2, subnormals=False, special="fnuz"),
    Float(4, 0, special="fn"),
    Float(3, 1, bias=-2),
    Float(8, 1, bias=140),  # normal range reaches below float32's smallest normal
    Fixed(5, 2),
    Fixed(5, 2, signed=False),
    Fixed(5, 2, symmetric=True),
    Fixed(5, 2, clamp=False),
    Fixed(4, -3),
    Fixed(6, 9),
]


# Each of these also runs in the float64, bfloat16 and float16 containers.
OTHER_CONTAINER_FORMATS = [
    Float(3, 2),
    Float(3, 2, special="fn", subnormals=False),
    Float(5, 2, special="fnuz"),  # normal range reaches below float16's smallest normal
    Float(5, 2, special="fnuz", subnormals=False),
    Fixed(5, 2),
    Fixed(5, 2, signed=False),
]

CASES = [(f, torch.float32) for f in FORMATS] + [
    (f, d) for f in OTHER_CONTAINER_FORMATS for d in DTYPES if d != torch.float32
]


def _fits(fmt, dtype) -> bool:
    try:
        check_fits(fmt, dtype)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("fmt,dtype", CASES, ids=[f"{f!r}-{d}" for f, d in CASES])
def test_every_rule_equals_the_oracle_on_every_decision(fmt, dtype):
    if not _fits(fmt, dtype):
        pytest.skip(f"{fmt!r} does not fit {dtype}")
    x = neighbourhood(fmt.values(), dtype)
    for rule in Rounding:
        got = lpsim.quantize(x, fmt, rule, seed=2024)
        want = ref.quantize(x, fmt, rule, seed=2024)
        assert_same_bits(got, want, f"{fmt!r} {rule.name} {dtype}")


@pytest.mark.parametrize(
    "fmt,shape",
    [
        (BlockFloat(4), (7, 9)),
        (BlockFloat(3, 0), (5, 11)),
        (BlockFloat(5, 2), (6, 4, 3)),
        (BlockFloat(4, 1), (3, 5, 2)),
        (BlockFloat(4, block_size=4), (5, 10)),
        (BlockFloat(2, block_size=3), (4, 7)),
        (BlockFloat(8, block_size=32), (3, 100)),
    ],
    ids=lambda p: repr(p) if not isinstance(p, tuple) else str(p),
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_formats_equal_the_oracle(fmt, shape, dtype):
    if not _fits(fmt, dtype):
        pytest.skip(f"{fmt!r} does not fit {dtype}")
    g = torch.Generator().manual_seed(len(shape) * 100 + fmt.wl)
    count = torch.Size(shape).numel()
    scale = torch.exp2(torch.randint(-6, 7, (count,), generator=g).double())
    x = (torch.randn(count, generator=g, dtype=torch.float64) * scale).to(dtype)
    x[::13] = 0.0
    x[5::17] = x[5::17].round()  # exact small integers and ties
    x = x.reshape(shape)
    for rule in Rounding:
        got = lpsim.quantize(x, fmt, rule, seed=11)
        want = ref.quantize(x, fmt, rule, seed=11)
        assert_same_bits(got, want, f"{fmt!r} {rule.name} {dtype}")


@pytest.mark.parametrize(
    "fmt", [BlockFloat(8), BlockFloat(5, 0), BlockFloat(7, block_size=300)], ids=repr
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_formats_equal_the_oracle_where_the_cpu_loops_take_their_forms(fmt, dtype):
    """Blocks of 256 inputs whose magnitudes all lie in one binade (the fixed quantum form of
    lpsim/in_range.h), within the block's top binades (the variable form) or anywhere, with a
    maximum just below a power of two and one that rounds up past the largest element (the
    saturation): the forms and the shortcut against the exact oracle."""
    if not _fits(fmt, dtype):
        pytest.skip(f"{fmt!r} does not fit {dtype}")
    g = torch.Generator().manual_seed(fmt.wl)
    rows = []
    for low in (1.0, 0.125, 0.0):  # magnitudes in [low, 2) before scaling
        u = torch.rand(2, 600, generator=g, dtype=torch.float64)
        magnitude = low + (2.0 - low) * u
        sign = torch.where(torch.rand(2, 600, generator=g) < 0.5, -1.0, 1.0).double()
        rows.append(sign * magnitude * 2.0**-7)
    x = torch.cat(rows)
    x[0, 7] = 2.0**-6 * (1 - 2.0**-30)  # just below a power of two: the top binade's end
    x[3, 11] = -(2.0**-7) * (2 - 2.0 ** (1 - fmt.wl))  # rounds up past the largest element
    x = x.to(dtype)
    for rule in Rounding:
        got = lpsim.quantize(x, fmt, rule, seed=7)
        want = ref.quantize(x, fmt, rule, seed=7)
        assert_same_bits(got, want, f"{fmt!r} {rule.name} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_specials_keep_their_values_and_do_not_set_the_exponent(dtype):
    x = torch.tensor(
        [[1.0, float("inf"), float("nan"), 0.3, -0.0, -float("inf"), 0.7, 1e-3]], dtype=dtype
    )
    for fmt in (BlockFloat(4), BlockFloat(4, 0), BlockFloat(4, block_size=4)):
        for rule in Rounding:
            assert_same_bits(
                lpsim.quantize(x, fmt, rule, seed=5),
                ref.quantize(x, fmt, rule, seed=5),
                f"{fmt!r} {rule.name}",
            )
    y = lpsim.quantize(x, BlockFloat(4), "nearest")
    assert y[0, 1].item() == float("inf") and torch.isnan(y[0, 2]) and y[0, 0].item() == 1.0
