"""Differentiable quantisers: quantise a tensor in the forward pass and its gradient in the backward
pass, each with its own format and rounding rule.

A *spec* says how to quantise: a format (Float, Fixed, P3109, BlockFloat, Scaled) or a
DelayedScaling, or a (format, rounding) pair whose rounding overrides the default. None means
"leave as is". A DelayedScaling keeps state per tensor: the Quantizer module and inject() give each
quantised tensor its own DelayedScaler (see ``bind``; inject's inputs, outputs and errors have one
per tensor and place, made at its first quantisation), which is in the model's state_dict.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.autograd.forward_ad as forward_ad
from torch import nn

from lpsim import _observation
from lpsim._checks import check_container, signature_kept, under_torch_func
from lpsim.delayed_scaling import DelayedScaler, DelayedScaling
from lpsim.formats import (
    GRID_FORMATS,
    P3109,
    BlockFloat,
    Fixed,
    Float,
    Format,
    fitting_container,
)
from lpsim.functional import quantize
from lpsim.rounding import Rounding
from lpsim.scaled import Scaled

__all__ = [
    "Spec",
    "QuantSpec",
    "as_spec",
    "quantizer",
    "Quantizer",
    "eval_spec",
    "parse_eval_rounding",
    "ScalerCall",
    "bind",
    "quantizing_function",
    "in_layout_of",
]

Spec = Format | Scaled | DelayedScaling | tuple | None
_SPEC_FORMATS = (*GRID_FORMATS, BlockFloat, Scaled, DelayedScaling)


class QuantSpec(NamedTuple):
    """A format and the rule that rounds into it."""

    format: Format | Scaled | DelayedScaling
    rounding: Rounding

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x quantised (differentiable, straight-through).

        Raises:
            TypeError: the format is a DelayedScaling, which needs a state (``bind``).
        """
        if isinstance(self.format, DelayedScaling):
            raise TypeError(
                "a DelayedScaling spec keeps state per tensor: quantise through bind(spec) or "
                "format.scaler(), not the spec itself"
            )
        return quantize(x, self.format, self.rounding)

    def __str__(self) -> str:
        return f"{self.format!r} {self.rounding.name}"

    def for_eval(self, eval_rounding: Rounding | None) -> QuantSpec:
        """The spec an evaluating module uses: a stochastic rule replaced by ``eval_rounding``
        (None keeps it); deterministic rules are kept."""
        if eval_rounding is None or not self.rounding.is_stochastic:
            return self
        return QuantSpec(self.format, eval_rounding)


def eval_spec(spec: QuantSpec | None, eval_rounding: Rounding | None) -> QuantSpec | None:
    """spec.for_eval(eval_rounding), None for None."""
    return None if spec is None else spec.for_eval(eval_rounding)


def parse_eval_rounding(value: Rounding | str | None) -> Rounding | None:
    """The rule that replaces stochastic rules in eval mode (None: keep them).

    Raises:
        ValueError: value names a stochastic rule (evaluation would draw random words again).
    """
    if value is None:
        return None
    rule = Rounding.parse(value, "eval_rounding")
    if rule.is_stochastic:
        raise ValueError(f"eval_rounding must be a deterministic rule or None, got {rule.name!r}")
    return rule


def as_spec(
    value: Spec, rounding: Rounding | str, name: str, *, functions: bool = False
) -> QuantSpec | None:
    """The QuantSpec that ``value`` describes (None for None), ``rounding`` applying when value is
    a bare format. ``functions``: whether the caller also takes a function tensor -> tensor (which
    it handles itself); the error then lists it.

    Raises:
        TypeError: value is neither None, a format, nor a (format, rounding) pair; the message
            names the argument and every accepted kind.
    """
    if value is None:
        return None
    if isinstance(value, _SPEC_FORMATS):
        return QuantSpec(value, Rounding.parse(rounding))
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], _SPEC_FORMATS):
        # A QuantSpec too (its format checked, a rule's name parsed). A malformed rule is named
        # by the argument that holds it ("momentum rounding").
        return QuantSpec(value[0], Rounding.parse(value[1], f"{name} rounding"))
    kinds = ["None", "a Float, Fixed, P3109, BlockFloat, Scaled or DelayedScaling format"]
    kinds += ["a (format, rounding) pair"] + (["a function tensor -> tensor"] if functions else [])
    raise TypeError(f"{name} must be {', '.join(kinds[:-1])} or {kinds[-1]}; got {value!r}")


