"""Formats: validation with clear messages, derived facts equal to numpy.finfo-style references
(ml_dtypes, torch.finfo), values() equal to enumerations of other libraries' codes, and the fit to
each container."""

import math
import sys

import ml_dtypes
import numpy as np
import pytest
import torch
from gfloat import round_float
from gfloat.types import Domain, FormatInfo, RoundMode

import lpsim
from lpsim import BlockFloat, Fixed, Float
from lpsim.formats import PRESETS, SPECIALS, check_fits, preset

ML_DTYPES = {
    "e3m4": ml_dtypes.float8_e3m4,
    "e4m3": ml_dtypes.float8_e4m3,
    "e4m3fn": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "e2m3fn": ml_dtypes.float6_e2m3fn,
    "e3m2fn": ml_dtypes.float6_e3m2fn,
    "e2m1fn": ml_dtypes.float4_e2m1fn,
    "bfloat16": ml_dtypes.bfloat16,
}

TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "e4m3fn": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e4m3fnuz": torch.float8_e4m3fnuz,
    "e5m2fnuz": torch.float8_e5m2fnuz,
}


@pytest.mark.parametrize("name", ML_DTYPES)
def test_preset_facts_match_ml_dtypes_finfo(name):
    fmt, info = preset(name), ml_dtypes.finfo(ML_DTYPES[name])
    assert fmt.max == float(info.max) and fmt.min == float(info.min)
    assert fmt.smallest_normal == float(info.smallest_normal)
    assert fmt.smallest_subnormal == float(info.smallest_subnormal)
    assert fmt.eps == float(info.eps)
    assert fmt.bits == info.bits


@pytest.mark.parametrize("name", TORCH_DTYPES)
def test_preset_facts_match_torch_finfo(name):
    fmt, info = preset(name), torch.finfo(TORCH_DTYPES[name])
    assert fmt.max == info.max and fmt.min == info.min
    assert fmt.smallest_normal == info.smallest_normal
    assert fmt.bits == info.bits
    # torch 2.14 reports eps = 0.125 for float8_e5m2fnuz, although the format has two fraction
    # bits (1.0 is followed by 1.25; ml_dtypes says 0.25): eps is checked against values() below.
    if name != "e5m2fnuz":
        assert fmt.eps == info.eps


@pytest.mark.parametrize("name", [n for n, f in PRESETS.items() if f.bits <= 16])
def test_eps_is_the_spacing_above_one(name):
    v = preset(name).values()
    above_one = v[v > 1.0]
    assert above_one.min().item() - 1.0 == preset(name).eps


def _finite_values_of_codes(dtype, bits: int) -> list[float]:
    codes = np.arange(2**bits, dtype=np.uint16 if bits > 8 else np.uint8)
    values = codes.view(dtype).astype(np.float64)
    return sorted({float(v) for v in values if np.isfinite(v)} - {-0.0} | {0.0})


@pytest.mark.parametrize("name", [n for n in ML_DTYPES if n != "bfloat16"])
def test_values_enumerate_every_ml_dtypes_code(name):
    fmt = preset(name)
    assert fmt.values().tolist() == _finite_values_of_codes(ML_DTYPES[name], fmt.bits)


@pytest.mark.parametrize("name,dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_values_enumerate_every_torch_code(name, dtype):
    codes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).double()
    finite = sorted(set(codes[torch.isfinite(codes)].tolist()))
    assert preset(name).values().tolist() == finite


def test_values_are_ascending_and_unique_for_every_small_preset():
    for name, fmt in PRESETS.items():
        if fmt.bits <= 16:
            v = fmt.values()
            assert bool((v[1:] > v[:-1]).all()), name
            assert v[-1].item() == fmt.max, name


def test_qtorch_convention_presets_have_the_extra_binade():
    # QPyTorch treats the top exponent code as finite: e5m2 reaches 114688, e4m3 480.
    assert preset("e5m2_qtorch").max == 114688.0
    assert preset("e4m3_qtorch").max == 480.0
    assert preset("e5m2").max == 57344.0


