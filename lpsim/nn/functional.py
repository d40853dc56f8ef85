"""Matrix products and convolutions whose every dot product is summed as a MAC prescribes, in the
forward pass and in both products of the backward pass.

Each function has torch.nn.functional's (or torch's) signature plus the keywords:

- ``mac``: the arithmetic of the forward product (an ``lpsim.MAC``; the default ``MAC()`` is
  torch's own float32 product);
- ``input_grad_mac``, ``weight_grad_mac``: the arithmetic of the backward products that give the
  gradient of the input (dgrad) and of the weight (wgrad, and the bias gradient); None, the
  default, is ``mac``;
- ``input_format``, ``weight_format``: None, a format, or a (format, rounding) pair: the operands
  are quantised before the product (a bare format by ``rounding``, "nearest" by default), with the
  straight-through gradient;
- ``grad_format``: likewise, the gradient arriving at the result, quantised before both backward
  products (the layer's error).

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
- ``bias`` is added after the sum, as one more rounded addition in the forward MAC's
  accumulator (result = round(s + bias) by its rule; torch's float32 addition for the native
  MAC); its gradient sums the output gradient over every position, in the order of the weight
  gradient, under ``weight_grad_mac``.

Random words: every stochastic product draws a seed from torch's default CPU generator (so
``torch.manual_seed`` makes a run reproducible); the matrices of a batch and the groups of a
convolution use the offsets 0, 1, ... of that seed (lpsim.mac's words within each).

The results have the dtype ``lpsim.mac.matmul`` gives (the operands' when the accumulator fits it,
else float32). Without any non-native MAC and format the functions are torch's own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from lpsim import mac as _mac
from lpsim._checks import draw_seed
from lpsim.mac import MAC
from lpsim.nn.quantizer import QuantSpec, Spec, as_spec, quantizing_function
from lpsim.rounding import Rounding
from lpsim.update import sr_add

__all__ = ["linear", "matmul", "bmm", "conv1d", "conv2d", "NATIVE"]

NATIVE = MAC()  # torch's own float32 product: the default of every MAC keyword


class Arithmetic(NamedTuple):
    """The three products of a layer and the formats of its operands (see the module docstring).
    ``input_grad`` and ``weight_grad`` are MACs here (None resolved to ``forward``)."""

    forward: MAC
    input_grad: MAC
    weight_grad: MAC
    input_spec: QuantSpec | None
    weight_spec: QuantSpec | None
    grad_spec: QuantSpec | None

    @property
    def native(self) -> bool:
        """Whether every product is torch's own and no operand is quantised."""
        return (
            self.forward.native
            and self.input_grad.native
            and self.weight_grad.native
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
) -> Arithmetic:
    """The validated Arithmetic of the functions' keywords.

    Raises:
        TypeError: a MAC argument is not a MAC, or a format argument is malformed.
    """
    for name, value in (
        ("mac", mac),
        ("input_grad_mac", input_grad_mac),
        ("weight_grad_mac", weight_grad_mac),
    ):
        if not isinstance(value, MAC) and not (value is None and name != "mac"):
            raise TypeError(f"{name} must be a lpsim.MAC, got {type(value).__name__}")
    return Arithmetic(
        mac,
        mac if input_grad_mac is None else input_grad_mac,
        mac if weight_grad_mac is None else weight_grad_mac,
        as_spec(input_format, rounding, "input_format"),
        as_spec(weight_format, rounding, "weight_format"),
        as_spec(grad_format, rounding, "grad_format"),
    )


def _seed(mac: MAC) -> int | None:
    """One seed for the products of one call under ``mac`` (None: the rule draws no words)."""
    return int(draw_seed()) if not mac.native and mac.drawing_rule.is_stochastic else None