class ScalerCall(NamedTuple):
    """A DelayedScaler applied with a rule: ``scaler(x, rounding, record=record)``.
    ``forward_tensor``: whether x is a tensor of a forward pass (not an error, nor an optimizer's
    tensor).

    Raises:
        RuntimeError: a recording call for a forward tensor runs inside a backward pass. That is
            a forward recomputed by activation checkpointing (torch.utils.checkpoint), which
            would record the tensor's amax a second time and quantise with the scale the first
            pass left: other activations and gradients than the forward's.
    """

    scaler: DelayedScaler
    rounding: Rounding
    record: bool
    forward_tensor: bool = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.record and self.forward_tensor and _observation.recomputing():
            raise RuntimeError(
                "DelayedScaling under activation checkpointing (a forward recomputed during the "
                "backward pass) is not supported: the recomputation would record every amax "
                "again and quantise with the scales the first pass left, giving other "
                "activations and gradients than the forward's; checkpoint no module whose "
                "tensors DelayedScaling quantises"
            )
        return self.scaler(x, self.rounding, record=self.record)

    def __str__(self) -> str:
        return f"{self.scaler.scaling!r} {self.rounding.name}"


def bind(spec: QuantSpec | None, eval_rounding: Rounding | None):
    """(train, eval, scaler): the functions that quantise one tensor by ``spec`` in training and
    in eval mode, and the state they share. For a DelayedScaling spec, a new DelayedScaler: the
    training function records every call, the eval function none, and uses ``eval_rounding`` in
    place of a stochastic rule (see QuantSpec.for_eval). For other specs, (spec,
    spec.for_eval(eval_rounding), None); for None, (None, None, None). The owner of the scaler
    registers it as a submodule, so that its state follows the model (state_dict, .to())."""
    if spec is None:
        return None, None, None
    evaluated = spec.for_eval(eval_rounding)
    if not isinstance(spec.format, DelayedScaling):
        return spec, evaluated, None
    scaler = spec.format.scaler()
    return (
        ScalerCall(scaler, spec.rounding, True),
        ScalerCall(scaler, evaluated.rounding, False),
        scaler,
    )


def clip_range(fmt: Format) -> tuple[float, float]:
    """The interval outside which quantising into fmt clips: [min, max] of a clamping Fixed
    format, [-max, max] of a saturating Float, [min, max] of a P3109 format under SatFinite or
    SatPropagate (min is 0 in an unsigned format).

    Raises:
        ValueError: the format does not clip (Fixed without clamp, non-saturating Float, P3109
            under SatNone, BlockFloat).
    """
    if isinstance(fmt, Fixed) and fmt.clamp:
        return fmt.min, fmt.max
    if isinstance(fmt, Float) and fmt.saturate:
        return -fmt.max, fmt.max
    if isinstance(fmt, P3109) and fmt.saturation != "SatNone":
        return fmt.min, fmt.max
    raise ValueError(
        "clamp_grad_zero needs a forward format that clips: a Fixed format with clamp=True, a "
        "Float with saturate=True or a P3109 with saturation SatFinite or SatPropagate, got "
        f"{fmt!r}"
    )


