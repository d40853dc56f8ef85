"""Statistics of a rounding: what happened to the elements of a tensor when it was quantised.

``rounding_statistics(x, rounded, fmt)`` compares a tensor with its rounded value and counts, in
one fused pass over both (a compiled kernel on CPU and CUDA):

- ``nonfinite``: elements of x that are NaN or +/-Inf (left out of every other count and sum);
- ``overflow``: finite elements that lie outside the format's range [min, max] (they saturated to
  its limit or became Inf or NaN), or whose rounded value is not finite;
- ``underflow``: finite nonzero elements inside the range that became zero;
- ``subnormal``: finite elements whose rounded value is nonzero and below the format's smallest
  normal value in magnitude;
- ``unchanged``: finite elements equal to their rounded value (-0 equals +0);
- ``squared_error`` and ``squared_value``: the sums of (rounded - x)**2 and of x**2 in float64
  over the elements where both x and the rounded value are finite, so that SQNR and the relative
  error follow. In float64 tensors the squares can leave float64's range: a square above about
  1.8e308 (|x| above 1.3e154) makes its sum inf, and sqnr_db and relative_error nan (unknown);
  a square below 4.9e-324 (a value or an error below about 2.2e-162 in magnitude) adds 0, so
  that a tensor of such values shows no signal (nan) and such errors count for nothing.

Which of the categories a format family has (the bounds of ``statistics_bounds``):

==============  ==================================  ===================================
family          overflow                            subnormal
==============  ==================================  ===================================
Float, P3109    outside [min, max]                  below smallest_normal
Fixed           outside [min, max]                  none (no subnormals)
Scaled          outside its block's range           below its block's smallest normal
BlockFloat      outside its block's range           none
DelayedScaling  non-finite results only             none (per tensor)
DelayedScaler   outside its latest call's range     below that call's smallest normal
==============  ==================================  ===================================

A Scaled block's range is that of its decoded values: from what the element format's most
negative value decodes to (times the block's scale, and the tensor scale where there is one, in
the format's arithmetic, then rounded into x's dtype, as quantize decodes it) to what its largest
decodes to; a finite x outside it saturated to that limit, an MX element beyond the scale that its
block's largest magnitude gave it included. With a Float scale (the "amax" rule) the encoder
multiplies x by the scale's reciprocal, which is not exactly the inverse of the decode factor, so
the range reaches on to the largest x whose product (rounded as the encoder rounds it) is within
the element format's limits: x counts as overflow only where the encoder took it past them. Its
smallest normal is what the element format's smallest normal value decodes to (none for Fixed
elements). The scales are those quantize finds from x, so the statistics are those of a rounding
of x itself; a block with a NaN or an Inf decodes to NaN, an overflow of each of its finite
elements.

A BlockFloat block's range is [-limit, limit], limit = (2**(wl-1) - 1) * 2**(e - (wl-2)) the
largest magnitude of its grid, e the exponent that quantize finds from the block's largest finite
magnitude in x (raised where quantize raises it, so that the spacing stays representable in x's
dtype); a finite x beyond it saturated to +/-limit. NaN and Inf take no part in the exponent.

A DelayedScaling range depends on a scale that the rounded tensor does not show (the scale of the
scaler's state before its call): with the DelayedScaling alone, only non-finite results count as
overflow, and its underflow, unchanged and error sums are exact as for the other families. Pass
the ``DelayedScaler`` whose call rounded x instead (as the Recorder does) for that call's range,
``DelayedScaler.statistics_bounds``: the element format's limits and smallest normal value
decoded with the scale the call used, the limits reaching on, as above, to the largest x that the
call's scale kept within the element's limits.

Counts are exact. The sums are float64, added in a fixed order (chunks of 16,384 elements, each
summed in 256 lanes that are then added pairwise, chunks added in order), so the statistics are
the same for any thread count and on any device (csrc/include/lpsim/rounding_statistics.h).

``quantize_with_statistics(x, fmt, rounding)`` returns ``quantize(x, fmt, rounding)`` (the same
bits, the same random draws) and its statistics; for Float, Fixed and P3109 formats on the CPU the
statistics of each chunk are taken inside the rounding kernel while the chunk is in cache.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass

import torch

from lpsim._checks import check_container, check_strided, check_tensor, under_vmap
from lpsim._ops import call
from lpsim.delayed_scaling import DelayedScaler, DelayedScaling
from lpsim.formats import GRID_FORMATS, P3109, BlockFloat, Fixed, Float, Format
from lpsim.functional import quantize, quantize_op_arguments
from lpsim.rounding import Rounding
from lpsim.scaled import Scaled

__all__ = [
    "RoundingStatistics",
    "rounding_statistics",
    "quantize_with_statistics",
    "statistics_bounds",
    "FRACTIONS",
]

# The counts of finite elements, which RoundingStatistics.fraction gives as shares of them.
FRACTIONS = ("overflow", "underflow", "subnormal", "unchanged")

# The containers the kernels read; other floating dtypes are compared in float64 (exactly).
_CONTAINERS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RoundingStatistics:
    """What one or more roundings did (see the module docstring for each field's definition).
    Statistics of several roundings add up with ``+``, and with ``sum()`` (whose start, 0, counts
    as no rounding)."""

    elements: int = 0
    nonfinite: int = 0
    overflow: int = 0
    underflow: int = 0
    subnormal: int = 0
    unchanged: int = 0
    squared_error: float = 0.0
    squared_value: float = 0.0

    def __add__(self, other: RoundingStatistics) -> RoundingStatistics:
        if not isinstance(other, RoundingStatistics):
            return NotImplemented
        return RoundingStatistics(
            *(a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True))
        )

    def __radd__(self, other: int) -> RoundingStatistics:
        if isinstance(other, int) and not isinstance(other, bool) and other == 0:
            return self  # sum()'s start
        return NotImplemented

    def as_tuple(self) -> tuple:
        return (
            self.elements,
            self.nonfinite,
            self.overflow,
            self.underflow,
            self.subnormal,
            self.unchanged,
            self.squared_error,
            self.squared_value,
        )

    def as_dict(self) -> dict:
        """The fields and the derived sqnr_db and relative_error, for CSV and JSON."""
        return {**asdict(self), "sqnr_db": self.sqnr_db, "relative_error": self.relative_error}

    @property
    def finite(self) -> int:
        """Elements of x that are finite."""
        return self.elements - self.nonfinite

    def fraction(self, name: str) -> float:
        """The count ``name`` (one of FRACTIONS: the counts of finite elements) as a fraction of
        the finite elements (nan when there are none).

        Raises:
            ValueError: name is not one of FRACTIONS.
        """
        if name not in FRACTIONS:
            raise ValueError(f"name must be one of {FRACTIONS}, got {name!r}")
        count = getattr(self, name)
        return count / self.finite if self.finite else math.nan

    @property
    def sqnr_db(self) -> float:
        """Signal-to-quantisation-noise ratio in dB, 10 log10(squared_value / squared_error):
        inf for an exact rounding, nan when there is no signal or a sum overflowed float64 (the
        ratio is then unknown). A quotient beyond float64's range (a float64 tensor holding
        2**500 exactly and a rounded 1e-150) is taken as a difference of logarithms."""
        value, error = self.squared_value, self.squared_error
        if value == 0 or math.isinf(value) or math.isinf(error):
            return math.nan
        if error == 0:
            return math.inf
        return 10 * _log10_quotient(value, error)

    @property
    def relative_error(self) -> float:
        """sqrt(squared_error / squared_value), the relative error in the 2-norm (nan when there
        is no signal or a sum overflowed float64; a quotient outside float64's normal range is
        taken as a quotient of square roots, neither flushed to 0 nor overflowed to inf)."""
        value, error = self.squared_value, self.squared_error
        if value == 0 or math.isinf(value) or math.isinf(error):
            return math.nan
        quotient = error / value
        if error == 0 or sys.float_info.min <= quotient <= sys.float_info.max:
            return math.sqrt(quotient)
        return math.sqrt(error) / math.sqrt(value)


def _log10_quotient(a: float, b: float) -> float:
    """log10(a / b) for positive finite a and b: of the quotient where it is a normal float64,
    else the difference of the logarithms (the quotient overflows or loses its digits)."""
    quotient = a / b
    if sys.float_info.min <= quotient <= sys.float_info.max:
        return math.log10(quotient)
    return math.log10(a) - math.log10(b)


def statistics_bounds(fmt: Format) -> tuple[float, float, float]:
    """(low, high, smallest_normal) of ``fmt`` for the counts: finite values outside [low, high]
    overflow, nonzero rounded values below smallest_normal in magnitude are subnormal (0: none).

    Raises:
        TypeError: fmt is not a Float, Fixed, P3109 or DelayedScaling format (a Scaled or a
            BlockFloat format's bounds are each block's, which only x gives).
    """
    if isinstance(fmt, Float):
        return -fmt.max, fmt.max, fmt.smallest_normal
    if isinstance(fmt, P3109):
        return fmt.min, fmt.max, fmt.smallest_normal
    if isinstance(fmt, Fixed):
        return fmt.min, fmt.max, 0.0
    if isinstance(fmt, DelayedScaling):
        return -math.inf, math.inf, 0.0
    if isinstance(fmt, (Scaled, BlockFloat)):
        raise TypeError(
            f"a {type(fmt).__name__} format's bounds are those of each block (see "
            "lpsim.statistics); rounding_statistics finds them"
        )
    raise TypeError(
        "fmt must be a Float, Fixed, P3109, BlockFloat, Scaled or DelayedScaling format, got "
        f"{type(fmt).__name__}"
    )


def _check_pair(x: torch.Tensor, rounded: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(rounded, torch.Tensor):
        raise TypeError("x and rounded must be tensors")
    check_strided(x, "x", "rounding_statistics")
    check_strided(rounded, "rounded", "rounding_statistics")
    if x.shape != rounded.shape:
        raise ValueError(
            f"rounded must have x's shape {tuple(x.shape)}, got {tuple(rounded.shape)}"
        )
    if not x.is_floating_point() or not rounded.is_floating_point():
        raise TypeError(
            f"x and rounded must be floating tensors, got {x.dtype} and {rounded.dtype}"
        )
    if x.device != rounded.device:
        raise ValueError(
            f"x and rounded must be on one device, got {x.device} and {rounded.device}"
        )


def rounding_statistics(
    x: torch.Tensor, rounded: torch.Tensor, fmt: Format | Scaled | DelayedScaler
) -> RoundingStatistics:
    """The statistics of rounding ``x`` to ``rounded`` in ``fmt`` (see the module docstring).

    Args:
        x: the tensor before rounding, any floating dtype, shape and strides (for a Scaled or
            BlockFloat format, a dtype quantize takes for it: float32, float64, bfloat16 or
            float16, wide enough for a BlockFloat's wl).
        rounded: its rounded value, of x's shape and device (any floating dtype; for a Scaled or
            BlockFloat format, values that x's dtype holds).
        fmt: the format x was rounded into (it sets the overflow and subnormal bounds), or the
            DelayedScaler whose latest call rounded it.

    Raises:
        TypeError: x or rounded is not a floating strided tensor, fmt is not a format, or fmt is
            Scaled or BlockFloat and x's dtype is not one quantize takes.
        ValueError: their shapes or devices differ; fmt is Scaled or BlockFloat and rounded holds
            a value that x's dtype does not, or the format does not fit x's dtype.
        IndexError: fmt is a BlockFloat whose dim x does not have.
    """
    _check_pair(x, rounded)
    x, rounded = x.detach(), rounded.detach()
    if isinstance(fmt, Scaled):
        return _scaled_statistics(x, rounded, fmt)
    if isinstance(fmt, BlockFloat):
        return _block_statistics(x, rounded, fmt)
    if isinstance(fmt, DelayedScaler):
        return _statistics(x, rounded, *fmt.statistics_bounds(x.dtype))
    return _statistics(x, rounded, *statistics_bounds(fmt))


def _statistics(x, rounded, low, high, smallest_normal) -> RoundingStatistics:
    if x.dtype != rounded.dtype or x.dtype not in _CONTAINERS:
        x, rounded = x.to(torch.float64), rounded.to(torch.float64)
    counts, sums = call("rounding_statistics", x, rounded, low, high, smallest_normal)
    return _from_op(counts, sums)


def _scaled_statistics(x, rounded, fmt: Scaled) -> RoundingStatistics:
    """Each element counted within its block's bounds, the blocks' scales found from x as quantize
    finds them: x must be a tensor quantize takes (its dtype sets the format's arithmetic)."""
    check_container(x)
    rounded = _in_dtype_of(x, rounded, fmt)
    element_smallest_normal = statistics_bounds(fmt.element)[2]
    counts, sums = call(
        "scaled_rounding_statistics",
        x,
        rounded,
        *fmt.op_arguments(x.dtype),
        element_smallest_normal,
    )
    return _from_op(counts, sums)


def _block_statistics(x, rounded, fmt: BlockFloat) -> RoundingStatistics:
    """Each element counted within its block's range, the blocks' exponents found from x as
    quantize finds them (and with its checks of x against fmt)."""
    _, (wl, dim, block_size, *_) = quantize_op_arguments(x, fmt, "nearest", None, None, 0)
    rounded = _in_dtype_of(x, rounded, fmt)
    counts, sums = call("block_rounding_statistics", x, rounded, wl, dim, block_size)
    return _from_op(counts, sums)


def _in_dtype_of(x, rounded, fmt) -> torch.Tensor:
    """rounded in x's dtype, for the block formats' ops: the values of a rounding of x are values
    of x's dtype, and a rounded tensor holding others is refused."""
    if rounded.dtype == x.dtype:
        return rounded
    narrowed = rounded.to(x.dtype)
    back = narrowed.to(rounded.dtype)
    if not bool(((back == rounded) | (back.isnan() & rounded.isnan())).all()):
        raise ValueError(
            f"rounded must hold values of x's dtype {x.dtype} for a {type(fmt).__name__} "
            "format (its rounding of x does)"
        )
    return narrowed


def _from_op(counts: torch.Tensor, sums: torch.Tensor) -> RoundingStatistics:
    if under_vmap():  # the counts are one per sample, tensors that give no Python numbers
        raise RuntimeError(
            "rounding statistics are Python numbers, which a tensor batched by torch.func.vmap "
            "does not give: compute them outside vmap (a lpsim.diagnostics Recorder attached to "
            "a model run under vmap computes them there: detach it, or run the model without "
            "vmap)"
        )
    return RoundingStatistics(*counts.tolist(), *sums.tolist())


def quantize_with_statistics(
    x: torch.Tensor,
    fmt: Format | Scaled,
    rounding: Rounding | str = "nearest",
    *,
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
) -> tuple[torch.Tensor, RoundingStatistics]:
    """(quantize(x, fmt, rounding, ...), its RoundingStatistics): the rounded tensor, bit for bit
    and draw for draw what quantize() returns with the same arguments (see lpsim.quantize for
    them and the errors raised), and the statistics of the rounding. Not differentiable: the
    result does not require grad.

    Raises:
        TypeError: x is a sparse tensor (round its values()), or as quantize raises.
    """
    check_tensor(x)
    check_strided(x, "x", "quantize_with_statistics")
    x = x.detach()
    if isinstance(fmt, GRID_FORMATS):
        name, args = quantize_op_arguments(x, fmt, rounding, rbits, seed, offset)
        assert name == "quantize_grid"
        bounds = statistics_bounds(fmt)
        rounded, counts, sums = call("quantize_grid_statistics", x, *args, *bounds)
        return rounded, _from_op(counts, sums)
    rounded = quantize(x, fmt, rounding, rbits=rbits, seed=seed, offset=offset)
    return rounded, rounding_statistics(x, rounded, fmt)
