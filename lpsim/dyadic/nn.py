"""Integer layers: forward and backward passes in dyadic integer arithmetic.

torch's autograd does not run on integer tensors, so each module has an explicit ``forward(x)``
and ``backward(grad)``; Sequential chains them. Every tensor is a DyadicTensor (values v * 2**-s)
and every step is one of lpsim.dyadic's integer operations. Scale bookkeeping of Linear, with x an
(N, in) activation at scale s_x, W an (out, in) weight at its fixed scale s_W and the bias b at
s_W too:

forward
    acc = x W^T               exact sums, checked against the accumulator      s_x + s_W
    acc = acc + R(b, s_x+s_W) the bias moved to the accumulator's scale        s_x + s_W
    k_f = fit_shift(acc, activation_bits), or the fixed forward_shift
    y   = R(acc, s_x + s_W - k_f, activation_bits)  -> clip mask               s_x + s_W - k_f
backward, with g the gradient of y at scale s_g
    g   = g with 0 where the forward clip fired (straight-through estimator)
    dW  = g^T x               exact sums, checked                              s_g + s_x
    db  = sum over the batch of g, checked                                     s_g
    dx  = g W                 exact sums, checked                              s_g + s_W
    k_b = fit_shift(dx, error_bits), or the fixed backward_shift
    dx  = R(dx, s_g + s_W - k_b, error_bits)                                   s_g + s_W - k_b

R is lpsim.dyadic.requantize with the layer's rounding (stochastic by default). The shifts k_f and
k_b are the bits each requantisation drops: with fit_shift they are as few as keep the largest
magnitude in range, so the forward clip fires only when rounding carries the largest element to
Qmax + 1. Each layer's LayerStats records them, with the clamp and overflow counts.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from lpsim._checks import check_bool, check_choice, check_int, check_rule, check_tensor
from lpsim.dyadic import functional as F
from lpsim.dyadic.tensor import DyadicTensor, check_cpu_dense

__all__ = [
    "Parameter",
    "LayerStats",
    "Module",
    "Linear",
    "ReLU",
    "Sequential",
    "LossOutput",
    "mse_loss",
]


@dataclass(eq=False)
class Parameter:
    """A trainable tensor: its value at a fixed scale, clipped to a signed ``bits``-bit integer,
    and the gradient the last backward pass left (None before one, and after zero_grad()).
    backward() raises where it is not None: gradients are set, never added to."""

    name: str
    value: DyadicTensor
    bits: int
    grad: DyadicTensor | None = None


@dataclass
class LayerStats:
    """What one layer's requantisations did since the last reset().

    forward_shifts, backward_shifts: the shift k of each forward and backward requantisation.
    forward_clamps: activations clipped to [Qmin, Qmax] (their gradient is zeroed).
    backward_clamps: errors clipped by the backward requantisation.
    overflows: accumulator results outside its range (counted under overflow="saturate";
        under "raise" the first one raises OverflowError).
    """

    forward_shifts: list[int] = field(default_factory=list)
    backward_shifts: list[int] = field(default_factory=list)
    forward_clamps: int = 0
    backward_clamps: int = 0
    overflows: int = 0

    def reset(self) -> None:
        self.forward_shifts.clear()
        self.backward_shifts.clear()
        self.forward_clamps = self.backward_clamps = self.overflows = 0

    def summary(self) -> dict:
        """Means of the shifts (NaN when there were none) and the counts."""

        def mean(values: list[int]) -> float:
            return sum(values) / len(values) if values else math.nan

        return {
            "forward_shift": mean(self.forward_shifts),
            "backward_shift": mean(self.backward_shifts),
            "forward_clamps": self.forward_clamps,
            "backward_clamps": self.backward_clamps,
            "overflows": self.overflows,
        }


class Module(abc.ABC):
    """A layer with an integer forward and backward pass.

    ``training`` (default True) is switched by train() and eval(): in evaluation mode a forward
    pass rounds to nearest, records no statistics and keeps nothing for backward, and drops what
    an earlier training forward kept (overflows are still reported as the overflow policy says).
    backward() runs in training mode only, after a training forward(): in evaluation mode it
    raises RuntimeError (it would otherwise differentiate an earlier input, not the last one).
    Linear's backward() takes the input and weight its forward() used (kept, not copied) and
    raises RuntimeError where either mantissa was changed in place since, as torch's autograd.
    """

    training: bool = True

    def train(self, mode: bool = True) -> Module:
        """Training (stochastic requantisation, gradients kept) or evaluation mode; mode must be
        a bool, as torch.nn.Module.train requires (TypeError otherwise)."""
        self.training = check_bool("mode", mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    @abc.abstractmethod
    def forward(self, x: DyadicTensor) -> DyadicTensor:
        """The output; keeps what backward() needs."""

    @abc.abstractmethod
    def backward(self, grad: DyadicTensor) -> DyadicTensor:
        """The gradient with respect to the last forward() input; sets the parameters' grad."""

    def parameters(self) -> list[Parameter]:
        return []

    def _check_backward(self, kept) -> None:
        """Raises RuntimeError unless a training forward() kept ``kept`` for backward()."""
        if not self.training:
            raise RuntimeError(
                "backward() runs in training mode only: an eval() forward keeps nothing for it "
                "(call train(), then forward())"
            )
        if kept is None:
            raise RuntimeError("backward() needs a forward() first")

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        """(name, parameter) pairs of parameters(): each named by the attribute that holds it
        ("weight", "bias"), as torch.nn.Module names them, else by its own ``name``."""
        attributes = {id(v): k for k, v in vars(self).items() if isinstance(v, Parameter)}
        return [(attributes.get(id(p), p.name), p) for p in self.parameters()]

    def __call__(self, x: DyadicTensor) -> DyadicTensor:
        return self.forward(x)


