"""Dyadic arithmetic: operations on DyadicTensors (values v * 2**-s), each one integer kernel.

Scale bookkeeping (s: scale, larger is finer; k, q, p: shift counts):

=================  ===================================================  ==========================
operation          mantissa                                             scale
=================  ===================================================  ==========================
align(a, b)        the finer operand shifted right by |s_a - s_b|       min(s_a, s_b)
add / sub          align, then v_a +/- v_b (exact)                      min(s_a, s_b)
mul(a, b, q)       round(v_a v_b / 2**q)                                s_a + s_b - q
div(a, b, p)       round(v_a 2**p / v_b)                                s_a - s_b + p
requantize(x, t)   clip(round(v / 2**(s - t)), Qmin, Qmax)              t
matmul(a, b)       exact sums of v_a v_b, checked against the           s_a + s_b
                   accumulator's range
=================  ===================================================  ==========================

Rounding (``rounding=``): "stochastic" (default for the ops that round), "nearest" (ties to even)
or "down" (floor, an arithmetic right shift). For negative mantissas every rule works on the
floor: SR(v, k) = floor(v / 2**k) + [(v mod 2**k) + U >= 2**k] with v mod 2**k in [0, 2**k).
The random U is the top k bits of the element's Philox word (see lpsim.functional for seeds and
offsets), so the shift is exactly unbiased for k <= rbits (default 32); a larger shift first
truncates the discarded bits to rbits bits, as lpsim's rbits does for the float formats. The
element index is the row-major position in the result (after broadcasting):

    >>> import torch
    >>> from lpsim import dyadic
    >>> from lpsim.reference import random_word
    >>> v = [-3, 5, 3, -6]
    >>> x = dyadic.DyadicTensor(torch.tensor(v, dtype=torch.int32), 3)
    >>> rounded = dyadic.requantize(x, 0, 8, seed=4).value.mantissa.tolist()
    >>> rounded == [w // 8 + (w % 8 + (random_word(4, 0, i) >> 29) >= 8) for i, w in enumerate(v)]
    True

Overflow (``overflow=``): a result outside the mantissa's dtype (the accumulator's range for
matmul) raises OverflowError by default; "saturate" clips it and warns with
DyadicOverflowWarning. Nothing overflows silently. Requantisation clips to the target range by
definition: its clip mask is returned, not raised.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from lpsim._checks import (
    check_choice,
    check_int,
    check_offset,
    check_rule,
    check_strided,
    check_tensor,
    draw_seed,
    seed_argument,
)
from lpsim._ops import call
from lpsim.dyadic.tensor import (
    MAX_SCALE,
    DyadicTensor,
    check_cpu_dense,
    normalize_axis,
    normalize_scale,
)
from lpsim.rounding import Rounding, check_rbits

__all__ = [
    "DyadicOverflowWarning",
    "Requantized",
    "Saturated",
    "integer_range",
    "scale_for",
    "fit_shift",
    "from_float",
    "requantize",
    "align",
    "add",
    "sub",
    "mul",
    "div",
    "matmul",
    "sum",
    "saturating_add",
    "saturating_sub",
    "saturating_matmul",
    "saturating_sum",
    "check_overflow",
]

ROUNDINGS = (Rounding.nearest, Rounding.down, Rounding.stochastic)
OVERFLOW_POLICIES = ("raise", "saturate")
_INT32 = (-(2**31), 2**31 - 1)


class DyadicOverflowWarning(RuntimeWarning):
    """Results were saturated to their range under overflow="saturate"."""


class Requantized(NamedTuple):
    """A requantised tensor and where the clip to [Qmin, Qmax] fired (a bool tensor)."""

    value: DyadicTensor
    clipped: torch.Tensor

    @property
    def clip_count(self) -> int:
        """How many elements the clip changed."""
        return int(self.clipped.sum())


class Saturated(NamedTuple):
    """A result whose out-of-range elements were saturated to their range, and how many were.

    The saturating_* functions return it and leave the reporting to the caller (the integer
    layers count overflows in their statistics, then report them under their own policy)."""

    value: DyadicTensor
    overflows: int


# ---- arguments ----------------------------------------------------------------------------------


def check_dyadic(name: str, x) -> DyadicTensor:
    """x, or a TypeError naming it ``name`` unless it is a DyadicTensor."""
    if not isinstance(x, DyadicTensor):
        raise TypeError(f"{name} must be a DyadicTensor, got {type(x).__name__}")
    return x


def _random_args(rounding, rbits, seed, offset) -> tuple:
    rule = check_rule(rounding, ROUNDINGS, "dyadic operations")
    return int(rule), check_rbits(rbits, rule), seed_argument(seed, rule), check_offset(offset)


def check_overflow(
    count: int,
    what: str,
    bounds: tuple[int, int],
    overflow: str = "raise",
    *,
    can_saturate: bool = True,
) -> None:
    """Report ``count`` results of ``what`` that fell outside ``bounds``: OverflowError under
    overflow="raise" (naming overflow="saturate" as the alternative where the caller has one,
    ``can_saturate``), a DyadicOverflowWarning under "saturate". Nothing when count is 0."""
    if count == 0:
        return
    message = f"{what}: {count} result(s) outside [{bounds[0]}, {bounds[1]}]"
    if check_choice("overflow", overflow, OVERFLOW_POLICIES) == "raise":
        if can_saturate:
            message += " (overflow='saturate' clips them instead, with a warning)"
        raise OverflowError(message)
    warnings.warn(message + "; saturated", DyadicOverflowWarning, stacklevel=3)


def integer_range(bits: int, signed: bool = True) -> tuple[int, int]:
    """(Qmin, Qmax) of a ``bits``-bit integer: [-2**(bits-1), 2**(bits-1) - 1] signed (2 to 64
    bits), [0, 2**bits - 1] unsigned (1 to 63 bits).

    >>> integer_range(8), integer_range(8, signed=False)
    ((-128, 127), (0, 255))
    """
    if not isinstance(signed, bool):
        raise TypeError(f"signed must be a bool, got {type(signed).__name__}")
    if signed:
        b = check_int("bits", bits, 2, 64)
        return -(2 ** (b - 1)), 2 ** (b - 1) - 1
    b = check_int("bits", bits, 1, 63)
    return 0, 2**b - 1


def accumulator_range(accumulator_bits: int) -> tuple[int, int]:
    """integer_range of a signed accumulator, with errors that name ``accumulator_bits``."""
    return integer_range(check_int("accumulator_bits", accumulator_bits, 2, 64))


def _storage(bounds: tuple[int, int], dtype: torch.dtype | None) -> torch.dtype:
    """The mantissa dtype for values in bounds: int32 when they fit, unless dtype says int64."""
    fits32 = _INT32[0] <= bounds[0] and bounds[1] <= _INT32[1]
    if dtype is None:
        return torch.int32 if fits32 else torch.int64
    if dtype not in (torch.int32, torch.int64):
        raise TypeError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
    if dtype == torch.int32 and not fits32:
        raise ValueError(f"the range [{bounds[0]}, {bounds[1]}] does not fit torch.int32")
    return dtype


def _inner(shape: torch.Size, axis: int | None) -> int:
    """Elements per class run for the kernels' class mapping (i / inner) % classes."""
    if axis is None:
        return max(math.prod(shape), 1)
    return max(math.prod(shape[axis + 1 :]), 1)