@pytest.mark.parametrize(
    "kwargs,smallest,largest",
    [
        (dict(wl=8, fl=4), -8.0, 127 / 16),
        (dict(wl=8, fl=4, symmetric=True), -127 / 16, 127 / 16),
        (dict(wl=8, fl=4, signed=False), 0.0, 255 / 16),
        (dict(wl=4, fl=-2), -32.0, 28.0),
    ],
)
def test_fixed_range_and_values(kwargs, smallest, largest):
    fmt = Fixed(**kwargs)
    v = fmt.values()
    assert (fmt.min, fmt.max) == (smallest, largest)
    assert (v[0].item(), v[-1].item()) == (smallest, largest)
    assert torch.equal(v[1:] - v[:-1], torch.full((v.numel() - 1,), fmt.eps, dtype=torch.float64))


def test_block_float_facts_are_those_of_a_block_with_exponent_zero():
    fmt = BlockFloat(4)
    assert fmt.max == 1.75 and fmt.eps == 0.25 and fmt.smallest_normal == 1.0
    assert fmt.values().tolist() == [k / 4 for k in range(-7, 8)]


def test_float_without_subnormals_has_no_values_below_the_smallest_normal():
    fmt = Float(3, 2, subnormals=False)
    positive = fmt.values()[fmt.values() > 0]
    assert positive.min().item() == fmt.smallest_normal == fmt.smallest_subnormal


@pytest.mark.parametrize(
    "make,error,pattern",
    [
        (lambda: Float(5.0, 2), TypeError, r"Float\.exp must be an int"),
        (lambda: Float(True, 2), TypeError, r"Float\.exp must be an int"),
        (lambda: Float(0, 2), ValueError, r"Float\.exp must be in \[1, 11\]"),
        (lambda: Float(12, 2), ValueError, r"Float\.exp must be in \[1, 11\]"),
        (lambda: Float(1, 2), ValueError, r"Float\.exp must be >= 2 with special='ieee'"),
        (lambda: Float(5, -1), ValueError, r"Float\.man must be in \[0, 52\]"),
        (lambda: Float(5, 53), ValueError, r"Float\.man must be in \[0, 52\]"),
        (lambda: Float(5, 2, special="ocp"), ValueError, r"Float\.special must be one of"),
        (lambda: Float(5, 2, bias=1.5), TypeError, r"Float\.bias must be an int"),
        (lambda: Float(5, 2, saturate=1), TypeError, r"Float\.saturate must be a bool"),
        (lambda: Float(5, 2, subnormals="yes"), TypeError, r"Float\.subnormals must be a bool"),
        (lambda: Float(11, 52, bias=0), ValueError, r"does not fit even a float64 container"),
        (lambda: Fixed(1, 0), ValueError, r"Fixed\.wl must be in \[2, 54\]"),
        (lambda: Fixed(8, 2.5), TypeError, r"Fixed\.fl must be an int"),
        (lambda: Fixed(60, 0), ValueError, r"Fixed\.wl must be in \[2, 54\], got 60"),
        (lambda: Fixed(64, 0, clamp=False), ValueError, r"Fixed\.wl must be in \[2, 54\]"),
        (lambda: Fixed(54, 0, signed=False), ValueError, r"Fixed\.wl must be in \[1, 53\], got 54"),
        (lambda: Fixed(0, 0, signed=False), ValueError, r"Fixed\.wl must be in \[1, 53\], got 0"),
        (
            lambda: Fixed(8, 4, signed=False, symmetric=True),
            ValueError,
            r"symmetric applies to signed",
        ),
        (lambda: BlockFloat(1), ValueError, r"BlockFloat\.wl must be in \[2, 54\]"),
        (lambda: BlockFloat(8, 0, block_size=32), ValueError, r"dim or block_size, not both"),
        (lambda: BlockFloat(8, block_size=0), ValueError, r"BlockFloat\.block_size must be in"),
        (lambda: BlockFloat(8, dim=1.0), TypeError, r"BlockFloat\.dim must be an int"),
        (lambda: preset("fp8"), ValueError, r"no preset named 'fp8'; presets: float32"),
    ],
)
def test_bad_format_fields_raise_naming_the_field(make, error, pattern):
    with pytest.raises(error, match=pattern):
        make()


