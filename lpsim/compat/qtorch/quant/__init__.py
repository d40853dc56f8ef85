"""QPyTorch's ``qtorch.quant``: quantisation functions, quantizer() and the Quantizer module."""

from lpsim.compat.qtorch.quant.quant_function import (
    block_quantize,
    fixed_point_quantize,
    float_quantize,
    quantizer,
)
from lpsim.compat.qtorch.quant.quant_module import Quantizer

__all__ = ["fixed_point_quantize", "block_quantize", "float_quantize", "quantizer", "Quantizer"]