def _shifts(shift) -> list[int]:
    """Per-class shifts as the kernels take them: [k] for an int, k.tolist() for a tensor. No
    channels (a per-channel axis of size 0, so no elements) is one class no element reads."""
    return (shift.tolist() or [0]) if isinstance(shift, torch.Tensor) else [shift]


# ---- conversions --------------------------------------------------------------------------------


def _channel_reduce(values: torch.Tensor, axis: int | None, reduce) -> torch.Tensor:
    """``reduce`` (torch.amax or torch.amin) of values over everything (a 0-d tensor) or over all
    dimensions but ``axis`` (one entry per channel); empty tensors and channels give 0."""
    if axis is None:
        return reduce(values) if values.numel() else values.new_zeros(())
    if not values.numel():
        return values.new_zeros(values.shape[axis])
    others = [d for d in range(values.dim()) if d != axis]
    return reduce(values, dim=others) if others else values


def scale_for(
    x: torch.Tensor, bits: int, signed: bool = True, axis: int | None = None
) -> int | torch.Tensor:
    """The scale at which x's largest magnitude uses the top bit of a ``bits``-bit integer.

    With floor(log2 max|x|) = e this is bits - 2 - e (signed) or bits - 1 - e (unsigned), so
    max|x| * 2**scale lies in [2**(bits-2), 2**(bits-1)) (signed): only rounding up can reach
    Qmax + 1 and clip, by at most one unit. An all-zero tensor (or channel) gets the scale of a
    largest magnitude in [0.5, 1). Returns an int, or with ``axis`` (negative counts from the
    end) an int64 tensor per channel.

    Raises:
        TypeError: x is not a real floating or integer tensor (complex, bool) or not strided
            (sparse, nested); an argument has the wrong type.
        ValueError: x has NaN or Inf or is a meta tensor, or bits is out of range.
        IndexError: ``axis`` does not exist in x.
    """
    check_tensor(x)
    if x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"x must be a real floating or integer tensor, got {x.dtype}")
    check_strided(x, "x", "lpsim.dyadic.scale_for")
    if x.is_meta:
        raise ValueError("x is a meta tensor, which holds no values: scale_for reads its values")
    integer_range(bits, signed)
    if axis is not None:
        axis = normalize_axis(axis, x.dim())
    x = x.detach()
    if x.dtype.is_floating_point:
        # float64 holds every value of every float dtype (float8_e8m0fnu too) exactly.
        peak = _channel_reduce(x.to(torch.float64).abs(), axis, torch.amax)
        if not bool(torch.isfinite(peak).all()):
            raise ValueError("x must be finite, found NaN or Inf")
        _, exponent = torch.frexp(peak)  # peak = f * 2**exponent, f in [0.5, 1): e = exponent - 1
    else:
        # Integers are read exactly: float64 rounds those above 2**53, and rounding up to a power
        # of two would make the scale one too coarse. The exponent is the bit length of the
        # largest magnitude; a uint64 is read as int64, where values from 2**63 are negative.
        wide = x.view(torch.int64) if x.dtype == torch.uint64 else x.to(torch.int64)
        top = _channel_reduce(wide, axis, torch.amax)
        bottom = _channel_reduce(wide, axis, torch.amin)
        lengths = [
            64 if x.dtype == torch.uint64 and b < 0 else max(t, -b).bit_length()
            for t, b in zip(top.reshape(-1).tolist(), bottom.reshape(-1).tolist())
        ]
        exponent = torch.tensor(lengths, dtype=torch.int64).reshape(top.shape)
    scale = bits - 1 - exponent.to(torch.int64) + (0 if signed else 1)
    return int(scale) if axis is None else scale