def test_eleven_exponent_bits_fit_float64_only_where_the_docs_say():
    # docs/formats.md, Float's table: with the default bias, exp=11 fits float64 under "ieee"
    # with any man, "fnuz" with man up to 51 and "fn" with man 0 only; "none" never. Float64's
    # own limits: largest finite binade 2**1023, smallest subnormal 2**-1074.
    fits = {
        "ieee": range(53),
        "fnuz": range(52),
        "fn": range(1),
        "none": range(0),
    }
    for special, mans in fits.items():
        for man in range(53):
            if man in mans:
                fmt = Float(11, man, special=special)
                assert fmt.max <= sys.float_info.max and fmt.smallest_subnormal >= 2.0**-1074
            else:
                with pytest.raises(ValueError, match="does not fit even a float64 container"):
                    Float(11, man, special=special)


@pytest.mark.parametrize(
    "fmt,dtype,pattern",
    [
        (
            Float(8, 7),
            torch.float16,
            r"does not fit a float16 tensor: its largest exponent is 127"
            r".*use a float32 or float64 or bfloat16 tensor|does not fit a float16 tensor",
        ),
        (Float(5, 10), torch.bfloat16, r"has 10 fraction bits, the container 7"),
        (Float(8, 23), torch.bfloat16, r"use a float32 or float64 tensor"),
        (Fixed(26, 4), torch.float32, r"integers need 25 significant bits, the container has 24"),
        (
            Fixed(8, 160),
            torch.float32,
            r"spacing 2\*\*-160 is below the container's smallest subnormal",
        ),
        (BlockFloat(10), torch.bfloat16, r"wl is 10, the container holds at most 9"),
    ],
)
def test_format_too_wide_for_the_container_raises(fmt, dtype, pattern):
    with pytest.raises(ValueError, match=pattern):
        check_fits(fmt, dtype)
    with pytest.raises(ValueError, match=pattern):
        lpsim.quantize(torch.zeros(3, dtype=dtype), fmt)


def test_values_refuses_formats_wider_than_16_bits():
    with pytest.raises(ValueError, match="at most 16 bits"):
        Float(8, 23).values()


def test_repr_lists_only_what_differs_from_the_defaults():
    assert repr(Float(5, 2)) == "Float(exp=5, man=2)"
    assert repr(Float(4, 3, special="fnuz")) == "Float(exp=4, man=3, special='fnuz')"
    assert repr(Float(5, 2, bias=12)) == "Float(exp=5, man=2, bias=12)"
    assert repr(Fixed(8, 4, clamp=False)) == "Fixed(wl=8, fl=4, clamp=False)"
    assert repr(BlockFloat(8, block_size=32)) == "BlockFloat(wl=8, dim=None, block_size=32)"


def test_formats_are_hashable_values():
    assert Float(5, 2) == Float(5, 2, bias=15)
    assert len({Float(5, 2), Float(5, 2, bias=15), Fixed(8, 4)}) == 2
    assert math.isinf(Fixed(8, 4, clamp=False).grid().pos_limit)


def _positive_values_by_codes(fmt: Float) -> list[float]:
    """The positive finite values of a Float, decoded from every code by the definition (not by
    Float's own decoder), ascending; exact, as integer significands times powers of two."""
    top = 2**fmt.exp - 1
    found = set()
    for e in range(top + 1):
        for m in range(2**fmt.man):
            if e == top and fmt.special == "ieee":
                continue  # Inf and NaN
            if e == top and fmt.special == "fn" and m == 2**fmt.man - 1:
                continue  # the NaN
            if e == 0:
                value = math.ldexp(m, 1 - fmt.bias - fmt.man) if fmt.subnormals else 0.0
            else:
                value = math.ldexp(2**fmt.man + m, e - fmt.bias - fmt.man)
            if value > 0:
                found.add(value)
    return sorted(found)


