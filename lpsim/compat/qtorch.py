"""QPyTorch 0.3's names and signatures, so that a QPyTorch script changes one import:

    from lpsim.compat.qtorch import FloatingPoint, FixedPoint, float_quantize, ...
    from lpsim.compat.qtorch import quantizer, Quantizer, OptimLP, lower, sequential_lower

The formats keep the number ranges QPyTorch's kernels produce (the top exponent code is finite,
subnormals exist, overflow saturates: ``FloatingPoint(5, 2)`` reaches 114688), and rounding is
what QPyTorch documents: "nearest" ties to even, "stochastic" is the default. Where QPyTorch's code
does otherwise (float "nearest" ties away from zero, NaN becomes +/-max, ...), this module follows
the documentation and is correct; docs/migrating-from-qtorch.md lists every difference.

Random numbers come from lpsim's generator: pass ``seed=`` or use ``torch.manual_seed``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch
from torch import nn

from lpsim import functional
from lpsim import nn as lpnn
from lpsim import optim as lpoptim
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
    "quantizer",
    "Quantizer",
    "OptimLP",
    "lower",
    "sequential_lower",
    "LAYER_TYPES",
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


def _format(number: Number | None):
    if number is not None and not isinstance(number, Number):
        raise TypeError(f"expected a qtorch number format (FloatingPoint, ...), got {number!r}")
    return None if number is None else number.format


def quantizer(forward_number: Number | None = None, backward_number: Number | None = None,
              forward_rounding: str = "stochastic", backward_rounding: str = "stochastic",
              clamping_grad_zero: bool = False,
              backward_hooks: Iterable[Callable[[torch.Tensor], torch.Tensor]] = ()):
    """QPyTorch's quantizer(): a differentiable function quantising activations forward and
    gradients backward. Unlike QPyTorch, backward_hooks always run (QPyTorch applies them only with
    clamping_grad_zero), and clamping_grad_zero also accepts saturating float formats."""
    return lpnn.quantizer(_format(forward_number), _format(backward_number), forward_rounding,
                          backward_rounding, clamp_grad_zero=clamping_grad_zero,
                          backward_hooks=backward_hooks)


class Quantizer(lpnn.Quantizer):
    """QPyTorch's Quantizer module."""

    def __init__(self, forward_number: Number | None = None, backward_number: Number | None = None,
                 forward_rounding: str = "stochastic", backward_rounding: str = "stochastic"):
        super().__init__(_format(forward_number), _format(backward_number), forward_rounding,
                         backward_rounding)


class OptimLP(lpoptim.OptimLP):
    """QPyTorch's OptimLP(optim, weight_quant, grad_scaling, grad_quant, momentum_quant,
    acc_quant): the *_quant arguments are functions tensor -> tensor. Unlike QPyTorch it wraps any
    torch.optim optimizer, forwards the closure, and quantises every floating state buffer."""

    def __init__(self, optim, weight_quant=None, grad_scaling: float = 1.0, grad_quant=None,
                 momentum_quant=None, acc_quant=None):
        super().__init__(optim, weight=weight_quant, grad=grad_quant, momentum=momentum_quant,
                         acc=acc_quant, grad_scaling=grad_scaling)


# QPyTorch's layer-type names for lower() and sequential_lower(), with the classes they stand for.
LAYER_TYPES = {
    "conv": (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
             nn.ConvTranspose3d, nn.Unfold, nn.Fold),
    "linear": (nn.Linear, nn.Bilinear),
    "pool": (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.MaxUnpool1d, nn.MaxUnpool2d,
             nn.MaxUnpool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.FractionalMaxPool2d,
             nn.LPPool1d, nn.LPPool2d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
             nn.AdaptiveMaxPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d),
    "pad": (nn.ReflectionPad1d, nn.ReflectionPad2d, nn.ReplicationPad1d, nn.ReplicationPad2d,
            nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d),
    "activation": (nn.ELU, nn.Hardshrink, nn.Hardtanh, nn.LeakyReLU, nn.LogSigmoid, nn.PReLU,
                   nn.ReLU, nn.ReLU6, nn.RReLU, nn.SELU, nn.Sigmoid, nn.Softplus, nn.Softshrink,
                   nn.Softsign, nn.Tanh, nn.Tanhshrink, nn.Threshold, nn.Softmin, nn.Softmax,
                   nn.Softmax2d, nn.LogSoftmax),
    "normalization": (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm,
                      nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LayerNorm,
                      nn.LocalResponseNorm),
    "dropout": (nn.Dropout, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout),
    "loss": (nn.L1Loss, nn.MSELoss, nn.CrossEntropyLoss, nn.NLLLoss, nn.PoissonNLLLoss,
             nn.KLDivLoss, nn.BCELoss, nn.BCEWithLogitsLoss, nn.MarginRankingLoss,
             nn.HingeEmbeddingLoss, nn.MultiLabelMarginLoss, nn.SmoothL1Loss, nn.SoftMarginLoss,
             nn.MultiLabelSoftMarginLoss, nn.MultiMarginLoss, nn.TripletMarginLoss),
}


def _layer_classes(layer_types) -> tuple[type, ...]:
    classes = []
    for name in layer_types:
        if name not in LAYER_TYPES:
            raise ValueError(f"layer_types must name some of {sorted(LAYER_TYPES)}; got {name!r}")
        classes.extend(LAYER_TYPES[name])
    return tuple(classes)


def lower(model: nn.Module, layer_types=(), forward_number: Number | None = None,
          backward_number: Number | None = None, forward_rounding: str = "stochastic",
          backward_rounding: str = "stochastic") -> nn.Module:
    """QPyTorch's lower(): in place, quantise the outputs (forward_number) and their gradients
    (backward_number) of every module whose type is exactly one of layer_types' classes. Returns
    the model (QPyTorch returns None)."""
    classes = _layer_classes(layer_types)
    settings = lpnn.LayerQuantization(
        output=None if forward_number is None else (_format(forward_number), forward_rounding),
        error=None if backward_number is None else (_format(backward_number), backward_rounding),
    )
    exact_type = lambda name, module: type(module) in classes  # noqa: E731  (QPyTorch's rule)
    return lpnn.inject(model, {exact_type: settings})


def sequential_lower(model: nn.Module, layer_types=(), forward_number: Number | None = None,
                     backward_number: Number | None = None, forward_rounding: str = "stochastic",
                     backward_rounding: str = "stochastic") -> nn.Module:
    """QPyTorch's sequential_lower(): a deep copy of model in which every leaf module whose type is
    exactly one of layer_types' classes is replaced by nn.Sequential(module, Quantizer(...))."""
    classes = _layer_classes(layer_types)
    quant = Quantizer(forward_number, backward_number, forward_rounding, backward_rounding)
    lowered = copy.deepcopy(model)

    def wrap(module: nn.Module) -> nn.Module:
        for name, child in module.named_children():
            if type(child) in classes and not any(True for _ in child.children()):
                setattr(module, name, nn.Sequential(child, quant))
            else:
                wrap(child)
        return module

    return wrap(lowered)
