"""lpsim.nn.functional: linear, matmul, bmm, conv1d and conv2d under MACs, with autograd.

Two kinds of proof. With small-integer operands every sum is exact in float32, so the simulated
ops under an exact float32 accumulator must give torch's float64 results and gradients bit for bit:
this checks the decomposition (unfold, the transposed convolution as a direct one, groups, bias)
for every geometry. With a rounding accumulator, single results are recomputed by a plain loop
that enumerates the terms the module docstring names, in its order, and sums them with the exact
reference (lpsim.reference.mac_dot): this checks the order of the additions."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from support import assert_same_bits

import lpsim
import lpsim.nn.functional as LF
from lpsim import MAC, Float
from lpsim import reference as ref

EXACT = MAC(accumulator=Float(8, 23))  # exact for the small-integer operands below
FLOAT16 = MAC(accumulator=Float(5, 10))
BFLOAT16_SR = MAC(accumulator=Float(8, 7), rounding="stochastic")


def ints(*shape, seed=0, low=-3, high=4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).float()


def torch_grads(op, tensors, grad, **kwargs):
    """The result and gradients of torch's own op in float64 on the same values."""
    leaves = [t.detach().double().requires_grad_() for t in tensors]
    y = op(*leaves, **kwargs)
    y.backward(grad.double())
    return y.detach(), [t.grad for t in leaves]


def simulated_grads(op, tensors, grad, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    y = op(*leaves, **kwargs)
    y.backward(grad)
    return y.detach(), [t.grad for t in leaves]


def assert_matches_torch(op, simulated, tensors, **kwargs):
    y_ref = op(*[t.double() for t in tensors], **kwargs)
    grad = ints(*y_ref.shape, seed=99)
    y_torch, grads_torch = torch_grads(op, tensors, grad, **kwargs)
    y_sim, grads_sim = simulated_grads(simulated, tensors, grad, mac=EXACT, **kwargs)
    # A MAC's sum starts from its first term, BLAS's from +0: a sum of zeros of which the first is
    # -0 is -0 here and +0 there (both IEEE sums). Adding +0 makes every zero +0.
    assert_same_bits(y_sim.double() + 0.0, y_torch + 0.0, "result")
    for name, got, want in zip("xwb", grads_sim, grads_torch):
        assert_same_bits(got.double() + 0.0, want + 0.0, f"gradient of {name}")


# ---- The decomposition: exact sums give torch's results and gradients bit for bit.


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 7), (7,)])
def test_linear_matches_torch_on_exact_sums(shape, bias):
    tensors = [ints(*shape, seed=1), ints(4, 7, seed=2)] + ([ints(4, seed=3)] if bias else [])
    assert_matches_torch(F.linear, LF.linear, tensors)


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 7), (7,)])
def test_linear_of_a_one_dimensional_weight_matches_torch(shape):
    # torch's weight (in_features,): one output feature, its dimension dropped; bias () with a
    # 1-D input (torch refuses a bias with a 1-D weight and a batched input).
    tensors = [ints(*shape, seed=23), ints(7, seed=24)]
    assert_matches_torch(F.linear, LF.linear, tensors)
    if len(shape) == 1:
        assert_matches_torch(F.linear, LF.linear, tensors + [ints(seed=25)])


@pytest.mark.parametrize(
    "x_shape, w_shape, b_shape",
    [
        ((5, 7), (4, 7), (1, 4)),
        ((5, 7), (4, 7), (5, 4)),
        ((5, 7), (4, 7), (5, 1)),
        ((5, 7), (4, 7), (1, 1)),
        ((5, 7), (4, 7), (1,)),
        ((5, 7), (4, 7), ()),
        ((2, 3, 7), (4, 7), (1, 4)),
        ((2, 3, 7), (4, 7), (3, 4)),
        ((2, 3, 7), (4, 7), (2, 1, 4)),
        ((2, 3, 7), (4, 7), (1, 3, 4)),
        ((2, 3, 7), (4, 7), (2, 3, 1)),
        ((2, 3, 7), (4, 7), (2, 3, 4)),
        ((2, 3, 7), (7,), (1, 1)),
        ((7,), (4, 7), (1,)),
    ],
    ids=str,
)
def test_linear_bias_that_broadcasts_to_the_result_is_added_as_torch(x_shape, w_shape, b_shape):
    """torch's linear adds any bias that broadcasts to the result's shape (without changing it);
    its gradient sums the output gradient over the broadcast dimensions."""
    tensors = [ints(*x_shape, seed=26), ints(*w_shape, seed=27), ints(*b_shape, seed=28)]
    assert_matches_torch(F.linear, LF.linear, tensors)


@pytest.mark.parametrize(
    "x_shape, w_shape, b_shape",
    [
        ((2, 3, 7), (4, 7), (5,)),
        ((2, 3, 7), (4, 7), (4, 1)),
        ((2, 3, 7), (4, 7), (3, 2, 3, 4)),
        ((2, 3, 7), (4, 7), (1, 2, 3, 4)),
        ((7,), (4, 7), (3, 4)),
        ((7,), (7,), (1,)),
        ((2, 3, 7), (7,), (2, 3, 1)),
    ],
    ids=str,
)
def test_linear_refuses_a_bias_that_does_not_broadcast_to_the_result_as_torch(
    x_shape, w_shape, b_shape
):
    """A bias that does not broadcast to the result, or would make it larger, is refused (as
    torch's linear refuses it), naming the bias and the result's shape."""
    x, w, b = ints(*x_shape), ints(*w_shape), ints(*b_shape)
    with pytest.raises(RuntimeError):
        F.linear(x.clone().requires_grad_(), w, b)
    with pytest.raises(ValueError, match="bias"):
        LF.linear(x, w, b, mac=EXACT)


@pytest.mark.parametrize(
    "a_shape, b_shape",
    [
        ((3, 5), (5, 4)),
        ((5,), (5, 4)),
        ((3, 5), (5,)),
        ((2, 3, 5), (5, 4)),
        ((2, 3, 5), (2, 5, 4)),
        ((2, 1, 3, 5), (4, 5, 2)),
        ((5,), (2, 5, 3)),
    ],
)
def test_matmul_matches_torch_on_exact_sums(a_shape, b_shape):
    tensors = [ints(*a_shape, seed=4), ints(*b_shape, seed=5)]
    assert_matches_torch(torch.matmul, LF.matmul, tensors)


def test_bmm_matches_torch_on_exact_sums():
    tensors = [ints(3, 4, 5, seed=6), ints(3, 5, 2, seed=7)]
    assert_matches_torch(torch.bmm, LF.bmm, tensors)


CONV2D_GEOMETRIES = [
    dict(stride=1, padding=0, dilation=1, groups=1, kernel=3),
    dict(stride=2, padding=1, dilation=1, groups=1, kernel=3),
    dict(stride=2, padding=2, dilation=2, groups=2, kernel=3),
    dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=1, kernel=2),
    dict(stride=1, padding="same", dilation=1, groups=1, kernel=2),
    dict(stride=1, padding="same", dilation=2, groups=2, kernel=4),
    dict(stride=1, padding="valid", dilation=1, groups=1, kernel=3),
    dict(stride=3, padding=4, dilation=1, groups=1, kernel=3),  # padding beyond the kernel's reach
    dict(stride=3, padding=0, dilation=1, groups=6, kernel=1),  # depthwise, uncovered rows
]


