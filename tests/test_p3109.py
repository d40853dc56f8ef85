"""IEEE P3109 formats (lpsim.P3109) against gfloat, the P3109 working group's reference code: for
every 8-bit format (precision 1 to 7 signed, 1 to 8 unsigned, extended and finite domain), values()
are gfloat's decoded finite values and the facts are gfloat's; under each saturation mode,
lpsim.quantize equals gfloat's rounding bit for bit on every rounding decision (every value, every
midpoint, their float32 neighbours, the overflow region, the subnormals, +/-0, +/-Inf, NaN, and
negative inputs), for each rule gfloat has; the fusable path equals the kernel; the exact oracle
(lpsim.reference) agrees; stochastic rounding lands on a neighbour; the fields are validated.

gfloat 0.5.2 takes a saturation flag, not a mode: SatFinite is ``sat=True``, SatNone is
``sat=False``, and SatPropagate is ``sat=True`` for finite inputs with Inf inputs kept as
``sat=False`` keeps them where the format has Inf (and sent to the limits as ``sat=True`` where it
has none). gfloat does not project negative inputs into unsigned formats (it returns them
negative); for those the expected result is the report's Saturate rule, written out below, with
gfloat deciding whether the magnitude rounds to zero."""

import dataclasses
import functools
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from gfloat import decode_float, round_float, round_ndarray
from gfloat.formats import format_info_p3109
from gfloat.types import Domain, RoundMode, Signedness
from support import assert_same_bits, neighbourhood

import lpsim
from lpsim import P3109, Float, Rounding
from lpsim import reference as ref
from lpsim.formats import P3109_SATURATIONS, PRESETS, preset
from lpsim.fusable import FUSABLE_RULES, quantize_grid_torch

FORMATS = [fmt for fmt in PRESETS.values() if isinstance(fmt, P3109)]

# lpsim's rule -> gfloat's RoundMode, and the rule that rounds the magnitude of a negative value
# the same way (up and down swap).
GFLOAT_RULES = {
    Rounding.nearest: RoundMode.TiesToEven,
    Rounding.nearest_away: RoundMode.TiesToAway,
    Rounding.toward_zero: RoundMode.TowardZero,
    Rounding.up: RoundMode.TowardPositive,
    Rounding.down: RoundMode.TowardNegative,
}
MIRRORED = {Rounding.up: Rounding.down, Rounding.down: Rounding.up}

_NO_SEED = torch.zeros((), dtype=torch.int64)


def _info(fmt: P3109):
    return format_info_p3109(
        fmt.bits,
        fmt.precision,
        Signedness.Signed if fmt.signed else Signedness.Unsigned,
        Domain.Extended if fmt.has_inf else Domain.Finite,
    )


@functools.cache
def _inputs(fmt: P3109) -> torch.Tensor:
    """Every rounding decision of fmt in float32, both signs (for unsigned formats the negative
    side is out of range), well past max."""
    x = neighbourhood(fmt.values(), torch.float32, beyond=4 * fmt.max)
    return torch.unique(torch.cat([x, -x]))  # NaN stays (unique keeps one of each NaN)


@functools.cache
def _gfloat(fmt: P3109, rule: Rounding, sat: bool) -> np.ndarray:
    """gfloat's rounding of _inputs(fmt) (saturation ignored: fmt's fields but that one decide)."""
    x = _inputs(fmt).double().numpy()
    return round_ndarray(_info(fmt), x, GFLOAT_RULES[rule], sat)


def _expected(fmt: P3109, rule: Rounding) -> torch.Tensor:
    """What P3109 projection gives for _inputs(fmt), from gfloat and the report's Saturate."""
    x = _inputs(fmt).double().numpy()
    infinite = np.isinf(x)
    if fmt.saturation == "SatFinite":
        want = _gfloat(fmt, rule, True)
    elif fmt.saturation == "SatNone":
        want = _gfloat(fmt, rule, False)
    else:  # SatPropagate: finite results clamp; Inf stays where the format has it
        keep_inf = infinite & fmt.has_inf
        want = np.where(keep_inf, _gfloat(fmt, rule, False), _gfloat(fmt, rule, True))
    if not fmt.signed:
        negative = np.signbit(x) & ~np.isnan(x)
        want = np.where(negative, _unsigned_negative(fmt, rule, x), want)
    return torch.from_numpy(want).float()


