"""QPyTorch 0.3, on lpsim's formats and kernels: the same names, signatures and module layout
(``qtorch``, ``qtorch.number``, ``qtorch.quant``, ``qtorch.optim``, ``qtorch.auto_low``), so that a
QPyTorch script changes one import:

    import lpsim.compat.qtorch as qtorch
    from lpsim.compat.qtorch.quant import float_quantize, quantizer, Quantizer
    from lpsim.compat.qtorch.optim import OptimLP
    from lpsim.compat.qtorch.auto_low import lower, sequential_lower

or none: ``install()`` registers this package under the name ``qtorch``, and
``python -m lpsim.compat.qtorch train.py ARGS`` runs an unchanged QPyTorch script with it.

The formats keep the number ranges QPyTorch's kernels produce (the top exponent code is finite,
subnormals exist, overflow saturates: ``FloatingPoint(5, 2)`` reaches 114688), and rounding is
what QPyTorch documents: "nearest" ties to even, "stochastic" is the default. Where QPyTorch's code
does otherwise (float "nearest" ties away from zero, NaN becomes +/-max, ...), this package follows
the documentation and is correct; docs/migrating-from-qtorch.md lists every difference.

Random numbers come from lpsim's generator: pass ``seed=`` or use ``torch.manual_seed``.
"""

from __future__ import annotations

import sys

from lpsim.compat.qtorch import auto_low, number, optim, quant
from lpsim.compat.qtorch.auto_low import lower, sequential_lower
from lpsim.compat.qtorch.auto_low.auto_low import LAYER_TYPES, LAYERS_TYPES
from lpsim.compat.qtorch.number import BlockFloatingPoint, FixedPoint, FloatingPoint, Number
from lpsim.compat.qtorch.optim import OptimLP
from lpsim.compat.qtorch.quant import (
    Quantizer,
    block_quantize,
    fixed_point_quantize,
    float_quantize,
    quantizer,
)

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
    "LAYERS_TYPES",
    "LAYER_TYPES",
    "install",
]

# QPyTorch 0.3's modules, relative to the package.
MODULES = (
    "number",
    "quant",
    "quant.quant_function",
    "quant.quant_module",
    "optim",
    "optim.optim_low",
    "auto_low",
    "auto_low.auto_low",
)


def install(name: str = "qtorch") -> None:
    """Register this package and its modules in ``sys.modules`` under ``name`` ("qtorch"), so that
    ``import qtorch``, ``from qtorch.quant import quantizer`` and the like import lpsim's: an
    unchanged QPyTorch script then runs on lpsim. Call it before the script's first import of
    qtorch. Calling it again changes nothing.

        import lpsim.compat.qtorch; lpsim.compat.qtorch.install()

    Raises:
        TypeError, ValueError: name is not a str, or not a module name (dotted identifiers).
        RuntimeError: another module is already imported under ``name`` (QPyTorch itself, say):
            objects taken from it would stay QPyTorch's.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"name must be a module name such as 'qtorch', got {name!r}")
    package = sys.modules[__name__]
    present = sys.modules.get(name)
    if present is not None and present is not package:
        where = getattr(present, "__file__", present)
        raise RuntimeError(
            f"install(): a module {name!r} is already imported ({where!r}); call "
            f"install() before the first import of {name}"
        )
    sys.modules[name] = package
    for relative in MODULES:
        sys.modules[f"{name}.{relative}"] = sys.modules[f"{__name__}.{relative}"]