@pytest.mark.filterwarnings(
    "ignore:Using padding='same' with even kernel"
)  # torch's own, on even kernels
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("geometry", CONV2D_GEOMETRIES, ids=str)
def test_conv2d_matches_torch_on_exact_sums(geometry, bias):
    g = dict(geometry)
    k, groups = g.pop("kernel"), g["groups"]
    c, o = 6, 6
    tensors = [ints(2, c, 9, 8, seed=8), ints(o, c // groups, k, k, seed=9)]
    if bias:
        tensors.append(ints(o, seed=10))
    assert_matches_torch(F.conv2d, LF.conv2d, tensors, **g)


@pytest.mark.parametrize(
    "geometry",
    [
        dict(stride=1, padding=0, dilation=1, groups=1),
        dict(stride=2, padding=2, dilation=3, groups=2),
        dict(stride=1, padding="same", dilation=1, groups=1),
    ],
    ids=str,
)
def test_conv1d_matches_torch_on_exact_sums(geometry):
    tensors = [
        ints(3, 4, 11, seed=11),
        ints(6, 4 // geometry["groups"], 3, seed=12),
        ints(6, seed=13),
    ]
    assert_matches_torch(F.conv1d, LF.conv1d, tensors, **geometry)


@pytest.mark.parametrize(
    "op, simulated, x_shape, w_shape, geometry",
    [
        (F.conv2d, LF.conv2d, (6, 9, 8), (6, 3, 3, 2), dict(stride=2, padding=1, groups=2)),
        (F.conv2d, LF.conv2d, (6, 9, 8), (6, 6, 3, 3), dict(padding="same", dilation=2)),
        (F.conv1d, LF.conv1d, (4, 11), (6, 2, 3), dict(stride=2, padding=2, groups=2)),
    ],
    ids=["conv2d", "conv2d-same", "conv1d"],
)
def test_convolution_of_unbatched_input_matches_torch(op, simulated, x_shape, w_shape, geometry):
    tensors = [ints(*x_shape, seed=14), ints(*w_shape, seed=15), ints(w_shape[0], seed=16)]
    assert_matches_torch(op, simulated, tensors, **geometry)


@pytest.mark.parametrize(
    "x_layout, w_layout",
    [("contiguous", "channels_last"), ("channels_last", "contiguous"), ("channels_last",) * 2],
)
@pytest.mark.parametrize("x_shape", [(2, 3, 9, 8), (3, 9, 8)], ids=["batched", "unbatched"])
def test_conv2d_gives_its_result_the_layout_torchs_conv2d_gives(x_shape, x_layout, w_layout):
    """torch's conv2d gives a channels-last result where an operand is channels last, and the
    layers after it keep that layout: BatchNorm's CPU kernels sum in another order in it, so a
    contiguous result changed the bits of the next layer (against the native MAC's, torch's)."""
    formats = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
    x, w, b = ints(*x_shape, seed=20), ints(4, 3, 3, 3, seed=21), ints(4, seed=22)
    if len(x_shape) == 4:
        x = x.contiguous(memory_format=formats[x_layout])
    w = w.contiguous(memory_format=formats[w_layout])
    want = F.conv2d(x, w, b, padding=1)
    accumulator = MAC(accumulator=Float(8, 7))
    got = LF.conv2d(x, w, b, padding=1, mac=accumulator)
    assert got.stride() == want.stride()
    assert_same_bits(got, LF.conv2d(x.contiguous(), w.contiguous(), b, padding=1, mac=accumulator))
    bn = torch.nn.BatchNorm2d(4)
    if len(x_shape) == 4:
        assert_same_bits(bn(got), bn(want))  # the products of small integers are exact


@pytest.mark.parametrize(
    "geometry",
    [
        dict(stride=(2,), padding=(1,), dilation=(2,)),
        dict(stride=[1], padding=[2], dilation=[1]),
        dict(stride=torch.tensor(2), padding=1),
    ],
    ids=str,
)
def test_conv2d_takes_one_value_for_both_dimensions_as_torch(geometry):
    tensors = [ints(2, 3, 9, 8, seed=17), ints(4, 3, 3, 3, seed=18)]
    assert_matches_torch(F.conv2d, LF.conv2d, tensors, **geometry)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "op, simulated, x_shape, w_shape, geometry",
    [
        (F.conv2d, LF.conv2d, (2, 0, 5, 4), (3, 0, 2, 2), dict(padding=1)),
        (F.conv2d, LF.conv2d, (2, 0, 5, 4), (3, 0, 2, 2), dict(padding=1, groups=3)),
        (F.conv2d, LF.conv2d, (0, 5, 4), (3, 0, 3, 2), dict(stride=2)),
        (F.conv1d, LF.conv1d, (2, 0, 7), (4, 0, 3), dict(padding="same", groups=2)),
        (F.conv1d, LF.conv1d, (0, 7), (4, 0, 3), dict(dilation=2)),
    ],
    ids=["conv2d", "conv2d-groups", "conv2d-unbatched", "conv1d-same-groups", "conv1d-unbatched"],
)
def test_convolution_without_input_channels_gives_torchs_empty_result_and_gradients(
    op, simulated, x_shape, w_shape, geometry, bias
):
    """torch's conv1d and conv2d give no output channels when the input has none (the bias
    included, whose gradient is zero); so do the simulated ones."""
    tensors = [torch.zeros(x_shape), torch.zeros(w_shape)]
    if bias:
        tensors.append(torch.tensor([1.0, -2.0, 0.5, 3.0])[: w_shape[0]])
    assert_matches_torch(op, simulated, tensors, **geometry)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: LF.conv2d(ints(1, 3, 5, 5), ints(0, 3, 3, 3), mac=EXACT), ValueError, "weight"),
        (
            lambda: LF.conv2d(ints(1, 3, 5, 5), ints(0, 1, 3, 3), groups=3, mac=EXACT),
            ValueError,
            "output channels",
        ),
        (lambda: LF.conv1d(ints(1, 3, 7), ints(0, 3, 3), mac=EXACT), ValueError, "weight"),
        (lambda: LF.conv2d(ints(1, 3, 5, 5), ints(2, 3, 6, 6), mac=EXACT), ValueError, "kernel"),
        (lambda: LF.conv2d(ints(3, 5), ints(2, 3, 3, 3), mac=EXACT), ValueError, "unbatched"),
        (
            lambda: LF.conv1d(ints(1, 3, 7), ints(2, 3, 3), stride=(1, 1), mac=EXACT),
            TypeError,
            "stride",
        ),
        (
            lambda: LF.conv2d(ints(1, 3, 5, 5), ints(2, 3, 3, 3), padding=(1, 1, 1), mac=EXACT),
            TypeError,
            "padding",
        ),
        (
            lambda: LF.conv2d(ints(1, 3, 5, 5), ints(2, 3, 3, 3), stride=2.0, mac=EXACT),
            TypeError,
            "stride",
        ),
    ],
    ids=[
        "no-output-channels",
        "fewer-than-groups",
        "conv1d-no-output-channels",
        "kernel-too-big",
        "2d-input",
        "conv1d-pair",
        "triple",
        "float",
    ],
)
def test_convolution_refuses_what_torch_refuses_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: LF.linear([[1.0]], ints(2, 1), mac=EXACT), "linear: input must be a tensor"),
        (lambda: LF.linear(ints(2, 3).int(), ints(4, 3), mac=EXACT), "linear: input .*int32"),
        (lambda: LF.linear(ints(2, 3), ints(4, 3), [1.0] * 4, mac=EXACT), "linear: bias"),
        (lambda: LF.matmul(ints(2, 3), ints(3, 4).long(), mac=EXACT), "matmul: other .*int64"),
        (lambda: LF.bmm(ints(1, 2, 3), (1, 2), mac=EXACT), "bmm: mat2 must be a tensor"),
        (
            lambda: LF.conv2d(ints(1, 2, 4, 4).int(), ints(2, 2, 3, 3).int(), mac=EXACT),
            "conv2d: input .*int32",
        ),
        (lambda: LF.conv1d(ints(1, 2, 4), None, mac=EXACT), "conv1d: weight must be a tensor"),
    ],
    ids=[
        "linear-list",
        "linear-int",
        "bias-list",
        "matmul-long",
        "bmm-tuple",
        "conv2d-int",
        "conv1d-none",
    ],
)
def test_simulated_products_refuse_operands_that_are_not_float_tensors_naming_them(call, match):
    with pytest.raises(TypeError, match=match):
        call()