def _small_floats():
    for exp in range(1, 6):
        for man in range(0, 5):
            for special in SPECIALS:
                for subnormals in (True, False):
                    for bias in range(-3, 2**exp + 3):
                        try:
                            yield Float(exp, man, bias=bias, subnormals=subnormals, special=special)
                        except ValueError:  # exp 1 with "ieee", Float(1, 0, special="fn")
                            continue


def test_eps_and_the_range_facts_equal_an_enumeration_of_every_code_of_every_small_float():
    """eps is the distance from 1 to the next value where 1 is a value below max, normal or
    subnormal (Float(1, ...), biases that put 1 below the smallest normal); where 1 is not a
    value or is max, it is 2**-man. max, smallest_subnormal and binades agree with the codes."""
    checked = subnormal_one = no_next = 0
    for fmt in _small_floats():
        positive = _positive_values_by_codes(fmt)
        if fmt.bits <= 6:
            assert fmt.values().tolist() == [-v for v in positive[::-1]] + [0.0] + positive, fmt
        assert (fmt.max, fmt.smallest_subnormal) == (positive[-1], positive[0]), fmt
        above = [v for v in positive if v > 1]
        if 1 in positive and above:
            expected = above[0] - 1
            subnormal_one += fmt.smallest_normal > 1
        else:
            expected = 2.0**-fmt.man
            no_next += 1
        info = lpsim.finfo(fmt)
        assert fmt.eps == info.eps == expected, fmt
        assert info.resolution == 10.0 ** -math.floor(-math.log10(expected)), fmt
        assert info.binades == pytest.approx(math.log2(positive[-1] / positive[0]), abs=1e-12)
        checked += 1
    assert checked > 2000 and subnormal_one > 100 and no_next > 100


def test_has_nan_has_inf_and_has_negative_zero_follow_the_codes_of_every_small_float():
    """Each flag says whether some code decodes to it, by the definition of the special values:
    "ieee" NaNs have the top exponent and a nonzero fraction, so a format without fraction bits
    (Float(3, 0)) has Inf but no NaN; "fn" has the all-ones NaN; "fnuz" the negative-zero NaN."""
    for fmt in _small_floats():
        top, ones = 2**fmt.exp - 1, 2**fmt.man - 1
        codes = [(s, e, m) for s in (0, 1) for e in range(top + 1) for m in range(ones + 1)]
        nan = inf = negative_zero = False
        for s, e, m in codes:
            if fmt.special == "ieee" and e == top:
                nan, inf = nan or m != 0, inf or m == 0
            elif fmt.special == "fn" and e == top and m == ones:
                nan = True
            elif (s, e, m) == (1, 0, 0):
                nan, negative_zero = fmt.special == "fnuz" or nan, fmt.special != "fnuz"
        assert (fmt.has_nan, fmt.has_inf, fmt.has_negative_zero) == (nan, inf, negative_zero), fmt


def _gfloat_info(fmt: Float) -> FormatInfo:
    """gfloat's description of a Float with subnormals: its codes, special values and bias."""
    high_nans = {"ieee": 2**fmt.man - 1, "fn": 1, "fnuz": 0, "none": 0}[fmt.special]
    return FormatInfo(
        repr(fmt),
        fmt.bits,
        fmt.man + 1,
        bias=fmt.bias,
        is_signed=True,
        domain=Domain.Extended if fmt.special == "ieee" else Domain.Finite,
        has_nz=fmt.special != "fnuz",
        num_high_nans=high_nans,
        has_subnormals=True,
        is_twos_complement=False,
    )


GFLOAT_MODES = {
    "nearest": RoundMode.TiesToEven,
    "nearest_away": RoundMode.TiesToAway,
    "toward_zero": RoundMode.TowardZero,
    "up": RoundMode.TowardPositive,
    "down": RoundMode.TowardNegative,
    "stochastic": RoundMode.StochasticFastest,  # P(up) = floor(frac 2**k) / 2**k, as documented
}


