"""The base of lpsim's own torch optimizers (FusedSGD, FusedAdam, lpsim.optim.SGD and AdamW), and
what every lpsim optimizer keeps in a copy."""

from __future__ import annotations

import functools

import torch
from torch.optim import Optimizer


@functools.cache
def _torch_attributes() -> frozenset[str]:
    """The attributes torch's Optimizer gives every optimizer: its state (defaults, state,
    param_groups) and what its __getstate__ leaves out on purpose (the per-optimizer hooks, which
    may be closures, and the names and warnings its __setstate__ makes again)."""
    return frozenset(Optimizer([torch.zeros(1, requires_grad=True)], {}).__dict__)


def pickled_state(optimizer: Optimizer) -> dict:
    """An lpsim optimizer's state for pickle (copy.copy, copy.deepcopy, pickle, torch.save of the
    optimizer): torch's (defaults, state, param_groups) and every attribute of the optimizer's own
    (grad_scaling, the stream counter, the wrapped optimizer, ...), which torch's
    Optimizer.__getstate__ drops, so that a copy would lack them or step without them. Left out,
    as torch leaves them out: its per-optimizer hooks, and methods set on the instance over the
    class's (an LR scheduler's wrapper of step, which steps the optimizer it was made for: the
    copy's step would step the original)."""
    cls = type(optimizer)
    own = {
        k: v
        for k, v in vars(optimizer).items()
        if k not in _torch_attributes() and not hasattr(cls, k)
    }
    return {**Optimizer.__getstate__(optimizer), **own}


class OwnOptions(Optimizer):
    """A torch Optimizer whose options are its own: torch's Optimizer.__setstate__, which
    load_state_dict and unpickling call, adds a "differentiable" option to the defaults, which
    these optimizers do not have. Kept, it would enter every group added after a load (and
    FusedSGD's and FusedAdam's loaded groups), so that a resumed run's optimizer would differ
    from the run's it continues; it is dropped again. A copy keeps every attribute
    (pickled_state)."""

    __getstate__ = pickled_state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.defaults.pop("differentiable", None)
