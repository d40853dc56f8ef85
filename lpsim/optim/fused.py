"""FusedSGD and FusedAdam: OptimLP(torch.optim.SGD / Adam / AdamW) in one pass per step.

``OptimLP(torch.optim.SGD(params, ...), weight=..., grad=..., momentum=..., acc=...)`` reads and
writes every parameter, gradient and state tensor several times per step (scale the gradient, round
it, torch's update in several elementwise ops, round the states, round the accumulator, round the
weight). These optimizers do the same step in one compiled pass over the elements of all
parameters: each element's gradient, states and weight are read once, torch's float32 arithmetic is
applied (lpsim/optim_step.h reproduces torch's CPU single-tensor kernels operation by operation) and
the results are rounded by the same rounding core, with the same random words, as OptimLP's
quantize_many_ calls.

Bit-identity. For float32 parameters on the CPU, after the same ``torch.manual_seed``, a step gives
bit for bit the parameters, gradients, states and accumulators that OptimLP around the torch
optimizer gives (foreach=False, torch's CPU default), for every format and rule: the seeds are
drawn from torch's default CPU generator in OptimLP's order and each tensor gets OptimLP's stream
offset. That order: one seed per stochastic spec (format and rule) per phase, phases in the order
gradients, states, accumulators, weights, specs in the order they first appear in parameter order;
tensor i of a spec's batch uses the stream offset i (states: exp_avg before exp_avg_sq for each
parameter). torch's float32 ``sqrt`` (Adam) is called through the library torch uses (MKL's vsSqrt
where torch is built with it), since it is not always correctly rounded.

CUDA. Where lpsim is built with its CUDA kernels, CUDA parameters take a kernel over the same core
with the same random words, in the arithmetic of torch's CUDA kernels (lpsim/optim_step.h: Adam's
last addition and square root differ from the CPU's), meant to be OptimLP's around torch's
optimizer with foreach=False on that device (tests/test_fused_optim_cuda.py, run by ``make
gpu-check``). That holds for FusedSGD; FusedAdam's parameters have been seen to differ from torch's
by one unit in the last place in a few elements (docs/training.md), so FusedAdam is not yet
bit-exact on CUDA.

Limits: float32 parameters only (other dtypes raise TypeError), CPU and CUDA devices only (others
raise NotImplementedError), element formats (Float, Fixed, P3109) only, Adam without amsgrad, no
closure re-evaluation at accumulator values (the closure runs first, as torch's optimizers run it),
no parameter or gradient whose elements share memory (expand()'s: RuntimeError before the step
changes anything; the step writes both in place).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from lpsim._checks import (
    check_betas,
    check_element_format,
    check_factor,
    check_number,
    draw_seed,
    positive_finite_attribute,
)
from lpsim._ops import cuda_built, ops
from lpsim.formats import GRID_FORMATS, BlockFloat, Float, sum_container
from lpsim.functional import quantize, quantize_
from lpsim.nn.quantizer import QuantSpec, Spec, as_spec
from lpsim.optim._own_options import OwnOptions
from lpsim.rounding import Rounding

__all__ = ["FusedSGD", "FusedAdam"]

_CATEGORIES = ("grad", "state", "acc", "weight")  # the op's rounding categories, in its order
_ACC = _CATEGORIES.index("acc")
_WEIGHT = _CATEGORIES.index("weight")
_UNROUNDED = Float(8, 23)  # the grid passed for a category that is not rounded (rule -1)
_NO_SEED = torch.zeros((), dtype=torch.int64)


def _kernel_devices() -> tuple[str, ...]:
    """The device types lpsim::optim_step_ has kernels for in this build."""
    return ("cpu", "cuda") if cuda_built() else ("cpu",)


def _spec(value, rounding, name: str) -> QuantSpec | None:
    """A format, a (format, rounding) pair or None as a QuantSpec of an element format."""
    spec = as_spec(value, rounding, name)
    if spec is not None:
        check_element_format(name, spec.format)
    return spec


class _Fused(OwnOptions):
    """What FusedSGD and FusedAdam share: the formats, the accumulators, the seeds and offsets of
    OptimLP's batches, and the call of the compiled step."""

    _RULE: StepRule  # the step arithmetic
    # The torch optimizer's options that a group of its state_dict may lack (saved by a torch
    # that did not have them), with the value torch's __setstate__ then gives them.
    _TORCH_DEFAULTS: dict = {}

    grad_scaling = positive_finite_attribute(
        "grad_scaling",
        "Every gradient is multiplied by it first: a finite number > 0, checked when assigned; a "
        "new value applies from the next step.",
    )

    def __init__(self, params, defaults: dict, formats: dict, grad_scaling: float, rounding):
        Rounding.parse(rounding)
        for name, value in formats.items():
            _spec(value, rounding, name)  # checked here; made a QuantSpec per group
            # Kept as given: a bare format takes the rule of each group that inherits it, so a
            # group that sets only "rounding" rounds the default formats by its own rule.
            defaults[name] = value
        defaults["rounding"] = rounding
        self._check_options(defaults)
        self.grad_scaling = grad_scaling
        # Each parameter with an accumulator: its version counter when the accumulator was made
        # from it ("made") or it was last set from the accumulator ("written"), to see a weight
        # changed outside the optimizer (_adopt_changed_weights), as OptimLP sees it.
        self._weight_versions: dict[torch.Tensor, tuple[int, str]] = {}
        # The accumulator each of those versions was recorded with: a state put in place without
        # load_state_dict (ZeroRedundancyOptimizer.load_state_dict sets the local optimizer's
        # state itself) holds another, loaded one.
        self._recorded_accumulators: dict[torch.Tensor, torch.Tensor] = {}
        super().__init__(params, defaults)

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        state.setdefault("_weight_versions", {})  # pickled before it was kept
        state.setdefault("_recorded_accumulators", {})
        super().__setstate__(state)

    def _check_options(self, group: dict) -> None:
        """The optimizer's options, of its defaults or of a parameter group (which may set any of
        them).

        Raises:
            TypeError / ValueError: an option has the wrong type or range (the message names it).
        """
        raise NotImplementedError

    def _refuse_unsupported(self, group: dict) -> None:
        """Refuse a group asking for a torch option the step does not implement: differentiable
        (torch's step then records itself for autograd; this one runs under torch.no_grad), which
        a group may carry, as one loaded from a torch optimizer's state_dict does. (foreach,
        fused and capturable choose how torch computes the same step, and are left alone.)

        Raises:
            ValueError: the option is set (the message names it).
        """
        if group.get("differentiable") not in (None, False):
            raise ValueError(
                f"differentiable must be False or None: {type(self).__name__}'s step is not "
                f"differentiable, got {group['differentiable']!r}"
            )

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group, len(self.param_groups) - 1)
        except (TypeError, ValueError, NotImplementedError):
            self.param_groups.pop()  # a refused group is not kept: the optimizer stays usable
            raise
        self._start_accumulators(group)

    @torch.no_grad()
    def _start_accumulators(self, group: dict) -> None:
        """Give each parameter of ``group`` that has none an accumulator (where the group has an
        acc_format): as OptimLP's, the weight rounded into acc_format."""
        acc = self._group_specs(group)[_ACC]
        if acc is None:
            return
        for p in group["params"]:
            if "accumulator" not in self.state[p]:
                self.state[p]["accumulator"] = quantize(p.detach().clone(), *acc)
                self._record(p, "made")

    @torch.no_grad()
    def _adopt_changed_weights(self) -> None:
        """OptimLP's first act in a step (docs/training.md): the elements of a weight changed
        outside the optimizer since its accumulator was made from it or it was last set from it
        (a pruning mask, model.load_state_dict; seen by its version counter) that hold a value the
        accumulator does not round to by weight_format (for a stochastic rule, neither neighbour)
        and that do not round into acc_format to the accumulator (before the first step only this
        counts) become the weight rounded into acc_format; the other elements keep theirs. One
        rounding per parameter so changed, in the order the accumulators were made, with
        OptimLP's random draws.

        Raises:
            TypeError / ValueError: a group's option or format is refused (as step()).
        """
        if all(p._version == version for p, (version, _) in self._weight_versions.items()):
            return  # the common step: no weight written since (no group's specs to make)
        specs = {}
        for group in self.param_groups:
            group_spec = self._group_specs(group)
            specs.update((p, group_spec) for p in group["params"])
        for p, (version, kind) in self._weight_versions.items():
            acc = self.state.get(p, {}).get("accumulator")
            if acc is not None and acc is not self._recorded_accumulators.get(p, acc):
                # Loaded without load_state_dict (by ZeroRedundancyOptimizer): the weights it was
                # saved with were set from it, as load_state_dict takes a loaded one.
                kind = "written"
            spec = specs.get(p)
            if p._version == version or acc is None or spec is None or spec[_ACC] is None:
                continue
            weight = p.detach()
            made = could_give(spec[_ACC], weight, acc)
            kept = made
            if kind == "written":
                # What the accumulator rounds to, or a value that rounds into acc_format to it.
                kept = could_give(spec[_WEIGHT], acc, weight)
                if kept is not None:
                    kept = kept | made
            if kept is None or bool(kept.all()):
                continue
            fresh = quantize(weight, *spec[_ACC])
            acc.copy_(torch.where(kept, acc, fresh))

    def _record_written(self) -> None:
        """Every parameter with an accumulator recorded as just set from it."""
        for p in self._weight_versions:
            self._record(p, "written")

    def _record(self, p: torch.Tensor, kind: str) -> None:
        """p's version counter now, with its accumulator ("made" from p, or "written" to p)."""
        self._weight_versions[p] = (p._version, kind)
        self._recorded_accumulators[p] = self.state.get(p, {}).get("accumulator")

    def _group_specs(self, group: dict) -> tuple[QuantSpec | None, ...]:
        """The QuantSpec (or None) of each category of _CATEGORIES in a parameter group, made
        from its formats as they are now: a bare format takes the group's rule as it is now, so
        that a rule or a format set on the group since it was made applies, as torch's
        optimizers read a group's options at every step.

        Raises:
            TypeError / ValueError: an option, the rule or a format is refused (the message names
                it).
        """
        self._check_options(group)
        Rounding.parse(group["rounding"])
        specs = []
        for category in _CATEGORIES:
            name = f"{category}_format"
            spec = _spec(group[name], group["rounding"], name)
            specs.append(spec)
            if spec is not None:
                try:
                    spec.format.grid_arguments(torch.float32)
                except ValueError as error:
                    raise ValueError(f"{name}: {error}") from None
                if category == "acc" and sum_container(spec.format, torch.float32) != torch.float32:
                    raise ValueError(
                        f"{name}: the sums of {spec.format!r} need a float64 accumulator (a Fixed "
                        "without clamp continues beyond its range), and the fused step keeps "
                        "float32 ones; use clamp=True, or OptimLP, which keeps float64 ones"
                    )
        return tuple(specs)

    def _check_group(self, group: dict, index: int) -> None:
        """A parameter group's options and formats and its parameters' dtypes and devices, with
        the errors add_param_group raises."""
        self._group_specs(group)
        for i, p in enumerate(group["params"]):
            if any(q is p for q in group["params"][:i]):
                raise ValueError(
                    f"parameter {i} of group {index} is listed twice in it (pass each parameter "
                    "once: the fused step would update it twice in one pass)"
                )
            if p.dtype != torch.float32:
                raise TypeError(
                    f"{type(self).__name__} takes float32 parameters; parameter {i} of group "
                    f"{index} is {p.dtype}"
                )
            devices = _kernel_devices()
            if p.device.type not in devices:
                raise NotImplementedError(
                    f"lpsim::optim_step_ has no kernel for {p.device.type} parameters "
                    f"({type(self).__name__} runs on {' and '.join(devices)} tensors)"
                )

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict of this optimizer, or of the torch optimizer it fuses (SGD, Adam or
        AdamW), as OptimLP loads one: the saved options apply (AdamW's decoupled_weight_decay as
        ``decoupled``), torch's options that its older versions did not save (SGD's nesterov and
        maximize, Adam's amsgrad and maximize) take torch's defaults where a saved group lacks
        them, as torch's __setstate__ gives them (the saved run ran without them), other options
        and formats a saved group lacks take this optimizer's constructor values, and a parameter
        of a group with ``acc_format`` whose state holds no accumulator starts one from its
        current weight. The saved groups' options and formats replace this optimizer's;
        ``grad_scaling``, which the state_dict does not hold, stays this optimizer's.

        Raises:
            TypeError / ValueError / NotImplementedError: a loaded group's option or format is
                refused, as add_param_group refuses it (the optimizer keeps its state).
        """
        kept = super().state_dict()  # this optimizer's own, restored as it was
        super().load_state_dict(state_dict)
        try:
            for index, group in enumerate(self.param_groups):
                self._options_of_torch_group(group)
                for key, value in self._TORCH_DEFAULTS.items():
                    group.setdefault(key, value)
                for key, value in self.defaults.items():
                    group.setdefault(key, value)
                self._check_group(group, index)
        except (TypeError, ValueError, NotImplementedError):
            super().load_state_dict(kept)
            raise
        # A weight changed after this (the model's state loaded after the optimizer's) is
        # compared with the loaded accumulators as step() compares it, as OptimLP does.
        for p, state in self.state.items():
            if "accumulator" in state:
                self._record(p, "written")
        for group in self.param_groups:
            self._start_accumulators(group)

    def _options_of_torch_group(self, group: dict) -> None:
        """Set, in a loaded group, the options that the torch optimizer's group holds under other
        names (none here)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step of every parameter (see the module documentation). Returns the closure's
        loss."""
        # torch's optimizers read a group's options at every step: each is checked again, and the
        # formats are rounded by the group's rule as it is now (before the closure runs).
        group_specs = [self._group_specs(group) for group in self.param_groups]
        self._adopt_changed_weights()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, (group, group_spec) in enumerate(zip(self.param_groups, group_specs)):
            for i, p in enumerate(group["params"]):
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                for what, t in (("", p), ("'s gradient", p.grad)):
                    if t is not None and _shares_memory_locations(t):
                        # Checked before the step changes anything: the op wrote the parameters
                        # before torch refused to write such a gradient back.
                        raise RuntimeError(
                            f"parameter {i} of group {index}{what} has elements that share one "
                            "memory location (a stride of 0, as expand() gives): the fused step "
                            "writes it in place; clone() it first"
                        )
                if group_spec[_ACC] is not None and "accumulator" not in self.state[p]:
                    # Else the step would update the weight itself, as without acc_format.
                    raise ValueError(
                        f"parameter {i} of group {index} has no accumulator: acc_format was set "
                        "on its group after the group was added (set it in the constructor or "
                        "in add_param_group), or its state was replaced by one without an "
                        "accumulator (ZeroRedundancyOptimizer.load_state_dict sets the saved "
                        "state, a torch optimizer's too, without this optimizer's load_state_dict)"
                    )
        specs = {
            p: group_spec
            for group, group_spec in zip(self.param_groups, group_specs)
            for p in group["params"]
        }
        fused_step(self.param_groups, specs, self.state, self._RULE, self.grad_scaling)
        self._record_written()
        return loss


@dataclass(frozen=True)
class StepRule:
    """The arithmetic of one optimizer's fused step: the op's algorithm, the state tensors it
    updates (in the state dict's order), the state it creates for a parameter with a gradient, its
    values per parameter, its scalars per parameter group, and its factors: the numbers that
    torch's step of a parameter (given its group and its state before the step) passes as the
    ``alpha`` or ``value`` of an in-place op, named. torch converts those to float32 and refuses
    one beyond its range, where the op's float32 conversion would make it infinite."""

    algorithm: int
    states: tuple[str, ...]
    init_state: Callable[[dict, torch.Tensor, dict], None]
    per_parameter: Callable[[dict, torch.Tensor, dict], list[float]]
    scalars: Callable[[dict], list[float]]
    factors: Callable[[dict, dict], list[tuple[str, float]]]


def fused_step(
    param_groups: list[dict],
    specs: dict,
    state: dict,
    rule: StepRule,
    grad_scaling: float,
    accumulators: dict | None = None,
) -> None:
    """One fused step of every parameter of ``param_groups``: the states of those with a gradient
    created (rule.init_state), OptimLP's random streams planned (plan_streams), and one op call
    (run_step) per group, setting ``specs[p]`` and device, parameters in order. ``state``: the
    optimizer's state per parameter; ``accumulators``: as run_step. A group may hold parameters on
    several devices (a model split across them), as OptimLP's may: the op takes the tensors of
    one device, and each parameter's streams are its own, so the split changes no bits.

    Raises:
        ValueError: a factor of the step (rule.factors) is beyond float32's range, as torch's
            step raises for it; checked before any tensor or state changes.
    """
    params = [p for group in param_groups for p in group["params"]]
    why = "for float32 parameters, as torch's optimizers require"
    for group in param_groups:
        for p in group["params"]:
            if p.grad is not None:
                for name, value in rule.factors(group, state.get(p, {})):
                    check_factor(name, value, torch.float32, why)
    for group in param_groups:
        for p in group["params"]:
            if p.grad is not None:
                rule.init_state(group, p, state[p])
    offsets, seeds = plan_streams(params, specs, state, rule.states)
    for group in param_groups:
        runs: dict[tuple, list[torch.Tensor]] = {}  # the group's parameters by setting, device
        for p in group["params"]:
            runs.setdefault((specs[p], p.device), []).append(p)
        scalars = rule.scalars(group) + [grad_scaling]
        for (run_specs, _), run in runs.items():
            per_parameter = [x for p in run for x in rule.per_parameter(group, p, state[p])]
            run_step(
                run,
                run_specs,
                state,
                rule.states,
                rule.algorithm,
                scalars,
                per_parameter,
                offsets,
                seeds,
                accumulators,
            )


def _held(state: dict, key: str) -> torch.Tensor | None:
    """The state tensor ``state[key]``, or None where there is none: a missing key, or a None
    value (torch.optim.SGD before torch 2.0 kept ``momentum_buffer: None`` with momentum 0, and its
    checkpoints load so), which torch's step and OptimLP's rounding pass over."""
    return state.get(key)


def plan_streams(params: list, specs: dict, state: dict, state_keys: tuple[str, ...]):
    """OptimLP's random streams for one step of ``params`` (in parameter order): the stream offset
    of each rounded tensor (five slots per parameter: gradient, the states in ``state_keys``
    order, accumulator, weight) and the seed of each (category, spec). ``specs[p]``: the
    QuantSpec (or None) of each category of _CATEGORIES; ``state[p]``: its optimizer state. As
    OptimLP's batches: per phase, one quantize_many_ call per spec, tensors in parameter order,
    tensor i of a call at offset i; one seed per stochastic spec per phase, phases in the order
    of _CATEGORIES, drawn in that order."""
    batches = {category: {} for category in _CATEGORIES}
    offsets = {}
    for p in params:
        kept = state.get(p, {})
        slots = [0] * 5
        grad_spec, state_spec, acc_spec, weight_spec = specs[p]
        rounded = [
            ("grad", grad_spec, 0, grad_spec is not None and p.grad is not None),
            *[
                (
                    "state",
                    state_spec,
                    1 + i,
                    state_spec is not None and _held(kept, key) is not None,
                )
                for i, key in enumerate(state_keys)
            ],
            ("acc", acc_spec, 3, acc_spec is not None),
            ("weight", weight_spec, 4, weight_spec is not None),
        ]
        for category, spec, slot, wanted in rounded:
            if wanted:
                members = batches[category].setdefault(spec, [])
                slots[slot] = len(members)
                members.append(p)
        offsets[p] = slots
    seeds = {}
    for category in _CATEGORIES:
        for spec in batches[category]:
            seeds[category, spec] = draw_seed() if spec.rounding.is_stochastic else _NO_SEED
    return offsets, seeds


def run_step(
    params: list,
    specs: tuple,
    state: dict,
    state_keys: tuple[str, ...],
    algorithm: int,
    scalars: list[float],
    per_parameter: list[float],
    offsets: dict,
    seeds: dict,
    accumulators: dict | None = None,
) -> None:
    """One lpsim::optim_step_ call: the step of ``params`` (float32 CPU tensors of one parameter
    group, all rounded by the same ``specs``) with their states ``state[p][key]`` for key in
    ``state_keys`` (absent: none), their accumulators (``accumulators[p]``, else
    ``state[p]["accumulator"]``), the group's ``scalars`` followed by the gradient scaling, the
    ``per_parameter`` values and the streams of plan_streams.

    A BlockFloat gradient, state or weight spec (the accumulator's must be an element format, or
    None) is not rounded inside the op, since its shared exponent depends on the whole tensor:
    each gradient is scaled and rounded by quantize_ before the op, and the op leaves each state
    and weight unrounded, to be rounded by quantize_ after it, with the same seeds and stream
    offsets. That is OptimLP's order (gradients, the wrapped step, states, weights), so the bits
    are the same."""
    empty = torch.empty(0)
    grads, states1, states2, accs, offset_list = [], [], [], [], []
    for p in params:
        kept = state.get(p, {})
        grads.append(p.grad if p.grad is not None else empty)
        found = [_held(kept, key) for key in state_keys] + [None, None]
        found = [t if t is not None else empty for t in found]
        states1.append(found[0])
        states2.append(found[1])
        acc = accumulators.get(p) if accumulators is not None else kept.get("accumulator")
        accs.append(acc if acc is not None else empty)
        offset_list += offsets[p]
    deferred = {
        category: spec
        for category, spec in zip(_CATEGORIES, specs)
        if spec is not None and isinstance(spec.format, BlockFloat)
    }
    if "acc" in deferred:
        raise TypeError("the fused step rounds accumulators into element formats only")
    if "grad" in deferred:
        grad_scaling = scalars[-1]
        for p in params:
            if p.grad is not None:
                if grad_scaling != 1.0:
                    p.grad.mul_(grad_scaling)
                _round_deferred(p.grad, deferred["grad"], seeds, "grad", offsets[p][0])
        scalars = scalars[:-1] + [1.0]
    grids, roundings, rbits, seed_list = [], [], [], []
    for category, spec in zip(_CATEGORIES, specs):
        if category in deferred:
            spec = None
        fmt = spec.format if spec is not None else _UNROUNDED
        grids += fmt.grid_arguments(torch.float32)
        roundings.append(int(spec.rounding) if spec is not None else -1)
        rbits.append(32)
        seed_list.append(seeds.get((category, spec), _NO_SEED))
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its contiguous copy)
    ops.optim_step_(
        _contiguous(params, staged),
        _contiguous(grads, staged),
        _contiguous(states1, staged),
        _contiguous(states2, staged),
        _contiguous(accs, staged),
        *grids,
        roundings,
        rbits,
        torch.stack(seed_list),
        offset_list,
        algorithm,
        scalars,
        per_parameter,
    )
    for t, copy in staged:
        t.copy_(copy)
    if "state" in deferred:
        for p in params:
            kept = state.get(p, {})
            for slot, key in enumerate(state_keys, start=1):
                if _held(kept, key) is not None:
                    _round_deferred(kept[key], deferred["state"], seeds, "state", offsets[p][slot])
    if "weight" in deferred:
        for p in params:
            _round_deferred(p, deferred["weight"], seeds, "weight", offsets[p][4])


