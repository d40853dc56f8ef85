"""Injection of quantisers into an existing model, without editing its code.

    config = {
        "conv1": None,                      # keep the first convolution in full precision
        "fc": None,                         # and the last linear layer
        nn.Conv2d: LayerQuantization(weight=e5m2, output=e5m2, error=e5m2),
        "layer4.*": LayerQuantization(output=(e4m3, "nearest")),
        lambda name, m: isinstance(m, nn.BatchNorm2d): LayerQuantization(output=bf16),
        "default": LayerQuantization(output=bf16, error=bf16),
    }
    lpsim.nn.inject(model, config)
    print(lpsim.nn.report(model))
    lpsim.nn.remove(model)                  # back to the original model exactly

Selectors are module types (subclasses match), glob patterns on qualified module names
("features.*", "classifier.2"; the model itself is named ""; a module shared between two parents
is matched under each of its names), callables (name, module) -> bool (called with each name), or
tuples of these (any matches). Every module of the model, the model itself included, is decided by
the first matching entry in the mapping's order; its value is a LayerQuantization, or None to leave
the module as it is. The entry keyed "default" applies to leaf modules (modules without children)
that no other entry matched. lpsim's own state (the DelayedScaler of an lpsim.nn.Quantizer in the
model) is no module to select and makes no module a container.

A selector that decides no module (it matches nothing, or only modules an earlier entry already
decided) is almost always a mistake (a misspelled name, a layer the model does not have), so it is
an error unless ``unmatched="warn"`` or ``"ignore"`` is given. The "default" entry is exempt: it is
a fallback, and a model whose leaves all have entries of their own leaves it nothing.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import sys
import threading
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize, prune
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from lpsim import _observation
from lpsim._checks import check_bool, check_container, under_torch_func
from lpsim.delayed_scaling import DelayedScaler, DelayedScaling
from lpsim.functional import quantize_op_arguments
from lpsim.mac import MAC
from lpsim.nn import functional as _functional
from lpsim.nn._hooks import (
    compiled_model,
    guard_hooks_under_compile,
    map_placed_tensors,
    map_tensors,
)
from lpsim.nn.functional import OperandSpecs
from lpsim.nn.quantizer import (
    QuantSpec,
    ScalerCall,
    Spec,
    as_spec,
    bind,
    eval_spec,
    in_layout_of,
    parse_eval_rounding,
    quantizing_function,
)
from lpsim.nn.selectors import check_selector, module_names, selector_name, selects
from lpsim.rounding import Rounding

__all__ = [
    "LayerQuantization",
    "inject",
    "remove",
    "report",
    "injected",
    "quantized_parameters",
    "DEFAULT",
]

DEFAULT = "default"
_STATE = "_lpsim_injection"  # attribute holding what inject() did to a module
_SCALERS = "lpsim_scalers"  # submodule holding the DelayedScalers of inputs, outputs and errors
_UNMATCHED = ("error", "warn", "ignore")

# Children whose forward() their parent never calls: the parent reads their parameters directly,
# so their weight quantisers run but their input, output and error quantisers never do. Their MACs
# run only in a parent that simulates its products (a MultiheadAttention given MACs uses
# out_proj's MACs for its out projection).
_FORWARD_BYPASSED = {nn.MultiheadAttention: ("out_proj",)}
_FAST_PATH = "_lpsim_fast_path"  # attribute holding how inject() kept a torch fast path off


@dataclass(frozen=True)
class LayerQuantization:
    """What to quantise in one layer. Each field is None (not quantised), a format, or a
    (format, rounding) pair; bare formats use ``rounding``.

    Args:
        weight: the module's own parameters whose names end in "weight" (weight, in_proj_weight,
            ...), in a recurrent layer (nn.RNN, nn.LSTM, nn.GRU) those whose names start with
            "weight_" (weight_ih_l0, weight_hh_l0, ...), and in a recurrent cell (nn.RNNCell,
            nn.LSTMCell, nn.GRUCell) weight_ih and weight_hh, fake-quantised in every forward
            pass by a parametrisation (straight-through gradient): once per call of the module's
            forward, at the first read (a forward that reads a weight several times gets one
            quantisation), and at each read outside it. Each read gives a new tensor: an in-place
            write to it (reset_parameters(), nn.init) is lost; write to
            ``parametrizations.<name>.original``. One that already has torch
            parametrisations (weight_norm, orthogonal, ...) is quantised after them, which are
            computed with it, once per call (spectral_norm's power iteration steps once per call,
            as under torch's parametrize.cached()), and remove() leaves them (one registered
            after inject would change the rounded tensor: reading it raises); inject refuses
            (NotImplementedError) one computed by a forward pre-hook of the older
            torch.nn.utils.weight_norm or spectral_norm, or of torch.nn.utils.prune. An Embedding or
            EmbeddingBag with max_norm renormalises the rows of the weight it reads in place, as
            torch's does (its Parameter's; the tensor its parametrisations compute where it has
            some), before they are quantised, and looks them up quantised.
        bias: the module's own parameters whose names end in "bias" (in a recurrent layer, start
            with "bias_": bias_ih_l0, ...; in a recurrent cell, bias_ih and bias_hh; in a
            MultiheadAttention, bias_k and bias_v too), likewise.
        input: the floating-point tensors passed to forward (positional and keyword), forward only.
            A tensor passed at several places (self-attention's ``attention(x, x, x)``) is
            quantised once, at its first place, and every place gets that one result. Masks are
            no inputs: an argument of a forward parameter whose name ends in "mask"
            (MultiheadAttention's attn_mask and key_padding_mask, a TransformerEncoderLayer's
            src_mask, HuggingFace's attention_mask), a float mask with -inf or an additive bias,
            passes as it is.
        output: the floating-point tensors forward returns (nested tuples, lists and dicts too,
            each rebuilt with its own type: a named tuple, an OrderedDict, a ModelOutput). A
            tensor returned at several places is quantised once, every place getting that result.
        error: the gradient flowing back into those outputs (the layer's error), in backward;
            that of a tensor returned at several places, the sum of their gradients, once.
            With a DelayedScaling, each input, output and error tensor has a DelayedScaler of
            its own, named after its place (see _TensorScalers). Integer and bool tensors pass
            as they are; a complex tensor where input, output or error is set raises a
            TypeError in the forward pass (lpsim's formats round real tensors).
        rounding: the rule for fields given as bare formats (default "stochastic").
        eval_rounding: the rule that replaces stochastic rules while the module is in eval mode
            ("nearest" by default: evaluation is deterministic and draws no random numbers, so
            how often one evaluates never changes training). None keeps the stochastic rules.
            It replaces the stochastic rules of the MACs too.
        mac: the arithmetic of the forward product of a Linear, Conv1d or Conv2d, and of the four
            products of a MultiheadAttention (an lpsim.MAC; None: torch's own), computed by
            lpsim.nn.functional. A MultiheadAttention's out projection uses the MACs of its
            ``out_proj`` when out_proj is itself injected with MACs, else its own. Other modules
            ignore it, and inject warns when a model given MACs has modules whose products lpsim
            does not simulate (Conv3d, transposed convolutions, Bilinear, recurrent layers and
            cells, and subclasses of the four above whose class overrides forward: their own
            forward runs, as it is, in torch's arithmetic).
        input_grad_mac, weight_grad_mac: the arithmetic of the backward products (the input's and
            the weight's gradients, the bias gradient with the weight's); None: ``mac``'s.
        input_grad_operands, weight_grad_operands: lpsim.nn.functional.Operands (None: none): the
            formats, and a transform, of the two operands of each backward product of a Linear,
            quantised afresh from the unquantised input, weight and error along that product's
            reduction axis (bare formats use ``rounding``; eval mode applies eval_rounding).
            Linear layers only (that run nn.Linear's forward); an Operands.error excludes
            ``error`` (both quantise the error).

    While a lpsim.diagnostics.recorder.Recorder observes the model, every rounding is recorded
    under the module's qualified name and the field's name as its category.
    """

    weight: Spec = None
    bias: Spec = None
    input: Spec = None
    output: Spec = None
    error: Spec = None
    rounding: Rounding | str = field(default="stochastic")
    eval_rounding: Rounding | str | None = field(default="nearest")
    mac: MAC | None = None
    input_grad_mac: MAC | None = None
    weight_grad_mac: MAC | None = None
    input_grad_operands: _functional.Operands | None = None
    weight_grad_operands: _functional.Operands | None = None

    def spec(self, name: str) -> QuantSpec | None:
        return as_spec(getattr(self, name), self.rounding, name)

    def macs(self) -> tuple[MAC, MAC, MAC] | None:
        """(forward, input gradient, weight gradient) MACs, or None when no MAC is set."""
        if self.mac is None and self.input_grad_mac is None and self.weight_grad_mac is None:
            return None
        forward = self.mac if self.mac is not None else _functional.NATIVE
        return (
            forward,
            self.input_grad_mac if self.input_grad_mac is not None else forward,
            self.weight_grad_mac if self.weight_grad_mac is not None else forward,
        )

    def operands(
        self, for_eval: bool = False
    ) -> tuple[OperandSpecs | None, OperandSpecs | None] | None:
        """The resolved (input gradient, weight gradient) Operands, or None when neither is set;
        ``for_eval``: with stochastic rules replaced by eval_rounding, as in eval mode.

        Raises:
            ValueError: ``error`` and an Operands.error are both set, or an Operands sets the
                operand its product does not take.
        """
        if self.input_grad_operands is None and self.weight_grad_operands is None:
            return None
        for name in ("input_grad_operands", "weight_grad_operands"):
            value = getattr(self, name)
            if self.error is not None and getattr(value, "error", None) is not None:
                raise ValueError(
                    f"LayerQuantization: error and {name}.error both quantise the layer's error: "
                    "give error (once, for both backward products) or each product's error format"
                )
        how = _functional.arithmetic(
            _functional.NATIVE,
            None,
            None,
            None,
            None,
            None,
            self.rounding,
            input_grad_operands=self.input_grad_operands,
            weight_grad_operands=self.weight_grad_operands,
        )
        operands = how.input_grad_operands, how.weight_grad_operands
        if for_eval:
            eval_rule = parse_eval_rounding(self.eval_rounding)
            return tuple(None if o is None else o.for_eval(eval_rule) for o in operands)
        return operands

    def __post_init__(self) -> None:
        Rounding.parse(self.rounding)
        parse_eval_rounding(self.eval_rounding)
        for f in ("weight", "bias", "input", "output", "error"):
            self.spec(f)  # raises TypeError for malformed specs
        for f in ("mac", "input_grad_mac", "weight_grad_mac"):
            value = getattr(self, f)
            if value is not None and not isinstance(value, MAC):
                raise TypeError(f"{f} must be a lpsim.MAC or None, got {type(value).__name__}")
        self.operands()  # raises for malformed or conflicting Operands


class _Scalers(nn.Module):
    """The DelayedScalers of a module's input, output and error quantisers: a _TensorScalers per
    role (submodules "input", "output", "error"), so that their state is in the model's
    state_dict and follows .to()."""


# A DelayedScaler's buffers.
_SCALER_STATE = ("amax_history", "scale", "scale_inverse", "calls", "scaled_max")


def _loading_strictly() -> bool:
    """The ``strict`` argument of the innermost nn.Module.load_state_dict call running now (True
    where none is found). torch passes strict=True to every module's _load_from_state_dict and
    load_state_dict pre-hook, whatever the caller's, and applies the caller's to the missing and
    unexpected keys only at the end; a module that drops or resets state the state_dict does not
    hold must know the caller's, so that strict=False leaves that state as it is."""
    load_state_dict = nn.Module.load_state_dict.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is load_state_dict:
            return bool(frame.f_locals.get("strict", True))
        frame = frame.f_back
    return True


class _TensorScalers(nn.Module):
    """The DelayedScalers of one role (input, output or error) of an injected module: one per
    tensor, a submodule named after the tensor's place (lpsim.nn._hooks.map_placed_tensors: "0",
    "1", ... for the positional arguments and the outputs, the keyword for a keyword argument;
    the error's scaler has its output's name), created at the tensor's first quantisation on the
    tensor's device.

    load_state_dict creates the scalers that a state_dict holds (on the device the module was
    last moved to) and, when strict, drops those it does not hold (tensors it never quantised);
    strict=False leaves them as they are (see _loading_strictly). A
    state_dict from before the scalers were per tensor holds the role's one scaler (keys
    ``...lpsim_scalers.input.amax_history``): it is loaded as the first tensor's ("0")."""

    def __init__(self, scaling: DelayedScaling, device: torch.device):
        super().__init__()
        self._scaling = scaling
        self._device = torch.device(device)

    def scaler(self, place: str, device: torch.device) -> DelayedScaler:
        """The scaler of the tensor at ``place``, made on ``device`` where there is none."""
        name = self._name(place)
        found = self._modules.get(name)
        return found if found is not None else self._made(name, device)

    @torch.compiler.disable
    def _made(self, name: str, device: torch.device) -> DelayedScaler:
        """A new scaler, added as submodule ``name``. Made outside any graph torch.compile
        traces (a break in it): its state is then the module's, which a compiled graph takes as
        an input and may update in its backward pass (an error's scaler), where state made
        inside the traced forward could not be."""
        found = self._scaling.scaler(device)
        found.train(self.training)
        self.add_module(name, found)
        return found

    def __getitem__(self, place: str) -> DelayedScaler:
        """The scaler of the tensor at ``place`` ("0", "query", ...).

        Raises:
            KeyError: no tensor at ``place`` has been quantised yet.
        """
        found = self._modules.get(self._name(place))
        if found is None:
            raise KeyError(
                f"no scaler for {place!r}: the tensors quantised so far: {list(self._modules)}"
            )
        return found

    def _name(self, place: str) -> str:
        """The submodule name of the scaler at place: place, or "%" + place where place names
        another attribute of the module ("training"); no place starts with "%" (see
        lpsim.nn._hooks.dict_key_place), so no two places share a name."""
        if place not in self._modules and hasattr(self, place):
            return "%" + place
        return place

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        self._device = fn(torch.empty(0, device=self._device)).device  # where .to() moved it
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, *rest):
        for key in _SCALER_STATE:  # the role's one scaler of earlier state_dicts: the first's
            if prefix + key in state_dict and prefix + "0." + key not in state_dict:
                state_dict[prefix + "0." + key] = state_dict.pop(prefix + key)
        places = {
            key[len(prefix) :].split(".", 1)[0]
            for key in state_dict
            if key.startswith(prefix) and "." in key[len(prefix) :]
        }
        for place in places:
            if place not in self._modules:
                found = self._scaling.scaler(self._device)
                found.train(self.training)
                self.add_module(place, found)
        if _loading_strictly():  # strict=False keeps the scalers it does not hold, as they are
            for place in [p for p in self._modules if p not in places]:
                del self._modules[place]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, *rest)

    def extra_repr(self) -> str:
        return repr(self._scaling)


class _RoleQuantiser:
    """How one role (input, output or error) of an injected module quantises each of its tensors:
    ``quantiser(place, x, training)`` is the QuantSpec or ScalerCall that quantises the tensor x
    at ``place`` (``spec`` in training mode, ``eval_spec`` in eval mode; with a DelayedScaling,
    through the scaler of that place, recording in training mode only)."""

    def __init__(self, spec: QuantSpec, eval_rule: Rounding | None, scalers: _TensorScalers | None):
        self.spec, self.eval_spec, self.scalers = spec, spec.for_eval(eval_rule), scalers

    def __call__(self, place: str, x: torch.Tensor, training: bool) -> QuantSpec | ScalerCall:
        spec = self.spec if training else self.eval_spec
        if self.scalers is None:
            return spec
        return ScalerCall(self.scalers.scaler(place, x.device), spec.rounding, training)


def _is_mask_name(name: str) -> bool:
    """Whether a forward parameter named ``name`` takes a mask rather than data: its name ends in
    "mask" (MultiheadAttention's attn_mask and key_padding_mask, a TransformerEncoderLayer's
    src_mask, HuggingFace's attention_mask)."""
    return name.endswith("mask")


def _mask_positions(module: nn.Module) -> frozenset[int]:
    """The positions of the parameters of ``module``'s forward (its class's, self not counted)
    that take masks (see _is_mask_name), up to the first that is not positional."""
    try:
        parameters = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):  # a forward without a signature inspect can read
        return frozenset()
    found = set()
    for i, parameter in enumerate(parameters):
        if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            break
        if _is_mask_name(parameter.name):
            found.add(i)
    return frozenset(found)


class _InputQuantiser:
    """The forward pre-hook (with kwargs) that quantises a module's floating-point inputs, each
    by its place's quantiser, reporting each rounding to the current observer as "input". An
    object rather than a closure, so that copy.deepcopy of the model gives the copy's hook the
    copy's scalers.

    Masks are no inputs: the arguments of forward's parameters named like masks (``masks``, their
    positions, from _mask_positions; keywords by _is_mask_name), float attention masks with -inf or
    additive biases, pass as they are."""

    masks: frozenset[str] = frozenset()  # also for a hook pickled before masks were kept

    def __init__(self, role: _RoleQuantiser, masks: frozenset[int] = frozenset()):
        self.role = role
        self.masks = frozenset(str(i) for i in masks)

    def quantise(self, module: nn.Module, value, done: list | None = None, skip=frozenset()):
        """``value`` (a tensor, or the positional arguments, or the keyword arguments) with its
        floating-point tensors quantised, but those under the places in ``skip`` (the masks).
        A tensor found at several places (the same object: self-attention's query, key and
        value) is quantised once, by its first place's quantiser, and every place gets that one
        result, so that a stochastic rule rounds it once and the module still sees one tensor
        (torch's MultiheadAttention checks ``query is key``). ``done`` maps id(tensor) to
        (tensor, result) for the tensors already quantised in this call (the positional
        arguments', for the keyword arguments)."""
        training = module.training
        observer = _observation.current
        done = [] if done is None else done

        def quantised(tensor: torch.Tensor, place: str) -> torch.Tensor:
            quantiser = self.role(place, tensor, training)
            rounded = in_layout_of(tensor, quantiser(tensor))
            if observer is not None:
                observer.observe(module, "input", tensor, rounded, quantiser, training)
            return rounded

        def one(tensor: torch.Tensor, place: str) -> torch.Tensor:
            if place.split("-", 1)[0] in skip:
                return tensor
            return _once(done, tensor, place, quantised)

        return map_placed_tensors(value, one, on_complex=_complex_refused(module, "input"))

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        done: list = []
        masked = {key for key in kwargs if _is_mask_name(key)}
        return (
            self.quantise(module, args, done, self.masks),
            self.quantise(module, kwargs, done, masked),
        )


def _once(done: list, tensor: torch.Tensor, place: str, quantised) -> torch.Tensor:
    """quantised(tensor, place), made once per tensor object in a call: ``done`` holds the
    (tensor, result) pairs of the tensors already quantised in it, and a tensor found at a later
    place gets its first place's result.

    Found by ``is``, not by id(tensor): where a graph break (a MAC's product, a stochastic error
    quantiser) makes dynamo compile a hook's frame on its own, id() of a tensor it is given
    guards that frame on the tensor's address, and a new activation at every call recompiled it
    at every call (until dynamo's recompile limit, then ran it eagerly)."""
    for seen, result in done:
        if seen is tensor:
            return result
    result = quantised(tensor, place)
    done.append((tensor, result))
    return result


def _complex_refused(module: nn.Module, role: str):
    """The on_complex of map_placed_tensors for a module's quantised ``role``: a complex tensor
    (which lpsim's formats do not round) there raises, rather than passing unquantised."""

    def refuse(tensor: torch.Tensor, place: str) -> None:
        raise TypeError(
            f"inject: the {role} at {place!r} of a {type(module).__name__} is a {tensor.dtype} "
            "tensor, which lpsim's formats do not round (quantise torch.view_as_real of it "
            "inside the module, or select the module out)"
        )

    return refuse


class _OutputQuantiser:
    """The forward hook that quantises a module's floating-point outputs (``output``) and the
    gradients flowing back into them (``error``), each by its place's quantisers, reported to the
    current observer as "output" and "error". An object, as _InputQuantiser.

    A tensor returned at several places (the same object: a last hidden state that is also the
    last of the hidden states) is one output, as a tensor passed at several places is one input:
    quantised once, by its first place's quantisers, every place getting that one result, so that
    a stochastic rule rounds it once, and its error, the sum of the gradients of every place, is
    quantised once."""

    def __init__(self, output: _RoleQuantiser | None, error: _RoleQuantiser | None):
        self.output, self.error = output, error

    def __call__(self, module: nn.Module, args: tuple, value):
        training = module.training
        observed = (module, training) if _observation.current is not None else None
        done: list = []  # the tensors quantised in this call (_once)

        def quantised(tensor: torch.Tensor, place: str) -> torch.Tensor:
            forward = None if self.output is None else self.output(place, tensor, training)
            backward = None if self.error is None else self.error(place, tensor, training)
            return quantizing_function(forward, backward)(tensor, observed)  # in tensor's layout

        def one(tensor: torch.Tensor, place: str) -> torch.Tensor:
            return _once(done, tensor, place, quantised)

        role = "output" if self.output is not None else "error"
        return map_placed_tensors(value, one, on_complex=_complex_refused(module, role))


# torch's modules that can work in place (``inplace=True``): nn.ReLU, nn.Dropout, ...; each
# writes its result into its input, of the same shape and dtype.
_IN_PLACE_MODULES = tuple(
    cls
    for cls in vars(nn).values()
    if isinstance(cls, type)
    and issubclass(cls, nn.Module)
    and "inplace" in inspect.signature(cls.__init__).parameters
)


class _InPlaceResult:
    """The hooks that give an injected in-place module of torch's (_IN_PLACE_MODULES, when its
    ``inplace`` is True at the call) torch's contract, that the tensor it is given holds its
    result afterwards, which code that does not read the result (``self.relu(out); return out``)
    relies on.

    The module runs on a new tensor: the input quantiser's result, or, where it has none, a copy
    that ``before`` hands it, since its in-place op may save its result for its backward (nn.ReLU
    does), and that result must not change again. ``before`` is the first of inject's pre-hooks
    (those the user registered before inject run before it, and the tensor it keeps is the one
    they hand the module). The output and error quantisers give a new result too; ``after``
    copies the result into the tensor the module was given and returns that tensor, as torch's
    in-place modules return their input. The gradient flows through the copy to the
    quantisers' result, so the error quantiser rounds it as before.

    The caller's tensor (or None, where the module does not work in place) goes from ``before``
    to ``after`` on a stack of this thread's (_given_stack): every call pushes one and pops it,
    and the calls of modules inside one another's forward nest, so ``after`` pops its own call's
    tensor; the replicas nn.DataParallel runs in threads at once share their hooks. Not by
    id(module): where the graph breaks (a stochastic error quantiser), dynamo compiles these
    hooks as frames of their own, and id() guarded them on the module, once per in-place module
    of the model, up to dynamo's recompile limit."""

    def __init__(self, quantises_input: bool):
        self.quantises_input = quantises_input

    def before(self, module: nn.Module, args: tuple, kwargs: dict):
        given = args[0] if args else kwargs.get("input")
        stack = _given_stack()
        if (
            module.inplace is not True
            or not isinstance(given, torch.Tensor)
            or not given.is_floating_point()
        ):
            stack.append(None)
            return None
        stack.append(given)
        if self.quantises_input:
            return None
        if args:
            return (given.clone(), *args[1:]), kwargs
        return args, {**kwargs, "input": given.clone()}

    def after(self, module: nn.Module, args: tuple, result):
        stack = _given_stack()
        given = stack.pop() if stack else None
        if (
            given is None
            or result is given
            or not isinstance(result, torch.Tensor)
            or result.shape != given.shape
            or result.dtype != given.dtype
        ):
            return result
        if torch.is_grad_enabled() and not torch.compiler.is_compiling() and not under_torch_func():
            return _WrittenInto.apply(given, result)
        # Without gradients nothing flows back; under torch.func, and under torch.compile (whose
        # graphs gave _WrittenInto other gradients than eager), torch's copy_.
        return given.copy_(result)


class _WrittenInto(torch.autograd.Function):
    """given.copy_(result), whose gradient goes to result alone, none to the value given held
    before, as the gradient of torch's in-place ops goes (_InPlaceResult.after). torch's copy_
    gives that earlier value a zero gradient, contiguous, which autograd adds to its real one
    (through the in-place module's op): the sum took the zeros' layout, so in a channels_last
    model the module before (a BatchNorm) computed its backward on another layout than in the
    plain model, and summed in another order."""

    @staticmethod
    def forward(ctx, given: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        given.copy_(result)
        ctx.mark_dirty(given)
        return given

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad


# The weight scopes of the module forwards running now in this thread, innermost last: each maps a
# _FakeQuantize to the tensor it gave in that scope (see _open_weight_scope).
_THREAD = threading.local()


def _thread_list(name: str) -> list:
    """This thread's list ``name`` of _THREAD, made empty on first use."""
    found = getattr(_THREAD, name, None)
    if found is None:
        found = []
        setattr(_THREAD, name, found)
    return found


def _given_stack() -> list:
    """The tensors given to the in-place modules whose forwards run now in this thread,
    innermost last (see _InPlaceResult)."""
    return _thread_list("given")


# A weight scope's key, not a parametrisation: whether grad mode was on when its call began.
_GRAD_AT_START = "grad mode at the start of the call"


def _weight_scopes() -> list[dict]:
    return _thread_list("scopes")


class _FakeQuantize(nn.Module):
    """Parametrisation: the parameter as seen by forward is its quantised value (``spec`` while
    the module owning it is in training mode, ``eval_spec`` in eval mode; with a DelayedScaling,
    through ``scaler``, its submodule, made on ``device``). ``site`` is (the module owning the
    parameter, "weight" or "bias"), under which the rounding is reported to the current observer
    (lpsim._observation); ``name`` is the parameter's name in that module.

    Inside a weight scope the whole parametrised tensor is computed once (see
    _scoped_parametrization): each read outside every scope quantises.

    ``renorm``, set by _renorming_embedding_forward for the call of an Embedding or EmbeddingBag
    with max_norm, is (indices, max_norm, norm_type): the rows of the value that the indices
    name are renormalised in place (torch.embedding_renorm_, without gradients) before it is
    quantised, as torch's forward renormalises the weight it reads."""

    renorm: tuple | None = None  # also for a quantiser pickled before it had one

    def __init__(
        self,
        spec: QuantSpec,
        eval_rule: Rounding | None,
        site: tuple,
        device: torch.device,
        name: str,
    ):
        super().__init__()
        self.spec, self.eval_spec, self.scaler = bind(spec, eval_rule)
        if self.scaler is not None:
            self.scaler.to(device)
        self.site = site  # a tuple, so the owner is not registered as a submodule
        self.name = name

    def right_inverse(self, value: torch.Tensor) -> torch.Tensor:
        """Refuses: a quantised parameter replaced by its plain name (``module.weight = t``,
        torch.func.functional_call(model, {"0.weight": t}, ...)) would be written into the
        unquantised tensor in place, out of the gradient's reach, and functional_call would put
        back the quantised value in its place. (torch takes the NotImplementedError raised while
        it registers the parametrisation as "no inverse": the parameter is kept as it is.)

        Raises:
            NotImplementedError: always, naming the tensor to replace instead.
        """
        raise NotImplementedError(
            f"{self.name!r} is quantised by lpsim.nn.inject (a parametrisation) and cannot be "
            f"replaced by its plain name: replace its unquantised value, the parameter "
            f"'parametrizations.{self.name}.original' of the module (under that name in "
            "model.named_parameters() and torch.func.functional_call, or in place with "
            "copy_ under torch.no_grad())"
        )

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        scopes = _weight_scopes()
        if scopes:  # the value before quantisation, for the backward Operands (_unquantised_weight)
            scopes[-1][self, "unquantised"] = value
        return self._quantise(value)

    def _quantise(self, value: torch.Tensor) -> torch.Tensor:
        # The mode of the module that owns the parameter, as its input and output quantisers
        # take theirs: eval() sets this parametrisation's flag too, but code may set the module's
        # ``training`` alone (as torch's modules read it).
        owner, category = self.site
        training = owner.training
        if self.renorm is not None:
            indices, max_norm, norm_type = self.renorm
            with torch.no_grad():
                torch.embedding_renorm_(value, indices, max_norm, norm_type)
        quantise = self.spec if training else self.eval_spec
        rounded = in_layout_of(value, quantise(value))
        observer = _observation.current
        if observer is not None:
            observer.observe(owner, category, value, rounded, quantise, training)
        return rounded

    def extra_repr(self) -> str:
        """The spec, and, for a stochastic rule, the rule eval mode uses (None: kept)."""
        if not self.spec.rounding.is_stochastic:
            return str(self.spec)
        kept = self.eval_spec.rounding.is_stochastic  # eval_rounding=None
        return f"{self.spec}, eval_rounding={'None' if kept else self.eval_spec.rounding.name}"


def _scoped_parametrization(parametrizations: parametrize.ParametrizationList) -> torch.Tensor:
    """The forward of a ParametrizationList whose last parametrisation is inject's _FakeQuantize
    (an instance attribute, set by _inject_module): the parametrised tensor.

    Inside a weight scope (the forward of a module holding parametrised tensors, or reading them:
    see _open_weight_scope) the whole list is computed at the first read, the parametrisations
    the tensor had before inject (weight_norm, spectral_norm, ...) included, and later reads in
    the same scope get that tensor, so that a forward reading a weight several times (torch's
    MultiheadAttention reads in_proj_weight up to three times) quantises it once, one amax
    recorded, one seed drawn, and computes its parametrisations once (spectral_norm's power
    iteration steps once per call, the weight it computes being the one quantised), as under
    torch's parametrize.cached(). A read without gradients (torch.no_grad, or
    torch.inference_mode entered inside the forward) gets it detached; a later read with them
    gets it with its gradient, whichever came first. Outside every scope each
    read computes it afresh.

    Raises:
        RuntimeError: a parametrisation was registered on the tensor after inject, so that it
            comes after the fake-quantiser and would be applied to the rounded tensor.
    """
    if not isinstance(parametrizations[-1], _FakeQuantize):
        _refuse_parametrization_after(parametrizations)
    compute = type(parametrizations).forward
    scopes = _weight_scopes()
    if not scopes:
        return compute(parametrizations)
    cache = scopes[-1]
    key = parametrizations[-1]
    rounded = cache.get(key)
    if rounded is None:
        if (
            not torch.is_grad_enabled()
            and (cache[_GRAD_AT_START] or not torch.is_inference_mode_enabled())
            and any(t.requires_grad for t in _original_tensors(parametrizations))
        ):
            # A first read without gradients (torch.no_grad inside forward, or
            # torch.inference_mode inside a forward with gradients): computed with them, so that
            # a later read in the scope, which gets this tensor, has a gradient (an inference
            # tensor would have none, and could not be saved for backward). Grad mode is read
            # first: a compiled forward with a no_grad read does not meet
            # torch.is_inference_mode_enabled, which dynamo does not trace.
            with torch.inference_mode(False), torch.enable_grad():
                rounded = compute(parametrizations)
        else:
            rounded = compute(parametrizations)
        cache[key] = rounded
    return rounded if torch.is_grad_enabled() else rounded.detach()


def _refuse_parametrization_after(parametrizations: parametrize.ParametrizationList) -> None:
    """Raise for a parametrised tensor whose list has a parametrisation after inject's
    fake-quantiser (registered after inject): forward would see that parametrisation applied to
    the rounded tensor, off the format's grid.

    Raises:
        RuntimeError: always, naming the tensor, the parametrisation and what to do instead.
    """
    listed = list(parametrizations)
    at = next(i for i, p in enumerate(listed) if isinstance(p, _FakeQuantize))
    quantiser = listed[at]
    owner = parametrize.type_before_parametrizations(quantiser.site[0]).__name__
    after = ", ".join(type(p).__name__ for p in listed[at + 1 :])
    raise RuntimeError(
        f"{owner}.{quantiser.name} has a parametrisation ({after}) registered after "
        "inject(), which would be applied to the quantised tensor, off the format's grid: "
        "remove() the injection, register the parametrisation, and inject() again (inject "
        "quantises a tensor after the parametrisations it has)"
    )


def own_parametrized_classes(model: nn.Module) -> nn.Module:
    """``model`` with every parametrised module given a class of its own; returns it.

    torch gives a parametrised module a class made for it, holding one property per parametrised
    tensor, and copy.deepcopy shares that class between the copy and the original. Registering a
    parametrisation on another tensor adds a property to the class, and removing one deletes it
    (and, with the last, turns the module back into its original class), so either, done to the
    copy, would break the original. inject() and remove() give each module they change a class of
    its own first; lpsim.diagnostics.Shadow gives its copy of the model its own classes."""
    for module in model.modules():
        _own_parametrized_class(module)
    return model


def _own_parametrized_class(module: nn.Module) -> None:
    """Give a parametrised ``module`` a class of its own: a copy of its class (same name, bases
    and attributes), which no other module shares (see own_parametrized_classes)."""
    if not parametrize.is_parametrized(module):
        return
    shared = type(module)
    namespace = {
        key: value for key, value in vars(shared).items() if key not in ("__dict__", "__weakref__")
    }
    module.__class__ = type(shared.__name__, shared.__bases__, namespace)


def _original_tensors(parametrization: parametrize.ParametrizationList) -> list[torch.Tensor]:
    """The tensors a parametrised tensor is computed from (``original``, or ``original0``,
    ``original1``, ... for a parametrisation such as weight_norm's)."""
    if parametrization.is_tensor:
        return [parametrization.original]
    return [getattr(parametrization, f"original{i}") for i in range(parametrization.ntensors)]


def _originals(parametrization: parametrize.ParametrizationList) -> list[nn.Parameter]:
    """The parameters among _original_tensors (none for a parametrised buffer)."""
    return [t for t in _original_tensors(parametrization) if isinstance(t, nn.Parameter)]


def _parametrization_modules(model: nn.Module) -> set[int]:
    """ids of the modules that make up parametrisations (the ``parametrizations`` ModuleDict of
    each parametrised module and everything in it): they compute parameters, they are no layers."""
    found = set()
    for module in model.modules():
        if parametrize.is_parametrized(module):
            found.update(id(m) for m in module.parametrizations.modules())
    return found


def _is_state(module: nn.Module) -> bool:
    """Whether ``module`` is a DelayedScaler, or inject's holder of them: state, not a layer
    (the DelayedScaler of an lpsim.nn.Quantizer in the model, say)."""
    return isinstance(module, (_Scalers, _TensorScalers, DelayedScaler))


def _is_leaf(module: nn.Module) -> bool:
    """Whether ``module`` has no children but its parametrisations and DelayedScalers (a
    weight_norm Linear is a leaf module, as the Linear was, and so is an lpsim.nn.Quantizer with
    a DelayedScaling, as one with a Float is)."""
    parametrizations = module.parametrizations if parametrize.is_parametrized(module) else None
    return all(child is parametrizations or _is_state(child) for child in module.children())


def _remove_quantiser(module: nn.Module, pname: str) -> None:
    """Take inject's fake-quantiser off ``module``'s parameter ``pname``: with no other
    parametrisation, the original Parameter back in its place; else the parametrisations the
    tensor had before inject (weight_norm, orthogonal, ...) stay."""
    parametrizations = module.parametrizations[pname]
    if len(parametrizations) == 1 and isinstance(parametrizations[0], _FakeQuantize):
        parametrize.remove_parametrizations(module, pname, leave_parametrized=False)
        return
    last = max(i for i, p in enumerate(parametrizations) if isinstance(p, _FakeQuantize))
    del parametrizations[last]
    parametrizations.__dict__.pop("forward", None)  # _scoped_parametrization


_parametrize_lock = threading.Lock()


@contextlib.contextmanager
def _parameter_kept_whole():
    """Register a parametrisation without torch's ``original.set_(original)``.

    _FakeQuantize has no inverse, so torch keeps the parameter as it is and then sets it to itself
    (parametrize._maybe_set), which changes no value but gives the leaf a new gradient accumulator
    node. Hooks registered on the old node then never run: DistributedDataParallel's gradient
    all-reduce of a model wrapped before inject() (a torch error "Expected to have finished
    reduction" without find_unused_parameters; with it, silently unreduced gradients, and the
    ranks' weights part). Setting a tensor to itself is skipped here; everything else is torch's.
    """
    maybe_set = getattr(parametrize, "_maybe_set", None)
    if maybe_set is None:  # a torch that sets the tensor another way: nothing to skip
        yield
        return

    def set_unless_same(dest: torch.Tensor, src: torch.Tensor) -> None:
        if dest is not src:
            maybe_set(dest, src)

    with _parametrize_lock:
        parametrize._maybe_set = set_unless_same
        try:
            yield
        finally:
            parametrize._maybe_set = maybe_set


def _bound(function, module: nn.Module) -> functools.partial:
    """``function`` bound to ``module``, to be its forward: a partial rather than a bound method,
    so that copy.deepcopy of the model binds the copy's own forward and pickling the model
    (torch.save of a whole model) finds the function by its name."""
    return functools.partial(function, module)


_WEIGHT_SCOPE = "_lpsim_weight_scope"  # attribute: the instance forward a weight scope wraps


def _weight_scoped_forward(self: nn.Module, *args, **kwargs):
    """The forward of a module given a weight scope: the forward it wrapped, in a scope of its
    own (see _FakeQuantize)."""
    inner = getattr(self, _WEIGHT_SCOPE)
    scopes = _weight_scopes()
    scopes.append({_GRAD_AT_START: torch.is_grad_enabled()})
    try:
        if inner is None:
            return type(self).forward(self, *args, **kwargs)
        return inner(*args, **kwargs)
    finally:
        scopes.pop()
        if _RNN_FLAT_WEIGHTS in self.__dict__:
            _rest_flat_weights(self)


# An injected recurrent layer's instance attribute replacing torch's method that fills its
# _flat_weights, the list its forward computes with (see _rnn_init_flat_weights).
_RNN_FLAT_WEIGHTS = "_init_flat_weights"


def _rnn_init_flat_weights(module: nn.RNNBase) -> None:
    """_init_flat_weights of an injected recurrent layer. torch calls it in forward, where it
    fills _flat_weights with the weights as forward sees them (quantised, once per call: the
    forward runs in a weight scope), and in .to(), .float(), ..., where torch's would quantise
    every weight (drawing random numbers, recording amaxes) and keep non-leaf tensors that
    copy.deepcopy refuses: there, as after each forward, _flat_weights holds the tensors the
    weights are computed from (see _rest_flat_weights)."""
    if _weight_scopes():
        type(module)._init_flat_weights(module)
    else:
        _rest_flat_weights(module)


def _rest_flat_weights(module: nn.RNNBase) -> None:
    """Fill an injected recurrent layer's _flat_weights, between forward passes, with its
    parametrised weights' originals (None for one parametrised from several tensors), its other
    weights as they are: leaf tensors, so that copy.deepcopy of the model works. Its next forward
    sees them changed and reads the quantised weights afresh."""
    flat = []
    for name in module._flat_weights_names:
        if parametrize.is_parametrized(module, name):
            parametrization = module.parametrizations[name]
            flat.append(parametrization.original if parametrization.is_tensor else None)
        else:
            flat.append(getattr(module, name, None))
    module.__dict__["_flat_weights"] = flat
    module.__dict__["_flat_weight_refs"] = [None if w is None else weakref.ref(w) for w in flat]


def _keep_flat_weights_at_rest(module: nn.Module) -> None:
    """Give an injected recurrent layer with quantised weights _rnn_init_flat_weights."""
    if isinstance(module, nn.RNNBase) and _parametrises(module):
        module.__dict__[_RNN_FLAT_WEIGHTS] = _bound(_rnn_init_flat_weights, module)
        _rest_flat_weights(module)


def _release_flat_weights(module: nn.Module) -> None:
    """Undo _keep_flat_weights_at_rest (after the quantisers are removed): torch's method again,
    and _flat_weights filled by it."""
    if module.__dict__.pop(_RNN_FLAT_WEIGHTS, None) is not None:
        module._init_flat_weights()


def _open_weight_scope(module: nn.Module) -> None:
    """Run each call of ``module``'s forward in a weight scope of its own: the parametrised
    tensors read during the call are quantised once each, at their first read. The forward it
    wraps is the module's instance attribute (the simulated forward of a module given MACs), or
    its class's."""
    if _WEIGHT_SCOPE in module.__dict__:
        return
    module.__dict__[_WEIGHT_SCOPE] = module.__dict__.get("forward")
    module.forward = _bound(_weight_scoped_forward, module)


def _close_weight_scope(module: nn.Module) -> None:
    """Undo _open_weight_scope: the module's forward is the one it wrapped again."""
    if _WEIGHT_SCOPE not in module.__dict__:
        return
    inner = module.__dict__.pop(_WEIGHT_SCOPE)
    if inner is None:
        del module.forward
    else:
        module.forward = inner


# The modules whose products lpsim.nn.functional computes under MACs, and modules with products it
# does not simulate (inject warns when a model given MACs has them).
_SIMULATED_PRODUCTS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.MultiheadAttention)
_UNSIMULATED_PRODUCTS = (
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Bilinear,
    nn.RNNBase,
    nn.RNNCellBase,
)


def _simulable(module: nn.Module) -> bool:
    """Whether lpsim.nn.functional can compute ``module``'s products: it is a Linear, Conv1d,
    Conv2d or MultiheadAttention whose class runs that class's own forward. A subclass that
    overrides forward computes something around or instead of torch's product (a standardised
    weight, a padding of its own, a scaled result), which a simulated forward in its place would
    silently drop: its products are torch's, as a Conv3d's."""
    base = next((c for c in _SIMULATED_PRODUCTS if isinstance(module, c)), None)
    return base is not None and type(module).forward is base.forward


def _unsimulated(module: nn.Module) -> bool:
    """Whether ``module`` computes products that lpsim does not simulate (see _simulable)."""
    if isinstance(module, _UNSIMULATED_PRODUCTS):
        return True
    return isinstance(module, _SIMULATED_PRODUCTS) and not _simulable(module)


def simulates_products(module: nn.Module) -> bool:
    """Whether inject gave ``module`` MACs: its products run under lpsim.nn.functional."""
    return "macs" in getattr(module, _STATE, {})


def _injected_macs(module: nn.Module) -> tuple[MAC, MAC, MAC] | None:
    """The (forward, input gradient, weight gradient) MACs injected into ``module`` (the eval MACs
    in eval mode), or None where it has none."""
    done = getattr(module, _STATE, None)
    if done is None or "macs" not in done:
        return None
    return done["macs"] if module.training else done["eval_macs"]


def _simulated_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """The forward of an injected Linear, Conv1d or Conv2d: its product by lpsim.nn.functional
    under the injected MACs (the eval MACs in eval mode), its weight and bias as forward sees them
    (quantised by their parametrisations). A Linear with Operands quantises its input here rather
    than in a forward pre-hook, so that the backward products can quantise the unquantised input
    (and the weight as it is before inject's fake-quantiser) afresh.

    It takes what torch's forward takes: the argument by its name, ``input``, and a convolution's
    unbatched input ((C, L), (C, H, W)), computed as the batch of one it is."""
    x = input
    if isinstance(self, (nn.Conv1d, nn.Conv2d)) and x.dim() == len(self.kernel_size) + 1:
        return _simulated_forward(self, x.unsqueeze(0)).squeeze(0)
    mac, input_grad_mac, weight_grad_mac = _injected_macs(self)
    if isinstance(self, nn.Linear):
        done = getattr(self, _STATE)
        operands = done.get("operands" if self.training else "eval_operands", (None, None))
        weight = self.weight
        unquantised = (x, _unquantised_weight(self, weight))
        if done["input_quantiser"] is not None:
            x = done["input_quantiser"](self, x)
        how = _functional.Arithmetic(
            mac, input_grad_mac, weight_grad_mac, None, None, None, *operands
        )
        if how.native:
            return F.linear(x, weight, self.bias)
        return _functional.simulated_linear(x, weight, self.bias, how, unquantised)
    keywords = dict(mac=mac, input_grad_mac=input_grad_mac, weight_grad_mac=weight_grad_mac)
    padding = self.padding
    if self.padding_mode != "zeros":
        x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
        padding = 0
    conv = _functional.conv1d if isinstance(self, nn.Conv1d) else _functional.conv2d
    return conv(
        x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups, **keywords
    )


def _renorms_its_weight(module: nn.Module) -> bool:
    """Whether ``module`` is an Embedding or EmbeddingBag with ``max_norm`` whose weight inject's
    fake-quantiser parametrises, the last of its parametrisations (see
    _renorming_embedding_forward)."""
    return (
        isinstance(module, (nn.Embedding, nn.EmbeddingBag))
        and module.max_norm is not None
        and parametrize.is_parametrized(module, "weight")
        and isinstance(module.parametrizations.weight[-1], _FakeQuantize)
    )


def _renorming_embedding_forward(self: nn.Module, input: torch.Tensor, *args, **kwargs):  # noqa: A002
    """The forward of an injected Embedding or EmbeddingBag with ``max_norm`` and a quantised
    weight. torch's forward renormalises, in place, the rows of the weight it reads that the input
    indexes: the Parameter in the plain layer, the tensor its parametrisations compute in a
    parametrised one (weight_norm, ...). Here it would read the quantised weight, a new tensor,
    so the rows looked up would be renormalised quantised values, off the format's grid (and the
    Parameter never renormalised). This has inject's fake-quantiser renormalise the tensor it
    quantises, as torch does (torch.embedding_renorm_, without gradients: the Parameter itself
    where the fake-quantiser alone parametrises it), then runs the class's forward without
    ``max_norm``, so that the rows looked up are the quantised renormalised rows."""
    max_norm = self.max_norm
    if max_norm is None:
        return type(self).forward(self, input, *args, **kwargs)
    quantiser = self.parametrizations.weight[-1]
    quantiser.renorm = (input.reshape(-1), max_norm, self.norm_type)
    self.max_norm = None
    try:
        return type(self).forward(self, input, *args, **kwargs)
    finally:
        self.max_norm = max_norm
        quantiser.renorm = None


def _unquantised_weight(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """The module's weight before inject's fake-quantiser, the last of its parametrisations: its
    original, or the value of the parametrisations it had before inject (weight_norm, ...);
    ``weight`` itself when inject quantises no weight."""
    if not parametrize.is_parametrized(module, "weight"):
        return weight
    parametrizations = module.parametrizations.weight
    if not isinstance(parametrizations[-1], _FakeQuantize):
        return weight
    if len(parametrizations) == 1:
        return parametrizations.original
    scopes = _weight_scopes()
    found = scopes[-1].get((parametrizations[-1], "unquantised")) if scopes else None
    if found is not None:  # computed by this call's read of the weight, once (a power iteration)
        return found
    value = parametrizations[0](*_original_tensors(parametrizations))
    for i in range(1, len(parametrizations) - 1):
        value = parametrizations[i](value)
    return value


def _simulated_attention_forward(
    self: nn.MultiheadAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward of an injected MultiheadAttention (torch's arguments and results): its four
    products by lpsim.nn.functional.multi_head_attention_forward under the injected MACs (the eval
    MACs in eval mode), the out projection under out_proj's own when out_proj was injected with
    MACs; its parameters, out_proj's included, as forward sees them (quantised by their
    parametrisations), each read once per call.

    Raises:
        ValueError: an input is a nested tensor (torch's MultiheadAttention takes those only in
            its fused path, which simulates nothing).
    """
    if query.is_nested or key.is_nested or value.is_nested:
        raise ValueError(
            "an injected MultiheadAttention with MACs does not take nested tensors (torch takes "
            "them only in its fused path, which would not simulate the products)"
        )
    batched = query.dim() == 3
    if self.batch_first and batched:  # to (L, N, E), keeping which inputs are the same tensor
        same_kv, same_qk = key is value, query is key
        query = query.transpose(1, 0)
        key = query if same_qk else key.transpose(1, 0)
        value = key if same_kv else value.transpose(1, 0)
    mac, input_grad_mac, weight_grad_mac = _injected_macs(self)
    output, weights = _functional.multi_head_attention_forward(
        query,
        key,
        value,
        self.embed_dim,
        self.num_heads,
        self.in_proj_weight,
        self.in_proj_bias,
        self.bias_k,
        self.bias_v,
        self.add_zero_attn,
        self.dropout,
        self.out_proj.weight,
        self.out_proj.bias,
        training=self.training,
        key_padding_mask=key_padding_mask,
        need_weights=need_weights,
        attn_mask=attn_mask,
        use_separate_proj_weight=not self._qkv_same_embed_dim,
        q_proj_weight=self.q_proj_weight,
        k_proj_weight=self.k_proj_weight,
        v_proj_weight=self.v_proj_weight,
        average_attn_weights=average_attn_weights,
        is_causal=is_causal,
        mac=mac,
        input_grad_mac=input_grad_mac,
        weight_grad_mac=weight_grad_mac,
        out_proj_macs=_injected_macs(self.out_proj),
    )
    if self.batch_first and batched:
        output = output.transpose(1, 0)
    return output, weights


def _plan(model: nn.Module, config) -> tuple[list, dict]:
    """[(name, module, settings)] for the modules some entry decides, and for every selector the
    number of modules it decided and the number it matched. A module registered under several
    names (shared between two parents) is one module, named by its first name, which an entry
    matches when it matches any of its names."""
    decided = {key: 0 for key in config}
    matched = {key: 0 for key in config}
    plan = []
    parametrizing = _parametrization_modules(model)  # a user's weight_norm and the like
    names = module_names(model)
    for name, module in model.named_modules():
        if id(module) in parametrizing or _is_state(module):
            continue
        chosen = None
        for selector in config:
            if selector == DEFAULT:
                continue
            if selects(selector, names[id(module)], module, "inject()"):
                matched[selector] += 1
                if chosen is None:
                    chosen = selector
        if chosen is None and DEFAULT in config and _is_leaf(module):
            chosen = DEFAULT
            matched[DEFAULT] += 1
        if chosen is not None:
            decided[chosen] += 1
            plan.append((name, module, config[chosen]))
    return plan, {key: (decided[key], matched[key]) for key in config}


def _check_unmatched(counts: dict, unmatched: str, model: nn.Module) -> None:
    problems = []
    for selector, (decided, matched) in counts.items():
        if decided or selector == DEFAULT:  # "default" is a fallback: finding nothing left is fine
            continue
        if matched:
            why = f"matches {matched} module(s), all decided by an earlier entry"
        else:
            why = "matches no module of the model"
        problems.append(f"{selector_name(selector)}: {why}")
    if not problems or unmatched == "ignore":
        return
    message = (
        "inject(): config entries that decide no module (pass unmatched='warn' or 'ignore' "
        "to allow this): " + "; ".join(problems)
    )
    if compiled_model(model) is not None:
        message += (
            "; the model is torch.compile's wrapper, in which the model's modules are named "
            "'_orig_mod.<name>': inject into the model before compiling it (or select "
            "'_orig_mod.<name>')"
        )
    if unmatched == "warn":
        warnings.warn(message, stacklevel=3)
    else:
        raise ValueError(message)


# The parameters of a recurrent cell (nn.RNNCell, nn.LSTMCell, nn.GRUCell), whose names neither
# end in "weight" or "bias" nor are among a recurrent layer's _flat_weights_names.
_CELL_PARAMETERS = {"weight": ("weight_ih", "weight_hh"), "bias": ("bias_ih", "bias_hh")}


def _is_named(module: nn.Module, name: str, kind: str) -> bool:
    """Whether the parameter ``name`` of ``module`` is one of its ``kind`` ("weight" or "bias")
    parameters: its name ends in ``kind``, or, in a recurrent layer (nn.RNN, nn.LSTM, nn.GRU),
    starts with ``kind + "_"`` (weight_ih_l0, bias_hh_l1_reverse, ...), or, in a recurrent cell
    (nn.RNNCell, nn.LSTMCell, nn.GRUCell), is ``kind + "_ih"`` or ``kind + "_hh"``; a
    MultiheadAttention's bias_k and bias_v (add_bias_kv) are biases."""
    if name.endswith(kind):
        return True
    if isinstance(module, nn.MultiheadAttention) and kind == "bias":
        return name in ("bias_k", "bias_v")
    if isinstance(module, nn.RNNCellBase):
        return name in _CELL_PARAMETERS[kind]  # not weight_norm's weight_ih_g, say
    return (
        isinstance(module, nn.RNNBase)
        and name in module._flat_weights_names  # not weight_norm's weight_ih_l0_g, say
        and name.startswith(kind + "_")
    )


def _parameter_names(module: nn.Module, kind: str) -> list[str]:
    """The names of the module's own ``kind`` parameters (see _is_named), those already
    parametrised (weight_norm, orthogonal, ...) included: inject's fake-quantiser goes after their
    parametrisations."""
    names = [n for n, _ in module.named_parameters(recurse=False) if _is_named(module, n, kind)]
    if parametrize.is_parametrized(module):
        names += [
            n
            for n, parametrization in module.parametrizations.items()
            if _is_named(module, n, kind) and n not in names and _originals(parametrization)
        ]
    return names


def _bypassed(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Qualified names of the modules whose forward their parent never calls, with the parent and
    the reason; and of the modules that have no forward (nn.ModuleList, nn.ModuleDict: their
    parent runs the modules inside them), with themselves as the parent."""
    found = {}
    for name, module in model.named_modules():
        if _has_no_forward(module):
            found[name] = (
                module,
                f"{type(module).__name__} has no forward; its parent runs the modules inside it",
            )
        for parent_type, children in _FORWARD_BYPASSED.items():
            if isinstance(module, parent_type):
                for child in children:
                    if isinstance(getattr(module, child, None), nn.Module):
                        qualified = f"{name}.{child}" if name else child
                        found[qualified] = (
                            module,
                            f"{type(module).__name__} never calls its forward; "
                            "it reads the parameters directly",
                        )
    return found


def _has_no_forward(module: nn.Module) -> bool:
    """Whether calling ``module`` raises torch's NotImplementedError for a missing forward (a
    container: nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)."""
    return "forward" not in vars(module) and type(module).forward is nn.Module.forward


def _never_run(done: dict, parent: nn.Module) -> list[str]:
    """What never runs of an injection into a module whose forward ``parent`` never calls: its
    input/output/error quantisers, and its MACs unless the parent simulates its products."""
    parts = ["input/output/error"] if done["hooks"] or done["input_quantiser"] else []
    if "operands" in done:  # the parent's products take the parameters, never the Operands
        parts.append("backward operands")
    simulated = "macs" in done and not all(m.native for m in done["macs"])
    if simulated and _injected_macs(parent) is None:
        parts.append(
            f"MACs ({type(parent).__name__} has none: give it MACs to simulate its products)"
        )
    return parts


def _keep_off_fast_path(module: nn.Module, args) -> None:
    """A forward pre-hook that does nothing: see _guard_fast_paths."""


def _runs_forward(modules) -> bool:
    """Whether any of ``modules`` holds an injection that runs in forward (hooks or MACs)."""
    for module in modules:
        done = getattr(module, _STATE, None)
        if done is not None and (done["hooks"] or "macs" in done):
            return True
    return False


def _guard_fast_paths(model: nn.Module) -> None:
    """Keep torch's fused transformer paths from bypassing injected quantisers and MACs.

    In eval mode without gradients, a TransformerEncoderLayer computes its whole layer by
    torch._transformer_encoder_layer_fwd, calling no submodule's forward, unless some module in
    it has forward hooks (torch checks ``_forward_hooks`` and ``_forward_pre_hooks``): each layer
    holding an injection that runs in forward gets a forward pre-hook that does nothing. Given a
    key padding mask, a TransformerEncoder turns its input into a nested tensor for its layers
    unless its ``use_nested_tensor`` is False: it is set False while such layers are injected.
    remove() undoes both."""
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoderLayer) and _runs_forward(module.modules()):
            handle = module.register_forward_pre_hook(_keep_off_fast_path)
            setattr(module, _FAST_PATH, {"hook": handle})
        elif (
            isinstance(module, nn.TransformerEncoder)
            and getattr(module, "use_nested_tensor", False)
            and _runs_forward(module.layers.modules())
        ):
            setattr(module, _FAST_PATH, {"use_nested_tensor": module.use_nested_tensor})
            module.use_nested_tensor = False


def _unguard_fast_paths(model: nn.Module) -> None:
    for module in model.modules():
        guard = module.__dict__.pop(_FAST_PATH, None)
        if guard is None:
            continue
        if "hook" in guard:
            guard["hook"].remove()
        else:
            module.use_nested_tensor = guard["use_nested_tensor"]


def _device_of(module: nn.Module, model: nn.Module) -> torch.device:
    """Where the scalers of ``module``'s inputs, outputs and errors are made when a state_dict
    loads them before any forward pass: the device of its first parameter or buffer, else the
    model's, else the CPU (``.to()`` moves them later, as it moves the module)."""
    for holder in (module, model):
        tensor = next(itertools.chain(holder.parameters(), holder.buffers()), None)
        if tensor is not None:
            return tensor.device
    return torch.device("cpu")


def _is_delayed(spec: QuantSpec | None) -> bool:
    return spec is not None and isinstance(spec.format, DelayedScaling)


def _value_to_quantise(module: nn.Module, pname: str) -> torch.Tensor:
    """What inject's fake-quantiser of ``module``'s parameter ``pname`` will quantise: the
    Parameter, or for one already parametrised (weight_norm, ...) the value of its
    parametrisations, computed without gradients and in an unobserved_pass, so that a
    parametrisation with state (spectral_norm's power iteration, which updates its buffers _u and
    _v at every read in training mode) is left as it was."""
    parameter = module._parameters.get(pname)
    if parameter is not None:
        return parameter
    with unobserved_pass(module), torch.no_grad():
        return getattr(module, pname)


# torch's forward pre-hooks that compute a module's tensor from parameters under other names (the
# hook's class, the attribute naming the tensor), what applies each, and what to do instead.
_COMPUTING_HOOKS = (
    (
        WeightNorm,
        "name",
        "torch.nn.utils.weight_norm",
        "apply torch.nn.utils.parametrizations.weight_norm instead: inject quantises its result",
    ),
    (
        SpectralNorm,
        "name",
        "torch.nn.utils.spectral_norm",
        "apply torch.nn.utils.parametrizations.spectral_norm instead: inject quantises its result",
    ),
    (
        prune.BasePruningMethod,
        "_tensor_name",
        "torch.nn.utils.prune",
        "make the pruning permanent first (torch.nn.utils.prune.remove), or apply the mask by a "
        "parametrisation (torch.nn.utils.parametrize.register_parametrization): inject quantises "
        "its result",
    ),
)


def _check_no_hook_computes(module: nn.Module, kind: str) -> None:
    """Refuse a ``kind`` ("weight" or "bias") tensor of ``module`` that a forward pre-hook of
    torch.nn.utils.weight_norm, spectral_norm or prune computes: it is no parameter (the
    parameters are weight_g and weight_v, or weight_orig), so a weight setting would quantise
    nothing.

    Raises:
        NotImplementedError: naming the tensor, what computes it and what to do instead.
    """
    for hook in module._forward_pre_hooks.values():
        for hook_type, attribute, applied, advice in _COMPUTING_HOOKS:
            name = getattr(hook, attribute, None) if isinstance(hook, hook_type) else None
            if name is not None and _is_named(module, name, kind):
                raise NotImplementedError(
                    f"inject(): {type(module).__name__}.{name} is computed by the forward "
                    f"pre-hook of {applied}, which inject cannot quantise; {advice}"
                )


def _simulates_products(module: nn.Module, settings: LayerQuantization) -> bool:
    """Whether injecting ``settings`` gives ``module`` MACs (a simulated forward): it is a Linear,
    Conv1d, Conv2d or MultiheadAttention that runs its class's own forward (_simulable), and its
    settings have MACs or backward Operands."""
    has_macs = settings.macs() is not None or settings.operands() is not None
    return has_macs and _simulable(module)


def _replaces_forward(module: nn.Module, settings: LayerQuantization) -> str | None:
    """What of injecting ``settings`` makes inject set ``module.forward`` to a forward of its own
    (named, for an error message), or None: MACs (_simulated_forward), or a quantised weight of
    an Embedding or EmbeddingBag with max_norm (_renorming_embedding_forward). The weight scope
    wraps any forward and replaces none."""
    if _simulates_products(module, settings):
        return "MACs (mac, input_grad_mac, weight_grad_mac, backward Operands)"
    if (
        isinstance(module, (nn.Embedding, nn.EmbeddingBag))
        and module.max_norm is not None
        and settings.spec("weight") is not None
    ):
        return "quantised weight (an Embedding with max_norm renormalises it in its own forward)"
    return None


def _check_module(module: nn.Module, settings: LayerQuantization) -> None:
    """Raise what injecting ``settings`` into ``module`` would raise, changing nothing (inject
    checks every module before it changes any). The parameters are checked as quantising them
    would check them (their dtype, a format that does not fit it, a BlockFloat dim they lack),
    quantising nothing: injecting draws no random word and records no amax.

    Raises:
        TypeError, ValueError, IndexError: as lpsim.quantize for a parameter; Operands on a module
            that is not a Linear; a module with an attribute named lpsim_scalers; a parameter to
            quantise of a lazy module that has not run yet (ValueError).
        NotImplementedError: a weight or bias to quantise is computed by a forward pre-hook (see
            _check_no_hook_computes); the module has a forward of its own (an instance attribute)
            that inject would replace (see _replaces_forward).
    """
    replacing = _replaces_forward(module, settings)
    if replacing is not None and "forward" in module.__dict__:
        raise NotImplementedError(
            f"inject(): {type(module).__name__} has a forward of its own (an instance attribute "
            "'forward': a wrapper set by a library or a script), which inject would replace to "
            f"run its {replacing} and remove() would delete: take the wrapper off before "
            f"injecting (and put it back after remove()), or give this module no {replacing}"
        )
    if settings.operands() is not None and not (
        isinstance(module, nn.Linear) and _simulable(module)
    ):
        overrides = isinstance(module, nn.Linear)
        raise ValueError(
            "inject(): LayerQuantization.input_grad_operands and weight_grad_operands apply to "
            f"Linear layers, but an entry that sets them selects {type(module).__name__}"
            + (", a Linear whose class overrides forward" if overrides else "")
            + "; select the Linear layers (that run nn.Linear's forward) for them"
        )
    for kind in ("weight", "bias"):
        spec = settings.spec(kind)
        if spec is None:
            continue
        _check_no_hook_computes(module, kind)
        for pname in _parameter_names(module, kind):
            value = _value_to_quantise(module, pname)
            if isinstance(value, nn.parameter.UninitializedParameter):
                raise ValueError(
                    f"inject(): {type(module).__name__}.{pname} is not initialised yet (a lazy "
                    "module infers its shape at its first forward pass): run the model once "
                    "before inject()"
                )
            try:
                if _is_delayed(spec):
                    check_container(value)
                else:
                    quantize_op_arguments(value, spec.format, spec.rounding, None, None, 0)
            except (TypeError, ValueError, IndexError) as error:
                if type(error) not in (TypeError, ValueError, IndexError):
                    raise
                kind_name = parametrize.type_before_parametrizations(module).__name__
                raise type(error)(
                    f"inject(): {kind_name}.{pname} cannot be quantised by {spec}: {error}"
                ) from error
    if any(_is_delayed(settings.spec(f)) for f in ("input", "output", "error")) and hasattr(
        module, _SCALERS
    ):
        raise ValueError(f"inject(): {type(module).__name__} already has an attribute {_SCALERS!r}")


def _inject_module(
    module: nn.Module, settings: LayerQuantization, bypassed: str | None, device: torch.device
) -> dict:
    """Inject ``settings`` into ``module`` (checked by _check_module) and return what was done;
    ``device`` is where its input, output and error scalers are made before any forward pass."""
    done = {
        "type": parametrize.type_before_parametrizations(module).__name__,
        "weight": [],
        "bias": [],
        "input": None,
        "output": None,
        "error": None,
        "hooks": [],
        "parameter_order": list(module._parameters),
        "bypassed": bypassed,
        "never_run": [],
    }
    eval_rule = parse_eval_rounding(settings.eval_rounding)
    done["eval_rule"] = eval_rule
    macs = settings.macs()
    operands = settings.operands()
    if operands is not None:
        done["operands"] = operands
        done["eval_operands"] = settings.operands(for_eval=True)
        macs = macs if macs is not None else (_functional.NATIVE,) * 3
    if _simulates_products(module, settings):
        done["macs"] = macs
        done["eval_macs"] = tuple(m.for_eval(eval_rule) for m in macs)
        forward = (
            _simulated_attention_forward
            if isinstance(module, nn.MultiheadAttention)
            else _simulated_forward
        )
        module.forward = _bound(forward, module)
    _own_parametrized_class(module)  # registering may add a property to a shared class
    for kind in ("weight", "bias"):
        spec = settings.spec(kind)
        if spec is None:
            continue
        for pname in _parameter_names(module, kind):
            where = _value_to_quantise(module, pname).device
            quantise = _FakeQuantize(spec, eval_rule, (module, kind), where, pname)
            # unsafe: torch would check the parametrisation by running it once, which would
            # record an amax (the first forward pass must use scale 1) and draw a seed;
            # _check_module has checked what quantising the parameter checks.
            with _parameter_kept_whole():
                parametrize.register_parametrization(module, pname, quantise, unsafe=True)
            parametrizations = module.parametrizations[pname]
            parametrizations.forward = _bound(_scoped_parametrization, parametrizations)
            done[kind].append((pname, spec))
    if done["weight"] or done["bias"]:
        done["load_hook"] = module.register_load_state_dict_pre_hook(_load_plain_keys)
    if _renorms_its_weight(module):
        done["renorm"] = True
        module.forward = _bound(_renorming_embedding_forward, module)
    scalers = _Scalers()

    def role(field: str) -> _RoleQuantiser | None:
        spec = settings.spec(field)
        if spec is None:
            return None
        if _is_delayed(spec):
            setattr(scalers, field, _TensorScalers(spec.format, device))
        return _RoleQuantiser(spec, eval_rule, getattr(scalers, field, None))

    input_role = role("input")
    output_role, error_role = role("output"), role("error")
    in_place = None
    if isinstance(module, _IN_PLACE_MODULES) and (input_role or output_role or error_role):
        # The first of inject's pre-hooks, after those the user registered before inject: the
        # tensor it keeps is the one the module's forward is given (a user's pre-hook may have
        # replaced the caller's, which torch's in-place op then leaves alone).
        in_place = _InPlaceResult(quantises_input=input_role is not None)
        done["hooks"].append(module.register_forward_pre_hook(in_place.before, with_kwargs=True))
    done["input_quantiser"] = None
    if input_role is not None:
        quantise_inputs = _InputQuantiser(input_role, _mask_positions(module))
        if "operands" in done:  # the simulated forward quantises the input itself
            done["input_quantiser"] = quantise_inputs.quantise
        else:
            done["hooks"].append(
                module.register_forward_pre_hook(quantise_inputs, with_kwargs=True)
            )
        done["input"] = input_role.spec
    if output_role is not None or error_role is not None:
        done["hooks"].append(
            module.register_forward_hook(_OutputQuantiser(output_role, error_role))
        )
        done["output"] = None if output_role is None else output_role.spec
        done["error"] = None if error_role is None else error_role.spec
    if in_place is not None:
        # always_call: a forward that raises pops its entry too (else its tensor stayed on the
        # stack, held for ever)
        done["hooks"].append(module.register_forward_hook(in_place.after, always_call=True))
    if any(True for _ in scalers.children()):
        module.add_module(_SCALERS, scalers)
        done["scalers"] = True
    return done


def _load_plain_keys(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    """load_state_dict pre-hook of a module whose parameters inject parametrised: a parameter
    that inject's fake-quantiser alone parametrises loads from a state_dict saved without the
    injection (a float32 checkpoint, under its plain name ``prefix + "weight"``) as from one saved
    with it (``prefix + "parametrizations.weight.original"``), so that such a checkpoint loads
    into the injected model (strict=False would otherwise load none of these parameters, and
    strict=True refuse them). The key saved with the injection is taken where both are.

    Such a checkpoint holds no state of a DelayedScaling weight's scaler: strict loads it as the
    scaler's state when inject made it (empty history, scale 1), as a strict load drops the input,
    output and error scalers a state_dict does not hold; strict=False leaves it as it is, as
    torch leaves every missing key."""
    done = getattr(module, _STATE, None)
    if done is None:
        return
    for pname, _ in done["weight"] + done["bias"]:
        parametrizations = module.parametrizations[pname]
        if len(parametrizations) != 1 or not parametrizations.is_tensor:
            continue  # parametrised before inject: its checkpoints have the parametrised keys
        plain, original = prefix + pname, f"{prefix}parametrizations.{pname}.original"
        if plain in state_dict and original not in state_dict:
            state_dict[original] = state_dict.pop(plain)
            scaler = parametrizations[0].scaler
            if scaler is not None and _loading_strictly():
                where = f"{prefix}parametrizations.{pname}.0.scaler."
                fresh = scaler.scaling.scaler(scaler.scale.device).state_dict()
                for key, value in fresh.items():
                    state_dict.setdefault(where + key, value)


def _active(done: dict) -> bool:
    """Whether any quantiser of an injection exists (a weight setting on a module without
    weights, say, creates none)."""
    return bool(done["weight"] or done["bias"] or done["hooks"] or "macs" in done)


def _check_model(model) -> None:
    """Raises TypeError unless model is an nn.Module (inject, remove, injected, report)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")


def inject(
    model: nn.Module,
    config: Mapping[object, LayerQuantization | None],
    *,
    unmatched: str = "error",
    verbose: bool = False,
) -> nn.Module:
    """Insert quantisers into ``model`` in place, as ``config`` says (see the module docstring),
    and return it. Injecting again into an injected model first removes the earlier injection.

    Modules whose forward their parent never calls (``out_proj`` of ``nn.MultiheadAttention``)
    get their weight quantisers, which run, and a warning for configured input, output or error
    quantisers, which would never run, and for MACs, which run only when the parent has MACs
    too (a MultiheadAttention with MACs computes its out projection under out_proj's).

    torch's fused transformer paths, which skip the forward of every submodule, are kept off for
    the TransformerEncoderLayers and TransformerEncoders that hold input, output or error
    quantisers or MACs (a forward pre-hook that does nothing on each such layer, and
    ``use_nested_tensor = False`` on each such encoder, both undone by remove()), so that in
    eval mode without gradients these run as they do with gradients.

    Also sets ``torch._dynamo.config.skip_nnmodule_hook_guards = False`` for the process (and, the
    first time, clears dynamo's caches), so that torch.compile never reuses a graph compiled
    without the injected hooks: with dynamo's default, a compiled float32 model of the same class
    would lend its graph to the injected one, silently without quantisers.

    Args:
        model: any nn.Module (nested containers, ModuleDict, custom modules, a single layer).
        config: a mapping (in priority order) from selectors to LayerQuantization or None.
        unmatched: what a config entry that decides no module causes: "error" (ValueError, the
            default), "warn" (a UserWarning) or "ignore".
        verbose: print the report table.

    Raises:
        TypeError: a selector or a setting is malformed (a module instance as a selector, say).
        ValueError: an entry decides no module (with unmatched="error"), or unmatched is not one of
            "error", "warn", "ignore". The model is unchanged when inject raises (an earlier
            injection included: whatever raises, every module's class, parameters, submodules,
            hooks and attributes are put back as they were).
    """
    _check_model(model)
    check_bool("verbose", verbose)
    if not hasattr(config, "items"):
        raise TypeError(
            f"config must be a mapping from selectors to settings, got {type(config).__name__}"
        )
    if unmatched not in _UNMATCHED:
        raise ValueError(
            f"unmatched must be one of {', '.join(map(repr, _UNMATCHED))}; got {unmatched!r}"
        )
    for selector, settings in config.items():
        if selector != DEFAULT:
            check_selector(selector)
        if settings is not None and not isinstance(settings, LayerQuantization):
            raise TypeError(f"config values must be LayerQuantization or None, got {settings!r}")
    snapshot = _Snapshot(model)  # to put back should anything below raise
    try:
        remove(model)  # an earlier injection would otherwise be matched as part of the model
        plan, counts = _plan(model, config)
        _check_unmatched(counts, unmatched, model)
        guard_hooks_under_compile()
        bypassed = _bypassed(model)
        for _, module, settings in plan:  # every module checked before any is changed
            if settings is not None:
                _check_module(module, settings)
        simulating = False
        for name, module, settings in plan:
            if settings is None:
                continue
            reason = bypassed[name][1] if name in bypassed else None
            done = _inject_module(module, settings, reason, _device_of(module, model))
            setattr(module, _STATE, done)
            simulating = simulating or settings.macs() is not None
        _open_weight_scopes(model, bypassed)
        for module in model.modules():
            _keep_flat_weights_at_rest(module)
        never_run = []
        for name, (parent, reason) in bypassed.items():
            done = getattr(model.get_submodule(name), _STATE, None)
            if done is not None:
                done["never_run"] = _never_run(done, parent)
                if done["never_run"]:
                    never_run.append(f"{name!r} ({reason}): {' and '.join(done['never_run'])}")
        if never_run:
            warnings.warn(
                "inject(): quantisers or MACs configured for these modules never run: "
                + "; ".join(never_run),
                stacklevel=2,
            )
        _guard_fast_paths(model)
        unsimulated = [
            f"{name!r} ({type(module).__name__})"
            for name, module in model.named_modules()
            if _unsimulated(module)
        ]
        if simulating and unsimulated:
            warnings.warn(
                "inject(): lpsim simulates the products of Linear, Conv1d, Conv2d and "
                "MultiheadAttention only, and only where the class runs their own forward (a "
                "subclass that overrides forward runs it as it is); these modules compute theirs "
                "in torch's own arithmetic: " + ", ".join(unsimulated),
                stacklevel=2,
            )
    except BaseException:
        snapshot.restore()  # the earlier injection's quantisers, weight scopes and scalers too
        raise
    if verbose:
        print(report(model))
    return model


class _Snapshot:
    """The structure of every module of a model (its class and its attributes, the dicts and sets
    among them, which hold its parameters, buffers, submodules and hooks, by content) as it is now,
    for restore() to put back exactly: inject() takes one so that the model is unchanged when it
    raises, an earlier injection included (the same Parameter objects, hooks, quantisers,
    scalers and weight scopes, which are instance attributes)."""

    def __init__(self, model: nn.Module):
        self.saved = []
        for module in model.modules():
            attributes = dict(module.__dict__)
            contents = {
                key: list(value.items()) if isinstance(value, dict) else list(value)
                for key, value in attributes.items()
                if isinstance(value, (dict, set))
            }
            self.saved.append((module, type(module), attributes, contents))

    def restore(self) -> None:
        # A class changed since is a new one (inject and remove never change a class in place:
        # see _own_parametrized_class), so the saved classes are as they were.
        for module, cls, attributes, contents in self.saved:
            module.__class__ = cls
            state = module.__dict__
            for key in [k for k in state if k not in attributes]:
                del state[key]
            state.update(attributes)
            for key, items in contents.items():
                container = attributes[key]
                container.clear()
                container.update(items)


def _parametrises(module: nn.Module) -> bool:
    """Whether inject gave ``module`` parametrised weights or biases."""
    done = getattr(module, _STATE, None)
    return done is not None and bool(done["weight"] or done["bias"])


def _open_weight_scopes(model: nn.Module, bypassed: dict) -> None:
    """A weight scope (_open_weight_scope) for every module holding parametrised tensors, and for
    every module whose forward reads those of a child whose forward it never calls
    (nn.MultiheadAttention reads out_proj's weight and bias)."""
    for module in model.modules():
        if _parametrises(module):
            _open_weight_scope(module)
    for name, (parent, _) in bypassed.items():
        if _parametrises(model.get_submodule(name)):
            _open_weight_scope(parent)


def _restore_parameter_order(module: nn.Module, order: list[str]) -> None:
    params = module._parameters
    ordered = {k: params[k] for k in order if k in params}
    ordered.update((k, v) for k, v in params.items() if k not in ordered)
    params.clear()
    params.update(ordered)


def remove(model: nn.Module) -> nn.Module:
    """Undo inject(): remove every hook and parametrisation it added, restoring the original
    parameters (the same Parameter objects, in their original registration order, so that
    named_parameters(), state_dict() and optimizer states saved before injection match again),
    and torch's fused transformer paths where inject kept them off. Parametrisations the
    parameters had before inject stay. A copy.deepcopy of an injected model may be removed (or
    injected again) without harm to the original: each module whose parametrisations change gets
    a class of its own first (see own_parametrized_classes). Returns the model."""
    _check_model(model)
    _unguard_fast_paths(model)
    for module in model.modules():
        _close_weight_scope(module)
    for module in model.modules():
        done = getattr(module, _STATE, None)
        if done is None:
            continue
        for handle in done["hooks"]:
            handle.remove()
        if "macs" in done or "renorm" in done:
            del module.forward  # the class's forward again
        if done["weight"] or done["bias"]:
            _own_parametrized_class(module)  # the class may be shared with a deep copy
        for pname, _ in done["weight"] + done["bias"]:
            _remove_quantiser(module, pname)
        _restore_parameter_order(module, done["parameter_order"])
        _release_flat_weights(module)
        if "load_hook" in done:
            done["load_hook"].remove()
        if done.get("scalers"):
            delattr(module, _SCALERS)
        delattr(module, _STATE)
    return model


def injected(model: nn.Module) -> list[tuple[str, nn.Module, dict]]:
    """(name, module, what was injected) for every module inject() placed a quantiser in, in
    model order."""
    _check_model(model)
    return [
        (n, m, getattr(m, _STATE))
        for n, m in model.named_modules()
        if hasattr(m, _STATE) and _active(getattr(m, _STATE))
    ]


def quantized_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that inject() fake-quantises in ``model``, in model order, each once (a
    parameter tied between modules too): the ones to give OptimLP(..., parameters=...) so that
    the optimizer rounds exactly the parameters forward sees quantised, and leaves the others
    (first and last layers kept in float32, say) alone. For a tensor parametrised before inject
    (weight_norm, orthogonal, ...), the parameters it is computed from."""
    found: dict[int, nn.Parameter] = {}  # each once, a tied parameter too
    for _, module, done in injected(model):
        for pname, _ in done["weight"] + done["bias"]:
            for parameter in _originals(module.parametrizations[pname]):
                found.setdefault(id(parameter), parameter)
    return list(found.values())


def parameter_name(name: str) -> str:
    """The name reports give the parameter that ``model.named_parameters()`` calls ``name``: the
    name without a parametrisation's indirection where the parametrised tensor is computed from
    that one parameter ("0.parametrizations.weight.original" and, for the model itself,
    "parametrizations.weight.original": "0.weight" and "weight"), and ``name`` itself where it is
    computed from several ("0.parametrizations.weight.original0" and "...original1", weight_norm's
    g and v, each a parameter of its own: both called "0.weight" would add up the statistics of
    two tensors under one name)."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[-3] == "parametrizations" and parts[-1] == "original":
        parts = parts[:-3] + [parts[-2]]
    return ".".join(parts)


@contextlib.contextmanager
def unobserved_pass(*models: nn.Module):
    """A context in which passes through ``models`` leave them as they were: no observer is
    current (an attached lpsim.diagnostics.Recorder records none of their roundings, and gets its
    observer back however the context ends), every buffer they write (BatchNorm's running
    statistics, the DelayedScalers' histories and scales) is put back afterwards, the same tensor
    holding the same bits, and the input, output and error scalers created meanwhile (those of
    tensors first quantised inside) are dropped. A DynamicLossScaler's watches record no overflow
    of the errors computed inside (lpsim._observation.hidden), so that the run's next step does
    not skip for them. report(example=...) runs its pass in one, and
    lpsim.diagnostics.Shadow.compare its two. The parameters a forward writes in place (an
    Embedding or EmbeddingBag with max_norm renormalises the rows looked up; a module may write
    its own weight, through .data too) are put back as they were, bit for bit: every parameter is
    copied on entry, and one whose version counter moved or whose values differ is set back (a
    parameter the pass left alone is not written, so its version counter stays as it was)."""
    modules = [module for model in models for module in model.modules()]
    buffers = [
        (module._buffers, name, buffer, buffer.clone())
        for module in modules
        for name, buffer in module._buffers.items()
        if buffer is not None
    ]
    parameters = {id(p): p for module in modules for p in module.parameters(recurse=False)}
    saved_parameters = [(p, p._version, p.detach().clone()) for p in parameters.values()]
    scalers = [(s, set(s._modules)) for s in modules if isinstance(s, _TensorScalers)]
    observer = _observation.current
    _observation.current = None
    _observation.hidden += 1
    try:
        yield
    finally:
        _observation.current = observer
        _observation.hidden -= 1
        with torch.no_grad():
            for owner, name, buffer, saved in buffers:
                owner[name] = buffer
                if buffer.shape == saved.shape:
                    buffer.copy_(saved)
                else:
                    buffer.set_(saved)
            for parameter, version, saved in saved_parameters:
                if parameter._version != version or not torch.equal(parameter, saved):
                    parameter.copy_(saved)
        for found, places in scalers:
            for place in [p for p in found._modules if p not in places]:
                del found._modules[place]


def _modules_that_run(model: nn.Module, example) -> set[int]:
    """ids of the modules whose forward runs on ``example`` (a tensor or a tuple of arguments).
    The pass changes nothing: it runs without gradients, inside a fork of torch's generators (the
    CPU one and those of the CUDA devices the model and the example are on), so it leaves the
    random streams of training where they were, and in an unobserved_pass (a Recorder records
    nothing; every buffer it writes is put back as it was, the scalers it creates dropped), the
    delayed scalers of an active quantize_functions context kept as they were too."""
    # lpsim.nn.functions imports this module.
    from lpsim.nn.functions import scalers_kept  # noqa: PLC0415

    ran: set[int] = set()
    # A plain tuple holds the arguments; a tuple of another type (a PackedSequence, a named tuple)
    # is one argument, as a tensor is.
    args = example if type(example) is tuple else (example,)
    tensors = [*model.parameters(), *model.buffers()]
    map_tensors(args, lambda t: tensors.append(t) or t)
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    handles = [
        m.register_forward_pre_hook(lambda mod, args: ran.add(id(mod))) for m in model.modules()
    ]
    try:
        with (
            unobserved_pass(model),
            scalers_kept(),
            torch.no_grad(),
            torch.random.fork_rng(devices=devices),
        ):
            model(*args)
    finally:
        for h in handles:
            h.remove()
    return ran


def _run_as(spec: QuantSpec | None, done: dict, training: bool) -> QuantSpec | None:
    """The spec an injected module runs in its mode: in eval mode, a stochastic rule replaced by
    its eval_rounding."""
    return spec if training else eval_spec(spec, done.get("eval_rule"))


def _products(done: dict, training: bool) -> str:
    """The report's summary of a module's MACs (one when the three agree, else each named) and of
    its backward products' Operands, those of training or of eval mode."""
    macs = done.get("macs" if training else "eval_macs")
    if macs is None:
        return "-"
    forward, input_grad, weight_grad = macs
    if forward == input_grad == weight_grad:
        text = str(forward)
    else:
        text = f"forward {forward}; input grad {input_grad}; weight grad {weight_grad}"
    for product, other, ops in zip(
        ("input grad", "weight grad"),
        ("weight", "input"),
        done.get("operands" if training else "eval_operands", (None, None)),
    ):
        if ops is not None:
            specs = (("error", ops.error), (other, ops.other))
            parts = [f"{name} {spec or '-'}" for name, spec in specs]
            if ops.transform is not None:
                parts.append(f"transform {ops.transform}")
            text += f"; {product} operands: {', '.join(parts)}"
    return text


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def report(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    example: torch.Tensor | tuple | None = None,
) -> str:
    """What really runs in low precision in ``model``: a table with one row per module that holds a
    quantiser or simulated products (a ``products`` column, shown when some module has MACs, gives
    them) and per module left in full
    precision (leaf modules, modules with parameters of
    their own, and modules an entry decided in which it quantises nothing, flagged "nothing to
    quantise": weight= and bias= take a module's own parameters, and an nn.TransformerEncoderLayer
    has none), then the share of parameter elements fake-quantised, and, with an OptimLP
    ``optimizer``, what the optimizer rounds for each parameter.

    The ``note`` column flags configured quantisers that never run: on modules whose forward their
    parent bypasses (always), and, given ``example`` (a tensor or a plain tuple of positional
    arguments; a tuple of another type, a PackedSequence or a named tuple, is one argument),
    on modules whose forward does not run on it. The example pass runs without gradients, in a
    fork of torch's generators and unobserved, and the buffers it writes (BatchNorm's running
    statistics, the DelayedScalers' state, those of an active lpsim.nn.quantize_functions
    context included) are restored afterwards and the scalers it creates dropped, so it changes
    nothing; each such quantiser also gives a warning.

    Each module's formats are those its current mode runs: for a module in eval mode, a stochastic
    rule shows as the eval_rounding that replaces it (LayerQuantization.eval_rounding).
    """
    _check_model(model)
    ran = _modules_that_run(model, example) if example is not None else None
    specs = lambda entries: ", ".join(sorted({str(s) for _, s in entries})) or "-"  # noqa: E731
    rows = [("module", "type", "weight", "bias", "input", "output", "error", "products", "note")]
    quantised = full = 0
    parametrizing = _parametrization_modules(model)
    for name, module in model.named_modules():
        if id(module) in parametrizing or _is_state(module):
            continue
        done = getattr(module, _STATE, None)
        if done is not None and _active(done):
            note = ""
            if done.get("never_run"):
                note = f"{' and '.join(done['never_run'])} never run: {done['bypassed']}"
            elif done["hooks"] and ran is not None and id(module) not in ran:
                note = "input/output/error never ran on the example: forward not called"
            if note:
                warnings.warn(f"report(): {name or type(module).__name__}: {note}", stacklevel=2)
            quantised += 1
            training = module.training  # its formats as this mode runs them
            rows.append(
                (
                    name or "(model)",
                    done["type"],
                    specs((p, _run_as(spec, done, training)) for p, spec in done["weight"]),
                    specs((p, _run_as(spec, done, training)) for p, spec in done["bias"]),
                    str(_run_as(done["input"], done, training) or "-"),
                    str(_run_as(done["output"], done, training) or "-"),
                    str(_run_as(done["error"], done, training) or "-"),
                    _products(done, training),
                    note,
                )
            )
        elif (
            done is not None
            or _is_leaf(module)
            or any(True for _ in module.parameters(recurse=False))
        ):
            full += 1
            note = "full precision" if done is None else "full precision (nothing to quantise)"
            kind = parametrize.type_before_parametrizations(module).__name__
            rows.append((name or "(model)", kind) + ("-",) * 6 + (note,))
    if all(row[7] == "-" for row in rows[1:]):  # the products column only where MACs are set
        rows = [row[:7] + row[8:] for row in rows]
    lines = _table(rows)
    total = sum(p.numel() for p in model.parameters())
    fake = sum(p.numel() for p in quantized_parameters(model))
    share = f"{100 * fake / total:.1f}%" if total else "-"
    lines.append(
        f"{quantised} modules quantised, {full} in full precision; "
        f"{fake} of {total} parameter elements fake-quantised ({share})"
    )
    if optimizer is not None:
        lines.append("")
        lines.extend(_optimizer_table(model, optimizer))
    return "\n".join(lines)


def _optimizer_table(model: nn.Module, optimizer) -> list[str]:
    settings_of = getattr(optimizer, "parameter_settings", None)
    if settings_of is None:
        return [f"optimizer: {type(optimizer).__name__} rounds nothing (not an OptimLP)"]
    names = {id(p): parameter_name(n) for n, p in model.named_parameters()}
    rows = [("parameter", "weight", "grad", "momentum", "acc")]
    for group in optimizer.param_groups:
        for p in group["params"]:
            s = settings_of(p)
            cells = (
                ("full precision", "", "", "")
                if s is None
                else tuple(str(getattr(s, k) or "-") for k in ("weight", "grad", "momentum", "acc"))
            )
            rows.append((names.get(id(p), "(not in model)"),) + cells)
    return ["optimizer (OptimLP) rounds:"] + _table(rows)
