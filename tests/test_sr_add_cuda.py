"""The CUDA update kernels against the CPU loops: bit-identical sr_add, sr_addcmul and sr_addcdiv
for every rule, both sources of randomness and every operand dtype, with the same seed and offset.
Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch
from support import assert_same_bits

import lpsim
from lpsim import Fixed, Float, Rounding

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not lpsim.cuda_built(),
    reason="needs a CUDA device and lpsim built with its CUDA kernels",
)

PAIRS = [
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float16, torch.float16),
    (torch.float16, torch.float32),
    (torch.float32, torch.float32),
    (torch.float32, torch.float64),
    (torch.float64, torch.float64),
    (torch.float64, torch.float32),
]


def _operands(a_dtype, b_dtype, n=70001):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(n, generator=g, dtype=torch.float64) * 4).to(a_dtype)
    b = (torch.randn(n, generator=g, dtype=torch.float64) * 2.0**-9).to(b_dtype)
    a[:6] = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1.0, -1.0], dtype=a_dtype)
    return a, b


@pytest.mark.parametrize("a_dtype,b_dtype", PAIRS, ids=str)
@pytest.mark.parametrize("rule", list(Rounding), ids=lambda r: r.name)
@pytest.mark.parametrize("randomness", ["position", "value"])
def test_cuda_sr_add_matches_cpu(a_dtype, b_dtype, rule, randomness):
    a, b = _operands(a_dtype, b_dtype)
    for fmt in (None, Float(5, 2), Fixed(6, 3)):
        want = lpsim.sr_add(a, b, fmt, rule, seed=3, offset=9, randomness=randomness)
        got = lpsim.sr_add(a.cuda(), b.cuda(), fmt, rule, seed=3, offset=9, randomness=randomness)
        assert_same_bits(got.cpu(), want, f"{fmt!r}")
        inplace = a.cuda()
        lpsim.sr_add_(inplace, b.cuda(), fmt, rule, seed=3, offset=9, randomness=randomness)
        assert_same_bits(inplace.cpu(), want, f"{fmt!r} in place")


@pytest.mark.parametrize("a_dtype,t_dtype", PAIRS, ids=str)
@pytest.mark.parametrize("divide", [False, True])
def test_cuda_addcmul_and_addcdiv_match_cpu(a_dtype, t_dtype, divide):
    a, t1 = _operands(a_dtype, t_dtype)
    t2 = (t1.double().abs() + 0.5).to(t_dtype)
    fused = lpsim.sr_addcdiv if divide else lpsim.sr_addcmul
    for rule in ("stochastic", "nearest", "stochastic_equal"):
        want = fused(a, t1, t2, -3e-3, rounding=rule, seed=5)
        got = fused(a.cuda(), t1.cuda(), t2.cuda(), -3e-3, rounding=rule, seed=5)
        assert_same_bits(got.cpu(), want, rule)


def test_cuda_sr_sgd_step_matches_cpu():
    w_cpu = torch.randn(1000).bfloat16().requires_grad_()
    w_gpu = w_cpu.detach().cuda().requires_grad_()
    # No momentum: the update is one float32 product on both devices, so the terms are identical.
    opt_cpu = lpsim.optim.SGD([w_cpu], lr=1e-3, seed=1)
    opt_gpu = lpsim.optim.SGD([w_gpu], lr=1e-3, seed=1)
    for _ in range(3):
        g = torch.randn(1000)
        w_cpu.grad, w_gpu.grad = g.bfloat16(), g.bfloat16().cuda()
        opt_cpu.step()
        opt_gpu.step()
    assert_same_bits(w_gpu.detach().cpu(), w_cpu.detach())