def _unsigned_negative(fmt: P3109, rule: Rounding, x: np.ndarray) -> np.ndarray:
    """The report's projection of negative x into an unsigned format: 0 if x rounds to zero (at
    the format's precision and bias, gfloat on |x| with the mirrored rule); otherwise x lies below
    the range [0, max]: 0 under SatFinite and SatPropagate, and under SatNone 0 for the rules
    that round toward zero there (toward_zero, up) and NaN for the others. -Inf: 0, or NaN under
    SatNone."""
    magnitude = round_ndarray(_info(fmt), np.abs(x), GFLOAT_RULES[MIRRORED.get(rule, rule)], True)
    clamps = fmt.saturation != "SatNone" or rule in (Rounding.toward_zero, Rounding.up)
    below = np.where(np.isinf(x), fmt.saturation != "SatNone", clamps)
    out = np.where(below, 0.0, np.nan)
    return np.where(np.isfinite(x) & (magnitude == 0), 0.0, out)


def _with(fmt: P3109, saturation: str) -> P3109:
    return dataclasses.replace(fmt, saturation=saturation)


CASES = [(fmt, s) for fmt in FORMATS for s in P3109_SATURATIONS]
IDS = [f"{fmt.name}-{s}" for fmt, s in CASES]


def test_the_presets_are_the_whole_8_bit_family():
    names = {fmt.name for fmt in FORMATS}
    assert len(FORMATS) == 30 and len(names) == 30
    assert all(preset(name).name == name for name in names)
    assert {(f.precision, f.signed) for f in FORMATS} == {
        (p, s) for s in (True, False) for p in range(1, 8 if s else 9)
    }


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_values_are_gfloats_decoded_finite_values(fmt):
    info = _info(fmt)
    decoded = {decode_float(info, code).fval for code in range(2**fmt.bits)}
    finite = sorted({v for v in decoded if math.isfinite(v)} - {-0.0} | {0.0})
    assert fmt.values().tolist() == finite


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_facts_are_gfloats(fmt):
    info = _info(fmt)
    assert fmt.bits == info.bits == 8
    assert fmt.bias == info.bias
    assert fmt.max == info.max
    assert fmt.min == info.min
    assert fmt.emax == info.emax
    assert fmt.smallest_normal == info.smallest_normal
    assert fmt.smallest_subnormal == info.smallest_subnormal
    assert fmt.eps == info.eps
    assert fmt.has_inf == (info.num_posinfs == 1)
    assert fmt.values()[-1].item() == fmt.max


@pytest.mark.parametrize("fmt,saturation", CASES, ids=IDS)
def test_quantize_equals_gfloat_on_every_decision(fmt, saturation):
    fmt = _with(fmt, saturation)
    x = _inputs(fmt)
    for rule in GFLOAT_RULES:
        got = lpsim.quantize(x, fmt, rule)
        assert_same_bits(got, _expected(fmt, rule), f"{fmt!r} {rule.name}")


@pytest.mark.parametrize("fmt,saturation", CASES, ids=IDS)
def test_the_fusable_path_equals_the_kernel(fmt, saturation):
    fmt = _with(fmt, saturation)
    x = _inputs(fmt)
    for rule in FUSABLE_RULES:
        want = torch.ops.lpsim.quantize_grid(x, *fmt.grid(), int(rule), 32, _NO_SEED, 0)
        assert_same_bits(quantize_grid_torch(x, fmt.grid(), rule), want, f"{fmt!r} {rule.name}")


@pytest.mark.parametrize(
    "name", ["binary8p1se", "binary8p1ue", "binary8p3uf", "binary8p4se", "binary8p8ue"]
)
def test_gfloats_scalar_and_array_rounding_agree_on_the_sweep(name):
    # The sweep above uses gfloat's round_ndarray; here its scalar round_float gives the same.
    fmt = preset(name)
    x = _inputs(fmt).double().numpy()
    if not fmt.signed:
        x = x[~np.signbit(x) | np.isnan(x)]  # gfloat does not project these (see above)
    for mode in GFLOAT_RULES.values():
        for sat in (False, True):
            scalar = np.array([round_float(_info(fmt), float(v), mode, sat) for v in x])
            np.testing.assert_array_equal(scalar, round_ndarray(_info(fmt), x, mode, sat))


@pytest.mark.parametrize(
    "name", ["binary8p1se", "binary8p1uf", "binary8p2ue", "binary8p4sf", "binary8p7se"]
)
@pytest.mark.parametrize("saturation", P3109_SATURATIONS)
def test_every_rule_equals_the_exact_oracle(name, saturation):
    fmt = _with(preset(name), saturation)
    x = _inputs(fmt)
    for rule in Rounding:
        got = lpsim.quantize(x, fmt, rule, seed=3109)
        want = ref.quantize(x, fmt, rule, seed=3109)
        assert_same_bits(got, want, f"{fmt!r} {rule.name}")


