"""Quantising what is not a module: matrix products, softmax and attention called as functions.

inject hooks modules, so the products a model computes by calling functions (q @ k^T and p @ v
inside ``F.scaled_dot_product_attention``, a ``torch.matmul`` in a forward method, a softmax) are
invisible to it. ``quantize_functions`` sees them: a context manager (a
``torch.overrides.TorchFunctionMode``) that, while active, quantises the operands and results of
the calls its config selects and runs their products under MACs:

    config = {
        "attention.scores": LayerQuantization(input=e4m3, weight=e4m3, error=e5m2, mac=hopper),
        "attention.context": LayerQuantization(input=e4m3, weight=e4m3, error=e5m2),
        ("softmax", "blocks.0.*"): LayerQuantization(output=bf16),
    }
    functions = lpsim.nn.quantize_functions(model, config)
    with functions:
        loss = criterion(model(x), y)
    loss.backward()          # error formats and backward MACs are in the autograd graph already

Keys are an op name, or a pair (op name, module selector). The selectors are inject's (module
types, glob patterns on qualified names relative to ``model``, callables (name, module) -> bool,
tuples of these); a pair applies to calls made while a module it selects is running (the module
itself, its forward pre-hooks and forward hooks included, or any module inside it; a module
registered under several names, shared by two parents, is selected by any of them, as in
inject). A selector that matches no module of the model is an
error, as in inject; a key that has decided no call when the context exits (its op never called
while its modules ran: a module whose parent uses its weights without calling it, say) is
warned of once (a UserWarning). Each call is decided by the first entry, in the
mapping's order, whose op and selector match it; a call no entry matches is torch's own. Values
are ``LayerQuantization``; a field an op does not take is an error.

The ops and what LayerQuantization's fields mean for them:

- ``"matmul"``: ``torch.matmul`` and its alias ``torch.linalg.matmul``, ``torch.mm``,
  ``torch.bmm``, their Tensor methods and the ``@`` operator (``__matmul__``, and
  ``b.__rmatmul__(a)``, which is a @ b). ``input`` and ``weight`` are the first and second
  operands' formats (quantised before the product, straight-through gradient), ``output`` the
  result's, ``error`` the gradient arriving at the result; ``mac``, ``input_grad_mac`` and
  ``weight_grad_mac`` the forward product and the gradients of the first and second operands, as
  lpsim.nn.functional.matmul computes them (its docstring states the terms and their order);
  ``input_grad_operands`` and ``weight_grad_operands`` the operands of those two backward
  products (an lpsim.nn.functional.Operands: quantised afresh from the unquantised operands and
  error).
  Each format applies to its tensor as the call passes it: the first operand is (M, K), the second
  (K, N), so a scaled format whose blocks run along the reduction axis K, as MX and block-scaled
  FP8 hardware scales them, has axis=-1 on the first operand and axis=-2 on the second (with -1,
  its blocks run along N); the error (M, N) has N, the input gradient's reduction, last.
- ``"linear"``: ``torch.nn.functional.linear`` (nn.Linear's forward): the fields of ``"matmul"``
  plus ``bias``; the bias is added as lpsim.nn.functional.linear adds it. The weight is
  (out_features, in_features): axis=-1 runs along the reduction.
- ``"softmax"``: ``torch.softmax``, ``torch.nn.functional.softmax`` (nn.Softmax's forward),
  ``Tensor.softmax`` and ``torch.special.softmax``: ``input``, ``output``, ``error``. With
  ``dtype=``, the input is cast to dtype, as torch casts it before the softmax, and then rounded
  by the input format (in the dtype the softmax computes in); the result has dtype. A -inf input
  is a masked position, which takes no part in the softmax: it stays -inf, and the input format
  rounds the other entries as if it were a zero (no amax, block scale or random word sees it), so
  that a format without Inf neither makes a mask leak (saturated to its largest negative value)
  nor turns it into NaN.
- ``"attention.scores"``, ``"attention.softmax"``, ``"attention.context"``: the three steps of
  attention (the scores q k^T, their softmax, the context p v), as ``"matmul"`` and ``"softmax"``
  take them; where no entry names them, the ``"matmul"`` and ``"softmax"`` entries decide them.
  The second operands are k^T (head_dim, keys) and v (keys, head_dim): axis=-2 runs along the
  reduction in both.

Attention is computed step by step where an entry decides one of its steps (else it is torch's
fused kernel):

- ``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)``:
  s = q k^T (the scores product: input q, weight k^T, K = head_dim), then s * scale (scale defaults
  to 1 / sqrt(head_dim)), in the scores' dtype, as the FP8 attention kernels apply it after their
  product; the causal mask (positions j > i get -inf) and attn_mask (a bool mask's False as -inf,
  else added: bool, float32 or the query's dtype, as torch takes it; a float32 mask is added to
  lower-precision scores as torch's in-place addition adds it, the sum rounded once to the scores'
  dtype; a torch.nn.attention.bias.CausalBias, causal_upper_left's or causal_lower_right's, is the
  bool mask it stands for, as torch applies it); softmax over the keys in the scores' dtype (a row
  of scores that are all -inf, a query no key takes part in, gives weights 0 with zero gradients, as
  torch's kernels give, not softmax's NaN); dropout with ``dropout_p`` (torch's F.dropout: other
  random draws than torch's fused kernels); the context product p v (K = the keys). With enable_gqa
  each key and value head serves its group of query heads as in torch, quantised once: the products
  broadcast it over the group (torch repeats it; a stochastic rule would round each copy its own
  way), their operands and results having the heads split into (key heads, group) for the scores
  and (value heads, group) for the context, each of k and v grouped by its own head count as torch
  repeats it, and k and v a group axis of size 1 (a format's negative axis is unchanged).
- ``F.multi_head_attention_forward`` (nn.MultiheadAttention, nn.TransformerEncoderLayer and
  nn.TransformerDecoderLayer call it): lpsim.nn.functional.multi_head_attention_forward, whose
  in and out projections are ``"linear"`` calls and whose attention steps are the three above
  (q scaled by 1 / sqrt(head_dim) before the scores product, as torch does). The out projection
  is made as if the attention's ``out_proj`` ran (nn.MultiheadAttention passes its weight and
  bias instead of calling it): a key selecting out_proj decides it, at out_proj's sites.

torch's function modes are per thread: the calls made in another thread are torch's own, and
the modules that thread runs are not running modules of the calls of the thread that entered
the context.

Calls made directly by a module that inject gave MACs (an injected Linear, Conv or
MultiheadAttention) are left to inject. Rules: bare formats use the LayerQuantization's
``rounding``; while the innermost running module (or, outside the model's modules, the model) is
in eval mode, its ``eval_rounding`` replaces stochastic rules, as in inject. Stochastic roundings
draw their seeds from torch's default generator, as lpsim.quantize does.

A DelayedScaling format keeps one amax history per call site: the entry, the innermost running
module, the op, the field, and the call's rank among that op's calls in the module's current
forward (the second softmax of a block is another site than the first). A call made outside the
model's modules has sites of its own, apart from the calls of the model's own forward, and is
ranked among such calls since the context was entered: enter the context once per step, as above,
for it to keep one site; in a loop inside one ``with`` it gets a new site, and a fresh history, at
every step. The scalers (lpsim's DelayedScaler) are created at a site's first call, on its tensor's
device, and live in the context's ``scalers`` (an nn.ModuleDict); ``state_dict()`` and
``load_state_dict()`` save and restore them (loading creates the scalers it names, on the
model's device), so that a resumed run continues their histories. In eval mode they quantise
without recording. Under torch.compile, the scaler of an error must exist before the compiled
model's first call, as the backward pass updates it and a compiled graph cannot update state made
inside its own forward (torch.compile fails there, in aot_autograd's partitioner): run one step
eagerly, or load a state_dict, first. (inject() makes its scalers outside the traced graph, and
needs neither.)

mm and bmm keep their shape rules (two matrices; two 3-D tensors of one batch size): other shapes
are refused with a ValueError, not computed as a broadcasting matmul. Products of integer (or bool)
tensors are torch's own, exact, and not counted as calls of a site. A format that would apply to a
complex operand or result is refused with a TypeError naming the field (lpsim's formats round no
complex tensor). Under the ``@`` operator, a TypeError the simulation raises (a float64 operand
under a non-native MAC, say) reaches the caller as Python's "unsupported operand type(s) for @",
since torch turns it into NotImplemented; ``torch.matmul`` shows its message. Where two contexts
are active, a call is decided by the innermost one that selects it, once: the calls its simulation
makes (the product of its quantised operands, the attention steps it selects) are not seen by the
contexts further out, and the calls it does not select, an attention's projections or steps inside
its simulation of that attention included, are decided by the contexts further out as the model's
own calls. Nested contexts thus act as one whose entries are the inner's, then the outer's.

Activation checkpointing (torch.utils.checkpoint, reentrant or not) recomputes a forward during
the backward pass, where no TorchFunctionMode is active, this context's included (inside its
``with`` or not): the recomputed calls are torch's own, unquantised, and the gradients are those
of the unquantised recomputation, not of the quantised forward. Checkpoint no function or module
whose calls a context quantises.

Not simulated: calls with ``out=`` (refused). Every other function is torch's own, unquantised,
even where it computes the same products: einsum, addmm, addbmm, baddbmm, mv, dot, inner,
tensordot, linalg.multi_dot; log_softmax and softmin; convolutions (through inject). The matrix
product of lpsim.RandomHadamard's apply and inverse is the transform's own arithmetic, which no
context sees, as are the products of an lpsim.nn.functional function whose products are not all
native (one whose are is torch's op, decided as the model's call). While a context is active,
torch's own calls are those of its non-fused paths: nn.MultiheadAttention and
nn.TransformerEncoderLayer in eval mode without gradients take their fused fast path only where no
TorchFunctionMode is active (torch checks), so an attention no entry selects gives the bits of
their other path, which may differ in the last place; and nn.TransformerEncoder given a
src_key_padding_mask, whose fast path runs a nested tensor and returns zeros at the padded
positions, returns there what its other path computes for them.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import CausalBias, CausalVariant
from torch.overrides import TorchFunctionMode

from lpsim.delayed_scaling import DelayedScaling
from lpsim.mac import MAC
from lpsim.nn import _hooks
from lpsim.nn import functional as _functional
from lpsim.nn.functional import OperandSpecs
from lpsim.nn.inject import LayerQuantization, simulates_products
from lpsim.nn.quantizer import QuantSpec, ScalerCall, parse_eval_rounding, quantizing_function
from lpsim.nn.selectors import check_selector, module_names, selects

__all__ = ["quantize_functions", "FunctionQuantization", "OPS"]

_PRODUCT_FIELDS = (
    "input",
    "weight",
    "output",
    "error",
    "mac",
    "input_grad_mac",
    "weight_grad_mac",
    "input_grad_operands",
    "weight_grad_operands",
)
_SOFTMAX_FIELDS = ("input", "output", "error")
# Each op and the LayerQuantization fields it takes.
OPS: dict[str, tuple[str, ...]] = {
    "matmul": _PRODUCT_FIELDS,
    "linear": (*_PRODUCT_FIELDS, "bias"),
    "softmax": _SOFTMAX_FIELDS,
    "attention.scores": _PRODUCT_FIELDS,
    "attention.softmax": _SOFTMAX_FIELDS,
    "attention.context": _PRODUCT_FIELDS,
}
_FALLBACK = {
    "attention.scores": "matmul",
    "attention.softmax": "softmax",
    "attention.context": "matmul",
}
_ATTENTION = ("attention.scores", "attention.softmax", "attention.context")
_SETTINGS_FIELDS = ("weight", "bias", "input", "output", "error")
_MAC_FIELDS = ("mac", "input_grad_mac", "weight_grad_mac")
_OPERANDS_FIELDS = ("input_grad_operands", "weight_grad_operands")

_MATMUL_FUNCTIONS = (
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.Tensor.matmul,
    torch.Tensor.mm,
    torch.Tensor.bmm,
    torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__,
    torch.linalg.matmul,
)
_SOFTMAX_FUNCTIONS = (torch.softmax, F.softmax, torch.Tensor.softmax, torch.special.softmax)
# Where each softmax function takes ``dtype`` positionally (the others: (input, dim, dtype)).
_SOFTMAX_DTYPE_POSITION = {F.softmax: 3}
# The context whose simulation of a call is running: the calls its implementation makes (the
# product of quantised operands, a softmax, attention's steps) are its own, and another
# quantize_functions context further out on torch's mode stack lets them pass. passing_calls()
# sets it to itself, which no context is: every context lets every call pass.
_CLAIMED: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "lpsim_claimed_by", default=None
)
# The contexts entered and not yet left, innermost last.
_ACTIVE: list[FunctionQuantization] = []
# The module part of the sites of calls made outside the model's modules (the model's own calls
# have the name ""; attribute names hold no "<").
_OUTSIDE = "<outside>"
_MM_FUNCTIONS = (torch.mm, torch.Tensor.mm)
_BMM_FUNCTIONS = (torch.bmm, torch.Tensor.bmm)


def _check_shapes(func, a, b) -> None:
    """mm's and bmm's own shape rules, which torch.matmul (the simulated product) does not
    enforce: mm takes two matrices, bmm two 3-D tensors with the same batch size (no
    broadcasting, no vectors).

    Raises:
        ValueError: the operands break the rule of ``func``.
    """
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return
    if func in _MM_FUNCTIONS and (a.dim() != 2 or b.dim() != 2):
        raise ValueError(
            f"quantize_functions: mm takes two matrices (M, K) and (K, N), got "
            f"{tuple(a.shape)} and {tuple(b.shape)}"
        )
    if func in _BMM_FUNCTIONS and (a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0]):
        raise ValueError(
            f"quantize_functions: bmm takes (B, M, K) and (B, K, N) with one batch size B, got "
            f"{tuple(a.shape)} and {tuple(b.shape)}"
        )


class _Arithmetic(NamedTuple):
    """What one entry does in one mode (training or eval): field -> QuantSpec, the three MACs
    (None: torch's products) and the backward products' (input grad, weight grad) operands (None:
    the forward's operands)."""

    specs: dict[str, QuantSpec]
    macs: tuple[MAC, MAC, MAC] | None
    operands: tuple[OperandSpecs | None, OperandSpecs | None] | None = None


class _Entry(NamedTuple):
    op: str
    selector: object  # None: any call
    train: _Arithmetic
    eval: _Arithmetic


class _Decision(NamedTuple):
    """What one call does: ``how`` by the entry at ``index`` of the config, and the call's site
    (where a DelayedScaling keeps its history)."""

    index: int
    how: _Arithmetic
    site: str
    training: bool


def _parse_key(key) -> tuple[str, object]:
    """(op, selector) of a config key.

    Raises:
        ValueError: an unknown op name.
        TypeError: a key that is neither an op name nor an (op name, selector) pair.
    """
    if isinstance(key, str):
        op, selector = key, None
    elif isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str):
        op, selector = key
        check_selector(selector)
    else:
        raise TypeError(
            f"quantize_functions: config keys are op names or (op name, module selector) pairs, "
            f"got {key!r}"
        )
    if op not in OPS:
        raise ValueError(f"quantize_functions: unknown op {op!r}; the ops are {sorted(OPS)}")
    return op, selector


def _entry(key, settings) -> _Entry:
    """The validated entry of one config item.

    Raises:
        TypeError: settings is not a LayerQuantization.
        ValueError: settings sets a field the op does not take.
    """
    op, selector = _parse_key(key)
    if not isinstance(settings, LayerQuantization):
        raise TypeError(
            f"quantize_functions: the value of {key!r} must be a LayerQuantization, got "
            f"{type(settings).__name__}"
        )
    for name in (*_SETTINGS_FIELDS, *_MAC_FIELDS, *_OPERANDS_FIELDS):
        if getattr(settings, name) is not None and name not in OPS[op]:
            raise ValueError(
                f"quantize_functions: {op!r} takes the fields {', '.join(OPS[op])}; the entry "
                f"{key!r} sets {name}"
            )
    specs = {name: settings.spec(name) for name in _SETTINGS_FIELDS}
    specs = {name: spec for name, spec in specs.items() if spec is not None}
    eval_rule = parse_eval_rounding(settings.eval_rounding)
    macs = settings.macs()
    eval_specs = {name: spec.for_eval(eval_rule) for name, spec in specs.items()}
    eval_macs = None if macs is None else tuple(m.for_eval(eval_rule) for m in macs)
    return _Entry(
        op,
        selector,
        _Arithmetic(specs, macs, settings.operands()),
        _Arithmetic(eval_specs, eval_macs, settings.operands(for_eval=True)),
    )


def _inert(*args) -> None:
    """What a context's hook is in a deep copy of its model."""


def _inert_hook() -> Callable:
    """What an unpickled _Hook is."""
    return _inert


class _Hook:
    """A hook of a context on its model's modules. A deep copy of the model made while the
    context is active (lpsim.diagnostics.Shadow's reference, an EMA copy), and one pickled then
    (torch.save of the whole model, a model sent to a worker process), gets an inert hook: its
    modules are not the context's model's, and running them must not enter its running stack."""

    def __init__(self, function: Callable):
        self.function = function

    def __call__(self, *args):
        return self.function(*args)

    def __deepcopy__(self, memo) -> Callable:
        return _inert

    def __reduce__(self) -> tuple:
        return _inert_hook, ()


class FunctionQuantization(TorchFunctionMode):
    """The context ``quantize_functions`` returns (see the module docstring). It can be entered
    any number of times, one at a time; each entry registers forward hooks on the model's modules
    (to know which module a call runs under) and each exit removes them."""

    def __init__(self, model: nn.Module, entries: list[_Entry]):
        super().__init__()
        self.model = model
        self.entries = entries
        self.scalers = nn.ModuleDict()  # site -> DelayedScaler (see the module docstring)
        self._running: list[tuple[str, nn.Module, dict]] = []  # name, module, calls per op
        self._outside: dict[str, int] = {}  # calls per op made outside the model's modules
        self._hooks: list = []
        # Per entry, the modules its selector selects (None: any call), found on entering.
        self._selects: list[tuple[nn.Module, ...] | None] = []
        self._active = False
        self._thread: int | None = None  # the thread that entered the context
        # Per entry, whether it has decided a call since the context was made, or been warned of
        # not having done so (stored, never read while a call is traced, so that torch.compile
        # installs no guard on it).
        self._settled = [False] * len(entries)
        # Per entry index, the backward hooks its error quantiser applies to the gradient before
        # rounding it (DynamicLossScaler.watch_functions).
        self._error_hooks: dict[int, tuple[Callable, ...]] = {}

    # -- entering and leaving --------------------------------------------------------------
    def __enter__(self):
        if self._active:
            raise RuntimeError("quantize_functions: this context is already active")
        names = module_names(self.model)
        modules = {id(m): m for _, m in self.model.named_modules(remove_duplicate=False)}
        # Before the context counts as active: a predicate that raises leaves it as it was.
        self._selects = [
            None
            if entry.selector is None
            else tuple(
                modules[key]
                for key, aliases in names.items()
                if selects(entry.selector, aliases, modules[key], "quantize_functions")
            )
            for entry in self.entries
        ]
        self._active = True
        self._thread = threading.get_ident()
        self._outside.clear()
        for name, module in self.model.named_modules():
            entering, leaving = _Hook(self._entering(name)), _Hook(self._leaving)
            # The module runs from before its first forward pre-hook to after its last forward
            # hook: the calls its hooks make are made while it runs.
            self._hooks.append(module.register_forward_pre_hook(entering, prepend=True))
            self._hooks.append(module.register_forward_hook(leaving, always_call=True))
        entered = super().__enter__()
        _ACTIVE.append(self)
        return entered

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            for handle in self._hooks:
                handle.remove()
            self._hooks.clear()
            self._running.clear()
            self._active = False
            if exc[0] is None:
                self._warn_undecided()

    def _warn_undecided(self) -> None:
        """Warns, once per entry, of the entries that have decided no call since the context was
        made: a key whose op its modules never call, or whose modules never run (a parent that
        uses a child's weights without calling it, a module inject gave MACs), quantises nothing."""
        for index, entry in enumerate(self.entries):
            if self._settled[index]:
                continue
            self._settled[index] = True
            key = entry.op if entry.selector is None else (entry.op, entry.selector)
            where = "" if entry.selector is None else " while a module its selector selects runs"
            warnings.warn(
                f"quantize_functions: the key {key!r} has decided no call: no {entry.op!r} "
                f"call was made{where} (outside modules inject gave MACs), so it quantised "
                "nothing",
                stacklevel=3,
            )

    def _entering(self, name: str):
        def push(module, args):
            if self._this_thread():
                self._running.append((name, module, {}))

        return push

    def _this_thread(self) -> bool:
        """Whether a hook runs in the thread that entered the context: modules run by other
        threads, where torch's function modes (this one) are not active and their calls are
        torch's own, are not running modules of this thread's calls. (Under torch.compile, whose
        tracing cannot call threading.get_ident, a hook is taken as this thread's.)"""
        return torch.compiler.is_compiling() or threading.get_ident() == self._thread

    def _leaving(self, module, args, output):
        if not self._this_thread():
            return
        if self._running and self._running[-1][1] is module:
            self._running.pop()

    # -- choosing --------------------------------------------------------------------------
    def _left_to_inject(self) -> bool:
        """Whether the innermost running module is one whose products inject simulates."""
        return bool(self._running) and simulates_products(self._running[-1][1])

    def _stack(self) -> list[tuple[str, nn.Module, dict]]:
        """The running modules, innermost last. Inside the out projection of a simulated
        multi-head attention, the attention's ``out_proj`` counts as running inside it, as if its
        forward had been called (nn.MultiheadAttention passes its weight and bias to the function
        instead): a key that selects it decides the projection, whose site is its own."""
        child = _hooks.submodule_name()
        if child is None or not self._running:
            return self._running
        name, module, _ = self._running[-1]
        submodule = getattr(module, child, None)
        if not isinstance(submodule, nn.Module):
            return self._running
        return [*self._running, (f"{name}.{child}" if name else child, submodule, {})]

    def _selected(self, op: str) -> int | None:
        """The index of the first entry that decides a call of ``op`` made now. (Modules are
        compared by identity, not looked up by id(), which torch.compile cannot trace here.)"""
        running = self._stack()
        for index, entry in enumerate(self.entries):
            if entry.op != op:
                continue
            selects = self._selects[index]
            if selects is None or any(
                module is selected for _, module, _ in running for selected in selects
            ):
                return index
        return None

    def _entry_index(self, op: str) -> int | None:
        """_selected, the attention steps falling back to "matmul" and "softmax" (None: torch's
        own, or a call inject decides)."""
        if self._left_to_inject():
            return None
        index = self._selected(op)
        if index is None and op in _FALLBACK:
            index = self._selected(_FALLBACK[op])
        return index

    def decide(self, op: str) -> _Decision | None:
        """What the config prescribes for a call of ``op`` made now (None: torch's own); counts
        the call for its site."""
        index = self._entry_index(op)
        if index is None:
            return None
        self._settled[index] = True
        if self._running:
            name, module, calls = self._stack()[-1]
            where, training = name.replace(".", "/"), module.training
        else:  # not the model's own calls, whose module name "" is the model's
            where, training, calls = _OUTSIDE, self.model.training, self._outside
        rank = calls.get(op, 0)
        calls[op] = rank + 1
        entry = self.entries[index]
        site = f"{index}:{where}:{op.replace('.', '/')}:{rank}"
        return _Decision(index, entry.train if training else entry.eval, site, training)

    def _quantiser(self, decision: _Decision, field: str, x: torch.Tensor):
        """The QuantSpec, or for a DelayedScaling the ScalerCall of the call's site (its scaler
        created on x's device), that quantises ``field`` of the call, the tensor x (None: not
        quantised).

        Raises:
            TypeError: x is complex and the field has a format, which would round nothing.
        """
        spec = decision.how.specs.get(field)
        if spec is not None and x.is_complex():
            op = self.entries[decision.index].op
            raise TypeError(
                f"quantize_functions: the {field} of a {op!r} call is a {x.dtype} tensor, which "
                "lpsim's formats do not round (quantise torch.view_as_real of it inside the "
                f"model instead, or give {field} no format)"
            )
        if spec is None or not isinstance(spec.format, DelayedScaling):
            return spec
        scaler = self._scaler(f"{decision.site}:{field}", x.device)
        return ScalerCall(scaler, spec.rounding, decision.training)

    def _quantise(self, decision: _Decision, field: str, x):
        """x quantised as ``field`` of the call prescribes (straight-through gradient); x itself
        where it is not, or is not a floating-point tensor (a complex one is refused: see
        _quantiser)."""
        if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.is_complex()):
            return x
        quantiser = self._quantiser(decision, field, x)
        return x if quantiser is None else quantizing_function(quantiser, None)(x)

    def _scaler(self, key: str, device: torch.device | None = None):
        """The DelayedScaler of a site and field (created on first use).

        Raises:
            KeyError: the key names no DelayedScaling field of the config.
        """
        if key not in self.scalers:
            index, field = key.split(":")[0], key.split(":")[-1]
            if not index.isdigit() or int(index) >= len(self.entries):
                raise KeyError(f"quantize_functions: no entry {index!r} in the key {key!r}")
            spec = self.entries[int(index)].train.specs.get(field)
            if spec is None or not isinstance(spec.format, DelayedScaling):
                raise KeyError(f"quantize_functions: no DelayedScaling {field} at {key!r}")
            self.scalers[key] = spec.format.scaler(device)
        return self.scalers[key]

    def _result(self, y: torch.Tensor, decision: _Decision) -> torch.Tensor:
        """y quantised by the output format, its gradient by the error format."""
        output = self._quantiser(decision, "output", y)
        error = self._quantiser(decision, "error", y)
        if output is None and error is None:
            return y
        hooks = self._error_hooks.get(decision.index, ()) if error is not None else ()
        return quantizing_function(output, error, backward_hooks=hooks)(y)

    def state_dict(self) -> dict:
        """The DelayedScalers' states, by site."""
        return {key: scaler.state_dict() for key, scaler in self.scalers.items()}

    def load_state_dict(self, state: Mapping[str, dict]) -> None:
        """Restore the scalers ``state`` names, creating the missing ones on the model's device
        (that of its first parameter or buffer; the saved state's for a model without any), where
        its calls will quantise: a checkpoint loaded onto the CPU (``map_location="cpu"``) resumes
        a run on a GPU. An existing scaler keeps its device.

        Raises:
            KeyError: a site that names no DelayedScaling field of this config.
        """
        tensors = (*self.model.parameters(), *self.model.buffers())
        for key, scaler_state in state.items():
            device = tensors[0].device if tensors else scaler_state["scale"].device
            self._scaler(key, device).load_state_dict(scaler_state)

    # -- the ops -------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        claimed = _CLAIMED.get()
        if claimed is not None and claimed is not self:  # inside another context's simulation
            return func(*args, **kwargs)
        if func in _MATMUL_FUNCTIONS:
            return self._matmul(func, args, kwargs)
        if func is F.linear:
            return self._linear(args, kwargs)
        if func in _SOFTMAX_FUNCTIONS:
            return self.softmax(_hooks.function_name() or "softmax", func, args, kwargs)
        if func is F.scaled_dot_product_attention:
            return self._scaled_dot_product_attention(func, args, kwargs)
        if func is F.multi_head_attention_forward:
            return self._multi_head_attention(func, args, kwargs)
        return func(*args, **kwargs)

    def _product(self, decision: _Decision, a, b, bias=None, linear: bool = False):
        """a @ b (or linear(a, b, bias)) with the operands, the result and the products as the
        call's decision prescribes."""
        unquantised = (a, b)
        a, b = self._quantise(decision, "input", a), self._quantise(decision, "weight", b)
        bias = self._quantise(decision, "bias", bias)
        macs, operands = decision.how.macs, decision.how.operands
        how = _functional.Arithmetic(
            *(macs or (_functional.NATIVE,) * 3), None, None, None, *(operands or (None, None))
        )
        with self._claimed():
            if how.native:
                y = F.linear(a, b, bias) if linear else torch.matmul(a, b)
            elif linear:
                y = _functional.simulated_linear(a, b, bias, how, unquantised)
            else:  # the backward products' Operands quantise the unquantised operands
                y = _functional.simulated_matmul(a, b, how, unquantised)
        return self._result(y, decision)

    def _product_decision(self, op: str, args: tuple, kwargs: dict) -> _Decision | None:
        """decide(op) for a product call; None, torch's own and not counted as a call of a site,
        where an operand is an integer (or bool) tensor: torch computes it exactly."""
        if any(_integer(t) for t in (*args, *kwargs.values())):
            return None
        return self.decide(op)

    def _matmul(self, func, args, kwargs):
        op = _hooks.function_name() or "matmul"
        decision = self._product_decision(op, args, kwargs)
        if decision is None:
            return self._passed_on(op, func, args, kwargs)
        second = "mat2" if func in (*_MM_FUNCTIONS, *_BMM_FUNCTIONS) else "other"
        # operands given by torch's names (input: a method's self); out=None is no out tensor
        rest = {k: v for k, v in kwargs.items() if not (k == "out" and v is None)}
        names = ("input", second)[len(args) :]
        operands = (*args, *(rest.pop(name) for name in names if name in rest))
        if len(operands) != 2 or rest:
            raise ValueError(
                f"quantize_functions: {func.__name__} is simulated with its two operands only, "
                f"got {len(args)} positional arguments and keywords {sorted(kwargs)}"
            )
        if func is torch.Tensor.__rmatmul__:  # self.__rmatmul__(other) is other @ self
            operands = operands[::-1]
        _check_shapes(func, *operands)
        return self._product(decision, *operands)

    def _linear(self, args, kwargs):
        decision = self._product_decision("linear", args, kwargs)
        if decision is None:
            return self._passed_on("linear", F.linear, args, kwargs)
        bound = dict(zip(("input", "weight", "bias"), args), **kwargs)
        return self._product(decision, bound["input"], bound["weight"], bound.get("bias"), True)

    def softmax(self, op: str, func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
        """func(*args, **kwargs), a softmax, with its input and result as the config prescribes
        for ``op`` ("softmax" or "attention.softmax"). With ``dtype``, the input is cast to it
        before its rounding, as torch casts it before the softmax: the input format rounds in the
        dtype the softmax computes in."""
        decision = self.decide(op)
        if decision is None:
            return self._passed_on(op, func, args, kwargs)
        if kwargs.get("out") is not None:  # torch would write the unquantised result there
            raise ValueError(
                f"quantize_functions: {getattr(func, '__name__', func)} with out= is not "
                "simulated (its out tensor would hold the unquantised result): call it without "
                "out= and copy the result"
            )
        position = _SOFTMAX_DTYPE_POSITION.get(func, 2)
        dtype = kwargs.get("dtype", args[position] if len(args) > position else None)
        if args:
            x, args = args[0], args[1:]
        else:  # torch.softmax(input=x, dim=d)
            kwargs = dict(kwargs)
            x = kwargs.pop("input")
        if dtype is not None and isinstance(x, torch.Tensor):
            x = x.to(dtype)
        x = self._softmax_input(decision, x)
        with self._claimed():
            y = func(x, *args, **kwargs)
        return self._result(y, decision)

    def _softmax_input(self, decision: _Decision, x):
        """A softmax's input quantised by the call's input format, its -inf entries (masked
        positions, which take no part in the softmax) kept -inf and left out of the rounding: a
        format without Inf would make them finite (a causal mask would leak) or NaN, and their
        magnitude would make a scaled format's scale NaN. They are rounded as zeros, which no
        amax, block scale or random word notices, and then set back to -inf."""
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return x
        if decision.how.specs.get("input") is None:
            return x
        masked = x == float("-inf")  # no data-dependent branch, which torch.compile would break at
        kept = self._quantise(decision, "input", x.masked_fill(masked, 0.0))
        return kept.masked_fill(masked, float("-inf"))

    def product(self, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b with the operands, the result and the products as the config prescribes for
        ``op``."""
        decision = self.decide(op)
        if decision is None:
            return self._passed_on(op, torch.matmul, (a, b), {})
        return self._product(decision, a, b)

    def _simulates_attention(self, ops) -> bool:
        return any(self._entry_index(op) is not None for op in ops)

    def _scaled_dot_product_attention(self, func, args, kwargs):
        if not self._simulates_attention(_ATTENTION):
            return self._passed_on(None, func, args, kwargs)
        with self._claimed():
            return scaled_dot_product_attention(self, *args, **kwargs)

    def _multi_head_attention(self, func, args, kwargs):
        with _hooks.submodule_call("out_proj"):
            out_projection = self._entry_index("linear") is not None
        if not (out_projection or self._simulates_attention((*_ATTENTION, "linear"))):
            return self._passed_on(None, func, args, kwargs)
        with self._claimed(), self._reentered():
            return _functional.multi_head_attention_forward(*args, **kwargs)

    def _passed_on(self, op: str | None, func: Callable, args: tuple, kwargs: dict):
        """func(*args, **kwargs), a call this context does not select (of ``op``, None: an
        enclosing call), made as the model made it: a context further out decides it as if this
        one were not entered, even inside this context's simulation of an enclosing call, whose
        own calls that context lets pass. Nested contexts thus act as one whose entries are the
        inner's, then the outer's."""
        token = _CLAIMED.set(None)
        try:
            with _hooks.named_function(op) if op is not None else contextlib.nullcontext():
                return func(*args, **kwargs)
        finally:
            _CLAIMED.reset(token)

    @contextlib.contextmanager
    def _claimed(self) -> Iterator[None]:
        """The calls made inside are this context's implementation of a call it simulates:
        another quantize_functions context further out lets them pass (see _CLAIMED)."""
        token = _CLAIMED.set(self)
        try:
            yield
        finally:
            _CLAIMED.reset(token)

    def _reentered(self):
        """This mode pushed again (inside __torch_function__ torch pops it), so that the calls of
        a Python decomposition reach it; the hooks stay as they are."""
        return _Pushed(self)


def _integer(value) -> bool:
    """Whether value is a tensor of integers (or bools), whose products torch computes exactly."""
    return isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex())


@contextlib.contextmanager
def scalers_kept() -> Iterator[None]:
    """A context after which the delayed scalers of every active quantize_functions context are
    as they were: their buffers (histories, scales) restored bit for bit, the same tensors, the
    scalers of sites first met inside dropped, and the count of the calls made outside the
    model's modules (which ranks them into sites) and the entries that have decided a call as
    before, so that a call the run makes afterwards has the site it would have had.
    lpsim.diagnostics.Shadow.compare runs its passes in one: they are not part of the run."""
    saved = [(context, dict(context.scalers.items())) for context in _ACTIVE]
    counts = [(context, dict(context._outside), list(context._settled)) for context in _ACTIVE]
    buffers = [
        (scaler._buffers, name, buffer, buffer.clone())
        for _, scalers in saved
        for scaler in scalers.values()
        for name, buffer in scaler._buffers.items()
        if buffer is not None
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for owner, name, buffer, copy in buffers:
                owner[name] = buffer
                buffer.copy_(copy)
        for context, scalers in saved:
            for key in [k for k in context.scalers if k not in scalers]:
                del context.scalers[key]
        for context, outside, settled in counts:
            context._outside.clear()
            context._outside.update(outside)
            context._settled[:] = settled


@contextlib.contextmanager
def passing_calls() -> Iterator[None]:
    """A context in which every active quantize_functions context lets every call pass as torch's
    own, unquantised: lpsim.diagnostics.Shadow runs its float32 reference in one."""
    token = _CLAIMED.set(passing_calls)
    try:
        yield
    finally:
        _CLAIMED.reset(token)


class _Pushed:
    def __init__(self, mode: FunctionQuantization):
        self.mode = mode

    def __enter__(self):
        return TorchFunctionMode.__enter__(self.mode)

    def __exit__(self, *exc):
        return TorchFunctionMode.__exit__(self.mode, *exc)


def _causal_bias_mask(bias: CausalBias, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The bool mask (True: takes part) that a torch.nn.attention.bias.CausalBias stands for, as
    torch's scaled_dot_product_attention applies it: key j takes part for query i where
    j <= i (causal_upper_left), or j <= i + S - L (causal_lower_right, the diagonal ending at
    the last query and key). Its tensor holds no mask: added as a float mask, its storage would
    shift the scores.

    Raises:
        ValueError: its sizes are not the queries' and keys' (L, S).
    """
    target, source = query.shape[-2], key.shape[-2]
    if (bias.seq_len_q, bias.seq_len_kv) != (target, source):
        raise ValueError(
            f"scaled_dot_product_attention: attn_mask, a CausalBias of ({bias.seq_len_q}, "
            f"{bias.seq_len_kv}), must have the queries' and keys' sizes ({target}, {source})"
        )
    diagonal = source - target if bias.variant == CausalVariant.LOWER_RIGHT else 0
    allowed = torch.ones(target, source, dtype=torch.bool, device=query.device)
    return allowed.tril(diagonal)


def _query_groups(query: torch.Tensor, t: torch.Tensor, name: str, enable_gqa: bool):
    """(grouped, merged, t): with enable_gqa and fewer heads in t (the key or the value) than in
    the query, the functions that split the query heads (axis -3) into (t's heads, group) and
    merge them back, and t with a group axis of size 1, over which the products broadcast it;
    else identities and t.

    Raises:
        ValueError: the query heads are not a multiple of t's heads.
    """
    if not (enable_gqa and query.dim() >= 3 and t.shape[-3] != query.shape[-3]):
        return (lambda x: x), (lambda x: x), t
    heads, kv_heads = query.shape[-3], t.shape[-3]
    if heads % kv_heads:
        raise ValueError(
            f"scaled_dot_product_attention: enable_gqa needs the query heads ({heads}) to be "
            f"a multiple of the {name} heads ({kv_heads})"
        )
    groups = (kv_heads, heads // kv_heads)
    return (lambda x: x.unflatten(-3, groups)), (lambda x: x.flatten(-4, -3)), t.unsqueeze(-3)


def scaled_dot_product_attention(
    mode: FunctionQuantization,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """F.scaled_dot_product_attention step by step, each step as ``mode`` prescribes (the module
    docstring states the steps).

    Raises:
        ValueError: is_causal together with attn_mask (as torch), dropout_p outside [0, 1], a
            CausalBias mask whose sizes are not the queries' and keys', or enable_gqa with head
            counts that do not divide.
        TypeError: attn_mask is neither bool, float32 nor the query's dtype (torch refuses it
            too; added, an integer mask would shift the scores).
    """
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: is_causal and attn_mask are exclusive")
    if not 0.0 <= dropout_p <= 1.0:  # NaN too, which no dropout would have applied
        raise ValueError(
            f"scaled_dot_product_attention: dropout_p must be in [0, 1], got {dropout_p}"
        )
    if isinstance(attn_mask, CausalBias):
        attn_mask = _causal_bias_mask(attn_mask, query, key)
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise TypeError(
            f"scaled_dot_product_attention: attn_mask must be bool (False: masked), float32 or "
            f"the query's dtype {query.dtype} (added to the scores), as torch requires; got "
            f"{attn_mask.dtype}"
        )
    # With GQA each key head, and each value head, quantised once, is broadcast over its group
    # of query heads (head h takes head h // group, as torch's repeat_interleave gives it); the
    # key and the value are grouped each by its own head count, as torch repeats each.
    (grouped_k, merged_k, key), (grouped_v, merged_v, value) = (
        _query_groups(query, t, name, enable_gqa) for t, name in ((key, "key"), (value, "value"))
    )
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = merged_k(mode.product("attention.scores", grouped_k(query), key.transpose(-2, -1)))
    scores = scores * scale
    target, source = query.shape[-2], key.shape[-2]
    if is_causal:
        allowed = torch.ones(target, source, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = _functional.masked_scores(scores, attn_mask)
    # Rows no key takes part in: weights 0 (torch's, not softmax's NaN), and zero gradients.
    weights = _functional.softmax_zeroing_masked_rows(
        scores, lambda s: mode.softmax("attention.softmax", torch.softmax, (s,), {"dim": -1})
    )
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return merged_v(mode.product("attention.context", grouped_v(weights), value))


def quantize_functions(
    model: nn.Module, config: Mapping[object, LayerQuantization]
) -> FunctionQuantization:
    """The context that quantises the functions ``config`` selects while ``model`` runs (see the
    module docstring for keys, ops and fields). torch.compile's wrapper of a model stands for the
    model it wraps, whose modules its forward runs (selectors name them as in that model): the
    context hooks those modules, which the compiled graph then traces.

    Raises:
        TypeError: model is not an nn.Module, or a key or value is malformed.
        ValueError: an unknown op, a field its op does not take, or a selector that matches no
            module of the model (a misspelt name would otherwise quantise nothing, silently).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_functions: model must be an nn.Module, got {type(model)}")
    if not isinstance(config, Mapping):
        raise TypeError(f"quantize_functions: config must be a mapping, got {type(config)}")
    model = _hooks.compiled_model(model) or model
    entries = [_entry(k, v) for k, v in config.items()]
    modules = list(model.named_modules(remove_duplicate=False))
    for key, entry in zip(config, entries, strict=True):
        selector = entry.selector
        if selector is not None and not any(
            selects(selector, [name], module, "quantize_functions") for name, module in modules
        ):
            raise ValueError(
                f"quantize_functions: the key {key!r} selects no module of the model (its "
                "selector matches none of model.named_modules())"
            )
    return FunctionQuantization(model, entries)
