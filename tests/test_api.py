"""The functional API: shapes, strides, empty and 0-d tensors, in place and out=, dtypes, the
QPyTorch-named wrappers, and the straight-through gradient."""

import pytest
import torch
from support import DTYPES, assert_same_bits

import lpsim
from lpsim import BlockFloat, Fixed, Float
from lpsim import reference as ref

FORMATS = [Float(5, 2), Fixed(8, 4), BlockFloat(6), BlockFloat(6, 1), BlockFloat(6, block_size=5)]
RULES = ["nearest", "stochastic"]


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
@pytest.mark.parametrize("rule", RULES)
def test_non_contiguous_input_gives_the_result_of_its_contiguous_copy(fmt, rule):
    base = torch.randn(12, 20, 6) * 8
    for view in (
        base.transpose(0, 1),
        base[:, ::3, 1:5],
        base.permute(2, 0, 1),
        base.expand(2, 12, 20, 6)[1],
    ):
        got = lpsim.quantize(view, fmt, rule, seed=3)
        assert got.shape == view.shape and got.is_contiguous()
        assert_same_bits(got, lpsim.quantize(view.contiguous(), fmt, rule, seed=3), repr(fmt))


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_output_has_the_dtype_and_shape_of_the_input(fmt, dtype):
    if isinstance(fmt, Fixed) and dtype == torch.bfloat16:
        fmt = Fixed(8, 4)
    x = (torch.randn(3, 4, 5) * 4).to(dtype)
    y = lpsim.quantize(x, fmt, "nearest")
    assert y.dtype == dtype and y.shape == x.shape
    assert_same_bits(y, ref.quantize(x, fmt, "nearest"))


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
@pytest.mark.parametrize("shape", [(0,), (3, 0, 4), ()], ids=["empty", "empty-3d", "0-d"])
def test_empty_and_zero_dimensional_tensors(fmt, shape):
    if isinstance(fmt, BlockFloat) and fmt.dim == 1 and len(shape) < 2:
        fmt = BlockFloat(fmt.wl, 0)
    x = torch.randn(shape) * 3
    y = lpsim.quantize(x, fmt, "stochastic", seed=1)
    assert y.shape == x.shape
    assert_same_bits(y, ref.quantize(x, fmt, "stochastic", seed=1))


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
@pytest.mark.parametrize("rule", RULES)
def test_in_place_equals_out_of_place(fmt, rule):
    x = torch.randn(9, 31) * 5
    want = lpsim.quantize(x, fmt, rule, seed=21)
    contiguous = x.clone()
    assert lpsim.quantize_(contiguous, fmt, rule, seed=21) is contiguous
    assert_same_bits(contiguous, want)
    # A non-contiguous tensor is rounded in place through a contiguous copy.
    strided = x.t().contiguous().t()
    lpsim.quantize_(strided, fmt, rule, seed=21)
    assert_same_bits(strided, want)


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_out_receives_the_result(fmt):
    x = torch.randn(7, 10) * 5
    want = lpsim.quantize(x, fmt, "stochastic", seed=2)
    out = torch.empty_like(x)
    assert lpsim.quantize(x, fmt, "stochastic", seed=2, out=out) is out
    assert_same_bits(out, want)
    strided_out = torch.empty(10, 7).t()
    lpsim.quantize(x, fmt, "stochastic", seed=2, out=strided_out)
    assert_same_bits(strided_out, want)


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_out_may_be_x_itself_but_not_a_partial_overlap_of_it(fmt):
    """As documented: out=x rounds x in place (as quantize_); an out that shares only some of x's
    memory is refused, as torch's out= functions refuse it (clone x first)."""
    x = torch.randn(7, 10) * 5
    want = lpsim.quantize(x, fmt, "stochastic", seed=2)
    assert lpsim.quantize(x, fmt, "stochastic", seed=2, out=x) is x
    assert_same_bits(x, want)
    buffer = torch.randn(71) * 5
    with pytest.raises(RuntimeError, match="single memory location"):
        lpsim.quantize(buffer[1:].view(7, 10), fmt, out=buffer[:70].view(7, 10))


