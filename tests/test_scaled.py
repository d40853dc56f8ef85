"""Scaled formats (lpsim.scaled): the kernels against the exact reference, and the reference and the
kernels against peers' casts (torchao's MX and NVFP4, gfloat's MX block quantisation, ml_dtypes'
E8M0), bit for bit."""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
import subprocess
import warnings
from fractions import Fraction

import gfloat
import gfloat.formats
import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import CXX, build_cpp_check

import lpsim
from lpsim import Fixed, Float, reference
from lpsim.scaled import SCALE_RULES, SCALED_PRESETS, PowerOfTwo, Scaled, preset

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_dtype, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

MX_ELEMENTS = {
    "mxfp8_e4m3": torch.float8_e4m3fn,
    "mxfp8_e5m2": torch.float8_e5m2,
    "mxfp6_e3m2": "fp6_e3m2",
    "mxfp6_e2m3": "fp6_e2m3",
    "mxfp4_e2m1": torch.float4_e2m1fn_x2,
}
TORCHAO_MODES = {
    "floor": ScaleCalculationMode.FLOOR,
    "ceil": ScaleCalculationMode.CEIL,
    "even": ScaleCalculationMode.EVEN,
    "rceil": ScaleCalculationMode.RCEIL,
}
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def heavy_tailed(rows: int, cols: int, seed: int, spread: float = 4.0) -> torch.Tensor:
    """Gaussian rows with log-normal row scales, a few zero and tiny blocks and one huge value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * spread)
    x[1, :32] = 0
    x[2, :32] *= 1e-30
    x[3, 5] = 1e30
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal bits, or both NaN."""
    both_nan = torch.isnan(a) & torch.isnan(b)
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return (a.contiguous().view(width) == b.contiguous().view(width)) | both_nan


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    ok = same_bits(actual, expected)
    if not bool(ok.all()):
        i = (~ok).flatten().nonzero()[0].item()
        raise AssertionError(
            f"{int((~ok).sum())} of {ok.numel()} elements differ; first at flat index {i}: "
            f"{actual.flatten()[i].item()!r} != {expected.flatten()[i].item()!r}"
        )


# ---- Peers' casts


@pytest.mark.parametrize("rule", TORCHAO_MODES)
@pytest.mark.parametrize("name", MX_ELEMENTS)
def test_mx_presets_match_torchao_to_mx_bit_for_bit(name, rule):
    x = heavy_tailed(64, 256, seed=len(name) + len(rule))
    fmt = dataclasses.replace(preset(name), scale_rule=rule)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, data = to_mx(x, MX_ELEMENTS[name], 32, TORCHAO_MODES[rule])
        theirs = to_dtype(data, code, MX_ELEMENTS[name], 32, torch.float32)
    ours = lpsim.quantize(x, fmt)
    # torchao divides a block whose E8M0 code is 0 (scale 2**-127) by 2**-126 (F32_MIN_NORMAL),
    # so its elements and its code disagree; lpsim uses 2**-127 for both. Those blocks (the zero
    # and tiny ones here) are compared on their own: all zero in both.
    code_zero = (code.view(torch.uint8) == 0).repeat_interleave(32, dim=-1)
    assert int(code_zero.sum()) <= 2 * 32
    assert_same_bits(ours[~code_zero], theirs[~code_zero])
    assert_same_bits(ours, reference.quantize(x, fmt))


def test_rceil_takes_the_exact_ceiling_where_torchao_rounds_log2_first():
    # torchao's RCEIL is ceil(log2(amax / elem_max)) with a float32 log2, which rounds a quotient
    # a few units above 2^-5 down to -5 exactly; the rule (NVIDIA's cvt.rp to UE8M0) is the
    # exact ceiling, -4. The test of the four rules above meets no such block.
    x = torch.zeros(1, 32)
    x[0, 0] = 0.234375 + 2.0**-25  # amax / 7.5 = 2^-5 (1 + 2^-19)
    x[0, 1] = 0.0195312
    fmt = dataclasses.replace(preset("mxfp6_e2m3"), scale_rule="rceil")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, data = to_mx(x, MX_ELEMENTS["mxfp6_e2m3"], 32, ScaleCalculationMode.RCEIL)
        theirs = to_dtype(data, code, MX_ELEMENTS["mxfp6_e2m3"], 32, torch.float32)
    assert int(code.view(torch.uint8)[0, 0]) - 127 == -5
    ours = lpsim.quantize(x, fmt)
    assert_same_bits(ours, reference.quantize(x, fmt))
    assert ours[0, 1] == 0.25 * 2.0**-4 and theirs[0, 1] == 0.625 * 2.0**-5


def test_rceil_quotient_is_rounded_in_float64_for_a_float64_tensor():
    # docs/formats.md: rceil's quotient amax / elem_max is rounded in the tensor's arithmetic,
    # float32 or float64. amax = 6 (1 + 2^-30) over E2M1's 6 is 1 + 2^-30 in float64, whose
    # exact ceiling is 1 (scale 2: 0.3 / 2 rounds to 0); rounded to float32 the quotient is 1 and
    # the scale 1 (0.3 rounds to 0.5), as the float32 tensor, which holds amax as 6, gives.
    fmt = dataclasses.replace(preset("mxfp4_e2m1"), scale_rule="rceil")
    x = torch.tensor([[6 * (1 + 2.0**-30), 0.3]], dtype=torch.float64)
    quotient = Fraction(float(x[0, 0]) / 6.0)  # Python's float division: rounded in float64
    assert quotient == 1 + Fraction(1, 2**30)
    assert lpsim.quantize(x, fmt)[0, 1].item() == 0.0
    assert lpsim.quantize(x.float(), fmt)[0, 1].item() == 0.5


def test_rceil_saturates_the_scale_where_the_quotient_overflows():
    # Elements whose largest value is below 1 (Fixed(5, 7): 15/128): amax / elem_max overflows
    # float32, and the rule takes the largest scale; the reference once raised OverflowError.
    fmt = Scaled(Fixed(5, 7), block=4, scale_rule="rceil")
    x = torch.tensor([1e38, 1.0, -2.0, 0.5])
    ours = lpsim.quantize(x, fmt)
    assert_same_bits(ours, reference.quantize(x, fmt))
    assert ours[0] == 15 / 128 * 2.0**127


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp8_matches_torchao_on_bfloat16_inputs(dtype):
    x = heavy_tailed(16, 128, seed=3).to(dtype)
    x[2, :32] = 1.0  # no code-0 blocks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, data = to_mx(x, torch.float8_e4m3fn, 32)
        theirs = to_dtype(data, code, torch.float8_e4m3fn, 32, dtype)
    x[1, :32] = 1.0
    assert_same_bits(lpsim.quantize(x, preset("mxfp8_e4m3"))[3:], theirs[3:])


