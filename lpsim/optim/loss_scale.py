"""Dynamic loss scaling for gradients and errors in any simulated format.

Errors (the gradients flowing back through a model) are often far smaller than the smallest value
of a low-precision format: in e4m3 (smallest subnormal 2**-9) the errors of a mean loss over a
batch of a thousand examples round to zero, and training stalls. Multiplying the loss by a scale
S multiplies every error by S, which lifts them into the format's range; the gradients are divided
by S again before the optimizer uses them. Too large an S pushes the largest errors past the
format's largest value instead. DynamicLossScaler chooses S as torch.amp.GradScaler does (grow it
after a run of clean steps, shrink it and skip the step after an overflow), with the overflow of
the simulated formats as the signal:

    scaler = DynamicLossScaler()
    scaler.watch_model(model)               # a model injected with LayerQuantization(error=...)
    for x, y in batches:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)              # unscales, then steps or skips
        scaler.update()                     # grows or backs off the scale
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable, JoinHook
from torch.nn.utils import parametrize
from torch.optim import Optimizer

from lpsim import _observation
from lpsim._checks import steps_in_backward
from lpsim.formats import P3109, Fixed, Float
from lpsim.nn.functions import FunctionQuantization
from lpsim.nn.inject import injected
from lpsim.nn.quantizer import QuantSpec, Spec, as_spec
from lpsim.scaled import Scaled

__all__ = ["DynamicLossScaler"]

_CONFIG = (
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "min_scale",
    "max_scale",
    "power_of_two",
)


def _is_power_of_two(value: float) -> bool:
    return math.frexp(value)[0] == 0.5


def _show(value: float) -> str:
    """value as written in messages: 2**k for large and small powers of two."""
    if 0 < value < math.inf and _is_power_of_two(value) and abs(math.log2(value)) >= 10:
        return f"2**{int(math.log2(value))}"
    return repr(value)


def _check_scale_number(
    name: str,
    value,
    low: float,
    high: float,
    *,
    open_low: bool = True,
    open_high: bool = True,
    power_of_two: bool = False,
    bounds: str = "",
) -> float:
    """value as a float, or TypeError/ValueError naming ``name`` and the allowed range
    (``bounds``: the names of the limits, such as "[min_scale, max_scale]")."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond the float range
        value = math.inf if value > 0 else -math.inf
    above = value > low if open_low else value >= low
    below = value < high if open_high else value <= high
    if not (above and below):
        left, right = "(" if open_low else "[", ")" if open_high else "]"
        interval = f"{left}{_show(low)}, {_show(high)}{right}"
        raise ValueError(
            f"{name} must be in {bounds + ' = ' if bounds else ''}{interval}, got {_show(value)}"
        )
    if power_of_two and not _is_power_of_two(value):
        raise ValueError(
            f"{name} must be a power of two (2.0**k) with power_of_two=True, got {value}"
        )
    return value


def _overflow_bounds(spec) -> tuple[float | None, float]:
    """(low, high) such that an error e overflows ``spec``'s format when e >= high or e <= low
    (low None: |e| >= high counts, as for Float and a signed P3109; an unsigned Fixed or P3109
    has low -inf: only e >= high counts, a negative error being clipped to 0 or made NaN, which
    the check of non-finite gradients sees, not overflowing)."""
    fmt = spec.format if isinstance(spec, QuantSpec) else spec
    if isinstance(fmt, Float):
        return None, fmt.max
    if isinstance(fmt, P3109):  # every saturation mode: SatNone overflows, the others saturate
        return (None if fmt.signed else -math.inf), fmt.max
    if isinstance(fmt, Fixed) and fmt.clamp:
        return (fmt.min if fmt.min < 0 else -math.inf), fmt.max
    if isinstance(fmt, Scaled) and not fmt.tensor_scale:
        # A block's scale stops at the scale format's largest, where its elements saturate: the
        # format's values end at the element's limits times that scale (lpsim.finfo's max, min).
        element = fmt.element
        if isinstance(element, Float):
            return None, fmt.max
        low = element.min * fmt.scale.max
        return (low if low < 0 else -math.inf), fmt.max
    raise ValueError(
        "watch needs a format with a largest value that errors can overflow: a Float, a P3109, "
        f"a Fixed with clamp=True or a Scaled format without a tensor scale, got {fmt!r} (a "
        "BlockFloat format scales each block, a Scaled format with a tensor scale and a "
        "DelayedScaling each tensor, to a range of its own, which a loss scale does not move; a "
        "Fixed without clamp keeps its spacing beyond its range)"
    )


