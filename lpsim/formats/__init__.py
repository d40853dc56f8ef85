"""Number formats: Float, Fixed, BlockFloat and P3109, and the named presets.

A format is a frozen dataclass that describes a set of numbers. Values are simulated in an ordinary
floating-point tensor (the *container*: float32, float64, bfloat16 or float16), so every number of
the format must be representable in the container; a format that does not fit raises ValueError
when it is used. Each format answers the questions ``numpy.finfo`` answers, under the same names:
``max``, ``smallest_normal``, ``smallest_subnormal``, ``eps`` and ``bits``, and lists its finite
values with ``values()`` when it has at most 16 bits.

See docs/formats.md for every field and for which preset reproduces which library's cast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import NamedTuple

import torch

__all__ = [
    "Float",
    "Fixed",
    "BlockFloat",
    "P3109",
    "Format",
    "GRID_FORMATS",
    "PRESETS",
    "preset",
    "SPECIALS",
    "P3109_DOMAINS",
    "P3109_SATURATIONS",
]

SPECIALS = ("ieee", "fn", "fnuz", "none")
MAX_VALUES_BITS = 16  # values() lists formats of at most this many bits


class Container(NamedTuple):
    """An IEEE binary format that holds simulated values."""

    name: str
    exp: int
    man: int

    @property
    def bias(self) -> int:
        return 2 ** (self.exp - 1) - 1

    @property
    def emax(self) -> int:
        return 2**self.exp - 2 - self.bias

    @property
    def emin(self) -> int:
        return 1 - self.bias

    @property
    def qmin(self) -> int:
        """Exponent of the smallest subnormal."""
        return self.emin - self.man


CONTAINERS = {
    torch.float32: Container("float32", 8, 23),
    torch.float64: Container("float64", 11, 52),
    torch.bfloat16: Container("bfloat16", 8, 7),
    torch.float16: Container("float16", 5, 10),
}
_WIDEST = CONTAINERS[torch.float64]


def container_of(dtype: torch.dtype) -> Container:
    """The container description of a tensor dtype.

    Raises:
        TypeError: the dtype is not float32, float64, bfloat16 or float16.
    """
    try:
        return CONTAINERS[dtype]
    except (KeyError, TypeError):
        raise TypeError(
            f"x must be a float32, float64, bfloat16 or float16 tensor, got {dtype}"
        ) from None


class GridSpec(NamedTuple):
    """The grid a Float, Fixed or P3109 format rounds onto, as the compiled ``quantize_grid`` op
    takes it: spacing 2**max(E - keep, qmin) in the binade [2**E, 2**(E+1)), with overflow limits.
    The fields are those of LPSIM_GRID_FIELDS in csrc/include/lpsim/grid_spec.h, in its order."""

    keep: int  # fraction bits kept in the normal range; -1: the container's precision
    qmin: int  # exponent of the finest spacing
    emin: int  # exponent of the smallest normal (used without subnormals)
    subnormals: bool
    pos_limit: float  # largest positive value (inf: none)
    neg_limit: float  # largest magnitude of a negative value (0: no negative values)
    saturate: bool  # overflow clamps to the limit
    has_inf: bool  # +Inf, and -Inf if neg_limit > 0: Inf stays, unclamped overflow gives it
    unsigned_zero: bool  # no -0
    code_parity: bool  # precision-1 ties: to the even exponent code (P3109), not the larger value


# Grids and op arguments of every format seen, shared by equal formats: a format written inline,
# quantize(x, Float(5, 2)), finds the grid its first equal built. Formats are frozen and few.
_GRIDS: dict = {}
_GRID_ARGUMENTS: dict = {}


def stored_grid(fmt) -> GridSpec:
    """fmt._build_grid(), built once per distinct format and stored on fmt. Formats are frozen, so
    the grid never changes; building it costs ~30 us (max goes through Fractions), reading it back
    ~0.2 us (benchmarks/bench_overhead.py). Not functools.cached_property: its lock stops
    torch.compile. While torch.compile traces, nothing is stored (dynamo cannot replay a store
    into a format): the grid is read from the stores or built."""
    grid = fmt.__dict__.get("_grid")
    if grid is None:
        grid = _GRIDS.get(fmt)
        if grid is None:
            grid = fmt._build_grid()
        if not torch.compiler.is_compiling():
            _GRIDS.setdefault(fmt, grid)
            object.__setattr__(fmt, "_grid", grid)  # frozen: set once, never changed
            # The first equal format made: what torch.compile's trace-time constants are keyed by
            # (dynamo guards on its identity, so equal formats share a compiled graph).
            object.__setattr__(fmt, "_first", _FIRST.setdefault(fmt, fmt))
    return grid


_FIRST: dict = {}


def first_equal(fmt):
    """The first format made equal to fmt (fmt itself if none was), for a format whose grid is
    stored; None for one made while torch.compile traces."""
    return fmt.__dict__.get("_first")


def _stored_grid_arguments(fmt, dtype: torch.dtype) -> tuple:
    """tuple(fmt.grid()) once check_fits(fmt, dtype) has passed, stored on fmt per dtype (a
    format that does not fit raises on every call). Saves check_fits' ~3 us per quantize call;
    a plain attribute rather than functools.lru_cache, which torch.compile warns about. Stores
    nothing while torch.compile traces, as stored_grid."""
    stored = fmt.__dict__.get("_grid_arguments")
    if stored is None:
        stored = _GRID_ARGUMENTS.get(fmt, {})
    arguments = stored.get(dtype)
    if arguments is None:
        check_fits(fmt, dtype)
        arguments = tuple(stored_grid(fmt))
        if not torch.compiler.is_compiling():
            stored = _GRID_ARGUMENTS.setdefault(fmt, stored)
            stored[dtype] = arguments
    if not torch.compiler.is_compiling() and "_grid_arguments" not in fmt.__dict__:
        object.__setattr__(fmt, "_grid_arguments", stored)  # frozen: a cache, not a field
    return arguments


@torch.compiler.assume_constant_result
def _constant_grid_arguments(fmt, dtype: torch.dtype) -> tuple:
    """_stored_grid_arguments(fmt, dtype), which dynamo computes at trace time (guarding on fmt's
    identity: fmt is first_equal's, shared by equal formats) and holds as a constant."""
    return _stored_grid_arguments(fmt, dtype)


def check_int_field(owner: str, name: str, value, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{owner}.{name} must be in [{low}, {high}], got {value}")


def check_bool_field(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be a bool, got {type(value).__name__}")


def _exponent_of(value: Fraction) -> int:
    """floor(log2(value)) for value > 0, exactly."""
    e = value.numerator.bit_length() - value.denominator.bit_length()
    return e if Fraction(2) ** e <= value else e - 1


def short_repr(obj) -> str:
    """Class(field=value, ...) listing the positional fields and the keywords that differ from
    their defaults."""
    parts = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.kw_only and value == _default_of(obj, f):
            continue
        parts.append(f"{f.name}={value!r}")
    return f"{type(obj).__name__}({', '.join(parts)})"


def field_state(obj) -> dict:
    """A format's state for pickle (torch.save, copy): its fields. The caches stored on it (its
    grid, its ops' arguments) are left out and rebuilt on use, so that a checkpoint holds the
    fields only, which torch.load's default weights_only unpickler builds a format from (lpsim
    registers its formats as safe globals)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _default_of(obj, f):
    if f.name == "bias":
        return obj.default_bias
    return f.default


class _OnGrid:
    """What Float, Fixed and P3109 share: a grid (GridSpec) the compiled ops round onto, built by
    the format's _build_grid() once per distinct format."""

    def _finish(self) -> None:
        """The end of a format's validation: it must fit float64 (its _misfit), and its grid is
        stored now, outside torch.compile's traces (lpsim.fusable.format_constants).

        Raises:
            ValueError: the format does not fit even a float64 container.
        """
        problem = self._misfit(_WIDEST)
        if problem:
            raise ValueError(f"{self!r} does not fit even a float64 container: {problem}")
        stored_grid(self)

    def __setstate__(self, state: dict) -> None:
        """A format made by unpickling (copy.deepcopy of a model, torch.load): its fields, and
        its grid stored as _finish stores it, so that under torch.compile a copy's constants are
        computed at trace time as the original's are (lpsim.fusable.format_constants); a copy
        that stored nothing until its first eager use would have dynamo make its limits symbolic
        inside the error quantiser's autograd.Function, which fails under dynamic=True."""
        self.__dict__.update(state)
        stored_grid(self)

    def grid(self) -> GridSpec:
        """The grid the compiled ops round onto (computed once per distinct format)."""
        return stored_grid(self)

    def grid_arguments(self, dtype: torch.dtype) -> tuple:
        """grid() as the ops' argument tuple for a tensor of ``dtype``.

        While torch.compile traces, the arguments of a format whose grid is stored (every format
        made outside the trace) are computed at trace time and enter the graph as constants (see
        lpsim.fusable.format_constants): read through the format's attributes under
        torch.compile(dynamic=True), their floats were symbolic, which dynamo could not pass into
        the ops called inside an autograd.Function (a stochastic quantiser of lpsim.nn in a model
        compiled before any eager call raised an internal dynamo error).

        Raises:
            ValueError: the format does not fit ``dtype`` (see check_fits).
        """
        first = first_equal(self) if torch.compiler.is_compiling() else None
        if first is not None:
            check_fits(self, dtype)
            return _constant_grid_arguments(first, dtype)
        return _stored_grid_arguments(self, dtype)

    def stored_grid_arguments(self, dtype: torch.dtype) -> tuple | None:
        """grid_arguments(dtype) if it was computed before for this format, else None: a
        dictionary look-up, for lpsim.functional's fast path."""
        stored = self.__dict__.get("_grid_arguments")
        return None if stored is None else stored.get(dtype)


def _floating_misfit(trailing: int, what: str, emax: int, emin: int, c: Container) -> str | None:
    """Why a floating-point format with ``trailing`` significand bits after the leading one (named
    ``what`` in the message) and exponents emin..emax does not fit container c, or None."""
    if trailing > c.man:
        return f"it has {trailing} {what}, the container {c.man}"
    if emax > c.emax:
        return f"its largest exponent is {emax}, the container's {c.emax}"
    if emin - trailing < c.qmin:
        return (
            f"its finest spacing is 2**{emin - trailing}, the container's smallest subnormal "
            f"2**{c.qmin}"
        )
    return None


@dataclass(frozen=True, repr=False)
class Float(_OnGrid):
    """A binary floating-point format with ``exp`` exponent bits and ``man`` fraction bits.

    Values are (-1)**s * 2**(e - bias) * (1 + m / 2**man) for exponent codes e >= 1, and
    (-1)**s * 2**(1 - bias) * (m / 2**man) for e = 0 (subnormals).

    Args:
        exp: exponent bits, 1 to 11 (2 to 11 for ``special="ieee"``). The format must fit
            float64: with the default bias, 11 takes ``"ieee"`` with any man, ``"fnuz"`` with man
            up to 51 and ``"fn"`` only with man 0, ``"none"`` never (its values reach 2**1024).
        man: stored fraction bits, 0 to 52. Precision is man + 1 bits.
        bias: exponent bias; default 2**(exp-1) - 1, or 2**(exp-1) for ``special="fnuz"``.
        subnormals: whether exponent code 0 holds subnormals. Without them it holds only zero,
            and values below the smallest normal round to 0 or to the smallest normal.
        special: which codes are not finite.
            ``"ieee"``: the top exponent code holds +/-Inf and NaN (IEEE 754).
            ``"fn"``: no Inf; only the all-ones code (top exponent, all-ones fraction) is NaN
            (OCP E4M3).
            ``"fnuz"``: no Inf and no -0; the negative-zero code is NaN; bias one larger.
            ``"none"``: every code is finite; no Inf, no NaN (QPyTorch's convention, OCP FP6/FP4).
        saturate: overflow clamps to +/-max. Otherwise overflow goes to +/-Inf, or NaN where the
            format has no Inf; rules that round toward zero (toward_zero, odd, and up/down on the
            side where they do) give +/-max, as in IEEE 754. With saturate, +/-Inf inputs also
            become +/-max in formats without Inf.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field is out of range, or the format has no positive finite value or fits
            no container (not even float64).
    """

    exp: int
    man: int
    bias: int | None = field(default=None, kw_only=True)
    subnormals: bool = field(default=True, kw_only=True)
    special: str = field(default="ieee", kw_only=True)
    saturate: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        check_int_field("Float", "exp", self.exp, 1, 11)
        check_int_field("Float", "man", self.man, 0, 52)
        check_bool_field("Float", "subnormals", self.subnormals)
        check_bool_field("Float", "saturate", self.saturate)
        if self.special not in SPECIALS:
            raise ValueError(f"Float.special must be one of {SPECIALS}, got {self.special!r}")
        if self.special == "ieee" and self.exp < 2:
            raise ValueError(
                "Float.exp must be >= 2 with special='ieee' (the top exponent code holds Inf "
                f"and NaN), got {self.exp}"
            )
        if self.bias is None:
            object.__setattr__(self, "bias", self.default_bias)
        check_int_field("Float", "bias", self.bias, -4096, 4096)
        if self.special == "fn" and self.exp == 1 and self.man == 0:
            raise ValueError("Float(exp=1, man=0, special='fn') has no finite non-zero value")
        self._finish()

    @property
    def default_bias(self) -> int:
        """The bias used when none is given: 2**(exp-1) - 1, or 2**(exp-1) for fnuz."""
        return 2 ** (self.exp - 1) - (0 if self.special == "fnuz" else 1)

    __repr__ = short_repr
    __getstate__ = field_state

    # Facts about the encoding, with numpy.finfo's names.

    @property
    def bits(self) -> int:
        """Bits per value: 1 + exp + man."""
        return 1 + self.exp + self.man

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value."""
        top = 2**self.exp - 1 - self.bias  # exponent of the top exponent code
        if self.special == "ieee" or (self.special == "fn" and self.man == 0):
            return top - 1
        return top

    @property
    def max(self) -> float:
        """The largest finite value."""
        return float(self._max_fraction)

    @property
    def min(self) -> float:
        """The most negative finite value, -max (torch.finfo's min)."""
        return -self.max

    @property
    def _max_fraction(self) -> Fraction:
        # In "fn" formats the all-ones fraction of the top binade is NaN.
        top_fraction = 2**self.man - (1 if self.special == "fn" and self.man > 0 else 0) - 1
        return (1 + Fraction(top_fraction, 2**self.man)) * Fraction(2) ** self.emax

    @property
    def smallest_normal(self) -> float:
        """2**emin."""
        return math.ldexp(1.0, self.emin)

    @property
    def smallest_subnormal(self) -> float:
        """The smallest positive value: 2**(emin - man), or 2**emin without subnormals."""
        return math.ldexp(1.0, self.emin - (self.man if self.subnormals else 0))

    @property
    def eps(self) -> float:
        """The distance from 1 to the next larger value: 2**-man where 1 is a normal value, and
        the subnormal spacing 2**(emin - man) where 1 is a subnormal one (emin > 0, as in every
        Float(1, ...) and in formats whose bias puts 1 below the smallest normal).

        Where no value follows 1 (1 is not a value of the format, lying outside its positive
        range, or 1 is max), eps is 2**-man, the spacing above 1 in a binade of normal values:
        numpy's and torch's finfo define eps as this for their types.
        """
        if self._one_is_subnormal:
            return math.ldexp(1.0, self.emin - self.man)
        return math.ldexp(1.0, -self.man)

    @property
    def _one_is_subnormal(self) -> bool:
        """Whether 1 is a subnormal value: below the smallest normal, a multiple of the
        subnormal spacing."""
        return self.emin > 0 and self.subnormals and self.emin <= self.man

    @property
    def has_inf(self) -> bool:
        return self.special == "ieee"

    @property
    def has_nan(self) -> bool:
        """Whether a code decodes to NaN: not in "none" formats, nor in "ieee" ones without
        fraction bits (their top exponent code holds only +/-Inf)."""
        return self.special != "none" and not (self.special == "ieee" and self.man == 0)

    @property
    def has_negative_zero(self) -> bool:
        return self.special != "fnuz"

    def values(self) -> torch.Tensor:
        """All finite values, ascending, once each, as a float64 tensor (formats of <= 16 bits)."""
        _check_enumerable(self)
        magnitudes = set()
        for e in range(2**self.exp):
            for m in range(2**self.man):
                value = self._decode(e, m)
                if value is not None:
                    magnitudes.add(value)
        return _signed_values(magnitudes)

    def _decode(self, e: int, m: int) -> Fraction | None:
        """The magnitude of exponent code e and fraction code m; None for Inf/NaN codes."""
        top = 2**self.exp - 1
        if e == top and (self.special == "ieee" or (self.special == "fn" and m == 2**self.man - 1)):
            return None
        if e == 0:
            return (
                Fraction(m, 2**self.man) * Fraction(2) ** self.emin
                if self.subnormals
                else Fraction(0)
            )
        return (1 + Fraction(m, 2**self.man)) * Fraction(2) ** (e - self.bias)

    # Fit to a container and the grid the kernels round onto.

    def _misfit(self, c: Container) -> str | None:
        return _floating_misfit(self.man, "fraction bits", self.emax, self.emin, c)

    def _build_grid(self) -> GridSpec:
        return GridSpec(
            keep=self.man,
            qmin=self.emin - self.man,
            emin=self.emin,
            subnormals=self.subnormals,
            pos_limit=self.max,
            neg_limit=self.max,
            saturate=self.saturate,
            has_inf=self.has_inf,
            unsigned_zero=not self.has_negative_zero,
            code_parity=False,
        )


@dataclass(frozen=True, repr=False)
class Fixed(_OnGrid):
    """A fixed-point format: values k * 2**-fl for integers k of ``wl`` bits.

    Args:
        wl: word length in bits, the sign bit included: 2 to 54 signed, 1 to 53 unsigned (the
            integers a float64 significand holds), and at most what the container's significand
            holds (25 signed and 24 unsigned in float32).
        fl: fractional bits; the spacing is 2**-fl. May be negative (spacing above 1).
        signed: two's complement k in [-2**(wl-1), 2**(wl-1) - 1]; unsigned: k in [0, 2**wl - 1].
        clamp: values outside the range saturate to it (and +/-Inf become the limits). Without
            clamp, values keep the spacing beyond the range and Inf stays Inf.
        symmetric: drop the most negative code, so the range is [-max, max] (signed only).

    Zero keeps the sign of its input in the container (-0.0 == 0), except in unsigned formats.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field is out of range, or the format fits no container.
    """

    wl: int
    fl: int
    signed: bool = field(default=True, kw_only=True)
    clamp: bool = field(default=True, kw_only=True)
    symmetric: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        check_bool_field("Fixed", "signed", self.signed)
        check_bool_field("Fixed", "clamp", self.clamp)
        check_bool_field("Fixed", "symmetric", self.symmetric)
        # The widest words whose integers a float64 significand (53 bits) holds.
        check_int_field("Fixed", "wl", self.wl, *((2, 54) if self.signed else (1, 53)))
        check_int_field("Fixed", "fl", self.fl, -1100, 1100)
        if self.symmetric and not self.signed:
            raise ValueError("Fixed.symmetric applies to signed formats only")
        self._finish()

    __repr__ = short_repr
    __getstate__ = field_state

    @property
    def bits(self) -> int:
        return self.wl

    @property
    def eps(self) -> float:
        """The spacing, 2**-fl."""
        return math.ldexp(1.0, -self.fl)

    smallest_normal = eps
    smallest_subnormal = eps

    @property
    def _max_integer(self) -> int:
        return 2 ** (self.wl - 1) - 1 if self.signed else 2**self.wl - 1

    @property
    def _min_integer(self) -> int:
        if not self.signed:
            return 0
        return -(2 ** (self.wl - 1)) + (1 if self.symmetric else 0)

    @property
    def max(self) -> float:
        """The largest value."""
        return math.ldexp(float(self._max_integer), -self.fl)

    @property
    def min(self) -> float:
        """The most negative value (0 for unsigned formats)."""
        return math.ldexp(float(self._min_integer), -self.fl)

    def values(self) -> torch.Tensor:
        """All values, ascending, as a float64 tensor (formats of <= 16 bits)."""
        _check_enumerable(self)
        k = torch.arange(self._min_integer, self._max_integer + 1, dtype=torch.float64)
        return torch.ldexp(k, torch.tensor(-self.fl))

    def _misfit(self, c: Container) -> str | None:
        needed = self._max_integer.bit_length()  # |min| is a power of two or equals max
        if needed > c.man + 1:
            return f"its integers need {needed} significant bits, the container has {c.man + 1}"
        if -self.fl < c.qmin:
            return (
                f"its spacing 2**{-self.fl} is below the container's smallest subnormal 2**{c.qmin}"
            )
        largest = _exponent_of(max(self._max_integer, -self._min_integer) / Fraction(2) ** self.fl)
        if largest > c.emax:
            return f"its largest magnitude is about 2**{largest}, beyond the container's range"
        return None

    def _build_grid(self) -> GridSpec:
        unbounded = not self.clamp
        return GridSpec(
            keep=-1,
            qmin=-self.fl,
            emin=-self.fl,
            subnormals=True,
            pos_limit=math.inf if unbounded else self.max,
            neg_limit=math.inf if unbounded else -self.min,
            saturate=self.clamp,
            has_inf=unbounded,
            unsigned_zero=not self.signed,
            code_parity=False,
        )


P3109_DOMAINS = ("extended", "finite")
P3109_SATURATIONS = ("SatFinite", "SatPropagate", "SatNone")


@dataclass(frozen=True, repr=False)
class P3109(_OnGrid):
    """A binary floating-point format of IEEE P3109 (Binary{K}p{P}, K = ``bits``, P =
    ``precision`` in the report's notation), with the saturation mode its projection applies.

    The encoding follows the P3109 interim report (v3.0 2025, v4.0 2026; gfloat's
    ``format_info_p3109``): ``bits`` bits, of which 1 is the sign (signed formats only) and
    precision - 1 are the trailing significand, the rest the exponent field, with exponent bias
    2**(bits - precision - 1) (signed) or 2**(bits - precision) (unsigned). Exponent code 0 holds
    zero and the subnormals. There is one NaN and no -0: the negative-zero code (0x80 for 8 bits)
    is the NaN of a signed format, the all-ones code that of an unsigned one. In the "extended"
    domain the largest remaining code of each sign is Inf (0x7F = +Inf and 0xFF = -Inf signed,
    0xFE = +Inf unsigned); in the "finite" domain it is a finite value. An unsigned format has no
    negative values.

    Rounding rounds x to the format's precision with the exponent unbounded above (the report's
    RoundToPrecision: ``nearest`` is NearestTiesToEven, ``nearest_away`` NearestTiesToAway,
    ``toward_zero`` TowardZero, ``up`` TowardPositive, ``down`` TowardNegative; ``stochastic`` with
    rbits = n is StochasticA with n random bits); ties to even go to the value with the even code,
    which at precision 1 is the even exponent code. A result outside [lo, max], lo = -max (signed)
    or 0 (unsigned), is then mapped by ``saturation`` (the report's Saturate):

    - ``"SatFinite"``: to lo or max, +/-Inf inputs included.
    - ``"SatPropagate"``: finite results to lo or max; +Inf and -Inf inputs stay infinite where the
      format has them (+Inf: extended; -Inf: signed extended), and otherwise become max or lo.
    - ``"SatNone"`` (the interim report v3.0's OvfInf): a result that the rule rounded toward zero
      (``toward_zero``; ``down`` above max; ``up`` below lo; and lpsim's ``odd``, see below)
      becomes max or lo; any other becomes +Inf above max and -Inf below lo where the format has
      them, and NaN where it does not (finite formats; negative values in unsigned formats).
      +/-Inf inputs stay infinite where the format has them, and become NaN otherwise.

    So in an unsigned format a negative x that rounds to zero gives +0, and one that does not
    gives 0 under SatFinite and SatPropagate, and under SatNone 0 for toward_zero, odd and up, NaN
    for the other rules; -Inf gives 0, or NaN under SatNone. NaN stays NaN. This is the formal
    specification's wSaturate (imandra-ai/ieee-p3109, July 2026) and the v4.0 report's table,
    except that v4.0 sends SatNone results outside a finite format's range to lo or max where the
    formal specification (and gfloat's ``sat=False``) gives NaN, as here; v3.0 defines only
    SatFinite for finite formats, and sends negative values in unsigned formats to 0 under OvfInf.
    lpsim's ``odd`` is P3109's ToOdd within the range, but keeps max (or lo) on overflow where
    ToOdd under SatNone gives Inf.

    Why a class of its own rather than Float options: the bias, the one NaN at the negative-zero
    code, the Inf codes inside the top binade, the missing sign bit of unsigned formats and the
    saturation modes that treat Inf by domain and signedness would each be a Float option that
    means something only in combination with the others; here every field is one of the report's
    format-defining parameters or its saturation mode, and Float stays as it is. Both describe
    their numbers by the same GridSpec, so the kernels, the fusable path and every op that takes a
    Float take a P3109 format alike.

    Args:
        bits: the bit width K, 3 to 16.
        precision: the precision P (significand bits, the leading one included): 1 to bits - 1
            for signed formats, 1 to bits for unsigned ones; from 13 bits (12 unsigned) on at
            least bits - 11 (bits - 10 unsigned), so that the values fit a float64.
        signed: whether the format has a sign bit and negative values.
        domain: ``"extended"`` (with Inf) or ``"finite"`` (every code but the NaN is finite).
        saturation: ``"SatFinite"``, ``"SatPropagate"`` or ``"SatNone"`` (see above).

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field is out of range, or the format fits no container (not even float64).
    """

    bits: int
    precision: int
    signed: bool = field(default=True, kw_only=True)
    domain: str = field(default="extended", kw_only=True)
    saturation: str = field(default="SatNone", kw_only=True)

    def __post_init__(self) -> None:
        check_int_field("P3109", "bits", self.bits, 3, 16)
        check_bool_field("P3109", "signed", self.signed)
        if not isinstance(self.precision, int) or isinstance(self.precision, bool):
            raise TypeError(f"P3109.precision must be an int, got {type(self.precision).__name__}")
        top = self.bits - 1 if self.signed else self.bits
        # The exponent field (bits - precision wide, one bit more unsigned) must be at most 11 bits,
        # float64's, for the values to fit a float64.
        low = max(1, self.bits - (11 if self.signed else 10))
        if not low <= self.precision <= top:
            kind = "a signed" if self.signed else "an unsigned"
            why = f" (below {low} its values exceed float64's range)" if low > 1 else ""
            raise ValueError(
                f"P3109.precision must be in [{low}, {top}] for {kind} {self.bits}-bit "
                f"format{why}, got {self.precision}"
            )
        if self.domain not in P3109_DOMAINS:
            raise ValueError(f"P3109.domain must be one of {P3109_DOMAINS}, got {self.domain!r}")
        if self.saturation not in P3109_SATURATIONS:
            hint = (
                " (the interim report v3.0's OvfInf is SatNone)"
                if self.saturation == "OvfInf"
                else ""
            )
            raise ValueError(
                f"P3109.saturation must be one of {P3109_SATURATIONS}, "
                f"got {self.saturation!r}{hint}"
            )
        self._finish()

    __repr__ = short_repr
    __getstate__ = field_state

    @property
    def name(self) -> str:
        """The report's name, lower case: binary{K}p{P} then s/u (signed/unsigned) and e/f
        (extended/finite), e.g. binary8p4se."""
        sign = "s" if self.signed else "u"
        return f"binary{self.bits}p{self.precision}{sign}{self.domain[0]}"

    # Facts about the encoding, with numpy.finfo's names.

    @property
    def bias(self) -> int:
        """The exponent bias: 2**(bits - precision - 1) signed, 2**(bits - precision) unsigned."""
        return 2 ** (self.bits - self.precision - (1 if self.signed else 0))

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value, 1 - bias."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value."""
        return _exponent_of(self._max_fraction)

    @property
    def max(self) -> float:
        """The largest finite value."""
        return float(self._max_fraction)

    @property
    def min(self) -> float:
        """The most negative finite value: -max, or 0 for unsigned formats."""
        return -self.max if self.signed else 0.0

    @property
    def smallest_normal(self) -> float:
        """2**emin (at precision 1 also the smallest positive value: there are no subnormals)."""
        return math.ldexp(1.0, self.emin)

    @property
    def smallest_subnormal(self) -> float:
        """The smallest positive value, 2**(emin - (precision - 1))."""
        return math.ldexp(1.0, self.emin - self._trailing)

    @property
    def eps(self) -> float:
        """The distance from 1 to the next larger value, 2**-(precision - 1) (1 is always a
        normal value; where it is max, in binary3p1se and binary3p2se, eps is still
        2**-(precision - 1), as for Float)."""
        return math.ldexp(1.0, -self._trailing)

    @property
    def has_inf(self) -> bool:
        """Whether the format encodes +Inf (the extended domain; -Inf only if also signed)."""
        return self.domain == "extended"

    @property
    def has_nan(self) -> bool:
        return True

    @property
    def has_negative_zero(self) -> bool:
        return False

    @property
    def _trailing(self) -> int:
        return self.precision - 1

    @property
    def _max_code(self) -> int:
        """The code of max, counted without the sign bit: below it lie the finite codes, above it
        Inf (extended) and, in unsigned formats, the NaN."""
        top = 2 ** (self.bits - (1 if self.signed else 0)) - 1
        return top - (0 if self.signed else 1) - (1 if self.has_inf else 0)

    @property
    def _max_fraction(self) -> Fraction:
        return self._decode(self._max_code)

    def _decode(self, code: int) -> Fraction:
        """The magnitude of a finite code without its sign bit."""
        e, m = code >> self._trailing, code & (2**self._trailing - 1)
        if e == 0:
            return Fraction(m, 2**self._trailing) * Fraction(2) ** self.emin
        return (1 + Fraction(m, 2**self._trailing)) * Fraction(2) ** (e - self.bias)

    def values(self) -> torch.Tensor:
        """All finite values, ascending, once each, as a float64 tensor (formats of <= 16 bits)."""
        _check_enumerable(self)
        magnitudes = {self._decode(code) for code in range(self._max_code + 1)}
        if self.signed:
            return _signed_values(magnitudes)
        return torch.tensor(sorted(float(m) for m in magnitudes), dtype=torch.float64)

    # Fit to a container and the grid the kernels round onto.

    def _misfit(self, c: Container) -> str | None:
        trailing = self._trailing
        return _floating_misfit(trailing, "trailing significand bits", self.emax, self.emin, c)

    def _build_grid(self) -> GridSpec:
        # SatFinite clamps Inf too: the grid has no Inf. Unsigned (neg_limit 0): no -Inf either.
        return GridSpec(
            keep=self._trailing,
            qmin=self.emin - self._trailing,
            emin=self.emin,
            subnormals=True,
            pos_limit=self.max,
            neg_limit=self.max if self.signed else 0.0,
            saturate=self.saturation != "SatNone",
            has_inf=self.has_inf and self.saturation != "SatFinite",
            unsigned_zero=True,
            code_parity=True,
        )


@dataclass(frozen=True, repr=False)
class BlockFloat:
    """Block floating point: blocks of values share one exponent, the exponent of the block's
    largest finite magnitude; each element is a ``wl``-bit sign-magnitude integer k,
    |k| <= 2**(wl-1) - 1, times 2**(exponent - (wl - 2)), so the largest element uses the top bit.
    Rounding up past the largest integer saturates. +/-Inf and NaN elements stay as they are and do
    not affect the exponent.

    Args:
        wl: bits per element, the sign included, 2 or more (at most the container's precision + 1).
        dim: None: the whole tensor is one block. An int d >= 0: one exponent per index along d (the
            maximum is taken over all other dimensions), as in QPyTorch. Negative dims are refused:
            QPyTorch's dim=-1 means the whole tensor and torch's the last dimension, so -1 would
            mean different things to different readers.
        block_size: blocks of this many consecutive elements along the last dimension (the last
            block of a row may be shorter). Give dim or block_size, not both.

    The range facts (max, eps, ...) and values() are those of one block whose shared exponent is 0,
    that is whose largest magnitude lies in [1, 2).

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field is out of range, or both dim and block_size are given.
    """

    wl: int
    dim: int | None = None
    block_size: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        check_int_field("BlockFloat", "wl", self.wl, 2, _WIDEST.man + 2)
        if self.dim is not None:
            if isinstance(self.dim, int) and not isinstance(self.dim, bool) and self.dim < 0:
                raise ValueError(
                    "BlockFloat.dim must be None (one block for the whole tensor) or a dimension "
                    f">= 0, got {self.dim}: negative dims are ambiguous (QPyTorch's -1 is the "
                    "whole tensor, torch's the last dimension); write dim=None or dim=x.dim() - 1"
                )
            check_int_field("BlockFloat", "dim", self.dim, 0, 2**31)
        if self.block_size is not None:
            check_int_field("BlockFloat", "block_size", self.block_size, 1, 2**31)
            if self.dim is not None:
                raise ValueError("BlockFloat takes dim or block_size, not both")

    __repr__ = short_repr
    __getstate__ = field_state

    @property
    def bits(self) -> int:
        """Bits per element, the shared exponent not included."""
        return self.wl

    @property
    def eps(self) -> float:
        """The element spacing relative to a shared exponent of 0: 2**-(wl-2)."""
        return math.ldexp(1.0, 2 - self.wl)

    smallest_subnormal = eps

    @property
    def smallest_normal(self) -> float:
        """The smallest element that uses the top bit, at shared exponent 0: 1."""
        return 1.0

    @property
    def max(self) -> float:
        """The largest element at shared exponent 0: 2 - 2**-(wl-2)."""
        return math.ldexp(float(2 ** (self.wl - 1) - 1), 2 - self.wl)

    @property
    def min(self) -> float:
        """The most negative element at shared exponent 0, -max (sign-magnitude)."""
        return -self.max

    def values(self) -> torch.Tensor:
        """The element values at shared exponent 0, ascending (formats of <= 16 bits)."""
        _check_enumerable(self)
        top = 2 ** (self.wl - 1) - 1
        k = torch.arange(-top, top + 1, dtype=torch.float64)
        return torch.ldexp(k, torch.tensor(2 - self.wl))

    def _misfit(self, c: Container) -> str | None:
        if self.wl > c.man + 2:
            return f"wl is {self.wl}, the container holds at most {c.man + 2}"
        return None


Format = Float | Fixed | BlockFloat | P3109

# The format classes whose numbers form a GridSpec (every one but BlockFloat, whose grid depends on
# the block): lpsim.quantize and the ops that take a grid accept exactly these.
GRID_FORMATS = (Float, Fixed, P3109)


def fitting_container(fmt: Format, dtype: torch.dtype) -> torch.dtype:
    """``dtype`` when a tensor of it holds every value of ``fmt``, else float32 when that does,
    else float64 (also when nothing does: rounding into fmt then says why)."""
    for candidate in (dtype, torch.float32, torch.float64):
        if candidate in CONTAINERS and fmt._misfit(CONTAINERS[candidate]) is None:
            return candidate
    return torch.float64


def sum_container(fmt: Format, dtype: torch.dtype) -> torch.dtype:
    """The container of sums rounded into ``fmt`` from terms of ``dtype``: fitting_container, but
    float64 for a Fixed without clamp, whose grid continues beyond its range (2048 + 1 in
    Fixed(9, 3, clamp=False) is 2049, which a float16 or bfloat16 tensor cannot hold)."""
    if isinstance(fmt, Fixed) and not fmt.clamp:
        return torch.float64
    return fitting_container(fmt, dtype)


def check_fits(fmt: Format, dtype: torch.dtype) -> None:
    """Raise unless every value of ``fmt`` is representable in a tensor of ``dtype``.

    Raises:
        TypeError: ``dtype`` is not a supported container.
        ValueError: the format does not fit; the message says why and what to use instead.
    """
    container_of(dtype)  # raises TypeError for a dtype that is not a container
    first = first_equal(fmt) if torch.compiler.is_compiling() else None
    problem = _constant_misfit(first, dtype) if first is not None else _misfit_message(fmt, dtype)
    if problem is not None:
        raise ValueError(problem)


def _misfit_message(fmt: Format, dtype: torch.dtype) -> str | None:
    """check_fits' message for fmt and a container dtype, or None when fmt fits."""
    c = CONTAINERS[dtype]
    problem = fmt._misfit(c)
    if not problem:
        return None
    wider = [d.name for d in CONTAINERS.values() if fmt._misfit(d) is None]
    hint = f"; use a {' or '.join(wider)} tensor" if wider else ""
    return f"{fmt!r} does not fit a {c.name} tensor: {problem}{hint}"


@torch.compiler.assume_constant_result
def _constant_misfit(fmt: Format, dtype: torch.dtype) -> str | None:
    """_misfit_message(fmt, dtype), computed by dynamo at trace time (fmt is first_equal's, whose
    identity dynamo guards on). Read through the format's attributes, a field that changed
    between two traces of one function (Fixed(8, 4), then Fixed(8, 3)) is a symbolic int, which
    the Fractions of _misfit cannot take (dynamo refused the second call)."""
    return _misfit_message(fmt, dtype)


def _check_enumerable(fmt) -> None:
    if fmt.bits > MAX_VALUES_BITS:
        raise ValueError(
            f"values() lists formats of at most {MAX_VALUES_BITS} bits; {fmt!r} has {fmt.bits}"
        )


def _signed_values(magnitudes) -> torch.Tensor:
    positive = sorted(float(m) for m in magnitudes if m > 0)
    ordered = [-m for m in reversed(positive)] + [0.0] + positive
    return torch.tensor(ordered, dtype=torch.float64)


PRESETS: dict[str, Float | P3109] = {
    "float32": Float(8, 23),
    "tf32": Float(8, 10),
    "bfloat16": Float(8, 7),
    "float16": Float(5, 10),
    # 8-bit formats. torch's float8_e4m3fn cast saturates; ml_dtypes' (and OCP's default) do not.
    "e5m2": Float(5, 2),
    "e4m3": Float(4, 3),
    "e3m4": Float(3, 4),
    "e4m3fn": Float(4, 3, special="fn"),
    "e4m3fn_saturating": Float(4, 3, special="fn", saturate=True),
    "e5m2fnuz": Float(5, 2, special="fnuz"),
    "e4m3fnuz": Float(4, 3, special="fnuz"),
    "e4m3b11fnuz": Float(4, 3, bias=11, special="fnuz"),  # ml_dtypes' float8_e4m3b11fnuz
    # OCP microscaling element formats: no Inf, no NaN, saturating.
    "e3m2fn": Float(3, 2, special="none", saturate=True),
    "e2m3fn": Float(2, 3, special="none", saturate=True),
    "e2m1fn": Float(2, 1, special="none", saturate=True),
    # QPyTorch's convention: the top exponent code is finite (one extra binade) and overflow
    # saturates.
    "e5m2_qtorch": Float(5, 2, special="none", saturate=True),
    "e4m3_qtorch": Float(4, 3, special="none", saturate=True),
}
# The IEEE P3109 8-bit formats under the report's names (binary8p4se: K = 8, P = 4, signed,
# extended), with the default saturation mode SatNone: P = 1..7 signed, 1..8 unsigned, each in the
# extended and the finite domain. dataclasses.replace(preset, saturation=...) picks another mode.
PRESETS.update(
    {
        fmt.name: fmt
        for signed in (True, False)
        for precision in range(1, 8 if signed else 9)
        for domain in P3109_DOMAINS
        for fmt in [P3109(8, precision, signed=signed, domain=domain)]
    }
)


def preset(name: str) -> Float | P3109:
    """The preset format called ``name`` (see PRESETS).

    Raises:
        TypeError: name is not a str.
        ValueError: no preset has that name; the message lists them.
    """
    if not isinstance(name, str):  # an unhashable one raised "unhashable type" from the dict
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"no preset named {name!r}; presets: {', '.join(PRESETS)}") from None
