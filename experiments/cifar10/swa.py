"""Stochastic weight averaging (Izmailov et al., UAI 2018) of a low-precision run, as SWALP does it
(Yang et al., ICML 2019): an equal-weight running average of the weights at the end of every epoch
from the start epoch on, kept in full precision in a separate copy of the network (without
quantisers), whose batch-norm statistics are recomputed on the training data before it is
evaluated."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["WeightAverage"]


class WeightAverage:
    """A running average of a model's parameters in ``average_model``, a full-precision instance
    of the same architecture.

    Attributes:
        model: the averaged network.
        count: how many weight vectors the average holds.
    """

    def __init__(self, average_model: nn.Module):
        self.model = average_model
        self.count = 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold model's current parameters into the average: with n held,
        average <- average * (1 - 1/(n+1)) + weights / (n+1) (QPyTorch's moving_average).

        Raises:
            ValueError: model's parameter names differ from the average's.
        """
        current = dict(model.named_parameters())
        mine = dict(self.model.named_parameters())
        if current.keys() != mine.keys():
            raise ValueError(
                "the averaged model and the trained model have different parameters: "
                f"{sorted(set(current) ^ set(mine))[:4]}"
            )
        alpha = 1.0 / (self.count + 1)
        for name, p in mine.items():
            p.mul_(1.0 - alpha).add_(current[name].detach() * alpha)
        self.count += 1

    def recompute_batch_norm(self, batches: Iterable[torch.Tensor]) -> None:
        """Reset the batch-norm statistics and re-estimate them as the plain average over
        ``batches`` (inputs, on the model's device), in training mode. No-op without batch norm."""
        torch.optim.swa_utils.update_bn(batches, self.model)

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.count = int(state["count"])
