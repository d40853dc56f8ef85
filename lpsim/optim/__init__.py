"""Optimizers for low-precision training."""

from lpsim.optim.optim_lp import OptimLP

__all__ = ["OptimLP"]