def _contiguous(tensors: list[torch.Tensor], staged: list) -> list[torch.Tensor]:
    """tensors, each non-contiguous one (a transposed parameter, its gradient and the states
    torch makes in its layout) replaced by a contiguous copy, noted in ``staged`` to be written
    back after the op. The copy keeps the row-major order of the elements, which is the order
    their random words follow, so the bits are those of the tensor itself."""
    out = []
    for t in tensors:
        if not t.is_contiguous():
            copy = t.contiguous()
            staged.append((t, copy))
            t = copy
        out.append(t)
    return out


def could_give(
    quant: QuantSpec | Callable[[torch.Tensor], torch.Tensor] | None,
    value: torch.Tensor,
    result: torch.Tensor,
) -> torch.Tensor | None:
    """Where ``result`` (of value's shape, in its own dtype) holds what rounding ``value`` by
    ``quant`` gives, or could give: for a deterministic rule the one value it gives, for a
    stochastic rule either neighbour of ``value`` on quant's grid (None: ``value`` converted to
    result's dtype, to nearest); NaN where value is NaN. A value between the two neighbours that
    is neither (off the grid, or the other neighbour of a deterministic rule) is not one. A bool
    tensor; None where that cannot be told (a function, a block, scaled or delayed-scaling
    format)."""
    if quant is None:
        expected = value.to(result.dtype)
        return (result == expected) | (result.isnan() & expected.isnan())
    if not (isinstance(quant, QuantSpec) and isinstance(quant.format, GRID_FORMATS)):
        return None
    if quant.rounding.is_stochastic:
        low = quantize(value, quant.format, "down").to(result.dtype)
        high = quantize(value, quant.format, "up").to(result.dtype)
        given = (result == low) | (result == high)
    else:
        given = result == quantize(value, quant.format, quant.rounding).to(result.dtype)
    return given | (result.isnan() & value.isnan())


