"""Drop-in names of other libraries, on top of lpsim's formats and kernels.

- ``lpsim.compat.qtorch``: QPyTorch 0.3's package (number formats, quantisers, OptimLP, lower).
- ``lpsim.compat.stochastorch``: StochasTorch's ``StochasticAdder``.
"""

from lpsim.compat import qtorch, stochastorch

__all__ = ["qtorch", "stochastorch"]