def _tensors(value):
    """The floating-point tensors in value (a tensor, or nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _gradient_versions(optimizer: Optimizer) -> list:
    """Each gradient of optimizer's parameters, with its version counter (None: no gradient)."""
    return [
        None if p.grad is None else (p.grad, p.grad._version)
        for group in optimizer.param_groups
        for p in group["params"]
    ]


def _unchanged_gradients(optimizer: Optimizer, closure: Callable[[], object]):
    """closure, raising RuntimeError when it returns if it replaced or modified a gradient of
    optimizer's parameters (a backward pass of the scaled loss)."""
    before = _gradient_versions(optimizer)

    def checked():
        result = closure()
        after = _gradient_versions(optimizer)
        if len(after) != len(before) or any(
            (a is None) != (b is None) or (a is not None and (a[0] is not b[0] or a[1] != b[1]))
            for a, b in zip(after, before)
        ):
            raise RuntimeError(
                "the closure passed to DynamicLossScaler.step() changed the gradients of the "
                "optimizer's parameters: gradients computed inside it are those of the scaled "
                "loss and are neither unscaled nor checked for overflow; run the backward pass "
                "before step() and pass a closure that only returns the loss"
            )
        return result

    return checked


def _setting(name: str) -> property:
    """A setting of DynamicLossScaler (one of _CONFIG): assigning it validates it with the others
    and the current scale, as the constructor does (a growth_factor that is not a power of two
    with power_of_two=True, a max_scale below the scale, ... raise), and applies from the next
    update()."""

    def setter(self, value) -> None:
        settings = {key: getattr(self, key) for key in _CONFIG}
        settings[name] = value
        self._configure(self._scale, *settings.values(), scale_name="the current scale")

    return property(lambda self: getattr(self, "_" + name), setter)


class _FunctionHook:
    """A hook that watch_functions() gave an entry of a quantize_functions context."""

    def __init__(self, functions, index: int, hook: Callable):
        self.functions, self.index, self.hook = functions, index, hook

    def remove(self) -> None:
        hooks = self.functions._error_hooks
        left = tuple(h for h in hooks.get(self.index, ()) if h is not self.hook)
        if left:
            hooks[self.index] = left
        else:
            hooks.pop(self.index, None)


class _OverflowWatch:
    """The hook DynamicLossScaler.watch() returns. An object, not a closure, so that a copy of a
    model holding it (copy.deepcopy or pickle of the model and its scaler together: an EMA
    model, a branch of a run) records the copy's overflows in the copy's scaler, not in the
    original's, whose next step it would skip."""

    def __init__(self, scaler: DynamicLossScaler, low, high):
        self.scaler, self.low, self.high = scaler, low, high

    def __call__(self, error: torch.Tensor) -> torch.Tensor:
        if _observation.hidden:
            return error
        if self.low is None:
            inside = error.abs() < self.high  # False for NaN
        else:
            inside = (error < self.high) & (error > self.low)
        self.scaler._record(~inside.all())
        return error


class _ErrorWatch:
    """The forward hook watch_model() puts on a module: the errors flowing back into its
    outputs go through ``hook`` (an _OverflowWatch). An object, as _OverflowWatch is."""

    def __init__(self, hook: _OverflowWatch):
        self.hook = hook

    def __call__(self, module: nn.Module, args, output) -> None:
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(self.hook)


class _OperandsWatch:
    """The forward hook (with kwargs) watch_model() puts on a Linear whose backward products take
    the error as an operand of their own (LayerQuantization's input_grad_operands and
    weight_grad_operands with an Operands.error): the error flowing back into its output is
    checked, by each product's _OverflowWatch, as that product quantises it: E (the rows of the
    output, out_features last) for the input gradient, E^T (the rows, all tokens, last) for the
    weight gradient, each after the Operands' transform along that axis. A product that does not
    run (an input or weight without gradient) is not checked. An object, as _OverflowWatch is."""

    def __init__(self, input_grad, weight_grad):
        # (OperandSpecs, _OverflowWatch) or None, for each product
        self.input_grad, self.weight_grad = input_grad, weight_grad

    def __call__(self, module: nn.Module, args, kwargs, output) -> None:
        x = args[0] if args else kwargs.get("input")
        weight = (
            module.parametrizations.weight.original
            if parametrize.is_parametrized(module, "weight")
            else module.weight
        )
        products = []
        if self.input_grad is not None and isinstance(x, torch.Tensor) and x.requires_grad:
            products.append((self.input_grad, False))
        if self.weight_grad is not None and weight.requires_grad:
            products.append((self.weight_grad, True))
        if products and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(_OperandsCheck(products))