def _check_shift(name: str, shift: int | None) -> int | None:
    if shift is None:
        return None
    if not isinstance(shift, int) or isinstance(shift, bool):
        raise TypeError(f"{name} must be None (dynamic) or an int, got {type(shift).__name__}")
    if not 0 <= shift <= 2**31:  # a larger shift moves every scale out of [-2**30, 2**30]
        raise ValueError(f"{name} must be None (dynamic) or an int in [0, 2**31], got {shift}")
    return shift


def _accumulated(result: F.Saturated, accumulator_bits: int) -> F.Saturated:
    """A sum saturated to its mantissa dtype, clipped further to the accumulator's range: the
    result, and how many elements either saturated, each once. (The dtype is at least as wide as
    the accumulator. An element saturated to a bound of a wider dtype lies beyond the
    accumulator's range, so the clip counts it: then the clip's count is the whole count.)"""
    value, count = result
    clipped = F.requantize(
        value, value.scale, accumulator_bits, rounding="nearest", dtype=value.dtype
    )
    narrower = accumulator_bits < torch.iinfo(value.dtype).bits
    return F.Saturated(clipped.value, clipped.clip_count if narrower else count)


def _check_initial(name: str, value, shape: tuple[int, ...]) -> None:
    """Raises unless ``value`` is a finite dense CPU float tensor of ``shape`` (the message calls
    it ``name``)."""
    check_tensor(value, name)
    if not value.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got {value.dtype}")
    check_cpu_dense(value, name, "lpsim.dyadic.nn.Linear")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
    finite = torch.isfinite(value.detach().to(torch.float64))  # float8 values too, exactly
    if not bool(finite.all()):
        raise ValueError(f"{name} must be finite, found {int((~finite).sum())} NaN or Inf")


def _version(x: DyadicTensor) -> int | None:
    """The version counter of x's mantissa; None for an inference tensor, which keeps none."""
    return None if x.mantissa.is_inference() else x.mantissa._version


class _Kept(NamedTuple):
    """What Linear's training forward() keeps for backward(): its input and weight (the
    DyadicTensors themselves, not copies), their mantissas' version counters then, and the clip
    mask of its output."""

    input: DyadicTensor
    weight: DyadicTensor
    versions: tuple[int | None, int | None]
    clipped: torch.Tensor

    @classmethod
    def of(cls, x: DyadicTensor, weight: DyadicTensor, clipped: torch.Tensor) -> _Kept:
        return cls(x, weight, (_version(x), _version(weight)), clipped)

    def checked(self) -> _Kept:
        """These values, or a RuntimeError where a kept mantissa was written in place since the
        forward pass (backward would differentiate other values than the forward's, as torch's
        autograd refuses to). Tensors made under torch.inference_mode keep no version counter
        and are not checked."""
        now = (_version(self.input), _version(self.weight))
        for name, then, current in zip(("input", "weight"), self.versions, now, strict=True):
            if current != then:
                raise RuntimeError(
                    f"backward(): the {name} of the last forward() was changed in place since "
                    "(its mantissa's version counter moved), so its gradients would be those of "
                    "other values: call forward() again after changing it"
                )
        return self


