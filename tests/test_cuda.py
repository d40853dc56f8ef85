"""The CUDA kernels against the CPU kernels: bit-identical results for every format family, rule
and container, for any layout, with the same seed and offset. Skipped without a CUDA device."""

from __future__ import annotations

import math

import pytest
import torch

import lpsim
from lpsim import P3109, BlockFloat, Fixed, Float, Rounding
from lpsim.formats import check_fits
from lpsim.scaled import SCALED_PRESETS, Scaled

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not lpsim.cuda_built(),
    reason="needs a CUDA device and lpsim built with its CUDA kernels",
)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INT_VIEW = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}
RULES = list(Rounding)
STOCHASTIC = [r for r in Rounding if r.is_stochastic]

FORMATS = {
    "e5m2": Float(5, 2),
    "e4m3fn": Float(4, 3, special="fn"),
    "e5m2fnuz": Float(5, 2, special="fnuz"),
    "e2m1fn": Float(2, 1, special="none", saturate=True),
    "e4m3-no-subnormals": Float(4, 3, subnormals=False),
    "bfloat16": Float(8, 7),
    "float16-saturating": Float(5, 10, saturate=True),
    "fixed(8,4)": Fixed(8, 4),
    "fixed-unsigned": Fixed(8, 6, signed=False),
    "fixed-unclamped": Fixed(12, 3, clamp=False),
    "fixed-symmetric": Fixed(6, 2, symmetric=True),
    "block-whole": BlockFloat(6),
    "block-dim0": BlockFloat(5, 0),
    "block-dim2": BlockFloat(4, 2),
    "block-dim1": BlockFloat(8, 1),
    "block-size16": BlockFloat(8, block_size=16),
    "block-size7": BlockFloat(4, block_size=7),
    "block-size600": BlockFloat(6, block_size=600),  # longer than a fused tile's blocks
    "p3109-8p1": P3109(8, 1),  # ties to the even exponent code
    "p3109-8p3-unsigned": P3109(8, 3, signed=False, saturation="SatFinite"),
    "p3109-8p4-finite": P3109(8, 4, domain="finite"),
}

SHAPES = [(1000,), (7, 300), (3, 17, 45)]


def sample(shape, dtype, seed=0):
    """Values over a wide range of exponents, with ties, zeros of both signs, Inf and NaN."""
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    scale = torch.exp2(torch.randint(-14, 14, (n,), generator=gen).double())
    x = torch.randn(n, generator=gen, dtype=torch.float64) * scale
    ties = torch.randint(-64, 64, (n,), generator=gen).double() / 8 + 1 / 16
    x = torch.where(torch.rand(n, generator=gen) < 0.2, ties, x)
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            math.inf,
            -math.inf,
            math.nan,
            1.0,
            -1.5,
            2.5,
            1e-30,
            -6e-8,
            448.0,
            65504.0,
            1e5,
            -3.0e38,
        ],
        dtype=torch.float64,
    )
    k = min(n, len(specials))
    x[torch.randperm(n, generator=gen)[:k]] = specials[:k]
    return x.to(dtype).reshape(shape)


def fits(fmt, dtype) -> bool:
    try:
        check_fits(fmt, dtype)
    except ValueError:
        return False
    return True


def applies(fmt, shape) -> bool:
    """Whether fmt's dim exists in a tensor of this shape."""
    return not (
        isinstance(fmt, BlockFloat)
        and fmt.dim is not None
        and not -max(len(shape), 1) <= fmt.dim < max(len(shape), 1)
    )


def assert_same(cuda_result: torch.Tensor, cpu_result: torch.Tensor) -> None:
    """Equal bits (NaN payloads included)."""
    assert cuda_result.is_cuda
    got = cuda_result.cpu()
    assert got.shape == cpu_result.shape and got.dtype == cpu_result.dtype
    view = INT_VIEW[got.dtype]
    assert torch.equal(got.reshape(-1).view(view), cpu_result.reshape(-1).view(view))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(FORMATS))