class _OperandsCheck:
    """The gradient hook of _OperandsWatch: each product's error operand, checked."""

    def __init__(self, products: list):
        self.products = products

    def __call__(self, error: torch.Tensor) -> torch.Tensor:
        if _observation.hidden:
            return error
        rows = error.reshape(-1, error.shape[-1])  # as Linear's product takes it
        for (operands, watch), transposed in self.products:
            operand = rows.t() if transposed else rows
            transform = operands.transform
            if transform is not None:
                if operand.shape[-1] % transform.size:
                    continue  # the product raises, naming the reduction
                # as the product transforms it: in float32 at least
                work = torch.promote_types(operand.dtype, torch.float32)
                operand = transform.apply(operand.to(work))
            watch(operand)
        return error


class _Handles:
    """The hooks watch_model() registered; remove() takes them out."""

    def __init__(self, handles: list):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class _ScalerJoinHook(JoinHook):
    """What a rank that has run out of batches does for its DynamicLossScaler inside torch's
    Join context (see DynamicLossScaler's docstring): it shadows the overflow all-reduces of each
    step() of the ranks still training, and at the end takes the scaler's state from the last
    rank to join."""

    def __init__(self, scaler: DynamicLossScaler):
        self.scaler = scaler

    def main_hook(self) -> None:
        scaler = self.scaler
        if not scaler._reducing():
            return
        for _ in range(scaler._reductions_per_iteration):
            flag = torch.zeros((), device=scaler.join_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=scaler.process_group)

    def post_hook(self, is_last_joiner: bool) -> None:
        scaler = self.scaler
        if not scaler._reducing():
            return
        group, device = scaler.process_group, scaler.join_device
        rank = dist.get_rank(group)
        source = torch.tensor(rank if is_last_joiner else -1, device=device)
        dist.all_reduce(source, op=dist.ReduceOp.MAX, group=group)
        # float64 holds the scale (a float) and the counters exactly
        state = torch.tensor(
            [
                scaler._scale,
                scaler.clean_steps,
                scaler.skipped_steps,
                scaler._reductions_per_iteration,
            ],
            dtype=torch.float64,
            device=device,
        )
        last = int(source) if group is None else dist.get_global_rank(group, int(source))
        dist.broadcast(state, last, group=group)
        scale, clean, skipped, reductions = state.tolist()
        scaler._scale = scale
        scaler.clean_steps, scaler.skipped_steps = int(clean), int(skipped)
        scaler._reductions_per_iteration = int(reductions)