def _shares_memory_locations(t: torch.Tensor) -> bool:
    """Whether several elements of t are one element of its storage (a stride of 0 along a
    dimension of size > 1, as expand() gives)."""
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))


def _round_deferred(t: torch.Tensor, spec: QuantSpec, seeds: dict, category: str, offset: int):
    """t rounded in place by a spec the op does not round (run_step), as OptimLP's batch rounds it:
    the batch's seed, the tensor's stream offset."""
    seed = seeds[category, spec]
    quantize_(
        t,
        spec.format,
        spec.rounding,
        seed=int(seed) if spec.rounding.is_stochastic else None,
        offset=offset,
    )


def sgd_init_state(group: dict, p: torch.Tensor, state: dict) -> None:
    """Create the momentum buffer of a parameter with a gradient (torch.optim.SGD's state key),
    marked fresh: torch's first step takes the direction itself, so its old values are unused."""
    if group["momentum"] != 0 and state.get("momentum_buffer") is None:
        state["momentum_buffer"] = torch.empty_like(p)
        state["fresh"] = True  # removed by sgd_per_parameter


def sgd_factors(group: dict, state: dict) -> list[tuple[str, float]]:
    """The numbers torch.optim.SGD's step of a parameter with this state passes as ``alpha``:
    weight_decay (where nonzero), 1 - dampening (momentum onto an existing buffer), momentum
    (Nesterov's) and lr (negated)."""
    factors = []
    if group["weight_decay"] != 0:
        factors.append(("weight_decay", group["weight_decay"]))
    if group["momentum"] != 0:
        if state.get("momentum_buffer") is not None:
            factors.append(("1 - dampening", 1 - group["dampening"]))
        if group["nesterov"]:
            factors.append(("momentum", group["momentum"]))
    return factors + [("lr", group["lr"])]