def _product(a: torch.Tensor, b: torch.Tensor, mac: MAC, seed: int | None, offset: int):
    """a @ b under mac, the operands brought to one dtype (the wider)."""
    dtype = torch.promote_types(a.dtype, b.dtype)
    a, b = a.to(dtype), b.to(dtype)
    if mac.native:
        return torch.matmul(a, b)
    if dtype == torch.float64:
        raise TypeError(
            "a product under a non-native MAC takes float32, bfloat16 or float16 operands (float64 "
            "products would not be exact), got float64: an accumulator wider than float32 gives "
            "float64 results, whose gradients no simulated backward product can take"
        )
    return _mac.matmul(a, b, mac, seed=seed, offset=offset)


def _batched(a: torch.Tensor, b: torch.Tensor, mac: MAC) -> torch.Tensor:
    """a[i] @ b[i] for every matrix of the (B, M, K) and (B, K, N) batches, matrix i at offset i."""
    if mac.native:
        return torch.matmul(*(t.to(torch.promote_types(a.dtype, b.dtype)) for t in (a, b)))
    seed = _seed(mac)
    return torch.stack([_product(a[i], b[i], mac, seed, i) for i in range(a.shape[0])])


class _BatchedProduct(torch.autograd.Function):
    """c[i] = a[i] @ b[i] under the forward MAC; dA[i] = g[i] b[i]^T under input_grad and
    dB[i] = a[i]^T g[i] under weight_grad."""

    @staticmethod
    def forward(ctx, a, b, how: Arithmetic):
        ctx.save_for_backward(a, b)
        ctx.how = how
        return _batched(a, b, how.forward)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        how = ctx.how
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = _batched(grad, b.transpose(1, 2), how.input_grad)
        if ctx.needs_input_grad[1]:
            grad_b = _batched(a.transpose(1, 2), grad, how.weight_grad)
        return grad_a, grad_b, None


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


class _AddBias(torch.autograd.Function):
    """y + bias along ``dim``, rounded once into the forward MAC's accumulator; the bias gradient
    sums the output gradient over every other position (batch-major) under weight_grad."""

    @staticmethod
    def forward(ctx, y, bias, dim: int, how: Arithmetic):
        ctx.dim, ctx.how = dim, how
        ctx.bias_dtype = bias.dtype
        shape = [1] * y.dim()
        shape[dim] = -1
        b = bias.reshape(shape)
        if how.forward.native:
            return y + b
        mac = how.forward
        rbits = mac.rbits if mac.rounding.is_stochastic else None
        return sr_add(y, b.to(y.dtype), mac.accumulator, mac.rounding, rbits=rbits)

    @staticmethod
    def backward(ctx, grad):
        how = ctx.how
        grad_bias = None
        if ctx.needs_input_grad[1]:
            rows = grad.movedim(ctx.dim, -1).reshape(-1, grad.shape[ctx.dim])
            ones = torch.ones(1, rows.shape[0], dtype=rows.dtype)
            grad_bias = _product(ones, rows, how.weight_grad, _seed(how.weight_grad), 0)[0]
        return grad, grad_bias, None, None


