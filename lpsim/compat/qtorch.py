"""QPyTorch 0.3's names and signatures, so that a QPyTorch script changes one import:

    from lpsim.compat.qtorch import FloatingPoint, FixedPoint, float_quantize, ...

The formats keep the number ranges QPyTorch's kernels produce (the top exponent code is finite,
subnormals exist, overflow saturates: ``FloatingPoint(5, 2)`` reaches 114688), and rounding is
what QPyTorch documents: "nearest" ties to even, "stochastic" is the default. Where QPyTorch's code
does otherwise (float "nearest" ties away from zero, NaN becomes +/-max, ...), this module follows
the documentation and is correct; docs/migrating-from-qtorch.md lists every difference.

Random numbers come from lpsim's generator: pass ``seed=`` or use ``torch.manual_seed``.
"""

from __future__ import annotations

import torch

from lpsim import functional
from lpsim.formats import BlockFloat, Fixed, Float
from lpsim.rounding import Rounding

__all__ = [
    "Number",
    "FloatingPoint",
    "FixedPoint",
    "BlockFloatingPoint",
    "float_quantize",
    "fixed_point_quantize",
    "block_quantize",
]


class Number:
    """A QPyTorch number format; ``.format`` is the equivalent lpsim format."""

    format: Float | Fixed | BlockFloat

    def __eq__(self, other) -> bool:
        return isinstance(other, Number) and self.format == other.format

    def __hash__(self) -> int:
        return hash(self.format)


class FloatingPoint(Number):
    """QPyTorch's FloatingPoint(exp, man): bias 2**(exp-1) - 1, subnormals, no Inf or NaN codes
    (the top exponent code is finite), overflow saturates to +/-max.

    With exp=8 that range would pass float32's; QPyTorch's kernels then never clip, and overflow
    and Inf behave as in IEEE float32, so FloatingPoint(8, man) is the IEEE Float(8, man)."""

    def __init__(self, exp: int, man: int):
        self.exp = exp
        self.man = man
        if exp == 8:
            self.format = Float(exp, man)
        else:
            self.format = Float(exp, man, special="none", saturate=True)

    def __repr__(self) -> str:
        return f"FloatingPoint (exponent={self.exp:d}, mantissa={self.man:d})"


class FixedPoint(Number):
    """QPyTorch's FixedPoint(wl, fl, clamp=True, symmetric=False): values k * 2**-fl for wl-bit
    two's complement k; clamp saturates out-of-range values; symmetric drops the most negative."""

    def __init__(self, wl: int, fl: int, clamp: bool = True, symmetric: bool = False):
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
    along d."""

    def __init__(self, wl: int, dim: int = -1):
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < -1:
            raise ValueError(f"BlockFloatingPoint.dim must be -1 or a dimension >= 0, got {dim!r}")
        self.wl = wl
        self.dim = dim
        self.format = BlockFloat(wl, None if dim == -1 else dim)

    def __repr__(self) -> str:
        return f"BlockFloatingPoint (wl={self.wl:d}, dim={self.dim:d})"


def float_quantize(x: torch.Tensor, exp: int, man: int, rounding: Rounding | str = "stochastic",
                   *, seed: int | None = None) -> torch.Tensor:
    """QPyTorch's float_quantize: x rounded into FloatingPoint(exp, man)."""
    return functional.quantize(x, FloatingPoint(exp, man).format, rounding, seed=seed)


def fixed_point_quantize(x: torch.Tensor, wl: int, fl: int, clamp: bool = True,
                         symmetric: bool = False, rounding: Rounding | str = "stochastic",
                         *, seed: int | None = None) -> torch.Tensor:
    """QPyTorch's fixed_point_quantize: x rounded into FixedPoint(wl, fl, clamp, symmetric)."""
    return functional.quantize(x, FixedPoint(wl, fl, clamp, symmetric).format, rounding, seed=seed)


def block_quantize(x: torch.Tensor, wl: int, dim: int = -1,
                   rounding: Rounding | str = "stochastic", *,
                   seed: int | None = None) -> torch.Tensor:
    """QPyTorch's block_quantize: dim=-1 is one block for the whole tensor."""
    return functional.quantize(x, BlockFloatingPoint(wl, dim).format, rounding, seed=seed)