def test_matches_cpu(name, dtype):
    fmt = FORMATS[name]
    if not fits(fmt, dtype):
        pytest.skip(f"{name} does not fit {dtype}")
    for s, shape in enumerate(SHAPES):
        if not applies(fmt, shape):
            continue
        x = sample(shape, dtype, seed=s)
        xc = x.cuda()
        for rule in RULES:
            for rbits in [None, 5] if rule.is_stochastic else [None]:
                kw = dict(rbits=rbits, seed=1234 + s, offset=7 * s)
                assert_same(lpsim.quantize(xc, fmt, rule, **kw), lpsim.quantize(x, fmt, rule, **kw))


# Layouts that reach each kernel: the whole-tensor and per-dim reductions (long rows, short rows
# with few and with many classes), fused and two-pass block_size, several tiles and grid strides.
BIG_CASES = [
    (Float(4, 3), (1 << 20) + 3),
    (Fixed(10, 5), (3000, 700)),
    (BlockFloat(8), (1 << 20) + 3),
    (BlockFloat(6, 0), (3, 5000)),
    (BlockFloat(6, 1), (5000, 3)),
    (BlockFloat(6, 1), (40, 700)),
    (BlockFloat(6, 1), (4, 1500, 3)),
    (BlockFloat(6, block_size=32), (333, 320)),
    (BlockFloat(6, block_size=100), (70, 1000)),
    (BlockFloat(6, block_size=5000), (9, 12000)),
    (BlockFloat(6, block_size=1 << 20), (3 << 20,)),
]


@pytest.mark.parametrize("case", range(len(BIG_CASES)))
@pytest.mark.parametrize(
    "rule",
    [Rounding.nearest, Rounding.up, Rounding.stochastic, Rounding.stochastic_equal],
    ids=lambda r: r.name,
)
def test_large_tensors(case, rule):
    fmt, shape = BIG_CASES[case]
    shape = shape if isinstance(shape, tuple) else (shape,)
    x = sample(shape, torch.float32, seed=case)
    assert_same(
        lpsim.quantize(x.cuda(), fmt, rule, seed=99, offset=3),
        lpsim.quantize(x, fmt, rule, seed=99, offset=3),
    )


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory < 24 << 30,
    reason="needs 24 GiB of GPU memory",
)
def test_more_than_two_to_the_31_elements():
    # 2^31 + 77 float16 elements (4 GiB): element indices, random-word counters and block indices
    # past int32's range, stochastic elementwise and blocks of 32 (the last one partial).
    n = (1 << 31) + 77
    gen = torch.Generator(device="cuda").manual_seed(17)
    x = torch.empty(n, dtype=torch.float16, device="cuda").normal_(generator=gen)
    x_cpu = x.cpu()
    for fmt in (Float(4, 3), BlockFloat(5, block_size=32)):
        got = lpsim.quantize(x, fmt, "stochastic", seed=7, offset=1).cpu()
        want = lpsim.quantize(x_cpu, fmt, "stochastic", seed=7, offset=1)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), fmt
        del got, want


def views():
    """Non-contiguous and unaligned views of a 2-D tensor, applied alike on both devices."""
    yield "transpose", lambda t: t.t()
    yield "step-slice", lambda t: t[::2, 1::3]
    yield "flat-offset", lambda t: t.reshape(-1)[1:]  # not aligned to 16 bytes
    yield "column", lambda t: t[:, 5]