def _add_bias(y, bias, dim: int, how: Arithmetic):
    return y if bias is None else _AddBias.apply(y, bias, dim, how)


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
) -> torch.Tensor:
    """torch.matmul(input, other) under the MACs (the module docstring states the terms and their
    order; ``other`` takes the weight's role: weight_format, weight_grad_mac).

    Raises:
        TypeError: a MAC or format argument is malformed, or an operand dtype is unsupported by
            a non-native MAC (float64: its products would not be exact).
        ValueError: the shapes do not match, or a non-native MAC gets a non-CPU operand.
    """
    how = arithmetic(
        mac, input_grad_mac, weight_grad_mac, input_format, weight_format, grad_format, rounding
    )
    if how.native:
        return torch.matmul(input, other)
    a, b = _quantised_operands(input, other, how)
    if a.dim() == 0 or b.dim() == 0:
        raise ValueError("matmul: both operands need at least one dimension")
    vector_a, vector_b = a.dim() == 1, b.dim() == 1
    if vector_a:
        a = a.unsqueeze(0)
    if vector_b:
        b = b.unsqueeze(1)
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"matmul: input (..., M, K) and other (..., K, N) disagree on K: "
            f"{tuple(input.shape)} and {tuple(other.shape)}"
        )
    if b.dim() == 2:  # fold the input's leading dimensions into the rows, as torch does
        c = _BatchedProduct.apply(a.reshape(1, -1, a.shape[-1]), b.unsqueeze(0), how)
        c = c.reshape(*a.shape[:-1], b.shape[-1])
    else:
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
        b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
        c = _BatchedProduct.apply(a3, b3, how).reshape(*batch, a.shape[-2], b.shape[-1])
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
) -> torch.Tensor:
    """torch.bmm(input, mat2) under the MACs: input (B, M, K), mat2 (B, K, N).

    Raises:
        ValueError: the operands are not 3-D or their shapes do not match; otherwise as matmul.
    """
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
) -> torch.Tensor:
    """torch.nn.functional.linear(input, weight, bias) under the MACs: input (..., in_features),
    weight (out_features, in_features), bias (out_features) added as the module docstring states.

    Raises:
        ValueError: the shapes do not match; otherwise as matmul.
    """
    how = arithmetic(
        mac, input_grad_mac, weight_grad_mac, input_format, weight_format, grad_format, rounding
    )
    if how.native:
        return F.linear(input, weight, bias)
    if weight.dim() != 2 or input.dim() < 1 or input.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear takes input (..., in_features) and weight (out_features, in_features), got "
            f"{tuple(input.shape)} and {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    x, w = _quantised_operands(input, weight, how)
    rows = x.reshape(1, -1, x.shape[-1])
    y = _BatchedProduct.apply(rows, w.t().unsqueeze(0), how)[0]
    y = _add_bias(y, bias, 1, how).reshape(*x.shape[:-1], w.shape[0])
    return _with_grad_format(y, how)


class _Geometry(NamedTuple):
    """A 2-D convolution's stride, padding (top, bottom, left, right), dilation and groups."""

    stride: tuple[int, int]
    padding: tuple[int, int, int, int]
    dilation: tuple[int, int]
    groups: int


def _pair(name: str, value, dims: int) -> tuple[int, ...]:
    values = (value,) * dims if isinstance(value, int) else tuple(value)
    if len(values) != dims or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    ):
        raise TypeError(f"{name} must be an int or a tuple of {dims} ints, got {value!r}")
    return values


def _geometry(weight_shape, stride, padding, dilation, groups, dims: int) -> _Geometry:
    """The 2-D geometry of a conv1d (dims 1, as a 1 x L image) or conv2d call.

    Raises:
        ValueError: a value is out of range (stride, dilation, groups < 1; padding < 0; "same" with
            a stride; an unknown padding string).
    """
    stride = _pair("stride", stride, dims)
    dilation = _pair("dilation", dilation, dims)
    if min(stride) < 1 or min(dilation) < 1:
        raise ValueError(f"stride and dilation must be >= 1, got {stride} and {dilation}")
    if not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be an int >= 1, got {groups!r}")
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
    if mac.native:
        return F.conv2d(x, w, None, stride, 0, dilation)
    columns = F.unfold(x, (kh, kw), dilation=dilation, stride=stride)  # (N, C kh kw, L)
    columns = columns.transpose(0, 1).reshape(columns.shape[1], -1)
    y = _product(w.reshape(o, -1), columns, mac, seed, offset)  # (O, N L)
    return y.reshape(o, n, ho, wo).transpose(0, 1)


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
    if mac.native:
        return _native_input_grad(grad, w, input_size, geometry)
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
    if mac.native:
        return torch.nn.grad.conv2d_weight(
            padded, w_shape, grad, geometry.stride, 0, geometry.dilation, geometry.groups
        )
    seed = _seed(mac)
    parts = []
    for g, (xg, gg) in enumerate(
        zip(_groups(padded, geometry.groups, 1), _groups(grad, geometry.groups, 1))
    ):
        columns = F.unfold(xg, (kh, kw), dilation=geometry.dilation, stride=geometry.stride)
        rows = gg.transpose(0, 1).reshape(gg.shape[1], -1)  # (O, N L)
        columns = columns.transpose(1, 2).reshape(-1, columns.shape[1])  # (N L, C kh kw)
        parts.append(_product(rows, columns, mac, seed, g).reshape(gg.shape[1], -1, kh, kw))
    return torch.cat(parts, 0)