def sgd_per_parameter(state: dict) -> list[float]:
    """The SGD step's value per parameter: whether its momentum buffer is fresh."""
    return [1.0 if state.pop("fresh", False) else 0.0]


def sgd_scalars(group: dict) -> list[float]:
    """The SGD step's scalars from a torch.optim.SGD (or FusedSGD) parameter group."""
    return [
        group["weight_decay"],
        group["momentum"],
        1 - group["dampening"],
        -group["lr"],
        float(group["nesterov"]),
        float(group["maximize"]),
    ]


def adam_step_count(step: float) -> torch.Tensor:
    """torch.optim.Adam's (not fused) step count ``step``: a 0-d tensor, float64 where that is
    the default dtype, else float32."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(float(step), dtype=dtype)


def adam_init_state(group: dict, p: torch.Tensor, state: dict) -> None:
    """torch.optim.Adam's state of a parameter with a gradient, in its order, and its step count
    advanced."""
    if "step" not in state:
        state["step"] = adam_step_count(0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["step"] += 1


def adam_per_parameter(group: dict, p: torch.Tensor, state: dict) -> list[float]:
    """The Adam step's values per parameter: -lr / (1 - beta1^step) and (1 - beta2^step)^0.5, as
    torch's Python code computes them in double."""
    if p.grad is None or "step" not in state:
        return [0.0, 1.0]
    beta1, beta2 = group["betas"]
    step = state["step"].item()
    return [-(group["lr"] / (1 - beta1**step)), (1 - beta2**step) ** 0.5]


