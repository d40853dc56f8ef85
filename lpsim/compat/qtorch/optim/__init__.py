"""QPyTorch's ``qtorch.optim``: the OptimLP wrapper."""

from lpsim.compat.qtorch.optim.optim_low import OptimLP

__all__ = ["OptimLP"]
