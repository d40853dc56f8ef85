"""QPyTorch's ``qtorch.optim.optim_low``: the OptimLP wrapper."""

from __future__ import annotations

import torch

from lpsim import optim as lpoptim
from lpsim.compat.qtorch.number import Number
from lpsim.optim.optim_lp import TORCH_LAYOUT_EXTRAS, QuantFunction

__all__ = ["OptimLP"]

# The state_dict keys of the accumulators (QPyTorch saves none) and of the delayed-scaling
# states (when some parameter has one), which lpsim.optim.OptimLP.load_state_dict reads.
_WEIGHT_ACC, _SCALERS = TORCH_LAYOUT_EXTRAS


def _with_qtorch_name(error: Exception) -> Exception:
    """error with lpsim.optim.OptimLP's argument name (weight, grad, momentum, acc) at the start of
    its message replaced by this class's (weight_quant, ...)."""
    message = str(error)
    for name in ("weight", "grad", "momentum", "acc"):
        for prefix in (f"{name} ", f"OptimLP {name}:"):
            if message.startswith(prefix):
                return type(error)(message.replace(name, f"{name}_quant", 1))
    return error


class OptimLP(lpoptim.OptimLP):
    """QPyTorch's OptimLP(optim, weight_quant, grad_scaling, grad_quant, momentum_quant,
    acc_quant): the *_quant arguments are functions tensor -> tensor (a quantizer(), a lambda
    around float_quantize, ...) or lpsim formats. One step quantises the gradients (after
    multiplying them by grad_scaling), lets the accumulators take the weights' place, steps the
    wrapped optimizer, and rounds the optimizer state, the accumulators and the weights.

    Unlike QPyTorch it wraps any torch.optim optimizer, forwards the closure, rounds every
    floating-point state tensor (momentum_keys lists them), multiplies the gradients by
    grad_scaling also without grad_quant (QPyTorch then ignores grad_scaling), and rounds each
    accumulator into acc_quant when it is created (QPyTorch copies the weight unrounded).
    As in QPyTorch, weight_quant, grad_quant, momentum_quant and acc_quant may be assigned
    between steps: the next step uses them. With acc_quant the accumulators are the master copy:
    without weight_quant, a weight changed in place between steps (a pruning mask, say) is taken
    into its accumulator (QPyTorch keeps it too, after a first step, where the weight shares its
    accumulator's memory); with a weight_quant function, whose results cannot be predicted, it is
    set back from its accumulator at the next step (as in QPyTorch), unless weight_acc[p] is
    changed too. See lpsim.optim.OptimLP for the rest.

    state_dict() has QPyTorch's layout (a torch optimizer's "state" and "param_groups", here the
    wrapped optimizer's, so the momentum buffers are in it) plus the accumulators under
    "weight_acc" (and, where a *_quant argument is an lpsim DelayedScaling, the scalers' states
    under "scalers"), which QPyTorch's load_state_dict ignores. load_state_dict() takes that, a
    QPyTorch OptimLP's state_dict, a torch optimizer's, or lpsim.optim.OptimLP's.

    Raises:
        TypeError: a *_quant argument is a qtorch number format (FloatingPoint, ...), which
            QPyTorch does not take either: pass a function such as quantizer(number, ...); or it
            is neither a function, an lpsim format nor None (the message names the argument).
        ValueError: an lpsim format given as a *_quant argument does not fit the tensors it rounds
            (the message names the argument), or grad_scaling is not a finite number > 0.
    """

    def __init__(
        self,
        optim: torch.optim.Optimizer,
        weight_quant: QuantFunction | None = None,
        grad_scaling: float = 1.0,
        grad_quant: QuantFunction | None = None,
        momentum_quant: QuantFunction | None = None,
        acc_quant: QuantFunction | None = None,
    ):
        quants = {
            "weight_quant": weight_quant,
            "grad_quant": grad_quant,
            "momentum_quant": momentum_quant,
            "acc_quant": acc_quant,
        }
        for name, value in quants.items():
            if isinstance(value, Number):
                raise TypeError(
                    f"{name} must be a function tensor -> tensor (such as quantizer(number)), an "
                    f"lpsim format or None; got the qtorch number {value!r}"
                )
        try:
            super().__init__(
                optim,
                weight=weight_quant,
                grad=grad_quant,
                momentum=momentum_quant,
                acc=acc_quant,
                grad_scaling=grad_scaling,
            )
        except (TypeError, ValueError) as error:
            raise _with_qtorch_name(error) from None

    @property
    def optim(self) -> torch.optim.Optimizer:
        """The wrapped optimizer (QPyTorch's name for lpsim's ``optimizer``)."""
        return self.optimizer

    @property
    def weight_acc(self) -> dict[torch.Tensor, torch.Tensor]:
        """The accumulators, parameter -> tensor (lpsim's ``accumulators``): after a step each
        holds the updated weight rounded into acc_quant. Empty without acc_quant (QPyTorch then
        has no such attribute)."""
        return self.accumulators

    @property
    def momentum_keys(self) -> list[str]:
        """The keys of the optimizer state that momentum_quant rounds: every floating-point state
        buffer, those of 0-d parameters included, not the per-parameter scalars (step counters,
        ASGD's eta and mu, NAdam's mu_product, LBFGS's H_diag; see lpsim.optim.OptimLP). For SGD
        (momentum_buffer) and Adam or AdamW (exp_avg, exp_avg_sq, and max_exp_avg_sq with
        amsgrad) the list is known before the first step, as in QPyTorch; for other optimizers it
        lists the keys found in the state so far."""
        if isinstance(self.optimizer, torch.optim.SGD):
            return ["momentum_buffer"]
        if isinstance(self.optimizer, torch.optim.Adam):  # AdamW included
            amsgrad = any(group.get("amsgrad", False) for group in self.param_groups)
            return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
        return self._rounded_state_keys()

    def state_dict(self) -> dict:
        """The wrapped optimizer's state_dict ("state", "param_groups": QPyTorch's layout), and
        under "weight_acc" the accumulators in parameter order (None for parameters without one).
        Where a *_quant argument is an lpsim DelayedScaling, the scalers' states are under
        "scalers" as in lpsim.optim.OptimLP.state_dict()."""
        saved = super().state_dict()
        out = {**saved["optimizer"], _WEIGHT_ACC: saved["accumulators"]}
        if any(saved["scalers"]):
            out[_SCALERS] = saved["scalers"]
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict of this class, of QPyTorch's OptimLP (its "state" is empty: QPyTorch
        saves its wrapper's state, not the wrapped optimizer's, so momentum buffers start afresh),
        of a torch optimizer, or of lpsim.optim.OptimLP. Accumulators the state_dict does not hold
        start from the current weights.

        Raises:
            TypeError: state_dict is not a dict.
            ValueError: it is none of these, or holds accumulators for some parameters that need
                one but not for others.
        """
        super().load_state_dict(state_dict)  # which reads every one of these layouts