def unclipped(fmt: Fixed | Float | P3109) -> Fixed | Float:
    """A format that rounds every value exactly as ``fmt`` does, but does not clip in the binade
    above fmt's range: fmt without clamp (Fixed), or fmt with one more exponent bit, the same bias
    and IEEE Inf (Float; for a P3109 format, the Float of its precision, exponent field and bias,
    signed, with one more exponent bit). Rounding into it and then clipping gives what rounding
    into fmt gives.

    Raises:
        ValueError: fmt does not clip (see clip_range), it is a Float whose widened exponent fits
            no container (more than 9 exponent bits with the default bias), or a P3109 format of
            precision 1 (its ties go to the even exponent code, a Float's to the larger value).
    """
    clip_range(fmt)
    if isinstance(fmt, Fixed):
        return dataclasses.replace(fmt, clamp=False)
    if isinstance(fmt, P3109):
        if fmt.precision == 1:
            raise ValueError(
                f"clamp_grad_zero: {fmt!r} has precision 1, whose ties round to the even exponent "
                "code; no wider format of lpsim rounds alike, so where rounding clips cannot be "
                "seen"
            )
        # The exponent field: bits - precision, and the sign bit's place in unsigned formats.
        exp, man = fmt.bits - fmt.precision + (0 if fmt.signed else 1), fmt.precision - 1
        subnormals = True
    else:
        exp, man, subnormals = fmt.exp, fmt.man, fmt.subnormals
    try:
        return Float(exp + 1, man, bias=fmt.bias, subnormals=subnormals)
    except ValueError:
        raise ValueError(
            f"clamp_grad_zero: {fmt!r} leaves no room above its range in a float64 container, so "
            "where rounding overflows cannot be seen"
        ) from None