@pytest.mark.parametrize("tensor_scale", [False, True])
def test_nvfp4_matches_torchao_nvfp4_quantize_bit_for_bit(tensor_scale):
    x = heavy_tailed(64, 128, seed=11, spread=3.0)
    t = per_tensor_amax_to_scale(x.abs().amax()) if tensor_scale else None
    scale, data = nvfp4_quantize(x, 16, t)
    elements = f4_unpacked_to_f32(unpack_uint4(data)).reshape(64, 8, 16)
    decode = scale.to(torch.float32) if t is None else t * scale.to(torch.float32)
    theirs = (elements * decode.reshape(64, 8, 1)).reshape(64, 128)
    fmt = dataclasses.replace(preset("nvfp4"), tensor_scale=tensor_scale)
    ours = lpsim.quantize(x, fmt)
    assert_same_bits(ours, theirs)
    assert_same_bits(ours, reference.quantize(x, fmt))


def _torchao_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """torchao's two-level NVFP4 of a (rows, 16 k) float32 x, decoded in float32."""
    t = per_tensor_amax_to_scale(x.abs().amax())
    scale, data = nvfp4_quantize(x, 16, t)
    elements = f4_unpacked_to_f32(unpack_uint4(data)).reshape(x.shape[0], -1, 16)
    return (elements * (t * scale.to(torch.float32)).unsqueeze(-1)).reshape(x.shape)


def test_nvfp4_matches_torchao_down_to_its_tensor_scale_floor_as_documented():
    # docs/formats.md: the match holds for a tensor amax of at least 2688 x 2**-120, where t is at
    # least lpsim's floor 2**-120; below, the values differ as the page says.
    g = torch.Generator().manual_seed(4)
    base = torch.randn(4, 32, generator=g)
    base[:, 16:] *= 2.0**-6  # second blocks with smaller scales
    floor = 2688 * 2.0**-120
    for amax in (floor, 2 * floor, 1e-30, 1.0, 1e30):
        x = (base / base.abs().max() * amax).float()
        assert_same_bits(lpsim.quantize(x, preset("nvfp4")), _torchao_nvfp4(x))
    x = torch.zeros(1, 16)
    x[0, :3] = torch.tensor([1e-35, -1e-35 / 3, 1e-37])
    assert lpsim.quantize(x, preset("nvfp4"))[0, 0].item() == pytest.approx(1.0156e-35, rel=1e-4)
    assert _torchao_nvfp4(x)[0, 0].item() == pytest.approx(1.00000009e-35, rel=1e-8)
    x[0, :3] = torch.tensor([5e-36, -5e-36 / 3, 5e-38])  # below 2688 x 2**-128: 1 / t is Inf
    assert _torchao_nvfp4(x)[0, :3].abs().unique().numel() == 1
    x[0, :3] = torch.tensor([1e-40, -1e-41, 1e-42])
    assert not lpsim.quantize(x, preset("nvfp4")).any()
    zeros = torch.zeros(1, 16)
    assert _torchao_nvfp4(zeros).isnan().all() and not lpsim.quantize(zeros, preset("nvfp4")).any()


@pytest.mark.parametrize("name", MX_ELEMENTS)
def test_torchao_halves_blocks_whose_e8m0_code_is_0_that_is_amax_below_2_to_emax_minus_126(name):
    # docs/formats.md: under floor a block gets E8M0 code 0 (scale 2**-127) where amax is below
    # 2**(emax - 126) (2**-111 for E5M2, not only below 2**-118); torchao divides its elements by
    # 2**-126 and decodes them with 2**-127, so its values are half lpsim's, which are exact here
    # (1.5 x 2**(emax - 127) is the element 1.5 x 2**emax at scale 2**-127). From 2**(emax - 126)
    # on, the code is 1 and the two agree.
    fmt = preset(name)
    below = 1.5 * 2.0 ** (fmt.element_emax - 127)
    at = 2.0 ** (fmt.element_emax - 126)
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1], x[1, 0], x[1, 1] = below, -below / 2, at, -at / 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, data = to_mx(x, MX_ELEMENTS[name], 32, ScaleCalculationMode.FLOOR)
        theirs = to_dtype(data, code, MX_ELEMENTS[name], 32, torch.float32)
    ours = lpsim.quantize(x, fmt)
    assert code.view(torch.uint8).flatten().tolist() == [0, 1]
    assert ours[0, :2].tolist() == [below, -below / 2]
    assert theirs[0, :2].tolist() == [below / 2, -below / 4]
    assert_same_bits(ours[1], theirs[1])


@pytest.mark.parametrize("rule", TORCHAO_MODES)
@pytest.mark.parametrize("name", MX_ELEMENTS)
def test_torchao_gives_a_block_with_an_inf_a_finite_scale_under_every_rule(name, rule):
    # docs/formats.md: torchao's scale is 2**min(128 - emax, 127) (2**127 under rceil), its Inf
    # decodes to +/-Inf and its finite elements round at that scale; lpsim's block is NaN.
    x = torch.full((2, 32), 1.0)
    x[0, 3], x[1, 5] = math.inf, -math.inf
    fmt = dataclasses.replace(preset(name), scale_rule=rule)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, data = to_mx(x, MX_ELEMENTS[name], 32, TORCHAO_MODES[rule])
        theirs = to_dtype(data, code, MX_ELEMENTS[name], 32, torch.float32)
    exponent = 127 if rule == "rceil" else min(128 - fmt.element_emax, 127)
    assert (code.view(torch.uint8).int() - 127 == exponent).all()
    assert theirs[0, 3] == math.inf and theirs[1, 5] == -math.inf
    assert not theirs[:, :3].any()
    assert lpsim.quantize(x, fmt).isnan().all()


GFLOAT_MX = {
    "mxfp8_e4m3": gfloat.formats.format_info_mxfp8_e4m3,
    "mxfp8_e5m2": gfloat.formats.format_info_mxfp8_e5m2,
    "mxfp6_e3m2": gfloat.formats.format_info_mxfp6_e3m2,
    "mxfp6_e2m3": gfloat.formats.format_info_mxfp6_e2m3,
    "mxfp4_e2m1": gfloat.formats.format_info_mxfp4_e2m1,
    "mxint8": gfloat.formats.format_info_mxint8,
}
GFLOAT_ROUNDING = {
    "nearest": gfloat.RoundMode.TiesToEven,
    "nearest_away": gfloat.RoundMode.TiesToAway,
    "toward_zero": gfloat.RoundMode.TowardZero,
    "up": gfloat.RoundMode.TowardPositive,
    "down": gfloat.RoundMode.TowardNegative,
}


@pytest.mark.parametrize("rounding", GFLOAT_ROUNDING)
@pytest.mark.parametrize("name", GFLOAT_MX)
def test_mx_presets_match_gfloat_quantize_block(name, rounding):
    fi = GFLOAT_MX[name]
    x = heavy_tailed(8, 64, seed=5).double()
    x[2, :32] = torch.linspace(-3, 3, 32)  # exact ties and small values
    theirs = np.stack(
        [
            gfloat.quantize_block(fi, block, gfloat.compute_scale_amax, GFLOAT_ROUNDING[rounding])
            for block in x.reshape(-1, 32).numpy()
        ]
    ).reshape(8, 64)
    ours = lpsim.quantize(x, preset(name), rounding)
    if name == "mxint8":
        # Two's complement has no -0; lpsim's Fixed keeps a zero's sign in the container.
        ours = ours + 0.0
    assert_same_bits(ours, torch.from_numpy(theirs))