LAYOUT_FORMATS = [
    "e5m2",
    "fixed(8,4)",
    "block-whole",
    "block-dim0",
    "block-dim1",
    "block-size7",
    "block-size600",
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", LAYOUT_FORMATS)
def test_views(name, dtype):
    fmt = FORMATS[name]
    if not fits(fmt, dtype):
        pytest.skip(f"{name} does not fit {dtype}")
    base = sample((40, 66), dtype, seed=3)
    base_cuda = base.cuda()
    for _, view in views():
        x, xc = view(base), view(base_cuda)
        if not applies(fmt, x.shape):
            continue
        for rule in (Rounding.nearest, Rounding.odd, Rounding.stochastic):
            assert_same(lpsim.quantize(xc, fmt, rule, seed=5), lpsim.quantize(x, fmt, rule, seed=5))


@pytest.mark.parametrize("name", LAYOUT_FORMATS)
def test_in_place_and_out(name):
    fmt = FORMATS[name]
    base = sample((40, 66), torch.float32, seed=4)
    for _, view in views():
        x = view(base)
        if not applies(fmt, x.shape):
            continue
        for rule in (Rounding.nearest_away, Rounding.stochastic):
            expected = lpsim.quantize(x, fmt, rule, seed=11)

            target = base.cuda()
            result = lpsim.quantize_(view(target), fmt, rule, seed=11)
            assert_same(result, expected)
            assert_same(view(target), expected)  # written through the view

            out = torch.full((*x.shape, 2), 7.0, device="cuda")[..., 0]  # not contiguous
            returned = lpsim.quantize(x.cuda(), fmt, rule, seed=11, out=out)
            assert returned is out
            assert_same(out, expected)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 5)])
@pytest.mark.parametrize("name", ["e5m2", "block-whole", "block-dim0", "block-size16"])
def test_empty(shape, name):
    fmt = FORMATS[name]
    x = torch.empty(shape, device="cuda")
    assert lpsim.quantize(x, fmt, "stochastic", seed=1).shape == shape
    assert lpsim.quantize_(x, fmt, "nearest") is x
    out = torch.empty(shape, device="cuda")
    assert lpsim.quantize(x, fmt, "nearest", out=out) is out


def test_scalar_tensor():
    x = torch.tensor(1.37)
    for fmt in (Float(4, 3), BlockFloat(4), BlockFloat(4, 0), BlockFloat(4, block_size=3)):
        for rule in (Rounding.nearest, Rounding.stochastic):
            assert_same(
                lpsim.quantize(x.cuda(), fmt, rule, seed=2), lpsim.quantize(x, fmt, rule, seed=2)
            )


