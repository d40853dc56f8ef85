"""OptimLP: low-precision training with any torch.optim optimizer."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

import torch
import torch.optim.optimizer as torch_optimizer
from torch.optim import Optimizer

from lpsim import _observation
from lpsim._checks import (
    CONTAINER_DTYPES,
    draw_seed,
    positive_finite_attribute,
    steps_in_backward,
)
from lpsim.delayed_scaling import DelayedScaler, DelayedScaling
from lpsim.formats import GRID_FORMATS, BlockFloat, check_fits, sum_container
from lpsim.functional import quantize
from lpsim.multi_tensor import quantize_many_
from lpsim.nn.quantizer import QuantSpec, ScalerCall, Spec, as_spec
from lpsim.optim import fused
from lpsim.optim._own_options import pickled_state
from lpsim.rounding import Rounding
from lpsim.scaled import Scaled

__all__ = ["OptimLP", "ParameterQuantization"]

QuantFunction = Callable[[torch.Tensor], torch.Tensor]
_GROUP_KEY = "quantization"  # a parameter group's own ParameterQuantization (or None)
_CATEGORIES = ("weight", "grad", "momentum", "acc")
# The OptimLP made around each optimizer (the latest), held weakly both ways (OptimLP.wrapping).
_WRAPPERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# The keys that lpsim.compat.qtorch.OptimLP.state_dict() adds to the wrapped optimizer's
# ("state", "param_groups"): the accumulators, and the delayed-scaling states.
TORCH_LAYOUT_EXTRAS = ("weight_acc", "scalers")


def _as_function(value, rounding, name: str) -> QuantFunction | None:
    """A spec (format or (format, rounding)) or any tensor -> tensor function, as a function."""
    if callable(value) and not isinstance(value, tuple):  # a function, or a QuantSpec
        return value
    return as_spec(value, rounding, name, functions=True)


@dataclass(frozen=True)
class ParameterQuantization:
    """What OptimLP rounds for one parameter. Each field is None (not rounded), a format, a
    (format, rounding) pair, or any function tensor -> tensor; bare formats use ``rounding``.

    Args:
        weight: the parameter after every step.
        grad: its gradient before every step (after OptimLP's grad_scaling).
        momentum: every floating-point tensor of the optimizer's state for the parameter.
        acc: the high-precision accumulator that takes the parameter's place in the update.
        rounding: the rule for fields given as bare formats (default "stochastic").
    """

    weight: Spec | QuantFunction = None
    grad: Spec | QuantFunction = None
    momentum: Spec | QuantFunction = None
    acc: Spec | QuantFunction = None
    rounding: Rounding | str = field(default="stochastic")

    def __post_init__(self) -> None:
        # Checked also where no field is a bare format, as a Quantizer's rules are.
        Rounding.parse(self.rounding, "rounding")
        for name in _CATEGORIES:  # formats and pairs become QuantSpecs; malformed ones raise
            object.__setattr__(self, name, _as_function(getattr(self, name), self.rounding, name))

    def __str__(self) -> str:
        return (
            ", ".join(
                f"{name}={getattr(self, name)}"
                for name in _CATEGORIES
                if getattr(self, name) is not None
            )
            or "nothing"
        )


# A parameter group's "quantization" is saved in OptimLP's state_dict: plain data (formats, rules),
# which torch.load's default weights_only unpickler may then build, as it builds the formats.
torch.serialization.add_safe_globals([ParameterQuantization])


class _Batch:
    """Tensors to round in place, one quantize_many_ call per spec (format and rule) when run, in
    the order the specs first appear; tensor i of a spec's call uses the stream offset i. Functions
    that are not QuantSpecs are applied one tensor at a time, when the tensor is added.
    (Measured on resnet18's 62 parameters: one call per spec instead of one per tensor.)

    With an ``observer`` (lpsim._observation), the value of every tensor of a category it wants is
    copied when added, and each rounding is reported to it after the run, under the parameter the
    tensor belongs to."""

    def __init__(self, observer=None) -> None:
        self.groups: dict[QuantSpec, list[torch.Tensor]] = {}
        self.observer = observer
        self.observed: list[tuple] = []  # (parameter, category, value before, tensor, quant)
        self.stored: list[tuple] = []  # (values, dense tensor, indices): written back when run

    def add(
        self,
        quant: QuantFunction,
        t: torch.Tensor,
        parameter: torch.Tensor | None = None,
        category: str = "",
    ) -> None:
        if self.observer is not None and self.observer.wants(category):
            self.observed.append((parameter, category, t.clone(), t, quant))
        if isinstance(quant, QuantSpec):
            self.groups.setdefault(quant, []).append(t)
        else:
            t.copy_(quant(t))

    def add_stored(
        self,
        quant: QuantFunction,
        t: torch.Tensor,
        parameter: torch.Tensor | None = None,
        category: str = "",
    ) -> None:
        """add() for the values t holds (see _stored_values): for a coalesced sparse t, its
        stored values rounded as the dense tensor it stands for is rounded. A Scaled or
        BlockFloat format whose blocks are blocks of the values (see _values_format) rounds the
        values themselves, its axis or dim counted in their dimensions; one whose blocks group
        elements of several entries that the values do not hold side by side (blocks of n or
        tiles along a sparse dimension, a BlockFloat's slices along one of several sparse
        dimensions) rounds the dense tensor (which an observer sees), whose values at the stored
        positions are then written back."""
        values = _stored_values(t)
        blocked = isinstance(quant, QuantSpec) and isinstance(quant.format, (Scaled, BlockFloat))
        if not (t.is_sparse and blocked):
            self.add(quant, values, parameter, category)
            return
        fmt = _values_format(quant.format, t)
        if fmt is not None:
            self.add(quant._replace(format=fmt), values, parameter, category)
            return
        dense = t.to_dense()  # observed as the tensor rounded, its blocks' bounds those of fmt
        self.add(quant, dense, parameter, category)
        self.stored.append((values, dense, t.indices()))

    def run(self) -> None:
        for spec, tensors in self.groups.items():
            _quantize_batch(tensors, spec)
        for values, dense, indices in self.stored:
            values.copy_(dense[tuple(indices)])
        for parameter, category, before, t, quant in self.observed:
            self.observer.observe(parameter, category, before, t, quant, True)


def _quantize_batch(tensors: list[torch.Tensor], spec: QuantSpec) -> None:
    """quantize_many_(tensors, spec) for tensors on one device or several (a model split across
    devices): one seed for the batch, tensor i at the stream offset i, each run of consecutive
    tensors on one device rounded by one call."""
    device = tensors[0].device
    if all(t.device == device for t in tensors):
        quantize_many_(tensors, spec.format, spec.rounding)
        return
    seed = int(draw_seed()) if spec.rounding.is_stochastic else None  # the one call's draw
    start = 0
    for end in range(1, len(tensors) + 1):
        if end == len(tensors) or tensors[end].device != tensors[start].device:
            run = tensors[start:end]
            quantize_many_(run, spec.format, spec.rounding, seed=seed, offset=start)
            start = end


def _rounded(quant: QuantFunction, t: torch.Tensor) -> torch.Tensor:
    """quant(t) in a new tensor."""
    if isinstance(quant, QuantSpec):
        return quantize(t, quant.format, quant.rounding)
    return quant(t.clone())


_WIDE = (torch.float32, torch.float64)


@dataclass(frozen=True)
class _FusedRule:
    """When OptimLP takes the fused step around one torch optimizer class: its arithmetic, the
    group options that must be unset or False (torch's other paths), those that must be numbers,
    not tensors, and what else a group's settings must satisfy."""

    step: fused.StepRule
    off: tuple[str, ...]
    numbers: tuple[str, ...]
    group_applies: Callable[[dict], bool] = lambda group: True


def _adam_group_applies(group: dict) -> bool:
    """betas[0] = 0 is left to torch's step. exp_avg.lerp_(grad, w) with w = 1 - betas[0] >= 0.5
    computes fma(w - 1, grad - exp_avg, grad) in torch's vectorised CPU loop (as the fused step
    does) but grad - (grad - exp_avg) * (1 - w) in its last numel % 16 elements (AVX2): at w = 1
    the two add zero products of opposite signs to grad, so where grad is a zero the results'
    signs differ."""
    return group["betas"][0] != 0


_ADAM_OFF = ("foreach", "fused", "differentiable", "capturable", "amsgrad")
_ADAM_NUMBERS = ("lr", "betas", "eps", "weight_decay")
_FUSED_RULES = {
    torch.optim.SGD: _FusedRule(
        fused.SGD_RULE,
        off=("foreach", "fused", "differentiable"),
        numbers=("lr", "momentum", "dampening", "weight_decay"),
    ),
    torch.optim.Adam: _FusedRule(
        fused.adam_rule("decoupled_weight_decay", False),
        _ADAM_OFF,
        _ADAM_NUMBERS,
        _adam_group_applies,
    ),
    torch.optim.AdamW: _FusedRule(
        fused.adam_rule("decoupled_weight_decay", True),
        _ADAM_OFF,
        _ADAM_NUMBERS,
        _adam_group_applies,
    ),
}


def _is_number(value) -> bool:
    """A Python number, or a tuple of them (Adam's betas): not a tensor."""
    if isinstance(value, tuple):
        return all(_is_number(v) for v in value)
    return isinstance(value, (int, float))


# The 0-d entries torch's optimizers keep per parameter as scalars of the algorithm (a step count,
# ASGD's eta and mu, NAdam's product of momenta, LBFGS's scale of the initial inverse Hessian,
# kept with its first parameter), not as buffers of the parameter's elements.
_SCALAR_STATE = frozenset({"step", "eta", "mu", "mu_product", "H_diag"})


# LBFGS keeps its direction, its previous gradient and its history of steps and gradient changes
# in its first parameter's state as vectors over the elements of all its parameters, in order
# (flat buffers and lists of them); OptimLP rounds each parameter's segment by its own settings.
_LBFGS_FLAT_STATE = ("d", "prev_flat_grad")
_LBFGS_FLAT_HISTORY = ("old_dirs", "old_stps")


def _state_tensor(key: str, value, param: torch.Tensor) -> bool:
    """Whether OptimLP's momentum phase rounds this entry of param's optimizer state: a
    floating-point buffer, not one of the scalars above. A 0-d entry is one only for a 0-d
    parameter (whose buffers are 0-d too); for others it is a scalar whatever its key."""
    return (
        key not in _SCALAR_STATE
        and isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and (value.dim() > 0 or param.dim() == 0)
    )


def _stored_values(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds t's values, to round in place: t itself, or for a coalesced sparse
    tensor (a gradient of nn.Embedding(sparse=True), SGD's momentum buffer of one) its values,
    one per stored entry."""
    return t.values() if t.is_sparse else t


def _values_format(fmt: Scaled | BlockFloat, t: torch.Tensor) -> Scaled | BlockFloat | None:
    """The format that rounds the stored values of the coalesced sparse tensor t, (entries,
    *dense dimensions), as ``fmt`` rounds the dense t at those positions, or None where fmt's
    blocks hold elements of several entries. Zeros do not change a block's largest magnitude, so
    a block of the dense t is a block of its stored elements: one per entry where the blocks run
    along a dense dimension (counted from the end, where the values have it too), or the tiles lie
    in the last two; one for the whole tensor; one for the whole sparse dimension of a tensor that
    has one (the values' first). A BlockFloat's slice along a dense dimension d is the values'
    slice along their dimension d - sparse + 1; along the one sparse dimension, each entry's
    slice of the values' first."""
    ndim, sparse = t.dim(), t.sparse_dim()
    if isinstance(fmt, BlockFloat):
        if fmt.block_size is not None:
            return fmt if ndim > sparse else None
        if fmt.dim is None or sparse == 1:
            return fmt
        return replace(fmt, dim=fmt.dim - sparse + 1) if fmt.dim >= sparse else None
    if fmt.block == "tensor":
        return fmt
    if isinstance(fmt.block, tuple):
        return fmt if ndim - sparse >= 2 else None
    axis = fmt.axis % max(ndim, 1)
    if axis >= sparse:
        return replace(fmt, axis=axis - ndim)
    if fmt.block is None and sparse == 1:
        return replace(fmt, axis=0)
    return None


def _fusable_tensor(t: torch.Tensor) -> bool:
    return (
        t.dtype == torch.float32
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
    )


def _fusable_spec(quant, category: str) -> bool:
    """Whether the fused step rounds ``category`` by ``quant`` as OptimLP's batches do: element
    formats in every category; BlockFloat in all but the accumulator's (fused.run_step rounds those
    around the op)."""
    formats = GRID_FORMATS if category == "acc" else (*GRID_FORMATS, BlockFloat)
    return quant is None or (isinstance(quant, QuantSpec) and isinstance(quant.format, formats))


def _in_dtype(optimizer: Optimizer, group: dict, state: dict, key: str, dtype: torch.dtype):
    """state[key], a buffer the wrapped optimizer made in a parameter's dtype, in ``dtype`` (its
    accumulator's): as the optimizer would have made it around the accumulator. Adagrad fills its
    sum at construction with initial_accumulator_value rounded to the parameter's dtype (0.1 is
    0.10009765625 in bfloat16); before its first step that sum is made again from the value
    itself, so that it starts where an Adagrad around a float32 accumulator starts (float32's
    0.1). Anything else is converted as it is."""
    value = state[key]
    if (
        isinstance(optimizer, torch.optim.Adagrad)
        and key == "sum"
        and float(state.get("step", 0)) == 0
    ):
        return torch.full_like(value, group["initial_accumulator_value"], dtype=dtype)
    return value.to(dtype)


def _accumulator_dtype(acc: QuantFunction, dtype: torch.dtype) -> torch.dtype:
    """The container of a parameter's accumulator: the parameter's own dtype when it is float32 or
    float64 and holds the format, else float32 when that holds it, else float64; float64 for a
    Fixed without clamp, whose sums continue beyond its range (sum_container)."""
    own = dtype if dtype in _WIDE else torch.float32
    return sum_container(acc.format, own) if isinstance(acc, QuantSpec) else own


def _default_field(name: str) -> property:
    """OptimLP's default ``name`` (weight, grad, momentum, acc) under QPyTorch's attribute name
    (``weight_quant``, ...). Assigning it (a spec, a function or None) replaces that field of
    default_quantization from the next step, as QPyTorch's OptimLP reads its attributes at every
    step."""

    def read(self):
        return getattr(self.default_quantization, name)

    def write(self, value):
        try:
            self.default_quantization = replace(self.default_quantization, **{name: value})
        except (TypeError, ValueError) as error:  # named as the attribute assigned
            message = str(error)
            if message.startswith(f"{name} "):
                message = f"{name}_quant{message[len(name) :]}"
            raise type(error)(message) from None

    return property(
        read,
        write,
        doc=f"The default {name} (a QuantSpec, a function or None); assigning it replaces "
        "default_quantization's field from the next step.",
    )


def check_wrappable(optimizer: object) -> None:
    """Raises TypeError unless ``optimizer`` is a torch.optim.Optimizer that OptimLP may wrap:
    not an OptimLP, whose own step already multiplies by grad_scaling and rounds (a second wrapper
    would do both twice, silently)."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, OptimLP):
        raise TypeError(
            "optimizer must be a plain torch optimizer, got an OptimLP (a recipe applied "
            "before?): wrapping it again multiplies the gradients by grad_scaling twice and "
            "rounds them twice; pass the optimizer it wraps, optimizer.optimizer"
        )


class OptimLP(Optimizer):
    """Wrap ``optimizer`` (any torch.optim optimizer) so that one step is, for every parameter:

    1. gradient: multiplied by ``grad_scaling`` (every parameter's, so that a loss scale is undone
       everywhere), then quantised by ``grad`` (parameters whose .grad is None are skipped; a
       sparse gradient, as nn.Embedding(sparse=True) gives, is coalesced and its values, one per
       stored entry, are quantised; a Scaled or BlockFloat format rounds them with the blocks of
       the dense gradient, whose blocks of rows, tiles or slices hold only the stored entries that
       lie in them; a function gets the values tensor, (entries, *dense dimensions));
    2. with ``acc``: the parameter's high-precision accumulator (a copy of the weight in a
       container wide enough for ``acc``, float32 unless ``acc`` needs float64, as a Fixed
       without clamp does, itself rounded into ``acc``) takes the weight's place for the update;
    3. ``optimizer.step(closure)``;
    4. every floating-point tensor in the optimizer's state for the parameter (momentum_buffer,
       exp_avg, exp_avg_sq, max_exp_avg_sq, ...; not the 0-d ``step`` counters) quantised by
       ``momentum`` (a sparse one, as gradients are);
    5. with ``acc``: the accumulator rounded into ``acc`` and the weight set to it rounded by
       ``weight``; without: the weight rounded by ``weight``.

    Each of ``weight``, ``grad``, ``momentum``, ``acc`` is None (no quantisation), a format, a
    (format, rounding) pair, or any function tensor -> tensor (QPyTorch's convention); bare formats
    use ``rounding`` (default "stochastic"). They are the defaults; each parameter may have its
    own settings:

    - ``parameters=`` an iterable of parameters: only these are rounded (with the defaults); every
      other parameter of the optimizer stays in full precision (its gradient is still multiplied
      by grad_scaling). ``lpsim.nn.quantized_parameters(model)`` lists the parameters inject()
      fake-quantises, so the optimizer rounds exactly those.
    - ``parameters=`` a mapping parameter -> ParameterQuantization or None: each listed parameter
      its own settings (None: full precision); unlisted ones stay in full precision.
    - a parameter group of the wrapped optimizer with the key ``"quantization"``
      (a ParameterQuantization, or None for full precision) sets its parameters' settings, unless
      ``parameters=`` says otherwise: ``SGD([{"params": body}, {"params": edges,
      "quantization": None}], lr=0.1)``. As torch's optimizers read a group's options, a step
      reads it as it is then: one set, replaced or removed since applies from that step.

    ``parameters=`` speaks of the parameters the optimizer holds when it is made: a group added
    later by add_param_group (OptimLP's or the wrapped optimizer's), or a parameter appended to a
    group's ``"params"``, takes its group's settings as above (its ``"quantization"``, else the
    defaults), with or without ``parameters=``.

    A parameter's accumulator may be wider than the parameter itself (a bfloat16 model with an
    e6m9 accumulator in float32): the wrapped optimizer then updates the accumulator directly, and
    its state buffers live in the accumulator's dtype. During its step (and load_state_dict) a
    tensor on the accumulator's storage, holding the gradient in its dtype, stands in for the
    parameter in its parameter groups and as its state's key (step hooks on it see the stand-in);
    the parameter itself, its dtype and its gradient accumulator node, on which
    DistributedDataParallel's all-reduce hooks sit, are left alone. Quantisation happens in place,
    so parameters keep their storage (DDP and other wrappers hold on to them). Parameter groups and
    state are the wrapped optimizer's own, so LR schedulers, zero_grad and add_param_group act on
    it; state_dict() includes the accumulators, and load_state_dict() also takes a plain torch
    optimizer's state_dict (the accumulators then start from the current weights, rounded into
    ``acc`` as when they are made).

    A weight changed outside the optimizer (model.load_state_dict after the optimizer was made,
    a pruning mask, any in-place change, seen by its version counter; not a change through
    ``.data``) is taken into its accumulator by the next step or round_weights(): its elements
    that hold a value the accumulator does not round to by ``weight`` (the one value of a
    deterministic rule, either neighbour of a stochastic one; the accumulator itself without
    ``weight``) and that do not round into ``acc`` to the accumulator (before the first step only
    this counts) get the weight rounded into ``acc``; the other elements keep their
    accumulators. Where the format that decides (``weight`` after a step, ``acc`` before the
    first) is a function, a block, scaled or delayed-scaling format this cannot be told, and the
    accumulator is left as it is.
    load_state_dict() makes the loaded accumulators the source: weights loaded after it that
    they round to change nothing.

    Random streams. Each rounding phase of a step (1: gradients; 4: optimizer state; 5:
    accumulators, then weights) rounds its tensors in batches: the tensors of one spec (format and
    rule) are rounded in place by one ``lpsim.quantize_many_`` call, in parameter order (a
    parameter's state tensors in the order of its state dict), the specs in the order they first
    appear. A stochastic spec's call draws one seed from torch's default CPU generator and gives
    the i-th tensor of its batch (from 0) the stream offset i under that seed, so a run is
    reproducible from ``torch.manual_seed``. A batch whose tensors are on several devices (a
    model split across them) is rounded by one call per run of consecutive tensors on one
    device, with the batch's one seed and the same offsets. Functions that are not specs are
    called one tensor at a time, as their tensors are met. Weights of parameters whose
    accumulator is wider than they are are rounded in a copy in the accumulator's dtype (within
    the weight batch) and then written into the parameter.

    With a closure, step 1 applies to the gradients the closure computes: it follows each
    evaluation of the closure inside the wrapped optimizer's step (the gradients present before
    step() are left alone, as the closure replaces or adds to them). With ``acc`` and a closure,
    the closure is evaluated at the accumulators' values (the parameters hold them during the
    wrapped step); that needs accumulators of the parameters' dtype.

    Fused step. Around a torch.optim.SGD, Adam or AdamW, step() does not call the wrapped optimizer
    where lpsim's fused step (that of lpsim.optim.FusedSGD and FusedAdam) gives the same bits: one
    compiled pass per parameter group and setting reads each gradient, state tensor, accumulator and
    weight once, applies torch's float32 arithmetic and writes them rounded, with the random streams
    above (SGD on resnet18 with round to nearest, one thread: 1.07x torch's own step, against 1.88x
    for the batches; docs/performance.md). That is the case when the optimizer runs its
    single-tensor path (foreach and fused unset or False, as torch leaves them on the CPU; not
    differentiable; Adam without amsgrad or capturable; hyperparameters that are numbers, not
    tensors; no step hooks, global or on the wrapped optimizer, and no LR scheduler attached to the
    wrapped optimizer itself, rather than to OptimLP), every parameter, gradient, state tensor and
    accumulator is a contiguous float32 CPU tensor, every setting is a Float, Fixed or P3109 format
    with a rule, or a BlockFloat format with a rule for the gradients, states and weights (no
    functions, scaled formats or delayed scaling; the step rounds block formats by quantize_ around
    its pass), no closure is given and no Recorder observes the step. Otherwise, or with
    ``fused=False``, the steps above run as listed. The two paths give the same tensors and draw
    the same seeds, so a run may switch between them.

    While a lpsim.diagnostics.recorder.Recorder observes the optimizer, every rounding of a step
    is recorded under its parameter with the category "grad", "momentum" (each state tensor),
    "accumulator" or "weight"; only then are the tensors copied before they are rounded in place.

    Raises:
        TypeError: optimizer is not a torch optimizer or is an OptimLP, a spec is malformed (the
            message names the argument), or fused is not a bool.
        ValueError: grad_scaling is not a finite number > 0; a format does not fit the tensor it
            rounds (the message names the argument, the parameter and the dtype); ``parameters``
            holds a tensor the optimizer does not; a parameter is listed twice; around a torch
            ZeroRedundancyOptimizer, a ``momentum`` format or an accumulator wider than its
            parameter, and around one made with overlap_with_ddp=True (which steps in the
            backward pass) any ``grad`` or ``acc`` format or a grad_scaling other than 1.0 (also
            at step(), where grad_scaling was assigned since).
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
        *,
        parameters: Iterable[torch.Tensor]
        | Mapping[torch.Tensor, ParameterQuantization | None]
        | None = None,
        fused: bool = True,
    ):
        check_wrappable(optimizer)
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool, got {type(fused).__name__}")
        self.optimizer = optimizer
        self.fused = fused
        self.default_quantization = ParameterQuantization(weight, grad, momentum, acc, rounding)
        self.grad_scaling = grad_scaling
        self._chosen = self._parse_parameters(parameters)
        self.settings: dict[torch.Tensor, ParameterQuantization | None] = {}
        self.accumulators: dict[torch.Tensor, torch.Tensor] = {}
        # Delayed scaling: one DelayedScaler per parameter and rounded tensor ("weight", "grad",
        # "acc", "momentum.<state key>"), made when the tensor is first rounded.
        self.scalers: dict[torch.Tensor, dict[str, DelayedScaler]] = {}
        # Each parameter with an accumulator: its version counter when the accumulator was made
        # from it ("made") or it was last set from the accumulator ("written"), to see a weight
        # changed outside the optimizer (_adopt_changed_weights).
        self._weight_versions: dict[torch.Tensor, tuple[int, str]] = {}
        # The base class sets up hooks and calls add_param_group on each group, which the wrapped
        # optimizer already holds (see add_param_group); then both share groups and state.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._share_with_optimizer()
        if self._chosen is not None:
            known = {id(p) for p in self._params()}
            stray = sum(1 for key in self._chosen if key not in known)
            if stray:
                raise ValueError(
                    f"parameters: {stray} tensor(s) are not parameters of the wrapped optimizer"
                )
            self._settle_unlisted(self._params())
        self._configure()
        self._check_grad_scaling_applies()
        _WRAPPERS[optimizer] = weakref.ref(self)

    def __getstate__(self) -> dict:
        """The state for pickle (copy.copy, copy.deepcopy, pickle, torch.save of the optimizer):
        every attribute (pickled_state), ``parameters=`` as pairs (parameter, settings), since the
        parameters of a copy are other tensors."""
        state = pickled_state(self)
        chosen = state["_chosen"]
        if chosen is not None:
            state["_chosen"] = [(p, chosen[id(p)]) for p in self._params() if id(p) in chosen]
        return state

    def __setstate__(self, state: dict) -> None:
        """A copy (see __getstate__): ``parameters=`` of its own parameters, and the copy of the
        wrapped optimizer answers OptimLP.wrapping with it."""
        state = dict(state)
        state.setdefault("_weight_versions", {})  # pickled before it was kept
        chosen = state["_chosen"]
        if chosen is not None:
            state["_chosen"] = {id(p): settings for p, settings in chosen}
        super().__setstate__(state)
        if chosen is not None:  # one pickled with the listed parameters only
            self._settle_unlisted(p for g in self.optimizer.param_groups for p in g["params"])
        _WRAPPERS[self.optimizer] = weakref.ref(self)

    def _settle_unlisted(self, params) -> None:
        """Record the parameters that ``parameters=`` leaves out as full precision (None), so that
        a parameter missing from it later is one the optimizer got after OptimLP was made (by
        OptimLP.add_param_group or the wrapped optimizer's own), which takes its group's settings.
        """
        for p in params:
            self._chosen.setdefault(id(p), None)

    @staticmethod
    def wrapping(optimizer: Optimizer) -> OptimLP | None:
        """The OptimLP made around ``optimizer`` (the latest, while it exists), or None. Its
        step() runs the optimizer's step between its roundings: a Recorder refuses the wrapped
        optimizer, whose step hooks would run between them."""
        found = _WRAPPERS.get(optimizer)
        return None if found is None else found()

    @property
    def default_quantization(self) -> ParameterQuantization:
        """What the parameters without settings of their own (a group's ``"quantization"``, an
        entry of ``parameters=``) are rounded by: the constructor's weight, grad, momentum, acc
        and rounding. A ParameterQuantization assigned to it applies from the next step, as a
        group's ``"quantization"`` set between steps does."""
        return self._default_quantization

    @default_quantization.setter
    def default_quantization(self, value: ParameterQuantization) -> None:
        if not isinstance(value, ParameterQuantization):
            raise TypeError(f"default_quantization must be a ParameterQuantization, got {value!r}")
        self._default_quantization = value

    grad_scaling = positive_finite_attribute(
        "grad_scaling",
        "Every gradient is multiplied by it before it is rounded: a finite number > 0, checked "
        "when assigned; a new value applies from the next step.",
    )

    weight_quant = _default_field("weight")
    grad_quant = _default_field("grad")
    momentum_quant = _default_field("momentum")
    acc_quant = _default_field("acc")

    @staticmethod
    def _parse_parameters(parameters) -> dict | None:
        """{id(parameter): settings, or True for "the defaults"}, from the ``parameters``
        argument."""
        if parameters is None:
            return None
        if isinstance(parameters, torch.Tensor):
            raise TypeError("parameters must be an iterable of tensors or a mapping, not a tensor")
        if isinstance(parameters, Mapping):
            chosen = {}
            for p, settings in parameters.items():
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"parameters: keys must be tensors, got {type(p).__name__}")
                if settings is not None and not isinstance(settings, ParameterQuantization):
                    raise TypeError(
                        "parameters: values must be ParameterQuantization or None, got "
                        f"{settings!r}"
                    )
                chosen[id(p)] = settings
            return chosen
        if not isinstance(parameters, Iterable):
            raise TypeError(
                "parameters must be None, an iterable of tensors or a mapping from tensors to "
                f"ParameterQuantization or None, got {type(parameters).__name__}"
            )
        chosen = {}
        for p in parameters:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameters must hold tensors, got {type(p).__name__}")
            chosen[id(p)] = True
        return chosen

    def _share_with_optimizer(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def _params(self):
        for group in self.param_groups:
            yield from group["params"]

    def _settings_of_group(self, group: dict) -> ParameterQuantization | None:
        if _GROUP_KEY not in group:
            return self.default_quantization
        settings = group[_GROUP_KEY]
        if settings is not None and not isinstance(settings, ParameterQuantization):
            raise TypeError(
                f"a parameter group's {_GROUP_KEY!r} must be a ParameterQuantization or "
                f"None, got {settings!r}"
            )
        return settings

    def _group_keys(self) -> list:
        """default_quantization and each parameter group's "quantization" as they are now (the
        group itself where it has none), to compare by identity with those the settings were
        worked out from."""
        return [
            self.default_quantization,
            *(group.get(_GROUP_KEY, group) for group in self.param_groups),
        ]

    def _group_sizes(self) -> list[int]:
        """The number of parameters of each parameter group as it is now."""
        return [len(group["params"]) for group in self.param_groups]

    def _configure_changed_groups(self) -> None:
        """Work out the settings again where default_quantization or a group's "quantization"
        was set, replaced or removed since (torch's optimizers read a group's options at every
        step), or a group gained or lost parameters (``group["params"].append(p)``: torch's
        optimizer steps p, which would otherwise stay unrounded), with the checks the
        constructor makes."""
        keys = self._group_keys()
        configured = getattr(self, "_groups_configured", ())
        sizes = self._group_sizes()
        if (
            len(keys) != len(configured)
            or any(a is not b for a, b in zip(keys, configured))
            or sizes != getattr(self, "_sizes_configured", sizes)
        ):
            self._configure()

    @torch.compiler.disable
    def _configure(self, make_accumulators: bool = True) -> None:
        """Work out every parameter's settings, check that their formats fit, and create the
        missing accumulators (unless ``make_accumulators`` is False: load_state_dict makes them
        from the state_dict).

        Run outside any graph torch.compile traces (a break in it): in a traced frame that holds
        a grad-mode context (the torch.no_grad() below), dynamo drops the frame's attribute
        assignments on an optimizer, so a compiled step (``torch.compile(opt.step)``) kept the
        settings worked out before a change of default_quantization or of a group's
        "quantization", silently rounding by the old ones."""
        settings = {}
        groups = {}  # each parameter's group
        for g, group in enumerate(self.param_groups):
            group_settings = self._settings_of_group(group)
            for i, p in enumerate(group["params"]):
                groups[p] = group
                if p in settings:
                    raise ValueError(
                        f"parameter {i} of group {g} is listed twice: torch's optimizer steps it "
                        "once per listing, while OptimLP rounds each parameter once per phase "
                        "(pass each parameter once)"
                    )
                if self._chosen is None:
                    s = group_settings
                else:  # not in it: added after OptimLP was made (see _settle_unlisted)
                    s = self._chosen.get(id(p), True)
                    s = group_settings if s is True else s
                if s is not None:
                    self._check_fits(s, p, f"parameter {i} of group {g}")
                    self._check_reachable(s, p, f"parameter {i} of group {g}")
                settings[p] = s
        self.settings = settings
        self._groups_configured = self._group_keys()
        self._sizes_configured = self._group_sizes()
        if not make_accumulators:
            return
        with torch.no_grad():
            for p, s in settings.items():
                if s is not None and s.acc is not None and p not in self.accumulators:
                    dtype = _accumulator_dtype(s.acc, p.dtype)
                    acc = p.detach().to(dtype)
                    self.accumulators[p] = _rounded(self._quantizer(p, "acc", s.acc, acc), acc)
                    self._weight_versions[p] = (p._version, "made")
                    # State the wrapped optimizer made before (Adagrad's sum, at construction) in
                    # the parameter's dtype goes to the accumulator's, where the state it makes
                    # in a step (the accumulator's place) would be.
                    state = self.optimizer.state.get(p, {})
                    for key, value in state.items():
                        if _state_tensor(key, value, p) and value.dtype != dtype:
                            state[key] = _in_dtype(self.optimizer, groups[p], state, key, dtype)

    def _check_fits(self, s: ParameterQuantization, p: torch.Tensor, where: str) -> None:
        """Refuse, naming the argument and the parameter, a format that does not fit the dtype of
        a tensor it rounds (the optimizer state's: the accumulator's with one, to which
        _configure moves the existing buffers, else the parameter's and the existing buffers';
        an accumulator made for an earlier acc keeps its dtype) or whose block dimension or axis
        the parameter's shape lacks."""
        acc = self.accumulators.get(p)
        if s.acc is None:
            state_dtype = p.dtype
        elif acc is not None:  # made for an earlier acc: the new one must fit it too
            state_dtype = acc.dtype
        else:
            state_dtype = _accumulator_dtype(s.acc, p.dtype)
        state = self.optimizer.state.get(p, {}) if s.acc is None else {}
        state_dtypes = {v.dtype for k, v in state.items() if _state_tensor(k, v, p)}
        for name, dtypes, what in (
            ("weight", {p.dtype}, "the parameter"),
            ("grad", {p.dtype}, "its gradient"),
            ("acc", {state_dtype}, "its accumulator"),
            ("momentum", {state_dtype} | state_dtypes, "its optimizer state"),
        ):
            quant = getattr(s, name)
            if not isinstance(quant, QuantSpec):
                continue
            for dtype in sorted(dtypes, key=str):
                if dtype not in CONTAINER_DTYPES:  # container_of's message would name an "x"
                    raise TypeError(
                        f"OptimLP {name}: {where}: {what} is {str(dtype).replace('torch.', '')}; "
                        "lpsim rounds float32, float64, bfloat16 and float16 tensors only"
                    )
                try:
                    check_fits(quant.format, dtype)
                    if isinstance(quant.format, (BlockFloat, Scaled)):
                        # quantize's own checks of the block dimension or axis.
                        quantize(torch.zeros((1,) * p.dim(), dtype=dtype), quant.format, "nearest")
                except (ValueError, IndexError) as error:
                    shape = f", shape {tuple(p.shape)}" if isinstance(error, IndexError) else ""
                    raise ValueError(
                        f"OptimLP {name}: {error} ({where}: {what} is "
                        f"{str(dtype).replace('torch.', '')}{shape})"
                    ) from None

    def _check_reachable(self, s: ParameterQuantization, p: torch.Tensor, where: str) -> None:
        """Refuse, naming the argument and the parameter, a momentum format or an accumulator
        wider than the parameter around a torch.distributed ZeroRedundancyOptimizer. That one
        steps each rank's shard with a local optimizer of its own, whose parameter groups and
        state are not the wrapper's: OptimLP's momentum phase would find no state to round, and a
        wide accumulator's stand-in in the wrapper's groups would never be stepped (the local
        optimizer updates the parameter, which the stale accumulator then overwrites), silently.
        Weights, gradients and accumulators of the parameter's dtype are rounded as without it.
        One made with ``overlap_with_ddp=True`` steps in DistributedDataParallel's backward pass
        (its step() does nothing), before OptimLP's gradient phase: a ``grad`` format would never
        reach the update, and an ``acc`` would take the weight's place only after it (the update
        then starts from the rounded weight, not the accumulator); both are refused too.
        """
        if not torch.distributed.is_available():
            return
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if not isinstance(self.optimizer, ZeroRedundancyOptimizer):
            return
        if steps_in_backward(self.optimizer):
            for name in ("grad", "acc"):
                if getattr(s, name) is not None:
                    raise ValueError(
                        f"OptimLP {name}: a ZeroRedundancyOptimizer made with "
                        f"overlap_with_ddp=True updates the parameters ({where}) inside "
                        "DistributedDataParallel's backward pass, before OptimLP could round the "
                        "gradients or put the accumulator in the weight's place (its step() does "
                        "nothing). Make it without overlap_with_ddp, or round only the weights"
                    )
        wide = s.acc is not None and _accumulator_dtype(s.acc, p.dtype) != p.dtype
        for name, refused in (("momentum", s.momentum is not None), ("acc", wide)):
            if refused:
                what = "optimizer state" if name == "momentum" else "wider accumulator"
                raise ValueError(
                    f"OptimLP {name}: cannot reach the {what} of a parameter of a "
                    f"ZeroRedundancyOptimizer ({where}): its local optimizer keeps each shard's "
                    "groups and state apart from the wrapper's. Put OptimLP inside it instead: "
                    "ZeroRedundancyOptimizer(params, optimizer_class=lambda params, **options: "
                    "OptimLP(torch.optim.SGD(params, **options), ...), ...)"
                )

    def _check_grad_scaling_applies(self) -> None:
        """Refuse a grad_scaling other than 1 around a ZeroRedundancyOptimizer that steps in
        DistributedDataParallel's backward pass (overlap_with_ddp=True, see _check_reachable):
        the gradients it would scale have been used by then, so the update would take them
        unscaled (a recipe's loss scale times too large), silently."""
        if self.grad_scaling != 1.0 and steps_in_backward(self.optimizer):
            raise ValueError(
                f"OptimLP grad_scaling: {self.grad_scaling} cannot scale the gradients of a "
                "ZeroRedundancyOptimizer made with overlap_with_ddp=True, which updates the "
                "parameters inside DistributedDataParallel's backward pass (its step() does "
                "nothing); it must be 1.0 there: scale the loss by 1.0, or make the "
                "ZeroRedundancyOptimizer without overlap_with_ddp"
            )

    def _quantizer(self, p: torch.Tensor, name: str, quant: QuantFunction, t: torch.Tensor):
        """What rounds tensor ``name`` of parameter p: ``quant`` itself, or for a DelayedScaling
        spec the call of that tensor's own scaler (made on t's device the first time, and made
        afresh where the tensor's DelayedScaling has changed since: a group's "quantization" or
        default_quantization replaced between steps)."""
        if not (isinstance(quant, QuantSpec) and isinstance(quant.format, DelayedScaling)):
            return quant
        scalers = self.scalers.setdefault(p, {})
        scaler = scalers.get(name)
        if scaler is None or scaler.scaling != quant.format:
            scaler = scalers[name] = quant.format.scaler(t.device)
        return ScalerCall(scaler, quant.rounding, True, forward_tensor=False)

    def parameter_settings(self, p: torch.Tensor) -> ParameterQuantization | None:
        """What the optimizer rounds for parameter ``p`` (None: nothing, full precision) at the
        next step: with a group's ``"quantization"`` or default_quantization as they are now.

        Raises:
            KeyError: p is not a parameter of the optimizer.
        """
        self._configure_changed_groups()
        return self.settings[p]

    def _rounded_params(self):
        for p in self._params():
            s = self.settings.get(p)
            if s is not None:
                yield p, s

    @torch.no_grad()
    def _quantize_grads(self) -> None:
        batch = _Batch(_observation.current)
        for p in self._params():
            if p.grad is None:
                continue
            if self.grad_scaling != 1.0:
                p.grad.mul_(self.grad_scaling)
            s = self.settings.get(p)
            if s is not None and s.grad is not None:
                if p.grad.is_sparse:
                    p.grad = p.grad.coalesce()
                grad = _stored_values(p.grad)
                batch.add_stored(self._quantizer(p, "grad", s.grad, grad), p.grad, p, "grad")
        batch.run()

    def _rounded_state_keys(self) -> list[str]:
        """The keys of the state entries the momentum phase rounds (of any parameter), in the
        order they first appear in the wrapped optimizer's state."""
        keys: list[str] = []
        for p, state in self.optimizer.state.items():
            for key, value in state.items():
                if key not in keys and _state_tensor(key, value, p):
                    keys.append(key)
        return keys

    @torch.no_grad()
    def _quantize_state(self) -> None:
        batch = _Batch(_observation.current)
        flat = self._lbfgs_flat_state()
        for p, s in self._rounded_params():
            if s.momentum is None:
                continue
            state = self.optimizer.state.get(p, {})
            for key, value in state.items():
                if any(value is buffer for _, buffer in flat):
                    continue
                if _state_tensor(key, value, p):
                    if value.is_sparse:
                        state[key] = value = value.coalesce()
                    stored = _stored_values(value)
                    quant = self._quantizer(p, f"momentum.{key}", s.momentum, stored)
                    batch.add_stored(quant, value, p, "momentum")
        self._add_flat_segments(batch, flat)
        batch.run()

    def _lbfgs_flat_state(self) -> list[tuple[str, torch.Tensor]]:
        """(name, buffer) of LBFGS's vectors over all its parameters (see _LBFGS_FLAT_STATE);
        empty for other optimizers."""
        if not isinstance(self.optimizer, torch.optim.LBFGS):
            return []
        state = self.optimizer.state.get(self.optimizer.param_groups[0]["params"][0], {})
        flat = [(key, state[key]) for key in _LBFGS_FLAT_STATE if key in state]
        for key in _LBFGS_FLAT_HISTORY:
            flat += [(f"{key}.{i}", t) for i, t in enumerate(state.get(key, []))]
        return [(key, t) for key, t in flat if isinstance(t, torch.Tensor)]

    def _add_flat_segments(self, batch: _Batch, flat: list[tuple[str, torch.Tensor]]) -> None:
        """Each parameter's segment of LBFGS's vectors, shaped as the parameter, added to batch
        for its own ``momentum`` (none: left as it is), as a buffer of that parameter would be."""
        if not flat:
            return
        params = self.optimizer.param_groups[0]["params"]
        # A complex parameter's elements are its real and imaginary parts, as LBFGS flattens it.
        shapes = [torch.view_as_real(p).shape if p.is_complex() else p.shape for p in params]
        sizes = [shape.numel() for shape in shapes]
        for name, buffer in flat:
            if buffer.dim() != 1 or buffer.numel() != sum(sizes):
                raise RuntimeError(
                    f"OptimLP: LBFGS's {name} holds {buffer.numel()} elements, not the "
                    f"{sum(sizes)} of its parameters"
                )
            for p, shape, segment in zip(params, shapes, buffer.split(sizes), strict=True):
                s = self.settings.get(p)
                if s is None or s.momentum is None:
                    continue
                segment = segment.view(shape)
                quant = self._quantizer(p, f"momentum.{name}", s.momentum, segment)
                batch.add(quant, segment, p, "momentum")

    def _widened(self) -> list[torch.Tensor]:
        """The parameters whose accumulator is wider than they are."""
        return [p for p, acc in self.accumulators.items() if acc.dtype != p.dtype]

    @torch.no_grad()
    def _swap_in(self, for_step: bool) -> dict:
        """Let the accumulators take their parameters' place in the wrapped optimizer. Where an
        accumulator has its parameter's dtype, for a step, the parameter receives a copy of it.
        Where it is wider, a tensor on the accumulator's storage stands in for the parameter in the
        wrapped optimizer's groups and state (for a step, holding the gradient in its dtype), so
        that the optimizer updates the accumulator and keeps its state in its dtype. The parameter
        itself is left alone: giving it the accumulator as its data (``p.data = acc``, another
        dtype) would give it a new gradient accumulator node, and hooks on the old one, such as
        DistributedDataParallel's gradient all-reduce, would never run again. Returns what
        _swap_out needs."""
        stand_ins = {}
        for p, s in self._rounded_params():
            if s.acc is None:
                continue
            acc = self.accumulators[p]
            if acc.dtype == p.dtype:
                if for_step:
                    p.copy_(acc)
                continue
            stand_in = acc.detach()  # the accumulator's storage, in a tensor of its own
            if for_step and p.grad is not None:
                stand_in.grad = p.grad.to(acc.dtype)
            stand_ins[id(p)] = (p, stand_in)
        self._replace_in_optimizer(stand_ins)
        return stand_ins

    def _swap_out(self, stand_ins: dict) -> None:
        """Put the parameters back where _swap_in put their stand-ins."""
        self._replace_in_optimizer(
            {id(stand_in): (stand_in, p) for p, stand_in in stand_ins.values()}
        )

    def _replace_in_optimizer(self, replacements: dict) -> None:
        """Each tensor ``old`` of ``replacements`` ({id(old): (old, new)}) replaced by ``new`` in
        the wrapped optimizer's parameter groups (in place: an optimizer such as LBFGS keeps the
        list) and as the key of its state (those it holds now: load_state_dict replaces both)."""
        if not replacements:
            return
        for group in self.optimizer.param_groups:
            params = group["params"]
            for i, q in enumerate(params):
                if id(q) in replacements:
                    params[i] = replacements[id(q)][1]
        state = self.optimizer.state
        for old, new in replacements.values():
            if old in state:
                state[new] = state.pop(old)

    @torch.no_grad()
    def _round_weights(self) -> None:
        accumulators = _Batch(_observation.current)
        for p, s in self._rounded_params():
            if s.acc is not None:
                acc = self.accumulators[p]
                if acc.dtype == p.dtype:
                    acc.copy_(p)  # the wrapped step updated the parameter
                accumulators.add(self._quantizer(p, "acc", s.acc, acc), acc, p, "accumulator")
        accumulators.run()
        self._set_weights()

    @torch.no_grad()
    def _set_weights(self) -> None:
        """Every rounded parameter set to its accumulator (when it has one) or itself, rounded by
        ``weight``: in place, or through a copy in the accumulator's dtype where that is wider."""
        weights = _Batch(_observation.current)
        widened = []  # (parameter, its weight value in the accumulator's dtype)
        for p, s in self._rounded_params():
            acc = self.accumulators[p] if s.acc is not None else p
            if acc.dtype != p.dtype:
                if s.weight is None:
                    p.copy_(acc)  # rounds to nearest in p's dtype
                    continue
                acc = acc.clone()
                widened.append((p, acc))
            elif acc is not p:
                p.copy_(acc)
            if s.weight is not None:
                target = acc if acc.dtype != p.dtype else p
                weights.add(self._quantizer(p, "weight", s.weight, target), target, p, "weight")
        weights.run()
        for p, value in widened:
            p.copy_(value)
        self._record_written()

    def _record_written(self) -> None:
        """Every parameter with an accumulator recorded as just set from it."""
        for p in self.accumulators:
            self._weight_versions[p] = (p._version, "written")

    @torch.compiler.disable
    @torch.no_grad()
    def _adopt_changed_weights(self) -> None:
        """The elements of a weight changed outside the optimizer since its accumulator was made
        from it or it was last set from its accumulator (model.load_state_dict, a pruning mask,
        any in-place change: its version counter moved, and it holds a value the accumulator
        does not give, or one that does not give the accumulator) become its accumulator's
        values, rounded into ``acc`` as when it is made; the other elements keep theirs. Where
        that cannot be told (a function, a block, scaled or delayed-scaling format as ``weight``
        after a step, as ``acc`` before the first), the accumulator is left as it is. Outside
        any graph torch.compile traces."""
        for p, (version, kind) in self._weight_versions.items():
            s = self.settings.get(p)
            if p._version == version or s is None or s.acc is None:
                continue
            acc = self.accumulators[p]
            weight = p.detach()
            made = fused.could_give(s.acc, weight.to(acc.dtype), acc)
            if kind == "written":
                # What the accumulator rounds to, or a value that rounds into acc to it (the
                # weights of a checkpoint saved before its first step).
                kept = fused.could_give(s.weight, acc, weight)
                if kept is not None and made is not None:
                    kept = kept | made
            else:
                kept = made
            if kept is None or bool(kept.all()):
                continue
            fresh = _rounded(self._quantizer(p, "acc", s.acc, acc), weight.to(acc.dtype))
            acc.copy_(torch.where(kept, acc, fresh))

    @torch.no_grad()
    def round_weights(self) -> None:
        """Set every rounded parameter to its weight value without a step: its accumulator (when
        it has one) rounded by ``weight``, or the parameter itself rounded by ``weight``. step()
        ends the same way, so calling this once after construction lets the first forward pass
        see low-precision weights (QPyTorch's examples round them only after the first step).

        Parameters in full precision are unchanged, and so is every accumulator: an accumulator
        rounded into ``acc`` when the optimizer was made keeps that value. Random streams as in
        step()'s weight phase: one quantize_many_ call per ``weight`` spec. Reads the groups'
        ``"quantization"`` as they are now, as step() does.
        """
        self._configure_changed_groups()
        self._adopt_changed_weights()
        self._set_weights()

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step of the wrapped optimizer with the quantisation above; returns its loss."""
        self._check_grad_scaling_applies()  # grad_scaling may have been assigned since
        self._configure_changed_groups()
        self._adopt_changed_weights()
        if closure is None and self._fused_step_applies():
            self._fused_step()
            return None
        if closure is not None and self._widened():
            raise ValueError(
                "OptimLP.step(closure) needs accumulators of the parameters' dtype: "
                "some are wider than their parameters (see acc)"
            )
        if closure is None:
            self._quantize_grads()
        else:  # the closure computes the gradients: step 1 follows each of its evaluations
            closure = self._then_quantize_grads(closure)
        stand_ins = self._swap_in(for_step=True)
        try:
            loss = self.optimizer.step(closure)
        finally:
            self._swap_out(stand_ins)
        self._quantize_state()
        self._round_weights()
        return loss

    def _then_quantize_grads(self, closure: Callable[[], float]) -> Callable[[], float]:
        """closure, then step 1 (grad_scaling and ``grad``) on the gradients it computed."""

        def evaluate():
            loss = closure()
            self._quantize_grads()
            return loss

        return evaluate

    def _fused_step_applies(self) -> bool:
        """Whether lpsim's fused step (FusedSGD's and FusedAdam's op) gives this step's bits: the
        wrapped optimizer is a torch.optim.SGD, Adam or AdamW on its single-tensor path (see
        _FusedRule; no step hooks, global or on it), every parameter, gradient, state tensor and
        accumulator is a contiguous float32 CPU tensor, every setting is a format with a rule
        (Float, Fixed or P3109; no functions, no delayed scaling), and no Recorder observes the step
        (which needs the tensors before each rounding)."""
        opt = self.optimizer
        rule = _FUSED_RULES.get(type(opt))
        if (
            not self.fused
            or rule is None
            or _observation.current is not None
            or "step" in vars(opt)  # wrapped by an LR scheduler or a user
            or opt._optimizer_step_pre_hooks
            or opt._optimizer_step_post_hooks
            # Global hooks run around the wrapped optimizer's step too.
            or torch_optimizer._global_optimizer_pre_hooks
            or torch_optimizer._global_optimizer_post_hooks
        ):
            return False
        for group in self.param_groups:
            if (
                any(group.get(key) for key in rule.off)
                or not all(_is_number(group[key]) for key in rule.numbers)
                or not rule.group_applies(group)
            ):
                return False
            for p in group["params"]:
                state = self.state.get(p, {})
                # The tensors OptimLP's momentum phase would round, in its order: the rule's.
                rounded = [key for key, value in state.items() if _state_tensor(key, value, p)]
                if rounded and rounded != list(rule.step.states):
                    return False
                tensors = [p, p.grad, self.accumulators.get(p)]
                tensors += [state.get(key) for key in rule.step.states]
                if any(t is not None and not _fusable_tensor(t) for t in tensors):
                    return False
                s = self.settings.get(p)
                if s is not None and not all(_fusable_spec(getattr(s, n), n) for n in _CATEGORIES):
                    return False
        return True

    @torch.no_grad()
    def _fused_step(self) -> None:
        """step() in one pass per parameter group and settings, bit for bit (see
        _fused_step_applies): the random streams and seeds of OptimLP's batches."""
        rule = _FUSED_RULES[type(self.optimizer)].step
        specs = {}
        for p in self._params():
            s = self.settings.get(p)
            specs[p] = (None,) * 4 if s is None else (s.grad, s.momentum, s.acc, s.weight)
        accumulators = {p: a for p, a in self.accumulators.items() if specs[p][2] is not None}
        fused.fused_step(
            self.param_groups, specs, self.state, rule, self.grad_scaling, accumulators
        )
        self._record_written()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        if any(param_group is group for group in self.optimizer.param_groups):
            return  # one of the wrapped optimizer's own groups, offered by Optimizer.__init__
        self.optimizer.add_param_group(param_group)
        self._share_with_optimizer()
        try:  # a new group's parameters take its "quantization", else the defaults
            self._configure()
        except (TypeError, ValueError):
            # A refused group is not kept: its parameters would train in full precision.
            self.optimizer.param_groups.pop()
            raise

    def state_dict(self) -> dict:
        """The wrapped optimizer's state_dict, the accumulators in parameter order (None for
        parameters without one), and the delayed-scaling states in parameter order (a dict from
        tensor name to DelayedScaler.state_dict(), empty for parameters without one)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "accumulators": [
                self.accumulators[p].clone() if p in self.accumulators else None
                for p in self._params()
            ],
            "scalers": [
                {name: scaler.state_dict() for name, scaler in self.scalers.get(p, {}).items()}
                for p in self._params()
            ],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict of OptimLP, of lpsim.compat.qtorch.OptimLP (a torch optimizer's with
        the accumulators under "weight_acc" and the delayed-scaling states under "scalers"), or of
        a plain torch optimizer of the wrapped type. Accumulators that a state_dict does not hold
        (a torch optimizer's, or one saved by an OptimLP without accumulators) start from the
        current weights, rounded into acc as when they are made.

        As torch's load_state_dict, the saved parameter groups replace the wrapped optimizer's:
        their options (lr, momentum, ...) and their ``"quantization"`` come from the state_dict,
        and the accumulators and delayed-scaling states are loaded for those settings (a group
        whose "quantization" a precision schedule changed before the checkpoint included).
        What this OptimLP was made with stays its own: the default formats, ``parameters=``,
        ``grad_scaling`` and ``fused`` (none of them is in the state_dict).

        Raises:
            ValueError: the state_dict is none of these, or holds accumulators for some
                parameters but not for one that needs one.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if "optimizer" in state_dict:
            inner, saved = state_dict["optimizer"], state_dict.get("accumulators")
            scalers = state_dict.get("scalers")
        elif "state" in state_dict and "param_groups" in state_dict:
            # A plain torch optimizer's, or lpsim.compat.qtorch.OptimLP's: torch's layout with the
            # accumulators and delayed-scaling states under two more keys.
            inner = {k: v for k, v in state_dict.items() if k not in TORCH_LAYOUT_EXTRAS}
            saved = state_dict.get(TORCH_LAYOUT_EXTRAS[0])
            scalers = state_dict.get(TORCH_LAYOUT_EXTRAS[1])
        else:
            raise ValueError(
                "state_dict must be an OptimLP state_dict (keys 'optimizer', "
                "'accumulators') or a torch optimizer's (keys 'state', "
                f"'param_groups'); got keys {sorted(state_dict)}"
            )
        params = list(self._params())
        if saved is not None and len(saved) != len(params):
            raise ValueError(
                f"state_dict holds {len(saved)} accumulators for {len(params)} parameters"
            )
        if saved is not None and all(acc is None for acc in saved):
            saved = None  # saved without accumulators: they start from the weights
        if scalers is not None and len(scalers) != len(params):
            raise ValueError(
                f"state_dict holds scalers for {len(scalers)} of {len(params)} parameters"
            )
        before = self._take_saved_quantization(inner)
        try:
            self._load_scalers(params, scalers)
        except (RuntimeError, ValueError):
            self._restore_quantization(before)
            raise
        with torch.no_grad():
            for i, p in enumerate(params):
                s = self.settings.get(p)
                if p not in self.accumulators:
                    if s is None or s.acc is None:
                        continue
                    # An acc that the saved group's "quantization" set during the saved run.
                    dtype = _accumulator_dtype(s.acc, p.dtype)
                    self.accumulators[p] = torch.empty_like(p, dtype=dtype)
                acc = self.accumulators[p]
                if saved is None:  # as the constructor makes it: the weight rounded into acc
                    quant = self._quantizer(p, "acc", s.acc, acc)
                    acc.copy_(_rounded(quant, p.detach().to(acc.dtype)))
                elif saved[i] is None:
                    raise ValueError(f"state_dict holds no accumulator for parameter {i}")
                else:
                    acc.copy_(saved[i])
                # A weight changed after this (the model's state loaded after the optimizer's, or
                # other weights) is compared with the accumulator as step() compares it.
                self._weight_versions[p] = (p._version, "made" if saved is None else "written")
        # Torch casts state buffers to their parameter's dtype: show it the accumulators' dtype
        # where they are wider, so that their buffers keep it.
        stand_ins = self._swap_in(for_step=False)
        try:
            self.optimizer.load_state_dict(inner)
        finally:
            self._swap_out(stand_ins)
        self._share_with_optimizer()
        self._configure()

    def _take_saved_quantization(self, inner: dict) -> list:
        """Give each parameter group the ``"quantization"`` of its saved group (none where the
        saved group has none), as torch's load_state_dict replaces the groups with the saved
        ones, and work out the settings from them before the accumulators and delayed-scaling
        states are loaded: a group whose "quantization" the saved run set or replaced between
        steps (a precision schedule) has its saved accumulators and scalers loaded, as in the
        uninterrupted run. Saved groups that do not match the groups in number and size are left
        to torch's load_state_dict, which refuses them. Returns what _restore_quantization
        needs to put the groups back. A saved setting that does not fit a parameter raises as
        the constructor's does, the groups left as they were."""
        before = [(group, group.get(_GROUP_KEY, group)) for group in self.param_groups]
        saved_groups = inner.get("param_groups")
        sizes = self._group_sizes()
        if not isinstance(saved_groups, list) or len(saved_groups) != len(sizes):
            return before
        if any(
            not isinstance(g, dict) or len(g.get("params", ())) != n
            for g, n in zip(saved_groups, sizes)
        ):
            return before
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            if _GROUP_KEY in saved:
                group[_GROUP_KEY] = saved[_GROUP_KEY]
            else:
                group.pop(_GROUP_KEY, None)
        try:
            self._configure(make_accumulators=False)
        except (TypeError, ValueError):
            self._restore_quantization(before)
            raise
        return before

    def _restore_quantization(self, before: list) -> None:
        """Each group's "quantization" as _take_saved_quantization found it, and the settings
        worked out from them."""
        for group, value in before:
            if value is group:
                group.pop(_GROUP_KEY, None)
            else:
                group[_GROUP_KEY] = value
        self._configure(make_accumulators=False)

    def _load_scalers(self, params: list, saved: list | None) -> None:
        """Delayed-scaling states from a state_dict (None: none saved; scalers start afresh).
        The scalers are replaced once every state has loaded: a state that does not load leaves
        them as they were."""
        if saved is None:
            self.scalers = {}
            return
        loaded = {}
        for p, states in zip(params, saved, strict=True):
            s = self.settings.get(p)
            for name, state in states.items():
                category = name.split(".", 1)[0]
                quant = None if s is None else getattr(s, category, None)
                if not (isinstance(quant, QuantSpec) and isinstance(quant.format, DelayedScaling)):
                    raise ValueError(
                        f"state_dict holds a delayed-scaling state {name!r} for a parameter whose "
                        f"{category} has no DelayedScaling"
                    )
                scaler = quant.format.scaler(p.device)
                scaler.load_state_dict(state)
                loaded.setdefault(p, {})[name] = scaler
        self.scalers = loaded

    def __repr__(self) -> str:
        parts = [
            f"{name}={getattr(self.default_quantization, name)}"
            for name in _CATEGORIES
            if getattr(self.default_quantization, name) is not None
        ]
        if self.grad_scaling != 1.0:
            parts.append(f"grad_scaling={self.grad_scaling}")
        full = sum(1 for s in self.settings.values() if s is None)
        if full:
            parts.append(f"{full} of {len(self.settings)} parameters in full precision")
        return f"OptimLP({', '.join(parts)}) wrapping {self.optimizer!r}"
