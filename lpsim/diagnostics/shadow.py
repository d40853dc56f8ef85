"""Shadow mode: a float32 copy of a simulated model run on the same batch, and the per-layer
relative divergence of the simulated model's activations and errors from the copy's, to find the
first layer where a low-precision run departs from full precision.

    shadow = Shadow(model)                       # model: injected by lpsim.nn.inject
    report = shadow.compare(x, loss_fn=lambda out: F.cross_entropy(out, y) * loss_scale)
    print(report.table())
    report.first_divergent(0.1)                  # the first layer whose activations diverge
    report.first_divergent(0.1, kind="error")    # the first, going backward, whose errors do

The *reference* is a deep copy of the model with every quantiser of lpsim.nn.inject and of
lpsim.compat.qtorch's lower() removed and every lpsim.nn.Quantizer module (under each name it is
registered under) replaced by nn.Identity, its floating-point parameters and buffers in float32.
Before every comparison it takes the simulated model's stored parameter values (for a
fake-quantised weight, the unrounded parameter that the parametrisation rounds in each forward
pass, with OptimLP the values the optimizer rounded) and its buffers: "the float32 model on the
same weights", so each comparison measures one step's divergence, not drift accumulated over
training.

For each module call, in the order the calls finish (forward order), the report gives

- the activation divergence ||a_sim - a_ref|| / ||a_ref||: a is the module's output after every
  forward hook, so after the module's own output quantiser (what the next layer receives);
- the error divergence ||e_sim - e_ref|| / ||e_ref||: e is the gradient of the loss with respect
  to the module's output before its output quantiser, so after its error quantiser (what the
  module's backward receives): the gradient that reaches the output from outside the module, not
  that of other readers of the same tensor (a module that returns its input, nn.Identity on a
  residual connection, has the error of its own output only).

Norms are Euclidean over every floating-point tensor of the output (tuples, lists and dicts
included), computed in float64. A zero reference norm gives 0 where the simulated tensor is zero
too and inf otherwise; NaN in either model gives NaN. Where compare() hands a module's output on
(with loss_fn, a copy whose gradient-carrying tensors are clones) and the reference its inputs
(in its dtype), every container keeps its type: named tuples, OrderedDicts and dict subclasses
with attribute access such as HuggingFace's ModelOutput stay what the model returned.

compare() never changes the simulated model: its parameters (restored bit for bit where its
forward writes them in place, as an Embedding with max_norm renormalises rows), their .grad (the
gradients are taken with torch.autograd.grad, which accumulates nothing), its buffers (restored
bit for bit: BatchNorm running statistics, DelayedScaler histories), the modules' training flags,
and the state of torch's generators are as before the call. Its passes are not part of the run: a
lpsim.diagnostics.Recorder attached meanwhile records none of them.

Distributed training (DistributedDataParallel): give Shadow the model inside the wrapper
(``ddp.module``). compare() leaves the run as it was on every rank, and its passes make no
collective of lpsim's (delayed scaling reduces no amax in them), so one rank may compare alone;
through the wrapper, its simulated passes run DDP's forward, whose broadcast of the buffers every
rank must join: compare() on one rank alone then waits for the others until the process group
times out.

Products called as functions (attention's inside F.scaled_dot_product_attention, a matmul):
call compare() inside the lpsim.nn.quantize_functions context that the training runs in. The
simulated model's calls are then quantised as the context says and the reference's are torch's
own (every active context lets them pass, although a context also quantises calls made outside
its model's modules), and the context's delayed scalers are left as they were (histories and
scales bit for bit; no scaler kept for a site first met in compare()), as is its count of the
calls made outside the model's modules: a call of loss_fn's does not shift the site of the run's
later ones.

nn.TransformerEncoder: both passes run with its ``use_nested_tensor`` False, so that given a key
padding mask in eval mode without gradients neither model hands its layers nested tensors, and
both compute every position (torch's nested path pads its result with zeros, which an injected
encoder, kept dense by inject, does not).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from lpsim._observation import recomputing
from lpsim.compat.qtorch.auto_low.auto_low import remove_lowering
from lpsim.nn._hooks import compiled_model, floating_tensors, map_tensors
from lpsim.nn.functions import passing_calls, scalers_kept
from lpsim.nn.inject import injected, own_parametrized_classes, remove, unobserved_pass
from lpsim.nn.quantizer import Quantizer

__all__ = ["Shadow", "ShadowReport", "ModuleDivergence"]

KINDS = ("activation", "error")
DROPOUT_TYPES = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)
# Modules that apply dropout with their attribute ``dropout`` inside their own forward: to the
# attention weights (nn.MultiheadAttention), between stacked layers (nn.RNN, nn.LSTM, nn.GRU).
DROPOUT_PROBABILITY_TYPES = (nn.MultiheadAttention, nn.RNNBase)


@dataclass(frozen=True)
class ModuleDivergence:
    """How far one module call of the simulated model departs from the float32 reference.

    Attributes:
        module: the module's qualified name ("" for the model itself).
        call: which call of the module in the forward pass this is, from 1 (a module used twice
            has two rows).
        type: the module's class name.
        activation_divergence: ||a_sim - a_ref|| / ||a_ref|| of the module's output, a
            non-negative number, inf where the reference is zero and the simulated output is
            not, NaN where either holds NaN; None when the module returned no floating-point
            tensor.
        error_divergence: the same for the gradient of the loss with respect to the module's
            output; None without a loss, or when no gradient reaches the output.
        reference_activation_norm: ||a_ref||, the Euclidean norm of the reference output
            (None as for activation_divergence).
        reference_error_norm: ||e_ref||, the Euclidean norm of the reference error (None as for
            error_divergence).
    """

    module: str
    call: int
    type: str
    activation_divergence: float | None
    error_divergence: float | None
    reference_activation_norm: float | None
    reference_error_norm: float | None

    @property
    def label(self) -> str:
        """The module's name as the table prints it: "(model)" for the model itself, and " #2",
        " #3", ... after the name of a module's second and later calls."""
        name = self.module or "(model)"
        return name if self.call == 1 else f"{name} #{self.call}"