@pytest.mark.parametrize("precision", range(1, 8))
def test_signed_finite_formats_are_float_fnuz_but_for_precision_1_ties(precision):
    # binary8p{P}sf encodes as Float(8 - P, P - 1, special="fnuz"): bias 2**(7 - P), the NaN at
    # the negative-zero code, no Inf. Under SatNone they round alike by every rule, except that at
    # precision 1 a tie (and round to odd) goes by the exponent code's parity in P3109 and to the
    # larger magnitude in Float (IEEE 754).
    fmt = P3109(8, precision, domain="finite")
    fnuz = Float(8 - precision, precision - 1, special="fnuz")
    assert fmt.values().tolist() == fnuz.values().tolist()
    x = _inputs(fmt)
    for rule in Rounding:
        got = lpsim.quantize(x, fmt, rule, seed=7)
        want = lpsim.quantize(x, fnuz, rule, seed=7)
        if precision > 1 or rule not in (Rounding.nearest, Rounding.odd):
            assert_same_bits(got, want, f"{rule.name}")
    if precision == 1:
        ties = torch.tensor([1.5, 3.0, 6.0, 12.0, -3.0])  # codes of 1, 2, 4, 8: 64, 65, 66, 67
        assert lpsim.quantize(ties, fmt).tolist() == [1.0, 4.0, 4.0, 16.0, -4.0]
        assert lpsim.quantize(ties, fnuz).tolist() == [2.0, 4.0, 8.0, 16.0, -4.0]
        assert lpsim.quantize(ties, fmt, "odd").tolist() == [2.0, 2.0, 8.0, 8.0, -2.0]
        assert lpsim.quantize(ties, fnuz, "odd").tolist() == [1.0, 2.0, 4.0, 8.0, -2.0]


@pytest.mark.parametrize(
    "name,torch_dtype,numpy_dtype",
    [
        ("binary8p4sf", torch.float8_e4m3fnuz, ml_dtypes.float8_e4m3fnuz),
        ("binary8p3sf", torch.float8_e5m2fnuz, ml_dtypes.float8_e5m2fnuz),
    ],
)
def test_signed_finite_8_bit_formats_match_the_fnuz_casts(name, torch_dtype, numpy_dtype):
    # With the default SatNone, overflow and Inf become NaN, as in torch's and ml_dtypes' casts.
    fmt = preset(name)
    x = _inputs(fmt)
    got = lpsim.quantize(x, fmt, "nearest")
    assert_same_bits(got, x.to(torch_dtype).float(), f"{name} torch")
    numpy_cast = torch.from_numpy(x.numpy().astype(numpy_dtype).astype(np.float32))
    assert_same_bits(got, numpy_cast, f"{name} ml_dtypes")


@pytest.mark.parametrize("name", ["binary8p1se", "binary8p3se", "binary8p5ue", "binary8p2uf"])
def test_stochastic_rounding_lands_on_a_neighbouring_value(name):
    fmt = preset(name)
    v = fmt.values()
    generator = torch.Generator().manual_seed(16)
    x = v[0] + (v[-1] - v[0]) * torch.rand(4096, generator=generator, dtype=torch.float64)
    x = x.float()
    y = lpsim.quantize(x, fmt, "stochastic", seed=5).double()
    xd = x.double()
    above = torch.searchsorted(v, xd, side="left")
    below = torch.searchsorted(v, xd, side="right") - 1
    assert bool(((y == v[above]) | (y == v[below])).all())
    assert bool((y != v[above]).any() and (y != v[below]).any())  # both neighbours occur


STOCHASTIC_CASES = [
    (name, saturation)
    for name in ["binary8p1se", "binary8p3sf", "binary8p4se", "binary8p5ue", "binary8p8uf"]
    for saturation in ("SatFinite", "SatNone")
]


