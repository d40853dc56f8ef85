"""QPyTorch's number formats (``qtorch.number``), each standing for an lpsim format (``.format``).

The formats keep the number ranges QPyTorch's kernels produce: in FloatingPoint the top exponent
code is finite, subnormals exist and overflow saturates (``FloatingPoint(5, 2)`` reaches 114688).
"""

from __future__ import annotations

import operator

from lpsim.formats import BlockFloat, Fixed, Float

__all__ = ["Number", "FixedPoint", "BlockFloatingPoint", "FloatingPoint"]


def integer(value):
    """value as a Python int where it is an integer of another type (numpy's int64, a 0-d integer
    tensor: what QPyTorch's pure-Python number classes accept); otherwise value itself, which
    lpsim's formats then check (a bool stays a bool, and is refused)."""
    if isinstance(value, (int, float, str)) or not hasattr(type(value), "__index__"):
        return value
    try:
        return operator.index(value)
    except TypeError:  # a tensor of several elements, or of a floating dtype
        return value


class Number:
    """A QPyTorch number format; ``.format`` is the equivalent lpsim format. Two numbers are equal
    when their lpsim formats are.

    A number cannot be changed once made (``number.fl = 6`` raises AttributeError): its lpsim
    format, and every quantizer made from it, would not follow. Make a new one instead."""

    format: Float | Fixed | BlockFloat

    def __setattr__(self, name: str, value) -> None:
        if "format" in self.__dict__:
            raise AttributeError(
                f"{self!r} cannot be changed (setting {name!r}); make a new {type(self).__name__}"
            )
        super().__setattr__(name, value)

    def __eq__(self, other) -> bool:
        return isinstance(other, Number) and self.format == other.format

    def __hash__(self) -> int:
        return hash(self.format)


class FloatingPoint(Number):
    """QPyTorch's FloatingPoint(exp, man): bias 2**(exp-1) - 1, subnormals, no Inf or NaN codes
    (the top exponent code is finite), overflow saturates to +/-max.

    With exp=8 that range would pass float32's; QPyTorch's kernels then never clip, and overflow
    and Inf behave as in IEEE float32, so FloatingPoint(8, man) is the IEEE Float(8, man).

    Raises:
        ValueError: exp or man out of range: exp 1 to 10, man 0 to 52 (lpsim's Float allows exp
            up to 11, but with the top exponent code finite exp=11 reaches 2**1024, which no
            container holds; QPyTorch allows exp 1 to 8 and man 1 to 23).
    """

    def __init__(self, exp: int, man: int):
        exp, man = integer(exp), integer(man)
        if isinstance(exp, int) and not isinstance(exp, bool) and not 1 <= exp <= 10:
            raise ValueError(
                f"FloatingPoint exp must be 1 to 10, got {exp} (with its top exponent code "
                "finite, exp=11 reaches 2**1024, beyond float64, the widest container)"
            )
        self.exp = exp
        self.man = man
        if isinstance(exp, int) and exp == 8:
            self.format = Float(exp, man)
        else:
            self.format = Float(exp, man, special="none", saturate=True)

    def __repr__(self) -> str:
        return f"FloatingPoint (exponent={self.exp:d}, mantissa={self.man:d})"


class FixedPoint(Number):
    """QPyTorch's FixedPoint(wl, fl, clamp=True, symmetric=False): values k * 2**-fl for wl-bit
    two's complement k; clamp saturates out-of-range values; symmetric drops the most negative.
    fl may be zero or negative (a spacing of 1 or more), which QPyTorch refuses."""

    def __init__(self, wl: int, fl: int, clamp: bool = True, symmetric: bool = False):
        wl, fl = integer(wl), integer(fl)
        self.wl = wl
        self.fl = fl
        self.clamp = clamp
        self.symmetric = symmetric
        self.format = Fixed(wl, fl, clamp=clamp, symmetric=symmetric)

    def __repr__(self) -> str:
        return f"FixedPoint (wl={self.wl:d}, fl={self.fl:d})"


class BlockFloatingPoint(Number):
    """QPyTorch's BlockFloatingPoint(wl, dim=-1): dim=-1 shares one exponent over the whole tensor
    (unlike torch's convention, where -1 is the last dimension); dim=d >= 0 shares one per index
    along d.

    Raises:
        ValueError: dim is not an int >= -1.
    """

    def __init__(self, wl: int, dim: int = -1):
        wl, dim = integer(wl), integer(dim)
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < -1:
            raise ValueError(f"BlockFloatingPoint.dim must be -1 or a dimension >= 0, got {dim!r}")
        self.wl = wl
        self.dim = dim
        self.format = BlockFloat(wl, None if dim == -1 else dim)

    def __repr__(self) -> str:
        return f"BlockFloatingPoint (wl={self.wl:d}, dim={self.dim:d})"


def lpsim_format(number: Number | None) -> Float | Fixed | BlockFloat | None:
    """The lpsim format of a QPyTorch number (None for None).

    Raises:
        TypeError: number is neither None nor a Number.
    """
    if number is not None and not isinstance(number, Number):
        raise TypeError(f"expected a qtorch number format (FloatingPoint, ...), got {number!r}")
    return None if number is None else number.format