def from_float(
    x: torch.Tensor,
    bits: int = 8,
    scale: int | list[int] | None = None,
    *,
    signed: bool = True,
    axis: int | None = None,
    dtype: torch.dtype | None = None,
    rounding: Rounding | str = "nearest",
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
) -> Requantized:
    """x as a ``bits``-bit dyadic tensor: clip(round(x * 2**scale), Qmin, Qmax) at ``scale``.

    The conversion reads each float's exact bits (sign, integer significand, exponent) and shifts
    the significand with the integer rounding: no floating-point arithmetic.

    Args:
        x: a finite float tensor (float16, bfloat16 and the float8 dtypes are widened exactly
            to float32).
        bits: the integer width, sign included (see integer_range).
        scale: an int, a per-channel sequence/tensor along ``axis``, or None: scale_for(x, ...).
        signed: two's complement [-2**(bits-1), 2**(bits-1) - 1], else [0, 2**bits - 1].
        axis: the dimension of a per-channel scale; None for one scale.
        dtype: the mantissa dtype; default int32 when the range fits it, else int64.
        rounding, rbits, seed, offset: as for requantize (default "nearest" here).

    Returns:
        Requantized(value, clipped).

    Raises:
        TypeError: x is not a float tensor or is sparse; an argument has the wrong type.
        ValueError: x is not on the CPU or has NaN or Inf, or an argument is out of range.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating tensor, got {x.dtype}")
    check_cpu_dense(x, "x", "lpsim.dyadic.from_float")
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()  # float16, bfloat16 and the float8 dtypes: every value exactly
    bounds = integer_range(bits, signed)
    storage = _storage(bounds, dtype)
    if axis is not None:
        axis = normalize_axis(axis, x.dim())
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"x must be finite, found {int((~torch.isfinite(x)).sum())} NaN or Inf")
    if scale is None:
        scale = scale_for(x, bits, signed, axis)
    scale, axis = normalize_scale(scale, x.shape, axis)
    mantissa, clipped = call(
        "dyadic_from_float",
        x.detach(),
        _shifts(scale),
        _inner(x.shape, axis),
        bounds[0],
        bounds[1],
        storage,
        *_random_args(rounding, rbits, seed, offset),
    )
    return Requantized(DyadicTensor(mantissa, scale, axis), clipped)


def _target_shifts(x: DyadicTensor, scale, axis: int | None):
    """(shift per class, the classes' axis, target scale, the target's axis) of requantising x to
    ``scale``. A per-tensor target of a per-channel x has shifts per channel of x."""
    if not isinstance(scale, (list, tuple, torch.Tensor)) or (
        isinstance(scale, torch.Tensor) and scale.dim() == 0
    ):  # one scale: an int, checked
        if axis is not None:
            raise ValueError(
                f"axis= goes with a per-channel target scale; got axis={axis!r} with one scale "
                f"({scale!r}): leave axis=None"
            )
        target, _ = normalize_scale(scale, x.shape, None)
        return x.scale - target, x.axis, target, None
    axis = x.axis if axis is None else axis
    if axis is None:
        raise ValueError("a per-channel target scale needs axis= (x has one scale)")
    target, axis = normalize_scale(scale, x.shape, axis)
    if x.axis is not None and x.axis != axis:
        raise ValueError(f"x's scale runs along axis {x.axis}, the target's along {axis}")
    return x.scale - target, axis, target, axis


def requantize(
    x: DyadicTensor,
    scale: int | list[int],
    bits: int,
    signed: bool = True,
    rounding: Rounding | str = "stochastic",
    *,
    axis: int | None = None,
    dtype: torch.dtype | None = None,
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
) -> Requantized:
    """R(x, t) = (clip(round(v / 2**(s - t)), Qmin, Qmax), t): x on the grid of scale t.

    A coarser target (t < s) shifts the mantissa right by s - t with the rounding; a finer one
    shifts it left, exactly. The clip mask is what the straight-through estimator uses: the
    gradient passes through the rounding and is zeroed where the clip fired.

    Args:
        x: a DyadicTensor.
        scale: the target scale t: an int, or per channel along ``axis`` (default x.axis).
        bits, signed: the target integer, see integer_range.
        rounding: "stochastic" (default), "nearest" (ties to even) or "down" (floor).
        axis: the dimension of a per-channel target when x has a per-tensor scale (a
            ValueError with a target of one scale, which has no axis).
        dtype: the result's mantissa dtype; default int32 when [Qmin, Qmax] fits it, else int64.
        rbits: random bits per decision, 1 to 32 (stochastic only; default 32).
        seed: 0 <= seed < 2**64 (stochastic only); None draws one from torch's default generator.
        offset: 0 <= offset < 2**64, the random stream under the seed.

    Returns:
        Requantized(value, clipped): the new tensor and a bool tensor of where the clip fired.

    Raises:
        TypeError, ValueError: an argument has the wrong type or is out of range.
    """
    check_dyadic("x", x)
    bounds = integer_range(bits, signed)
    storage = _storage(bounds, dtype)
    shifts, shift_axis, target, target_axis = _target_shifts(x, scale, axis)
    mantissa, clipped = call(
        "dyadic_requantize",
        x.mantissa,
        _shifts(shifts),
        _inner(x.shape, shift_axis),
        bounds[0],
        bounds[1],
        storage,
        *_random_args(rounding, rbits, seed, offset),
    )
    return Requantized(DyadicTensor(mantissa, target, target_axis), clipped)


def fit_shift(x: DyadicTensor, bits: int, signed: bool = True) -> int:
    """The smallest right shift k >= 0 after which every mantissa of x fits a ``bits``-bit
    integer before rounding (rounding up may still reach Qmax + 1, which the clip catches).

    This is the dynamic shift the integer layers use: requantize(x, x.scale - k, bits).
    """
    check_dyadic("x", x)
    integer_range(bits, signed)
    if x.mantissa.numel() == 0:
        return 0
    top, bottom = int(x.mantissa.max()), int(x.mantissa.min())
    needed = top.bit_length() if top > 0 else 0
    if signed and bottom < 0:
        needed = max(needed, (-bottom - 1).bit_length())
    return max(0, needed - (bits - 1 if signed else bits))


# ---- elementwise arithmetic ---------------------------------------------------------------------


class _Pair(NamedTuple):
    """Two operands broadcast to one shape and dtype, with their scales along the result's axis:
    ints when both are per tensor, else int64 tensors of one entry per channel."""

    a: torch.Tensor
    b: torch.Tensor
    scale_a: int | torch.Tensor
    scale_b: int | torch.Tensor
    axis: int | None
    inner: int


def _pair(a: DyadicTensor, b: DyadicTensor) -> _Pair:
    check_dyadic("a", a)
    check_dyadic("b", b)
    va, vb = a.mantissa, b.mantissa
    if va.dtype != vb.dtype:
        va, vb = va.to(torch.int64), vb.to(torch.int64)
    if va.shape != vb.shape:
        va, vb = torch.broadcast_tensors(va, vb)
    ndim = va.dim()
    axis_a = None if a.axis is None else a.axis + ndim - a.mantissa.dim()
    axis_b = None if b.axis is None else b.axis + ndim - b.mantissa.dim()
    if axis_a is not None and axis_b is not None and axis_a != axis_b:
        raise ValueError(
            f"a's scale runs along dimension {axis_a} of the result and b's along "
            f"{axis_b}: the result would need a scale per pair of channels"
        )
    axis = axis_a if axis_a is not None else axis_b
    sa, sb = a.scale, b.scale
    if axis is not None:  # per-tensor scales and broadcast length-1 channels repeat
        channels = va.shape[axis]
        sa = torch.as_tensor(sa, dtype=torch.int64).expand(channels)
        sb = torch.as_tensor(sb, dtype=torch.int64).expand(channels)
    return _Pair(va.contiguous(), vb.contiguous(), sa, sb, axis, _inner(va.shape, axis))


def _coarser(p: _Pair):
    """The coarser of the two scales, per channel."""
    if p.axis is None:
        return min(p.scale_a, p.scale_b)
    return torch.minimum(p.scale_a, p.scale_b)


def _add(a, b, subtract, rounding, rbits, seed, offset) -> Saturated:
    p = _pair(a, b)
    scale = _coarser(p)
    out, count = call(
        "dyadic_add",
        p.a,
        p.b,
        _shifts(p.scale_a - scale),
        _shifts(p.scale_b - scale),
        p.inner,
        subtract,
        *_random_args(rounding, rbits, seed, offset),
    )
    return Saturated(DyadicTensor(out, scale, p.axis), int(count))


def saturating_add(
    a: DyadicTensor,
    b: DyadicTensor,
    *,
    rounding: Rounding | str = "stochastic",
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
) -> Saturated:
    """a + b as add() computes it (default rounding "stochastic", used only to align the finer
    operand), with sums outside the mantissa's dtype saturated and counted instead of reported.

    Raises:
        TypeError, ValueError: as add().
    """
    return _add(a, b, False, rounding, rbits, seed, offset)


def saturating_sub(
    a: DyadicTensor,
    b: DyadicTensor,
    *,
    rounding: Rounding | str = "stochastic",
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
) -> Saturated:
    """a - b as sub() computes it (default rounding "stochastic", used only to align the finer
    operand), with differences outside the mantissa's dtype saturated and counted.

    Raises:
        TypeError, ValueError: as sub().
    """
    return _add(a, b, True, rounding, rbits, seed, offset)


def _result_scale(function: str, formula: str, scale):
    """The scale (an int or a per-channel tensor) of a result, checked before the kernel runs: a
    ValueError naming ``function`` and ``formula`` where it leaves [-2**30, 2**30]."""
    if isinstance(scale, torch.Tensor):
        if not scale.numel():
            return scale
        low, high = int(scale.min()), int(scale.max())
    else:
        low = high = scale
    if not (-MAX_SCALE <= low and high <= MAX_SCALE):
        value = scale if not isinstance(scale, torch.Tensor) else scale.tolist()
        raise ValueError(
            f"{function}: the result's scale {formula} = {value} is outside [-2**30, 2**30]"
        )
    return scale


def _bounds_of(dtype: torch.dtype) -> tuple[int, int]:
    info = torch.iinfo(dtype)
    return info.min, info.max


def align(
    a: DyadicTensor,
    b: DyadicTensor,
    *,
    rounding: Rounding | str = "stochastic",
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
) -> tuple[DyadicTensor, DyadicTensor]:
    """a and b, broadcast to one shape, both at the coarser scale min(s_a, s_b) (per channel):
    the finer operand's mantissa is shifted right by the difference with the rounding
    ("stochastic" by default; rbits, seed and offset as for requantize).

    With the same seed and offset, add(a, b) is exactly the sum of the aligned mantissas; without
    a seed both operands use the one seed drawn from torch's default generator, as add() does, so
    the same generator state gives the same equality.

    Raises:
        TypeError, ValueError: an operand is not a DyadicTensor, the per-channel axes differ, or a
            random argument is out of range.
    """
    p = _pair(a, b)
    scale = _coarser(p)
    rule, bits, seed_arg, stream = _random_args(rounding, rbits, seed, offset)
    if seed_arg is None and Rounding(rule).is_stochastic:
        # One call, one seed, as for every other operation: both operands' shifts draw from it
        # (each element uses one word: one operand is shifted per element). Each op drawing its
        # own seed took two draws here, and one under torch.compile, which draws it in Python.
        seed_arg = draw_seed()
    random = (rule, bits, seed_arg, stream)
    bounds = _bounds_of(p.a.dtype)
    out = []
    for mantissa, own in ((p.a, p.scale_a), (p.b, p.scale_b)):
        shifted, _ = call(
            "dyadic_requantize",
            mantissa,
            _shifts(own - scale),
            p.inner,
            bounds[0],
            bounds[1],
            mantissa.dtype,
            *random,
        )
        out.append(DyadicTensor(shifted, scale, p.axis))
    return out[0], out[1]


def add(
    a: DyadicTensor,
    b: DyadicTensor,
    *,
    rounding: Rounding | str = "stochastic",
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
    overflow: str = "raise",
) -> DyadicTensor:
    """a + b at the coarser scale: align, then add the mantissas exactly (broadcasting).

    The mantissa dtype is the wider of the two; a sum outside it is an overflow (see the module
    docstring). Per-channel scales must run along the same dimension of the result. The rounding
    ("stochastic" by default) applies to the alignment only; operands at one scale add exactly.

    Raises:
        TypeError, ValueError: as align(), or overflow is not "raise" or "saturate".
        OverflowError: a sum overflows under overflow="raise".
    """
    check_choice("overflow", overflow, OVERFLOW_POLICIES)
    result, count = _add(a, b, False, rounding, rbits, seed, offset)
    check_overflow(count, "lpsim.dyadic.add", _bounds_of(result.dtype), overflow)
    return result


def sub(
    a: DyadicTensor,
    b: DyadicTensor,
    *,
    rounding: Rounding | str = "stochastic",
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
    overflow: str = "raise",
) -> DyadicTensor:
    """a - b at the coarser scale, as add() (default rounding "stochastic", errors as add())."""
    check_choice("overflow", overflow, OVERFLOW_POLICIES)
    result, count = _add(a, b, True, rounding, rbits, seed, offset)
    check_overflow(count, "lpsim.dyadic.sub", _bounds_of(result.dtype), overflow)
    return result


def mul(
    a: DyadicTensor,
    b: DyadicTensor,
    shift: int = 0,
    *,
    rounding: Rounding | str = "stochastic",
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
    overflow: str = "raise",
) -> DyadicTensor:
    """a * b with the product shifted right by ``shift`` (q >= 0): mantissa round(v_a v_b / 2**q)
    at scale s_a + s_b - q. The product is exact (64 bits for int32 operands, 128 for int64)
    before the one rounding ("stochastic" by default); shift=0 is exact.

    Raises:
        TypeError, ValueError: as add(), or shift is not an int in [0, 2**30].
        OverflowError: a product overflows under overflow="raise".
    """
    check_choice("overflow", overflow, OVERFLOW_POLICIES)
    check_int("shift", shift, 0, 2**30)
    p = _pair(a, b)
    scale = _result_scale("lpsim.dyadic.mul", "s_a + s_b - shift", p.scale_a + p.scale_b - shift)
    out, count = call("dyadic_mul", p.a, p.b, shift, *_random_args(rounding, rbits, seed, offset))
    check_overflow(int(count), "lpsim.dyadic.mul", _bounds_of(out.dtype), overflow)
    return DyadicTensor(out, scale, p.axis)


def div(
    a: DyadicTensor,
    b: DyadicTensor,
    shift: int,
    *,
    rounding: Rounding | str = "stochastic",
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
    overflow: str = "raise",
) -> DyadicTensor:
    """a / b with the dividend shifted left by ``shift`` (p) first: mantissa
    round(v_a 2**p / v_b) at scale s_a - s_b + p. p is 0 to 31 for int32 mantissas, 0 to 63 for
    int64 (the shifted dividend is exact in 64 or 128 bits). The rounding is "stochastic" by
    default; stochastic rounding of a quotient rounds up with probability
    floor(frac * 2**rbits) / 2**rbits.

    Raises:
        TypeError, ValueError: as mul(), with shift's range as stated.
        ZeroDivisionError: an element of b is 0.
        OverflowError: a quotient overflows under overflow="raise".
    """
    check_choice("overflow", overflow, OVERFLOW_POLICIES)
    p = _pair(a, b)
    check_int("shift", shift, 0, 31 if p.a.dtype == torch.int32 else 63)
    zeros = int((p.b == 0).sum())
    if zeros:
        raise ZeroDivisionError(f"lpsim.dyadic.div: b is 0 in {zeros} element(s)")
    scale = _result_scale("lpsim.dyadic.div", "s_a - s_b + shift", p.scale_a - p.scale_b + shift)
    out, count = call("dyadic_div", p.a, p.b, shift, *_random_args(rounding, rbits, seed, offset))
    check_overflow(int(count), "lpsim.dyadic.div", _bounds_of(out.dtype), overflow)
    return DyadicTensor(out, scale, p.axis)


# ---- products -----------------------------------------------------------------------------------


def saturating_matmul(a: DyadicTensor, b: DyadicTensor, *, accumulator_bits: int = 32) -> Saturated:
    """The product matmul() computes, exact (no rounding), with sums outside the accumulator's
    range saturated to it and counted instead of reported.

    Raises:
        TypeError: an operand is not a DyadicTensor, or accumulator_bits is not an int.
        ValueError: the shapes or the operands' per-channel axes do not allow the product, or
            accumulator_bits is outside [2, 64].
    """
    check_dyadic("a", a)
    check_dyadic("b", b)
    if a.mantissa.dim() != 2 or b.mantissa.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"matmul needs (N, K) and (K, M) tensors, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.axis == 1 or b.axis == 0:
        raise ValueError(
            "matmul: a per-channel scale along the summed dimension would add "
            "terms of different scales; align them first"
        )
    if a.axis is not None and b.axis is not None:
        raise ValueError(
            "matmul: per-channel scales on both operands would need a scale per "
            "element of the result"
        )
    bounds = accumulator_range(accumulator_bits)
    scale = _result_scale("lpsim.dyadic.matmul", "s_a + s_b", a.scale + b.scale)
    dtype = torch.promote_types(a.dtype, b.dtype)
    out, count = call("dyadic_matmul", a.mantissa.to(dtype), b.mantissa.to(dtype), *bounds)
    axis = 0 if a.axis is not None else 1 if b.axis is not None else None
    return Saturated(DyadicTensor(out, scale, axis), int(count))


def matmul(
    a: DyadicTensor, b: DyadicTensor, *, accumulator_bits: int = 32, overflow: str = "raise"
) -> DyadicTensor:
    """The matrix product of (N, K) a and (K, M) b at scale s_a + s_b, as an accumulator of
    ``accumulator_bits`` bits would compute it.

    The sums are exact (int64, or int128 when the operands' magnitudes require it), then checked
    against the accumulator's range: a two's complement accumulator that wraps ends with the
    exact sum precisely when the exact sum is in range, so an out-of-range sum is exactly a wrong
    result, and it is reported (see the module docstring). The result is int32 when the
    accumulator has at most 32 bits. a may have a per-channel scale along its rows (axis 0) or b
    along its columns (axis 1), not both. Nothing is rounded.

    Raises:
        TypeError, ValueError: as saturating_matmul(), or overflow is not "raise" or "saturate".
        OverflowError: a sum leaves the accumulator's range under overflow="raise".
    """
    check_choice("overflow", overflow, OVERFLOW_POLICIES)
    result, count = saturating_matmul(a, b, accumulator_bits=accumulator_bits)
    check_overflow(count, "lpsim.dyadic.matmul", accumulator_range(accumulator_bits), overflow)
    return result


def saturating_sum(x: DyadicTensor, dim: int, *, accumulator_bits: int = 32) -> Saturated:
    """The sum sum() computes, exact, with sums outside the accumulator's range saturated to it
    and counted instead of reported.

    Raises:
        TypeError: x is not a DyadicTensor, or dim or accumulator_bits is not an int.
        ValueError: x is not 2-D, or dim or accumulator_bits is out of range.
    """
    check_dyadic("x", x)
    if x.mantissa.dim() != 2:
        raise ValueError(f"sum needs a 2-D tensor, got {x.mantissa.dim()} dimensions")
    check_int("dim", dim, -2, 1)
    if dim % 2 == 0:  # a row of ones times x
        total, count = saturating_matmul(
            DyadicTensor(torch.ones(1, x.shape[0], dtype=x.dtype)),
            x,
            accumulator_bits=accumulator_bits,
        )
    else:  # x times a column of ones
        total, count = saturating_matmul(
            x,
            DyadicTensor(torch.ones(x.shape[1], 1, dtype=x.dtype)),
            accumulator_bits=accumulator_bits,
        )
    flat = total.mantissa.reshape(-1)
    return Saturated(DyadicTensor(flat, total.scale, None if total.axis is None else 0), count)


def sum(
    x: DyadicTensor,
    dim: int,
    *,
    accumulator_bits: int = 32,  # noqa: A001 (as torch.sum)
    overflow: str = "raise",
) -> DyadicTensor:
    """The exact sum of a 2-D tensor over ``dim`` (0 or 1) at x's scale, checked against the
    accumulator like matmul (it is a product with a vector of ones). Nothing is rounded.

    Raises:
        TypeError, ValueError: as saturating_sum(), or overflow is not "raise" or "saturate".
        OverflowError: a sum leaves the accumulator's range under overflow="raise".
    """
    check_choice("overflow", overflow, OVERFLOW_POLICIES)
    result, count = saturating_sum(x, dim, accumulator_bits=accumulator_bits)
    check_overflow(count, "lpsim.dyadic.sum", accumulator_range(accumulator_bits), overflow)
    return result
