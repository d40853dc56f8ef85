"""Optimizers for low-precision training."""

from lpsim.optim.fused import FusedAdam, FusedSGD
from lpsim.optim.loss_scale import DynamicLossScaler
from lpsim.optim.optim_lp import OptimLP, ParameterQuantization
from lpsim.optim.stochastic import SGD, AdamW

__all__ = [
    "DynamicLossScaler",
    "FusedSGD",
    "FusedAdam",
    "OptimLP",
    "ParameterQuantization",
    "SGD",
    "AdamW",
]