@pytest.mark.parametrize("name", ["e4m3fn", "block-dim1", "block-size16", "block-size600"])
def test_side_stream(name):
    fmt = FORMATS[name]
    x = sample((64, 700), torch.float32, seed=6)
    expected = lpsim.quantize(x, fmt, "stochastic", seed=8)
    xc = x.cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = lpsim.quantize(xc, fmt, "stochastic", seed=8)
        z = xc.clone()
        lpsim.quantize_(z, fmt, "stochastic", seed=8)
    stream.synchronize()
    assert_same(y, expected)
    assert_same(z, expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize(
    "name", ["e5m2", "block-whole", "block-dim1", "block-size16", "block-size600"]
)
def test_second_device(name):
    fmt = FORMATS[name]
    x = sample((33, 650), torch.float32, seed=7)
    xc = x.to("cuda:1")
    before = torch.cuda.current_device()
    y = lpsim.quantize(xc, fmt, "stochastic", seed=9)
    assert y.device == xc.device
    assert torch.cuda.current_device() == before
    assert_same(y, lpsim.quantize(x, fmt, "stochastic", seed=9))


# ---- quantize_many_: one launch per 48 tensors of one dtype (gpu::quantize_grid_many)


def many_tensors(device: str, seed: int = 0) -> list[torch.Tensor]:
    """130 tensors, 86 of them float32 (more than one launch holds, empty ones aside), the others
    float64, bfloat16 and float16; sizes across random-word groups (256 elements), empty and 0-dim
    tensors, and non-contiguous views (a transpose, a strided slice) made on the device itself."""
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for i in range(130):
        dtype = DTYPES[1 + (i // 3) % 3] if i % 3 == 0 else torch.float32
        n = (0, 1, 7, 255, 256, 257, 1000, 4099)[i % 8]
        x = sample((n,), dtype, seed=int(torch.randint(1 << 30, (), generator=gen)))
        if i % 11 == 5:  # a transpose: dense, not contiguous
            x = sample((9, 31), dtype, seed=i).to(device).t()
        elif i % 11 == 7:  # a strided slice of a larger tensor
            x = sample((12, 40), dtype, seed=i).to(device)[1::2, ::3]
        elif i == 129:
            x = torch.tensor(2.75, dtype=dtype)
        tensors.append(x.to(device))
    return tensors


@pytest.mark.parametrize(
    "rule",
    [Rounding.nearest, Rounding.odd, Rounding.stochastic, Rounding.stochastic_equal],
    ids=lambda r: r.name,
)
@pytest.mark.parametrize("name", ["e5m2", "fixed(8,4)"])
def test_quantize_many_matches_cpu(name, rule):
    fmt = FORMATS[name]
    on_cpu, on_cuda = many_tensors("cpu"), many_tensors("cuda")
    assert any(not t.is_contiguous() for t in on_cuda)
    lpsim.quantize_many_(on_cpu, fmt, rule, seed=31, offset=5)
    lpsim.quantize_many_(on_cuda, fmt, rule, seed=31, offset=5)
    for got, want in zip(on_cuda, on_cpu):
        assert_same(got, want)


# Scaled formats: every preset, with its blocks along other axes, as tiles and per tensor.
SCALED = {
    **SCALED_PRESETS,
    "mxfp8_e4m3-axis0": Scaled(SCALED_PRESETS["mxfp8_e4m3"].element, axis=0),
    "mxfp4_e2m1-ceil": Scaled(SCALED_PRESETS["mxfp4_e2m1"].element, scale_rule="ceil"),
    "mxfp6_e3m2-even": Scaled(SCALED_PRESETS["mxfp6_e3m2"].element, scale_rule="even"),
    "mxint8-rceil": Scaled(SCALED_PRESETS["mxint8"].element, scale_rule="rceil"),
    "nvfp4-axis1-whole": Scaled(
        SCALED_PRESETS["nvfp4"].element, Float(4, 3, special="fn"), None, axis=1, tensor_scale=True
    ),
    "e4m3-16x16": Scaled(Float(4, 3, special="fn"), Float(8, 23), (16, 16)),
}


# Rows whose length is a multiple of 32 take the one-pass kernel of small blocks along the last
# axis (MX, NVFP4); the others the three-pass one.
SCALED_SHAPES = [*SHAPES, (5, 96), (3, 2, 64)]


def scaled_applies(fmt: Scaled, shape) -> bool:
    return isinstance(fmt.block, (tuple, str)) or -max(len(shape), 1) <= fmt.axis < max(
        len(shape), 1
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SCALED))
def test_scaled_matches_cpu(name, dtype):
    fmt = SCALED[name]
    if not fits(fmt.element, dtype):
        pytest.skip(f"{name}'s elements do not fit {dtype}")
    for s, shape in enumerate(SCALED_SHAPES):
        if not scaled_applies(fmt, shape):
            continue
        x = sample(shape, dtype, seed=s)
        xc = x.cuda()
        for rule in RULES:
            for rbits in [None, 3] if rule.is_stochastic else [None]:
                kw = dict(rbits=rbits, seed=77 + s, offset=3 * s)
                assert_same(lpsim.quantize(xc, fmt, rule, **kw), lpsim.quantize(x, fmt, rule, **kw))


SCALED_BIG_CASES = [
    ("mxfp8_e4m3", ((1 << 20) + 3,)),
    ("mxfp4_e2m1", (4096, 1024)),
    ("nvfp4", (4096, 1024)),
    ("mxfp8_e4m3-axis0", (3000, 700)),
    ("fp8_e4m3_128x128", (1000, 700)),
    ("fp8_e4m3_row", (300, 40000)),  # rows longer than a fused group
    ("fp8_e4m3_tensor", ((3 << 20) + 1,)),
]


@pytest.mark.parametrize("case", range(len(SCALED_BIG_CASES)))
@pytest.mark.parametrize("rule", [Rounding.nearest, Rounding.stochastic], ids=lambda r: r.name)
def test_scaled_large_tensors(case, rule):
    name, shape = SCALED_BIG_CASES[case]
    x = sample(shape, torch.float32, seed=case)
    fmt = SCALED[name]
    assert_same(
        lpsim.quantize(x.cuda(), fmt, rule, seed=9, offset=1),
        lpsim.quantize(x, fmt, rule, seed=9, offset=1),
    )


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "nvfp4", "mxfp8_e4m3-axis0", "e4m3-16x16"])
def test_scaled_views_in_place_and_out(name):
    fmt = SCALED[name]
    base = sample((64, 96), torch.float32, seed=6)
    base_cuda = base.cuda()
    for _, view in views():
        x, xc = view(base), view(base_cuda)
        if not scaled_applies(fmt, x.shape):
            continue
        expected = lpsim.quantize(x, fmt, "stochastic", seed=5)
        assert_same(lpsim.quantize(xc, fmt, "stochastic", seed=5), expected)
        out = torch.empty_like(xc)
        lpsim.quantize(xc, fmt, "stochastic", seed=5, out=out)
        assert_same(out, expected)
    in_place = base_cuda.clone()
    lpsim.quantize_(in_place, fmt, "nearest")
    assert_same(in_place, lpsim.quantize(base, fmt, "nearest"))


