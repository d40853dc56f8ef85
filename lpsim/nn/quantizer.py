"""Differentiable quantisers: quantise a tensor in the forward pass and its gradient in the backward
pass, each with its own format and rounding rule.

A *spec* says how to quantise: a format (Float, Fixed, BlockFloat), or a (format, rounding) pair
whose rounding overrides the default. None means "leave as is".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple, Union

import torch
from torch import nn

from lpsim.formats import BlockFloat, Fixed, Float, Format
from lpsim.functional import quantize
from lpsim.rounding import Rounding

__all__ = ["Spec", "QuantSpec", "as_spec", "quantizer", "Quantizer"]

Spec = Union[Format, tuple, None]


class QuantSpec(NamedTuple):
    """A format and the rule that rounds into it."""

    format: Format
    rounding: Rounding

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x quantised (differentiable, straight-through)."""
        return quantize(x, self.format, self.rounding)

    def __str__(self) -> str:
        return f"{self.format!r} {self.rounding.name}"


def as_spec(value: Spec, rounding: Rounding | str, name: str) -> QuantSpec | None:
    """The QuantSpec that ``value`` describes (None for None), ``rounding`` applying when value is
    a bare format.

    Raises:
        TypeError: value is neither None, a format, nor a (format, rounding) pair; the message
            names the argument.
    """
    if value is None:
        return None
    if isinstance(value, QuantSpec):
        return value
    if isinstance(value, (Float, Fixed, BlockFloat)):
        return QuantSpec(value, Rounding.parse(rounding))
    if (isinstance(value, tuple) and len(value) == 2
            and isinstance(value[0], (Float, Fixed, BlockFloat))):
        return QuantSpec(value[0], Rounding.parse(value[1]))
    raise TypeError(
        f"{name} must be None, a Float, Fixed or BlockFloat, or a (format, rounding) pair; "
        f"got {value!r}"
    )


def clip_range(fmt: Format) -> tuple[float, float]:
    """The interval outside which quantising into fmt clips: [min, max] of a clamping Fixed
    format, [-max, max] of a saturating Float.

    Raises:
        ValueError: the format does not clip (Fixed without clamp, non-saturating Float, BlockFloat).
    """
    if isinstance(fmt, Fixed) and fmt.clamp:
        return fmt.min, fmt.max
    if isinstance(fmt, Float) and fmt.saturate:
        return -fmt.max, fmt.max
    raise ValueError(
        "clamp_grad_zero needs a forward format that clips: a Fixed format with clamp=True or a "
        f"Float with saturate=True, got {fmt!r}"
    )


def clip_mask(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Where quantising x into fmt clips it (see clip_range)."""
    low, high = clip_range(fmt)
    return (x > high) | (x < low)


class _Quantize(torch.autograd.Function):
    """y = forward_spec(x); dL/dx = backward_spec(hooks(dL/dy)), zero where the forward clipped."""

    @staticmethod
    def forward(ctx, x, forward_spec, backward_spec, clamp_grad_zero, hooks):
        ctx.backward_spec = backward_spec
        ctx.hooks = hooks
        ctx.masked = clamp_grad_zero
        if clamp_grad_zero:
            ctx.save_for_backward(clip_mask(x, forward_spec.format))
        if forward_spec is None:
            return x.view_as(x)
        return forward_spec(x)

    @staticmethod
    def backward(ctx, grad):
        for hook in ctx.hooks:
            grad = hook(grad)
        if ctx.backward_spec is not None:
            grad = ctx.backward_spec(grad)
        if ctx.masked:
            (mask,) = ctx.saved_tensors
            grad = grad.masked_fill(mask, 0.0)
        return grad, None, None, None, None


def quantizer(
    forward: Spec = None,
    backward: Spec = None,
    forward_rounding: Rounding | str = "stochastic",
    backward_rounding: Rounding | str = "stochastic",
    clamp_grad_zero: bool = False,
    backward_hooks: Iterable[Callable[[torch.Tensor], torch.Tensor]] = (),
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A differentiable function that quantises its input in the forward pass (activations) and the
    incoming gradient in the backward pass (errors).

    Args:
        forward: spec of the forward quantisation (None: identity).
        backward: spec of the gradient quantisation (None: the gradient passes unchanged).
        forward_rounding, backward_rounding: rules for specs given as bare formats.
        clamp_grad_zero: zero the gradient where the forward pass clipped the input (outside the
            range of a clamping Fixed format or a saturating Float): the straight-through
            estimator with a clip mask.
        backward_hooks: functions applied in order to the gradient before its quantisation (for
            example loss-scaling).

    Random numbers of stochastic rules come from torch's default generator, so torch.manual_seed
    makes forward and backward reproducible.

    Raises:
        TypeError: a spec is malformed.
        ValueError: clamp_grad_zero without a clipping forward format.
    """
    forward_spec = as_spec(forward, forward_rounding, "forward")
    backward_spec = as_spec(backward, backward_rounding, "backward")
    hooks = tuple(backward_hooks)
    if clamp_grad_zero:
        if forward_spec is None:
            raise ValueError("clamp_grad_zero needs a forward format")
        clip_range(forward_spec.format)

    def apply(x: torch.Tensor) -> torch.Tensor:
        return _Quantize.apply(x, forward_spec, backward_spec, clamp_grad_zero, hooks)

    return apply


class Quantizer(nn.Module):
    """A module wrapping quantizer(): quantises activations forward and errors backward.

    Arguments as for lpsim.nn.quantizer().
    """

    def __init__(
        self,
        forward: Spec = None,
        backward: Spec = None,
        forward_rounding: Rounding | str = "stochastic",
        backward_rounding: Rounding | str = "stochastic",
        clamp_grad_zero: bool = False,
        backward_hooks: Iterable[Callable[[torch.Tensor], torch.Tensor]] = (),
    ):
        super().__init__()
        self.forward_spec = as_spec(forward, forward_rounding, "forward")
        self.backward_spec = as_spec(backward, backward_rounding, "backward")
        self.clamp_grad_zero = clamp_grad_zero
        self.backward_hooks = tuple(backward_hooks)
        self._apply_quantizer = quantizer(self.forward_spec, self.backward_spec,
                                          clamp_grad_zero=clamp_grad_zero,
                                          backward_hooks=self.backward_hooks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply_quantizer(x)

    def extra_repr(self) -> str:
        parts = [f"forward={self.forward_spec or 'None'}", f"backward={self.backward_spec or 'None'}"]
        if self.clamp_grad_zero:
            parts.append("clamp_grad_zero=True")
        if self.backward_hooks:
            parts.append(f"backward_hooks={len(self.backward_hooks)}")
        return ", ".join(parts)