def adam_factors(group: dict, state: dict, decoupled: bool) -> list[tuple[str, float]]:
    """The numbers torch.optim.Adam's (AdamW's with ``decoupled``) step of a parameter with this
    state passes as ``alpha`` or ``value``: weight_decay (coupled, where nonzero) and the step
    size lr / (1 - beta1^step) of the step about to be taken (negated)."""
    factors = []
    if group["weight_decay"] != 0 and not decoupled:
        factors.append(("weight_decay", group["weight_decay"]))
    step = float(state["step"]) + 1 if "step" in state else 1.0
    beta1 = group["betas"][0]
    name = f"lr / (1 - betas[0]**step), the step size of step {step:g},"
    return factors + [(name, group["lr"] / (1 - beta1**step))]


def adam_scalars(group: dict, decoupled: bool) -> list[float]:
    """The Adam step's scalars from a parameter group (AdamW's with ``decoupled``)."""
    beta1, beta2 = group["betas"]
    decay = group["weight_decay"] != 0
    return [
        group["weight_decay"],
        1 - group["lr"] * group["weight_decay"],
        1 - beta1,
        beta2,
        1 - beta2,
        group["eps"],
        float(decay and not decoupled),
        float(decay and decoupled),
        float(group["maximize"]),
    ]


SGD_RULE = StepRule(
    algorithm=0,
    states=("momentum_buffer",),
    init_state=sgd_init_state,
    per_parameter=lambda group, p, state: sgd_per_parameter(state),
    scalars=sgd_scalars,
    factors=sgd_factors,
)