class DynamicLossScaler(Joinable):
    """Dynamic loss scaling, as torch.amp.GradScaler, for gradients and errors in any simulated
    format (lpsim.nn quantisers, lpsim.nn.inject, OptimLP, the recipes, or no quantisation).

    The scale S multiplies the loss (``scale(loss)``), hence every error and gradient of the
    backward pass; ``unscale_(optimizer)`` divides the gradients of the optimizer's parameters by
    S again, in place. ``step(optimizer)`` unscales if that was not done yet and calls
    ``optimizer.step()``, or skips the step when the backward pass overflowed; ``update()`` then
    adapts S:

    - after an overflow in the iteration (in any of its steps, or in the gradients that
      ``unscale_`` found non-finite for an optimizer whose step() was then not called, as
      torch.amp.GradScaler counts them): S <- S * backoff_factor, and the count of clean steps
      restarts;
    - after ``growth_interval`` consecutive iterations without overflow: S <- S * growth_factor;

    S is clamped to [min_scale, max_scale] each time.

    What counts as overflow:

    1. a non-finite gradient (Inf or NaN) of any parameter of the optimizer, after the backward
       pass. A non-saturating simulated format produces exactly that when its errors overflow:
       +/-Inf in an IEEE-style Float, NaN in a format without Inf (e4m3fn, the fnuz formats)
       with saturate=False; overflow of the float32 container itself gives Inf too.
    2. an error at or beyond the largest magnitude of a *watched* format: before a quantiser
       rounds the errors into a format, a hook from ``watch(format)`` (or ``watch_model(model)``)
       records overflow when any element e is non-finite or has |e| >= max (for a clamping
       signed Fixed, e >= max or e <= min; for an unsigned Fixed or P3109, e >= max). This is how
       a *saturating* format (Float with saturate=True, clamping Fixed, P3109 with SatFinite or
       SatPropagate, a Scaled format without a tensor scale, whose blocks' scales stop at the
       scale format's largest) is seen: it clamps the error to +/-max instead of producing Inf,
       and the clamped gradient stays finite but wrong. The bound is inclusive because an error
       equal to max cannot be told apart from one that an earlier quantiser clamped; a
       legitimate error exactly at max costs one halving.

    Not seen: a saturating MAC accumulator in the backward products (inject's and
    quantize_functions' mac, input_grad_mac, weight_grad_mac) clamps the partial sums of the
    scaled gradients, which no check reaches; give them a non-saturating accumulator, whose
    overflow is Inf. Nor a saturating error operand of quantize_functions' backward products (an
    entry's input_grad_operands or weight_grad_operands with an Operands.error), which
    watch_functions does not reach; inject's (a Linear's) are watched by watch_model.

    A step with either kind of overflow is skipped: optimizer.step() is not called, so
    parameters, optimizer state (and OptimLP's accumulators) stay as they were. Watched overflows
    are not attributed to one optimizer: with several optimizers, every step of that iteration
    is skipped.

    Distributed training: every rank of a DistributedDataParallel model steps with the same
    all-reduced gradients, so every rank must take the same decision, or the ranks' weights part
    silently. A non-finite gradient is seen by all (the all-reduce spreads it, which is all that
    torch.amp.GradScaler relies on), but a watched overflow is found in a rank's own errors, before
    the all-reduce, and a saturating format leaves no trace of it in the reduced gradients. So
    with ``reduce_overflow=True`` (the default), while torch.distributed is initialised,
    step() all-reduces its decision (MAX: an overflow on any rank skips the step on every rank)
    over ``process_group`` (None: the default group), as torch's ShardedGradScaler reduces its
    found-inf flag: one collective per step(), which every rank of the group must call in the
    same order (it waits for the others). update() counts the non-finite gradients of an
    optimizer that was unscaled but not stepped on its own rank (DDP's gradients agree). With
    ``reduce_overflow=False`` each rank decides alone (independent runs sharing a process group).
    A ZeroRedundancyOptimizer made with ``overlap_with_ddp=True`` is stepped by DDP's
    communication hook during the backward pass, with the scaled gradients, before any unscaling
    or skip: unscale_() and step() refuse it (ValueError), and an OptimLP around it.
    Uneven inputs: the scaler is a torch ``Joinable``; list it after the model,
    ``with torch.distributed.algorithms.join.Join([ddp_model, scaler]):``, and a rank that has run
    out of batches shadows the overflow all-reduces of each iteration of the ranks still training
    (as many as its own last iteration made, one per step(); one for a rank that never stepped),
    and when all have joined every rank takes the scale and counters of the last rank to join, so
    the next epoch scales every rank's loss alike. ``ddp_model.join()`` alone shadows DDP's
    collectives, not these: a rank still training would pair its overflow all-reduce with a
    shadowed gradient all-reduce (gloo aborts on the mismatch; other backends may hang). Listing
    the scaler first raises RuntimeError.

    Powers of two: with ``power_of_two=True`` (the default) init_scale, growth_factor,
    backoff_factor, min_scale and max_scale must be powers of two, so S always is one, and
    multiplying the loss by S and dividing the gradients by it are exact in any binary floating
    format, unless a product leaves the container's range (float16's, for example). Without
    quantisers the unscaled gradients then equal those of the unscaled loss bit for bit; with
    them, only the rounding of the scaled errors differs, which is the point. With
    ``power_of_two=False`` any positive values are accepted, and scaling and unscaling then round
    in the container.

    With OptimLP, leave its ``grad_scaling`` at 1.0: the scaler divides the gradients by S before
    OptimLP quantises them. With a recipe, apply ``dataclasses.replace(recipe, loss_scale=1.0)``
    and let the scaler choose the scale.

    Args:
        init_scale: the first S, in (0, inf) and within [min_scale, max_scale].
        growth_factor: the factor of a growth, in (1, inf).
        backoff_factor: the factor of a backoff, in (0, 1).
        growth_interval: clean iterations before a growth, an integer >= 1.
        min_scale, max_scale: the range of S, 0 < min_scale <= max_scale < inf (by default
            2**-64 and 2**64, powers of two that float32 and bfloat16 hold); scale() refuses an
            S that rounds to 0 in the loss's dtype.
        power_of_two: require the five numbers above to be powers of two (see above).
        reduce_overflow: take step()'s skip decision over all ranks of ``process_group`` while
            torch.distributed is initialised (see above); a bool.
        process_group: the ranks whose decisions agree (a torch.distributed ProcessGroup, that of
            DistributedDataParallel's all-reduce); None: the default group.

    ``get_scale()`` returns S (a float). The settings growth_factor, backoff_factor,
    growth_interval, min_scale, max_scale and power_of_two are attributes that may be assigned
    between iterations (as torch.amp.GradScaler's set_growth_factor, ...): each assignment is
    validated with the other settings and the current S as the constructor validates them, and
    applies from the next update().

    Attributes:
        found_overflow: whether the last step() found an overflow (and skipped the step).
        skipped_steps: how many optimizer steps were skipped in all.
        clean_steps: iterations without overflow since the last growth or backoff.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of its range, or not a power of two where one is required;
            the message names the argument and the range.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 2.0**-64,
        max_scale: float = 2.0**64,
        *,
        power_of_two: bool = True,
        reduce_overflow: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ):
        if not isinstance(reduce_overflow, bool):
            raise TypeError(f"reduce_overflow must be a bool, got {type(reduce_overflow).__name__}")
        if process_group is not None and not (
            dist.is_available() and isinstance(process_group, dist.ProcessGroup)
        ):
            raise TypeError(
                "process_group must be a torch.distributed ProcessGroup or None (the default "
                f"group), got {type(process_group).__name__}"
            )
        super().__init__()  # Joinable: torch's Join context manager
        self.reduce_overflow = reduce_overflow
        self.process_group = process_group
        self._reductions = 0  # overflow all-reduces since the last update()
        self._reductions_per_iteration = (
            1  # those of the last iteration: what a joined rank shadows
        )
        self._join_device = torch.device("cpu")  # that of the last overflow all-reduce
        self._configure(
            init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            min_scale,
            max_scale,
            power_of_two,
            scale_name="init_scale",
        )
        self.found_overflow = False
        self.skipped_steps = 0
        self.clean_steps = 0
        self._optimizers: dict[int, dict] = {}  # per optimizer this iteration: unscaled, stepped
        self._watched: dict[torch.device, torch.Tensor] = {}  # overflow seen by watch hooks

    def _configure(
        self,
        scale,
        growth_factor,
        backoff_factor,
        growth_interval,
        min_scale,
        max_scale,
        power_of_two,
        *,
        scale_name: str,
    ) -> None:
        if not isinstance(power_of_two, bool):
            raise TypeError(f"power_of_two must be a bool, got {type(power_of_two).__name__}")
        exact = {"power_of_two": power_of_two}
        growth_factor = _check_scale_number("growth_factor", growth_factor, 1.0, math.inf, **exact)
        backoff_factor = _check_scale_number("backoff_factor", backoff_factor, 0.0, 1.0, **exact)
        if not isinstance(growth_interval, int) or isinstance(growth_interval, bool):
            raise TypeError(f"growth_interval must be an int, got {type(growth_interval).__name__}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        min_scale = _check_scale_number("min_scale", min_scale, 0.0, math.inf, **exact)
        max_scale = _check_scale_number(
            "max_scale",
            max_scale,
            min_scale,
            math.inf,
            open_low=False,
            bounds="[min_scale, inf)",
            **exact,
        )
        scale = _check_scale_number(
            scale_name,
            scale,
            min_scale,
            max_scale,
            open_low=False,
            open_high=False,
            bounds="[min_scale, max_scale]",
            **exact,
        )
        self._scale = scale
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._power_of_two = power_of_two

    growth_factor = _setting("growth_factor")
    backoff_factor = _setting("backoff_factor")
    growth_interval = _setting("growth_interval")
    min_scale = _setting("min_scale")
    max_scale = _setting("max_scale")
    power_of_two = _setting("power_of_two")

    # The backward pass

    def get_scale(self) -> float:
        """The current scale S."""
        return self._scale

    def scale(self, loss: torch.Tensor | tuple | list) -> torch.Tensor | tuple | list:
        """loss * S: a tensor, or the same structure of tuples and lists of tensors, each
        multiplied by the scale (exact in a binary format when S is a power of two). Call
        backward() on the result.

        Raises:
            TypeError: loss is not a tensor or a tuple or list of them.
            ValueError: S rounds to 0 in a floating loss's dtype (S at most half its smallest
                subnormal: 2^-150 for float32), which would make every gradient 0 or NaN.
        """
        if isinstance(loss, torch.Tensor):
            if loss.is_floating_point():
                finfo = torch.finfo(loss.dtype)
                smallest = finfo.tiny * finfo.eps  # the smallest subnormal
                if self._scale <= smallest / 2:
                    raise ValueError(
                        f"the loss scale {self._scale!r} rounds to 0 in the loss's dtype "
                        f"{loss.dtype}, whose smallest subnormal is {smallest!r}: set min_scale "
                        f"(and init_scale) to at least {smallest!r}"
                    )
            return loss * self._scale
        if isinstance(loss, (tuple, list)):
            return type(loss)(self.scale(item) for item in loss)
        raise TypeError(
            f"loss must be a tensor or a tuple or list of tensors, got {type(loss).__name__}"
        )

    def watch(self, spec: Spec) -> Callable[[torch.Tensor], torch.Tensor]:
        """A backward hook for lpsim.nn.quantizer / Quantizer (``backward_hooks=[...]``) that
        records overflow when the errors about to be rounded into ``spec``'s format reach its
        largest magnitude or are not finite (see the class docstring). The hook returns the error
        unchanged and does not synchronise with the device: it keeps a flag on the error's device,
        read once by step(). Errors of passes that are not part of the run
        (lpsim.diagnostics.Shadow.compare) are not checked.

        Args:
            spec: a Float, a P3109, a clamping Fixed, a Scaled format without a tensor scale
                (whose blocks' scales stop at the scale format's largest: its values end at
                lpsim.finfo's max and min), or a (format, rounding) pair.

        Raises:
            TypeError: spec is not a format or a (format, rounding) pair.
            ValueError: the format has no fixed largest value that a loss scale can push errors
                past (BlockFloat, Scaled with a tensor scale, DelayedScaling, Fixed without
                clamp).
        """
        return _OverflowWatch(self, *_overflow_bounds(as_spec(spec, "nearest", "spec")))

    def watch_model(self, model: nn.Module) -> _Handles:
        """Watch every error quantiser that lpsim.nn.inject placed in ``model`` (modules injected
        with LayerQuantization(error=...), as the recipes do): the errors flowing back into each
        such module's outputs are checked against the module's error format, as by watch().
        So are the error operands of a Linear's backward products (LayerQuantization's
        input_grad_operands and weight_grad_operands with an Operands.error), each as its product
        quantises it: the error E (the output's rows) for the input gradient and E^T for the
        weight gradient, after the Operands' transform along that product's reduction axis (a
        random Hadamard transform mixes each group of errors, whose largest magnitude then is not
        E's), and only where the product runs (its input or weight has a gradient).
        Formats without a fixed largest value (BlockFloat, Scaled with a tensor scale,
        DelayedScaling, Fixed without clamp) are not watched: they scale each block or tensor to
        its own range, which the loss scale does not move (a DelayedScaling element still
        saturates on an amax spike, and a growth of the loss scale is one: give its error format
        margin >= log2(growth_factor); see docs/training.md). A Scaled format without a tensor
        scale is watched: its blocks' scales stop at the scale format's largest, beyond which
        its elements saturate (E2M1 elements with E4M3 scales end at 6 * 448 = 2688). Inject
        first; after injecting other formats, remove the handle and watch the model again.

        Returns:
            A handle whose remove() takes the hooks out again.

        Raises:
            ValueError: no module of the model has an error quantiser that can overflow.
        """
        handles = []
        modules = [(module, done) for _, module, done in injected(model)]
        errors = ((module, done.get("error")) for module, done in modules)
        for module, hook in self._overflow_hooks(errors):
            handles.append(module.register_forward_hook(_ErrorWatch(hook)))
        for module, done in modules:
            products = []
            for operands in done.get("operands") or (None, None):
                spec = None if operands is None else operands.error
                hooks = list(self._overflow_hooks([(operands, spec)]))
                products.append(hooks[0] if hooks else None)
            if any(products):
                watch = _OperandsWatch(*products)
                handles.append(module.register_forward_hook(watch, with_kwargs=True))
        if not handles:
            raise ValueError(
                "watch_model found no error quantiser that can overflow in the model: inject it "
                "first with LayerQuantization(error=...) in a Float, P3109, clamping Fixed or "
                "Scaled format without a tensor scale"
            )
        return _Handles(handles)

    def _overflow_hooks(self, errors) -> Iterator[tuple[object, Callable]]:
        """(place, watch(spec)) for each (place, error spec) of ``errors`` whose format can
        overflow (a spec that is None, or whose format has no fixed largest value, is passed)."""
        for place, spec in errors:
            if spec is None:
                continue
            try:
                hook = self.watch(spec)
            except ValueError:
                continue
            yield place, hook

    def watch_functions(self, functions: FunctionQuantization) -> _Handles:
        """Watch the error quantisers of a ``lpsim.nn.quantize_functions`` context, as
        watch_model() watches inject()'s: the gradient arriving at the result of each call that an
        entry with an error format decides is checked against that format, as by watch(), before
        it is rounded. Entries whose error format has no fixed largest value (BlockFloat, Scaled
        with a tensor scale, DelayedScaling, Fixed without clamp) are not watched.

        Returns:
            A handle whose remove() takes the hooks out again.

        Raises:
            TypeError: functions is not what quantize_functions returned.
            ValueError: no entry has an error format that can overflow.
        """
        if not isinstance(functions, FunctionQuantization):
            raise TypeError(
                "functions must be what lpsim.nn.quantize_functions returned, got "
                f"{type(functions).__name__}"
            )
        handles = []
        errors = ((i, entry.train.specs.get("error")) for i, entry in enumerate(functions.entries))
        for index, hook in self._overflow_hooks(errors):
            functions._error_hooks[index] = functions._error_hooks.get(index, ()) + (hook,)
            handles.append(_FunctionHook(functions, index, hook))
        if not handles:
            raise ValueError(
                "watch_functions found no error format that can overflow in the config: give an "
                "entry LayerQuantization(error=...) in a Float, P3109, clamping Fixed or Scaled "
                "format without a tensor scale"
            )
        return _Handles(handles)

    def _record(self, overflow: torch.Tensor) -> None:
        device = overflow.device
        seen = self._watched.get(device)
        self._watched[device] = overflow if seen is None else seen | overflow

    # The optimizer step

    def _state(self, optimizer: Optimizer) -> dict:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if steps_in_backward(optimizer):
            raise ValueError(
                "optimizer: a ZeroRedundancyOptimizer made with overlap_with_ddp=True updates the "
                "parameters inside DistributedDataParallel's backward pass (its step() does "
                "nothing), with the gradients of the scaled loss, before the scaler could unscale "
                "them or skip the step; make it without overlap_with_ddp to scale the loss"
            )
        # Keyed by the parameter groups, which hold the gradients: an OptimLP shares its wrapped
        # optimizer's, so unscaling one and stepping the other divides the gradients once.
        return self._optimizers.setdefault(
            id(optimizer.param_groups),
            {"unscaled": False, "stepped": False, "skipped": False, "overflow": []},
        )

    @torch.no_grad()
    def unscale_(self, optimizer: Optimizer) -> None:
        """Divide the gradients of ``optimizer``'s parameters by the scale, in place, and note
        (without synchronising) whether any is not finite. Call it at most once per iteration,
        before step(), where the true gradients are needed before the step (gradient clipping).
        An OptimLP and the optimizer it wraps share their gradients and count as one optimizer
        here and in step().

        Raises:
            RuntimeError: unscale_ was already called for this optimizer since the last update(),
                or step() was.
            ValueError: the optimizer (or the one an OptimLP wraps) is a ZeroRedundancyOptimizer
                made with overlap_with_ddp=True, which steps in the backward pass.
        """
        state = self._state(optimizer)
        if state["unscaled"]:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()"
            )
        if state["stepped"]:
            raise RuntimeError("unscale_() is being called after step(); call update() first")
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_device.setdefault(p.grad.device, []).append(p.grad)
        for grads in by_device.values():
            dense = [g for g in grads if not g.is_sparse]
            sparse = [g for g in grads if g.is_sparse]  # nn.Embedding(sparse=True)
            if self._scale != 1.0:
                if dense:
                    torch._foreach_div_(dense, self._scale)
                for g in sparse:
                    g.div_(self._scale)
            values = dense + [g.coalesce()._values() for g in sparse]
            finite = torch.stack([torch.isfinite(v).all() for v in values]).all()
            state["overflow"].append(~finite)
        state["unscaled"] = True

    def step(
        self, optimizer: Optimizer, closure: Callable[[], object] | None = None
    ) -> object | None:
        """Unscale the gradients (unless unscale_ did already) and call
        ``optimizer.step(closure)`` if the iteration has not overflowed (see the class
        docstring); otherwise skip it. Reads the overflow flags once (one synchronisation per
        device).

        The closure is passed on, to be called by the optimizer, and must not change the
        gradients of the optimizer's parameters (return a loss already computed, for example): the
        gradients of a backward pass run inside it would be those of the scaled loss, S times too
        large, and computed after the overflow check. A closure that changes them raises
        RuntimeError when it returns, before the optimizer uses them (torch's optimizers and
        OptimLP call the closure before changing anything); compute the gradients before step().

        Returns:
            What optimizer.step returns, or None when the step is skipped.

        Raises:
            RuntimeError: step() was already called for this optimizer since the last update(),
                or the closure changed a gradient of the optimizer's parameters.
            ValueError: the optimizer (or the one an OptimLP wraps) is a ZeroRedundancyOptimizer
                made with overlap_with_ddp=True, which steps in the backward pass: neither the
                unscaling nor a skip would reach its update.
        """
        state = self._state(optimizer)
        if state["stepped"]:
            raise RuntimeError(
                "step() has already been called on this optimizer since the last update()"
            )
        if not state["unscaled"]:
            self.unscale_(optimizer)
        flags = state["overflow"] + list(self._watched.values())
        overflow = self._across_ranks(any(bool(flag) for flag in flags), flags, optimizer)
        state["stepped"], state["skipped"] = True, overflow
        self.found_overflow = overflow
        if overflow:
            self.skipped_steps += 1
            return None
        if closure is None:
            return optimizer.step()
        return optimizer.step(_unchanged_gradients(optimizer, closure))

    def _reducing(self) -> bool:
        """Whether step() all-reduces its decision (see the class docstring)."""
        return (
            self.reduce_overflow
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(self.process_group) > 1
        )

    def _across_ranks(self, overflow: bool, flags: list, optimizer: Optimizer) -> bool:
        """overflow on any rank of the process group (see the class docstring), or this rank's
        own when there is nothing to reduce over. The flag travels on the device of the gradients
        (that of the first flag, or of the first parameter): NCCL reduces CUDA tensors only."""
        if not self._reducing():
            return overflow
        if self._join_config.enable and self._join_config.is_first_joinable:
            raise RuntimeError(
                "DynamicLossScaler must follow the model in Join([...]): list the "
                "DistributedDataParallel model first, as Join([model, scaler])"
            )
        params = [p for group in optimizer.param_groups for p in group["params"]]
        device = flags[0].device if flags else params[0].device if params else "cpu"
        self._join_device = torch.device(device)
        flag = torch.tensor(float(overflow), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        self._reductions += 1
        return bool(flag)

    # torch.distributed.algorithms.join.Joinable

    def join_hook(self, **kwargs) -> JoinHook:
        """The hook by which a rank that has run out of batches inside ``Join([model, scaler])``
        shadows the overflow all-reduces of the ranks still training (see the class docstring)."""
        return _ScalerJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the overflow all-reduces (that of the gradients of the last step())."""
        return self._join_device

    @property
    def join_process_group(self):
        """The process group of the overflow all-reduces (the default group for None)."""
        return dist.group.WORLD if self.process_group is None else self.process_group

    def update(self) -> None:
        """Adapt the scale after this iteration's steps: back off if any overflowed, grow after
        growth_interval clean iterations (see the class docstring); then start a new iteration.

        Raises:
            RuntimeError: no step() since the last update().
        """
        if not any(s["stepped"] for s in self._optimizers.values()):
            raise RuntimeError("update() needs a step() since the last update()")
        states = self._optimizers.values()
        if any(s["skipped"] for s in states) or any(
            bool(flag) for s in states if not s["stepped"] for flag in s["overflow"]
        ):
            self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self._scale = min(self._scale * self.growth_factor, self.max_scale)
                self.clean_steps = 0
        self._optimizers.clear()
        self._watched.clear()
        if self._reductions:
            self._reductions_per_iteration = self._reductions
        self._reductions = 0

    # Checkpoints

    def __deepcopy__(self, memo: dict) -> DynamicLossScaler:
        """A scaler with its own state and the original's process_group, which cannot be
        copied (as DelayedScaling's amax_group): a model that a scaler watches, copied with it
        or alone (lpsim.diagnostics.Shadow's reference, an EMA model), holds a copy of it."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for name, value in vars(self).items():
            shared = name == "process_group"
            copied.__dict__[name] = value if shared else copy.deepcopy(value, memo)
        return copied

    def state_dict(self) -> dict:
        """The scale, the counters and the configuration, as plain Python numbers."""
        return {
            "scale": self._scale,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
            **{name: getattr(self, name) for name in _CONFIG},
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what state_dict() returned (validated as the constructor's arguments).

        Raises:
            KeyError: an entry is missing.
            TypeError, ValueError: an entry is malformed.
        """
        missing = [
            k for k in ("scale", "clean_steps", "skipped_steps", *_CONFIG) if k not in state_dict
        ]
        if missing:
            raise KeyError(f"state_dict lacks {', '.join(missing)}")
        for name in ("clean_steps", "skipped_steps"):
            value = state_dict[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"state_dict[{name!r}] must be an int >= 0, got {value!r}")
        self._configure(
            state_dict["scale"],
            *(state_dict[name] for name in _CONFIG),
            scale_name="state_dict['scale']",
        )
        self.clean_steps = state_dict["clean_steps"]
        self.skipped_steps = state_dict["skipped_steps"]

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self._scale}, growth_factor={self.growth_factor}, "
            f"backoff_factor={self.backoff_factor}, growth_interval={self.growth_interval}, "
            f"skipped_steps={self.skipped_steps})"
        )
