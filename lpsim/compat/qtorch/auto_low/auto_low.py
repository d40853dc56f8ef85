"""QPyTorch's ``qtorch.auto_low.auto_low``: lower() and sequential_lower(), which insert
quantisers after the modules of named layer types, and the layer lists that define the names.

A module is of a layer type when its type is exactly one of the listed classes (subclasses do not
count), as in QPyTorch.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable

from torch import nn

from lpsim.compat.qtorch.number import Number
from lpsim.compat.qtorch.quant.quant_module import Quantizer
from lpsim.nn._hooks import guard_hooks_under_compile, map_tensors

__all__ = ["lower", "sequential_lower"]

SEQUENTIAL_LAYERS = [nn.Sequential, nn.ModuleList]
DICT_LAYERS = [nn.ModuleDict]

CONV_LAYERS = [
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Unfold,
    nn.Fold,
]
POOL_LAYERS = [
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.MaxUnpool1d,
    nn.MaxUnpool2d,
    nn.MaxUnpool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.FractionalMaxPool2d,
    nn.LPPool1d,
    nn.LPPool2d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
]
PAD_LAYERS = [
    nn.ReflectionPad1d,
    nn.ReflectionPad2d,
    nn.ReplicationPad1d,
    nn.ReplicationPad2d,
    nn.ZeroPad2d,
    nn.ConstantPad1d,
    nn.ConstantPad2d,
    nn.ConstantPad3d,
]
ACTIVATION_LAYERS = [
    nn.ELU,
    nn.Hardshrink,
    nn.Hardtanh,
    nn.LeakyReLU,
    nn.LogSigmoid,
    nn.PReLU,
    nn.ReLU,
    nn.ReLU6,
    nn.RReLU,
    nn.SELU,
    nn.Sigmoid,
    nn.Softplus,
    nn.Softshrink,
    nn.Softsign,
    nn.Tanh,
    nn.Tanhshrink,
    nn.Threshold,
    nn.Softmin,
    nn.Softmax,
    nn.Softmax2d,
    nn.LogSoftmax,
]
NORM_LAYERS = [
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.GroupNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LayerNorm,
    nn.LocalResponseNorm,
]
LINEAR_LAYERS = [nn.Linear, nn.Bilinear]
DROPOUT_LAYERS = [nn.Dropout, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout]
LOSS_LAYERS = [
    nn.L1Loss,
    nn.MSELoss,
    nn.CrossEntropyLoss,
    nn.NLLLoss,
    nn.PoissonNLLLoss,
    nn.KLDivLoss,
    nn.BCELoss,
    nn.BCEWithLogitsLoss,
    nn.MarginRankingLoss,
    nn.HingeEmbeddingLoss,
    nn.MultiLabelMarginLoss,
    nn.SmoothL1Loss,
    nn.SoftMarginLoss,
    nn.MultiLabelSoftMarginLoss,
    nn.MultiMarginLoss,
    nn.TripletMarginLoss,
]

# The names lower() and sequential_lower() take, with the classes each stands for.
LAYERS_TYPES = {
    "conv": CONV_LAYERS,
    "linear": LINEAR_LAYERS,
    "pool": POOL_LAYERS,
    "pad": PAD_LAYERS,
    "activation": ACTIVATION_LAYERS,
    "normalization": NORM_LAYERS,
    "dropout": DROPOUT_LAYERS,
    "loss": LOSS_LAYERS,
}
LAYER_TYPES = LAYERS_TYPES  # the name earlier lpsim releases used

_LOWERED = "_qtorch_lowered"  # a lowered module's list of output quantisers, in lower() order


def _layer_classes(layer_types) -> tuple[type, ...]:
    if isinstance(layer_types, str):
        raise TypeError(f"layer_types must be a list of names, got the string {layer_types!r}")
    classes = []
    for name in layer_types:
        if name not in LAYERS_TYPES:
            raise ValueError(f"layer_types must name some of {sorted(LAYERS_TYPES)}; got {name!r}")
        classes.extend(LAYERS_TYPES[name])
    return tuple(classes)


def _quantize_output(module: nn.Module, args, output):
    """Forward hook of a lowered module: its outputs through its quantisers, in lower() order,
    their roundings reported to an attached lpsim.diagnostics.Recorder as the module's."""
    for quant in module.__dict__[_LOWERED]:
        output = map_tensors(output, functools.partial(quant.apply_for, module))
    return output