class _Convolution(torch.autograd.Function):
    """The 2-D convolution of x by w under the forward MAC, and its two gradients under
    input_grad and weight_grad (see the module docstring for the terms and their order)."""

    @staticmethod
    def forward(ctx, x, w, geometry: _Geometry, how: Arithmetic):
        ctx.save_for_backward(x, w)
        ctx.geometry, ctx.how = geometry, how
        return _conv_forward(x, w, geometry, how.forward)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        how, geometry = ctx.how, ctx.geometry
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _conv_input_grad(grad, w, x.shape, geometry, how.input_grad)
        if ctx.needs_input_grad[1]:
            grad_w = _conv_weight_grad(x, grad, w.shape, geometry, how.weight_grad)
        return grad_x, grad_w, None, None


def _conv(input, weight, bias, geometry: _Geometry, how: Arithmetic, dims: int):
    if input.dim() != dims + 2 or weight.dim() != dims + 2:
        raise ValueError(
            f"conv{dims}d takes input (N, C, {'L' if dims == 1 else 'H, W'}) and weight "
            f"(O, C / groups, {'k' if dims == 1 else 'kh, kw'}), got {tuple(input.shape)} and "
            f"{tuple(weight.shape)}"
        )
    groups = geometry.groups
    if input.shape[1] != weight.shape[1] * groups or weight.shape[0] % groups:
        raise ValueError(
            f"conv{dims}d: input channels ({input.shape[1]}) must be groups ({groups}) x the "
            f"weight's ({weight.shape[1]}), and output channels ({weight.shape[0]}) a multiple "
            "of groups"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    x, w = _quantised_operands(input, weight, how)
    if dims == 1:
        x, w = x.unsqueeze(2), w.unsqueeze(2)
    y = _add_bias(_Convolution.apply(x, w, geometry, how), bias, 1, how)
    if dims == 1:
        y = y.squeeze(2)
    return _with_grad_format(y, how)


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
    """torch.nn.functional.conv2d under the MACs: input (N, C, H, W), weight (O, C / groups, kh,
    kw); padding an int, a pair, "valid" or "same" (stride 1), zeros.

    Raises:
        TypeError: stride, padding or dilation is not an int or a pair of ints; otherwise as
            matmul.
        ValueError: the shapes do not match or a value is out of range.
    """
    how = arithmetic(
        mac, input_grad_mac, weight_grad_mac, input_format, weight_format, grad_format, rounding
    )
    if how.native:
        return F.conv2d(input, weight, bias, stride, padding, dilation, groups)
    geometry = _geometry(weight.shape, stride, padding, dilation, groups, 2)
    return _conv(input, weight, bias, geometry, how, 2)


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
    """torch.nn.functional.conv1d under the MACs: input (N, C, L), weight (O, C / groups, k),
    computed as conv2d of 1 x L images (the same terms in the same order).

    Raises:
        As conv2d.
    """
    how = arithmetic(
        mac, input_grad_mac, weight_grad_mac, input_format, weight_format, grad_format, rounding
    )
    if how.native:
        return F.conv1d(input, weight, bias, stride, padding, dilation, groups)
    geometry = _geometry(weight.shape, stride, padding, dilation, groups, 1)
    return _conv(input, weight, bias, geometry, how, 1)
