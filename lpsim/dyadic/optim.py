"""Integer SGD with momentum, whose learning rate and momentum are shifts.

For a parameter W at its fixed scale s_W (a signed b_W-bit integer) with gradient G (any scale),
one step is, with R = lpsim.dyadic.requantize (stochastic rounding by default):

    g = R(G, s_W, grad_bits)                    the gradient on W's grid, clipped (below)
    M = M - R(M * 2**-momentum_shift, s_W) + g  momentum 1 - 2**-momentum_shift, M at scale s_W
    W = R(W - R(M * 2**-lr_shift, s_W), s_W, b_W)  learning rate 2**-lr_shift; W clipped

Multiplying by 2**-k is free (the scale grows by k), so each shift costs one rounding, when the
result returns to the grid of W. The momentum follows torch.optim.SGD (dampening 0): M = beta M + g,
W = W - lr M, with beta = 1 - 2**-momentum_shift (momentum_shift=0: no momentum) and
lr = 2**-lr_shift. Gradient clipping is elementwise, to a signed grad_bits-bit integer at W's
scale: g in [-2**(grad_bits-1), 2**(grad_bits-1) - 1] 2**-s_W. A parameter with per-channel scales
is updated on each channel's grid, from a gradient of one scale or of the same per-channel axis.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from lpsim._checks import check_choice, check_int, check_rule
from lpsim.dyadic import functional as F
from lpsim.dyadic.nn import Parameter
from lpsim.dyadic.tensor import DyadicTensor

__all__ = ["SGD", "ClampCounts"]


def _same_scales(a: DyadicTensor, b: DyadicTensor) -> bool:
    """Whether a and b have the same scales along the same axis (or both one scale)."""
    if a.axis != b.axis:
        return False
    if a.axis is None:
        return a.scale == b.scale
    return torch.equal(a.scale, b.scale)


def _scale_text(x: DyadicTensor) -> str:
    if x.axis is None:
        return str(x.scale)
    return f"{x.scale.tolist()} along axis {x.axis}"


@dataclass
class ClampCounts:
    """Elements clipped by the optimizer since the last reset: gradients (gradient clipping) and
    weights (the parameter's range)."""

    gradient: int = 0
    weight: int = 0


class SGD:
    """Integer SGD (see the module docstring).

    Args:
        parameters: lpsim.dyadic.nn Parameters (e.g. model.parameters()) of 2 to 32 bits.
        lr_shift: the learning rate is 2**-lr_shift, 0 to 62.
        momentum_shift: the momentum is 1 - 2**-momentum_shift, 0 (none) to 30.
        grad_bits: gradients are clipped to a signed grad_bits-bit integer at the weight's scale,
            2 to 32.
        rounding: of every requantisation: "stochastic" (default), "nearest" or "down".
        overflow: "raise" (default) or "saturate" when the momentum buffer overflows int32.

    Raises:
        TypeError, ValueError: an argument has the wrong type or is out of range.
    """

    def __init__(
        self,
        parameters: Iterable[Parameter],
        *,
        lr_shift: int,
        momentum_shift: int = 0,
        grad_bits: int = 16,
        rounding: str = "stochastic",
        overflow: str = "raise",
    ):
        self.parameters = list(parameters)
        for p in self.parameters:
            if not isinstance(p, Parameter):
                raise TypeError(
                    f"parameters must be lpsim.dyadic.nn.Parameter, got {type(p).__name__}"
                )
            if not isinstance(p.bits, int) or isinstance(p.bits, bool) or not 2 <= p.bits <= 32:
                raise ValueError(
                    f"the bits of parameter {p.name!r} must be in [2, 32] (SGD's momentum and "
                    f"updates are int32), got {p.bits!r}"
                )
        self.lr_shift = check_int("lr_shift", lr_shift, 0, 62)
        self.momentum_shift = check_int("momentum_shift", momentum_shift, 0, 30)
        self.grad_bits = check_int("grad_bits", grad_bits, 2, 32)
        check_rule(rounding, F.ROUNDINGS, "dyadic operations")
        self.rounding = rounding
        self.overflow = check_choice("overflow", overflow, F.OVERFLOW_POLICIES)
        self.momentum: list[DyadicTensor | None] = [None] * len(self.parameters)
        self._counts = [ClampCounts() for _ in self.parameters]
        self._distinct_names()

    def _distinct_names(self) -> list[str]:
        names = [p.name for p in self.parameters]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(
                    f"parameters must have distinct names (stats are kept by name), got {name!r} "
                    f"{names.count(name)} times: put the layers in a Sequential, which names them "
                    f"'0.weight', '1.weight', ..., or set Parameter.name"
                )
        return names

    @property
    def stats(self) -> dict[str, ClampCounts]:
        """The ClampCounts of each parameter, by its current name."""
        return dict(zip(self._distinct_names(), self._counts))

    def zero_grad(self) -> None:
        for p in self.parameters:
            p.grad = None

    def reset_stats(self) -> None:
        for counts in self._counts:
            counts.gradient = counts.weight = 0

    def state_dict(self) -> dict:
        """What a resumed run needs besides the parameters' values and torch's generator state
        (the stochastic roundings draw from it): each parameter's momentum buffer, in order (None
        before its first step, else its int32 "mantissa", "scale" and "axis"), and the clamp
        counts. The buffers are copies."""
        momentum = []
        for m in self.momentum:
            if m is None:
                momentum.append(None)
            else:
                scale = m.scale.clone() if isinstance(m.scale, torch.Tensor) else m.scale
                momentum.append({"mantissa": m.mantissa.clone(), "scale": scale, "axis": m.axis})
        counts = [{"gradient": c.gradient, "weight": c.weight} for c in self._counts]
        return {"momentum": momentum, "stats": counts}

    def load_state_dict(self, state: dict) -> None:
        """Restores what state_dict() saved, for the same parameters in the same order.

        Raises:
            ValueError: the state is not one of this optimizer's (another number of parameters,
                a buffer that is not an int32 tensor of its parameter's shape).
            TypeError: it is not a state_dict() mapping.
        """
        if not isinstance(state, dict) or set(state) != {"momentum", "stats"}:
            raise TypeError("state must be a mapping with the keys 'momentum' and 'stats'")
        momentum, stats = state["momentum"], state["stats"]
        if len(momentum) != len(self.parameters) or len(stats) != len(self.parameters):
            raise ValueError(
                f"state holds {len(momentum)} momentum buffers and {len(stats)} counts; the "
                f"optimizer has {len(self.parameters)} parameters"
            )
        buffers = []
        for p, m in zip(self.parameters, momentum, strict=True):
            if m is None:
                buffers.append(None)
                continue
            mantissa = m["mantissa"]
            if (
                not isinstance(mantissa, torch.Tensor)
                or mantissa.dtype != torch.int32
                or mantissa.shape != p.value.shape
            ):
                got = (
                    f"{mantissa.dtype} {tuple(mantissa.shape)}"
                    if isinstance(mantissa, torch.Tensor)
                    else type(mantissa).__name__
                )
                raise ValueError(
                    f"the momentum buffer of {p.name!r} must be an int32 tensor of shape "
                    f"{tuple(p.value.shape)}, got {got}"
                )
            scale = m["scale"]
            scale = scale.clone() if isinstance(scale, torch.Tensor) else scale
            buffers.append(DyadicTensor(mantissa.clone(), scale, m["axis"]))
        self.momentum = buffers
        self._counts = [ClampCounts(int(c["gradient"]), int(c["weight"])) for c in stats]

    def _round(self, x: DyadicTensor, grid: DyadicTensor, bits: int = 32) -> F.Requantized:
        """x requantised onto the scales of ``grid`` (the weight): per channel along the weight's
        axis when it has one, whether x has one scale or the same per-channel axis."""
        return F.requantize(x, grid.scale, bits, rounding=self.rounding, axis=grid.axis)

    def _add(self, a: DyadicTensor, b: DyadicTensor, subtract: bool) -> F.Saturated:
        combine = F.saturating_sub if subtract else F.saturating_add
        return combine(a, b, rounding=self.rounding)  # same scale: exact

    def _checked(self, what: str, result: tuple[DyadicTensor, int], bits: int = 32) -> DyadicTensor:
        value, count = result
        F.check_overflow(count, f"SGD {what}", F.integer_range(bits), self.overflow)
        return value

    def step(self) -> None:
        """Update every parameter that has a gradient.

        Raises:
            TypeError, ValueError: a value or gradient is not a DyadicTensor, a gradient is not
                of its parameter's shape or has per-channel scales along another axis than its
                parameter's, or a momentum buffer is not of the parameter's shape and at its
                scales (one loaded from a parameter at other scales, or a value replaced by
                another). Each message names the parameter.
            OverflowError: the momentum buffer overflows int32 under overflow="raise".
        """
        for index, p in enumerate(self.parameters):
            if p.grad is None:
                continue
            w = p.value
            if not isinstance(w, DyadicTensor):
                raise TypeError(
                    f"the value of {p.name!r} must be a DyadicTensor, got {type(w).__name__}"
                )
            if not isinstance(p.grad, DyadicTensor):
                raise TypeError(
                    f"the gradient of {p.name!r} must be a DyadicTensor, got "
                    f"{type(p.grad).__name__}"
                )
            if p.grad.shape != w.shape:
                raise ValueError(
                    f"the gradient of {p.name!r} has shape {tuple(p.grad.shape)}, its value "
                    f"{tuple(w.shape)}"
                )
            if None not in (p.grad.axis, w.axis) and p.grad.axis != w.axis:
                raise ValueError(
                    f"the gradient of {p.name!r} has its scales along axis {p.grad.axis}, its "
                    f"value along axis {w.axis}: a per-channel gradient must run along the "
                    "value's axis (or have one scale)"
                )
            grad = self._round(p.grad, w, self.grad_bits)
            counts = self._counts[index]
            counts.gradient += grad.clip_count
            m = self.momentum[index]
            if m is None:
                m = w.with_mantissa(torch.zeros_like(w.mantissa, dtype=torch.int32))
            elif m.shape != w.shape or not _same_scales(m, w):
                raise ValueError(
                    f"the momentum buffer of {p.name!r} is {tuple(m.shape)} at scale "
                    f"{_scale_text(m)}, the parameter {tuple(w.shape)} at {_scale_text(w)}: the "
                    "rule keeps the buffer on the parameter's grid, element for element (a "
                    "state_dict() from a parameter at another scale, or a value replaced by one "
                    "of another shape or scale)"
                )
            decay = self._round(m.ldexp(-self.momentum_shift), w).value
            m = self._checked("momentum decay", self._add(m, decay, subtract=True))
            m = self._checked("momentum", self._add(m, grad.value, subtract=False))
            self.momentum[index] = m
            update = self._round(m.ldexp(-self.lr_shift), w).value
            # W - update in int64, exact for int32 operands: the clip to W's bits below is the
            # one range check the rule has (and counts), also for 32-bit weights.
            wide = w.with_mantissa(w.mantissa.to(torch.int64))
            moved = self._checked("update", self._add(wide, update, subtract=True), 64)
            new = self._round(moved, w, p.bits)
            counts.weight += new.clip_count
            p.value = new.value