# ---- A plain model of OCP MX v1.0, in Fractions
#
# Section 6.3: a block's shared E8M0 exponent is floor(log2(amax)) - emax_elem, clamped to
# [-127, 127]; each element is x / 2**e cast to the element format with saturation. The other
# rules change only the exponent, as docs/formats.md gives them. The element grids are
# ml_dtypes' (every finite code of the type); a block with a NaN or an Inf is NaN.

_ML_ELEMENTS = {
    "mxfp8_e4m3": ml_dtypes.float8_e4m3fn,
    "mxfp8_e5m2": ml_dtypes.float8_e5m2,
    "mxfp6_e3m2": ml_dtypes.float6_e3m2fn,
    "mxfp6_e2m3": ml_dtypes.float6_e2m3fn,
    "mxfp4_e2m1": ml_dtypes.float4_e2m1fn,
}


def _grid(dtype) -> list[Fraction]:
    """The nonnegative finite values of an ml_dtypes type, ascending."""
    values = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
    return sorted({Fraction(v) for v in values.tolist() if math.isfinite(v) and v >= 0})


def _floor_log2(a: Fraction) -> int:
    e = a.numerator.bit_length() - a.denominator.bit_length()
    return e - 1 if Fraction(2) ** e > a else e


def _rounded(v: Fraction, grid: list[Fraction], rule: str) -> Fraction:
    """v rounded onto the symmetric, saturating grid by rule (ties to the even code)."""
    sign, a = (-1 if v < 0 else 1), abs(v)
    if a >= grid[-1]:
        return sign * grid[-1]
    i = bisect.bisect_right(grid, a) - 1
    low, high = grid[i], grid[i + 1]
    if a == low:
        return sign * low
    tie = a - low == high - a
    nearer = low if a - low < high - a else high
    up = high if sign > 0 else low  # toward +inf, in magnitudes
    chosen = {
        "nearest": (low if i % 2 == 0 else high) if tie else nearer,
        "nearest_away": high if tie else nearer,
        "toward_zero": low,
        "away": high,
        "up": up,
        "down": low if up is high else high,
        "odd": low if i % 2 else high,
    }[rule]
    return sign * chosen


def _mx_exponent(amax: Fraction, grid: list[Fraction], man: int, rule: str, work) -> int:
    """The block's scale exponent by rule, clamped to E8M0's range."""
    if amax == 0:
        return -127
    elem_max = grid[-1]
    emax = _floor_log2(elem_max)
    if rule == "floor":
        e = _floor_log2(amax) - emax
    elif rule == "ceil":
        e = _ceil_log2(amax) - emax
    elif rule == "even":  # amax rounded to man fraction bits of its binade, ties away
        unit = Fraction(2) ** (_floor_log2(amax) - man)
        e = _floor_log2(math.floor(amax / unit + Fraction(1, 2)) * unit) - emax
    else:  # rceil: the quotient rounded in the work dtype
        e = _ceil_log2(Fraction(float(work(float(amax)) / work(float(elem_max)))))
    return max(-127, min(127, e))


def _ceil_log2(a: Fraction) -> int:
    e = _floor_log2(a)
    return e if Fraction(2) ** e == a else e + 1


def _mx_model(x: torch.Tensor, name: str, block: int, rule: str, rounding: str) -> torch.Tensor:
    """x (blocks of ``block`` along its last axis) quantised by the Fraction model."""
    grid = _grid(_ML_ELEMENTS[name])
    man = preset(name).element.man
    work = np.float64 if x.dtype == torch.float64 else np.float32
    rows = x.double().reshape(-1, x.shape[-1]).tolist()
    out = []
    for row in rows:
        for start in range(0, len(row), block):
            values = row[start : start + block]
            if not all(map(math.isfinite, values)):
                out += [math.nan] * len(values)
                continue
            amax = max(abs(Fraction(v)) for v in values)
            scale = Fraction(2) ** _mx_exponent(amax, grid, man, rule, work)
            for v in values:
                r = _rounded(Fraction(v) / scale, grid, rounding) * scale
                out.append(math.copysign(0.0, v) if r == 0 else float(r))
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape).to(x.dtype)


@st.composite
def _mx_cases(draw):
    name = draw(st.sampled_from(list(_ML_ELEMENTS)))
    dtype = draw(st.sampled_from(DTYPES))
    lo, hi = {torch.float16: (-24, 15), torch.bfloat16: (-133, 127)}.get(dtype, (-149, 127))
    if dtype == torch.float64:
        lo, hi = -1074, 1023
    block = draw(st.sampled_from([1, 3, 8, 32]))
    cols = draw(st.integers(1, 40))
    rows = draw(st.integers(1, 3))
    base = draw(st.integers(lo + 12, hi - 2))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    x = x * torch.exp2(base - torch.randint(0, 12, (rows, cols), generator=g).double())
    kind = draw(st.sampled_from(["random", "ties", "specials"]))
    if kind == "ties":  # multiples of a power of two: many elements lie midway
        x = torch.randint(-64, 65, (rows, cols), generator=g).double() * 2.0 ** (base - 6)
    if kind == "specials":
        specials = [math.nan, math.inf, -0.0, 0.0, 2.0**-127, 2.0**127, 2.0**lo, 3.0e38]
        for _ in range(draw(st.integers(1, 3))):
            i, j = draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))
            x[i, j] = draw(st.sampled_from(specials))
    x = x.to(dtype)
    rule = draw(st.sampled_from(["floor", "ceil", "even", "rceil"]))
    rounding = draw(st.sampled_from(list(_ROUNDINGS)))
    return name, x, block, rule, rounding


_ROUNDINGS = ("nearest", "nearest_away", "toward_zero", "away", "up", "down", "odd")


@settings(max_examples=150, deadline=None)
@given(_mx_cases())
def test_mx_elements_match_a_fraction_model_of_the_ocp_spec(case):
    # Every scale rule and deterministic rounding rule, blocks not dividing the rows, subnormal,
    # huge and E8M0-edge amaxes, NaN, Inf and signed zeros, in every container, bit for bit.
    name, x, block, rule, rounding = case
    fmt = dataclasses.replace(preset(name), block=block, scale_rule=rule)
    expected = _mx_model(x, name, block, rule, rounding)
    assert_same_bits(lpsim.quantize(x, fmt, rounding), expected)
    # The same blocks along axis 0 of the transpose.
    moved = dataclasses.replace(fmt, axis=0)
    assert_same_bits(lpsim.quantize(x.t().contiguous(), moved, rounding), expected.t())


# Float scales (the "amax" rule), one float32 operation at a time as docs/formats.md gives them:
# d = amax / elem_max (two levels: d = (amax / elem_max) / t), s = d clamped to [the scale's
# smallest normal, its max] and rounded to the scale format, r = 1 / s (two levels: (1 / t) / s),
# element = x * r rounded to nearest even onto the saturating element grid, value = element * s
# (two levels: element * (t * s)), with t = amax(tensor) / (scale max * elem_max), at least
# 2**-126 / (the scale's smallest normal).