@pytest.mark.parametrize(
    "op, simulated, dims",
    [(F.conv2d, LF.conv2d, 2), (F.conv1d, LF.conv1d, 1)],
    ids=["conv2d", "conv1d"],
)
def test_convolution_with_float64_results_takes_native_backward_products(op, simulated, dims):
    # Float(11, 52) gives float64 results, whose gradients need native backward MACs: torch's
    # products in float64, cast by autograd to the float32 operands' dtype (the module docstring).
    # The convolution's native backward products refused the float64 gradient of float32 tensors.
    x = ints(2, 4, *(7,) * dims, seed=19)
    w, b = ints(6, 2, *(3,) * dims, seed=20), ints(6, seed=21)
    wide, native = MAC(accumulator=Float(11, 52)), MAC()
    g = dict(stride=2, padding=1, groups=2)
    y_torch, grads_torch = torch_grads(op, (x, w, b), ints(2, 6, *(4,) * dims, seed=22), **g)
    y_sim, grads_sim = simulated_grads(
        simulated,
        (x, w, b),
        ints(2, 6, *(4,) * dims, seed=22).double(),
        mac=wide,
        input_grad_mac=native,
        weight_grad_mac=native,
        **g,
    )
    assert_same_bits(y_sim + 0.0, y_torch + 0.0, "result")
    for name, got, want in zip("xwb", grads_sim, grads_torch):
        assert_same_bits(got + 0.0, want.float() + 0.0, f"gradient of {name}")


# ---- The order of the additions, as the module docstring states it, against the exact reference.


def reference_sum(terms: list[float], mac: MAC) -> float:
    return ref.mac_dot(terms, mac)


def spread(*shape, seed) -> torch.Tensor:
    """Values of very different magnitudes, whose float16 sums round at every step."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 7, shape, generator=g))
    return x.to(torch.float16).float()


def test_conv2d_forward_sums_channel_then_kernel_row_then_column():
    x, w = spread(2, 3, 6, 5, seed=20), spread(4, 3, 3, 2, seed=21)
    stride, padding = (2, 1), (1, 1)
    y = LF.conv2d(x, w, None, stride, padding, mac=FLOAT16)
    xp = F.pad(x, (1, 1, 1, 1))
    for n, o, h, v in [(0, 0, 0, 0), (1, 3, 2, 4), (1, 2, 1, 3)]:
        terms = [
            xp[n, c, h * 2 + i, v + j].item() * w[o, c, i, j].item()
            for c in range(3)
            for i in range(3)
            for j in range(2)
        ]
        assert y[n, o, h, v].item() == reference_sum(terms, FLOAT16)


def conv_gradients(mac_name: str, mac: MAC, x, w, grad, **geometry):
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    kwargs = {mac_name: mac, "mac": EXACT}
    y = LF.conv2d(xl, wl, None, **geometry, **kwargs)
    y.backward(grad)
    return xl.grad, wl.grad


def test_conv2d_input_gradient_sums_output_channel_then_flipped_kernel():
    x, w = spread(1, 2, 7, 6, seed=22), spread(3, 2, 3, 3, seed=23)
    stride, padding, dilation = 2, 1, 1
    grad = spread(1, 3, 4, 3, seed=24)
    grad_x, _ = conv_gradients(
        "input_grad_mac", FLOAT16, x, w, grad, stride=stride, padding=padding, dilation=dilation
    )
    # The zero-dilated output gradient, padded by the kernel's reach minus the padding (plus the
    # rows and columns the stride leaves uncovered at the end).
    dilated = torch.zeros(1, 3, 7, 5)
    dilated[:, :, ::2, ::2] = grad
    dilated = F.pad(dilated, (1, 1 + 1, 1, 1))  # reach 2 - padding 1; one uncovered column
    flipped = w.flip(2, 3)
    for c, h, v in [(0, 0, 0), (1, 3, 2), (1, 6, 5), (0, 5, 4)]:
        terms = [
            dilated[0, o, h + i, v + j].item() * flipped[o, c, i, j].item()
            for o in range(3)
            for i in range(3)
            for j in range(3)
        ]
        assert grad_x[0, c, h, v].item() == reference_sum(terms, FLOAT16)


def test_conv2d_weight_gradient_sums_batch_then_position():
    x, w = spread(2, 2, 5, 5, seed=25), spread(3, 2, 2, 2, seed=26)
    grad = spread(2, 3, 4, 4, seed=27)
    _, grad_w = conv_gradients("weight_grad_mac", FLOAT16, x, w, grad)
    for o, c, i, j in [(0, 0, 0, 0), (2, 1, 1, 0), (1, 1, 1, 1)]:
        terms = [
            grad[n, o, h, v].item() * x[n, c, h + i, v + j].item()
            for n in range(2)
            for h in range(4)
            for v in range(4)
        ]
        assert grad_w[o, c, i, j].item() == reference_sum(terms, FLOAT16)


def _round_binary16(x: Fraction) -> Fraction:
    """x rounded to nearest even onto float16's grid (an exact model, no overflow here)."""
    if x == 0:
        return Fraction(0)
    exponent = -14  # float16's smallest normal exponent: subnormals share its ulp
    while abs(x) >= Fraction(2) ** (exponent + 1):
        exponent += 1
    ulp = Fraction(2) ** (exponent - 10)
    return round(x / ulp) * ulp  # Python's round of a Fraction: to nearest even


def _sequential_binary16(terms) -> Fraction:
    total = None
    for t in terms:
        total = _round_binary16(t if total is None else total + t)
    return Fraction(0) if total is None else total


def _chunked_binary16(terms, chunk: int) -> Fraction:
    """lpsim.mac's chunked order in float16: each chunk of ``chunk`` terms summed sequentially,
    each chunk's sum then added into the running sum, every addition rounded."""
    total = None
    for first in range(0, len(terms), chunk):
        u = _sequential_binary16(terms[first : first + chunk])
        total = u if total is None else _round_binary16(total + u)
    return Fraction(0) if total is None else total


