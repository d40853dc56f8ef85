"""The recorder: statistics of every rounding of a training run, per step, module and category.

    model, optimizer = lpsim.recipes.FIXED8.apply(model, torch.optim.SGD(model.parameters(), 0.05))
    with Recorder(model, optimizer) as recorder:
        for x, y in batches:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            (loss * lpsim.recipes.FIXED8.loss_scale).backward()
            optimizer.step()                # ends the step: the recorder moves to the next
    print(recorder.table())
    recorder.to_csv("roundings.csv")
    recorder.plot("errors.png", metric="underflow", category="error")

What is recorded while the recorder is attached:

- the model's roundings: in every module that lpsim.nn.inject quantises, under the module's
  qualified name ("(model)" for the model itself) and the category "weight", "bias" (the
  parametrisations, in every forward pass), "input", "output" or "error" (the gradient flowing
  back into the module's outputs); in every lpsim.nn.Quantizer module, "output" (its forward
  rounding) and "error" (its backward rounding), and likewise the quantisers that
  lpsim.compat.qtorch's lower() puts on a module's outputs, under that module's name. Only
  roundings in training mode, unless ``record_eval=True``. Modules outside the recorder's model
  are not recorded. A forward that activation checkpointing (torch.utils.checkpoint) recomputes
  during the backward pass is not recorded again: the counts are those of one forward.
- an OptimLP's roundings: under the parameter's qualified name in the model ("0.weight" for the
  parameter inject's quantiser rounds; the full name of each of several tensors that a weight is
  computed from, "0.parametrizations.weight.original0" and "...original1" under weight_norm, as
  lpsim.nn.inject.parameter_name gives them; without
  a model, "group0.param0" for parameter 0 of group 0) and the category "grad", "momentum" (every
  rounded state tensor: momentum_buffer, exp_avg, ...), "accumulator" or "weight" (the weight
  rounding that ends a step). Parameters outside the recorder's model and optimizer are not
  recorded.
- stagnation: per parameter and step, how many elements the step should have moved and how many
  of them it left where they were (Stagnation, below): for an OptimLP, of the parameters whose
  weight or accumulator it rounds (none of those it leaves in full precision: the recipes' first
  and last layers, the master weights of the scaled recipes, round_weights=False); for any other
  optimizer, of every parameter with a gradient.

A record holds a RoundingStatistics (lpsim.statistics): counts of elements, and of nonfinite,
overflowing, underflowing (nonzero to zero), subnormal and unchanged elements, and the float64
sums of the squared rounding errors and squared values, from which the SQNR in dB follows. The
roundings of one step, module and category add up into one record (the several outputs of a
module, the state tensors of a parameter, the forward passes of gradient accumulation, the calls
of a module called several times). A module registered under several names (one module shared by
two places of the model, such as the one Quantizer of lpsim.compat.qtorch's sequential_lower())
has one name, the first that model.named_modules() gives it: its roundings in every place add up
there.

Not recorded: the roundings of lpsim.nn.quantize_functions contexts (matmul, linear, softmax and
attention called as functions), of the lpsim.nn.quantizer() function (it belongs to no module; the
Quantizer module's are recorded), of the operands of products under MACs (lpsim.nn.functional's
Operands, and the input_format, weight_format and grad_format of its products called directly),
and those inside a MAC's products (LayerQuantization.mac, Recipe.mac: the rounded
products and partial sums, forward and backward; a product's result is no rounding of one tensor):
a model that rounds only there has no records.

FusedSGD and FusedAdam round inside one compiled pass, and lpsim.optim.SGD and AdamW (weights
stored in low precision, updated by lpsim.sr_add and sr_addcdiv_ in one rounding) inside one
op, so only their stagnation is recorded: they give no "weight" record.
Roundings by functions that are not formats (OptimLP accepts any function tensor -> tensor) have
no format to count against and are not recorded (their stagnation is).

Names. attach() names the model's modules and parameters and the optimizer's parameters, and so
does each recorded step of the optimizer, before it runs: a parameter group added meanwhile
(add_param_group) is recorded from that step on. A module or parameter added to the model while
the recorder is attached is named at its first rounding, and recorded from there (one that
rounded before, outside the model, too); one that another module replaced in the model
(``model[1] = new``) is no longer recorded.

Steps. The step counter starts at 0. The attached optimizer's step() ends a step (through a step
hook), and so does Recorder.step(): call it yourself when the recorder has no optimizer. With
``every=k`` only the steps 0, k, 2k, ... are recorded; during the others nothing observes. A step
that a DynamicLossScaler skips does not call the optimizer's step(): its roundings count towards
the next.

Detached, nothing observes: every call site costs one attribute lookup and a branch. attach()
makes the recorder lpsim._observation's current observer, registers two step hooks on the
optimizer and two of torch's global module and parameter registration hooks (after which the
next rounding names the model's modules and parameters again, see Names); detach() undoes
these, and nothing else is changed, so the model and the optimizer are exactly as before.
Recording draws no random numbers and writes no tensor of the run: a run with a recorder attached
is bit for bit the run without.

torch.compile: a compiled model gives the records it gives in eager mode, bit for bit, and its
run stays the run without a recorder, except with stochastic rounding under Inductor: the graphs
broken apart draw other random numbers than the whole graphs, so the run with a recorder attached
differs from the run without unless ``torch._inductor.config.fallback_random = True`` (which also
makes both equal eager runs, docs/training.md). Each rounding's statistics are taken outside
the compiled graphs, which break there (the steps run slower, and a model compiled with
``fullgraph=True`` raises dynamo's Unsupported error while a recorder observes it: record without
fullgraph). The guards of the broken graphs do not see the recorder, so detach() drops
torch.compile's caches (torch.compiler.reset()) where graphs were compiled while it was attached:
the model then compiles once more into its unbroken graphs. With ``every=k`` the steps between
recorded ones run the broken graphs too. Given torch.compile's wrapper, a recorder names the
modules as the wrapper does ("_orig_mod.0"); given the model, as the model does ("0").

Distributed training (torch.distributed, DistributedDataParallel): a recorder records the
roundings of its own process only, and nothing is reduced across ranks. The model's inputs,
outputs and errors are those of the rank's own batches and differ between ranks; the weights and
the optimizer's roundings (of the all-reduced gradients) are the same on every rank. Gather the
records yourself where needed (torch.distributed.all_gather_object of ``records``). As recording
changes nothing of the run, a recorder attached on one rank only (rank 0, say) leaves the ranks'
weights identical. Given the DistributedDataParallel wrapper, a recorder names the modules as the
wrapper does ("module.0"); given the wrapped model, as the model does ("0").
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim import Optimizer

from lpsim import _observation
from lpsim.nn.inject import parameter_name
from lpsim.nn.quantizer import QuantSpec, ScalerCall
from lpsim.optim.fused import FusedAdam, FusedSGD
from lpsim.optim.optim_lp import OptimLP
from lpsim.optim.stochastic import SGD as LowPrecisionSGD
from lpsim.optim.stochastic import AdamW as LowPrecisionAdamW
from lpsim.statistics import FRACTIONS, RoundingStatistics, rounding_statistics

__all__ = [
    "Recorder",
    "Record",
    "StagnationRecord",
    "Stagnation",
    "CATEGORIES",
    "PLOT_METRICS",
]

# What a recorder can record: the model's categories, the optimizer's, and stagnation.
CATEGORIES = (
    "weight",
    "bias",
    "input",
    "output",
    "error",
    "grad",
    "momentum",
    "accumulator",
    "stagnation",
)
PLOT_METRICS = ("underflow", "overflow", "subnormal", "unchanged", "sqnr_db")
SUMMARY_KEYS = ("step", "module", "category")
STAGNATION_KEYS = ("step", "parameter")
CSV_COLUMNS = (
    "step",
    "module",
    "category",
    "elements",
    "nonfinite",
    "overflow",
    "underflow",
    "subnormal",
    "unchanged",
    "squared_error",
    "squared_value",
    "sqnr_db",
    "relative_error",
    "updated",
    "lost",
    "stagnation",
)
_TENSORBOARD_FRACTIONS = ("overflow", "underflow", "subnormal")

_attached = None  # the Recorder attached now (one at a time), or None


@dataclass(frozen=True)
class Stagnation:
    """What one or more steps did to a parameter's elements that should have moved.

    Attributes:
        elements: elements of the parameter.
        updated: elements whose update was nonzero. With OptimLP: elements whose new value
            before its rounding differs from the value before the step. That value is the
            weight, or with an accumulator (``acc``) the accumulator as the step begins (a weight
            changed outside the optimizer taken in: docs/training.md, OptimLP): the update moves
            it, and the weight follows it rounded. With any other optimizer (FusedSGD, FusedAdam,
            lpsim.optim.SGD and AdamW, torch's), whose updates are not seen: elements with a
            nonzero gradient before the step, or the gradient its closure computed, for
            step(closure) (for a sparse gradient, a nonzero dense value).
        lost: of the updated elements, those the step left where they were (OptimLP: those its
            rounding returned to the old weight, or to the old accumulator; otherwise those whose
            weight after the step equals the weight before it, or for FusedSGD and FusedAdam with
            an ``acc_format``, whose accumulator after the step equals the accumulator before
            it: the update moves the accumulator, which keeps what the weight's rounding drops;
            for lpsim.optim.SGD and AdamW with ``kahan=True``, whose weight and compensation
            are both as before it: the compensation keeps the part of the update that the
            weight's rounding left out, to be applied later).

    Stagnations add up with ``+``.
    """

    elements: int = 0
    updated: int = 0
    lost: int = 0

    def __add__(self, other: Stagnation) -> Stagnation:
        if not isinstance(other, Stagnation):
            return NotImplemented
        return Stagnation(
            self.elements + other.elements, self.updated + other.updated, self.lost + other.lost
        )

    @property
    def fraction(self) -> float:
        """lost / updated, the share of the nonzero updates that were lost (nan when there were
        none)."""
        return self.lost / self.updated if self.updated else math.nan

    def as_dict(self) -> dict:
        """The fields and the fraction, for CSV and JSON."""
        return {
            "elements": self.elements,
            "updated": self.updated,
            "lost": self.lost,
            "fraction": self.fraction,
        }


def _compiled_graphs() -> int:
    """How many graphs torch.compile has compiled in this process so far."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")  # not loaded: nothing compiled yet
    return 0 if dynamo_utils is None else dynamo_utils.counters["stats"]["unique_graphs"]


class Record(NamedTuple):
    """The statistics of the roundings of one category in one module (or parameter) in one
    step."""

    step: int
    module: str
    category: str
    statistics: RoundingStatistics


class StagnationRecord(NamedTuple):
    """The stagnation of one parameter in one step."""

    step: int
    parameter: str
    stagnation: Stagnation


class Recorder:
    """Records the statistics of every rounding in ``model`` and ``optimizer`` while attached
    (see the module docstring for what is recorded, and how steps are counted).

    Args:
        model: the model whose roundings are recorded (injected with lpsim.nn.inject, or holding
            lpsim.nn.Quantizer modules), or None.
        optimizer: the optimizer whose roundings (OptimLP) and stagnation (any optimizer) are
            recorded, and whose step() ends each step; or None. The one whose step() the
            training calls: an OptimLP, not the optimizer it wraps (which is refused).
        categories: the categories to record, a subset of CATEGORIES (one name or several;
            default all).
        every: record every ``every``-th step only (steps 0, every, 2 * every, ...).
        record_eval: also record the model's roundings in eval mode.

    Raises:
        TypeError: model is not an nn.Module, optimizer not a torch optimizer, or an argument
            has the wrong type (the message names it).
        ValueError: neither a model nor an optimizer, an unknown category, every < 1, or an
            OptimLP wraps optimizer (pass the OptimLP).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: Optimizer | None = None,
        *,
        categories: Iterable[str] | str | None = None,
        every: int = 1,
        record_eval: bool = False,
    ):
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module or None, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
            )
        if model is None and optimizer is None:
            raise ValueError("Recorder needs a model, an optimizer or both; got neither")
        _check_not_wrapped(optimizer)
        if not isinstance(every, int) or isinstance(every, bool):
            raise TypeError(f"every must be an int, got {type(every).__name__}")
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        if not isinstance(record_eval, bool):
            raise TypeError(f"record_eval must be a bool, got {type(record_eval).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.categories = _checked_categories(categories)
        self.every = every
        self.record_eval = record_eval
        self.current_step = 0
        self._statistics: dict[tuple[int, str, str], RoundingStatistics] = {}
        self._stagnation: dict[tuple[int, str], Stagnation] = {}
        self._names: dict[int, str] = {}  # id of a module or parameter -> its name
        self._unnamed: dict[int, weakref.ref] = {}  # owners found to have no name, by id
        self._hooks: list = []
        self._graphs_at_attach = 0
        self._registered = False  # a module or parameter registered since the last naming
        # id(parameter) -> (its weight before the step, the mask of its nonzero gradient or None)
        self._before_step: dict[int, _BeforeStep] = {}
        # Stagnation in OptimLP is seen in the rounding of the value its update moves (the
        # weight's, or the accumulator's), which is then observed.
        self._observed = set(self.categories) | (
            {"weight", "accumulator"} if "stagnation" in self.categories else set()
        )

    # Attaching

    @property
    def attached(self) -> bool:
        """Whether the recorder is attached."""
        return _attached is self

    def attach(self) -> Recorder:
        """Start recording (at the current step); returns the recorder.

        Raises:
            RuntimeError: this or another recorder is attached already.
            ValueError: an OptimLP wraps the optimizer (made around it since the recorder was).
        """
        global _attached
        if _attached is self:
            raise RuntimeError("this Recorder is attached already")
        if _attached is not None:
            raise RuntimeError("another Recorder is attached: detach it first")
        _check_not_wrapped(self.optimizer)
        self._names = self._collect_names()
        self._unnamed.clear()
        self._registered = False
        # A module or parameter registered anywhere may give an owner a name in the model (a
        # module called on its own, then added to the model; one put in another's place).
        self._hooks = [
            register_module_module_registration_hook(self._registration),
            register_module_parameter_registration_hook(self._registration),
        ]
        if self.optimizer is not None:
            self._hooks += [
                self.optimizer.register_step_pre_hook(self._before_optimizer_step),
                self.optimizer.register_step_post_hook(self._after_optimizer_step),
            ]
        _attached = self
        self._graphs_at_attach = _compiled_graphs()
        self._observe_if_recorded()
        return self

    def detach(self) -> None:
        """Stop recording: no observer and no hook of the recorder is left (a detached recorder
        may be detached again, which does nothing). The records stay."""
        global _attached
        if _attached is not self:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._before_step.clear()
        _observation.current = None
        _attached = None
        if _compiled_graphs() != self._graphs_at_attach:
            # torch.compile traced the model while this recorder observed: the statistics break
            # its graphs, and the guards of the broken graphs do not see the observer, so they
            # would keep serving the model after detaching. Dropping them lets it compile again
            # without the breaks.
            torch.compiler.reset()

    def __enter__(self) -> Recorder:
        return self.attach()

    def __exit__(self, *exc_info: object) -> None:
        self.detach()

    @property
    def current_step(self) -> int:
        """The step being recorded, counted from 0. In a resumed run, set it to the number of
        optimizer steps already taken (before attach() or while attached: ``every`` then decides
        at once whether this step is recorded), so that the step numbers continue the run's.

        Raises:
            TypeError: the value assigned is not an int.
            ValueError: it is negative.
        """
        return self._current_step

    @current_step.setter
    def current_step(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"current_step must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"current_step must be at least 0, got {value}")
        self._current_step = value
        if self.attached:
            self._observe_if_recorded()

    def step(self) -> None:
        """End the current step and move to the next (the attached optimizer's step() calls
        this)."""
        self.current_step += 1

    def _recorded(self) -> bool:
        return self.current_step % self.every == 0

    def _observe_if_recorded(self) -> None:
        _observation.current = self if self._recorded() else None

    def _collect_names(self) -> dict[int, str]:
        names = {}
        if self.optimizer is not None:
            for g, group in enumerate(self.optimizer.param_groups):
                for i, p in enumerate(group["params"]):
                    names[id(p)] = f"group{g}.param{i}"
        if self.model is not None:
            for name, module in self.model.named_modules():
                names[id(module)] = name or "(model)"
            for name, p in self.model.named_parameters():
                names[id(p)] = parameter_name(name)
        return names

    def _registration(self, module: nn.Module, name: str, value: object) -> None:
        """A module or parameter was registered somewhere: the next rounding names the model's
        modules and parameters again."""
        self._registered = True

    def _name_of(self, owner: object) -> str | None:
        """owner's name (None: not the model's or the optimizer's). After a module or parameter
        was registered, and for an owner the last naming did not name (once per such owner), the
        model's modules and parameters are named again."""
        if self._registered:
            self._registered = False
            self._names = self._collect_names()
            self._unnamed.clear()
        name = self._names.get(id(owner))
        if name is not None:
            return name
        known = self._unnamed.get(id(owner))
        if known is not None and known() is owner:
            return None
        self._names = self._collect_names()
        name = self._names.get(id(owner))
        if name is None:
            self._unnamed[id(owner)] = weakref.ref(owner)
        return name

    # The observer (called by the quantising call sites, see lpsim._observation)

    def wants(self, category: str) -> bool:
        """Whether roundings of ``category`` are observed (sites that round in place copy the
        tensor first only then)."""
        return category in self._observed

    def observe(
        self,
        owner: object,
        category: str,
        x: torch.Tensor,
        rounded: torch.Tensor,
        quantiser: object,
        training: bool,
    ) -> None:
        """Record that ``x`` was rounded to ``rounded`` by ``quantiser`` in ``owner`` (a module of
        the model or a parameter), under ``category``."""
        if not training and not self.record_eval:
            return
        if isinstance(owner, nn.Module) and category != "error" and _observation.recomputing():
            return  # a forward recomputed by activation checkpointing, recorded the first time
        name = self._name_of(owner)
        if name is None:
            return
        before = self._before_step.get(id(owner))
        if before is not None and before.category == category:
            del self._before_step[id(owner)]
            self._add_stagnation(name, _lost_updates(before, x, rounded))
        if category not in self.categories:
            return
        fmt = _format_of(quantiser)
        if fmt is None:
            return
        key = (self.current_step, name, category)
        statistics = rounding_statistics(x, rounded, fmt)
        self._statistics[key] = self._statistics.get(key, RoundingStatistics()) + statistics

    def _add_stagnation(self, parameter: str, stagnation: Stagnation) -> None:
        key = (self.current_step, parameter)
        self._stagnation[key] = self._stagnation.get(key, Stagnation()) + stagnation

    # Stagnation through the optimizer's step hooks

    def _before_optimizer_step(
        self, optimizer: Optimizer, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        self._before_step.clear()
        if not self._recorded():
            return None
        # Parameter groups added since (add_param_group), modules and parameters added to the
        # model: named as attach() names them, so that this step's roundings are recorded.
        self._names = self._collect_names()
        if "stagnation" not in self.categories:
            return None
        # args: the optimizer, then step's own arguments (torch's step hooks).
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if isinstance(optimizer, (OptimLP, FusedSGD, FusedAdam)):
            # The accumulators as the update finds them: step() first takes into them the weights
            # changed outside the optimizer (a pruning mask, a loaded model state). Done here, it
            # draws what step() would draw, in the same order, and leaves step() nothing to take.
            if isinstance(optimizer, OptimLP):
                optimizer._configure_changed_groups()
            optimizer._adopt_changed_weights()
        for p in _parameters(optimizer):
            if id(p) not in self._names:
                continue
            if isinstance(optimizer, OptimLP):
                settings = optimizer.parameter_settings(p)
                if settings is None:
                    continue
                if settings.acc is not None:
                    # The update moves the accumulator (made with the optimizer or its parameter
                    # group; one made in this step has no value before it).
                    acc = optimizer.accumulators.get(p)
                    if acc is not None:
                        before = _BeforeStep(None, acc.detach().clone(), "accumulator")
                        self._before_step[id(p)] = before
                elif settings.weight is not None:
                    before = _BeforeStep(None, p.detach().clone(), "weight")
                    self._before_step[id(p)] = before
            elif p.grad is not None or closure is not None:
                moved = tuple(t.detach().clone() for t in _moved_values(optimizer, p))
                self._before_step[id(p)] = _BeforeStep(_nonzero(p.grad), moved, "")
        if closure is None or not any(b.category == "" for b in self._before_step.values()):
            return None
        # The closure computes the step's gradient (after zero_grad): the moving elements are
        # those of the gradient it leaves (its last call's, where the optimizer calls it several
        # times). It is called as given, and returns what it returns.

        def closure_then_gradients():
            loss = closure()
            for p in _parameters(optimizer):
                before = self._before_step.get(id(p))
                if before is not None and before.category == "":
                    self._before_step[id(p)] = before._replace(moving=_nonzero(p.grad))
            return loss

        if len(args) > 1:
            return (args[0], closure_then_gradients, *args[2:]), kwargs
        return args, {**kwargs, "closure": closure_then_gradients}

    def _after_optimizer_step(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> None:
        for p in _parameters(optimizer):
            found = self._before_step.get(id(p))
            if found is not None and found.category == "" and found.moving is not None:
                moving = found.moving
                lost = moving
                for now, before in zip(_moved_values(optimizer, p), found.previous, strict=True):
                    lost = lost & (now.detach() == before)
                stagnation = Stagnation(p.numel(), int(moving.sum()), int(lost.sum()))
                self._add_stagnation(self._names[id(p)], stagnation)
        self._before_step.clear()
        self.step()

    # Results

    @property
    def records(self) -> list[Record]:
        """Every record, in the order the keys first occurred (steps in order)."""
        return [Record(*key, statistics) for key, statistics in self._statistics.items()]

    @property
    def stagnation_records(self) -> list[StagnationRecord]:
        """The stagnation of every parameter in every recorded step."""
        return [StagnationRecord(*key, value) for key, value in self._stagnation.items()]

    def summary(
        self, by: Iterable[str] | str = ("module", "category")
    ) -> dict[tuple, RoundingStatistics]:
        """The records added up (with ``+``) per value of ``by``, a subset of ("step", "module",
        "category"): {(values of by...): RoundingStatistics}, in the order of first occurrence.

        Raises:
            ValueError: by names something else, or a key twice.
        """
        keys = _checked_keys(by, SUMMARY_KEYS, "by")
        return _totals(self.records, keys, "statistics", RoundingStatistics())

    def stagnation_summary(
        self, by: Iterable[str] | str = ("parameter",)
    ) -> dict[tuple, Stagnation]:
        """The stagnation records added up per value of ``by``, a subset of ("step",
        "parameter").

        Raises:
            ValueError: by names something else, or a key twice.
        """
        keys = _checked_keys(by, STAGNATION_KEYS, "by")
        return _totals(self.stagnation_records, keys, "stagnation", Stagnation())

    def table(self, by: Iterable[str] | str = ("module", "category")) -> str:
        """A plain-text table of ``summary(by)``: elements, the overflow, underflow, subnormal and
        unchanged elements in percent of the finite ones, and the SQNR in dB ("inf": exact;
        "-": no signal, or sums beyond float64's range: see RoundingStatistics.sqnr_db). Then,
        where stagnation was recorded, a table of it per parameter (and step, when by holds
        "step"): updated and lost elements, and the lost ones in percent of the updated ones.

        Raises:
            ValueError: as summary().
        """
        keys = _checked_keys(by, SUMMARY_KEYS, "by")
        header = (*keys, "elements", *(f"{name} %" for name in FRACTIONS), "SQNR dB")
        rows = [header]
        for key, statistics in self.summary(keys).items():
            rows.append(
                (
                    *map(str, key),
                    str(statistics.elements),
                    *(percent_text(statistics.fraction(name)) for name in FRACTIONS),
                    _decibels(statistics.sqnr_db),
                )
            )
        lines = _aligned(rows, len(keys)) if len(rows) > 1 else ["no roundings recorded"]
        stagnation_keys = tuple(
            "parameter" if k == "module" else k for k in keys if k != "category"
        )
        stagnation = self.stagnation_summary(stagnation_keys)
        if stagnation:
            rows = [(*stagnation_keys, "updated", "lost", "stagnation %")]
            for key, value in stagnation.items():
                rows.append(
                    (
                        *map(str, key),
                        str(value.updated),
                        str(value.lost),
                        percent_text(value.fraction),
                    )
                )
            lines += [""] + _aligned(rows, len(stagnation_keys))
        return "\n".join(lines)

    def to_csv(self, path: str | os.PathLike) -> None:
        """Write every record to a CSV file with the columns CSV_COLUMNS: one row per record
        (the RoundingStatistics fields, sqnr_db and relative_error), then one row per stagnation
        record (category "stagnation", the parameter in the module column; elements, updated,
        lost, and the fraction in the stagnation column). Cells that do not apply are empty;
        floats are written exactly (Python's repr: "inf" and "nan" included).

        Raises:
            TypeError: path is not a str or os.PathLike (an int would be taken by open() as a
                file descriptor, written into and closed).
        """
        _check_path(path)
        with open(path, "w", newline="") as file:
            writer = csv.DictWriter(file, CSV_COLUMNS, restval="")
            writer.writeheader()
            for record in self.records:
                writer.writerow(
                    {
                        "step": record.step,
                        "module": record.module,
                        "category": record.category,
                        **record.statistics.as_dict(),
                    }
                )
            for record in self.stagnation_records:
                value = record.stagnation
                writer.writerow(
                    {
                        "step": record.step,
                        "module": record.parameter,
                        "category": "stagnation",
                        "elements": value.elements,
                        "updated": value.updated,
                        "lost": value.lost,
                        "stagnation": value.fraction,
                    }
                )

    def to_json(self, path: str | os.PathLike) -> None:
        """Write every record to a JSON file: {"every": ..., "records": [{"step", "module",
        "category", the RoundingStatistics fields, "sqnr_db", "relative_error"}, ...],
        "stagnation": [{"step", "parameter", "elements", "updated", "lost", "fraction"}, ...]}.
        Non-finite numbers (an exact rounding's infinite SQNR, say) are written as null, so
        that the file is standard JSON.

        Raises:
            TypeError: path is not a str or os.PathLike (as to_csv).
        """
        _check_path(path)
        data = {
            "every": self.every,
            "records": [
                {
                    "step": r.step,
                    "module": r.module,
                    "category": r.category,
                    **_finite_or_none(r.statistics.as_dict()),
                }
                for r in self.records
            ],
            "stagnation": [
                {
                    "step": r.step,
                    "parameter": r.parameter,
                    **_finite_or_none(r.stagnation.as_dict()),
                }
                for r in self.stagnation_records
            ],
        }
        with open(path, "w") as file:
            json.dump(data, file, indent=1, allow_nan=False)
            file.write("\n")

    def plot(
        self, path: str | os.PathLike, metric: str = "underflow", category: str | None = None
    ) -> None:
        """Save a heatmap of ``metric`` per layer (rows) and recorded step (columns) as an image
        (PNG for a .png path; any format matplotlib writes). Metrics: "underflow", "overflow",
        "subnormal", "unchanged" (in percent of the finite elements) and "sqnr_db". Rows are the
        modules (and parameters) with records of ``category``, or every (module, category) pair
        when category is None. Cells without a value (no record, no signal, or an exact rounding's
        infinite SQNR) are left blank. Needs matplotlib; does not touch pyplot's state.

        Raises:
            TypeError: path is not a str or os.PathLike (as to_csv).
            ValueError: metric or category is unknown, or nothing of category was recorded.
            ImportError: matplotlib is not installed.
        """
        _check_path(path)
        if metric not in PLOT_METRICS:
            raise ValueError(f"metric must be one of {PLOT_METRICS}, got {metric!r}")
        if category is not None and category not in CATEGORIES[:-1]:
            raise ValueError(f"category must be None or one of {CATEGORIES[:-1]}, got {category!r}")
        records = [r for r in self.records if category is None or r.category == category]
        if not records:
            raise ValueError(f"nothing recorded for category {category!r}")
        rows = list(dict.fromkeys((r.module, r.category) for r in records))
        steps = sorted({r.step for r in records})
        values = torch.full((len(rows), len(steps)), math.nan, dtype=torch.float64)
        row_of = {row: i for i, row in enumerate(rows)}
        column_of = {step: j for j, step in enumerate(steps)}
        for r in records:
            values[row_of[r.module, r.category], column_of[r.step]] = _metric(r.statistics, metric)
        labels = [m if category is not None else f"{m} {c}" for m, c in rows]
        _heatmap(path, values, labels, steps, metric, category)

    def to_tensorboard(self, writer: object) -> None:
        """Write every record as TensorBoard scalars at its step: "<category>/<metric>/<module>"
        for the metrics overflow, underflow and subnormal (percent of the finite elements) and
        sqnr_db (when finite), and "stagnation/<parameter>" (percent of the updated elements,
        when any were updated).

        Args:
            writer: a log directory (a torch.utils.tensorboard.SummaryWriter is opened on it and
                closed again; needs the tensorboard package) or any object with
                ``add_scalar(tag, value, step)``, such as an open SummaryWriter.

        Raises:
            ImportError: writer is a directory and tensorboard is not installed.
            TypeError: writer is neither a path nor has add_scalar.
        """
        if isinstance(writer, (str, os.PathLike)):
            summary_writer = _summary_writer(writer)
            try:
                self._write_scalars(summary_writer)
            finally:
                summary_writer.close()
            return
        if not callable(getattr(writer, "add_scalar", None)):
            raise TypeError(
                "writer must be a log directory or have add_scalar(tag, value, step), got "
                f"{type(writer).__name__}"
            )
        self._write_scalars(writer)

    def _write_scalars(self, writer) -> None:
        for r in self.records:
            for name in _TENSORBOARD_FRACTIONS:
                percent = 100 * r.statistics.fraction(name)
                _add_scalar(writer, f"{r.category}/{name}/{r.module}", percent, r.step)
            _add_scalar(writer, f"{r.category}/sqnr_db/{r.module}", r.statistics.sqnr_db, r.step)
        for r in self.stagnation_records:
            _add_scalar(writer, f"stagnation/{r.parameter}", 100 * r.stagnation.fraction, r.step)

    def __repr__(self) -> str:
        state = "attached" if self.attached else "detached"
        return (
            f"Recorder({state}, step {self.current_step}, every={self.every}, "
            f"{len(self._statistics)} records, {len(self._stagnation)} stagnation records)"
        )


def _totals(records, keys: tuple[str, ...], field: str, zero):
    """The ``field`` of the records added up with ``+`` (starting from ``zero``) per tuple of
    their ``keys`` attributes, in the order of first occurrence."""
    totals = {}
    for record in records:
        key = tuple(getattr(record, k) for k in keys)
        totals[key] = totals.get(key, zero) + getattr(record, field)
    return totals


def _check_path(path) -> None:
    """Raises TypeError unless path is a file name (str, bytes or os.PathLike): open() takes an
    int as a file descriptor, which the writers would write into and close."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")


def _checked_categories(categories) -> tuple[str, ...]:
    if categories is None:
        return CATEGORIES
    if not isinstance(categories, (str, Iterable)):
        raise TypeError(
            f"categories must be a str, an iterable of str or None, got {type(categories).__name__}"
        )
    names = (categories,) if isinstance(categories, str) else tuple(categories)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"categories must hold strings, got {type(name).__name__}")
        if name not in CATEGORIES:
            raise ValueError(f"categories: unknown category {name!r}; choose from {CATEGORIES}")
    if not names:
        raise ValueError(f"categories must name at least one of {CATEGORIES}")
    return tuple(c for c in CATEGORIES if c in names)


def _checked_keys(by, allowed: tuple[str, ...], name: str) -> tuple[str, ...]:
    keys = (by,) if isinstance(by, str) else tuple(by)
    for key in keys:
        if key not in allowed:
            raise ValueError(f"{name} must name some of {allowed}, got {key!r}")
    if len(set(keys)) != len(keys):
        raise ValueError(f"{name} names a key twice: {keys}")
    return keys


def _check_not_wrapped(optimizer: Optimizer | None) -> None:
    """Raises ValueError where an OptimLP wraps ``optimizer`` (recipe.apply(model, sgd) wraps
    sgd): the wrapped optimizer's step runs inside the OptimLP's, before its state and weight
    roundings, so its step hooks would end the recorder's step too early (those roundings would
    count towards the next) and see the weights half-updated."""
    if optimizer is None:
        return
    wrapper = OptimLP.wrapping(optimizer)
    if wrapper is not None:
        raise ValueError(
            f"optimizer: this {type(optimizer).__name__} is wrapped by an OptimLP (recipe.apply "
            "returns it): pass the OptimLP, whose step() you call, so that each step's roundings "
            "and stagnation are recorded in that step"
        )


def _parameters(optimizer: Optimizer):
    for group in optimizer.param_groups:
        yield from group["params"]


def _format_of(quantiser):
    """The format a quantiser rounds into (for a scaler's call, the DelayedScaler, whose latest
    call's scale sets the range: see lpsim.statistics), or None for a function that is not a
    spec."""
    if isinstance(quantiser, QuantSpec):
        return quantiser.format
    if isinstance(quantiser, ScalerCall):
        return quantiser.scaler
    return None


class _BeforeStep(NamedTuple):
    """A parameter before an optimizer step. Optimizers whose roundings are not seen: the
    elements with a nonzero gradient (``moving``; None while a closure has yet to compute it), the
    values the step moves (``previous``, a tuple: _moved_values) and the category "". OptimLP:
    moving is None, previous is the value its update moves (the accumulator with one, else the
    weight), and ``category`` the observed rounding of its new value ("accumulator" or
    "weight")."""

    moving: torch.Tensor | None
    previous: torch.Tensor | tuple[torch.Tensor, ...]
    category: str


def _moved_values(optimizer: Optimizer, p: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors whose values the step of an optimizer that is not an OptimLP moves, and keeps
    the update in: the accumulator of a FusedSGD or FusedAdam parameter with one (made with the
    optimizer or its parameter group, as OptimLP's), which the weight follows rounded; the weight
    and its Kahan compensation under lpsim.optim.SGD or AdamW with kahan=True (the compensation
    holds the part of the updates not applied yet; zero before the first step makes it); else
    the weight."""
    state = optimizer.state.get(p, {})
    if isinstance(optimizer, (FusedSGD, FusedAdam)):
        accumulator = state.get("accumulator")
        if accumulator is not None:
            return (accumulator,)
    if isinstance(optimizer, (LowPrecisionSGD, LowPrecisionAdamW)):
        compensation = state.get("compensation")
        if compensation is not None:
            return p, compensation
        if any(g["kahan"] for g in optimizer.param_groups if any(q is p for q in g["params"])):
            return p, torch.zeros_like(p)
    return (p,)


def _nonzero(grad: torch.Tensor | None) -> torch.Tensor | None:
    """The mask of a gradient's nonzero elements (None for no gradient). A sparse gradient
    (nn.Embedding(sparse=True)) moves the elements where its dense value, its repeated indices
    added up, is nonzero."""
    if grad is None:
        return None
    return (grad.to_dense() if grad.is_sparse else grad) != 0


def _lost_updates(before: _BeforeStep, x: torch.Tensor, rounded: torch.Tensor) -> Stagnation:
    """The stagnation of the rounding of an OptimLP's updated value: x (the new weight or
    accumulator before its rounding, maybe in a wider dtype) rounded to ``rounded``. Updated: the
    elements where x differs from the value before the step; lost: of those, the ones the rounding
    returned to it."""
    previous = before.previous.to(x.dtype)
    updated = x != previous
    lost = updated & (rounded == previous)
    return Stagnation(x.numel(), int(updated.sum()), int(lost.sum()))


def _metric(statistics: RoundingStatistics, metric: str) -> float:
    if metric == "sqnr_db":
        return statistics.sqnr_db
    return 100 * statistics.fraction(metric)


def percent_text(fraction: float, decimals: int = 2) -> str:
    """100 * fraction with ``decimals`` decimals, as the tables print a share ("-" for nan), never
    0 or 100 unless it is: a share that would print as 0 is written as 1.0e-03 (say), and one
    that would print as 100 gets the decimals that tell it from 100 (99.9995 for one element in
    200,000 left out)."""
    if math.isnan(fraction):
        return "-"
    percent = 100 * fraction
    text = f"{percent:.{decimals}f}"
    if percent in (0, 100):
        return text
    if float(text) == 0:
        return f"{percent:.1e}"
    while float(text) == 100 and decimals < 17:
        decimals += 1
        text = f"{percent:.{decimals}f}"
    return text


def _decibels(value: float) -> str:
    if math.isnan(value):
        return "-"
    return "inf" if math.isinf(value) else f"{value:.1f}"


def _aligned(rows: list[tuple[str, ...]], text_columns: int) -> list[str]:
    """Rows as lines of columns two spaces apart, a rule under the header; the first
    ``text_columns`` columns left-aligned, the numbers right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def line(row):
        cells = [
            cell.ljust(width) if i < text_columns else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ]
        return "  ".join(cells).rstrip()

    lines = [line(row) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return lines


def _finite_or_none(values: dict) -> dict:
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()
    }


def _add_scalar(writer, tag: str, value: float, step: int) -> None:
    if math.isfinite(value):
        writer.add_scalar(tag, value, step)


def _summary_writer(logdir):
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional dependency
    except ImportError as error:
        raise ImportError(
            "Recorder.to_tensorboard(logdir) needs the tensorboard package (pip install "
            "tensorboard); without it, pass any object with add_scalar(tag, value, step)"
        ) from error
    return SummaryWriter(os.fspath(logdir))


def _heatmap(path, values: torch.Tensor, labels: list[str], steps: list[int], metric, category):
    try:
        from matplotlib.figure import Figure  # noqa: PLC0415 - optional dependency
    except ImportError as error:
        raise ImportError("Recorder.plot needs matplotlib (pip install matplotlib)") from error
    import numpy  # noqa: PLC0415

    data = values.numpy()
    figure = Figure(
        figsize=(min(16.0, 3.0 + 0.25 * len(steps)), 1.5 + 0.3 * len(labels)), layout="constrained"
    )
    axes = figure.subplots()
    image = axes.imshow(
        numpy.ma.masked_invalid(data), aspect="auto", interpolation="nearest", cmap="viridis"
    )
    axes.set_yticks(range(len(labels)), labels=labels)
    shown = range(0, len(steps), max(1, len(steps) // 12))
    axes.set_xticks(list(shown), labels=[str(steps[j]) for j in shown])
    axes.set_xlabel("step")
    unit = "SQNR (dB)" if metric == "sqnr_db" else f"{metric} (% of elements)"
    figure.colorbar(image, ax=axes, label=unit)
    axes.set_title(f"{unit}" + (f", {category}" if category is not None else ""))
    figure.savefig(path, dpi=100)