def adam_rule(decoupled_key: str, decoupled: bool) -> StepRule:
    """Adam's step, AdamW's where the group's ``decoupled_key`` (default ``decoupled``) is true."""
    return StepRule(
        algorithm=1,
        states=("exp_avg", "exp_avg_sq"),
        init_state=adam_init_state,
        per_parameter=adam_per_parameter,
        scalars=lambda group: adam_scalars(group, group.get(decoupled_key, decoupled)),
        factors=lambda group, state: adam_factors(
            group, state, group.get(decoupled_key, decoupled)
        ),
    )


class FusedSGD(_Fused):
    """``OptimLP(torch.optim.SGD(params, lr, momentum, dampening, weight_decay, nesterov,
    maximize=maximize), weight=weight_format, grad=grad_format, momentum=state_format,
    acc=acc_format, grad_scaling=grad_scaling, rounding=rounding)`` in one fused pass per step,
    bit for bit (see the module documentation).

    Args:
        params: float32 CPU parameters or parameter groups (a group may set any option below).
        lr, momentum, dampening, weight_decay: as torch.optim.SGD, all >= 0.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening = 0).
        maximize: maximise the objective.
        weight_format, grad_format, state_format, acc_format: None (not rounded), a Float,
            Fixed or P3109 format (rounded by ``rounding``) or a (format, rounding) pair: OptimLP's
            ``weight``, ``grad``, ``momentum`` (the momentum buffer) and ``acc`` (a float32 copy
            of the weight that the update applies to; the weight is then the accumulator rounded
            by ``weight_format``; a Fixed without clamp, whose sums need float64, is refused).
        grad_scaling: a finite number > 0; every gradient is multiplied by it first (a loss
            scale undone).
        rounding: the rule of bare formats, default "stochastic"; a group's own rule applies to the
            bare formats it sets and to those it inherits from these arguments. As torch's
            optimizers, a step reads every group's options as they are then: a rule or format
            set on a group since it was made applies from the next step (and is checked there).

    Raises:
        TypeError: a parameter is not float32, a format is not a Float, Fixed, P3109 or pair, or an
            option has the wrong type.
        ValueError: an option is out of range (the message names it and the range), or
            acc_format is a Fixed without clamp, or a parameter is listed twice in a group; by
            step(), a number torch's step converts to float32 (lr, weight_decay, 1 - dampening,
            Nesterov's momentum, Adam's step size lr / (1 - beta1^step)) is beyond its range,
            as torch's optimizers refuse it.
        NotImplementedError: a parameter is neither on the CPU nor, where lpsim is built with
            its CUDA kernels, on a CUDA device.
    """

    _RULE = SGD_RULE
    _TORCH_DEFAULTS = {"nesterov": False, "maximize": False}

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        weight_format: Spec = None,
        grad_format: Spec = None,
        state_format: Spec = None,
        acc_format: Spec = None,
        grad_scaling: float = 1.0,
        rounding: Rounding | str = "stochastic",
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        )
        formats = dict(
            grad_format=grad_format,
            state_format=state_format,
            acc_format=acc_format,
            weight_format=weight_format,
        )
        super().__init__(params, defaults, formats, grad_scaling, rounding)

    def _check_options(self, group: dict) -> None:
        for name in ("lr", "momentum", "dampening", "weight_decay"):
            check_number(name, group[name])
        for name in ("nesterov", "maximize"):
            if not isinstance(group[name], bool):
                raise TypeError(f"{name} must be a bool, got {type(group[name]).__name__}")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening = 0")
        self._refuse_unsupported(group)


