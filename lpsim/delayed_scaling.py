"""Delayed scaling: FP8 with one float32 scale per tensor, taken from the largest magnitudes
(amax) of the tensor's earlier quantisations, as Transformer Engine's ``DelayedScaling`` recipe
computes it.

``DelayedScaling(element, history_length=1024, reduction="max", margin=0, reduce_amax=True,
amax_group=None)`` describes the scaling;
it goes wherever a format goes in ``lpsim.nn.Quantizer``, ``lpsim.nn.inject``'s
``LayerQuantization`` and ``lpsim.optim.OptimLP``, each of which gives every tensor it quantises
its own ``DelayedScaler``: the state (the amax history and the scale), an ``nn.Module`` whose
buffers are in its owner's ``state_dict``.

One call ``scaler(x, rounding)`` does, in float32 arithmetic (float64 for a float64 x), one IEEE
operation at a time:

1. y = x * scale, at most the arithmetic's largest finite number in magnitude for a finite x
   (a product that overflows saturates, as Transformer Engine's satfinite cast saturates it);
   element = y rounded onto the saturating element format by ``rounding``; the result is
   element * scale_inverse, in x's dtype (rounded to nearest where x is bfloat16 or float16).
   A finite x thus never gives Inf; an infinite x gives what the element format makes of Inf
   (see Float's ``saturate``): +-elem_max for E4M3, as Transformer Engine's satfinite cast,
   which takes +-Inf to +-elem_max in every FP8 format, but +-Inf for E5M2, where Transformer
   Engine decodes it to +-57344 * scale_inverse. The gradient passes straight through.
2. When recording (the default in training mode): amax = max |x| over x's elements that are not
   NaN (0 if there are none), as Transformer Engine's fmaxf from 0 takes it, is pushed onto the
   history (the oldest entry drops out; under torch.distributed, the ranks' largest amax: see
   below), and the scale is recomputed from the history:
   a = the largest entry ("max", NaN entries ignored) or the newest ("most_recent");
   if a is finite and positive, scale = (elem_max * 2^-margin) / a, at most float32's largest
   finite number (an amax so small that the quotient overflows) and at least 2^-128 + 2^-149,
   the smallest float32 number whose reciprocal is finite (a margin that takes the quotient of a
   large amax below it), and scale_inverse = 1 / scale, else both stay as they were. The
   numerator elem_max * 2^-margin is a float32 number, as Transformer Engine's scaled_max, where
   that is a normal one; an element format whose range reaches beyond float32's (Float(8, 24)
   and wider, or tiny ones, for float64 tensors) takes the quotient from the float64 numerator,
   rounded to float32 once.
   The history is float32: a float64 x's amax enters it rounded to nearest, a positive one below
   float32's smallest subnormal as 2^-149 (its scale is float32's largest either way), and one
   beyond float32's range (finite, above 3.4e38) raises ValueError before the state changes.

So the scale a call uses comes from the calls before it: the first call uses scale 1. This is
Transformer Engine's amax_and_scale_update (history rolled, max or most-recent reduction,
``fp8_max * 2^-margin / amax``, the scale kept for a zero or non-finite amax, NaN ignored by the
max reduction as CUDA's fmaxf ignores it; an infinite quotient becomes float32's largest finite
number, as in its compute_scale_from_amax; Transformer Engine has no lower bound, and a scale
below 2^-128 gives it an infinite scale_inverse, which decodes a finite tensor to Inf and its
zeros to NaN), with one update per recording call. Transformer Engine updates the forward
tensors' scales at the exit of the outermost fp8_autocast and the gradients' at the end of each
backward pass, which is the same when each tensor is quantised once between two updates (a
micro-batch of gradient accumulation in its own fp8_autocast included). A module called twice
inside one fp8_autocast is quantised there twice with one scale, its larger amax entering the
history once; here each call records, and the second uses the scale the first left.

Whether a call records is the module's training mode (or ``record``); Transformer Engine decides
by grad mode instead. Its casts write every forward's amax into the history's pending entry (the
largest of them), but the forward histories roll and the scales change at fp8_autocast's exit
only where torch.is_grad_enabled(): a forward under torch.no_grad leaves its scales as they were
and its amax goes into the next training step's entry (a validation pass in eval mode too),
while a forward in eval mode with gradients enabled updates them, and so does its backward pass.
Here a training-mode forward under torch.no_grad records as any other call, and nothing records
in eval mode, gradients or not: call ``model.eval()`` around a pass that is to leave the scales
alone.

An amax of 0 (a tensor of zeros, or of NaN only) enters the history as any other amax, as in
Transformer Engine's per-tensor amax_and_scale_update and its JAX quantizers. Its PyTorch modules
update through a fused kernel (fused_amax_and_scale_update_after_reduction, the default unless
NVTE_UNFUSED_FP8_UPDATE=1) that takes an amax of 0 for a tensor not quantised in the step and
leaves that tensor's history unrolled and its scale as it was. Under "max" with history_length > 1
the two differ: after amaxes 64, 1, 1 and a tensor of zeros (history_length 3) the scale here is
448 / 1 = 448, the 64 having left the history, where Transformer Engine's PyTorch keeps
448 / 64 = 7 until the next nonzero amax pushes the 64 out; the histories then hold different
windows ([1, 0, 1] here, [1, 1, 1] there, newest first).

Distributed training: Transformer Engine all-reduces the amaxes (MAX) over the data-parallel group
before they enter the histories (its recipe's ``reduce_amax=True``), so every rank scales with the
same global amax. So does a scaler here, while torch.distributed is initialised with more than one
rank in ``amax_group`` (None: the default group) and ``reduce_amax`` is True (the default): each
recorded amax is all-reduced (MAX) over the group, one collective per recording call (on the
amax's device: NCCL needs the scaler's state on the GPU), which every rank of the group must make
for the same tensors in the same order (it waits for the others), as the ranks of
DistributedDataParallel do. The histories and scales of the ranks are then identical. With
``reduce_amax=False``, or without torch.distributed, each rank records its own amaxes, and so do
the passes that are not part of the run (lpsim.diagnostics.Shadow.compare, lpsim.nn.report's
example pass, which put every history back afterwards), which one rank may run alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch._C._functorch import TransformType

from lpsim import _observation
from lpsim._checks import (
    check_bool,
    check_container,
    check_number,
    check_strided,
    functorch_transforms,
)
from lpsim.formats import Fixed, Float, check_int_field, field_state, short_repr
from lpsim.functional import quantize
from lpsim.rounding import Rounding
from lpsim.scaled import Scaled

__all__ = ["DelayedScaling", "DelayedScaler", "REDUCTIONS"]

REDUCTIONS = ("max", "most_recent")
# The float32 buffers.
# The smallest float32 number whose reciprocal is finite in float32: 2**-128 + 2**-149.
_SMALLEST_INVERTIBLE = math.ldexp(1.0, -128) + math.ldexp(1.0, -149)
_FLOAT32_STATE = (
    "amax_history",
    "scale",
    "scale_inverse",
    "scaled_max",
    "call_scale",
    "call_scale_inverse",
)


@dataclass(frozen=True, repr=False)
class DelayedScaling:
    """Per-tensor scaling from an amax history (see the module docstring).

    Args:
        element: the element format, a Float or Fixed (E4M3 or E5M2 in Transformer Engine); it
            always saturates.
        history_length: amaxes remembered, 1 to 2**20 (Transformer Engine's amax_history_len,
            default 1024).
        reduction: "max" (the largest remembered amax, the default) or "most_recent"
            (Transformer Engine's amax_compute_algo).
        margin: the scale leaves 2**margin of headroom above the reduced amax, a number in
            [0, 64] (default 0).
        reduce_amax: all-reduce (MAX) each recorded amax over ``amax_group`` while
            torch.distributed is initialised (see the module docstring); a bool, default True
            (Transformer Engine's reduce_amax).
        amax_group: the ranks whose amaxes are reduced, a torch.distributed ProcessGroup (the
            data-parallel group, Transformer Engine's fp8_group); None: the default group.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field is out of range.
    """

    element: Float | Fixed
    history_length: int = field(default=1024, kw_only=True)
    reduction: str = field(default="max", kw_only=True)
    margin: float = field(default=0, kw_only=True)
    reduce_amax: bool = field(default=True, kw_only=True)
    amax_group: dist.ProcessGroup | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.element, (Float, Fixed)):
            raise TypeError(
                f"DelayedScaling.element must be a Float or Fixed, got "
                f"{type(self.element).__name__}"
            )
        check_int_field("DelayedScaling", "history_length", self.history_length, 1, 2**20)
        if self.reduction not in REDUCTIONS:
            raise ValueError(
                f"DelayedScaling.reduction must be one of {REDUCTIONS}, got {self.reduction!r}"
            )
        check_number("DelayedScaling.margin", self.margin, 0.0, 64.0)
        if not isinstance(self.reduce_amax, bool):
            raise TypeError(
                f"DelayedScaling.reduce_amax must be a bool, got {type(self.reduce_amax).__name__}"
            )
        if self.amax_group is not None and not (
            dist.is_available() and isinstance(self.amax_group, dist.ProcessGroup)
        ):
            raise TypeError(
                "DelayedScaling.amax_group must be a torch.distributed ProcessGroup or None (the "
                f"default group), got {type(self.amax_group).__name__}"
            )
        if not self.element.max > 0:
            raise ValueError(f"DelayedScaling.element {self.element!r} has no positive value")

    __repr__ = short_repr
    __getstate__ = field_state

    def __deepcopy__(self, memo: dict) -> DelayedScaling:
        """The description itself: it is immutable, and its amax_group (a process group) cannot
        be copied, so a model holding scalers that reduce over one can be (copy.deepcopy)."""
        return self

    def saturating_element(self) -> Float | Fixed:
        """The element format as it is rounded: saturating."""
        return Scaled(self.element, Float(8, 23), "tensor").saturating_element()

    def _misfit(self, container) -> str | None:
        """None: every tensor dtype can be quantised (the work is in float32 or float64, the
        result rounded to the tensor's dtype)."""
        return None

    def scaled_max(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """elem_max * 2**-margin in ``dtype`` (float32 or float64), the numerator of the scale."""
        top = torch.tensor(self.element.max, dtype=dtype)
        return top * torch.tensor(math.pow(2.0, -self.margin), dtype=dtype)

    def scaler(self, device: torch.device | str | None = None) -> DelayedScaler:
        """A new scaler (fresh state: empty history, scale 1) for one tensor, its state on
        ``device`` (None: the CPU). The state is made of ordinary tensors even inside
        torch.inference_mode, whose tensors the training passes after it could not update.

        Raises:
            RuntimeError: called while torch.export traces (a model's first pass through a
                DelayedScaling quantiser makes its scaler): a scaler made there is no state of the
                exported program, whose calls would then quantise with the trace's scale and never
                record. Run the model once (a forward pass makes every scaler of its quantisers)
                before exporting it."""
        if torch.compiler.is_exporting():
            raise RuntimeError(
                "a DelayedScaler is being made while torch.export traces the model: it would be "
                "no state of the exported program, which would quantise with the trace's scale "
                "and record nothing. Run the model once (a forward pass) before exporting it, so "
                "that every scaler exists"
            )
        with torch.inference_mode(False):
            scaler = DelayedScaler(self)
            return scaler if device is None else scaler.to(device)


class _StraightThrough(torch.autograd.Function):
    """``value`` forward (computed without autograd), the identity gradient backward."""

    @staticmethod
    def forward(ctx, x, value):
        # Not ``value`` itself: a custom Function's input returned as is becomes a view, on which
        # torch refuses in-place ops (an inplace ReLU after the quantiser). value is new, so its
        # alias (no view) is the scaler's own result.
        return value.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _float32_amax(amax: torch.Tensor) -> torch.Tensor:
    """amax (0-d, >= 0) as the float32 history holds it: rounded to nearest, except that a
    positive float64 amax below float32's smallest subnormal is that subnormal, 2**-149, so that it
    gives the scale its value gives (float32's largest), not the kept scale of a zero amax."""
    rounded = amax.float()
    return torch.where((amax > 0) & (rounded == 0), math.ldexp(1.0, -149), rounded)


def _check_recordable(amax: torch.Tensor) -> None:
    """Raise where a float64 x's finite amax lies beyond float32's range, which the history cannot
    hold: rounded to Inf, it would keep the scale as an Inf does, and under "max" for as long as
    the history remembers it, so that every such value saturated silently."""
    largest = torch.finfo(torch.float32).max
    if bool(amax.isfinite()) and float(amax) > largest:
        raise ValueError(
            f"x's largest finite magnitude, {float(amax):.6g}, lies beyond float32's range "
            f"(at most {largest:.6g}), which a DelayedScaler's amax history holds (float32, as "
            "Transformer Engine's): it would enter it as Inf and keep the scale unchanged. Scale "
            "the float64 tensor into float32's range first"
        )


def _largest_unsaturated(start: torch.Tensor, limit: float, scale: torch.Tensor) -> float:
    """The largest value of start's dtype, at least ``start`` (a 0-d tensor >= 0), whose product
    with ``scale`` (a 0-d tensor > 0 in the call's arithmetic), rounded there as a call rounds it,
    is at most the element value ``limit`` >= 0. The products grow with the value, and
    limit / scale, rounded into start's dtype, lies within a step or two of the answer: the search
    starts there, not at start, which in float64 can lie 2**28 steps below it (scale_inverse is
    float32's 1 / scale, a float32 rounding away from float64's)."""
    up = torch.tensor(math.inf, dtype=start.dtype)
    down = torch.tensor(-math.inf, dtype=start.dtype)
    bound = torch.tensor(limit, dtype=scale.dtype)
    largest = torch.finfo(start.dtype).max

    def within(value: torch.Tensor) -> bool:
        return bool(value.isfinite()) and not bool(value.to(scale.dtype) * scale > bound)

    divisor = float(scale)  # 0 where elem_max * 2**-margin / amax underflowed float32
    guess = largest if divisor == 0 else min(limit / divisor, largest)
    x = torch.tensor(guess, dtype=torch.float64).to(start.dtype)
    while x > 0 and not within(x):
        x = torch.nextafter(x, down)
    while True:
        step = torch.nextafter(x, up)
        if not within(step):
            break
        x = step
    return float(torch.maximum(x, start))


class DelayedScaler(nn.Module):
    """The state of delayed scaling for one tensor, and the quantisation that uses it.

    Buffers (float32, in the module's ``state_dict``; ``.to(device)`` moves them, and they stay
    float32 when the module, or a model holding it, is converted to another dtype: ``.to(dtype)``,
    ``.half()``, ``.bfloat16()``, ``.double()``):
        amax_history: the last ``history_length`` amaxes, newest first (zeros before any call).
        scale: what x is multiplied by before rounding (1 before the first recorded call).
        scale_inverse: 1 / scale, what the rounded elements are multiplied by.
        calls: how many calls have been recorded (a 0-d int64).
        scaled_max: elem_max * 2^-margin (``DelayedScaling.scaled_max()``), the numerator the
            scale is computed with. Loading a state saved with another one raises RuntimeError:
            its scale was made for another element range (an E5M2 scale, 57344 / amax, would
            clamp an E4M3 tensor at amax / 128 in the next call). A state_dict saved without it
            loads as before.

    And one that is not in the ``state_dict``:
        call_scale, call_scale_inverse: the scale and scale_inverse the latest call used (before
            it recorded), whose range ``statistics_bounds`` gives.
    """

    def __init__(self, scaling: DelayedScaling):
        super().__init__()
        if not isinstance(scaling, DelayedScaling):
            raise TypeError(f"scaling must be a DelayedScaling, got {type(scaling).__name__}")
        self.scaling = scaling
        self._element = scaling.saturating_element()
        self.register_buffer("amax_history", torch.zeros(scaling.history_length))
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("scale_inverse", torch.ones(()))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scaled_max", scaling.scaled_max())
        self.register_buffer("call_scale", torch.ones(()), persistent=False)
        self.register_buffer("call_scale_inverse", torch.ones(()), persistent=False)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        """nn.Module's, where the state was saved with this scaler's elem_max * 2^-margin (a
        state_dict saved before it was kept has none and loads as it did). Another one is an
        error that load_state_dict raises (torch's RuntimeError, as for a history of another
        length), and this scaler's state is left as it is."""
        key, own = prefix + "scaled_max", float(self.scaling.scaled_max())
        saved = state_dict.get(key)
        if saved is None:
            if any(prefix + name in state_dict for name in ("amax_history", "scale", "calls")):
                state_dict[key] = self.scaled_max  # saved before it was kept
        elif not (
            isinstance(saved, torch.Tensor)
            and saved.shape == ()
            and (saved.is_meta or float(saved) == own)
        ):
            error_msgs.append(
                f"{key}: a DelayedScaler state saved with elem_max * 2^-margin = {saved!r} cannot "
                f"be loaded into a scaler of {self.scaling!r}, whose elem_max * 2^-margin is "
                f"{own!r}: its scale was computed for the other element range. Load it where the "
                "checkpoint's DelayedScaling is used, or take the scaler's keys out of the "
                "state_dict (and load it with strict=False) to keep this scaler's state"
            )
            return
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def forward(
        self,
        x: torch.Tensor,
        rounding: Rounding | str = "nearest",
        *,
        rbits: int | None = None,
        seed: int | None = None,
        record: bool | None = None,
    ) -> torch.Tensor:
        """x quantised with the current scale (straight-through gradient); then, when
        ``record`` (default: the module's training mode), x's amax enters the history and the
        scale is updated.

        Args:
            x: a float32, float64, bfloat16 or float16 tensor on the buffers' device.
            rounding, rbits, seed: as lpsim.quantize, for the elements.
            record: whether this call updates the state (None: ``self.training``).

        Raises:
            TypeError, ValueError: as lpsim.quantize; x on another device than the buffers;
                record is neither None nor a bool; recording a float64 x whose largest finite
                magnitude exceeds float32's range (the history is float32; nothing changes).
            RuntimeError: under torch.func's grad, jacrev, jacfwd, hessian or vmap, which do
                not allow the writes to the state (in eval mode too: the call's scale is kept);
                torch.func.vjp and jvp are allowed.
        """
        check_container(x)
        check_strided(x, "x", "DelayedScaler")
        refused = (TransformType.Grad, TransformType.Vmap)
        if any(transform in refused for transform in functorch_transforms()):
            raise RuntimeError(
                "a DelayedScaler writes its state (the scale it used, the amax history) at every "
                "call, which torch.func's grad, jacrev, jacfwd, hessian and vmap do not allow: "
                "compute gradients with backward(), torch.autograd.grad or torch.func.vjp (jvp "
                "is allowed too)"
            )
        if record is not None:  # a truthy "no" would record
            check_bool("record", record)
        if x.device != self.scale.device:
            raise ValueError(
                f"x is on {x.device} but the scaler's state is on {self.scale.device}; move the "
                "module holding it with .to()"
            )
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        with torch.no_grad():
            wide = x.detach().to(work)
            # A finite x whose product overflows the arithmetic saturates as its exact product
            # would (Transformer Engine's satfinite cast); an infinite x is left to the element
            # format.
            largest = torch.finfo(work).max
            scaled = (wide * self.scale.to(work)).clamp(-largest, largest)
            scaled = torch.where(wide.isinf(), wide, scaled)
            elements = quantize(scaled, self._element, rounding, rbits=rbits, seed=seed)
            value = (elements * self.scale_inverse.to(work)).to(x.dtype)
            recording = self.training if record is None else record
            if recording:
                # fmaxf from 0, as Transformer Engine takes a tensor's amax: NaN is skipped.
                magnitudes = wide.abs().masked_fill(wide.isnan(), 0.0)
                amax = magnitudes.amax() if wide.numel() else wide.new_zeros(())
                recorded = self._across_ranks(_float32_amax(amax))
                if work == torch.float64:  # after the collective, which every rank makes
                    _check_recordable(amax)
            self.call_scale.copy_(self.scale)
            self.call_scale_inverse.copy_(self.scale_inverse)
            if recording:
                self._record(recorded)
        return _StraightThrough.apply(x, value)

    def statistics_bounds(self, dtype: torch.dtype) -> tuple[float, float, float]:
        """(low, high, smallest_normal) of the latest call's rounding of a ``dtype`` tensor, for
        lpsim.statistics: what the element format's most negative and largest values, and its
        smallest normal value (0 for a Fixed element), decode to with that call's scale, times
        ``call_scale_inverse`` in the call's arithmetic and rounded into ``dtype`` as the call
        decodes its elements; and beyond them, the largest values that the call's scale did not
        take past the element format's limits (x * call_scale, rounded in the arithmetic, within
        them), since 1 / scale_inverse is not exactly the scale. A finite x outside [low, high]
        saturated."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        element = self.scaling.element
        if isinstance(element, Float):
            limits = (-element.max, element.max, element.smallest_normal)
        else:
            limits = (element.min, element.max, 0.0)
        factor = self.call_scale_inverse.cpu().to(work)
        decoded = (torch.tensor(limits, dtype=work) * factor).to(dtype)
        scale = self.call_scale.cpu().to(work)
        high = _largest_unsaturated(decoded[1], limits[1], scale)
        low = -_largest_unsaturated(-decoded[0], -limits[0], scale)
        return low, high, float(decoded[2])

    def _across_ranks(self, amax: torch.Tensor) -> torch.Tensor:
        """The largest of the ranks' amaxes (see the module docstring), or amax itself where
        nothing is reduced."""
        scaling = self.scaling
        if not (scaling.reduce_amax and dist.is_available() and dist.is_initialized()):
            return amax
        if _observation.hidden:  # a pass outside the run, perhaps on this rank alone
            return amax
        if dist.get_world_size(scaling.amax_group) == 1:
            return amax
        amax = amax.reshape(1).clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=scaling.amax_group)
        return amax[0]

    def _record(self, amax: torch.Tensor) -> None:
        history = self.amax_history
        history.copy_(torch.cat([amax.float().reshape(1), history[:-1]]))
        if self.scaling.reduction == "max":
            reduced = torch.where(history.isnan(), 0.0, history).amax()
        else:
            reduced = history[0]
        usable = torch.isfinite(reduced) & (reduced > 0)
        # An amax below elem_max / 2**128 overflows the quotient; an infinite scale would turn
        # zeros into NaN (0 * Inf) and every other element into 0 (scale_inverse 0). A quotient
        # at or below 2**-128 (a margin on a large amax) would give an infinite scale_inverse,
        # and the same NaN and Inf in the decoded values. The numerator is Transformer Engine's
        # float32 scaled_max where that is a normal float32 number; beyond float32's range (an
        # element format wider than float32's, for float64 tensors) it would be Inf or 0, and the
        # float64 quotient is rounded to float32 once instead.
        info = torch.finfo(torch.float32)
        narrow = self.scaling.scaled_max()
        wide = self.scaling.scaled_max(torch.float64) / reduced.double()
        normal = (narrow >= info.tiny) & (narrow <= info.max)
        quotient = torch.where(normal, narrow / reduced, wide.float())
        quotient = quotient.clamp(_SMALLEST_INVERTIBLE, info.max)
        scale = torch.where(usable, quotient, self.scale)
        self.scale_inverse.copy_(torch.where(usable, 1 / scale, self.scale_inverse))
        self.scale.copy_(scale)
        self.calls.add_(1)

    def _apply(self, fn, *args, **kwargs):
        """nn.Module._apply (what .to(), .cuda(), .half(), ... call), with the floating-point
        buffers kept float32: where ``fn`` gives one another dtype, the buffer becomes its
        unconverted value on the device ``fn`` moved it to, so no value is ever rounded."""
        kept = {name: self._buffers[name] for name in _FLOAT32_STATE}
        super()._apply(fn, *args, **kwargs)
        for name, before in kept.items():
            after = self._buffers[name]
            if after is not None and after.dtype != torch.float32:
                self._buffers[name] = before.to(after.device)
        return self

    def extra_repr(self) -> str:
        return repr(self.scaling)