_SCALE_TYPES = {  # a Float scale format and the ml_dtypes type that rounds to it
    "e4m3": (Float(4, 3, special="fn"), ml_dtypes.float8_e4m3fn),
    "e5m2": (Float(5, 2), ml_dtypes.float8_e5m2),
    "float32": (Float(8, 23), np.float32),
}


def _amax_model(x: np.ndarray, name: str, scale: str, block: int, tensor_scale: bool):
    """x (float32, blocks of ``block`` along its last axis) quantised by the documented float32
    arithmetic, to nearest."""
    f32 = np.float32
    grid = _grid(_ML_ELEMENTS[name])
    elem_max = f32(float(grid[-1]))
    fmt, rounds_to = _SCALE_TYPES[scale]
    smallest, largest = f32(fmt.smallest_normal), f32(fmt.max)
    if tensor_scale:
        t = f32(f32(np.abs(x).max()) / f32(largest * elem_max))
        t = max(t, f32(f32(2.0**-126) / smallest))
    out = np.empty_like(x)
    for i, row in enumerate(x):
        for start in range(0, len(row), block):
            values = row[start : start + block]
            d = f32(f32(np.abs(values).max()) / elem_max)
            d = f32(d / t) if tensor_scale else d
            s = np.array([min(max(d, smallest), largest)], f32).astype(rounds_to).astype(f32)[0]
            r = f32(f32(f32(1) / t) / s) if tensor_scale else f32(f32(1) / s)
            decode = f32(t * s) if tensor_scale else s
            for j, v in enumerate(values):
                element = f32(float(_rounded(Fraction(float(f32(v * r))), grid, "nearest")))
                value = f32(element * decode)
                out[i, start + j] = math.copysign(0.0, v) if value == 0 else value
    return out


@pytest.mark.parametrize("tensor_scale", [False, True])
@pytest.mark.parametrize("scale", list(_SCALE_TYPES))
@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp6_e2m3", "mxfp4_e2m1"])
def test_float_scales_match_a_float32_model_of_the_documented_arithmetic(name, scale, tensor_scale):
    if tensor_scale and scale == "float32":
        pytest.skip("a tensor scale over float32 block scales overflows float32 (refused)")
    g = torch.Generator().manual_seed(len(name) + len(scale))
    x = torch.randn(6, 40, generator=g) * torch.exp2(torch.randint(-30, 30, (6, 1), generator=g))
    x[1, :8] *= 2.0**-90  # block scales below the scale format's smallest normal
    x[2, 8:16] *= 2.0**40  # and above its largest (without a tensor scale)
    x[3, :16] = 0.0
    element = preset(name).element
    # Midpoints between elements under a scale that is not a power of two: x * r lies a rounding
    # from the tie, which decides the element (x / s would decide otherwise in some).
    values = element.values()
    values = values[values >= 0].double()
    midpoints = (values[:-1] + values[1:]) / 2
    for row, factor in ((4, 1.3), (5, 1.7)):
        top = np.float32(float(values[-1]) * factor)
        block_scale = np.array([top / np.float32(values[-1])], np.float32)
        block_scale = float(block_scale.astype(_SCALE_TYPES[scale][1]).astype(np.float32)[0])
        picks = midpoints[torch.randint(len(midpoints), (39,), generator=g)]
        x[row] = torch.cat([torch.tensor([float(top)]), picks * block_scale]).float()
    fmt = Scaled(element, _SCALE_TYPES[scale][0], 8, tensor_scale=tensor_scale)
    expected = _amax_model(x.numpy(), name, scale, 8, tensor_scale)
    assert_same_bits(lpsim.quantize(x, fmt), torch.from_numpy(expected))


def test_one_compiled_function_takes_mx_presets_one_after_another():
    """A function compiled with fullgraph=True and given mxfp8_e4m3, then mxfp6_e3m2, mxfp4_e2m1
    and mxint8 as an argument recompiles for each and rounds as gfloat does. Before, dynamo's
    second trace read the fields that had changed as symbolic values, and the element's max
    (computed with Fractions) made it refuse the call."""
    torch._dynamo.reset()
    x = heavy_tailed(4, 64, seed=9).double()
    compiled = torch.compile(lambda x, fmt: lpsim.quantize(x, fmt), backend="eager", fullgraph=True)
    for name in ("mxfp8_e4m3", "mxfp6_e3m2", "mxfp4_e2m1", "mxint8", "mxfp8_e4m3"):
        blocks = x.reshape(-1, 32).numpy()
        theirs = [
            gfloat.quantize_block(GFLOAT_MX[name], b, gfloat.compute_scale_amax) for b in blocks
        ]
        ours = compiled(x, preset(name))
        if name == "mxint8":
            ours = ours + 0.0  # two's complement has no -0
        assert_same_bits(ours, torch.from_numpy(np.stack(theirs)).reshape(x.shape))


def test_e8m0_range_is_ml_dtypes_float8_e8m0fnu():
    info = ml_dtypes.finfo(ml_dtypes.float8_e8m0fnu)
    e8m0 = PowerOfTwo(8)
    assert e8m0.max == float(info.max)
    assert e8m0.smallest_normal == float(info.smallest_normal)
    # Every scale chosen, clamped ones included, is an E8M0 value.
    fmt = preset("mxfp8_e4m3")
    blocks = [[1.5 * 2.0**k, -3.0] for k in range(-1000, 1000, 7)] + [[0.0], [1e-310]]
    exponents = [reference.scaled_block_scale(b, fmt, torch.float64)[1] for b in blocks]
    assert min(exponents) == -127 and max(exponents) == 127
    scales = np.exp2(np.array(exponents, dtype=np.float64))
    assert np.array_equal(scales.astype(ml_dtypes.float8_e8m0fnu).astype(np.float64), scales)


# ---- The kernels against the exact reference

FORMATS = [
    *SCALED_PRESETS.values(),
    Scaled(Float(3, 2, special="none"), PowerOfTwo(8), 8, axis=0, scale_rule="even"),
    Scaled(Fixed(6, 4), PowerOfTwo(5), None, axis=1, scale_rule="rceil"),
    Scaled(Float(2, 1, special="none"), Float(5, 3), (2, 3)),
    Scaled(Float(4, 3, special="fn"), Float(4, 3, special="fn", saturate=True), 4, axis=0),
    Scaled(Float(2, 1, special="none"), Float(4, 3, special="fn"), "tensor", tensor_scale=True),
]


def _values(draw, shape, dtype):
    count = math.prod(shape)
    kind = draw(st.sampled_from(["normal", "wide", "specials"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(count, generator=g, dtype=torch.float64)
    if kind == "wide":
        x = x * torch.exp2(torch.randint(-30, 30, (count,), generator=g).double())
    if kind == "specials" and count > 0:
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, count - 1))
            x[i] = draw(st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-30]))
    return x.to(dtype).reshape(shape)


@st.composite
def cases(draw):
    fmt = draw(st.sampled_from(FORMATS))
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0 if ndim > 1 else 1, 9)) for _ in range(ndim))
    if fmt.axis not in range(-len(shape), len(shape)):
        shape = (*shape, 3)
    rounding = draw(st.sampled_from(list(lpsim.Rounding)))
    rbits = draw(st.sampled_from([None, 1, 7])) if rounding.is_stochastic else None
    return fmt, _values(draw, shape, dtype), rounding, rbits, draw(st.integers(0, 2**64 - 1))