@pytest.mark.parametrize("rbits", [32, 3, 1])
@pytest.mark.parametrize(
    "name, saturation", STOCHASTIC_CASES, ids=[f"{n}-{s}" for n, s in STOCHASTIC_CASES]
)
def test_stochastic_rounding_is_gfloats_stochastic_a_with_the_words_top_bits(
    name, saturation, rbits
):
    """``stochastic`` with rbits = k is P3109's StochasticA (gfloat's StochasticFastest) whose k
    random bits are the top k bits of the element's Philox word, bit for bit: inside the range,
    between max and the next value of the unbounded precision (where SatFinite clamps and SatNone
    gives Inf, or NaN in a finite format), among the subnormals and for negative values."""
    fmt = _with(preset(name), saturation)
    generator = torch.Generator().manual_seed(rbits)
    v = fmt.values()
    positive = v[v > 0]
    x = torch.cat(
        [
            positive * (1 + 0.3 * torch.rand(len(positive), generator=generator)),
            fmt.max * (1 + 0.1 * torch.rand(64, generator=generator)),
            fmt.smallest_subnormal * torch.rand(64, generator=generator),
        ]
    ).float()
    if fmt.signed:
        x = torch.cat([x, -x])
    got = lpsim.quantize(x, fmt, "stochastic", rbits=rbits, seed=11, offset=2)
    info = _info(fmt)
    want = [
        round_float(
            info,
            value,
            RoundMode.StochasticFastest,
            saturation == "SatFinite",
            ref.random_word(11, 2, i) >> (32 - rbits),
            rbits,
        )
        for i, value in enumerate(x.double().tolist())
    ]
    assert_same_bits(got, torch.tensor(want, dtype=torch.float32))


def test_negative_values_in_an_unsigned_format_follow_the_saturation_mode():
    x = torch.tensor([-3.0, -1e-30, -0.0, -math.inf, 2.0, math.inf])
    unsigned = P3109(8, 3, signed=False)
    got = {s: lpsim.quantize(x, _with(unsigned, s), "nearest").tolist() for s in P3109_SATURATIONS}
    assert got["SatFinite"] == [0.0, 0.0, 0.0, 0.0, 2.0, unsigned.max]
    assert got["SatPropagate"] == [0.0, 0.0, 0.0, 0.0, 2.0, math.inf]
    assert [math.isnan(v) for v in got["SatNone"]] == [True, False, False, True, False, False]
    assert got["SatNone"][-1] == math.inf
    toward_zero = lpsim.quantize(x[:1], _with(unsigned, "SatNone"), "toward_zero")
    assert toward_zero.item() == 0.0 and not math.copysign(1.0, toward_zero.item()) < 0


def test_saturation_modes_on_overflow_and_infinities():
    signed = P3109(8, 4)  # binary8p4se: max 224
    x = torch.tensor([300.0, -300.0, math.inf, -math.inf])
    modes = {
        "SatFinite": [224.0, -224.0, 224.0, -224.0],
        "SatPropagate": [224.0, -224.0, math.inf, -math.inf],
        "SatNone": [math.inf, -math.inf, math.inf, -math.inf],
    }
    for saturation, want in modes.items():
        assert lpsim.quantize(x, _with(signed, saturation)).tolist() == want, saturation
    finite = P3109(8, 4, domain="finite", saturation="SatPropagate")  # max 240, no Inf
    assert lpsim.quantize(x, finite).tolist() == [240.0, -240.0, 240.0, -240.0]
    none = lpsim.quantize(x, _with(finite, "SatNone"))
    assert bool(torch.isnan(none).all())
    toward_zero = lpsim.quantize(x[:2], _with(finite, "SatNone"), "toward_zero")
    assert toward_zero.tolist() == [240.0, -240.0]


def test_formats_of_other_widths_match_gfloat():
    for bits, precision, signed in [(3, 1, True), (4, 2, False), (6, 3, True), (10, 5, True)]:
        for domain in ("extended", "finite"):
            fmt = P3109(bits, precision, signed=signed, domain=domain, saturation="SatFinite")
            x = _inputs(fmt)
            if not signed:
                x = x[~torch.signbit(x)]
            info = format_info_p3109(
                bits,
                precision,
                Signedness.Signed if signed else Signedness.Unsigned,
                Domain.Extended if domain == "extended" else Domain.Finite,
            )
            want = round_ndarray(info, x.double().numpy(), RoundMode.TiesToEven, True)
            got = lpsim.quantize(x, fmt, "nearest")
            assert_same_bits(got, torch.from_numpy(want).float(), repr(fmt))


def test_repr_name_and_equality():
    assert repr(P3109(8, 4)) == "P3109(bits=8, precision=4)"
    fmt = P3109(8, 3, signed=False, domain="finite", saturation="SatFinite")
    assert repr(fmt) == (
        "P3109(bits=8, precision=3, signed=False, domain='finite', saturation='SatFinite')"
    )
    assert fmt.name == "binary8p3uf" and P3109(8, 4).name == "binary8p4se"
    assert preset("binary8p4se") == P3109(8, 4)
    assert len({P3109(8, 4), P3109(8, 4, saturation="SatNone"), fmt}) == 2