def quantize_with_clip_mask(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(spec(x), clipped): x rounded by spec into a clipping format (see clip_range), and
    the boolean mask of the elements whose rounded value lay outside the format's range and was
    clipped to its limit.

    The mask is decided on the rounded value, as QPyTorch's kernels decide it: with Fixed(4, 3)
    and nearest, 0.9 rounds to 0.875 = max and is not clipped, 0.95 rounds to 1.0 and is. x is
    rounded once, into unclipped(spec.format) in a container that holds it, and then clipped, so
    the result is bit for bit spec(x) for every rule, and a stochastic rule's mask comes from the
    same random decisions as its values (the same draw from torch's generator as spec(x) makes).
    NaN is never clipped, nor is +/-Inf in a format that keeps it (a saturating IEEE Float; a
    P3109 format with Inf under SatPropagate, -Inf only if signed); in other formats +/-Inf is
    clipped to the limits. A negative value in an unsigned P3109 format is clipped to 0 unless it
    rounds to zero.

    Raises:
        ValueError: as unclipped().
    """
    fmt = spec.format
    wide = unclipped(fmt)
    low, high = clip_range(fmt)
    rounded = quantize(x.detach().to(fitting_container(wide, x.dtype)), wide, spec.rounding)
    clipped = (rounded > high) | (rounded < low)
    infinite = rounded.isinf() & ~x.isfinite()  # an Inf input
    if isinstance(fmt, Float) and fmt.has_inf:
        clipped &= ~infinite
    if isinstance(fmt, P3109) and fmt.has_inf and fmt.saturation == "SatPropagate":
        clipped &= ~(infinite & ((rounded > 0) | fmt.signed))  # -Inf only in signed formats
    out = torch.where(clipped, rounded.clamp(low, high), rounded)
    if isinstance(fmt, (Float, P3109)) and not fmt.has_negative_zero:
        out = torch.where(out == 0, 0.0, out)
    return out.to(x.dtype), clipped


def in_layout_of(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """``rounded`` (x quantised: lpsim.quantize gives a contiguous tensor) in x's memory layout,
    as torch's elementwise ops give their results: a channels_last activation, weight or gradient
    stays channels_last, a transposed one transposed (x's strides where x is dense and does not
    overlap itself, else torch.empty_like's choice), so that the modules reading the quantised
    tensor compute as they would on x (a convolution picks its kernel by the layout of its input,
    weight and output gradient, a BatchNorm its order of summation), and code that checks the
    layout finds it. Costs a copy where x is not contiguous; the gradient passes the copy
    unchanged."""
    if x.is_contiguous() or x.layout != torch.strided or rounded.stride() == x.stride():
        return rounded
    return torch.empty_like(x).copy_(rounded)


def _report(observed, category: str, x, rounded, quantiser) -> None:
    """Tell the current observer, if any, that the module ``observed`` names rounded x."""
    observer = _observation.current
    if observer is not None:
        module, training = observed
        observer.observe(module, category, x, rounded, quantiser, training)


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    """x's values, as the result of a custom autograd Function that leaves them unchanged: a copy.

    Not x or a view of x: torch refuses in-place ops on a view that a custom Function returns (an
    inplace ReLU after an error-only quantiser), because the in-place op's gradient would bypass the
    Function's backward. Nor an alias of x's memory (x.detach()): an in-place op on it would change
    x behind autograd's back, and x read again afterwards would carry the new values with the
    gradient of the old. The copy costs a pass over x (about 0.2-0.3 ns per element on one core);
    an in-place op on it changes neither x nor its gradient.
    """
    return x.clone()


@signature_kept
class _Quantize(torch.autograd.Function):
    """y = forward_spec(x), in x's memory layout; dL/dx = backward_spec(hooks(dL/dy)), zero where
    the forward clipped (where the rounded value lay outside the format's range), in the memory
    layout of the gradient it rounds (see in_layout_of; under torch.compile, whose backward gets
    contiguous gradients, contiguous). ``observed`` is None, or the pair
    (module, training mode) under which both roundings are reported to the current observer (as
    "output" and "error"; see lpsim._observation). Without forward_spec, y is a copy of x, which
    in-place ops may modify (see _unchanged).

    forward returns (y, clipped): the clip mask (None without clamp_grad_zero) is an output that
    setup_context saves, so that the Function works under torch.func's transforms (grad, jacrev,
    vmap), which need forward and setup_context apart."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, forward_spec, backward_spec, clamp_grad_zero, hooks, observed):
        if clamp_grad_zero:
            out, clipped = quantize_with_clip_mask(x, forward_spec)
        elif forward_spec is None:
            return _unchanged(x), None
        else:
            out, clipped = forward_spec(x), None
        out = in_layout_of(x, out)
        if observed is not None:
            _report(observed, "output", x, out, forward_spec)
        return out, clipped

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, _, ctx.backward_spec, ctx.masked, ctx.hooks, ctx.observed = inputs
        clipped = output[1]
        if clipped is not None:
            ctx.mark_non_differentiable(clipped)
            ctx.save_for_backward(clipped)
            ctx.save_for_forward(clipped)

    @staticmethod
    def backward(ctx, grad, _):
        for hook in ctx.hooks:
            grad = hook(grad)
        if ctx.backward_spec is not None:
            spec = ctx.backward_spec
            if isinstance(spec, ScalerCall):
                spec = spec._replace(forward_tensor=False)
            rounded = spec(grad)
            if not torch.compiler.is_compiling():  # dynamo gives backward contiguous gradients
                rounded = in_layout_of(grad, rounded)
            if ctx.observed is not None:
                _report(ctx.observed, "error", grad, rounded, ctx.backward_spec)
            grad = rounded
        if ctx.masked:
            (mask,) = ctx.saved_tensors
            grad = grad.masked_fill(mask, 0.0)
        return grad, None, None, None, None, None


class _QuantizeWithTangent(_Quantize):
    """_Quantize with forward mode, used where forward mode can be active (a dual level of
    torch.autograd.forward_ad, or any torch.func transform): dynamo refuses to trace an
    autograd.Function that defines jvp, so a compiled model uses _Quantize itself."""

    @staticmethod
    def jvp(ctx, tangent, *_):
        """Forward mode (torch.func.jvp, jacfwd, forward_ad): the tangent passes, zero where the
        forward clipped, as the gradient does in reverse mode. The backward spec and hooks act on
        the errors of a backward pass, which forward mode has none of: tangents are not rounded.
        """
        if ctx.masked:
            (mask,) = ctx.saved_tensors
            tangent = tangent.masked_fill(mask, 0.0)
        return tangent, None


def quantizer(
    forward: Spec = None,
    backward: Spec = None,
    forward_rounding: Rounding | str = "stochastic",
    backward_rounding: Rounding | str = "stochastic",
    clamp_grad_zero: bool = False,
    backward_hooks: Iterable[Callable[[torch.Tensor], torch.Tensor]] = (),
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A differentiable function that quantises its input in the forward pass (activations) and the
    incoming gradient in the backward pass (errors).

    Args:
        forward: spec of the forward quantisation (None: identity).
        backward: spec of the gradient quantisation (None: the gradient passes unchanged).
        forward_rounding, backward_rounding: rules for specs given as bare formats (default
            "stochastic" for both).
        clamp_grad_zero: zero the gradient where the forward pass clipped: where the rounded
            value lay outside the range of a clamping Fixed format, a saturating Float or a P3109
            format under SatFinite or SatPropagate (precision 2 or more; decided
            on the rounded value, with the forward pass's own random decisions; see
            quantize_with_clip_mask): the straight-through estimator with a clip mask.
        backward_hooks: functions applied in order to the gradient before its quantisation (for
            example loss-scaling).

    The result has x's memory layout, and x's gradient that of the gradient it rounds (a
    channels_last tensor stays channels_last; lpsim.quantize gives a contiguous tensor).

    Random numbers of stochastic rules come from torch's default generator, so torch.manual_seed
    makes forward and backward reproducible. The function has no train/eval mode: the Quantizer
    module and lpsim.nn.inject() switch to deterministic rounding in eval mode.

    Given a forward or a backward format, the function takes a float32, float64, bfloat16 or
    float16 tensor (TypeError otherwise, when it is called: an integer or complex tensor has no
    gradient that a backward format rounds); given neither, it rounds nothing and passes any
    tensor through, its gradient through the backward hooks.

    Raises:
        TypeError: a spec is malformed; clamp_grad_zero is not a bool; a backward hook is not
            callable.
        ValueError: clamp_grad_zero without a clipping forward format.
    """
    forward_rounding = Rounding.parse(forward_rounding, "forward_rounding")  # also without a format
    backward_rounding = Rounding.parse(backward_rounding, "backward_rounding")
    forward_spec = as_spec(forward, forward_rounding, "forward")
    backward_spec = as_spec(backward, backward_rounding, "backward")
    for name, spec in (("forward", forward_spec), ("backward", backward_spec)):
        if spec is not None and isinstance(spec.format, DelayedScaling):
            raise TypeError(
                f"{name}: quantizer() keeps no state, and a DelayedScaling needs one; use the "
                "Quantizer module, which holds its DelayedScaler"
            )
    return quantizing_function(forward_spec, backward_spec, clamp_grad_zero, backward_hooks)


def checked_hooks(backward_hooks) -> tuple:
    """backward_hooks as a tuple of callables.

    Raises:
        TypeError: backward_hooks is not an iterable, or one of its items is not callable.
    """
    try:
        hooks = tuple(backward_hooks)
    except TypeError:
        raise TypeError(
            "backward_hooks must be an iterable of functions tensor -> tensor, got "
            f"{type(backward_hooks).__name__}"
        ) from None
    for i, hook in enumerate(hooks):
        if not callable(hook):
            raise TypeError(f"backward_hooks[{i}] must be callable, got {type(hook).__name__}")
    return hooks


def quantizing_function(forward, backward, clamp_grad_zero=False, backward_hooks=()):
    """quantizer() for functions already made: ``forward`` and ``backward`` are None, a
    QuantSpec or a ScalerCall (clamp_grad_zero needs a QuantSpec forward). The function returned
    takes the tensor and, optionally, ``observed``: None, or the pair (module, training mode)
    under which its roundings are reported to the current observer (lpsim._observation)."""
    if not isinstance(clamp_grad_zero, bool):
        raise TypeError(f"clamp_grad_zero must be a bool, got {type(clamp_grad_zero).__name__}")
    hooks = checked_hooks(backward_hooks)
    if clamp_grad_zero:
        if forward is None:
            raise ValueError("clamp_grad_zero needs a forward format")
        if not isinstance(forward, QuantSpec):
            raise ValueError(
                "clamp_grad_zero needs a forward format that clips, not a DelayedScaling"
            )
        unclipped(forward.format)

    return _QuantizingFunction(forward, backward, clamp_grad_zero, hooks)


@dataclasses.dataclass(frozen=True, eq=False)
class _QuantizingFunction:
    """The function quantizing_function returns. An object, not a closure, so that a module
    holding it can be deep-copied (the copy's function then uses the copy's DelayedScaler, not
    the original's) and pickled (torch.save of a whole model); not a tuple, which specs are.
    Compared and hashed by identity (eq=False): a field-wise __hash__ is what dynamo calls on the
    object while its __init__ is still setting the fields, where a frame that builds one with a
    DelayedScaler's ScalerCall is compiled on its own (after a graph break inside a nested
    output's quantisation), and it raised an internal dynamo error there."""

    forward: QuantSpec | ScalerCall | None
    backward: QuantSpec | ScalerCall | None
    clamp_grad_zero: bool
    hooks: tuple

    @property
    def _forward_only(self) -> bool:
        """Whether the function is a plain format's rounding, its gradient passed unchanged."""
        return (
            isinstance(self.forward, QuantSpec)
            and self.backward is None
            and not self.clamp_grad_zero
            and not self.hooks
        )

    def __call__(self, x: torch.Tensor, observed: tuple | None = None) -> torch.Tensor:
        if self.forward is None and self.backward is not None:
            # The forward format checks x; here x's gradient is what its backward format rounds
            # (an integer x has none, a complex one's would be refused in the backward pass).
            check_container(x)
        if self._forward_only and observed is None:
            # quantize's own straight-through gradient (and tangent) is _Quantize's here, the
            # same bits without a Python autograd.Function (tens of us per call).
            return in_layout_of(x, self.forward(x))
        function = _QuantizeWithTangent if _forward_mode_possible() else _Quantize
        return function.apply(
            x, self.forward, self.backward, self.clamp_grad_zero, self.hooks, observed
        )[0]


def _forward_mode_possible() -> bool:
    """Whether a tangent may reach a quantiser: inside a forward_ad dual level or a torch.func
    transform (torch.func.jvp, jacfwd, hessian), outside torch.compile's tracing."""
    if torch.compiler.is_compiling():
        return False
    return forward_ad._current_level >= 0 or under_torch_func()


# The settings of a Quantizer, each held in the instance's __dict__ under _SETTING_PREFIX + its
# name. Not "_" + name: "_backward_hooks" is nn.Module's own dict of full backward hooks, which
# the tuple of backward_hooks replaced (dynamo failed on every compiled model holding a
# Quantizer, and register_full_backward_hook on one raised).
_SETTINGS = ("forward_spec", "backward_spec", "clamp_grad_zero", "backward_hooks", "eval_rounding")
_SETTING_PREFIX = "_lpsim_"


def _setting(name: str) -> property:
    """A read-only attribute of Quantizer, held in ``_lpsim_<name>``. Assigning it raises: the
    module's quantising functions were built from it and would not change."""

    def read(self):
        return self.__dict__[_SETTING_PREFIX + name]

    def refuse(self, value):
        raise AttributeError(
            f"Quantizer.{name} is fixed when the Quantizer is made (its quantising functions and "
            f"DelayedScalers are built from it); make a new Quantizer(...) with the {name} "
            "wanted"
        )

    return property(read, refuse)


class Quantizer(nn.Module):
    """A module wrapping quantizer(): quantises activations forward and errors backward.

    Arguments as for lpsim.nn.quantizer() (rules "stochastic" by default), and:

    Args:
        eval_rounding: the rule that replaces the stochastic rules while the module is in eval
            mode (``module.eval()``), "nearest" by default, so that evaluation is deterministic and
            draws no random numbers (evaluating never shifts the training stream of torch's
            generator). None keeps the stochastic rules in eval mode too. Deterministic rules
            are the same in both modes.

    While a lpsim.diagnostics.recorder.Recorder observes its model, the module's forward
    rounding is recorded as its "output" and its backward rounding as its "error".

    The settings are read-only attributes (``forward_spec``, ``backward_spec``,
    ``clamp_grad_zero``, ``backward_hooks``, ``eval_rounding``): the quantising functions and the
    DelayedScalers are built from them when the module is made, so assigning one raises
    AttributeError instead of leaving the module rounding as before; make a new Quantizer.
    """

    def __init__(
        self,
        forward: Spec = None,
        backward: Spec = None,
        forward_rounding: Rounding | str = "stochastic",
        backward_rounding: Rounding | str = "stochastic",
        clamp_grad_zero: bool = False,
        backward_hooks: Iterable[Callable[[torch.Tensor], torch.Tensor]] = (),
        eval_rounding: Rounding | str | None = "nearest",
    ):
        super().__init__()
        settings = self.__dict__
        forward_rounding = Rounding.parse(forward_rounding, "forward_rounding")  # also unused
        backward_rounding = Rounding.parse(backward_rounding, "backward_rounding")
        settings[_SETTING_PREFIX + "forward_spec"] = as_spec(forward, forward_rounding, "forward")
        settings[_SETTING_PREFIX + "backward_spec"] = as_spec(
            backward, backward_rounding, "backward"
        )
        settings[_SETTING_PREFIX + "clamp_grad_zero"] = clamp_grad_zero
        settings[_SETTING_PREFIX + "backward_hooks"] = checked_hooks(backward_hooks)
        settings[_SETTING_PREFIX + "eval_rounding"] = parse_eval_rounding(eval_rounding)
        forward_train, forward_eval, self.forward_scaler = bind(
            self.forward_spec, self.eval_rounding
        )
        backward_train, backward_eval, self.backward_scaler = bind(
            self.backward_spec, self.eval_rounding
        )
        self._apply_train = quantizing_function(
            forward_train, backward_train, clamp_grad_zero, self.backward_hooks
        )
        self._apply_eval = quantizing_function(
            forward_eval, backward_eval, clamp_grad_zero, self.backward_hooks
        )

    forward_spec = _setting("forward_spec")
    backward_spec = _setting("backward_spec")
    clamp_grad_zero = _setting("clamp_grad_zero")
    backward_hooks = _setting("backward_hooks")
    eval_rounding = _setting("eval_rounding")

    def __setstate__(self, state: dict) -> None:
        """Unpickling (torch.load of a whole model). A Quantizer pickled when its settings were
        held in "_<name>" gets them moved to their names now, and nn.Module's own dict of full
        backward hooks, which its backward_hooks tuple had replaced, back."""
        state = dict(state)
        if not any(_SETTING_PREFIX + name in state for name in _SETTINGS):
            for name in _SETTINGS:
                if "_" + name in state:
                    state[_SETTING_PREFIX + name] = state.pop("_" + name)
            if not isinstance(state.get("_backward_hooks"), dict):
                state["_backward_hooks"] = OrderedDict()
        super().__setstate__(state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_for(self, x)

    def apply_for(self, owner: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """forward(x), its roundings reported to an attached Recorder as those of ``owner``, in
        owner's training mode (forward reports them as the Quantizer's own). For a Quantizer that
        is no submodule of the model it serves, such as those lpsim.compat.qtorch's lower() puts
        on a module's output."""
        apply = self._apply_train if self.training else self._apply_eval
        if _observation.current is None:
            return apply(x)
        return apply(x, (owner, owner.training))

    def extra_repr(self) -> str:
        parts = [
            f"forward={self.forward_spec or 'None'}",
            f"backward={self.backward_spec or 'None'}",
        ]
        if self.clamp_grad_zero:
            parts.append("clamp_grad_zero=True")
        if self.backward_hooks:
            parts.append(f"backward_hooks={len(self.backward_hooks)}")
        if any(
            s is not None and s.rounding.is_stochastic
            for s in (self.forward_spec, self.backward_spec)
        ):  # where eval mode rounds otherwise, or keeps the stochastic rules (None)
            rule = "None" if self.eval_rounding is None else self.eval_rounding.name
            parts.append(f"eval_rounding={rule}")
        return ", ".join(parts)
