"""DyadicTensor: an integer mantissa tensor v and integer scales s, meaning the values v * 2**-s.

The scale is one integer for the whole tensor, or one per index along a dimension (``axis``, a
per-channel scale). A larger scale is a finer grid: (3, 2) is 0.75 and (3, 0) is 3. The mantissa
is an int32 or int64 tensor; the scales are plain integers and cost nothing to change, so
multiplying by a power of two (``ldexp``) is free and exact.

A DyadicTensor is a value: it holds its mantissa and scales and offers only exact operations
(``ldexp``, views, ``to_float``). Arithmetic that rounds or can overflow is a function of
lpsim.dyadic (add, mul, requantize, ...), where rounding, seed, offset and overflow policy are
arguments.

    >>> import torch
    >>> from lpsim.dyadic import DyadicTensor
    >>> x = DyadicTensor(torch.tensor([3, -5, 12], dtype=torch.int32), scale=2)
    >>> x.to_float()
    tensor([ 0.7500, -1.2500,  3.0000])
    >>> x.ldexp(3).scale, x.ldexp(3).to_float()
    (-1, tensor([  6., -10.,  24.]))
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

__all__ = ["DyadicTensor", "MAX_SCALE", "check_cpu_dense", "normalize_axis", "normalize_scale"]

MAX_SCALE = 2**30  # |scale| bound: far beyond any useful grid, small enough for every shift count

_MANTISSA_DTYPES = (torch.int32, torch.int64)


def _check_scale_value(s: int) -> int:
    if not isinstance(s, int) or isinstance(s, bool):
        raise TypeError(f"scale must be an int, got {type(s).__name__}")
    if not -MAX_SCALE <= s <= MAX_SCALE:
        raise ValueError(f"scale must be in [-2**30, 2**30], got {s}")
    return s


def check_cpu_dense(x: torch.Tensor, name: str, function: str) -> None:
    """Raises unless x is a dense CPU tensor, the only kind the integer kernels read: TypeError for
    a sparse layout or a nested tensor, ValueError for another device (the messages call x
    ``name`` and the caller ``function``)."""
    if x.is_nested:  # a nested tensor may have torch.strided as its layout
        raise TypeError(f"{name} is a nested tensor; {function} takes dense (strided) tensors")
    if x.layout != torch.strided:
        layout = str(x.layout).replace("torch.", "")
        raise TypeError(f"{name} is a {layout} tensor; {function} takes dense (strided) tensors")
    if x.device.type != "cpu":
        raise ValueError(
            f"{name} must be a CPU tensor ({function} runs on the CPU), got one on {x.device}"
        )


def normalize_axis(axis: int, ndim: int) -> int:
    """``axis`` as a dimension index in [0, ndim), checked."""
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"axis must be an int or None, got {type(axis).__name__}")
    if not -ndim <= axis < ndim:
        raise IndexError(
            f"axis must be in [{-ndim}, {ndim - 1}] for a tensor of {ndim} dimensions, got {axis}"
        )
    return axis % ndim


def normalize_scale(scale, shape: torch.Size, axis: int | None) -> tuple:
    """(scale, axis) checked for a mantissa of ``shape``: an int and None, or a 1-D int64 tensor
    with one entry per index along the non-negative ``axis``."""
    if axis is None:
        if isinstance(scale, torch.Tensor) and scale.dim() == 0:
            if scale.dtype.is_floating_point or scale.dtype.is_complex or scale.dtype == torch.bool:
                raise TypeError(f"scale must be an int, got a {scale.dtype} tensor")
            scale = int(scale)
        if isinstance(scale, (Sequence, torch.Tensor)) and not isinstance(scale, str):
            raise TypeError(
                f"scale must be an int, got {type(scale).__name__}: a per-channel scale needs "
                "axis= (the dimension it runs along)"
            )
        return _check_scale_value(scale), None
    axis = normalize_axis(axis, len(shape))
    if isinstance(scale, Sequence) and not isinstance(scale, str):
        # Each entry as a scale of its own: True is not 1, and 2**63 is out of range (not an
        # error from the conversion to a tensor).
        for entry in scale:
            if isinstance(entry, bool) or not isinstance(entry, numbers.Integral):
                raise TypeError(
                    f"a per-channel scale must hold integers, got {type(entry).__name__}"
                )
            _check_scale_value(int(entry))
        # int64 explicitly: an empty sequence (a dimension of size 0) would become float32.
        s = torch.tensor([int(entry) for entry in scale], dtype=torch.int64)
    else:
        s = torch.as_tensor(scale)
    if s.dtype.is_floating_point or s.dtype == torch.bool or s.dtype.is_complex:
        raise TypeError(f"a per-channel scale must hold integers, got {s.dtype}")
    # A copy: the scales are part of the value, and a caller's tensor changed in place later
    # would change them (past the range check below).
    s = s.to(torch.int64).reshape(-1).clone()
    if s.numel() != shape[axis]:
        raise ValueError(
            f"a per-channel scale along axis {axis} needs {shape[axis]} entries, got {s.numel()}"
        )
    if s.numel():  # min and max, not abs(): abs(-2**63) wraps to -2**63 in int64
        for bound in (int(s.min()), int(s.max())):
            _check_scale_value(bound)
    return s, axis


class DyadicTensor:
    """Values mantissa * 2**-scale, the scale per tensor or per channel.

    Args:
        mantissa: an int32 or int64 dense CPU tensor, any shape (kept as given, not copied).
        scale: an int (one scale for the tensor), or with ``axis`` a 1-D int64 tensor or sequence
            of ints, one per index along ``axis`` (copied). Every scale lies in [-2**30, 2**30].
        axis: the dimension a per-channel scale runs along (negative counts from the end); None
            for a per-tensor scale.

    Raises:
        TypeError: the mantissa is not an int32/int64 tensor or is sparse, or a scale is not an
            integer.
        ValueError: the mantissa is not on the CPU, a scale is out of range, or a per-channel
            scale's length differs from the size of ``axis``.
        IndexError: ``axis`` does not exist in the mantissa.
    """

    __slots__ = ("mantissa", "scale", "axis")

    def __init__(
        self,
        mantissa: torch.Tensor,
        scale: int | Sequence[int] | torch.Tensor = 0,
        axis: int | None = None,
    ):
        if not isinstance(mantissa, torch.Tensor):
            raise TypeError(f"mantissa must be a torch.Tensor, got {type(mantissa).__name__}")
        if mantissa.dtype not in _MANTISSA_DTYPES:
            raise TypeError(f"mantissa must be an int32 or int64 tensor, got {mantissa.dtype}")
        check_cpu_dense(mantissa, "mantissa", "DyadicTensor")
        self.mantissa = mantissa
        self.scale, self.axis = normalize_scale(scale, mantissa.shape, axis)

    # ---- facts -------------------------------------------------------------------------------

    @property
    def shape(self) -> torch.Size:
        """The mantissa's shape."""
        return self.mantissa.shape

    @property
    def dtype(self) -> torch.dtype:
        """The mantissa's dtype, int32 or int64."""
        return self.mantissa.dtype

    @property
    def per_channel(self) -> bool:
        """Whether the scale is one per index along ``axis`` (else one for the tensor)."""
        return self.axis is not None

    def scales(self) -> torch.Tensor:
        """The scale of every element as an int64 tensor that broadcasts against the mantissa."""
        if self.axis is None:
            return torch.tensor(self.scale, dtype=torch.int64)
        view = [1] * self.mantissa.dim()
        view[self.axis] = -1
        return self.scale.reshape(view)

    def to_float(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values mantissa * 2**-scale as a float tensor of ``dtype``, for reading results (no
        dyadic operation goes through floating point).

        Every value is rounded once, to nearest with ties to even, into ``dtype`` (float32,
        float64, float16 or bfloat16), for any mantissa and scale: subnormal results included,
        values beyond the largest finite number become +/-inf, and a tiny negative value -0.0.
        The rounding is done on the integers (the mantissa shifted right to ``dtype``'s
        precision at the value's exponent), so the float arithmetic that follows is exact.
        """
        if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            raise TypeError(
                f"dtype must be torch.float32, float64, float16 or bfloat16, got {dtype}"
            )
        if dtype in (torch.float32, torch.float64) and self._exact_in_float64():
            # The products are exact normal float64 numbers and the cast rounds them once: the
            # same results as below, about 20 times faster (2**22 elements, one core).
            power = torch.pow(2.0, -self.scales().to(torch.float64))
            return (self.mantissa.to(torch.float64) * power).to(dtype)
        info = torch.finfo(dtype)
        precision = 1 - math.frexp(info.eps)[1] + 1  # significand bits, the implicit one included
        emin = math.frexp(info.tiny)[1] - 1  # exponent of the smallest normal number
        v = self.mantissa.to(torch.int64)
        scale = self.scales().expand(v.shape)
        lowest = v == torch.iinfo(torch.int64).min  # -2**63 is -2**62 at scale - 1 (|v| fits)
        v = torch.where(lowest, v // 2, v)
        scale = scale - lowest.to(torch.int64)
        magnitude = v.abs()
        # Bit length n of |v|: from frexp of its float64, one less where that rounded up across a
        # power of two. The value lies in [2**e, 2**(e+1)) with e = n - 1 - scale.
        length = torch.frexp(magnitude.to(torch.float64))[1].to(torch.int64)
        length = length - ((magnitude >> (length - 1).clamp(0, 63)) == 0).to(torch.int64)
        exponent = length - 1 - scale
        # Right shift to the grid of dtype's unit in the last place at that exponent (none when
        # the value is on it already); shifts past 63 bits leave less than half a unit: 0.
        shift = (torch.maximum(exponent, torch.tensor(emin)) - (precision - 1) + scale).clamp_min(0)
        short = shift.clamp_max(63)
        kept = magnitude >> short
        rest = magnitude - (kept << short)
        half = torch.where(short > 0, torch.ones_like(short) << (short - 1).clamp_min(0), 0)
        up = (short > 0) & ((rest > half) | ((rest == half) & (kept % 2 == 1)))
        kept = torch.where(shift > 63, 0, kept + up.to(torch.int64))
        # kept has at most precision + 1 bits and kept * 2**(shift - scale) is representable in
        # float64 or beyond dtype's range: one exact product (inf where it overflows), then an
        # exact cast (inf beyond dtype's range, which is where the rounded value lies then).
        power = torch.pow(2.0, (shift - scale).to(torch.float64))
        values = torch.where(kept == 0, 0.0, kept.to(torch.float64) * power)
        values = torch.where(v < 0, -values, values)
        return values.to(dtype)

    def _exact_in_float64(self) -> bool:
        """Whether every mantissa has at most 53 bits and every nonzero value mantissa * 2**-scale
        is a normal float64 number: |mantissa| < 2**53 and -970 <= scale <= 1022."""
        v, scales = self.mantissa, self.scales()
        if v.numel() == 0:
            return True
        fits = v.dtype == torch.int32 or (int(v.min()) > -(2**53) and int(v.max()) < 2**53)
        return fits and -970 <= int(scales.min()) and int(scales.max()) <= 1022

    # ---- exact rescaling and views ------------------------------------------------------------

    def ldexp(self, exponent: int) -> DyadicTensor:
        """These values times 2**exponent: the same mantissa at scale - exponent (exact, free).

        Raises:
            TypeError: exponent is not an int.
            ValueError: a scale - exponent would leave [-2**30, 2**30] (the message gives the
                exponents that keep every scale in it).
        """
        if not isinstance(exponent, int) or isinstance(exponent, bool):
            raise TypeError(f"exponent must be an int, got {type(exponent).__name__}")
        if self.axis is None:
            low = high = self.scale
        elif self.scale.numel():
            low, high = int(self.scale.min()), int(self.scale.max())
        else:
            low = high = 0
        # Checked on Python ints: a per-channel scale tensor minus a huge exponent would wrap.
        if not (-MAX_SCALE <= low - exponent and high - exponent <= MAX_SCALE):
            raise ValueError(
                f"exponent {exponent} moves the scale {self._scale_text()} out of "
                f"[-2**30, 2**30]: exponent must be in [{high - MAX_SCALE}, {low + MAX_SCALE}]"
            )
        return DyadicTensor(self.mantissa, self.scale - exponent, self.axis)

    def _scale_text(self) -> str:
        return str(self.scale) if self.axis is None else str(self.scale.tolist())

    def with_mantissa(self, mantissa: torch.Tensor) -> DyadicTensor:
        """A tensor of the same scales with another mantissa of the same shape."""
        if mantissa.shape != self.mantissa.shape:
            raise ValueError(
                f"mantissa must have shape {tuple(self.shape)}, got {tuple(mantissa.shape)}"
            )
        return DyadicTensor(mantissa, self.scale, self.axis)

    def masked_zero(self, mask: torch.Tensor) -> DyadicTensor:
        """These values with the elements where ``mask`` is True set to zero."""
        return self.with_mantissa(self.mantissa.masked_fill(mask, 0))

    def t(self) -> DyadicTensor:
        """The transpose of a 2-D tensor (a per-channel axis moves with its dimension)."""
        if self.mantissa.dim() != 2:
            raise ValueError(f"t() needs a 2-D tensor, got {self.mantissa.dim()} dimensions")
        axis = None if self.axis is None else 1 - self.axis
        return DyadicTensor(self.mantissa.t(), self.scale, axis)

    def clone(self) -> DyadicTensor:
        """A copy that shares no storage with this tensor."""
        scale = self.scale if self.axis is None else self.scale.clone()
        return DyadicTensor(self.mantissa.clone(), scale, self.axis)

    def __repr__(self) -> str:
        scale = self.scale if self.axis is None else self.scale.tolist()
        axis = "" if self.axis is None else f", axis={self.axis}"
        return f"DyadicTensor(mantissa={self.mantissa!r}, scale={scale}{axis})"