@pytest.mark.parametrize(
    "make,error,pattern",
    [
        (lambda: P3109(8.0, 4), TypeError, r"P3109\.bits must be an int"),
        (lambda: P3109(2, 1), ValueError, r"P3109\.bits must be in \[3, 16\]"),
        (lambda: P3109(17, 4), ValueError, r"P3109\.bits must be in \[3, 16\]"),
        (lambda: P3109(8, True), TypeError, r"P3109\.precision must be an int"),
        (
            lambda: P3109(8, 8),
            ValueError,
            r"P3109\.precision must be in \[1, 7\] for a signed 8-bit format, got 8",
        ),
        (
            lambda: P3109(8, 9, signed=False),
            ValueError,
            r"P3109\.precision must be in \[1, 8\] for an unsigned 8-bit format",
        ),
        (lambda: P3109(8, 0), ValueError, r"P3109\.precision must be in \[1, 7\]"),
        (lambda: P3109(8, 4, signed=1), TypeError, r"P3109\.signed must be a bool"),
        (lambda: P3109(8, 4, domain="Extended"), ValueError, r"P3109\.domain must be one of"),
        (lambda: P3109(8, 4, saturation="sat"), ValueError, r"P3109\.saturation must be one of"),
        (lambda: P3109(8, 4, saturation="OvfInf"), ValueError, r"OvfInf is SatNone"),
        (
            lambda: P3109(16, 1),
            ValueError,
            r"P3109\.precision must be in \[5, 15\] for a signed 16-bit format.*float64",
        ),
        (
            lambda: P3109(13, 1),
            ValueError,
            r"P3109\.precision must be in \[2, 12\] for a signed 13-bit format",
        ),
        (
            lambda: P3109(12, 1, signed=False),
            ValueError,
            r"P3109\.precision must be in \[2, 12\] for an unsigned 12-bit format",
        ),
    ],
)
def test_bad_fields_raise_naming_the_field(make, error, pattern):
    with pytest.raises(error, match=pattern):
        make()


def test_every_precision_in_the_documented_range_makes_a_format():
    # docs/formats.md: precision 1 to bits - 1 (signed) or bits (unsigned), and from 13 bits
    # (12 unsigned) on at least bits - 11 (bits - 10), so that the values fit a float64 (an
    # exponent field of bits - precision bits, one more unsigned, at most 11 wide).
    for bits in range(3, 17):
        for signed, low, top in (
            (True, max(1, bits - 11), bits - 1),
            (False, max(1, bits - 10), bits),
        ):
            for precision in range(low, top + 1):
                fmt = P3109(bits, precision, signed=signed)
                assert math.isfinite(fmt.max) and fmt.smallest_subnormal > 0
            if low > 1:
                with pytest.raises(ValueError, match=rf"must be in \[{low}, {top}\]"):
                    P3109(bits, low - 1, signed=signed)