# ---- Rounding statistics: the CUDA kernel adds the same terms in the same order as the CPU loop


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["e5m2", "e4m3fn", "fixed(8,4)", "p3109-8p1", "block-size16"])
@pytest.mark.parametrize("n", [1, 1000, 16384, 3 * 16384 + 4097])
def test_rounding_statistics_match_cpu_bit_for_bit(name, dtype, n):
    from lpsim.statistics import quantize_with_statistics, rounding_statistics  # noqa: PLC0415

    fmt = FORMATS[name]
    try:
        check_fits(fmt, dtype)
    except ValueError:
        pytest.skip("the format does not fit this container")
    x = sample((n,), dtype, seed=n)
    y = lpsim.quantize(x, fmt, "nearest")
    cpu = rounding_statistics(x, y, fmt)
    assert rounding_statistics(x.cuda(), y.cuda(), fmt) == cpu
    # quantize_with_statistics rounds and counts in one kernel, instantiated for each rule.
    for rule in ("nearest", "stochastic", "down", "stochastic_equal"):
        rounded_cpu, stats_cpu = quantize_with_statistics(x, fmt, rule, seed=3)
        rounded_cuda, stats_cuda = quantize_with_statistics(x.cuda(), fmt, rule, seed=3)
        assert torch.equal(
            rounded_cuda.cpu().view(INT_VIEW[dtype]), rounded_cpu.view(INT_VIEW[dtype])
        )
        assert stats_cuda == stats_cpu


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", [name for name in FORMATS if name.startswith("block-")])
def test_block_rounding_statistics_match_cpu_bit_for_bit(name, dtype):
    """Each element counted within its block's range: the CUDA kernels' block maxima and bounds,
    and the statistics loop over the blocks as tiles, give the CPU's counts and sums."""
    from lpsim.statistics import rounding_statistics  # noqa: PLC0415

    fmt = FORMATS[name]
    if not fits(fmt, dtype):
        pytest.skip("the format does not fit this container")
    for shape in [*SHAPES, (3, 16384 + 96)]:
        if not applies(fmt, shape):
            continue
        x = sample(shape, dtype, seed=shape[0])
        y = lpsim.quantize(x, fmt, "nearest")
        assert rounding_statistics(x.cuda(), y.cuda(), fmt) == rounding_statistics(x, y, fmt)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(SCALED))
def test_scaled_rounding_statistics_match_cpu_bit_for_bit(name, dtype):
    """Each element counted within its block's range: the CUDA kernels' scales and bounds, and the
    statistics loop over blocks of every layout, give the CPU's counts and sums."""
    from lpsim.statistics import rounding_statistics  # noqa: PLC0415

    fmt = SCALED[name]
    if not fits(fmt.element, dtype):
        pytest.skip(f"{name}'s elements do not fit {dtype}")
    for shape in [(3, 16384 + 96), (257, 64), (40, 48)]:
        if not scaled_applies(fmt, shape):
            continue
        x = sample(shape, dtype, seed=shape[0])
        y = lpsim.quantize(x, fmt, "nearest")
        assert rounding_statistics(x.cuda(), y.cuda(), fmt) == rounding_statistics(x, y, fmt)
