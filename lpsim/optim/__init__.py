"""Optimizers for low-precision training."""

from lpsim.optim.loss_scale import DynamicLossScaler
from lpsim.optim.optim_lp import OptimLP, ParameterQuantization
from lpsim.optim.stochastic import SGD, AdamW

__all__ = ["DynamicLossScaler", "OptimLP", "ParameterQuantization", "SGD", "AdamW"]
