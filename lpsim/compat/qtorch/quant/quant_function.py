"""QPyTorch's ``qtorch.quant.quant_function``: the quantisation functions and quantizer().

Rounding is what QPyTorch documents ("nearest" ties to even, "stochastic" is the default), with
lpsim's generator for the random numbers: pass ``seed=`` or use ``torch.manual_seed``. Every rule
of lpsim.Rounding is accepted besides "nearest" and "stochastic". float_quantize,
fixed_point_quantize and block_quantize pass the gradient straight through (unchanged), as
lpsim.quantize does; QPyTorch's return a tensor without history.

QPyTorch's compiled-kernel modules ``quant_cpu`` and ``quant_cuda`` do not exist here;
get_module() returns an object with their functions, computed by lpsim's kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from lpsim import functional
from lpsim import nn as lpnn
from lpsim.compat.qtorch.number import (
    BlockFloatingPoint,
    FixedPoint,
    FloatingPoint,
    Number,
    integer,
    lpsim_format,
)
from lpsim.nn.quantizer import QuantSpec, clip_range, quantize_with_clip_mask
from lpsim.rounding import Rounding

__all__ = ["fixed_point_quantize", "block_quantize", "float_quantize", "quantizer"]


def float_quantize(
    x: torch.Tensor,
    exp: int,
    man: int,
    rounding: Rounding | str = "stochastic",
    *,
    seed: int | None = None,
) -> torch.Tensor:
    """x rounded into FloatingPoint(exp, man) (QPyTorch's range: saturating, no Inf codes below
    exp=8)."""
    return functional.quantize(x, FloatingPoint(exp, man).format, rounding, seed=seed)


def fixed_point_quantize(
    x: torch.Tensor,
    wl: int,
    fl: int,
    clamp: bool = True,
    symmetric: bool = False,
    rounding: Rounding | str = "stochastic",
    *,
    seed: int | None = None,
) -> torch.Tensor:
    """x rounded into FixedPoint(wl, fl, clamp, symmetric)."""
    return functional.quantize(x, FixedPoint(wl, fl, clamp, symmetric).format, rounding, seed=seed)


def block_quantize(
    x: torch.Tensor,
    wl: int,
    dim: int = -1,
    rounding: Rounding | str = "stochastic",
    *,
    seed: int | None = None,
) -> torch.Tensor:
    """x rounded into BlockFloatingPoint(wl, dim): dim=-1 is one block for the whole tensor.
    Other negative dims count from the last dimension, as QPyTorch's function takes them
    (dim=-2 of a 2-D tensor is dim 0); BlockFloatingPoint itself refuses them, as QPyTorch's."""
    dim = integer(dim)
    if isinstance(x, torch.Tensor) and isinstance(dim, int) and -x.dim() <= dim < -1:
        dim += x.dim()
    return functional.quantize(x, BlockFloatingPoint(wl, dim).format, rounding, seed=seed)