@pytest.mark.parametrize("chunk", [None, 5], ids=["sequential", "chunks_of_5"])
def test_convolution_and_its_gradients_sum_as_a_fraction_model_of_the_docstring(chunk):
    """conv2d under a float16 accumulator, with stride, padding, dilation, groups and a bias,
    against a plain model of the module docstring in exact rational arithmetic: the forward sums
    (input channel, kernel row, kernel column), padding zeros included, then adds the bias in one
    more rounding; the input gradient sums (output channel, flipped kernel row, flipped kernel
    column) of the zero-dilated, padded error, its zeros included; the weight and bias gradients
    sum (batch, output position). In chunks (5 does not divide the 12 terms of the forward and
    input-gradient sums) the zero terms count: they decide where each chunk ends."""
    mac = FLOAT16 if chunk is None else MAC(accumulator=Float(5, 10), order="chunked", chunk=chunk)
    summed = _sequential_binary16 if chunk is None else (lambda t: _chunked_binary16(t, chunk))
    n, c, h, w, o, groups, kh, kw = 2, 4, 5, 6, 4, 2, 3, 2
    (sh, sw), (ph, pw), (dh, dw) = (2, 1), (1, 2), (1, 2)
    x = spread(n, c, h, w, seed=70).requires_grad_()
    k = spread(o, c // groups, kh, kw, seed=71).requires_grad_()
    b = spread(o, seed=72).requires_grad_()
    y = LF.conv2d(x, k, b, (sh, sw), (ph, pw), (dh, dw), groups, mac=mac)
    grad = spread(*y.shape, seed=73)
    y.backward(grad)
    fr = lambda t: Fraction(t.item())  # noqa: E731
    xp, kd, bd = F.pad(x.detach(), (pw, pw, ph, ph)), k.detach(), b.detach()
    cg, og = c // groups, o // groups
    ho, wo = y.shape[2:]
    for i, j, r, q in itertools.product(range(n), range(o), range(ho), range(wo)):
        g = j // og
        terms = [
            fr(kd[j, ci, u, v]) * fr(xp[i, g * cg + ci, r * sh + u * dh, q * sw + v * dw])
            for ci in range(cg)
            for u in range(kh)
            for v in range(kw)
        ]
        want = _round_binary16(summed(terms) + fr(bd[j]))
        assert fr(y[i, j, r, q]) == want, (i, j, r, q)
    for i, ch, r, q in itertools.product(range(n), range(c), range(h), range(w)):
        g, ci = ch // cg, ch % cg
        terms = []
        for j, u, v in itertools.product(range(g * og, (g + 1) * og), range(kh), range(kw)):
            row, col = r + ph - (kh - 1 - u) * dh, q + pw - (kw - 1 - v) * dw
            hit = row % sh == 0 and col % sw == 0 and 0 <= row // sh < ho and 0 <= col // sw < wo
            if hit:
                terms.append(
                    fr(kd[j, ci, kh - 1 - u, kw - 1 - v]) * fr(grad[i, j, row // sh, col // sw])
                )
            else:
                terms.append(Fraction(0))
        assert fr(x.grad[i, ch, r, q]) == summed(terms), (i, ch, r, q)
    for j, ci, u, v in itertools.product(range(o), range(cg), range(kh), range(kw)):
        g = j // og
        terms = [
            fr(grad[i, j, r, q]) * fr(xp[i, g * cg + ci, r * sh + u * dh, q * sw + v * dw])
            for i in range(n)
            for r in range(ho)
            for q in range(wo)
        ]
        assert fr(k.grad[j, ci, u, v]) == summed(terms), (j, ci, u, v)
    for j in range(o):
        terms = [fr(grad[i, j, r, q]) for i in range(n) for r in range(ho) for q in range(wo)]
        assert fr(b.grad[j]) == summed(terms), j


def test_linear_folds_leading_dimensions_into_the_weight_gradient_sum():
    x, w = spread(2, 3, 8, seed=28), spread(4, 8, seed=29)
    grad = spread(2, 3, 4, seed=30)
    wl = w.clone().requires_grad_()
    bl = torch.zeros(4, requires_grad=True)
    LF.linear(x, wl, bl, weight_grad_mac=FLOAT16, mac=EXACT).backward(grad)
    rows = x.reshape(6, 8)
    g = grad.reshape(6, 4)
    for o, i in [(0, 0), (3, 7), (2, 5)]:
        terms = [g[r, o].item() * rows[r, i].item() for r in range(6)]
        assert wl.grad[o, i].item() == reference_sum(terms, FLOAT16)
    for o in range(4):
        assert bl.grad[o].item() == reference_sum([g[r, o].item() for r in range(6)], FLOAT16)


def test_bias_is_one_rounded_addition_in_the_accumulator():
    x, w = torch.ones(1, 2048), torch.ones(1, 2048)
    bias = torch.tensor([1.0])
    # float16: the sum stagnates at 2048; 2048 + 1 rounds to nearest even, 2048.
    assert LF.linear(x, w, bias, mac=FLOAT16).item() == 2048.0
    assert LF.linear(x, w, bias + 2, mac=FLOAT16).item() == 2052.0


def test_a_bias_of_another_dtype_is_added_exactly_and_rounded_once():
    # A float32 bias on bfloat16 (float16) operands was first rounded to their dtype, then added:
    # two roundings (or an overflow) where the rule is one.
    one = torch.ones(1, 1, dtype=torch.bfloat16)
    bias = torch.tensor([2.0**-8 + 2.0**-20])  # 1 + bias lies just above a bfloat16 midpoint
    assert LF.linear(one, one, bias, mac=MAC(accumulator=Float(8, 7))).item() == 1 + 2.0**-7
    x, w = torch.ones(1, 1, dtype=torch.half), torch.full((1, 1), -10000.0, dtype=torch.half)
    assert LF.linear(x, w, torch.tensor([70000.0]), mac=FLOAT16).item() == 60000.0


@pytest.mark.parametrize(
    "call",
    [
        lambda mac: LF.linear(torch.zeros(2, 0), torch.zeros(3, 0), torch.ones(3), mac=mac),
        lambda mac: LF.linear(torch.zeros(0, 5, 4), torch.zeros(3, 4), torch.ones(3), mac=mac),
        lambda mac: LF.matmul(torch.zeros(2, 0), torch.zeros(0, 3), mac=mac),
        lambda mac: LF.matmul(torch.zeros(0, 2, 4), torch.zeros(4, 3), mac=mac),
        lambda mac: LF.bmm(torch.zeros(2, 2, 0), torch.zeros(2, 0, 3), mac=mac),
        lambda mac: LF.bmm(torch.zeros(0, 2, 4), torch.zeros(0, 4, 3), mac=mac),
    ],
    ids=["linear_k0", "linear_m0", "matmul_k0", "matmul_batch0", "bmm_k0", "bmm_batch0"],
)
def test_empty_products_give_torchs_shapes_and_values(call):
    # An empty sum (K = 0) or batch once failed inside the simulated ops (reshape(-1) of an empty
    # tensor, a stack of no matrices); the empty sum is +0, plus the bias rounded once.
    want = call(MAC())
    got = call(FLOAT16)
    assert_same_bits(got, want, "empty product")


def test_linear_equals_mac_matmul():
    x, w = spread(5, 33, seed=31), spread(6, 33, seed=32)
    assert_same_bits(LF.linear(x, w, mac=FLOAT16), lpsim.mac.matmul(x, w.t(), FLOAT16))


# ---- Formats, randomness, the fast path, errors.


def test_operand_formats_are_quantised_with_the_straight_through_gradient():
    x, w = spread(3, 5, seed=33).requires_grad_(), spread(2, 5, seed=34).requires_grad_()
    e4m3 = Float(4, 3)
    y = LF.linear(x, w, mac=EXACT, input_format=e4m3, weight_format=e4m3)
    xq, wq = (
        lpsim.quantize(x.detach(), e4m3, "nearest"),
        lpsim.quantize(w.detach(), e4m3, "nearest"),
    )
    assert_same_bits(y.detach(), lpsim.mac.matmul(xq, wq.t(), EXACT))
    grad = spread(3, 2, seed=35)
    y.backward(grad)
    assert_same_bits(x.grad, lpsim.mac.matmul(grad, wq, EXACT))
    assert_same_bits(w.grad, lpsim.mac.matmul(grad.t(), xq, EXACT))


def test_grad_format_rounds_the_error_before_both_backward_products():
    x, w = spread(3, 5, seed=36).requires_grad_(), spread(2, 5, seed=37).requires_grad_()
    e5m2 = Float(5, 2)
    LF.linear(x, w, mac=EXACT, grad_format=e5m2).backward(spread(3, 2, seed=38))
    gq = lpsim.quantize(spread(3, 2, seed=38), e5m2, "nearest")
    assert_same_bits(x.grad, lpsim.mac.matmul(gq, w.detach(), EXACT))
    assert_same_bits(w.grad, lpsim.mac.matmul(gq.t(), x.detach(), EXACT))


# (name, lpsim's op, torch's op, shapes of input, weight and bias)
_TORCH_OPS = [
    ("linear", LF.linear, F.linear, (2, 3, 40), (5, 40), (5,)),
    (
        "matmul",
        lambda x, w, b, **k: LF.matmul(x, w, **k),
        lambda x, w, b: x @ w,
        (6, 40),
        (40, 5),
        None,
    ),
    ("conv2d", LF.conv2d, F.conv2d, (2, 6, 5, 5), (4, 6, 3, 3), (4,)),
    ("conv1d", LF.conv1d, F.conv1d, (2, 6, 9), (4, 6, 3), (4,)),
]
_NATIVE_FORMATS = [
    dict(input_format=Float(4, 3)),
    dict(weight_format=(Float(5, 2), "toward_zero")),
    dict(grad_format=Float(5, 2)),
    dict(
        input_format=Float(4, 3), weight_format=Float(4, 3), grad_format=Float(5, 2), rounding="up"
    ),
]


@pytest.mark.parametrize("formats", _NATIVE_FORMATS, ids=lambda f: "-".join(sorted(f)))
@pytest.mark.parametrize("case", _TORCH_OPS, ids=lambda c: c[0])
def test_formats_under_native_macs_are_torchs_op_of_the_quantised_operands(case, formats):
    """With the native MACs the result is torch's op of the quantised operands, and the
    gradients torch's of the quantised error (straight through the operands' quantisation):
    a grad_format alone leaves the forward torch's, bit for bit."""
    _, simulated, torch_op, x_shape, w_shape, b_shape = case
    rule = formats.get("rounding", "nearest")

    def quantised(t, field):
        spec = formats.get(field)
        fmt, rounding = spec if isinstance(spec, tuple) else (spec, rule)
        return t if fmt is None else lpsim.quantize(t, fmt, rounding)

    torch.manual_seed(0)
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    b = None if b_shape is None else torch.randn(b_shape)
    leaves = [t if t is None else t.clone().requires_grad_() for t in (x, w, b)]
    y = simulated(*leaves, **formats)
    xq = quantised(x, "input_format").requires_grad_()
    wq = quantised(w, "weight_format").requires_grad_()
    bq = None if b is None else b.clone().requires_grad_()
    want = torch_op(xq, wq, bq)
    assert_same_bits(y.detach(), want.detach(), "result")
    grad = torch.randn(want.shape)
    y.backward(grad)
    want.backward(quantised(grad, "grad_format"))
    for name, got, expected in zip("xwb", leaves, (xq, wq, bq)):
        if got is not None:
            assert_same_bits(got.grad, expected.grad, f"gradient of {name}")


@pytest.mark.parametrize("mac", [MAC(), EXACT], ids=["native", "exact"])
@pytest.mark.parametrize(
    "op, simulated, x_shape, w_shape",
    [(F.conv2d, LF.conv2d, (4, 4, 4), (2, 4, 1, 1)), (F.conv1d, LF.conv1d, (4, 4), (2, 4, 1))],
)
def test_an_unbatched_convolution_input_is_quantised_as_given_under_any_mac(
    mac, op, simulated, x_shape, w_shape
):
    """An unbatched input's format quantises the tensor passed, (C, ...), as inject's input
    format does: axis=1 runs along its second axis under the native MAC as under a simulated
    one; so does the error's format (the result's gradient, unbatched)."""
    scale = torch.tensor([1.0, 8.0, 64.0, 512.0])[: x_shape[-1]]
    x = (ints(*x_shape, seed=74, low=-8, high=9) * scale).requires_grad_()
    w = ints(*w_shape, seed=75)
    fmt = lpsim.Scaled(Float(2, 1), block=4, axis=1)
    xq = lpsim.quantize(x.detach(), fmt).requires_grad_()
    want = op(xq, w)
    got = simulated(x, w, mac=mac, input_format=fmt, grad_format=fmt)
    assert_same_bits(got.detach(), want.detach())
    grad = ints(*want.shape, seed=76, low=-8, high=9) * scale[: want.shape[-1]]
    got.backward(grad)
    want.backward(lpsim.quantize(grad, fmt))
    # (+0: a MAC's sum of zeros that starts with -0 is -0, BLAS's +0)
    assert_same_bits(x.grad + 0.0, xq.grad + 0.0)


def test_stochastic_products_are_reproducible_under_manual_seed():
    x, w = spread(4, 40, seed=39), spread(3, 40, seed=40)
    torch.manual_seed(5)
    first = LF.linear(x, w, mac=BFLOAT16_SR)
    torch.manual_seed(5)
    assert_same_bits(LF.linear(x, w, mac=BFLOAT16_SR), first)
    torch.manual_seed(6)
    assert not torch.equal(LF.linear(x, w, mac=BFLOAT16_SR), first)


def test_matrices_of_a_batch_draw_disjoint_words():
    a = spread(1, 4, 40, seed=41).expand(2, 4, 40)
    b = spread(1, 40, 3, seed=42).expand(2, 40, 3)
    c = LF.bmm(a, b, mac=BFLOAT16_SR)
    assert not torch.equal(c[0], c[1])


def test_native_arithmetic_is_torch_itself():
    x, w, b = torch.randn(3, 5), torch.randn(2, 5), torch.randn(2)
    assert_same_bits(LF.linear(x, w, b), F.linear(x, w, b))
    img, k = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    assert_same_bits(LF.conv2d(img, k, None, 1, 1), F.conv2d(img, k, None, 1, 1))


@pytest.mark.parametrize("op", ["linear", "conv2d"])
def test_gradcheck_in_float64_with_the_native_mac(op):
    if op == "linear":
        args = (torch.randn(3, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64))
        fn = lambda x, w: LF.linear(x, w, grad_format=None)  # noqa: E731
    else:
        args = (
            torch.randn(1, 2, 5, 5, dtype=torch.float64),
            torch.randn(2, 2, 3, 3, dtype=torch.float64),
        )
        fn = lambda x, w: LF.conv2d(x, w, None, 2, 1)  # noqa: E731
    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in args))


def test_native_forward_with_simulated_backward():
    x, w = spread(3, 5, seed=43).requires_grad_(), spread(2, 5, seed=44).requires_grad_()
    y = LF.linear(x, w, input_grad_mac=FLOAT16, weight_grad_mac=FLOAT16)
    assert_same_bits(y.detach(), F.linear(x.detach(), w.detach()))
    grad = spread(3, 2, seed=45)
    y.backward(grad)
    assert_same_bits(x.grad, lpsim.mac.matmul(grad, w.detach(), FLOAT16))


@pytest.mark.parametrize(
    "op, simulated, a_shape, b_shape",
    [
        (torch.matmul, LF.matmul, (5, 11), (11, 7)),
        (torch.matmul, LF.matmul, (16, 5), (5, 1)),
        (torch.matmul, LF.matmul, (2, 8, 5), (5, 1)),
        (torch.matmul, LF.matmul, (1, 5, 11), (1, 11, 7)),
        (torch.matmul, LF.matmul, (3, 5, 11), (3, 11, 7)),
        (torch.matmul, LF.matmul, (300,), (300,)),
        (torch.matmul, LF.matmul, (300,), (300, 7)),
        (torch.matmul, LF.matmul, (2, 8, 300), (300,)),
        (torch.matmul, LF.matmul, (300,), (3, 300, 7)),
        (torch.matmul, LF.matmul, (2, 1, 3, 300), (5, 300, 6)),
        (F.linear, LF.linear, (5, 11), (7, 11)),
        (F.linear, LF.linear, (2, 8, 5), (1, 5)),
        (F.linear, LF.linear, (300,), (300,)),
        (F.linear, LF.linear, (2, 3, 300), (300,)),
    ],
)
def test_a_native_forward_mac_is_torchs_product_whatever_the_backward_macs(
    op, simulated, a_shape, b_shape
):
    """The forward product under MAC() is torch's own op, bit for bit, also when only the
    backward products are simulated: torch's op of the operands as given, whose kernel torch
    picks by their shapes (dot for two vectors: the matrices (1, K) and (K, 1) that the product
    folds them into would take mm, which sums in another order)."""
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(a_shape, generator=g), torch.randn(b_shape, generator=g)
    assert_same_bits(simulated(a, b, input_grad_mac=FLOAT16, weight_grad_mac=FLOAT16), op(a, b))


@pytest.mark.parametrize(
    "op, simulated, x_shape, w_shape, geometry",
    [
        (F.conv2d, LF.conv2d, (2, 2, 9, 8), (3, 2, 2, 2), dict(padding=2)),
        (F.conv2d, LF.conv2d, (2, 8, 9, 8), (8, 2, 3, 3), dict(padding=1, groups=4)),
        (F.conv1d, LF.conv1d, (2, 2, 13), (3, 2, 2), dict(padding=2)),
        (F.conv1d, LF.conv1d, (8, 13), (8, 2, 3), dict(stride=2, groups=4)),
    ],
)
def test_a_native_forward_mac_is_torchs_convolution_whatever_the_backward_macs(
    op, simulated, x_shape, w_shape, geometry
):
    """The forward convolution under MAC() is torch's own, bit for bit, also when only the
    backward products are simulated (not the groups apart, nor the input padded apart)."""
    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(x_shape, generator=g), torch.randn(w_shape, generator=g)
    got = simulated(x, w, input_grad_mac=FLOAT16, weight_grad_mac=FLOAT16, **geometry)
    assert_same_bits(got, op(x, w, **geometry))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "op, simulated, x_shape, w_shape, geometry",
    [
        (F.linear, LF.linear, (2, 16, 64), (32, 64), {}),
        (F.linear, LF.linear, (16, 64), (32, 64), {}),
        (F.conv2d, LF.conv2d, (2, 8, 9, 9), (6, 8, 3, 3), dict(padding=1)),
        (F.conv2d, LF.conv2d, (8, 9, 9), (6, 4, 3, 3), dict(stride=2, groups=2)),
        (F.conv1d, LF.conv1d, (2, 8, 13), (6, 8, 3), dict(padding="same")),
    ],
    ids=["linear-3d", "linear-2d", "conv2d", "conv2d-unbatched-groups", "conv1d"],
)
def test_a_native_forward_mac_adds_the_bias_as_torchs_op_whatever_the_backward_products(
    op, simulated, x_shape, w_shape, geometry, dtype
):
    """Under MAC() the forward result is torch's op with its bias, bit for bit, also where only
    the backward products are simulated or take Operands: torch adds a bfloat16 or float16 bias
    in its float32 arithmetic and rounds once (a second rounding, bias added to the rounded
    product, moved results by an ulp). The bias gradient still sums the error over (batch,
    position) under weight_grad_mac: here a float16 sum, checked against an exact model (then
    rounded to the bias's dtype, as autograd casts it)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(x_shape, generator=g).to(dtype)
    w = torch.randn(w_shape, generator=g).to(dtype)
    b = (torch.randn(w_shape[0], generator=g) * 10).to(dtype)
    want = op(x, w, b, **geometry)
    keywords = [dict(input_grad_mac=FLOAT16, weight_grad_mac=FLOAT16)]
    if op is F.linear:
        keywords.append(dict(input_grad_operands=LF.Operands(error=Float(5, 2))))
    for keyword in keywords:
        bias = b.clone().requires_grad_()
        got = simulated(x, w, bias, **geometry, **keyword)
        assert_same_bits(got, want, str(keyword))
    grad = spread(*want.shape, seed=74).to(dtype)
    got.backward(grad)  # the last: the native weight-gradient MAC, torch's sum
    bias = b.clone().requires_grad_()
    simulated(x, w, bias, **geometry, weight_grad_mac=FLOAT16).backward(grad)
    if op is F.linear:  # (position, feature): the positions in order
        errors = grad.reshape(-1, w_shape[0]).t()
    else:  # (batch, channel, position): per channel, batch then position
        batched = grad if grad.dim() == len(w_shape) else grad.unsqueeze(0)
        errors = batched.transpose(0, 1).reshape(w_shape[0], -1)
    for j in range(w_shape[0]):
        total = _sequential_binary16([Fraction(v.item()) for v in errors[j]])
        # The float16 sum comes out in float32 for bfloat16 (float16 does not fit it), and
        # autograd rounds it to the bias's dtype.
        want_j = torch.tensor(float(total), dtype=torch.float64).to(dtype)
        assert_same_bits(bias.grad[j], want_j, f"bias gradient {j}")


def test_a_bias_of_another_dtype_under_a_native_forward_mac_is_added_to_the_product():
    """torch's linear and convolutions refuse a float32 bias on bfloat16 operands; lpsim adds it
    to the product by torch's addition (in float32), also where it has torch's op add the bias."""
    g = torch.Generator().manual_seed(10)
    x = torch.randn(4, 8, generator=g).bfloat16()
    w = torch.randn(3, 8, generator=g).bfloat16()
    b = torch.randn(3, generator=g)
    got = LF.linear(x, w, b, input_grad_mac=FLOAT16)
    assert_same_bits(got, torch.matmul(x, w.t()) + b)
    got = LF.conv1d(x[None], w[:, :4, None], b, input_grad_mac=FLOAT16)
    assert_same_bits(got, F.conv1d(x[None], w[:, :4, None]) + b[:, None])


# Double backward. (name, lpsim's op, torch's op, shapes of input, weight, bias)
_TWICE = [
    ("linear", LF.linear, F.linear, (4, 5), (3, 5), (3,)),
    (
        "matmul",
        lambda x, w, b, **k: LF.matmul(x, w, **k),
        lambda x, w, b: x @ w,
        (2, 4, 5),
        (5, 3),
        None,
    ),
    (
        "bmm",
        lambda x, w, b, **k: LF.bmm(x, w, **k),
        lambda x, w, b: x.bmm(w),
        (2, 4, 5),
        (2, 5, 3),
        None,
    ),
    (
        "conv1d",
        lambda x, w, b, **k: LF.conv1d(x, w, b, 2, 1, **k),
        lambda x, w, b: F.conv1d(x, w, b, 2, 1),
        (2, 4, 9),
        (3, 4, 3),
        (3,),
    ),
    (
        "conv2d",
        lambda x, w, b, **k: LF.conv2d(x, w, b, 1, 1, 1, 2, **k),
        lambda x, w, b: F.conv2d(x, w, b, 1, 1, 1, 2),
        (2, 4, 5, 5),
        (6, 2, 3, 3),
        (6,),
    ),
]


def _padded(tensors):
    """(input, weight, bias), bias None where the case has none."""
    return [*tensors, *[None] * (3 - len(tensors))]


def second_derivatives(op, tensors, loss):
    """The gradients of a weighted sum of the first derivatives (taken with create_graph)."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    first = torch.autograd.grad(loss(op(*leaves)), leaves, create_graph=True)
    total = sum((g * ints(*g.shape, seed=7)).sum() for g in first)
    return torch.autograd.grad(total, leaves, allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("case", _TWICE, ids=[c[0] for c in _TWICE])
@pytest.mark.parametrize("loss", [lambda y: (y**2).sum(), lambda y: y.sum()], ids=["y2", "y"])
def test_double_backward_through_simulated_backward_products_raises(case, loss):
    # Before, lpsim::mac_matmul (no autograd kernel) gave zero second derivatives with a warning.
    _, op, _, *shapes = case
    tensors = [ints(*s, seed=i) for i, s in enumerate(shapes) if s]
    for macs in (dict(mac=EXACT), dict(input_grad_mac=EXACT), dict(weight_grad_mac=EXACT)):
        with pytest.raises(RuntimeError, match="has no derivative"):
            second_derivatives(lambda *t, macs=macs: op(*_padded(t), **macs), tensors, loss)


@pytest.mark.parametrize("case", _TWICE, ids=[c[0] for c in _TWICE])
@pytest.mark.parametrize("loss", [lambda y: (y**2).sum(), lambda y: y.sum()], ids=["y2", "y"])
def test_double_backward_with_native_backward_macs_is_torchs(case, loss):
    # The forward product simulated (exact on small integers), the backward products torch's.
    _, op, torch_op, *shapes = case
    tensors = [ints(*s, seed=i) for i, s in enumerate(shapes) if s]
    expected = second_derivatives(lambda *t: torch_op(*_padded(t)), tensors, loss)
    native = MAC()
    for macs in (dict(mac=EXACT, input_grad_mac=native, weight_grad_mac=native), dict()):
        got = second_derivatives(lambda *t, macs=macs: op(*_padded(t), **macs), tensors, loss)
        for g, e in zip(got, expected):
            assert_same_bits(g, e)


def test_mac_matmul_is_not_differentiable():
    a, b = spread(3, 4, seed=1).requires_grad_(), spread(4, 2, seed=2)
    c = lpsim.mac.matmul(a, b, FLOAT16)
    with torch.no_grad():
        assert_same_bits(c.detach(), lpsim.mac.matmul(a, b, FLOAT16))
    with pytest.raises(RuntimeError, match="lpsim.nn.functional.matmul"):
        c.sum().backward()


def test_bfloat16_gradients_under_a_float32_accumulator_are_cast_by_autograd():
    x = spread(4, 6, seed=3).bfloat16().requires_grad_()
    w = spread(3, 6, seed=4).bfloat16().requires_grad_()
    b = spread(3, seed=5).bfloat16().requires_grad_()
    y = LF.linear(x, w, b, mac=EXACT)
    assert y.dtype == torch.float32
    grad = spread(4, 3, seed=6)
    y.backward(grad)
    # the float32 products' results, rounded to bfloat16 (nearest) by autograd's cast
    assert_same_bits(w.grad, lpsim.mac.matmul(grad.t(), x.detach().float(), EXACT).bfloat16())
    assert_same_bits(x.grad, lpsim.mac.matmul(grad, w.detach().float(), EXACT).bfloat16())
    ones = torch.ones(1, 4)
    assert_same_bits(b.grad, lpsim.mac.matmul(ones, grad, EXACT)[0].bfloat16())


def test_an_accumulator_wider_than_float32_gives_float64_results():
    x, w = spread(2, 3, seed=7).requires_grad_(), spread(4, 3, seed=8).requires_grad_()
    wide = MAC(accumulator=Float(11, 52))
    y = LF.linear(x, w, mac=wide)
    assert y.dtype == torch.float64
    with pytest.raises(TypeError, match="float64"):
        y.sum().backward()
    y = LF.linear(x, w, mac=wide, input_grad_mac=MAC(), weight_grad_mac=MAC())
    y.sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.float32


AUTOCAST_PRODUCTS = [
    (F.linear, LF.linear, [(4, 8), (3, 8), (3,)], {}),
    (torch.matmul, LF.matmul, [(2, 4, 8), (8, 3)], {}),
    (torch.bmm, LF.bmm, [(2, 4, 8), (2, 8, 3)], {}),
    (F.conv2d, LF.conv2d, [(2, 4, 5, 5), (6, 2, 3, 3), (6,)], dict(padding=1, groups=2)),
    (F.conv1d, LF.conv1d, [(2, 3, 7), (4, 3, 2)], dict(stride=2)),
]


@pytest.mark.parametrize("op, simulated, shapes, kwargs", AUTOCAST_PRODUCTS)
def test_under_autocast_the_simulated_products_take_the_operands_autocast_gives_torchs_op(
    op, simulated, shapes, kwargs
):
    # torch.autocast casts the operands (and bias) of linear, matmul, bmm and the convolutions to
    # its dtype; the native MAC is torch's op, which autocast casts. A simulated product takes the
    # same operands: bfloat16 values, whose products and sums a float64 accumulator holds exactly.
    g = torch.Generator().manual_seed(len(shapes))
    tensors = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
    wide = MAC(accumulator=Float(11, 52))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        native = op(*tensors, **kwargs)
        y = simulated(*tensors, mac=wide, input_grad_mac=MAC(), weight_grad_mac=MAC(), **kwargs)
        narrow = simulated(*tensors, mac=MAC(accumulator=Float(8, 7)), **kwargs)
    assert native.dtype == narrow.dtype == torch.bfloat16  # the operands' dtype holds bfloat16
    exact = op(*[t.detach().bfloat16().double() for t in tensors], **kwargs)
    assert_same_bits(y.detach(), exact)
    # The gradients come from products of the saved bfloat16 operands (native backward MACs:
    # torch's, in float64) and flow through autocast's casts, as under torch's op: rounded to the
    # bfloat16 of the cast tensor, then returned to the float32 leaf.
    y.sum().backward()
    leaves = [t.detach().bfloat16().double().requires_grad_() for t in tensors]
    op(*leaves, **kwargs).sum().backward()
    for t, leaf in zip(tensors, leaves):
        assert t.grad.dtype == torch.float32
        assert_same_bits(t.grad, leaf.grad.bfloat16().float())


@pytest.mark.parametrize(
    "call, error, words",
    [
        (
            lambda: LF.linear(torch.ones(2, 3), torch.ones(4, 5), mac=FLOAT16),
            ValueError,
            "in_features",
        ),
        (lambda: LF.linear(torch.ones(2, 3), torch.ones(4, 3), mac="fp16"), TypeError, "mac"),
        (
            lambda: LF.linear(torch.ones(2, 3), torch.ones(4, 3), input_grad_mac=3),
            TypeError,
            "input_grad_mac",
        ),
        (
            lambda: LF.linear(torch.ones(2, 3), torch.ones(4, 3), input_format="e4m3"),
            TypeError,
            "input_format",
        ),
        (
            lambda: LF.conv2d(
                torch.ones(1, 2, 4, 4), torch.ones(1, 2, 3, 3), stride=0, mac=FLOAT16
            ),
            ValueError,
            "stride",
        ),
        (
            lambda: LF.conv2d(
                torch.ones(1, 2, 4, 4), torch.ones(1, 2, 3, 3), padding="full", mac=FLOAT16
            ),
            ValueError,
            "padding",
        ),
        (
            lambda: LF.conv2d(
                torch.ones(1, 2, 4, 4),
                torch.ones(1, 2, 3, 3),
                stride=2,
                padding="same",
                mac=FLOAT16,
            ),
            ValueError,
            "same",
        ),
        (
            lambda: LF.conv2d(
                torch.ones(1, 3, 4, 4), torch.ones(2, 2, 3, 3), groups=2, mac=FLOAT16
            ),
            ValueError,
            "groups",
        ),
        (lambda: LF.bmm(torch.ones(2, 3), torch.ones(3, 2), mac=FLOAT16), ValueError, "bmm"),
        (
            lambda: LF.matmul(
                torch.ones(2, 3, dtype=torch.float64),
                torch.ones(3, 2, dtype=torch.float64),
                mac=FLOAT16,
            ),
            TypeError,
            "float64",
        ),
    ],
)
def test_bad_arguments_raise_errors_that_name_them(call, error, words):
    with pytest.raises(error, match=words):
        call()


# ---- inject: every Linear, Conv1d and Conv2d of an existing model under MACs.


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, stride=2, padding=1, padding_mode="reflect"),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 3 * 3, 5),
    )


