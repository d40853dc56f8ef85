"""The CUDA kernel of mac_matmul (csrc/cuda/mac.cuh) against the CPU loops, bit for bit, with the
same seed and offset: every rule, accumulator, order, Kahan, rounded products and tensor-core
preset, tile remainders, Inf and NaN, layouts, streams, and the functional ops' forward and
backward. The CPU loops are checked against the exact reference in test_mac.py and
test_mac_kernel.py. Skipped without a CUDA device."""

from __future__ import annotations

import math

import pytest
import torch

import lpsim
from lpsim import MAC, P3109, Fixed, Float, Rounding
from lpsim.mac import PRESETS, TensorCore

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not lpsim.cuda_built(),
    reason="needs a CUDA device and lpsim built with its CUDA kernels",
)

FLOAT16 = Float(5, 10)
BFLOAT16 = Float(8, 7)
RULES = [rule.name for rule in Rounding]  # every rule, by name
ACCUMULATORS = [
    FLOAT16,
    BFLOAT16,
    Float(8, 23),
    Float(4, 3, subnormals=False),
    Float(5, 2, saturate=True),
    Float(4, 3, special="fn"),
    Fixed(12, 6),
    P3109(8, 3),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def operands(dtype, m, k, n, seed, spread=6.0):
    """a (m, k) and b (k, n): signed values over 2^(+-spread) binades, some exact zeros."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        x = torch.randn(*shape, generator=gen) * torch.exp2(
            torch.empty(*shape).uniform_(-spread, spread, generator=gen).round()
        )
        x[torch.rand(*shape, generator=gen) < 0.05] = 0.0
        return x.to(dtype)

    return draw(m, k), draw(k, n)


def assert_same(cuda_result: torch.Tensor, cpu_result: torch.Tensor) -> None:
    """Equal bits, NaN payloads included."""
    assert cuda_result.is_cuda
    got = cuda_result.cpu()
    assert got.shape == cpu_result.shape and got.dtype == cpu_result.dtype
    view = {torch.float64: torch.int64, **INT_VIEW}[got.dtype]
    assert torch.equal(got.reshape(-1).view(view), cpu_result.reshape(-1).view(view))


def on_both(a, b, mac, seed=5, offset=2):
    """(CUDA result, CPU result) of a @ b under mac."""
    cpu = lpsim.mac.matmul(a, b, mac, seed=seed, offset=offset)
    cuda = lpsim.mac.matmul(a.cuda(), b.cuda(), mac, seed=seed, offset=offset)
    return cuda, cpu


@pytest.mark.parametrize("rounding", RULES)
@pytest.mark.parametrize("acc", ACCUMULATORS, ids=str)
def test_cuda_equals_cpu_for_every_rule_and_accumulator(acc, rounding):
    a, b = operands(torch.float32, 19, 70, 23, seed=1)  # partial tiles and term steps
    assert_same(*on_both(a, b, MAC(acc, rounding=rounding)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "mac",
    [
        MAC(BFLOAT16, product=Float(5, 2), rounding="stochastic", rbits=7),
        MAC(FLOAT16, order="chunked", chunk=16, chunk_accumulator=BFLOAT16),
        MAC(BFLOAT16, order="chunked", chunk=5, rounding="stochastic_equal"),
        MAC(BFLOAT16, order="pairwise", rounding="up"),
        MAC(FLOAT16, order="pairwise", rounding="stochastic"),
        MAC(BFLOAT16, compensated=True),
        MAC(FLOAT16, compensated=True, rounding="stochastic", rbits=12),
        MAC(Float(8, 23), product=BFLOAT16, rounding="toward_zero"),
    ],
    ids=str,
)
def test_cuda_equals_cpu_for_every_order_kahan_and_product_rounding(mac, dtype):
    a, b = operands(dtype, 17, 45, 33, seed=2)
    assert_same(*on_both(a, b, mac))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_cuda_equals_cpu_for_every_tensor_core_preset(name):
    mac = PRESETS[name]
    operand = mac.tensor_core.operands
    a, b = operands(torch.float32, 18, 300, 20, seed=3, spread=10.0)
    if operand is not None:  # values of the preset's operand format, as its docstring expects
        a, b = lpsim.quantize(a, operand), lpsim.quantize(b, operand)
        a, b = a.nan_to_num(0.0, 0.0, 0.0), b.nan_to_num(0.0, 0.0, 0.0)
    assert_same(*on_both(a, b, mac))


@pytest.mark.parametrize("normalise", ["nearest", "stochastic", "toward_zero"])
def test_cuda_equals_cpu_for_tensor_cores_with_any_normalisation(normalise):
    core = TensorCore(group=8, fraction_bits=20, exponent_floor=-40, normalise=normalise)
    mac = MAC(Float(8, 23), tensor_core=core, order="chunked", chunk=32)
    a, b = operands(torch.bfloat16, 9, 200, 40, seed=4, spread=20.0)
    assert_same(*on_both(a, b, mac))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "down"])
def test_cuda_equals_cpu_with_inf_nan_overflow_and_cancellation(rounding):
    a, b = operands(torch.float32, 20, 64, 20, seed=5)
    a[0, 3], a[1, 0], b[5, 2], b[7, 4] = math.inf, -math.inf, math.nan, 1e30
    a[2] = 1e4  # overflows float16's accumulator
    a[3, :2], b[:2, 3] = torch.tensor([1.0, 1.0]), torch.tensor([3.0, -3.0])  # cancels to zero
    for acc in (FLOAT16, BFLOAT16):
        assert_same(*on_both(a, b, MAC(acc, rounding=rounding)))


@pytest.mark.parametrize("shape", [(0, 5, 3), (4, 0, 3), (4, 5, 0), (1, 1, 1), (33, 1, 65)])
def test_cuda_equals_cpu_for_empty_and_thin_products(shape):
    m, k, n = shape
    a, b = operands(torch.float32, m, k, n, seed=6)
    assert_same(*on_both(a, b, MAC(BFLOAT16, rounding="stochastic")))


def test_cuda_equals_cpu_for_long_sums_and_views():
    a, b = operands(torch.float16, 70, 3000, 40, seed=7)
    mac = MAC(FLOAT16, rounding="stochastic")
    cpu = lpsim.mac.matmul(a[::2], b[:, 1::3], mac, seed=8)
    ac, bc = a.cuda(), b.cuda()
    assert_same(lpsim.mac.matmul(ac[::2], bc[:, 1::3], mac, seed=8), cpu)
    assert_same(
        lpsim.mac.matmul(ac.t().contiguous().t(), bc, mac, seed=8),
        lpsim.mac.matmul(a, b, mac, seed=8),
    )


def test_cuda_runs_on_a_side_stream():
    a, b = operands(torch.float32, 40, 100, 30, seed=9)
    mac = MAC(BFLOAT16, rounding="stochastic")
    expected = lpsim.mac.matmul(a, b, mac, seed=1)
    ac, bc = a.cuda(), b.cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = lpsim.mac.matmul(ac, bc, mac, seed=1)
    stream.synchronize()
    assert_same(y, expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_runs_on_a_second_device():
    a, b = operands(torch.float32, 20, 50, 20, seed=10)
    mac = MAC(FLOAT16, rounding="stochastic")
    before = torch.cuda.current_device()
    y = lpsim.mac.matmul(a.to("cuda:1"), b.to("cuda:1"), mac, seed=2)
    assert y.device == torch.device("cuda:1") and torch.cuda.current_device() == before
    assert_same(y, lpsim.mac.matmul(a, b, mac, seed=2))


def test_operands_on_two_devices_are_refused():
    a, b = operands(torch.float32, 4, 5, 6, seed=11)
    with pytest.raises(ValueError, match="device"):
        lpsim.mac.matmul(a.cuda(), b, MAC(BFLOAT16))


def test_functional_linear_and_conv2d_forward_and_backward_equal_the_cpu():
    F = lpsim.nn.functional
    mac = MAC(BFLOAT16, rounding="stochastic")
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(6, 3, 9, 9, generator=gen)
    w = torch.randn(5, 3, 3, 3, generator=gen)
    v = torch.randn(7, 5 * 7 * 7, generator=gen)
    results = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(13)
        xd, wd, vd = (t.to(device).detach().requires_grad_() for t in (x, w, v))
        h = F.conv2d(xd, wd, mac=mac, input_grad_mac=mac, weight_grad_mac=mac)
        y = F.linear(h.flatten(1), vd, mac=mac, input_grad_mac=mac, weight_grad_mac=mac)
        y.square().sum().backward()
        results.append([t.detach() for t in (y, xd.grad, wd.grad, vd.grad)])
    for cpu, cuda in zip(*results):
        assert_same(cuda, cpu)


def test_functional_biases_and_their_gradients_equal_the_cpu():
    # The bias gradient is a product of the output gradient (on its device) and ones, which must be
    # on the same device.
    F = lpsim.nn.functional
    mac = MAC(FLOAT16)
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(2, 3, 6, 6, generator=gen)
    w = torch.randn(4, 3, 3, 3, generator=gen)
    c = torch.randn(4, generator=gen)
    v = torch.randn(5, 4 * 4 * 4, generator=gen)
    d = torch.randn(5, generator=gen)
    results = []
    for device in ("cpu", "cuda"):
        leaves = [t.to(device).detach().requires_grad_() for t in (x, w, c, v, d)]
        xd, wd, cd, vd, dd = leaves
        h = F.conv2d(xd, wd, cd, mac=mac)
        y = F.linear(h.flatten(1), vd, dd, mac=mac)
        y.square().sum().backward()
        results.append([y.detach()] + [t.grad for t in leaves])
    for cpu, cuda in zip(*results):
        assert_same(cuda, cpu)