class Linear(Module):
    """y = x W^T + b in integers (see the module docstring for every scale).

    Args:
        in_features, out_features: the sizes.
        bias: whether the layer has a bias (a bool; TypeError otherwise).
        weight, bias_value: initial finite float values ((out, in) and (out,)); default uniform on
            [-1/sqrt(in), 1/sqrt(in)] from torch's default generator, as torch.nn.Linear.
        weight_bits: width of the weight and bias integers (signed), 2 to 32.
        headroom: bits of growth the parameters' fixed scale leaves above the initial largest
            magnitude: scale = scale_for(initial values, weight_bits) - headroom, 0 to 16.
        activation_bits: width of the output y (signed), 2 to 32.
        error_bits: width of the gradient dx passed back (signed), 2 to 32.
        accumulator_bits: width of the accumulator of every matrix product, 2 to 64.
        forward_shift, backward_shift: fixed shifts k_f, k_b in [0, 2**31], or None to fit them to
            the data.
        rounding: of every requantisation: "stochastic" (default), "nearest" or "down".
        overflow: "raise" (default) or "saturate" for accumulator overflows (counted in stats).

    Raises:
        TypeError, ValueError: an argument has the wrong type or is out of range (a weight or
            bias_value of another shape, or with NaN or Inf, is named; a bias_value with
            bias=False is refused).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        weight: torch.Tensor | None = None,
        bias_value: torch.Tensor | None = None,
        weight_bits: int = 16,
        headroom: int = 2,
        activation_bits: int = 8,
        error_bits: int = 8,
        accumulator_bits: int = 32,
        forward_shift: int | None = None,
        backward_shift: int | None = None,
        rounding: str = "stochastic",
        overflow: str = "raise",
    ):
        check_int("in_features", in_features, 1, 2**31)
        check_int("out_features", out_features, 1, 2**31)
        check_int("weight_bits", weight_bits, 2, 32)
        check_int("headroom", headroom, 0, 16)
        check_int("activation_bits", activation_bits, 2, 32)
        check_int("error_bits", error_bits, 2, 32)
        check_int("accumulator_bits", accumulator_bits, 2, 64)
        check_bool("bias", bias)  # a truthy "no" would give the layer a bias
        check_rule(rounding, F.ROUNDINGS, "dyadic operations")
        check_choice("overflow", overflow, F.OVERFLOW_POLICIES)
        if not bias and bias_value is not None:
            raise ValueError(
                "bias_value is the initial bias of a layer with bias=True; got one with bias=False"
            )
        self.in_features, self.out_features = in_features, out_features
        self.activation_bits, self.error_bits = activation_bits, error_bits
        self.accumulator_bits = accumulator_bits
        self.forward_shift = _check_shift("forward_shift", forward_shift)
        self.backward_shift = _check_shift("backward_shift", backward_shift)
        self.rounding, self.overflow = rounding, overflow
        self.stats = LayerStats()

        bound = 1.0 / math.sqrt(in_features)
        w = weight
        if w is None:
            w = torch.empty(out_features, in_features).uniform_(-bound, bound)
        _check_initial("weight", w, (out_features, in_features))
        initial = [w.detach()]
        b = None
        if bias:
            b = bias_value
            if b is None:
                b = torch.empty(out_features).uniform_(-bound, bound)
            _check_initial("bias_value", b, (out_features,))
            initial.append(b.detach())
        # The largest magnitude of weight and bias together (an all-zero bias does not count).
        largest = torch.cat([t.reshape(-1).to(torch.float64) for t in initial])  # exact
        scale = F.scale_for(largest, weight_bits) - headroom
        self.weight = Parameter(
            "weight", F.from_float(w.detach(), weight_bits, scale).value, weight_bits
        )
        self.bias = (
            None
            if b is None
            else Parameter("bias", F.from_float(b.detach(), weight_bits, scale).value, weight_bits)
        )
        self._kept: _Kept | None = None  # what the last training forward() keeps for backward()

    @classmethod
    def from_torch(cls, module: torch.nn.Linear, **options) -> Linear:
        """An integer copy of a torch.nn.Linear's current weight and bias (options as __init__)."""
        bias = module.bias.detach() if module.bias is not None else None
        return cls(
            module.in_features,
            module.out_features,
            bias=bias is not None,
            weight=module.weight.detach(),
            bias_value=bias,
            **options,
        )

    def parameters(self) -> list[Parameter]:
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def _product(self, what: str, a: DyadicTensor, b: DyadicTensor) -> DyadicTensor:
        result, count = F.saturating_matmul(a, b, accumulator_bits=self.accumulator_bits)
        self._count_overflows(what, count)
        return result

    def _count_overflows(self, what: str, count: int) -> None:
        if self.training:
            self.stats.overflows += count
        F.check_overflow(
            count, f"Linear {what}", F.integer_range(self.accumulator_bits), self.overflow
        )

    @property
    def _rule(self) -> str:
        return self.rounding if self.training else "nearest"

    def _requantize(self, x: DyadicTensor, fixed: int | None, bits: int) -> tuple:
        shift = fixed if fixed is not None else F.fit_shift(x, bits)
        out = F.requantize(x, x.scale - shift, bits, rounding=self._rule)
        return out, shift

    def forward(self, x: DyadicTensor) -> DyadicTensor:
        F.check_dyadic("x", x)
        if x.per_channel or x.mantissa.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"x must be (N, {self.in_features}) with one scale, got "
                f"{tuple(x.shape)}{' per channel' if x.per_channel else ''}"
            )
        acc = self._product("forward x W^T", x, self.weight.value.t())
        if self.bias is not None:
            bias = F.requantize(
                self.bias.value, acc.scale, self.accumulator_bits, rounding=self._rule
            )
            self._count_overflows("bias at the accumulator's scale", bias.clip_count)
            acc, count = _accumulated(
                F.saturating_add(acc, bias.value, rounding=self._rule), self.accumulator_bits
            )
            self._count_overflows("forward x W^T + b", count)
        (y, clipped), shift = self._requantize(acc, self.forward_shift, self.activation_bits)
        if self.training:
            self.stats.forward_shifts.append(shift)
            self.stats.forward_clamps += int(clipped.sum())
            self._kept = _Kept.of(x, self.weight.value, clipped)
        else:
            self._kept = None
        return y

    def backward(self, grad: DyadicTensor) -> DyadicTensor:
        self._check_backward(self._kept)
        kept = self._kept.checked()
        F.check_dyadic("grad", grad)
        if grad.shape != kept.clipped.shape or grad.per_channel:
            raise ValueError(
                f"grad must have the output's shape {tuple(kept.clipped.shape)} and one scale"
            )
        left = [p.name for p in self.parameters() if p.grad is not None]
        if left:
            raise RuntimeError(
                f"backward() sets the gradients and does not add to them (adding gradients of "
                f"different scales is not modelled), but {left} still hold one from an earlier "
                f"backward(): call the optimizer's zero_grad() first, or set them to None"
            )
        g = grad.masked_zero(kept.clipped)
        self.weight.grad = self._product("backward g^T x", g.t(), kept.input)
        if self.bias is not None:
            self.bias.grad, count = F.saturating_sum(g, 0, accumulator_bits=self.accumulator_bits)
            self._count_overflows("backward sum of g", count)
        dx = self._product("backward g W", g, kept.weight)
        (dx, clipped), shift = self._requantize(dx, self.backward_shift, self.error_bits)
        self.stats.backward_shifts.append(shift)
        self.stats.backward_clamps += int(clipped.sum())
        return dx