def test_injected_layers_compute_the_functional_ops_forward_and_backward():
    model = small_model()
    x = spread(2, 2, 6, 6, seed=50)
    e5m2 = Float(5, 2)
    lpsim.nn.inject(
        model,
        {
            "default": lpsim.nn.LayerQuantization(
                weight=(e5m2, "nearest"), mac=FLOAT16, weight_grad_mac=EXACT
            )
        },
    )
    y = model(x)
    y.backward(torch.ones_like(y))
    conv, linear = model[0], model[3]
    wq = lpsim.quantize(conv.parametrizations.weight.original.detach(), e5m2, "nearest")
    bq = conv.bias.detach()
    xr = F.pad(x, (1, 1, 1, 1), mode="reflect").requires_grad_()
    h = LF.conv2d(xr, wq, bq, 2, 0, mac=FLOAT16, weight_grad_mac=EXACT)
    lw = lpsim.quantize(linear.parametrizations.weight.original.detach(), e5m2, "nearest")
    lb = linear.bias.detach()
    want = LF.linear(h.relu().flatten(1), lw, lb, mac=FLOAT16, weight_grad_mac=EXACT)
    assert_same_bits(y.detach(), want.detach())
    lwl = lw.clone().requires_grad_()
    LF.linear(h.relu().flatten(1).detach(), lwl, lb, mac=FLOAT16, weight_grad_mac=EXACT).backward(
        torch.ones_like(y)
    )
    assert_same_bits(linear.parametrizations.weight.original.grad, lwl.grad)