def test_containers_that_do_not_hold_the_format_are_refused():
    with pytest.raises(ValueError, match=r"does not fit a float16 tensor"):
        lpsim.quantize(torch.zeros(2, dtype=torch.float16), P3109(8, 1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_every_container_that_holds_the_format_gives_the_same_values(dtype):
    checked = 0
    for fmt in FORMATS:
        for saturation in P3109_SATURATIONS:
            fmt = _with(fmt, saturation)
            try:
                lpsim.formats.check_fits(fmt, dtype)
            except ValueError:
                continue
            x = _inputs(fmt).to(dtype)
            for rule in GFLOAT_RULES:
                want = lpsim.quantize(x.float(), fmt, rule).to(dtype)
                assert_same_bits(lpsim.quantize(x, fmt, rule), want, f"{fmt!r} {rule.name}")
            checked += 1
    assert checked >= 60


CLIPPING = [(fmt, s) for fmt in FORMATS if fmt.precision > 1 for s in ("SatFinite", "SatPropagate")]


@pytest.mark.parametrize("rule", list(GFLOAT_RULES))
@pytest.mark.parametrize(
    "fmt, saturation", CLIPPING, ids=[f"{fmt.name}-{s}" for fmt, s in CLIPPING]
)
def test_clamp_grad_zero_masks_where_gfloats_unclipped_rounding_leaves_the_range(
    fmt, saturation, rule
):
    """A saturating P3109 format clips: quantizer(clamp_grad_zero=True) gives P3109's values
    (gfloat), and zeroes the gradient exactly where the rounding at the format's precision with
    one more exponent bit (gfloat, the same bias) lies outside [min, max], except for the Inf
    inputs that SatPropagate keeps."""
    fmt = _with(fmt, saturation)
    x = _inputs(fmt).clone().requires_grad_()
    y = lpsim.nn.quantizer(forward=(fmt, rule), clamp_grad_zero=True)(x)
    assert_same_bits(y.detach(), _expected(fmt, rule))
    y.backward(torch.ones_like(y))
    info = _info(fmt)
    wider = dataclasses.replace(
        info, k=info.k + (1 if fmt.signed else 2), is_signed=True, domain=Domain.Extended
    )
    values = x.detach().double().numpy()
    unclipped = round_ndarray(wider, values, GFLOAT_RULES[rule], False)
    with np.errstate(invalid="ignore"):
        outside = (unclipped > fmt.max) | (unclipped < fmt.min)
    kept = np.isinf(values) & (saturation == "SatPropagate") & fmt.has_inf
    kept &= (values > 0) | fmt.signed
    want = torch.from_numpy(np.where(outside & ~kept, 0.0, 1.0)).float()
    assert_same_bits(x.grad, want)


@pytest.mark.parametrize(
    "fmt, message",
    [
        (P3109(8, 3, saturation="SatNone"), "clips"),
        (P3109(8, 1, saturation="SatFinite"), "precision 1"),
    ],
    ids=["SatNone", "precision-1"],
)
def test_clamp_grad_zero_refuses_p3109_formats_it_cannot_mask_saying_why(fmt, message):
    with pytest.raises(ValueError, match=message):
        lpsim.nn.quantizer(forward=fmt, clamp_grad_zero=True)


def test_unsigned_satnone_sends_negative_values_to_zero_only_for_the_rules_toward_zero():
    # -1 lies below lo = 0 of an unsigned format: toward_zero, odd (which keeps the neighbour
    # nearer zero on overflow) and up round it toward zero, to 0; the other rules give NaN.
    fmt = P3109(8, 3, signed=False)
    x = torch.tensor([-1.0])
    for rule in ("toward_zero", "odd", "up"):
        assert lpsim.quantize(x, fmt, rule).tolist() == [0.0], rule
    for rule in ("nearest", "nearest_away", "away", "down"):
        assert lpsim.quantize(x, fmt, rule).isnan().all(), rule


@pytest.mark.parametrize("precision", range(1, 8))
def test_signed_finite_formats_round_as_float_fnuz_except_ties_and_odd_at_precision_1(precision):
    # docs/formats.md: Binary8pPsf has the values of Float(8 - P, P - 1, special="fnuz") and from
    # precision 2 on rounds as it does under every rule; at precision 1 nearest's ties and odd read
    # the parity of the exponent code, so only those two rules differ there.
    fmt = P3109(8, precision, domain="finite")
    fnuz = Float(8 - precision, precision - 1, special="fnuz")
    assert torch.equal(fmt.values(), fnuz.values())
    x = _inputs(fmt)
    for rule in Rounding:
        kwargs = {"seed": 3} if rule.is_stochastic else {}
        got = lpsim.quantize(x, fmt, rule, **kwargs)
        if precision == 1 and rule in (Rounding.nearest, Rounding.odd):
            continue
        assert_same_bits(got, lpsim.quantize(x, fnuz, rule, **kwargs), rule.name)


def test_odd_at_precision_1_takes_the_neighbour_with_the_odd_exponent_code():
    # A plain model of the code parity: between 2**e and 2**(e + 1) (both in range), the value
    # whose exponent code e + bias is odd; exact powers of two stay.
    fmt = P3109(8, 1, domain="finite")
    xs, want = [], []
    for e in range(-60, 62):
        for x in (2.0**e, 1.25 * 2.0**e, 1.5 * 2.0**e, 1.75 * 2.0**e):
            xs += [x, -x]
            odd = 2.0**e if (e + fmt.bias) % 2 else 2.0 ** (e + 1)
            value = x if x == 2.0**e else odd
            want += [value, -value]
    got = lpsim.quantize(torch.tensor(xs, dtype=torch.float64), fmt, "odd")
    assert got.tolist() == want
    assert lpsim.quantize(torch.tensor([5.0, 3.0]), fmt, "odd").tolist() == [8.0, 2.0]
