"""The CPU ops' results depend on no floating-point mode of the caller: under
torch.set_flush_denormal(True) (flush-to-zero and denormals-are-zero in the calling thread, not in
the thread pool's) every op gives the bits it gives without it, subnormal operands and results of
the simulated formats included, for one and two threads (csrc/parallel.h)."""

import pytest
import torch

import lpsim
from lpsim import MAC, Float, accumulate
from lpsim.nn.functional import linear

FLOAT32 = Float(8, 23)
BFLOAT16 = Float(8, 7)


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    torch.set_flush_denormal(False)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def same_in_flush_to_zero_mode(run):
    """run() without and with flush-to-zero mode, compared bit for bit, for 1 and 2 threads."""
    for threads in (1, 2):
        torch.set_num_threads(threads)
        want = run()
        if not torch.set_flush_denormal(True):
            pytest.skip("this CPU has no flush-to-zero mode")
        try:
            got = run()
        finally:
            torch.set_flush_denormal(False)
        assert torch.equal(bits(got), bits(want)), (threads, got, want)
    return want


def tiny_operands(dtype=torch.float32):
    """(a, b): products and sums in float32's subnormals (2^-140, 2^-130), subnormal operands, and
    enough rows for several tasks with two threads."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(1, 8, (64, 12), generator=g).to(torch.float32) * 2.0**-70
    b = torch.randint(-8, 8, (12, 300), generator=g).to(torch.float32) * 2.0**-70
    a[:, 0] = 2.0**-130  # a float32 subnormal operand
    b[0, :] = 1.0
    return a.to(dtype), b.to(dtype)


@pytest.mark.parametrize(
    "mac",
    [
        MAC(accumulator=FLOAT32),
        MAC(accumulator=FLOAT32, order="pairwise"),
        MAC(accumulator=BFLOAT16),
    ],
    ids=repr,
)
def test_simulated_products_keep_subnormals_in_flush_to_zero_mode(mac):
    a, b = tiny_operands(torch.bfloat16 if mac.accumulator == BFLOAT16 else torch.float32)
    want = same_in_flush_to_zero_mode(lambda: lpsim.mac.matmul(a, b, mac))
    assert int((want != 0).sum()) > want.numel() // 2
    assert float(want.abs().min()) < 2.0**-126 or float(want.abs().max()) < 2.0**-126


def test_a_subnormal_bias_is_added_exactly_in_flush_to_zero_mode():
    x, w = torch.ones(3, 1), torch.full((2, 1), 2.0**-128)
    bias = torch.full((2,), 2.0**-130)
    want = same_in_flush_to_zero_mode(lambda: linear(x, w, bias, mac=MAC(accumulator=FLOAT32)))
    assert bool((want == 2.0**-128 + 2.0**-130).all())


def test_sr_add_keeps_subnormals_in_flush_to_zero_mode():
    a = torch.full((70000,), 2.0**-128)
    b = torch.full((70000,), 2.0**-130)
    for rounding in ("nearest", "stochastic"):
        want = same_in_flush_to_zero_mode(
            lambda: lpsim.sr_add(a, b, FLOAT32, rounding, seed=5)  # noqa: B023
        )
        assert bool((want == 2.0**-128 + 2.0**-130).all())


def test_rounded_sums_keep_subnormals_in_flush_to_zero_mode():
    x = torch.full((40, 9), 2.0**-140)
    x[:, 0] = 2.0**-127
    want = same_in_flush_to_zero_mode(lambda: accumulate.sum(x, 1, acc=FLOAT32))
    assert bool((want == 2.0**-127 + 8 * 2.0**-140).all())


@pytest.mark.parametrize("name", ["nvfp4", "fp8_e4m3_row", "mxfp8_e4m3"])
def test_scaled_formats_of_subnormal_inputs_are_the_same_in_flush_to_zero_mode(name):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=g) * 2.0**-130
    fmt = lpsim.scaled.preset(name)
    same_in_flush_to_zero_mode(lambda: lpsim.quantize(x, fmt, "stochastic", seed=2))