class FusedAdam(_Fused):
    """``OptimLP(torch.optim.Adam(...))`` (``decoupled=False``) or
    ``OptimLP(torch.optim.AdamW(...))`` (``decoupled=True``, the default) with OptimLP's
    formats, in one fused pass per step, bit for bit (see the module documentation). AdamW with
    weight_decay=0 is Adam. The default weight_decay is AdamW's 1e-2: pass weight_decay=0.0 for
    torch.optim.Adam's default.

    Args:
        params: float32 CPU parameters or parameter groups (a group may set any option below).
        lr: >= 0. betas: (beta1, beta2), each in [0, 1). eps: >= 0. weight_decay: >= 0 (default
            1e-2, AdamW's).
        decoupled: AdamW's decoupled weight decay (True) or Adam's L2 term (False).
        amsgrad: only False (ValueError otherwise).
        maximize: maximise the objective.
        weight_format, grad_format, state_format, acc_format, grad_scaling, rounding: as for
            FusedSGD; state_format rounds exp_avg and exp_avg_sq.

    Raises:
        TypeError, ValueError, NotImplementedError: as for FusedSGD; ValueError for amsgrad=True.
    """

    _RULE = adam_rule("decoupled", True)
    _TORCH_DEFAULTS = {"amsgrad": False, "maximize": False}

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        decoupled: bool = True,
        amsgrad: bool = False,
        maximize: bool = False,
        weight_format: Spec = None,
        grad_format: Spec = None,
        state_format: Spec = None,
        acc_format: Spec = None,
        grad_scaling: float = 1.0,
        rounding: Rounding | str = "stochastic",
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled=decoupled,
            amsgrad=amsgrad,
            maximize=maximize,
        )
        formats = dict(
            grad_format=grad_format,
            state_format=state_format,
            acc_format=acc_format,
            weight_format=weight_format,
        )
        super().__init__(params, defaults, formats, grad_scaling, rounding)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # torch's Adam saved its step counts as numbers before torch 1.12; its __setstate__ (run
        # by load_state_dict) makes them tensors, as this optimizer's step reads them.
        for kept in self.state.values():
            step = kept.get("step")
            if step is not None and not torch.is_tensor(step):
                kept["step"] = adam_step_count(step)

    def _refuse_unsupported(self, group: dict) -> None:
        super()._refuse_unsupported(group)
        if group["amsgrad"] is not False:
            raise ValueError(f"amsgrad must be False: {type(self).__name__} has no amsgrad")

    def state_dict(self) -> dict:
        """torch's state_dict, each group's ``decoupled`` also saved as torch's
        ``decoupled_weight_decay``: torch.optim.Adam (since torch 2.6) reads that option from a
        loaded group and, where it is missing, takes its default, False, so that without it a
        decoupled run continued by torch's Adam would switch to L2 decay silently. (torch's AdamW
        makes every loaded group decoupled, as it does a torch Adam's.)"""
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            group["decoupled_weight_decay"] = group["decoupled"]
        return state_dict

    def _options_of_torch_group(self, group: dict) -> None:
        # torch.optim.AdamW's groups (and Adam's, since torch 2.6) say decoupled_weight_decay,
        # and this optimizer's state_dict says it too (state_dict). Read into decoupled, it is
        # dropped, so that a loaded group holds this optimizer's options only; where a group says
        # both and they disagree, it is kept for _check_options to refuse.
        torch_decoupled = group.get("decoupled_weight_decay")
        if torch_decoupled is None:
            return
        group.setdefault("decoupled", bool(torch_decoupled))
        if group["decoupled"] == bool(torch_decoupled):
            del group["decoupled_weight_decay"]

    def _check_options(self, group: dict) -> None:
        for name in ("lr", "eps", "weight_decay"):
            check_number(name, group[name])
        group["betas"] = check_betas(group["betas"])
        self._refuse_unsupported(group)
        for name in ("decoupled", "maximize"):
            if not isinstance(group[name], bool):
                raise TypeError(f"{name} must be a bool, got {type(group[name]).__name__}")
        # A torch Adam/AdamW group's option, set on this group since it was made: by
        # ZeroRedundancyOptimizer.load_state_dict, which copies a saved group's options onto its
        # local optimizer's groups without this optimizer's load_state_dict (that one reads it
        # into decoupled). Stepping by decoupled alone would run the other algorithm than the
        # saved run's, silently.
        torch_decoupled = group.get("decoupled_weight_decay")
        if (
            torch_decoupled is not None
            and bool(torch_decoupled) != group["decoupled"]
            and group["weight_decay"] != 0
        ):
            raise ValueError(
                f"decoupled ({group['decoupled']}) and decoupled_weight_decay "
                f"({torch_decoupled!r}, a torch Adam/AdamW option set on the group since it was "
                "made, as ZeroRedundancyOptimizer.load_state_dict sets a saved group's options) "
                "disagree while weight_decay is nonzero: set decoupled to the saved run's, "
                f"FusedAdam(..., decoupled={bool(torch_decoupled)})"
            )
