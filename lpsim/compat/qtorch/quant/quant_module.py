"""QPyTorch's ``qtorch.quant.quant_module``: the Quantizer module."""

from __future__ import annotations

from lpsim import nn as lpnn
from lpsim.compat.qtorch.number import Number, lpsim_format
from lpsim.rounding import Rounding

__all__ = ["Quantizer"]


class Quantizer(lpnn.Quantizer):
    """A module quantising its input into forward_number and the gradient into backward_number
    (None: left as is).

    As in QPyTorch, stochastic rules stay stochastic in eval mode; ``eval_rounding="nearest"``
    makes evaluation deterministic, as lpsim.nn.Quantizer does by default.
    """

    def __init__(
        self,
        forward_number: Number | None = None,
        backward_number: Number | None = None,
        forward_rounding: str = "stochastic",
        backward_rounding: str = "stochastic",
        *,
        eval_rounding: Rounding | str | None = None,
    ):
        super().__init__(
            lpsim_format(forward_number),
            lpsim_format(backward_number),
            forward_rounding,
            backward_rounding,
            eval_rounding=eval_rounding,
        )

    @property
    def quantize(self):
        """The quantisation function the module applies in its current mode (QPyTorch's
        attribute)."""
        return self._apply_train if self.training else self._apply_eval