@dataclass(frozen=True)
class ShadowReport:
    """The result of Shadow.compare(): one ModuleDivergence per module call, in forward order
    (the order in which the calls finished), and the two losses.

    Attributes:
        modules: the rows, in forward order.
        simulated_loss: the simulated model's loss (None without loss_fn).
        reference_loss: the float32 reference's loss (None without loss_fn).
    """

    modules: tuple[ModuleDivergence, ...]
    simulated_loss: float | None = None
    reference_loss: float | None = None

    def first_divergent(
        self, threshold: float, kind: str = "activation"
    ) -> ModuleDivergence | None:
        """The first module call whose divergence exceeds ``threshold`` (a NaN divergence always
        does), or None.

        Args:
            threshold: a relative divergence, a non-negative number (0.01 is one percent).
            kind: "activation" searches the activation divergences in forward order; "error"
                searches the error divergences in backward order (the reverse of forward order:
                the errors of the last layers are computed first).

        Raises:
            ValueError: threshold is negative or NaN, or kind is neither "activation" nor "error".
        """
        if not isinstance(threshold, (int, float)) or not threshold >= 0:
            raise ValueError(f"threshold must be a non-negative number, got {threshold!r}")
        if kind not in KINDS:
            raise ValueError(f"kind must be 'activation' or 'error', got {kind!r}")
        rows = self.modules if kind == "activation" else tuple(reversed(self.modules))
        for row in rows:
            value = getattr(row, f"{kind}_divergence")
            if value is not None and not value <= threshold:
                return row
        return None

    def table(self) -> str:
        """The report as plain text: one line per module call in forward order with the
        activation and error divergences and the reference norms ("-" where not measured), then
        the losses."""
        header = ("module", "type", "activation", "error", "|activation|", "|error|")
        rows = [header] + [
            (
                row.label,
                row.type,
                _number(row.activation_divergence),
                _number(row.error_divergence),
                _number(row.reference_activation_norm),
                _number(row.reference_error_norm),
            )
            for row in self.modules
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [_aligned(r, widths) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if self.simulated_loss is not None:
            lines.append(
                f"loss: simulated {_number(self.simulated_loss)}, "
                f"reference {_number(self.reference_loss)}"
            )
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """The report as plain Python values for json.dump: {"simulated_loss", "reference_loss",
        "modules": [one dict per row with the fields of ModuleDivergence]}; the "modules" list
        suits csv.DictWriter. Infinite and NaN divergences stay floats (json writes Infinity and
        NaN)."""
        return {
            "simulated_loss": self.simulated_loss,
            "reference_loss": self.reference_loss,
            "modules": [asdict(row) for row in self.modules],
        }


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _aligned(cells: tuple[str, ...], widths: list[int]) -> str:
    """Names left-aligned, numbers right-aligned."""
    left = [c.ljust(w) for c, w in zip(cells[:2], widths[:2])]
    right = [c.rjust(w) for c, w in zip(cells[2:], widths[2:])]
    return "  ".join(left + right).rstrip()


def _clone_tensors_needing_grad(value):
    """value with every tensor that requires a gradient cloned (the same values)."""
    return map_tensors(value, lambda t: t.clone() if t.requires_grad else t)


class _Recorder:
    """Forward hooks on the named modules of one model that record, per call, the output before
    the other forward hooks (whose gradient is the module's error) and after them (the module's
    activation, detached and copied).

    The error is the gradient of a clone of each output that needs one, the *port*, which only
    the tensor handed on (a clone of the port) reads: so it holds the gradient that flows into
    the output from outside the module alone. The module's own tensor may also be read elsewhere:
    inside the module (an output computed from another, (y, relu(y))), or, where the module
    returns a tensor it was given (nn.Identity, dropout as identity), by the other readers of its
    input (a residual connection); the gradients of those readers are not the module's error. And
    an in-place operation after the module changes the tensor handed on, not the port.

    A forward that activation checkpointing runs again during the backward pass (to recompute
    what it saved) is no call of its modules: the hooks leave it alone."""

    def __init__(self, model: nn.Module, names: list[str], track_errors: bool):
        self.order: list[tuple[str, int]] = []
        self.types: dict[tuple[str, int], str] = {}
        self.activations: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.raw_outputs: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.track_errors = track_errors
        self._calls: dict[str, int] = {}
        self._handles = []
        modules = dict(model.named_modules())
        for name in names:
            module = modules.get(name)
            if module is None:
                continue
            self._handles.append(
                module.register_forward_hook(self._before_other_hooks(name), prepend=True)
            )
            self._handles.append(module.register_forward_hook(self._after_other_hooks(name)))

    def _before_other_hooks(self, name: str):
        def hook(module, args, output):
            if recomputing():  # activation checkpointing's forward, run again in the backward
                return None
            call = self._calls.get(name, 0) + 1
            self._calls[name] = call
            key = (name, call)
            self.order.append(key)
            self.types[key] = parametrize.type_before_parametrizations(module).__name__
            if not self.track_errors:
                return None
            ports = _clone_tensors_needing_grad(output)
            self.raw_outputs[key] = floating_tensors(ports)
            return _clone_tensors_needing_grad(ports)

        return hook

    def _after_other_hooks(self, name: str):
        def hook(module, args, output):
            if recomputing():
                return
            key = (name, self._calls[name])
            self.activations[key] = [t.detach().clone() for t in floating_tensors(output)]

        return hook

    def errors(self, loss: torch.Tensor) -> dict[tuple[str, int], list[torch.Tensor] | None]:
        """The gradient of ``loss`` with respect to every recorded raw output (None for a call
        whose outputs no gradient reaches)."""
        wanted = {}
        for tensors in self.raw_outputs.values():
            for t in tensors:
                if t.requires_grad:
                    wanted[id(t)] = t
        found: dict[int, torch.Tensor | None] = {}
        if loss.requires_grad and wanted:
            try:
                grads = torch.autograd.grad(loss, list(wanted.values()), allow_unused=True)
            except RuntimeError as error:
                if "use_reentrant=True" not in str(error):
                    raise
                raise RuntimeError(
                    "Shadow.compare: the model checkpoints with torch.utils.checkpoint's "
                    "use_reentrant=True, through which torch takes no torch.autograd.grad (the "
                    "errors of the modules' outputs): checkpoint with use_reentrant=False, or "
                    "compare without loss_fn"
                ) from error
            found = dict(zip(wanted, grads))
        errors = {}
        for key, tensors in self.raw_outputs.items():
            grads = [found.get(id(t)) for t in tensors]
            if all(g is None for g in grads):
                errors[key] = None
            else:
                errors[key] = [
                    torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads)
                ]
        return errors

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _squared_norm(tensors: list[torch.Tensor]) -> float:
    return sum(float(t.double().square().sum()) for t in tensors)


def _divergence(
    module: str, simulated: list[torch.Tensor] | None, reference: list[torch.Tensor] | None
) -> tuple[float | None, float | None]:
    """(||simulated - reference|| / ||reference||, ||reference||) over the tensors of one output,
    (None, None) where either side has none."""
    if not simulated or not reference:
        return None, None
    shapes = [tuple(t.shape) for t in simulated], [tuple(t.shape) for t in reference]
    if shapes[0] != shapes[1]:
        raise RuntimeError(
            f"Shadow: module {module or '(model)'!r} returned tensors of shapes {shapes[0]} in the "
            f"simulated model and {shapes[1]} in the reference"
        )
    difference = math.sqrt(
        sum(float((s.double() - r.double()).square().sum()) for s, r in zip(simulated, reference))
    )
    norm = math.sqrt(_squared_norm(reference))
    if math.isnan(difference) or math.isnan(norm):
        return math.nan, norm
    if norm == 0:
        return (0.0 if difference == 0 else math.inf), norm
    return difference / norm, norm


@dataclass
class _Run:
    """What one model's forward (and backward) pass recorded."""

    order: list[tuple[str, int]]
    types: dict[tuple[str, int], str]
    activations: dict[tuple[str, int], list[torch.Tensor]]
    errors: dict[tuple[str, int], list[torch.Tensor] | None]
    loss: float | None


def _run(
    model: nn.Module,
    inputs: tuple,
    names: list[str],
    loss_fn: Callable[..., torch.Tensor] | None,
    generator_devices: list[int],
) -> _Run:
    """Forward (and, given loss_fn, the gradients with respect to every module output) of model on
    inputs, in a fork of torch's generators."""
    recorder = _Recorder(model, names, track_errors=loss_fn is not None)
    try:
        with torch.random.fork_rng(devices=generator_devices):
            if loss_fn is None:
                with torch.no_grad():
                    model(*inputs)
                return _Run(recorder.order, recorder.types, recorder.activations, {}, None)
            with torch.enable_grad():
                loss = _checked_loss(loss_fn(model(*inputs)))
                errors = recorder.errors(loss)
            return _Run(
                recorder.order, recorder.types, recorder.activations, errors, float(loss.detach())
            )
    finally:
        recorder.remove()


def _checked_loss(loss) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        described = (
            f"a {loss.dtype} tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise TypeError(
            f"loss_fn must return a floating-point tensor with one element, got {described}"
        )
    return loss.reshape(())


def _lpsim_parameter_names(model: nn.Module) -> dict[str, str]:
    """{name in model: name in the reference} of the parameters that lpsim.nn.inject
    parametrised ("0.parametrizations.weight.original": "0.weight"), under every name of a module
    registered under several (nn.Sequential(a, shared, b, shared): "1." and "3."), as
    named_parameters(remove_duplicate=False) lists them."""
    done_by_module = {id(module): done for _, module, done in injected(model)}
    names = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        done = done_by_module.get(id(module))
        if done is None:
            continue
        prefix = f"{module_name}." if module_name else ""
        for parameter_name, _ in done["weight"] + done["bias"]:
            if len(module.parametrizations[parameter_name]) > 1:
                continue  # parametrised before inject (weight_norm, ...): so in the reference too
            stored = f"{prefix}parametrizations.{parameter_name}.original"
            names[stored] = f"{prefix}{parameter_name}"
    return names


def _stored_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters (the stored, unrounded values of parametrised ones) and buffers, by
    the names the reference gives them."""
    renamed = _lpsim_parameter_names(model)
    tensors = {
        renamed.get(name, name): p for name, p in model.named_parameters(remove_duplicate=False)
    }
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors


def _replace_quantizers(model: nn.Module) -> nn.Module:
    """model with every lpsim.nn.Quantizer module replaced by nn.Identity (in place; the model
    itself, if a Quantizer, by a new nn.Identity, returned). A Quantizer registered under several
    names is replaced under each of them by one Identity, shared as the Quantizer was."""
    if isinstance(model, Quantizer):
        return nn.Identity()
    identities: dict[int, nn.Identity] = {}
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if name and isinstance(module, Quantizer):
            parent_name, _, child_name = name.rpartition(".")
            identity = identities.setdefault(id(module), nn.Identity())
            setattr(model.get_submodule(parent_name), child_name, identity)
    return model


def _recorded_names(reference: nn.Module) -> list[str]:
    """Qualified names of the modules whose calls compare() records: every module of the
    reference except the parametrisations (which run when a parameter is read, outside the data
    flow)."""
    skipped = [
        name
        for name, module in reference.named_modules()
        if isinstance(module, parametrize.ParametrizationList)
    ]
    return [
        name
        for name, _ in reference.named_modules()
        if not any(name == s or name.startswith(f"{s}.") for s in skipped)
    ]


def _as_arguments(inputs) -> tuple:
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if isinstance(inputs, tuple):
        return inputs
    raise TypeError(
        "inputs must be a tensor or a tuple of the model's positional arguments, got "
        f"{type(inputs).__name__}"
    )


def _cast_floating(value, dtype: torch.dtype | None):
    """value with every floating-point tensor inside it copied (into a new tensor, also where it
    has dtype already), converted to dtype (None: its own), its containers of their own types."""
    return map_tensors(value, lambda t: t.to(dtype or t.dtype, copy=True))


def _cuda_devices(model: nn.Module, inputs: tuple) -> list[int]:
    tensors = [*model.parameters(), *model.buffers(), *floating_tensors(inputs)]
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


class _DropoutOff:
    """Context: dropout modules of the given models in eval mode (identity), and the dropout
    probability that modules holding one apply in their own forward (DROPOUT_PROBABILITY_TYPES)
    0; their training flags and probabilities restored on exit."""

    def __init__(self, *models: nn.Module):
        modules = [m for model in models for m in model.modules()]
        self.modules = [m for m in modules if isinstance(m, DROPOUT_TYPES)]
        self.holders = [m for m in modules if isinstance(m, DROPOUT_PROBABILITY_TYPES)]

    def __enter__(self):
        self.flags = [m.training for m in self.modules]
        self.probabilities = [m.dropout for m in self.holders]
        for m in self.modules:
            m.training = False
        for m in self.holders:
            m.dropout = 0.0

    def __exit__(self, *exception):
        for m, flag in zip(self.modules, self.flags):
            m.training = flag
        for m, probability in zip(self.holders, self.probabilities):
            m.dropout = probability


class _DenseTransformers:
    """Context: the nn.TransformerEncoders of the given models with ``use_nested_tensor`` False,
    restored on exit. Given a key padding mask in eval mode without gradients, an encoder whose
    use_nested_tensor is True hands its layers a nested tensor (no per-module norms can be taken
    of it) and pads its result with zeros where an encoder without (an injected one: inject sets
    it False) computes every position; both models run dense, the same path."""

    def __init__(self, *models: nn.Module):
        self.modules = [
            m for model in models for m in model.modules() if isinstance(m, nn.TransformerEncoder)
        ]

    def __enter__(self):
        self.flags = [m.__dict__.get("use_nested_tensor") for m in self.modules]
        for m in self.modules:
            m.use_nested_tensor = False

    def __exit__(self, *exception):
        for m, flag in zip(self.modules, self.flags):
            if flag is None:
                m.__dict__.pop("use_nested_tensor", None)
            else:
                m.use_nested_tensor = flag


class Shadow:
    """A float32 shadow of a simulated model (see the module docstring).

    Args:
        model: the simulated model: any nn.Module, injected by lpsim.nn.inject, holding
            lpsim.nn.Quantizer modules, lowered by lpsim.compat.qtorch's lower() or
            sequential_lower(), or any of these together. Shadow never changes it. Given
            torch.compile's wrapper, Shadow takes the model it wraps and compare() runs that
            model eagerly, uncompiled: the reports name the modules as the model does ("0", not
            "_orig_mod.0") and equal those of the model before compiling (the errors of the
            modules' outputs, gradients of tensors inside the compiled graph, cannot be taken
            from it); modules compiled inside the model also run eagerly in compare().
        dtype: the floating-point dtype of the reference (torch.float32 by default); its
            floating-point parameters and buffers, and the floating-point inputs it receives,
            are converted to it.

    The reference is made once, by deep copy; after changing the model's structure (injecting
    quantisers into it does not count, its parameters keep their names), make a new Shadow.
    Forward hooks, pre-hooks and parametrisations of the model other than lpsim's quantisers are
    copied with it and run in both models; a DynamicLossScaler that watches the model (or whose
    watch() is a Quantizer's backward hook) records no overflow of compare()'s errors, so that
    compare() cannot make the next training step skip.

    Raises:
        TypeError: model is not an nn.Module, or dtype is not a floating-point torch.dtype.
    """

    def __init__(self, model: nn.Module, *, dtype: torch.dtype = torch.float32):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        self._model = model
        # torch.compile's wrapper: both passes run the model it wraps, eagerly (see the class
        # docstring).
        self._simulated = compiled_model(model) or model
        self._dtype = dtype
        reference = copy.deepcopy(self._simulated)
        reference = remove_lowering(remove(own_parametrized_classes(reference)))
        reference = _replace_quantizers(reference)
        reference.to(dtype)
        for p in reference.parameters():
            p.grad = None
        self._reference = reference
        self._names = _recorded_names(reference)

    @property
    def model(self) -> nn.Module:
        """The simulated model."""
        return self._model

    @property
    def reference(self) -> nn.Module:
        """The reference model: without quantisers, in the Shadow's dtype, holding the values of
        the simulated model's parameters and buffers as of the last compare()."""
        return self._reference

    def compare(
        self,
        inputs: torch.Tensor | tuple,
        loss_fn: Callable[[object], torch.Tensor] | None = None,
        *,
        dropout: bool = False,
    ) -> ShadowReport:
        """Run the simulated model and the reference on the same inputs and report, per module
        call, how far the simulated activations (and, given loss_fn, errors) are from the
        reference's.

        First the reference takes the simulated model's current parameters (stored values),
        buffers and each module's training flag; both then run in that mode (a model in eval
        mode uses its eval_rounding). Both passes start from the state torch's generators (the
        CPU one and those of the CUDA devices the model and the inputs are on) had when
        compare() was called, and on return the generators are back in that state: the
        simulated model's stochastic roundings draw from them as in training, and compare()
        shifts no training stream. The simulated model's buffers (BatchNorm running statistics,
        DelayedScaler histories), which its forward updates, are restored bit for bit, and so
        are the parameters its forward writes in place (the rows of the weight that an
        Embedding or EmbeddingBag with max_norm renormalises, a weight a module normalises in
        place, through .data too); their .grad are never written. The roundings
        of both passes are hidden from an attached lpsim.diagnostics.Recorder, which records
        the training run only.

        Args:
            inputs: the batch: a tensor, or a tuple of the model's positional arguments
                (floating-point tensors among them are converted to the reference's dtype for
                the reference). Each pass reads its own copy of the floating-point tensors: a
                forward that writes its input in place changes neither the other pass's batch nor
                the caller's.
            loss_fn: a function of the model's output returning the loss, a floating-point
                tensor with one element (close over the targets: ``lambda out:
                F.cross_entropy(out, y)``). Include the loss scale the training multiplies the
                loss by, as it decides where the simulated errors underflow. None: forward only,
                no error divergences.
            dropout: False (the default) runs the dropout modules (nn.Dropout and its relatives)
                of both models as identity, and the dropout that nn.MultiheadAttention applies to
                its attention weights and nn.RNN, nn.LSTM and nn.GRU between their layers with
                probability 0, so that the divergence measures rounding alone.
                True runs them as their mode says; their masks then agree only until the
                simulated model's first stochastic rounding, whose random draws the reference
                does not make. Dropout called as a function in a forward is never changed.

        Returns:
            A ShadowReport with one row per call of a module the reference also has (every
            module but the parametrisations, the model itself included; an lpsim.nn.Quantizer
            module, nn.Identity in the reference, has its rows, of type "Quantizer"; the
            quantisers of inject and lower() are hooks, no modules, and have none), in the
            order the calls finished in the simulated model.

        Raises:
            TypeError: inputs is neither a tensor nor a tuple, loss_fn is not callable or
                returns no one-element floating-point tensor, or dropout is not a bool.
            RuntimeError: the model no longer has a parameter or buffer of the reference (its
                structure changed: make a new Shadow), a module's outputs differ in shape
                between the two models, or, given loss_fn, the model checkpoints activations
                with torch.utils.checkpoint's use_reentrant=True (use_reentrant=False is
                compared as the model without checkpointing: the forward it recomputes in the
                backward pass adds no row).
        """
        arguments = _as_arguments(inputs)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
        if not isinstance(dropout, bool):
            raise TypeError(f"dropout must be a bool, got {dropout!r}")
        self._synchronize()
        generator_devices = _cuda_devices(self._simulated, arguments)
        dropout_context = (
            _DropoutOff() if dropout else _DropoutOff(self._simulated, self._reference)
        )
        # compare()'s passes are not the run's: an attached Recorder does not see their roundings
        # (and gets its observer back, at the step it was at, however the passes end), the
        # buffers they write are restored bit for bit and the scalers of tensors first seen here
        # dropped. Modules compiled by torch.compile inside the model run eagerly (the errors,
        # gradients of their modules' outputs, cannot be taken inside a compiled graph). The
        # reference computes every call as torch's own: active quantize_functions contexts (which
        # quantise calls made outside their model's modules too) let its calls pass.
        with (
            unobserved_pass(self._simulated, self._reference),
            scalers_kept(),
            dropout_context,
            _DenseTransformers(self._simulated, self._reference),
            torch.compiler.set_stance("force_eager"),
        ):
            # Each pass reads its own copy of the batch's floating-point tensors: a forward that
            # writes its input in place (an in-place activation first, x.mul_(...)) would
            # otherwise hand the reference the simulated pass's result and change the caller's.
            simulated = _run(
                self._simulated,
                _cast_floating(arguments, None),
                self._names,
                loss_fn,
                generator_devices,
            )
            with passing_calls():
                reference = _run(
                    self._reference,
                    _cast_floating(arguments, self._dtype),
                    self._names,
                    loss_fn,
                    generator_devices,
                )
        return _report(simulated, reference)

    def _synchronize(self) -> None:
        """Copy the simulated model's parameters, buffers and training flags into the
        reference."""
        stored = _stored_tensors(self._simulated)
        with torch.no_grad():
            for kind, named in (
                ("parameter", self._reference.named_parameters(remove_duplicate=False)),
                ("buffer", self._reference.named_buffers(remove_duplicate=False)),
            ):
                for name, tensor in named:
                    if name not in stored:
                        raise RuntimeError(
                            f"Shadow: the model has no {kind} {name!r} any more; its structure "
                            "changed since the Shadow was made: make a new one"
                        )
                    tensor.copy_(stored[name])
        modules = dict(self._simulated.named_modules(remove_duplicate=False))
        for name, module in self._reference.named_modules(remove_duplicate=False):
            if name in modules:
                module.training = modules[name].training


def _report(simulated: _Run, reference: _Run) -> ShadowReport:
    rows = []
    for key in simulated.order:
        name, call = key
        activation, activation_norm = _divergence(
            name, simulated.activations.get(key), reference.activations.get(key)
        )
        error, error_norm = _divergence(name, simulated.errors.get(key), reference.errors.get(key))
        rows.append(
            ModuleDivergence(
                module=name,
                call=call,
                type=simulated.types[key],
                activation_divergence=activation,
                error_divergence=error,
                reference_activation_norm=activation_norm,
                reference_error_norm=error_norm,
            )
        )
    return ShadowReport(tuple(rows), simulated.loss, reference.loss)