def quantizer(
    forward_number: Number | None = None,
    backward_number: Number | None = None,
    forward_rounding: str = "stochastic",
    backward_rounding: str = "stochastic",
    clamping_grad_zero: bool = False,
    backward_hooks: Iterable[Callable[[torch.Tensor], torch.Tensor]] = (),
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A differentiable function quantising its input into forward_number and the gradient into
    backward_number (None: left as is), after applying backward_hooks to the gradient.

    clamping_grad_zero zeroes the gradient where the forward pass clipped: where the rounded value
    lay outside the range of forward_number (a FixedPoint with clamp, or a FloatingPoint with
    exp < 8, which saturates), decided as QPyTorch's kernels decide it. Without a forward_number
    nothing is clipped and the gradient is only quantised.

    Unlike QPyTorch, backward_hooks always run (QPyTorch applies them only with
    clamping_grad_zero and a backward_number), and the clip mask applies without a
    backward_number too (QPyTorch then passes the gradient unmasked).

    Raises:
        TypeError: a number is not a qtorch Number; clamping_grad_zero is not a bool; a backward
            hook is not callable; a rounding is not a str or Rounding.
        ValueError: forward_rounding or backward_rounding names no rule (checked also where its
            number is None, as in QPyTorch).
        ValueError: clamping_grad_zero with a forward_number that does not clip (a FixedPoint
            without clamp, a FloatingPoint with exp=8, a BlockFloatingPoint).
    """
    if not isinstance(clamping_grad_zero, bool):
        raise TypeError(
            f"clamping_grad_zero must be a bool, got {type(clamping_grad_zero).__name__}"
        )
    forward_format = lpsim_format(forward_number)
    clamp_grad_zero = clamping_grad_zero and forward_number is not None
    if clamp_grad_zero:
        try:
            clip_range(forward_format)
        except ValueError:
            raise ValueError(
                "clamping_grad_zero needs a forward_number that clips: a FixedPoint with "
                f"clamp=True or a FloatingPoint with exp < 8 (which saturates), got "
                f"{forward_number!r}"
            ) from None
    return lpnn.quantizer(
        forward_format,
        lpsim_format(backward_number),
        forward_rounding,
        backward_rounding,
        clamp_grad_zero=clamp_grad_zero,
        backward_hooks=backward_hooks,
    )


def assert_wl_fl(wl: int, fl: int, stage: str = "") -> None:
    """QPyTorch's check that a fixed-point format is either full precision (wl = fl = -1) or has a
    word length: raises ValueError for wl == -1 with fl != -1."""
    if wl == -1 and fl != -1:
        raise ValueError(f"fixed point {stage} wl {wl}, fl {fl}")


def _mask_kernel(rounding: str):
    def kernel(a: torch.Tensor, wl: int, fl: int, symmetric: bool):
        spec = QuantSpec(FixedPoint(wl, fl, True, symmetric).format, Rounding.parse(rounding))
        out, clipped = quantize_with_clip_mask(a, spec)
        return out, clipped.to(torch.uint8)

    kernel.__name__ = f"fixed_point_quantize_{rounding}_mask"
    kernel.__doc__ = (
        f"(a rounded ({rounding}) into FixedPoint(wl, fl, clamp=True, symmetric), "
        "uint8 mask of the elements whose rounded value was clipped)."
    )
    return kernel


class Kernels:
    """The functions of QPyTorch's compiled modules (quant_cpu, quant_cuda), with their argument
    orders (float kernels take man before exp), computed by lpsim's kernels on any device."""

    @staticmethod
    def float_quantize_nearest(a: torch.Tensor, man: int, exp: int) -> torch.Tensor:
        return float_quantize(a, exp, man, "nearest")

    @staticmethod
    def float_quantize_stochastic(a: torch.Tensor, man: int, exp: int) -> torch.Tensor:
        return float_quantize(a, exp, man, "stochastic")

    @staticmethod
    def fixed_point_quantize_nearest(
        a: torch.Tensor, wl: int, fl: int, clamp: bool, symmetric: bool
    ) -> torch.Tensor:
        return fixed_point_quantize(a, wl, fl, clamp, symmetric, "nearest")

    @staticmethod
    def fixed_point_quantize_stochastic(
        a: torch.Tensor, wl: int, fl: int, clamp: bool, symmetric: bool
    ) -> torch.Tensor:
        return fixed_point_quantize(a, wl, fl, clamp, symmetric, "stochastic")

    fixed_point_quantize_nearest_mask = staticmethod(_mask_kernel("nearest"))
    fixed_point_quantize_stochastic_mask = staticmethod(_mask_kernel("stochastic"))

    @staticmethod
    def block_quantize_nearest(a: torch.Tensor, wl: int, dim: int) -> torch.Tensor:
        return block_quantize(a, wl, dim, "nearest")

    @staticmethod
    def block_quantize_stochastic(a: torch.Tensor, wl: int, dim: int) -> torch.Tensor:
        return block_quantize(a, wl, dim, "stochastic")


_KERNELS = Kernels()


def get_module(x: torch.Tensor) -> Kernels:
    """The kernel module QPyTorch would use for x (quant_cpu or quant_cuda). lpsim's ops dispatch
    on the tensor's device, so one object serves every device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    return _KERNELS