class ReLU(Module):
    """max(x, 0) on the mantissas (the scale is unchanged); the gradient passes where x > 0."""

    def __init__(self):
        self._positive: torch.Tensor | None = None

    def forward(self, x: DyadicTensor) -> DyadicTensor:
        F.check_dyadic("x", x)
        self._positive = x.mantissa > 0 if self.training else None
        return x.with_mantissa(x.mantissa.clamp_min(0))

    def backward(self, grad: DyadicTensor) -> DyadicTensor:
        self._check_backward(self._positive)
        F.check_dyadic("grad", grad)
        if grad.shape != self._positive.shape:
            raise ValueError(
                f"grad must have the output's shape {tuple(self._positive.shape)}, got "
                f"{tuple(grad.shape)}"
            )
        return grad.masked_zero(~self._positive)


def _held(modules) -> list[Module]:
    """The modules and, inside the Sequentials among them, theirs."""
    held = []
    for m in modules:
        held.append(m)
        if isinstance(m, Sequential):
            held.extend(_held(m.modules))
    return held


class Sequential(Module):
    """Modules applied in order; backward runs them in reverse.

    Each module may appear once (nested Sequentials included): a module keeps what its last
    forward() needs for backward(), so one in two places would compute the gradients of its first
    place from the input of its second.

    A Sequential names its parameters by position, as torch.nn.Sequential's named_parameters():
    it sets each Parameter.name to its name in this Sequential ("0.weight", "1.0.bias" in a
    nested one), the names lpsim.dyadic.optim.SGD keeps its counts by. The names come from the
    structure, not from earlier names: modules put into another Sequential are named by their
    place in that one, the Sequential built last.

    Raises:
        TypeError: a module is not an lpsim.dyadic.nn Module.
        ValueError: a module appears more than once.
    """

    def __init__(self, *modules: Module):
        for m in modules:
            if not isinstance(m, Module):
                raise TypeError(f"Sequential takes lpsim.dyadic.nn modules, got {type(m).__name__}")
        held = _held(modules)
        if len({id(m) for m in held}) != len(held):
            raise ValueError(
                "Sequential takes each module once (each keeps the input of its last forward() "
                "for backward()): make a new module for each place"
            )
        self.modules = list(modules)
        for name, p in self.named_parameters():
            p.name = name

    def train(self, mode: bool = True) -> Sequential:
        super().train(mode)
        for m in self.modules:
            m.train(mode)
        return self

    def forward(self, x: DyadicTensor) -> DyadicTensor:
        for m in self.modules:
            x = m.forward(x)
        return x

    def backward(self, grad: DyadicTensor) -> DyadicTensor:
        for m in reversed(self.modules):
            grad = m.backward(grad)
        return grad

    def parameters(self) -> list[Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        """Each parameter named by its module's position and its own name in that module:
        "0.weight", "2.bias", and "1.0.weight" inside a nested Sequential at position 1."""
        return [
            (f"{i}.{name}", p)
            for i, m in enumerate(self.modules)
            for name, p in m.named_parameters()
        ]

    def stats(self) -> dict[str, LayerStats]:
        """The LayerStats of every layer that keeps them, named by position as the parameters
        are: "0", "2", and "1.0" for the first layer of a nested Sequential at position 1."""
        found = {}
        for i, m in enumerate(self.modules):
            if isinstance(m, Sequential):
                found.update({f"{i}.{name}": s for name, s in m.stats().items()})
            elif isinstance(getattr(m, "stats", None), LayerStats):
                found[str(i)] = m.stats
        return found


class LossOutput(NamedTuple):
    """The loss (a float, for reading), its gradient with respect to the output, and the shift
    the gradient's requantisation applied."""

    loss: float
    grad: DyadicTensor
    shift: int


def _sum_of_squares(m: torch.Tensor) -> int:
    """The exact sum of the squares of integer mantissas: in int64 where it cannot wrap, else in
    Python's integers."""
    if m.numel() == 0:
        return 0
    peak = max(-int(m.min()), int(m.max()))
    if peak * peak * m.numel() < 2**63:
        return int((m.to(torch.int64) ** 2).sum())
    return sum(v * v for v in m.reshape(-1).tolist())


def _ratio_to_float(numerator: int, denominator: int, exponent: int) -> float:
    """numerator / denominator * 2**exponent (numerator >= 0, denominator > 0) rounded once to
    the nearest float64, ties to even: subnormal results included (a division then an ldexp
    would round twice there), inf beyond float64's range."""
    if numerator == 0:
        return 0.0
    magnitude = numerator.bit_length() - denominator.bit_length() + exponent  # log2, +/- 1
    if magnitude > 1026:
        return math.inf
    if magnitude < -1077:  # below a quarter of the smallest subnormal: rounds to 0
        return 0.0
    if exponent >= 0:
        numerator <<= exponent
    else:
        denominator <<= -exponent
    try:
        return numerator / denominator  # Python's integer division rounds once, correctly
    except OverflowError:  # beyond float64's range: read as inf, as a rounding to float64 gives
        return math.inf


def mse_loss(
    output: DyadicTensor,
    target: DyadicTensor,
    *,
    error_bits: int = 8,
    rounding: str = "stochastic",
    accumulator_bits: int = 32,
) -> LossOutput:
    """L = (1 / 2N) sum over the batch and the outputs of (y - t)^2, and dL/dy = (y - t) / N.

    In integers: the target is requantised to the output's scale s_y (a left shift, exact, when
    it is coarser, as a one-hot target at scale 0 is), e = y - t is exact at s_y, and dividing by
    the batch size N is free when N is a power of two (the scale grows by log2 N); otherwise
    e / N = div(e, N, p) with p = N.bit_length(), rounded (on int64 mantissas: e 2**p / N is up
    to one bit wider than e). The gradient is then requantised to ``error_bits`` with the shift
    fit_shift() gives. The loss itself is computed exactly from the integers and only then
    rounded once to the nearest float64 (subnormals included, inf beyond float64's range). Every
    other rounding uses ``rounding`` ("stochastic" by default, "nearest" or "down").

    Raises:
        ValueError: output and target differ in shape, are not (N, C) with one scale, or N = 0.
        OverflowError: the target or the error does not fit the accumulator at the output's scale,
            or (accumulator_bits=64 only) e 2**p / N does not fit int64.
    """
    F.check_dyadic("output", output)
    F.check_dyadic("target", target)
    if output.shape != target.shape or output.mantissa.dim() != 2:
        raise ValueError(
            f"output and target must be (N, C) of one shape, got {tuple(output.shape)}"
            f" and {tuple(target.shape)}"
        )
    if output.shape[0] == 0:
        raise ValueError("mse_loss needs a batch of N >= 1 samples (the mean over N), got N = 0")
    if output.per_channel or target.per_channel:
        raise ValueError("mse_loss needs per-tensor scales")
    check_int("error_bits", error_bits, 2, 32)
    bounds = F.accumulator_range(accumulator_bits)
    moved = F.requantize(target, output.scale, accumulator_bits, rounding=rounding)
    F.check_overflow(
        moved.clip_count, "mse_loss target at the output's scale", bounds, can_saturate=False
    )
    # saturating_sub widens the narrower mantissa to int64: converting an int64 output down to
    # the target's int32 would wrap it before the range check.
    error, count = _accumulated(
        F.saturating_sub(output, moved.value, rounding=rounding), accumulator_bits
    )
    F.check_overflow(count, "mse_loss y - t", bounds, can_saturate=False)
    n = output.shape[0]
    total = _sum_of_squares(error.mantissa)
    loss = _ratio_to_float(total, 2 * n, -2 * error.scale)
    if n & (n - 1) == 0:
        grad = error.ldexp(-(n.bit_length() - 1))
    else:
        # e 2**p / N with 2**p / N in (1, 2) needs one bit more than the error: in int64, which
        # holds it for every accumulator of up to 63 bits (an int32 error near its range would
        # overflow int32 although e / N is smaller than e).
        wide = error.with_mantissa(error.mantissa.to(torch.int64))
        try:
            grad = F.div(
                wide,
                DyadicTensor(torch.tensor(n, dtype=torch.int64)),
                n.bit_length(),
                rounding=rounding,
            )
        except OverflowError:  # only a 64-bit accumulator's error can need a 65th bit
            raise OverflowError(
                f"mse_loss (y - t) / N: e 2**{n.bit_length()} / {n} of an error near the 64-bit "
                "accumulator's range does not fit int64 (accumulator_bits of at most 63 leave "
                "room for it)"
            ) from None
    shift = F.fit_shift(grad, error_bits)
    grad = F.requantize(grad, grad.scale - shift, error_bits, rounding=rounding).value
    return LossOutput(loss, grad, shift)
