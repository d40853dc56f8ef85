"""Optimizers for low-precision training."""

from lpsim.optim.optim_lp import OptimLP
from lpsim.optim.stochastic import SGD, AdamW

__all__ = ["OptimLP", "SGD", "AdamW"]
