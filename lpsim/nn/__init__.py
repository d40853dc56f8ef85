"""Quantisers for training: differentiable quantisation of activations and errors, modules, and
injection of quantisers into existing models."""

from lpsim.nn.functions import FunctionQuantization, quantize_functions
from lpsim.nn.inject import (
    DEFAULT,
    LayerQuantization,
    inject,
    injected,
    quantized_parameters,
    remove,
    report,
)
from lpsim.nn.quantizer import Quantizer, QuantSpec, as_spec, quantizer

__all__ = [
    "quantizer",
    "Quantizer",
    "QuantSpec",
    "as_spec",
    "LayerQuantization",
    "inject",
    "remove",
    "report",
    "injected",
    "quantized_parameters",
    "DEFAULT",
    "quantize_functions",
    "FunctionQuantization",
]
