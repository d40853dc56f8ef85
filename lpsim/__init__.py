"""lpsim: low-precision arithmetic simulation for PyTorch.

Tensors stay in an ordinary float container (float32, float64, bfloat16 or float16) and fused
kernels round every element into a target format (Float, Fixed, BlockFloat, Scaled) under a chosen
rule. ``quantize(x, fmt, rounding)`` is the API; the QPyTorch names ``float_quantize``,
``fixed_point_quantize`` and ``block_quantize`` are those of ``lpsim.compat.qtorch``: QPyTorch's
signatures, number ranges and defaults (stochastic rounding, ``dim=-1`` for one block over the
whole tensor), with the rounding QPyTorch documents; docs/migrating-from-qtorch.md lists where
QPyTorch's own kernels give other numbers (float ties, NaN, some subnormals and large values).

One word names each feature: ``lpsim.quantize`` rounds a tensor into a format, ``lpsim.update``
holds ``sr_add`` and its fused forms (sums rounded once), ``lpsim.accumulate`` the sums and products
rounded after every operation, ``lpsim.MAC`` the arithmetic inside a matrix product (products,
accumulator, order of the additions), ``lpsim.dyadic`` integer-native arithmetic, and
``lpsim.transforms`` the orthogonal transforms applied before quantisation (``RandomHadamard``).

    >>> import torch, lpsim
    >>> x = torch.tensor([1.0, 1.1, 1.25, 300.0])
    >>> lpsim.quantize(x, lpsim.Float(5, 2), "nearest")
    tensor([  1.0000,   1.0000,   1.2500, 320.0000])
"""

import torch

from lpsim import (
    accumulate,
    compat,
    diagnostics,  # the recorder of rounding statistics and the float32 shadow
    dyadic,  # integer-native arithmetic on (mantissa, scale) pairs
    formats,
    mac,  # the arithmetic of a simulated matrix product: MAC
    nn,
    optim,
    recipes,
    scaled,  # scaled formats: MX, NVFP4, FP8 with block, row or tensor scales
    statistics,  # what a rounding did: overflow, underflow, subnormal counts, squared errors
    transforms,
    update,
)
from lpsim._ops import cpu_generator, cuda_built
from lpsim.compat.qtorch import block_quantize, fixed_point_quantize, float_quantize
from lpsim.delayed_scaling import DelayedScaling
from lpsim.formats import P3109, PRESETS, BlockFloat, Fixed, Float, preset
from lpsim.functional import quantize, quantize_
from lpsim.mac import MAC
from lpsim.multi_tensor import quantize_many_
from lpsim.nn.quantizer import QuantSpec
from lpsim.rounding import Rounding
from lpsim.scaled import PowerOfTwo, Scaled
from lpsim.transforms import RandomHadamard
from lpsim.update import (
    sr_add,
    sr_add_,
    sr_addcdiv,
    sr_addcdiv_,
    sr_addcmul,
    sr_addcmul_,
)

__version__ = "0.1.0"

# Optimizers' param_groups (FusedSGD, FusedAdam, lpsim.optim.SGD and AdamW) hold formats and the
# rules that round into them: plain data (a format pickles as its fields), which torch.load's
# default weights_only unpickler may then build.
torch.serialization.add_safe_globals(
    [Float, Fixed, P3109, BlockFloat, PowerOfTwo, Scaled, DelayedScaling, QuantSpec, Rounding]
)

# Reachable as lpsim.demo, lpsim.explore and lpsim.finfo without importing them with the package
# (so that `python -m lpsim.demo` and `python -m lpsim.explore` run them once).
_LAZY_MODULES = ("demo", "explore")


def __getattr__(name: str):
    import importlib  # noqa: PLC0415

    if name in _LAZY_MODULES:
        return importlib.import_module(f"lpsim.{name}")
    if name == "finfo":
        return importlib.import_module("lpsim.explore").finfo
    raise AttributeError(f"module 'lpsim' has no attribute {name!r}")


__all__ = [
    "finfo",
    "Float",
    "Fixed",
    "BlockFloat",
    "P3109",
    "Scaled",
    "PowerOfTwo",
    "scaled",
    "Rounding",
    "PRESETS",
    "preset",
    "formats",
    "nn",
    "optim",
    "quantize",
    "quantize_",
    "quantize_many_",
    "float_quantize",
    "fixed_point_quantize",
    "block_quantize",
    "cuda_built",
    "cpu_generator",
    "dyadic",
    "sr_add",
    "sr_add_",
    "sr_addcmul",
    "sr_addcmul_",
    "sr_addcdiv",
    "sr_addcdiv_",
    "update",
    "accumulate",
    "MAC",
    "mac",
    "recipes",
    "compat",
    "transforms",
    "RandomHadamard",
    "statistics",
    "diagnostics",
]
