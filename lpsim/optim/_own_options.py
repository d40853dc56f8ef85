"""The base of lpsim's own torch optimizers (FusedSGD, FusedAdam, lpsim.optim.SGD and AdamW)."""

from __future__ import annotations

from torch.optim import Optimizer


class OwnOptions(Optimizer):
    """A torch Optimizer whose options are its own: torch's Optimizer.__setstate__, which
    load_state_dict and unpickling call, adds a "differentiable" option to the defaults, which
    these optimizers do not have. Kept, it would enter every group added after a load (and
    FusedSGD's and FusedAdam's loaded groups), so that a resumed run's optimizer would differ
    from the run's it continues; it is dropped again."""

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.defaults.pop("differentiable", None)