@settings(max_examples=300, deadline=None)
@given(cases())
def test_kernel_matches_the_exact_reference(case):
    fmt, x, rounding, rbits, seed = case
    try:
        lpsim.formats.check_fits(fmt.element, x.dtype)
    except ValueError:
        return
    kwargs = {"rbits": rbits, "seed": seed} if rounding.is_stochastic else {}
    ours = lpsim.quantize(x, fmt, rounding, **kwargs)
    assert_same_bits(ours, reference.quantize(x, fmt, rounding, **kwargs))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "name", ["mxfp4_e2m1", "nvfp4", "fp8_e4m3_128x128", "fp8_e4m3_tensor", "fp8_e5m2_row"]
)
def test_large_blocks_and_many_blocks_match_the_reference(name, dtype):
    # 40000 positions per tile exceed the loops' in-cache size: scanned in chunks, then rounded.
    x = heavy_tailed(200, 200, seed=2, spread=1.0).to(dtype)
    fmt = preset(name)
    assert_same_bits(lpsim.quantize(x, fmt, "stochastic", seed=7), _reference(x, fmt, seed=7))


def _reference(x, fmt, seed):
    return reference.quantize(x, fmt, "stochastic", seed=seed)


def test_results_do_not_depend_on_the_thread_count():
    x = heavy_tailed(512, 512, seed=9, spread=2.0)
    threads = torch.get_num_threads()
    results = []
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        results.append(
            [lpsim.quantize(x, fmt, "stochastic", seed=1) for fmt in SCALED_PRESETS.values()]
        )
    torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_same_bits(a, b)


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2])
def test_any_axis_and_layout_give_the_contiguous_result(axis):
    x = heavy_tailed(6, 40, seed=4).reshape(6, 5, 8)
    fmt = Scaled(Float(2, 1, special="none"), PowerOfTwo(8), 3, axis=axis)
    expected = reference.quantize(x, fmt)
    assert_same_bits(lpsim.quantize(x, fmt), expected)
    view = x.transpose(0, 2).contiguous().transpose(0, 2)  # same values, other strides
    assert not view.is_contiguous()
    assert_same_bits(lpsim.quantize(view, fmt), expected)
    out = torch.empty_like(x)
    lpsim.quantize(x, fmt, out=out)
    assert_same_bits(out, expected)
    y = x.clone()
    lpsim.quantize_(y, fmt)
    assert_same_bits(y, expected)


# ---- The vectorised paths against the exact reference
#
# The CPU loops round a block with a power-of-two scale onto the element grid shifted by the scale:
# in the tensor's container where that grid fits it, else (16-bit tensors) in float32 where it fits
# that, else (tiny blocks: scales below 2^-127, or elements finer than float32's) one element at a
# time in float64; blocks with Float scales in float32 arithmetic; NaN or Inf blocks are NaN.
# Blocks along the last axis are contiguous; along another axis each row of a group holds elements
# of many blocks, transposed into a buffer. These tests hold every path to the exact reference, bit
# for bit, with dense edge cases.

# Besides the presets, formats that take the other paths: scales down to 2^-149 (tiny float32
# blocks run one element at a time), elements down to 2^-24 (float16's own: small blocks fit only
# float32), no subnormals, a Fixed element, and a Float scale without a tensor scale.
PATH_FORMATS = {
    **SCALED_PRESETS,
    "e4m3_scales_to_2^-149": Scaled(Float(4, 3, special="fn"), PowerOfTwo(8, bias=149), 32),
    "e5m10_ceil": Scaled(Float(5, 10), PowerOfTwo(8), 16, scale_rule="ceil"),
    "e4m3_no_subnormals_even": Scaled(
        Float(4, 3, subnormals=False), PowerOfTwo(8, bias=140), 8, scale_rule="even"
    ),
    "int8_rceil": Scaled(Fixed(8, 6), PowerOfTwo(8), 32, scale_rule="rceil"),
    "e2m1_e4m3_scale": Scaled(Float(2, 1, special="none"), Float(4, 3, special="fn"), 16),
}

# (smallest positive, largest finite) of each container, as powers of two.
_RANGE = {
    torch.float32: (-149, 128),
    torch.bfloat16: (-133, 128),
    torch.float16: (-24, 16),
    torch.float64: (-1074, 1024),
}
_RULES = [
    *[(r, None) for r in lpsim.Rounding if not r.is_stochastic],
    *[(r, bits) for r in lpsim.Rounding if r.is_stochastic for bits in (1, 3, 8, 32)],
]