def test_out_with_the_negative_bit_receives_the_result():
    """z.conj().imag is a view of z's storage whose values torch reads negated (its negative bit).
    As out= (also as x and out at once) it receives the rounded values, as torch's out= ops write
    into it; it once corrupted the heap (torch's fallback for such views cannot run an out= op that
    returns nothing), so the calls run in a child process."""
    import subprocess
    import sys

    code = """if True:
        import torch, lpsim
        torch.manual_seed(0)
        x = torch.randn(64) * 300
        want = x.to(torch.float8_e5m2).float()
        z = torch.complex(torch.randn(64), torch.randn(64))
        out = z.conj().imag
        assert lpsim.quantize(x, lpsim.Float(5, 2), out=out) is out
        assert torch.equal(out, want) and torch.equal(z.imag, -want)
        z = torch.complex(torch.randn(64), x.neg())
        y = z.conj().imag
        assert lpsim.quantize(y, lpsim.Float(5, 2), out=y) is y
        assert torch.equal(y, want) and torch.equal(z.imag, -want)
        print("ok")
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout == "ok\n", done.stdout + done.stderr[-2000:]


@pytest.mark.parametrize("fmt", [*FORMATS, lpsim.scaled.preset("mxfp4_e2m1")], ids=repr)
def test_out_on_another_device_than_x_is_refused(fmt):
    # As torch.neg(x, out=...) refuses it. With a meta tensor on either side the call returned
    # out unwritten: a CPU out kept whatever it held.
    cpu = torch.randn(4, 32)
    for x, out in ((cpu, torch.empty(4, 32, device="meta")), (cpu.to("meta"), torch.zeros(4, 32))):
        with pytest.raises(RuntimeError):
            torch.neg(x, out=out)
        with pytest.raises(RuntimeError, match=r"out must be on the device of x, meta|got meta"):
            lpsim.quantize(x, fmt, out=out)
        if out.device.type == "cpu":
            assert torch.equal(out, torch.zeros(4, 32))


@pytest.mark.parametrize("fmt", [*FORMATS, lpsim.scaled.preset("mxfp4_e2m1")], ids=repr)
@pytest.mark.parametrize("rule", ["nearest", "up", "down", "stochastic"])
def test_out_with_the_negative_bit_reads_the_rounded_values(fmt, rule):
    # z.conj().imag is a view of z's imaginary parts with torch's negative bit set: writing y into
    # it stores -y, and reading it gives y back, as torch.neg(x, out=z.conj().imag) does.
    x = torch.randn(7, 32) * 5
    want = lpsim.quantize(x, fmt, rule, seed=4)
    z = torch.zeros(7, 32, dtype=torch.complex64)
    out = z.conj().imag
    assert out.is_neg()
    assert lpsim.quantize(x, fmt, rule, seed=4, out=out) is out
    assert_same_bits(out, want, "out")
    assert_same_bits(z.imag, -want, "the memory out views")
    assert_same_bits(z.real, torch.zeros(7, 32), "the real parts")
    # out=x itself, x a negative view: x reads its rounded values (those of -x's memory).
    own = torch.complex(x, x).conj().imag
    lpsim.quantize(own, fmt, rule, seed=4, out=own)
    assert_same_bits(own, lpsim.quantize(-x, fmt, rule, seed=4), "out is x")


@pytest.mark.parametrize("fmt", [*FORMATS, lpsim.scaled.preset("mxfp4_e2m1")], ids=repr)
def test_in_place_rounding_of_a_negative_view_writes_the_rounded_values_through_it(fmt):
    # z.conj().imag views z's imaginary parts with torch's negative bit: rounding it in place
    # leaves it holding quantize() of its values, and z.imag their negatives. Calls alternate
    # deterministic and stochastic rules: torch's fallback for such views corrupted the heap on
    # lpsim's in-place ops (the process aborted within a few calls).
    x = torch.randn(7, 32) * 5
    for i, rule in enumerate(["nearest", "stochastic", "up", "stochastic", "down"] * 2):
        seed = i if rule == "stochastic" else None
        z = torch.complex(torch.zeros(7, 32), -x)
        view = z.conj().imag
        assert view.is_neg()
        assert lpsim.quantize_(view, fmt, rule, seed=seed) is view
        want = lpsim.quantize(x, fmt, rule, seed=seed)
        assert_same_bits(view, want, rule)
        assert_same_bits(z.imag, -want, f"{rule}: the memory")
    # Through a non-leaf, the gradient stays the identity; a view of a leaf is refused.
    leaf = torch.randn(7, 32, requires_grad=True)
    y = torch.complex(torch.zeros(7, 32), leaf * 2)
    lpsim.quantize_(y.conj().imag, fmt)
    y.imag.sum().backward()
    assert torch.equal(leaf.grad, torch.full((7, 32), 2.0))


def test_negative_block_dims_are_refused_as_ambiguous():
    for d in (-1, -2):
        with pytest.raises(ValueError, match="negative dims are ambiguous"):
            BlockFloat(5, d)


def test_top_level_qtorch_names_are_the_qtorch_drop_in():
    # A user typing QPyTorch's names gets QPyTorch's numbers: its ranges (the top exponent code
    # finite, saturation), stochastic rounding by default, dim=-1 as one block for the tensor.
    from lpsim.compat import qtorch as compat

    assert lpsim.float_quantize is compat.float_quantize
    assert lpsim.fixed_point_quantize is compat.fixed_point_quantize
    assert lpsim.block_quantize is compat.block_quantize
    assert lpsim.float_quantize(torch.tensor([1e5, 1e9]), 5, 2, "nearest").tolist() == [
        98304.0,
        114688.0,
    ]
    x = torch.tensor([[8.0, 0.3], [0.2, 0.1]])
    assert_same_bits(lpsim.block_quantize(x, 4, -1, "nearest"), lpsim.quantize(x, BlockFloat(4)))
    assert_same_bits(lpsim.block_quantize(x, 4, 1, "nearest"), lpsim.quantize(x, BlockFloat(4, 1)))
    kw = dict(seed=4)
    y = torch.randn(100) * 10
    assert_same_bits(
        lpsim.fixed_point_quantize(y, 8, 4, **kw),
        lpsim.quantize(y, Fixed(8, 4), "stochastic", **kw),
    )


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_gradient_is_straight_through(fmt):
    x = (torch.randn(6, 7) * 3).requires_grad_()
    upstream = torch.randn(6, 7)
    lpsim.quantize(x, fmt, "stochastic", seed=1).backward(upstream)
    assert torch.equal(x.grad, upstream)


def test_rounding_accepts_the_enum():
    x = torch.randn(50)
    assert_same_bits(
        lpsim.quantize(x, Float(5, 2), lpsim.Rounding.up), lpsim.quantize(x, Float(5, 2), "up")
    )


@pytest.mark.skipif(
    int(open("/proc/meminfo").read().split("MemAvailable:")[1].split()[0]) < 14 * 2**20,
    reason="needs 14 GiB of free memory",
)
def test_more_than_two_to_the_31_elements_are_indexed_with_64_bits():
    n = 2**31 + 4099
    x = torch.full((n,), 1.1, dtype=torch.float16)
    x[-3:] = torch.tensor([3.3, -7.0, 1e-3], dtype=torch.float16)
    lpsim.quantize_(x, Float(5, 2), "nearest")
    assert x[-3:].tolist() == [3.5, -7.0, 0.0009765625]
    assert x[0].item() == 1.0 and x[2**31].item() == 1.0
    del x
