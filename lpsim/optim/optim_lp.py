"""OptimLP: low-precision training with any torch.optim optimizer."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim import Optimizer

from lpsim.functional import quantize_
from lpsim.nn.quantizer import QuantSpec, Spec, as_spec
from lpsim.rounding import Rounding

__all__ = ["OptimLP"]

QuantFunction = Callable[[torch.Tensor], torch.Tensor]


def _as_function(value, rounding, name: str) -> QuantFunction | None:
    """A spec (format or (format, rounding)) or any tensor -> tensor function, as a function."""
    if callable(value) and not isinstance(value, tuple):  # a function, or a QuantSpec
        return value
    return as_spec(value, rounding, name)


def _round_in_place(quant: QuantFunction, t: torch.Tensor) -> None:
    """t <- quant(t). A spec rounds in place in one pass; a function's result is copied back
    (measured on 15M parameters: 37 ms in place against 106 ms for copy_(quantize(t)))."""
    if isinstance(quant, QuantSpec):
        quantize_(t, quant.format, quant.rounding)
    else:
        t.copy_(quant(t))


class OptimLP(Optimizer):
    """Wrap ``optimizer`` (any torch.optim optimizer) so that one step is, for every parameter:

    1. gradient: multiplied by ``grad_scaling``, then quantised by ``grad`` (parameters whose
       .grad is None are skipped);
    2. with ``acc``: the parameter's high-precision accumulator (a float copy of the weight,
       itself rounded into ``acc``) takes the weight's place for the update;
    3. ``optimizer.step(closure)``;
    4. every floating-point tensor in the optimizer's state for the parameter (momentum_buffer,
       exp_avg, exp_avg_sq, max_exp_avg_sq, ...; not the 0-d ``step`` counters) quantised by
       ``momentum``;
    5. with ``acc``: the accumulator rounded into ``acc`` and the weight set to it rounded by
       ``weight``; without: the weight rounded by ``weight``.

    Each of ``weight``, ``grad``, ``momentum``, ``acc`` is None (no quantisation), a format, a
    (format, rounding) pair, or any function tensor -> tensor (QPyTorch's convention); bare formats
    use ``rounding``. Quantisation happens in place, so tensors keep their storage (DDP and other
    wrappers hold on to them). Parameter groups and state are the wrapped optimizer's own, so LR
    schedulers, zero_grad and add_param_group act on it; state_dict() includes the accumulators.

    With ``acc`` and a closure, the closure is evaluated at the accumulators' values (the
    parameters hold them during the wrapped step).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        weight: Spec | QuantFunction = None,
        grad: Spec | QuantFunction = None,
        momentum: Spec | QuantFunction = None,
        acc: Spec | QuantFunction = None,
        grad_scaling: float = 1.0,
        rounding: Rounding | str = "stochastic",
    ):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(grad_scaling, (int, float)) or isinstance(grad_scaling, bool) or not grad_scaling > 0:
            raise ValueError(f"grad_scaling must be a positive number, got {grad_scaling!r}")
        self.optimizer = optimizer
        self.weight_quant = _as_function(weight, rounding, "weight")
        self.grad_quant = _as_function(grad, rounding, "grad")
        self.momentum_quant = _as_function(momentum, rounding, "momentum")
        self.acc_quant = _as_function(acc, rounding, "acc")
        self.grad_scaling = float(grad_scaling)
        self.accumulators: dict[torch.Tensor, torch.Tensor] = {}
        # The base class sets up hooks and calls add_param_group on each group, which the wrapped
        # optimizer already holds (see add_param_group); then both share groups and state.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._share_with_optimizer()
        self._init_accumulators()

    def _share_with_optimizer(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def _params(self):
        for group in self.param_groups:
            yield from group["params"]

    def _init_accumulators(self) -> None:
        if self.acc_quant is None:
            return
        with torch.no_grad():
            for p in self._params():
                if p not in self.accumulators:
                    self.accumulators[p] = self.acc_quant(p.detach().clone())

    @torch.no_grad()
    def _quantize_grads(self) -> None:
        for p in self._params():
            if p.grad is None:
                continue
            if self.grad_scaling != 1.0:
                p.grad.mul_(self.grad_scaling)
            if self.grad_quant is not None:
                _round_in_place(self.grad_quant, p.grad)

    @torch.no_grad()
    def _quantize_state(self) -> None:
        if self.momentum_quant is None:
            return
        for p in self._params():
            for key, value in self.optimizer.state.get(p, {}).items():
                if (key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point()
                        and value.dim() > 0):
                    _round_in_place(self.momentum_quant, value)

    def step(self, closure=None):
        """One step of the wrapped optimizer with the quantisation above; returns its loss."""
        self._quantize_grads()
        if self.acc_quant is not None:
            with torch.no_grad():
                for p in self._params():
                    p.copy_(self.accumulators[p])
        loss = self.optimizer.step(closure)
        self._quantize_state()
        with torch.no_grad():
            for p in self._params():
                if self.acc_quant is not None:
                    acc = self.accumulators[p]
                    acc.copy_(p)
                    _round_in_place(self.acc_quant, acc)
                    p.copy_(acc)
                if self.weight_quant is not None:
                    _round_in_place(self.weight_quant, p)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        if any(param_group is group for group in self.optimizer.param_groups):
            return  # one of the wrapped optimizer's own groups, offered by Optimizer.__init__
        self.optimizer.add_param_group(param_group)
        self._share_with_optimizer()
        self._init_accumulators()

    def state_dict(self) -> dict:
        """The wrapped optimizer's state_dict and the accumulators, in parameter order."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "accumulators": [self.accumulators[p].clone() for p in self._params()]
            if self.acc_quant is not None else None,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._share_with_optimizer()
        saved = state_dict.get("accumulators")
        if self.acc_quant is not None:
            params = list(self._params())
            if saved is None or len(saved) != len(params):
                raise ValueError("state_dict holds no accumulators for these parameters")
            with torch.no_grad():
                for p, acc in zip(params, saved):
                    self.accumulators[p] = acc.to(device=p.device, dtype=p.dtype).clone()

    def __repr__(self) -> str:
        parts = [f"{name}={getattr(self, name + '_quant')}"
                 for name in ("weight", "grad", "momentum", "acc")
                 if getattr(self, name + "_quant") is not None]
        if self.grad_scaling != 1.0:
            parts.append(f"grad_scaling={self.grad_scaling}")
        return f"OptimLP({', '.join(parts)}) wrapping {self.optimizer!r}"