def remove_lowering(model: nn.Module) -> nn.Module:
    """In place, every quantiser that lower() put on a module of ``model`` (the model included)
    removed: the lowered modules' hooks then pass their outputs on unchanged. Returns the model.
    lpsim.diagnostics.Shadow's float32 reference is made with it."""
    for module in model.modules():
        if _LOWERED in module.__dict__:
            module.__dict__[_LOWERED] = []
    return model


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")


def lower(
    model: nn.Module,
    layer_types: Iterable[str] = (),
    forward_number: Number | None = None,
    backward_number: Number | None = None,
    forward_rounding: str = "stochastic",
    backward_rounding: str = "stochastic",
) -> nn.Module:
    """In place, quantise the outputs (into forward_number) and their gradients (into
    backward_number) of every module of ``model``, the model itself included, whose type is
    exactly one of layer_types' classes. Returns the model (QPyTorch returns None).

    Calls stack as in QPyTorch: a module lowered twice passes its output through the first call's
    quantiser, then the second's, before any forward hook of its own. A call that matches no
    module changes nothing. The quantisers keep stochastic rules in eval mode, as QPyTorch's do.

    The quantisers run in a forward hook (QPyTorch replaces ``module.forward``), so a lowered
    model can be deep-copied, and every floating-point tensor of a tuple, list or dict output is
    quantised. A module that occurs several times in the model is lowered once. Only calls of the
    module (``module(x)``) run the hook: code that calls ``module.forward(x)`` directly gets the
    output unquantised, where QPyTorch's replaced forward quantises it.

    An nn.TransformerEncoder whose layers hold a lowered module gets ``use_nested_tensor =
    False``: given a key padding mask in eval mode without gradients it would hand its layers
    nested tensors, which lpsim's quantisers do not take, where with gradients they get padded
    tensors (torch's fused layer is off already: it checks for forward hooks). remove_lowering()
    leaves it so.

    Raises:
        ValueError: layer_types names an unknown layer type.
        TypeError: a number is not a qtorch Number, or model is not an nn.Module.
    """
    _check_model(model)
    classes = _layer_classes(layer_types)
    quant = Quantizer(forward_number, backward_number, forward_rounding, backward_rounding)
    matched = [m for m in model.modules() if type(m) in classes]
    if matched:
        guard_hooks_under_compile()
    for module in matched:
        if _LOWERED not in module.__dict__:
            module.__dict__[_LOWERED] = []
            module.register_forward_hook(_quantize_output, prepend=True)
        module.__dict__[_LOWERED].append(quant)
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder) and any(
            _LOWERED in m.__dict__ for m in module.layers.modules()
        ):
            module.use_nested_tensor = False
    return model


def sequential_lower(
    model: nn.Module,
    layer_types: Iterable[str] = (),
    forward_number: Number | None = None,
    backward_number: Number | None = None,
    forward_rounding: str = "stochastic",
    backward_rounding: str = "stochastic",
) -> nn.Module:
    """A deep copy of model in which every module without children whose type is exactly one of
    layer_types' classes is replaced by nn.Sequential(module, Quantizer(...)), one Quantizer shared
    by all. A model that is itself such a module becomes nn.Sequential(model copy, Quantizer).

    A module registered under several names (twice in a Sequential, or shared by two parents) is
    replaced under each by the same wrapper, so its output is quantised once wherever it is
    called. QPyTorch skips entries of a container holding a module twice and wraps a leaf of a
    shared parent once per name of the parent.

    Raises:
        ValueError: layer_types names an unknown layer type.
        TypeError: a number is not a qtorch Number, or model is not an nn.Module.
    """
    _check_model(model)
    classes = _layer_classes(layer_types)
    quant = Quantizer(forward_number, backward_number, forward_rounding, backward_rounding)
    model = copy.deepcopy(model)
    leaves = [
        (name, module)
        for name, module in model.named_modules(remove_duplicate=False)
        if type(module) in classes and not any(True for _ in module.children())
    ]
    wrappers: dict[int, nn.Module] = {}
    for name, leaf in leaves:
        if id(leaf) not in wrappers:
            wrappers[id(leaf)] = nn.Sequential(leaf, quant)
        if not name:  # the model itself
            return wrappers[id(leaf)]
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, wrappers[id(leaf)])
    return model