@pytest.mark.parametrize(
    "fmt",
    [
        Float(4, 3, bias=11),
        Float(4, 3, bias=-3, special="fn", saturate=True),
        Float(3, 2, bias=9, special="fnuz"),
        Float(5, 2, bias=1, special="none"),
        Float(2, 0, bias=-5),
        Float(1, 4, special="none", saturate=True),  # every value subnormal but the top binade
        Float(3, 0, bias=6, special="fn"),
    ],
    ids=repr,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_floats_with_shifted_biases_and_specials_round_as_gfloat_rounds_them(fmt, dtype):
    """Bit for bit against gfloat's round_float, for every rule gfloat has (StochasticFastest with
    the element's top rbits bits of its Philox word as srbits), over every value, the points a
    quarter, a half and three quarters between neighbours, the overflow region, +/-0 and +/-Inf.
    saturate is gfloat's sat for finite inputs; an Inf input stays Inf where the format has Inf
    (gfloat's sat=True would clamp it). gfloat refuses an overflow without sat in a format with no
    NaN ("none"): lpsim's NaN. Without fraction bits the ties of nearest differ as documented
    (docs/rounding.md), and are left out."""
    info = _gfloat_info(fmt)
    positive = [v for v in fmt.values().tolist() if v > 0]
    steps = [b - a for a, b in zip(positive, positive[1:])] + [positive[-1] * 2.0**-fmt.man]
    xs = [0.0]
    for v, step in zip(positive, steps):
        xs += [v, v + step / 4, v + step / 2, v + 3 * step / 4]
    xs += [positive[0] / 4, positive[-1] * 4, math.inf]
    xs = [sign * v for v in xs for sign in (1.0, -1.0)]
    x = torch.tensor(xs, dtype=dtype)
    assert x.double().tolist() == xs
    for rule, mode in GFLOAT_MODES.items():
        if rule == "nearest" and fmt.man == 0:
            continue  # ties: IEEE 754's larger magnitude, gfloat's even exponent code (rounding.md)
        rbits = 5 if rule == "stochastic" else None
        got = lpsim.quantize(x, fmt, rule, seed=77, rbits=rbits).tolist()
        for i, (value, result) in enumerate(zip(xs, got)):
            sat = fmt.saturate and not (math.isinf(value) and fmt.has_inf)
            srbits = lpsim.reference.random_word(77, 0, i) >> 27
            try:
                want = round_float(info, value, mode, sat, srbits, 5)
            except ValueError:
                want = math.nan
            if math.isnan(want) or math.isnan(result):
                assert math.isnan(want) and math.isnan(result), (rule, value)
            else:
                assert (result, math.copysign(1, result)) == (want, math.copysign(1, want)), (
                    rule,
                    value,
                )


def test_block_float_min_is_the_negated_max_of_its_sign_magnitude_elements():
    for wl in (2, 4, 8):
        fmt = BlockFloat(wl)
        assert fmt.min == -fmt.max == float(fmt.values()[0])


@pytest.mark.parametrize(
    "fmt",
    [
        Float(5, 2),
        Fixed(8, 4),
        lpsim.P3109(8, 3),
        BlockFloat(8, block_size=4),
        lpsim.scaled.preset("mxfp8_e4m3"),
        lpsim.scaled.preset("nvfp4"),
    ],
    ids=repr,
)
def test_a_format_pickles_as_its_fields_and_rounds_the_same_unpickled(fmt):
    import io
    import pickle

    x = torch.randn(64) * 10
    want = lpsim.quantize(x, fmt)  # stores the grid and the op arguments on fmt
    data = pickle.dumps(fmt)
    assert b"GridSpec" not in data
    again = pickle.loads(data)
    assert again == fmt and again.__dict__.keys() <= fmt.__dict__.keys()
    assert torch.equal(lpsim.quantize(x, again), want)
    buffer = io.BytesIO()
    torch.save(fmt, buffer)
    buffer.seek(0)
    assert torch.load(buffer) == fmt  # weights_only, torch.load's default


def _float_model(x: torch.Tensor, fmt: Float, rule: str, words: torch.Tensor) -> torch.Tensor:
    """docs/formats.md and docs/rounding.md as plain float64 arithmetic, for float16 and bfloat16
    inputs (every step is exact in float64): the magnitude is rounded onto the spacing 2**q of its
    binade (2**emin below the smallest normal without subnormals), with the exponent unbounded
    above; then the overflow, Inf, NaN and zero-sign rules of the format."""
    v = x.double()
    a = v.abs()
    finite = torch.isfinite(a) & (a > 0)
    safe = torch.where(finite, a, torch.ones_like(a))
    e = torch.frexp(safe).exponent.double() - 1
    emin, man = fmt.emin, fmt.man
    if fmt.subnormals:
        q = torch.clamp(e, min=emin) - man
    else:
        q = torch.where(e < emin, torch.full_like(e, emin), e - man)
    r = torch.ldexp(safe, -q)
    lo = torch.floor(r)
    rem = r - lo
    odd = torch.remainder(lo, 2) == 1
    neg = torch.signbit(v)
    inexact = rem > 0
    frac32 = torch.floor(rem * 2.0**32)
    up = {
        "nearest": (rem > 0.5) | ((rem == 0.5) & odd),
        "nearest_away": rem >= 0.5,
        "nearest_zero": rem > 0.5,
        "toward_zero": torch.zeros_like(inexact),
        "away": inexact,
        "up": inexact & ~neg,
        "down": inexact & neg,
        "odd": inexact & ~odd,
        "stochastic": frac32 + words >= 2.0**32,
        "stochastic_equal": inexact & (words >= 2.0**31),
    }[rule]
    mag = torch.ldexp(lo + up.double(), q)
    top = float(fmt.max)
    toward_zero = {"toward_zero": True, "odd": True}.get(rule, False)
    keeps_max = fmt.saturate | toward_zero | ((rule == "down") & ~neg) | ((rule == "up") & neg)
    over = torch.full_like(mag, math.inf if fmt.has_inf else math.nan)
    mag = torch.where(mag > top, torch.where(keeps_max, torch.full_like(mag, top), over), mag)
    out = torch.where(neg, -mag, mag)
    zero = torch.zeros_like(v) if fmt.special == "fnuz" else torch.where(neg, -0.0, 0.0).double()
    out = torch.where(finite & (mag == 0), zero, out)
    out = torch.where(v == 0, zero if fmt.special == "fnuz" else v, out)
    if fmt.has_inf:
        inf = v
    elif fmt.saturate:
        inf = torch.where(neg, -top, top).double()
    else:
        inf = torch.full_like(v, math.nan)
    out = torch.where(torch.isinf(v), inf, out)
    return torch.where(torch.isnan(v), v, out)


@pytest.mark.parametrize(
    "fmt, dtype",
    [
        (Float(1, 0, special="none"), torch.float16),
        (Float(1, 3, special="fnuz"), torch.float16),
        (Float(2, 0, special="fn"), torch.float16),
        (Float(3, 2, bias=20), torch.float16),
        (Float(3, 2, bias=-8, special="fn", saturate=True), torch.float16),
        (Float(4, 3, bias=0, subnormals=False), torch.float16),
        (Float(4, 3, subnormals=False, special="fnuz"), torch.float16),
        (Float(4, 3, bias=-100, special="none"), torch.bfloat16),
        (Float(4, 3, bias=130), torch.bfloat16),
        (Float(8, 0, special="fnuz", subnormals=False), torch.bfloat16),
        (Float(1, 0, special="fnuz", bias=-120), torch.bfloat16),
    ],
    ids=repr,
)
def test_edge_floats_round_every_16_bit_pattern_as_the_documented_rules_say(fmt, dtype):
    """Every float16 or bfloat16 bit pattern, every rule (the ones gfloat lacks included: odd,
    nearest_zero, away, stochastic_equal, and subnormals=False), bit for bit against a float64
    model written from the docs; the stochastic words are the documented Philox words."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    words = torch.tensor(
        [lpsim.reference.random_word(5, 0, i) for i in range(x.numel())], dtype=torch.float64
    )
    for rule in lpsim.Rounding:
        got = lpsim.quantize(x, fmt, rule, seed=5)
        want = _float_model(x, fmt, rule.name, words).to(dtype)
        same = (got.isnan() & want.isnan()) | (got.view(torch.int16) == want.view(torch.int16))
        assert bool(same.all()), (rule.name, x[~same][:4].tolist(), got[~same][:4].tolist())


@pytest.mark.parametrize(
    "fmt",
    [
        Float(4, 3, special="fnuz"),
        Float(5, 2, special="fnuz"),
        lpsim.P3109(8, 4),
        lpsim.P3109(8, 3, domain="finite"),
        lpsim.P3109(8, 3, signed=False),
        lpsim.P3109(6, 2, signed=False, domain="finite"),
        Fixed(8, 4, signed=False),
        Fixed(8, 4, signed=False, clamp=False),
    ],
    ids=repr,
)
def test_formats_without_negative_zero_give_positive_zero_for_every_rule(fmt):
    # docs/rounding.md: the formats without a -0 (fnuz, every P3109 format, unsigned fixed point)
    # give +0 for -0 and for every negative value that rounds to zero.
    x = torch.tensor([-0.0, -1e-30, -0.0, -1e-30])
    for rule in lpsim.Rounding:
        kwargs = {"seed": 5} if rule.is_stochastic else {}
        y = lpsim.quantize(x, fmt, rule, **kwargs)
        zero = y == 0
        assert zero[0] and zero[2], rule
        assert not torch.signbit(y[zero]).any(), (rule, y.tolist())


def test_the_four_format_families_answer_finfos_questions_and_finfo_answers_for_scaled_ones():
    # docs/formats.md: Float, Fixed, BlockFloat and P3109 formats have bits, max, min,
    # smallest_normal, smallest_subnormal, eps and values(); for Scaled formats and PowerOfTwo
    # scales lpsim.finfo gives the facts.
    from lpsim.scaled import PowerOfTwo
    from lpsim.scaled import preset as scaled_preset

    facts = ("bits", "max", "min", "smallest_normal", "smallest_subnormal", "eps")
    for fmt in (Float(4, 3), Fixed(8, 4), BlockFloat(8), lpsim.P3109(8, 4)):
        for name in facts:
            assert getattr(fmt, name) == getattr(lpsim.finfo(fmt), name), (fmt, name)
        values = fmt.values()
        assert values.dtype == torch.float64
        assert values[-1].item() == fmt.max and values[0].item() == fmt.min
    for fmt in (scaled_preset("mxfp4_e2m1"), PowerOfTwo(8)):
        info = lpsim.finfo(fmt)
        assert all(isinstance(getattr(info, name), (int, float)) for name in facts)


@pytest.mark.parametrize(
    "fmt",
    [Float(5, 2, subnormals=False), Float(3, 0, subnormals=False), Float(8, 7, subnormals=False)],
    ids=repr,
)
def test_nearest_sends_half_the_smallest_normal_to_zero_without_subnormals(fmt):
    # docs/rounding.md: without subnormals, a tie between 0 and the smallest normal goes to 0
    # (keeping the sign of x) under nearest; just above the tie, to the smallest normal.
    normal = fmt.smallest_normal
    x = torch.tensor([normal / 2, -normal / 2, normal * 0.5000001, -normal * 0.5000001])
    y = lpsim.quantize(x, fmt, "nearest")
    assert y.tolist() == [0.0, 0.0, normal, -normal]
    assert torch.signbit(y).tolist() == [False, True, False, True]