def _edge_rows(dtype, cols: int, seed: int) -> torch.Tensor:
    """Rows of finite values, one kind per row: ordinary, ties, wide ranges within a row, zeros
    of both signs, tiny values near the container's subnormals (scales clamp; the shifted grid
    does not fit), huge values near its largest, and both in one row."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = _RANGE[dtype]

    def randn():
        return torch.randn(cols, generator=g, dtype=torch.float64)

    def exp2(a: int, b: int):
        return torch.exp2(torch.randint(a, b, (cols,), generator=g).double())

    rows = [
        randn() * 3,
        torch.randint(-(2**9), 2**9, (cols,), generator=g).double() / 16,  # many midpoints
        randn() * exp2(-12, 12),
        torch.tensor([0.0, -0.0] * (cols // 2) + [0.0] * (cols % 2), dtype=torch.float64),
        randn() * exp2(lo, lo + 16),
        randn().abs().clamp(max=1.9) * exp2(hi - 8, hi - 1),
        randn() * exp2(lo, hi - 1),
    ]
    tiny_and_huge = randn() * 2.0 ** (lo + 2)
    tiny_and_huge[::7] = 1.5 * 2.0 ** (hi - 2)
    rows.append(tiny_and_huge)
    x = torch.stack(rows)
    return x.clamp(-(2.0 ** (hi - 1)), 2.0 ** (hi - 1)).to(dtype)


def _special_rows(dtype, cols: int) -> torch.Tensor:
    x = torch.linspace(-3, 3, 4 * cols, dtype=torch.float64).reshape(4, cols)
    x[0, 1], x[1, cols - 1], x[2, cols // 2] = math.nan, math.inf, -math.inf
    return x.to(dtype)


def _cases_of(fmt: Scaled):
    """(format, layout) pairs: blocks along the last axis, and along axis 0 of the transpose."""
    yield fmt, lambda x: x
    if isinstance(fmt.block, int) or fmt.block is None:
        yield dataclasses.replace(fmt, axis=0), lambda x: x.t().contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(PATH_FORMATS))
def test_every_path_matches_the_reference_bit_for_bit(name, dtype):
    fmt = PATH_FORMATS[name]
    try:
        lpsim.formats.check_fits(fmt.element, dtype)
    except ValueError:
        pytest.skip(f"{name} does not fit {dtype}")
    tensors = [_edge_rows(dtype, 48, seed=len(name)), _special_rows(dtype, 48)]
    for case, layout in _cases_of(fmt):
        for x in map(layout, tensors):
            for rounding, rbits in _RULES:
                kwargs = {"rbits": rbits, "seed": 11 + (rbits or 0)} if rbits else {}
                ours = lpsim.quantize(x, case, rounding, **kwargs)
                assert_same_bits(ours, reference.quantize(x, case, rounding, **kwargs))


@pytest.mark.parametrize(
    "dtype, name, rounding, shuffled, axis",
    [
        (torch.bfloat16, "mxfp8_e4m3", "nearest", False, -1),
        (torch.bfloat16, "nvfp4", "stochastic", True, 0),
        (torch.float16, "mxfp4_e2m1", "stochastic", False, -1),
        (torch.float16, "mxfp8_e5m2", "up", True, 0),
    ],
)
def test_every_16_bit_value_matches_the_reference(dtype, name, rounding, shuffled, axis):
    # All finite 16-bit values, in order (each block holds neighbouring values) or shuffled (each
    # block spans the whole range).
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    values = values[torch.isfinite(values)]
    if shuffled:
        values = values[torch.randperm(len(values), generator=torch.Generator().manual_seed(3))]
    x = values[: len(values) // 64 * 64].reshape(-1, 64)
    fmt = dataclasses.replace(preset(name), axis=axis)
    if axis == 0:
        x = x.t().contiguous()
    ours = lpsim.quantize(x, fmt, rounding, seed=5)
    assert_same_bits(ours, reference.quantize(x, fmt, rounding, seed=5))


def test_float64_blocks_with_elements_far_below_the_scale_round_exactly():
    # x / 2^e of the tiny elements lies below float64's range (the scale clamps at 2^127): they are
    # rounded exactly, so rules that round away from zero give the smallest element times 2^127.
    x = torch.tensor(
        [[2.0**200, 2.0**-1074, -(2.0**-1000), 2.0**-900] + [0.0] * 28], dtype=torch.float64
    )
    for rounding in lpsim.Rounding:
        kwargs = {"seed": 2} if rounding.is_stochastic else {}
        ours = lpsim.quantize(x, preset("mxfp8_e4m3"), rounding, **kwargs)
        assert_same_bits(ours, reference.quantize(x, preset("mxfp8_e4m3"), rounding, **kwargs))
    assert lpsim.quantize(x, preset("mxfp8_e4m3"), "up")[0, 1] == 2.0 ** (127 - 9)


def test_large_groups_along_axis_0_with_tiny_and_nan_blocks_match_the_reference():
    # 33000 positions per group: scanned in chunks, then rounded with the blocks' scales; blocks
    # along axis 0, so each row holds an ordinary, a tiny and a NaN block.
    g = torch.Generator().manual_seed(8)
    x = torch.randn(33000, 3, generator=g)
    x[:, 1] *= 2.0**-140  # with scales down to 2^-149, its shifted grid does not fit float32
    x[100, 2] = math.nan
    for fmt, rounding in (
        (Scaled(Float(4, 3, special="fn"), PowerOfTwo(8, bias=149), None, axis=0), "stochastic"),
        (Scaled(Float(2, 1, special="none"), Float(4, 3, special="fn"), None, axis=0), "nearest"),
    ):
        ours = lpsim.quantize(x, fmt, rounding, seed=4)
        assert_same_bits(ours, reference.quantize(x, fmt, rounding, seed=4))


@pytest.mark.parametrize(
    "shape, fmt",
    [
        # 1100 positions per group: a task takes 29 of the 40 inner indices, then the other 11.
        ((1100, 40), Scaled(Float(4, 3, special="fn"), PowerOfTwo(8, bias=149), None, axis=0)),
        # The last group is one row of 3000 blocks: wider than a batch, rounded 2048 at a time.
        ((5, 3000), Scaled(Float(2, 1, special="none"), PowerOfTwo(8, bias=149), 4, axis=0)),
        ((5, 3000), Scaled(Float(2, 1, special="none"), Float(4, 3, special="fn"), 4, axis=0)),
    ],
)
def test_wide_and_sliced_groups_along_axis_0_match_the_reference(shape, fmt):
    x = heavy_tailed(*shape, seed=13, spread=3.0)
    # A block of float32 subnormals: with scales down to 2^-149, its shifted grid does not fit.
    x[:, 3] = torch.arange(1, shape[0] + 1) * 2.0**-149
    x[2, 7] = math.inf
    for rounding in ("nearest", "stochastic"):
        ours = lpsim.quantize(x, fmt, rounding, seed=6)
        assert_same_bits(ours, reference.quantize(x, fmt, rounding, seed=6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_along_axis_0_do_not_depend_on_the_thread_count(dtype):
    x = heavy_tailed(512, 384, seed=12, spread=2.0)
    x[7, 5] = math.nan
    x[:, 9] *= 1e-30
    x = x.to(dtype)
    threads = torch.get_num_threads()
    results = []
    for n in (1, 2):
        torch.set_num_threads(n)
        results.append(
            [
                lpsim.quantize(x, dataclasses.replace(preset(name), axis=0), rounding, seed=3)
                for name in ("mxfp8_e4m3", "mxfp4_e2m1", "nvfp4", "fp8_e4m3_row")
                for rounding in ("nearest", "stochastic")
            ]
        )
    torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert_same_bits(a, b)


def _check_arguments(fmt: Scaled) -> str:
    """The format as tests/cpp/scaled_paths_check.cpp reads it: the op's arguments, reals in hex."""
    *grids, rule, tensor_scale, emax, precision, elem_max, _block, _axis = fmt.op_arguments(
        torch.float64
    )

    def text(v):
        return float(v).hex() if isinstance(v, float) else str(int(v))

    def fits(dtype):
        try:
            lpsim.formats.check_fits(fmt.element, dtype)
        except ValueError:
            return 0
        return 1

    fields = [*grids, rule, tensor_scale, emax, precision, elem_max]
    return " ".join([*map(text, fields), str(fits(torch.bfloat16)), str(fits(torch.float16))])


@pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")
def test_vectorised_paths_give_scaled_elements_bits_for_every_value_and_rule(tmp_path):
    # The loops' paths against the element as x / 2^e rounded in float64 (power-of-two scales)
    # and against the float64 element grid (Float scales), element by element with the same random
    # word, in C++: every bfloat16 and float16 value, random and edge float32 and float64 values,
    # every rule and rbits 1, 3, 8 and 32.
    binary = build_cpp_check(
        "scaled_paths_check", tmp_path, ("-std=c++20", "-O2", "-ffp-contract=off")
    )
    arguments = [_check_arguments(fmt) for fmt in PATH_FORMATS.values()]
    run = subprocess.run([binary, *arguments], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout
    assert run.stdout.strip().endswith("\n0 failures"), run.stdout
    # Every path compared something.
    paths = r"compared: (\d+) in the container, (\d+) in float32, (\d+) with"
    counts = re.search(paths, run.stdout)
    assert counts and all(int(c) > 0 for c in counts.groups()), run.stdout


# ---- Properties


@pytest.mark.parametrize("name", [n for n in SCALED_PRESETS if n.startswith("mx")])
def test_blocks_of_scaled_element_values_are_unchanged(name):
    fmt = preset(name)
    # Values no larger in magnitude than the largest element (MXINT8's -2 would raise the scale).
    values = [v for v in fmt.element.values().tolist() if abs(v) <= fmt.element.max]
    g = torch.Generator().manual_seed(0)
    picks = torch.tensor(values, dtype=torch.float64)[
        torch.randint(len(values), (64, 32), generator=g)
    ]
    picks[:, 0] = fmt.element.max  # the largest element sets the scale: 2**e exactly (floor rule)
    e = torch.randint(-100, 100, (64, 1), generator=g).double()
    x = (picks * torch.exp2(e)).float()
    for rounding in lpsim.Rounding:
        assert_same_bits(lpsim.quantize(x, fmt, rounding, seed=1), x)


@pytest.mark.parametrize("name", SCALED_PRESETS)
def test_values_of_the_format_come_back_unchanged_by_every_rule(name):
    # Values of the format under their own scales: rounded to nearest until that changes nothing
    # (a block's scale follows its largest value, which the rounding may move). With a Float scale
    # the encoder's y = x * (1 / s) lies a rounding or two from the element, where the directed
    # and stochastic rules once moved it a step.
    fmt = preset(name)
    x = heavy_tailed(128, 256, seed=7, spread=2.0)
    for _ in range(8):
        y = lpsim.quantize(x, fmt, "nearest")
        if bool(same_bits(y, x).all()):
            break
        x = y
    else:
        pytest.fail("rounding to nearest found no fixed point in 8 passes")
    for rounding, rbits in _RULES:
        got = lpsim.quantize(x, fmt, rounding, rbits=rbits, seed=1)
        assert_same_bits(got, x)


def test_a_nan_or_inf_makes_its_block_nan_and_leaves_the_others():
    x = torch.ones(4, 64)
    x[0, 3] = math.nan
    x[2, 40] = -math.inf
    for fmt in SCALED_PRESETS.values():
        if fmt.block != 32:
            continue
        y = lpsim.quantize(x, fmt)
        assert torch.isnan(y[0, :32]).all() and torch.isnan(y[2, 32:]).all()
        assert (y[0, 32:] == 1).all() and (y[2, :32] == 1).all() and (y[1] == 1).all()


def test_all_zero_blocks_stay_zero_with_their_signs():
    x = torch.tensor([[0.0, -0.0] * 16])
    for fmt in SCALED_PRESETS.values():
        assert_same_bits(lpsim.quantize(x, fmt), x)


def test_stochastic_rounding_is_unbiased_within_a_block():
    x = torch.full((1, 32), 1.3)
    x[0, 0] = 6.0  # mxfp4: scale 1, elements 1 and 1.5 around 1.3
    draws = torch.stack(
        [lpsim.quantize(x, preset("mxfp4_e2m1"), "stochastic", seed=s)[0, 1:] for s in range(400)]
    )
    assert set(draws.unique().tolist()) == {1.0, 1.5}
    # P(1.5) = 0.6; 400 * 31 Bernoulli draws: the mean is within 5 standard errors of 1.3.
    standard_error = 0.5 * math.sqrt(0.6 * 0.4 / draws.numel())
    assert abs(draws.mean().item() - 1.3) < 5 * standard_error


def test_gradient_is_straight_through():
    x = torch.randn(4, 32, requires_grad=True)
    y = lpsim.quantize(x, preset("nvfp4"))
    y.backward(torch.arange(128.0).reshape(4, 32))
    assert torch.equal(x.grad, torch.arange(128.0).reshape(4, 32))


def test_facts_of_the_presets():
    mx = preset("mxfp8_e4m3")
    assert (mx.bits, mx.block_elements, mx.bits_per_element) == (8, 32, 8.25)
    assert mx.max == 448 * 2.0**127
    nv = preset("nvfp4")
    assert (nv.bits_per_element, nv.element_max, nv.scale_rule) == (4.5, 6.0, "amax")
    assert preset("fp8_e4m3_128x128").block_elements == 128 * 128
    assert preset("fp8_e4m3_tensor").bits_per_element is None
    assert preset("mxint8").element_precision == 6
    assert SCALE_RULES == ("floor", "ceil", "even", "rceil", "amax")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"element": "e4m3"}, TypeError, "Scaled.element must be a Float or Fixed"),
        ({"scale": 8}, TypeError, "Scaled.scale must be a PowerOfTwo or Float"),
        ({"block": 0}, ValueError, r"Scaled.block must be in \[1, 2147483648\], got 0"),
        ({"block": (4, 0)}, ValueError, r"Scaled.block cols must be in \[1"),
        ({"block": (4, 4), "axis": 0}, ValueError, "axis must be -1"),
        ({"block": "rows"}, ValueError, "must be 'tensor'"),
        ({"scale_rule": "amax"}, ValueError, "scale_rule must be one of"),
        ({"scale": Float(4, 3), "scale_rule": "floor"}, ValueError, "scale_rule must be one of"),
        ({"tensor_scale": True}, ValueError, "tensor_scale needs a Float scale"),
        ({"scale": Float(11, 3)}, ValueError, "does not fit float32's range"),
    ],
)
def test_bad_fields_raise_naming_the_field(kwargs, error, message):
    fields = {"element": Float(2, 1, special="none"), **kwargs}
    with pytest.raises(error, match=message):
        Scaled(**fields)


def test_bad_arguments_raise():
    fmt = Scaled(Float(2, 1, special="none"), axis=3)
    with pytest.raises(IndexError, match="axis must be in"):
        lpsim.quantize(torch.ones(2, 2), fmt)
    with pytest.raises(ValueError, match="does not fit a float16 tensor"):
        lpsim.quantize(torch.ones(2, dtype=torch.float16), Scaled(Float(8, 7)))
    with pytest.raises(ValueError, match="no scaled preset named 'mxfp9'"):
        preset("mxfp9")
    with pytest.raises(ValueError, match=r"PowerOfTwo.exp must be in \[1, 8\]"):
        PowerOfTwo(9)


@pytest.mark.parametrize("variant", ["quantize", "quantize_", "out"])
@pytest.mark.parametrize("axis", [3, -3])
def test_a_bad_axis_raises_the_eager_error_on_meta_tensors_and_under_compile(axis, variant):
    """The fake kernels (meta tensors, torch.compile's tracing) check the axis as the compiled
    kernel does, with its message."""
    fmt = Scaled(Float(2, 1, special="none"), axis=axis)

    def run(x):
        if variant == "quantize":
            return lpsim.quantize(x, fmt)
        if variant == "quantize_":
            return lpsim.quantize_(x.clone(), fmt)
        return lpsim.quantize(x, fmt, out=torch.empty_like(x))

    with pytest.raises(IndexError) as eager:
        run(torch.ones(2, 2))
    assert f"got {axis}" in str(eager.value)
    with pytest.raises(IndexError) as meta:
        run(torch.ones(2, 2, device="meta"))
    assert str(meta.value) == str(eager.value)
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=re.escape(str(eager.value))):
        compiled(torch.ones(2, 2))