class _DoubledLinear(torch.nn.Linear):
    """A Linear whose class overrides forward (as LoRA layers and scaled heads do)."""

    def forward(self, x):
        return super().forward(x) * 2


class _StandardisedConv2d(torch.nn.Conv2d):
    """A Conv2d whose forward standardises its weight first (timm's StdConv2d)."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.std(dim=(1, 2, 3), keepdim=True) + 1)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


def test_a_subclass_that_overrides_forward_runs_its_own_and_inject_warns_it_is_not_simulated():
    # Such a subclass's forward was replaced by the simulated forward of its base class: the
    # doubling and the standardisation vanished, silently. Its forward now runs as it is, in
    # torch's arithmetic, and the warning names it, as it names a Conv3d; a Linear beside it
    # that runs nn.Linear's forward is simulated.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        _StandardisedConv2d(2, 3, 3),
        torch.nn.Flatten(),
        _DoubledLinear(3 * 4 * 4, 5),
        torch.nn.Linear(5, 4),
        torch.nn.Unflatten(1, (4, 1, 1, 1)),
        torch.nn.Conv3d(4, 2, 1),
    )
    with torch.no_grad():
        model[3].bias.zero_()
    x = spread(2, 2, 6, 6, seed=52)
    hidden = model[:3](x)
    config = {(torch.nn.Linear, torch.nn.Conv2d): lpsim.nn.LayerQuantization(mac=FLOAT16)}
    with pytest.warns(UserWarning, match="torch's own arithmetic") as record:
        lpsim.nn.inject(model, config)
    message = str(record[0].message)
    assert "'0' (_StandardisedConv2d)" in message and "'2' (_DoubledLinear)" in message
    assert "'5' (Conv3d)" in message and "'3' " not in message
    assert_same_bits(model[:3](x), hidden)
    last = lpsim.mac.matmul(hidden.detach(), model[3].weight.detach().t(), FLOAT16)
    assert_same_bits(model[:4](x), last)
    assert_same_bits(model(x), model[5](model[4](last)))


def test_backward_operands_refuse_a_linear_whose_class_overrides_forward():
    operands = lpsim.nn.functional.Operands(error=Float(5, 2))
    with pytest.raises(ValueError, match="overrides forward"):
        lpsim.nn.inject(
            torch.nn.Sequential(_DoubledLinear(3, 2)),
            {"0": lpsim.nn.LayerQuantization(input_grad_operands=operands)},
        )


def test_remove_restores_the_class_forward():
    model = small_model()
    x = spread(2, 2, 6, 6, seed=51)
    before = model(x)
    lpsim.nn.inject(model, {"default": lpsim.nn.LayerQuantization(mac=FLOAT16)})
    assert not torch.equal(model(x), before)
    lpsim.nn.remove(model)
    assert "forward" not in vars(model[0]) and "forward" not in vars(model[3])
    assert_same_bits(model(x), before)


def test_eval_mode_replaces_stochastic_mac_rules():
    model = small_model()
    x = spread(2, 2, 6, 6, seed=52)
    lpsim.nn.inject(model, {"default": lpsim.nn.LayerQuantization(mac=BFLOAT16_SR)})
    model.eval()
    nearest = MAC(accumulator=Float(8, 7))
    h = LF.conv2d(
        F.pad(x, (1, 1, 1, 1), mode="reflect"), model[0].weight, model[0].bias, 2, mac=nearest
    )
    want = LF.linear(h.relu().flatten(1), model[3].weight, model[3].bias, mac=nearest)
    assert_same_bits(model(x), want)


def test_a_deep_copy_runs_its_own_parameters():
    import copy

    model = small_model()
    lpsim.nn.inject(model, {"default": lpsim.nn.LayerQuantization(mac=FLOAT16)})
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[3].weight.mul_(2)
    x = spread(2, 2, 6, 6, seed=53)
    assert not torch.equal(twin(x), model(x))


def test_report_shows_the_products():
    model = small_model()
    lpsim.nn.inject(
        model, {torch.nn.Linear: lpsim.nn.LayerQuantization(mac=FLOAT16, weight_grad_mac=EXACT)}
    )
    table = lpsim.nn.report(model)
    assert "products" in table
    assert f"forward {FLOAT16}; input grad {FLOAT16}; weight grad {EXACT}" in table


def test_resnet18_runs_with_simulated_products_in_forward_and_backward():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    # In eval mode: batch normalisation over a batch of two 1 x 1 maps (layer4, training mode)
    # divides differences of a few ulps by sqrt(eps), which would hide the comparison.
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(2, 3, 16, 16)
    reference = model(x)
    float32 = MAC(accumulator=Float(8, 23))
    lpsim.nn.inject(model, {"default": lpsim.nn.LayerQuantization(mac=float32)})
    assert sum("macs" in done for _, _, done in lpsim.nn.injected(model)) == 21  # 20 convs, fc
    y = model(x)
    # A sequential float32 sum differs from BLAS's order by a few units in the last place.
    torch.testing.assert_close(y, reference, rtol=1e-4, atol=1e-4)
    y.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_tensor_core_presets_run_in_the_functional_ops():
    x, w = spread(3, 40, seed=60), spread(2, 40, seed=61)
    h100 = lpsim.mac.preset("H100/fp16")
    assert_same_bits(LF.linear(x, w, mac=h100), lpsim.mac.matmul(x, w.t(), h100))


def test_eval_mode_replaces_a_stochastic_tensor_core_normalisation():
    import dataclasses

    h100 = lpsim.mac.preset("H100/fp16")
    stochastic = dataclasses.replace(
        h100, tensor_core=dataclasses.replace(h100.tensor_core, normalise="stochastic")
    )
    fp16 = h100.tensor_core.operands  # the tensor core's operands: inputs and weights rounded
    model = torch.nn.Linear(40, 2)
    settings = lpsim.nn.LayerQuantization(input=fp16, weight=fp16, mac=stochastic)
    lpsim.nn.inject(model, {"": settings})
    model.eval()
    x = spread(3, 40, seed=62)
    nearest = dataclasses.replace(
        h100, tensor_core=dataclasses.replace(h100.tensor_core, normalise="nearest")
    )
    want = LF.linear(lpsim.quantize(x, fp16), model.weight, model.bias, mac=nearest)
    assert_same_bits(model(x), want)
