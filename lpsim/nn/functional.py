"""Matrix products, convolutions and multi-head attention whose every dot product is summed as a
MAC prescribes, in the forward pass and in both products of the backward pass.

Each function has torch.nn.functional's (or torch's) signature plus the keywords (all of them for
the products below, the three MACs and ``out_proj_macs`` for ``multi_head_attention_forward``):

- ``mac``: the arithmetic of the forward product (an ``lpsim.MAC``; the default ``MAC()`` is
  torch's own float32 product);
- ``input_grad_mac``, ``weight_grad_mac``: the arithmetic of the backward products that give the
  gradient of the input (dgrad) and of the weight (wgrad, and the bias gradient); None, the
  default, is ``mac``. A backward product's result has the dtype ``lpsim.mac.matmul`` gives (see
  below); where that is wider than the tensor whose gradient it is (a float32 accumulator for
  bfloat16 or float16 inputs and parameters), autograd casts the gradient to that tensor's dtype
  by round to nearest even: a second rounding, after the accumulator's (whatever the MAC's rule);
- ``input_format``, ``weight_format``: None, a format, or a (format, rounding) pair: the operands
  are quantised before the product (a bare format by ``rounding``, "nearest" by default), with the
  straight-through gradient;
- ``grad_format``: likewise, the gradient arriving at the result, quantised before both backward
  products (the layer's error).

``linear``, ``matmul`` and ``bmm`` also take ``input_grad_operands`` and ``weight_grad_operands``
(an ``Operands``, or None): the formats, and a transform, of the two operands of each backward
product, quantised afresh from the unquantised tensors as hardware quantises them (see Operands).

    >>> import torch, lpsim
    >>> from lpsim import MAC, Float
    >>> x = torch.ones(2, 4096)
    >>> w = torch.ones(3, 4096)
    >>> lpsim.nn.functional.linear(x, w, mac=MAC(accumulator=Float(5, 10)))[0].tolist()
    [2048.0, 2048.0, 2048.0]

Which terms each result sums, in which order (k below is a MAC's term index):

- ``matmul``, ``bmm``, ``linear``: c[i, j] sums a[i, k] b[k, j] for k = 0, ..., K - 1. ``linear``
  and a ``matmul`` by a 2-D matrix fold every leading dimension of the input into the rows, so
  the weight gradient sums over all of them under ``weight_grad_mac``; batched products (``bmm``,
  ``matmul`` of two batched operands) multiply each matrix of the batch on its own, and torch sums
  the gradient of an operand broadcast over the batch (in its own arithmetic).
- ``conv1d``, ``conv2d``: the forward pass is the product of the weight, as an (out channels) x
  (in channels / groups x kernel size) matrix, and the columns of the (zero-padded) input that
  ``torch.nn.functional.unfold`` forms: each output sums over (input channel, kernel row, kernel
  column), in that order, padding zeros included. The weight gradient sums the output gradient
  times those columns over (batch, output position), in that order. The input gradient is the
  transposed convolution, computed as the direct convolution of the output gradient (with
  stride - 1 zeros between its elements when the stride exceeds 1, and zero padding) by the
  flipped kernel: each input element sums over (output channel, kernel row, kernel column) of the
  flipped kernel, those zeros included. Every group is its own product.
- ``multi_head_attention_forward``: torch's multi-head attention, whose four products (the input
  projections and the out projection, each a ``linear``; the scores q k^T of each head, summed
  over head_dim, q scaled by 1 / sqrt(head_dim) and rounded before the product; the context
  softmax(scores) v, summed over the source positions) run under the MACs, the out projection
  under its own if given; the softmax and the dropout are torch's. Its docstring states each
  product's terms and order.
- Under the native forward MAC the forward product is torch's own op (torch.matmul, F.linear,
  the convolution) of the operands as given, whatever the backward products: the kernel torch
  picks for their shapes (dot for two vectors), bit for bit.
- ``bias`` is added after the sum, as one more rounded addition in the forward MAC's
  accumulator (result = round(s + bias) by its rule). Under the native forward MAC a bias of at
  most one dimension (nn.Linear's, a convolution's) and of the operands' dtype is added by
  torch's op itself, F.linear or the convolution with its bias, so that the forward result is
  torch's op bit for bit whatever the backward products (torch adds a bfloat16 or float16 bias
  in its float32 arithmetic and rounds once); another bias is added to the result by torch's
  addition (in the wider dtype). Its gradient sums the output gradient over every position
  along which the bias is broadcast (every position but the channel or feature for a 1-D
  bias), in the order of the weight gradient, under ``weight_grad_mac``.

Random words: every stochastic product draws a seed from torch's default CPU generator (so
``torch.manual_seed`` makes a run reproducible); the matrices of a batch and the groups of a
convolution use the offsets 0, 1, ... of that seed (lpsim.mac's words within each).

The results have the dtype ``lpsim.mac.matmul`` gives: the operands' when the accumulator fits it,
else float32 when the accumulator fits that, else float64. An accumulator wider than float32
(Float(11, 52), say, or a Fixed without clamp) gives float64 results, whose gradients no
simulated backward product takes (float64 products would not be exact: TypeError); such a product
needs native backward MACs (``input_grad_mac=weight_grad_mac=MAC()``), whose float64 gradients
autograd casts to the operands' dtype. Where all three MACs are native (and no Operands are
given) the functions are torch's own ops (torch.matmul, F.linear, F.conv1d, F.conv2d) applied to
the operands as the formats quantise them, their gradients torch's of the error as grad_format
quantises it: without formats, torch's op itself. ``multi_head_attention_forward`` is the
exception: it always computes torch's explicit path (its need_weights=True one) product by
product: torch's result to rounding.

Under ``torch.autocast`` the simulated products take the operands autocast gives torch's own op
(linear, matmul, bmm, conv1d and conv2d are among its lower-precision ops), as the native MACs'
torch ops do: the operands and the bias, once the formats have quantised them, are cast to the
autocast dtype (every floating-point tensor but a float64 one) by a cast that autograd
differentiates, so the gradients reach the leaves through it, as under torch's op. The result
has the dtype above for those operands (bfloat16 under a bfloat16 autocast and a ``Float(8, 7)``
accumulator, float32 under a float32 accumulator).

Under lpsim.nn.quantize_functions: a function whose products are all native (and takes no
Operands) is torch's op, which a context decides as it decides the model's own calls; any other
is lpsim's own product, whose torch calls (its forward product under the native forward MAC
among them) no context sees.

Double backward (``create_graph=True``, then a second differentiation): a product under a
non-native MAC has no derivative, so differentiating a gradient that a simulated backward product
computed raises a RuntimeError that says so when the second backward pass reaches
it, rather than giving zeros. With native backward MACs the backward products are torch's and
double backward works, the simulated forward product differentiated by its backward products.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from lpsim import mac as _mac
from lpsim._checks import check_strided, draw_seed
from lpsim.delayed_scaling import DelayedScaling
from lpsim.formats import check_fits
from lpsim.mac import MAC
from lpsim.nn import _hooks
from lpsim.nn.quantizer import QuantSpec, Spec, as_spec, quantizing_function
from lpsim.rounding import Rounding
from lpsim.transforms import RandomHadamard
from lpsim.update import sr_add

__all__ = [
    "linear",
    "matmul",
    "bmm",
    "conv1d",
    "conv2d",
    "multi_head_attention_forward",
    "Operands",
    "NATIVE",
]

NATIVE = MAC()  # torch's own float32 product: the default of every MAC keyword


@dataclass(frozen=True)
class Operands:
    """The two operands of one backward product, each quantised afresh from the unquantised tensor
    it comes from, optionally after a transform along the product's reduction axis.

    Without it a backward product takes the operands of the forward product as they were quantised
    for it (``input_format``, ``weight_format``, blocks along the forward's reduction axis) and the
    error as it arrives (after ``grad_format``). Hardware quantises each operand of each product
    along that product's own reduction axis, from the higher-precision tensor: Transformer Engine
    keeps a second copy of the input and of the weight, quantised along the other axis, for the
    backward products; Tseng et al., "Training LLMs with MXFP4" (2025), and NVIDIA's NVFP4 recipe
    ("Pretraining Large Language Models with NVFP4", 2025) also apply a 16-point random Hadamard
    transform to both operands of the weight-gradient product before quantising them.

    Each operand is quantised as the matrix whose last axis is the product's reduction axis, so a
    scaled format with blocks along axis -1 (``Recipe.along(-1)``) scales blocks along the
    reduction whatever the layout of the tensor it comes from. With E the error (the gradient of
    the result, M x N), A the first operand (``input``, M x K) and B the second (the weight's
    role; for ``linear`` B is the weight transposed, in_features x out_features):

    - the input-gradient product dA = E B^T (``input_grad_operands``) sums over N: ``error``
      quantises E (M x N), ``weight`` quantises B (K x N; for ``linear`` the weight, out_features
      x in_features, read along out_features).
    - the weight-gradient product dB = A^T E (``weight_grad_operands``) sums over M (for
      ``linear``, every token): ``input`` quantises A^T (K x M), ``error`` quantises E^T (N x M).

    Args:
        error: the format of the error as this product's operand: None, a format, or a (format,
            rounding) pair (a bare format is rounded by the function's ``rounding``, or by
            LayerQuantization.rounding). Not with ``grad_format`` (LayerQuantization.error), which
            quantises the error once for both products.
        input: the weight-gradient product's other operand, quantised from the input before
            ``input_format``. Only in ``weight_grad_operands``.
        weight: the input-gradient product's other operand, quantised from the weight before
            ``weight_format``. Only in ``input_grad_operands``.
        transform: None, or a RandomHadamard with axis -1 applied to both operands along the
            reduction axis before they are quantised (the product is unchanged up to rounding:
            R is orthogonal). The reduction length must be a multiple of its size. The format
            quantises the transform as computed (float32 for a bfloat16 or float16 tensor, as a
            fused transform-and-quantise kernel keeps it), not its rounding into the tensor's
            dtype, and the quantised operand has the tensor's dtype. An operand left None is
            still transformed (and rounded into its dtype). Its signs are fixed: every call, step
            and layer that takes this Operands uses the same ones (an entry per layer with its
            own seed gives each layer its own).

    For ``matmul`` of batched operands, an operand that the product broadcasts over the batch (a
    (K, N) or (1, K, N) weight by a (B, M, K) input, say) is quantised once, as the tensor it is,
    and every matrix of the batch takes that one rounding, as the forward's formats quantise it.

    Formats are stateless: a DelayedScaling keeps one history per tensor and is refused.

    Raises:
        TypeError: a format is malformed or a DelayedScaling, or transform is not a RandomHadamard.
        ValueError: transform.axis is not -1.
    """

    error: Spec = None
    input: Spec = None
    weight: Spec = None
    transform: RandomHadamard | None = None

    def __post_init__(self) -> None:
        for name in ("error", "input", "weight"):
            spec = as_spec(getattr(self, name), "nearest", f"Operands.{name}")
            if spec is not None and isinstance(spec.format, DelayedScaling):
                raise TypeError(
                    f"Operands.{name}: a DelayedScaling keeps state per tensor; the operands of "
                    "a backward product take stateless formats (Scaled with current scaling)"
                )
        if self.transform is not None:
            if not isinstance(self.transform, RandomHadamard):
                raise TypeError(
                    "Operands.transform must be a lpsim.RandomHadamard or None, got "
                    f"{type(self.transform).__name__}"
                )
            if self.transform.axis != -1:
                raise ValueError(
                    "Operands.transform runs along the product's reduction axis, the operands' "
                    f"last: its axis must be -1, got {self.transform.axis}"
                )

    def specs(self, product: str, rounding: Rounding | str) -> OperandSpecs:
        """The resolved specs for ``product`` ("input_grad" or "weight_grad"), bare formats
        rounded by ``rounding``.

        Raises:
            ValueError: the field of the operand the product does not take is set.
        """
        other, absent = ("weight", "input") if product == "input_grad" else ("input", "weight")
        if getattr(self, absent) is not None:
            raise ValueError(
                f"{product}_operands.{absent}: the {product.replace('_', '-')}ient product's "
                f"operands are the error and the {other}"
            )
        return OperandSpecs(
            as_spec(self.error, rounding, f"{product}_operands.error"),
            as_spec(getattr(self, other), rounding, f"{product}_operands.{other}"),
            self.transform,
        )


class OperandSpecs(NamedTuple):
    """Operands resolved for one product: the error's spec, the other operand's (the weight's for
    the input gradient, the input's for the weight gradient), and the transform."""

    error: QuantSpec | None
    other: QuantSpec | None
    transform: RandomHadamard | None

    def for_eval(self, eval_rounding: Rounding | None) -> OperandSpecs:
        """The specs with stochastic rules replaced by ``eval_rounding`` (QuantSpec.for_eval)."""
        return OperandSpecs(
            None if self.error is None else self.error.for_eval(eval_rounding),
            None if self.other is None else self.other.for_eval(eval_rounding),
            self.transform,
        )

    def operand(self, x: torch.Tensor, spec: QuantSpec | None) -> torch.Tensor:
        """x (reduction axis last) transformed, then quantised by ``spec``, in x's dtype.

        The format quantises the transform as computed (in float32 for a bfloat16 or float16 x,
        as a fused transform-and-quantise kernel keeps it), not its rounding into x's dtype,
        which would move values onto the format's midpoints (and shift a stochastic rule's
        odds). The format must fit x's dtype all the same (ValueError)."""
        if self.transform is None:
            return x if spec is None else spec(x)
        if spec is None:
            return self.transform.apply(x)
        check_fits(spec.format, x.dtype)
        work = torch.promote_types(x.dtype, torch.float32)
        return spec(self.transform.apply(x.to(work))).to(x.dtype)


class Arithmetic(NamedTuple):
    """The three products of a layer and the formats of its operands (see the module docstring).
    ``input_grad`` and ``weight_grad`` are MACs here (None resolved to ``forward``)."""

    forward: MAC
    input_grad: MAC
    weight_grad: MAC
    input_spec: QuantSpec | None
    weight_spec: QuantSpec | None
    grad_spec: QuantSpec | None
    input_grad_operands: OperandSpecs | None = None
    weight_grad_operands: OperandSpecs | None = None

    @property
    def native_products(self) -> bool:
        """Whether every product, forward and backward, is torch's own (its operands, quantised
        or not, are the forward's): the function is then torch's own op on the quantised
        operands, its gradients torch's of the quantised error."""
        return (
            self.forward.native
            and self.input_grad.native
            and self.weight_grad.native
            and self.input_grad_operands is None
            and self.weight_grad_operands is None
        )

    @property
    def native(self) -> bool:
        """Whether every product is torch's own and no operand is quantised."""
        return (
            self.native_products
            and self.input_spec is None
            and self.weight_spec is None
            and self.grad_spec is None
        )


def arithmetic(
    mac: MAC,
    input_grad_mac: MAC | None,
    weight_grad_mac: MAC | None,
    input_format: Spec,
    weight_format: Spec,
    grad_format: Spec,
    rounding: Rounding | str,
    *,
    input_grad_operands: Operands | None = None,
    weight_grad_operands: Operands | None = None,
) -> Arithmetic:
    """The validated Arithmetic of the functions' keywords.

    Raises:
        TypeError: a MAC argument is not a MAC, an operands argument not an Operands, or a format
            argument is malformed.
        ValueError: grad_format and an Operands.error are both given, or an Operands sets the
            field of an operand its product does not take; rounding is no rule (also where no
            format uses it, as a Quantizer's rules).
    """
    rounding = Rounding.parse(rounding, "rounding")
    for name, value in (
        ("mac", mac),
        ("input_grad_mac", input_grad_mac),
        ("weight_grad_mac", weight_grad_mac),
    ):
        if not isinstance(value, MAC) and not (value is None and name != "mac"):
            raise TypeError(f"{name} must be a lpsim.MAC, got {type(value).__name__}")
    operands = {}
    products = (("input_grad", input_grad_operands), ("weight_grad", weight_grad_operands))
    for product, value in products:
        if value is not None and not isinstance(value, Operands):
            raise TypeError(
                f"{product}_operands must be a lpsim.nn.functional.Operands or None, got "
                f"{type(value).__name__}"
            )
        operands[product] = None if value is None else value.specs(product, rounding)
        if grad_format is not None and value is not None and value.error is not None:
            raise ValueError(
                f"grad_format and {product}_operands.error both quantise the error: give "
                "grad_format (once, for both backward products) or each product's error format"
            )
    return Arithmetic(
        mac,
        mac if input_grad_mac is None else input_grad_mac,
        mac if weight_grad_mac is None else weight_grad_mac,
        as_spec(input_format, rounding, "input_format"),
        as_spec(weight_format, rounding, "weight_format"),
        as_spec(grad_format, rounding, "grad_format"),
        operands["input_grad"],
        operands["weight_grad"],
    )


def _seed(mac: MAC) -> int | torch.Tensor | None:
    """One seed for the products of one call under ``mac`` (None: the rule draws no words). While
    torch.export traces, the 0-d tensor that holds it: the exported program draws it at each
    call (an int would be the trace's seed, made a constant of the program)."""
    if mac.native or not mac.drawing_rule.is_stochastic:
        return None
    seed = draw_seed()
    return seed if torch.compiler.is_exporting() else int(seed)


def _product(a: torch.Tensor, b: torch.Tensor, mac: MAC, seed, offset: int):
    """a @ b under mac, the operands brought to one dtype (the wider)."""
    dtype = torch.promote_types(a.dtype, b.dtype)
    a, b = a.to(dtype), b.to(dtype)
    if mac.native:
        return torch.matmul(a, b)
    if dtype == torch.float64:
        raise TypeError(
            "a product under a non-native MAC takes float32, bfloat16 or float16 operands (float64 "
            "products would not be exact), got float64: a float64 model's tensor, or the result "
            "of an earlier product (or its gradient) under an accumulator wider than float32 (or "
            "a Fixed without clamp); give the products that take it native MACs, or an "
            "accumulator that float32 holds"
        )
    return _mac.seeded_matmul(a, b, mac, seed, offset)


def _batched(a: torch.Tensor, b: torch.Tensor, mac: MAC) -> torch.Tensor:
    """a @ b for one product of the matrices (M, K) and (K, N), at offset 0, or a[i] @ b[i] for
    every matrix of the (B, M, K) and (B, K, N) batches, matrix i at offset i. Under the native
    MAC, torch.matmul: mm for the matrices, as torch multiplies them, bmm for the batches."""
    if mac.native:
        return torch.matmul(*(t.to(torch.promote_types(a.dtype, b.dtype)) for t in (a, b)))
    seed = _seed(mac)
    if a.dim() == 2:
        return _product(a, b, mac, seed, 0)
    if a.shape[0] == 0:  # no matrices: the results' dtype from an empty product
        empty = _product(a.new_zeros((0, a.shape[2])), b.new_zeros((b.shape[1], 0)), mac, seed, 0)
        return empty.new_empty((0, a.shape[1], b.shape[2]))
    return torch.stack([_product(a[i], b[i], mac, seed, i) for i in range(a.shape[0])])


def _own_arithmetic():
    """A context for the forward product of a simulated function (one whose products are not all
    native): its torch calls (torch.matmul, F.linear, a convolution under the native forward MAC)
    are its own arithmetic, not a model's, and no TorchFunctionMode sees them: a
    lpsim.nn.quantize_functions context would otherwise round the forward product of, say,
    linear(x, w, input_grad_mac=...) as a model's matmul, its backward products not."""
    return torch._C.DisableTorchFunction()


def _in_batch(t: torch.Tensor, batch: tuple[int, ...] | None) -> torch.Tensor:
    """t (..., R, C), whose leading dimensions broadcast to ``batch``, as the (prod(batch), R, C)
    batch of its copies; t itself for None (one product of matrices)."""
    if batch is None:
        return t
    return t.expand(*batch, *t.shape[-2:]).reshape(math.prod(batch), *t.shape[-2:])


class _BatchedProduct(torch.autograd.Function):
    """c[i] = a[i] @ b[i] under the forward MAC; dA[i] = g[i] b[i]^T under input_grad and
    dB[i] = a[i]^T g[i] under weight_grad, their operands formed by the Arithmetic's Operands
    where it has them (from ``raw_a`` and ``raw_b``, the tensors a and b were quantised from).
    a and b are batches (B, M, K) and (B, K, N), or the matrices (M, K) and (K, N) of one product
    (see _batched). ``batch``: the batch shape that raw_a and raw_b broadcast to (a and b are
    them broadcast and flattened), None for one product of matrices. A raw operand is quantised
    once, as the tensor it is, and then broadcast: every matrix of the batch that shares it takes
    the same rounding (a stochastic rule would round each copy its own way)."""

    @staticmethod
    def forward(
        ctx,
        a,
        b,
        raw_a,
        raw_b,
        how: Arithmetic,
        batch: tuple[int, ...] | None = None,
        bias: torch.Tensor | None = None,
        native=None,
    ):
        wgrad, dgrad = how.weight_grad_operands, how.input_grad_operands
        ctx.save_for_backward(
            a,
            b,
            raw_a if wgrad is not None and wgrad.other is not None else None,
            raw_b if dgrad is not None and dgrad.other is not None else None,
        )
        ctx.how, ctx.batch = how, batch
        ctx.bias_shape = None if bias is None else bias.shape
        with _own_arithmetic():
            if native is not None:  # torch's op of the caller's tensors, the bias included
                return native()
            return _batched(a, b, how.forward)

    @staticmethod
    def backward(ctx, grad):
        a, b, raw_a, raw_b = ctx.saved_tensors
        how = ctx.how
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            ops = how.input_grad_operands
            if ops is None:
                grad_a = _batched(grad, b.transpose(-2, -1), how.input_grad)
            else:  # the operands with the reduction axis (N) last: E (M x N), B (K x N)
                _check_grouped(
                    ops, "input_grad", grad.shape[-1], "columns of the error (out_features)"
                )
                error = ops.operand(grad, ops.error)
                if ops.other is None:
                    weight = ops.operand(b, None)
                else:
                    weight = _in_batch(ops.operand(raw_b, ops.other), ctx.batch)
                grad_a = _batched(error, weight.transpose(-2, -1), how.input_grad)
        if ctx.needs_input_grad[1]:
            ops = how.weight_grad_operands
            if ops is None:
                grad_b = _batched(a.transpose(-2, -1), grad, how.weight_grad)
            else:  # the operands with the reduction axis (M) last: A^T (K x M), E^T (N x M)
                _check_grouped(ops, "weight_grad", grad.shape[-2], "rows of the input (its tokens)")
                if ops.other is None:
                    inputs = ops.operand(a.transpose(-2, -1), None)
                else:
                    inputs = _in_batch(ops.operand(raw_a.transpose(-2, -1), ops.other), ctx.batch)
                error = ops.operand(grad.transpose(-2, -1), ops.error)
                grad_b = _batched(inputs, error.transpose(-2, -1), how.weight_grad)
        grad_bias = None
        if ctx.bias_shape is not None and ctx.needs_input_grad[6]:
            grad_bias = _bias_gradient(grad, ctx.bias_shape, how.weight_grad)
        return grad_a, grad_b, None, None, None, None, grad_bias, None


def _check_grouped(ops: OperandSpecs, product: str, length: int, what: str) -> None:
    """Raise unless the reduction of ``product``, of ``length`` terms, fills the groups of its
    operands' transform (if any).

    Raises:
        ValueError: length is not a multiple of the transform's size (the message names the
            product, the reduction and both numbers).
    """
    if ops.transform is not None and length % ops.transform.size:
        raise ValueError(
            f"{product}_operands.transform: the {product.replace('_', '-')}ient product sums "
            f"over the {length} {what}, which must be a multiple of RandomHadamard.size, "
            f"{ops.transform.size}"
        )


def _check_tensors(where: str, bias=None, **operands) -> None:
    """The operands of a simulated product, and its bias unless None, are strided floating-point
    tensors.

    Raises:
        TypeError: one is not a tensor, not a strided one (sparse, nested) or not a floating-point
            one (the message names it).
    """
    for name, t in (*operands.items(), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a tensor, got {type(t).__name__}")
        check_strided(t, f"{where}: {name}", "a product under a non-native MAC")
        if not t.is_floating_point():
            raise TypeError(
                f"{where}: {name} must be a floating-point tensor (float32, bfloat16 or float16 "
                f"under a non-native MAC), got {t.dtype}"
            )


def _autocast(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The operands (and bias) of a simulated product as torch.autocast gives them to its own op
    (linear, matmul, bmm, conv1d and conv2d are among its lower-precision ops): where autocast is
    enabled for their device type, every floating-point tensor but a float64 one cast to the
    autocast dtype by an autograd cast (its gradient returns in its own dtype); otherwise the
    tensors as they are. The native MACs' torch ops cast so themselves."""
    device = next(t.device.type for t in tensors if t is not None)
    if not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(
        t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in tensors
    )


def _quantised_operands(a, b, how: Arithmetic):
    if how.input_spec is not None:
        a = how.input_spec(a)
    if how.weight_spec is not None:
        b = how.weight_spec(b)
    return a, b


def _with_grad_format(y: torch.Tensor, how: Arithmetic) -> torch.Tensor:
    """y, whose incoming gradient is quantised by grad_spec before the backward products."""
    if how.grad_spec is None:
        return y
    return quantizing_function(None, how.grad_spec)(y)


def _torch_op(op, input: torch.Tensor, weight: torch.Tensor, how: Arithmetic, *args):
    """op(input, weight, *args), torch's own, of the operands quantised by how's formats, its
    error quantised by grad_spec: a function whose products are all native (see
    Arithmetic.native_products)."""
    x, w = _quantised_operands(input, weight, how)
    return _with_grad_format(op(x, w, *args), how)


def _bias_gradient(grad: torch.Tensor, bias_shape, mac: MAC) -> torch.Tensor:
    """The gradient of a bias of ``bias_shape`` broadcast to grad's shape: grad summed over the
    dimensions along which the bias is broadcast (their positions in row-major order:
    batch-major), one product under ``mac``."""
    shape = (1,) * (grad.dim() - len(bias_shape)) + tuple(bias_shape)
    summed = [d for d, n in enumerate(shape) if n == 1]
    kept = [d for d, n in enumerate(shape) if n != 1]
    rows = grad.permute(summed + kept)
    rows = rows.reshape(math.prod(rows.shape[: len(summed)]), math.prod(rows.shape[len(summed) :]))
    ones = torch.ones(1, rows.shape[0], dtype=rows.dtype, device=rows.device)
    return _product(ones, rows, mac, _seed(mac), 0)[0].reshape(bias_shape)


class _AddBias(torch.autograd.Function):
    """y + bias (a tensor that broadcasts to y's shape without changing it), rounded once into the
    forward MAC's accumulator; the bias gradient is _bias_gradient under weight_grad. (Under the
    native forward MAC a 1-D bias is added by torch's op itself, with the product: see _fused.)"""

    @staticmethod
    def forward(ctx, y, bias, how: Arithmetic):
        ctx.how, ctx.bias_shape = how, bias.shape
        if how.forward.native:
            return y + bias
        mac = how.forward
        rbits = mac.rbits if mac.rounding.is_stochastic else None
        # bias in its own dtype: sr_add rounds the exact y + bias once (bias.to(y.dtype) rounded
        # it first).
        return sr_add(y, bias, mac.accumulator, mac.rounding, rbits=rbits)

    @staticmethod
    def backward(ctx, grad):
        grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_bias = _bias_gradient(grad, ctx.bias_shape, ctx.how.weight_grad)
        return grad, grad_bias, None


def _fused(bias: torch.Tensor | None, how: Arithmetic, *operands: torch.Tensor) -> bool:
    """Whether torch's own op adds ``bias`` with the product of ``operands``: under the native
    forward MAC, a bias of at most one dimension (nn.Linear's, a convolution's) and of the
    operands' dtype, which every path of torch's linear and convolutions takes. The forward
    result is then torch's op, bit for bit (its bias added in the product's float32 arithmetic
    and rounded once with it, for bfloat16 and float16 operands), whatever the backward products.
    (Operands or a bias of other dtypes, which torch's ops refuse, are brought to the wider.)"""
    return (
        bias is not None
        and how.forward.native
        and bias.dim() <= 1
        and all(t.dtype == bias.dtype for t in operands)
    )


def _native_product(op, given: tuple, how: Arithmetic, shape: tuple[int, ...]):
    """Under the native forward MAC, the forward product as torch's own ``op`` (torch.matmul,
    F.linear) of the caller's tensors computes it, reshaped to ``shape`` (the rows or the
    matrices _BatchedProduct multiplies): torch chooses its kernel by the operands' shapes (dot
    for two vectors, mv for a matrix by a vector), and the matrices they are folded into would
    take another one (mm), whose sums differ in the last bits. The operands are brought to one
    dtype (the wider) first, as _product does. None under a simulated forward MAC."""
    if not how.forward.native:
        return None
    dtype = torch.promote_types(given[0].dtype, given[1].dtype)
    operands = tuple(t.to(dtype) for t in given[:2])
    return lambda: op(*operands, *given[2:]).reshape(shape)


def _add_bias(y, bias, how: Arithmetic):
    return y if bias is None else _AddBias.apply(y, bias, how)


def _broadcasts_to(shape: tuple[int, ...], result: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``result`` without changing it."""
    if len(shape) > len(result):
        return False
    return all(n in (1, r) for n, r in zip(reversed(shape), reversed(result)))


def matmul(
    input: torch.Tensor,
    other: torch.Tensor,
    *,
    mac: MAC = NATIVE,
    input_grad_mac: MAC | None = None,
    weight_grad_mac: MAC | None = None,
    input_format: Spec = None,
    weight_format: Spec = None,
    grad_format: Spec = None,
    rounding: Rounding | str = "nearest",
    input_grad_operands: Operands | None = None,
    weight_grad_operands: Operands | None = None,
) -> torch.Tensor:
    """torch.matmul(input, other) under the MACs (the module docstring states the terms and their
    order; ``other`` takes the weight's role: weight_format, weight_grad_mac,
    input_grad_operands.weight).

    Raises:
        TypeError: a MAC, format or operands argument is malformed, or an operand dtype is
            unsupported by a non-native MAC (float64: its products would not be exact).
        ValueError: the shapes do not match, a non-native MAC gets operands that are not on one
            CPU or CUDA device, or the operands arguments conflict (see arithmetic).
    """
    how = arithmetic(
        mac,
        input_grad_mac,
        weight_grad_mac,
        input_format,
        weight_format,
        grad_format,
        rounding,
        input_grad_operands=input_grad_operands,
        weight_grad_operands=weight_grad_operands,
    )
    if how.native_products:
        return _torch_op(torch.matmul, input, other, how)
    a, b = _quantised_operands(input, other, how)
    return simulated_matmul(a, b, how, (input, other))


def simulated_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    how: Arithmetic,
    unquantised: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """torch.matmul(a, b) under ``how``, whose input and weight formats the caller has already
    applied (matmul applies them; inject and quantize_functions apply their own quantisers):
    ``unquantised`` are the tensors a and b were quantised from, which the backward products'
    Operands quantise afresh. The error is quantised by how.grad_spec.

    Raises:
        ValueError: the shapes do not match; otherwise as matmul.
    """
    _check_tensors("matmul", input=a, other=b)
    a, b = _autocast(a, b)
    if a.dim() == 0 or b.dim() == 0:
        raise ValueError("matmul: both operands need at least one dimension")
    raw_a, raw_b = unquantised
    given = (a, b)
    vector_a, vector_b = a.dim() == 1, b.dim() == 1
    if vector_a:
        a, raw_a = a.unsqueeze(0), raw_a.unsqueeze(0)
    if vector_b:
        b, raw_b = b.unsqueeze(1), raw_b.unsqueeze(1)
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"matmul: input (..., M, K) and other (..., K, N) disagree on K: "
            f"{tuple(a.shape)} and {tuple(b.shape)}"
        )
    if b.dim() == 2:  # fold the input's leading dimensions into the rows, as torch does
        rows = math.prod(a.shape[:-1])  # (not -1: K may be 0)
        c = _BatchedProduct.apply(
            a.reshape(rows, a.shape[-1]),
            b,
            raw_a.reshape(rows, a.shape[-1]),
            raw_b,
            how,
            None,
            None,
            _native_product(torch.matmul, given, how, (rows, b.shape[-1])),
        )
        c = c.reshape(*a.shape[:-1], b.shape[-1])
    else:
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        # The raw operands stay as given: the backward products quantise each once (_in_batch).
        shape = (math.prod(batch), a.shape[-2], b.shape[-1])
        c = _BatchedProduct.apply(
            _in_batch(a, batch),
            _in_batch(b, batch),
            raw_a,
            raw_b,
            how,
            tuple(batch),
            None,
            _native_product(torch.matmul, given, how, shape),
        )
        c = c.reshape(*batch, a.shape[-2], b.shape[-1])
    if vector_a:
        c = c.squeeze(-2)
    if vector_b:
        c = c.squeeze(-1)
    return _with_grad_format(c, how)


def bmm(
    input: torch.Tensor,
    mat2: torch.Tensor,
    *,
    mac: MAC = NATIVE,
    input_grad_mac: MAC | None = None,
    weight_grad_mac: MAC | None = None,
    input_format: Spec = None,
    weight_format: Spec = None,
    grad_format: Spec = None,
    rounding: Rounding | str = "nearest",
    input_grad_operands: Operands | None = None,
    weight_grad_operands: Operands | None = None,
) -> torch.Tensor:
    """torch.bmm(input, mat2) under the MACs: input (B, M, K), mat2 (B, K, N).

    Raises:
        ValueError: the operands are not 3-D or their shapes do not match; otherwise as matmul.
    """
    _check_tensors("bmm", input=input, mat2=mat2)
    if input.dim() != 3 or mat2.dim() != 3 or input.shape[0] != mat2.shape[0]:
        raise ValueError(
            f"bmm takes input (B, M, K) and mat2 (B, K, N), got {tuple(input.shape)} and "
            f"{tuple(mat2.shape)}"
        )
    return matmul(
        input,
        mat2,
        mac=mac,
        input_grad_mac=input_grad_mac,
        weight_grad_mac=weight_grad_mac,
        input_format=input_format,
        weight_format=weight_format,
        grad_format=grad_format,
        rounding=rounding,
        input_grad_operands=input_grad_operands,
        weight_grad_operands=weight_grad_operands,
    )


def linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    mac: MAC = NATIVE,
    input_grad_mac: MAC | None = None,
    weight_grad_mac: MAC | None = None,
    input_format: Spec = None,
    weight_format: Spec = None,
    grad_format: Spec = None,
    rounding: Rounding | str = "nearest",
    input_grad_operands: Operands | None = None,
    weight_grad_operands: Operands | None = None,
) -> torch.Tensor:
    """torch.nn.functional.linear(input, weight, bias) under the MACs: input (..., in_features),
    weight (out_features, in_features) for the result (..., out_features), or, as in torch, weight
    (in_features) for the result (...). The bias, added as the module docstring states, is any
    tensor that broadcasts to the result's shape without changing it: (out_features), (), (1,
    out_features), (..., 1), ... (torch's linear adds it so; its fused path for a contiguous input
    also refuses some of these, a (rows, 1) bias for a 3-D input or any bias for a 2-D input with a
    1-D weight, which it takes for another layout of the same input). Where all three MACs are
    native, the result is torch's linear itself, which takes the biases torch's takes.

    Raises:
        ValueError: the shapes do not match; otherwise as matmul.
    """
    how = arithmetic(
        mac,
        input_grad_mac,
        weight_grad_mac,
        input_format,
        weight_format,
        grad_format,
        rounding,
        input_grad_operands=input_grad_operands,
        weight_grad_operands=weight_grad_operands,
    )
    if how.native_products:
        return _torch_op(F.linear, input, weight, how, bias)
    x, w = _quantised_operands(input, weight, how)
    return simulated_linear(x, w, bias, how, (input, weight))


def simulated_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    how: Arithmetic,
    unquantised: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """linear(x, w, bias) under ``how``, x and w already quantised by the caller (as for
    simulated_matmul; ``unquantised`` is (input, weight) before quantisation). As in torch, a 1-D
    weight (in_features) is one output feature whose dimension the result drops, and the bias is
    any tensor that broadcasts to the result's shape without changing it.

    Raises:
        ValueError: the shapes do not match; otherwise as matmul.
    """
    _check_tensors("linear", input=x, weight=w, bias=bias)
    x, w, bias = _autocast(x, w, bias)
    if w.dim() not in (1, 2) or x.dim() < 1 or x.shape[-1] != w.shape[-1]:
        raise ValueError(
            f"linear takes input (..., in_features) and weight (out_features, in_features) or "
            f"(in_features), got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    raw_x, raw_w = unquantised
    shape = (*x.shape[:-1], *w.shape[:-1])
    if bias is not None and not _broadcasts_to(tuple(bias.shape), shape):
        raise ValueError(
            f"linear: bias of shape {tuple(bias.shape)} does not broadcast to the result's shape "
            f"{shape} (as torch's linear, which adds it to the result in place)"
        )
    fused = _fused(bias, how, x, w) and w.dim() == 2
    # Under the native forward MAC, torch's linear of the caller's tensors, a fused bias included.
    given = (x, w, bias) if fused else (x, w)
    if w.dim() == 1:  # one output feature
        w, raw_w = w.unsqueeze(0), raw_w.unsqueeze(0)
    rows = math.prod(x.shape[:-1])  # (not -1: in_features may be 0)
    y = _BatchedProduct.apply(
        x.reshape(rows, x.shape[-1]),
        w.t(),
        raw_x.reshape(rows, x.shape[-1]),
        raw_w.t(),
        how,
        None,
        bias if fused else None,
        _native_product(F.linear, given, how, (rows, w.shape[0])),
    )
    y = y.reshape(shape)
    if not fused:
        y = _add_bias(y, bias, how)
    return _with_grad_format(y, how)


class _Geometry(NamedTuple):
    """A 2-D convolution's stride, padding (top, bottom, left, right), dilation and groups."""

    stride: tuple[int, int]
    padding: tuple[int, int, int, int]
    dilation: tuple[int, int]
    groups: int


def _pair(name: str, value, dims: int) -> tuple[int, ...]:
    """value as ``dims`` ints, as torch reads a convolution's stride, padding or dilation: an int
    (or an integer 0-d tensor) for every dimension, or a sequence of one (repeated) or ``dims``.

    Raises:
        TypeError: value is neither (a bool, a float, a sequence of another length).
    """

    def integer(v):
        if isinstance(v, bool) or isinstance(v, float):
            return None
        try:
            return operator.index(v)
        except TypeError:
            return None

    single = integer(value)
    if single is not None:
        return (single,) * dims
    values = tuple(value) if isinstance(value, (tuple, list)) else ()
    values = tuple(integer(v) for v in values)
    if len(values) not in (1, dims) or any(v is None for v in values):
        lengths = "1" if dims == 1 else f"1 or {dims}"
        raise TypeError(f"{name} must be an int or a tuple of {lengths} ints, got {value!r}")
    return values * dims if len(values) == 1 else values


def _geometry(weight_shape, stride, padding, dilation, groups, dims: int) -> _Geometry:
    """The 2-D geometry of a conv1d (dims 1, as a 1 x L image) or conv2d call.

    Raises:
        TypeError: stride, padding, dilation or groups is not an int (or tuple of ints).
        ValueError: a value is out of range (stride, dilation, groups < 1; padding < 0; "same" with
            a stride; an unknown padding string).
    """
    stride = _pair("stride", stride, dims)
    dilation = _pair("dilation", dilation, dims)
    if min(stride) < 1 or min(dilation) < 1:
        raise ValueError(f"stride and dilation must be >= 1, got {stride} and {dilation}")
    if not isinstance(groups, int) or isinstance(groups, bool):
        raise TypeError(f"groups must be an int, got {groups!r}")
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    kernel = tuple(weight_shape[2:])
    if padding == "valid":
        pads = [(0, 0)] * dims
    elif padding == "same":
        if max(stride) != 1:
            raise ValueError('padding="same" needs stride 1, as in torch')
        totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
        pads = [(t // 2, t - t // 2) for t in totals]
    elif isinstance(padding, str):
        raise ValueError(f'padding must be an int, a tuple, "valid" or "same", got {padding!r}')
    else:
        pads = [(p, p) for p in _pair("padding", padding, dims)]
        if min(min(p) for p in pads) < 0:
            raise ValueError(f"padding must be >= 0, got {padding!r}")
    if dims == 1:
        return _Geometry((1, stride[0]), (0, 0, *pads[0]), (1, dilation[0]), groups)
    return _Geometry(stride, (*pads[0], *pads[1]), dilation, groups)


def _padded(x: torch.Tensor, geometry: _Geometry) -> torch.Tensor:
    """x (N, C, H, W) with the geometry's zero padding (F.pad takes the last dimension first)."""
    return F.pad(x, geometry.padding[2:] + geometry.padding[:2])


def _output_size(size: int, pad: int, kernel: int, stride: int, dilation: int) -> int:
    return (size + pad - dilation * (kernel - 1) - 1) // stride + 1


def _convolve(x, w, stride, dilation, mac: MAC, seed, offset):
    """The convolution of the already padded x (N, C, H, W) by w (O, C, kh, kw) under mac, one
    product of w (O, C kh kw) by the columns (C kh kw, N L)."""
    n, o = x.shape[0], w.shape[0]
    kh, kw = w.shape[2:]
    ho = _output_size(x.shape[2], 0, kh, stride[0], dilation[0])
    wo = _output_size(x.shape[3], 0, kw, stride[1], dilation[1])
    columns = _unfold(x, (kh, kw), dilation, stride, (ho, wo))  # (N, C kh kw, L)
    columns = columns.transpose(0, 1).reshape(columns.shape[1], n * ho * wo)
    y = _product(w.reshape(o, w.shape[1] * kh * kw), columns, mac, seed, offset)  # (O, N L)
    return y.reshape(o, n, ho, wo).transpose(0, 1)


def _unfold(x, kernel, dilation, stride, output_size) -> torch.Tensor:
    """F.unfold's columns (N, C kh kw, L) of x (N, C, H, W), also for C = 0 (no terms: F.unfold
    refuses an input without channels)."""
    if x.shape[1] == 0:
        return x.new_zeros(x.shape[0], 0, output_size[0] * output_size[1])
    return F.unfold(x, kernel, dilation=dilation, stride=stride)


def _groups(t: torch.Tensor, groups: int, dim: int):
    return t.chunk(groups, dim) if groups > 1 else (t,)


def _conv_forward(x, w, geometry: _Geometry, mac: MAC):
    padded = _padded(x, geometry)
    seed = _seed(mac)
    parts = zip(_groups(padded, geometry.groups, 1), _groups(w, geometry.groups, 0))
    return torch.cat(
        [
            _convolve(xg, wg, geometry.stride, geometry.dilation, mac, seed, g)
            for g, (xg, wg) in enumerate(parts)
        ],
        1,
    )


def _conv_input_grad(grad, w, input_size, geometry: _Geometry, mac: MAC):
    """The gradient of the input (N, C, H, W): the transposed convolution, as the direct
    convolution of the zero-dilated, padded output gradient by the flipped kernel."""
    n, o, ho, wo = grad.shape
    (sh, sw), (dh, dw) = geometry.stride, geometry.dilation
    kh, kw = w.shape[2:]
    if mac.native:  # in the wider dtype, as _product: a float64 gradient of float32 operands
        dtype = torch.promote_types(grad.dtype, w.dtype)
        return _native_input_grad(grad.to(dtype), w.to(dtype), input_size, geometry)
    dilated = grad.new_zeros(n, o, (ho - 1) * sh + 1, (wo - 1) * sw + 1)
    dilated[:, :, ::sh, ::sw] = grad
    top, bottom, left, right = geometry.padding
    height, width = input_size[2], input_size[3]
    # The transposed convolution's output is (ho - 1) sh + d (k - 1) + 1 minus the padding; the
    # rows and columns that the stride left uncovered at the end get the extra padding.
    extra_h = height + top + bottom - ((ho - 1) * sh + dh * (kh - 1) + 1)
    extra_w = width + left + right - ((wo - 1) * sw + dw * (kw - 1) + 1)
    reach_h, reach_w = dh * (kh - 1), dw * (kw - 1)
    dilated = F.pad(
        dilated,
        (reach_w - left, reach_w - right + extra_w, reach_h - top, reach_h - bottom + extra_h),
    )
    flipped = w.flip(2, 3)
    seed = _seed(mac)
    parts = zip(_groups(dilated, geometry.groups, 1), _groups(flipped, geometry.groups, 0))
    return torch.cat(
        [
            _convolve(gg, wg.transpose(0, 1), (1, 1), geometry.dilation, mac, seed, g)
            for g, (gg, wg) in enumerate(parts)
        ],
        1,
    )


def _native_input_grad(grad, w, input_size, geometry: _Geometry):
    top, bottom, left, right = geometry.padding
    padded = (
        input_size[0],
        input_size[1],
        input_size[2] + top + bottom,
        input_size[3] + left + right,
    )
    full = torch.nn.grad.conv2d_input(
        padded, w, grad, geometry.stride, 0, geometry.dilation, geometry.groups
    )
    return full[:, :, top : top + input_size[2], left : left + input_size[3]]


def _conv_weight_grad(x, grad, w_shape, geometry: _Geometry, mac: MAC):
    """The gradient of the weight: the output gradient (O, N L) times the input's columns
    (N L, C kh kw), per group."""
    padded = _padded(x, geometry)
    kh, kw = w_shape[2:]
    if mac.native:  # in the wider dtype, as _product
        dtype = torch.promote_types(padded.dtype, grad.dtype)
        padded, grad = padded.to(dtype), grad.to(dtype)
        return torch.nn.grad.conv2d_weight(
            padded, w_shape, grad, geometry.stride, 0, geometry.dilation, geometry.groups
        )
    seed = _seed(mac)
    parts = []
    for g, (xg, gg) in enumerate(
        zip(_groups(padded, geometry.groups, 1), _groups(grad, geometry.groups, 1))
    ):
        output_size = tuple(grad.shape[2:])
        columns = _unfold(xg, (kh, kw), geometry.dilation, geometry.stride, output_size)
        n, terms, positions = columns.shape
        rows = gg.transpose(0, 1).reshape(gg.shape[1], n * positions)  # (O, N L)
        columns = columns.transpose(1, 2).reshape(n * positions, terms)  # (N L, C kh kw)
        parts.append(
            _product(rows, columns, mac, seed, g).reshape(gg.shape[1], xg.shape[1], kh, kw)
        )
    return torch.cat(parts, 0)


class _Convolution(torch.autograd.Function):
    """The 2-D convolution of x by w under the forward MAC, and its two gradients under
    input_grad and weight_grad (see the module docstring for the terms and their order)."""

    @staticmethod
    def forward(ctx, x, w, geometry: _Geometry, how: Arithmetic, torch_conv, bias=None):
        ctx.save_for_backward(x, w)
        ctx.geometry, ctx.how = geometry, how
        ctx.has_bias = bias is not None
        # Under the native MAC, torch's own convolution with the caller's arguments: the same
        # bits (but not without input channels, where torch gives no output channels: see _conv).
        # ``bias``: a bias torch's convolution adds (see _fused), given only under the native MAC.
        with _own_arithmetic():
            if how.forward.native and x.shape[1] > 0:
                return torch_conv(x, w, bias)
            return _conv_forward(x, w, geometry, how.forward)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        how, geometry = ctx.how, ctx.geometry
        grad_x = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _conv_input_grad(grad, w, x.shape, geometry, how.input_grad)
        if ctx.needs_input_grad[1]:
            grad_w = _conv_weight_grad(x, grad, w.shape, geometry, how.weight_grad)
        if ctx.has_bias and ctx.needs_input_grad[5]:
            grad_bias = _bias_gradient(grad, (w.shape[0], 1, 1), how.weight_grad).reshape(-1)
        return grad_x, grad_w, None, None, None, grad_bias


def _conv(input, weight, bias, geometry: _Geometry, how: Arithmetic, dims: int, torch_conv):
    """conv1d or conv2d (``dims``) of input, batched or not, checked and computed as torch does:
    an unbatched input as the batch of one it is, its operands and error quantised as given (as
    under the native MACs, where the function is torch's op of the quantised operands).
    ``torch_conv``: torch's convolution (x, w, bias) -> result of the 4-D operands (for conv1d,
    1 x L images), the forward product under the native MAC (bias None, or added by it: _fused).

    Raises:
        ValueError: the shapes do not match torch's.
    """
    spatial = "L" if dims == 1 else "H, W"
    if input.dim() not in (dims + 1, dims + 2) or weight.dim() != dims + 2:
        raise ValueError(
            f"conv{dims}d takes input (N, C, {spatial}) or unbatched (C, {spatial}) and weight "
            f"(O, C / groups, {'k' if dims == 1 else 'kh, kw'}), got {tuple(input.shape)} and "
            f"{tuple(weight.shape)}"
        )
    unbatched = input.dim() == dims + 1
    _check_conv_shapes(input.unsqueeze(0) if unbatched else input, weight, bias, geometry, dims)
    x, w = _quantised_operands(input, weight, how)
    x, w, bias = _autocast(x, w, bias)
    if unbatched:
        x = x.unsqueeze(0)
    channels = x.shape[1]
    if dims == 1:
        x, w = x.unsqueeze(2), w.unsqueeze(2)
    fused = _fused(bias, how, x, w) and channels > 0
    y = _Convolution.apply(x, w, geometry, how, torch_conv, bias if fused else None)
    if not fused:
        y = _add_bias(y, None if bias is None else bias.reshape(-1, 1, 1), how)
    if channels == 0:  # torch's result: no output channels (the bias's gradient zero)
        y = y[:, :0]
    if dims == 1:
        y = y.squeeze(2)
    elif _channels_last(input) or _channels_last(weight):  # torch's conv2d gives y that layout
        y = y.contiguous(memory_format=torch.channels_last)
    return _with_grad_format(y.squeeze(0) if unbatched else y, how)


def _channels_last(t: torch.Tensor) -> bool:
    """Whether a tensor is 4-D and laid out channels last (and not also contiguous, as tensors with
    one channel or one pixel are): then torch's conv2d gives its result, and the operations after
    it (BatchNorm's CPU kernels among them, whose sums then run in another order) take, that
    layout."""
    return (
        t.dim() == 4
        and t.is_contiguous(memory_format=torch.channels_last)
        and not t.is_contiguous()
    )


def _check_conv_shapes(input, weight, bias, geometry: _Geometry, dims: int) -> None:
    """The shapes of a batched convolution's operands, as torch checks them.

    Raises:
        ValueError: they do not match (see conv2d).
    """
    groups = geometry.groups
    if weight.shape[0] < groups:
        raise ValueError(
            f"conv{dims}d: weight must have at least groups ({groups}) output channels, got "
            f"weight of shape {tuple(weight.shape)}"
        )
    if input.shape[1] != weight.shape[1] * groups or weight.shape[0] % groups:
        raise ValueError(
            f"conv{dims}d: input channels ({input.shape[1]}) must be groups ({groups}) x the "
            f"weight's ({weight.shape[1]}), and output channels ({weight.shape[0]}) a multiple "
            "of groups"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    top, bottom, left, right = geometry.padding
    pads = (top + bottom, left + right)[-dims:]
    padded_size = tuple(n + p for n, p in zip(input.shape[2:], pads))
    reach = tuple(d * (k - 1) + 1 for d, k in zip(geometry.dilation[-dims:], weight.shape[2:]))
    if any(r > n for r, n in zip(reach, padded_size)):
        raise ValueError(
            f"conv{dims}d: the padded input's size {padded_size} is smaller than the dilated "
            f"kernel's {reach}"
        )


def conv2d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] | str = 0,
    dilation: int | tuple[int, int] = 1,
    groups: int = 1,
    *,
    mac: MAC = NATIVE,
    input_grad_mac: MAC | None = None,
    weight_grad_mac: MAC | None = None,
    input_format: Spec = None,
    weight_format: Spec = None,
    grad_format: Spec = None,
    rounding: Rounding | str = "nearest",
) -> torch.Tensor:
    """torch.nn.functional.conv2d under the MACs: input (N, C, H, W) or unbatched (C, H, W),
    weight (O, C / groups, kh, kw), O >= groups; stride, padding and dilation each an int or a
    tuple of one (for both dimensions) or two ints, padding also "valid" or "same" (stride 1),
    zeros. Without input channels (C = 0) the result has no channels either, (N, 0, Ho, Wo), as
    torch's conv2d gives it (the bias's gradient is then zero). An unbatched input is computed as
    the batch of one it is; input_format quantises it, and grad_format the error of the unbatched
    result, as given (an axis counts from the tensor passed, as in inject's input format).

    Raises:
        TypeError: stride, padding or dilation is not an int or a tuple of one or two ints, or
            groups is not an int; otherwise as matmul.
        ValueError: the shapes do not match (as torch checks them: the dilated kernel larger than
            the padded input, fewer output channels than groups) or a value is out of range.
    """
    how = arithmetic(
        mac, input_grad_mac, weight_grad_mac, input_format, weight_format, grad_format, rounding
    )
    if how.native_products:
        return _torch_op(F.conv2d, input, weight, how, bias, stride, padding, dilation, groups)
    _check_tensors("conv2d", input=input, weight=weight, bias=bias)
    geometry = _geometry(weight.shape, stride, padding, dilation, groups, 2)

    def torch_conv(x, w, bias):
        return F.conv2d(x, w, bias, stride, padding, dilation, groups)

    return _conv(input, weight, bias, geometry, how, 2, torch_conv)


def conv1d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | tuple[int] = 1,
    padding: int | tuple[int] | str = 0,
    dilation: int | tuple[int] = 1,
    groups: int = 1,
    *,
    mac: MAC = NATIVE,
    input_grad_mac: MAC | None = None,
    weight_grad_mac: MAC | None = None,
    input_format: Spec = None,
    weight_format: Spec = None,
    grad_format: Spec = None,
    rounding: Rounding | str = "nearest",
) -> torch.Tensor:
    """torch.nn.functional.conv1d under the MACs: input (N, C, L) or unbatched (C, L), weight
    (O, C / groups, k); stride, padding and dilation each an int or a tuple of one int, padding
    also "valid" or "same". Computed as conv2d of 1 x L images (the same terms in the same order);
    without input channels, no output channels either, as torch's conv1d.

    Raises:
        As conv2d (a tuple of two ints is refused).
    """
    how = arithmetic(
        mac, input_grad_mac, weight_grad_mac, input_format, weight_format, grad_format, rounding
    )
    if how.native_products:
        return _torch_op(F.conv1d, input, weight, how, bias, stride, padding, dilation, groups)
    _check_tensors("conv1d", input=input, weight=weight, bias=bias)
    geometry = _geometry(weight.shape, stride, padding, dilation, groups, 1)

    def torch_conv(x, w, bias):  # of the 1 x L images
        y = F.conv1d(x.squeeze(2), w.squeeze(2), bias, stride, padding, dilation, groups)
        return y.unsqueeze(2)

    return _conv(input, weight, bias, geometry, how, 1, torch_conv)


def _keywords(how: Arithmetic) -> dict:
    """The MAC keywords of the functions above for the products of ``how``."""
    return dict(mac=how.forward, input_grad_mac=how.input_grad, weight_grad_mac=how.weight_grad)


def _additive_mask(mask: torch.Tensor | None, name: str, dtype: torch.dtype):
    """``mask`` as torch adds it to the scores: a bool mask becomes -inf where True and 0 where
    False (in ``dtype``, the query's), a floating-point mask is added as it is.

    Raises:
        TypeError: the mask is neither bool nor floating-point.
    """
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise TypeError(f"{name} must be a bool or floating-point tensor, got {mask.dtype}")
    return mask


def _attention_is_batched(query, key, value, key_padding_mask, attn_mask) -> bool:
    """Whether the inputs are batched (query 3-D) or not (2-D), as torch decides it.

    Raises:
        ValueError: the dimensions of the inputs and masks disagree.
    """
    if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            "multi_head_attention_forward takes query, key and value all 3-D (batched) or all 2-D "
            f"(unbatched), got {query.dim()}-D, {key.dim()}-D and {value.dim()}-D"
        )
    if key_padding_mask is not None and key_padding_mask.dim() != query.dim() - 1:
        raise ValueError(
            f"key_padding_mask must be {query.dim() - 1}-D for a {query.dim()}-D query, got "
            f"{key_padding_mask.dim()}-D"
        )
    if attn_mask is not None and attn_mask.dim() not in (2, 3):
        raise ValueError(f"attn_mask must be 2-D or 3-D, got {attn_mask.dim()}-D")
    return query.dim() == 3


def _three_dimensional_mask(attn_mask, batch_heads: int, tgt_len: int, src_len: int):
    """attn_mask as (1 or N H, L, S).

    Raises:
        ValueError: its shape is neither (L, S) nor (N H, L, S).
    """
    if attn_mask is None:
        return None
    if attn_mask.dim() == 2 and attn_mask.shape == (tgt_len, src_len):
        return attn_mask.unsqueeze(0)
    if attn_mask.dim() == 3 and attn_mask.shape == (batch_heads, tgt_len, src_len):
        return attn_mask
    raise ValueError(
        f"attn_mask must have shape ({tgt_len}, {src_len}) or ({batch_heads}, {tgt_len}, "
        f"{src_len}), got {tuple(attn_mask.shape)}"
    )


def _packed_projections(query, key, value, weight, bias, how: Arithmetic):
    """q, k and v by the packed (3 E, E) weight and (3 E) bias, grouped into products as torch
    groups them: one product for self-attention (query is key is value), one for query and one
    for key and value when key is value, else one each."""
    e = query.shape[-1]
    if query is key and key is value:
        return linear(query, weight, bias, **_keywords(how)).unflatten(-1, (3, e)).unbind(-2)
    if key is value:
        w_q, w_kv = weight.split([e, 2 * e])
        b_q, b_kv = (None, None) if bias is None else bias.split([e, 2 * e])
        q = linear(query, w_q, b_q, **_keywords(how))
        k, v = linear(key, w_kv, b_kv, **_keywords(how)).unflatten(-1, (2, e)).unbind(-2)
        return q, k, v
    return _separate_projections(query, key, value, weight.chunk(3), bias, how)


def _separate_projections(query, key, value, weights, bias, how: Arithmetic):
    """q, k and v, one product each by its own weight and third of the (3 E) bias."""
    biases = (None, None, None) if bias is None else bias.chunk(3)
    return tuple(
        linear(x, w, b, **_keywords(how)) for x, w, b in zip((query, key, value), weights, biases)
    )


def _in_projections(query, key, value, in_proj_weight, in_proj_bias, separate, weights, how):
    """q, k and v: the packed weight's products, or with ``separate`` those of the three weights
    (q_proj_weight, k_proj_weight, v_proj_weight).

    Raises:
        ValueError: a weight the chosen layout needs is missing.
    """
    if not separate:
        if in_proj_weight is None:
            raise ValueError("use_separate_proj_weight is False but in_proj_weight is None")
        return _packed_projections(query, key, value, in_proj_weight, in_proj_bias, how)
    if any(w is None for w in weights):
        raise ValueError(
            "use_separate_proj_weight is True: q_proj_weight, k_proj_weight and v_proj_weight "
            "are needed"
        )
    return _separate_projections(query, key, value, weights, in_proj_bias, how)


def _heads(t: torch.Tensor, batch_heads: int, head_dim: int) -> torch.Tensor:
    """(S, N, E) as (N H, S, head_dim): matrix n H + h of the batch is head h of sequence n."""
    return t.reshape(t.shape[0], batch_heads, head_dim).transpose(0, 1)


def _pad_masks(attn_mask, key_padding_mask):
    """The masks with one more source position, not masked (a zero column)."""
    pad = lambda m: None if m is None else F.pad(m, (0, 1))  # noqa: E731
    return pad(attn_mask), pad(key_padding_mask)


def _sources(k, v, biases, statics, add_zero_attn, masks, bsz: int, num_heads: int):
    """k and v as (N H, S', head_dim) batches of heads, and the masks, with bias_k and bias_v
    appended to every sequence, static_k and static_v in place of the projections, and a zero
    key and value appended with add_zero_attn (each a source position the masks do not mask).

    Raises:
        ValueError: bias_k without bias_v (or the reverse), biases with static keys or values, or
            a static tensor of the wrong shape.
    """
    (bias_k, bias_v), (static_k, static_v), (attn_mask, key_padding_mask) = biases, statics, masks
    if (bias_k is None) != (bias_v is None):
        raise ValueError("bias_k and bias_v are given together or not at all")
    batch_heads, head_dim = bsz * num_heads, k.shape[-1] // num_heads
    if bias_k is not None:
        if static_k is not None or static_v is not None:
            raise ValueError("bias_k and bias_v cannot be added to static_k and static_v")
        k = torch.cat([k, bias_k.repeat(1, bsz, 1)])
        v = torch.cat([v, bias_v.repeat(1, bsz, 1)])
        attn_mask, key_padding_mask = _pad_masks(attn_mask, key_padding_mask)
    for name, t in (("static_k", static_k), ("static_v", static_v)):
        if t is not None and (t.dim() != 3 or t.shape[0] != batch_heads or t.shape[2] != head_dim):
            raise ValueError(
                f"{name} must have shape ({batch_heads}, S, {head_dim}), got {tuple(t.shape)}"
            )
    k = _heads(k, batch_heads, head_dim) if static_k is None else static_k
    v = _heads(v, batch_heads, head_dim) if static_v is None else static_v
    if add_zero_attn:
        k = torch.cat([k, k.new_zeros(batch_heads, 1, head_dim)], dim=1)
        v = torch.cat([v, v.new_zeros(batch_heads, 1, head_dim)], dim=1)
        attn_mask, key_padding_mask = _pad_masks(attn_mask, key_padding_mask)
    return k, v, attn_mask, key_padding_mask


def _merged_mask(attn_mask, key_padding_mask, bsz: int, num_heads: int, src_len: int):
    """The one additive mask of the scores (N H or 1, L, S): attn_mask + key_padding_mask, each
    sequence's padding mask repeated for its heads (the sum rounded as torch adds)."""
    if key_padding_mask is None:
        return attn_mask
    if key_padding_mask.shape != (bsz, src_len):
        raise ValueError(
            f"key_padding_mask must have shape ({bsz}, {src_len}) (with bias_k and "
            f"add_zero_attn's positions), got {tuple(key_padding_mask.shape)}"
        )
    padding = (
        key_padding_mask.reshape(bsz, 1, 1, src_len)
        .expand(-1, num_heads, -1, -1)
        .reshape(bsz * num_heads, 1, src_len)
    )
    return padding if attn_mask is None else attn_mask + padding


def masked_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """scores + mask (a floating-point mask) in the scores' dtype, as torch's attention adds it
    (its in-place ``scores.add_(mask)``): computed in the wider of the two dtypes and rounded once
    to the scores', so that a float32 mask (nn.Transformer.generate_square_subsequent_mask's)
    leaves bfloat16 or float16 scores, and the steps after them, in their dtype."""
    return (scores + mask).to(scores.dtype)


def softmax_zeroing_masked_rows(scores: torch.Tensor, softmax) -> torch.Tensor:
    """softmax(scores) over the last axis, where a row of scores that are all -inf (a query no key
    takes part in) gets weights 0 and zero gradients, as torch's scaled_dot_product_attention
    gives them, not softmax's NaN: such a row is given to ``softmax`` (a function of the scores)
    as zeros, so that its backward multiplies no NaN, and its weights are then set to 0."""
    masked = (scores == float("-inf")).all(dim=-1, keepdim=True)
    return softmax(scores.masked_fill(masked, 0.0)).masked_fill(masked, 0.0)


def _attention(q, k, v, mask, dropout_p: float, how: Arithmetic, zero_masked_rows: bool = False):
    """The context softmax(q k^T / sqrt(head_dim) + mask) v of each matrix of the batch and the
    attention weights; q is scaled (rounded in its dtype) before its product, as torch does.
    ``zero_masked_rows``: a query whose scores are all -inf gets weights 0, as in torch's
    scaled_dot_product_attention (see softmax_zeroing_masked_rows), rather than NaN."""
    scaled = q * math.sqrt(1.0 / float(q.shape[-1]))
    with _hooks.named_function("attention.scores"):
        scores = bmm(scaled, k.transpose(1, 2), **_keywords(how))
    if mask is not None:
        scores = masked_scores(scores, mask)
    with _hooks.named_function("attention.softmax"):
        if zero_masked_rows:
            weights = softmax_zeroing_masked_rows(scores, lambda s: F.softmax(s, dim=-1))
        else:
            weights = F.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    with _hooks.named_function("attention.context"):
        return bmm(weights, v, **_keywords(how)), weights


def _out_arithmetic(out_proj_macs, how: Arithmetic) -> Arithmetic:
    """The Arithmetic of the out projection: ``how`` for None, else the (forward, input gradient,
    weight gradient) triple.

    Raises:
        TypeError: out_proj_macs is not None or a triple of MACs.
    """
    if out_proj_macs is None:
        return how
    if not isinstance(out_proj_macs, tuple) or len(out_proj_macs) != 3:
        raise TypeError(
            "out_proj_macs must be None or a (forward, input gradient, weight gradient) tuple of "
            f"MACs, got {out_proj_macs!r}"
        )
    return arithmetic(*out_proj_macs, None, None, None, "nearest")


def multi_head_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: torch.Tensor | None,
    in_proj_bias: torch.Tensor | None,
    bias_k: torch.Tensor | None,
    bias_v: torch.Tensor | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: torch.Tensor,
    out_proj_bias: torch.Tensor | None,
    training: bool = True,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: torch.Tensor | None = None,
    k_proj_weight: torch.Tensor | None = None,
    v_proj_weight: torch.Tensor | None = None,
    static_k: torch.Tensor | None = None,
    static_v: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
    *,
    mac: MAC = NATIVE,
    input_grad_mac: MAC | None = None,
    weight_grad_mac: MAC | None = None,
    out_proj_macs: tuple[MAC, MAC, MAC] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch.nn.functional.multi_head_attention_forward (torch's arguments, shapes and results:
    query (L, N, E) or unbatched (L, E), key and value (S, N, kdim / vdim) or (S, ...)) with its
    four products under the MACs: ``mac``, ``input_grad_mac`` and ``weight_grad_mac`` for the
    input projections and the two products of attention, ``out_proj_macs`` (a (forward, input
    gradient, weight gradient) triple; None: those three) for the out projection. With H heads of
    head_dim = E / H, the batch of attention matrices is (N H), matrix n H + h being head h of
    sequence n; in each product below k (the MAC's term index) runs 0, ..., K - 1:

    - in projections: ``linear`` of query, key and value by their rows of in_proj_weight (or by
      q_proj_weight, k_proj_weight, v_proj_weight when use_separate_proj_weight): K = E (kdim,
      vdim for key and value), the input's features in order; the bias one rounded addition in
      the accumulator. Self-attention (query is key is value) is one product by the packed
      (3 E, E) weight, key is value one product by its (2 E, E) rows, as in torch.
    - scores: s[b, i, j] = sum over d of q'[b, i, d] k[b, j, d], K = head_dim, where
      q' = q * sqrt(1 / head_dim) is rounded to q's dtype before the product (torch scales q, not
      the scores). The mask (attn_mask plus key_padding_mask, bool masks as -inf) is then added
      in torch's arithmetic, in the scores' dtype, not in the accumulator (a float32 mask on
      bfloat16 or float16 scores as torch's in-place addition adds it: the sum rounded once to
      the scores' dtype).
    - attention weights: torch's softmax over j in the scores' dtype (float32 for float32
      operands, whatever the MAC), then, with dropout_p > 0 in training, torch's F.dropout (the
      same random draws as torch's).
    - context: c[b, i, d] = sum over j of p[b, i, j] v[b, j, d], K = S, the source positions in
      order (bias_k's, then add_zero_attn's, last; masked positions add zero terms).
    - out projection: ``linear`` of the context, K = E over (head, head_dim) head-major, the bias
      one rounded addition, under out_proj_macs.

    The backward products are the functions' own: for scores = bmm(q', k^T), the gradient of q'
    sums over j (K = S) under input_grad_mac and that of k over i (K = L) under weight_grad_mac;
    for the context = bmm(p, v), the gradient of p sums over d (K = head_dim) under
    input_grad_mac and that of v over i (K = L) under weight_grad_mac; the projections' weight
    gradients sum over (position, sequence), in that order. A tensor used twice (query as key,
    say) gets the sum of its gradients from autograd, in torch's arithmetic.

    is_causal is torch's hint: attn_mask, which it requires, is the causal mask and is used as
    given, except where torch takes the hint itself (need_weights=False and no
    key_padding_mask): there, as in torch, attn_mask is dropped and the keys j > i are masked
    among all the keys, bias_k's and add_zero_attn's positions included (which a query i < S
    then does not see, where the given mask, padded, would let every query see them).
    need_weights decides whether the weights (after dropout, averaged over heads with
    average_attn_weights) are returned; the computation is always the explicit one (torch's
    need_weights=False path is its fused scaled_dot_product_attention, not simulated here),
    except that with need_weights=False a query whose keys are all masked gets weights 0 (its
    context 0, its gradients zero), as that path of torch's gives it, where the explicit one
    (need_weights=True) gives NaN. With the native MACs every product is torch's and the result
    equals torch's to rounding.

    Random words: each linear draws its own seed, each bmm one seed with matrix b at offset b.

    Raises:
        TypeError: a MAC argument is malformed, a mask is neither bool nor floating-point, or a
            non-native MAC gets float64 operands.
        ValueError: the shapes do not match torch's, num_heads is not an int >= 1, dropout_p is
            outside [0, 1] (torch's explicit path skips a negative one), or is_causal is given
            without attn_mask.
    """
    if isinstance(num_heads, bool) or not hasattr(num_heads, "__index__") or num_heads < 1:
        raise ValueError(
            f"multi_head_attention_forward: num_heads must be an int >= 1, got {num_heads!r}"
        )
    if not 0.0 <= dropout_p <= 1.0:  # NaN too; torch's explicit path skips dropout for them
        raise ValueError(
            f"multi_head_attention_forward: dropout_p must be in [0, 1], got {dropout_p}"
        )
    how = arithmetic(mac, input_grad_mac, weight_grad_mac, None, None, None, "nearest")
    out_how = _out_arithmetic(out_proj_macs, how)
    batched = _attention_is_batched(query, key, value, key_padding_mask, attn_mask)
    if not batched:  # one sequence (each unsqueezed on its own, as in torch)
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    tgt_len, bsz, embed_dim = query.shape
    src_len = key.shape[0]
    if embed_dim != embed_dim_to_check or embed_dim % num_heads:
        raise ValueError(
            f"query's embedding dimension {embed_dim} must be embed_dim_to_check "
            f"({embed_dim_to_check}) and divisible by num_heads ({num_heads})"
        )
    if key.shape[:2] != value.shape[:2] or (
        not use_separate_proj_weight and key.shape != value.shape
    ):
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} do not match")
    if is_causal and attn_mask is None:
        raise ValueError("is_causal needs attn_mask (the causal mask), as in torch")
    head_dim, batch_heads = embed_dim // num_heads, bsz * num_heads
    # torch takes the hint itself where it computes no weights and has no padding mask: it drops
    # attn_mask and its scaled_dot_product_attention masks the keys j > i among the final keys
    # (bias_k's and add_zero_attn's positions included).
    causal = is_causal and key_padding_mask is None and not need_weights
    key_padding_mask = _additive_mask(key_padding_mask, "key_padding_mask", query.dtype)
    attn_mask = None if causal else _additive_mask(attn_mask, "attn_mask", query.dtype)
    attn_mask = _three_dimensional_mask(attn_mask, batch_heads, tgt_len, src_len)
    separate = (q_proj_weight, k_proj_weight, v_proj_weight)
    q, k, v = _in_projections(
        query, key, value, in_proj_weight, in_proj_bias, use_separate_proj_weight, separate, how
    )
    biases, statics = (bias_k, bias_v), (static_k, static_v)
    k, v, attn_mask, key_padding_mask = _sources(
        k, v, biases, statics, add_zero_attn, (attn_mask, key_padding_mask), bsz, num_heads
    )
    q = _heads(q, batch_heads, head_dim)
    src_len = k.shape[1]
    if causal:
        future = torch.ones(tgt_len, src_len, dtype=torch.bool, device=q.device).triu(1)
        attn_mask = torch.zeros(1, tgt_len, src_len, dtype=q.dtype, device=q.device)
        attn_mask = attn_mask.masked_fill(future, float("-inf"))
    mask = _merged_mask(attn_mask, key_padding_mask, bsz, num_heads, src_len)
    dropout_p = dropout_p if training else 0.0
    # torch's need_weights=False path is its scaled_dot_product_attention, whose rows of scores
    # all -inf give weights 0; its explicit path gives softmax's NaN.
    context, attention = _attention(q, k, v, mask, dropout_p, how, not need_weights)
    context = context.transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
    with _hooks.submodule_call("out_proj"):  # nn.MultiheadAttention's out_proj, bypassed
        output = linear(context, out_proj_weight, out_proj_bias, **_keywords(out_how))
    output = output.reshape(tgt_len, bsz, output.shape[-1])
    if not batched:
        output = output.squeeze(1)
    if not need_weights:
        return output, None
    attention = attention.reshape(bsz, num_heads, tgt_len, src_len)
    if average_attn_weights:
        attention = attention.mean(dim=1)
    return output, attention if batched else attention.squeeze(0)