@pytest.mark.parametrize(
    "scale, message",
    [
        # scale max * elem_max = 1.875 * 2**126 * 448 overflows float32: t was taken as its
        # floor and 3e38 decoded to 420.
        (Float(7, 3, bias=0), r"scale max \* element max below 2\*\*128"),
        # smallest scale 2**11: t's floor 2**-137 has no finite float32 reciprocal, and an
        # all-zero float32 tensor decoded to NaN (to 0 in float64).
        (Float(4, 3, bias=-10), r"smallest normal is at most 2 \(emin <= 1"),
        # smallest scale 2**101: t's floor 2**-227 is below float32's range.
        (Float(4, 3, bias=-100), r"smallest normal is at most 2 \(emin <= 1"),
    ],
)
def test_tensor_scale_whose_float32_arithmetic_overflows_is_refused(scale, message):
    element = Float(4, 3, special="fn", saturate=True)
    Scaled(element, scale, 16)  # one level is fine
    with pytest.raises(ValueError, match=message):
        Scaled(element, scale, 16, tensor_scale=True)


@pytest.mark.parametrize("element", [Fixed(4, 30), Fixed(8, 6), Float(2, 1, bias=3)])
def test_tensor_scale_with_elements_below_2_is_refused(element):
    # A block's decode factor t * s is about amax / elem_max: with elem_max below 2 it overflowed
    # float32 for a tensor near float32's max, and a finite block decoded to Inf and its zero
    # elements to NaN (0 * Inf).
    assert element.max < 2
    scale = Float(4, 3, special="fn")
    Scaled(element, scale, 16)  # one level is fine
    with pytest.raises(ValueError, match=r"element max of at least 2"):
        Scaled(element, scale, 16, tensor_scale=True)


def test_tensor_scale_near_float32_max_decodes_finite_values():
    # Elements up to 3 (the smallest maximum a two-level format allows is 2), scales up to about
    # 2**126: t * s stays finite for a block holding 3e38, and every value is finite.
    fmt = Scaled(Fixed(3, 0), Float(8, 3, bias=129), 16, tensor_scale=True)
    x = torch.tensor([3e38, -2.9e38] + [0.0] * 14 + [1.0, 2.0] * 8)
    q = lpsim.quantize(x, fmt)
    assert torch.isfinite(q).all()
    assert torch.equal(q, reference.quantize(x, fmt))


def test_tensor_scale_at_the_limits_of_its_arithmetic_decodes_exactly():
    element = Float(2, 1, special="none", saturate=True)
    # The smallest scale 2 (emin 1): t's floor 2**-127 still has a finite reciprocal.
    fmt = Scaled(element, Float(4, 3, bias=0), 4, tensor_scale=True)
    for dtype in (torch.float32, torch.float64):
        zeros = torch.zeros(8, dtype=dtype)
        assert torch.equal(lpsim.quantize(zeros, fmt), zeros)
        x = torch.tensor([6.0, 3.0, -1.5, 0.5, 0.0, 0.0, 0.0, 1.0], dtype=dtype) * 2.0**20
        assert torch.equal(lpsim.quantize(x, fmt), x)


def test_nvfp4_tensor_scale_of_a_float64_tensor_is_float64_as_documented():
    # docs/formats.md: the tensor scale is computed in the format's arithmetic, float64 for a
    # float64 tensor, and not rounded to float32. A numpy model of NVFP4 (torchao's steps) with t
    # in float64 gives lpsim's values; with t rounded to float32 it does not.
    x = torch.tensor([1.0, 0.3, 0.7] + [0.1] * 13, dtype=torch.float64) * 1.2345678901
    amax = float(x.abs().max())

    def model(t: float) -> np.ndarray:
        d = min(max((amax / 6) / t, 2.0**-6), 448.0)
        s = float(np.float64(d).astype(np.float32).astype(ml_dtypes.float8_e4m3fn))
        elements = np.clip(x.numpy() * ((1 / t) / s), -6, 6).astype(ml_dtypes.float4_e2m1fn)
        return elements.astype(np.float64) * (t * s)

    got = lpsim.quantize(x, preset("nvfp4")).numpy()
    assert np.array_equal(got, model(amax / 2688))
    assert not np.array_equal(got, model(float(np.float32(np.float32(amax) / np.float32(2688)))))


def test_decoded_values_beyond_the_dtype_are_inf_as_documented():
    # docs/formats.md: a block's elements may decode to a power of two the dtype cannot hold.
    big = torch.tensor([3.3e38, -3.3e38, 1.0])
    ceil = dataclasses.replace(preset("mxfp4_e2m1"), scale_rule="ceil")
    assert torch.equal(lpsim.quantize(big, ceil), torch.tensor([math.inf, -math.inf, 0.0]))
    assert torch.equal(
        lpsim.quantize(big.double(), ceil),
        torch.tensor([2.0**128, -(2.0**128), 0.0], dtype=torch.float64),
    )
    half = torch.tensor([65000.0, 1.0], dtype=torch.float16)
    assert torch.equal(
        lpsim.quantize(half, ceil), torch.tensor([math.inf, 0.0], dtype=torch.float16)
    )
    mxint8 = preset("mxint8")
    x = torch.tensor([-3.39e38, 3.39e38])
    assert torch.equal(lpsim.quantize(x, mxint8), torch.tensor([-math.inf, 127 / 64 * 2.0**127]))
    half = torch.tensor([-65504.0, 65504.0], dtype=torch.float16)
    assert torch.equal(
        lpsim.quantize(half, mxint8), torch.tensor([-math.inf, 65024.0], dtype=torch.float16)
    )


def test_scaled_quantize_compiles_with_dynamic_shapes_to_the_eager_bits():
    # torch.compile traces quantize_scaled with its Meta kernel, on symbolic shapes here.
    fmt = preset("mxfp8_e4m3")
    compiled = torch.compile(lambda x: lpsim.quantize(x, fmt), backend="aot_eager", dynamic=True)
    for shape in [(3, 64), (5, 96), (2, 7, 32)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
        assert_same_bits(compiled(x), lpsim.quantize(x, fmt))


def test_float_scaled_bfloat16_results_differ_from_float32_as_often_as_the_docs_count():
    # docs/formats.md, "Which container": with fp8_e4m3_1x128, of the 4096 values of
    # torch.manual_seed(0); torch.randn(4096).bfloat16(), 97 round otherwise in the bfloat16
    # tensor than in a float32 one under "down", 7 under "stochastic" (seed=3), none under
    # "nearest".
    fmt = lpsim.scaled.preset("fp8_e4m3_1x128")
    torch.manual_seed(0)
    x = torch.randn(4096).bfloat16()
    for rule, kwargs, count in [
        ("down", {}, 97),
        ("stochastic", {"seed": 3}, 7),
        ("nearest", {}, 0),
    ]:
        in_bfloat16 = lpsim.quantize(x, fmt, rule, **kwargs)
        in_float32 = lpsim.quantize(x.float(), fmt, rule, **kwargs).bfloat16()
        assert (in_bfloat16 != in_float32).sum().item() == count, rule
